// What one dependency between two steps of a decode costs on the device, idle and beside memory
// traffic: a chain of dependent kernels (a CUDA graph, with and without programmatic dependent
// launch) and a persistent kernel whose blocks meet at a grid barrier (an arrival counter in
// global memory) between the same steps. Each step reads what the step before wrote (a 3,840-float row) and
// writes the next; under load, a second stream keeps the device's memory busy meanwhile (a reader
// of a 2 GB buffer on part of the multiprocessors), as the weight streaming of a decode step
// would; the last table varies the bytes that reader keeps in flight. Build and run on the device
// machine, from the checkout's root (or with bench/cuda/run.sh):
//   nvcc -O3 -arch=sm_90 -std=c++17 -o /tmp/boundary bench/cuda/boundary.cu && /tmp/boundary
// `/tmp/boundary domains` takes the dependency apart instead: steps that only write, that read the
// row in one round trip or in a loop (the default steps' 7-8 loads a thread, one after another),
// a chain that polls tagged rows instead of waiting for the kernel before (chain_ll), and the
// load in the default or the remote memory synchronization domain (RESULTS.md "issue 4ap").
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
#include "bench_util.cuh"
#include <cstring>

constexpr int WIDTH = 3840, THREADS = 128, STEPS = 512;

// How a chain step reads the row before it: not at all (the dependency and the stores only), in a
// loop of 7-8 loads a thread each waiting for the one before (the steps of the default tables), or
// with its loads issued together (one round trip).
enum Read { WRITE_ONLY = 0, LOOP = 1, ONE_TRIP = 2 };

// One step of the chain: block b (of any grid) reads the whole row `in` (as a matrix-vector
// block reads its input) and writes its share of `out`.
__device__ __forceinline__ void step_body(const float* in, float* out, Read read = LOOP) {
    float s = 0.f;
    if (read == ONE_TRIP) {
        constexpr int PER = (WIDTH / 4 + THREADS - 1) / THREADS;
        float4 v[PER];
#pragma unroll
        for (int j = 0; j < PER; j++) {
            int i = threadIdx.x + j * THREADS;
            v[j] = i < WIDTH / 4 ? __ldcg((const float4*)in + i) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int j = 0; j < PER; j++) s += v[j].x + v[j].y + v[j].z + v[j].w;
    } else if (read == LOOP) {
        for (int i = threadIdx.x; i < WIDTH / 4; i += blockDim.x) {
            float4 v = __ldcg((const float4*)in + i);
            s += v.x + v.y + v.z + v.w;
        }
    }
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < WIDTH; i += gridDim.x * blockDim.x) out[i] = s * 1e-9f + (float)i;
}

__global__ void chain_step(const float* in, float* out, int pdl, Read read) {
    if (pdl) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
    step_body(in, out, read);
}

// The same step with the row passed as in NCCL's low-latency protocol: 8-byte words {value, tag},
// each written by one store, so a reader knows a word has arrived when it carries the step's tag.
// The step waits for no kernel (no griddepcontrol.wait): its blocks poll their loads until every
// word carries `tag`, then let the next step launch and write their share tagged `tag + 1`. One
// round trip (repeated while the words are missing) instead of a kernel boundary and a load. The
// tags: `epoch` (raised by ll_init before each run) times STEPS + 1, plus the step.
__global__ void ll_init(uint2* row, u32* epoch) {
    u32 tag = (epoch[0] + 1) * (STEPS + 1);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < WIDTH; i += gridDim.x * blockDim.x) row[i] = make_uint2(0u, tag);
    __syncthreads();
    if (blockIdx.x == 0 && threadIdx.x == 0) epoch[0] += 1;
}
// A load the compiler must issue every time (a poll): `__ldcv` is not volatile asm, so a loop of
// them may be hoisted and never see the word change.
__device__ __forceinline__ uint4 ld_poll(const uint4* p) {
    uint4 v;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}
__global__ void chain_ll(const uint4* in, uint2* out, const u32* epoch, int t) {
    constexpr int PER = (WIDTH / 2 + THREADS - 1) / THREADS;
    const u32 tag = __ldcg(epoch) * (STEPS + 1) + t;
    uint4 v[PER];
    bool done;
    do {
        done = true;
#pragma unroll
        for (int j = 0; j < PER; j++) {
            int i = threadIdx.x + j * THREADS;
            v[j] = i < WIDTH / 2 ? ld_poll(in + i) : make_uint4(0u, tag, 0u, tag);
            done = done && v[j].y == tag && v[j].w == tag;
        }
    } while (!done);
    // (Every thread of the block has its words before the next step may launch: that step
    // overwrites the row this one read.)
    __syncthreads();
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < PER; j++) s += __uint_as_float(v[j].x) + __uint_as_float(v[j].z);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < WIDTH; i += gridDim.x * blockDim.x)
        __stcg(out + i, make_uint2(__float_as_uint(s * 1e-9f + (float)i), tag + 1));
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

int main(int argc, char** argv) {
    setvbuf(stdout, nullptr, _IOLBF, 0);
    const bool domains_mode = argc == 2 && !strcmp(argv[1], "domains");
    if (argc > 1 && !domains_mode) {
        fprintf(stderr, "usage: boundary [domains]\n");
        return 2;
    }
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
    auto chain_graph = [&](int grid, int pdl, Read read = LOOP) {
        cudaGraph_t g;
        cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
        for (int t = 0; t < STEPS; t++) {
            PdlLaunch l(dim3(grid), dim3(THREADS), 0, s);
            l.cfg.numAttrs = pdl ? 1 : 0;
            CK(cudaLaunchKernelEx(&l.cfg, chain_step, (const float*)(rows + (t & 1) * WIDTH), rows + ((t + 1) & 1) * WIDTH, pdl, read));
        }
        CK(cudaStreamEndCapture(s, &g));
        CK(cudaGraphInstantiate(&ge, g, 0));
        return ge;
    };
    // The background load: `lblocks` reader blocks of 512 threads, `lunroll` loads each in flight,
    // sized to outlast the timed steps; load_gbs: what it reads alone.
    // `remote`: the reader runs in the remote memory synchronization domain, so that the chain's
    // fences and kernel-boundary flushes (the default domain) need not wait for its traffic.
    int lblocks = sms / 2, lunroll = 8, remote = 0;
    double load_gbs = 0.0;
    auto launch_reader = [&](int passes) {
        // The reader with `lunroll` (1, 2, 4, 8 or 16) loads in flight.
        void (*const readers[])(const uint4*, size_t, int, uint4*) = {reader<1>, reader<2>, reader<4>, reader<8>, reader<16>};
        cudaLaunchConfig_t cfg = {};
        cudaLaunchAttribute at[1];
        cfg.gridDim = dim3(lblocks);
        cfg.blockDim = dim3(512);
        cfg.stream = bg;
        at[0].id = cudaLaunchAttributeMemSyncDomain;
        at[0].val.memSyncDomain = remote ? cudaLaunchMemSyncDomainRemote : cudaLaunchMemSyncDomainDefault;
        cfg.attrs = at;
        cfg.numAttrs = 1;
        CK(cudaLaunchKernelEx(&cfg, readers[__builtin_ctz(lunroll)], (const uint4*)src, load_bytes / 16, passes, sink));
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
    // Microseconds per step of `run` under the load, the reader in the remote memory
    // synchronization domain or the default one.
    auto time_loaded = [&](auto run, bool in_remote) {
        remote = in_remote;
        double us = time(run, true);
        remote = 0;
        return us;
    };
    int domains = 0;
    CK(cudaDeviceGetAttribute(&domains, cudaDevAttrMemSyncDomainCount, 0));
    printf("memory synchronization domains: %d\n", domains);
    if (domains_mode) {
        // `boundary domains`: the same steps under the load in the default and in the remote
        // domain (a pdl graph of one block per multiprocessor and the persistent kernel), then the
        // bytes-in-flight table for both.
        cudaGraphExec_t ge = chain_graph(sms, 1);
        auto run = [&] { CK(cudaGraphLaunch(ge, s)); };
        auto prun = [&] {
            CK(cudaMemsetAsync(count, 0, sizeof(unsigned), s));
            persistent<<<sms, THREADS, 0, s>>>(rows, count);
        };
        // The tagged chain (chain_ll): ll_init, then STEPS steps, the first launched plainly after it.
        uint2* llrows;
        u32* epoch;
        CK(cudaMalloc(&llrows, 2 * WIDTH * sizeof(uint2)));
        CK(cudaMalloc(&epoch, sizeof(u32)));
        CK(cudaMemset(llrows, 0, 2 * WIDTH * sizeof(uint2)));
        CK(cudaMemset(epoch, 0, sizeof(u32)));
        for (int grid : {1, sms}) {
            cudaGraph_t g;
            cudaGraphExec_t gl;
            CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
            ll_init<<<1, THREADS, 0, s>>>(llrows, epoch);
            for (int t = 0; t < STEPS; t++) {
                PdlLaunch l(dim3(grid), dim3(THREADS), 0, s);
                l.cfg.numAttrs = t > 0 ? 1 : 0;
                CK(cudaLaunchKernelEx(&l.cfg, chain_ll, (const uint4*)(llrows + (t & 1) * WIDTH), llrows + ((t + 1) & 1) * WIDTH,
                                      (const u32*)epoch, t));
            }
            CK(cudaStreamEndCapture(s, &g));
            CK(cudaGraphInstantiate(&gl, g, 0));
            auto lrun = [&] { CK(cudaGraphLaunch(gl, s)); };
            double a = time(lrun, false), b = time(lrun, true);
            printf("graph pdl grid %d, tagged rows polled (no wait): idle %.2f  load %.2f\n", grid, a, b);
            CK(cudaGraphExecDestroy(gl));
        }
        for (Read read : {WRITE_ONLY, ONE_TRIP, LOOP}) {
            for (int grid : {1, sms}) {
                cudaGraphExec_t gw = chain_graph(grid, 1, read);
                auto wrun = [&] { CK(cudaGraphLaunch(gw, s)); };
                double a = time(wrun, false), b = time(wrun, true);
                printf("graph pdl grid %d, steps that %s: idle %.2f  load %.2f\n", grid,
                       read == WRITE_ONLY ? "only write" : read == ONE_TRIP ? "read in one round trip" : "read in a loop", a, b);
                CK(cudaGraphExecDestroy(gw));
            }
        }
        for (int pass = 0; pass < 2; pass++) {
            // (One after another: the order in which a call's arguments are evaluated is unspecified.)
            double a = time(run, false), b = time_loaded(run, false), c = time_loaded(run, true);
            printf("graph pdl grid %d: idle %.2f  load same domain %.2f  load remote domain %.2f\n", sms, a, b, c);
            a = time(prun, false), b = time_loaded(prun, false), c = time_loaded(prun, true);
            printf("persistent grid %d: idle %.2f  load same domain %.2f  load remote domain %.2f\n", sms, a, b, c);
        }
        cudaGraphExec_t gone = chain_graph(sms, 1, ONE_TRIP);
        auto run1 = [&] { CK(cudaGraphLaunch(gone, s)); };
        printf("load in flight (MB)   load GB/s   us per step (loop read), same domain | load GB/s   remote domain | one-round-trip read\n");
        for (auto [b, u] : std::vector<std::pair<int, int>>{{sms / 2, 4}, {sms / 2, 8}, {sms * 5 / 8, 8}, {sms * 3 / 4, 8}, {sms * 7 / 8, 8}, {sms, 8}, {sms, 16}}) {
            lblocks = b;
            lunroll = u;
            double t0 = time_loaded(run, false), g0 = load_gbs;
            double t1 = time_loaded(run, true), g1 = load_gbs;
            double t2 = time_loaded(run1, false);
            printf("%18.1f %11.0f %10.2f | %9.0f %10.2f | %10.2f\n", b * 512.0 * u * 16 / 1e6, g0, t0, g1, t1, t2);
        }
        return 0;
    }
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
