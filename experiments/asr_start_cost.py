"""Where the speech loop's chunk spends its time before the encoder starts (deviceop, eager).

The speech example's deviceop-torch loop (``examples/asr_stream/run.py``) reaches its encoder later
after a chunk's arrival than the blocking PyTorch loop does. This takes that stretch apart, with
the example's own encoder and audio, in one uvloop loop, a chunk every ``--every`` seconds:

  task start    from ``asyncio.ensure_future`` of the chunk's task (the loop's main task then
                sleeping) to the task's first line
  build         making the chunk's op (the example's ``eager_op``)
  to encoder    from the call of ``.wait(stream=)`` to the first line of the encoder's first
                step (``do.interop.torch``'s ``fn``): the await's start, the audio's upload op,
                the hand-over of a new deviceop tensor to PyTorch
  cached        the same for an op that hands an already uploaded tensor to PyTorch (its view
                made before)
  upload        ``do.from_numpy`` of the chunk's audio alone, enqueued (``submit``), to the
                enqueue's return
  blocking      the blocking loop's upload: ``torch.from_numpy(x).to("cuda")``

Each is timed after 2 ms of yielding to the loop, as the example's loop does before a chunk
arrives (a thread that slept starts slowly). Medians and p90 over ``--chunks`` chunks, in µs.

    python experiments/asr_start_cost.py --out asr_start_cost.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples", "asr_stream"))
sys.path.insert(0, os.path.dirname(HERE))

import run as asr  # the example's encoder and audio

import deviceop as do


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=200)
    ap.add_argument("--every", type=float, default=0.02, help="seconds between chunks")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    ns = argparse.Namespace(
        wav=os.path.join(os.path.dirname(HERE), "examples", "asr_stream", "speech.wav"),
        chunk=0.32,
        context=2.0,
        vad_mode=2,
        voiced_fraction=0.3,
        interrupt_every=0,
        interrupt_after=0.001,
        speed=1.0,
    )
    st = asr.Stream(ns)
    import torch

    dev = "cuda" if do.backend_name() == "cuda" else "cpu"
    enc = asr.Encoder(dev, a.width, a.layers)
    n = len(enc.layers)
    group = -(-n // 8)
    stream = do.next_stream()
    mark = [0.0]

    def features(x):
        mark[0] = time.perf_counter()
        return enc.features(x)

    def head(h):
        return enc.head(h)

    def eager_op(c):  # as the example's deviceop-torch loop builds it
        op = do.interop.torch(features, do.from_numpy(c.context))
        for lo in range(0, n, group):
            op = op.then(lambda h, lo=lo: do.interop.torch(enc.block, h, lo, min(n, lo + group)))
        return op.then(lambda h: do.interop.torch(head, h)).then(do.to_numpy)

    x_cached = do.from_numpy(st.chunks[0].context).sync_on(stream)
    rows: dict[str, list[float]] = {
        k: [] for k in ("task_start", "build", "to_encoder", "cached", "upload", "blocking")
    }

    async def chunk(c, t_sched):
        t_task = time.perf_counter()
        rows["task_start"].append(t_task - t_sched)
        op = eager_op(c)
        t_built = time.perf_counter()
        rows["build"].append(t_built - t_task)
        await op.wait(stream=stream)
        rows["to_encoder"].append(mark[0] - t_built)

    async def hot(seconds: float) -> None:
        # as the example's loop before a chunk's arrival: yield to the loop until then, so the
        # core is awake when the chunk comes (a thread that slept long starts slowly)
        t = time.perf_counter() + seconds
        while time.perf_counter() < t:
            await asyncio.sleep(0)

    async def run() -> None:
        for i in range(a.chunks + 5):
            c = st.chunks[i % len(st.chunks)]
            await hot(2e-3)
            t_sched = time.perf_counter()
            task = asyncio.ensure_future(chunk(c, t_sched))
            await asyncio.sleep(a.every / 2)
            await task
            await hot(2e-3)
            t0 = time.perf_counter()
            await do.interop.torch(features, x_cached).wait(stream=stream)
            rows["cached"].append(mark[0] - t0)
            await hot(2e-3)
            t0 = time.perf_counter()
            fut = do.from_numpy(c.context).submit(stream=stream)
            rows["upload"].append(time.perf_counter() - t0)
            await fut
            await hot(2e-3)
            t0 = time.perf_counter()
            torch.from_numpy(c.context).to(dev, non_blocking=False)
            rows["blocking"].append(time.perf_counter() - t0)
            await asyncio.sleep(a.every / 2)
            if i == 4:
                for v in rows.values():
                    v.clear()

    try:
        import uvloop

        uvloop.run(run())
    except ImportError:
        asyncio.run(run())
    out = {
        k: {"p50_us": 1e6 * statistics.median(v), "p90_us": 1e6 * float(np.percentile(v, 90)), "n": len(v)}
        for k, v in rows.items()
    }
    out["backend"] = do.backend_name()
    for k, v in out.items():
        if isinstance(v, dict):
            print(f"{k:12s} p50 {v['p50_us']:8.1f} us  p90 {v['p90_us']:8.1f} us")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
