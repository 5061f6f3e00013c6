// What one dependency between two steps of a decode costs on the device, idle and beside memory
// traffic: a chain of dependent kernels (a CUDA graph, with and without programmatic dependent
// launch) and a persistent kernel whose blocks meet at a grid barrier (an arrival counter in
// global memory) between the same steps. Each step reads what the step before wrote (a 3,840-float row) and
// writes the next; under load, a second stream keeps the device's memory busy meanwhile (a reader
// of a 2 GB buffer on part of the multiprocessors), as the weight streaming of a decode step
// would; the last table varies the bytes that reader keeps in flight. Build and run on the device
// machine, from the checkout's root (or with bench/cuda/run.sh):
//   nvcc -O3 -arch=sm_90 -std=c++17 -o /tmp/boundary bench/cuda/boundary.cu && /tmp/boundary
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
#include "bench_util.cuh"

constexpr int WIDTH = 3840, THREADS = 128, STEPS = 512;

// One step of the chain: block b (of any grid) reads the whole row `in` (as a matrix-vector
// block reads its input) and writes its share of `out`.
__device__ __forceinline__ void step_body(const float* in, float* out) {
    float s = 0.f;
    for (int i = threadIdx.x; i < WIDTH / 4; i += blockDim.x) {
        float4 v = __ldcg((const float4*)in + i);
        s += v.x + v.y + v.z + v.w;
    }
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < WIDTH; i += gridDim.x * blockDim.x) out[i] = s * 1e-9f + (float)i;
}

__global__ void chain_step(const float* in, float* out, int pdl) {
    if (pdl) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
    step_body(in, out);
}

// STEPS steps in one launch: the blocks meet at a barrier (arrive, then wait for all) after each.
__global__ void persistent(float* rows, unsigned* count) {
    for (int t = 0; t < STEPS; t++) {
        step_body(rows + (t & 1) * WIDTH, rows + ((t + 1) & 1) * WIDTH);
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(count, 1u);
            unsigned target = (unsigned)(t + 1) * gridDim.x, v;
            do {
                asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(count));
            } while (v < target);
        }
        __syncthreads();
    }
}

// Keeps the memory busy: each block streams its part of `src` `passes` times, U 16-byte loads per
// thread in flight.
template <int U>
__global__ void __launch_bounds__(512, 1) reader(const uint4* src, size_t words, int passes, uint4* sink) {
    uint4 acc = make_uint4(0, 0, 0, 0);
    size_t per = words / gridDim.x / (U * 512) * (U * 512), base = per * blockIdx.x;
    for (int p = 0; p < passes; p++) {
        for (size_t i = threadIdx.x; i < per; i += U * blockDim.x) {
            uint4 v[U];
#pragma unroll
            for (int u = 0; u < U; u++) v[u] = __ldcs(src + base + i + u * blockDim.x);
#pragma unroll
            for (int u = 0; u < U; u++) acc.x ^= v[u].x, acc.y ^= v[u].y, acc.z ^= v[u].z, acc.w ^= v[u].w;
        }
    }
    if (acc.x == 0x12345678u) sink[0] = acc;
}

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const int sms = prop.multiProcessorCount;
    printf("%s, %d SMs, L2 %d MB\n", prop.name, sms, prop.l2CacheSize >> 20);
    float* rows;
    unsigned* count;
    CK(cudaMalloc(&rows, 2 * WIDTH * sizeof(float)));
    CK(cudaMalloc(&count, sizeof(unsigned)));
    CK(cudaMemset(rows, 0, 2 * WIDTH * sizeof(float)));
    const size_t load_bytes = size_t(2) << 30;
    uint4 *src, *sink;
    CK(cudaMalloc(&src, load_bytes));
    CK(cudaMemset(src, 1, load_bytes));
    CK(cudaMalloc(&sink, 16));
    cudaStream_t s, bg;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&bg, cudaStreamNonBlocking));

    // A graph of STEPS dependent chain steps on `grid` blocks.
    auto chain_graph = [&](int grid, int pdl) {
        cudaGraph_t g;
        cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
        for (int t = 0; t < STEPS; t++) {
            PdlLaunch l(dim3(grid), dim3(THREADS), 0, s);
            l.cfg.numAttrs = pdl ? 1 : 0;
            CK(cudaLaunchKernelEx(&l.cfg, chain_step, (const float*)(rows + (t & 1) * WIDTH), rows + ((t + 1) & 1) * WIDTH, pdl));
        }
        CK(cudaStreamEndCapture(s, &g));
        CK(cudaGraphInstantiate(&ge, g, 0));
        return ge;
    };
    // The background load: `lblocks` reader blocks of 512 threads, `lunroll` loads each in flight,
    // sized to outlast the timed steps; load_gbs: what it reads alone.
    int lblocks = sms / 2, lunroll = 8;
    double load_gbs = 0.0;
    auto launch_reader = [&](int passes) {
        // The reader with `lunroll` (1, 2, 4, 8 or 16) loads in flight.
        void (*const readers[])(const uint4*, size_t, int, uint4*) = {reader<1>, reader<2>, reader<4>, reader<8>, reader<16>};
        readers[__builtin_ctz(lunroll)]<<<lblocks, 512, 0, bg>>>(src, load_bytes / 16, passes, sink);
        CK(cudaGetLastError());
    };
    // Microseconds per step of `run`, median of 7, with or without the background load.
    auto time = [&](auto run, bool load) {
        if (load) {
            double us = time_us(bg, 1, 1, [&] { launch_reader(4); });
            load_gbs = 4.0 * (double)load_bytes / (us * 1e3);
            // Long enough for 7 runs of the steps at 100 us each.
            launch_reader((int)(7 * STEPS * 100.0 / (us / 4)) + 4);
        }
        double us = time_us(s, 7, STEPS, run);
        // (The reader must still be running: else the last runs were not under load.)
        if (load && cudaStreamQuery(bg) == cudaSuccess) printf("(the load ended before the steps)\n");
        CK(cudaDeviceSynchronize());
        return us;
    };
    printf("us per dependent step (%d steps, %d threads per block; load = a reader on %d SMs streaming 2 GB)\n", STEPS, THREADS, sms / 2);
    printf("%-34s %10s %10s\n", "", "idle", "load");
    for (int grid : {1, sms, 4 * sms}) {
        for (int pdl : {0, 1}) {
            cudaGraphExec_t ge = chain_graph(grid, pdl);
            auto run = [&] { CK(cudaGraphLaunch(ge, s)); };
            double a = time(run, false), b = time(run, true);
            printf("graph of kernels, grid %4d, %-6s %10.2f %10.2f\n", grid, pdl ? "pdl" : "plain", a, b);
            CK(cudaGraphExecDestroy(ge));
        }
    }
    for (int grid : {sms / 2, sms}) {
        auto run = [&] {
            CK(cudaMemsetAsync(count, 0, sizeof(unsigned), s));
            persistent<<<grid, THREADS, 0, s>>>(rows, count);
        };
        double a = time(run, false), b = time(run, true);
        printf("persistent, grid barrier, grid %4d  %10.2f %10.2f\n", grid, a, b);
    }
    // The same dependent steps (graph, pdl, one block per multiprocessor) against loads with more
    // or fewer bytes in flight: how long a step waits behind them, and what bandwidth they get.
    printf("\nload in flight (MB)   load GB/s   us per step under it (graph, pdl, grid %d)\n", sms);
    cudaGraphExec_t ge = chain_graph(sms, 1);
    auto run = [&] { CK(cudaGraphLaunch(ge, s)); };
    for (auto [b, u] : std::vector<std::pair<int, int>>{{sms / 2, 1}, {sms / 2, 2}, {sms / 2, 4}, {sms / 2, 8}, {sms, 8}, {sms, 16}}) {
        lblocks = b;
        lunroll = u;
        double t = time(run, true);
        printf("%18.1f %11.0f %10.2f\n", b * 512.0 * u * 16 / 1e6, load_gbs, t);
    }
    return 0;
}
