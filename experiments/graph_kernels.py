"""Where a one-kernel graph replay's time goes: the kernel recorded, the stream, deviceop's path.

The graph-replay figure compares ``g.launch().sync_on(s)`` of deviceop's ``scale`` built-in
with a CUDA C++ replay of a plain ``scale_f16`` kernel (experiments/ref/graph_ref.cu). This
separates, in one process with every column interleaved in a shuffled order each rep:

  raw_ref              raw cuda.bindings replaying its own graph of the reference kernel
  raw_builtin          raw cuda.bindings replaying deviceop's recorded graph of the built-in
  raw_builtin_rawst    the same graph replayed on the raw reference's stream
  raw_userref          raw cuda.bindings replaying a deviceop graph of the reference kernel
                       (the same source as a user ``Kernel``, grid 16 x 128 as the reference)
  dev_builtin          deviceop's replay of the built-in's graph (the figure's column)
  dev_userref          deviceop's replay of the user kernel's graph
  cuda_cpp             the C++ replay (with --graph-lib)

raw_builtin against raw_userref is the kernel's own cost; raw_userref against raw_ref is what
deviceop's recording (capture stream, upload, memory) adds; dev_* against raw_* is deviceop's
host path. Medians per column and ratios against cuda_cpp and raw_ref; one JSON document.

    python experiments/graph_kernels.py --graph-lib /tmp/libgraphref.so --out graph_kernels.json
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
from exec_modes import cpp_graph_replay, interleave, machine_info, warm_up

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

    st = _refs._raw_state()
    ref_exec = st.graph_exec(1)
    glaunch, sync = driver.cuGraphLaunch, driver.cuStreamSynchronize
    rstream = st.stream
    s = do.next_stream()
    dstream = driver.CUstream(s.handle_int)
    x = do.from_numpy(np.full(N, 1.5, dtype=np.float16)).sync_on(s)
    y = do.zeros(N, do.float16).sync_on(s)
    y2 = do.zeros(N, do.float16).sync_on(s)
    user = K.Kernel(
        _refs.KERNEL_SRC,
        _refs.KERNEL_NAME,
        params=(K.Out(do.float16), K.In(do.float16), do.float32, do.int64),
        block=(_refs.THREADS,),
    )
    g_builtin = K.scale(y.partition((_refs.THREADS,)), x, 0.5).graph()
    g_user = user(y2.partition((_refs.THREADS,)), x, 0.5, N).graph()
    ex_builtin = driver.CUgraphExec(g_builtin._exec.handle_int)
    ex_user = driver.CUgraphExec(g_user._exec.handle_int)
    clock = time.perf_counter_ns

    def timed(fn):
        def run() -> float:
            t = clock()
            fn()
            return (clock() - t) / 1e3

        return run

    fns = {
        "raw_ref": timed(lambda: (glaunch(ref_exec, rstream), sync(rstream))),
        "raw_builtin": timed(lambda: (glaunch(ex_builtin, dstream), sync(dstream))),
        "raw_builtin_rawst": timed(lambda: (glaunch(ex_builtin, rstream), sync(rstream))),
        "raw_userref": timed(lambda: (glaunch(ex_user, dstream), sync(dstream))),
        "dev_builtin": timed(lambda: g_builtin.launch().sync_on(s)),
        "dev_userref": timed(lambda: g_user.launch().sync_on(s)),
    }
    if a.graph_lib:
        fns["cuda_cpp"], _ = cpp_graph_replay(a.graph_lib, 1)
    warm_up(fns, 0.5)
    # each Python column's lambda adds a call; the same lambda around nothing is taken off
    empty = timed(lambda: None)
    timer_us = float(np.median([empty() for _ in range(2000)]))
    samples, _ = interleave(fns, a.reps, "shuffle", {"cuda_cpp": 0.0}, timer_us, 1)
    for t, name in ((y, "built-in"), (y2, "user kernel")):
        if not np.array_equal(t.numpy(), np.full(N, 0.75, np.float16)):
            raise AssertionError(f"the {name} graph produced wrong values")
    med = {k: float(np.median(v)) for k, v in samples.items()}
    doc = {
        "experiment": "graph_kernels",
        "machine": machine_info(),
        "reps": a.reps,
        "timer_us": timer_us,
        "us_median": med,
        "over_raw_ref": {
            k: float(np.median([u / r for u, r in zip(v, samples["raw_ref"])])) for k, v in samples.items()
        },
    }
    if "cuda_cpp" in samples:
        doc["over_cuda_cpp"] = {
            k: float(np.median([u / c for u, c in zip(v, samples["cuda_cpp"])])) for k, v in samples.items()
        }
    print(json.dumps(doc["us_median"]))
    print(json.dumps({k: round(v, 4) for k, v in doc.get("over_cuda_cpp", doc["over_raw_ref"]).items()}))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
