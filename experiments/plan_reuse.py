"""A built-in call on fresh tensors of a known shape beside a call on the previous call's tensors.

A chain of N ``K.scale`` calls run by one ``sync``: "same" calls it on one (out, x) pair every
step; "fresh" cycles through --pool distinct pairs of the same shape and dtype (a service's
fresh buffers). Plans are keyed by layout, so both reuse one plan; the figure is the host cost
per call (process CPU time; wall time beside it), median over --reps after warm-up, and the
ratio fresh / same. Also the plan cache's hit and miss counts over the fresh run.

    python experiments/plan_reuse.py --out plan_reuse.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deviceop as do

K = do.kernels


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--size", type=int, default=2048)
    ap.add_argument("--pool", type=int, default=64)
    ap.add_argument("--reps", type=int, default=31)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    s = do.streams()[0]
    xs = [do.full(a.size, 1.0, do.float16).sync_on(s) for _ in range(a.pool)]
    ys = [do.zeros(a.size, do.float16).sync_on(s) for _ in range(a.pool)]
    pairs = [(y.partition((128,)), x) for x, y in zip(xs, ys)]

    def chain(fresh: bool) -> None:
        op = do.value(None)
        for i in range(a.n):
            p, x = pairs[i % a.pool] if fresh else pairs[0]
            op = op.then(lambda _, p=p, x=x: K.scale(p, x, 0.5))
        op.sync_on(s)

    def timed(fresh: bool) -> tuple[float, float]:
        c0, t0 = time.process_time(), time.perf_counter()
        chain(fresh)
        return (time.process_time() - c0) / a.n * 1e6, (time.perf_counter() - t0) / a.n * 1e6

    for _ in range(3):
        chain(False), chain(True)
    same, fresh = [], []
    for _ in range(a.reps):  # interleaved
        same.append(timed(False))
        fresh.append(timed(True))
    K.scale.plans.clear()
    chain(True)
    hits, misses = K.scale.plans.hits, K.scale.plans.misses
    doc = {
        "experiment": "plan_reuse",
        "n": a.n,
        "size": a.size,
        "pool": a.pool,
        "reps": a.reps,
        "same_cpu_us": statistics.median(c for c, _ in same),
        "fresh_cpu_us": statistics.median(c for c, _ in fresh),
        "same_wall_us": statistics.median(w for _, w in same),
        "fresh_wall_us": statistics.median(w for _, w in fresh),
        "fresh_over_same_cpu": statistics.median(f[0] / s_[0] for f, s_ in zip(fresh, same)),
        "fresh_over_same_wall": statistics.median(f[1] / s_[1] for f, s_ in zip(fresh, same)),
        "plan_hits_fresh_run": hits,
        "plan_misses_fresh_run": misses,
        "backend": do.backend_name(),
    }
    print(
        f"scale x{a.n}: same tensors {doc['same_cpu_us']:.2f} us CPU/call ({doc['same_wall_us']:.2f} wall), "
        f"fresh {doc['fresh_cpu_us']:.2f} ({doc['fresh_wall_us']:.2f} wall): fresh/same {doc['fresh_over_same_cpu']:.3f}x CPU, "
        f"{doc['fresh_over_same_wall']:.3f}x wall; plans over a fresh run: {hits} hits, {misses} misses"
    )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
