"""Host cost of one graph replay, without a GPU: every CUDA call goes to a stub driver (diagnostic).

Builds experiments/ref/stub_cuda.c into a temporary libcuda.so.1 (needs a C compiler), then
re-runs itself on it with the host backend and times, interleaved, the host side of an N=1
replay of a two-region graph:

* ``dev``: ``g.launch().sync_on(s)`` through deviceop's native replay (ledger, context, op)
* ``natraw``: the native module's thin ``graph_launch`` + ``stream_sync`` (the floor)
* ``raw``: cuda.bindings ``cuGraphLaunch`` + ``cuStreamSynchronize``

The numbers are what the host adds to a replay, the GPU's part being zero here.

    python3 experiments/replay_host_cost.py [--rounds 15] [--out host_cost.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import timeit

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STUB = "_DEVICEOP_STUB_DRIVER"


def build_and_rerun() -> int:
    with tempfile.TemporaryDirectory() as d:
        cc = os.environ.get("CC", "cc")
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", os.path.join(d, "libcuda.so.1"),
                        os.path.join(HERE, "ref", "stub_cuda.c"), "-ldl"], check=True)
        env = dict(os.environ, LD_LIBRARY_PATH=d + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""),
                   DEVICEOP_BACKEND="host", OPENBLAS_NUM_THREADS="1", **{STUB: "1"})
        return subprocess.run([sys.executable, *sys.argv], env=env).returncode


def measure(rounds: int, out: str | None) -> None:
    sys.path.insert(0, os.environ.get("DEVICEOP_ROOT", ROOT))
    import numpy as np
    from cuda.bindings import driver

    import deviceop as do
    from deviceop.device import _fast, _ledger
    from deviceop.device._capture import CAPTURE, RECORDING
    from deviceop.executors._context import context_maker
    from deviceop.graph._graph import CudaGraph

    nat = _fast.native
    if nat is None or not nat.load_driver():
        raise SystemExit("needs the native module (python setup.py build_ext --inplace)")

    class StubStream:
        __slots__ = ("backend", "handle_int")

        def __init__(self, backend: object, handle: int) -> None:
            self.backend, self.handle_int = backend, handle

    be, exh, sh = object(), 0x1234, 0x99
    nat.set_lock(_ledger.LOCK)
    nat.set_replay(context_maker(), CAPTURE, RECORDING, StubStream, _ledger.touch, _ledger.ENABLED,
                   lambda err, what: RuntimeError(f"{what}: {err}"), None, _fast.REPLAY)
    _fast.REPLAY[0] = True
    x, y = do.zeros(2048, do.float16).sync(), do.zeros(2048, do.float16).sync()
    g = CudaGraph.__new__(CudaGraph)
    g.launches = 0
    g._fast = (be, 1, None, exh, ((x.buffer, 0, 4096, False), (y.buffer, 0, 4096, True)), y, [None, None])
    s = StubStream(be, sh)
    if g.launch().sync_on(s) is not y or x.buffer.accesses or y.buffer.accesses:
        raise AssertionError("the stub replay did not run through the native replay")
    gexec, rstream = driver.CUgraphExec(exh), driver.CUstream(sh)
    glaunch, gsync, nlaunch, nsync = driver.cuGraphLaunch, driver.cuStreamSynchronize, nat.graph_launch, nat.stream_sync

    def dev() -> None:
        g.launch().sync_on(s)

    def natraw() -> None:
        nlaunch(exh, sh)
        nsync(sh)

    def raw() -> None:
        glaunch(gexec, rstream)
        gsync(rstream)

    fns = {"dev": dev, "natraw": natraw, "raw": raw}
    n = 50000
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            samples[k].append(timeit.timeit(f, number=n) / n * 1e9)
    med = {k: float(np.median(v)) for k, v in samples.items()}
    print("host ns per N=1 replay (stub driver), median of", rounds, "rounds:",
          "  ".join(f"{k} {v:.0f}" for k, v in med.items()))
    if out:
        with open(out, "w") as f:
            json.dump({"experiment": "replay_host_cost", "ns_median": med, "samples_ns": samples}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if os.environ.get(STUB) != "1":
        raise SystemExit(build_and_rerun())
    measure(a.rounds, a.out)


if __name__ == "__main__":
    main()
