// Tensor-core products of many activation rows at Gemma 3 12B and 270M shapes: kiln's `mmq` in
// each block size (128, 64, 32, 8 weight rows; for at most 8 activation rows also the blocks of 8
// activation rows, `mmqf`: 128, 64, 32, 16 weight rows), and cuBLAS's SGEMM on the dequantized weight
// (exec.rs's path for the formats without `mmq`), each checked against kiln's one-warp-per-row
// product (relative L2 of the whole output, every element written) and timed (median of 7 runs of
// 5 launches, weights rotated over copies so that L2 does not hold them).
// nvcc -O3 -arch=sm_90 -std=c++17 -I<dir from prep.sh> mmq.cu -lcublas -o mmq
#include "common.cuh"
#include "quant_f.cu"
#include "bench_util.cuh"
#include "kiln_ref.cuh"
#include <cmath>
#include <cstring>
#include <cublas_v2.h>

// Valid f16 scales in a planar legacy format's d plane (at byte `off` per block).
__global__ void fix_plane(u8* w, u64 nblk, int off) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < nblk; i += (u64)gridDim.x * blockDim.x) {
        u16* d = (u16*)(w + (u64)off * nblk) + i;
        *d = 0x1c00u | (*d & 0x3ffu);
    }
}

struct Case {
    const char* name;
    int fmt, n, k;
};

static int sms;

// The reference: kiln's one-warp-per-row product (matrix-vector chunk decoders), row by row.
template <int T> static void ref_rows(const u8* w, u64 rb, int n, const u8* xq, int k, int rows, float* out, cudaStream_t st) {
    for (int r = 0; r < rows; r++) ref_mv<T><<<(n + 3) / 4, 128, 0, st>>>(w, rb, n, xq + (u64)r * k * 5 / 2, k, out + (u64)r * n);
}

typedef void (*MmqFn)(const u8*, u64, u64, int, const u8*, int, int, float*);
// few: the blocks of 8 activation rows (mmqf{bw}), else of 32 (mmq{bw}).
template <int T> static MmqFn mmq_fn(bool few, int bw) {
#define TILES(NAME, F)                                \
    if (T == F) {                                     \
        if (few) {                                    \
            if (bw == 128) return mmqf128_##NAME;     \
            if (bw == 64) return mmqf64_##NAME;       \
            if (bw == 32) return mmqf32_##NAME;       \
            return mmqf16_##NAME;                     \
        }                                             \
        if (bw == 128) return mmq128_##NAME;          \
        if (bw == 64) return mmq64_##NAME;            \
        if (bw == 32) return mmq32_##NAME;            \
        return mmq8_##NAME;                           \
    }
    TILES(q4_k, F_Q4_K) TILES(q6_k, F_Q6_K) TILES(q8_0, F_Q8_0) TILES(q5_0, F_Q5_0)
#undef TILES
    return nullptr;
}
template <int T> static void mmq_tile(bool few, int bw, const u8* w, u64 rb, u64 nb, int n, const u8* xq, int k, int rows, float* out,
                                      cudaStream_t st) {
    MmqFn f = mmq_fn<T>(few, bw);
    const int xr = few ? MMQF_ROWS : MMQ_ROWS;
    int smem = (few ? MMQF_STAGES : MMQ_STAGES) * mmq_stage<T>(xr, bw);
    static bool set[2][4][129];
    if (!set[few][T % 4][bw]) {
        CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        set[few][T % 4][bw] = true;
    }
    dim3 grid((rows + xr - 1) / xr, (n + bw - 1) / bw);
    f<<<grid, 128, smem, st>>>(w, rb, nb, n, xq, k, rows, out);
}
template <int T> static void dequant_k(const u8* w, u64 rb, u64 nb, float* out, int k, u64 n, cudaStream_t st) {
    u64 count = n * k / 32;
    if (T == F_Q4_K) dequant_q4_k<<<(count + 255) / 256, 256, 0, st>>>(w, rb, nb, out, k, n);
    if (T == F_Q6_K) dequant_q6_k<<<(count + 255) / 256, 256, 0, st>>>(w, rb, nb, out, k, n);
}

static double rel_l2(const std::vector<float>& a, const std::vector<float>& ref, int* unwritten) {
    double num = 0, den = 0;
    *unwritten = 0;
    for (size_t i = 0; i < a.size(); i++) {
        if (std::isnan(a[i])) (*unwritten)++;
        double d = (double)a[i] - ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    return std::sqrt(num / den);
}

template <int T> static void run(const Case& c, const std::vector<int>& row_counts, cublasHandle_t blas, cudaStream_t st) {
    // cuBLAS beside the formats the dequantization kernels here cover (the K-quants).
    constexpr bool cublas = T == F_Q4_K || T == F_Q6_K;
    const int bpr = c.k / Fmt<T>::per, bytes = Fmt<T>::bytes;
    const u64 rb = (u64)bpr * bytes, nblk = (u64)c.n * bpr, mbytes = rb * c.n;
    const int copies = (int)std::max<u64>(1, std::min<u64>(16, (256ull << 20) / mbytes));
    std::vector<u8*> ws(copies);
    for (int i = 0; i < copies; i++) {
        CK(cudaMalloc(&ws[i], mbytes + 256));
        CK(cudaMemset(ws[i] + mbytes, 0, 256));
        fill_rand<<<1024, 256>>>((u32*)ws[i], mbytes / 4, 77 + i * 0x9e3779b9u);
        if (T == F_Q4_K) fix_q4k<<<1024, 256>>>(ws[i], nblk);
        if (T == F_Q6_K) fix_q6k<<<1024, 256>>>(ws[i], nblk);
        if (T == F_Q8_0) fix_plane<<<1024, 256>>>(ws[i], nblk, 32);
        if (T == F_Q5_0) fix_plane<<<1024, 256>>>(ws[i], nblk, 20);
    }
    int maxr = *std::max_element(row_counts.begin(), row_counts.end());
    float *x, *o_ref, *o, *deq = nullptr;
    u8* xq;
    CK(cudaMalloc(&x, (u64)maxr * c.k * 4));
    CK(cudaMalloc(&xq, (u64)maxr * c.k * 5 / 2));
    CK(cudaMalloc(&o_ref, (u64)maxr * c.n * 4));
    CK(cudaMalloc(&o, (u64)maxr * c.n * 4));
    if (cublas) CK(cudaMalloc(&deq, (u64)c.n * c.k * 4));
    fill_f<<<(maxr * c.k + 255) / 256, 256>>>(x, maxr * c.k, 1234, 0.f, 4.f);
    for (int rows : row_counts) {
        quantize_rows<<<(rows * c.k + 255) / 256, 256, 0, st>>>(x, xq, c.k, rows);
        CK(cudaStreamSynchronize(st));
        const u64 outn = (u64)rows * c.n;
        std::vector<float> ref(outn), got(outn);
        CK(cudaMemsetAsync(o_ref, 0xff, outn * 4, st));
        ref_rows<T>(ws[0], rb, c.n, xq, c.k, rows, o_ref, st);
        CK(cudaMemcpy(ref.data(), o_ref, outn * 4, cudaMemcpyDeviceToHost));
        int bad;
        int cur = 0;
        printf("%-10s %6d x %5d  rows %4d", c.name, c.n, c.k, rows);
        for (int few = rows <= MMQF_ROWS; few >= 0; few--)
            for (int bw : {128, 64, 32, few ? 16 : 8}) {
                CK(cudaMemsetAsync(o, 0xff, outn * 4, st));
                mmq_tile<T>(few, bw, ws[0], rb, nblk, c.n, xq, c.k, rows, o, st);
                CK(cudaGetLastError());
                CK(cudaMemcpy(got.data(), o, outn * 4, cudaMemcpyDeviceToHost));
                double err = rel_l2(got, ref, &bad);
                double us = time_us(st, 7, 5, [&] {
                    for (int i = 0; i < 5; i++) mmq_tile<T>(few, bw, ws[cur++ % copies], rb, nblk, c.n, xq, c.k, rows, o, st);
                });
                printf(" | mmq%s%-3d %7.1f us %4.0f GB/s (%.0e%s)", few ? "f" : "", bw, us, mbytes / us / 1e3, err, bad ? ", UNWRITTEN" : "");
            }
        if (cublas) {
            const float one = 1.f, zero = 0.f;
            CK(cudaMemsetAsync(o, 0xff, outn * 4, st));
            auto gemm = [&](const u8* w) {
                dequant_k<T>(w, rb, nblk, deq, c.k, c.n, st);
                cublasSgemm(blas, CUBLAS_OP_T, CUBLAS_OP_N, c.n, rows, c.k, &one, deq, c.k, x, c.k, &zero, o, c.n);
            };
            gemm(ws[0]);
            CK(cudaMemcpy(got.data(), o, outn * 4, cudaMemcpyDeviceToHost));
            double err = rel_l2(got, ref, &bad);
            double us = time_us(st, 7, 5, [&] {
                for (int i = 0; i < 5; i++) gemm(ws[cur++ % copies]);
            });
            printf(" | cublas %7.1f (%.0e)", us, err);
        }
        printf("\n");
        fflush(stdout);
    }
    for (auto w : ws) CK(cudaFree(w));
    CK(cudaFree(x));
    CK(cudaFree(xq));
    CK(cudaFree(o_ref));
    CK(cudaFree(o));
    if (deq) CK(cudaFree(deq));
}

int main(int argc, char** argv) {
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    cublasHandle_t blas;
    cublasCreate(&blas);
    cublasSetStream(blas, st);
    const bool quick = argc > 1 && !strcmp(argv[1], "quick");
    // `mmq few`: the few-row blocks against the 32-row ones at 2-8 activation rows.
    const bool few = argc > 1 && !strcmp(argv[1], "few");
    const std::vector<Case> cases = {
        {"12b.gate", F_Q4_K, 15360, 3840}, {"12b.q", F_Q4_K, 4096, 3840}, {"12b.v", F_Q6_K, 2048, 3840},
        {"12b.o", F_Q4_K, 3840, 4096},     {"12b.down", F_Q6_K, 3840, 15360}, {"270m.q", F_Q5_0, 1024, 640},
        {"270m.gate", F_Q5_0, 2048, 640},  {"270m.v", F_Q8_0, 256, 640},    {"270m.o", F_Q4_K, 640, 1024},
        {"270m.down", F_Q6_K, 640, 2048},  {"head.q8", F_Q8_0, 262144, 640},
    };
    // `mmq one NAME ROWS`: one case (for a profiler).
    const bool one = argc > 3 && !strcmp(argv[1], "one");
    const std::vector<int> rows = one ? std::vector<int>{atoi(argv[3])}
                                : quick ? std::vector<int>{16, 64, 512}
                                : few   ? std::vector<int>{2, 4, 8}
                                        : std::vector<int>{9, 16, 33, 64, 128, 256, 512};
    for (const Case& c : cases) {
        if (one && strcmp(c.name, argv[2])) continue;
        std::vector<int> r = rows;
        if (!one && !strcmp(c.name, "head.q8")) r = few ? std::vector<int>{8} : std::vector<int>{16, 64};
        switch (c.fmt) {
        case F_Q4_K: run<F_Q4_K>(c, r, blas, st); break;
        case F_Q6_K: run<F_Q6_K>(c, r, blas, st); break;
        case F_Q8_0: run<F_Q8_0>(c, r, blas, st); break;
        case F_Q5_0: run<F_Q5_0>(c, r, blas, st); break;
        }
    }
    CK(cudaDeviceSynchronize());
    return 0;
}
