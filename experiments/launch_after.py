"""How long the host takes to enqueue a kernel, by how long the kernel runs (a diagnostic).

``await_cost.py --stages`` showed an await's enqueue taking longer for longer spin kernels. Here
the same spin kernel (``await_cost.py``'s, ``grid=(1,)``), for each length, is enqueued on an
idle stream and waited for with ``synchronize()``, ``--reps`` times: the host time of building
the op, of its enqueue (the core's ``start_sliced``, as ``await`` calls it) and of the wait; and
the same kernel through CuPy (``RawKernel``: its launch call and the wait); and, with no GPU
at all, a fixed piece of Python work after ``time.sleep`` of each length and after spinning
that long. Medians, µs.

    python experiments/launch_after.py --out launch_after.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from await_cost import LENGTHS, SPIN_SRC, spin_k

import deviceop as do
from deviceop._core._op import start_sliced


def deviceop_rows(ns_list: list[int], reps: int) -> dict:
    s = do.next_stream()
    out_t = do.zeros(1024, do.float32).sync_on(s)
    clock = time.perf_counter_ns
    res = {}
    for ns in ns_list:
        cols: dict[str, list[float]] = {"build": [], "enqueue": [], "wait": []}
        for r in range(reps + 3):
            t0 = clock()
            op = spin_k(out_t, ns, grid=(1,), block=(32,))
            t1 = clock()
            cx, _out, rest = start_sliced(op, s, "launch_after", 1.0)
            t2 = clock()
            s.synchronize()
            t3 = clock()
            assert rest is None
            cx.finish()
            if r >= 3:
                cols["build"].append((t1 - t0) / 1e3)
                cols["enqueue"].append((t2 - t1) / 1e3)
                cols["wait"].append((t3 - t2) / 1e3)
        res[ns] = {k: statistics.median(v) for k, v in cols.items()}
    return res


def cupy_rows(ns_list: list[int], reps: int) -> dict:
    import cupy as cp
    import numpy as np

    k = cp.RawKernel(SPIN_SRC, "spin")
    out = cp.zeros(1024, cp.float32)
    st = cp.cuda.Stream(non_blocking=True)
    clock = time.perf_counter_ns
    res = {}
    with st:
        for ns in ns_list:
            cols: dict[str, list[float]] = {"launch": [], "wait": []}
            for r in range(reps + 3):
                t0 = clock()
                k((1,), (32,), (out, np.int64(ns)))
                t1 = clock()
                st.synchronize()
                t2 = clock()
                if r >= 3:
                    cols["launch"].append((t1 - t0) / 1e3)
                    cols["wait"].append((t2 - t1) / 1e3)
            res[ns] = {k2: statistics.median(v) for k2, v in cols.items()}
    return res


def _work() -> int:
    s = 0
    for i in range(400):
        s += i * i
    return s


def python_rows(ns_list: list[int], reps: int) -> dict:
    clock = time.perf_counter_ns
    res = {}
    for ns in ns_list:
        cols: dict[str, list[float]] = {"after_sleep": [], "after_spin": []}
        for r in range(reps + 3):
            time.sleep(ns / 1e9)
            t0 = clock()
            _work()
            t1 = clock()
            t = clock()
            while clock() - t < ns:
                pass
            t2 = clock()
            _work()
            t3 = clock()
            if r >= 3:
                cols["after_sleep"].append((t1 - t0) / 1e3)
                cols["after_spin"].append((t3 - t2) / 1e3)
        res[ns] = {k: statistics.median(v) for k, v in cols.items()}
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    ns_list = [max(int(secs * 1e9), 1000) for _, secs in LENGTHS]
    doc = {"experiment": "launch_after", "deviceop": {}, "cupy": {}, "python": {}}
    for rnd in range(2):  # each library twice, in turn
        doc["deviceop"][rnd] = deviceop_rows(ns_list, a.reps)
        try:
            doc["cupy"][rnd] = cupy_rows(ns_list, a.reps)
        except ImportError:
            doc["cupy"][rnd] = None
        doc["python"][rnd] = python_rows(ns_list, a.reps)
        for ns in ns_list:
            d = doc["deviceop"][rnd][ns]
            c = doc["cupy"][rnd][ns] if doc["cupy"][rnd] else None
            print(
                f"round {rnd} spin {ns / 1e3:9.1f} us: deviceop build {d['build']:6.1f} enqueue {d['enqueue']:7.1f} "
                f"wait {d['wait']:9.1f}"
                + (f" | cupy launch {c['launch']:7.1f} wait {c['wait']:9.1f}" if c else "")
                + f" | python work after sleep {doc['python'][rnd][ns]['after_sleep']:6.1f} "
                f"after spin {doc['python'][rnd][ns]['after_spin']:6.1f}"
            )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
