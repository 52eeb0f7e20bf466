"""Where one deviceop graph replay's time goes, against raw cuda.bindings and CUDA C++ (diagnostic).

Interleaved rep by rep in one process after a 0.5 s warm-up, medians in µs per replay of an
N-kernel `scale` graph (replay + sync):

* ``raw``: cuGraphLaunch + cuStreamSynchronize through cuda.bindings
* ``rawdev``: the same calls on deviceop's graph and stream (the graph's and stream's share)
* ``natraw``: deviceop's graph and stream through the native module's thin ``graph_launch`` /
  ``stream_sync`` (the native calls without the op, ledger and execution context)
* ``cpp``: the CUDA C++ replay (experiments/ref/graph_ref.cu as a shared library, timed in C++)
* ``dev``: ``g.launch().sync_on(s)``
* ``preop``: ``op.sync_on(s)`` of a launch op built outside the timed region
* ``noledger``: as ``preop`` for a view of the graph that registers no regions (the ledger's share)
* ``generic``: the generic terminal (``DeviceOp.sync_on``) instead of the native replay
* ``launch_only``: ``g.launch()`` alone

    nvcc -O3 -arch=sm_90 -shared -Xcompiler -fPIC -o /tmp/libgraphref.so experiments/ref/graph_ref.cu
    python3 experiments/replay_cost.py 1 [--lib /tmp/libgraphref.so] [--reps 400]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _refs  # noqa: E402

import deviceop as do  # noqa: E402
from deviceop.ops._base import DeviceOp  # noqa: E402


def main() -> None:
    from cuda.bindings import driver

    ap = argparse.ArgumentParser()
    ap.add_argument("n", type=int, nargs="?", default=1, help="kernels in the graph")
    ap.add_argument("--lib", default="/tmp/libgraphref.so")
    ap.add_argument("--reps", type=int, default=400)
    a = ap.parse_args()
    n = a.n
    K = do.kernels
    st = _refs._raw_state()
    gexec = st.graph_exec(n)
    glaunch, sync, rstream = driver.cuGraphLaunch, driver.cuStreamSynchronize, st.stream
    s = do.next_stream()
    x = do.from_numpy(np.full(_refs.N_ELEMS, 1.5, np.float16)).sync_on(s)
    y = do.zeros(_refs.N_ELEMS, do.float16).sync_on(s)
    op = K.scale(y.partition((128,)), x, 0.5)
    for _ in range(n - 1):
        op = op.then(lambda o: K.scale(*o))
    g = op.graph()
    if g._fast is None:
        raise SystemExit("needs the cuda backend")
    lib = ctypes.CDLL(a.lib)
    lib.ref_replay_us.restype = ctypes.c_double
    if lib.ref_setup(n) != 0:
        raise SystemExit(f"{a.lib}: ref_setup failed")
    gfree = do.graph.CudaGraph.__new__(do.graph.CudaGraph)  # the same graph, no regions to register
    gfree.__dict__.update(g.__dict__)
    f = g._fast
    gfree._fast = (f[0], f[1], f[2], f[3], (), f[5], [None, None])
    clock = time.perf_counter_ns
    nd = do.device._fast.DRIVER[0]
    dexec, dstream, exh, sh = f[2].handle, s.handle, f[3], s.handle_int

    def launch_sync(launch, sync_, ex, stream):  # type: ignore[no-untyped-def]
        """A timed replay through one pair of launch / sync calls."""

        def run() -> float:
            t = clock()
            launch(ex, stream)
            sync_(stream)
            return (clock() - t) / 1e3

        return run

    raw = launch_sync(glaunch, sync, gexec, rstream)
    rawdev = launch_sync(glaunch, sync, dexec, dstream)
    natraw = launch_sync(nd.graph_launch, nd.stream_sync, exh, sh)

    def cpp() -> float:
        return float(lib.ref_replay_us(n))

    def dev() -> float:
        t = clock()
        g.launch().sync_on(s)
        return (clock() - t) / 1e3

    def timed(o: DeviceOp, fn) -> float:  # type: ignore[no-untyped-def]
        t = clock()
        fn(o, s)
        return (clock() - t) / 1e3

    def launch_only() -> float:
        t = clock()
        g.launch()
        return (clock() - t) / 1e3

    fns = {
        "raw": raw, "cpp": cpp, "dev": dev, "rawdev": rawdev, "natraw": natraw,
        "preop": lambda: timed(g.launch(), lambda o, st_: o.sync_on(st_)),
        "noledger": lambda: timed(gfree.launch(), lambda o, st_: o.sync_on(st_)),
        "generic": lambda: timed(g.launch(), DeviceOp.sync_on),
        "launch_only": launch_only,
    }
    t_end = time.perf_counter() + 0.5
    while time.perf_counter() < t_end:
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(a.reps):
        for k, fn in fns.items():
            samples[k].append(fn())
    med = {k: float(np.median(v)) for k, v in samples.items()}
    print(f"N={n} " + "  ".join(f"{k} {v:.3f}" for k, v in med.items()))
    dev_cpp = np.median([d / c for d, c in zip(samples["dev"], samples["cpp"])])
    raw_cpp = np.median([r / c for r, c in zip(samples["raw"], samples["cpp"])])
    print(f"  dev/cpp {dev_cpp:.3f}  raw/cpp {raw_cpp:.3f}")


if __name__ == "__main__":
    main()
