"""Soak: mixed, hostile use of deviceop in one process for a while; every result checked.

For ``--seconds`` (default 600), at once:

* an asyncio (uvloop where installed) service: ``--tasks`` request tasks, each awaiting a
  pipeline (from_numpy, scale, add, to_numpy) per request, with random timeouts and random
  cancellations of requests in flight;
* ``--threads`` threads using ``sync`` and ``submit().result()`` on pipelines of their own;
* a thread replaying a recorded graph over its own buffers, and two threads calling one
  GraphCache with inputs of varying length;
* once, a subprocess (spawned) whose kernel faults: it must see CudaError, this process not.

A watchdog reports a hang when a worker makes no progress for 60 s. At the end the workers
stop and the process's threads, file descriptors, device memory in use and resident memory
are compared with a baseline taken after a warm-up (and sampled every 30 s meanwhile, so that
growth shows apart from a one-time start of something). Prints and writes (``--out``) the counts.

    python tests/soak.py --seconds 600 --out soak.json
    DEVICEOP_BACKEND=host python tests/soak.py --seconds 30   # the host backend
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from await_cost import spin_k

import deviceop as do

K = do.kernels
N = 4096
HANG_S = 60.0


def _os_thread_names() -> dict[str, int]:
    """The process's OS threads by name (Python's, deviceop's reactor, the driver's)."""
    names: dict[str, int] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                n = f.read().strip()
        except OSError:  # ended meanwhile
            continue
        names[n] = names.get(n, 0) + 1
    return dict(sorted(names.items()))


def _resources() -> dict[str, Any]:
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {
        "threads": threading.active_count(),
        "os_threads": len(os.listdir("/proc/self/task")),
        "os_thread_names": _os_thread_names(),
        "fds": len(os.listdir("/proc/self/fd")),
        "device_bytes": do.used_bytes(),
        "rss_mib": rss / 1024,
    }


def pipeline(x: np.ndarray, g: float, delay: float = 0.0) -> do.DeviceOp:
    """to_numpy((x * g) + x) through fresh device buffers, as a request handler writes it;
    ``delay``: seconds of GPU work first (a spin kernel), so that a cancellation or a timeout
    lands while the request's work is in flight."""
    op = do.from_numpy(x)
    if delay:
        span_ns = int(delay * 1e9)
        op = op.then(
            lambda t: (
                do.empty((32,), do.float32).then(lambda s: spin_k(s, span_ns, grid=(1,), block=(32,))).map(lambda _: t)
            )
        )
    return (
        op.then(lambda t: do.empty(t.shape, t.dtype).then(lambda y: K.scale(y.partition((N,)), t, g)))
        .map(lambda r: r[0].tensor)
        .then(lambda y: do.empty(y.shape, y.dtype).then(lambda z: K.add(z.partition((N,)), y, y)))
        .map(lambda r: r[0].tensor)
        .then(do.to_numpy)
    )


def expected(x: np.ndarray, g: float) -> np.ndarray:
    y = (x * np.float32(g)).astype(np.float32)
    return (y + y).astype(np.float32)


class Soak:
    def __init__(self, seconds: float, tasks: int, threads: int, fault: bool = True) -> None:
        self.inject_fault = fault
        self.fault: dict[str, Any] = {}
        self.deadline = time.monotonic() + seconds
        self.tasks, self.threads = tasks, threads
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()
        self.progress: dict[str, float] = {}
        self.hangs: list[str] = []
        self.errors: list[str] = []
        self.timeline: list[dict[str, Any]] = []

    def count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + n

    def alive(self, who: str) -> None:
        self.progress[who] = time.monotonic()

    def running(self) -> bool:
        return time.monotonic() < self.deadline and not self.hangs

    def check(self, what: str, got: np.ndarray, want: np.ndarray) -> None:
        if np.array_equal(got, want):
            self.count(f"{what}_ok")
        else:
            self.count("wrong_results")
            self.errors.append(f"{what}: wrong result (max error {float(np.max(np.abs(got - want)))})")

    # -- the asyncio service -----------------------------------------------------------------
    async def _request(self, rng: random.Random, name: str) -> None:
        x = np.full(N, rng.uniform(-4, 4), np.float32)
        g = rng.choice([0.5, 2.0, -1.0])
        mode = rng.random()
        # the requests a client gives up on take up to 2 ms of GPU time: short ones complete
        # before any cancellation or deadline could land
        op = pipeline(x, g, rng.uniform(0, 0.002) if mode < 0.3 else 0.0)
        if mode < 0.15:  # a client that goes away: cancel the request in flight
            task = asyncio.ensure_future(op.wait())
            await asyncio.sleep(rng.uniform(0, 0.002))
            task.cancel()
            try:
                got = await task
            except asyncio.CancelledError:
                self.count("async_cancelled")
                return
            self.check("async", got, expected(x, g))
        elif mode < 0.3:  # a tight deadline
            try:
                got = await op.wait(timeout=rng.uniform(0, 0.001))
            except TimeoutError:
                self.count("async_timeouts")
                return
            self.check("async", got, expected(x, g))
        else:
            self.check("async", await op, expected(x, g))

    async def _task(self, i: int) -> None:
        rng = random.Random(i)
        who = f"async-{i}"
        while self.running():
            try:
                await self._request(rng, who)
            except Exception as e:
                self.count("async_errors")
                self.errors.append(f"{who}: {e!r}")
            self.alive(who)

    async def service(self) -> None:
        await asyncio.gather(*(self._task(i) for i in range(self.tasks)))

    # -- threads ---------------------------------------------------------------------------------
    def _thread(self, i: int) -> None:
        rng = random.Random(1000 + i)
        who = threading.current_thread().name
        while self.running():
            x = np.full(N, rng.uniform(-4, 4), np.float32)
            g = rng.choice([0.5, 2.0, -1.0])
            try:
                if rng.random() < 0.5:
                    self.check("sync", pipeline(x, g).sync(), expected(x, g))
                else:
                    self.check("submit", pipeline(x, g).submit().result(timeout=HANG_S), expected(x, g))
            except Exception as e:
                self.count("thread_errors")
                self.errors.append(f"{who}: {e!r}")
            self.alive(who)

    def _graphs(self) -> None:
        who = threading.current_thread().name
        x = do.zeros(N, do.float32).sync()
        y = do.zeros(N, do.float32).sync()
        g = K.scale(y.partition((N,)), x, 3.0).graph()
        rng = random.Random(7)
        while self.running():
            v = rng.uniform(-4, 4)
            try:
                K.fill(x.partition((N,)), v).sync()
                g.launch().sync()
                self.check("graph", y.numpy(), np.full(N, np.float32(v) * np.float32(3.0), np.float32))
            except Exception as e:
                self.count("graph_errors")
                self.errors.append(f"{who}: {e!r}")
            self.alive(who)

    def _graph_cache(self, cache: Any, i: int) -> None:
        who = threading.current_thread().name
        rng = random.Random(100 + i)
        while self.running():
            n = rng.randint(1, 16)
            xs = np.arange(n * 64, dtype=np.float32).reshape(n, 64) * np.float32(i + 1)
            try:
                x = do.from_numpy(xs).sync()
                got = cache(x).then(do.to_numpy).sync()
                self.check("graphcache", got, xs * np.float32(2.0))
            except Exception as e:
                self.count("graphcache_errors")
                self.errors.append(f"{who}: {e!r}")
            self.alive(who)

    # -- the watchdog ----------------------------------------------------------------------------
    def _watchdog(self) -> None:
        t0 = last = time.monotonic()
        while time.monotonic() < self.deadline + HANG_S:
            now = time.monotonic()
            if now - last >= 30:  # resources over time: growth, not a one-time start, is a leak
                last = now
                self.timeline.append({"t": round(now - t0), **_resources()})
            for who, t in list(self.progress.items()):
                if now - t > HANG_S and who not in self.hangs:
                    self.hangs.append(who)
            if self.hangs or all(not th.is_alive() for th in self.workers):
                return
            time.sleep(1.0)

    def run(self) -> None:
        def build(x: Any) -> do.DeviceOp:
            y = do.empty(x.shape, x.dtype).sync()
            return K.scale(y.partition((1, 64)), x, 2.0).map(lambda r: r[0].tensor)

        cache = do.graph.GraphCache(build, max_size=16)
        self.workers = [
            threading.Thread(target=self._thread, args=(i,), name=f"soak-thread-{i}") for i in range(self.threads)
        ]
        self.workers += [threading.Thread(target=self._graphs, name="soak-graph")]
        self.workers += [
            threading.Thread(target=self._graph_cache, args=(cache, i), name=f"soak-gc-{i}") for i in range(2)
        ]
        now = time.monotonic()
        for th in self.workers:
            self.progress[th.name] = now
        watchdog = threading.Thread(target=self._watchdog, name="soak-watchdog", daemon=True)
        for th in self.workers:
            th.start()
        watchdog.start()
        if self.inject_fault:
            self.fault = _fault_in_subprocess()
            self.counts["fault_subprocess_saw_cuda_error"] = int(self.fault["saw_cuda_error"])
        try:
            import uvloop

            runner: Callable[[Any], Any] = uvloop.run  # type: ignore[attr-defined]
        except (ImportError, AttributeError):
            runner = asyncio.run
        runner(self.service())
        for th in self.workers:
            th.join(HANG_S)
            if th.is_alive():
                self.hangs.append(th.name)


_FAULT = r"""
import deviceop as do
K = do.kernels
if do.backend_name() == "cuda":
    k = K.Kernel('extern "C" __global__ void oob(float* p) { p[(long long)threadIdx.x << 40] = 1.0f; }', "oob",
                 params=(K.Out(do.float32),))
    run = lambda t: k(t, grid=(1,), block=(32,)).sync()
else:
    def boom(out): raise FloatingPointError("injected fault")
    k = K.Kernel("", "boom", params=(K.Out(do.float32),), host=boom)
    run = lambda t: k(t.partition((32,))).sync()
t = do.zeros(32, do.float32).sync()
try:
    run(t)
except do.CudaError as e:
    print("CUDAERROR", e.name)
"""


def _fault_in_subprocess() -> dict[str, Any]:
    """A kernel fault in a spawned process: it sees CudaError; this process carries on."""
    import subprocess

    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-c", _FAULT],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))},
    )
    return {
        "saw_cuda_error": "CUDAERROR" in p.stdout,
        "stdout": p.stdout.strip()[-200:],
        "returncode": p.returncode,
        "seconds": time.monotonic() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=" ".join((__doc__ or "").split("\n\n")[0].replace("``", "").split()))
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--tasks", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    multiprocessing.set_start_method("spawn", force=True)
    # warm-up: the same load, the faulting subprocess included, for a while, so that caches,
    # pools, bounded caches (GraphCache buckets, plans) and the helper threads (deviceop's and the
    # driver's, some made only under load; multiprocessing's for the spawn) exist when the
    # baseline is taken
    warm = Soak(min(30.0, a.seconds), a.tasks, a.threads, fault=True)
    warm.run()
    gc.collect()
    do.empty_cache()
    base = _resources()
    s = Soak(a.seconds, a.tasks, a.threads)
    t0 = time.monotonic()
    s.run()
    elapsed = time.monotonic() - t0
    # everything the run started is over once its work completed: resources back to the baseline
    deadline = time.monotonic() + 30
    while True:
        gc.collect()
        for st in do.streams():
            st.synchronize()
        do.empty_cache()
        end = _resources()
        if (
            end["threads"] <= base["threads"]
            and end["fds"] <= base["fds"]
            and end["device_bytes"] <= base["device_bytes"]
        ) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    doc = {
        "experiment": "soak",
        "backend": do.backend_name(),
        "seconds": elapsed,
        "tasks": a.tasks,
        "threads": a.threads,
        "counts": dict(sorted(s.counts.items())),
        "hangs": s.hangs,
        "errors": s.errors[:20],
        "n_errors": len(s.errors),
        "fault_subprocess": s.fault,
        "baseline": base,
        "timeline": s.timeline,
        "end": end,
        "back_to_baseline": {k: end[k] <= base[k] for k in ("threads", "os_threads", "fds", "device_bytes")},
        # which OS threads the run added (by name), if any
        "os_threads_added": {
            n: c - base["os_thread_names"].get(n, 0)
            for n, c in end["os_thread_names"].items()
            if c > base["os_thread_names"].get(n, 0)
        },
        "rss_growth_mib": end["rss_mib"] - base["rss_mib"],
        # growth after the first sample: what a leak would show (the first interval can still
        # fill bounded caches)
        "rss_growth_after_first_sample_mib": (
            end["rss_mib"] - s.timeline[0]["rss_mib"] if s.timeline else end["rss_mib"] - base["rss_mib"]
        ),
    }
    ok = (
        not s.hangs
        and not s.errors
        and s.counts.get("wrong_results", 0) == 0
        and all(doc["back_to_baseline"].values())
        and s.fault["saw_cuda_error"]
    )
    doc["ok"] = ok
    print(
        json.dumps(
            {
                k: doc[k]
                for k in (
                    "backend",
                    "seconds",
                    "counts",
                    "hangs",
                    "n_errors",
                    "back_to_baseline",
                    "os_threads_added",
                    "rss_growth_mib",
                    "rss_growth_after_first_sample_mib",
                    "ok",
                )
            },
            indent=1,
        )
    )
    for e in s.errors[:5]:
        print("error:", e)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
