// Shared by the benchmarks built on kiln's kernels (after common.cuh and the quantized family):
// random floats, kiln's activation quantizer over a row, a one-warp-per-row reference product.
__global__ void fill_f(float* p, int n, u32 seed, float base, float amp) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        u32 x = (u32)i * 2654435761u ^ seed;
        x ^= x >> 13;
        x *= 3266489917u;
        x ^= x >> 16;
        p[i] = base + amp * ((float)(x & 0xffff) / 65536.f - 0.5f);
    }
}
__global__ void quant_x(const float* x, u8* xq, int k) {
    int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e < k) quantize32(x[e], xq, k, e);
}
// Reference: one warp per row with kiln's chunk decoders.
template <int T>
__global__ void ref_mv(const u8* w, u64 rb, int n, const u8* xq, int k, float* out) {
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= n) return;
    Mat m{w, rb, (u64)n * (rb / Fmt<T>::bytes)};
    float acc = 0.f;
    for (int c = lane; c < (k >> 5); c += 32) {
        XGroup xg[2] = {xgroup(xq, k, Chunk<T>::xoff(c, 0)), xgroup(xq, k, Chunk<T>::xoff(c, 1))};
        acc += Chunk<T>::dot(m, Chunk<T>::load(m, row, c), c, xg);
    }
    acc = warp_sum(acc);
    if (lane == 0) out[row] = acc;
}
