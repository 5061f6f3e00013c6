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
// are not 4-byte aligned (Q5_0, Q8_0, Q6_K) are uploaded planar (weights.rs): each field of every
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
template <> __device__ __forceinline__ void aos32<F_Q4_0>(const u8* row, int s, float* v) {
    const u8* b = row + 18 * s;
    float d = half_at(b);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        u8 q = b[2 + j];
        v[j] = (float)((int)(q & 15) - 8) * d;
        v[j + 16] = (float)((int)(q >> 4) - 8) * d;
    }
}
template <> __device__ __forceinline__ void aos32<F_Q4_1>(const u8* row, int s, float* v) {
    const u8* b = row + 20 * s;
    float d = half_at(b), m = half_at(b + 2);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        u8 q = b[4 + j];
        v[j] = (float)(q & 15) * d + m;
        v[j + 16] = (float)(q >> 4) * d + m;
    }
}
template <> __device__ __forceinline__ void aos32<F_Q5_1>(const u8* row, int s, float* v) {
    const u8* b = row + 24 * s;
    float d = half_at(b), m = half_at(b + 2);
    u32 qh = u32_at(b + 4);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        u8 q = b[8 + j];
        int l0 = (q & 15) | (((qh >> j) & 1) << 4);
        int l1 = (q >> 4) | (((qh >> (j + 16)) & 1) << 4);
        v[j] = (float)l0 * d + m;
        v[j + 16] = (float)l1 * d + m;
    }
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
template <> __device__ __forceinline__ void aos32<F_Q3_K>(const u8* row, int s, float* v) {
    const u8* b = row + 110 * (s >> 3);
    int sub = s & 7, n = sub >> 2, j = sub & 3;
    float d = half_at(b + 108);
    const u8* sc = b + 96;
    u8 mask = (u8)(1u << sub);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int i = 8 * n + 2 * j + h;
        int low = i < 8 ? (sc[i] & 15) : (sc[i - 8] >> 4);
        int high = (sc[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
        float dl = d * (float)((low | (high << 4)) - 32);
        const u8* q = b + 32 + 32 * n + 16 * h;
        const u8* hm = b + 16 * h;
#pragma unroll
        for (int l = 0; l < 16; l++) {
            int lv = (q[l] >> (2 * j)) & 3;
            v[16 * h + l] = dl * (float)(lv - ((hm[l] & mask) ? 0 : 4));
        }
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
// Planar Q5_0: qs [16 per block], qh [4], d [2].
template <> __device__ __forceinline__ void sub32<F_Q5_0>(const Mat& m, u64 r, int s, float* v) {
    u64 g = block_of<F_Q5_0>(m, r, s);
    float d = half_u16(*(const u16*)(m.w + 20 * m.nblk + 2 * g));
    u32 qh = *(const u32*)(m.w + 16 * m.nblk + 4 * g);
    uint4 w = *(const uint4*)(m.w + 16 * g);
    u32 ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int j = 0; j < 16; j++) {
        u32 q = (ws[j >> 2] >> (8 * (j & 3))) & 0xff;
        int l0 = (q & 15) | (((qh >> j) & 1) << 4);
        int l1 = (q >> 4) | (((qh >> (j + 16)) & 1) << 4);
        v[j] = (float)(l0 - 16) * d;
        v[j + 16] = (float)(l1 - 16) * d;
    }
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

// ---------------------------------------------------------------------------------------------
// Chunks for the matrix-vector kernels: a row is walked in chunks of 32 elements, two groups of
// 16 consecutive elements at offsets xoff(c, 0) and xoff(c, 1). `load` fetches a chunk's packed
// bytes (16-byte loads where the format has a chunk decoder), `dot` decodes them and returns the
// dot product with the chunk's 32 activations. The generic chunk is a sub-block decoded by sub32.
// ---------------------------------------------------------------------------------------------

#define MAGIC 8388608.f

// Byte k of w as a float 2^23 + byte (exact): the caller subtracts 2^23 + bias.
__device__ __forceinline__ float magic_byte(u32 w, int k) {
    return __int_as_float(__byte_perm(w, 0x4B000000u, 0x7540 | k));
}

// Sum of xs[i] * (byte i of q - bias) over 16 bytes.
__device__ __forceinline__ float dot16(const u32* q, const float* xs, float bias) {
    float s = 0.f, off = MAGIC + bias;
#pragma unroll
    for (int t = 0; t < 4; t++)
#pragma unroll
        for (int k = 0; k < 4; k++) s = fmaf(xs[4 * t + k], magic_byte(q[t], k) - off, s);
    return s;
}

template <int T> struct Chunk {
    struct Raw {
        u64 row;
        int c;
    };
    static __device__ __forceinline__ int xoff(int c, int g) { return 32 * c + 16 * g; }
    static __device__ __forceinline__ Raw load(const Mat& m, u64 row, int c) { return Raw{row, c}; }
    static __device__ __forceinline__ float dot(const Mat& m, const Raw& r, const float* xs) {
        float v[32], s = 0.f;
        sub32<T>(m, r.row, r.c, v);
#pragma unroll
        for (int i = 0; i < 32; i++) s = fmaf(v[i], xs[i], s);
        return s;
    }
};

template <> struct Chunk<F_Q8_0> {
    struct Raw {
        uint4 a, b;
        float d;
    };
    static __device__ __forceinline__ int xoff(int c, int g) { return 32 * c + 16 * g; }
    static __device__ __forceinline__ Raw load(const Mat& m, u64 row, int c) {
        u64 g = block_of<F_Q8_0>(m, row, c);
        const uint4* q = (const uint4*)(m.w + 32 * g);
        return Raw{q[0], q[1], half_u16(*(const u16*)(m.w + 32 * m.nblk + 2 * g))};
    }
    static __device__ __forceinline__ float dot(const Mat&, const Raw& r, const float* xs) {
        const u32 f = 0x80808080u;  // signed bytes to q + 128
        u32 a[4] = {r.a.x ^ f, r.a.y ^ f, r.a.z ^ f, r.a.w ^ f}, b[4] = {r.b.x ^ f, r.b.y ^ f, r.b.z ^ f, r.b.w ^ f};
        return r.d * (dot16(a, xs, 128.f) + dot16(b, xs + 16, 128.f));
    }
};

template <> struct Chunk<F_Q5_0> {
    struct Raw {
        uint4 q;
        u32 h;
        float d;
    };
    static __device__ __forceinline__ int xoff(int c, int g) { return 32 * c + 16 * g; }
    static __device__ __forceinline__ Raw load(const Mat& m, u64 row, int c) {
        u64 g = block_of<F_Q5_0>(m, row, c);
        return Raw{*(const uint4*)(m.w + 16 * g), *(const u32*)(m.w + 16 * m.nblk + 4 * g),
                   half_u16(*(const u16*)(m.w + 20 * m.nblk + 2 * g))};
    }
    static __device__ __forceinline__ float dot(const Mat&, const Raw& r, const float* xs) {
        u32 q[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
        float s = 0.f;
#pragma unroll
        for (int g = 0; g < 2; g++) {
            u32 w[4];
#pragma unroll
            for (int t = 0; t < 4; t++) {
                u32 nib = g ? (q[t] >> 4) & 0x0f0f0f0fu : q[t] & 0x0f0f0f0fu;
                u32 bits = (r.h >> (16 * g + 4 * t)) & 15u;
                w[t] = nib | (((bits * 0x00204081u) & 0x01010101u) << 4);
            }
            s += dot16(w, xs + 16 * g, 16.f);
        }
        return r.d * s;
    }
};

__device__ __forceinline__ u32 byte3(u32 a, u32 b, u32 c, int i) {
    u32 w = i < 4 ? a : i < 8 ? b : c;
    return (w >> (8 * (i & 3))) & 0xff;
}

template <> struct Chunk<F_Q4_K> {
    struct Raw {
        uint4 hdr, q;
        int j;
    };
    // chunk c: super-block c / 8, sub-block pair j = (c % 8) / 2 (low nibbles: sub-block 2j, high:
    // 2j + 1), half h = c % 2 of their 32 elements.
    static __device__ __forceinline__ int xoff(int c, int g) {
        return 256 * (c >> 3) + 64 * ((c & 7) >> 1) + 16 * (c & 1) + 32 * g;
    }
    static __device__ __forceinline__ Raw load(const Mat& m, u64 row, int c) {
        const u8* b = m.w + row * m.rb + 144 * (c >> 3);
        int j = (c & 7) >> 1;
        return Raw{*(const uint4*)b, *(const uint4*)(b + 16 + 32 * j + 16 * (c & 1)), j};
    }
    static __device__ __forceinline__ float dot(const Mat&, const Raw& r, const float* xs) {
        float d = half_u16(r.hdr.x & 0xffff), dmin = half_u16(r.hdr.x >> 16);
        u32 q[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
        float s = 0.f;
#pragma unroll
        for (int g = 0; g < 2; g++) {
            int i = 2 * r.j + g;
            u32 sc, mn;
            if (i < 4) {
                sc = byte3(r.hdr.y, r.hdr.z, r.hdr.w, i) & 63;
                mn = byte3(r.hdr.y, r.hdr.z, r.hdr.w, i + 4) & 63;
            } else {
                u32 hi = byte3(r.hdr.y, r.hdr.z, r.hdr.w, i + 4);
                sc = (hi & 15) | ((byte3(r.hdr.y, r.hdr.z, r.hdr.w, i - 4) >> 6) << 4);
                mn = (hi >> 4) | ((byte3(r.hdr.y, r.hdr.z, r.hdr.w, i) >> 6) << 4);
            }
            float d1 = d * (float)sc, m1 = dmin * (float)mn;
#pragma unroll
            for (int t = 0; t < 4; t++) {
                u32 w = g ? (q[t] >> 4) & 0x0f0f0f0fu : q[t] & 0x0f0f0f0fu;
#pragma unroll
                for (int k = 0; k < 4; k++) s = fmaf(xs[16 * g + 4 * t + k], fmaf(d1, magic_byte(w, k) - MAGIC, -m1), s);
            }
        }
        return s;
    }
};

template <> struct Chunk<F_Q6_K> {
    struct Raw {
        uint4 l0, l1, h;
        float s0, s1;
        int p;
    };
    // chunk c: super-block c / 8, half n, 16 positions t, nibble p; its groups have scales
    // 8n + t + 4p and 8n + t + 4p + 2 (see sub32<F_Q6_K>).
    static __device__ __forceinline__ int xoff(int c, int g) {
        int q = c & 7;
        return 256 * (c >> 3) + 128 * (q >> 2) + 16 * ((q >> 1) & 1) + 64 * (q & 1) + 32 * g;
    }
    static __device__ __forceinline__ Raw load(const Mat& m, u64 row, int c) {
        int q = c & 7, n = q >> 2, t = (q >> 1) & 1, p = q & 1;
        u64 g = block_of<F_Q6_K>(m, row, c >> 3);
        const u8* ql = m.w + 128 * g + 64 * n + 16 * t;
        const i8* sc = (const i8*)(m.w + 192 * m.nblk + 16 * g + 8 * n + t + 4 * p);
        float d = half_u16(*(const u16*)(m.w + 208 * m.nblk + 2 * g));
        return Raw{*(const uint4*)ql, *(const uint4*)(ql + 32), *(const uint4*)(m.w + 128 * m.nblk + 64 * g + 32 * n + 16 * t),
                   d * (float)sc[0], d * (float)sc[2], p};
    }
    static __device__ __forceinline__ float dot(const Mat&, const Raw& r, const float* xs) {
        u32 h[4] = {r.h.x, r.h.y, r.h.z, r.h.w};
        u32 l[2][4] = {{r.l0.x, r.l0.y, r.l0.z, r.l0.w}, {r.l1.x, r.l1.y, r.l1.z, r.l1.w}};
        float s[2];
#pragma unroll
        for (int g = 0; g < 2; g++) {
            u32 w[4];
#pragma unroll
            for (int t = 0; t < 4; t++)
                w[t] = ((l[g][t] >> (4 * r.p)) & 0x0f0f0f0fu) | (((h[t] >> (4 * r.p + 2 * g)) & 0x03030303u) << 4);
            s[g] = dot16(w, xs + 16 * g, 32.f);
        }
        return r.s0 * s[0] + r.s1 * s[1];
    }
};

// Most activation rows one matrix-vector launch multiplies (the weights are read once for all).
#define MV_ROWS 8
// Warps per matrix-vector block.
#define MV_WARPS 4

// out_i[r, o] = x[r, :] . W_i[o, :] for up to three matrices W_0..W_2 of one format sharing x
// (n_i rows each; n_i = 0: absent) and r < rows <= ROWS. Each group of `split` warps computes R
// consecutive output rows of the concatenation; lanes walk the row in 32-element chunks, and each
// chunk's activations are loaded once for the R rows. With `glu` set (R even, ROWS = 1), a warp computes
// rows o..o+R/2 of W_0 (gate) and of W_1 (up) and also writes glu[o] = gelu(gate) * up.
template <int T, int R, int ROWS>
__device__ __forceinline__ void matvec(const u8* w0, const u8* w1, const u8* w2, u64 rb, int n0, int n1, int n2, float* o0,
                                       float* o1, float* o2, float* glu, const float* x, int k, int rows, int split) {
    __shared__ float part[MV_WARPS][ROWS][R];
    // The block's MV_WARPS warps form MV_WARPS / split groups; the `split` warps of a group share
    // its R output rows, each walking every split-th run of 32 chunks.
    int wi = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int warp = blockIdx.x * (MV_WARPS / split) + wi / split, piece = wi % split;
    u64 bpr = rb / Fmt<T>::bytes;
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
    for (int c = piece * 32 + lane; c < chunks; c += 32 * split) {
        typename Chunk<T>::Raw raw[R];
#pragma unroll
        for (int rr = 0; rr < R; rr++)
            if (mi[rr] >= 0) raw[rr] = Chunk<T>::load(mr[rr], ri[rr], c);
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            if (r < rows) {
                float xs[32];
#pragma unroll
                for (int g = 0; g < 2; g++) {
                    const float4* xp = (const float4*)(x + (u64)r * k + Chunk<T>::xoff(c, g));
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        float4 a = __ldg(xp + i);
                        xs[16 * g + 4 * i] = a.x;
                        xs[16 * g + 4 * i + 1] = a.y;
                        xs[16 * g + 4 * i + 2] = a.z;
                        xs[16 * g + 4 * i + 3] = a.w;
                    }
                }
#pragma unroll
                for (int rr = 0; rr < R; rr++)
                    if (mi[rr] >= 0) acc[r][rr] += Chunk<T>::dot(mr[rr], raw[rr], xs);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int rr = 0; rr < R; rr++) {
            float s = r < rows ? warp_sum(acc[r][rr]) : 0.f;
            if (lane == 0) part[wi][r][rr] = s;
        }
    __syncthreads();
    if (piece != 0 || !any) return;
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        if (r < rows) {
#pragma unroll
            for (int rr = 0; rr < R; rr++) {
                float s = 0.f;
                for (int p = 0; p < split; p++) s += part[wi + p][r][rr];
                acc[r][rr] = s;
            }
            if (lane == 0) {
#pragma unroll
                for (int rr = 0; rr < R; rr++)
                    if (mi[rr] >= 0) orr[rr][(u64)r * nr[rr] + ri[rr]] = acc[r][rr];
                if (glu) {
#pragma unroll
                    for (int rr = 0; rr < R / 2; rr++)
                        if (mi[rr] >= 0) glu[(u64)r * n0 + ri[rr]] = gelu_tanh(acc[r][rr]) * acc[r][rr + R / 2];
                }
            }
        }
    }
}

// out[r, :] = dequant(W[ids[r], :]) * scale; one block per row, one thread per sub-block.
template <int T>
__device__ __forceinline__ void embed(const Mat& m, const int* ids, float* out, int k, float scale) {
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

// Per format: matvec (2 output rows per warp, up to MV_ROWS activation rows), matvec4 (4 output
// rows per warp, one activation row: large matrices), embed, dequant. `nb`: blocks of the matrix.
#define MV_ARGS                                                                                                     \
    const u8 *w0, const u8 *w1, const u8 *w2, u64 rb, int n0, int n1, int n2, float *o0, float *o1, float *o2, \
        float *glu, const float *x, int k, int rows, int split
#define KILN_FORMAT(NAME, T)                                                                                        \
    extern "C" __global__ void __launch_bounds__(128) matvec_##NAME(MV_ARGS) {                                     \
        matvec<T, 2, MV_ROWS>(w0, w1, w2, rb, n0, n1, n2, o0, o1, o2, glu, x, k, rows, split);                            \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(128) matvec4_##NAME(MV_ARGS) {                                    \
        matvec<T, 4, 1>(w0, w1, w2, rb, n0, n1, n2, o0, o1, o2, glu, x, k, 1, split);                                     \
    }                                                                                                               \
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
