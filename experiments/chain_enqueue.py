"""How long a 300-kernel chain takes to enqueue, by the kernels' size (a diagnostic of async_overlap.py's E).

``async_overlap.py``'s pipeline (300 ``scale`` kernels chained with ``then``) over ``--elems``
f16 elements: the host time of building the op and of enqueuing it (the core's ``start``, as
``submit`` and ``sync_on`` call it), and of ``submit()`` itself, per kernel; then the wait.
Medians, µs per kernel.

    python experiments/chain_enqueue.py --sizes 2048,1048576,67108864
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
from deviceop._core._op import start

K = do.kernels
N = 300


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2048,1048576,67108864")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    s = do.next_stream()
    res = []
    for n in [int(v) for v in a.sizes.split(",")]:
        x = do.full(n, 1.0, do.float16).sync_on(s)
        y = do.zeros(n, do.float16).sync_on(s)
        yp = y.partition((min(n, 4096),))

        def step(o: tuple) -> do.DeviceOp:
            return K.scale(*o)

        def pipeline() -> do.DeviceOp:
            op = K.scale(yp, x, 0.5)
            for _ in range(N - 1):
                op = op.then(step)
            return op

        cols: dict[str, list[float]] = {"build": [], "enqueue": [], "wait": [], "submit": []}
        for r in range(a.reps + 2):
            t0 = time.perf_counter()
            op = pipeline()
            t1 = time.perf_counter()
            op._take("diag")
            cx, _ = start(op, s, "diag")
            t2 = time.perf_counter()
            s.synchronize()
            t3 = time.perf_counter()
            cx.finish()
            op = pipeline()
            t4 = time.perf_counter()
            fut = op.submit(s)
            t5 = time.perf_counter()
            fut.result()
            if r >= 2:
                cols["build"].append((t1 - t0) / N * 1e6)
                cols["enqueue"].append((t2 - t1) / N * 1e6)
                cols["wait"].append((t3 - t2) * 1e6)
                cols["submit"].append((t5 - t4) / N * 1e6)
        row = {"elems": n, **{k: statistics.median(v) for k, v in cols.items()}}
        res.append(row)
        print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
