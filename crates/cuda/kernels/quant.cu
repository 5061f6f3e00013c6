// Quantized weights: one decoder per block format for a 32-element sub-block and, for the formats
// that carry most bytes, a chunk decoder for the matrix-vector kernels; the kernels built on them
// (matrix-vector products for decode, row gather for embeddings, dequantization to f32 for the
// cuBLAS prefill path). Format ids are ggml's type ids.

#define F_F32 0
#define F_F16 1
#define F_Q4_0 2
#define F_Q4_1 3
#define F_Q5_0 6
#define F_Q5_1 7
#define F_Q8_0 8
#define F_Q2_K 10
#define F_Q3_K 11
#define F_Q4_K 12
#define F_Q5_K 13
#define F_Q6_K 14
#define F_BF16 30

// Bytes of one 32-element sub-block (legacy and float formats) or of one 256-element super-block.
template <int T> struct Fmt;
template <> struct Fmt<F_F32> { static const int bytes = 128, per = 32; };
template <> struct Fmt<F_F16> { static const int bytes = 64, per = 32; };
template <> struct Fmt<F_BF16> { static const int bytes = 64, per = 32; };
template <> struct Fmt<F_Q4_0> { static const int bytes = 18, per = 32; };
template <> struct Fmt<F_Q4_1> { static const int bytes = 20, per = 32; };
template <> struct Fmt<F_Q5_0> { static const int bytes = 22, per = 32; };
template <> struct Fmt<F_Q5_1> { static const int bytes = 24, per = 32; };
template <> struct Fmt<F_Q8_0> { static const int bytes = 34, per = 32; };
template <> struct Fmt<F_Q2_K> { static const int bytes = 84, per = 256; };
template <> struct Fmt<F_Q3_K> { static const int bytes = 110, per = 256; };
template <> struct Fmt<F_Q4_K> { static const int bytes = 144, per = 256; };
template <> struct Fmt<F_Q5_K> { static const int bytes = 176, per = 256; };
template <> struct Fmt<F_Q6_K> { static const int bytes = 210, per = 256; };

// A packed matrix on the device: `rb` bytes per row, `nblk` blocks in all. The formats whose blocks
// are not 4-byte aligned or whose fields are not 16-byte aligned (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
// Q3_K, Q6_K) are uploaded planar (weights.rs): each field of every
// block stored contiguously in block order (same bytes), so every field is aligned for vector
// loads; the other formats keep ggml's layout.
struct Mat {
    const u8* w;
    u64 rb;
    u64 nblk;
};

// Index of block `b` of row `r` (in the whole matrix).
template <int T> __device__ __forceinline__ u64 block_of(const Mat& m, u64 r, int b) {
    return r * (m.rb / Fmt<T>::bytes) + b;
}

__device__ __forceinline__ float half_u16(u32 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)h));
    return f;
}

__device__ __forceinline__ void scale_min_k4(const u8* s, int i, int* sc, int* mn) {
    if (i < 4) {
        *sc = s[i] & 63;
        *mn = s[i + 4] & 63;
    } else {
        *sc = (s[i + 4] & 0x0f) | ((s[i - 4] >> 6) << 4);
        *mn = (s[i + 4] >> 4) | ((s[i] >> 6) << 4);
    }
}

// Decodes sub-block `s` (elements 32s..32s+32) of a row in ggml's layout into v.
template <int T> __device__ __forceinline__ void aos32(const u8* row, int s, float* v);

template <> __device__ __forceinline__ void aos32<F_F32>(const u8* row, int s, float* v) {
    const float4* p = (const float4*)(row + 128 * s);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        float4 q = p[i];
        v[4 * i] = q.x; v[4 * i + 1] = q.y; v[4 * i + 2] = q.z; v[4 * i + 3] = q.w;
    }
}
template <> __device__ __forceinline__ void aos32<F_F16>(const u8* row, int s, float* v) {
    const u8* b = row + 64 * s;
#pragma unroll
    for (int i = 0; i < 32; i++) v[i] = half_at(b + 2 * i);
}
template <> __device__ __forceinline__ void aos32<F_BF16>(const u8* row, int s, float* v) {
    const u8* b = row + 64 * s;
#pragma unroll
    for (int i = 0; i < 32; i++) v[i] = __int_as_float(((u32)b[2 * i] | ((u32)b[2 * i + 1] << 8)) << 16);
}
template <> __device__ __forceinline__ void aos32<F_Q2_K>(const u8* row, int s, float* v) {
    const u8* b = row + 84 * (s >> 3);
    int sub = s & 7, n = sub >> 2, j = sub & 3;
    float d = half_at(b + 80), dmin = half_at(b + 82);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        u8 sc = b[8 * n + 2 * j + h];
        float dl = d * (float)(sc & 15), ml = dmin * (float)(sc >> 4);
        const u8* q = b + 16 + 32 * n + 16 * h;
#pragma unroll
        for (int l = 0; l < 16; l++) v[16 * h + l] = dl * (float)((q[l] >> (2 * j)) & 3) - ml;
    }
}
template <> __device__ __forceinline__ void aos32<F_Q4_K>(const u8* row, int s, float* v) {
    const u8* b = row + 144 * (s >> 3);
    int sub = s & 7, j = sub >> 1, hi = sub & 1;
    int sc, mn;
    scale_min_k4(b + 4, sub, &sc, &mn);
    float d1 = half_at(b) * (float)sc, m1 = half_at(b + 2) * (float)mn;
    const uint4* q4 = (const uint4*)(b + 16 + 32 * j);
#pragma unroll
    for (int c = 0; c < 2; c++) {
        uint4 w = q4[c];
        u32 ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int t = 0; t < 16; t++) {
            u32 byte = (ws[t >> 2] >> (8 * (t & 3))) & 0xff;
            u32 lv = hi ? (byte >> 4) : (byte & 15);
            v[16 * c + t] = d1 * (float)lv - m1;
        }
    }
}
template <> __device__ __forceinline__ void aos32<F_Q5_K>(const u8* row, int s, float* v) {
    const u8* b = row + 176 * (s >> 3);
    int sub = s & 7, j = sub >> 1, hi = sub & 1;
    int sc, mn;
    scale_min_k4(b + 4, sub, &sc, &mn);
    float d1 = half_at(b) * (float)sc, m1 = half_at(b + 2) * (float)mn;
    const u8* qh = b + 16;
    const u8* q = b + 48 + 32 * j;
#pragma unroll
    for (int l = 0; l < 32; l++) {
        int lv = (hi ? (q[l] >> 4) : (q[l] & 15)) | (((qh[l] >> sub) & 1) << 4);
        v[l] = d1 * (float)lv - m1;
    }
}
// Decodes sub-block `s` of row `r` of a matrix into v.
template <int T> __device__ __forceinline__ void sub32(const Mat& m, u64 r, int s, float* v) {
    aos32<T>(m.w + r * m.rb, s, v);
}
// Planar Q8_0: qs [32 per block], d [2 per block].
template <> __device__ __forceinline__ void sub32<F_Q8_0>(const Mat& m, u64 r, int s, float* v) {
    u64 g = block_of<F_Q8_0>(m, r, s);
    float d = half_u16(*(const u16*)(m.w + 32 * m.nblk + 2 * g));
    const uint4* q = (const uint4*)(m.w + 32 * g);
#pragma unroll
    for (int c = 0; c < 2; c++) {
        uint4 w = q[c];
        u32 ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int t = 0; t < 16; t++) v[16 * c + t] = (float)(i8)((ws[t >> 2] >> (8 * (t & 3))) & 0xff) * d;
    }
}
// A planar 32-element block's values: byte j of `w` holds levels j (low nibble) and j + 16 (high),
// with HIGH their fifth bits j and j + 16 of `qh`; each value d * (level - OFF), or with MIN
// d * level + m.
template <int OFF, bool HIGH, bool MIN>
__device__ __forceinline__ void legacy32(const uint4& w, u32 qh, float d, float m, float* v) {
    u32 ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int j = 0; j < 16; j++) {
        u32 q = (ws[j >> 2] >> (8 * (j & 3))) & 0xff;
        int l0 = q & 15, l1 = q >> 4;
        if (HIGH) {
            l0 |= ((qh >> j) & 1) << 4;
            l1 |= ((qh >> (j + 16)) & 1) << 4;
        }
        v[j] = MIN ? (float)l0 * d + m : (float)(l0 - OFF) * d;
        v[j + 16] = MIN ? (float)l1 * d + m : (float)(l1 - OFF) * d;
    }
}
// Planar Q4_0: qs [16 per block], d [2].
template <> __device__ __forceinline__ void sub32<F_Q4_0>(const Mat& m, u64 r, int s, float* v) {
    u64 g = block_of<F_Q4_0>(m, r, s);
    legacy32<8, false, false>(*(const uint4*)(m.w + 16 * g), 0, half_u16(*(const u16*)(m.w + 16 * m.nblk + 2 * g)), 0.f, v);
}
// Planar Q4_1: qs [16 per block], {d, m} [4].
template <> __device__ __forceinline__ void sub32<F_Q4_1>(const Mat& m, u64 r, int s, float* v) {
    u64 g = block_of<F_Q4_1>(m, r, s);
    u32 dm = *(const u32*)(m.w + 16 * m.nblk + 4 * g);
    legacy32<0, false, true>(*(const uint4*)(m.w + 16 * g), 0, half_u16(dm & 0xffff), half_u16(dm >> 16), v);
}
// Planar Q5_1: qs [16 per block], qh [4], {d, m} [4].
template <> __device__ __forceinline__ void sub32<F_Q5_1>(const Mat& m, u64 r, int s, float* v) {
    u64 g = block_of<F_Q5_1>(m, r, s);
    u32 dm = *(const u32*)(m.w + 20 * m.nblk + 4 * g);
    legacy32<0, true, true>(*(const uint4*)(m.w + 16 * g), *(const u32*)(m.w + 16 * m.nblk + 4 * g), half_u16(dm & 0xffff),
                            half_u16(dm >> 16), v);
}
// Planar Q5_0: qs [16 per block], qh [4], d [2].
template <> __device__ __forceinline__ void sub32<F_Q5_0>(const Mat& m, u64 r, int s, float* v) {
    u64 g = block_of<F_Q5_0>(m, r, s);
    legacy32<16, true, false>(*(const uint4*)(m.w + 16 * g), *(const u32*)(m.w + 16 * m.nblk + 4 * g),
                              half_u16(*(const u16*)(m.w + 20 * m.nblk + 2 * g)), 0.f, v);
}
// Planar Q6_K: ql [128 per block], qh [64], scales [16], d [2].
template <> __device__ __forceinline__ void sub32<F_Q6_K>(const Mat& m, u64 r, int s, float* v) {
    u64 g = block_of<F_Q6_K>(m, r, s >> 3);
    int sub = s & 7, n = sub >> 2, gg = sub & 3;
    float d = half_u16(*(const u16*)(m.w + 208 * m.nblk + 2 * g));
    const u8* ql = m.w + 128 * g + 64 * n + 32 * (gg & 1);
    const u8* qh = m.w + 128 * m.nblk + 64 * g + 32 * n;
    const i8* sc = (const i8*)(m.w + 192 * m.nblk + 16 * g + 8 * n);
    int nib = 4 * (gg >> 1), hs = 2 * gg;
#pragma unroll
    for (int l = 0; l < 32; l++) {
        int q = ((ql[l] >> nib) & 15) | (((qh[l] >> hs) & 3) << 4);
        v[l] = d * (float)sc[(l >> 4) + 2 * gg] * (float)(q - 32);
    }
}

// Four Q3_K levels 0..7 as bytes: low bits (q >> 2j) & 3 of each byte, high bit (h >> hb) & 1 times 4.
__device__ __forceinline__ u32 q3k_levels(u32 q, u32 h, int j, int hb) {
    return ((q >> (2 * j)) & 0x03030303u) | (((h >> hb) & 0x01010101u) << 2);
}
__device__ __forceinline__ int q3k_scale(const u8* sc, int i) {
    const int low = i < 8 ? (sc[i] & 15) : (sc[i - 8] >> 4), high = (sc[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
    return (low | (high << 4)) - 32;
}
// Planar Q3_K: hmask [32 per block], qs [64], scales [12], d [2]. Element 128n + 32j + l (l < 32)
// of a block: low bits (qs[32n + l] >> 2j) & 3, high bit hmask[l] >> (4n + j) (set: no -4); the
// 6-bit scale of 16-element half i = 8n + 2j + h: q3k_scale.
template <> __device__ __forceinline__ void sub32<F_Q3_K>(const Mat& m, u64 r, int s, float* v) {
    u64 g = block_of<F_Q3_K>(m, r, s >> 3);
    int sub = s & 7, n = sub >> 2, j = sub & 3;
    float d = half_u16(*(const u16*)(m.w + 108 * m.nblk + 2 * g));
    const u8* hm = m.w + 32 * g;
    const u8* q = m.w + 32 * m.nblk + 64 * g + 32 * n;
    const u8* sc = m.w + 96 * m.nblk + 12 * g;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const float dl = d * (float)q3k_scale(sc, 8 * n + 2 * j + h);
#pragma unroll
        for (int l = 0; l < 16; l++) {
            v[16 * h + l] = dl * (float)((int)q3k_levels(q[16 * h + l], hm[16 * h + l], j, 4 * n + j) - 4);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Chunks for the matrix-vector kernels: a row is walked in chunks of 16 G elements (G = 2, 32
// elements, except RingChunk<F_Q4_K>), G groups of 16 consecutive elements at offsets xoff(c, 0),
// ..., xoff(c, G - 1). `load` fetches a chunk's packed
// bytes (16-byte loads where the format has a chunk decoder) and computes nothing from them: the
// matrix-vector loop issues the loads of all its rows at once, and arithmetic on a row's bytes in
// `load` made the warp wait for them before the next row's loads (measured on an H200 at 12B
// shapes: the Q6_K head 359 -> 326 us, down 20.0 -> 19.1 us without it; bench/RESULTS.md "issue
// 4h"). `dot` (given the chunk index c) turns the bytes into integer levels and returns the dot
// product with the chunk's quantized activations (integer dp4a products, one float scale per
// group). `decode` does the first half alone (a `Dec`: levels and scales) and `dot` of a `Dec` the
// second, so that a chunk multiplied by several activation rows is decoded once. Q5_0, Q4_K and
// Q6_K keep the one-row `dot` as it was tuned, each group's levels decoded next to its products
// (composed from `decode`, the one-row kernels compiled to other code); their per-group helpers
// serve both. The generic chunk is a sub-block decoded by sub32.
// Formats with NP > 0 can also be staged through shared memory: `stage` issues asynchronous copies
// of a chunk's bytes (NP 16-byte pieces; the lane's piece p at dst[32 p]) and `unstage` reads them
// back as the Raw that `load` would have returned (the matrix-vector loop keeps several chunks in
// flight without holding them in registers). Only Q5_0 is staged: measured on an H200, staging
// made the 270M shapes' Q5_0 gate/up launch faster (+3-4% decode); at 12B shapes it slowed Q4_K
// (gate/up 30 -> 47 us) and Q6_K (the head 369 -> 527 us).
// ---------------------------------------------------------------------------------------------

// 16 quantized activations and their block's scale and level sum (see quantize32).
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

// c + Σ a_i * b_i over 4 bytes, a's unsigned and b's signed.
__device__ __forceinline__ int dp4a_us(u32 a, u32 b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// Σ w_i * (254 hi_i + lo_i) over a group's 16 elements; w holds 4 signed byte levels per word.
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

template <int T> struct Chunk {
    static const int NP = 0;
    static const int G = 2;
    struct Raw {
        u64 row;
        int c;
    };
    static __device__ __forceinline__ int xoff(int c, int g) { return 32 * c + 16 * g; }
    static __device__ __forceinline__ Raw load(const Mat& m, u64 row, int c) { return Raw{row, c}; }
    struct Dec {
        float v[32];
    };
    static __device__ __forceinline__ Dec decode(const Mat& m, const Raw& r, int) {
        Dec e;
        sub32<T>(m, r.row, r.c, e.v);
        return e;
    }
    static __device__ __forceinline__ float dot(const Mat& m, const Raw& r, int c, const XGroup* x) { return dot(decode(m, r, c), x); }
    static __device__ __forceinline__ float dot(const Dec& e, const XGroup* x) {
        const float* v = e.v;
        float s = 0.f;
#pragma unroll
        for (int g = 0; g < 2; g++) {
            u32 hi[4] = {x[g].hi.x, x[g].hi.y, x[g].hi.z, x[g].hi.w}, lo[4] = {x[g].lo.x, x[g].lo.y, x[g].lo.z, x[g].lo.w};
#pragma unroll
            for (int i = 0; i < 16; i++) {
                int sh = 8 * (i & 3);
                int q = 254 * (int)(i8)((hi[i >> 2] >> sh) & 0xff) + (int)(i8)((lo[i >> 2] >> sh) & 0xff);
                s = fmaf(v[16 * g + i], x[g].d * (float)q, s);
            }
        }
        return s;
    }
};

template <> struct Chunk<F_Q8_0> {
    static const int NP = 0;
    static const int G = 2;
    struct Raw {
        uint4 a, b;
        u32 d;
    };
    static __device__ __forceinline__ int xoff(int c, int g) { return 32 * c + 16 * g; }
    static __device__ __forceinline__ Raw load(const Mat& m, u64 row, int c) {
        u64 g = block_of<F_Q8_0>(m, row, c);
        const uint4* q = (const uint4*)(m.w + 32 * g);
        return Raw{q[0], q[1], *(const u16*)(m.w + 32 * m.nblk + 2 * g)};
    }
    struct Dec {
        u32 a[4], b[4];
        float d;
    };
    static __device__ __forceinline__ Dec decode(const Mat&, const Raw& r, int) {
        return Dec{{r.a.x, r.a.y, r.a.z, r.a.w}, {r.b.x, r.b.y, r.b.z, r.b.w}, half_u16(r.d)};
    }
    static __device__ __forceinline__ float dot(const Mat& m, const Raw& r, int c, const XGroup* x) { return dot(decode(m, r, c), x); }
    static __device__ __forceinline__ float dot(const Dec& e, const XGroup* x) {
        return e.d * x[0].d * (float)(dotq16(e.a, x[0]) + dotq16(e.b, x[1]));
    }
};

// Planar Q4_0 (weights.rs): Q5_0's chunk without the high bits, levels offset by 8.
template <> struct Chunk<F_Q4_0> {
    static const int NP = 0;
    static const int G = 2;
    struct Raw {
        uint4 q;
        u32 d;
    };
    static __device__ __forceinline__ int xoff(int c, int g) { return 32 * c + 16 * g; }
    static __device__ __forceinline__ Raw load(const Mat& m, u64 row, int c) {
        u64 g = block_of<F_Q4_0>(m, row, c);
        return Raw{*(const uint4*)(m.w + 16 * g), *(const u16*)(m.w + 16 * m.nblk + 2 * g)};
    }
    // Group g's 16 levels (q: the chunk's level words).
    static __device__ __forceinline__ void levels(const u32* q, int g, u32* w) {
#pragma unroll
        for (int t = 0; t < 4; t++) w[t] = g ? (q[t] >> 4) & 0x0f0f0f0fu : q[t] & 0x0f0f0f0fu;
    }
    struct Dec {
        u32 w[2][4];
        float d;
    };
    static __device__ __forceinline__ Dec decode(const Mat&, const Raw& r, int) {
        u32 q[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
        Dec e;
        levels(q, 0, e.w[0]);
        levels(q, 1, e.w[1]);
        e.d = half_u16(r.d);
        return e;
    }
    // (The raw chunk's product without the decoded struct: through it, matvecr4_q4_0 took 106
    // registers instead of 104.)
    static __device__ __forceinline__ float dot(const Mat&, const Raw& r, int, const XGroup* x) {
        u32 q[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
        int s = 0;
#pragma unroll
        for (int g = 0; g < 2; g++) {
            u32 w[4];
            levels(q, g, w);
            s += dotq16(w, x[g]) - 8 * x[g].s;
        }
        return half_u16(r.d) * x[0].d * (float)s;
    }
    static __device__ __forceinline__ float dot(const Dec& e, const XGroup* x) {
        return e.d * x[0].d * (float)(dotq16(e.w[0], x[0]) - 8 * x[0].s + dotq16(e.w[1], x[1]) - 8 * x[1].s);
    }
};

// Planar Q4_1 (weights.rs): Q4_0's levels, w = d * level + m.
template <> struct Chunk<F_Q4_1> {
    static const int NP = 0;
    static const int G = 2;
    struct Raw {
        uint4 q;
        u32 dm;
    };
    static __device__ __forceinline__ int xoff(int c, int g) { return 32 * c + 16 * g; }
    static __device__ __forceinline__ Raw load(const Mat& m, u64 row, int c) {
        u64 g = block_of<F_Q4_1>(m, row, c);
        return Raw{*(const uint4*)(m.w + 16 * g), *(const u32*)(m.w + 16 * m.nblk + 4 * g)};
    }
    struct Dec {
        u32 w[2][4];
        float d, m;
    };
    static __device__ __forceinline__ Dec decode(const Mat&, const Raw& r, int) {
        u32 q[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
        Dec e;
        Chunk<F_Q4_0>::levels(q, 0, e.w[0]);
        Chunk<F_Q4_0>::levels(q, 1, e.w[1]);
        e.d = half_u16(r.dm & 0xffff);
        e.m = half_u16(r.dm >> 16);
        return e;
    }
    static __device__ __forceinline__ float dot(const Mat& m, const Raw& r, int c, const XGroup* x) { return dot(decode(m, r, c), x); }
    static __device__ __forceinline__ float dot(const Dec& e, const XGroup* x) {
        return x[0].d * (e.d * (float)(dotq16(e.w[0], x[0]) + dotq16(e.w[1], x[1])) + e.m * (float)(x[0].s + x[1].s));
    }
};

// Bits 0-3 of `bits` to bit 0 of bytes 0-3.
__device__ __forceinline__ u32 spread4(u32 bits) { return ((bits & 15u) * 0x00204081u) & 0x01010101u; }

template <> struct Chunk<F_Q5_0> {
    static const int NP = 2;
    static const int G = 2;
    struct Raw {
        uint4 q;
        u32 h, d;
    };
    static __device__ __forceinline__ int xoff(int c, int g) { return 32 * c + 16 * g; }
    static __device__ __forceinline__ Raw load(const Mat& m, u64 row, int c) {
        u64 g = block_of<F_Q5_0>(m, row, c);
        return Raw{*(const uint4*)(m.w + 16 * g), *(const u32*)(m.w + 16 * m.nblk + 4 * g), *(const u16*)(m.w + 20 * m.nblk + 2 * g)};
    }
    static __device__ __forceinline__ void stage(const Mat& m, u64 row, int c, uint4* dst) {
        u64 g = block_of<F_Q5_0>(m, row, c);
        cp_async16(dst, m.w + 16 * g);
        cp_async4(dst + 32, m.w + 16 * m.nblk + 4 * g);
        cp_async4((u8*)(dst + 32) + 4, m.w + 20 * m.nblk + 2 * (g & ~1ull));
    }
    static __device__ __forceinline__ Raw unstage(const Mat& m, u64 row, int c, const uint4* src) {
        u64 g = block_of<F_Q5_0>(m, row, c);
        const u32* p = (const u32*)(src + 32);
        return Raw{src[0], p[0], ((const u16*)(p + 1))[g & 1]};
    }
    // Group g's 16 levels (q: the chunk's level words).
    static __device__ __forceinline__ void levels(const Raw& r, const u32* q, int g, u32* w) {
#pragma unroll
        for (int t = 0; t < 4; t++) {
            u32 nib = g ? (q[t] >> 4) & 0x0f0f0f0fu : q[t] & 0x0f0f0f0fu;
            w[t] = nib | (spread4(r.h >> (16 * g + 4 * t)) << 4);
        }
    }
    static __device__ __forceinline__ float dot(const Mat&, const Raw& r, int, const XGroup* x) {
        u32 q[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
        int s = 0;
#pragma unroll
        for (int g = 0; g < 2; g++) {
            u32 w[4];
            levels(r, q, g, w);
            s += dotq16(w, x[g]) - 16 * x[g].s;
        }
        return half_u16(r.d) * x[0].d * (float)s;
    }
    struct Dec {
        u32 w[2][4];
        float d;
    };
    static __device__ __forceinline__ Dec decode(const Mat&, const Raw& r, int) {
        u32 q[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
        Dec e;
        levels(r, q, 0, e.w[0]);
        levels(r, q, 1, e.w[1]);
        e.d = half_u16(r.d);
        return e;
    }
    static __device__ __forceinline__ float dot(const Dec& e, const XGroup* x) {
        return e.d * x[0].d * (float)(dotq16(e.w[0], x[0]) - 16 * x[0].s + dotq16(e.w[1], x[1]) - 16 * x[1].s);
    }
};

// Planar Q5_1 (weights.rs): Q5_0's levels, w = d * level + m.
template <> struct Chunk<F_Q5_1> {
    static const int NP = 0;
    static const int G = 2;
    struct Raw {
        uint4 q;
        u32 h, dm;
    };
    static __device__ __forceinline__ int xoff(int c, int g) { return 32 * c + 16 * g; }
    static __device__ __forceinline__ Raw load(const Mat& m, u64 row, int c) {
        u64 g = block_of<F_Q5_1>(m, row, c);
        return Raw{*(const uint4*)(m.w + 16 * g), *(const u32*)(m.w + 16 * m.nblk + 4 * g), *(const u32*)(m.w + 20 * m.nblk + 4 * g)};
    }
    using Dec = Chunk<F_Q4_1>::Dec;
    static __device__ __forceinline__ Dec decode(const Mat&, const Raw& r, int) {
        u32 q[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
        Dec e;
#pragma unroll
        for (int g = 0; g < 2; g++)
#pragma unroll
            for (int t = 0; t < 4; t++)
                e.w[g][t] = (g ? (q[t] >> 4) & 0x0f0f0f0fu : q[t] & 0x0f0f0f0fu) | (spread4(r.h >> (16 * g + 4 * t)) << 4);
        e.d = half_u16(r.dm & 0xffff);
        e.m = half_u16(r.dm >> 16);
        return e;
    }
    static __device__ __forceinline__ float dot(const Mat& m, const Raw& r, int c, const XGroup* x) { return dot(decode(m, r, c), x); }
    static __device__ __forceinline__ float dot(const Dec& e, const XGroup* x) { return Chunk<F_Q4_1>::dot(e, x); }
};

// The 6-bit scales and minima of a Q4_K super-block's sub-blocks 2j and 2j + 1 (hdr: the block's
// first 16 bytes), one per byte of *sc2 and *mn2 (scale_min_k4 for both at once, without
// branches): bytes 2j.. of the scale words for j < 2, else the low nibbles (scales) or high nibbles
// (minima) of bytes 8 + 2(j - 2).. with the top two bits of bytes 2(j - 2).. (scales) or
// 4 + 2(j - 2).. (minima).
__device__ __forceinline__ void q4k_pair_scales(const uint4& hdr, int j, u32* sc2, u32* mn2) {
    int sh = 16 * (j & 1);
    u32 y = (hdr.y >> sh) & 0xffffu, z = (hdr.z >> sh) & 0xffffu, w4 = (hdr.w >> sh) & 0xffffu;
    *sc2 = j < 2 ? y & 0x3f3fu : (w4 & 0x0f0fu) | ((y >> 2) & 0x3030u);
    *mn2 = j < 2 ? z & 0x3f3fu : ((w4 >> 4) & 0x0f0fu) | ((z >> 2) & 0x3030u);
}

template <> struct Chunk<F_Q4_K> {
    static const int NP = 0;
    static const int G = 2;
    struct Raw {
        uint4 hdr, q;
    };
    // chunk c: super-block c / 8, sub-block pair j = (c % 8) / 2 (low nibbles: sub-block 2j, high:
    // 2j + 1), half h = c % 2 of their 32 elements.
    static __device__ __forceinline__ int xoff(int c, int g) {
        return 256 * (c >> 3) + 64 * ((c & 7) >> 1) + 16 * (c & 1) + 32 * g;
    }
    static __device__ __forceinline__ Raw load(const Mat& m, u64 row, int c) {
        const u8* b = m.w + row * m.rb + 144 * (c >> 3);
        int j = (c & 7) >> 1;
        return Raw{*(const uint4*)b, *(const uint4*)(b + 16 + 32 * j + 16 * (c & 1))};
    }
    // The chunk's levels, its two sub-blocks' 6-bit scales and minima (a byte each) and d, dmin.
    struct Dec {
        u32 w[2][4];
        u32 sc2, mn2;
        float d, dmin;
    };
    // Group g's 16 levels (q: the chunk's level words).
    static __device__ __forceinline__ void levels(const u32* q, int g, u32* w) {
#pragma unroll
        for (int t = 0; t < 4; t++) w[t] = g ? (q[t] >> 4) & 0x0f0f0f0fu : q[t] & 0x0f0f0f0fu;
    }
    static __device__ __forceinline__ Dec decode(const Mat&, const Raw& r, int c) {
        Dec e;
        u32 q[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
        q4k_pair_scales(r.hdr, (c & 7) >> 1, &e.sc2, &e.mn2);
        levels(q, 0, e.w[0]);
        levels(q, 1, e.w[1]);
        e.d = half_u16(r.hdr.x & 0xffff);
        e.dmin = half_u16(r.hdr.x >> 16);
        return e;
    }
    // Group g's part of a chunk's product: levels w, the scales and minima of the chunk's sub-blocks.
    static __device__ __forceinline__ float group(const XGroup& x, int g, const u32* w, u32 sc2, u32 mn2, float d, float dmin) {
        int sc = (int)((sc2 >> (8 * g)) & 0xff), mn = (int)((mn2 >> (8 * g)) & 0xff);
        return x.d * (d * (float)(sc * dotq16(w, x)) - dmin * (float)(mn * x.s));
    }
    static __device__ __forceinline__ float dot(const Mat&, const Raw& r, int c, const XGroup* x) {
        float d = half_u16(r.hdr.x & 0xffff), dmin = half_u16(r.hdr.x >> 16);
        u32 q[4] = {r.q.x, r.q.y, r.q.z, r.q.w}, sc2, mn2;
        q4k_pair_scales(r.hdr, (c & 7) >> 1, &sc2, &mn2);
        float s = 0.f;
#pragma unroll
        for (int g = 0; g < 2; g++) {
            u32 w[4];
            levels(q, g, w);
            s += group(x[g], g, w, sc2, mn2, d, dmin);
        }
        return s;
    }
    static __device__ __forceinline__ float dot(const Dec& e, const XGroup* x) {
        return group(x[0], 0, e.w[0], e.sc2, e.mn2, e.d, e.dmin) + group(x[1], 1, e.w[1], e.sc2, e.mn2, e.d, e.dmin);
    }
};
// Q5_K: Q4_K's chunks with the fifth bits (bit s of high-bit byte l: element l of sub-block s).
template <> struct Chunk<F_Q5_K> {
    static const int NP = 0;
    static const int G = 2;
    struct Raw {
        uint4 hdr, q, qh;
    };
    static __device__ __forceinline__ int xoff(int c, int g) { return Chunk<F_Q4_K>::xoff(c, g); }
    static __device__ __forceinline__ Raw load(const Mat& m, u64 row, int c) {
        const u8* b = m.w + row * m.rb + 176 * (c >> 3);
        int j = (c & 7) >> 1, h = c & 1;
        return Raw{*(const uint4*)b, *(const uint4*)(b + 48 + 32 * j + 16 * h), *(const uint4*)(b + 16 + 16 * h)};
    }
    using Dec = Chunk<F_Q4_K>::Dec;
    // Group g's 16 levels (q, qh: the chunk's level and high-bit words; sub-block 2j + g).
    static __device__ __forceinline__ void levels(const u32* q, const u32* qh, int j, int g, u32* w) {
        Chunk<F_Q4_K>::levels(q, g, w);
#pragma unroll
        for (int t = 0; t < 4; t++) w[t] |= ((qh[t] >> (2 * j + g)) & 0x01010101u) << 4;
    }
    static __device__ __forceinline__ Dec decode(const Mat&, const Raw& r, int c) {
        Dec e;
        const int j = (c & 7) >> 1;
        u32 q[4] = {r.q.x, r.q.y, r.q.z, r.q.w}, qh[4] = {r.qh.x, r.qh.y, r.qh.z, r.qh.w};
        q4k_pair_scales(r.hdr, j, &e.sc2, &e.mn2);
        levels(q, qh, j, 0, e.w[0]);
        levels(q, qh, j, 1, e.w[1]);
        e.d = half_u16(r.hdr.x & 0xffff);
        e.dmin = half_u16(r.hdr.x >> 16);
        return e;
    }
    static __device__ __forceinline__ float dot(const Mat& m, const Raw& r, int c, const XGroup* x) { return dot(decode(m, r, c), x); }
    static __device__ __forceinline__ float dot(const Dec& e, const XGroup* x) { return Chunk<F_Q4_K>::dot(e, x); }
};

template <> struct Chunk<F_Q6_K> {
    static const int NP = 0;
    static const int G = 2;
    struct Raw {
        uint4 l, h;
        uint2 sc;
        u32 d;
    };
    // chunk c: super-block c / 8, half n, ql region a, 16 positions t (q = c % 8 = 4n + 2a + t):
    // low nibbles of ql[64n + 32a + 16t..] are elements 128n + 32a + 16t.. (qh bits 2a, scale
    // 8n + 2a + t), high nibbles the elements 64 later (qh bits 4 + 2a, scale + 4); see sub32<F_Q6_K>.
    static __device__ __forceinline__ int xoff(int c, int g) {
        int q = c & 7;
        return 256 * (c >> 3) + 128 * (q >> 2) + 32 * ((q >> 1) & 1) + 16 * (q & 1) + 64 * g;
    }
    static __device__ __forceinline__ Raw load(const Mat& m, u64 row, int c) {
        int q = c & 7, n = q >> 2, a = (q >> 1) & 1, t = q & 1;
        u64 g = block_of<F_Q6_K>(m, row, c >> 3);
        // Scales 8n + 2a + t and 4 later: the same byte of two consecutive words (one 8-byte load).
        return Raw{*(const uint4*)(m.w + 128 * g + 64 * n + 32 * a + 16 * t), *(const uint4*)(m.w + 128 * m.nblk + 64 * g + 32 * n + 16 * t),
                   *(const uint2*)(m.w + 192 * m.nblk + 16 * g + 8 * n), *(const u16*)(m.w + 208 * m.nblk + 2 * g)};
    }
    // Group g's 16 levels (l, h: the chunk's low and high bit words; a: its ql region).
    static __device__ __forceinline__ void levels(const u32* l, const u32* h, int a, int g, u32* w) {
#pragma unroll
        for (int t = 0; t < 4; t++) {
            // The 2 high bits (bits 2a + 4g.. of each qh byte) moved straight to bits 4-5 and
            // merged under the nibbles' mask (3 operations a word for g = 0, 4 for g = 1: the
            // streamed loop ~85 -> ~77 instructions per chunk and row; 12B decode 331 -> 333).
            u32 hb = (g ? h[t] >> (2 * a) : h[t] << (4 - 2 * a)) & 0x30303030u;
            w[t] = ((g ? l[t] >> 4 : l[t]) & 0x0f0f0f0fu) | hb;
        }
    }
    static __device__ __forceinline__ float dot(const Mat&, const Raw& r, int c, const XGroup* x) {
        int a = (c >> 1) & 1, sh = 8 * (c & 3);
        float d = half_u16(r.d), s0 = d * (float)(i8)(r.sc.x >> sh), s1 = d * (float)(i8)(r.sc.y >> sh);
        u32 h[4] = {r.h.x, r.h.y, r.h.z, r.h.w}, l[4] = {r.l.x, r.l.y, r.l.z, r.l.w};
        int s[2];
#pragma unroll
        for (int g = 0; g < 2; g++) {
            u32 w[4];
            levels(l, h, a, g, w);
            s[g] = dotq16(w, x[g]) - 32 * x[g].s;
        }
        return s0 * x[0].d * (float)s[0] + s1 * x[1].d * (float)s[1];
    }
    // The chunk's levels and its two 16-element groups' scales (d times the 8-bit scale).
    struct Dec {
        u32 w[2][4];
        float s0, s1;
    };
    static __device__ __forceinline__ Dec decode(const Mat&, const Raw& r, int c) {
        int a = (c >> 1) & 1, sh = 8 * (c & 3);
        float d = half_u16(r.d);
        u32 h[4] = {r.h.x, r.h.y, r.h.z, r.h.w}, l[4] = {r.l.x, r.l.y, r.l.z, r.l.w};
        Dec e;
        e.s0 = d * (float)(i8)(r.sc.x >> sh);
        e.s1 = d * (float)(i8)(r.sc.y >> sh);
        levels(l, h, a, 0, e.w[0]);
        levels(l, h, a, 1, e.w[1]);
        return e;
    }
    static __device__ __forceinline__ float dot(const Dec& e, const XGroup* x) {
        return e.s0 * x[0].d * (float)(dotq16(e.w[0], x[0]) - 32 * x[0].s) + e.s1 * x[1].d * (float)(dotq16(e.w[1], x[1]) - 32 * x[1].s);
    }
};

// A Q2_K sub-block's two 16-element halves: scales (.x, .y) and minima from their scale bytes `sc`
// (low nibble: scale, high: minimum) and the block's {d, dmin} word `dm`.
__device__ __forceinline__ void q2k_scales(u32 sc, u32 dm, float2& d, float2& mn) {
    const float dd = half_u16(dm & 0xffff), dmin = half_u16(dm >> 16);
    d = make_float2(dd * (float)(sc & 15), dd * (float)((sc >> 8) & 15));
    mn = make_float2(dmin * (float)((sc >> 4) & 15), dmin * (float)((sc >> 12) & 15));
}
// Q2_K (ggml's layout: 84-byte blocks, 4-byte aligned): chunk c is sub-block pair s = c % 8 of
// super-block c / 8 (half n = s / 4, shift j = s % 4): element l < 32 is (qs[32n + l] >> 2j) & 3,
// its 16-element half h with scale byte 8n + 2j + h (low nibble: scale, high: minimum).
template <> struct Chunk<F_Q2_K> {
    static const int NP = 0;
    static const int G = 2;
    struct Raw {
        u32 q[8];
        u32 sc, dm;
    };
    static __device__ __forceinline__ int xoff(int c, int g) { return 32 * c + 16 * g; }
    static __device__ __forceinline__ Raw load(const Mat& m, u64 row, int c) {
        const u8* b = m.w + row * m.rb + 84 * (c >> 3);
        const int s = c & 7, n = s >> 2, j = s & 3;
        Raw r;
#pragma unroll
        for (int t = 0; t < 8; t++) r.q[t] = *(const u32*)(b + 16 + 32 * n + 4 * t);
        r.sc = *(const u16*)(b + 8 * n + 2 * j);
        r.dm = *(const u32*)(b + 80);
        return r;
    }
    // The chunk's levels (2 bits, as bytes), its halves' scales and minima (q2k_scales).
    struct Dec {
        u32 w[2][4];
        float2 d, mn;
    };
    static __device__ __forceinline__ Dec decode(const Mat&, const Raw& r, int c) {
        const int sh = 2 * (c & 3);
        Dec e;
#pragma unroll
        for (int t = 0; t < 8; t++) e.w[t >> 2][t & 3] = (r.q[t] >> sh) & 0x03030303u;
        q2k_scales(r.sc, r.dm, e.d, e.mn);
        return e;
    }
    static __device__ __forceinline__ float dot(const Dec& e, const XGroup* x) {
        return x[0].d * (e.d.x * (float)dotq16(e.w[0], x[0]) - e.mn.x * (float)x[0].s) +
               x[1].d * (e.d.y * (float)dotq16(e.w[1], x[1]) - e.mn.y * (float)x[1].s);
    }
    static __device__ __forceinline__ float dot(const Mat& m, const Raw& r, int c, const XGroup* x) { return dot(decode(m, r, c), x); }
};
// Planar Q3_K (see sub32<F_Q3_K>): chunk c is sub-block s = c % 8 of super-block c / 8 (half n =
// s / 4, shift j = s % 4); its levels 0..7 (low bits, high bit times 4) are 4 more than the values.
template <> struct Chunk<F_Q3_K> {
    static const int NP = 0;
    static const int G = 2;
    // The chunk's levels (the high bits already in place) and its scale bytes (see load).
    struct Raw {
        u32 w[8];
        u32 sc, d;
    };
    static __device__ __forceinline__ int xoff(int c, int g) { return 32 * c + 16 * g; }
    static __device__ __forceinline__ Raw load(const Mat& m, u64 row, int c) {
        const u64 g = block_of<F_Q3_K>(m, row, c >> 3);
        const int s = c & 7, n = s >> 2, j = s & 3, hb = 4 * n + j;
        const uint4* q = (const uint4*)(m.w + 32 * m.nblk + 64 * g + 32 * n);
        const uint4* h = (const uint4*)(m.w + 32 * g);
        const u8* sc = m.w + 96 * m.nblk + 12 * g;
        const uint4 q0 = q[0], q1 = q[1], h0 = h[0], h1 = h[1];
        const u32 qw[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
        const u32 hw[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
        Raw r;
        // The chunk takes one bit of each of the block's 32 high-bit bytes (the other 7 are the
        // block's other chunks'): merged into the levels as soon as loaded, a row's raw chunk is 10
        // registers, not 19 (matvec4's 4 rows of 19 spilled 152 bytes, matvec4p's 212).
#pragma unroll
        for (int t = 0; t < 8; t++) r.w[t] = q3k_levels(qw[t], hw[t], j, hb);
        // The scales' low nibbles of halves 8n + 2j, + 1 (bytes 2j, 2j + 1, high nibbles for n = 1)
        // in the low half, their high bits (bytes 8 + 2 (j % 2), + 1, bits 2 (2n + j / 2)..) in
        // the high half (one register, not two: matvec4p spilled 56 bytes with two).
        r.sc = (u32)*(const u16*)(sc + 2 * j) | ((u32)*(const u16*)(sc + 8 + 2 * (j & 1)) << 16);
        r.d = *(const u16*)(m.w + 108 * m.nblk + 2 * g);
        return r;
    }
    struct Dec {
        u32 w[2][4];
        float s0, s1;
    };
    static __device__ __forceinline__ Dec decode(const Mat&, const Raw& r, int c) {
        const int s = c & 7, n = s >> 2, j = s & 3;
        Dec e;
#pragma unroll
        for (int t = 0; t < 8; t++) e.w[t >> 2][t & 3] = r.w[t];
        const float d = half_u16(r.d);
        // Both halves' 6-bit scales at once, one per byte (fewer operations than one at a time).
        const u32 sc = ((r.sc >> (4 * n)) & 0x0f0fu) | (((r.sc >> (16 + 2 * (2 * n + (j >> 1)))) & 0x0303u) << 4);
        e.s0 = d * (float)((int)(sc & 0xff) - 32);
        e.s1 = d * (float)((int)(sc >> 8) - 32);
        return e;
    }
    static __device__ __forceinline__ float dot(const Dec& e, const XGroup* x) {
        return e.s0 * x[0].d * (float)(dotq16(e.w[0], x[0]) - 4 * x[0].s) + e.s1 * x[1].d * (float)(dotq16(e.w[1], x[1]) - 4 * x[1].s);
    }
    static __device__ __forceinline__ float dot(const Mat& m, const Raw& r, int c, const XGroup* x) { return dot(decode(m, r, c), x); }
};

// The chunks of the streamed (matvec_ring) kernels: a format's Chunk, except Q4_K's, which takes a
// whole sub-block pair (64 elements: the scales decoded once per 32 elements, not per 16; ~50
// instructions per 32 weights and row against ~76, measured in the SASS; the 12B's decode on an
// H200 320 -> 331 tokens/s, bench/RESULTS.md "issue 4k"; its high nibbles multiplied in place as
// unsigned bytes, one masking operation a word: 80 fewer instructions in matvecr8_q4_k, 12B decode
// 0.1-0.8% faster, "issue 4l"). (The matvec kernels keep the 32-element chunk: with 4 rows per warp
// the wide one spills.)
template <int T> struct RingChunk : Chunk<T> {};
template <> struct RingChunk<F_Q4_K> {
    static const int NP = 0;
    static const int G = 4;
    struct Raw {
        uint4 hdr, q0, q1;
    };
    // chunk c: sub-block pair j = c % 4 of super-block c / 4, its 64 elements in order: sub-block
    // 2j is the low nibbles of the pair's 32 bytes, 2j + 1 the high ones.
    static __device__ __forceinline__ int xoff(int c, int g) { return 64 * c + 16 * g; }
    static __device__ __forceinline__ Raw load(const Mat& m, u64 row, int c) {
        const u8* b = m.w + row * m.rb + 144 * (c >> 2);
        const uint4* q = (const uint4*)(b + 16 + 32 * (c & 3));
        return Raw{*(const uint4*)b, q[0], q[1]};
    }
    static __device__ __forceinline__ float dot(const Mat&, const Raw& r, int c, const XGroup* x) {
        float d = half_u16(r.hdr.x & 0xffff), dmin = half_u16(r.hdr.x >> 16);
        u32 q[8] = {r.q0.x, r.q0.y, r.q0.z, r.q0.w, r.q1.x, r.q1.y, r.q1.z, r.q1.w}, sc2, mn2;
        q4k_pair_scales(r.hdr, c & 3, &sc2, &mn2);
        float s = 0.f;
#pragma unroll
        for (int g = 0; g < 2; g++) {
            // Sub-block 2j + g: its 32 levels against groups 2g and 2g + 1 (one 32-element block
            // of the activations: one scale). |dot| <= 32 * 15 * 32258, times a 6-bit scale: fits.
            const XGroup &a = x[2 * g], &b = x[2 * g + 1];
            u32 xh[8] = {a.hi.x, a.hi.y, a.hi.z, a.hi.w, b.hi.x, b.hi.y, b.hi.z, b.hi.w};
            u32 xl[8] = {a.lo.x, a.lo.y, a.lo.z, a.lo.w, b.lo.x, b.lo.y, b.lo.z, b.lo.w};
            int h = 0, l = 0;
#pragma unroll
            for (int t = 0; t < 8; t++) {
                // The high nibbles stay in place (16 times their level, an unsigned byte): one
                // operation a word, not two.
                u32 w = q[t] & (g ? 0xf0f0f0f0u : 0x0f0f0f0fu);
                h = dp4a_us(w, xh[t], h);
                l = dp4a_us(w, xl[t], l);
            }
            int sc = (int)((sc2 >> (8 * g)) & 0xff), mn = (int)((mn2 >> (8 * g)) & 0xff);
            // (g = 1: 16 times the sum, exactly; divided back before the scale: no overflow.)
            s += a.d * (d * (float)(sc * ((254 * h + l) >> (4 * g))) - dmin * (float)(mn * (a.s + b.s)));
        }
        return s;
    }
};

// Most activation rows one matrix-vector launch multiplies (the weights are read once for all).
#define MV_ROWS 8
// Warps per matrix-vector block.
#define MV_WARPS 4
// Shared-memory stages of matvec4 (exec.rs sizes its dynamic shared memory from it).
#define MV_STAGES 3
// Argmax partial maxima per activation row (spread over addresses: fewer atomics per address).
#define ARGMAX_SLOTS 256

// Ordered key of (value, index): larger value first, then lower index.
__device__ __forceinline__ u64 argmax_key(float v, int i) {
    u32 f = __float_as_uint(v);
    f = (f & 0x80000000u) ? ~f : (f | 0x80000000u);
    return ((u64)f << 32) | (u64)(0xffffffffu - (u32)i);
}

// Widest row the norm epilogue takes (EPI_PER float4 per thread of a MV_WARPS-warp block; wider
// rows go through the norm kernel, see EPILOGUE_MAX in exec.rs).
#define EPI_PER 2
// Widest row the norm prologue takes (PRO_PER float4 per thread of a MV_WARPS-warp block:
// PROLOGUE_MAX in exec.rs).
#define PRO_PER 2

// The norm (pair) of one row x of k <= 4 * EPI_PER * blockDim.x elements by one block, every
// input loaded before the first reduction: y = x / rms(x) * w1 (res null), or h = res + x /
// rms(x) * w1 and y = h / rms(h) * w2; y is written to `out` and quantized to xq (when given). x
// was written by other blocks of this launch (read through L2). Rows are 16-byte aligned.
__device__ __noinline__ void norm_epilogue(const float* x, const float* w1, const float* res, float* h, const float* w2,
                                              float* out, u8* xq, int k, float eps, float* scratch) {
    float4 v[EPI_PER];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < EPI_PER; j++) {
        int i = 4 * (threadIdx.x + j * blockDim.x);
        v[j] = i < k ? __ldcg((const float4*)(x + i)) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int j = 0; j < EPI_PER; j++) ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
    float inv = 1.f / sqrtf(block_sum(ss, scratch) / (float)k + eps), inv2 = inv;
    if (res) {
        // (The residual is loaded only now: fewer registers than the matrix-vector loop needs.)
        float ss2 = 0.f;
#pragma unroll
        for (int j = 0; j < EPI_PER; j++) {
            int i = 4 * (threadIdx.x + j * blockDim.x);
            if (i < k) {
                float4 a = *(const float4*)(res + i), w = *(const float4*)(w1 + i);
                v[j] = make_float4(a.x + v[j].x * inv * w.x, a.y + v[j].y * inv * w.y, a.z + v[j].z * inv * w.z, a.w + v[j].w * inv * w.w);
                ss2 += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
            }
        }
    inv2 = 1.f / sqrtf(block_sum(ss2, scratch) / (float)k + eps);
    }
    // The last pass's weights are loaded together (one round trip, not one per iteration).
    float4 wl[EPI_PER];
#pragma unroll
    for (int j = 0; j < EPI_PER; j++) {
        int i = 4 * (threadIdx.x + j * blockDim.x);
        wl[j] = i < k ? *(const float4*)((res ? w2 : w1) + i) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int j = 0; j < EPI_PER; j++) {
        int i = 4 * (threadIdx.x + j * blockDim.x);
        if (4 * (j * blockDim.x + (threadIdx.x & ~31)) >= k) break;
        float4 w = wl[j];
        float s = res ? inv2 : inv;
        float4 y = make_float4(v[j].x * s * w.x, v[j].y * s * w.y, v[j].z * s * w.z, v[j].w * s * w.w);
        if (i < k) {
            if (res) *(float4*)(h + i) = v[j];
            *(float4*)(out + i) = y;
        }
        if (xq) quantize32x4(y, xq, k, i);
    }
}

// A warp's finished group of output rows (acc: the products, in every lane): the stores, or the glu
// (activation ACT) and its quantization (see `matvec`).
template <int R, int ROWS, int ACT>
__device__ __forceinline__ void group_out(const float (&acc)[ROWS][R], const int (&mi)[R], const int (&ri)[R], const int (&nr)[R],
                                          float* const (&orr)[R], int n0, float* o0, float* o1, float* glu, u8* gq, u32* gcnt, int rows, int lane) {
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        if (r >= rows) break;
        if (lane == 0) {
#pragma unroll
            for (int rr = 0; rr < R; rr++)
                if (mi[rr] >= 0 && !glu) orr[rr][(u64)r * nr[rr] + ri[rr]] = acc[r][rr];
            if (glu) {
#pragma unroll
                for (int rr = 0; rr < R / 2; rr++)
                    if (mi[rr] >= 0) {
                        o0[(u64)r * n0 + ri[rr]] = acc[r][rr];
                        o1[(u64)r * n0 + ri[rr]] = acc[r][rr + R / 2];
                        glu[(u64)r * n0 + ri[rr]] = glu_act<ACT>(acc[r][rr]) * acc[r][rr + R / 2];
                    }
            }
        }
        if (glu && gq) {
            // The warp whose rows complete a 32-row block of glu quantizes it.
            int count = 0;
#pragma unroll
            for (int rr = 0; rr < R / 2; rr++) count += mi[rr] >= 0;
            u32* cnt = gcnt + r * (n0 >> 5) + (ri[0] >> 5);
            int done = 0;
            if (lane == 0) {
                done = arrive(cnt, (u32)count) + count == 32;
            }
            if (__shfl_sync(0xffffffffu, done, 0)) {
                acquire();
                int e = (ri[0] & ~31) + lane;
                quantize32(__ldcg(glu + (u64)r * n0 + e), gq + r * xq_bytes(n0), n0, e);
                if (lane == 0) *cnt = 0;
            }
        }
    }
}

// By the last warp of an argmax launch to arrive (after `acquire`): reduces the slots of each of
// `rows` activation rows into aout (-1 where a flag says a product was not finite) and resets the
// slots, the flags and the arrival counter `acnt`.
__device__ __forceinline__ void argmax_reduce(u64* aslots, int* aout, u32* acnt, int rows, int lane) {
    for (int r = 0; r < rows; r++) {
        u64 b = 0;
        for (int s = lane; s < ARGMAX_SLOTS; s += 32) {
            u64* p = &aslots[r * ARGMAX_SLOTS + s];
            u64 v = __ldcg(p);
            b = v > b ? v : b;
            *p = 0;
        }
        b = warp_max_key(b);
        if (lane == 0) {
            u32* flag = (u32*)(aslots + MV_ROWS * ARGMAX_SLOTS) + r;
            aout[r] = __ldcg(flag) ? -1 : (int)(0xffffffffu - (u32)(b & 0xffffffffu));
            *flag = 0;
        }
    }
    if (lane == 0) *acnt = 0;
}

// Folds a warp's finished group of output rows into its running argmax keys (best: per activation
// row, 0 for none yet; bad: per row, a product was not finite).
template <int R, int ROWS>
__device__ __forceinline__ void argmax_fold(const float (&acc)[ROWS][R], const int (&mi)[R], const int (&ri)[R], int rows, u64 (&best)[ROWS],
                                            u32& bad) {
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        if (r >= rows) break;
#pragma unroll
        for (int rr = 0; rr < R; rr++)
            if (mi[rr] >= 0) {
                float v = acc[r][rr];
                if (!(fabsf(v) <= 3.402823466e38f)) bad |= 1u << r;
                u64 key = argmax_key(v, ri[rr]);
                best[r] = key > best[r] ? key : best[r];
            }
    }
}

// A warp's argmax keys (lane 0's) into the slots, once after all its groups; the last of the `warps`
// warps with groups to arrive (counted in `acnt`) reduces the slots of every row into aout and
// resets them.
template <int ROWS>
__device__ __forceinline__ void argmax_publish(const u64 (&best)[ROWS], u32 bad, int warp, int warps, int rows, u64* aslots, int* aout,
                                               u32* acnt, int lane) {
    int done = 0;
    if (lane == 0) {
        for (int r = 0; r < rows; r++) {
            if (best[r]) atomicMax((unsigned long long*)&aslots[r * ARGMAX_SLOTS + warp % ARGMAX_SLOTS], (unsigned long long)best[r]);
            if (bad & (1u << r)) atomicOr((u32*)(aslots + MV_ROWS * ARGMAX_SLOTS) + r, 1u);
        }
        done = arrive(acnt, 1u) == (u32)warps - 1;
    }
    if (!__shfl_sync(0xffffffffu, done, 0)) return;
    acquire();
    argmax_reduce(aslots, aout, acnt, rows, lane);
}

// out_i[r, o] = x[r, :] . W_i[o, :] for up to three matrices W_0..W_2 of one format sharing x
// (n_i rows each; n_i = 0: absent) and r < rows <= ROWS, x given quantized (xq). Each group of
// `split` warps computes R consecutive output rows of the concatenation; lanes walk the row in
// 32-element chunks, and each chunk's activations are loaded once for the R rows.
// - `glu` (R even): a warp computes rows o..o+R/2 of W_0 (gate) and of W_1 (up) and writes
//   glu[o] = act(gate) * up (ACT: GELU-tanh or SiLU, `glu_act`); with `gq`, each 32-row block of glu is also quantized (by the warp
//   that completes it, counted in `gcnt`) for the next matrix-vector product.
// - `ecnt` (one matrix, no glu): the last block to finish (counted in `ecnt`) also computes the
//   norm (pair) of the products o0 (see norm_epilogue): all of them are written by then.
// - `px` (PRO kernels, one activation row, no `ecnt`): x is not given quantized but as the input px of a norm
//   (pair) with the epilogue's arguments (ew1, er, eh, ew2, eout, eps; with er but no ew1 the pair's
//   first norm is none, h = er + px: a residual add and the next norm): every block computes it
//   into its dynamic shared memory (after the ring) right after waiting, and reads it there
//   instead of xq; block 0 also writes h (eh), a copy of h or of x without residual (eh2), y
//   (eout, when given) and y quantized (exq, when given) for later launches. No norm kernel, no
//   last-block tail.
// - STAGES > 0 (formats with staged chunks): each lane keeps its next STAGES - 1 chunks (of all R
//   rows) in flight as asynchronous copies into dynamic shared memory (mv_stage_bytes per block)
//   instead of loading one chunk at a time into registers.
// - `aout` (one matrix, no glu): instead of the products, aout[r] = argmax of row r (lowest
//   index among equal maxima, -1 if any value is not finite): each warp keeps the best key of its
//   groups (argmax_fold) and publishes it once (argmax_publish) into `aslots` (ARGMAX_SLOTS keys
//   per row, then a flag per row), counted in `acnt`; the last warp reduces and resets them.
template <int T, int R, int ROWS, int STAGES, bool PRO, bool LOOP, int ACT>
__device__ __forceinline__ void matvec(const u8* w0, const u8* w1, const u8* w2, u64 rb, int n0, int n1, int n2, float* o0,
                                       float* o1, float* o2, float* glu, const u8* xq, int k, int rows, int split, u8* gq,
                                       u32* gcnt, const float* ew1, const float* er, float* eh, const float* ew2, float* eout,
                                       u8* exq, u32* ecnt, float eps, u64* aslots, int* aout, u32* acnt, const float* px, float* eh2) {
    extern __shared__ uint4 mv_dyn[];
    __shared__ float part[MV_WARPS][ROWS][R];
    __shared__ float scratch[32];
    __shared__ int last_block;
    // The block's MV_WARPS warps form MV_WARPS / split groups; the `split` warps of a group share
    // its R output rows, each walking every split-th run of 32 chunks.
    int wi = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int warp = blockIdx.x * (MV_WARPS / split) + wi / split, piece = wi % split;
    if (ecnt) {
        // Whichever block computes the norm finds its vectors in L2: the blocks prefetch the
        // 128-byte lines of w1, the residual and w2 (L2 is coherent: the residual may be prefetched
        // before its writer is known to be done).
        int lines = (k * rows + 31) >> 5, t = blockIdx.x * blockDim.x + threadIdx.x;
        if (t < lines) {
            if (er) prefetch_l2(er + 32 * (u64)t);
            if (t < (k + 31) >> 5) {
                prefetch_l2(ew1 + 32 * t);
                if (ew2) prefetch_l2(ew2 + 32 * t);
            }
        }
    }
    u64 bpr = rb / Fmt<T>::bytes, xqb = xq_bytes(k);
    // The norm prologue (px): the residual and the norm weights (written by no kernel of the step
    // or by one at least two launches back, complete once this block runs) are loaded before
    // waiting; x, the products of the launch before, after it.
    float4 pres[PRO_PER], pw1[PRO_PER], pw2[PRO_PER];
    if (PRO && px) {
#pragma unroll
        for (int j = 0; j < PRO_PER; j++) {
            int i = 4 * (threadIdx.x + j * blockDim.x);
            float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
            pw1[j] = i < k ? ew1 ? *(const float4*)(ew1 + i) : make_float4(1.f, 1.f, 1.f, 1.f) : z;
            pres[j] = i < k && er ? *(const float4*)(er + i) : z;
            pw2[j] = i < k && er ? *(const float4*)(ew2 + i) : z;
        }
    }
    auto prologue = [&]() {
        if (!PRO || !px) return;
        constexpr int ring = STAGES > 0 && Chunk<T>::NP > 0 ? MV_WARPS * STAGES * R * Chunk<T>::NP * 32 : 0;
        u8* sx = (u8*)(mv_dyn + ring);
        bool first = blockIdx.x == 0;
        float4 v[PRO_PER];
        float ss = 0.f;
#pragma unroll
        for (int j = 0; j < PRO_PER; j++) {
            int i = 4 * (threadIdx.x + j * blockDim.x);
            v[j] = i < k ? __ldcg((const float4*)(px + i)) : make_float4(0.f, 0.f, 0.f, 0.f);
            ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
        }
        // (Without ew1 no first norm: h = residual + x, exactly, its weights ones. Its sum is
        // reduced all the same: skipping it cost registers in some instances.)
        float inv = 1.f / sqrtf(block_sum(ss, scratch) / (float)k + eps);
        if (!ew1) inv = 1.f;
        if (er) {
            float ss2 = 0.f;
#pragma unroll
            for (int j = 0; j < PRO_PER; j++) {
                float4 a = pres[j], w = pw1[j];
                v[j] = make_float4(a.x + v[j].x * inv * w.x, a.y + v[j].y * inv * w.y, a.z + v[j].z * inv * w.z, a.w + v[j].w * inv * w.w);
                ss2 += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
            }
            inv = 1.f / sqrtf(block_sum(ss2, scratch) / (float)k + eps);
        }
#pragma unroll
        for (int j = 0; j < PRO_PER; j++) {
            int i = 4 * (threadIdx.x + j * blockDim.x);
            if (4 * (j * blockDim.x + (threadIdx.x & ~31)) >= k) break;
            float4 w = er ? pw2[j] : pw1[j];
            float4 y = make_float4(v[j].x * inv * w.x, v[j].y * inv * w.y, v[j].z * inv * w.z, v[j].w * inv * w.w);
            if (first && i < k) {
                if (er) *(float4*)(eh + i) = v[j];
                *(float4*)(eh2 + i) = v[j];
                if (eout) *(float4*)(eout + i) = y;
            }
            quantize32x4(y, sx, k, i);
        }
        __syncthreads();
        if (first && exq)
            for (int i = threadIdx.x; i < (int)(xqb >> 4); i += blockDim.x) ((uint4*)exq)[i] = ((const uint4*)sx)[i];
        xq = sx;
    };
    // Groups of R output rows: the block's teams (of `split` warps) take groups team, team +
    // teams, ... (split 1 launches are persistent: fewer blocks than groups; with split > 1 every
    // team has at most one group, as the shared-memory reduction below needs).
    const int groups = glu ? (n0 + R / 2 - 1) / (R / 2) : (n0 + n1 + n2 + R - 1) / R;
    const int teams = gridDim.x * (MV_WARPS / split);
    // The argmax launches' running keys (see argmax_fold), published once after the warp's groups.
    u64 abest[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) abest[r] = 0;
    u32 abad = 0;
    const int first_warp = warp;
    bool waited = false;
    auto wait_once = [&]() {
        if (!waited) {
            pdl_wait();
            prologue();
            waited = true;
        }
    };
    for (;; warp += teams) {
        // Per output row: its matrix (-1: none), row index, width and output (selects, not arrays
        // indexed at run time, so nothing goes to local memory).
        int mi[R], ri[R], nr[R];
        Mat mr[R];
        float* orr[R];
        bool any = false;
#pragma unroll
        for (int rr = 0; rr < R; rr++) {
            if (glu) {
                mi[rr] = rr < R / 2 ? 0 : 1;
                ri[rr] = warp * (R / 2) + rr % (R / 2);
                if (ri[rr] >= n0) mi[rr] = -1;
            } else {
                int g = warp * R + rr;
                mi[rr] = g < n0 ? 0 : g < n0 + n1 ? 1 : g < n0 + n1 + n2 ? 2 : -1;
                ri[rr] = mi[rr] == 0 ? g : mi[rr] == 1 ? g - n0 : g - n0 - n1;
            }
            any |= mi[rr] >= 0;
            nr[rr] = mi[rr] == 0 ? n0 : mi[rr] == 1 ? n1 : n2;
            mr[rr] = Mat{mi[rr] == 0 ? w0 : mi[rr] == 1 ? w1 : w2, rb, (u64)nr[rr] * bpr};
            orr[rr] = mi[rr] == 0 ? o0 : mi[rr] == 1 ? o1 : o2;
        }
        float acc[ROWS][R];
#pragma unroll
        for (int r = 0; r < ROWS; r++)
#pragma unroll
            for (int rr = 0; rr < R; rr++) acc[r][rr] = 0.f;
        int chunks = any ? k >> 5 : 0;
        int c = piece * 32 + lane, stride = 32 * split;
        if constexpr (STAGES > 0 && Chunk<T>::NP > 0) {
            // Stage s of the lane's ring holds turn t = s (mod STAGES): R rows of NP pieces.
            constexpr int NP = Chunk<T>::NP;
            uint4* ring = mv_dyn + wi * (STAGES * R * NP * 32) + lane;
            const int c0 = c, turns = c < chunks ? (chunks - c + stride - 1) / stride : 0;
            // (Turn t's chunk counts from the first: c moves on with the loop below.)
            auto issue = [&](int t) {
                if (t < turns) {
#pragma unroll
                    for (int rr = 0; rr < R; rr++)
                        if (mi[rr] >= 0) Chunk<T>::stage(mr[rr], ri[rr], c0 + t * stride, ring + ((t % STAGES) * R + rr) * NP * 32);
                }
                cp_async_commit();
            };
            // The first turns' weights are requested before waiting for the kernels that write x.
#pragma unroll
            for (int t = 0; t < STAGES - 1; t++) issue(t);
            wait_once();
            for (int t = 0; t < turns; t++, c += stride) {
                issue(t + STAGES - 1);
                cp_async_wait<STAGES - 1>();
                const uint4* st = ring + (t % STAGES) * R * NP * 32;
#pragma unroll
                for (int r = 0; r < ROWS; r++) {
                    if (r < rows) {
                        const u8* xr = xq + r * xqb;
                        XGroup xg[2] = {xgroup(xr, k, Chunk<T>::xoff(c, 0)), xgroup(xr, k, Chunk<T>::xoff(c, 1))};
#pragma unroll
                        for (int rr = 0; rr < R; rr++)
                            if (mi[rr] >= 0) acc[r][rr] += Chunk<T>::dot(mr[rr], Chunk<T>::unstage(mr[rr], ri[rr], c, st + rr * NP * 32), c, xg);
                    }
                }
            }
            cp_async_wait<0>();
        } else {
            // The lane's first chunk of weights is loaded before waiting for the kernels that write x.
            typename Chunk<T>::Raw raw[R];
#pragma unroll
            for (int rr = 0; rr < R; rr++)
                if (mi[rr] >= 0 && c < chunks) raw[rr] = Chunk<T>::load(mr[rr], ri[rr], c);
            wait_once();
            for (; c < chunks; c += stride) {
                if (c >= piece * 32 + stride) {
#pragma unroll
                    for (int rr = 0; rr < R; rr++)
                        if (mi[rr] >= 0) raw[rr] = Chunk<T>::load(mr[rr], ri[rr], c);
                }
                // (One activation row: each row's chunk is decoded next to its product; decoding
                // all R first held them all in registers, and matvec4 spilled for several formats.)
                if constexpr (ROWS == 1) {
                    if (rows > 0) {
                        XGroup xg[2] = {xgroup(xq, k, Chunk<T>::xoff(c, 0)), xgroup(xq, k, Chunk<T>::xoff(c, 1))};
#pragma unroll
                        for (int rr = 0; rr < R; rr++)
                            if (mi[rr] >= 0) acc[0][rr] += Chunk<T>::dot(mr[rr], raw[rr], c, xg);
                    }
                } else {
                    // Each weight row's chunk is decoded once for all activation rows (it was
                    // decoded again for each row behind the rows' branches: on an H200, synthetic
                    // 12B, 8 sequences 418 -> 449 tokens/s; bench/RESULTS.md "issue 4v").
                    typename Chunk<T>::Dec dec[R];
#pragma unroll
                    for (int rr = 0; rr < R; rr++)
                        if (mi[rr] >= 0) dec[rr] = Chunk<T>::decode(mr[rr], raw[rr], c);
#pragma unroll
                    for (int r = 0; r < ROWS; r++) {
                        if (r < rows) {
                            const u8* xr = xq + r * xqb;
                            XGroup xg[2] = {xgroup(xr, k, Chunk<T>::xoff(c, 0)), xgroup(xr, k, Chunk<T>::xoff(c, 1))};
#pragma unroll
                            for (int rr = 0; rr < R; rr++)
                                if (mi[rr] >= 0) acc[r][rr] += Chunk<T>::dot(dec[rr], xg);
                        }
                    }
                }
            }
        }
        if (LOOP && split == 1) {
#pragma unroll
            for (int r = 0; r < ROWS; r++)
#pragma unroll
                for (int rr = 0; rr < R; rr++) acc[r][rr] = r < rows ? warp_sum(acc[r][rr]) : 0.f;
        } else {
#pragma unroll
            for (int r = 0; r < ROWS; r++)
#pragma unroll
                for (int rr = 0; rr < R; rr++) {
                    float s = r < rows ? warp_sum(acc[r][rr]) : 0.f;
                    if (lane == 0) part[wi][r][rr] = s;
                }
            __syncthreads();
            if (piece == 0 && any)
#pragma unroll
                for (int r = 0; r < ROWS; r++)
#pragma unroll
                    for (int rr = 0; rr < R; rr++) {
                        float s = 0.f;
                        for (int p = 0; p < split; p++) s += part[wi + p][r][rr];
                        acc[r][rr] = s;
                    }
        }
        if (piece == 0 && any) {
            if (aout)
                argmax_fold<R, ROWS>(acc, mi, ri, rows, abest, abad);
            else
                group_out<R, ROWS, ACT>(acc, mi, ri, nr, orr, n0, o0, o1, glu, gq, gcnt, rows, lane);
        }
        if (!LOOP || warp + teams >= groups) break;
    }
    if (aout && piece == 0 && first_warp < groups)
        argmax_publish<ROWS>(abest, abad, first_warp, teams < groups ? teams : groups, rows, aslots, aout, acnt, lane);
    if (ecnt) {
        // The last block to finish computes the norm (pair) of the products (see norm_epilogue).
        // (Written out rather than `last_to_arrive`, which made ptxas spill in matvec1_q2_k and
        // matvec1_q5_k: 0 -> 28 and 16 -> 32 bytes.)
        __syncthreads();
        if (threadIdx.x == 0) last_block = arrive(ecnt, 1u) == gridDim.x - 1;
        __syncthreads();
        if (!last_block) return;
        acquire();
        for (int r = 0; r < rows; r++)
            norm_epilogue(o0 + (u64)r * n0, ew1, er ? er + (u64)r * n0 : nullptr, eh ? eh + (u64)r * n0 : nullptr, ew2,
                          eout + (u64)r * n0, exq ? exq + r * xq_bytes(n0) : nullptr, n0, eps, scratch);
        if (threadIdx.x == 0) *ecnt = 0;
    }
}

// The planes of a matrix as uploaded (weights.rs): plane p holds per(p) bytes of every block, in
// block order, from byte off(p) * (the matrix's blocks). Formats kept in ggml's layout have one.
template <int T> struct Planes {
    static const int N = 1;
    static __device__ __forceinline__ u32 off(int) { return 0; }
    static __device__ __forceinline__ u32 per(int) { return Fmt<T>::bytes; }
};
template <> struct Planes<F_Q8_0> {
    static const int N = 2;
    static __device__ __forceinline__ u32 off(int p) { return p ? 32 : 0; }
    static __device__ __forceinline__ u32 per(int p) { return p ? 2 : 32; }
};
template <> struct Planes<F_Q4_0> {
    static const int N = 2;
    static __device__ __forceinline__ u32 off(int p) { return p ? 16 : 0; }
    static __device__ __forceinline__ u32 per(int p) { return p ? 2 : 16; }
};
template <> struct Planes<F_Q5_0> {
    static const int N = 3;
    static __device__ __forceinline__ u32 off(int p) { return p == 0 ? 0 : p == 1 ? 16 : 20; }
    static __device__ __forceinline__ u32 per(int p) { return p == 0 ? 16 : p == 1 ? 4 : 2; }
};
template <> struct Planes<F_Q3_K> {
    static const int N = 4;
    static __device__ __forceinline__ u32 off(int p) { return p == 0 ? 0 : p == 1 ? 32 : p == 2 ? 96 : 108; }
    static __device__ __forceinline__ u32 per(int p) { return p == 0 ? 32 : p == 1 ? 64 : p == 2 ? 12 : 2; }
};
template <> struct Planes<F_Q6_K> {
    static const int N = 4;
    static __device__ __forceinline__ u32 off(int p) { return p == 0 ? 0 : p == 1 ? 128 : p == 2 ? 192 : 208; }
    static __device__ __forceinline__ u32 per(int p) { return p == 0 ? 128 : p == 1 ? 64 : p == 2 ? 16 : 2; }
};

// Warps of a matvecr8/matvecr2 block (4 resident per multiprocessor) and of a matvecr4 block (2
// resident, twice the ring), most stages.
#define MVR_WARPS 4
#define MVR4_WARPS 8
#define MVR_STAGES 4
// Tiles a matvecr block asks for before waiting for the previous kernel (the rest of its ring
// after): a third early tile per block slowed the small kernels the launch waits on (the norms,
// attention), whose loads queue behind the copies: 12B decode on an H200 332 tok/s with every
// stage early, 338 with 2, 333 with 1, 309 with none (bench/RESULTS.md "issue 4k"); on an H100
// 1 early tile made the norms cheaper and the products slower by as much (+0.3% a token), 1 in
// every other block +4.1% ("issue 4ap"); spacing them 3 us apart, -2.5% on an H100 and +1.2% on an
// H200 ("issue 4aq").
#define MVR_EARLY 2

// Asks the copy engine for blocks b0..b0+nb of a matrix of `nblk` blocks at w, into a tile of `tb`
// blocks at dst (laid out as a matrix of its own) from its block `at` on, counted on `bar`.
template <int T> __device__ __forceinline__ void ring_copy(u8* dst, const u8* w, u64 nblk, u64 b0, u64 nb, u64 tb, u64 at, u64* bar) {
#pragma unroll
    for (int p = 0; p < Planes<T>::N; p++)
        bulk_copy(dst + Planes<T>::off(p) * tb + Planes<T>::per(p) * at, w + Planes<T>::off(p) * nblk + Planes<T>::per(p) * b0,
                  (u32)(Planes<T>::per(p) * nb), bar);
}

// Sums each of 8 values over the warp's lanes: lane l gets the sum of a[4 b4 + 2 b3 + b2] (b_i:
// bit i of l) in 9 exchanges instead of 40.
__device__ __forceinline__ float rows_sum8(float (&a)[8], int lane) {
    bool b = (lane >> 4) & 1;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float send = b ? a[i] : a[i + 4], keep = b ? a[i + 4] : a[i];
        a[i] = keep + __shfl_xor_sync(0xffffffffu, send, 16);
    }
    b = (lane >> 3) & 1;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        float send = b ? a[i] : a[i + 2], keep = b ? a[i + 2] : a[i];
        a[i] = keep + __shfl_xor_sync(0xffffffffu, send, 8);
    }
    b = (lane >> 2) & 1;
    float v = (b ? a[1] : a[0]) + __shfl_xor_sync(0xffffffffu, b ? a[0] : a[1], 4);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    return v + __shfl_xor_sync(0xffffffffu, v, 1);
}

// The tiles of a matvec_ring block (after its wait; arguments as matvec_ring's, with its ring,
// stage barriers, partial sums `red`, tile counts and the refill `issue`), computed with the tile's
// rows in SETS sets, each walked by 32 W / SETS lanes (a lane takes ROWS = TR / SETS rows of its
// chunks): the sums, the outputs (with their biases; or the argmax, or the glu of activation ACT), the refills.
template <int T, int TR, int W, int SETS, int ACT, class Issue>
__device__ __forceinline__ void ring_tiles(const Issue& issue, const u8* ring, u64* full, float (*red)[W][TR], int mine, int tiles,
                                           u64 rb, u64 tb, u32 stage, int n0, int n1, float* o0, float* o1, float* o2, const float* b0,
                                           const float* b1, const float* b2, float* glu,
                                           const u8* xq, int k, int ns, u64* aslots, int* aout, u32* acnt) {
    constexpr int HALF = TR / 2;
    const int wi = threadIdx.x >> 5, lane = threadIdx.x & 31;
    constexpr int G = RingChunk<T>::G, ROWS = TR / SETS, LANES = 32 * W / SETS;
    const int chunks = k / (16 * G);
    u64 best = 0;
    u32 bad = 0;
    // Chunks whose activations a lane holds for all tiles (4 groups in all: 40 registers).
    constexpr int HELD = 4 / G;
    const int li = threadIdx.x % LANES, set = threadIdx.x / LANES;
    const bool held = chunks <= HELD * LANES;
    XGroup xc[HELD][G];
    if (held) {
#pragma unroll
        for (int p = 0; p < HELD; p++)
#pragma unroll
            for (int g = 0; g < G; g++)
                if (li + p * LANES < chunks) xc[p][g] = xgroup(xq, k, RingChunk<T>::xoff(li + p * LANES, g));
    }
    // The lane's ROWS rows of chunk c against activations xg.
    auto chunk = [&](const Mat& st, float (&acc)[ROWS], int c, const XGroup* xg) {
        // (At most four rows' loads at a time: eight rows' raw bytes and the sums overflow
        // the registers.)
        constexpr int GR = ROWS < 4 ? ROWS : 4;
#pragma unroll
        for (int r0 = 0; r0 < ROWS; r0 += GR) {
            typename RingChunk<T>::Raw raw[GR];
#pragma unroll
            for (int r = 0; r < GR; r++) raw[r] = RingChunk<T>::load(st, set * ROWS + r0 + r, c);
#pragma unroll
            for (int r = 0; r < GR; r++) acc[r0 + r] += RingChunk<T>::dot(st, raw[r], c, xg);
        }
    };
    for (int i = 0; i < mine; i++) {
        const int slot = i % ns, t = blockIdx.x + i * gridDim.x;
        bar_wait(&full[slot], (i / ns) & 1);
        const Mat st{ring + (u64)slot * stage, rb, tb};
        float acc[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; r++) acc[r] = 0.f;
        if (held) {
#pragma unroll
            for (int p = 0; p < HELD; p++)
                if (li + p * LANES < chunks) chunk(st, acc, li + p * LANES, xc[p]);
        } else {
            for (int c = li; c < chunks; c += LANES) {
                XGroup xg[G];
#pragma unroll
                for (int g = 0; g < G; g++) xg[g] = xgroup(xq, k, RingChunk<T>::xoff(c, g));
                chunk(st, acc, c, xg);
            }
        }
        // The warp's sums go to red[.][wi][row within its set].
        if constexpr (ROWS == 8) {
            const float v = rows_sum8(acc, lane);
            if ((lane & 3) == 0) red[i & 1][wi][4 * ((lane >> 4) & 1) + 2 * ((lane >> 3) & 1) + ((lane >> 2) & 1)] = v;
        } else {
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                const float v = warp_sum(acc[r]);
                if (lane == 0) red[i & 1][wi][r] = v;
            }
        }
        // Every warp has left the stage: refill it. (Two sets of partial sums: a warp can
        // reach the next tile's barrier only after warp 0 has passed this one.)
        __syncthreads();
        if (threadIdx.x == 0 && i + ns < mine) issue(i + ns);
        if (wi != 0) continue;
        // Row r of the tile: the sums of the warps of its set.
        auto sum = [&](int r) {
            float s = 0.f;
#pragma unroll
            for (int w = 0; w < W / SETS; w++) s += red[i & 1][(r / ROWS) * (W / SETS) + w][r % ROWS];
            return s;
        };
        if (glu) {
            if (lane < HALF) {
                const float g = sum(lane), u = sum(lane + HALF);
                const int r = t * HALF + lane;
                o0[r] = g;
                o1[r] = u;
                glu[r] = glu_act<ACT>(g) * u;
            }
        } else if (lane < TR) {
            const float s = sum(lane);
            const int g = t * TR + lane;
            if (aout) {
                if (!(fabsf(s) <= 3.402823466e38f)) bad = 1;
                const u64 key = argmax_key(s, g);
                best = key > best ? key : best;
            } else {
                const int mi = g < n0 ? 0 : g < n0 + n1 ? 1 : 2, o = g - (mi > 0 ? n0 : 0) - (mi > 1 ? n1 : 0);
                const float* b = mi == 0 ? b0 : mi == 1 ? b1 : b2;
                (mi == 0 ? o0 : mi == 1 ? o1 : o2)[o] = b ? s + __ldg(b + o) : s;
            }
        }
    }
    if (aout && wi == 0 && mine > 0) {
        const u64 b[1] = {warp_max_key(best)};
        argmax_publish<1>(b, __any_sync(0xffffffffu, bad) ? 1u : 0u, blockIdx.x, min((int)gridDim.x, tiles), 1, aslots, aout, acnt, lane);
    }
}

// One activation row times up to three matrices of one format (each plus its bias where given), the
// glu pair (activation ACT) or the greedy argmax (arguments as in `matvec`; no norm prologue or epilogue, no glu quantization) with the weights
// streamed through shared memory (sm_90): the rows are cut in tiles of TR rows (8, 4 or 2; with
// glu, TR / 2 rows of W_0 and the same rows of W_1), taken by the blocks in turn (block b: tiles b,
// b + gridDim.x, ...). Thread 0 asks the copy engine for each tile into a ring of `ns` stages of
// dynamic shared memory (ns <= MVR_STAGES; the first MVR_EARLY before waiting for the previous
// kernel: no kernel writes weights; later ones as soon as every warp has left the stage), and the W
// warps compute from there (ring_tiles): the tile's rows in one or two sets, lane l of a set's 32
// W/sets lanes takes chunks l, l + 32 W/sets, ... of every row of its set (the activations loaded
// once per chunk for all those rows, and held in registers for all tiles where the row has at most
// 64 elements per lane), then the tile's sums are reduced over the lanes and the warps. The host
// sizes the tiles so that every plane's share of a tile is a multiple of 16 bytes (bulk copies) and
// no tile spans two matrices (ring_geometry in exec.rs). Measured on an H200 at 12B shapes against
// matvec4 (bench/RESULTS.md "issue 4i"): the Q6_K greedy head 328 -> 206 us (90% of the read
// bandwidth), gate/up 26.2 -> 20.5 us, down 19.1 -> 17.6 us, o 6.2 -> 4.4 us, v 5.1 -> 3.9 us, q/k
// 7.6 -> 7.4 us. (A producer warp waiting on "stage free" barriers took registers from the
// computing warps: 3 blocks of 4 + 1 warps per multiprocessor against 4 blocks of 4, head 218
// against 206 us; a run-time row count made each row's loads a branch: gate/up 23.0 against
// 20.6 us.) Rows too long for two 8-row tiles in the ring (the down projection's 15,360) take tiles
// of 4 rows in blocks of 8 warps with twice the ring (matvecr4) rather than 2 rows: each chunk's
// activations serve 4 rows, not 2.
template <int T, int TR, int W, int ACT>
__device__ __forceinline__ void matvec_ring(const u8* w0, const u8* w1, const u8* w2, u64 rb, int n0, int n1, int n2, float* o0,
                                            float* o1, float* o2, const float* b0, const float* b1, const float* b2, float* glu, const u8* xq, int k, int ns, u64* aslots, int* aout,
                                            u32* acnt) {
    constexpr int HALF = TR / 2;
    extern __shared__ uint4 mvr_dyn[];
    __shared__ __align__(8) u64 full[MVR_STAGES];
    __shared__ float red[2][W][TR];
    const u64 bpr = rb / Fmt<T>::bytes, tb = TR * bpr;
    const u32 stage = (u32)(TR * rb);
    const int tiles = glu ? n0 / HALF : (n0 + n1 + n2) / TR;
    const int mine = (int)blockIdx.x < tiles ? (tiles - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
    u8* ring = (u8*)mvr_dyn;
    // Thread 0 asks for tile i into stage i % ns (after every warp has left the tile that held it).
    auto issue = [&](int i) {
        const int slot = i % ns, t = blockIdx.x + i * gridDim.x;
        u8* dst = ring + (u64)slot * stage;
        bar_expect(&full[slot], stage);
        if (glu) {
            ring_copy<T>(dst, w0, (u64)n0 * bpr, (u64)t * HALF * bpr, HALF * bpr, tb, 0, &full[slot]);
            ring_copy<T>(dst, w1, (u64)n0 * bpr, (u64)t * HALF * bpr, HALF * bpr, tb, HALF * bpr, &full[slot]);
        } else {
            const int g = t * TR, mi = g < n0 ? 0 : g < n0 + n1 ? 1 : 2;
            const int r0 = g - (mi > 0 ? n0 : 0) - (mi > 1 ? n1 : 0), nm = mi == 0 ? n0 : mi == 1 ? n1 : n2;
            ring_copy<T>(dst, mi == 0 ? w0 : mi == 1 ? w1 : w2, (u64)nm * bpr, (u64)r0 * bpr, tb, tb, 0, &full[slot]);
        }
    };
    if (threadIdx.x == 0) {
        for (int s = 0; s < ns; s++) bar_init(&full[s], 1);
        bar_init_fence();
        for (int i = 0; i < ns && i < mine && i < MVR_EARLY; i++) issue(i);
    }
    __syncthreads();
    pdl_wait();
    if (threadIdx.x == 0)
        for (int i = MVR_EARLY; i < ns && i < mine; i++) issue(i);
    // Formats with chunks of 4 groups (Q4_K: 64 elements) take two sets where half the block's
    // lanes cover a row in one chunk each (a lane still takes 8 x 32 elements of an 8-row tile).
    if constexpr (RingChunk<T>::G == 4) {
        if (2 * (k / (16 * RingChunk<T>::G)) <= 32 * W) {
            ring_tiles<T, TR, W, 2, ACT>(issue, ring, full, red, mine, tiles, rb, tb, stage, n0, n1, o0, o1, o2, b0, b1, b2, glu, xq, k, ns, aslots, aout, acnt);
            return;
        }
    }
    ring_tiles<T, TR, W, 1, ACT>(issue, ring, full, red, mine, tiles, rb, tb, stage, n0, n1, o0, o1, o2, b0, b1, b2, glu, xq, k, ns, aslots, aout, acnt);
}

// Greedy head for one activation row over a planar Q8_0 matrix of n rows and k <= HEAD_MAX_K
// columns (k a multiple of 32): aout[0] = argmax_o x . W[o, :] (lowest index among equal maxima,
// -1 if a product is not finite). Warps stride over steps of 8 consecutive rows; in a step,
// lane 4s + p takes row s of the step and the 32-element blocks p, p + 4, p + 8, ... of it (each
// lane's loads are issued together, rows' bytes are contiguous). x (quantized) is staged in
// shared memory once per block; each lane keeps its best row, the block's best goes to
// `aslots[block % ARGMAX_SLOTS]` (then a non-finite flag), and the last block to finish (counted
// in `acnt`) reduces the slots, writes aout and resets them.
#define HEAD_WARPS 8
#define HEAD_MAX_K 1024
#define HEAD_BLOCKS (HEAD_MAX_K / 128)
extern "C" __global__ void __launch_bounds__(HEAD_WARPS * 32) argmax_head_q8_0(const u8* w, u64 nblk, int n, const u8* xq, int k,
                                                                              u64* aslots, int* aout, u32* acnt) {
    __shared__ __align__(16) u8 sx[HEAD_MAX_K * 5 / 2];
    __shared__ u64 sbest[HEAD_WARPS];
    __shared__ int sbad, last;
    int lane = threadIdx.x & 31, wi = threadIdx.x >> 5;
    int bpr = k >> 5, part = lane & 3, sub = lane >> 2;
    int warps = gridDim.x * HEAD_WARPS, steps = (n + 7) >> 3;
    uint4 qa[HEAD_BLOCKS], qb[HEAD_BLOCKS];
    float dw[HEAD_BLOCKS];
    // Loads the lane's blocks of step g.
    auto load = [&](int g) {
        u64 row = (u64)g * 8 + sub;
#pragma unroll
        for (int j = 0; j < HEAD_BLOCKS; j++) {
            int b = part + 4 * j;
            if (b < bpr && row < (u64)n) {
                u64 blk = row * bpr + b;
                const uint4* q = (const uint4*)(w + 32 * blk);
                qa[j] = q[0];
                qb[j] = q[1];
                dw[j] = half_u16(*(const u16*)(w + 32 * nblk + 2 * blk));
            }
        }
    };
    int g = blockIdx.x * HEAD_WARPS + wi;
    if (g < steps) load(g);
    if (threadIdx.x == 0) sbad = 0;
    pdl_wait();
    for (int i = threadIdx.x; i < (int)(xq_bytes(k) / 16); i += blockDim.x) ((uint4*)sx)[i] = ((const uint4*)xq)[i];
    __syncthreads();
    float best = -INFINITY;
    int idx = 0x7fffffff, bad = 0;
    for (; g < steps; g += warps) {
        u64 row = (u64)g * 8 + sub;
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < HEAD_BLOCKS; j++) {
            int b = part + 4 * j;
            if (b < bpr && row < (u64)n) {
                XGroup x0 = xgroup(sx, k, 32 * b), x1 = xgroup(sx, k, 32 * b + 16);
                u32 a[4] = {qa[j].x, qa[j].y, qa[j].z, qa[j].w}, c[4] = {qb[j].x, qb[j].y, qb[j].z, qb[j].w};
                acc += dw[j] * x0.d * (float)(dotq16(a, x0) + dotq16(c, x1));
            }
        }
        if (g + warps < steps) load(g + warps);
        acc += __shfl_xor_sync(0xffffffffu, acc, 1);
        acc += __shfl_xor_sync(0xffffffffu, acc, 2);
        if (row < (u64)n) {
            if (!(fabsf(acc) <= 3.402823466e38f)) bad = 1;
            // Rows come in increasing order: a strict comparison keeps the lowest index.
            if (acc > best) {
                best = acc;
                idx = (int)row;
            }
        }
    }
    u64 key = warp_max_key(idx != 0x7fffffff ? argmax_key(best, idx) : 0);
    if (__any_sync(0xffffffffu, bad) && lane == 0) sbad = 1;
    if (lane == 0) sbest[wi] = key;
    __syncthreads();
    if (threadIdx.x == 0) {
        u64 b = 0;
        for (int i = 0; i < HEAD_WARPS; i++) b = sbest[i] > b ? sbest[i] : b;
        if (b) atomicMax((unsigned long long*)&aslots[blockIdx.x % ARGMAX_SLOTS], (unsigned long long)b);
        if (sbad) atomicOr((u32*)(aslots + MV_ROWS * ARGMAX_SLOTS), 1u);
        last = arrive(acnt, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last || wi != 0) return;
    acquire();
    argmax_reduce(aslots, aout, acnt, 1, lane);
}

// out[r, :] = dequant(W[ids[r], :]) * scale; one block per row, one thread per sub-block.
template <int T>
__device__ __forceinline__ void embed(const Mat& m, const int* ids, float* out, int k, float scale) {
    pdl_wait();
    int r = blockIdx.x;
    u64 row = (u64)ids[r];
    for (int s = threadIdx.x; s < (k >> 5); s += blockDim.x) {
        float v[32];
        sub32<T>(m, row, s, v);
        float* o = out + (u64)r * k + 32 * s;
#pragma unroll
        for (int i = 0; i < 32; i++) o[i] = v[i] * scale;
    }
}

// out[r, :] = dequant(W[r, :]) for rows 0..count (f32, for the GEMM path).
template <int T>
__device__ __forceinline__ void dequant(const Mat& m, float* out, int k, u64 count) {
    pdl_wait();
    u64 subs = (u64)(k >> 5);
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count * subs) return;
    u64 r = i / subs;
    int s = (int)(i % subs);
    float v[32];
    sub32<T>(m, r, s, v);
    float4* o = (float4*)(out + r * k + 32 * s);
#pragma unroll
    for (int q = 0; q < 8; q++) o[q] = make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
}

// Quantizes rows of x (k a multiple of 32) for the matrix-vector kernels: one warp per 32 elements.
extern "C" __global__ void quantize_rows(const float* x, u8* xq, int k, int rows) {
    pdl_release();
    pdl_wait();
    u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 r = e / k;
    if (r >= (u64)rows) return;
    int i = (int)(e % k);
    quantize32(x[e], xq + r * xq_bytes(k), k, i);
}

// ---------------------------------------------------------------------------------------------
// Tensor-core products of many activation rows (`mmq`, sm_80 and later): out[r, o] = x[r, :] .
// W[o, :] for the rows of a batched decode step or a prompt, x given quantized (quantize_rows).
// Integer mma with the two byte levels of an activation as two rows of A (A rows 0-7: hi of 8
// activation rows, rows 8-15: lo) and 8 weight rows' integer levels as B, 32 (or 16) elements a
// product: lane (g, t) then holds row g's hi and lo sums against weight rows 2t and 2t + 1, exact,
// which the sub-block's scales turn into floats as the matrix-vector kernels do (same activations,
// same numbers up to the order of the float sums). A block's 32 activation rows and 8-128 weight
// rows are staged through shared memory in stages of 128 elements (4 sub-blocks), the next
// MMQ_STAGES - 1 stages in flight as cp.async copies while one is multiplied, and every warp
// reads its fragments there: a weight byte is read from memory once per 32 activation rows, an
// activation byte once per block of weight rows.
// ---------------------------------------------------------------------------------------------

// Not `volatile`: a product has no side effect, so the compiler may move it among the fragment
// loads around it. d[4] = A (16 x 32 signed bytes: a0 = row g, elements 4t..; a1 = row g + 8;
// a2, a3 the same 16 elements on) times B (32 x 8 signed bytes: b0 = column g, elements 4t..; b1
// 16 on).
__device__ __forceinline__ void mma_k32(int (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(0));
#endif
}
// The same over 16 elements (a0 = row g, a1 = row g + 8, b0 = column g; elements 4t..).
__device__ __forceinline__ void mma_k16(int (&d)[4], u32 a0, u32 a1, u32 b0) {
#if __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%7,%7,%7};"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(a0), "r"(a1), "r"(b0), "r"(0));
#endif
}

// A 4-byte aligned word.
__device__ __forceinline__ u32 ld32(const u8* p) { return *(const u32*)p; }

#define MMQ_WARPS 4
#define MMQ_ROWS 32
#define MMQ_K 128
#define MMQ_STAGES 3
// Bytes of an activation row in a stage: hi levels 128, lo levels 128, 16 of padding (the 8 rows
// of a fragment then start 4 banks apart: conflict-free loads).
#define MMQ_XS 272
// cp.async copies of 16 bytes that bring one activation row's share of a stage: 8 of hi levels,
// 8 of lo levels, 4 of scales ({d, level sum} for its 8 16-element halves).
#define MMQ_XUNITS 20

// Per format, a weight row's share of one stage j (elements 128j..128j + 127): STRIDE bytes in
// shared memory (4 more than a multiple of 8 words: the 8 rows of a fragment start 4 banks apart),
// copied as UNITS cp.async copies (`copy` issues unit u); from it, `frag` gives a lane's B fragment
// of sub-block i (0..3) of stage j (elements 4t..4t + 3 in b0, 16 later in b1, signed bytes) and
// `scales` an output row's scale and offset (w = d * level - mn; per 16-element half: .x the first,
// .y the second; HALVES: the halves have scales of their own, so the products are taken 16
// elements at a time; SHARE_SCALES: see WarpScales). The 32-element formats, Q3_K and Q6_K are uploaded planar
// (weights.rs).
template <int T> struct Tile;
// A planar K-quant's d for stage j of a row, from the aligned 4-byte word of its d plane that a
// tile copied (`word`): the high half for odd blocks (block (row, j / 2) is row * blocks per row +
// j / 2).
template <int T> __device__ __forceinline__ float tile_d(const u8* word, const Mat& m, u64 row, int j) {
    const u32 odd = ((u32)row & (u32)(m.rb / Fmt<T>::bytes) & 1u) ^ ((u32)(j >> 1) & 1u);
    return half_u16((ld32(word) >> (16 * odd)) & 0xffff);
}
template <> struct Tile<F_Q4_K> {
    static const bool HALVES = false;
    static const bool SHARE_SCALES = true;
    static const int STRIDE = 80, UNITS = 5;
    // [the super-block's 16 header bytes][the 64 level bytes of the stage's sub-blocks]
    static __device__ __forceinline__ void copy(const Mat& m, u64 row, int j, u8* dst, int u) {
        const u8* b = m.w + row * m.rb + 144 * (u64)(j >> 1);
        cp_async16(dst + 16 * u, u == 0 ? b : b + 16 + 64 * (j & 1) + 16 * (u - 1));
    }
    static __device__ __forceinline__ void frag(const u8* r, int i, int, int t, u32& b0, u32& b1) {
        const u8* q = r + 16 + 32 * (i >> 1) + 4 * t;
        const int sh = 4 * (i & 1);
        b0 = (ld32(q) >> sh) & 0x0f0f0f0fu;
        b1 = (ld32(q + 16) >> sh) & 0x0f0f0f0fu;
    }
    static __device__ __forceinline__ void scales(const u8* r, int i, int j, const Mat&, u64, float2& d, float2& mn) {
        const uint4 h = *(const uint4*)r;
        u32 sc2, mn2;
        q4k_pair_scales(h, 2 * (j & 1) + (i >> 1), &sc2, &mn2);
        const int sh = 8 * (i & 1);
        const float dd = half_u16(h.x & 0xffff) * (float)((sc2 >> sh) & 0xff);
        const float mm = half_u16(h.x >> 16) * (float)((mn2 >> sh) & 0xff);
        d = make_float2(dd, dd);
        mn = make_float2(mm, mm);
    }
};
template <> struct Tile<F_Q5_K> {
    static const bool HALVES = false;
    static const bool SHARE_SCALES = true;
    static const int STRIDE = 112, UNITS = 7;
    // [the super-block's 16 header bytes][its 32 high-bit bytes][the 64 level bytes of the stage's
    // sub-blocks]: Q4_K's tile with the high bits (bit s of byte l: element l of sub-block s).
    static __device__ __forceinline__ void copy(const Mat& m, u64 row, int j, u8* dst, int u) {
        const u8* b = m.w + row * m.rb + 176 * (u64)(j >> 1);
        cp_async16(dst + 16 * u, u < 3 ? b + 16 * u : b + 48 + 64 * (j & 1) + 16 * (u - 3));
    }
    static __device__ __forceinline__ void frag(const u8* r, int i, int j, int t, u32& b0, u32& b1) {
        const u8* q = r + 48 + 32 * (i >> 1) + 4 * t;
        const int sh = 4 * (i & 1), s = 4 * (j & 1) + i;
        b0 = ((ld32(q) >> sh) & 0x0f0f0f0fu) | (((ld32(r + 16 + 4 * t) >> s) & 0x01010101u) << 4);
        b1 = ((ld32(q + 16) >> sh) & 0x0f0f0f0fu) | (((ld32(r + 32 + 4 * t) >> s) & 0x01010101u) << 4);
    }
    static __device__ __forceinline__ void scales(const u8* r, int i, int j, const Mat& m, u64 row, float2& d, float2& mn) {
        Tile<F_Q4_K>::scales(r, i, j, m, row, d, mn);
    }
};
template <> struct Tile<F_Q6_K> {
    static const bool HALVES = true;
    static const bool SHARE_SCALES = true;
    static const int STRIDE = 112, UNITS = 8;
    // [ql: 64 bytes][qh: 32][the half's 8 scales][the aligned 4-byte word holding d]
    static __device__ __forceinline__ void copy(const Mat& m, u64 row, int j, u8* dst, int u) {
        const u64 g = block_of<F_Q6_K>(m, row, j >> 1);
        const int n = j & 1;
        if (u < 4)
            cp_async16(dst + 16 * u, m.w + 128 * g + 64 * n + 16 * u);
        else if (u < 6)
            cp_async16(dst + 16 * u, m.w + 128 * m.nblk + 64 * g + 32 * n + 16 * (u - 4));
        else if (u == 6)
            cp_async8(dst + 96, m.w + 192 * m.nblk + 16 * g + 8 * n);
        else
            cp_async4(dst + 104, m.w + ((208 * m.nblk + 2 * g) & ~(u64)3));
    }
    static __device__ __forceinline__ void frag(const u8* r, int i, int, int t, u32& b0, u32& b1) {
        const u8* l = r + 32 * (i & 1) + 4 * t;
        const u8* h = r + 64 + 4 * t;
        const int nib = 4 * (i >> 1), hs = 2 * i;
        b0 = ((ld32(l) >> nib) & 0x0f0f0f0fu) | (((ld32(h) >> hs) & 0x03030303u) << 4);
        b1 = ((ld32(l + 16) >> nib) & 0x0f0f0f0fu) | (((ld32(h + 16) >> hs) & 0x03030303u) << 4);
    }
    static __device__ __forceinline__ void scales(const u8* r, int i, int j, const Mat& m, u64 row, float2& d, float2& mn) {
        const u32 sc = *(const u16*)(r + 96 + 2 * i);
        const float dd = tile_d<F_Q6_K>(r + 104, m, row, j);
        d = make_float2(dd * (float)(i8)(sc & 0xff), dd * (float)(i8)(sc >> 8));
        mn = make_float2(32.f * d.x, 32.f * d.y);
    }
};
template <> struct Tile<F_Q8_0> {
    static const bool HALVES = false;
    static const bool SHARE_SCALES = false;
    static const int STRIDE = 144, UNITS = 9;
    // [the 4 blocks' 128 level bytes][their 4 scales]
    static __device__ __forceinline__ void copy(const Mat& m, u64 row, int j, u8* dst, int u) {
        const u64 g = block_of<F_Q8_0>(m, row, 4 * j);
        if (u < 8)
            cp_async16(dst + 16 * u, m.w + 32 * g + 16 * u);
        else
            cp_async8(dst + 128, m.w + 32 * m.nblk + 2 * g);
    }
    static __device__ __forceinline__ void frag(const u8* r, int i, int, int t, u32& b0, u32& b1) {
        b0 = ld32(r + 32 * i + 4 * t);
        b1 = ld32(r + 32 * i + 16 + 4 * t);
    }
    static __device__ __forceinline__ void scales(const u8* r, int i, int, const Mat&, u64, float2& d, float2& mn) {
        const float dd = half_u16(*(const u16*)(r + 128 + 2 * i));
        d = make_float2(dd, dd);
        mn = make_float2(0.f, 0.f);
    }
};
template <> struct Tile<F_Q4_0> {
    static const bool HALVES = false;
    static const bool SHARE_SCALES = false;
    static const int STRIDE = 80, UNITS = 5;
    // [the 4 blocks' 64 level bytes][their 4 scales][8 bytes of padding]
    static __device__ __forceinline__ void copy(const Mat& m, u64 row, int j, u8* dst, int u) {
        const u64 g = block_of<F_Q4_0>(m, row, 4 * j);
        if (u < 4)
            cp_async16(dst + 16 * u, m.w + 16 * g + 16 * u);
        else
            cp_async8(dst + 64, m.w + 16 * m.nblk + 2 * g);
    }
    static __device__ __forceinline__ void frag(const u8* r, int i, int, int t, u32& b0, u32& b1) {
        const u32 w = ld32(r + 16 * i + 4 * t);
        b0 = w & 0x0f0f0f0fu;
        b1 = (w >> 4) & 0x0f0f0f0fu;
    }
    static __device__ __forceinline__ void scales(const u8* r, int i, int, const Mat&, u64, float2& d, float2& mn) {
        const float dd = half_u16(*(const u16*)(r + 64 + 2 * i));
        d = make_float2(dd, dd);
        mn = make_float2(8.f * dd, 8.f * dd);
    }
};
template <> struct Tile<F_Q5_0> {
    static const bool HALVES = false;
    static const bool SHARE_SCALES = false;
    static const int STRIDE = 112, UNITS = 6;
    // [the 4 blocks' 64 level bytes][their 4 high-bit words][their 4 scales]
    static __device__ __forceinline__ void copy(const Mat& m, u64 row, int j, u8* dst, int u) {
        const u64 g = block_of<F_Q5_0>(m, row, 4 * j);
        if (u < 4)
            cp_async16(dst + 16 * u, m.w + 16 * g + 16 * u);
        else if (u == 4)
            cp_async16(dst + 64, m.w + 16 * m.nblk + 4 * g);
        else
            cp_async8(dst + 80, m.w + 20 * m.nblk + 2 * g);
    }
    static __device__ __forceinline__ void frag(const u8* r, int i, int, int t, u32& b0, u32& b1) {
        const u32 w = ld32(r + 16 * i + 4 * t), qh = ld32(r + 64 + 4 * i) >> (4 * t);
        b0 = (w & 0x0f0f0f0fu) | (spread4(qh) << 4);
        b1 = ((w >> 4) & 0x0f0f0f0fu) | (spread4(qh >> 16) << 4);
    }
    static __device__ __forceinline__ void scales(const u8* r, int i, int, const Mat&, u64, float2& d, float2& mn) {
        const float dd = half_u16(*(const u16*)(r + 80 + 2 * i));
        d = make_float2(dd, dd);
        mn = make_float2(16.f * dd, 16.f * dd);
    }
};
template <> struct Tile<F_Q4_1> {
    static const bool HALVES = false;
    static const bool SHARE_SCALES = false;
    static const int STRIDE = 80, UNITS = 5;
    // [the 4 blocks' 64 level bytes][their 4 {d, m} pairs]
    static __device__ __forceinline__ void copy(const Mat& m, u64 row, int j, u8* dst, int u) {
        const u64 g = block_of<F_Q4_1>(m, row, 4 * j);
        cp_async16(dst + 16 * u, u < 4 ? m.w + 16 * g + 16 * u : m.w + 16 * m.nblk + 4 * g);
    }
    static __device__ __forceinline__ void frag(const u8* r, int i, int j, int t, u32& b0, u32& b1) {
        Tile<F_Q4_0>::frag(r, i, j, t, b0, b1);
    }
    static __device__ __forceinline__ void scales(const u8* r, int i, int, const Mat&, u64, float2& d, float2& mn) {
        const u32 dm = ld32(r + 64 + 4 * i);
        const float dd = half_u16(dm & 0xffff), mm = -half_u16(dm >> 16);
        d = make_float2(dd, dd);
        mn = make_float2(mm, mm);
    }
};
template <> struct Tile<F_Q5_1> {
    static const bool HALVES = false;
    static const bool SHARE_SCALES = false;
    static const int STRIDE = 112, UNITS = 6;
    // [the 4 blocks' 64 level bytes][their 4 high-bit words][their 4 {d, m} pairs][16 bytes of padding]
    static __device__ __forceinline__ void copy(const Mat& m, u64 row, int j, u8* dst, int u) {
        const u64 g = block_of<F_Q5_1>(m, row, 4 * j);
        cp_async16(dst + 16 * u, u < 4 ? m.w + 16 * g + 16 * u : m.w + (16 + 4 * (u - 4)) * m.nblk + 4 * g);
    }
    static __device__ __forceinline__ void frag(const u8* r, int i, int j, int t, u32& b0, u32& b1) {
        Tile<F_Q5_0>::frag(r, i, j, t, b0, b1);
    }
    static __device__ __forceinline__ void scales(const u8* r, int i, int, const Mat&, u64, float2& d, float2& mn) {
        const u32 dm = ld32(r + 80 + 4 * i);
        const float dd = half_u16(dm & 0xffff), mm = -half_u16(dm >> 16);
        d = make_float2(dd, dd);
        mn = make_float2(mm, mm);
    }
};

template <> struct Tile<F_Q2_K> {
    static const bool HALVES = true;
    static const bool SHARE_SCALES = true;
    static const int STRIDE = 48, UNITS = 11;
    // [the half's 32 level bytes][its 8 scale bytes][d, dmin][4 bytes of padding], copied 4 bytes
    // at a time (ggml's 84-byte blocks are 4-byte aligned).
    static __device__ __forceinline__ void copy(const Mat& m, u64 row, int j, u8* dst, int u) {
        const u8* b = m.w + row * m.rb + 84 * (u64)(j >> 1);
        const int n = j & 1;
        cp_async4(dst + 4 * u, u < 8 ? b + 16 + 32 * n + 4 * u : u < 10 ? b + 8 * n + 4 * (u - 8) : b + 80);
    }
    static __device__ __forceinline__ void frag(const u8* r, int i, int, int t, u32& b0, u32& b1) {
        b0 = (ld32(r + 4 * t) >> (2 * i)) & 0x03030303u;
        b1 = (ld32(r + 16 + 4 * t) >> (2 * i)) & 0x03030303u;
    }
    static __device__ __forceinline__ void scales(const u8* r, int i, int, const Mat&, u64, float2& d, float2& mn) {
        q2k_scales(*(const u16*)(r + 32 + 2 * i), ld32(r + 40), d, mn);
    }
};
template <> struct Tile<F_Q3_K> {
    static const bool HALVES = true;
    static const bool SHARE_SCALES = true;
    static const int STRIDE = 80, UNITS = 8;
    // [the half's 32 low-bit bytes][the block's 32 high-bit bytes][its 12 scale bytes][the aligned
    // 4-byte word holding d] (planar, see sub32<F_Q3_K>).
    static __device__ __forceinline__ void copy(const Mat& m, u64 row, int j, u8* dst, int u) {
        const u64 g = block_of<F_Q3_K>(m, row, j >> 1);
        if (u < 2)
            cp_async16(dst + 16 * u, m.w + 32 * m.nblk + 64 * g + 32 * (j & 1) + 16 * u);
        else if (u < 4)
            cp_async16(dst + 16 * u, m.w + 32 * g + 16 * (u - 2));
        else if (u < 7)
            cp_async4(dst + 64 + 4 * (u - 4), m.w + 96 * m.nblk + 12 * g + 4 * (u - 4));
        else
            cp_async4(dst + 76, m.w + ((108 * m.nblk + 2 * g) & ~(u64)3));
    }
    static __device__ __forceinline__ void frag(const u8* r, int i, int j, int t, u32& b0, u32& b1) {
        const int hb = 4 * (j & 1) + i;
        b0 = q3k_levels(ld32(r + 4 * t), ld32(r + 32 + 4 * t), i, hb);
        b1 = q3k_levels(ld32(r + 16 + 4 * t), ld32(r + 48 + 4 * t), i, hb);
    }
    static __device__ __forceinline__ void scales(const u8* r, int i, int j, const Mat& m, u64 row, float2& d, float2& mn) {
        const float dd = tile_d<F_Q3_K>(r + 76, m, row, j);
        const int h = 8 * (j & 1) + 2 * i;
        d = make_float2(dd * (float)q3k_scale(r + 64, h), dd * (float)q3k_scale(r + 64, h + 1));
        mn = make_float2(4.f * d.x, 4.f * d.y);
    }
};

// Bytes of one stage of a block of `xr` activation rows and `bw` weight rows in format T: activation
// levels, activation scales ({d, level sum} per 16 elements: 64 bytes a row), weight rows
// (`MmqBlock::shared` in exec.rs).
template <int T> __device__ constexpr int mmq_stage(int xr, int bw) { return xr * MMQ_XS + xr * 64 + bw * Tile<T>::STRIDE; }

// Activation rows of a few-row block (`mmqf`): A holds 16 weight rows, B 4 activation rows' hi and
// lo levels as 8 columns (column 2t: row t's hi, 2t + 1: its lo), so lane (g, t) holds weight rows
// g and g + 8 against activation row t, both levels; a block takes two such groups of 4 rows.
#define MMQF_ROWS 8
// Stages of a few-row block (4 measured faster than 6 and 10 at 270M widths, as wide blocks then
// keep two a multiprocessor: bench/RESULTS.md "issue 4w").
#define MMQF_STAGES 4

// One product of A (a0, a1: rows g, g + 8, elements 4t..; a2, a3: 16 on) and B (b0, b1): over 32
// elements into p, or, where the format's halves have scales of their own, over each half (the
// first into p, the second into q).
template <bool HALVES>
__device__ __forceinline__ void mmq_mma(int (&p)[4], int (&q)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    if constexpr (HALVES) {
        mma_k16(p, a0, a1, b0);
        mma_k16(q, a2, a3, b1);
    } else {
        mma_k32(p, a0, a1, a2, a3, b0, b1);
    }
}

// One product's share of an output: `acc += ds.x * (d * level sum - mn * activation level sum)`,
// the level sums 254 hi + lo from a product's hi and lo results, per 16-element half where the
// format's halves have scales of their own (h1, l1, sa1: the second half's; else sa = sa0 + sa1).
template <bool HALVES>
__device__ __forceinline__ void mmq_scale(float& acc, float dsx, float2 d, float2 mn, int h0, int l0, int h1, int l1, int sa0, int sa1, float sa) {
    if constexpr (HALVES)
        acc += dsx * (d.x * (float)(254 * h0 + l0) - mn.x * (float)sa0 + d.y * (float)(254 * h1 + l1) - mn.y * (float)sa1);
    else
        acc += dsx * (d.x * (float)(254 * h0 + l0) - mn.x * sa);
}

// The scales of the weight rows wt + o (o < rows <= 32) of a warp for sub-block i of stage jg, as
// `Tile::scales` gives them. Where their decoding costs more than handing them over (a Q4_K row's
// 6-bit pairs, a Q6_K row's two scales: SHARE_SCALES), each lane decodes one row's (wt + lane %
// rows) and `row` hands row wt + o's to the lanes that multiply it by shuffles; before, every lane
// decoded each of its rows itself, 4 or 8 lanes the same row (`mmq128_q4_k` 5,080 -> 3,960
// instructions, 168 -> 134 registers). Same floats either way.
template <int T> struct WarpScales {
    const u8* ws;
    const Mat& m;
    u64 w0;
    int wt, i, jg;
    float2 d, mn;
    __device__ __forceinline__ WarpScales(const u8* ws, int wt, int rows, int i, int jg, const Mat& m, u64 w0)
        : ws(ws), m(m), w0(w0), wt(wt), i(i), jg(jg) {
        if constexpr (Tile<T>::SHARE_SCALES) {
            const int r = wt + (int)(threadIdx.x & 31) % rows;
            Tile<T>::scales(ws + r * Tile<T>::STRIDE, i, jg, m, w0 + r, d, mn);
        }
    }
    __device__ __forceinline__ void row(int o, float2& dr, float2& mnr) const {
        if constexpr (Tile<T>::SHARE_SCALES) {
            dr.x = __shfl_sync(0xffffffffu, d.x, o);
            mnr.x = __shfl_sync(0xffffffffu, mn.x, o);
            if constexpr (Tile<T>::HALVES) {
                dr.y = __shfl_sync(0xffffffffu, d.y, o);
                mnr.y = __shfl_sync(0xffffffffu, mn.y, o);
            } else {
                dr.y = dr.x;
                mnr.y = mnr.x;
            }
        } else {
            Tile<T>::scales(ws + (wt + o) * Tile<T>::STRIDE, i, jg, m, w0 + wt + o, dr, mnr);
        }
    }
};

// The stages of one `mmq` block (below): acc[jb][g] += its products over all of k (XR = MMQ_ROWS:
// jb a warp's group of 8 weight rows, g a group of 8 activation rows; XR = MMQF_ROWS: jb a group of
// 16 weight rows, g a group of 4 activation rows). FULL: the block has all its groups of
// activation rows, so the group loop runs unchecked and the compiler can overlap one group's
// shared-memory loads with another's products (the checked loop, which partial blocks keep, made
// every block as slow as a partial one).
template <int T, int XR, int ST, int NB, int KS, bool FULL, class CopyW, class CopyX>
__device__ __forceinline__ void mmq_walk(float (&acc)[NB][XR == MMQ_ROWS ? 4 : 2][2], const Mat& m, u8* sm, int j0, int steps, int groups,
                                         u64 w0, const CopyW& copy_w, const CopyX& copy_x) {
    constexpr bool FEW = XR == MMQF_ROWS;
    constexpr int G = FEW ? 2 : 4, WR = FEW ? 16 : 8;
    constexpr int BW = WR * NB * (MMQ_WARPS / KS), XB = XR * MMQ_XS, SB = XR * 64, STAGE = mmq_stage<T>(XR, BW);
    const int lane = threadIdx.x & 31, wi = threadIdx.x >> 5, gid = lane >> 2, tid = lane & 3;
    const int part = wi % KS, wt = WR * NB * (wi / KS);
    for (int j = 0; j < steps; j++) {
        cp_async_wait<ST - 2>();
        __syncthreads();
        // Stage j + ST - 1 goes where stage j - 1 was: every warp is past it.
        if (j + ST - 1 < steps) {
            copy_w(j + ST - 1);
            copy_x(j + ST - 1);
        }
        cp_async_commit();
        const u8* st = sm + (j % ST) * STAGE;
        const float4* xsc = (const float4*)(st + XB);
        const u8* ws = st + XB + SB;
        if constexpr (FEW) {
#pragma unroll
            for (int i = part; i < 4; i += KS) {
                // A: weight rows g (a0, a2) and g + 8 (a1, a3) of each group of 16.
                u32 a[NB][4];
                float2 d0[NB], m0[NB], d1[NB], m1[NB];
                const WarpScales<T> sc(ws, wt, WR * NB, i, j0 + j, m, w0);
#pragma unroll
                for (int jb = 0; jb < NB; jb++) {
                    const int r = wt + 16 * jb + gid;
                    Tile<T>::frag(ws + r * Tile<T>::STRIDE, i, j0 + j, tid, a[jb][0], a[jb][2]);
                    Tile<T>::frag(ws + (r + 8) * Tile<T>::STRIDE, i, j0 + j, tid, a[jb][1], a[jb][3]);
                    sc.row(16 * jb + gid, d0[jb], m0[jb]);
                    sc.row(16 * jb + gid + 8, d1[jb], m1[jb]);
                }
#pragma unroll
                for (int g = 0; g < G; g++) {
                    if (!FULL && g >= groups) break;
                    // B column gid: activation row 4 g + gid / 2, its hi (even gid) or lo levels.
                    const u8* xr = st + (4 * g + (gid >> 1)) * MMQ_XS + (gid & 1) * MMQ_K + 32 * i + 4 * tid;
                    const u32 b0 = ld32(xr), b1 = ld32(xr + 16);
                    const float4 ds = xsc[4 * (4 * g + tid) + i];
                    const int sa0 = __float_as_int(ds.y), sa1 = __float_as_int(ds.w);
#pragma unroll
                    for (int jb = 0; jb < NB; jb++) {
                        // p[0], p[1]: weight row g's hi and lo; p[2], p[3]: row g + 8's.
                        int p[4], q[4] = {0, 0, 0, 0};
                        mmq_mma<Tile<T>::HALVES>(p, q, a[jb][0], a[jb][1], a[jb][2], a[jb][3], b0, b1);
                        const float sa = (float)(sa0 + sa1);
                        mmq_scale<Tile<T>::HALVES>(acc[jb][g][0], ds.x, d0[jb], m0[jb], p[0], p[1], q[0], q[1], sa0, sa1, sa);
                        mmq_scale<Tile<T>::HALVES>(acc[jb][g][1], ds.x, d1[jb], m1[jb], p[2], p[3], q[2], q[3], sa0, sa1, sa);
                    }
                }
            }
        } else {
#pragma unroll
            for (int i = part; i < 4; i += KS) {
                u32 b[NB][2];
                float2 d0[NB], m0[NB], d1[NB], m1[NB];
                const WarpScales<T> sc(ws, wt, WR * NB, i, j0 + j, m, w0);
#pragma unroll
                for (int jb = 0; jb < NB; jb++) {
                    const int r = wt + 8 * jb;
                    Tile<T>::frag(ws + (r + gid) * Tile<T>::STRIDE, i, j0 + j, tid, b[jb][0], b[jb][1]);
                    sc.row(8 * jb + 2 * tid, d0[jb], m0[jb]);
                    sc.row(8 * jb + 2 * tid + 1, d1[jb], m1[jb]);
                }
#pragma unroll
                for (int g = 0; g < 4; g++) {
                    if (!FULL && g >= groups) break;
                    const u8* xr = st + (8 * g + gid) * MMQ_XS + 32 * i + 4 * tid;
                    const u32 h0 = ld32(xr), l0 = ld32(xr + MMQ_K), h1 = ld32(xr + 16), l1 = ld32(xr + MMQ_K + 16);
                    const float4 ds = xsc[4 * (8 * g + gid) + i];
                    const int sa0 = __float_as_int(ds.y), sa1 = __float_as_int(ds.w);
#pragma unroll
                    for (int jb = 0; jb < NB; jb++) {
                        // p[0], p[2]: weight row 2t's hi and lo; p[1], p[3]: row 2t + 1's.
                        int p[4], q[4] = {0, 0, 0, 0};
                        mmq_mma<Tile<T>::HALVES>(p, q, h0, l0, h1, l1, b[jb][0], b[jb][1]);
                        const float sa = (float)(sa0 + sa1);
                        mmq_scale<Tile<T>::HALVES>(acc[jb][g][0], ds.x, d0[jb], m0[jb], p[0], p[2], q[0], q[2], sa0, sa1, sa);
                        mmq_scale<Tile<T>::HALVES>(acc[jb][g][1], ds.x, d1[jb], m1[jb], p[1], p[3], q[1], q[3], sa0, sa1, sa);
                    }
                }
            }
        }
    }
}

// out[r, o] (row-major, n wide) for activation rows r < rows of xq (quantize_rows' layout, k a
// multiple of MMQ_K): block (x, y) takes activation rows XR x.. and weight rows BW y.., BW =
// WR NB MMQ_WARPS / KS (WR = 8 weight rows a product for XR = MMQ_ROWS, 16 for MMQF_ROWS); its
// warps form teams of KS that share WR NB weight rows, each warp of a team taking every KS-th
// sub-block of a stage, summed over the team at the end. With gridDim.z = Z > 1 (few-row blocks of
// KS = 1 only), block z takes the z-th of Z runs of stages over k, writes its sums to `part` and the last block
// of (x, y) to arrive (counted in `cnt`, which it resets) adds the Z partial sums in order of z
// (every run gets the same bits whichever block is last) and writes the outputs.
template <int T, int XR, int ST, int NB, int KS>
__device__ __forceinline__ void mmq(const Mat& m, int n, const u8* xq, int k, int rows, float* out, float* part, u32* cnt) {
    constexpr bool FEW = XR == MMQF_ROWS;
    constexpr int G = FEW ? 2 : 4, WR = FEW ? 16 : 8, XG = XR / G;
    constexpr int BW = WR * NB * (MMQ_WARPS / KS), XB = XR * MMQ_XS, SB = XR * 64, STAGE = mmq_stage<T>(XR, BW);
    extern __shared__ uint4 mmq_smem[];
    u8* const sm = (u8*)mmq_smem;
    const int lane = threadIdx.x & 31, wi = threadIdx.x >> 5, gid = lane >> 2, tid = lane & 3;
    const int team = wi / KS, part_of = wi % KS;
    const int a0 = XR * (int)blockIdx.x, groups = min(G, (rows - a0 + XG - 1) / XG);
    const u64 w0 = (u64)BW * blockIdx.y;
    // This block's run of stages: [j0, j0 + steps) (all of them but in a few-row block of one team
    // a warp: only those take runs, and the other kernels keep their code).
    constexpr bool SPLIT = FEW && KS == 1;
    const int all_steps = k / MMQ_K, per = SPLIT ? (all_steps + (int)gridDim.z - 1) / (int)gridDim.z : all_steps;
    const int j0 = SPLIT ? (int)blockIdx.z * per : 0, steps = SPLIT ? max(0, min(all_steps, j0 + per) - j0) : all_steps;
    const int xrows = min(XR, rows - a0), wrows = (int)min((u64)BW, (u64)n - w0);
    const u64 xqb = xq_bytes(k);
    auto copy_w = [&](int j) {
        u8* dst = sm + (j % ST) * STAGE + XB + SB;
        for (int c = threadIdx.x; c < wrows * Tile<T>::UNITS; c += 32 * MMQ_WARPS)
            Tile<T>::copy(m, w0 + c / Tile<T>::UNITS, j0 + j, dst + (c / Tile<T>::UNITS) * Tile<T>::STRIDE, c % Tile<T>::UNITS);
    };
    auto copy_x = [&](int j) {
        u8* dst = sm + (j % ST) * STAGE;
        const int jg = j0 + j;
        for (int c = threadIdx.x; c < xrows * MMQ_XUNITS; c += 32 * MMQ_WARPS) {
            const int r = c / MMQ_XUNITS, u = c % MMQ_XUNITS;
            const u8* src = xq + (u64)(a0 + r) * xqb;
            if (u < 8)
                cp_async16(dst + r * MMQ_XS + 16 * u, src + MMQ_K * jg + 16 * u);
            else if (u < 16)
                cp_async16(dst + r * MMQ_XS + 16 * u, src + k + MMQ_K * jg + 16 * (u - 8));
            else
                cp_async16(dst + XB + 64 * r + 16 * (u - 16), src + 2 * (u64)k + 64 * jg + 16 * (u - 16));
        }
    };
    // The weights of the first stages are asked for before waiting for the kernel before (nothing
    // in a step writes them), the activations after.
    for (int j = 0; j < ST - 1; j++)
        if (j < steps) copy_w(j);
    pdl_wait();
    for (int j = 0; j < ST - 1; j++) {
        if (j < steps) copy_x(j);
        cp_async_commit();
    }
    float acc[NB][G][2];
#pragma unroll
    for (int jb = 0; jb < NB; jb++)
#pragma unroll
        for (int g = 0; g < G; g++) acc[jb][g][0] = acc[jb][g][1] = 0.f;
    const int wt = WR * NB * team;
    if (groups == G)
        mmq_walk<T, XR, ST, NB, KS, true>(acc, m, sm, j0, steps, groups, w0, copy_w, copy_x);
    else
        mmq_walk<T, XR, ST, NB, KS, false>(acc, m, sm, j0, steps, groups, w0, copy_w, copy_x);
    if constexpr (KS > 1) {
        // The stages are free once every warp is past its last products (no copy is in flight).
        float* red = (float*)sm;
        __syncthreads();
#pragma unroll
        for (int jb = 0; jb < NB; jb++)
#pragma unroll
            for (int g = 0; g < G; g++) {
                red[((wi * NB + jb) * G + g) * 64 + 2 * lane] = acc[jb][g][0];
                red[((wi * NB + jb) * G + g) * 64 + 2 * lane + 1] = acc[jb][g][1];
            }
        __syncthreads();
        if (part_of != 0) return;
#pragma unroll
        for (int jb = 0; jb < NB; jb++)
#pragma unroll
            for (int g = 0; g < G; g++)
#pragma unroll
                for (int w = 1; w < KS; w++) {
                    acc[jb][g][0] += red[(((wi + w) * NB + jb) * G + g) * 64 + 2 * lane];
                    acc[jb][g][1] += red[(((wi + w) * NB + jb) * G + g) * 64 + 2 * lane + 1];
                }
    }
    if (SPLIT && gridDim.z > 1) {
        // Each thread's sums at part[((tile Z + z) NACC + q) threads + thread] (coalesced).
        constexpr int NACC = NB * G * 2, THREADS = 32 * MMQ_WARPS;
        const u64 tile = (u64)blockIdx.y * gridDim.x + blockIdx.x;
        float* mine = part + ((tile * gridDim.z + blockIdx.z) * NACC) * THREADS + threadIdx.x;
#pragma unroll
        for (int q = 0; q < NACC; q++) mine[q * THREADS] = acc[q / (G * 2)][(q / 2) % G][q % 2];
        if (!last_to_arrive(cnt + tile, gridDim.z)) return;
        const float* all = part + (tile * gridDim.z * NACC) * THREADS + threadIdx.x;
        float v[NACC];
#pragma unroll
        for (int q = 0; q < NACC; q++) v[q] = 0.f;
        for (u32 z = 0; z < gridDim.z; z++)
#pragma unroll
            for (int q = 0; q < NACC; q++) v[q] += __ldcg(all + ((u64)z * NACC + q) * THREADS);
#pragma unroll
        for (int q = 0; q < NACC; q++) acc[q / (G * 2)][(q / 2) % G][q % 2] = v[q];
    }
#pragma unroll
    for (int jb = 0; jb < NB; jb++)
#pragma unroll
        for (int g = 0; g < G; g++) {
            // Lane (g, t): activation row 8 g' + g against weight rows 2t, 2t + 1; few rows:
            // activation row 4 g' + t against weight rows g, g + 8.
            if constexpr (FEW) {
                const int a = a0 + 4 * g + tid;
                const u64 o = w0 + wt + 16 * jb + gid;
                if (g < groups && a < rows) {
                    if (o < (u64)n) out[(u64)a * n + o] = acc[jb][g][0];
                    if (o + 8 < (u64)n) out[(u64)a * n + o + 8] = acc[jb][g][1];
                }
            } else {
                const int a = a0 + 8 * g + gid;
                const u64 o = w0 + wt + 8 * jb + 2 * tid;
                if (g < groups && a < rows) {
                    if (o < (u64)n) out[(u64)a * n + o] = acc[jb][g][0];
                    if (o + 1 < (u64)n) out[(u64)a * n + o + 1] = acc[jb][g][1];
                }
            }
        }
}

// mmq{BW}_<fmt>: blocks of 32 activation rows and BW = 128, 64, 32 or 8 weight rows; mmqf{BW}_<fmt>:
// blocks of 8 activation rows and BW = 128, 64, 32 or 16 weight rows (`MmqBlock` in exec.rs).
#define KILN_MMQ1(NAME, T, PRE, XR, ST, BW, NB, KS)                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * MMQ_WARPS)                                                          \
        PRE##BW##_##NAME(const u8* w, u64 rb, u64 nb, int n, const u8* xq, int k, int rows, float* out, float* part,      \
                         u32* cnt) {                                                                                      \
        mmq<T, XR, ST, NB, KS>(Mat{w, rb, nb}, n, xq, k, rows, out, part, cnt);                                            \
    }
#define KILN_MMQ(NAME, T)                                                                                                 \
    KILN_MMQ1(NAME, T, mmq, MMQ_ROWS, MMQ_STAGES, 128, 4, 1)                                                              \
    KILN_MMQ1(NAME, T, mmq, MMQ_ROWS, MMQ_STAGES, 64, 2, 1)                                                               \
    KILN_MMQ1(NAME, T, mmq, MMQ_ROWS, MMQ_STAGES, 32, 1, 1)                                                               \
    KILN_MMQ1(NAME, T, mmq, MMQ_ROWS, MMQ_STAGES, 8, 1, 4)                                                                \
    KILN_MMQ1(NAME, T, mmqf, MMQF_ROWS, MMQF_STAGES, 128, 2, 1)                                                           \
    KILN_MMQ1(NAME, T, mmqf, MMQF_ROWS, MMQF_STAGES, 64, 1, 1)                                                            \
    KILN_MMQ1(NAME, T, mmqf, MMQF_ROWS, MMQF_STAGES, 32, 1, 2)                                                            \
    KILN_MMQ1(NAME, T, mmqf, MMQF_ROWS, MMQF_STAGES, 16, 1, 4)
KILN_MMQ(q4_k, F_Q4_K)
KILN_MMQ(q6_k, F_Q6_K)
KILN_MMQ(q8_0, F_Q8_0)
KILN_MMQ(q5_0, F_Q5_0)
KILN_MMQ(q5_k, F_Q5_K)
KILN_MMQ(q4_0, F_Q4_0)
KILN_MMQ(q4_1, F_Q4_1)
KILN_MMQ(q5_1, F_Q5_1)
KILN_MMQ(q2_k, F_Q2_K)
KILN_MMQ(q3_k, F_Q3_K)

// Per format: matvec (2 output rows per warp, up to MV_ROWS activation rows), matvec1 (the same for
// one activation row, with the norm prologue), matvec4 (4 output rows per warp, one activation row:
// large matrices; chunks staged through MV_STAGES shared-memory stages where the format can),
// matvec4p (the same with the norm prologue: its registers, unused, slowed 12B decode by 4% in
// matvec4), each for a GELU glu (`matvec_<fmt>`, ...: every launch without glu takes these) and a
// SiLU one (`matvec_silu_<fmt>`, ...: KILN_MATVECS's ACTN, the name infix, and ACT); embed, dequant.
// `nb`: blocks of the matrix.
#define MV_ARGS                                                                                                     \
    const u8 *w0, const u8 *w1, const u8 *w2, u64 rb, int n0, int n1, int n2, float *o0, float *o1, float *o2, \
        float *glu, const u8 *xq, int k, int rows, int split, u8 *gq, u32 *gcnt, const float *ew1, \
        const float *er, float *eh, const float *ew2, float *eout, u8 *exq, u32 *ecnt, float eps, u64 *aslots, int *aout, \
        u32 *acnt, const float *px, float *eh2
#define MV_PASS o0, o1, o2, glu, xq, k, rows, split, gq, gcnt, ew1, er, eh, ew2, eout, exq, ecnt, eps, aslots, aout, acnt, px, eh2
#define KILN_MATVECS(NAME, T, ACTN, ACT)                                                                            \
    extern "C" __global__ void __launch_bounds__(128) matvec##ACTN##_##NAME(MV_ARGS) {                             \
        matvec<T, 2, MV_ROWS, 0, false, false, ACT>(w0, w1, w2, rb, n0, n1, n2, MV_PASS);                          \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(128) matvec1##ACTN##_##NAME(MV_ARGS) {                            \
        matvec<T, 2, 1, 0, true, false, ACT>(w0, w1, w2, rb, n0, n1, n2, MV_PASS);                                 \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(128, 4) matvec4##ACTN##_##NAME(MV_ARGS) {                         \
        matvec<T, 4, 1, MV_STAGES, false, true, ACT>(w0, w1, w2, rb, n0, n1, n2, MV_PASS);                         \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(128, 4) matvec4p##ACTN##_##NAME(MV_ARGS) {                        \
        matvec<T, 4, 1, MV_STAGES, true, false, ACT>(w0, w1, w2, rb, n0, n1, n2, MV_PASS);                         \
    }
#define KILN_FORMAT(NAME, T)                                                                                        \
    KILN_MATVECS(NAME, T, , ACT_GELU)                                                                               \
    KILN_MATVECS(NAME, T, _silu, ACT_SILU)                                                                          \
    extern "C" __global__ void embed_##NAME(const u8* w, u64 rb, u64 nb, const int* ids, float* out, int k,        \
                                            float scale) {                                                          \
        embed<T>(Mat{w, rb, nb}, ids, out, k, scale);                                                               \
    }                                                                                                               \
    extern "C" __global__ void dequant_##NAME(const u8* w, u64 rb, u64 nb, float* out, int k, u64 count) {        \
        dequant<T>(Mat{w, rb, nb}, out, k, count);                                                                  \
    }
KILN_FORMAT(f32, F_F32)
KILN_FORMAT(f16, F_F16)
KILN_FORMAT(bf16, F_BF16)
KILN_FORMAT(q4_0, F_Q4_0)
KILN_FORMAT(q4_1, F_Q4_1)
KILN_FORMAT(q5_0, F_Q5_0)
KILN_FORMAT(q5_1, F_Q5_1)
KILN_FORMAT(q8_0, F_Q8_0)
KILN_FORMAT(q2_k, F_Q2_K)
KILN_FORMAT(q3_k, F_Q3_K)
KILN_FORMAT(q4_k, F_Q4_K)
KILN_FORMAT(q5_k, F_Q5_K)
KILN_FORMAT(q6_k, F_Q6_K)

// matvecr8, matvecr4 and matvecr2 (one activation row, weights streamed through shared memory in
// tiles of 8, 4 or 2 rows; sm_90) for the formats with chunk decoders: those that carry most of a
// model's bytes; each for a GELU glu (`matvecr8_<fmt>`, ...) and a SiLU one (`matvecr8_silu_<fmt>`).
#define KILN_RINGS(NAME, T, ACTN, ACT)                                                                                       \
    extern "C" __global__ void __launch_bounds__(32 * MVR_WARPS, 4) matvecr8##ACTN##_##NAME(MVR_ARGS) {                     \
        matvec_ring<T, 8, MVR_WARPS, ACT>(MVR_PASS);                                                                         \
    }                                                                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * MVR4_WARPS, 2) matvecr4##ACTN##_##NAME(MVR_ARGS) {                    \
        matvec_ring<T, 4, MVR4_WARPS, ACT>(MVR_PASS);                                                                        \
    }                                                                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * MVR_WARPS, 4) matvecr2##ACTN##_##NAME(MVR_ARGS) {                     \
        matvec_ring<T, 2, MVR_WARPS, ACT>(MVR_PASS);                                                                         \
    }
#define KILN_RING(NAME, T) KILN_RINGS(NAME, T, , ACT_GELU) KILN_RINGS(NAME, T, _silu, ACT_SILU)
#define MVR_ARGS                                                                                                             \
    const u8 *w0, const u8 *w1, const u8 *w2, u64 rb, int n0, int n1, int n2, float *o0, float *o1, float *o2,               \
        const float *b0, const float *b1, const float *b2, float *glu, const u8 *xq, int k, int ns, u64 *aslots, int *aout, u32 *acnt
#define MVR_PASS w0, w1, w2, rb, n0, n1, n2, o0, o1, o2, b0, b1, b2, glu, xq, k, ns, aslots, aout, acnt
KILN_RING(q4_k, F_Q4_K)
KILN_RING(q6_k, F_Q6_K)
KILN_RING(q8_0, F_Q8_0)
KILN_RING(q5_0, F_Q5_0)
KILN_RING(q4_0, F_Q4_0)
KILN_RING(q5_k, F_Q5_K)
KILN_RING(q2_k, F_Q2_K)
KILN_RING(q3_k, F_Q3_K)
