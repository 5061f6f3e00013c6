// Element-wise and row kernels: step inputs, RMS norm, RoPE, element-wise ops (add, mul, GELU,
// SiLU, scale, soft-cap, bias), last row, argmax.

// Writes the step's token ids and positions into the arena from the step buffer (common.cuh) of a
// plan of `rows` rows. The positions live in device memory, so a captured graph serves every step
// of its bucket. For one-row steps also the RoPE cosines and sines of the row's position for
// `n_rope` (<= 2) tables c, pair j of table c at rope[c * stride + j] (`half` pairs each): angle
// position * scale * theta^(-2j / (2 half)) / factors[j] (factors null: no divisors), in double
// as the CPU and the rope kernels compute it.
extern "C" __global__ void set_inputs(const int* step, int rows, int* tokens, int* positions, float2* rope, int n_rope, int stride,
                                      float theta0, float scale0, const float* factors0, int half0, float theta1, float scale1,
                                      const float* factors1, int half1) {
    pdl_wait();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n_rope * stride) {
        const bool first = i < stride;
        const int j = i % stride, half = first ? half0 : half1;
        const float* factors = first ? factors0 : factors1;
        if (j < half) {
            double inv_freq = (double)(first ? scale0 : scale1) / pow((double)(first ? theta0 : theta1), (double)(2 * j) / (double)(2 * half));
            if (factors) inv_freq /= (double)factors[j];
            double ang = (double)step_row(step, 0).pos * inv_freq;
            rope[i] = make_float2((float)cos(ang), (float)sin(ang));
        }
    }
    if (i >= step[0]) return;
    // (A greedy step launched ahead takes the token the step before chose, copied on the device:
    // -1 where that step's products were not finite. It then embeds token 0, and its result is
    // never used: exec.rs `greedy_step`.)
    if (tokens) tokens[i] = max(step_token(step, rows, i), 0);
    if (positions) positions[i] = step_row(step, i).pos;
}

// Norm kernels load every value of their row before the first reduction (up to NORM_PER per
// thread, at most NORM_THREADS threads: rows of up to 8192), so a row costs one round trip to
// memory, not one per loop iteration.
#define NORM_PER 16
#define NORM_THREADS 512

// out = x / rms(x) * w (+ residual) over groups of `group` <= NORM_PER * blockDim.x elements:
// one block per group.
// With `xq` (groups are whole rows), out is also written quantized for a matrix-vector product.
// Without W (`rms_normalize`), no weight: out = x / rms(x) (w, residual and xq null).
template <bool W>
__device__ __forceinline__ void rms_norm_impl(const float* x, const float* w, const float* residual, float* out, int group, float eps,
                                              u8* xq) {
    __shared__ float scratch[32];
    pdl_release();
    u64 base = (u64)blockIdx.x * group;
    float v[NORM_PER], wv[NORM_PER], rv[NORM_PER], ss = 0.f;
#pragma unroll
    for (int j = 0; j < NORM_PER; j++) {
        int i = threadIdx.x + j * blockDim.x;
        wv[j] = i < group ? (W ? w[i] : 1.f) : 0.f;
    }
    pdl_wait();
#pragma unroll
    for (int j = 0; j < NORM_PER; j++) {
        int i = threadIdx.x + j * blockDim.x;
        bool in = i < group;
        v[j] = in ? x[base + i] : 0.f;
        rv[j] = in && residual ? residual[base + i] : 0.f;
    }
#pragma unroll
    for (int j = 0; j < NORM_PER; j++) ss += v[j] * v[j];
    ss = block_sum(ss, scratch);
    float inv = 1.f / sqrtf(ss / (float)group + eps);
#pragma unroll
    for (int j = 0; j < NORM_PER; j++) {
        int i = threadIdx.x + j * blockDim.x;
        float y = v[j] * inv * wv[j];
        y = residual ? rv[j] + y : y;
        if (xq && i - (threadIdx.x & 31) < group) quantize32(y, xq + blockIdx.x * xq_bytes(group), group, i);
        if (i < group) out[base + i] = y;
    }
}
extern "C" __global__ void __launch_bounds__(NORM_THREADS) rms_norm(const float* x, const float* w, const float* residual, float* out, int group,
                                    float eps, u8* xq) {
    rms_norm_impl<true>(x, w, residual, out, group, eps, xq);
}
extern "C" __global__ void __launch_bounds__(NORM_THREADS) rms_normalize(const float* x, float* out, int group, float eps) {
    rms_norm_impl<false>(x, nullptr, nullptr, out, group, eps, nullptr);
}

// Two norms in one pass over a row (a post-norm and its residual add, then the next pre-norm):
// h = residual + x / rms(x) * w1, out = h / rms(h) * w2. One block per row of
// `width` <= NORM_PER * blockDim.x. `out` is also written quantized to `xq` when given (the next
// matrix-vector product's input). Rows of a multiple of 128 elements at 16-byte aligned addresses
// (every Gemma width) go through float4 loads, the norm weights loaded before waiting for the
// kernels before and all of x and the residual in one round trip after (measured on an H200:
// 10.3 µs per 12B row of 3840 in the scalar form, whose weights came in two more round trips
// after the reductions). With w1 null there is no first norm, h = residual + x (a residual add and
// the next norm: Llama, Qwen); such pairs take the float4 path only (exec.rs `fuse_at` pairs an
// add only where it applies).
extern "C" __global__ void __launch_bounds__(NORM_THREADS) rms_norm2(const float* x, const float* w1, const float* residual,
                                                                     float* h, const float* w2, float* out, u8* xq,
                                                                     int width, float eps) {
    __shared__ float scratch[32];
    pdl_release();
    u64 base = (u64)blockIdx.x * width;
    u8* q = xq ? xq + blockIdx.x * xq_bytes(width) : nullptr;
    if (((width & 127) | (((u64)x | (u64)w1 | (u64)residual | (u64)h | (u64)w2 | (u64)out) & 15)) != 0) {
        pdl_wait();
        norm_row<NORM_PER>(x + base, w1, residual + base, w2, eps, width, q, h + base, out + base, scratch);
        return;
    }
    constexpr int PER4 = NORM_PER / 4;
    const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
    float4 a[PER4], b[PER4], v[PER4], r[PER4];
#pragma unroll
    for (int j = 0; j < PER4; j++) {
        int i = 4 * (threadIdx.x + j * blockDim.x);
        a[j] = i < width ? w1 ? *(const float4*)(w1 + i) : make_float4(1.f, 1.f, 1.f, 1.f) : z;
        b[j] = i < width ? *(const float4*)(w2 + i) : z;
    }
    pdl_wait();
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < PER4; j++) {
        int i = 4 * (threadIdx.x + j * blockDim.x);
        v[j] = i < width ? *(const float4*)(x + base + i) : z;
        r[j] = i < width ? *(const float4*)(residual + base + i) : z;
        ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
    }
    // (Without w1 no first norm: h = residual + x exactly.)
    float inv = w1 ? 1.f / sqrtf(block_sum(ss, scratch) / (float)width + eps) : 1.f, ss2 = 0.f;
#pragma unroll
    for (int j = 0; j < PER4; j++) {
        v[j] = make_float4(r[j].x + v[j].x * inv * a[j].x, r[j].y + v[j].y * inv * a[j].y, r[j].z + v[j].z * inv * a[j].z,
                           r[j].w + v[j].w * inv * a[j].w);
        ss2 += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
    }
    float inv2 = 1.f / sqrtf(block_sum(ss2, scratch) / (float)width + eps);
#pragma unroll
    for (int j = 0; j < PER4; j++) {
        int i = 4 * (threadIdx.x + j * blockDim.x);
        // (Whole warps: quantize32x4 takes the 8 lanes of each 32-element block together.)
        if (4 * (j * blockDim.x + (threadIdx.x & ~31)) >= width) break;
        float4 y = make_float4(v[j].x * inv2 * b[j].x, v[j].y * inv2 * b[j].y, v[j].z * inv2 * b[j].z, v[j].w * inv2 * b[j].w);
        if (i < width) {
            *(float4*)(h + base + i) = v[j];
            *(float4*)(out + base + i) = y;
        }
        if (q) quantize32x4(y, q, width, i);
    }
}

// Per-head RMS norms of q and k followed by NeoX RoPE, one block per (row, head) of q's heads
// then k's: qn/kn = the normed heads, qr/kr = the rotated ones. Block size >= head_dim / 2.
// With `step` (the positions are the step's), the rotation is computed before
// waiting for the kernels that write q and k; else the positions are read from `positions`.
extern "C" __global__ void qk_norm_rope(const float* q, const float* k, const float* wq, const float* wk,
                                        const int* positions, const int* step, float* qn, float* kn, float* qr, float* kr,
                                        int q_heads, int k_heads, int d, float theta, float eps) {
    __shared__ float scratch[32];
    int heads = q_heads + k_heads;
    int r = blockIdx.x / heads, h = blockIdx.x % heads;
    bool isq = h < q_heads;
    u64 off = isq ? ((u64)r * q_heads + h) * d : ((u64)r * k_heads + (h - q_heads)) * d;
    const float* x = (isq ? q : k) + off;
    const float* w = isq ? wq : wk;
    int half = d / 2, i = threadIdx.x;
    // (Weights and frequencies do not depend on earlier kernels.)
    float w0 = i < half ? w[i] : 0.f, w1 = i < half ? w[i + half] : 0.f;
    double inv_freq = 1.0 / pow((double)theta, (double)(2 * i) / (double)d);
    float c = 0.f, s = 0.f;
    if (step) {
        double ang = (double)step_row(step, r).pos * inv_freq;
        c = (float)cos(ang);
        s = (float)sin(ang);
    }
    pdl_wait();
    if (!step) {
        double ang = (double)positions[r] * inv_freq;
        c = (float)cos(ang);
        s = (float)sin(ang);
    }
    float x0 = i < half ? x[i] : 0.f, x1 = i < half ? x[i + half] : 0.f;
    float ss = block_sum(x0 * x0 + x1 * x1, scratch);
    if (i >= half) return;
    float inv = 1.f / sqrtf(ss / (float)d + eps);
    float a = x0 * inv * w0, b = x1 * inv * w1;
    float* n = (isq ? qn : kn) + off;
    float* o = (isq ? qr : kr) + off;
    n[i] = a;
    n[i + half] = b;
    o[i] = a * c - b * s;
    o[i + half] = b * c + a * s;
}

// Rotary embedding: one block per (row, head), angles in double as the CPU computes them. `rope`:
// NeoX pairing (element i with i + head_dim / 2), frequency i theta^(-2i/d). `rope_scaled` (any
// `RopeSpec`): NeoX pairing, or with `adjacent` the "normal" one (2i with 2i + 1), and frequency i
// freq_scale * theta^(-2i/d) / factors[i] (`factors` null: no divisors; Llama 3 and proportional
// RoPE).
template <bool SCALED>
__device__ __forceinline__ void rope_impl(const float* x, const int* positions, float* out, int heads, int head_dim, float theta,
                                          float freq_scale, const float* factors, int adjacent) {
    pdl_wait();
    int r = blockIdx.x / heads;
    u64 base = (u64)blockIdx.x * head_dim;
    int half = head_dim / 2;
    double pos = (double)positions[r];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        double inv_freq = (SCALED ? (double)freq_scale : 1.0) / pow((double)theta, (double)(2 * i) / (double)head_dim);
        // Pair i is elements (e, e + off).
        int e = i, off = half;
        if (SCALED) {
            if (factors) inv_freq /= (double)factors[i];
            if (adjacent) {
                e = 2 * i;
                off = 1;
            }
        }
        double a = pos * inv_freq;
        float c = (float)cos(a), s = (float)sin(a);
        float x0 = x[base + e], x1 = x[base + e + off];
        out[base + e] = x0 * c - x1 * s;
        out[base + e + off] = x1 * c + x0 * s;
    }
}
extern "C" __global__ void rope(const float* x, const int* positions, float* out, int heads, int head_dim,
                                float theta) {
    rope_impl<false>(x, positions, out, heads, head_dim, theta, 1.f, nullptr, 0);
}
extern "C" __global__ void rope_scaled(const float* x, const int* positions, float* out, int heads, int head_dim, float theta,
                                       float freq_scale, const float* factors, int adjacent) {
    rope_impl<true>(x, positions, out, heads, head_dim, theta, freq_scale, factors, adjacent);
}

// out[i] for i < len by `op` (`ElementOp` in exec.rs): 0: a + b, 1: a * b, 2: gelu(a),
// 3: gelu(a) * b, 4: silu(a), 5: silu(a) * b, 6: a * c, 7: c * tanh(a / c) (soft-cap),
// 8: a + b[i % width] (a bias row added to every row of `width`).
extern "C" __global__ void elementwise(const float* a, const float* b, float* out, u64 len, int op, float c, u32 width) {
    pdl_wait();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    float x = a[i], y;
    switch (op) {
    case 0: y = x + b[i]; break;
    case 1: y = x * b[i]; break;
    case 2: y = gelu_tanh(x); break;
    case 3: y = gelu_tanh(x) * b[i]; break;
    case 4: y = silu(x); break;
    case 5: y = silu(x) * b[i]; break;
    case 6: y = x * c; break;
    case 7: y = soft_cap(x, c); break;
    default: y = x + b[i % width]; break;
    }
    out[i] = y;
}

// out[s, :] = x[last row of sequence s, :] for the step's sequences (blockIdx.y: the sequence) of a
// plan of `rows` rows.
extern "C" __global__ void copy_last_rows(const float* x, float* out, const int* step, int rows, int width) {
    pdl_wait();
    int s = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= step[1] || i >= width) return;
    out[(u64)s * width + i] = x[(u64)step_last_row(step, rows, s) * width + i];
}

// Better of two (value, index) candidates: larger value, lower index on ties.
__device__ __forceinline__ void better(float& v, int& i, float v2, int i2) {
    if (v2 > v || (v2 == v && i2 < i)) {
        v = v2;
        i = i2;
    }
}

// Argmax phase 1: block b of row r reduces its share of the row into partial[(r * blocks + b)]:
// (value, index, non-finite flag). Lowest index among equal maxima.
extern "C" __global__ void argmax_partial(const float* x, float* pval, int* pidx, int width) {
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ int sbad;
    pdl_wait();
    int r = blockIdx.y, blocks = gridDim.x;
    const float* row = x + (u64)r * width;
    float best = -INFINITY;
    int idx = 0x7fffffff, bad = 0;
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < width; j += blocks * blockDim.x) {
        float v = row[j];
        if (!(fabsf(v) <= 3.402823466e38f)) bad = 1;
        better(best, idx, v, j);
    }
    if (threadIdx.x == 0) sbad = 0;
    __syncthreads();
    if (bad) sbad = 1;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float v2 = __shfl_xor_sync(0xffffffffu, best, o);
        int i2 = __shfl_xor_sync(0xffffffffu, idx, o);
        better(best, idx, v2, i2);
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (lane == 0) {
        sv[warp] = best;
        si[warp] = idx;
    }
    __syncthreads();
    if (warp == 0) {
        best = lane < warps ? sv[lane] : -INFINITY;
        idx = lane < warps ? si[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float v2 = __shfl_xor_sync(0xffffffffu, best, o);
            int i2 = __shfl_xor_sync(0xffffffffu, idx, o);
            better(best, idx, v2, i2);
        }
        if (lane == 0) {
            u64 p = (u64)r * blocks + blockIdx.x;
            pval[p] = best;
            pidx[p] = sbad ? -1 : idx;
        }
    }
}

// Argmax phase 2: one warp per row reduces its `blocks` partials; -1 when any value was non-finite.
extern "C" __global__ void argmax_final(const float* pval, const int* pidx, int* out, int blocks) {
    pdl_wait();
    int r = blockIdx.x, lane = threadIdx.x;
    float best = -INFINITY;
    int idx = 0x7fffffff, bad = 0;
    for (int b = lane; b < blocks; b += 32) {
        u64 p = (u64)r * blocks + b;
        if (pidx[p] < 0) bad = 1;
        better(best, idx, pval[p], pidx[p]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float v2 = __shfl_xor_sync(0xffffffffu, best, o);
        int i2 = __shfl_xor_sync(0xffffffffu, idx, o);
        better(best, idx, v2, i2);
        bad |= __shfl_xor_sync(0xffffffffu, bad, o);
    }
    if (lane == 0) out[r] = bad ? -1 : idx;
}

// Reads `bytes` of `src` as 16-byte words and writes their xor to `sink` (device-memory bandwidth).
extern "C" __global__ void read_bandwidth(const uint4* src, u64 words, uint4* sink) {
    pdl_wait();
    uint4 acc = make_uint4(0, 0, 0, 0);
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += (u64)gridDim.x * blockDim.x) {
        uint4 v = src[i];
        acc.x ^= v.x; acc.y ^= v.y; acc.z ^= v.z; acc.w ^= v.w;
    }
    if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x9e3779b9u) sink[0] = acc;
}

// Row-wise top-k (kiln_ir::Op::TopK; exec.rs `top_k`) in two launches: `top_k_part` takes each
// slice of TOPK_SLICE values of a row to its `count` (at most TOPK_MAX) largest, `top_k_final`
// takes a row's slices' survivors to its `count` largest and writes them, largest first, then
// their indices as floats. The order is a 64-bit key, a value's ordered bits then the complement
// of its index (the lower index first among equal values), so every key is distinct and the
// `count` largest are one set. They are found by radix selection (8 bits a pass from the top:
// a histogram of the keys that match the digits chosen so far, then the digit where the count
// is reached), over keys staged in shared memory.
#define TOPK_THREADS 256
#define TOPK_MAX 64
#define TOPK_SLICE 4096

__device__ __forceinline__ u64 top_key(float v, u32 j) {
    const u32 b = __float_as_uint(v);
    return ((u64)((b & 0x80000000u) ? ~b : (b | 0x80000000u)) << 32) | (0xffffffffu - j);
}

// The `count` largest of the `n` keys at k (shared memory), written in no order to top (shared);
// every thread of the block (TOPK_THREADS) calls it. hist: 256 counters per warp; sel: 3 words of
// scratch. (A warp counts into its own histogram: most values share a few exponents, and lanes
// adding to one counter wait on each other only within their warp; counting with one atomic per
// group of equal digits, `__match_any_sync`, the two launches took 73 µs for a row of 262,144
// on an H100.)
__device__ void top_keys_select(const u64* k, int n, int count, u64* top, u32* hist, u32* sel) {
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    u64 prefix = 0, mask = 0;
    u32 want = (u32)min(count, n);
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int i = t; i < 256 * (TOPK_THREADS / 32); i += TOPK_THREADS) hist[i] = 0;
        __syncthreads();
        for (int i = t; i < n; i += TOPK_THREADS) {
            if ((k[i] & mask) == prefix) atomicAdd(&hist[256 * warp + ((u32)(k[i] >> shift) & 0xffu)], 1u);
        }
        __syncthreads();
        // Thread b sums digit b's counts into the first warp's histogram.
        u32 c = 0;
        for (int w = 0; w < TOPK_THREADS / 32; w++) c += hist[256 * w + t];
        hist[t] = c;
        __syncthreads();
        if (t < 32) {
            // Lane l holds digits 255 - 8l down to 248 - 8l; counts from the top.
            u32 mine = 0;
            for (int d = 0; d < 8; d++) mine += hist[255 - 8 * lane - d];
            u32 incl = mine;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const u32 up = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += up;
            }
            const u32 first = __ballot_sync(0xffffffffu, incl >= want);
            if (lane == __ffs(first) - 1) {
                u32 above = incl - mine;
                for (int d = 0; d < 8; d++) {
                    const u32 digit = 255 - 8 * lane - d, c = hist[digit];
                    if (above + c >= want) {
                        sel[0] = digit;
                        sel[1] = above;
                        break;
                    }
                    above += c;
                }
            }
        }
        __syncthreads();
        const u32 digit = sel[0];
        want -= sel[1];
        prefix |= (u64)digit << shift;
        mask |= (u64)0xff << shift;
        // Every key left with these digits is wanted: the selection is made.
        const bool done = hist[digit] == want;
        __syncthreads();
        if (done) break;
    }
    // The keys above the chosen digits, then as many with them as are still wanted (several only
    // where keys repeat: the padding of short slices).
    if (t == 0) sel[2] = 0;
    __syncthreads();
    for (int i = t; i < n; i += blockDim.x) {
        if ((k[i] & mask) > prefix) top[atomicAdd(&sel[2], 1u)] = k[i];
    }
    __syncthreads();
    const u32 all = (u32)min(count, n);
    for (int i = t; i < n; i += blockDim.x) {
        if ((k[i] & mask) == prefix) {
            const u32 slot = atomicAdd(&sel[2], 1u);
            if (slot < all) top[slot] = k[i];
        }
    }
    __syncthreads();
}

// Moves the keys at or above `floor` (of the `n` at k, shared memory) to the front of k, in no
// order, and returns how many they are; every thread of the block (TOPK_THREADS) calls it. With a
// floor that `count` of them reach, the `count` largest are among those moved: the selection then
// counts a few keys, not the slice. sel: 3 words of scratch.
__device__ int top_keys_prune(u64* k, int n, u64 floor, u32* sel) {
    u64 mine[TOPK_SLICE / TOPK_THREADS];
#pragma unroll
    for (int q = 0; q < TOPK_SLICE / TOPK_THREADS; q++) {
        const int i = threadIdx.x + q * TOPK_THREADS;
        mine[q] = i < n ? k[i] : 0;
    }
    if (threadIdx.x == 0) sel[2] = 0;
    __syncthreads();
#pragma unroll
    for (int q = 0; q < TOPK_SLICE / TOPK_THREADS; q++) {
        if (threadIdx.x + q * TOPK_THREADS < n && mine[q] >= floor) k[atomicAdd(&sel[2], 1u)] = mine[q];
    }
    __syncthreads();
    return (int)sel[2];
}

// Grid (slices, rows): the slice's `count` largest keys to part[(row * slices + slice) * count..]
// (fewer in a short last slice: the rest 0, below every value's key), and whether it holds a
// non-finite value to bad[row * slices + slice].
extern "C" __global__ void __launch_bounds__(TOPK_THREADS) top_k_part(const float* x, u64* part, int* bad, int width, int count) {
    __shared__ u64 keys[TOPK_SLICE];
    __shared__ u64 top[TOPK_MAX], tmax[TOPK_THREADS], floor;
    __shared__ u32 hist[256 * (TOPK_THREADS / 32)], sel[3];
    __shared__ int sbad;
    pdl_wait();
    const int s = blockIdx.x, r = blockIdx.y, j0 = s * TOPK_SLICE, n = min(TOPK_SLICE, width - j0);
    const float* row = x + (u64)r * width;
    if (threadIdx.x == 0) sbad = 0;
    __syncthreads();
    int b = 0;
    u64 most = 0;
    // (Every load issued before the first is used: one round trip.)
    float v[TOPK_SLICE / TOPK_THREADS];
#pragma unroll
    for (int q = 0; q < TOPK_SLICE / TOPK_THREADS; q++) {
        const int i = threadIdx.x + q * TOPK_THREADS;
        v[q] = i < n ? row[j0 + i] : 0.f;
    }
#pragma unroll
    for (int q = 0; q < TOPK_SLICE / TOPK_THREADS; q++) {
        const int i = threadIdx.x + q * TOPK_THREADS;
        if (i < n) {
            b |= !(fabsf(v[q]) <= 3.402823466e38f);
            keys[i] = top_key(v[q], j0 + i);
            most = max(most, keys[i]);
        }
    }
    if (b) sbad = 1;
    // The threads' largest keys: the `count` largest of them are `count` keys at or above the
    // least of those, so the slice's `count` largest are too.
    tmax[threadIdx.x] = most;
    if (threadIdx.x == 0) floor = ~0ull;
    top_keys_select(tmax, TOPK_THREADS, count, top, hist, sel);
    if (threadIdx.x < min(count, TOPK_THREADS)) atomicMin(&floor, top[threadIdx.x]);
    __syncthreads();
    const int kept = top_keys_prune(keys, n, floor, sel);
    top_keys_select(keys, kept, count, top, hist, sel);
    u64* o = part + ((u64)r * gridDim.x + s) * count;
    for (int i = threadIdx.x; i < count; i += blockDim.x) o[i] = i < min(count, n) ? top[i] : 0;
    if (threadIdx.x == 0) bad[r * gridDim.x + s] = sbad;
}

// Grid (rows): a row's `count` largest of its slices' survivors, largest first: out[r] = the
// values (cap > 0: soft-capped; each read back from its key), then the indices as floats; every
// value NaN where a slice held a non-finite value.
extern "C" __global__ void __launch_bounds__(TOPK_THREADS) top_k_final(const u64* part, const int* bad, float* out, int slices, int count,
                                                                       float cap) {
    __shared__ u64 keys[TOPK_SLICE];
    __shared__ u64 top[TOPK_MAX], floor;
    __shared__ u32 hist[256 * (TOPK_THREADS / 32)], sel[3];
    __shared__ int sbad;
    pdl_wait();
    const int r = blockIdx.x, n = slices * count, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (threadIdx.x == 0) {
        sbad = 0;
        floor = 0;
    }
    // (Every load issued before the first is used: one round trip.)
    u64 mine[TOPK_SLICE / TOPK_THREADS];
#pragma unroll
    for (int q = 0; q < TOPK_SLICE / TOPK_THREADS; q++) {
        const int i = threadIdx.x + q * TOPK_THREADS;
        mine[q] = i < n ? part[(u64)r * n + i] : 0;
    }
    int b = 0;
    for (int i = threadIdx.x; i < slices; i += blockDim.x) b |= bad[r * slices + i];
#pragma unroll
    for (int q = 0; q < TOPK_SLICE / TOPK_THREADS; q++) {
        const int i = threadIdx.x + q * TOPK_THREADS;
        if (i < n) keys[i] = mine[q];
    }
    __syncthreads();
    if (b) sbad = 1;
    // Each slice's least kept key (a warp a slice, its keys read across the lanes): `count`
    // keys (its own) reach the largest of those.
    for (int sl = warp; sl < slices; sl += TOPK_THREADS / 32) {
        u64 least = ~0ull;
        for (int i = lane; i < count; i += 32) least = min(least, keys[sl * count + i]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) least = min(least, __shfl_xor_sync(0xffffffffu, least, o));
        if (lane == 0) atomicMax(&floor, least);
    }
    __syncthreads();
    const int kept = top_keys_prune(keys, n, floor, sel);
    top_keys_select(keys, kept, count, top, hist, sel);
    float* o = out + (u64)r * 2 * count;
    const int t = threadIdx.x;
    if (t < count) {
        const u64 key = top[t];
        int rank = 0;
        for (int i = 0; i < count; i++) rank += top[i] > key;
        // (The key's top half is the value's bits, ordered: top_key undone.)
        const u32 h = (u32)(key >> 32), j = 0xffffffffu - (u32)key;
        const float v = __uint_as_float((h & 0x80000000u) ? (h & 0x7fffffffu) : ~h);
        o[rank] = sbad ? __int_as_float(0x7fc00000) : cap > 0.f ? soft_cap(v, cap) : v;
        o[count + rank] = (float)j;
    }
}

// Draws (kiln_ir::Op::Draw; exec.rs `Kernel::Draw`): the token kiln_runtime::draw::draw_row draws,
// bit for bit. Every float operation is rounded on its own (__fmul_rn and kin: no fused
// multiply-add where the host has none), the divisions are IEEE ones, the candidates' sums are
// the host's doubles in the host's order, the vocabulary's are integers (any order). A
// sequence's draw lies in the step buffer (DRAW_BYTES each, from `draws`): the generator's four
// words (xoshiro256**), then the temperature, top-k, top-p and min-p. The generator is not
// advanced here: the host steps its own copy past each draw.
#define DRAW_BYTES 48
#define DRAW_THREADS 1024
#define DRAW_RUN 1024
static_assert(DRAW_RUN == DRAW_THREADS, "the draw's kernels take a token of a run a thread");

struct DrawSpec {
    u64 s[4];
    float t, top_p, min_p;
    u32 top_k;
};

__device__ __forceinline__ DrawSpec draw_spec(const u8* draws, int seq) {
    const u64* w = (const u64*)(draws + (u64)DRAW_BYTES * seq);
    const u32* f = (const u32*)(w + 4);
    DrawSpec d;
#pragma unroll
    for (int i = 0; i < 4; i++) d.s[i] = w[i];
    d.t = __uint_as_float(f[0]);
    d.top_k = f[1];
    d.top_p = __uint_as_float(f[2]);
    d.min_p = __uint_as_float(f[3]);
    return d;
}

// The top 53 bits of the generator's next output from state s.
__device__ __forceinline__ u64 draw_bits(const DrawSpec& d) {
    u64 x = d.s[1] * 5;
    x = ((x << 7) | (x >> 57)) * 9;
    return x >> 11;
}

// Those bits as a double in [0, 1): `Rng::next_f64`.
__device__ __forceinline__ double draw_uniform(const DrawSpec& d) { return (double)draw_bits(d) / 9007199254740992.0; }

// A weight's share, w x 2^40 without its fraction (`draw::weight_share`).
__device__ __forceinline__ u64 draw_share(float w) { return __float2ull_rz(__fmul_rn(w, 1099511627776.0f)); }

// e^x for x <= 0: `draw::exp_nonpositive`, operation for operation.
__device__ __forceinline__ float draw_exp(float x) {
    const float ROUND = 12582912.0f, LN2_HI = 0.6933594f, LN2_LO = -2.1219444e-4f;
    const float m = __fadd_rn(fmaxf(__fmul_rn(x, 1.44269504088896340736f), -126.0f), ROUND);
    const float n = __fsub_rn(m, ROUND);
    const float r = __fsub_rn(__fsub_rn(fmaxf(x, -88.0f), __fmul_rn(n, LN2_HI)), __fmul_rn(n, LN2_LO));
    float p = __fadd_rn(__fmul_rn(1.9875692e-4f, r), 1.3981999e-3f);
    p = __fadd_rn(__fmul_rn(p, r), 8.333452e-3f);
    p = __fadd_rn(__fmul_rn(p, r), 4.1665796e-2f);
    p = __fadd_rn(__fmul_rn(p, r), 0.16666665f);
    p = __fadd_rn(__fmul_rn(p, r), 0.5f);
    const float er = __fadd_rn(__fadd_rn(__fmul_rn(__fmul_rn(p, r), r), r), 1.0f);
    const int e = (int)(__float_as_uint(m) - __float_as_uint(ROUND));
    const float scale = __uint_as_float((u32)(e + 127) << 23);
    return x >= -87.0f ? __fmul_rn(er, scale) : 0.0f;
}

// The weight of logit l at temperature t below the largest scaled logit mx: e^(l/t - mx).
__device__ __forceinline__ float draw_weight(float l, float t, float mx) { return draw_exp(__fsub_rn(__fdiv_rn(l, t), mx)); }

// One warp per row of a top-k head's candidates (`width` = 2 x TOPK_MAX: values, then ids):
// `draw::draw_among`. Lane i holds candidates i and i + 32; their ranks by key (scaled logit,
// then the lower id) order them; lane 0 then walks the kept ones as the host does.
extern "C" __global__ void draw_candidates(const float* x, int* out, int width, const u8* draws) {
    __shared__ float sv[TOPK_MAX];
    __shared__ u32 sid[TOPK_MAX];
    __shared__ float sw[TOPK_MAX];
    pdl_wait();
    const int r = blockIdx.x, lane = threadIdx.x;
    const float* row = x + (u64)r * width;
    const DrawSpec d = draw_spec(draws, r);
    const float v0 = row[lane], v1 = row[lane + 32];
    const u32 i0 = (u32)row[TOPK_MAX + lane], i1 = (u32)row[TOPK_MAX + lane + 32];
    const bool bad = __any_sync(0xffffffffu, !(fabsf(v0) <= 3.402823466e38f) || !(fabsf(v1) <= 3.402823466e38f));
    if (bad) {
        if (lane == 0) out[r] = -1;
        return;
    }
    const float t = d.t, top = row[0];
    if (t == 0.0f) {
        if (lane == 0) out[r] = (int)(u32)row[TOPK_MAX];
        return;
    }
    // (Keys with the ids: distinct.)
    const u64 key0 = top_key(__fdiv_rn(v0, t), i0), key1 = top_key(__fdiv_rn(v1, t), i1);
    int rank0 = 0, rank1 = 0;
    for (int j = 0; j < 32; j++) {
        const u64 a = __shfl_sync(0xffffffffu, key0, j), b = __shfl_sync(0xffffffffu, key1, j);
        rank0 += (a > key0) + (b > key0);
        rank1 += (a > key1) + (b > key1);
    }
    sv[rank0] = v0;
    sid[rank0] = i0;
    sv[rank1] = v1;
    sid[rank1] = i1;
    __syncwarp();
    const float mx = __fdiv_rn(top, t);
    if (!(fabsf(mx) <= 3.402823466e38f)) {
        if (lane == 0) out[r] = (int)sid[0];
        return;
    }
    const int k = (int)max(min(d.top_k, (u32)TOPK_MAX), 1u);
    if (lane < k) sw[lane] = draw_weight(sv[lane], t, mx);
    if (lane + 32 < k) sw[lane + 32] = draw_weight(sv[lane + 32], t, mx);
    __syncwarp();
    if (lane != 0) return;
    // `listed`: the top-k's total, then `kept` (top-p, min-p), then `draw_listed` over the kept.
    double total = 0.0;
    for (int j = 0; j < k; j++) total += (double)sw[j];
    const double target = __dmul_rn((double)d.top_p, total);
    double cum = 0.0;
    int keep = max(k, 1);
    for (int j = 0; j < k; j++) {
        const float w = sw[j];
        if (w <= 0.0f || (d.min_p > 0.0f && w < d.min_p)) {
            keep = max(j, 1);
            break;
        }
        cum += (double)w;
        if (d.top_p < 1.0f && cum >= target) {
            keep = j + 1;
            break;
        }
    }
    double kept = 0.0;
    for (int j = 0; j < keep; j++) kept += (double)sw[j];
    double rem = __dmul_rn(draw_uniform(d), kept);
    for (int j = 0; j < keep; j++) {
        if (rem < (double)sw[j]) {
            out[r] = (int)sid[j];
            return;
        }
        rem -= (double)sw[j];
    }
    // (Rounding left rem at the end: the last one with any weight.)
    int last = 0;
    for (int j = keep - 1; j >= 0; j--) {
        if (sw[j] > 0.0f) {
            last = j;
            break;
        }
    }
    out[r] = (int)sid[last];
}

// A draw among a row of `width` logits (`draw::draw_vocabulary`) in three launches, over runs of
// DRAW_RUN tokens: `draw_runs_max` takes each run's largest logit, whether it holds a value that
// is not finite, and its likeliest token's key (for temperature 0); `draw_runs_sum` each run's sum
// of weight shares (`draw::weight_share`: integers, so any order of addition gives the host's
// sum); `draw_vocabulary`, a block a row, the total, the point the draw picks (`draw::draw_point`),
// the run it falls in and the token in that run, both by prefix sums over the block. The partials
// per (row, run) at `part`: sums (u64), keys (u64), maxima (f32), flags (i32), each an array of
// rows x runs.
struct DrawParts {
    u64* sum;
    u64* key;
    float* max;
    int* bad;
};

__device__ __forceinline__ DrawParts draw_parts(u8* part, int rows, int runs) {
    const u64 n = (u64)rows * runs;
    DrawParts p;
    p.sum = (u64*)part;
    p.key = (u64*)(part + 8 * n);
    p.max = (float*)(part + 16 * n);
    p.bad = (int*)(part + 20 * n);
    return p;
}

// Grid (runs, rows), DRAW_THREADS threads: run q of row r's largest logit, flag and likeliest key.
extern "C" __global__ void __launch_bounds__(DRAW_THREADS) draw_runs_max(const float* x, int width, u8* part) {
    __shared__ float smax[32];
    __shared__ u64 skey[32];
    pdl_wait();
    const int q = blockIdx.x, r = blockIdx.y, runs = gridDim.x, lo = q * DRAW_RUN, len = min(DRAW_RUN, width - lo);
    const float* row = x + (u64)r * width + lo;
    float m = -INFINITY;
    u64 key = 0;
    int bad = 0;
    for (int i = threadIdx.x; i < len; i += blockDim.x) {
        const float v = row[i];
        bad |= !(fabsf(v) <= 3.402823466e38f);
        m = fmaxf(m, v);
        // (-0 as +0: the host compares the values, not their bits.)
        const u64 k = top_key(__fadd_rn(v, 0.0f), (u32)(lo + i));
        key = k > key ? k : key;
    }
    bad = __syncthreads_or(bad);
    m = block_max(m, smax);
    key = block_max_key(key, skey);
    if (threadIdx.x == 0) {
        const DrawParts p = draw_parts(part, gridDim.y, runs);
        p.max[r * runs + q] = m;
        p.key[r * runs + q] = key;
        p.bad[r * runs + q] = bad;
    }
}

// The row's largest scaled logit mx = max / t, or a flag: 1 where the row holds a value that is not
// finite, 2 where there is no softmax (temperature 0, or mx not finite): every thread reads the
// runs' partials.
__device__ __forceinline__ int draw_scale(const DrawParts& p, int r, int runs, float t, float* mx, float* scratch) {
    float m = -INFINITY;
    int bad = 0;
    for (int q = threadIdx.x; q < runs; q += blockDim.x) {
        m = fmaxf(m, p.max[r * runs + q]);
        bad |= p.bad[r * runs + q];
    }
    bad = __syncthreads_or(bad);
    m = block_max(m, scratch);
    if (bad) return 1;
    if (t == 0.0f) return 2;
    *mx = __fdiv_rn(m, t);
    return fabsf(*mx) <= 3.402823466e38f ? 0 : 2;
}

// Grid (runs, rows), DRAW_THREADS threads: run q of row r's sum of weight shares.
extern "C" __global__ void __launch_bounds__(DRAW_THREADS) draw_runs_sum(const float* x, int width, const u8* draws, u8* part) {
    __shared__ float scratch[32];
    __shared__ u64 ssum[32];
    pdl_wait();
    const int q = blockIdx.x, r = blockIdx.y, runs = gridDim.x, lo = q * DRAW_RUN, len = min(DRAW_RUN, width - lo);
    const DrawParts p = draw_parts(part, gridDim.y, runs);
    const float t = draw_spec(draws, r).t;
    // (A token a thread, its logit loaded beside the runs' maxima: one round trip.)
    const float l = (int)threadIdx.x < len ? x[(u64)r * width + lo + threadIdx.x] : 0.0f;
    float mx = 0.0f;
    if (draw_scale(p, r, runs, t, &mx, scratch) != 0) return;
    const u64 s = block_sum_u64((int)threadIdx.x < len ? draw_share(draw_weight(l, t, mx)) : 0, ssum);
    if (threadIdx.x == 0) p.sum[r * runs + q] = s;
}

// One block (DRAW_THREADS) a row: the draw, from the runs' partials.
extern "C" __global__ void __launch_bounds__(DRAW_THREADS) draw_vocabulary(const float* x, int* out, int width, const u8* draws, u8* part) {
    __shared__ float scratch[32];
    __shared__ u64 skey[32], sshare[32];
    __shared__ int srun;
    __shared__ u64 spoint;
    pdl_wait();
    const int r = blockIdx.x, t = threadIdx.x, runs = (width + DRAW_RUN - 1) / DRAW_RUN;
    const float* row = x + (u64)r * width;
    const DrawSpec d = draw_spec(draws, r);
    const DrawParts p = draw_parts(part, gridDim.x, runs);
    const float temp = d.t;
    // (The first chunk of runs' sums loaded beside their maxima: one round trip.)
    const u64 first = t < runs ? p.sum[r * runs + t] : 0;
    float mx = 0.0f;
    const int how = draw_scale(p, r, runs, temp, &mx, scratch);
    if (how == 1) {
        if (t == 0) out[r] = -1;
        return;
    }
    if (how == 2) {
        // The likeliest: at temperature 0 the runs' keys of the largest logit; else (l / t not
        // finite) the largest key of l / t, the lowest id among equals.
        u64 best = 0;
        if (temp == 0.0f) {
            for (int q = t; q < runs; q += DRAW_THREADS) best = p.key[r * runs + q] > best ? p.key[r * runs + q] : best;
        } else {
            for (int i = t; i < width; i += DRAW_THREADS) {
                const u64 k = top_key(__fdiv_rn(row[i], temp), (u32)i);
                best = k > best ? k : best;
            }
        }
        best = block_max_key(best, skey);
        if (t == 0) out[r] = (int)(0xffffffffu - (u32)best);
        return;
    }
    // The total, the point the draw picks, and the run it falls in: the first whose prefix sum
    // passes the point (a chunk of DRAW_THREADS runs at a time).
    u64 sum = first, chunk = 0;
    for (int q = t + DRAW_THREADS; q < runs; q += DRAW_THREADS) sum += p.sum[r * runs + q];
    const u64 total = block_sum_u64(sum, sshare);
    u64 point = __umul64hi(draw_bits(d) << 11, total);
    if (t == 0) srun = -1;
    for (int c0 = 0; c0 < runs; c0 += DRAW_THREADS) {
        const int q = c0 + t;
        const u64 v = c0 == 0 ? first : q < runs ? p.sum[r * runs + q] : 0;
        const u64 incl = block_scan_u64(v, sshare, &chunk);
        if (q < runs && incl - v <= point && point < incl) {
            srun = q;
            spoint = point - (incl - v);
        }
        __syncthreads();
        if (srun >= 0) break;
        point -= chunk;
    }
    // The token: the first of the run whose prefix sum passes what is left of the point. (The
    // point lies below the total, so some run and token hold it.)
    const int q = srun, lo = q * DRAW_RUN, len = min(DRAW_RUN, width - lo);
    point = spoint;
    const u64 v = t < len ? draw_share(draw_weight(row[lo + t], temp, mx)) : 0;
    const u64 incl = block_scan_u64(v, sshare, &chunk);
    if (t < len && incl - v <= point && point < incl) out[r] = lo + t;
}
