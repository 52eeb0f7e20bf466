"""The cost of ``await``: against ``sync_on`` of the same op, per poll budget, and in CPU time.

1. Paired, one-kernel op (``scale`` over 2048 f16): ``sync_on`` and ``await op.wait(stream=s)``
   alternate rep by rep inside one running loop (uvloop, asyncio, trio); the per-rep ratio's
   median is the figure (DESIGN target: at most 2.0x, goal 1.2x).
2. Poll budget sweep (uvloop): a one-kernel op and a ~200 µs spin kernel, awaited with budgets
   from 0 (park at once) to 200 µs, beside their sync_on times. Chooses the default.
3. CPU while awaiting one ~200 ms GPU op: process CPU time over wall time (target <= 10%).

    python experiments/await_cost.py --reps 200 --out await_cost.json
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

import deviceop as do  # noqa: E402
from exec_modes import machine_info  # noqa: E402

K = do.kernels
SPIN_SRC = r"""
extern "C" __global__ void spin(float* out, long long cycles) {
  long long t0 = clock64();
  while (clock64() - t0 < cycles) { }
  if (threadIdx.x == 0) out[blockIdx.x] = (float)cycles;
}
"""
spin_k = K.Kernel(SPIN_SRC, "spin", params=(K.Out(do.float32), do.int64),
                  host=lambda out, cycles: time.sleep(float(cycles) / 1.98e9))


def _run(lib: str, coro_fn):  # type: ignore[no-untyped-def]
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


def paired(lib: str, reps: int, inner: int, warmup: int) -> dict:
    s, x, yp = _setup()
    clock = time.perf_counter_ns

    async def main() -> dict:
        sync_t, await_t = [], []
        for r in range(warmup + reps):
            t0 = clock()
            for _ in range(inner):
                K.scale(yp, x, 0.5).sync_on(s)
            t1 = clock()
            for _ in range(inner):
                await K.scale(yp, x, 0.5).wait(stream=s)
            t2 = clock()
            if r >= warmup:
                sync_t.append((t1 - t0) / inner / 1e3)
                await_t.append((t2 - t1) / inner / 1e3)
        ratios = [a / b for a, b in zip(await_t, sync_t)]
        return {
            "loop": lib, "reps": reps, "inner": inner,
            "sync_on_us": float(np.median(sync_t)), "await_us": float(np.median(await_t)),
            "await_over_sync_median_of_ratios": float(np.median(ratios)),
            "await_over_sync_p25": float(np.percentile(ratios, 25)),
            "await_over_sync_p75": float(np.percentile(ratios, 75)),
        }

    return _run(lib, main)


def budget_sweep(reps: int, budgets: list[float]) -> list[dict]:
    s, x, yp = _setup()
    out_t = do.zeros(1024, do.float32).sync_on(s)
    spin_cycles = int(200e-6 * 1.98e9)
    clock = time.perf_counter_ns
    old = do.poll_budget()

    async def main() -> list[dict]:
        res = []
        spin_k(out_t, spin_cycles, grid=(1,), block=(32,)).sync_on(s)  # compile
        for b in budgets:
            do.set_poll_budget(b)
            for name, make in (("scale_2048", lambda: K.scale(yp, x, 0.5)),
                               ("spin_200us", lambda: spin_k(out_t, spin_cycles, grid=(1,), block=(32,)))):
                sy, aw, cpu = [], [], []
                for r in range(reps + 5):
                    t0 = clock()
                    make().sync_on(s)
                    t1 = clock()
                    c0 = time.process_time_ns()
                    t2 = clock()
                    await make().wait(stream=s)
                    t3 = clock()
                    c1 = time.process_time_ns()
                    if r >= 5:
                        sy.append((t1 - t0) / 1e3)
                        aw.append((t3 - t2) / 1e3)
                        cpu.append((c1 - c0) / 1e3)
                res.append({"budget_us": b * 1e6, "op": name, "sync_on_us": float(np.median(sy)),
                            "await_us": float(np.median(aw)), "await_cpu_us": float(np.median(cpu)),
                            "ratio": float(np.median([a / b_ for a, b_ in zip(aw, sy)]))})
        return res

    try:
        return _run("uvloop", main)
    finally:
        do.set_poll_budget(old)


def cpu_while_awaiting(lib: str, seconds: float, reps: int) -> dict:
    s = do.next_stream()
    out_t = do.zeros(1024, do.float32).sync_on(s)
    cycles = int(seconds * 1.98e9)

    async def main() -> dict:
        spin_k(out_t, 1000, grid=(1,), block=(32,)).sync_on(s)
        fr, walls = [], []
        for _ in range(reps):
            c0, w0 = time.process_time(), time.perf_counter()
            await spin_k(out_t, cycles, grid=(1,), block=(32,)).wait(stream=s)
            c, w = time.process_time() - c0, time.perf_counter() - w0
            fr.append(c / w)
            walls.append(w)
        return {"loop": lib, "op_seconds_wall_median": float(np.median(walls)),
                "cpu_fraction_median": float(np.median(fr)), "cpu_fraction_max": float(np.max(fr)), "reps": reps}

    return _run(lib, main)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--inner", type=int, default=20)
    ap.add_argument("--loops", default="uvloop,asyncio,trio")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    loops = [v for v in a.loops.split(",") if v]
    doc: dict = {"experiment": "await_cost", "machine": machine_info(), "poll_budget_default_us": do.poll_budget() * 1e6}
    doc["paired_n1"] = [paired(lib, a.reps, a.inner, 20) for lib in loops]
    for p in doc["paired_n1"]:
        print(f"N=1 {p['loop']:<8} sync_on {p['sync_on_us']:.2f} us  await {p['await_us']:.2f} us  "
              f"-> {p['await_over_sync_median_of_ratios']:.3f}x (p25 {p['await_over_sync_p25']:.3f}, p75 {p['await_over_sync_p75']:.3f})")
    doc["budget_sweep"] = budget_sweep(max(a.reps // 4, 20), [0.0, 10e-6, 20e-6, 50e-6, 100e-6, 200e-6])
    for r in doc["budget_sweep"]:
        print(f"budget {r['budget_us']:6.0f} us  {r['op']:<11} sync_on {r['sync_on_us']:8.1f}  await {r['await_us']:8.1f} us "
              f"({r['ratio']:.2f}x)  await cpu {r['await_cpu_us']:8.1f} us")
    doc["cpu_200ms"] = [cpu_while_awaiting(lib, 0.2, 10) for lib in loops]
    for r in doc["cpu_200ms"]:
        print(f"CPU while awaiting a {r['op_seconds_wall_median'] * 1e3:.0f} ms op ({r['loop']}): "
              f"{r['cpu_fraction_median']:.2%} of a core (max {r['cpu_fraction_max']:.2%})")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
