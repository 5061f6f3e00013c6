// Matrix-vector loop structures for kiln's Q4_K / Q6_K chunk numerics at 12B shapes, alone and in
// chains of 12B layers (see README.md). nvcc -O3 -arch=sm_90 -std=c++17 matvec_variants.cu
#include <string>
#include "matvec_variants.cuh"
#include "bench_util.cuh"

typedef void (*MvFn)(const u8*, u64, u64, int, const u8*, int, float*, const u8*, u64, const u8*, u64, int);
struct Variant {
    const char* name;
    MvFn fn;
    bool q6;
    int threads, minb;
    bool sx;
};
static Variant variants[] = {
    {"q4k r4d1", p_q4k_r4d1g_128x4, false, 128, 4, false}, {"q4k r4d2", p_q4k_r4d2g_128x4, false, 128, 4, false},
    {"q4k r2d2", p_q4k_r2d2g_128x4, false, 128, 4, false}, {"q4k r2d3", p_q4k_r2d3g_128x4, false, 128, 4, false},
    {"q4k r8d1", p_q4k_r8d1g_128x4, false, 128, 4, false}, {"nop r4d1", n_q4k_r4d1g_128x4, false, 128, 4, false},
    {"nop r4d2", n_q4k_r4d2g_128x4, false, 128, 4, false}, {"nop r2d2", n_q4k_r2d2g_128x4, false, 128, 4, false},
    {"nop r8d1", n_q4k_r8d1g_128x4, false, 128, 4, false}, {"nop r4d2 x8", n_q4k_r4d2g_128x8, false, 128, 8, false}, {"q6k r4d1", p_q6k_r4d1g_128x4, true, 128, 4, false},
    {"q6k r4d2", p_q6k_r4d2g_128x4, true, 128, 4, false},  {"q6k r2d2", p_q6k_r2d2g_128x4, true, 128, 4, false},
    {"q6k r2d3", p_q6k_r2d3g_128x4, true, 128, 4, false},  {"q6k r8d1", p_q6k_r8d1g_128x4, true, 128, 4, false},
};
struct TVariant {
    const char* name;
    MvFn fn;
    bool q6;
    int sr, ns, warps;
};
static TVariant tvariants[] = {
    {"t q4k 8x4 w8", t_q4k_8x4_w8, false, 8, 4, 8},    {"t q4k 8x6 w8", t_q4k_8x6_w8, false, 8, 6, 8},
    {"t q4k 16x4 w16", t_q4k_16x4_w16, false, 16, 4, 16}, {"t q4k 2x4 w8", t_q4k_2x4_w8, false, 2, 4, 8},
    {"t q4k 2x6 w8", t_q4k_2x6_w8, false, 2, 6, 8},    {"t q6k 8x4 w8", t_q6k_8x4_w8, true, 8, 4, 8},
    {"t q6k 2x4 w8", t_q6k_2x4_w8, true, 2, 4, 8},     {"t q6k 2x6 w8", t_q6k_2x6_w8, true, 2, 6, 8},
    {"t q6k 4x4 w16", t_q6k_4x4_w16, true, 4, 4, 16},
};
static int sms;

static u8* make_xq(int k) {
    u8* x;
    CK(cudaMalloc(&x, (u64)k * 5 / 2));
    static u32 seed = 77;
    fill_rand<<<64, 256>>>((u32*)x, (u64)k * 5 / 8, seed++);
    fix_xq<<<(2 * k + 255) / 256, 256>>>(x, k);
    CK(cudaGetLastError());
    return x;
}
static size_t tsmem(const TVariant& v, const Matrix& m) { return (size_t)v.ns * v.sr * m.rb + (((size_t)m.k * 5 / 2 + 15) & ~(size_t)15); }
static bool tlaunch(const TVariant& v, const Matrix& m, const u8* xq, float* out, cudaStream_t s, int cps) {
    size_t sm = tsmem(v, m);
    // (Bulk copies move multiples of 16 bytes: a stage's Q6_K scale plane must be one.)
    if (sm * cps > 225 * 1024 || (v.q6 && (2 * v.sr * (m.k / 256)) % 16 != 0)) return false;
    PdlLaunch pl(dim3(sms * cps), dim3(v.warps * 32), sm, s);
    const u8* z = nullptr;
    CK(cudaLaunchKernelEx(&pl.cfg, v.fn, (const u8*)m.w, m.rb, m.nblk, m.n, xq, m.k, out, z, (u64)0, z, (u64)0, 0));
    return true;
}
static size_t smem_for(const Variant& v, int k) { return v.sx ? (size_t)(k / 32) * 80 : 0; }

static void launch(const Variant& v, const Matrix& m, const u8* xq, float* out, cudaStream_t s, int bps, const Matrix* next = nullptr,
                   int pfm = 0, u64 cap = 0) {
    const u8 *p0 = nullptr, *p1 = nullptr;
    u64 b0 = 0, b1 = 0;
    if (next && pfm) {
        double f = std::min(1.0, (double)cap / next->bytes);
        if (next->q6) {
            p0 = next->w;
            b0 = (u64)(128.0 * next->nblk * f);
            p1 = next->w + 128 * next->nblk;
            b1 = (u64)(64.0 * next->nblk * f);
        } else {
            p0 = next->w;
            b0 = (u64)(next->bytes * f);
        }
    }
    PdlLaunch pl(dim3(sms * bps), dim3(v.threads), smem_for(v, m.k), s);
    CK(cudaLaunchKernelEx(&pl.cfg, v.fn, (const u8*)m.w, m.rb, m.nblk, m.n, xq, m.k, out, p0, b0, p1, b1, pfm));
}
static void launch_ref(const Matrix& m, const u8* xq, float* out) {
    if (m.q6)
        ref_q6k<<<(m.n + 3) / 4, 128>>>(m.w, m.rb, m.nblk, m.n, xq, m.k, out);
    else
        ref_q4k<<<(m.n + 3) / 4, 128>>>(m.w, m.rb, m.nblk, m.n, xq, m.k, out);
    CK(cudaGetLastError());
}


int main(int argc, char** argv) {
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    sms = p.multiProcessorCount;
    printf("device %s, %d SMs\n", p.name, sms);
    for (auto& v : variants) CK(cudaFuncSetAttribute(v.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, 48 * 1024));
    for (auto& v : tvariants) CK(cudaFuncSetAttribute(v.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, 225 * 1024));
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));

    // Read bandwidth (same kernel as kiln's read_bandwidth), 4 GiB.
    const double bw = read_bandwidth(sms, st);
    printf("read bandwidth %.0f GB/s\n", bw / 1e9);

    u8* x3840 = make_xq(3840);
    u8* x4096 = make_xq(4096);
    u8* x15360 = make_xq(15360);
    auto xfor = [&](int k) { return k == 3840 ? x3840 : k == 4096 ? x4096 : x15360; };
    float *out, *ref;
    CK(cudaMalloc(&out, 4 * 262144 * 4));
    CK(cudaMalloc(&ref, 262144 * 4));

    // Isolated shapes: copies rotated so that at least ~300 MB are walked.
    struct Shape {
        const char* name;
        int n, k;
        bool q6;
    } shapes[] = {{"gate+up 30720x3840 q4k", 30720, 3840, false}, {"q 4096x3840 q4k", 4096, 3840, false},
                  {"down 3840x15360 q4k", 3840, 15360, false}, {"down 3840x15360 q6k", 3840, 15360, true},
                  {"v 2048x3840 q6k", 2048, 3840, true},          {"head 262144x3840 q6k", 262144, 3840, true},
                  {"headq4 262144x3840 q4k", 262144, 3840, false}};
    printf("\n%-26s %-18s %10s %9s %7s %9s\n", "shape", "variant", "us", "GB/s", "%bw", "maxrel");
    for (auto& sh : shapes) {
        Matrix m0 = make_matrix(sh.n, sh.k, sh.q6);
        int copies = std::max<int>(1, (int)std::min<u64>(24, (300ull << 20) / m0.bytes + 1));
        std::vector<Matrix> ms{m0};
        for (int i = 1; i < copies; i++) ms.push_back(make_matrix(sh.n, sh.k, sh.q6));
        const u8* xq = xfor(sh.k);
        launch_ref(m0, xq, ref);
        CK(cudaDeviceSynchronize());
        std::vector<float> hr(sh.n), ho(sh.n);
        CK(cudaMemcpy(hr.data(), ref, 4 * sh.n, cudaMemcpyDeviceToHost));
        double rmax = 0;
        for (float v : hr) rmax = std::max(rmax, (double)fabsf(v));
        // One variant (`go` launches it over a matrix into an output): its products against the
        // reference (max relative error; -1: not checked), then its median time per launch.
        auto measure = [&](const char* name, bool check, auto go) {
            CK(cudaMemset(out, 0xff, 4 * sh.n));
            go(m0, out);
            CK(cudaStreamSynchronize(st));
            CK(cudaGetLastError());
            CK(cudaMemcpy(ho.data(), out, 4 * sh.n, cudaMemcpyDeviceToHost));
            double err = 0;
            for (int i = 0; i < sh.n; i++) err = std::max(err, (double)fabsf(ho[i] - hr[i]) / rmax);
            if (!(err < 1e-4)) err = 1e9;
            if (!check) err = -1;
            int reps = std::max(4, copies * 2);
            double us = time_us(st, 7, reps, [&] {
                for (int i = 0; i < reps; i++) go(ms[i % copies], out + (i & 3) * 262144);
            });
            printf("%-26s %-18s %10.1f %9.0f %6.1f%% %9.2e\n", sh.name, name, us, m0.bytes / (us * 1e-6) / 1e9,
                   100.0 * m0.bytes / (us * 1e-6) / bw, err);
        };
        for (auto& v : variants) {
            if (v.q6 != sh.q6) continue;
            // (Variants without arithmetic have nothing to check.)
            measure(v.name, v.name[0] != 'n', [&](const Matrix& m, float* o) { launch(v, m, xq, o, st, v.minb); });
        }
        for (auto& v : tvariants) {
            if (v.q6 != sh.q6) continue;
            for (int cps = 1; cps <= 2; cps++) {
                if (!tlaunch(v, m0, xq, out, st, cps)) continue;  // (too much shared memory)
                char nm[64];
                snprintf(nm, sizeof nm, "%s c%d", v.name, cps);
                measure(nm, true, [&](const Matrix& m, float* o) { tlaunch(v, m, xq, o, st, cps); });
            }
        }
        for (auto& m : ms) CK(cudaFree(m.w));
    }

    // Chains of 12B layers (q, k, v, o, gate+up, down; v and down Q6_K every other layer), PDL
    // launches captured in a graph, 8 layers of distinct weights.
    const int L = 8;
    struct LayerMats {
        Matrix m[6];
    };
    std::vector<LayerMats> layers;
    u64 total = 0;
    for (int l = 0; l < L; l++) {
        bool q6 = l % 2 == 0;
        LayerMats lm{{make_matrix(4096, 3840, false), make_matrix(2048, 3840, false), make_matrix(2048, 3840, q6),
                      make_matrix(3840, 4096, false), make_matrix(30720, 3840, false), make_matrix(3840, 15360, q6)}};
        for (auto& m : lm.m) total += m.bytes;
        layers.push_back(lm);
    }
    CK(cudaDeviceSynchronize());
    struct Combo {
        int q4, q6, pfm, cap_mb;
    } combos[] = {{0, 10, 0, 0}, {1, 11, 0, 0}, {2, 12, 0, 0}, {4, 12, 0, 0}, {0, 10, 1, 8}, {0, 10, 2, 8}};
    printf("\nchain: %d layers, %.1f MB\n", L, total / 1e6);
    for (auto& c : combos) {
        Variant &a = variants[c.q4], &b = variants[c.q6];
        double us = graph_us(st, 9, [&] {
            for (int l = 0; l < L; l++)
                for (int i = 0; i < 6; i++) {
                    const Matrix& m = layers[l].m[i];
                    const Variant& v = m.q6 ? b : a;
                    const Matrix* next = i < 5 ? &layers[l].m[i + 1] : l + 1 < L ? &layers[l + 1].m[0] : nullptr;
                    launch(v, m, xfor(m.k), out + (i & 3) * 262144, st, v.minb, next, c.pfm, (u64)c.cap_mb << 20);
                }
        });
        printf("chain %-9s + %-9s pf %d cap %2d MB: %8.1f us/layer %7.0f GB/s %5.1f%%\n", a.name, b.name, c.pfm, c.cap_mb, us / L,
               total / (us * 1e-6) / 1e9, 100.0 * total / (us * 1e-6) / bw);
    }
    struct TCombo {
        int q4s, q4b, q6s, q6b, cps;
    } tcombos[] = {{0, 3, 5, 6, 1}, {0, 3, 5, 6, 2}, {1, 4, 5, 7, 1}, {2, 3, 5, 6, 1}};
    for (auto& c : tcombos) {
        double us = graph_us(st, 9, [&] {
            for (int l = 0; l < L; l++)
                for (int i = 0; i < 6; i++) {
                    const Matrix& m = layers[l].m[i];
                    const TVariant& v = tvariants[m.q6 ? (m.k > 4096 ? c.q6b : c.q6s) : (m.k > 4096 ? c.q4b : c.q4s)];
                    if (!tlaunch(v, m, xfor(m.k), out + (i & 3) * 262144, st, c.cps)) tlaunch(v, m, xfor(m.k), out + (i & 3) * 262144, st, 1);
                }
        });
        printf("chain %s/%s + %s/%s c%d: %8.1f us/layer %7.0f GB/s %5.1f%%\n", tvariants[c.q4s].name, tvariants[c.q4b].name,
               tvariants[c.q6s].name, tvariants[c.q6b].name, c.cps, us / L, total / (us * 1e-6) / 1e9, 100.0 * total / (us * 1e-6) / bw);
    }
    return 0;
}
