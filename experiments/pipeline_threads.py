"""Where the host CPU of ``pipeline_cost.py``'s 64-in-flight rounds goes.

CPU per request by thread (deviceop's and PyTorch's rounds together, as they alternate), and
the GEMM replay table's recordings and replays over the measured rounds, with replays on (the
default), off (every GEMM a cublasLtMatmul call) and after the table is cleared; PyTorch's
rounds alone before and after. Medians of 9 rounds of 256 requests after 2 warm-up rounds.

    DEVICEOP_STREAMS=4 STEPS=1 python experiments/pipeline_threads.py
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline_cost import B, D, build

from deviceop.kernels._gemm import GEMM

WIDTH, ROUNDS = 64, 9


def thread_cpu() -> dict[tuple[str, str], float]:
    """CPU seconds of each of this process's threads, by (tid, name).

    From ``schedstat`` (nanoseconds): ``stat``'s clock ticks charge a whole tick to whichever
    thread runs when it falls, which misstates threads that wake often and briefly (the driver's
    event handler, the reactor's scanner) by several microseconds per request.
    """
    out = {}
    tck = os.sysconf("SC_CLK_TCK")
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                comm = f.read().strip()
            try:
                with open(f"/proc/self/task/{t}/schedstat") as f:
                    out[(t, comm)] = int(f.read().split()[0]) * 1e-9
                continue
            except (OSError, ValueError, IndexError):  # a kernel without schedstats: ticks
                pass
            with open(f"/proc/self/task/{t}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        out[(t, comm)] = (int(fields[11]) + int(fields[12])) / tck
    return out


def main() -> None:
    import torch
    import uvloop

    steps = int(os.environ.get("STEPS", "1"))
    request, torch_work, _ = build(steps)
    xs = [np.random.default_rng(i).standard_normal((B, D)).astype(np.float16) for i in range(256)]
    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)

    async def serve() -> None:
        for i in range(0, len(xs), WIDTH):
            await asyncio.gather(*(request(x) for x in xs[i : i + WIDTH]))

    pinned = [torch.empty((B, D), dtype=torch.float16).pin_memory() for _ in range(WIDTH)]

    def tor() -> None:
        for i in range(0, len(xs), WIDTH):
            for k, x in enumerate(xs[i : i + WIDTH]):
                pinned[k].copy_(torch_work(x), non_blocking=True)
            torch.cuda.synchronize()

    def run() -> None:
        loop.run_until_complete(serve())

    def measure(label: str, fn: Callable[[], None]) -> None:
        fn(), fn()
        cpu = []
        r0 = (GEMM.replays.recorded, GEMM.replays.replays)
        th0 = thread_cpu()
        for _ in range(ROUNDS):
            c0 = time.process_time()
            fn()
            cpu.append((time.process_time() - c0) / len(xs) * 1e6)
            tor()
        th1 = thread_cpu()
        r1 = (GEMM.replays.recorded, GEMM.replays.replays)
        per: dict[str, float] = {}
        for key, v in th1.items():
            d = v - th0.get(key, 0.0)
            if d > 0.005:
                per[key[1]] = per.get(key[1], 0.0) + d / (ROUNDS * len(xs)) * 1e6
        threads = {k: round(v, 1) for k, v in per.items()}
        print(
            f"{label:28s} cpu/req {statistics.median(cpu):7.1f} us  recorded +{r1[0] - r0[0]} "
            f"replays +{r1[1] - r0[1]} table {len(GEMM.replays)}  threads (us/req, with PyTorch's) {threads}",
            flush=True,
        )

    def torch_only() -> None:
        tor(), tor()
        cpu = []
        for _ in range(ROUNDS):
            c0 = time.process_time()
            tor()
            cpu.append((time.process_time() - c0) / len(xs) * 1e6)
        print(f"{'torch':28s} cpu/req {statistics.median(cpu):7.1f} us", flush=True)

    print("streams", os.environ.get("DEVICEOP_STREAMS", "4"), "steps", steps)
    torch_only()
    measure("replays (default)", run)
    GEMM.mode = 1
    measure("no replays (cuBLASLt calls)", run)
    GEMM.mode = 0
    GEMM.replays.clear()
    measure("replays after clear", run)
    torch_only()


if __name__ == "__main__":
    main()
