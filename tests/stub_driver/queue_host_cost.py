"""The one-thread queue's host time per GEMM item, on the stub driver, without a GPU.

A development tool, not a figure: it times deviceop's own host path of the bimodal queue
(``benchmarks/bimodal.py``'s async variant: 2000 float16 GEMMs, every fifth 2048^3, the rest
512^3, from a ``WorkQueue`` inside ``asyncio.run``), with cuBLASLt replaced by the stub's
``stub_ltmatmul`` (one empty kernel on the call's stream). So the item's factory, the GEMM's
compiled op and launch, the access ledger, the replay table (repeated calls recorded and
replayed as graphs) and the queue's lanes all run as on a GPU; the driver's own cost and the
GPU's time do not. It also times the pieces: the GEMM op's build and its start and finish in a
batch of 8, and the queue with items that make no GPU work (``do.value``), whose time is the
queue's own. With ``DEVICEOP_STUB_INLINE=1`` the stub runs each stream's work as it is
enqueued, so that its worker threads do not take the measured thread's CPU (fewer cores than
streams): use it to compare two versions, and compare them in the same sitting.

    cc -O2 -shared -fPIC -Wl,-soname,libcuda.so.1 -o /tmp/stub/libcuda.so.1 tests/stub_driver/stub_cuda.c -ldl -lpthread
    DEVICEOP_STUB_INLINE=1 DEVICEOP_STUB_DRIVER=1 LD_LIBRARY_PATH=/tmp/stub python tests/stub_driver/queue_host_cost.py
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import os
import statistics
import sys
import time
import timeit

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import deviceop as do
from deviceop._core._op import Each, start_sliced
from deviceop.executors import WorkQueue
from deviceop.kernels._gemm import GEMM

K = do.kernels
SMALL, LARGE = 512, 2048


def stand_in() -> int:
    """The address of the stub driver's ``stub_ltmatmul`` (SystemExit if the driver is not the stub)."""
    if os.environ.get("DEVICEOP_STUB_DRIVER") != "1" or do.backend_name() != "cuda":
        raise SystemExit(
            "run on the stub driver: DEVICEOP_STUB_DRIVER=1 LD_LIBRARY_PATH=<its folder> (see the docstring)"
        )
    try:
        fn = ctypes.CDLL("libcuda.so.1").stub_ltmatmul
    except AttributeError:
        raise SystemExit("this libcuda.so.1 has no stub_ltmatmul: build tests/stub_driver/stub_cuda.c") from None
    return int(ctypes.cast(fn, ctypes.c_void_p).value or 0)


def plan_with_stand_in(fake: int, args: tuple, streams: list) -> None:
    """Plan ``gemm(*args)`` and have its plain cuBLASLt call be the stand-in, on ``streams``."""
    for st in streams:
        GEMM.blas[st.handle_int] = (0, 0)  # (no cuBLAS handle or workspace: the stand-in needs none)
    g = GEMM.plan(args, (1.0, 0.0, False))
    g.lt_call = (fake, 0, 0, 0, 0, 0, 0)
    g.lt_tried = True


def queue_us(items: list, lanes: int, batch: int, reps: int) -> list[float]:
    """Host µs an item of ``WorkQueue(streams=lanes, batch=batch).run(items)``, per run."""

    async def main() -> float:
        q = WorkQueue(streams=lanes, batch=batch)
        for st in q.streams:
            GEMM.blas[st.handle_int] = (0, 0)
        t = time.perf_counter()  # (the loop's and the queue's set-up left out)
        res = await q.run(items)
        t = time.perf_counter() - t
        bad = [r.error for r in res if r.error is not None]
        if bad:
            raise bad[0]
        return t

    # (the first run warms up: plans, the replay table's recordings)
    return [asyncio.run(main()) / len(items) * 1e6 for i in range(reps + 1)][1:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=" ".join((__doc__ or "queue host cost").split("\n\n")[0].replace("``", "").split())
    )
    ap.add_argument("--items", type=int, default=2000)
    ap.add_argument("--lanes", type=int, default=8)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    fake = stand_in()
    s0 = do.streams()[0]
    rng = np.random.default_rng(0)
    sizes = [LARGE if i % 5 == 4 else SMALL for i in range(a.items)]
    x = {n: do.from_numpy(rng.standard_normal((n, n)).astype(np.float16)).sync_on(s0) for n in (SMALL, LARGE)}
    c = [{n: do.zeros((n, n), do.float16).sync_on(s0) for n in (SMALL, LARGE)} for _ in range(a.lanes)]
    for n in (SMALL, LARGE):
        for lane in range(a.lanes):
            plan_with_stand_in(fake, (c[lane][n], x[n], x[n]), do.streams())
    factory = {n: (lambda lane, n=n: K.gemm(c[lane][n], x[n], x[n])) for n in (SMALL, LARGE)}
    gemms = [factory[n] for n in sizes]
    values = [lambda lane: do.value(lane)] * a.items
    gc.collect()
    gc.freeze()  # (as the queue benchmark: no collection in a measured run)
    doc: dict = {"items": a.items, "lanes": a.lanes, "reps": a.reps, "us_per_item": {}}
    for batch in (8, 1):
        for name, items in (("gemm", gemms), ("value", values)):
            xs = queue_us(items, a.lanes, batch, a.reps)
            doc["us_per_item"][f"{name}_batch{batch}"] = {"median": statistics.median(xs), "min": min(xs)}
            print(f"queue of {name} items, batch={batch}: {statistics.median(xs):.2f} µs an item (min {min(xs):.2f})")

    f = factory[SMALL]
    s = do.streams()[0]

    def batch8(start: bool) -> None:
        ops = [f(0) for _ in range(8)]
        for o in ops:
            o._take("a WorkQueue")
        e = Each(ops)
        if start:
            cx, _, _ = start_sliced(e, s, "WorkQueue", 0.0)
            cx.finish()

    def per_item(fn: object, number: int) -> float:
        return min(timeit.repeat(fn, number=number, repeat=5)) / number / 8 * 1e6  # type: ignore[arg-type]

    built = per_item(lambda: batch8(False), 2000)
    run = per_item(lambda: batch8(True), 2000)
    s.synchronize()
    doc["gemm_op_build_us"] = built
    doc["gemm_op_start_finish_us"] = run - built
    print(
        f"a GEMM item's op, built and taken: {built:.2f} µs; started and finished in a batch of 8: {run - built:.2f} µs"
    )
    for name, t in (("replay_table", GEMM.replays), ("batch_replay_table", GEMM.batch_replays)):
        doc[name] = {"recorded": t.recorded, "replays": t.replays}
        print(f"GEMM {name.replace('_', ' ')}: {t.recorded} recorded, {t.replays} replays")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(doc, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
