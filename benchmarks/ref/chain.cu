// Reference launch-overhead benchmark (cf. "Fearless Concurrency on the GPU", Fig. 6).
//
// Build:  nvcc -O3 -arch=sm_90 -o chain chain.cu
// Run:    ./chain [reps]        (reps default 200; 20 warm-up repetitions are always done)
//
// Modes, for N in {1, 10, 100, 1000}:
//   sync_each : N x (launch; cudaStreamSynchronize)
//   chained   : N launches, then one cudaStreamSynchronize
//   graph     : one cudaGraphLaunch of a captured graph of N kernel nodes + cudaStreamSynchronize
// Each repetition is timed with std::chrono::steady_clock (host wall time, includes the sync);
// reported figures are median / p25 / p75 of (repetition time / N) in microseconds.
// Output: one JSON object on stdout. Diagnostics go to stderr. Exit code != 0 on any error.
#include <cuda_runtime.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define CK(call)                                                                   \
    do {                                                                           \
        cudaError_t err_ = (call);                                                 \
        if (err_ != cudaSuccess) {                                                 \
            std::fprintf(stderr, "CUDA error %s (%d) at %s:%d: %s\n",              \
                         cudaGetErrorName(err_), (int)err_, __FILE__, __LINE__,    \
                         #call);                                                   \
            std::fprintf(stderr, "  %s\n", cudaGetErrorString(err_));              \
            std::exit(2);                                                          \
        }                                                                          \
    } while (0)

extern "C" __global__ void scale_f16(__half* y, const __half* x, float g, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        y[i] = __float2half(__half2float(x[i]) * g);
    }
}

static const long long kN = 2048;      // elements
static const int kThreads = 128;
static const int kBlocks = (int)(kN / kThreads);
static const int kWarmup = 20;
static const float kG = 0.5f;
static const float kX = 1.5f;

struct Stats {
    double median, p25, p75;
};

// Linear-interpolation percentile of a sorted vector (q in [0,1]).
static double percentile(const std::vector<double>& s, double q) {
    if (s.empty()) return NAN;
    double pos = q * (double)(s.size() - 1);
    size_t lo = (size_t)std::floor(pos);
    size_t hi = (size_t)std::ceil(pos);
    double frac = pos - (double)lo;
    return s[lo] + (s[hi] - s[lo]) * frac;
}

static Stats stats(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return Stats{percentile(v, 0.5), percentile(v, 0.25), percentile(v, 0.75)};
}

static inline void launch(cudaStream_t s, __half* y, const __half* x) {
    scale_f16<<<kBlocks, kThreads, 0, s>>>(y, x, kG, kN);
    CK(cudaGetLastError());
}

// Zero y (outside timing) so that a later check proves the timed launches ran.
static void clear_y(cudaStream_t s, __half* y) {
    CK(cudaMemsetAsync(y, 0, kN * sizeof(__half), s));
    CK(cudaStreamSynchronize(s));
}

// Returns true if every y[i] == x[i]*g.
static bool check_y(cudaStream_t s, const __half* dy, const char* what, int n_ops) {
    std::vector<__half> hy(kN);
    CK(cudaMemcpyAsync(hy.data(), dy, kN * sizeof(__half), cudaMemcpyDeviceToHost, s));
    CK(cudaStreamSynchronize(s));
    const float want = kX * kG;  // 0.75, exactly representable in fp16
    for (long long i = 0; i < kN; ++i) {
        float got = __half2float(hy[i]);
        if (got != want) {
            std::fprintf(stderr, "CHECK FAILED (%s, N=%d): y[%lld] = %g, want %g\n", what, n_ops,
                         i, got, want);
            return false;
        }
    }
    return true;
}

struct Result {
    std::string mode;
    int n_ops;
    Stats st;
    int reps;
};

int main(int argc, char** argv) {
    int reps = 200;
    if (argc > 1) {
        reps = std::atoi(argv[1]);
        if (reps <= 0) {
            std::fprintf(stderr, "usage: %s [reps>0]\n", argv[0]);
            return 1;
        }
    }

    CK(cudaSetDevice(0));
    CK(cudaFree(0));  // force context creation outside any timing

    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

    __half *dx = nullptr, *dy = nullptr;
    CK(cudaMalloc(&dx, kN * sizeof(__half)));
    CK(cudaMalloc(&dy, kN * sizeof(__half)));
    {
        std::vector<__half> hx(kN, __float2half(kX));
        CK(cudaMemcpy(dx, hx.data(), kN * sizeof(__half), cudaMemcpyHostToDevice));
    }
    CK(cudaMemset(dy, 0, kN * sizeof(__half)));
    CK(cudaDeviceSynchronize());

    // Sanity check before any timing: one launch must produce y == x*g.
    launch(s, dy, dx);
    CK(cudaStreamSynchronize(s));
    if (!check_y(s, dy, "initial", 1)) return 3;

    const int sizes[] = {1, 10, 100, 1000};
    std::vector<Result> results;
    bool ok = true;
    using clk = std::chrono::steady_clock;

    for (int n_ops : sizes) {
        // ---------------- sync_each ----------------
        {
            clear_y(s, dy);
            std::vector<double> per_op;
            per_op.reserve(reps);
            for (int r = 0; r < kWarmup + reps; ++r) {
                auto t0 = clk::now();
                for (int k = 0; k < n_ops; ++k) {
                    launch(s, dy, dx);
                    CK(cudaStreamSynchronize(s));
                }
                auto t1 = clk::now();
                if (r >= kWarmup)
                    per_op.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() /
                                     n_ops);
            }
            ok = check_y(s, dy, "sync_each", n_ops) && ok;
            results.push_back({"sync_each", n_ops, stats(per_op), reps});
        }
        // ---------------- chained ----------------
        {
            clear_y(s, dy);
            std::vector<double> per_op;
            per_op.reserve(reps);
            for (int r = 0; r < kWarmup + reps; ++r) {
                auto t0 = clk::now();
                for (int k = 0; k < n_ops; ++k) launch(s, dy, dx);
                CK(cudaStreamSynchronize(s));
                auto t1 = clk::now();
                if (r >= kWarmup)
                    per_op.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() /
                                     n_ops);
            }
            ok = check_y(s, dy, "chained", n_ops) && ok;
            results.push_back({"chained", n_ops, stats(per_op), reps});
        }
        // ---------------- graph ----------------
        {
            cudaGraph_t graph = nullptr;
            cudaGraphExec_t exec = nullptr;
            CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
            // launch() exits the process on any error, so capture is never left dangling.
            for (int k = 0; k < n_ops; ++k) launch(s, dy, dx);
            CK(cudaStreamEndCapture(s, &graph));
            size_t num_nodes = 0;
            CK(cudaGraphGetNodes(graph, nullptr, &num_nodes));
            if ((int)num_nodes != n_ops) {
                std::fprintf(stderr, "graph has %zu nodes, expected %d\n", num_nodes, n_ops);
                return 4;
            }
            CK(cudaGraphInstantiate(&exec, graph, 0));
            CK(cudaGraphUpload(exec, s));
            CK(cudaStreamSynchronize(s));

            clear_y(s, dy);
            std::vector<double> per_op;
            per_op.reserve(reps);
            for (int r = 0; r < kWarmup + reps; ++r) {
                auto t0 = clk::now();
                CK(cudaGraphLaunch(exec, s));
                CK(cudaStreamSynchronize(s));
                auto t1 = clk::now();
                if (r >= kWarmup)
                    per_op.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() /
                                     n_ops);
            }
            ok = check_y(s, dy, "graph", n_ops) && ok;
            results.push_back({"graph", n_ops, stats(per_op), reps});
            CK(cudaGraphExecDestroy(exec));
            CK(cudaGraphDestroy(graph));
        }
    }

    CK(cudaStreamSynchronize(s));
    CK(cudaFree(dx));
    CK(cudaFree(dy));
    CK(cudaStreamDestroy(s));

    if (!ok) {
        std::fprintf(stderr, "output check failed\n");
        return 3;
    }

    std::printf("{\"impl\":\"cuda_cpp\",\"results\":[");
    for (size_t i = 0; i < results.size(); ++i) {
        const Result& r = results[i];
        std::printf("%s{\"mode\":\"%s\",\"n_ops\":%d,\"us_per_op_median\":%.4f,"
                    "\"us_per_op_p25\":%.4f,\"us_per_op_p75\":%.4f,\"reps\":%d}",
                    i ? "," : "", r.mode.c_str(), r.n_ops, r.st.median, r.st.p25, r.st.p75,
                    r.reps);
    }
    std::printf("]}\n");
    return 0;
}
