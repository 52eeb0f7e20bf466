"""A work queue of mixed-size GEMMs drained by one host thread over a pool of streams.

The jobs: ``--items`` float16 GEMMs ``c = a @ b``, most of them ``--small``^3 and every
``--large-every``-th one ``--large``^3 (the bimodal mix of the paper), each reading one of a few
input pairs resident on the device. One thread runs an event loop (uvloop where installed) and
a ``WorkQueue`` over ``--streams`` streams. Every job writes a buffer of its own (from the memory
pool), so lanes never wait for each other and a result stays valid while the job's result is
held. The first pass checks a sample of the results against numpy in ``on_done`` (while the
other lanes keep the GPU busy) and warms up; the timed passes follow, and then the same jobs
one at a time on one stream (one ``sync`` per GEMM, as a plain loop does).

    python examples/gemm_queue/run.py
    python examples/gemm_queue/run.py --items 200 --small 64 --large 128 --streams 4   # small

Without a GPU (the host backend) the defaults are that small configuration, so the command
finishes in seconds; what it prints there shows the program works, not what a GPU does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import numpy as np

import deviceop as do
from deviceop.executors import WorkQueue

K = do.kernels


class Jobs:
    """Device-resident inputs and the job list."""

    def __init__(self, a: argparse.Namespace) -> None:
        rng = np.random.default_rng(0)
        self.sizes = [a.large if i % a.large_every == a.large_every - 1 else a.small for i in range(a.items)]
        self.pairs = 3
        self.host: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self.want: dict[tuple[int, int], np.ndarray] = {}  # numpy's results, made once
        self.dev: dict[tuple[int, int], tuple[do.Tensor, do.Tensor]] = {}
        for n in {a.small, a.large}:
            for p in range(self.pairs):
                x, y = ((rng.standard_normal((n, n)) / np.sqrt(n)).astype(np.float16) for _ in range(2))
                self.host[n, p] = (x, y)
                self.want[n, p] = x.astype(np.float32) @ y.astype(np.float32)
                self.dev[n, p] = (do.from_numpy(x).sync(), do.from_numpy(y).sync())
        self.check_every = max(1, a.items // a.check) if a.check else 0

    def item(self, i: int) -> Any:
        """Job ``i`` as an op: its output is ``(i, c)``, ``c`` a new tensor."""
        n = self.sizes[i]
        x, y = self.dev[n, i % self.pairs]
        return do.empty((n, n), do.float16).then(lambda c: K.gemm(c, x, y)).map(lambda r: (i, r[0]))

    def expected(self, i: int) -> np.ndarray:
        return self.want[self.sizes[i], i % self.pairs]


def flops(sizes: list[int]) -> float:
    return float(sum(2 * n**3 for n in sizes))


async def drain(jobs: Jobs, a: argparse.Namespace, check: bool) -> dict[str, Any]:
    """The queue: one thread, ``--streams`` lanes; with ``check``, a sample of the results is
    compared with numpy's as they complete."""
    worst = 0.0

    async def on_done(res: Any) -> None:
        nonlocal worst
        if not res.ok:
            return
        i, c = res.value
        if i % jobs.check_every == 0:
            got = (await do.to_numpy(c)).astype(np.float32)
            ref = jobs.expected(i)
            worst = max(worst, float(np.max(np.abs(got - ref)) / (np.max(np.abs(ref)) + 1e-6)))

    q = WorkQueue(
        streams=a.streams, batch=a.batch, poll=a.poll, on_done=on_done if check and jobs.check_every else None
    )
    results = await q.run(jobs.item(i) for i in range(len(jobs.sizes)))
    failed = [r for r in results if not r.ok]
    if failed:
        raise SystemExit(f"{len(failed)} jobs failed; the first: {failed[0].error!r}")
    st = q.stats()
    return {
        "seconds": st.seconds,
        "gemms_per_ms": st.items / st.seconds / 1e3,
        "tflops": flops(jobs.sizes) / st.seconds / 1e12,
        "latency_ms_p50": st.latency_p50 * 1e3,
        "latency_ms_p99": st.latency_p99 * 1e3,
        "cpu_us_per_gemm": st.cpu_s / st.items * 1e6,
        "busy_fraction": [round(b, 3) for b in st.busy_fraction],
        "checked": len(range(0, len(jobs.sizes), jobs.check_every)) if check and jobs.check_every else 0,
        "max_rel_err": worst,
    }


def _flops(tflops: float) -> str:
    """A rate as printed: TFLOP/s, or GFLOP/s below a tenth of one (the host backend's small GEMMs)."""
    return f"{tflops:.1f} TFLOP/s" if tflops >= 0.1 else f"{tflops * 1e3:.2f} GFLOP/s"


def one_at_a_time(jobs: Jobs) -> dict[str, Any]:
    """The plain loop: each GEMM synced before the next, on one stream."""
    t0, c0 = time.perf_counter(), time.process_time()
    make = [jobs.item(i) for i in range(len(jobs.sizes))]
    for op in make:
        op.sync()
    secs = time.perf_counter() - t0
    return {
        "seconds": secs,
        "gemms_per_ms": len(make) / secs / 1e3,
        "tflops": flops(jobs.sizes) / secs / 1e12,
        "cpu_us_per_gemm": (time.process_time() - c0) / len(make) * 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=" ".join((__doc__ or "").split("\n\n")[0].replace("``", "").split()))
    gpu = do.backend_name() == "cuda"
    # on the host backend (no GPU) a small configuration: numpy GEMMs of 2048^3 take seconds each
    ap.add_argument("--items", type=int, default=2000 if gpu else 200)
    ap.add_argument("--small", type=int, default=512 if gpu else 64)
    ap.add_argument("--large", type=int, default=2048 if gpu else 128)
    ap.add_argument("--large-every", type=int, default=5)
    ap.add_argument("--streams", type=int, default=0, help="lanes (0: every stream of the pool)")
    ap.add_argument("--batch", type=int, default=8, help="items a lane takes at once (WorkQueue batch)")
    ap.add_argument("--poll", type=float, default=None, help="seconds a lane polls before it parks (default: learned)")
    ap.add_argument("--check", type=int, default=20, help="results checked against numpy (0: none)")
    ap.add_argument(
        "--repeats", type=int, default=3 if gpu else 1, help="runs of each after a warm-up; the best is printed"
    )
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    a.streams = a.streams or len(do.streams())
    for name in ("items", "small", "large", "large_every", "streams", "repeats"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if a.streams > len(do.streams()):
        ap.error(f"--streams {a.streams}: the pool has {len(do.streams())} streams (DEVICEOP_STREAMS sets its size)")

    if not gpu:
        print(
            f"no GPU: the {do.backend_name()} backend (an emulated device) runs a small configuration "
            f"(--items {a.items} --small {a.small} --large {a.large} --repeats {a.repeats}); its figures show "
            "that the program works, not what a GPU does",
            flush=True,
        )
    print(f"making {a.items} jobs and their inputs...", flush=True)
    jobs = Jobs(a)
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    print("warm-up, checking results against numpy...", flush=True)
    checked = run(drain(jobs, a, check=True))  # and the warm-up: GEMM plans, the queue's learned poll
    one_at_a_time(jobs)
    queued, plain = [], []
    for r in range(a.repeats):
        print(f"run {r + 1} of {a.repeats}: the queue, then one at a time...", flush=True)
        queued.append(run(drain(jobs, a, check=False)))
        plain.append(one_at_a_time(jobs))
    best_q = max(queued, key=lambda r: r["gemms_per_ms"])
    best_p = max(plain, key=lambda r: r["gemms_per_ms"])
    doc = {
        "backend": do.backend_name(),
        "config": vars(a),
        "checked": checked["checked"],
        "max_rel_err": checked["max_rel_err"],
        "queue": queued,
        "one_at_a_time": plain,
        "speedup": best_q["gemms_per_ms"] / best_p["gemms_per_ms"],
    }
    print(f"{a.items} GEMMs ({a.small}^3, every {a.large_every}th {a.large}^3) on {do.backend_name()}")
    print(
        f"  queue, one thread, {a.streams} streams: {best_q['gemms_per_ms']:.2f} GEMMs/ms  "
        f"{_flops(best_q['tflops'])}  p99 latency {best_q['latency_ms_p99']:.2f} ms  "
        f"CPU {best_q['cpu_us_per_gemm']:.1f} us/GEMM  lanes busy {best_q['busy_fraction']}"
    )
    print(
        f"  one at a time, one stream:   {best_p['gemms_per_ms']:.2f} GEMMs/ms  {_flops(best_p['tflops'])}  "
        f"CPU {best_p['cpu_us_per_gemm']:.1f} us/GEMM"
    )
    print(
        f"  queue / one at a time: {doc['speedup']:.2f}x; "
        f"{doc['checked']} results checked, max rel err {doc['max_rel_err']:.2e}"
    )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    if not doc["max_rel_err"] <= 2e-2:
        print("a checked result differs from numpy", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
