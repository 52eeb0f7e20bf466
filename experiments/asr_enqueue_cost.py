"""Where the speech loop's encoder enqueue takes longer under deviceop than in blocking PyTorch.

The speech example's deviceop-torch loop spends longer from its encoder's first line to its last
(the "enqueue" stage) than the blocking loop does. With the example's encoder (``--width``,
``--layers``; 2 s of audio), each variant in turn, ``--reps`` times after a warm-up, every run
after a device sync; host time from the encoder's first line to its last (µs, median and p90):

  default       ``enc(x)`` on PyTorch's default stream (the blocking loop)
  external      the same with an ExternalStream of a deviceop pool stream current
  adapter       ``do.interop.torch(enc, t).sync_on(s)``: the encoder as one adapter step
  steps         the example's chain: features, ``--steps`` groups of layers and the head, each
                an adapter step, ``sync_on``
  steps_await   the same awaited in a uvloop loop, with the example's enqueue slice
  steps_slice0  the same with enqueue slice 0 (the chain enqueued whole)

    python experiments/asr_enqueue_cost.py --out asr_enqueue_cost.json
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

import run as asr  # the example's encoder

import deviceop as do


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--slice", type=float, default=2.5e-4)
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    import torch

    enc = asr.Encoder("cuda", a.width, a.layers)
    x_np = (np.random.default_rng(0).standard_normal(2 * 16000) * 0.1).astype(np.float32)
    xg = torch.from_numpy(x_np).cuda()
    s = do.next_stream()
    ts = torch.cuda.ExternalStream(s.handle_int)
    dx = do.from_numpy(x_np).sync_on(s)
    span = [0.0, 0.0]
    n = len(enc.layers)
    group = max(1, -(-n // a.steps))

    def features(x):  # type: ignore[no-untyped-def]
        span[0] = time.perf_counter()
        return enc.features(x)

    def head(h):  # type: ignore[no-untyped-def]
        y = enc.head(h)
        span[1] = time.perf_counter()
        return y

    def whole(x):  # type: ignore[no-untyped-def]
        return head(enc.block(features(x), 0, n))

    def chain() -> do.DeviceOp:
        op = do.interop.torch(features, dx)
        for lo in range(0, n, group):
            op = op.then(lambda h, lo=lo: do.interop.torch(enc.block, h, lo, min(n, lo + group)))
        return op.then(lambda h: do.interop.torch(head, h))

    def default() -> None:
        whole(xg)

    def external() -> None:
        with torch.cuda.stream(ts):
            whole(xg)

    def adapter() -> None:
        do.interop.torch(whole, dx).sync_on(s)

    def steps() -> None:
        chain().sync_on(s)

    async def awaited(slice_s: float) -> None:
        do.set_enqueue_slice(slice_s)
        await chain().wait(stream=s)

    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run

    variants = {
        "default": default,
        "external": external,
        "adapter": adapter,
        "steps": steps,
        "steps_await": lambda: runner(awaited(a.slice)),
        "steps_slice0": lambda: runner(awaited(0.0)),
    }
    got: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(a.reps + 5):
        for k, f in variants.items():  # in turn: drift of the host's speed hits every variant alike
            torch.cuda.synchronize()
            f()
            torch.cuda.synchronize()
            if r >= 5:
                got[k].append(1e6 * (span[1] - span[0]))
    doc: dict = {"experiment": "asr_enqueue_cost", "config": vars(a), "enqueue_us": {}}
    for k, v in got.items():
        v.sort()
        doc["enqueue_us"][k] = {"p50": statistics.median(v), "p90": v[int(0.9 * (len(v) - 1))]}
        print(f"{k:14s} p50 {doc['enqueue_us'][k]['p50']:8.1f} us  p90 {doc['enqueue_us'][k]['p90']:8.1f} us")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(doc, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
