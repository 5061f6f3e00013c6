// kiln's own matrix-vector kernels (crates/cuda/kernels/quant.cu, Q4_K/Q6_K only) at 12B shapes,
// launched as exec.rs does, alone and as a graph of 8 layers and the greedy head, under a few
// overrides of exec.rs's rules (see README.md).
// nvcc -O3 -arch=sm_90 -std=c++17 -I<dir from prep.sh> kiln_matvec.cu
#include "common.cuh"
#include "quant_f.cu"
#include "bench_util.cuh"
#include "kiln_ref.cuh"
#include <cstring>

typedef void (*Fn)(const u8*, const u8*, const u8*, u64, int, int, int, float*, float*, float*, float*, const u8*, int, int, int, u8*, u32*,
                   const float*, const float*, float*, const float*, float*, u8*, u32*, float, u64*, int*, u32*, const float*, float*);
static int sms;
// Overrides of exec.rs's rules: split (0: the rule), blocks per multiprocessor cap (0: the rule), the
// norm epilogue on the o and down launches (as kiln did before 2026-11-30 evening; now the norm kernel).
static int o_split = 0, o_cap = 0, o_epi = 0;
static size_t hxq(int k) { return (size_t)k * 5 / 2; }
// Dynamic shared memory of a matvec4 block of format T (its rings of staged chunks; as exec.rs).
template <int T> static size_t stage_bytes() { return (size_t)MV_WARPS * MV_STAGES * 4 * Chunk<T>::NP * 32 * 16; }

// Scratch shared by the launches (as exec.rs's sync buffer and step buffers).
struct Bufs {
    u8 *xq3840, *xq4096, *xq15360, *gq, *exq;
    float *o0, *o1, *o2, *glu, *ew1, *er, *eh, *ew2, *eout;
    u32 *gcnt, *ecnt, *acnt;
    u64* aslots;
    int* aout;
} B;

struct Launch {
    const Matrix* m[3];
    int nm;
    bool glu, epi, argmax, no_gq = false;
};

// matvecr (weights streamed through shared memory) instead of matvec4 where its tiles fit: ring
// budget per block (KB, 0: off; twice that for the 8-warp blocks of matvecr4), blocks per
// multiprocessor (half that of matvecr4), launch kinds (bit i: kind i of `names` below, 5: the
// head).
static int o_ring = 0, o_ring_bps = 4, o_ring_kinds = 63;
typedef void (*RingFn)(const u8*, const u8*, const u8*, u64, int, int, int, float*, float*, float*, const float*, const float*,
                       const float*, float*, const u8*, int, int, u64*, int*, u32*);
// The ring of a matvecr block of tiles of `rows` rows (bytes).
static u64 ring_bytes(int rows) { return (u64)o_ring * 1024 * (rows == 4 ? 2 : 1); }
// Whether a matrix cuts in matvecr tiles of `rows` rows (with glu, half of them from each matrix):
// every plane's share a multiple of 16 bytes, two tiles within the ring (as exec.rs).
static bool ring_fits(const Matrix& m, bool glu, int rows) {
    int bpr = m.k / 256, part = glu ? rows / 2 : rows;
    bool ok = m.n % part == 0 && 2 * rows * m.rb <= ring_bytes(rows);
    for (int per : m.q6 ? std::vector<int>{128, 64, 16, 2} : std::vector<int>{144}) ok = ok && (per * part * bpr) % 16 == 0;
    return ok;
}
static bool launch_ring(const Launch& L, cudaStream_t st) {
    const Matrix& m = *L.m[0];
    int total = 0;
    for (int i = 0; i < L.nm; i++) total += L.m[i]->n;
    bool isv = L.nm == 1 && !L.epi && !L.argmax;
    int kind = L.argmax ? 5 : L.glu ? 3 : L.epi ? (m.k == 4096 ? 2 : 4) : isv ? 1 : 0;
    if (!(o_ring_kinds >> kind & 1) || (L.glu && !L.no_gq) || (L.epi && o_epi)) return false;
    int rows = 0;
    for (int r : {8, 4, 2}) {
        bool ok = true;
        for (int i = 0; i < L.nm; i++) ok = ok && ring_fits(*L.m[i], L.glu, r);
        if (ok) {
            rows = r;
            break;
        }
    }
    if (!rows) return false;
    int ns = std::min(4, (int)(ring_bytes(rows) / (rows * m.rb)));
    int tiles = L.glu ? m.n / (rows / 2) : total / rows;
    int blocks = std::min(tiles, (rows == 4 ? o_ring_bps / 2 : o_ring_bps) * sms);
    RingFn fn = rows == 8   ? (m.q6 ? matvecr8_q6_k : matvecr8_q4_k)
                : rows == 4 ? (m.q6 ? matvecr4_q6_k : matvecr4_q4_k)
                            : (m.q6 ? matvecr2_q6_k : matvecr2_q4_k);
    const u8* xq = m.k == 3840 ? B.xq3840 : m.k == 4096 ? B.xq4096 : B.xq15360;
    const u8* w1 = L.nm > 1 ? L.m[1]->w : nullptr;
    const u8* w2 = L.nm > 2 ? L.m[2]->w : nullptr;
    int n1 = L.nm > 1 ? L.m[1]->n : 0, n2 = L.nm > 2 ? L.m[2]->n : 0;
    PdlLaunch pl(dim3(blocks), dim3(32 * (rows == 4 ? MVR4_WARPS : MVR_WARPS)), (size_t)ns * rows * m.rb, st);
    const float* nob = nullptr;  // (No biases.)
    CK(cudaLaunchKernelEx(&pl.cfg, fn, (const u8*)m.w, w1, w2, m.rb, m.n, n1, n2, B.o0, B.o1, B.o2, nob, nob, nob,
                          L.glu ? B.glu : (float*)nullptr, xq, m.k, ns, B.aslots, L.argmax ? B.aout : nullptr, B.acnt));
    return true;
}

static void launch(const Launch& L, cudaStream_t st) {
    if (o_ring && launch_ring(L, st)) return;
    const Matrix& m = *L.m[0];
    int total = 0;
    for (int i = 0; i < L.nm; i++) total += L.m[i]->n;
    Fn fn = m.q6 ? matvec4_q6_k : matvec4_q4_k;
    int groups = L.glu ? (m.n + 1) / 2 : (total + 3) / 4;
    int c = m.k / 32;
    int split = groups >= 2 * 16 * sms || (c <= 128 && groups >= 7 * sms) ? 1 : c >= 128 ? 4 : c >= 64 ? 2 : 1;
    if (o_split) split = o_split;
    int blocks = (groups + 4 / split - 1) / (4 / split);
    if (split == 1 && (o_cap || groups >= 16 * 16 * sms)) blocks = std::min(blocks, (o_cap ? o_cap : 4) * sms);
    bool epi = L.epi && o_epi;
    const u8* xq = m.k == 3840 ? B.xq3840 : m.k == 4096 ? B.xq4096 : B.xq15360;
    const u8* w1 = L.nm > 1 ? L.m[1]->w : nullptr;
    const u8* w2 = L.nm > 2 ? L.m[2]->w : nullptr;
    int n1 = L.nm > 1 ? L.m[1]->n : 0, n2 = L.nm > 2 ? L.m[2]->n : 0;
    PdlLaunch pl(dim3(blocks), dim3(128), m.q6 ? stage_bytes<F_Q6_K>() : stage_bytes<F_Q4_K>(), st);
    CK(cudaLaunchKernelEx(&pl.cfg, fn, (const u8*)m.w, w1, w2, m.rb, m.n, n1, n2, B.o0, B.o1, B.o2, L.glu ? B.glu : (float*)nullptr, xq,
                          m.k, 1, split, L.glu && !L.no_gq ? B.gq : (u8*)nullptr, B.gcnt, epi ? (const float*)B.ew1 : nullptr,
                          epi ? (const float*)B.er : nullptr, epi ? B.eh : nullptr, epi ? (const float*)B.ew2 : nullptr,
                          epi ? B.eout : nullptr, epi ? B.exq : nullptr, epi ? B.ecnt : nullptr, 1e-6f, B.aslots,
                          L.argmax ? B.aout : nullptr, B.acnt, (const float*)nullptr, (float*)nullptr));
}


int main(int argc, char** argv) {
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    sms = p.multiProcessorCount;
    CK(cudaFuncSetAttribute(matvec4_q4_k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)stage_bytes<F_Q4_K>()));
    CK(cudaFuncSetAttribute(matvec4_q6_k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)stage_bytes<F_Q6_K>()));
    for (RingFn f : {matvecr8_q4_k, matvecr8_q6_k, matvecr4_q4_k, matvecr4_q6_k, matvecr2_q4_k, matvecr2_q6_k})
        CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    // "quick": only exec.rs's rules (for A/B runs of kernel variants).
    bool quick = argc > 1 && !strcmp(argv[1], "quick");
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    // Inputs: x (quantized with kiln's quantizer), norm weights, residual.
    auto xq_of = [&](int k) {
        float* x;
        u8* q;
        CK(cudaMalloc(&x, 4 * k));
        CK(cudaMalloc(&q, hxq(k)));
        fill_f<<<(k + 255) / 256, 256>>>(x, k, k, 0.f, 2.f);
        quant_x<<<(k + 255) / 256, 256>>>(x, q, k);
        return q;
    };
    B.xq3840 = xq_of(3840);
    B.xq4096 = xq_of(4096);
    B.xq15360 = xq_of(15360);
    const int N = 262144;
    for (float** f : {&B.o0, &B.o1, &B.o2, &B.glu}) CK(cudaMalloc(f, 4 * N));
    for (float** f : {&B.ew1, &B.er, &B.eh, &B.ew2, &B.eout}) CK(cudaMalloc(f, 4 * 15360));
    fill_f<<<60, 256>>>(B.ew1, 15360, 3, 1.f, 0.5f);
    fill_f<<<60, 256>>>(B.ew2, 15360, 4, 1.f, 0.5f);
    fill_f<<<60, 256>>>(B.er, 15360, 5, 0.f, 4.f);
    CK(cudaMalloc(&B.gq, hxq(15360)));
    CK(cudaMalloc(&B.exq, hxq(15360)));
    CK(cudaMalloc(&B.gcnt, 4 * 8 * 15360 / 32));
    CK(cudaMalloc(&B.ecnt, 4));
    CK(cudaMalloc(&B.acnt, 4));
    CK(cudaMalloc(&B.aslots, 8 * (8 * 256 + 8)));
    CK(cudaMalloc(&B.aout, 4 * 8));
    CK(cudaMemset(B.gcnt, 0, 4 * 8 * 15360 / 32));
    CK(cudaMemset(B.ecnt, 0, 4));
    CK(cudaMemset(B.acnt, 0, 4));
    CK(cudaMemset(B.aslots, 0, 8 * (8 * 256 + 8)));
    CK(cudaDeviceSynchronize());

    // Correctness against the reference (plain, glu, argmax), matvec4 then matvecr.
    for (int ring : {0, 52}) {
        o_ring = ring;
        printf("-- %s\n", ring ? "matvecr" : "matvec4");
        Matrix g = make_matrix(15360, 3840, false), u = make_matrix(15360, 3840, false), h = make_matrix(65536, 3840, true);
        float* ref;
        CK(cudaMalloc(&ref, 4 * 65536 * 2));
        ref_mv<F_Q4_K><<<15360 / 4, 128>>>(g.w, g.rb, 15360, B.xq3840, 3840, ref);
        ref_mv<F_Q4_K><<<15360 / 4, 128>>>(u.w, u.rb, 15360, B.xq3840, 3840, ref + 15360);
        Launch lg{{&g, &u}, 2, true, false, false, ring != 0};
        launch(lg, st);
        CK(cudaStreamSynchronize(st));
        CK(cudaGetLastError());
        std::vector<float> r(2 * 15360), a(15360), b(15360), gl(15360);
        CK(cudaMemcpy(r.data(), ref, 4 * 2 * 15360, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(a.data(), B.o0, 4 * 15360, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(b.data(), B.o1, 4 * 15360, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(gl.data(), B.glu, 4 * 15360, cudaMemcpyDeviceToHost));
        double e = 0, mx = 0;
        for (int i = 0; i < 15360; i++) {
            e = std::max(e, (double)fabs(a[i] - r[i]) + fabs(b[i] - r[15360 + i]));
            mx = std::max(mx, (double)fabs(r[i]));
            double gv = 0.5 * r[i] * (1 + tanh(0.7978846 * (r[i] + 0.044715 * r[i] * r[i] * r[i]))) * r[15360 + i];
            e = std::max(e, fabs(gl[i] - gv) / std::max(1.0, fabs(gv)));
        }
        printf("glu gate/up 15360x3840: max err %.3e (max |ref| %.3e)\n", e, mx);
        // Plain over two matrices (q, k).
        Launch lp{{&g, &u}, 2, false, false, false};
        launch(lp, st);
        CK(cudaStreamSynchronize(st));
        std::vector<float> o(2 * 15360);
        CK(cudaMemcpy(o.data(), B.o0, 4 * 15360, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(o.data() + 15360, B.o1, 4 * 15360, cudaMemcpyDeviceToHost));
        e = 0;
        for (int i = 0; i < 2 * 15360; i++) e = std::max(e, (double)fabs(o[i] - r[i]));
        printf("plain 2 x 15360x3840: max err %.3e\n", e);
        // Plain Q6_K and Q4_K with long rows (down).
        for (bool q6 : {true, false}) {
            Matrix d = make_matrix(3840, 15360, q6);
            if (q6)
                ref_mv<F_Q6_K><<<3840 / 4, 128>>>(d.w, d.rb, 3840, B.xq15360, 15360, ref);
            else
                ref_mv<F_Q4_K><<<3840 / 4, 128>>>(d.w, d.rb, 3840, B.xq15360, 15360, ref);
            Launch ld{{&d}, 1, false, false, false};
            CK(cudaMemset(B.o0, 0xff, 4 * 3840));
            launch(ld, st);
            CK(cudaStreamSynchronize(st));
            CK(cudaGetLastError());
            std::vector<float> dr(3840), dg(3840);
            CK(cudaMemcpy(dr.data(), ref, 4 * 3840, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(dg.data(), B.o0, 4 * 3840, cudaMemcpyDeviceToHost));
            double de = 0, dm = 0;
            for (int i = 0; i < 3840; i++) {
                de = std::max(de, (double)fabs(dg[i] - dr[i]));
                dm = std::max(dm, (double)fabs(dr[i]));
            }
            if (!(de <= 1e-4 * dm)) de = 1e30;
            printf("plain 3840x15360 %s: max err %.3e (max |ref| %.3e)\n", q6 ? "q6k" : "q4k", de, dm);
            CK(cudaFree(d.w));
        }
        // Argmax over a Q6_K head.
        ref_mv<F_Q6_K><<<65536 / 4, 128>>>(h.w, h.rb, 65536, B.xq3840, 3840, ref);
        Launch la{{&h}, 1, false, false, true};
        for (int rep = 0; rep < 3; rep++) {
            launch(la, st);
            CK(cudaStreamSynchronize(st));
            CK(cudaGetLastError());
            std::vector<float> hr(65536);
            int got;
            CK(cudaMemcpy(hr.data(), ref, 4 * 65536, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(&got, B.aout, 4, cudaMemcpyDeviceToHost));
            int best = 0;
            for (int i = 1; i < 65536; i++)
                if (hr[i] > hr[best]) best = i;
            printf("argmax head 65536x3840 q6k: got %d, reference %d (%s)\n", got, best, got == best ? "ok" : "MISMATCH");
        }
        CK(cudaFree(g.w));
        CK(cudaFree(u.w));
        CK(cudaFree(h.w));
        CK(cudaFree(ref));
    }

    // Layers of the 12B: [q,k(,v)] [v q6k] o+epi, gate/up glu, down+epi; 8 layers, then the head.
    const int L = 8;
    std::vector<std::vector<Matrix>> mats;
    std::vector<std::vector<Launch>> launches;
    u64 total = 0;
    for (int l = 0; l < L; l++) {
        bool q6 = l % 2 == 0;
        mats.push_back({make_matrix(4096, 3840, false), make_matrix(2048, 3840, false), make_matrix(2048, 3840, q6),
                        make_matrix(3840, 4096, false), make_matrix(15360, 3840, false), make_matrix(15360, 3840, false),
                        make_matrix(3840, 15360, q6)});
    }
    for (int l = 0; l < L; l++) {
        auto& m = mats[l];
        for (auto& x : m) total += x.bytes;
        std::vector<Launch> ls;
        if (l % 2 == 0) {
            ls.push_back(Launch{{&m[0], &m[1]}, 2, false, false, false});
            ls.push_back(Launch{{&m[2]}, 1, false, false, false});
        } else {
            ls.push_back(Launch{{&m[0], &m[1], &m[2]}, 3, false, false, false});
        }
        ls.push_back(Launch{{&m[3]}, 1, false, true, false});
        ls.push_back(Launch{{&m[4], &m[5]}, 2, true, false, false, true});
        ls.push_back(Launch{{&m[6]}, 1, false, true, false});
        launches.push_back(ls);
    }
    Matrix head = make_matrix(262144, 3840, true);
    CK(cudaDeviceSynchronize());
    const char* names[] = {"qk(v)", "v q6k", "o", "gate/up", "down"};
    struct Cfg {
        const char* name;
        int split, cap, epi, ring, bps, kinds;
    } cfgs[] = {{"rules", 0, 0, 0, 0, 0, 0},
                {"ring 52 KB, 4 blocks/SM, v gate/up head", 0, 0, 0, 52, 4, 2 + 8 + 32},
                {"ring 52 KB, 4 blocks/SM, all launches", 0, 0, 0, 52, 4, 63},
                {"ring 40 KB, 5 blocks/SM, v gate/up head", 0, 0, 0, 40, 5, 2 + 8 + 32},
                {"rules + norm epilogues", 0, 0, 1, 0, 0, 0},
                {"split 1", 1, 0, 0, 0, 0, 0},
                {"split 2", 2, 0, 0, 0, 0, 0},
                {"split 1, persistent", 1, 4, 0, 0, 0, 0}};
    const char* only = argc > 2 ? argv[2] : nullptr;
    for (auto& cf : cfgs) {
    if (quick && cf.split + cf.cap + cf.epi + cf.ring) continue;
    if (only && !strstr(cf.name, only) && strcmp(cf.name, "rules")) continue;
    o_split = cf.split;
    o_cap = cf.cap;
    o_epi = cf.epi;
    o_ring = cf.ring;
    o_ring_bps = cf.bps;
    o_ring_kinds = cf.kinds;
    printf("\n== config %s\n", cf.name);
    // Each launch kind alone (rotating over the layers' copies).
    printf("\n%-12s %10s %9s\n", "launch", "us", "GB/s");
    for (int kind = 0; kind < 5; kind++) {
        std::vector<const Launch*> sel;
        for (int l = 0; l < L; l++)
            for (auto& x : launches[l]) {
                bool isv = x.nm == 1 && !x.epi && !x.argmax;
                int kk = x.glu ? 3 : x.epi ? (x.m[0]->k == 4096 ? 2 : 4) : isv ? 1 : 0;
                if (kk == kind) sel.push_back(&x);
            }
        if (sel.empty()) continue;
        u64 bytes = 0;
        for (auto* x : sel)
            for (int i = 0; i < x->nm; i++) bytes += x->m[i]->bytes;
        double us = time_us(st, 7, 3.0 * sel.size(), [&] {
            for (int rep = 0; rep < 3; rep++)
                for (auto* x : sel) launch(*x, st);
        });
        printf("%-12s %10.1f %9.0f\n", names[kind], us, bytes / sel.size() / (us * 1e-6) / 1e9);
    }
    Launch la{{&head}, 1, false, false, true};
    double us = time_us(st, 7, 1, [&] { launch(la, st); });
    printf("%-12s %10.1f %9.0f\n", "head argmax", us, head.bytes / (us * 1e-6) / 1e9);
    // What the outputs cost: the gate/up pair and the head writing plain products.
    {
        Launch lh{{&head}, 1, false, false, false};
        us = time_us(st, 7, 1, [&] { launch(lh, st); });
        printf("%-12s %10.1f %9.0f\n", "head plain", us, head.bytes / (us * 1e-6) / 1e9);
        u64 bytes = 0;
        std::vector<Launch> gu, gn;
        for (int l = 0; l < L; l++) {
            gu.push_back(Launch{{&mats[l][4], &mats[l][5]}, 2, false, false, false});
            gn.push_back(Launch{{&mats[l][4], &mats[l][5]}, 2, true, false, false, true});
            bytes += mats[l][4].bytes + mats[l][5].bytes;
        }
        for (auto* v : {&gu, &gn}) {
            us = time_us(st, 7, 3.0 * L, [&] {
                for (int rep = 0; rep < 3; rep++)
                    for (auto& x : *v) launch(x, st);
            });
            printf("%-12s %10.1f %9.0f\n", v == &gu ? "gate/up plain" : "gate/up glu, not quantized", us, bytes / L / (us * 1e-6) / 1e9);
        }
    }
    // The chain: all layers then the head, captured in a graph.
    u64 tot = total + head.bytes;
    us = graph_us(st, 9, [&] {
        for (int l = 0; l < L; l++)
            for (auto& x : launches[l]) launch(x, st);
        launch(la, st);
    });
    printf("chain: 8 layers + head, %.0f MB: %.1f us, %.0f GB/s\n", tot / 1e6, us, tot / (us * 1e-6) / 1e9);
    }
    return 0;
}
