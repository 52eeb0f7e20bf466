"""The bimodal GEMM queue (paper Fig. 8b), beside PyTorch, in one process.

2000 f16 GEMMs, 80% 512^3 and 20% 2048^3 interleaved (every fifth is large), drained:
  serial    one thread, one stream, sync per op                  (deviceop and PyTorch)
  threaded  S threads, a stream each (ThreadedQueue; PyTorch: sync per op)
  async     one thread (uvloop), S tasks, a stream each (WorkQueue)
deviceop's queues run with their default batching (a worker takes up to 8 items that are
already waiting and awaits them together) and again with batch=1 (one sync or await per item,
as the paper's loops do); batch=1 is also measured against a serial run made just before each
of its runs, the ratio taken pair by pair (``over_serial_paired``).
  ceiling   the same GEMMs captured into CUDA graphs (one per stream, its share of the items)
            and replayed on 1 and S streams: what the GPU does with no host in the way
for S in {1, 2, 4, 8, 16, 32}. Throughput in work units (GEMMs) per ms, median (and minimum) over
--reps runs after a warm-up run; process CPU time per work unit. The figure: the one-thread async
queue's minimum over the runs against the best ceiling measured in the same run. Inputs are shared (read only); each
stream writes its own outputs, so the access ledger never orders one stream after another.
After the warm-up the garbage collector is frozen (``gc.freeze()``; ``--gc`` leaves it on and
makes a full collection then, the one the imports' objects would otherwise set off in a measured
run; ``gc_full_before`` counts those made before it), and the host's speed is measured before
every run (``host_probe_us``); each run also records the CPU time the hypervisor took from the
machine meanwhile (``steal_ms``, all CPUs summed), how long the main thread waited runnable for
a CPU (``runq_wait_ms``), parked awaits (``parks``) and those that only their 20 ms re-check
ended (``late_wakeups``), the collector's pauses (``gc_pause_ms``) and full collections
(``gc_full``), and the GEMM replay tables' graph launches and recordings, of calls on their
own (``gemm_replays``, ``gemm_recorded``) and of a queue's batches that repeat, each one launch
for its calls (``gemm_batch_replays``, ``gemm_batch_recorded``).

    python benchmarks/bimodal.py --out bimodal.json --png bimodal.png
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import queue
import statistics
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _harness import description

import deviceop as do
from deviceop._core._completion import stats as await_stats
from deviceop.executors import ThreadedQueue, WorkQueue

K = do.kernels
SMALL, LARGE = 512, 2048


class Workload:
    """Shared inputs, per-lane outputs, and the item list (deviceop factories and sizes)."""

    def __init__(self, n_items: int, max_lanes: int) -> None:
        rng = np.random.default_rng(0)
        self.sizes = [LARGE if i % 5 == 4 else SMALL for i in range(n_items)]
        s0 = do.streams()[0]
        self.a = {
            n: do.from_numpy((rng.standard_normal((n, n)) / 16).astype(np.float16)).sync_on(s0) for n in (SMALL, LARGE)
        }
        self.b = {
            n: do.from_numpy((rng.standard_normal((n, n)) / 16).astype(np.float16)).sync_on(s0) for n in (SMALL, LARGE)
        }
        self.c = [{n: do.zeros((n, n), do.float16).sync_on(s0) for n in (SMALL, LARGE)} for _ in range(max_lanes)]
        a, b, c = self.a, self.b, self.c
        self.factory = {n: (lambda lane, n=n: K.gemm(c[lane][n], a[n], b[n])) for n in (SMALL, LARGE)}

    def items(self) -> list:
        return [self.factory[n] for n in self.sizes]


def run_serial(w: Workload, think=None) -> dict:
    s = do.streams()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    f = w.factory
    for n in w.sizes:
        f[n](0).sync_on(s)
        if think:
            think()
    return _row(len(w.sizes), time.perf_counter() - t0, time.process_time() - c0, 1)


def run_threaded(w: Workload, S: int, think=None, batch: int = 8) -> dict:
    q = ThreadedQueue(streams=S, on_done=(lambda r: think()) if think else None, batch=batch)
    res = q.run(w.items())
    _check(res)
    st = q.stats()
    return _row(len(res), st.seconds, st.cpu_s, st.host_threads)


#: the event loop the async queue runs in: "uvloop" (default) or "asyncio" (``--loop``)
LOOP = ["uvloop"]


def run_async(w: Workload, S: int, think_async=None, batch: int = 8) -> dict:
    q = WorkQueue(streams=S, on_done=think_async, batch=batch)
    if LOOP[0] == "uvloop":
        import uvloop

        res = uvloop.run(q.run(w.items()))
    else:
        res = asyncio.run(q.run(w.items()))
    _check(res)
    st = q.stats()
    return _row(len(res), st.seconds, st.cpu_s, st.host_threads)


class Ceiling:
    """The GEMMs of the queue as graph replays: per lane count S, a graph per lane holding its
    share of the items (round robin), replayed concurrently on S streams."""

    def __init__(self, w: Workload) -> None:
        self.w = w
        self.graphs: dict[int, list] = {}

    def _graphs(self, S: int) -> list:
        if S not in self.graphs:
            from deviceop.executors._queue_stats import lanes_of

            lanes = lanes_of(S)
            gs = []
            for lane, st in enumerate(lanes):
                with do.graph.scope(stream=st) as sc:
                    for i, n in enumerate(self.w.sizes):
                        if i % S == lane:
                            sc.record(self.w.factory[n](lane))
                gs.append((sc.graph, st))
            self.graphs[S] = gs
        return self.graphs[S]

    def run(self, S: int) -> dict:
        gs = self._graphs(S)
        t0, c0 = time.perf_counter(), time.process_time()
        futs = [g.launch().submit(stream=st) for g, st in gs]
        for f in futs:
            f.result()
        return _row(len(self.w.sizes), time.perf_counter() - t0, time.process_time() - c0, 1)


def _check(res: list) -> None:
    bad = [r for r in res if not r.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} queue items failed; first: {bad[0].error!r}")


def _row(items: int, secs: float, cpu: float, threads: int) -> dict:
    return {
        "wu_per_ms": items / secs / 1e3,
        "seconds": secs,
        "cpu_us_per_wu": cpu / items * 1e6,
        "host_threads": threads,
    }


class TorchWorkload:
    """The same queue in PyTorch: torch.matmul(out=) per item, stream.synchronize() per item."""

    def __init__(self, w: Workload, max_lanes: int) -> None:
        import torch

        self.torch = torch
        self.sizes = w.sizes
        self.a = {n: torch.from_dlpack(w.a[n]) for n in w.a}
        self.b = {n: torch.from_dlpack(w.b[n]) for n in w.b}
        self.c = [
            {n: torch.empty((n, n), dtype=torch.float16, device="cuda") for n in (SMALL, LARGE)}
            for _ in range(max_lanes)
        ]
        self.streams = [torch.cuda.Stream() for _ in range(max_lanes)]

    def serial(self, think=None) -> dict:
        torch = self.torch
        s = self.streams[0]
        a, b, c = self.a, self.b, self.c[0]
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.cuda.stream(s):
            for n in self.sizes:
                torch.matmul(a[n], b[n], out=c[n])
                s.synchronize()
                if think:
                    think()
        return _row(len(self.sizes), time.perf_counter() - t0, time.process_time() - c0, 1)

    def threaded(self, S: int, think=None) -> dict:
        torch = self.torch
        q: queue.Queue[int | None] = queue.Queue()
        for n in self.sizes:
            q.put(n)
        for _ in range(S):
            q.put(None)
        a, b = self.a, self.b

        def worker(lane: int) -> None:
            s, c = self.streams[lane], self.c[lane]
            with torch.cuda.stream(s):
                while (n := q.get()) is not None:
                    torch.matmul(a[n], b[n], out=c[n])
                    s.synchronize()
                    if think:
                        think()

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(S)]
        t0, c0 = time.perf_counter(), time.process_time()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return _row(len(self.sizes), time.perf_counter() - t0, time.process_time() - c0, S)


def sched_counters() -> tuple[float, float]:
    """(seconds of CPU time the hypervisor took from this machine's CPUs, all summed; seconds
    this thread waited runnable for a CPU) so far, from /proc (0, 0 where there is none)."""
    steal = wait = 0.0
    try:
        with open("/proc/stat") as f:
            cpu = f.readline().split()  # the summed line: user nice system idle iowait irq softirq steal
        steal = int(cpu[8]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/thread-self/schedstat") as f:
            wait = int(f.read().split()[1]) * 1e-9
    except (OSError, IndexError, ValueError):
        pass
    return steal, wait


def replay_counts() -> tuple[int, int, int, int]:
    """The GEMM replay tables' graph launches and recordings so far: of calls on their own, and
    of batches of calls (a queue's batch that repeats)."""
    from deviceop.kernels._gemm import GEMM

    b = GEMM.batch_replays  # (None where batches run call by call; an empty table is falsy)
    if b is None:
        return GEMM.replays.replays, GEMM.replays.recorded, 0, 0
    return GEMM.replays.replays, GEMM.replays.recorded, b.replays, b.recorded


def median_row(rows: list[dict]) -> dict:
    best = sorted(rows, key=lambda r: r["wu_per_ms"])[len(rows) // 2]
    return dict(
        best,
        runs=[r["wu_per_ms"] for r in rows],
        min_wu_per_ms=min(r["wu_per_ms"] for r in rows),
        host_probe_us=[r.get("host_probe_us") for r in rows],
        steal_ms=[r.get("steal_ms") for r in rows],
        runq_wait_ms=[r.get("runq_wait_ms") for r in rows],
        late_wakeups=[r.get("late_wakeups") for r in rows],
        parks=[r.get("parks") for r in rows],
        gc_pause_ms=[r.get("gc_pause_ms") for r in rows],
        gc_full=[r.get("gc_full") for r in rows],
        gemm_replays=[r.get("gemm_replays") for r in rows],
        gemm_recorded=[r.get("gemm_recorded") for r in rows],
        gemm_batch_replays=[r.get("gemm_batch_replays") for r in rows],
        gemm_batch_recorded=[r.get("gemm_batch_recorded") for r in rows],
    )


class GcPauses:
    """The garbage collector's pauses while it is installed (``gc.callbacks``): their total in
    ms and the count of full (oldest-generation) collections, so that a run slower than its
    neighbours says whether a collection stopped its thread."""

    def __init__(self) -> None:
        self.ms = 0.0
        self.full = 0
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.ms += (time.perf_counter() - self._t0) * 1e3
            self.full += info.get("generation") == 2

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def main(argv: list[str] | None = None) -> int:
    from exec_modes import host_probe, machine_info

    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--items", type=int, default=2000)
    ap.add_argument("--streams", default="1,2,4,8,16,32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument(
        "--gc",
        action="store_true",
        help="keep the garbage collector on, with one full collection after the warm-up (default: freeze it then)",
    )
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop", help="the async queue's event loop")
    ap.add_argument("--out", default=None)
    ap.add_argument("--png", default=None)
    a = ap.parse_args(argv)
    LOOP[0] = a.loop
    S_list = [int(x) for x in a.streams.split(",")]
    w = Workload(a.items, max(S_list))
    tw = None if a.no_torch else TorchWorkload(w, max(S_list))
    # warm-up: cuBLAS handles and heuristics per stream, uvloop, threads
    warm = Workload.__new__(Workload)
    warm.__dict__.update(w.__dict__, sizes=w.sizes[:200])
    run_serial(warm)
    for S in S_list:
        run_threaded(warm, S)
        run_async(warm, S)
        run_async(warm, S, batch=1)
    if tw is not None:
        tw.serial()
        tw.threaded(max(S_list))
    ceiling = Ceiling(w)
    for S in sorted({1, *S_list}):
        ceiling.run(S)
    full_before = None
    if not a.gc:
        # what exists now lives to the end: as a latency-bound program does (docs/concepts/
        # queues.md), the collector no longer traverses it; a full collection with PyTorch
        # imported stops the one thread for tens of milliseconds, in any variant
        gc.freeze()
    else:
        # the collector stays on. The objects the imports made (PyTorch's above all) set off a
        # full collection once enough of them have been promoted, walking all of them (tens of
        # milliseconds); left to the runs it fell in one run of the one-thread queue, at the
        # same place in every process, and that run measured it. It is made now instead: the
        # runs after it promote too few objects to set off another (gc_full shows any that do).
        # A program that keeps the collector on pays such pauses too (docs/concepts/queues.md
        # says to freeze it); the figure is the queue's, not that pause's
        full_before = gc.get_stats()[-1]["collections"]
        gc.collect()

    def rep(fn, *args) -> dict:
        # the host's speed just before each run: the one-thread queues are bound by it; and
        # what took the CPU from the run: the hypervisor (steal), other runnable threads
        # (this thread's run-queue wait), parked awaits (and those only their re-check ended),
        # the garbage collector; and the GEMM replay tables' graph launches and recordings, which
        # say whether the run's GEMMs (or its batches) were replayed
        rows = []
        for _ in range(a.reps):
            probe = host_probe()
            s0, w0, t0 = sched_counters(), await_stats(), replay_counts()
            with GcPauses() as pauses:
                row = fn(*args)
            s1, w1, t1 = sched_counters(), await_stats(), replay_counts()
            rows.append(
                dict(
                    row,
                    host_probe_us=probe,
                    steal_ms=(s1[0] - s0[0]) * 1e3,
                    runq_wait_ms=(s1[1] - s0[1]) * 1e3,
                    late_wakeups=w1["late"] - w0["late"],
                    parks=w1["parks"] - w0["parks"],
                    gc_pause_ms=pauses.ms,
                    gc_full=pauses.full,
                    gemm_replays=t1[0] - t0[0],
                    gemm_recorded=t1[1] - t0[1],
                    gemm_batch_replays=t1[2] - t0[2],
                    gemm_batch_recorded=t1[3] - t0[3],
                )
            )
        return median_row(rows)

    doc: dict = {
        "experiment": "bimodal",
        "machine": machine_info(),
        "items": a.items,
        "mix": "80% 512^3, 20% 2048^3 f16, every fifth large",
        "reps": a.reps,
        "gc_frozen": not a.gc,
        # --gc: one full collection made after the warm-up (the full ones before it, counted)
        "gc": None if not a.gc else {"collected_after_warmup": True, "gc_full_before": full_before},
        "rows": [],
    }
    doc["ceiling"] = {S: rep(ceiling.run, S) for S in sorted({1, *S_list})}
    ceil_best = max(r["wu_per_ms"] for r in doc["ceiling"].values())
    doc["ceiling_best_wu_per_ms"] = ceil_best
    print(
        "ceiling (graph replays): "
        + "  ".join(f"S={S} {r['wu_per_ms']:.1f}" for S, r in doc["ceiling"].items())
        + " WU/ms",
        file=sys.stderr,
    )
    serial = rep(run_serial, w)
    doc["serial"] = serial
    print(f"deviceop serial: {serial['wu_per_ms']:.1f} WU/ms", file=sys.stderr)
    if tw is not None:
        doc["torch_serial"] = rep(tw.serial)
        print(f"torch serial:    {doc['torch_serial']['wu_per_ms']:.1f} WU/ms", file=sys.stderr)
    for S in S_list:
        row = {
            "streams": S,
            "threaded": rep(run_threaded, w, S),
            "async": rep(run_async, w, S),
            "threaded_batch1": rep(run_threaded, w, S, None, 1),
            "async_batch1": rep(run_async, w, S, None, 1),
        }
        # batch=1 against serial, paired: a serial run just before each batch=1 run, the ratio
        # per pair (the host's speed moves within seconds; a ratio of runs far apart measures it)
        pairs = []
        for _ in range(a.reps):
            s_row = run_serial(w)
            b_row = run_async(w, S, None, 1)
            pairs.append(b_row["wu_per_ms"] / s_row["wu_per_ms"])
        row["async_batch1"]["over_serial_paired"] = statistics.median(pairs)
        row["async_batch1"]["over_serial_paired_min_max"] = [min(pairs), max(pairs)]
        if tw is not None:
            row["torch_threaded"] = rep(tw.threaded, S)
        doc["rows"].append(row)
        print(
            f"S={S:2d}: threaded {row['threaded']['wu_per_ms']:6.1f}  async {row['async']['wu_per_ms']:6.1f}  "
            f"(batch=1: threaded {row['threaded_batch1']['wu_per_ms']:6.1f}  async {row['async_batch1']['wu_per_ms']:6.1f})"
            + (f"  torch threaded {row['torch_threaded']['wu_per_ms']:6.1f}" if tw else "")
            + " WU/ms",
            file=sys.stderr,
        )
    best = max(doc["rows"], key=lambda r: r["async"]["min_wu_per_ms"])
    b1 = max(doc["rows"], key=lambda r: r["async_batch1"]["wu_per_ms"])
    doc["async_best"] = {
        "streams": best["streams"],
        "wu_per_ms": best["async"]["wu_per_ms"],
        "min_wu_per_ms": best["async"]["min_wu_per_ms"],
        "min_over_ceiling": best["async"]["min_wu_per_ms"] / ceil_best,
        "over_serial": best["async"]["wu_per_ms"] / serial["wu_per_ms"],
    }
    p1 = max(doc["rows"], key=lambda r: r["async_batch1"]["over_serial_paired"])
    doc["async_batch1_best"] = {
        "streams": b1["streams"],
        "wu_per_ms": b1["async_batch1"]["wu_per_ms"],
        "over_serial": b1["async_batch1"]["wu_per_ms"] / serial["wu_per_ms"],
        "paired_streams": p1["streams"],
        "over_serial_paired": p1["async_batch1"]["over_serial_paired"],
        "over_serial_paired_min_max": p1["async_batch1"]["over_serial_paired_min_max"],
    }
    if tw is not None:
        tb = max(r["torch_threaded"]["wu_per_ms"] for r in doc["rows"])
        doc["async_batch1_best"]["over_torch_threaded_best"] = doc["async_batch1_best"]["wu_per_ms"] / tb
        doc["torch_threaded_best_wu_per_ms"] = tb
    s16 = next((r for r in doc["rows"] if r["streams"] == 16), None)
    if s16:
        doc["cpu_us_per_wu_s16"] = {
            "async": s16["async"]["cpu_us_per_wu"],
            "threaded": s16["threaded"]["cpu_us_per_wu"],
            "async_threads": 1,
            "threaded_threads": 16,
        }
    print(
        f"async best: {best['async']['wu_per_ms']:.1f} WU/ms at S={best['streams']} (min of runs "
        f"{best['async']['min_wu_per_ms']:.1f} = {doc['async_best']['min_over_ceiling']:.1%} of the ceiling {ceil_best:.1f}; "
        f"{doc['async_best']['over_serial']:.2f}x deviceop serial)"
    )
    print(
        f"async batch=1 best: {b1['async_batch1']['wu_per_ms']:.1f} WU/ms at S={b1['streams']} "
        f"({doc['async_batch1_best']['over_serial']:.2f}x deviceop serial; paired with a serial run each: "
        f"{doc['async_batch1_best']['over_serial_paired']:.2f}x at S={doc['async_batch1_best']['paired_streams']}"
        + (f", {doc['async_batch1_best']['over_torch_threaded_best']:.2f}x torch thread-per-stream best" if tw else "")
        + ")"
    )
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(doc, fh, indent=1)
    if a.png:
        from plots import plot_bimodal

        plot_bimodal(doc, a.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
