"""The bimodal GEMM queue with host think-time per item (paper Fig. 8c), S = 16 streams.

After each GEMM completes, W of host work: serial and threaded spin (they have no executor to
yield to); async spins in slices and yields to the loop between them (cooperative, against a
wall-clock deadline), so its 16 tasks overlap their GPU waits with one another's host work.
W from 0 to 3 ms. Throughput in GEMMs per ms, median over --reps.

    python benchmarks/bimodal_hostwork.py --out bimodal_hostwork.json --png bimodal_hostwork.png
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _harness import description
from bimodal import Workload, median_row, run_async, run_serial, run_threaded

SLICE = 50e-6  # async host work yields to the loop this often


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main(argv: list[str] | None = None) -> int:
    import anyio
    from exec_modes import machine_info

    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--items", type=int, default=400)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--w-ms", default="0,0.1,0.25,0.5,1,2,3")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--png", default=None)
    a = ap.parse_args(argv)
    S = a.streams
    w = Workload(a.items, S)
    run_threaded(w, S)
    run_async(w, S)
    # the full collection the imports' objects set off, made now rather than in a measured run
    # (as bimodal.py --gc does); the collector stays on
    gc.collect()
    rows = []
    for w_ms in [float(x) for x in a.w_ms.split(",")]:
        W = w_ms * 1e-3

        def think() -> None:
            spin(W)

        async def think_async(_r: object) -> None:
            end = time.perf_counter() + W
            while (left := end - time.perf_counter()) > 0:
                spin(min(SLICE, left))
                await anyio.lowlevel.checkpoint()

        hook = think if W else None
        ahook = think_async if W else None
        row = {
            "w_ms": w_ms,
            "serial": median_row([run_serial(w, hook) for _ in range(a.reps)]),
            "threaded": median_row([run_threaded(w, S, hook) for _ in range(a.reps)]),
            "async": median_row([run_async(w, S, ahook) for _ in range(a.reps)]),
        }
        row["async_over_threaded"] = row["async"]["wu_per_ms"] / row["threaded"]["wu_per_ms"]
        rows.append(row)
        print(
            f"W={w_ms:4.2f} ms: serial {row['serial']['wu_per_ms']:6.2f}  threaded {row['threaded']['wu_per_ms']:6.2f}  "
            f"async {row['async']['wu_per_ms']:6.2f} WU/ms  (async/threaded {row['async_over_threaded']:.2f})",
            file=sys.stderr,
        )
    worst = min(rows, key=lambda r: r["async_over_threaded"])
    doc = {
        "experiment": "bimodal_hostwork",
        "machine": machine_info(),
        "items": a.items,
        "streams": S,
        "rows": rows,
        "async_over_threaded_min": worst["async_over_threaded"],
        "async_over_threaded_max": max(r["async_over_threaded"] for r in rows),
    }
    print(f"async/threaded across W: {worst['async_over_threaded']:.2f} .. {doc['async_over_threaded_max']:.2f}")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(doc, fh, indent=1)
    if a.png:
        from plots import plot_hostwork

        plot_hostwork(doc, a.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
