"""Host CPU per request of ``pipeline_cost.py``'s 1-step request by terminal, with each thread's share.

The request (from_numpy, gemm, gelu, gemm, to_numpy, fresh buffers) driven as a program may
drive it: ``sync()`` one at a time, ``await`` one at a time, 16 and 64 awaited at once
(``asyncio.gather`` under uvloop), 64 ``submit()``-ted then their ``result()``; beside PyTorch's
64 in flight (``pipeline_cost.py``'s). CPU per request of the process and of each thread by
name (from ``schedstat``: the driver's ``cuda-EvtHandlr``, deviceop's ``deviceop-reacto``...),
and the completion reactor's counters per request. Medians of 7 rounds of 256 requests after
2 warm-up rounds; the list is run twice.

    python experiments/await_paths.py
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
from pipeline_threads import thread_cpu

from deviceop._core import _reactor

ROUNDS = 7


def main() -> None:
    import torch
    import uvloop

    request, torch_work, _ = build(1)
    xs = [np.random.default_rng(i).standard_normal((B, D)).astype(np.float16) for i in range(256)]
    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    pinned = [torch.empty((B, D), dtype=torch.float16).pin_memory() for _ in range(64)]

    def tor() -> None:
        for i in range(0, len(xs), 64):
            for k, x in enumerate(xs[i : i + 64]):
                pinned[k].copy_(torch_work(x), non_blocking=True)
            torch.cuda.synchronize()

    def one() -> None:
        for x in xs:
            request(x).sync()

    def awaited(width: int) -> Callable[[], None]:
        async def serve() -> None:
            if width == 1:  # a plain await per request
                for x in xs:
                    await request(x)
                return
            for i in range(0, len(xs), width):
                await asyncio.gather(*(request(x) for x in xs[i : i + width]))

        return lambda: loop.run_until_complete(serve())

    def submitted() -> None:
        for i in range(0, len(xs), 64):
            futures = [request(x).submit() for x in xs[i : i + 64]]
            for f in futures:
                f.result()

    def measure(label: str, fn: Callable[[], None]) -> None:
        fn(), fn()
        r0, th0, cpu = _reactor.stats(), thread_cpu(), []
        for _ in range(ROUNDS):
            c0 = time.process_time()
            fn()
            cpu.append((time.process_time() - c0) / len(xs) * 1e6)
        th1, r1, n = thread_cpu(), _reactor.stats(), ROUNDS * len(xs)
        by: dict[str, float] = {}
        for k, v in th1.items():
            by[k[1]] = by.get(k[1], 0.0) + (v - th0.get(k, 0.0)) / n * 1e6
        threads = ", ".join(f"{k} {v:.1f}" for k, v in sorted(by.items(), key=lambda kv: -kv[1]) if v >= 0.1)
        counters = ", ".join(f"{k} {(r1[k] - r0[k]) / n:.2f}" for k in ("armed", "passes", "parks", "prewakes"))
        print(
            f"{label:16s} CPU/req {statistics.median(cpu):7.1f} us  threads (us/req): {threads}  reactor/req: {counters}",
            flush=True,
        )

    for _ in range(2):
        measure("torch 64", tor)
        measure("sync", one)
        measure("await", awaited(1))
        measure("await 16", awaited(16))
        measure("await 64", awaited(64))
        measure("submit 64", submitted)


if __name__ == "__main__":
    main()
