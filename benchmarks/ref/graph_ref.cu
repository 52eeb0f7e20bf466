// The CUDA C++ graph-replay reference as a shared library, so Python can interleave its replays
// with deviceop's rep by rep in ONE process (same GPU clock state for both; the H100's node rate
// for small kernels moves by ~18 % between clock states over seconds, see README).
//
// Build:  nvcc -O3 -arch=sm_90 -shared -Xcompiler -fPIC -o libgraphref.so graph_ref.cu
// Same kernel, launch configuration and capture as chain.cu's graph mode.
//   int    ref_setup(int n_ops)        capture + instantiate + upload a graph of n_ops kernels (0: ok)
//   double ref_replay_us(int n_ops)    one cudaGraphLaunch + cudaStreamSynchronize, host microseconds
//                                      (steady_clock, as chain.cu); < 0 on a CUDA error
//   int    ref_check(void)             1 if y == x * g everywhere (proves the replays ran)
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <vector>

extern "C" __global__ void scale_f16(__half* y, const __half* x, float g, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        y[i] = __float2half(__half2float(x[i]) * g);
    }
}

static const long long kN = 2048;
static const int kThreads = 128;
static const int kBlocks = (int)(kN / kThreads);
static cudaStream_t g_stream = nullptr;
static __half *g_x = nullptr, *g_y = nullptr;
static std::vector<std::pair<int, cudaGraphExec_t>> g_execs;

static int fail(cudaError_t e, const char* what) {
    std::fprintf(stderr, "graph_ref: %s failed: %s\n", what, cudaGetErrorString(e));
    return (int)e;
}

static int init() {
    if (g_stream) return 0;
    cudaError_t e;
    if ((e = cudaSetDevice(0)) != cudaSuccess) return fail(e, "cudaSetDevice");
    if ((e = cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking)) != cudaSuccess) return fail(e, "cudaStreamCreate");
    if ((e = cudaMalloc(&g_x, kN * sizeof(__half))) != cudaSuccess) return fail(e, "cudaMalloc");
    if ((e = cudaMalloc(&g_y, kN * sizeof(__half))) != cudaSuccess) return fail(e, "cudaMalloc");
    std::vector<__half> hx(kN, __float2half(1.5f));
    if ((e = cudaMemcpy(g_x, hx.data(), kN * sizeof(__half), cudaMemcpyHostToDevice)) != cudaSuccess) return fail(e, "cudaMemcpy");
    if ((e = cudaMemset(g_y, 0, kN * sizeof(__half))) != cudaSuccess) return fail(e, "cudaMemset");
    return 0;
}

static cudaGraphExec_t find(int n_ops) {
    for (auto& p : g_execs)
        if (p.first == n_ops) return p.second;
    return nullptr;
}

extern "C" int ref_setup(int n_ops) {
    if (int r = init()) return r;
    if (find(n_ops)) return 0;
    cudaError_t e;
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    if ((e = cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeThreadLocal)) != cudaSuccess) return fail(e, "begin capture");
    for (int k = 0; k < n_ops; ++k) scale_f16<<<kBlocks, kThreads, 0, g_stream>>>(g_y, g_x, 0.5f, kN);
    if ((e = cudaStreamEndCapture(g_stream, &graph)) != cudaSuccess) return fail(e, "end capture");
    if ((e = cudaGraphInstantiate(&exec, graph, 0)) != cudaSuccess) return fail(e, "instantiate");
    cudaGraphDestroy(graph);
    if ((e = cudaGraphUpload(exec, g_stream)) != cudaSuccess) return fail(e, "upload");
    if ((e = cudaStreamSynchronize(g_stream)) != cudaSuccess) return fail(e, "sync");
    g_execs.emplace_back(n_ops, exec);
    return 0;
}

extern "C" double ref_replay_us(int n_ops) {
    cudaGraphExec_t exec = find(n_ops);
    if (!exec) return -1.0;
    auto t0 = std::chrono::steady_clock::now();
    if (cudaGraphLaunch(exec, g_stream) != cudaSuccess) return -2.0;
    if (cudaStreamSynchronize(g_stream) != cudaSuccess) return -3.0;
    auto t1 = std::chrono::steady_clock::now();
    return std::chrono::duration<double, std::micro>(t1 - t0).count();
}

extern "C" int ref_check(void) {
    std::vector<__half> hy(kN);
    if (cudaMemcpy(hy.data(), g_y, kN * sizeof(__half), cudaMemcpyDeviceToHost) != cudaSuccess) return 0;
    for (long long i = 0; i < kN; ++i)
        if (__half2float(hy[i]) != 0.75f) return 0;
    return 1;
}
