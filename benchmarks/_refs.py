"""Reference launch-overhead measurements (cf. "Fearless Concurrency on the GPU", Fig. 6).

No deviceop code is used here: these are the baselines deviceop is compared against.

The kernel is ``y[i] = x[i] * g`` on n = 2048 fp16 elements (16 blocks x 128 threads).
Modes, per repetition (host wall time via time.perf_counter_ns, sync included):

* ``sync_each``: N x (launch; stream synchronize)
* ``chained``:   N launches, then one stream synchronize
* ``graph``:     one launch of a pre-instantiated, pre-uploaded graph of N kernel nodes,
                 then one stream synchronize (raw_bindings always; cupy / torch where their
                 capture API works)

Reported figures are the median / p25 / p75 over ``reps`` repetitions of (rep time / N), in us.

Implementations (each ``measure_<impl>(n_ops, reps, warmup) -> list[dict]``):

* ``raw_bindings``: cuda.bindings.driver + NVRTC, kernelParams prepared once (cuda-python sample style)
* ``cupy``:         cupy.RawKernel on a non-blocking cupy stream
* ``torch``:        torch.mul(x, g, out=y) on a side stream
* ``cuda_core``:    cuda.core Program / launch

All GPU imports are lazy, so this module imports on a machine without a GPU.

Usage::

    python3 benchmarks/_refs.py --reps 200 --out results.json
    python3 benchmarks/_refs.py --impls raw_bindings,cupy --sizes 1,10,100,1000
    python3 benchmarks/_refs.py --chain-bin ./chain   # also run the CUDA C++ reference and merge
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time
from collections.abc import Callable

from _harness import description

N_ELEMS = 2048
THREADS = 128
BLOCKS = N_ELEMS // THREADS
G = 0.5
X_FILL = 1.5
EXPECTED = X_FILL * G  # 0.75, exact in fp16
SIZES = (1, 10, 100, 1000)
KERNEL_NAME = "scale_f16"

KERNEL_SRC = r"""
#include <cuda_fp16.h>
extern "C" __global__ void scale_f16(__half* y, const __half* x, float g, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        y[i] = __float2half(__half2float(x[i]) * g);
    }
}
"""


# --------------------------------------------------------------------------------------
# shared helpers
# --------------------------------------------------------------------------------------


def _summary(impl: str, mode: str, n_ops: int, samples_ns: list[int], reps: int) -> dict:
    import numpy as np

    per_op_us = np.asarray(samples_ns, dtype=np.float64) / 1e3 / n_ops
    p25, p50, p75 = np.percentile(per_op_us, [25, 50, 75])  # linear interpolation
    return {
        "impl": impl,
        "mode": mode,
        "n_ops": n_ops,
        "us_per_op_median": float(p50),
        "us_per_op_p25": float(p25),
        "us_per_op_p75": float(p75),
        "reps": reps,
    }


def _time_reps(fn: Callable[[], None], reps: int, warmup: int) -> list[int]:
    """Call ``fn`` (one whole repetition: N launches + sync) warmup + reps times;
    return the ``reps`` timed durations in ns."""
    clock = time.perf_counter_ns
    for _ in range(warmup):
        fn()
    out = [0] * reps
    for r in range(reps):
        t0 = clock()
        fn()
        t1 = clock()
        out[r] = t1 - t0
    return out


def _check_host(y_host, what: str) -> None:
    import numpy as np

    y = np.asarray(y_host, dtype=np.float32).reshape(-1)
    if y.shape[0] != N_ELEMS or not np.all(y == EXPECTED):
        bad = np.flatnonzero(y != EXPECTED)
        first = int(bad[0]) if bad.size else -1
        raise RuntimeError(
            f"{what}: output check failed: {bad.size} wrong elements, "
            f"first y[{first}]={y[first] if first >= 0 else None!r}, want {EXPECTED}"
        )


# --------------------------------------------------------------------------------------
# raw cuda.bindings
# --------------------------------------------------------------------------------------


def _drv_check(result, what: str):
    """cuda.bindings calls return (err, *values); raise on error, return the values."""
    from cuda.bindings import driver, nvrtc

    err = result[0]
    if isinstance(err, driver.CUresult):
        if err != driver.CUresult.CUDA_SUCCESS:
            _, name = driver.cuGetErrorName(err)
            raise RuntimeError(f"{what} failed: {err!r} ({name!r})")
    elif isinstance(err, nvrtc.nvrtcResult):
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"{what} failed: {err!r}")
    else:  # pragma: no cover - unexpected return shape
        raise TypeError(f"{what}: unexpected result {result!r}")
    rest = result[1:]
    if len(rest) == 0:
        return None
    if len(rest) == 1:
        return rest[0]
    return rest


def _cuda_include_dirs() -> list[str]:
    import os

    dirs: list[str] = []
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        d = find_nvidia_header_directory("cudart")
        if d:
            dirs.append(str(d))
    except Exception as e:  # pragma: no cover
        print(f"[raw_bindings] cuda.pathfinder header lookup failed: {e!r}", file=sys.stderr)
    for env in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(env)
        if root and os.path.isdir(os.path.join(root, "include")):
            dirs.append(os.path.join(root, "include"))
    if not dirs and os.path.isdir("/usr/local/cuda/include"):
        dirs.append("/usr/local/cuda/include")
    return dirs


class _RawState:
    """Everything set up once for the raw-bindings measurements."""

    def __init__(self) -> None:
        import numpy as np
        from cuda.bindings import driver

        ck = _drv_check
        ck(driver.cuInit(0), "cuInit")
        self.dev = ck(driver.cuDeviceGet(0), "cuDeviceGet")
        self.ctx = ck(driver.cuDevicePrimaryCtxRetain(self.dev), "cuDevicePrimaryCtxRetain")
        ck(driver.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

        major = ck(
            driver.cuDeviceGetAttribute(
                driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.dev
            ),
            "cuDeviceGetAttribute(major)",
        )
        minor = ck(
            driver.cuDeviceGetAttribute(
                driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.dev
            ),
            "cuDeviceGetAttribute(minor)",
        )
        self.arch = f"sm_{major}{minor}"
        self.cubin = _nvrtc_compile_cubin(KERNEL_SRC, self.arch)

        # Keep the image alive while the module loads; pass it by address (int).
        self._image = np.frombuffer(self.cubin, dtype=np.uint8).copy()
        self.module = ck(driver.cuModuleLoadData(self._image.ctypes.data), "cuModuleLoadData")
        self.func = ck(driver.cuModuleGetFunction(self.module, KERNEL_NAME.encode()), "cuModuleGetFunction")
        self.stream = ck(driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING.value), "cuStreamCreate")

        self.nbytes = N_ELEMS * 2
        self.d_x = ck(driver.cuMemAlloc(self.nbytes), "cuMemAlloc(x)")
        self.d_y = ck(driver.cuMemAlloc(self.nbytes), "cuMemAlloc(y)")
        x_host = np.full(N_ELEMS, X_FILL, dtype=np.float16)
        ck(driver.cuMemcpyHtoD(self.d_x, x_host.ctypes.data, self.nbytes), "cuMemcpyHtoD(x)")
        self.clear_y()

        # Kernel params prepared ONCE, as in the cuda-python samples.
        self._arg_y = np.array([int(self.d_y)], dtype=np.uint64)
        self._arg_x = np.array([int(self.d_x)], dtype=np.uint64)
        self._arg_g = np.array([G], dtype=np.float32)
        self._arg_n = np.array([N_ELEMS], dtype=np.int64)
        self._args = [self._arg_y, self._arg_x, self._arg_g, self._arg_n]
        self.params = np.array([a.ctypes.data for a in self._args], dtype=np.uint64)
        self.params_ptr = self.params.ctypes.data

        # One checked launch before any timing.
        self.launch_once()
        ck(driver.cuStreamSynchronize(self.stream), "cuStreamSynchronize")
        self.check("raw_bindings initial")

        self.graphs: dict[int, tuple] = {}

    def launch_once(self) -> None:
        from cuda.bindings import driver

        _drv_check(
            driver.cuLaunchKernel(self.func, BLOCKS, 1, 1, THREADS, 1, 1, 0, self.stream, self.params_ptr, 0),
            "cuLaunchKernel",
        )

    def clear_y(self) -> None:
        from cuda.bindings import driver

        _drv_check(driver.cuMemsetD8(self.d_y, 0, self.nbytes), "cuMemsetD8(y)")
        _drv_check(driver.cuCtxSynchronize(), "cuCtxSynchronize")

    def check(self, what: str) -> None:
        import numpy as np
        from cuda.bindings import driver

        _drv_check(driver.cuStreamSynchronize(self.stream), "cuStreamSynchronize")
        y_host = np.empty(N_ELEMS, dtype=np.float16)
        _drv_check(driver.cuMemcpyDtoH(y_host.ctypes.data, self.d_y, self.nbytes), "cuMemcpyDtoH(y)")
        _check_host(y_host, what)

    def graph_exec(self, n_ops: int):
        from cuda.bindings import driver

        if n_ops in self.graphs:
            return self.graphs[n_ops][1]
        ck = _drv_check
        ck(
            driver.cuStreamBeginCapture(self.stream, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
            "cuStreamBeginCapture",
        )
        try:
            for _ in range(n_ops):
                self.launch_once()
        finally:
            graph = ck(driver.cuStreamEndCapture(self.stream), "cuStreamEndCapture")
        _, num_nodes = ck(driver.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")
        if num_nodes != n_ops:
            raise RuntimeError(f"captured graph has {num_nodes} nodes, expected {n_ops}")
        gexec = ck(driver.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        ck(driver.cuGraphUpload(gexec, self.stream), "cuGraphUpload")
        ck(driver.cuStreamSynchronize(self.stream), "cuStreamSynchronize")
        self.graphs[n_ops] = (graph, gexec)
        return gexec


def _nvrtc_compile_cubin(src: str, arch: str) -> bytes:
    from cuda.bindings import nvrtc

    ck = _drv_check
    prog = ck(nvrtc.nvrtcCreateProgram(src.encode(), b"scale_f16.cu", 0, [], []), "nvrtcCreateProgram")
    opts = [f"-arch={arch}".encode()] + [f"-I{d}".encode() for d in _cuda_include_dirs()]
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            size = ck(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = bytearray(max(size, 1))
            ck(nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
            raise RuntimeError(f"NVRTC compile failed ({err!r}), options {opts}:\n{log.decode(errors='replace')}")
        size = ck(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = bytearray(size)
        ck(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    finally:
        ck(nvrtc.nvrtcDestroyProgram(prog), "nvrtcDestroyProgram")
    if not cubin.startswith(b"\x7fELF"):
        raise RuntimeError("NVRTC did not return an ELF cubin")
    return bytes(cubin)


@functools.cache
def _raw_state() -> _RawState:
    return _RawState()


def measure_raw_bindings(n_ops: int, reps: int, warmup: int) -> list[dict]:
    from cuda.bindings import driver

    st = _raw_state()
    launch = driver.cuLaunchKernel
    sync = driver.cuStreamSynchronize
    OK = driver.CUresult.CUDA_SUCCESS
    func, stream, params = st.func, st.stream, st.params_ptr
    B, T = BLOCKS, THREADS
    out = []

    def sync_each() -> None:
        for _ in range(n_ops):
            (err,) = launch(func, B, 1, 1, T, 1, 1, 0, stream, params, 0)
            if err != OK:
                raise RuntimeError(f"cuLaunchKernel: {err!r}")
            (err,) = sync(stream)
            if err != OK:
                raise RuntimeError(f"cuStreamSynchronize: {err!r}")

    def chained() -> None:
        for _ in range(n_ops):
            (err,) = launch(func, B, 1, 1, T, 1, 1, 0, stream, params, 0)
            if err != OK:
                raise RuntimeError(f"cuLaunchKernel: {err!r}")
        (err,) = sync(stream)
        if err != OK:
            raise RuntimeError(f"cuStreamSynchronize: {err!r}")

    for mode, fn in (("sync_each", sync_each), ("chained", chained)):
        st.clear_y()
        samples = _time_reps(fn, reps, warmup)
        st.check(f"raw_bindings {mode} N={n_ops}")
        out.append(_summary("raw_bindings", mode, n_ops, samples, reps))

    gexec = st.graph_exec(n_ops)
    glaunch = driver.cuGraphLaunch

    def graph() -> None:
        (err,) = glaunch(gexec, stream)
        if err != OK:
            raise RuntimeError(f"cuGraphLaunch: {err!r}")
        (err,) = sync(stream)
        if err != OK:
            raise RuntimeError(f"cuStreamSynchronize: {err!r}")

    st.clear_y()
    samples = _time_reps(graph, reps, warmup)
    st.check(f"raw_bindings graph N={n_ops}")
    out.append(_summary("raw_bindings", "graph", n_ops, samples, reps))
    return out


# --------------------------------------------------------------------------------------
# cupy
# --------------------------------------------------------------------------------------


class _CupyState:
    def __init__(self) -> None:
        import cupy as cp

        self.cp = cp
        self.kernel = cp.RawKernel(KERNEL_SRC, KERNEL_NAME)
        self.stream = cp.cuda.Stream(non_blocking=True)
        with self.stream:
            self.x = cp.full(N_ELEMS, X_FILL, dtype=cp.float16)
            self.y = cp.zeros(N_ELEMS, dtype=cp.float16)
        self.stream.synchronize()
        self.args = (self.y, self.x, cp.float32(G), cp.int64(N_ELEMS))
        self.kernel((BLOCKS,), (THREADS,), self.args, stream=self.stream)
        self.stream.synchronize()
        self.check("cupy initial")
        self.graphs: dict[int, object] = {}

    def clear_y(self) -> None:
        with self.stream:
            self.y.fill(0)
        self.stream.synchronize()

    def check(self, what: str) -> None:
        self.stream.synchronize()
        with self.stream:
            y_host = self.cp.asnumpy(self.y, stream=self.stream)
        self.stream.synchronize()
        _check_host(y_host, what)


@functools.cache
def _cupy_state() -> _CupyState:
    return _CupyState()


def measure_cupy(n_ops: int, reps: int, warmup: int) -> list[dict]:
    st = _cupy_state()
    k, s, args = st.kernel, st.stream, st.args
    grid, block = (BLOCKS,), (THREADS,)
    out = []

    def sync_each() -> None:
        for _ in range(n_ops):
            k(grid, block, args, stream=s)
            s.synchronize()

    def chained() -> None:
        for _ in range(n_ops):
            k(grid, block, args, stream=s)
        s.synchronize()

    for mode, fn in (("sync_each", sync_each), ("chained", chained)):
        st.clear_y()
        samples = _time_reps(fn, reps, warmup)
        st.check(f"cupy {mode} N={n_ops}")
        out.append(_summary("cupy", mode, n_ops, samples, reps))

    # Optional: cupy stream capture (CUDA graph). Skipped with a note if unsupported.
    try:
        g = st.graphs.get(n_ops)
        if g is None:
            s.begin_capture()
            try:
                for _ in range(n_ops):
                    k(grid, block, args, stream=s)
            finally:
                g = s.end_capture()
            g.upload(s)
            s.synchronize()
            st.graphs[n_ops] = g

        def graph() -> None:
            g.launch(s)
            s.synchronize()

        st.clear_y()
        samples = _time_reps(graph, reps, warmup)
        st.check(f"cupy graph N={n_ops}")
        out.append(_summary("cupy", "graph", n_ops, samples, reps))
    except Exception as e:
        print(f"[cupy] graph mode skipped: {e!r}", file=sys.stderr)
    return out


# --------------------------------------------------------------------------------------
# torch
# --------------------------------------------------------------------------------------


class _TorchState:
    def __init__(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch.cuda is not available")
        self.torch = torch
        self.stream = torch.cuda.Stream()
        with torch.cuda.stream(self.stream):
            self.x = torch.full((N_ELEMS,), X_FILL, dtype=torch.float16, device="cuda")
            self.y = torch.zeros((N_ELEMS,), dtype=torch.float16, device="cuda")
            torch.mul(self.x, G, out=self.y)
        self.stream.synchronize()
        self.check("torch initial")
        self.graphs: dict[int, object] = {}

    def clear_y(self) -> None:
        with self.torch.cuda.stream(self.stream):
            self.y.zero_()
        self.stream.synchronize()

    def check(self, what: str) -> None:
        self.stream.synchronize()
        with self.torch.cuda.stream(self.stream):
            y_host = self.y.float().cpu().numpy()
        _check_host(y_host, what)


@functools.cache
def _torch_state() -> _TorchState:
    return _TorchState()


def measure_torch(n_ops: int, reps: int, warmup: int) -> list[dict]:
    st = _torch_state()
    torch = st.torch
    s, x, y = st.stream, st.x, st.y
    mul = torch.mul
    out = []

    def sync_each() -> None:
        for _ in range(n_ops):
            mul(x, G, out=y)
            s.synchronize()

    def chained() -> None:
        for _ in range(n_ops):
            mul(x, G, out=y)
        s.synchronize()

    for mode, fn in (("sync_each", sync_each), ("chained", chained)):
        st.clear_y()
        # The stream context is entered once, outside the timed region.
        with torch.cuda.stream(s):
            samples = _time_reps(fn, reps, warmup)
        st.check(f"torch {mode} N={n_ops}")
        out.append(_summary("torch", mode, n_ops, samples, reps))

    # Optional: torch.cuda.CUDAGraph. Skipped with a note if it fails.
    try:
        g = st.graphs.get(n_ops)
        if g is None:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=s):
                for _ in range(n_ops):
                    mul(x, G, out=y)
            torch.cuda.synchronize()
            st.graphs[n_ops] = g

        def graph() -> None:
            g.replay()
            s.synchronize()

        st.clear_y()
        with torch.cuda.stream(s):
            samples = _time_reps(graph, reps, warmup)
        st.check(f"torch graph N={n_ops}")
        out.append(_summary("torch", "graph", n_ops, samples, reps))
    except Exception as e:
        print(f"[torch] graph mode skipped: {e!r}", file=sys.stderr)
    return out


# --------------------------------------------------------------------------------------
# cuda.core
# --------------------------------------------------------------------------------------


def _import_cuda_core():
    try:
        import cuda.core as cc

        cc.Program  # noqa: B018  (1.x exposes the API at top level)
        return cc
    except (ImportError, AttributeError):
        import cuda.core.experimental as cc  # 0.x

        return cc


class _CudaCoreState:
    def __init__(self) -> None:
        import numpy as np
        from cuda.bindings import driver

        cc = _import_cuda_core()
        self.cc = cc
        self.dev = cc.Device(0)
        self.dev.set_current()
        self.stream = self.dev.create_stream(options=cc.StreamOptions(nonblocking=True))
        arch = f"sm_{self.dev.arch}"
        opts = cc.ProgramOptions(arch=arch, include_path=_cuda_include_dirs() or None)
        prog = cc.Program(KERNEL_SRC, code_type="c++", options=opts)
        mod = prog.compile("cubin")
        self.kernel = mod.get_kernel(KERNEL_NAME)
        self.config = cc.LaunchConfig(grid=BLOCKS, block=THREADS)

        self.nbytes = N_ELEMS * 2
        self.x = self.dev.allocate(self.nbytes, stream=self.stream)
        self.y = self.dev.allocate(self.nbytes, stream=self.stream)
        self.stream.sync()
        x_host = np.full(N_ELEMS, X_FILL, dtype=np.float16)
        _drv_check(driver.cuMemcpyHtoD(int(self.x.handle), x_host.ctypes.data, self.nbytes), "cuMemcpyHtoD")
        self.g = np.float32(G)
        self.n = np.int64(N_ELEMS)
        self.clear_y()
        cc.launch(self.stream, self.config, self.kernel, self.y, self.x, self.g, self.n)
        self.stream.sync()
        self.check("cuda_core initial")

    def clear_y(self) -> None:
        from cuda.bindings import driver

        _drv_check(driver.cuMemsetD8(int(self.y.handle), 0, self.nbytes), "cuMemsetD8")
        _drv_check(driver.cuCtxSynchronize(), "cuCtxSynchronize")

    def check(self, what: str) -> None:
        import numpy as np
        from cuda.bindings import driver

        self.stream.sync()
        y_host = np.empty(N_ELEMS, dtype=np.float16)
        _drv_check(driver.cuMemcpyDtoH(y_host.ctypes.data, int(self.y.handle), self.nbytes), "cuMemcpyDtoH")
        _check_host(y_host, what)


@functools.cache
def _cuda_core_state() -> _CudaCoreState:
    return _CudaCoreState()


def measure_cuda_core(n_ops: int, reps: int, warmup: int) -> list[dict]:
    st = _cuda_core_state()
    launch = st.cc.launch
    s, cfg, k = st.stream, st.config, st.kernel
    y, x, g, n = st.y, st.x, st.g, st.n
    out = []

    def sync_each() -> None:
        for _ in range(n_ops):
            launch(s, cfg, k, y, x, g, n)
            s.sync()

    def chained() -> None:
        for _ in range(n_ops):
            launch(s, cfg, k, y, x, g, n)
        s.sync()

    for mode, fn in (("sync_each", sync_each), ("chained", chained)):
        st.clear_y()
        samples = _time_reps(fn, reps, warmup)
        st.check(f"cuda_core {mode} N={n_ops}")
        out.append(_summary("cuda_core", mode, n_ops, samples, reps))
    return out


# --------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------

IMPLS: dict[str, Callable[[int, int, int], list[dict]]] = {
    "raw_bindings": measure_raw_bindings,
    "cupy": measure_cupy,
    "torch": measure_torch,
    "cuda_core": measure_cuda_core,
}


def run_chain_bin(path: str, reps: int) -> list[dict]:
    """Run the CUDA C++ reference binary (benchmarks/ref/chain) and flatten its results."""
    proc = subprocess.run([path, str(reps)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{path} exited {proc.returncode}: {proc.stderr.strip()}")
    doc = json.loads(proc.stdout)
    return [{"impl": doc["impl"], **r} for r in doc["results"]]


def _print_table(results: list[dict], sizes: list[int]) -> None:
    rows: dict[tuple[str, str], dict[int, dict]] = {}
    for r in results:
        rows.setdefault((r["impl"], r["mode"]), {})[r["n_ops"]] = r
    head = f"{'impl':<14}{'mode':<11}" + "".join(f"{'N=' + str(n):>22}" for n in sizes)
    print("us per op: median [p25, p75]")
    print(head)
    print("-" * len(head))
    for (impl, mode), by_n in rows.items():
        cells = []
        for n in sizes:
            r = by_n.get(n)
            cells.append(
                f"{r['us_per_op_median']:8.2f} [{r['us_per_op_p25']:5.2f},{r['us_per_op_p75']:6.2f}]" if r else "-"
            )
        print(f"{impl:<14}{mode:<11}" + "".join(f"{c:>22}" for c in cells))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="comma-separated N values")
    ap.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of " + ",".join(IMPLS))
    ap.add_argument("--chain-bin", default=None, help="path to the compiled benchmarks/ref/chain binary")
    ap.add_argument("--out", default=None, help="write the JSON list of results here")
    args = ap.parse_args(argv)

    sizes = [int(s) for s in args.sizes.split(",") if s]
    names = [s for s in args.impls.split(",") if s]
    unknown = [n for n in names if n not in IMPLS]
    if unknown:
        ap.error(f"unknown impls {unknown}; choose from {list(IMPLS)}")

    results: list[dict] = []
    failed: list[str] = []
    for name in names:
        fn = IMPLS[name]
        try:
            for n in sizes:
                t0 = time.perf_counter()
                res = fn(n, args.reps, args.warmup)
                results.extend(res)
                print(f"[{name}] N={n}: done in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        except ImportError as e:
            print(f"[{name}] skipped (import failed: {e})", file=sys.stderr)
        except Exception as e:
            # A failed output check is a real failure: keep going with other impls but exit non-zero.
            print(f"[{name}] FAILED: {e!r}", file=sys.stderr)
            failed.append(name)

    if args.chain_bin:
        try:
            results.extend(r for r in run_chain_bin(args.chain_bin, args.reps) if r["n_ops"] in sizes)
        except Exception as e:
            print(f"[cuda_cpp] FAILED: {e!r}", file=sys.stderr)
            failed.append("cuda_cpp")

    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    _print_table(results, sizes)
    if failed:
        print(f"failed: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
