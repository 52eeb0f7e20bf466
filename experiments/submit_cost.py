"""What ``op.submit()`` costs the submitting thread, beside ``sync_on`` of the same op.

A thread submits ``--items`` ops on ``--streams`` streams in turn (the bimodal queue's GEMMs,
or a 4096-element f16 ``scale`` kernel), then waits for every future: µs per submission (wall
and the thread's CPU), items per ms to the last completion; then the same ops with
``sync_on`` one after another. Medians over ``--reps`` after a warm-up.

    python experiments/submit_cost.py --out submit_cost.json
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

import deviceop as do
from deviceop.executors._queue_stats import lanes_of

K = do.kernels


def factories(kind: str, lanes: list) -> list:
    """One op factory per item: ``f(lane)``."""
    if kind == "gemm":
        from bimodal import Workload

        return Workload(2000, len(lanes)).items()
    xs = [do.full(4096, 1.0, do.float16).sync_on(s) for s in lanes]
    ys = [do.zeros(4096, do.float16).sync_on(s) for s in lanes]
    return [lambda lane: K.scale(ys[lane].partition((1024,)), xs[lane], 0.5)] * 2000


def submit_run(items: list, lanes: list) -> dict:
    n, S = len(items), len(lanes)
    t0, c0 = time.perf_counter(), time.thread_time()
    futs = [f(i % S).submit(stream=lanes[i % S]) for i, f in enumerate(items)]
    t1, c1 = time.perf_counter(), time.thread_time()
    for f in futs:
        f.result()
    t2 = time.perf_counter()
    return {"submit_us": 1e6 * (t1 - t0) / n, "submit_cpu_us": 1e6 * (c1 - c0) / n, "items_per_ms": n / (t2 - t0) / 1e3}


def sync_run(items: list, lanes: list) -> dict:
    n, S = len(items), len(lanes)
    t0 = time.perf_counter()
    for i, f in enumerate(items):
        f(i % S).sync_on(lanes[i % S])
    return {"sync_on_us": 1e6 * (time.perf_counter() - t0) / n}


def median_of(rows: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="scale,gemm")
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows = []
    for kind in a.kinds.split(","):
        for S in [int(v) for v in a.streams.split(",")]:
            lanes = lanes_of(S)
            items = factories(kind, lanes)
            submit_run(items, lanes)  # warm-up: plans, pools, the watchers' threads
            sync_run(items, lanes)
            sub = median_of([submit_run(items, lanes) for _ in range(a.reps)])
            syn = median_of([sync_run(items, lanes) for _ in range(a.reps)])
            rows.append({"kind": kind, "streams": S, "submit": sub, "sync_on": syn})
            print(
                f"{kind:5s} S={S:2d}: submit {sub['submit_us']:6.2f} µs (thread CPU {sub['submit_cpu_us']:6.2f}), "
                f"{sub['items_per_ms']:6.1f} items/ms to the last completion; sync_on {syn['sync_on_us']:6.2f} µs"
            )
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"experiment": "submit_cost", "items": 2000, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
