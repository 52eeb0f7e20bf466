"""The cost of ``await``: against ``sync_on`` of the same op, for every op length, and in CPU time.

1. Paired, per op length: a one-kernel op (``scale`` over 2048 f16) and a spin kernel of about
   20 µs, 100 µs, 500 µs, 2 ms and 20 ms; ``op.sync_on(s)`` and ``await op.wait(stream=s)``
   alternate rep by rep inside one running loop (uvloop, asyncio, trio), each first in every
   other pair. The figure is the
   median over reps of (await time - sync_on time) in µs (DESIGN target: <= 15 µs at every
   length, goal <= 5 µs), with the await's process CPU time per op beside it.
2. The same under each reactor CPU policy (uvloop): adaptive (default), spin, block.
3. CPU while awaiting one ~200 ms GPU op: process CPU time over wall time (target <= 2 %).

    python benchmarks/await_cost.py --reps 200 --out await_cost.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _harness import description
from exec_modes import machine_info

import deviceop as do
from deviceop._core import _reactor
from deviceop._core._completion import stats as await_stats
from deviceop._core._guards import blocking_allowed

K = do.kernels
# The spin kernel keeps the GPU busy for a span of the GPU's global nanosecond timer, not a count
# of SM cycles: its length does not follow the SM clock, so the two ops of a pair run equally long
# (a per cent of clock between them would be 200 us at 20 ms)
SPIN_SRC = r"""
extern "C" __global__ void spin(float* out, long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < (unsigned long long)ns);
  if (threadIdx.x == 0) out[blockIdx.x] = (float)ns;
}
"""
spin_k = K.Kernel(
    SPIN_SRC, "spin", params=(K.Out(do.float32), do.int64), host=lambda out, ns: time.sleep(float(ns) / 1e9)
)


def _run(lib: str, coro_fn):  # type: ignore[no-untyped-def]
    # the reference, sync_on, blocks the loop's thread on purpose (paired with the await of the
    # same op in the same loop): blocking terminals are allowed on this thread while it runs
    with blocking_allowed():
        if lib == "uvloop":
            import uvloop

            return uvloop.run(coro_fn())
        if lib == "trio":
            import trio

            return trio.run(coro_fn)
        return asyncio.run(coro_fn())


def _setup() -> tuple:
    s = do.next_stream()
    x = do.from_numpy(np.full(2048, 1.5, dtype=np.float16)).sync_on(s)
    y = do.zeros(2048, do.float16).sync_on(s)
    return s, x, y.partition((128,))


#: (name, seconds of GPU work; 0: the one-kernel op)
LENGTHS = [("1_kernel", 0.0), ("20us", 20e-6), ("100us", 100e-6), ("500us", 500e-6), ("2ms", 2e-3), ("20ms", 20e-3)]


def _path_counts() -> dict[str, int]:
    a, r = await_stats(), _reactor.stats()
    return {
        "polls": a["polls"],
        "parks": a["parks"],
        "late": a["late"],
        **{k: r[k] for k in ("prewakes", "rearmed", "late_resumes", "passes", "sleeps")},
    }


def lengths(lib: str, reps: int, warmup: int, names: list[str], pairs: bool = False) -> list[dict]:
    s, x, yp = _setup()
    out_t = do.zeros(1024, do.float32).sync_on(s)
    clock = time.perf_counter_ns
    cpu = time.process_time_ns

    async def main() -> list[dict]:
        res = []
        spin_k(out_t, 1000, grid=(1,), block=(32,)).sync_on(s)  # compiled and loaded
        for name, secs in LENGTHS:
            if name not in names:
                continue
            if secs:
                ns = int(secs * 1e9)
                make = lambda ns=ns: spin_k(out_t, ns, grid=(1,), block=(32,))  # noqa: E731
            else:
                make = lambda: K.scale(yp, x, 0.5)  # noqa: E731
            if STAGES.get("on"):
                built = make

                def make(built=built):  # type: ignore[no-untyped-def]
                    op = built()
                    STAGES["built"] = clock()
                    return op

            n = reps if secs < 1e-3 else max(40, reps // 2)
            sy, aw, diff, acpu, first, path = [], [], [], [], [], []
            st0 = _reactor.stats()
            for r in range(warmup + n):
                # the order alternates: what runs first in a pair follows the other kind's wait
                # (a thread that slept in its loop, or one that waited in the driver), and the
                # host work before a launch runs slower on a core that was idle
                if r % 2:
                    w0 = _path_counts() if pairs else None
                    STAGES.pop("waited", None)
                    c0 = cpu()
                    t2 = clock()
                    op = make()
                    STAGES["built_a"] = STAGES.get("built", 0)
                    await op.wait(stream=s)
                    t3 = clock()
                    c1 = cpu()
                    w1 = _path_counts() if pairs else None
                t0 = clock()
                op = make()
                STAGES["built_s"] = STAGES.get("built", 0)
                op.sync_on(s)
                t1 = clock()
                if not r % 2:
                    w0 = _path_counts() if pairs else None
                    STAGES.pop("waited", None)
                    c0 = cpu()
                    t2 = clock()
                    op = make()
                    STAGES["built_a"] = STAGES.get("built", 0)
                    await op.wait(stream=s)
                    t3 = clock()
                    c1 = cpu()
                    w1 = _path_counts() if pairs else None
                if r >= warmup:
                    sy.append((t1 - t0) / 1e3)
                    aw.append((t3 - t2) / 1e3)
                    diff.append(((t3 - t2) - (t1 - t0)) / 1e3)
                    acpu.append((c1 - c0) / 1e3)
                    first.append("await" if r % 2 else "sync_on")
                    if pairs:
                        path.append({k: w1[k] - w0[k] for k in w1})
                        if STAGES.get("on"):
                            b, dsp, e = STAGES["built_a"], STAGES["dispatched"], STAGES["enqueued"]
                            w = STAGES.get("waited", t3)
                            path[-1].update(
                                pre_us=(dsp - t2) / 1e3,
                                build_us=(b - t2) / 1e3,
                                enqueue_us=(e - b) / 1e3,
                                dispatch_us=(dsp - e) / 1e3,
                                wait_us=(w - dsp) / 1e3,
                                post_us=(t3 - w) / 1e3,
                                sync_build_us=(STAGES["built_s"] - t0) / 1e3,
                            )
            st1 = _reactor.stats()
            res.append(
                {
                    "loop": lib,
                    "policy": do.wait_policy(),
                    "op": name,
                    "reps": n,
                    "sync_on_us": float(np.median(sy)),
                    "await_us": float(np.median(aw)),
                    "await_minus_sync_us": float(np.median(diff)),
                    "await_minus_sync_p25_us": float(np.percentile(diff, 25)),
                    "await_minus_sync_p75_us": float(np.percentile(diff, 75)),
                    "await_cpu_us": float(np.median(acpu)),
                    # every pair (for the spread: which ran first, sync_on µs, await µs)
                    "pairs": [[f, a, b] for f, a, b in zip(first, sy, aw)] if pairs else None,
                    # per pair with --pairs: what the await's path did (its polls, parks, pre-wakes...)
                    "paths": path if pairs else None,
                    "reactor": {
                        k: st1[k] - st0[k]
                        for k in (
                            "armed",
                            "memop",
                            "host_function",
                            "passes",
                            "sleeps",
                            "parks",
                            "prewakes",
                            "rearmed",
                            "late_resumes",
                        )
                    },
                }
            )
        return res

    return _run(lib, main)


def _thread_cpu_ns() -> dict[str, int]:
    """CPU time of each thread of this process (Linux: /proc schedstat), by name and id."""
    out: dict[str, int] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for t in tids:
        try:
            with open(f"/proc/self/task/{t}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/self/task/{t}/comm") as f:
                name = f.read().strip()
        except (OSError, ValueError, IndexError):
            continue
        out[f"{name}:{t}"] = ns
    return out


def cpu_while_awaiting(lib: str, seconds: float, reps: int) -> dict:
    s = do.next_stream()
    out_t = do.zeros(1024, do.float32).sync_on(s)
    ns = int(seconds * 1e9)

    async def main() -> dict:
        spin_k(out_t, 1000, grid=(1,), block=(32,)).sync_on(s)
        fr, walls = [], []
        th0, st0, t0 = _thread_cpu_ns(), _reactor.stats(), time.perf_counter()
        for _ in range(reps):
            c0, w0 = time.process_time(), time.perf_counter()
            await spin_k(out_t, ns, grid=(1,), block=(32,)).wait(stream=s)
            c, w = time.process_time() - c0, time.perf_counter() - w0
            fr.append(c / w)
            walls.append(w)
        wall, th1, st1 = time.perf_counter() - t0, _thread_cpu_ns(), _reactor.stats()
        return {
            # per thread, over all the awaits: where the CPU goes
            "threads_cpu_fraction": {
                k: (v - th0.get(k, 0)) / 1e9 / wall for k, v in th1.items() if v - th0.get(k, 0) > 0
            },
            "reactor": {k: st1[k] - st0[k] for k in ("passes", "sleeps", "prewakes", "rearmed", "late_resumes")},
            "loop_lateness_us": st1["loop_lateness_s"] * 1e6,
            "wake_lateness_us": st1["wake_lateness_s"] * 1e6,
            "loop": lib,
            "policy": do.wait_policy(),
            "op_seconds_wall_median": float(np.median(walls)),
            "cpu_fraction_median": float(np.median(fr)),
            "cpu_fraction_max": float(np.max(fr)),
            "cpu_fraction_first": float(fr[0]),
            "reps": reps,
        }

    return _run(lib, main)


def _print(rows: list[dict]) -> None:
    for r in rows:
        print(
            f"{r['loop']:<8} {r['policy']:<8} {r['op']:<9} sync_on {r['sync_on_us']:10.1f} us  await {r['await_us']:10.1f} us  "
            f"await-sync {r['await_minus_sync_us']:+7.1f} us (p25 {r['await_minus_sync_p25_us']:+.1f}, p75 "
            f"{r['await_minus_sync_p75_us']:+.1f})  await cpu {r['await_cpu_us']:8.1f} us"
        )


def _spin_poll() -> None:
    """Replace the await's poll with one that never yields: what the await costs when the loop's
    turns between its looks cost nothing (a diagnostic; it blocks the loop while it looks)."""
    from deviceop._core import _completion as _await

    async def poll(lib, done, budget, deadline):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < budget:
            if done():
                return True
        return done()

    _await._poll = poll


#: with --stages, per await: when its enqueue ended and when its wait ended (perf_counter_ns)
STAGES: dict = {}


def _trace_stages() -> None:
    """Time stamps inside the await (a diagnostic): the end of its enqueue (the await looks its
    loop's dispatcher up right after it), the end of that lookup, and the end of its wait for the
    flag (a poll, a spin or a park returning), so that an await's time splits into the host work
    before the launch, the lookup, the wait, and the return after the flag was seen. (A chain
    long enough to be enqueued in slices goes on enqueuing after the lookup.)"""
    from deviceop._core import _completion as _await

    clock = time.perf_counter_ns
    dispatcher = _await.loop_dispatcher
    STAGES["on"] = True

    def traced_dispatcher():  # type: ignore[no-untyped-def]
        STAGES["enqueued"] = clock()
        r = dispatcher()
        STAGES["dispatched"] = clock()
        return r

    def stamped(fn, stage):  # type: ignore[no-untyped-def]
        """``fn``, noting the clock under ``stage`` when it returns."""

        def call(*a):  # type: ignore[no-untyped-def]
            r = fn(*a)
            STAGES[stage] = clock()
            return r

        return call

    def stamped_async(fn, stage):  # type: ignore[no-untyped-def]
        """The same for a coroutine function: the clock when its await ends."""

        async def call(*a):  # type: ignore[no-untyped-def]
            r = await fn(*a)
            STAGES[stage] = clock()
            return r

        return call

    _await._poll, _await._park = stamped_async(_await._poll, "waited"), stamped_async(_await._park, "waited")
    _await._spin = stamped(_await._spin, "waited")
    _await.loop_dispatcher = traced_dispatcher


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--inner", type=int, default=20)
    ap.add_argument("--loops", default="uvloop,asyncio,trio")
    ap.add_argument(
        "--lengths",
        default=",".join(n for n, _ in LENGTHS),
        help="comma-separated, of " + ", ".join(n for n, _ in LENGTHS),
    )
    ap.add_argument(
        "--no-policies", action="store_true", help="leave out the spin and block policies and the CPU figures"
    )
    ap.add_argument("--pairs", action="store_true", help="keep every pair's times in the JSON, not only the medians")
    ap.add_argument(
        "--spin-poll",
        action="store_true",
        help="diagnostic: an await's poll looks without yielding to its loop (the floor of seeing the flag)",
    )
    ap.add_argument(
        "--stages",
        action="store_true",
        help="diagnostic, with --pairs: split each await into its enqueue, its wait and its return",
    )
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.spin_poll:
        _spin_poll()
    if a.stages:
        _trace_stages()
    loops = [v for v in a.loops.split(",") if v]
    doc: dict = {
        "experiment": "await_cost",
        "machine": machine_info(),
        "poll_budget_default_us": do.poll_budget() * 1e6,
    }
    names = [n for n in a.lengths.split(",") if n]
    unknown = sorted(set(names) - {n for n, _ in LENGTHS})
    if unknown:
        ap.error(f"unknown lengths {unknown}; choose from {[n for n, _ in LENGTHS]}")
    doc["lengths"] = []
    for lib in loops:
        rows = lengths(lib, a.reps, 20, names, a.pairs)
        _print(rows)
        doc["lengths"] += rows
    doc["policies"] = []
    if a.no_policies:
        doc["reactor"] = _reactor.stats()
        _write(doc, a.out)
        return 0
    for pol in ("spin", "block"):
        do.set_wait_policy(pol)
        try:
            rows = lengths("uvloop", max(a.reps // 4, 30), 10, names)
            _print(rows)
            doc["policies"] += rows
            doc.setdefault("cpu_200ms_by_policy", []).append(cpu_while_awaiting("uvloop", 0.2, 5))
        finally:
            do.set_wait_policy("adaptive")
    doc["cpu_200ms"] = [cpu_while_awaiting(lib, 0.2, 10) for lib in loops]
    for r in doc["cpu_200ms"] + doc.get("cpu_200ms_by_policy", []):
        print(
            f"CPU while awaiting a {r['op_seconds_wall_median'] * 1e3:.0f} ms op ({r['loop']}, {r['policy']}): "
            f"{r['cpu_fraction_median']:.2%} of a core (max {r['cpu_fraction_max']:.2%}, first {r['cpu_fraction_first']:.2%}); "
            + ", ".join(
                f"{k.split(':')[0]} {v:.2%}"
                for k, v in sorted(r["threads_cpu_fraction"].items(), key=lambda kv: -kv[1])[:4]
            )
            + f"; scanner passes {r['reactor']['passes']} for {r['reps']}, loop lateness {r['loop_lateness_us']:.0f} us"
        )
    doc["reactor"] = _reactor.stats()
    _write(doc, a.out)
    return 0


def _write(doc: dict, out: str | None) -> None:
    if out:
        with open(out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
