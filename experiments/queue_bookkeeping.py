"""The WorkQueue's own host time per item, without any device work: ``await_op`` replaced by a
completion that is already there, items that are ready values (``do.value(i)``), one stream,
``batch=1`` and ``batch=8``. Best of --repeats. Runs on any backend (the device is never used).

    python experiments/queue_bookkeeping.py
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import deviceop as do
import deviceop.executors._queue as queue_module
from deviceop.executors import WorkQueue


async def _instant(op: Any, stream: Any, label: str, timeout: Any = None, poll: Any = None) -> None:
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=50000)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        import asyncio

        run = asyncio.run
    queue_module.await_op = _instant  # type: ignore[assignment]

    async def drain(batch: int) -> float:
        q = WorkQueue(streams=1, batch=batch)
        ops = [do.value(i) for i in range(a.items)]
        t = time.perf_counter()
        await q.run(ops)
        return (time.perf_counter() - t) / a.items * 1e6

    for batch in (1, 8):
        best = min(run(drain(batch)) for _ in range(a.repeats))
        print(f"batch={batch}: {best:.2f} us of queue bookkeeping per item")
    return 0


if __name__ == "__main__":
    sys.exit(main())
