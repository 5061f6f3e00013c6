// Causal attention over the device-resident KV cache plus the step's new rows, and the append of
// the new rows. Each row's position and sequence are read from the step buffer (common.cuh), and
// so are the layer's key and value cache addresses of each sequence (`cache[2 s]`, `cache[2 s + 1]`),
// so a captured graph replays for any past length of its bucket and any session's cache, and one
// launch serves the rows of several sequences, each attending to its own cache.

#define ATT_WARPS 16
#define ATT_UNROLL 4
#define ATT_MAX_DIM 256
// Fewest positions per block of a split head, and per head to split at all. A block's warps take
// ATT_WARPS * ATT_UNROLL = 64 positions per turn, and beside the weight stream each further turn
// cost more than a merge: from 128 positions on (not 256) an H200 decodes at 128-255 positions of
// past 1.07x (12B) and 1.14-1.18x (270M) faster; from 65 on, slower at 65-96 (bench/RESULTS.md
// "issue 4x").
#define ATT_SPLIT_MIN 64
#define ATT_SPLIT_FROM 128
// Most shares of a head (`ATTENTION_SPLITS_MAX` in exec.rs).
#define ATT_SPLITS_MAX 16

// A cache element: f32 as computed, or f16 (IEEE half bits, rounded to nearest even). With an
// f16 cache the step's new rows are read rounded as well (`round`), so a row's attention sees the
// same keys and values whether they were cached by an earlier step or are new in this one: chunked
// prompts, decode and batched decode stay the same function of the positions. (The f32 kernels
// read their cache with plain loads: only `put` serves both.)
template <class C> struct KvElem;
template <> struct KvElem<float> {
    static __device__ __forceinline__ void put(float* p, float x) { *p = x; }
};
template <> struct KvElem<u16> {
    static __device__ __forceinline__ float of(u16 h) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
        return f;
    }
    static __device__ __forceinline__ u16 bits(float x) {
        u16 h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
        return h;
    }
    static __device__ __forceinline__ float get(const u16* p) { return of(*p); }
    static __device__ __forceinline__ void put(u16* p, float x) { *p = bits(x); }
    static __device__ __forceinline__ float round(float x) { return of(bits(x)); }
    // Four halves (8 bytes) as floats, and four floats rounded as the cache holds them.
    static __device__ __forceinline__ float4 of4(uint2 b) { return make_float4(of(b.x & 0xffff), of(b.x >> 16), of(b.y & 0xffff), of(b.y >> 16)); }
    static __device__ __forceinline__ float4 round4(float4 a) { return make_float4(round(a.x), round(a.y), round(a.z), round(a.w)); }
};

// `splits` blocks per (new row, query head), each over one contiguous share of the row's
// positions (from ATT_SPLIT_FROM positions on, as many shares as give each at least
// ATT_SPLIT_MIN positions, at most `splits`; the rest of the blocks only wait); each warp walks
// every ATT_WARPS-th position of its block's share with an online softmax, then the warps'
// partial results are merged. With more than one share each block writes its merged partial (d
// sums, their maximum, their sum of weights) to `part` and the last block of the head to arrive
// (counted in `cnt`, which it resets) merges the shares, every share's values loaded in one round
// trip (three before: at 256-2048 positions 12B decode 1-2% and 270M decode 3-4% faster, "issue
// 4x"), in the same order as the warps' merge: a decode step's 4-16 heads would
// otherwise run on as many multiprocessors, each reading its head's whole cache (12B decode on an
// H200, with the early launches of common.cuh: 283 -> 303 tokens/s). Sliding layers keep `window`
// rows in a ring (slot = pos % window); global layers keep every position (slot = pos).
// With `append` (a one-row plan, whose row is sequence 0), the first query head of each group also
// appends the row's keys and values to the cache: the slot it writes holds a position no query of
// this step reads. Plans of several rows append with `kv_append` after attention.
// With `xq`, the output row is also written quantized for the next matrix-vector product.
// With QK (`attention_qk`: one new row, d a multiple of 64): q and k_new are the projections before their RoPE
// at the row's position, whose cosines and sines `rope` holds (d / 2 pairs of the layer's
// frequencies, written by set_inputs, several launches back: read before waiting), pairing elements
// i and i + d / 2 (NeoX) or with `adjacent` 2i and 2i + 1, and with `wq` before their per-head RMS
// norms (weights wq, wk); the block applies them to its query head (warp 0) and its group's key head
// (warp 1) first, into shared memory, so the decode step needs no separate q/k norm or RoPE kernel.
// (`attention` has no code for the q/k steps, whose registers slowed 12B decode.)
// With CAP (`attention_cap`, `attention_tiled_cap`: Gemma 2), the scaled scores s are soft-capped,
// softcap * tanh(s / softcap), before the softmax; the other kernels have no code for it.
// The cache slot of position `pos` (a ring of `window` rows on a sliding layer, else every
// position), and the first position a row at position `p` attends to.
__device__ __forceinline__ u64 cache_slot(int pos, int window) { return window > 0 ? (u64)(pos % window) : (u64)pos; }
__device__ __forceinline__ int first_visible(int p, int window) { return window > 0 ? max(0, p + 1 - window) : 0; }

// RoPE pair j of a head of d elements: elements rope_first(j) and rope_first(j) + rope_second(d):
// j and j + d / 2 (NeoX), or with `adjacent` 2j and 2j + 1.
__device__ __forceinline__ int rope_first(int j, int adjacent) { return adjacent ? 2 * j : j; }
__device__ __forceinline__ int rope_second(int d, int adjacent) { return adjacent ? 1 : d / 2; }

template <bool QK, bool CAP, class C>
__device__ __forceinline__ void attention_impl(const float* q, const float* k_new, const float* v_new, const u64* cache,
                                               float* out, const int* step, int q_heads, int kv_heads,
                                               int d, int window, float scale, int append, u8* xq, const float* wq,
                                               const float* wk, const float2* rope, int adjacent, float eps, int splits, float* part,
                                               u32* cnt, float softcap) {
    __shared__ float s_acc[ATT_WARPS][ATT_MAX_DIM];
    __shared__ float s_m[ATT_WARPS], s_l[ATT_WARPS];
    __shared__ float s_qk[2][ATT_MAX_DIM];
    int head = blockIdx.x / splits, share = blockIdx.x % splits;
    int i = head / q_heads, h = head % q_heads;
    int g = h / (q_heads / kv_heads);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    StepRow row = step_row(step, i);
    // (A one-row plan's row is sequence 0: its cache addresses are loaded beside its record, not
    // after it.)
    int seq = append ? 0 : row.seq;
    C *k_cache = (C*)cache[2 * seq], *v_cache = (C*)cache[2 * seq + 1];
    // The sequence's cached positions are 0..start; its new rows first.. hold start...
    int p = row.pos, start = p - (i - row.first);
    int lo = first_visible(p, window);
    // This block's share of the positions lo..p: [b0, e0].
    int len = p + 1 - lo, shares = len < ATT_SPLIT_FROM ? 1 : min(splits, (len + ATT_SPLIT_MIN - 1) / ATT_SPLIT_MIN);
    int per_share = (len + shares - 1) / shares;
    int b0 = lo + share * per_share, e0 = min(p, b0 + per_share - 1);
    if (share >= shares) {
        pdl_wait();
        return;
    }
    int kvw = kv_heads * d, per = d >> 5;
    // Lane l of warps 0 and 1 rotates the pairs j = l + 32t of its head (t < per / 2), by angle j of
    // the table.
    float wa[ATT_MAX_DIM / 64], wb[ATT_MAX_DIM / 64], rc[ATT_MAX_DIM / 64], rs[ATT_MAX_DIM / 64];
    if (!QK) rope = nullptr;
    bool rot = rope && warp < 2;
    if (rot) {
        const float* w = warp == 0 ? wq : wk;
#pragma unroll
        for (int t = 0; t < ATT_MAX_DIM / 64; t++) {
            const bool in = t < per / 2;
            const int a = rope_first(lane + 32 * t, adjacent);
            wa[t] = in && w ? w[a] : 1.f;
            wb[t] = in && w ? w[a + rope_second(d, adjacent)] : 1.f;
            float2 cs = in ? rope[lane + 32 * t] : make_float2(1.f, 0.f);
            rc[t] = cs.x;
            rs[t] = cs.y;
        }
    }
    // The cached rows were written by earlier steps: brought into L2 before waiting for this step's
    // q, k and v (one 128-byte line per thread and turn; the blocks of a sequence's first row do it).
    if (i == row.first) {
        constexpr int LINE = 128 / sizeof(C);
        int lines = max(1, d / LINE);
        for (int t = threadIdx.x; t < (min(e0 + 1, start) - b0) * lines; t += blockDim.x) {
            int pos = b0 + t / lines;
            u64 slot = cache_slot(pos, window);
            prefetch_l2(k_cache + slot * kvw + g * d + LINE * (t % lines));
            prefetch_l2(v_cache + slot * kvw + g * d + LINE * (t % lines));
        }
    }
    pdl_wait();
    // The appending blocks load the new row's values now, beside the q/k loads below, not after
    // the barrier: there the loop's loads would wait behind this load and the cache stores that
    // take it (one more round trip to memory in the step's critical path).
    const bool appends = append && share == 0 && h % (q_heads / kv_heads) == 0;
    const float v_app = appends && (int)threadIdx.x < d ? v_new[(u64)i * kvw + g * d + threadIdx.x] : 0.f;
    if (rope) {
        if (rot) {
            const float* x = warp == 0 ? q + ((u64)i * q_heads + h) * d : k_new + (u64)i * kvw + g * d;
            float xa[ATT_MAX_DIM / 64], xb[ATT_MAX_DIM / 64], ss = 0.f;
#pragma unroll
            for (int t = 0; t < ATT_MAX_DIM / 64; t++) {
                const bool in = t < per / 2;
                const int a = rope_first(lane + 32 * t, adjacent);
                xa[t] = in ? x[a] : 0.f;
                xb[t] = in ? x[a + rope_second(d, adjacent)] : 0.f;
            }
            // (Summed in element order for NeoX pairs, as the norm kernels do.)
#pragma unroll
            for (int t = 0; t < ATT_MAX_DIM / 64; t++) ss += xa[t] * xa[t];
#pragma unroll
            for (int t = 0; t < ATT_MAX_DIM / 64; t++) ss += xb[t] * xb[t];
            float inv = wq ? 1.f / sqrtf(warp_sum(ss) / (float)d + eps) : 1.f;
#pragma unroll
            for (int t = 0; t < ATT_MAX_DIM / 64; t++) {
                if (t < per / 2) {
                    const int e = rope_first(lane + 32 * t, adjacent);
                    float a = xa[t] * inv * wa[t], b = xb[t] * inv * wb[t];
                    s_qk[warp][e] = a * rc[t] - b * rs[t];
                    s_qk[warp][e + rope_second(d, adjacent)] = b * rc[t] + a * rs[t];
                }
            }
        }
        __syncthreads();
    }
    // (With rope the rotated query and key in shared memory replace the step's rows.)
    const float* kh_new = rope ? s_qk[1] : k_new + (u64)i * kvw + g * d;
    float qv[ATT_MAX_DIM / 32], acc[ATT_MAX_DIM / 32];
    const float* qh = rope ? s_qk[0] : q + ((u64)i * q_heads + h) * d;
#pragma unroll
    for (int t = 0; t < ATT_MAX_DIM / 32; t++) {
        qv[t] = t < per ? qh[lane + 32 * t] : 0.f;
        acc[t] = 0.f;
    }
    if (appends && (int)threadIdx.x < d) {
        // (d <= ATT_MAX_DIM <= blockDim.x: one element a thread.)
        u64 slot = cache_slot(p, window);
        KvElem<C>::put(k_cache + slot * kvw + g * d + threadIdx.x, kh_new[threadIdx.x]);
        KvElem<C>::put(v_cache + slot * kvw + g * d + threadIdx.x, v_app);
    }
    float m = -INFINITY, l = 0.f;
    // ATT_UNROLL positions per iteration: their key and value loads are in flight together.
    for (int pos0 = b0 + warp; pos0 <= e0; pos0 += ATT_UNROLL * ATT_WARPS) {
        float s[ATT_UNROLL], vv[ATT_UNROLL][ATT_MAX_DIM / 32];
#pragma unroll
        for (int u = 0; u < ATT_UNROLL; u++) {
            int pos = pos0 + u * ATT_WARPS;
            s[u] = 0.f;
            if (pos <= e0) {
                // (Position pos of the row's sequence is new row i + pos - p.)
                const float* kn = rope ? s_qk[1] : k_new + (u64)(i + pos - p) * kvw + g * d;
                const float* vn = v_new + (u64)(i + pos - p) * kvw + g * d;
                if constexpr (sizeof(C) == 4) {
                    const float *kr = kn, *vr = vn;
                    if (pos < start) {
                        u64 slot = cache_slot(pos, window);
                        kr = k_cache + slot * kvw + g * d;
                        vr = v_cache + slot * kvw + g * d;
                    }
#pragma unroll
                    for (int t = 0; t < ATT_MAX_DIM / 32; t++) {
                        if (t < per) {
                            s[u] += qv[t] * kr[lane + 32 * t];
                            vv[u][t] = vr[lane + 32 * t];
                        }
                    }
                } else if (pos < start) {
                    u64 slot = cache_slot(pos, window);
                    const C *kr = k_cache + slot * kvw + g * d, *vr = v_cache + slot * kvw + g * d;
#pragma unroll
                    for (int t = 0; t < ATT_MAX_DIM / 32; t++) {
                        if (t < per) {
                            s[u] += qv[t] * KvElem<C>::get(kr + lane + 32 * t);
                            vv[u][t] = KvElem<C>::get(vr + lane + 32 * t);
                        }
                    }
                } else {
#pragma unroll
                    for (int t = 0; t < ATT_MAX_DIM / 32; t++) {
                        if (t < per) {
                            s[u] += qv[t] * KvElem<C>::round(kn[lane + 32 * t]);
                            vv[u][t] = KvElem<C>::round(vn[lane + 32 * t]);
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int u = 0; u < ATT_UNROLL; u++) s[u] = warp_sum(s[u]) * scale;
        if (CAP) {
#pragma unroll
            for (int u = 0; u < ATT_UNROLL; u++) s[u] = soft_cap(s[u], softcap);
        }
#pragma unroll
        for (int u = 0; u < ATT_UNROLL; u++) {
            if (pos0 + u * ATT_WARPS <= e0) {
                float mn = fmaxf(m, s[u]);
                float c = expf(m - mn), e = expf(s[u] - mn);
                l = l * c + e;
#pragma unroll
                for (int t = 0; t < ATT_MAX_DIM / 32; t++)
                    if (t < per) acc[t] = acc[t] * c + e * vv[u][t];
                m = mn;
            }
        }
    }
#pragma unroll
    for (int t = 0; t < ATT_MAX_DIM / 32; t++)
        if (t < per) s_acc[warp][lane + 32 * t] = acc[t];
    if (lane == 0) {
        s_m[warp] = m;
        s_l[warp] = l;
    }
    __syncthreads();
    // (Warp 0 has position b0: mx is finite.)
    float mx = -INFINITY;
    for (int w = 0; w < ATT_WARPS; w++) mx = fmaxf(mx, s_m[w]);
    float sum = 0.f;
    for (int w = 0; w < ATT_WARPS; w++) sum += s_l[w] * expf(s_m[w] - mx);
    float* o = out + ((u64)i * q_heads + h) * d;
    float* mine = part + (u64)blockIdx.x * (d + 2);
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        float a = 0.f;
        for (int w = 0; w < ATT_WARPS; w++) a += s_acc[w][j] * expf(s_m[w] - mx);
        if (shares > 1) {
            mine[j] = a;
            continue;
        }
        o[j] = a / sum;
        // (d is a multiple of 32 and at most blockDim.x: whole warps quantize their 32 values.)
        if (xq) quantize32(a / sum, xq + (u64)i * xq_bytes(q_heads * d), q_heads * d, h * d + j);
    }
    if (shares == 1) return;
    if (threadIdx.x == 0) {
        mine[d] = mx;
        mine[d + 1] = sum;
    }
    // The last share to arrive merges them all (its reads bypass L1: the others wrote elsewhere).
    if (!last_to_arrive(cnt + head, (u32)shares)) return;
    // Every share's maximum, weight sum and this thread's value, loaded in one round trip.
    const float* all = part + (u64)head * splits * (d + 2);
    const int j = threadIdx.x;
    float ms[ATT_SPLITS_MAX], ls[ATT_SPLITS_MAX], as[ATT_SPLITS_MAX];
#pragma unroll
    for (int s = 0; s < ATT_SPLITS_MAX; s++) {
        if (s < shares) {
            ms[s] = __ldcg(all + (u64)s * (d + 2) + d);
            ls[s] = __ldcg(all + (u64)s * (d + 2) + d + 1);
            as[s] = j < d ? __ldcg(all + (u64)s * (d + 2) + j) : 0.f;
        }
    }
    float m_all = -INFINITY, l_all = 0.f, a = 0.f;
#pragma unroll
    for (int s = 0; s < ATT_SPLITS_MAX; s++)
        if (s < shares) m_all = fmaxf(m_all, ms[s]);
#pragma unroll
    for (int s = 0; s < ATT_SPLITS_MAX; s++) {
        if (s < shares) {
            const float c = expf(ms[s] - m_all);
            l_all += ls[s] * c;
            a += as[s] * c;
        }
    }
    // (d is a multiple of 32 and at most blockDim.x: whole warps quantize their 32 values.)
    if (j < d) {
        o[j] = a / l_all;
        if (xq) quantize32(a / l_all, xq + (u64)i * xq_bytes(q_heads * d), q_heads * d, h * d + j);
    }
}

#define ATT_ARGS                                                                                                   \
    const float *q, const float *k_new, const float *v_new, const u64 *cache, float *out, const int *step,               \
        int q_heads, int kv_heads, int d, int window, float scale, int append, u8 *xq, const float *wq, const float *wk,  \
        const float2 *rope, int adjacent, float eps, int splits, float *part, u32 *cnt, float softcap
#define ATT_PASS q, k_new, v_new, cache, out, step, q_heads, kv_heads, d, window, scale, append, xq, wq, wk, rope, adjacent, eps, splits, part, cnt, softcap
extern "C" __global__ void attention(ATT_ARGS) { attention_impl<false, false, float>(ATT_PASS); }
extern "C" __global__ void attention_qk(ATT_ARGS) { attention_impl<true, false, float>(ATT_PASS); }
extern "C" __global__ void attention_cap(ATT_ARGS) { attention_impl<false, true, float>(ATT_PASS); }
extern "C" __global__ void attention_f16(ATT_ARGS) { attention_impl<false, false, u16>(ATT_PASS); }
extern "C" __global__ void attention_qk_f16(ATT_ARGS) { attention_impl<true, false, u16>(ATT_PASS); }
extern "C" __global__ void attention_cap_f16(ATT_ARGS) { attention_impl<false, true, u16>(ATT_PASS); }

// Attention of prompt rows (plans of several rows of a sequence): a block takes ATT_TILE_ROWS
// consecutive rows and one query head. The rows of one sequence among them (a segment: usually
// all of them) walk the positions they attend to in chunks of ATT_TILE_KEYS, each chunk's keys and
// values copied into shared memory once for all the segment's rows (`attention` reads a row's
// whole past from L2 for every row and head: a prompt of n rows reads it n times). Each warp takes
// ATT_TILE_RPW rows: lane j scores the chunk's key j against them, an online softmax over the
// chunks, then every lane adds its d / 32 output elements. Blocks take the last row tiles (the
// longest pasts) first. Appends nothing (`kv_append` after it). With CAP, soft-capped scores (as
// `attention`).
#define ATT_TILE_ROWS 16
#define ATT_TILE_WARPS 8
#define ATT_TILE_RPW (ATT_TILE_ROWS / ATT_TILE_WARPS)
#define ATT_TILE_KEYS 32
// Floats of a key row in shared memory: d + 4, so that the float4 loads of 8 lanes (one per key)
// fall in distinct banks.
#define ATT_TILE_KS(d) ((d) + 4)
#define ATT_TILE_ARGS                                                                                                     \
    const float *q, const float *k_new, const float *v_new, const u64 *cache, float *out, const int *step, int q_heads,    \
        int kv_heads, int d, int window, float scale, u8 *xq, int rows, float softcap
#define ATT_TILE_PASS q, k_new, v_new, cache, out, step, q_heads, kv_heads, d, window, scale, xq, rows, softcap
template <bool CAP, class C> __device__ __forceinline__ void attention_tiled_impl(ATT_TILE_ARGS) {
    extern __shared__ float4 att_tile_smem[];
    float* const sq = (float*)att_tile_smem;            // [ATT_TILE_ROWS][d]
    float* const sk = sq + ATT_TILE_ROWS * d;            // [ATT_TILE_KEYS][ATT_TILE_KS(d)]
    float* const sv = sk + ATT_TILE_KEYS * ATT_TILE_KS(d); // [ATT_TILE_KEYS][d]
    const int h = blockIdx.y, g = h / (q_heads / kv_heads);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, per = d >> 5, d4 = d >> 2, kvw = kv_heads * d;
    const int r0 = ((int)gridDim.x - 1 - (int)blockIdx.x) * ATT_TILE_ROWS, r1 = min(rows, r0 + ATT_TILE_ROWS);
    pdl_wait();
    for (int a = r0; a < r1;) {
        // Rows a..b of the tile are one sequence's: row i at position ra.pos + i - a; the
        // sequence's cache holds positions 0..start, its new rows ra.first.. the positions start...
        const StepRow ra = step_row(step, a);
        const int b = min(r1, ra.end), start = ra.pos - (a - ra.first);
        const C *k_cache = (const C*)cache[2 * ra.seq], *v_cache = (const C*)cache[2 * ra.seq + 1];
        const int p0 = first_visible(ra.pos, window), p1 = ra.pos + (b - 1 - a);
        // (Every warp is past the previous segment's last chunk and query rows.)
        __syncthreads();
        for (int c = threadIdx.x; c < (b - a) * d4; c += blockDim.x)
            cp_async16(sq + (c / d4 + a - r0) * d + 4 * (c % d4), q + ((u64)(a + c / d4) * q_heads + h) * d + 4 * (c % d4));
        float m[ATT_TILE_RPW], l[ATT_TILE_RPW], acc[ATT_TILE_RPW][ATT_MAX_DIM / 32];
#pragma unroll
        for (int r = 0; r < ATT_TILE_RPW; r++) {
            m[r] = -INFINITY;
            l[r] = 0.f;
#pragma unroll
            for (int u = 0; u < ATT_MAX_DIM / 32; u++) acc[r][u] = 0.f;
        }
        for (int c0 = p0; c0 <= p1; c0 += ATT_TILE_KEYS) {
            const int nk = min(ATT_TILE_KEYS, p1 + 1 - c0);
            if (c0 != p0) __syncthreads();
            for (int c = threadIdx.x; c < nk * d4; c += blockDim.x) {
                const int j = c / d4, t = 4 * (c % d4), pos = c0 + j;
                const u64 r = (u64)(ra.first + pos - start);
                const float *kn = k_new + r * kvw + g * d, *vn = v_new + r * kvw + g * d;
                if constexpr (sizeof(C) == 4) {
                    const float *kr = kn, *vr = vn;
                    if (pos < start) {
                        const u64 slot = cache_slot(pos, window);
                        kr = k_cache + slot * kvw + g * d;
                        vr = v_cache + slot * kvw + g * d;
                    }
                    cp_async16(sk + j * ATT_TILE_KS(d) + t, kr + t);
                    cp_async16(sv + j * d + t, vr + t);
                } else {
                    // (Half rows are converted by the threads: 4 elements, 8 bytes, a load.)
                    float4 kx, vx;
                    if (pos < start) {
                        const u64 slot = cache_slot(pos, window);
                        kx = KvElem<C>::of4(*(const uint2*)(k_cache + slot * kvw + g * d + t));
                        vx = KvElem<C>::of4(*(const uint2*)(v_cache + slot * kvw + g * d + t));
                    } else {
                        kx = KvElem<C>::round4(*(const float4*)(kn + t));
                        vx = KvElem<C>::round4(*(const float4*)(vn + t));
                    }
                    *(float4*)(sk + j * ATT_TILE_KS(d) + t) = kx;
                    *(float4*)(sv + j * d + t) = vx;
                }
            }
            cp_async_commit();
            cp_async_wait<0>();
            __syncthreads();
            float s[ATT_TILE_RPW];
#pragma unroll
            for (int r = 0; r < ATT_TILE_RPW; r++) s[r] = 0.f;
            if (lane < nk) {
                const float4* kj = (const float4*)(sk + lane * ATT_TILE_KS(d));
#pragma unroll 4
                for (int t = 0; t < d4; t++) {
                    const float4 kv = kj[t];
#pragma unroll
                    for (int r = 0; r < ATT_TILE_RPW; r++) {
                        const float4 qv = ((const float4*)(sq + (warp * ATT_TILE_RPW + r) * d))[t];
                        s[r] = fmaf(qv.x, kv.x, s[r]);
                        s[r] = fmaf(qv.y, kv.y, s[r]);
                        s[r] = fmaf(qv.z, kv.z, s[r]);
                        s[r] = fmaf(qv.w, kv.w, s[r]);
                    }
                }
            }
            // Each row's weights e of the chunk's keys (0 where masked; all 0 for a row outside
            // the segment or with no key in the chunk, whose state stays as it is).
            float e[ATT_TILE_RPW];
#pragma unroll
            for (int r = 0; r < ATT_TILE_RPW; r++) {
                const int i = r0 + warp * ATT_TILE_RPW + r, p = ra.pos + (i - a);
                const int lo = first_visible(p, window), pos = c0 + lane;
                const bool ok = i >= a && i < b && lane < nk && pos >= lo && pos <= p;
                const float sc = ok ? (CAP ? soft_cap(s[r] * scale, softcap) : s[r] * scale) : -INFINITY, mx = warp_max(sc);
                e[r] = 0.f;
                if (mx != -INFINITY) {
                    const float mn = fmaxf(m[r], mx), c = expf(m[r] - mn);
                    e[r] = ok ? expf(sc - mn) : 0.f;
                    l[r] = l[r] * c + warp_sum(e[r]);
#pragma unroll
                    for (int u = 0; u < ATT_MAX_DIM / 32; u++) acc[r][u] *= c;
                    m[r] = mn;
                }
            }
            for (int j = 0; j < nk; j++) {
                float pj[ATT_TILE_RPW];
#pragma unroll
                for (int r = 0; r < ATT_TILE_RPW; r++) pj[r] = __shfl_sync(0xffffffffu, e[r], j);
#pragma unroll
                for (int u = 0; u < ATT_MAX_DIM / 32; u++) {
                    if (u < per) {
                        const float v = sv[j * d + lane + 32 * u];
#pragma unroll
                        for (int r = 0; r < ATT_TILE_RPW; r++) acc[r][u] = fmaf(pj[r], v, acc[r][u]);
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < ATT_TILE_RPW; r++) {
            const int i = r0 + warp * ATT_TILE_RPW + r;
            if (i < a || i >= b) continue;
            float* o = out + ((u64)i * q_heads + h) * d;
#pragma unroll
            for (int u = 0; u < ATT_MAX_DIM / 32; u++) {
                if (u < per) {
                    const float y = acc[r][u] / l[r];
                    o[lane + 32 * u] = y;
                    // (Whole warps quantize 32 consecutive values.)
                    if (xq) quantize32(y, xq + (u64)i * xq_bytes(q_heads * d), q_heads * d, h * d + lane + 32 * u);
                }
            }
        }
        a = b;
    }
}
extern "C" __global__ void __launch_bounds__(32 * ATT_TILE_WARPS) attention_tiled(ATT_TILE_ARGS) {
    attention_tiled_impl<false, float>(ATT_TILE_PASS);
}
extern "C" __global__ void __launch_bounds__(32 * ATT_TILE_WARPS) attention_tiled_cap(ATT_TILE_ARGS) {
    attention_tiled_impl<true, float>(ATT_TILE_PASS);
}
extern "C" __global__ void __launch_bounds__(32 * ATT_TILE_WARPS) attention_tiled_f16(ATT_TILE_ARGS) {
    attention_tiled_impl<false, u16>(ATT_TILE_PASS);
}
extern "C" __global__ void __launch_bounds__(32 * ATT_TILE_WARPS) attention_tiled_cap_f16(ATT_TILE_ARGS) {
    attention_tiled_impl<true, u16>(ATT_TILE_PASS);
}

// Appends the step's new rows to one layer's cache of their sequence (only a sequence's last
// `window` rows on a sliding layer, so no two blocks write one slot). One block per new row.
template <class C>
__device__ __forceinline__ void kv_append_impl(const float* k_new, const float* v_new, const u64* cache, const int* step, int width,
                                               int window) {
    int r = blockIdx.x;
    pdl_wait();
    if (r >= step[0]) return;
    StepRow row = step_row(step, r);
    if (window > 0 && r < row.end - window) return;
    C *k_cache = (C*)cache[2 * row.seq], *v_cache = (C*)cache[2 * row.seq + 1];
    int pos = row.pos;
    u64 slot = cache_slot(pos, window);
    for (int j = threadIdx.x; j < width; j += blockDim.x) {
        KvElem<C>::put(k_cache + slot * width + j, k_new[(u64)r * width + j]);
        KvElem<C>::put(v_cache + slot * width + j, v_new[(u64)r * width + j]);
    }
}
#define KV_APPEND_ARGS const float *k_new, const float *v_new, const u64 *cache, const int *step, int width, int window
extern "C" __global__ void kv_append(KV_APPEND_ARGS) { kv_append_impl<float>(k_new, v_new, cache, step, width, window); }
extern "C" __global__ void kv_append_f16(KV_APPEND_ARGS) { kv_append_impl<u16>(k_new, v_new, cache, step, width, window); }
