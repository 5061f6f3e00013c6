// Quantized weights: one decoder per block format for a 32-element sub-block, and the kernels
// built on it (matrix-vector products for decode, row gather for embeddings, dequantization to
// f32 for the tensor-core/cuBLAS prefill path). Format ids are ggml's type ids.

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

__device__ __forceinline__ void scale_min_k4(const u8* s, int i, int* sc, int* mn) {
    if (i < 4) {
        *sc = s[i] & 63;
        *mn = s[i + 4] & 63;
    } else {
        *sc = (s[i + 4] & 0x0f) | ((s[i - 4] >> 6) << 4);
        *mn = (s[i + 4] >> 4) | ((s[i] >> 6) << 4);
    }
}

// Decodes sub-block `s` (elements 32s..32s+32) of a packed row into v.
template <int T> __device__ __forceinline__ void sub32(const u8* row, int s, float* v);

template <> __device__ __forceinline__ void sub32<F_F32>(const u8* row, int s, float* v) {
    const float4* p = (const float4*)(row + 128 * s);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        float4 q = p[i];
        v[4 * i] = q.x; v[4 * i + 1] = q.y; v[4 * i + 2] = q.z; v[4 * i + 3] = q.w;
    }
}
template <> __device__ __forceinline__ void sub32<F_F16>(const u8* row, int s, float* v) {
    const u8* b = row + 64 * s;
#pragma unroll
    for (int i = 0; i < 32; i++) v[i] = half_at(b + 2 * i);
}
template <> __device__ __forceinline__ void sub32<F_BF16>(const u8* row, int s, float* v) {
    const u8* b = row + 64 * s;
#pragma unroll
    for (int i = 0; i < 32; i++) v[i] = __int_as_float(((u32)b[2 * i] | ((u32)b[2 * i + 1] << 8)) << 16);
}
template <> __device__ __forceinline__ void sub32<F_Q4_0>(const u8* row, int s, float* v) {
    const u8* b = row + 18 * s;
    float d = half_at(b);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        u8 q = b[2 + j];
        v[j] = (float)((int)(q & 15) - 8) * d;
        v[j + 16] = (float)((int)(q >> 4) - 8) * d;
    }
}
template <> __device__ __forceinline__ void sub32<F_Q4_1>(const u8* row, int s, float* v) {
    const u8* b = row + 20 * s;
    float d = half_at(b), m = half_at(b + 2);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        u8 q = b[4 + j];
        v[j] = (float)(q & 15) * d + m;
        v[j + 16] = (float)(q >> 4) * d + m;
    }
}
template <> __device__ __forceinline__ void sub32<F_Q5_0>(const u8* row, int s, float* v) {
    const u8* b = row + 22 * s;
    float d = half_at(b);
    u32 qh = u32_at(b + 2);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        u8 q = b[6 + j];
        int l0 = (q & 15) | (((qh >> j) & 1) << 4);
        int l1 = (q >> 4) | (((qh >> (j + 16)) & 1) << 4);
        v[j] = (float)(l0 - 16) * d;
        v[j + 16] = (float)(l1 - 16) * d;
    }
}
template <> __device__ __forceinline__ void sub32<F_Q5_1>(const u8* row, int s, float* v) {
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
template <> __device__ __forceinline__ void sub32<F_Q8_0>(const u8* row, int s, float* v) {
    const u8* b = row + 34 * s;
    float d = half_at(b);
#pragma unroll
    for (int j = 0; j < 32; j++) v[j] = (float)(i8)b[2 + j] * d;
}
template <> __device__ __forceinline__ void sub32<F_Q2_K>(const u8* row, int s, float* v) {
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
template <> __device__ __forceinline__ void sub32<F_Q3_K>(const u8* row, int s, float* v) {
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
template <> __device__ __forceinline__ void sub32<F_Q4_K>(const u8* row, int s, float* v) {
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
template <> __device__ __forceinline__ void sub32<F_Q5_K>(const u8* row, int s, float* v) {
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
template <> __device__ __forceinline__ void sub32<F_Q6_K>(const u8* row, int s, float* v) {
    const u8* b = row + 210 * (s >> 3);
    int sub = s & 7, n = sub >> 2, g = sub & 3;
    float d = half_at(b + 208);
    const u8* ql = b + 64 * n + 32 * (g & 1);
    const u8* qh = b + 128 + 32 * n;
    const i8* sc = (const i8*)(b + 192 + 8 * n);
    int nib = 4 * (g >> 1), hs = 2 * g;
#pragma unroll
    for (int l = 0; l < 32; l++) {
        int q = ((ql[l] >> nib) & 15) | (((qh[l] >> hs) & 3) << 4);
        v[l] = d * (float)sc[(l >> 4) + 2 * g] * (float)(q - 32);
    }
}

// Decodes elements 8u..8u+8 of a packed row into v. Formats without their own decoder decode
// the whole 32-element sub-block and keep a quarter (constant indices: no local memory).
template <int T> __device__ __forceinline__ void sub8(const u8* row, int u, float* v) {
    float t[32];
    sub32<T>(row, u >> 2, t);
    int q = u & 3;
#pragma unroll
    for (int i = 0; i < 32; i++)
        if ((i >> 3) == q) v[i & 7] = t[i];
}
template <> __device__ __forceinline__ void sub8<F_Q8_0>(const u8* row, int u, float* v) {
    const u8* b = row + 34 * (u >> 2);
    float d = half_at(b);
    const u16* q = (const u16*)(b + 2 + 8 * (u & 3));
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u16 w = q[i];
        v[2 * i] = (float)(i8)(w & 0xff) * d;
        v[2 * i + 1] = (float)(i8)(w >> 8) * d;
    }
}
template <> __device__ __forceinline__ void sub8<F_Q5_0>(const u8* row, int u, float* v) {
    const u8* b = row + 22 * (u >> 2);
    float d = half_at(b);
    const u16* h = (const u16*)(b + 2);
    u32 qh = (u32)h[0] | ((u32)h[1] << 16);
    int q = u & 3, hi = q >> 1;
    const u16* p = (const u16*)(b + 6 + 8 * (q & 1));
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u16 w = p[i];
#pragma unroll
        for (int c = 0; c < 2; c++) {
            u32 byte = (w >> (8 * c)) & 0xff;
            int e = 2 * i + c;
            int lv = (int)(hi ? (byte >> 4) : (byte & 15)) | (int)(((qh >> (8 * q + e)) & 1) << 4);
            v[e] = (float)(lv - 16) * d;
        }
    }
}
template <> __device__ __forceinline__ void sub8<F_Q4_K>(const u8* row, int u, float* v) {
    int s = u >> 2;
    const u8* b = row + 144 * (s >> 3);
    int sub = s & 7, j = sub >> 1, hi = sub & 1;
    int sc, mn;
    scale_min_k4(b + 4, sub, &sc, &mn);
    float d1 = half_at(b) * (float)sc, m1 = half_at(b + 2) * (float)mn;
    uint2 w = *(const uint2*)(b + 16 + 32 * j + 8 * (u & 3));
#pragma unroll
    for (int t = 0; t < 8; t++) {
        u32 byte = ((t < 4 ? w.x : w.y) >> (8 * (t & 3))) & 0xff;
        v[t] = d1 * (float)(hi ? (byte >> 4) : (byte & 15)) - m1;
    }
}
template <> __device__ __forceinline__ void sub8<F_Q6_K>(const u8* row, int u, float* v) {
    int s = u >> 2;
    const u8* b = row + 210 * (s >> 3);
    int sub = s & 7, n = sub >> 2, g = sub & 3, l0 = 8 * (u & 3);
    float d = half_at(b + 208) * (float)((const i8*)(b + 192 + 8 * n))[(l0 >> 4) + 2 * g];
    const u8* ql = b + 64 * n + 32 * (g & 1) + l0;
    const u8* qh = b + 128 + 32 * n + l0;
    int nib = 4 * (g >> 1), hs = 2 * g;
#pragma unroll
    for (int l = 0; l < 8; l++) {
        int q = ((ql[l] >> nib) & 15) | (((qh[l] >> hs) & 3) << 4);
        v[l] = d * (float)(q - 32);
    }
}

// Most activation rows one matvec launch multiplies (the weights are read once for all of them).
#define MV_ROWS 8

// out[r, o] = x[r, :] . W[o, :] for r < rows (<= MV_ROWS): one warp per output row; lane i
// decodes elements 8u..8u+8 for u = i, i + 32, ... so a warp reads contiguous bytes of its row;
// activations are read through the cache as float4.
template <int T>
__device__ __forceinline__ void matvec(const u8* w, u64 row_bytes, const float* x, float* out, int k, int n, int rows) {
    int o = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (o >= n) return;
    const u8* row = w + (u64)o * row_bytes;
    float acc[MV_ROWS];
#pragma unroll
    for (int r = 0; r < MV_ROWS; r++) acc[r] = 0.f;
    int units = k >> 3;
    for (int u = lane; u < units; u += 32) {
        float v[8];
        sub8<T>(row, u, v);
#pragma unroll
        for (int r = 0; r < MV_ROWS; r++) {
            if (r < rows) {
                const float4* xp = (const float4*)(x + (u64)r * k + 8 * u);
                float4 a = __ldg(xp), b = __ldg(xp + 1);
                acc[r] += v[0] * a.x + v[1] * a.y + v[2] * a.z + v[3] * a.w + v[4] * b.x + v[5] * b.y + v[6] * b.z +
                          v[7] * b.w;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < MV_ROWS; r++) {
        if (r < rows) {
            float a = warp_sum(acc[r]);
            if (lane == 0) out[(u64)r * n + o] = a;
        }
    }
}

// out[r, :] = dequant(W[ids[r], :]) * scale; one block per row, one thread per sub-block.
template <int T>
__device__ __forceinline__ void embed(const u8* w, u64 row_bytes, const int* ids, float* out, int k, float scale) {
    int r = blockIdx.x;
    const u8* row = w + (u64)ids[r] * row_bytes;
    for (int s = threadIdx.x; s < (k >> 5); s += blockDim.x) {
        float v[32];
        sub32<T>(row, s, v);
        float* o = out + (u64)r * k + 32 * s;
#pragma unroll
        for (int i = 0; i < 32; i++) o[i] = v[i] * scale;
    }
}

// out[r, :] = dequant(W[r, :]) for rows r0..r0+count (f32, for the GEMM path).
template <int T>
__device__ __forceinline__ void dequant(const u8* w, u64 row_bytes, float* out, int k, u64 count) {
    u64 subs = (u64)(k >> 5);
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count * subs) return;
    u64 r = i / subs;
    int s = (int)(i % subs);
    float v[32];
    sub32<T>(w + r * row_bytes, s, v);
    float4* o = (float4*)(out + r * k + 32 * s);
#pragma unroll
    for (int q = 0; q < 8; q++) o[q] = make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
}

#define KILN_FORMAT(NAME, T)                                                                                   \
    extern "C" __global__ void __launch_bounds__(256) matvec_##NAME(const u8* w, u64 rb, const float* x, float* out, int k, int n,    \
                                             int rows) {                                                       \
        matvec<T>(w, rb, x, out, k, n, rows);                                                                  \
    }                                                                                                          \
    extern "C" __global__ void embed_##NAME(const u8* w, u64 rb, const int* ids, float* out, int k,            \
                                            float scale) {                                                     \
        embed<T>(w, rb, ids, out, k, scale);                                                                   \
    }                                                                                                          \
    extern "C" __global__ void dequant_##NAME(const u8* w, u64 rb, float* out, int k, u64 count) {            \
        dequant<T>(w, rb, out, k, count);                                                                      \
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
