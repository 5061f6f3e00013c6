#!/usr/bin/env bash
# prep.sh DIR [ROOT]: kiln's kernel sources of ROOT (default: this checkout) into DIR, the quantized
# family cut to its Q4_K and Q6_K kernels (what kiln_matvec.cu launches; a faster nvcc build).
set -eu
d=$1
r=${2:-$(dirname "$0")/../..}
mkdir -p "$d"
cp "$r/crates/cuda/kernels/common.cuh" "$d/"
grep -v -E '^KILN_FORMAT\((f32|f16|bf16|q4_0|q4_1|q5_0|q5_1|q8_0|q2_k|q3_k|q5_k),' "$r/crates/cuda/kernels/quant.cu" > "$d/quant_f.cu"
