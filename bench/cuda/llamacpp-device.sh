#!/usr/bin/env bash
# llama.cpp's llama-bench for the device machine (no network there), from the source that
# llama-cpp-python 0.3.36 vendors (the CPU yardstick of bench/vs-llamacpp).
#   bench/cuda/llamacpp-device.sh pack OUT.tgz   here: fetch the sdist from PyPI, keep what a CUDA
#                                                build of llama-bench needs (~5 MB), write OUT.tgz
#   bench/cuda/llamacpp-device.sh build TGZ DIR  on the device: unpack into DIR, build
#                                                DIR/llama.cpp/build/bin/llama-bench for sm_90
#                                                (about 4.5 minutes with 16 cores)
# Then: llama-bench -m FILE -p 128,512 -n 128 -fa 1 -ngl 99 -r 5 (bench/RESULTS.md, issue 4t).
set -eu
version=0.3.36
case "${1:-}" in
pack)
    out=$(realpath -m "$2")
    tmp=$(mktemp -d)
    url=$(python3 -c "import re,urllib.request; p=urllib.request.urlopen('https://pypi.org/simple/llama-cpp-python/').read().decode(); print(re.search(r'href=\"([^\"]*llama_cpp_python-$version\.tar\.gz)', p).group(1).split('#')[0])")
    python3 -c "import sys,urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])" "$url" "$tmp/sdist.tgz"
    tar xzf "$tmp/sdist.tgz" -C "$tmp"
    src="$tmp/llama_cpp_python-$version/vendor/llama.cpp"
    (cd "$src" && rm -rf models docs media tests examples benches conversion gguf-py scripts pocs tools/ui \
        tools/server/public* vendor/miniaudio ggml/src/ggml-{et,metal,hexagon,sycl,vulkan,opencl} &&
        sed -i '/miniaudio/d' vendor/CMakeLists.txt)
    tar czf "$out" -C "$src/.." llama.cpp
    rm -rf "$tmp"
    ls -l "$out"
    ;;
build)
    mkdir -p "$3"
    tar xzf "$2" -C "$3"
    cd "$3/llama.cpp"
    # The multimodal tool links the audio library removed above; its generate error does not stop
    # the llama-bench target, so the configure step's status is ignored.
    cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release >cmake.log 2>&1 || true
    cmake --build build -j "$(nproc)" --target llama-bench >build.log 2>&1 || { tail -30 build.log; exit 1; }
    ls -l build/bin/llama-bench
    ;;
*)
    sed -n 2,10p "$0"
    exit 2
    ;;
esac
