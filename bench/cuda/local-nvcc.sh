#!/usr/bin/env bash
# local-nvcc.sh DIR [PYTHON]: nvcc 13.0 for a machine without a GPU or a CUDA install (this one): NVIDIA's
# PyPI wheels (compiler, NVVM, headers, runtime) unpacked into DIR. Then build the programs here
# (`DIR/nvidia/cu13/bin` on PATH, `-LDIR/nvidia/cu13/lib` to link; about a minute for
# persistent.cu) and carry the binaries, gzipped, to the device machine instead of building there.
set -eu
d=$1
py=${2:-python3}
mkdir -p "$d/wheels"
"$py" -m pip download -q --no-deps -d "$d/wheels" "nvidia-cuda-nvcc==13.0.88" "nvidia-nvvm==13.0.88" "nvidia-cuda-crt==13.0.88" \
    "nvidia-cuda-runtime==13.0.96" "nvidia-cuda-cccl==13.0.85"
for w in "$d"/wheels/*.whl; do "$py" -m zipfile -e "$w" "$d"; done
chmod +x "$d"/nvidia/cu13/bin/* "$d"/nvidia/cu13/nvvm/bin/*
"$d/nvidia/cu13/bin/nvcc" --version | tail -1
echo "export PATH=$d/nvidia/cu13/bin:\$PATH  # and link with -L$d/nvidia/cu13/lib"
