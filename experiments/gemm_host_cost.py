"""Host-thread CPU time per GEMM, layer by layer: what one thread spends to issue a 512^3 float16
GEMM, from the driver call up to a work queue item, beside PyTorch's ``matmul(out=)``.

Layers (each N GEMMs on one stream, then one sync; the issuing thread's CPU time
(``time.thread_time``) per GEMM, best of --repeats, after a warm-up):
  torch        torch.matmul(a, b, out=c) on a stream of deviceop's (ExternalStream)
  raw_graph    the recorded GEMM's executable graph, launched with deviceop's cuGraphLaunch binding
  raw_lt       cublasLtMatmul with deviceop's plan, through nvmath-python's binding
  build        K.gemm(c, a, b) only (the op, not run)
  run_batch    N ops made and run in one execution (as a queue's batch runs them)
  fresh_batch  the same with a fresh output per GEMM (do.empty): allocation, no replay
  sync_loop    K.gemm(c, a, b).sync_on(s) per GEMM
  queue_b8     WorkQueue over one stream, batch=8 (uvloop); queue_b1: batch=1
The GPU time of one such GEMM is measured too (a replayed graph of N of them), to show
which layers are host-bound.

    python experiments/gemm_host_cost.py --out gemm_host_cost.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import deviceop as do
from deviceop._core._op import Each
from deviceop.executors import WorkQueue

K = do.kernels


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import uvloop

    n, m = a.items, a.size
    rng = np.random.default_rng(0)
    x, y = (do.from_numpy((rng.standard_normal((m, m)) / 16).astype(np.float16)).sync() for _ in range(2))
    c = do.zeros((m, m), do.float16).sync()
    s = do.streams()[0]
    rows: list[dict[str, Any]] = []

    def timed(name: str, fn: Callable[[], Any], after: Callable[[], Any] = lambda: s.synchronize()) -> None:
        fn()
        after()  # warm-up: plans, replays recorded
        best: tuple[float, float] | None = None
        for _ in range(a.repeats):
            t, cpu = time.perf_counter(), time.thread_time()
            fn()
            after()
            r = ((time.thread_time() - cpu) / n * 1e6, (time.perf_counter() - t) / n * 1e6)
            best = r if best is None or r[0] < best[0] else best
        assert best is not None
        rows.append({"layer": name, "thread_cpu_us": best[0], "wall_us": best[1]})
        print(f"{name:12} thread CPU {best[0]:7.2f} us/GEMM   wall {best[1]:7.2f} us/GEMM", flush=True)

    # the GPU's own time per GEMM: N of them recorded into one graph, replayed
    with do.graph.scope(stream=s) as sc:
        for _ in range(200):
            sc.record(K.gemm(c, x, y))
    g = sc.graph
    g.launch().sync_on(s)
    t = time.perf_counter()
    for _ in range(10):
        g.launch().sync_on(s)
    gpu_us = (time.perf_counter() - t) / 2000 * 1e6
    print(f"GPU time per GEMM (graph of 200, replayed): {gpu_us:.2f} us", flush=True)

    cuda = s.backend.driver is not None  # the host backend has no torch stream nor driver layers
    try:
        if not cuda:
            raise ImportError
        import torch

        tx, ty, tc = (torch.from_dlpack(v) for v in (x, y, c))
        ts = torch.cuda.ExternalStream(s.handle_int)

        def torch_loop() -> None:
            with torch.cuda.stream(ts):
                for _ in range(n):
                    torch.matmul(tx, ty, out=tc)

        timed("torch", torch_loop)
    except ImportError:
        print("torch (or a GPU) not here: its row is left out")

    from deviceop._backends._cuda_driver import graph_launch
    from deviceop.kernels import _gemm
    from deviceop.kernels._blaslt import _lt

    K.gemm(c, x, y).sync_on(s)
    for _ in range(5):
        K.gemm(c, x, y).sync_on(s)  # hot: recorded
    execs = _gemm.GEMM.replays.executables() if cuda else []
    sh = s.handle_int
    if execs:
        ex = execs[-1].handle_int

        def raw_graph() -> None:
            for _ in range(n):
                graph_launch(ex, sh)

        timed("raw_graph", raw_graph)
    geo = _gemm.GEMM.plan((c, x, y), (1.0, 0.0, False))
    if cuda and geo.lt_call:
        _, handle, desc, la, lb, lc, algo = geo.lt_call
        pa, pb, pc = (y.addr, x.addr, c.addr) if geo.swap else (x.addr, y.addr, c.addr)
        ws = _gemm.GEMM.blas[sh][1]
        one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        al, be = ctypes.addressof(one), ctypes.addressof(zero)
        mm = _lt().matmul

        def raw_lt() -> None:
            for _ in range(n):
                mm(handle, desc, al, pb, la, pa, lb, be, pc, lc, pc, lc, algo, ws, _gemm.WORKSPACE_BYTES, sh)

        timed("raw_lt", raw_lt)

    timed("build", lambda: [K.gemm(c, x, y) for _ in range(n)], after=lambda: None)
    timed("run_batch", lambda: Each([K.gemm(c, x, y) for _ in range(n)]).sync_on(s))
    timed("fresh_batch", lambda: Each([K.gemm(do.empty((m, m), do.float16), x, y) for _ in range(n)]).sync_on(s))

    def sync_loop() -> None:
        for _ in range(n):
            K.gemm(c, x, y).sync_on(s)

    timed("sync_loop", sync_loop)
    for b in (8, 1):

        def queue(b: int = b) -> None:
            uvloop.run(WorkQueue(streams=[s], batch=b).run(K.gemm(c, x, y) for _ in range(n)))

        timed(f"queue_b{b}", queue)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"size": m, "items": n, "gpu_us_per_gemm": gpu_us, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
