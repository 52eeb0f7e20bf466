"""Where a one-thread queue's per-item time goes: the same small op (a 512^3 float16 GEMM into
a fixed output, or a fill of 1024 floats) run N times as a loop of ``sync``, as a loop of
sequential awaits (the learned poll, ``poll=0``, a 2 ms poll), and through ``WorkQueue`` over one
stream with ``batch=1`` and ``batch=8``. Wall and process CPU time per item, best of --repeats.

    python experiments/await_queue_cost.py --out await_queue_cost.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

import deviceop as do
from deviceop._core._completion import await_op
from deviceop.executors import WorkQueue

K = do.kernels


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        import asyncio

        run = asyncio.run
    rng = np.random.default_rng(0)
    x, y = (do.from_numpy(rng.standard_normal((512, 512)).astype(np.float16)).sync() for _ in range(2))
    c = do.empty((512, 512), do.float16).sync()
    f = do.zeros(1024, do.float32).sync()
    ops = {"gemm512": lambda: K.gemm(c, x, y), "fill1024": lambda: K.fill(f.partition((128,)), 1.0)}
    s = do.streams()[0]
    n = a.items
    rows: list[dict[str, Any]] = []

    def timed(name: str, mode: str, fn: Any) -> None:
        best = None
        for _ in range(a.repeats):
            t, cpu = time.perf_counter(), time.process_time()
            fn()
            r = ((time.perf_counter() - t) / n * 1e6, (time.process_time() - cpu) / n * 1e6)
            best = r if best is None or r[0] < best[0] else best
        assert best is not None
        rows.append({"op": name, "mode": mode, "wall_us": best[0], "cpu_us": best[1]})
        print(f"{name:9} {mode:22} wall {best[0]:7.1f} us/item  CPU {best[1]:7.1f} us/item", flush=True)

    for name, mk in ops.items():
        for _ in range(200):
            mk().sync_on(s)

        def sync_loop(mk: Any = mk) -> None:
            for _ in range(n):
                mk().sync_on(s)

        timed(name, "sync loop", sync_loop)
        for label, poll in (("await (learned poll)", None), ("await poll=0", 0.0), ("await poll=2ms", 2e-3)):

            async def awaits(mk: Any = mk, poll: Any = poll) -> None:
                for _ in range(n):
                    await await_op(mk(), s, "await", None, poll)

            timed(name, label, lambda awaits=awaits: run(awaits()))
        for batch in (1, 8):

            async def queue(mk: Any = mk, batch: int = batch) -> None:
                await WorkQueue(streams=[s], batch=batch).run(mk() for _ in range(n))

            timed(name, f"WorkQueue 1 stream b={batch}", lambda queue=queue: run(queue()))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"backend": do.backend_name(), "items": n, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
