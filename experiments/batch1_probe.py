"""Why the one-thread queue's ``batch=1`` runs at different speeds from one process to the next.

One process of the bimodal queue (``bimodal.py``'s GEMMs on ``--streams`` streams) records:

1. ``WorkQueue(batch=1)`` over ``--reps`` runs: work units per ms, the loop thread's CPU per
   item, polls per item, item latency (start to completion seen) p50 / p90, streams' busy
   fraction;
2. the same items without the queue: each enqueued (``op.submit``) on the streams in turn, no
   waiting, then every future's result: the enqueue's host time per item and the whole's work
   units per ms (what the GPU does with the queue's items when the host keeps ahead);
3. what could differ between processes: the lanes' stream handles, the GEMM replays (recorded,
   replayed, direct calls), the CPUs the threads last ran on, the hash seed, the environment's
   ``CUDA_DEVICE_MAX_CONNECTIONS``.

Run it in several fresh processes and compare (``experiments/gpu_suite.sh`` does not):

    for i in 1 2 3 4; do python experiments/batch1_probe.py --out probe_$i.json; done
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

from deviceop._core import _reactor
from deviceop._core._completion import stats as await_stats
from deviceop.executors import WorkQueue
from deviceop.executors._queue_stats import lanes_of
from deviceop.kernels._gemm import GEMM


def threads_cpus() -> dict[str, int]:
    """Per thread of this process: the CPU it last ran on (/proc's ``processor`` field)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[f"{name}:{tid}"] = int(fields[36])  # field 39 of stat; fields[0] is field 3
    return out


def queue_run(items: list, S: int) -> dict:
    import uvloop

    q = WorkQueue(streams=S, batch=1)
    a0 = await_stats()
    w0, c0 = time.perf_counter(), time.thread_time()
    res = uvloop.run(q.run(items))
    w1, c1 = time.perf_counter(), time.thread_time()
    a1 = await_stats()
    if any(not r.ok for r in res):
        raise SystemExit("queue items failed")
    st = q.stats()
    n = len(items)
    return {
        "wu_per_ms": n / (w1 - w0) / 1e3,
        "loop_cpu_us": 1e6 * (c1 - c0) / n,
        "polls_per_item": (a1["polls"] - a0["polls"]) / n,
        "latency_p50_us": st.latency_p50 * 1e6,
        "latency_p90_us": st.latency_p90 * 1e6,
        "busy_fraction_mean": statistics.fmean(st.busy_fraction),
    }


def submit_run(w: Workload, streams: list) -> dict:
    S = len(streams)
    t0 = time.perf_counter()
    futs = [w.factory[n](i % S).submit(stream=streams[i % S]) for i, n in enumerate(w.sizes)]
    t1 = time.perf_counter()
    for f in futs:
        f.result()
    t2 = time.perf_counter()
    n = len(w.sizes)
    return {"enqueue_us_per_item": 1e6 * (t1 - t0) / n, "wu_per_ms": n / (t2 - t0) / 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=2000)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    w = Workload(a.items, a.streams)
    items = w.items()
    lanes = lanes_of(a.streams)
    for _ in range(2):
        queue_run(items, a.streams)
        submit_run(w, lanes)
    gc.freeze()
    r0 = (GEMM.replays.recorded, GEMM.replays.replays)
    rows = [queue_run(items, a.streams) for _ in range(a.reps)]
    subs = [submit_run(w, lanes) for _ in range(a.reps)]
    r1 = (GEMM.replays.recorded, GEMM.replays.replays)
    doc = {
        "experiment": "batch1_probe",
        "pid": os.getpid(),
        "hashseed": os.environ.get("PYTHONHASHSEED"),
        "max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
        "lane_handles": [hex(s.handle_int) for s in lanes],
        "affinity": sorted(os.sched_getaffinity(0)),
        "threads_cpus": threads_cpus(),
        "replays": {
            "executables": len(GEMM.replays),
            "recorded_in_runs": r1[0] - r0[0],
            "replayed_in_runs": r1[1] - r0[1],
            "calls_in_runs": 2 * a.reps * a.items,
        },
        "queue_batch1": rows,
        "submit": subs,
        "reactor": _reactor.stats(),
    }
    q = statistics.median(r["wu_per_ms"] for r in rows)
    runs = ", ".join(f"{r['wu_per_ms']:.1f}" for r in rows)
    sb = statistics.median(r["wu_per_ms"] for r in subs)
    print(
        f"pid {doc['pid']}: batch=1 {q:.1f} WU/ms (runs {runs}), loop CPU "
        f"{statistics.median(r['loop_cpu_us'] for r in rows):.1f} µs/item, polls "
        f"{statistics.median(r['polls_per_item'] for r in rows):.2f}/item, latency p50 "
        f"{statistics.median(r['latency_p50_us'] for r in rows):.0f} µs; submit-all {sb:.1f} WU/ms "
        f"(enqueue {statistics.median(r['enqueue_us_per_item'] for r in subs):.1f} µs/item); replays "
        f"{doc['replays']['replayed_in_runs']}/{doc['replays']['calls_in_runs']}; lanes {doc['lane_handles']}"
    )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
