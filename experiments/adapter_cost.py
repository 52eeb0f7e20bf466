"""The host cost of PyTorch code run through ``do.interop.torch``, per step and by part.

A chain of K steps, each a small PyTorch call (``h + 1`` on 4,096 floats: a launch and an
allocation from PyTorch's caching allocator), medians over --reps after a warm-up, host CPU:

  direct          the K calls in PyTorch, its current stream set to the stream, one synchronize
  chain           one op: ``do.interop.torch(f, x)`` then K - 1 steps ``lambda h:
                  do.interop.torch(f, h)``, each taking the tensor the step before returned (as a
                  model split into steps does), ``sync_on`` the stream
  chain_await     the same op awaited in a uvloop loop (``await op.wait(stream=s)``), with the
                  default enqueue slice and with 0 (the whole chain enqueued at once): what the
                  loop's turns between steps add
  same            K steps through the adapter on the same three deviceop tensors
                  (``torch.add(x, y, out=z)``, --calls of them): the adapter's fixed cost, no new
                  tensor

and by part (µs per call): a PyTorch tensor made for a deviceop tensor that never reached PyTorch
(``new_view``), for one that did (``cached_view``), and ``t.detach()`` alone; and the wall time a
step of ``chain`` spends in each of the adapter's pieces (``pieces_us``: its output made a
deviceop tensor, ``_outputs``, of which the memory's region, ``buffer_for``; its input made a
PyTorch tensor, ``_view``; PyTorch's current stream set and restored, ``_enter`` and ``_leave``;
each timed by a wrapper, which adds its own cost).

A real program's boundaries run cold: ``--idle S`` sleeps S seconds before every repetition (a
streaming loop waiting for its next chunk), and ``--calls N`` makes each step N PyTorch calls (a
model's layers between two boundaries, whose host code evicts the adapter's from the caches).

    python experiments/adapter_cost.py --out adapter_cost.json
    python experiments/adapter_cost.py --calls 24 --idle 0.1 --reps 40 --out adapter_cost_cold.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deviceop as do


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--calls", type=int, default=1, help="PyTorch calls (h + 1) per step")
    ap.add_argument("--idle", type=float, default=0.0, help="seconds slept before every repetition")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.steps < 1 or a.reps < 1 or a.calls < 1 or a.idle < 0:
        ap.error("need --steps >= 1, --reps >= 1, --calls >= 1 and --idle >= 0")

    import torch

    from deviceop.interop import _torch as adapter

    K = a.steps
    s = do.streams()[0]
    ts = torch.cuda.ExternalStream(s.handle_int)
    x = torch.ones(4096, device="cuda")
    dx = do.from_dlpack(x)
    da, db, dc = (do.from_dlpack(torch.ones(4096, device="cuda")) for _ in range(3))
    torch.cuda.synchronize()
    C = a.calls

    def f(h: torch.Tensor) -> torch.Tensor:
        for _ in range(C):
            h = h + 1
        return h

    def add(p: torch.Tensor, q: torch.Tensor, r: torch.Tensor) -> None:
        for _ in range(C):
            torch.add(p, q, out=r)

    def direct() -> None:
        with torch.cuda.stream(ts):
            h = x
            for _ in range(K):
                h = f(h)
        s.synchronize()

    def chain_op() -> do.DeviceOp:
        op = do.interop.torch(f, dx)
        for _ in range(K - 1):
            op = op.then(lambda h: do.interop.torch(f, h))
        return op

    def chain() -> None:
        chain_op().sync_on(s)

    def same() -> None:
        op = do.value(None)
        for _ in range(K):
            op = op.then(lambda _: do.interop.torch(add, da, db, dc, writes=(dc,)))
        op.sync_on(s)

    fns = {"direct": direct, "chain": chain, "same": same}
    for fn in fns.values():
        for _ in range(10):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(a.reps):  # interleaved: drift of the host's speed hits every variant alike
        for k, fn in fns.items():
            if a.idle:
                time.sleep(a.idle)
            t0 = time.process_time_ns()
            fn()
            times[k].append((time.process_time_ns() - t0) / 1e3 / K)

    async def awaited(slice_s: float) -> list[float]:
        do.set_enqueue_slice(slice_s)
        out = []
        for i in range(a.reps + 10):
            if a.idle and i >= 10:
                await asyncio.sleep(a.idle)
            t0 = time.process_time_ns()
            await chain_op().wait(stream=s)
            if i >= 10:
                out.append((time.process_time_ns() - t0) / 1e3 / K)
        return out

    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    default_slice = do.enqueue_slice()
    times["chain_await"] = runner(awaited(default_slice))
    times["chain_await_slice0"] = runner(awaited(0.0))
    do.set_enqueue_slice(default_slice)

    # by part
    fresh = [do.empty((4096,), do.float32).sync_on(s) for _ in range(a.reps)]
    th = adapter._torch()
    parts: dict[str, list[float]] = {"new_view": [], "cached_view": [], "detach": []}
    with torch.cuda.stream(ts):
        for t in fresh:
            t0 = time.perf_counter_ns()
            adapter._view(th, t)
            t1 = time.perf_counter_ns()
            adapter._view(th, t)
            t2 = time.perf_counter_ns()
            x.detach()
            t3 = time.perf_counter_ns()
            parts["new_view"].append((t1 - t0) / 1e3)
            parts["cached_view"].append((t2 - t1) / 1e3)
            parts["detach"].append((t3 - t2) / 1e3)

    # the adapter's pieces in a step of the chain, each timed by a wrapper
    spent: dict[str, float] = dict.fromkeys(("_outputs", "buffer_for", "_view", "_enter", "_leave"), 0.0)

    def timed(name: str) -> None:
        real = getattr(adapter, name)

        def wrapped(*args: object) -> object:
            t0 = time.perf_counter()
            try:
                return real(*args)
            finally:
                spent[name] += time.perf_counter() - t0

        setattr(adapter, name, wrapped)

    for name in spent:
        timed(name)
    n = max(a.reps // 2, 1)
    for _ in range(n):
        if a.idle:
            time.sleep(a.idle)
        chain()

    doc: dict = {
        "experiment": "adapter_cost",
        "steps": K,
        "calls_per_step": C,
        "idle_s": a.idle,
        "reps": a.reps,
        "per_step_us": {},
        "part_us": {},
        "pieces_us": {k: 1e6 * v / (n * K) for k, v in spent.items()},
    }
    for k, v in times.items():
        doc["per_step_us"][k] = statistics.median(v)
    for k, v in parts.items():
        doc["part_us"][k] = statistics.median(v)
    d = doc["per_step_us"]
    doc["over_direct_us"] = {k: d[k] - d["direct"] for k in d if k != "direct"}
    print(
        "per step, host CPU µs: "
        + ", ".join(f"{k} {v:.2f}" for k, v in d.items())
        + "\nover direct: "
        + ", ".join(f"{k} +{v:.2f}" for k, v in doc["over_direct_us"].items())
        + "\nparts: "
        + ", ".join(f"{k} {v:.2f}" for k, v in doc["part_us"].items())
        + "\npieces of a chain's step (wall µs): "
        + ", ".join(f"{k} {v:.2f}" for k, v in doc["pieces_us"].items())
    )
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(doc, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
