// Shared by the CUDA benchmarks (after the u8/u32/u64 typedefs): error checks, random weights with
// valid f16 scales, launch configurations, medians, event timing.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>

#define CK(x)                                                                                 \
    do {                                                                                      \
        cudaError_t e = (x);                                                                  \
        if (e != cudaSuccess) {                                                               \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

// Random words (a hash of the index and the seed: never zeros).
__global__ void fill_rand(u32* p, u64 words, u32 seed) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += (u64)gridDim.x * blockDim.x) {
        u32 x = (u32)i * 2654435761u ^ seed;
        x ^= x >> 15;
        x *= 2246822519u;
        x ^= x >> 13;
        x *= 3266489917u;
        x ^= x >> 16;
        p[i] = x;
    }
}
// Valid f16 scales: Q4_K's d and dmin at the start of each 144-byte block.
__global__ void fix_q4k(u8* w, u64 nblk) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < nblk; i += (u64)gridDim.x * blockDim.x) {
        u32 r = *(u32*)(w + 144 * i);
        *(u32*)(w + 144 * i) = (0x2000u | (r & 0x3ffu)) | ((0x1c00u | ((r >> 16) & 0x3ffu)) << 16);
    }
}
// Valid f16 scales: the d plane of a planar Q6_K matrix.
__global__ void fix_q6k(u8* w, u64 nblk) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < nblk; i += (u64)gridDim.x * blockDim.x) {
        u16* d = (u16*)(w + 208 * nblk) + i;
        *d = 0x1c00u | (*d & 0x3ffu);
    }
}

// A random packed K-quant matrix on the device: n rows of k (a multiple of 256), planar Q6_K or
// Q4_K, with valid f16 scales.
struct Matrix {
    u8* w;
    u64 rb, nblk, bytes;
    int n, k;
    bool q6;
};
static Matrix make_matrix(int n, int k, bool q6) {
    Matrix m;
    m.n = n;
    m.k = k;
    m.q6 = q6;
    m.rb = (u64)(k / 256) * (q6 ? 210 : 144);
    m.nblk = (u64)n * (k / 256);
    m.bytes = m.rb * n;
    CK(cudaMalloc(&m.w, m.bytes + 256));
    static u32 seed = 1;
    fill_rand<<<1024, 256>>>((u32*)m.w, (m.bytes + 255) / 4, seed++ * 0x9e3779b9u);
    if (q6)
        fix_q6k<<<1024, 256>>>(m.w, m.nblk);
    else
        fix_q4k<<<1024, 256>>>(m.w, m.nblk);
    CK(cudaGetLastError());
    return m;
}

// A launch configuration with programmatic dependent launch, as kiln launches on sm_90 (not
// copyable: the configuration points at its attribute).
struct PdlLaunch {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute at[1];
    PdlLaunch(dim3 grid, dim3 block, size_t smem, cudaStream_t st) {
        cfg.gridDim = grid;
        cfg.blockDim = block;
        cfg.dynamicSmemBytes = smem;
        cfg.stream = st;
        at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = at;
        cfg.numAttrs = 1;
    }
    PdlLaunch(const PdlLaunch&) = delete;
    PdlLaunch& operator=(const PdlLaunch&) = delete;
};

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// Median over `runs` runs of the microseconds `enqueue` takes on `st`, divided by `per`.
template <class F> static double time_us(cudaStream_t st, int runs, double per, F enqueue) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<double> ts;
    for (int r = 0; r < runs; r++) {
        CK(cudaEventRecord(e0, st));
        enqueue();
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        ts.push_back(ms * 1e3 / per);
    }
    CK(cudaGetLastError());
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    return median(ts);
}

// Median microseconds of a replay of the graph of what `capture` enqueues on `st`.
template <class F> static double graph_us(cudaStream_t st, int runs, F capture) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    capture();
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    double us = time_us(st, runs, 1, [&] { CK(cudaGraphLaunch(ge, st)); });
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    return us;
}

// Reads `words` 16-byte words (kiln's read_bandwidth kernel).
__global__ void read_sink(const uint4* src, u64 words, uint4* sink) {
    uint4 acc = make_uint4(0, 0, 0, 0);
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += (u64)gridDim.x * blockDim.x) {
        const uint4 v = src[i];
        acc.x ^= v.x, acc.y ^= v.y, acc.z ^= v.z, acc.w ^= v.w;
    }
    if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x9e3779b9u) sink[0] = acc;
}

// The device's read bandwidth in bytes per second: median of 9 reads of a 4 GiB buffer on `st`.
static double read_bandwidth(int sms, cudaStream_t st) {
    const u64 bytes = 4ull << 30;
    uint4 *src, *sink;
    CK(cudaMalloc(&src, bytes));
    CK(cudaMalloc(&sink, 64));
    fill_rand<<<1024, 256>>>((u32*)src, bytes / 4, 5);
    const double bw = bytes / (time_us(st, 9, 1, [&] { read_sink<<<sms * 4, 512, 0, st>>>(src, bytes / 16, sink); }) * 1e-6);
    CK(cudaFree(src));
    CK(cudaFree(sink));
    return bw;
}
