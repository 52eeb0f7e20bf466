"""Where the bimodal queue's one thread waits: the async queue of ``bimodal.py`` (2000 GEMMs,
one thread, uvloop) over S streams with the learned poll, always polling (``poll=1``) and always
parking (``poll=0``), with the time spent polling and parked and the batches' enqueue time.

A completion the polling task misses shows as a poll that runs to its budget, then a park that
lasts the parked re-check (20 ms): with ``poll=1`` one such miss costs a second.

    python experiments/queue_stalls.py --out queue_stalls.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import uvloop
from bimodal import Workload

from deviceop._core import _op
from deviceop.executors import WorkQueue, _await

_acc: dict[str, list[float]] = {}


def _count(name: str, t: float) -> None:
    e = _acc.setdefault(name, [0, 0.0])
    e[0] += 1
    e[1] += time.perf_counter() - t


def _timed(name: str, f: Any) -> Any:
    async def g(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return await f(*a, **k)
        finally:
            _count(name, t)

    return g


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    _await._park = _timed("parked", _await._park)
    _await._poll = _timed("polling", _await._poll)
    each = _op.Each._run

    class Each(_op.Each):  # the batch's enqueue, timed
        def _run(self, cx: Any) -> Any:
            t = time.perf_counter()
            try:
                return each(self, cx)
            finally:
                _count("enqueue", t)

    from deviceop.executors import _queue_stats

    _queue_stats.Each = Each
    streams = [int(s) for s in a.streams.split(",")]
    w = Workload(2000, max(streams))
    rows = []
    for S in streams:
        for poll in (None, 1.0, 0.0):
            for _ in range(a.reps):  # the last run is reported (the first records the GEMM replays)
                _acc.clear()
                q = WorkQueue(streams=S, batch=8, poll=poll)
                t, ct = time.perf_counter(), time.thread_time()
                uvloop.run(q.run(w.items()))
                dt, dct = time.perf_counter() - t, time.thread_time() - ct
            row = {
                "streams": S,
                "poll": poll,
                "wu_per_ms": 2000 / dt / 1e3,
                "wall_ms": dt * 1e3,
                "thread_cpu_ms": dct * 1e3,
            }
            row.update({f"{k}_calls": v[0] for k, v in _acc.items()})
            row.update({f"{k}_ms": v[1] * 1e3 for k, v in _acc.items()})
            rows.append(row)
            print(
                f"S={S:2} poll={poll}: {row['wu_per_ms']:6.1f} WU/ms  wall {dt * 1e3:6.1f} ms  thread CPU {dct * 1e3:6.1f} ms  "
                + "  ".join(f"{k} {v[0]} x, {v[1] * 1e3:.1f} ms" for k, v in _acc.items()),
                flush=True,
            )
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"experiment": "queue_stalls", "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
