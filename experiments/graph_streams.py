"""One recorded graph replayed by raw cuda.bindings on streams of different histories.

experiments/graph_kernels.py found deviceop's one-kernel graph replaying about 0.1 µs slower
on deviceop's pool stream than on the raw reference's stream. This replays that graph
(``cuGraphLaunch`` + ``cuStreamSynchronize``) on, interleaved in a shuffled order each rep:

  raw            the raw reference's stream (made by experiments/_refs.py)
  pool<i>        each stream of deviceop's pool
  fresh          a non-blocking stream made after deviceop's start, used for nothing else
  fresh_alloc    the same, after one cuMemAllocAsync / cuMemFreeAsync on it
  fresh_memset   the same, after one cuMemsetD8Async on it
  fresh_copy     the same, after one cuMemcpyHtoDAsync on it
  fresh_kernel   the same, after one deviceop kernel launched on it (a foreign stream)

and the C++ replay (--graph-lib). Medians and medians of ratios against ``raw``; one JSON.

    python experiments/graph_streams.py --graph-lib /tmp/libgraphref.so --out graph_streams.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _refs
from exec_modes import clock_read_us, cpp_graph_replay, interleave, machine_info, warm_up

import deviceop as do

K = do.kernels
N = 2048


def main(argv: list[str] | None = None) -> int:
    from cuda.bindings import driver

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=1000)
    ap.add_argument("--graph-lib", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    def ck(r: tuple) -> object:
        if int(r[0]):
            raise RuntimeError(f"driver call failed: {r[0]!r}")
        return r[1] if len(r) > 1 else None

    st = _refs._raw_state()
    glaunch, sync = driver.cuGraphLaunch, driver.cuStreamSynchronize
    s = do.next_stream()
    x = do.from_numpy(np.full(N, 1.5, dtype=np.float16)).sync_on(s)
    y = do.zeros(N, do.float16).sync_on(s)
    g = K.scale(y.partition((_refs.THREADS,)), x, 0.5).graph()
    ex = driver.CUgraphExec(g._exec.handle_int)
    flags = driver.CUstream_flags.CU_STREAM_NON_BLOCKING.value
    streams = {"raw": st.stream}
    for i, p in enumerate(do.streams()):
        streams[f"pool{i}"] = driver.CUstream(p.handle_int)
    for name in ("fresh", "fresh_alloc", "fresh_memset", "fresh_copy", "fresh_kernel"):
        streams[name] = ck(driver.cuStreamCreate(flags))
    fs = streams["fresh_alloc"]
    ptr = ck(driver.cuMemAllocAsync(1 << 20, fs))
    ck(driver.cuMemFreeAsync(ptr, fs))
    scratch = ck(driver.cuMemAlloc(1 << 20))
    ck(driver.cuMemsetD8Async(scratch, 0, 1 << 20, streams["fresh_memset"]))
    host = np.zeros(1 << 18, np.uint8)
    ck(driver.cuMemcpyHtoDAsync(scratch, host.ctypes.data, host.nbytes, streams["fresh_copy"]))
    z = do.zeros(N, do.float16).sync_on(s)
    K.scale(z.partition((_refs.THREADS,)), x, 0.5).sync_on(do.Stream.from_handle(int(streams["fresh_kernel"])))
    for h in streams.values():
        ck(sync(h))
    clock = time.perf_counter_ns

    def on(h: object):
        def run() -> float:
            t = clock()
            glaunch(ex, h)
            sync(h)
            return (clock() - t) / 1e3

        return run

    fns = {name: on(h) for name, h in streams.items()}
    if a.graph_lib:
        fns["cuda_cpp"], _ = cpp_graph_replay(a.graph_lib, 1)
    warm_up(fns, 0.5)
    timer_us = clock_read_us()
    samples, _ = interleave(fns, a.reps, "shuffle", {"cuda_cpp": 0.0}, timer_us, 1)
    if not np.array_equal(y.numpy(), np.full(N, 0.75, np.float16)):
        raise AssertionError("the graph produced wrong values")
    med = {k: round(float(np.median(v)), 4) for k, v in samples.items()}
    rel = {k: round(float(np.median([u / r for u, r in zip(v, samples["raw"])])), 4) for k, v in samples.items()}
    doc = {"experiment": "graph_streams", "machine": machine_info(), "reps": a.reps, "us_median": med, "over_raw": rel}
    print(json.dumps(med))
    print(json.dumps(rel))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
