// Can one persistent kernel run a Gemma 3 12B decode layer at the read bandwidth? L layers of
// 12B shapes (q/k/v 8192 x 3840, o 3840 x 4096, gate and up 15360 x 3840, down 3840 x 15360, all
// Q4_K; attention over a past of P f32 positions; the norm pairs of Gemma 3) in ONE launch of one
// block of 16 consumer warps and a producer warp per multiprocessor: every tile of every matrix of
// every layer the block takes streams through a shared-memory ring of NS stages (TMA bulk copies):
// the producer asks for the block's tiles in order, each once its stage is free and while fewer
// than `lim` of the block's tiles are in flight, whatever matrix or layer it belongs to, so the
// stream goes on while the consumers wait at a dependency, as far as the ring reaches; 4 groups
// of 4 consumer warps take alternate tiles (each its own stages).
//
// Dependencies (the second design, issue 4ba; the first, 4q/4ag, spent most of a layer in its
// dependent steps, each a chain of round trips): q/k/v's rows are grouped by kv head (the two query
// heads, the key, the value: 1,024 rows), and each block counts its tiles per kv head after its
// last one, so a kv head's attention starts once its own rows are done; attention is split into 16
// shares of the past per kv head (blocks 0..127), every cached row of a share loaded in one round
// trip, the share's partial softmax merged over the block's warps in shared memory; the last share
// of a kv head merges the shares and writes its two heads' output quantized for o, whose consumers
// load their activations from there (no per-block quantization); the blocks meet at arrival
// counters after o, gate/up and down (the norms need whole rows), and each computes the norm pairs
// itself with every input of a norm loaded in one round trip (its weights before the wait) and
// keeps its own copy of the residual in shared memory; the down projection's activations are read
// from shared memory per tile (not held in registers for the whole matrix).
//
// Modes: full; no dependency waits (what the same work costs without them; results wrong); stream
// only (the copies alone); no copies (the consumers compute on the ring as they find it, with the
// dependency waits: what the work costs without the stream beside it). The full mode is checked
// against a chain of plain kernels (kiln's norm_row, quantize32 and chunk decoders); block 0's
// clock at 13 points of each layer shows where a layer goes, and at 4 points of each of its tiles
// (asked for, its group at the wait, past it, the stage freed) what the tiles wait for and what a
// group does between its tiles (the refill it asks for, its sums written out). Switches
// (-D): PRODUCER, DOWN4 (see each). Results: bench/RESULTS.md, 2026-12-02, issue 4q,
// 2026-12-05, issue 4ag (the first design), issues 4ba, 4bb and 4bc (this one; 4bc measured and
// dropped three switches that took meetings of the blocks out of a layer). Build and run on the
// device machine from the checkout's root (arguments: layers, past):
//   bench/cuda/prep.sh /tmp/pk && nvcc -O3 -arch=sm_90 -std=c++17 -I/tmp/pk -o /tmp/pk/persistent bench/cuda/persistent.cu && /tmp/pk/persistent 8 512
#include "common.cuh"
#include "quant_f.cu"
#include "bench_util.cuh"
#include "kiln_ref.cuh"

constexpr int D = 3840, QD = 4096, KVD = 2048, QKV = QD + 2 * KVD, FF = 15360, HD = 256, NH = 16, NKV = 8;
constexpr int GROWS = QKV / NKV;        // q/k/v rows of one kv head: q 2g, q 2g + 1, k g, v g
constexpr int NC = 16, CT = NC * 32;    // consumer warps and threads
constexpr int SHARES = 16;              // attention: position shares per kv head (blocks 0..127)
constexpr int SLOT = 18432;             // ring stage bytes (8 rows of o's 4096 Q4_K columns)
constexpr int XQ_MAX = FF * 5 / 2;      // quantized input of the down projection
constexpr int PD = (D / 4 + CT - 1) / CT;  // float4 a thread: rows of D
constexpr int MAXL = 8;
// A producer warp asks for every tile (1), or each consumer group's thread 0 refills the stage its
// group has just left (0: no 17th warp, so 128 registers a thread where the producer's warp
// leaves 96; the producer's in-flight limit `lim` is then NS).
#ifndef PRODUCER
#define PRODUCER 1
#endif
constexpr int BT = CT + 32 * PRODUCER;
// The down projection's tiles: 0 two whole rows (15,360 columns; the activations read from shared
// memory per tile), 1 eight rows by a quarter of the columns (3,840: the shape of the other
// matrices' tiles), group g taking quarter g of each 8-row block (its quarter of the activations
// held in registers, as the other matrices' are), the last of the 4 to finish adding the 4 partial
// sums in a fixed order (deterministic).
#ifndef DOWN4
#define DOWN4 0
#endif
// Arrival counters of a layer: o, gate/up, down (blocks), merged kv heads, then q/k/v tiles per kv
// head, then attention shares per kv head.
constexpr int C_O = 0, C_GU = 1, C_DN = 2, C_ATT = 3, C_QKV = 4, C_SH = 4 + NKV, NCNT = 4 + 2 * NKV;

struct Layer {
    const u8 *wqkv, *wo, *wg, *wu, *wd;
    const float *n_in, *n_pa, *n_pf, *n_po;  // input, post-attention, pre-FFN, post-FFN norm weights
    const float *kc, *vc;                    // [NKV][P][HD]
};
struct Prm {
    Layer ly[MAXL];
    const float* x0;
    float *qkv, *att, *o, *glu, *dn, *res, *part;  // per layer (res: the residual after the last layer)
    u8* xqa;                                      // per layer: attention's output quantized for o
    u32* cnt;                                     // [L][NCNT]
    long long* stamps;                            // block 0's clock at 13 points a layer
    long long* trace;                             // block 0's clock at 4 points of each tile (see consume)
    int L, P, mode, lim;                          // lim: most tiles in flight per block
};

// One arrival on a shared-memory barrier.
__device__ __forceinline__ void bar_arrive(u64* bar) {
    asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0];\n}" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void cbar() { asm volatile("bar.sync 1, %0;" ::"n"(CT) : "memory"); }
// Consumer groups (each takes one tile at a time and owns NS / GROUPS stages: 4; 2 and 1 measured
// no faster, issue 4bb): warps, threads each.
constexpr int GROUPS = 4, GW = NC / GROUPS, GT = GW * 32;
// Sets of a tile's tr rows that a group's lanes walk side by side: the most (a power of two) that
// leave each lane at most one of the row's chunks.
__host__ __device__ constexpr int sets_of(int chunks, int tr) {
    int s = 1;
    while (2 * s <= tr && GT / (2 * s) >= chunks) s *= 2;
    return s;
}
__device__ __forceinline__ void gbar(int g) { asm volatile("bar.sync %0, %1;" ::"r"(2 + g), "n"(GT) : "memory"); }
__device__ __forceinline__ u32 ld_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
// The consumers wait until *c reaches n (thread 0 polls, with acquire; `waits` false: the barrier only).
__device__ __forceinline__ void wait_count(const u32* c, u32 n, bool waits) {
    if (waits && threadIdx.x == 0)
        while (ld_acquire(c) < n) {
        }
    cbar();
}
// Sum over the consumer threads (every one gets it).
__device__ __forceinline__ float csum(float v, float* scr) {
    v = warp_sum(v);
    cbar();
    if ((threadIdx.x & 31) == 0) scr[threadIdx.x >> 5] = v;
    cbar();
    return warp_sum((threadIdx.x & 31) < NC ? scr[threadIdx.x & 31] : 0.f);
}

// Sums each of N values (a power of two, at most 32) over the warp's lanes: lane l gets the sum of
// a[l / (32 / N)], the values halved at each exchange (N = 8: kiln's rows_sum8).
template <int N> __device__ __forceinline__ float rows_sum(float (&a)[N], int lane) {
    int sh = 16;
#pragma unroll
    for (int n = N; n > 1; n /= 2, sh /= 2) {
        const bool b = (lane & sh) != 0;
#pragma unroll
        for (int i = 0; i < n / 2; i++) {
            const float send = b ? a[i] : a[i + n / 2], keep = b ? a[i + n / 2] : a[i];
            a[i] = keep + __shfl_xor_sync(0xffffffffu, send, sh);
        }
    }
    float v = a[0];
#pragma unroll
    for (; sh >= 1; sh /= 2) v += __shfl_xor_sync(0xffffffffu, v, sh);
    return v;
}

// xq = quantize(a) over FF elements (the down projection's input), every element loaded at once.
__device__ void quantize_ff(const float* a, u8* xq) {
    constexpr int PF = (FF / 4 + CT - 1) / CT;
    float4 v[PF];
#pragma unroll
    for (int j = 0; j < PF; j++) {
        const int i4 = threadIdx.x + j * CT;
        v[j] = i4 < FF / 4 ? __ldcg((const float4*)a + i4) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int j = 0; j < PF; j++) {
        const int i4 = threadIdx.x + j * CT;
        if (i4 - (threadIdx.x & 31) < FF / 4) quantize32x4(v[j], xq, FF, 4 * i4);
    }
    cbar();
}

// Matrix m of a layer: 0 q/k/v, 1 o, 2 gate/up (tiles of 4 gate rows then the same 4 up rows), 3 down.
struct Geo {
    int tiles, tr, k;
    u32 rb;
};
__host__ __device__ constexpr Geo geo(int m) {
    return m == 0 ? Geo{QKV / 8, 8, D, (u32)(D / 256 * 144)}
         : m == 1 ? Geo{D / 8, 8, QD, (u32)(QD / 256 * 144)}
         : m == 2 ? Geo{FF / 4, 8, D, (u32)(D / 256 * 144)}
         : DOWN4  ? Geo{D / 8 * GROUPS, 8, FF / GROUPS, (u32)(FF / GROUPS / 256 * 144)}
                  : Geo{D / 2, 2, FF, (u32)(FF / 256 * 144)};
}
// DOWN4: the down projection's 8-row blocks (each a tile per group: its column share), and the
// most a block takes (its partial sums' slots in shared memory; main checks the grid).
constexpr int DRB = D / 8, DRB_MAX = 8;
// The tiles of matrix m that block b of a grid of G takes (b, b + G, ...; DOWN4's down projection:
// 8-row blocks b, b + G, ..., each as GROUPS tiles).
__host__ __device__ constexpr int block_tiles(int m, int b, int G) {
    const bool split = DOWN4 && m == 3;
    const int units = split ? DRB : geo(m).tiles;
    return (split ? GROUPS : 1) * (b < units ? (units - 1 - b) / G + 1 : 0);
}

// The block's tiles of each matrix in a layer (block b: tiles b, b + gridDim.x, ...): its tile
// sequence, the same every layer, is what the ring streams.
struct Order {
    int n[4], per;
};
__device__ Order order() {
    Order o;
    o.per = 0;
    for (int m = 0; m < 4; m++) {
        o.n[m] = block_tiles(m, blockIdx.x, gridDim.x);
        o.per += o.n[m];
    }
    return o;
}
// The ring: group g (see consume) owns stages g NS / 4 .. (g + 1) NS / 4 - 1 and takes the tiles
// sq = g mod 4 of the block's sequence, tile sq into its stage (sq / 4) mod (NS / 4).
template <int NS> __device__ __forceinline__ u32 slot_of(u32 sq) { return (sq % GROUPS) * (NS / GROUPS) + (sq / GROUPS) % (NS / GROUPS); }
template <int NS> __device__ __forceinline__ u32 phase_of(u32 sq) { return (sq / GROUPS / (NS / GROUPS)) & 1; }
// Asks the copy engine for the block's tile `sq` (of all layers) into its stage.
template <int NS>
__device__ void issue(const Prm& p, const Order& o, u8* ring, u64* full, u32 sq) {
    const int l = sq / o.per;
    if (l >= p.L) return;
    int j = sq % o.per, m = 0;
    while (j >= o.n[m]) j -= o.n[m++];
    const Geo g = geo(m);
    const Layer& y = p.ly[l];
    const int t = blockIdx.x + j * gridDim.x;
    const u32 slot = slot_of<NS>(sq), bytes = g.tr * g.rb;
    u8* dst = ring + slot * SLOT;
    if (blockIdx.x == 0) p.trace[4 * sq] = clock64();
    bar_expect(&full[slot], bytes);
    if (DOWN4 && m == 3) {
        // 8-row block b + (j / GROUPS) G, column share sq mod GROUPS (the group that takes it).
        const u64 row0 = (u64)(blockIdx.x + (j / GROUPS) * gridDim.x) * 8, rbf = FF / 256 * 144;
        for (int r = 0; r < 8; r++) bulk_copy(dst + r * g.rb, y.wd + (row0 + r) * rbf + (sq % GROUPS) * g.rb, g.rb, &full[slot]);
    } else if (m == 2) {
        bulk_copy(dst, y.wg + (u64)t * 4 * g.rb, 4 * g.rb, &full[slot]);
        bulk_copy(dst + 4 * g.rb, y.wu + (u64)t * 4 * g.rb, 4 * g.rb, &full[slot]);
    } else {
        const u8* w = m == 0 ? y.wqkv : m == 1 ? y.wo : y.wd;
        bulk_copy(dst, w + (u64)t * bytes, bytes, &full[slot]);
    }
}

// The block's tiles of matrix M (consumers): group gi of 4 warps takes the block's tiles whose
// sequence number is gi mod 4 (4 tiles in flight per block, as 4 blocks of 4 warps would); in a
// tile, lane li of a set of LANES lanes takes the 64-element chunks li, li + LANES, ... of the
// set's ROWS rows, then the group meets, its warp 0 writes the sums, its thread 0 frees the stage.
// (Freeing it before the arithmetic, the tile loaded into registers first, was slower: spills,
// issue 4bb.) The activations xq (shared or global memory) are held in registers for the whole
// matrix, except the down projection's without DOWN4 (15,360 columns: read from shared memory per
// tile). Each warp's row sums go out in one butterfly (rows_sum).
template <int NS, int M>
__device__ void consume(const Prm& p, const Order& o, u8* ring, u64* full, u64* empty, u32& seq, const u8* xq, float* out, float (*red)[2][GW][8],
                        bool compute, float (*dpart)[GROUPS][8] = nullptr, u32* dcnt = nullptr) {
    constexpr Geo g = geo(M);
    // The activations' row length and the group's first column (DOWN4: its quarter).
    constexpr bool QUARTER = DOWN4 && M == 3;
    constexpr int XK = QUARTER ? FF : g.k;
    constexpr int CHUNKS = g.k / 64, SETS = sets_of(CHUNKS, g.tr), ROWS = g.tr / SETS, LANES = GT / SETS;
    constexpr int CH = (CHUNKS + LANES - 1) / LANES;
    constexpr bool HOLD = M != 3 || QUARTER;
    const int gi = threadIdx.x / GT, tig = threadIdx.x % GT, wg = tig >> 5, lane = threadIdx.x & 31;
    const int set = tig / LANES, li = tig % LANES, x0 = QUARTER ? gi * g.k : 0;
    XGroup xg[HOLD ? CH : 1][4];
    if (HOLD && compute)
#pragma unroll
        for (int q = 0; q < CH; q++)
            if (li + q * LANES < CHUNKS)
#pragma unroll
                for (int e = 0; e < 4; e++) xg[HOLD ? q : 0][e] = xgroup(xq, XK, x0 + 64 * (li + q * LANES) + 16 * e);
    const u32 s0 = seq;
    const int mine = o.n[M];
    int par = 0;
    for (int j = (int)((gi - s0 % GROUPS + GROUPS) % GROUPS); j < mine; j += GROUPS, par ^= 1) {
        const u32 sq = s0 + j, slot = slot_of<NS>(sq);
        const int t = blockIdx.x + j * gridDim.x;
        // Block 0's trace of the tile: asked for (issue), its group at the wait, past the wait
        // (landed), its stage freed.
        const long long at = clock64();
        if (p.mode != 3) bar_wait(&full[slot], phase_of<NS>(sq));
        if (blockIdx.x == 0 && tig == 0) p.trace[4 * sq + 1] = at, p.trace[4 * sq + 2] = clock64();
        float acc[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; r++) acc[r] = 0.f;
        const Mat st{ring + slot * SLOT, g.rb, 0};
        typename RingChunk<F_Q4_K>::Raw raw[CH][ROWS];
        auto load = [&](int q) {
#pragma unroll
            for (int r = 0; r < ROWS; r++) raw[q][r] = RingChunk<F_Q4_K>::load(st, set * ROWS + r, li + q * LANES);
        };
        if (compute) {
#pragma unroll
            for (int q = 0; q < CH; q++) {
                const int c = li + q * LANES;
                if (c < CHUNKS) {
                    const int qh = HOLD ? q : 0;
                    if (!HOLD)
#pragma unroll
                        for (int e = 0; e < 4; e++) xg[0][e] = xgroup(xq, XK, x0 + 64 * c + 16 * e);
                    load(q);
#pragma unroll
                    for (int r = 0; r < ROWS; r++) acc[r] += RingChunk<F_Q4_K>::dot(st, raw[q][r], c, xg[qh]);
                }
            }
            const float v = rows_sum<ROWS>(acc, lane);
            if (lane % (32 / ROWS) == 0) red[gi][par][wg][lane / (32 / ROWS)] = v;
        }
        gbar(gi);
        // The stage back to the ring: to the producer, or asked for again with the group's tile
        // NS later.
        if (tig == 0) {
            if (blockIdx.x == 0) p.trace[4 * sq + 3] = clock64();
            if (PRODUCER)
                bar_arrive(&empty[slot]);
            else if (p.mode != 3)
                issue<NS>(p, o, ring, full, sq + NS);
        }
        if (!compute || wg != 0) continue;
        // Row r of the tile: set r / ROWS, the sums of that set's warps.
        auto sum = [&](int r) {
            float s = 0.f;
#pragma unroll
            for (int w = 0; w < GW / SETS; w++) s += red[gi][par][(r / ROWS) * (GW / SETS) + w][r % ROWS];
            return s;
        };
        if constexpr (QUARTER) {
            // The block's 8-row block j / GROUPS: this share's sums, then the last share to finish
            // adds them all, in share order.
            const int k = j / GROUPS;
            if (lane < 8) dpart[k][gi][lane] = sum(lane);
            __syncwarp();
            bool last = false;
            if (lane == 0) {
                __threadfence_block();
                last = atomicAdd(&dcnt[k], 1u) % GROUPS == GROUPS - 1;
                if (last) __threadfence_block();
            }
            if (__shfl_sync(0xffffffffu, last, 0) && lane < 8) {
                float v = 0.f;
#pragma unroll
                for (int q = 0; q < GROUPS; q++) v += dpart[k][q][lane];
                out[(blockIdx.x + k * gridDim.x) * 8 + lane] = v;
            }
        } else if (M == 2) {
            if (lane < 4) out[t * 4 + lane] = gelu_tanh(sum(lane)) * sum(lane + 4);
        } else if (lane < g.tr)
            out[t * g.tr + lane] = sum(lane);
    }
    seq = s0 + mine;
}

// A norm's weights, loaded before its dependency wait.
struct NormW {
    float4 w1[PD], w2[PD];
};
__device__ __forceinline__ NormW norm_weights(const float* w1, const float* w2) {
    NormW n;
#pragma unroll
    for (int j = 0; j < PD; j++) {
        const int i4 = threadIdx.x + j * CT;
        const bool ok = i4 < D / 4;
        n.w1[j] = ok && w1 ? ((const float4*)w1)[i4] : make_float4(0.f, 0.f, 0.f, 0.f);
        n.w2[j] = ok ? ((const float4*)w2)[i4] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    return n;
}
__device__ __forceinline__ float dot4(float4 a, float4 b) { return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w; }
__device__ __forceinline__ float4 fma4(float4 a, float s, float4 w, float4 c) {
    return make_float4(c.x + a.x * s * w.x, c.y + a.y * s * w.y, c.z + a.z * s * w.z, c.w + a.w * s * w.w);
}

// The block's residual (resid, shared memory) and the next matrix's input: FIRST: resid = a,
// xq = quantize(a / rms(a) * w2); else resid += a / rms(a) * w1, xq = quantize(resid / rms(resid)
// * w2). Every input is loaded at once (a from L2: other blocks wrote it); block 0 writes resid to
// `keep` when given.
template <bool FIRST>
__device__ void norm_pair(const float* a, float* resid, const NormW& nw, u8* xq, float* keep, float* scr) {
    float4 v[PD];
#pragma unroll
    for (int j = 0; j < PD; j++) {
        const int i4 = threadIdx.x + j * CT;
        v[j] = i4 < D / 4 ? __ldcg((const float4*)a + i4) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    if (!FIRST) {
        float ss = 0.f;
#pragma unroll
        for (int j = 0; j < PD; j++) ss += dot4(v[j], v[j]);
        const float inv = 1.f / sqrtf(csum(ss, scr) / (float)D + 1e-6f);
#pragma unroll
        for (int j = 0; j < PD; j++) {
            const int i4 = threadIdx.x + j * CT;
            if (i4 < D / 4) v[j] = fma4(v[j], inv, nw.w1[j], ((float4*)resid)[i4]);
        }
    }
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < PD; j++) {
        const int i4 = threadIdx.x + j * CT;
        ss += dot4(v[j], v[j]);
        if (i4 < D / 4) {
            ((float4*)resid)[i4] = v[j];
            if (keep && blockIdx.x == 0) ((float4*)keep)[i4] = v[j];
        }
    }
    const float inv = 1.f / sqrtf(csum(ss, scr) / (float)D + 1e-6f);
#pragma unroll
    for (int j = 0; j < PD; j++) {
        const int i4 = threadIdx.x + j * CT;
        if (i4 - (threadIdx.x & 31) < D / 4) quantize32x4(fma4(v[j], inv, nw.w2[j], make_float4(0.f, 0.f, 0.f, 0.f)), xq, D, 4 * i4);
    }
    cbar();
}

// Attention of layer l for block b < 128: kv head g = b % 8 (its two query heads), the np = P / 16
// positions of share b / 8; warp w takes positions w and w + 16 (every cached key and value row
// loaded in one round trip, before the wait), the warps' partial softmaxes merged in shared
// memory (scr: NC x 2 x (HD + 2) floats); the last share of a kv head to arrive merges the shares
// and writes its two heads' output (att, and quantized for o into xqa), then counts the head.
__device__ void attention(const Prm& p, int l, float* scr, u32* flag, bool waits) {
    const int b = blockIdx.x, g = b % NKV, s = b / NKV, np = p.P / SHARES, p0 = s * np;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    u32* cnt = p.cnt + l * NCNT;
    const float* q = p.qkv + (u64)l * QKV + g * GROWS;
    const Layer& y = p.ly[l];
    // At most 2 positions a warp (P <= 512): every cached key and value row the warp needs loaded
    // at once, before the wait.
    float4 kr[2][2], vr[2][2];
#pragma unroll
    for (int t = 0; t < 2; t++) {
        const int j = w + NC * t;
        if (j < np) {
            const u64 row = ((u64)g * p.P + p0 + j) * HD + lane * 8;
            kr[t][0] = *(const float4*)(y.kc + row), kr[t][1] = *(const float4*)(y.kc + row + 4);
            vr[t][0] = *(const float4*)(y.vc + row), vr[t][1] = *(const float4*)(y.vc + row + 4);
        }
    }
    wait_count(cnt + C_QKV + g, GROWS / 8, waits);
    float4 qa[2][2];
#pragma unroll
    for (int h = 0; h < 2; h++) qa[h][0] = __ldcg((const float4*)(q + h * HD + lane * 8)), qa[h][1] = __ldcg((const float4*)(q + h * HD + lane * 8 + 4));
    float m[2], sum[2], acc[2][8];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float sc[2];
        m[h] = -INFINITY;
#pragma unroll
        for (int t = 0; t < 2; t++) {
            sc[t] = -INFINITY;
            if (w + NC * t < np) {
                sc[t] = warp_sum(dot4(qa[h][0], kr[t][0]) + dot4(qa[h][1], kr[t][1])) * 0.0625f;
                m[h] = fmaxf(m[h], sc[t]);
            }
        }
        sum[h] = 0.f;
#pragma unroll
        for (int e8 = 0; e8 < 8; e8++) acc[h][e8] = 0.f;
#pragma unroll
        for (int t = 0; t < 2; t++)
            if (w + NC * t < np) {
                const float e = __expf(sc[t] - m[h]);
                sum[h] += e;
                const float vv[8] = {vr[t][0].x, vr[t][0].y, vr[t][0].z, vr[t][0].w, vr[t][1].x, vr[t][1].y, vr[t][1].z, vr[t][1].w};
#pragma unroll
                for (int e8 = 0; e8 < 8; e8++) acc[h][e8] += e * vv[e8];
            }
    }
    float* part = scr;  // [NC][2][HD + 2]
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float* pw = part + (w * 2 + h) * (HD + 2);
        if (lane == 0) pw[0] = m[h], pw[1] = sum[h];
#pragma unroll
        for (int e8 = 0; e8 < 8; e8++) pw[2 + lane * 8 + e8] = acc[h][e8];
    }
    cbar();
    // Thread (h, d): the share's softmax over its warps (a warp with no position has m = -inf).
    const int h = threadIdx.x >> 8, d = threadIdx.x & 255, head = 2 * g + h;
    float mm = -INFINITY;
#pragma unroll
    for (int v = 0; v < NC; v++) mm = fmaxf(mm, part[(v * 2 + h) * (HD + 2)]);
    float ls = 0.f, as = 0.f;
#pragma unroll
    for (int v = 0; v < NC; v++) {
        const float* pw = part + (v * 2 + h) * (HD + 2);
        const float f = pw[0] == -INFINITY ? 0.f : __expf(pw[0] - mm);
        ls += f * pw[1];
        as += f * pw[2 + d];
    }
    float* pt = p.part + (((u64)l * NH + head) * SHARES + s) * (HD + 2);
    if (d == 0) pt[0] = mm, pt[1] = ls;
    pt[2 + d] = as;
    cbar();
    if (threadIdx.x == 0) {
        const bool last = arrive(cnt + C_SH + g, 1) == SHARES - 1;
        if (last) acquire();
        *flag = last;
    }
    cbar();
    if (!*flag) return;
    const float* ph = p.part + ((u64)l * NH + head) * SHARES * (HD + 2);
    float ms[SHARES], lv[SHARES], av[SHARES];
#pragma unroll
    for (int t = 0; t < SHARES; t++) ms[t] = __ldcg(ph + t * (HD + 2)), lv[t] = __ldcg(ph + t * (HD + 2) + 1), av[t] = __ldcg(ph + t * (HD + 2) + 2 + d);
    mm = -INFINITY;
#pragma unroll
    for (int t = 0; t < SHARES; t++) mm = fmaxf(mm, ms[t]);
    ls = 0.f, as = 0.f;
#pragma unroll
    for (int t = 0; t < SHARES; t++) {
        const float f = __expf(ms[t] - mm);
        ls += f * lv[t];
        as += f * av[t];
    }
    const float out = as / ls;
    p.att[(u64)l * QD + head * HD + d] = out;
    quantize32(out, p.xqa + (u64)l * (QD * 5 / 2), QD, head * HD + d);
    cbar();
    if (threadIdx.x == 0) arrive(cnt + C_ATT, 1);
}

template <int NS>
__global__ void __launch_bounds__(BT, 1) layers(const __grid_constant__ Prm p) {
    extern __shared__ __align__(128) u8 dyn[];
    __shared__ __align__(8) u64 full[NS], empty[NS];
    __shared__ float red[GROUPS][2][GW][8], scr[32];
    __shared__ __align__(16) float resid[D];
    __shared__ u32 flag, dcnt[DRB_MAX];
    __shared__ float dpart[DRB_MAX][GROUPS][8];  // DOWN4: partial sums [8-row block][share][row]
    u8* ring = dyn;
    u8* xq = dyn + NS * SLOT;  // also attention's scratch (NC x 2 x (HD + 2) floats)
    const Order o = order();
    if (threadIdx.x == 0) {
        for (int s = 0; s < NS; s++) bar_init(&full[s], 1), bar_init(&empty[s], 1);
        for (int k = 0; k < DRB_MAX; k++) dcnt[k] = 0;
        bar_init_fence();
    }
    __syncthreads();
    // The producer (warp NC, one lane): the block's tiles in order, tile sq once its stage is free
    // (tile sq - NS consumed) and fewer than p.lim of the block's tiles are in flight (tile sq -
    // lim landed).
    if (PRODUCER && threadIdx.x >= CT) {
        if (threadIdx.x == CT && p.mode != 3) {
            const u32 total = (u32)o.per * p.L;
            for (u32 sq = 0; sq < total; sq++) {
                if (sq >= NS) bar_wait(&empty[slot_of<NS>(sq)], phase_of<NS>(sq) ^ 1);
                if (p.lim < NS && sq >= (u32)p.lim) bar_wait(&full[slot_of<NS>(sq - p.lim)], phase_of<NS>(sq - p.lim));
                issue<NS>(p, o, ring, full, sq);
            }
        }
        return;
    }
    // Without a producer: each group's thread 0 asks for the group's first tiles (then refills
    // each stage as the group leaves it, in consume).
    if (!PRODUCER && p.mode != 3 && threadIdx.x % GT == 0)
        for (u32 sq = threadIdx.x / GT; sq < NS; sq += GROUPS) issue<NS>(p, o, ring, full, sq);
    const bool compute = p.mode != 2, waits = p.mode == 0 || p.mode == 3;
    const u32 G = gridDim.x;
    auto done = [&](u32* c) {
        cbar();
        if (threadIdx.x == 0) arrive(c, 1);
    };
    u32 seq = 0;
    for (int l = 0; l < p.L; l++) {
        const Layer& y = p.ly[l];
        u32* cnt = p.cnt + l * NCNT;
        float* keep = l == p.L - 1 ? p.res : nullptr;
        auto stamp = [&](int i) {
            if (blockIdx.x == 0 && threadIdx.x == 0) p.stamps[l * 16 + i] = clock64();
        };
        // q/k/v: the residual into the layer (the last layer's down projection after its norm),
        // its input norm.
        stamp(0);
        if (l == 0) {
            stamp(1);
            if (compute) norm_pair<true>(p.x0, resid, norm_weights(nullptr, y.n_in), xq, keep, scr);
        } else {
            const NormW nw = norm_weights(p.ly[l - 1].n_po, y.n_in);
            wait_count(cnt - NCNT + C_DN, G, waits);
            stamp(1);
            if (compute) norm_pair<false>(p.dn + (u64)(l - 1) * D, resid, nw, xq, keep, scr);
        }
        stamp(2);
        consume<NS, 0>(p, o, ring, full, empty, seq, xq, p.qkv + (u64)l * QKV, red, compute);
        cbar();
        if (compute && threadIdx.x == 0) {
            // q/k/v's arrivals: the block's tiles b, b + G, ... counted per kv head (tile t: rows
            // 8t..8t+7, kv head t / 128) after the last of them, one release and then a relaxed
            // addition a head (a release per tile held its group ~2 µs under the stream, and
            // the block's attention starts only here anyway; issue 4bc).
            auto head = [&](int j) { return (blockIdx.x + j * G) * 8 / GROWS; };
            __threadfence();
            for (int j = 0, n = 1; j < o.n[0]; j++, n++)
                if (j + 1 == o.n[0] || head(j + 1) != head(j)) {
                    asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" ::"l"(cnt + C_QKV + head(j)), "r"(n) : "memory");
                    n = 0;
                }
        }
        stamp(3);
        if (compute && blockIdx.x < NKV * SHARES) attention(p, l, (float*)xq, &flag, waits);
        stamp(4);
        wait_count(cnt + C_ATT, NKV, waits);
        stamp(5);
        consume<NS, 1>(p, o, ring, full, empty, seq, p.xqa + (u64)l * (QD * 5 / 2), p.o + (u64)l * D, red, compute);
        done(cnt + C_O);
        stamp(6);
        {
            const NormW nw = norm_weights(y.n_pa, y.n_pf);
            wait_count(cnt + C_O, G, waits);
            stamp(7);
            if (compute) norm_pair<false>(p.o + (u64)l * D, resid, nw, xq, nullptr, scr);
        }
        stamp(8);
        consume<NS, 2>(p, o, ring, full, empty, seq, xq, p.glu + (u64)l * FF, red, compute);
        done(cnt + C_GU);
        stamp(9);
        wait_count(cnt + C_GU, G, waits);
        stamp(10);
        if (compute) quantize_ff(p.glu + (u64)l * FF, xq);
        stamp(11);
        consume<NS, 3>(p, o, ring, full, empty, seq, xq, p.dn + (u64)l * D, red, compute, dpart, dcnt);
        done(cnt + C_DN);
        stamp(12);
    }
}

// ----- the reference: the same layers as a chain of plain kernels -----
__global__ void r_norm(const float* a, const float* w1, const float* res, const float* w2, int k, u8* xq, float* h) {
    __shared__ float scratch[32];
    norm_row<8>(a, w1, res, w2, 1e-6f, k, xq, h, nullptr, scratch);
}
__global__ void r_glu(const float* g, const float* u, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = gelu_tanh(g[i]) * u[i];
}
// One block per query head, one thread per dimension (q/k/v's rows grouped by kv head).
__global__ void r_attn(const float* qkv, const float* kc, const float* vc, int P, float* out) {
    extern __shared__ float s[];
    const int head = blockIdx.x, g = head / 2, d = threadIdx.x;
    const float* q = qkv + g * GROWS + (head % 2) * HD;
    for (int j = d; j < P; j += blockDim.x) {
        float a = 0.f;
        for (int e = 0; e < HD; e++) a += q[e] * kc[((u64)g * P + j) * HD + e];
        s[j] = a * 0.0625f;
    }
    __syncthreads();
    float m = -INFINITY;
    for (int j = 0; j < P; j++) m = fmaxf(m, s[j]);
    float sum = 0.f, acc = 0.f;
    for (int j = 0; j < P; j++) {
        const float e = __expf(s[j] - m);
        sum += e;
        acc += e * vc[((u64)g * P + j) * HD + d];
    }
    out[head * HD + d] = acc / sum;
}

static double rel_l2(const float* a, const float* b, int n) {
    std::vector<float> x(n), y(n);
    CK(cudaMemcpy(x.data(), a, 4 * n, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(y.data(), b, 4 * n, cudaMemcpyDeviceToHost));
    double e = 0, r = 0;
    for (int i = 0; i < n; i++) {
        e += (double)(x[i] - y[i]) * (x[i] - y[i]);
        r += (double)y[i] * y[i];
    }
    return sqrt(e / r);
}

int main(int argc, char** argv) {
    const int L = argc > 1 ? atoi(argv[1]) : 8, P = argc > 2 ? atoi(argv[2]) : 512;
    if (L < 1 || L > MAXL || P % SHARES || P / SHARES > 2 * NC) {
        fprintf(stderr, "usage: persistent [layers 1-8] [past: a multiple of 16, at most 512]\n");
        return 2;
    }
    cudaDeviceProp dp;
    CK(cudaGetDeviceProperties(&dp, 0));
    const int sms = dp.multiProcessorCount;
    if (DOWN4 && (DRB + sms - 1) / sms > DRB_MAX) {
        fprintf(stderr, "DOWN4 needs at least %d multiprocessors (this card has %d)\n", (DRB + DRB_MAX - 1) / DRB_MAX, sms);
        return 2;
    }
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    const double bw = read_bandwidth(sms, st);
    Prm p = {};
    p.L = L;
    p.P = P;
    u64 wbytes = 0;
    auto vec = [&](int n, float base, float amp) {
        float* v;
        CK(cudaMalloc(&v, 4ull * n));
        static u32 seed = 77;
        fill_f<<<(n + 255) / 256, 256>>>(v, n, seed++, base, amp);
        return v;
    };
    std::vector<Matrix> keep;
    for (int l = 0; l < L; l++) {
        Layer& y = p.ly[l];
        Matrix m[5] = {make_matrix(QKV, D, false), make_matrix(D, QD, false), make_matrix(FF, D, false), make_matrix(FF, D, false),
                       make_matrix(D, FF, false)};
        for (auto& x : m) wbytes += x.bytes, keep.push_back(x);
        y.wqkv = m[0].w, y.wo = m[1].w, y.wg = m[2].w, y.wu = m[3].w, y.wd = m[4].w;
        y.n_in = vec(D, 1.f, 0.5f), y.n_pa = vec(D, 1.f, 0.5f), y.n_pf = vec(D, 1.f, 0.5f), y.n_po = vec(D, 1.f, 0.5f);
        y.kc = vec(NKV * P * HD, 0.f, 2.f), y.vc = vec(NKV * P * HD, 0.f, 2.f);
    }
    p.x0 = vec(D, 0.f, 4.f);
    auto buf = [&](u64 n) {
        float* v;
        CK(cudaMalloc(&v, 4 * n));
        CK(cudaMemset(v, 0, 4 * n));
        return v;
    };
    p.qkv = buf((u64)L * QKV), p.att = buf((u64)L * QD), p.o = buf((u64)L * D), p.glu = buf((u64)L * FF), p.dn = buf((u64)L * D);
    p.res = buf(D), p.part = buf((u64)L * NH * SHARES * (HD + 2));
    CK(cudaMalloc(&p.xqa, (size_t)L * QD * 5 / 2));
    const size_t ncnt = (size_t)L * NCNT;
    CK(cudaMalloc(&p.cnt, 4 * ncnt));
    CK(cudaMalloc(&p.stamps, 8 * 16 * L));
    CK(cudaMemset(p.stamps, 0, 8 * 16 * L));
    // Block 0's tiles of each matrix and of a layer.
    int n0[4], per0 = 0;
    for (int m = 0; m < 4; m++) per0 += n0[m] = block_tiles(m, 0, sms);
    CK(cudaMalloc(&p.trace, 8 * 4 * (size_t)per0 * L));
    CK(cudaDeviceSynchronize());

    auto run = [&](auto kern, int ns, int mode) {
        p.mode = mode;
        p.lim = ns;
        const size_t smem = (size_t)ns * SLOT + XQ_MAX;
        CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        CK(cudaMemsetAsync(p.cnt, 0, 4 * ncnt, st));
        kern<<<sms, BT, smem, st>>>(p);
    };
    // The reference chain, into its own buffers.
    float *r_x = buf(D), *r_h = buf(D), *r_qkv = buf(QKV), *r_att = buf(QD), *r_o = buf(D), *r_g = buf(FF), *r_u = buf(FF), *r_gl = buf(FF),
          *r_dn = buf(D);
    u8* r_xq;
    CK(cudaMalloc(&r_xq, XQ_MAX));
    for (int l = 0; l < L; l++) {
        const Layer& y = p.ly[l];
        const u32 rb3840 = D / 256 * 144, rb4096 = QD / 256 * 144, rb15360 = FF / 256 * 144;
        if (l == 0) {
            CK(cudaMemcpy(r_x, p.x0, 4 * D, cudaMemcpyDeviceToDevice));
            r_norm<<<1, 512>>>(r_x, y.n_in, nullptr, nullptr, D, r_xq, nullptr);
        } else
            r_norm<<<1, 512>>>(r_dn, p.ly[l - 1].n_po, r_h, y.n_in, D, r_xq, r_x);
        ref_mv<F_Q4_K><<<QKV / 4, 128>>>(y.wqkv, rb3840, QKV, r_xq, D, r_qkv);
        r_attn<<<NH, HD, 4 * P>>>(r_qkv, y.kc, y.vc, P, r_att);
        quant_x<<<QD / 256, 256>>>(r_att, r_xq, QD);
        ref_mv<F_Q4_K><<<D / 4, 128>>>(y.wo, rb4096, D, r_xq, QD, r_o);
        r_norm<<<1, 512>>>(r_o, y.n_pa, r_x, y.n_pf, D, r_xq, r_h);
        ref_mv<F_Q4_K><<<FF / 4, 128>>>(y.wg, rb3840, FF, r_xq, D, r_g);
        ref_mv<F_Q4_K><<<FF / 4, 128>>>(y.wu, rb3840, FF, r_xq, D, r_u);
        r_glu<<<FF / 256, 256>>>(r_g, r_u, r_gl, FF);
        quant_x<<<FF / 256, 256>>>(r_gl, r_xq, FF);
        ref_mv<F_Q4_K><<<D / 4, 128>>>(y.wd, rb15360, D, r_xq, FF, r_dn);
    }
    CK(cudaDeviceSynchronize());
    for (int ns : {8, 4}) {
        run(ns == 8 ? layers<8> : layers<4>, ns, 0);
        CK(cudaStreamSynchronize(st));
        CK(cudaGetLastError());
        printf("ring %d stages, last layer against the chain of plain kernels (rel L2): residual in %.2e, q/k/v %.2e, attention %.2e, o %.2e, "
               "glu %.2e, down %.2e\n",
               ns, rel_l2(p.res, r_x, D), rel_l2(p.qkv + (u64)(L - 1) * QKV, r_qkv, QKV), rel_l2(p.att + (u64)(L - 1) * QD, r_att, QD),
               rel_l2(p.o + (u64)(L - 1) * D, r_o, D), rel_l2(p.glu + (u64)(L - 1) * FF, r_gl, FF), rel_l2(p.dn + (u64)(L - 1) * D, r_dn, D));
    }
    printf("read bandwidth %.0f GB/s; %d layers, %.1f MB of weights each, past %d (KV %.1f MB a layer), %d blocks of %d warps\n",
           bw / 1e9, L, wbytes / 1e6 / L, P, 2.0 * NKV * P * HD * 4 / 1e6, sms, NC);
    const char* names[4] = {"full", "no dependency waits", "stream only", "no copies (smem as found)"};
    const int ns = 8;
    for (int pass = 0; pass < 2; pass++)
        for (int lim : {8, 4, 3, 2})
            for (int mode : {0, 1, 2, 3}) {
                if (!PRODUCER && lim != ns) continue;
                auto k = layers<8>;
                p.lim = lim;
                std::vector<double> ts;
                for (int r = 0; r < 7; r++) {
                    cudaEvent_t e0, e1;
                    CK(cudaEventCreate(&e0));
                    CK(cudaEventCreate(&e1));
                    p.mode = mode;
                    const size_t smem = (size_t)ns * SLOT + XQ_MAX;
                    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
                    CK(cudaMemsetAsync(p.cnt, 0, 4 * ncnt, st));
                    CK(cudaEventRecord(e0, st));
                    k<<<sms, BT, smem, st>>>(p);
                    CK(cudaEventRecord(e1, st));
                    CK(cudaEventSynchronize(e1));
                    float ms;
                    CK(cudaEventElapsedTime(&ms, e0, e1));
                    ts.push_back(ms * 1e3);
                    CK(cudaEventDestroy(e0));
                    CK(cudaEventDestroy(e1));
                }
                CK(cudaGetLastError());
                const double us = median(ts) / L;
                if ((mode == 0 || mode == 3) && L > 2) {
                    // Block 0's view of the last run, median over layers 1..L-1, in µs at the clock
                    // that makes layers 1..L-1 take the measured time per layer.
                    std::vector<long long> h(16 * L);
                    CK(cudaMemcpy(h.data(), p.stamps, 8 * 16 * L, cudaMemcpyDeviceToHost));
                    const double clk = (double)(h[16 * (L - 1) + 12] - h[16 * 1 + 0]) / (L - 1) / us;
                    const char* what[12] = {"wait", "norm", "q/k/v", "attention", "wait", "o", "wait", "norm pair", "gate/up", "wait", "quantize", "down"};
                    printf("    block 0 (µs, at %.2f GHz):", clk / 1e3);
                    for (int i = 0; i < 12; i++) {
                        std::vector<double> d;
                        for (int l = 1; l < L; l++) d.push_back((h[16 * l + i + 1] - h[16 * l + i]) / clk);
                        printf(" %s %.1f%s", what[i], median(d), i == 11 ? "\n" : ",");
                    }
                    // Block 0's tiles, layers 1..L-1, per matrix, µs: asked for -> past the wait
                    // (the bytes' latency where the group waited), the group's wait, its work
                    // (past the wait -> stage freed), tiles of the block in flight when one is
                    // asked for (asked for, not yet past their wait); summed over a group's tiles
                    // of a layer: wait, work, and what its first warp did between freeing a stage
                    // and reaching its next tile of the matrix (asking for the refill, the sums
                    // written out).
                    if (mode == 0) {
                        std::vector<long long> tr(4 * (size_t)per0 * L);
                        CK(cudaMemcpy(tr.data(), p.trace, 8 * tr.size(), cudaMemcpyDeviceToHost));
                        const char* mat[4] = {"q/k/v", "o", "gate/up", "down"};
                        printf("    block 0's tiles (µs: asked -> landed where waited, wait, work; in flight when asked; sums over a group's tiles):");
                        for (int m = 0, off = 0; m < 4; off += n0[m++]) {
                            std::vector<double> lat, wt, wk, fl;
                            double swt = 0, swk = 0, saf = 0;
                            for (int l = 1; l < L; l++)
                                for (int j = 0; j < n0[m]; j++) {
                                    const size_t sq = (size_t)l * per0 + off + j;
                                    const long long* q = &tr[4 * sq];
                                    wt.push_back((q[2] - q[1]) / clk);
                                    wk.push_back((q[3] - q[2]) / clk);
                                    swt += wt.back(), swk += wk.back();
                                    if (q[2] - q[1] > clk / 10) lat.push_back((q[2] - q[0]) / clk);
                                    int n = 0;
                                    for (size_t s2 = sq > 16 ? sq - 16 : 0; s2 < sq; s2++)
                                        if (tr[4 * s2] <= q[0] && tr[4 * s2 + 2] > q[0]) n++;
                                    fl.push_back(n);
                                    if (j + GROUPS < n0[m]) saf += (tr[4 * (sq + GROUPS) + 1] - q[3]) / clk;
                                }
                            const double per = (double)(L - 1) * GROUPS;  // a group's share of a layer
                            printf(" %s %.1f (%zu of %zu waited), %.2f, %.2f; %.1f; a group's layer: wait %.1f, work %.1f, after %.1f%s", mat[m],
                                   lat.empty() ? 0.0 : median(lat), lat.size(), wt.size(), median(wt), median(wk), median(fl), swt / per, swk / per, saf / per,
                                   m == 3 ? "\n" : " |");
                        }
                    }
                }
                printf("pass %d, ring %d stages, at most %d in flight, %-20s %6.1f us a layer = %5.0f GB/s of weights (%2.0f%% of the read bandwidth)\n", pass, ns, lim,
                       names[mode], us, wbytes / L / (us * 1e-6) / 1e9, 100.0 * wbytes / L / (us * 1e-6) / bw);
            }
    return 0;
}
