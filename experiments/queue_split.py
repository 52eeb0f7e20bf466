"""Where an item of the one-thread work queue spends host time, part by part, on the GPU.

The bimodal queue's items (``bimodal.py``: f16 GEMMs, 80 % 512^3 and 20 % 2048^3) and the same
number of items whose op enqueues nothing (``do.external`` naming the same tensors, ``fn``
empty), each way:

1. Parts, one item at a time on ``--streams`` streams in turn (no event loop): building the op
   (the item's factory), its enqueue (the core's ``start_sliced``, as ``await`` calls it),
   arming its completion slot, and retiring the slot and finishing the execution after the
   flag was seen; and ``op.sync_on(stream)`` per item. Medians over the items, µs.
2. ``WorkQueue`` (uvloop, ``--streams`` streams) with ``batch=1`` and the default batching:
   wall time per item, the loop thread's CPU time per item (``time.thread_time``) and the
   process's (every thread: the completion reactor's scanner too), medians over ``--reps``;
   and per item the awaits, their polls (yields to the loop while looking for completion) and
   parks (waits for the reactor's wake-up).

    python experiments/queue_split.py --out queue_split.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bimodal import Workload

import deviceop as do
from deviceop._core import _reactor
from deviceop._core._base import Channel
from deviceop._core._completion import stats as await_stats
from deviceop._core._op import start_sliced
from deviceop.executors import WorkQueue


def _noop(*_: object) -> None:
    pass


def factories(w: Workload, kind: str) -> list:
    if kind == "gemm":
        return w.items()
    a, b, c = w.a, w.b, w.c
    f = {n: (lambda lane, n=n: do.external(_noop, reads=(a[n], b[n]), writes=(c[lane][n],))) for n in a}
    return [f[n] for n in w.sizes]


def _arm(s: object, ch: Channel, tok: int) -> int:
    try:
        return int(_reactor.arm(s, ch, tok, False))  # as await arms it (it polls first)
    except TypeError:  # a library from before unwatched slots (A/B runs)
        return int(_reactor.arm(s, ch, tok))


def parts(items: list, streams: list) -> dict:
    ns = time.perf_counter_ns
    ch = Channel()
    cols: dict[str, list[float]] = {k: [] for k in ("build", "enqueue", "arm", "retire_finish", "sync_on")}
    for i, f in enumerate(items):
        lane = i % len(streams)
        s = streams[lane]
        t0 = ns()
        op = f(lane)
        t1 = ns()
        cx, _out, _rest = start_sliced(op, s, "await", 0.5e-3)
        t2 = ns()
        h = _arm(s, ch, i + 1)
        t3 = ns()
        while not _reactor.done(h):
            pass
        t4 = ns()
        if not _reactor.retire(h, True):
            _reactor.disown(h)
        cx.finish()
        t5 = ns()
        cols["build"].append((t1 - t0) / 1e3)
        cols["enqueue"].append((t2 - t1) / 1e3)
        cols["arm"].append((t3 - t2) / 1e3)
        cols["retire_finish"].append((t5 - t4) / 1e3)
    ch.drain()
    for i, f in enumerate(items):
        lane = i % len(streams)
        op = f(lane)
        t0 = ns()
        op.sync_on(streams[lane])
        cols["sync_on"].append((ns() - t0) / 1e3)
    return {k: statistics.median(v) for k, v in cols.items()}


def queue(items: list, S: int, batch: int) -> dict:
    import uvloop

    q = WorkQueue(streams=S, batch=batch)
    a0 = await_stats()
    w0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
    res = uvloop.run(q.run(items))
    w1, c1, p1 = time.perf_counter(), time.thread_time(), time.process_time()
    a1 = await_stats()
    bad = [r for r in res if not r.ok]
    if bad:
        raise SystemExit(f"{len(bad)} items failed: {bad[0].error!r}")
    n = len(items)
    per = {f"{k}_per_item": (a1[k] - a0[k]) / n for k in ("awaits", "polls", "parks")}
    return {
        "wall_us": 1e6 * (w1 - w0) / n,
        "loop_cpu_us": 1e6 * (c1 - c0) / n,
        "process_cpu_us": 1e6 * (p1 - p0) / n,
        **per,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=2000)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kinds", default="noop,gemm", help="comma-separated: noop, gemm")
    ap.add_argument("--batches", default="1,8", help="comma-separated WorkQueue batch sizes")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    w = Workload(a.items, a.streams)
    streams = list(do.streams())[: a.streams]
    doc: dict = {"experiment": "queue_split", "items": a.items, "streams": a.streams, "parts_us": {}, "queue": {}}
    for kind in a.kinds.split(","):
        items = factories(w, kind)
        parts(items, streams)  # warm-up: plans, graphs of repeated GEMMs, pools
        doc["parts_us"][kind] = parts(items, streams)
        for batch in [int(b) for b in a.batches.split(",")]:
            queue(items, a.streams, batch)
            gc.freeze()
            rows = [queue(items, a.streams, batch) for _ in range(a.reps)]
            doc["queue"][f"{kind}_batch{batch}"] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            doc["queue"][f"{kind}_batch{batch}"]["runs"] = rows
    doc["reactor"] = _reactor.stats()
    for kind, p in doc["parts_us"].items():
        print(kind, " ".join(f"{k} {v:.2f}" for k, v in p.items()))
    for k, v in doc["queue"].items():
        print(
            f"{k:<14} wall {v['wall_us']:.2f} µs/item  loop CPU {v['loop_cpu_us']:.2f}  process CPU "
            f"{v['process_cpu_us']:.2f}  per item: awaits {v['awaits_per_item']:.2f} polls {v['polls_per_item']:.2f} "
            f"parks {v['parks_per_item']:.2f}"
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
