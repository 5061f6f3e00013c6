// Matrix-vector micro-benchmark kernels (12B shapes): kiln's Q4_K / Q6_K chunk numerics (copied from
// crates/cuda/kernels/quant.cu) under other loop structures: persistent warps over groups of R rows
// with D turns of weights in flight (x from global or shared memory), the same loads without the
// arithmetic, and weights streamed into shared memory by 1D bulk copies (TMA).
typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ void pdl_wait() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ float half_u16(u32 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)h));
    return f;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
struct Mat {
    const u8* w;
    u64 rb;
    u64 nblk;
};
__device__ __forceinline__ u64 xq_bytes_(int k) { return (u64)k * 5 / 2; }
struct XGroup {
    uint4 hi, lo;
    float d;
    int s;
};
__device__ __forceinline__ XGroup xgroup(const u8* xq, int k, int off) {
    XGroup g;
    g.hi = *(const uint4*)(xq + off);
    g.lo = *(const uint4*)(xq + k + off);
    float2 m = ((const float2*)(xq + 2 * (u64)k))[off >> 4];
    g.d = m.x;
    g.s = __float_as_int(m.y);
    return g;
}
__device__ __forceinline__ int dotq16(const u32* w, const XGroup& x) {
    int h = __dp4a((int)w[0], (int)x.hi.x, 0), l = __dp4a((int)w[0], (int)x.lo.x, 0);
    h = __dp4a((int)w[1], (int)x.hi.y, h);
    l = __dp4a((int)w[1], (int)x.lo.y, l);
    h = __dp4a((int)w[2], (int)x.hi.z, h);
    l = __dp4a((int)w[2], (int)x.lo.z, l);
    h = __dp4a((int)w[3], (int)x.hi.w, h);
    l = __dp4a((int)w[3], (int)x.lo.w, l);
    return 254 * h + l;
}

struct Q4K {
    static const int BYTES = 144;
    struct Raw {
        uint4 hdr, q;
    };
    static __device__ __forceinline__ int xoff(int c, int g) { return 256 * (c >> 3) + 64 * ((c & 7) >> 1) + 16 * (c & 1) + 32 * g; }
    static __device__ __forceinline__ Raw load(const Mat& m, u64 row, int c) {
        const u8* b = m.w + row * m.rb + 144 * (c >> 3);
        int j = (c & 7) >> 1;
        return Raw{*(const uint4*)b, *(const uint4*)(b + 16 + 32 * j + 16 * (c & 1))};
    }
    static __device__ __forceinline__ float dot(const Raw& r, int c, const XGroup* x) {
        int j = (c & 7) >> 1;
        float d = half_u16(r.hdr.x & 0xffff), dmin = half_u16(r.hdr.x >> 16);
        u32 q[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
        int sh = 16 * (j & 1);
        u32 y = (r.hdr.y >> sh) & 0xffffu, z = (r.hdr.z >> sh) & 0xffffu, w4 = (r.hdr.w >> sh) & 0xffffu;
        u32 sc2 = j < 2 ? y & 0x3f3fu : (w4 & 0x0f0fu) | ((y >> 2) & 0x3030u);
        u32 mn2 = j < 2 ? z & 0x3f3fu : ((w4 >> 4) & 0x0f0fu) | ((z >> 2) & 0x3030u);
        float s = 0.f;
#pragma unroll
        for (int g = 0; g < 2; g++) {
            int sc = (int)((sc2 >> (8 * g)) & 0xff), mn = (int)((mn2 >> (8 * g)) & 0xff);
            u32 w[4];
#pragma unroll
            for (int t = 0; t < 4; t++) w[t] = g ? (q[t] >> 4) & 0x0f0f0f0fu : q[t] & 0x0f0f0f0fu;
            s += x[g].d * (d * (float)(sc * dotq16(w, x[g])) - dmin * (float)(mn * x[g].s));
        }
        return s;
    }
};

// Same loads as Q4K, almost no arithmetic (is the loop bound by its arithmetic or by its loads?).
struct Q4KNop : Q4K {
    static __device__ __forceinline__ float dot(const Raw& r, int c, const XGroup* x) {
        return __int_as_float((r.q.x ^ r.q.y ^ r.q.z ^ r.q.w ^ r.hdr.x ^ r.hdr.y) & 0x3fffffff) * x[0].d + x[1].d;
    }
};
// Planar Q6_K (ql plane, qh plane, scales plane, d plane). Raw keeps the loaded scale words and d
// undecoded (decoding at load time would wait for the load there).
struct Q6K {
    static const int BYTES = 210;
    struct Raw {
        uint4 l, h;
        uint2 sc;
        u32 d;
    };
    static __device__ __forceinline__ int xoff(int c, int g) {
        int q = c & 7;
        return 256 * (c >> 3) + 128 * (q >> 2) + 32 * ((q >> 1) & 1) + 16 * (q & 1) + 64 * g;
    }
    static __device__ __forceinline__ Raw load(const Mat& m, u64 row, int c) {
        int q = c & 7, n = q >> 2, a = (q >> 1) & 1, t = q & 1;
        u64 g = row * (m.rb / 210) + (c >> 3);
        return Raw{*(const uint4*)(m.w + 128 * g + 64 * n + 32 * a + 16 * t), *(const uint4*)(m.w + 128 * m.nblk + 64 * g + 32 * n + 16 * t),
                   *(const uint2*)(m.w + 192 * m.nblk + 16 * g + 8 * n), *(const u16*)(m.w + 208 * m.nblk + 2 * g)};
    }
    static __device__ __forceinline__ float dot(const Raw& r, int c, const XGroup* x) {
        int q = c & 7, a = (q >> 1) & 1, t = q & 1;
        int sh = 8 * (2 * a + t);
        float d = half_u16(r.d);
        float s0 = d * (float)(i8)(r.sc.x >> sh), s1 = d * (float)(i8)(r.sc.y >> sh);
        u32 h[4] = {r.h.x, r.h.y, r.h.z, r.h.w}, l[4] = {r.l.x, r.l.y, r.l.z, r.l.w};
        int s[2];
#pragma unroll
        for (int g = 0; g < 2; g++) {
            u32 w[4];
#pragma unroll
            for (int tt = 0; tt < 4; tt++) w[tt] = ((l[tt] >> (4 * g)) & 0x0f0f0f0fu) | (((h[tt] >> (2 * a + 4 * g)) & 0x03030303u) << 4);
            s[g] = dotq16(w, x[g]) - 32 * x[g].s;
        }
        return s0 * x[0].d * (float)s[0] + s1 * x[1].d * (float)s[1];
    }
};

// Reference: one warp per row, x from global memory.
template <class C>
__device__ void mv_ref(const u8* w, u64 rb, u64 nblk, int n, const u8* xq, int k, float* out) {
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= n) return;
    Mat m{w, rb, nblk};
    float acc = 0.f;
    for (int c = lane; c < (k >> 5); c += 32) {
        XGroup xg[2] = {xgroup(xq, k, C::xoff(c, 0)), xgroup(xq, k, C::xoff(c, 1))};
        acc += C::dot(C::load(m, row, c), c, xg);
    }
    acc = warp_sum(acc);
    if (lane == 0) out[row] = acc;
}

// Persistent warps over groups of R rows, each group's chunks walked in turns of 32 (one chunk per
// lane); the weights of D - 1 turns ahead are in flight while a turn computes (the pipeline runs
// across groups). x staged in shared memory per chunk: hi g0, hi g1, lo g0, lo g1, {d0, s0, d1, s1}.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
// The warp's share of the 128-byte lines of two regions, into L2.
__device__ __forceinline__ void prefetch_regions(const u8* p0, u64 b0, const u8* p1, u64 b1, int gw, int nw, int lane) {
    for (u64 i = (u64)gw * 32 + lane; i < (b0 >> 7); i += (u64)nw * 32) prefetch_l2(p0 + 128 * i);
    for (u64 i = (u64)gw * 32 + lane; i < (b1 >> 7); i += (u64)nw * 32) prefetch_l2(p1 + 128 * i);
}
template <class C, int R, int D, bool SX>
__device__ void mv_pipe(const u8* w, u64 rb, u64 nblk, int n, const u8* xq, int k, float* out, const u8* p0, u64 b0, const u8* p1, u64 b1, int pfm) {
    extern __shared__ uint4 sx[];
    const int chunks = k >> 5, turns = (chunks + 31) >> 5;
    const int lane = threadIdx.x & 31;
    const int nw = gridDim.x * (blockDim.x >> 5);
    const int gw = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int groups = (n + R - 1) / R;
    Mat m{w, rb, nblk};
    typename C::Raw buf[D][R];
    int ig = gw, it = 0;
    auto issue = [&](typename C::Raw(&b)[R]) {
        if (ig < groups) {
            int c = it * 32 + lane;
#pragma unroll
            for (int rr = 0; rr < R; rr++)
                if (ig * R + rr < n && c < chunks) b[rr] = C::load(m, (u64)(ig * R + rr), c);
            if (++it == turns) {
                it = 0;
                ig += nw;
            }
        }
    };
#pragma unroll
    for (int d = 0; d < D - 1; d++) issue(buf[d]);
    if (pfm == 2) prefetch_regions(p0, b0, p1, b1, gw, nw, lane);
    pdl_wait();
    if (SX) {
        for (int i = threadIdx.x; i < chunks * 5; i += blockDim.x) {
            int c = i / 5, p = i - 5 * c;
            uint4 v;
            if (p < 4) {
                v = *(const uint4*)(xq + (p >> 1) * k + C::xoff(c, p & 1));
            } else {
                float2 a = ((const float2*)(xq + 2 * (u64)k))[C::xoff(c, 0) >> 4], b = ((const float2*)(xq + 2 * (u64)k))[C::xoff(c, 1) >> 4];
                v = make_uint4(__float_as_uint(a.x), __float_as_uint(a.y), __float_as_uint(b.x), __float_as_uint(b.y));
            }
            sx[i] = v;
        }
        __syncthreads();
    }
    float acc[R];
#pragma unroll
    for (int rr = 0; rr < R; rr++) acc[rr] = 0.f;
    int cg = gw, ct = 0;
    while (cg < groups) {
#pragma unroll
        for (int d = 0; d < D; d++) {
            if (cg < groups) {
                issue(buf[(d + D - 1) % D]);
                int c = ct * 32 + lane;
                if (c < chunks) {
                    XGroup xg[2];
                    if (SX) {
                        const uint4* rec = sx + 5 * c;
                        uint4 ds = rec[4];
                        xg[0] = XGroup{rec[0], rec[2], __uint_as_float(ds.x), (int)ds.y};
                        xg[1] = XGroup{rec[1], rec[3], __uint_as_float(ds.z), (int)ds.w};
                    } else {
                        xg[0] = xgroup(xq, k, C::xoff(c, 0));
                        xg[1] = xgroup(xq, k, C::xoff(c, 1));
                    }
#pragma unroll
                    for (int rr = 0; rr < R; rr++)
                        if (cg * R + rr < n) acc[rr] += C::dot(buf[d][rr], c, xg);
                }
                if (++ct == turns) {
#pragma unroll
                    for (int rr = 0; rr < R; rr++) {
                        float s = warp_sum(acc[rr]);
                        if (lane == 0 && cg * R + rr < n) out[cg * R + rr] = s;
                        acc[rr] = 0.f;
                    }
                    ct = 0;
                    cg += nw;
                }
            }
        }
    }
    if (pfm == 1) prefetch_regions(p0, b0, p1, b1, gw, nw, lane);
}

#define MVARGS const u8 *w, u64 rb, u64 nblk, int n, const u8 *xq, int k, float *out, const u8 *p0, u64 b0, const u8 *p1, u64 b1, int pfm
#define MVPASS w, rb, nblk, n, xq, k, out, p0, b0, p1, b1, pfm
extern "C" __global__ void ref_q4k(const u8 *w, u64 rb, u64 nblk, int n, const u8 *xq, int k, float *out) { mv_ref<Q4K>(w, rb, nblk, n, xq, k, out); }
extern "C" __global__ void ref_q6k(const u8 *w, u64 rb, u64 nblk, int n, const u8 *xq, int k, float *out) { mv_ref<Q6K>(w, rb, nblk, n, xq, k, out); }
#define PIPE(NAME, C, R, D, SX, THREADS, MINB) \
    extern "C" __global__ void __launch_bounds__(THREADS, MINB) NAME(MVARGS) { mv_pipe<C, R, D, SX>(MVPASS); }
// name: p_<fmt>_r<R>d<D><s|g>_<threads>x<minblocks>
PIPE(p_q4k_r4d1g_128x4, Q4K, 4, 1, false, 128, 4)
PIPE(p_q4k_r4d2g_128x4, Q4K, 4, 2, false, 128, 4)
PIPE(p_q4k_r2d2g_128x4, Q4K, 2, 2, false, 128, 4)
PIPE(p_q4k_r2d3g_128x4, Q4K, 2, 3, false, 128, 4)
PIPE(p_q4k_r8d1g_128x4, Q4K, 8, 1, false, 128, 4)
PIPE(n_q4k_r4d1g_128x4, Q4KNop, 4, 1, false, 128, 4)
PIPE(n_q4k_r4d2g_128x4, Q4KNop, 4, 2, false, 128, 4)
PIPE(n_q4k_r2d2g_128x4, Q4KNop, 2, 2, false, 128, 4)
PIPE(n_q4k_r8d1g_128x4, Q4KNop, 8, 1, false, 128, 4)
PIPE(n_q4k_r4d2g_128x8, Q4KNop, 4, 2, false, 128, 8)
PIPE(p_q6k_r4d1g_128x4, Q6K, 4, 1, false, 128, 4)
PIPE(p_q6k_r4d2g_128x4, Q6K, 4, 2, false, 128, 4)
PIPE(p_q6k_r2d2g_128x4, Q6K, 2, 2, false, 128, 4)
PIPE(p_q6k_r2d3g_128x4, Q6K, 2, 3, false, 128, 4)
PIPE(p_q6k_r8d1g_128x4, Q6K, 8, 1, false, 128, 4)

// Valid quantized activations (levels in [-127, 127], small positive scales).
extern "C" __global__ void fix_xq(u8* xq, int k) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < 2 * k) {
        i8 v = (i8)xq[i];
        if (v == -128) xq[i] = 0x81;
    }
    if (i < k / 16) {
        float2* m = (float2*)(xq + 2 * (u64)k) + i;
        u32 r = __float_as_uint(m->x);
        *m = make_float2(1e-3f * (1.f + (float)(r & 1023) / 1024.f), __int_as_float((int)(r >> 20) - 2048));
    }
}

// ---- bulk-copy (TMA 1D) streaming: weights go global -> shared through a ring of NS stages of SR
// rows, one thread issuing the copies (before waiting for the previous kernel), consumers reading
// shared memory. WARPS consumer warps; SPLIT = WARPS / SR warps share a row (chunk ranges).
__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u64* bar, u32 bytes) {
    asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, u32 bytes, u64* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(bytes), "r"(smem_u32(bar))
                 : "memory");
}
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
    asm volatile(
        "{\n .reg .pred p;\n WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra WAIT_%=;\n}" ::"r"(smem_u32(bar)),
        "r"(parity)
        : "memory");
}

// Per format: the planes of a row range (offset per block in the planar layout, bytes per block).
template <class C> struct Planes;
template <> struct Planes<Q4K> {
    static const int N = 1;
    static __device__ __forceinline__ u64 off(int p) { return 0; }
    static __device__ __forceinline__ u32 per(int p) { return 144; }
};
template <> struct Planes<Q6K> {
    static const int N = 4;
    static __device__ __forceinline__ u64 off(int p) { return p == 0 ? 0 : p == 1 ? 128 : p == 2 ? 192 : 208; }
    static __device__ __forceinline__ u32 per(int p) { return p == 0 ? 128 : p == 1 ? 64 : p == 2 ? 16 : 2; }
};

template <class C, int SR, int NS, int WARPS>
__device__ void mv_tma(const u8* w, u64 rb, u64 nblk, int n, const u8* xq, int k, float* out) {
    extern __shared__ __align__(128) u8 smem[];
    __shared__ __align__(8) u64 full[NS];
    __shared__ float red[2][WARPS];
    constexpr int SPLIT = WARPS / SR;
    const int bpr = (int)(rb / C::BYTES);
    const u32 stage_bytes = (u32)(SR * rb);
    u8* xs = smem + NS * stage_bytes;
    const int chunks = k >> 5, cpp = chunks / SPLIT;
    const int lane = threadIdx.x & 31, wi = threadIdx.x >> 5;
    const int ts = (n + SR - 1) / SR;
    const int s0 = (int)((long long)blockIdx.x * ts / gridDim.x), s1 = (int)((long long)(blockIdx.x + 1) * ts / gridDim.x);
    const int mine = s1 - s0;
    auto issue = [&](int i) {
        int s = s0 + i, slot = i % NS;
        int r0 = s * SR, rows = min(SR, n - r0);
        u32 total = 0;
        u8* dst = smem + slot * stage_bytes;
#pragma unroll
        for (int p = 0; p < Planes<C>::N; p++) total += (Planes<C>::per(p) * rows * bpr + 15) & ~15u;
        mbar_expect_tx(&full[slot], total);
#pragma unroll
        for (int p = 0; p < Planes<C>::N; p++) {
            u32 b = (Planes<C>::per(p) * rows * bpr + 15) & ~15u;
            bulk_g2s(dst, w + Planes<C>::off(p) * nblk + (u64)Planes<C>::per(p) * r0 * bpr, b, &full[slot]);
            dst += Planes<C>::per(p) * SR * bpr;
        }
    };
    if (threadIdx.x == 0) {
        for (int i = 0; i < NS; i++) mbar_init(&full[i], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (int i = 0; i < NS && i < mine; i++) issue(i);
    }
    pdl_wait();
    for (int i = threadIdx.x; i < (int)(xq_bytes_(k) >> 4); i += blockDim.x) ((uint4*)xs)[i] = ((const uint4*)xq)[i];
    __syncthreads();
    const int j = wi / SPLIT, part = wi % SPLIT;
    for (int i = 0; i < mine; i++) {
        int slot = i % NS;
        mbar_wait(&full[slot], (i / NS) & 1);
        Mat st{smem + slot * stage_bytes, rb, (u64)SR * bpr};
        int row = (s0 + i) * SR + j;
        float acc = 0.f;
        if (row < n) {
            for (int c = part * cpp + lane; c < (part + 1) * cpp; c += 32) {
                XGroup xg[2] = {xgroup(xs, k, C::xoff(c, 0)), xgroup(xs, k, C::xoff(c, 1))};
                acc += C::dot(C::load(st, (u64)j, c), c, xg);
            }
        }
        acc = warp_sum(acc);
        if (lane == 0) red[i & 1][wi] = acc;
        __syncthreads();
        if (threadIdx.x == 0 && i + NS < mine) {
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            issue(i + NS);
        }
        if (wi == 0 && lane < SR && (s0 + i) * SR + lane < n) {
            float s = 0.f;
#pragma unroll
            for (int p = 0; p < SPLIT; p++) s += red[i & 1][lane * SPLIT + p];
            out[(s0 + i) * SR + lane] = s;
        }
    }
}
#define TMA(NAME, C, SR, NS, WARPS) \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, 1) NAME(MVARGS) { mv_tma<C, SR, NS, WARPS>(w, rb, nblk, n, xq, k, out); }
TMA(t_q4k_8x4_w8, Q4K, 8, 4, 8)
TMA(t_q4k_8x6_w8, Q4K, 8, 6, 8)
TMA(t_q4k_16x4_w16, Q4K, 16, 4, 16)
TMA(t_q6k_8x4_w8, Q6K, 8, 4, 8)
TMA(t_q6k_2x4_w8, Q6K, 2, 4, 8)
TMA(t_q6k_2x6_w8, Q6K, 2, 6, 8)
TMA(t_q6k_4x4_w16, Q6K, 4, 4, 16)
TMA(t_q4k_2x4_w8, Q4K, 2, 4, 8)
TMA(t_q4k_2x6_w8, Q4K, 2, 6, 8)
