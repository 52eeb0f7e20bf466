"""Host cost of deviceop's launch paths beside raw cuda.bindings calls of the same work.

Chained launches of the built-in ``scale`` (N=1000, one sync), one launch with its sync, and
graph replays (N=1 and 10 kernels), each paired with raw ``cuda.bindings`` calls that launch
deviceop's own function / executable graph on deviceop's stream, interleaved round by round.
On a GPU this is wall time per op (GPU included); with the stub driver in inline mode
(``DEVICEOP_STUB_INLINE=1``, every item run when enqueued) it is the host cost alone, which
is how deviceop's own share is profiled without a GPU:

    cc -O2 -shared -fPIC -Wl,-soname,libcuda.so.1 -o /tmp/stub/libcuda.so.1 \\
        tests/stub_driver/stub_cuda.c -ldl -lpthread
    DEVICEOP_STUB_INLINE=1 LD_LIBRARY_PATH=/tmp/stub python experiments/host_cost.py
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deviceop as do

N_ELEMS = 2048
G = 0.5


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--sched",
        choices=("auto", "spin", "yield", "blocking"),
        default="auto",
        help="the primary context's scheduling flag (how a synchronize waits), set before deviceop starts",
    )
    a = ap.parse_args(argv)
    if a.sched != "auto":
        from cuda.bindings import driver as drv

        flag = {
            "spin": drv.CUctx_flags.CU_CTX_SCHED_SPIN,
            "yield": drv.CUctx_flags.CU_CTX_SCHED_YIELD,
            "blocking": drv.CUctx_flags.CU_CTX_SCHED_BLOCKING_SYNC,
        }[a.sched]
        drv.cuInit(0)
        (err,) = drv.cuDevicePrimaryCtxSetFlags(drv.cuDeviceGet(0)[1], flag)
        if err:
            raise RuntimeError(f"cuDevicePrimaryCtxSetFlags: {err!r}")
    if do.backend_name() != "cuda":
        print("host_cost.py needs the cuda backend (a GPU, or the stub driver)", file=sys.stderr)
        return 2
    from cuda.bindings import driver

    K = do.kernels
    s = do.next_stream()
    x = do.from_numpy(np.full(N_ELEMS, 1.5, dtype=np.float16)).sync_on(s)
    y = do.zeros(N_ELEMS, do.float16).sync_on(s)
    yp = y.partition((128,))
    plan = K.scale(yp, x, G).plan.cuda
    fn = driver.CUfunction(int(plan.fn))
    st = driver.CUstream(s.handle_int)
    # the kernel's parameters as deviceop packs them (out, x, g, then the plan's fixed values)
    ctype = {0: ctypes.c_uint64, 1: ctypes.c_float, 2: ctypes.c_int32, 3: ctypes.c_int64}
    vals = []
    for src, idx, ct, fixed in plan.layout:
        if src == 0:
            vals.append(ctypes.c_uint64((y, x)[idx].addr))
        elif src == 1:
            vals.append(ctypes.c_float(G))
        else:
            vals.append(ctype[ct].from_buffer_copy(int(fixed).to_bytes(8, "little")[: ctypes.sizeof(ctype[ct])]))
    block = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
    params = ctypes.addressof(block)
    launch, sync, glaunch = driver.cuLaunchKernel, driver.cuStreamSynchronize, driver.cuGraphLaunch
    (gx, gy, gz), (bx, by, bz) = plan.grid, plan.block
    n_chain = 1000

    def step(o: tuple) -> do.DeviceOp:
        return K.scale(*o)

    def raw_chain() -> None:
        for _ in range(n_chain):
            launch(fn, gx, gy, gz, bx, by, bz, 0, st, params, 0)
        sync(st)

    def dev_chain() -> None:
        op = K.scale(yp, x, G)
        for _ in range(n_chain - 1):
            op = op.then(step)
        op.sync_on(s)

    def raw_one() -> None:
        launch(fn, gx, gy, gz, bx, by, bz, 0, st, params, 0)
        sync(st)

    def dev_one() -> None:
        K.scale(yp, x, G).sync_on(s)

    cases = {"chained N=1000": (raw_chain, dev_chain, n_chain, 1), "sync each": (raw_one, dev_one, 1, 500)}
    for n in (1, 10):
        op = K.scale(yp, x, G)
        for _ in range(n - 1):
            op = op.then(step)
        g = op.graph()
        ex = driver.CUgraphExec(g._exec.handle_int)

        def raw_graph(ex=ex) -> None:
            glaunch(ex, st)
            sync(st)

        def dev_graph(g=g) -> None:
            g.launch().sync_on(s)

        cases[f"graph N={n}"] = (raw_graph, dev_graph, 1, 500)
        if n == 1:  # where deviceop's replay spends its time, step by step (each against raw)
            from deviceop._backends import _cuda_driver as nd
            from deviceop._core._op import start

            exi, si = g._exec.handle_int, s.handle_int

            def drv_calls(exi=exi) -> None:  # the same two driver calls through deviceop's wrappers
                nd.graph_launch(exi, si)
                nd.stream_sync(si)

            def start_finish(g=g) -> None:  # the terminal's steps, called one by one from Python
                op = g.launch()
                op._take("host_cost")
                cx, _ = start(op, s, "host_cost")
                nd.stream_sync(si)
                cx.finish()

            cases["graph N=1, deviceop's driver wrappers"] = (raw_graph, drv_calls, 1, 500)
            cases["graph N=1, start + sync + finish"] = (raw_graph, start_finish, 1, 500)
    out = {}
    for name, (raw, dev, per, inner) in cases.items():
        samples: dict[str, list[float]] = {"raw": [], "deviceop": []}
        for r in range(a.rounds + 3):
            for key, fn_ in (("raw", raw), ("deviceop", dev)):
                t = time.perf_counter_ns()
                for _ in range(inner):
                    fn_()
                if r >= 3:
                    samples[key].append((time.perf_counter_ns() - t) / 1e3 / inner / per)
        med = {k: float(np.median(v)) for k, v in samples.items()}
        ratio = float(np.median([d / r for d, r in zip(samples["deviceop"], samples["raw"])]))
        out[name] = {"us_per_op_median": med, "deviceop_over_raw": ratio}
        print(
            f"{name:<40} raw {med['raw']:.3f}  deviceop {med['deviceop']:.3f} us/op  -> {ratio:.3f}x "
            f"({med['deviceop'] - med['raw']:+.3f} us)"
        )
    inline = os.environ.get("DEVICEOP_STUB_INLINE") == "1"  # the stub's kernels compute nothing
    if not inline and not np.array_equal(y.numpy(), np.full(N_ELEMS, 0.75, np.float16)):
        raise AssertionError("wrong values after the runs")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"experiment": "host_cost", "inline_stub": inline, "sched": a.sched, "results": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
