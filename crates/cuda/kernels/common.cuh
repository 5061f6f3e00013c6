// Shared by every kiln kernel family: integer types, f16/bf16 loads, warp reductions.
typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
#define INFINITY __int_as_float(0x7f800000)

// Programmatic dependent launch (sm_90 and later; a no-op before). Kernels are launched so that
// the next kernel may start before this one ends: each kernel first loads (or prefetches into L2)
// what no earlier kernel of the step writes (weights, the step buffer, cached keys and values),
// then `pdl_wait`s: it waits for its predecessor to complete and its writes to be visible, and then
// lets its own successor launch, whose prologue so overlaps this kernel's work (triggering at
// entry in every kernel lets a chain of waiting kernels fill the device: measured slower). The
// norm and quantize kernels between two matrix-vector launches let their successor launch at
// entry (`pdl_release`): its blocks take the multiprocessors the matrix-vector launch before
// leaves and start streaming weights while the small kernel waits and runs (12B decode on an
// H200, together with the split attention: 283 -> 303 tokens/s; attention releasing at entry too
// cost 2%: 314 against 321). Every block waits before it reads or writes anything else and
// before it exits, so completion is transitive: a kernel completes only after every kernel
// before it has.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_release() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The step buffer, written by the host before each step (exec.rs, `StepLayout`), as 32-bit words:
// [0] the active rows n, [1] the sequences, [2] the plan's rows R, [3] 0; from word 4, per row
// {its position, its sequence, the sequence's first row, the row after its last} (at a fixed
// offset: a row's record is one load, not two in a row); then the R token ids; then per sequence
// its last row (the head's input in prefill). The rows of a sequence are consecutive, as are its
// positions: the sequence's cache held `position - (row - first)` rows before the step. Past these
// words (at a byte offset the host passes as a pointer) lie the cache addresses. Nothing in a step
// writes it, so kernels may read it before `pdl_wait`.
struct StepRow {
    int pos, seq, first, end;
};
__device__ __forceinline__ StepRow step_row(const int* step, int r) { return ((const StepRow*)(step + 4))[r]; }
// (`rows`: the plan's R, passed by the host so that these are one load, not two in a row.)
__device__ __forceinline__ int step_token(const int* step, int rows, int r) { return step[4 + 4 * rows + r]; }
__device__ __forceinline__ int step_last_row(const int* step, int rows, int s) { return step[4 + 5 * rows + s]; }

// Asynchronous copies from global to shared memory (sm_80 and later; a plain copy before): each
// thread's copies since its last `cp_async_commit` form a group; `cp_async_wait<N>` waits until at
// most N of the thread's groups are still in flight, whose bytes the thread may then read.
__device__ __forceinline__ void cp_async16(void* smem, const void* g) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((u32)__cvta_generic_to_shared(smem)), "l"(g) : "memory");
#else
    *(uint4*)smem = *(const uint4*)g;
#endif
}
__device__ __forceinline__ void cp_async4(void* smem, const void* g) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"((u32)__cvta_generic_to_shared(smem)), "l"(g) : "memory");
#else
    *(u32*)smem = *(const u32*)g;
#endif
}
__device__ __forceinline__ void cp_async8(void* smem, const void* g) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"((u32)__cvta_generic_to_shared(smem)), "l"(g) : "memory");
#else
    *(uint2*)smem = *(const uint2*)g;
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
template <int N> __device__ __forceinline__ void cp_async_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// Bulk copies from global to shared memory (sm_90 and later; the kernels using them are launched
// only there): `bulk_copy` asks the copy engine for `bytes` (a multiple of 16, both addresses
// 16-byte aligned) and counts them on the shared-memory barrier `bar`; a barrier's phase completes
// when its expected arrivals have arrived and the bytes announced by `bar_expect` have landed.
// `bar_wait` waits for the phase of the given parity (0 for the first, 1 for the next, ...).
__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void bar_init(u64* bar, u32 count) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
#endif
}
// Makes initialized barriers visible to the copy engine (after the inits, before a block barrier).
__device__ __forceinline__ void bar_init_fence() {
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
// One arrival that also announces `bytes` of copies to come.
__device__ __forceinline__ void bar_expect(u64* bar, u32 bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void bar_wait(u64* bar, u32 parity) {
#if __CUDA_ARCH__ >= 900
    asm volatile(
        "{\n .reg .pred p;\n WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra WAIT_%=;\n}" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
#endif
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, u32 bytes, u64* bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
#endif
}
// Arrival counting between the warps or blocks of a launch: `arrive` adds v to *c with release
// semantics (the thread's earlier writes, and those it saw through a barrier, are visible to
// whoever sees the addition) and returns the old value; the one that finds itself last calls
// `acquire` before reading what the others wrote. Lighter than __threadfence on both sides (on
// sm_90 that is a sequentially consistent barrier that also invalidates the multiprocessor's L1,
// where the other warps keep their activations): only the acquiring side invalidates L1.
__device__ __forceinline__ u32 arrive(u32* c, u32 v) {
#if __CUDA_ARCH__ >= 700
    u32 old;
    asm volatile("atom.add.release.gpu.u32 %0, [%1], %2;" : "=r"(old) : "l"(c), "r"(v) : "memory");
    return old;
#else
    __threadfence();
    return atomicAdd(c, v);
#endif
}
__device__ __forceinline__ void acquire() {
#if __CUDA_ARCH__ >= 700
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
#else
    __threadfence();
#endif
}

// Whether this block is the last of `n` blocks to arrive at the counter *c, after every thread of it
// has written what it shares: thread 0 adds the block's arrival (release); the last block acquires
// (its reads then see every other block's writes) and resets *c for the next launch. Every
// thread of the block calls it (two block barriers).
__device__ __forceinline__ bool last_to_arrive(u32* c, u32 n) {
    __shared__ int s_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        const bool last = arrive(c, 1u) == n - 1;
        if (last) {
            acquire();
            *c = 0;
        }
        s_last = last;
    }
    __syncthreads();
    return s_last;
}

// Asks for the 128-byte line holding `p` to be brought into L2 (no register holds the data).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

__device__ __forceinline__ float half_at(const u8* p) {
    unsigned short h = (unsigned short)p[0] | ((unsigned short)p[1] << 8);
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u32 u32_at(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// v folded by `op` over the warp's lanes (a butterfly), in every lane.
template <class T, class Op> __device__ __forceinline__ T warp_fold(T v, Op op) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The largest of the warp's 64-bit keys, in every lane.
__device__ __forceinline__ u64 warp_max_key(u64 key) {
    return warp_fold(key, [](u64 a, u64 b) { return b > a ? b : a; });
}

// GELU with the tanh approximation (Gemma's MLP activation).
__device__ __forceinline__ float gelu_tanh(float x) {
    const float k = 0.7978846f;
    return 0.5f * x * (1.f + tanhf(k * (x + 0.044715f * x * x * x)));
}

// SiLU, x * sigmoid(x) (Llama's and Qwen's MLP activation), as the CPU computes it.
__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }

// Soft-capping, cap * tanh(x / cap) (Gemma 2's attention scores and final logits).
__device__ __forceinline__ float soft_cap(float x, float cap) { return tanhf(x / cap) * cap; }

// The activation of a gated MLP's gate (the matrix-vector kernels' `glu`, a template parameter:
// each activation has its own kernels): GELU-tanh or SiLU.
#define ACT_GELU 0
#define ACT_SILU 1
template <int ACT> __device__ __forceinline__ float glu_act(float x) { return ACT == ACT_SILU ? silu(x) : gelu_tanh(x); }

// Sum over a block of at most 1024 threads; every thread gets the result. `scratch` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.f;
    return warp_sum(v);
}

// v folded by `op` over a block of at most 1024 threads (the warps' folds, then those in warp
// order), in every thread; for exact folds (a float's sum is `block_sum`). `scratch` holds 32.
template <class T, class Op> __device__ __forceinline__ T block_fold(T v, T* scratch, Op op) {
    v = warp_fold(v, op);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    v = scratch[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); w++) v = op(v, scratch[w]);
    return v;
}

// Largest value, largest 64-bit key, sum of 64-bit integers over a block (`block_fold`).
__device__ __forceinline__ float block_max(float v, float* scratch) {
    return block_fold(v, scratch, [](float a, float b) { return fmaxf(a, b); });
}
__device__ __forceinline__ u64 block_max_key(u64 k, u64* scratch) {
    return block_fold(k, scratch, [](u64 a, u64 b) { return b > a ? b : a; });
}
__device__ __forceinline__ u64 block_sum_u64(u64 v, u64* scratch) {
    return block_fold(v, scratch, [](u64 a, u64 b) { return a + b; });
}

// Inclusive prefix sum of 64-bit integers in thread order over a block of at most 1024 threads
// (a multiple of 32), and in *total the block's sum. `scratch` holds 32 of them.
__device__ __forceinline__ u64 block_scan_u64(u64 v, u64* scratch, u64* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u64 up = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += up;
    }
    __syncthreads();
    if (lane == 31) scratch[warp] = v;
    __syncthreads();
    u64 before = 0, all = 0;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) {
        const u64 s = scratch[w];
        before += w < warp ? s : 0;
        all += s;
    }
    *total = all;
    return v + before;
}

// Quantized activations (the matrix-vector kernels' input): a row of k floats (k a multiple of 32)
// is stored as hi[k] and lo[k] (signed bytes), then one {float d, int sum} per 16 elements, with
// x ≈ d * (254 * hi + lo): d = max|x| / 32258 per 32-element block (both of its 16-element
// halves carry it) and sum = Σ (254 * hi + lo) over the 16. About 15 bits per value, so the
// integer dot products (dp4a) lose about as much as the CPU's 16-bit activations.
#define XQ_LEVELS 32258
__device__ __forceinline__ u64 xq_bytes(int k) { return (u64)k * 5 / 2; }

// Quantizes the warp's 32 consecutive elements of a row (lane i holds element e0 + i, e0 a
// multiple of 32) into xq (the row's quantized form). Every lane of the warp must call it.
__device__ __forceinline__ void quantize32(float y, u8* xq, int k, int e) {
    float amax = warp_max(fabsf(y));
    int v = amax > 0.f ? __float2int_rn(y * ((float)XQ_LEVELS / amax)) : 0;
    v = max(-XQ_LEVELS, min(XQ_LEVELS, v));
    int hi = __float2int_rn((float)v * (1.f / 254.f));
    xq[e] = (u8)(i8)hi;
    xq[k + e] = (u8)(i8)(v - 254 * hi);
    int s = v;
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 15) == 0) ((float2*)(xq + 2 * (u64)k))[e >> 4] = make_float2(amax / (float)XQ_LEVELS, __int_as_float(s));
}

// One row of a norm or norm pair over `k` elements (k <= per * blockDim.x; every input is read
// before the first barrier): y = x / rms(x) * w1 (res null), or h = res + x / rms(x) * w1 and
// y = h / rms(h) * w2. Writes y quantized to xq, h and y, each when given.
template <int PER>
__device__ __forceinline__ void norm_row(const float* x, const float* w1, const float* res, const float* w2, float eps, int k,
                                         u8* xq, float* h, float* y_out, float* scratch) {
    float v[PER], y[PER], ss = 0.f;
#pragma unroll
    for (int j = 0; j < PER; j++) {
        int i = threadIdx.x + j * blockDim.x;
        v[j] = i < k ? x[i] : 0.f;
        y[j] = i < k && res ? res[i] : 0.f;
    }
#pragma unroll
    for (int j = 0; j < PER; j++) ss += v[j] * v[j];
    ss = block_sum(ss, scratch);
    float inv = 1.f / sqrtf(ss / (float)k + eps);
    if (res) {
        float ss2 = 0.f;
#pragma unroll
        for (int j = 0; j < PER; j++) {
            int i = threadIdx.x + j * blockDim.x;
            v[j] = i < k ? y[j] + v[j] * inv * w1[i] : 0.f;
            ss2 += v[j] * v[j];
        }
        ss2 = block_sum(ss2, scratch);
        float inv2 = 1.f / sqrtf(ss2 / (float)k + eps);
#pragma unroll
        for (int j = 0; j < PER; j++) {
            int i = threadIdx.x + j * blockDim.x;
            y[j] = i < k ? v[j] * inv2 * w2[i] : 0.f;
        }
    } else {
#pragma unroll
        for (int j = 0; j < PER; j++) {
            int i = threadIdx.x + j * blockDim.x;
            y[j] = i < k ? v[j] * inv * w1[i] : 0.f;
        }
    }
#pragma unroll
    for (int j = 0; j < PER; j++) {
        int i = threadIdx.x + j * blockDim.x;
        if (xq && i - (threadIdx.x & 31) < k) quantize32(y[j], xq, k, i);
        if (i < k) {
            if (h && res) h[i] = v[j];
            if (y_out) y_out[i] = y[j];
        }
    }
}


// Same as quantize32 for a lane holding 4 consecutive elements e..e+3 (e a multiple of 4; the 8
// lanes 8m..8m+7 of a warp hold one 32-element block). Every lane of the warp must call it.
__device__ __forceinline__ void quantize32x4(float4 y, u8* xq, int k, int e) {
    float amax = fmaxf(fmaxf(fabsf(y.x), fabsf(y.y)), fmaxf(fabsf(y.z), fabsf(y.w)));
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    float sc = amax > 0.f ? (float)XQ_LEVELS / amax : 0.f;
    float ys[4] = {y.x, y.y, y.z, y.w};
    u32 his = 0, los = 0;
    int s = 0;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        int v = max(-XQ_LEVELS, min(XQ_LEVELS, __float2int_rn(ys[j] * sc)));
        int hi = __float2int_rn((float)v * (1.f / 254.f));
        his |= (u32)(u8)(i8)hi << (8 * j);
        los |= (u32)(u8)(i8)(v - 254 * hi) << (8 * j);
        s += v;
    }
    *(u32*)(xq + e) = his;
    *(u32*)(xq + k + e) = los;
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 3) == 0) ((float2*)(xq + 2 * (u64)k))[e >> 4] = make_float2(amax / (float)XQ_LEVELS, __int_as_float(s));
}
