"""How fast each CPU of this machine runs the same Python work, pinned to it in turn.

On virtual machines some virtual CPUs run a thread slower than others for as long as the
thread stays there (another tenant on the physical core's other hardware thread): a process
whose event loop lands on one runs its host work slower from start to end. Each CPU runs a
fixed pure-Python loop ``--reps`` times; the median µs per loop, per CPU, and the slowest over
the fastest.

    python benchmarks/cpu_speed.py --out cpu_speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from _harness import description


def work(n: int = 20000) -> int:
    """Dictionary, attribute and call traffic, as an interpreter's host path has."""
    d: dict[int, int] = {}
    s = 0
    for i in range(n):
        d[i & 255] = i
        s += d.get((i * 7) & 255, 0) & 3
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    per: dict[int, float] = {}
    for _ in range(2):  # the second pass is the one kept: the first warms every CPU's caches
        for c in cpus:
            os.sched_setaffinity(0, {c})
            work()
            ts = []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                work()
                ts.append((time.perf_counter() - t0) * 1e6)
            per[c] = statistics.median(ts)
    os.sched_setaffinity(0, set(cpus))
    fast, slow = min(per.values()), max(per.values())
    for c, us in per.items():
        print(f"cpu {c:3d}: {us:8.1f} µs  ({us / fast:.2f}x the fastest)")
    print(f"slowest / fastest: {slow / fast:.2f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"experiment": "cpu_speed", "us_per_loop": per, "slowest_over_fastest": slow / fast}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
