"""Host µs per graph node of the reference scale kernel against deviceop's built-in (diagnostic).

Graphs of N identical ``scale`` nodes (16 blocks x 128 threads, 2048 halves) replayed with raw
cuda.bindings ``cuGraphLaunch`` + sync, the variants interleaved rep by rep in one process
after a 0.5 s warm-up; medians per node and medians of the per-rep ratio to ``ref``:

* ``ref``: experiments/ref/graph_ref.cu's kernel; ``ref_param``: the same with a fifth parameter
* ``dev``: deviceop's built-in ``scale_f16`` (tile 128, no vectors), as in exec_modes.py's graphs
* ``dev_fast``: with an early one-element-per-thread exit; ``dev_int``: with 32-bit indices

    python3 experiments/node_variants.py
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deviceop as do
from deviceop.kernels._elementwise import PRELUDE
from deviceop.kernels._nvrtc import compile_cubin

REF = r"""#include <cuda_fp16.h>
extern "C" __global__ void k_ref(__half* y, const __half* x, float g, long long n) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = __float2half(__half2float(x[i]) * g); }
extern "C" __global__ void k_refp(__half* y, const __half* x, float g, long long n, int vec) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = __float2half(__half2float(x[i]) * g); }
"""
FAST = "  if (!vec && tile <= blockDim.x) { long long e = i + threadIdx.x; if (e < end) st(out, e, scale_f(ld(x0, e), s0)); return; }\n"
INT = (
    "  if (!vec) { int b = (int)base, e = b + (int)threadIdx.x, en = (int)end; "
    "for (; e < en; e += blockDim.x) st(out, e, scale_f(ld(x0, e), s0)); return; }\n"
)


def main() -> None:
    from cuda.bindings import driver as D

    s = do.next_stream()
    be = s.backend
    x = do.from_numpy(np.full(2048, 1.5, np.float16)).sync_on(s)
    y = do.zeros(2048, do.float16).sync_on(s)
    dev_src = PRELUDE + do.kernels.scale.source()
    variants = {  # name: (source, function, parameter values)
        "ref": (REF, "k_ref", (y.ptr, x.ptr, 0.5, 2048)),
        "ref_param": (REF, "k_refp", (y.ptr, x.ptr, 0.5, 2048, 0)),
        "dev": (dev_src, "scale_f16", (y.ptr, x.ptr, 0.5, 128, 0)),
        "dev_fast": (
            dev_src.replace("  if (vec) {", FAST + "  if (vec) {", 1),
            "scale_f16",
            (y.ptr, x.ptr, 0.5, 128, 0),
        ),
        "dev_int": (dev_src.replace("  if (vec) {", INT + "  if (vec) {", 1), "scale_f16", (y.ptr, x.ptr, 0.5, 128, 0)),
    }
    types = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_longlong, ctypes.c_int)
    st = s.handle

    def ck(r):  # type: ignore[no-untyped-def]
        if r[0] != 0:
            raise RuntimeError(f"CUDA error {r[0]}")
        return r[1] if len(r) > 1 else None

    fns = {
        k: (be.load_function(compile_cubin(src, k, be.arch, ()), name), vals)
        for k, (src, name, vals) in variants.items()
    }

    def graph(f, vals, n):  # type: ignore[no-untyped-def]
        ck(D.cuStreamBeginCapture(st, D.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
        for _ in range(n):
            ck(D.cuLaunchKernel(f, 16, 1, 1, 128, 1, 1, 0, st, (vals, types[: len(vals)]), 0))
        ex = ck(D.cuGraphInstantiate(ck(D.cuStreamEndCapture(st)), 0))
        ck(D.cuGraphUpload(ex, st))
        ck(D.cuStreamSynchronize(st))
        return ex

    gl, sy, clock = D.cuGraphLaunch, D.cuStreamSynchronize, time.perf_counter_ns
    for n in (10, 100):
        exs = {k: graph(f, vals, n) for k, (f, vals) in fns.items()}
        t_end = time.perf_counter() + 0.5
        while time.perf_counter() < t_end:
            for ex in exs.values():
                gl(ex, st)
                sy(st)
        samples: dict[str, list[float]] = {k: [] for k in exs}
        for _ in range(1500 if n == 10 else 400):
            for k, ex in exs.items():
                t = clock()
                gl(ex, st)
                sy(st)
                samples[k].append((clock() - t) / 1e3 / n)
        if not np.all(y.numpy() == np.float16(0.75)):
            raise AssertionError("a variant computed the wrong values")
        ref = np.array(samples["ref"])
        print(f"N={n} us/node " + "  ".join(f"{k} {np.median(v):.4f}" for k, v in samples.items()))
        print("   over ref " + "  ".join(f"{k} {np.median(np.array(v) / ref):.4f}" for k, v in samples.items()))


if __name__ == "__main__":
    main()
