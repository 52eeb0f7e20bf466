"""Host time of enqueuing one request (``start``: the op's run up to the completion record) one
at a time against 64 started back to back, by request variant, without an event loop.

A request is the service pipeline of ``pipeline_cost.py`` at one step (``full``: from_numpy,
gemm, gelu, gemm, to_numpy, each into fresh buffers) or a part of it: ``io`` (from_numpy then
to_numpy), ``gemm``, ``gelu`` and ``empty`` (one allocation) between the two copies. "One at a
time" waits for each request's stream before the next starts; "64 back to back" starts 64 on
the stream pool round-robin and then waits. Medians of 15 rounds of 64 requests, in µs.

    python experiments/start_in_flight.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deviceop as do
from deviceop._core._op import start

K = do.kernels
B, D = 16, 2048


def main() -> None:
    rng = np.random.default_rng(0)
    w1, w2 = (do.from_numpy((rng.standard_normal((D, D)) / 45).astype(np.float16)).sync() for _ in range(2))
    xs = [np.random.default_rng(i).standard_normal((B, D)).astype(np.float16) for i in range(64)]

    def empty():
        return do.empty((B, D), do.float16)

    def full(x):
        return do.to_numpy(
            do.from_numpy(x).then(
                lambda x: (
                    empty()
                    .then(lambda h: K.gemm(h, x, w1))
                    .map(lambda r: r[0])
                    .then(lambda h: empty().then(lambda g: K.gelu(g.partition((1, D)), h)))
                    .map(lambda r: r[0].tensor)
                    .then(lambda g: empty().then(lambda y: K.gemm(y, g, w2)))
                    .map(lambda r: r[0])
                )
            )
        )

    variants = {
        "full": full,
        "io": lambda x: do.to_numpy(do.from_numpy(x)),
        "gemm": lambda x: do.to_numpy(
            do.from_numpy(x).then(lambda a: empty().then(lambda h: K.gemm(h, a, w1))).map(lambda r: r[0])
        ),
        "gelu": lambda x: do.to_numpy(
            do.from_numpy(x)
            .then(lambda a: empty().then(lambda g: K.gelu(g.partition((1, D)), a)))
            .map(lambda r: r[0].tensor)
        ),
        "empty": lambda x: do.to_numpy(do.from_numpy(x).then(lambda a: empty().map(lambda _e: a))),
    }
    streams = do.streams()

    def one_at_a_time(make) -> float:
        spent = 0
        for i, x in enumerate(xs):
            op, s = make(x), streams[i % len(streams)]
            t0 = time.perf_counter_ns()
            cx, _ = start(op, s, "start_in_flight")
            spent += time.perf_counter_ns() - t0
            s.synchronize()
            cx.finish()
        return spent / len(xs) / 1e3

    def back_to_back(make) -> float:
        spent, started = 0, []
        for i, x in enumerate(xs):
            op, s = make(x), streams[i % len(streams)]
            t0 = time.perf_counter_ns()
            cx, _ = start(op, s, "start_in_flight")
            spent += time.perf_counter_ns() - t0
            started.append(cx)
        for s in streams:
            s.synchronize()
        for cx in started:
            cx.finish()
        return spent / len(xs) / 1e3

    print("streams", len(streams))
    for name, make in variants.items():
        one_at_a_time(make), back_to_back(make)  # warm-up: plans, pools, replays
        r1 = statistics.median(one_at_a_time(make) for _ in range(15))
        r64 = statistics.median(back_to_back(make) for _ in range(15))
        print(f"{name:6s} start us: one at a time {r1:7.2f}   64 back to back {r64:7.2f}")


if __name__ == "__main__":
    main()
