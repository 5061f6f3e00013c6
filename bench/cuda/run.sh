#!/usr/bin/env bash
# Builds and runs the matrix-vector, dependency, persistent-layer and many-row product benchmarks (a machine with nvcc and an sm_90 GPU; from anywhere).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
d=$(mktemp -d)
"$here/prep.sh" "$d" "$here/../.."
nvcc -O3 -arch=sm_90 -std=c++17 -I"$d" "$here/kiln_matvec.cu" -o "$d/kiln_matvec"
nvcc -O3 -arch=sm_90 -std=c++17 "$here/matvec_variants.cu" -o "$d/matvec_variants"
"$d/kiln_matvec"
"$d/matvec_variants"
nvcc -O3 -arch=sm_90 -std=c++17 "$here/boundary.cu" -o "$d/boundary"
"$d/boundary"
nvcc -O3 -arch=sm_90 -std=c++17 -I"$d" "$here/persistent.cu" -o "$d/persistent"
"$d/persistent" 8 512
nvcc -O3 -arch=sm_90 -std=c++17 -I"$d" "$here/mmq.cu" -lcublas -o "$d/mmq"
"$d/mmq" quick
