"""Host CPU per request of a service's pipeline, written as a user writes it, beside PyTorch.

One request: ``from_numpy`` of a (16, 2048) float16 input, then S steps of (gemm, gelu, gemm),
each into buffers allocated for the request, then ``to_numpy``. Weights are shared. The same
work in PyTorch (``torch.matmul``, ``F.gelu(approximate="tanh")``, ``.cpu()``) in the same
process. Measured for S in {1, 8, 32}:

  one at a time   deviceop ``request(x).sync()`` / PyTorch with a ``.cpu()`` per request
  64 in flight    deviceop: 64 asyncio tasks (uvloop) awaiting ``request(x)``; PyTorch: the
                  64 requests' work enqueued, each copied to pinned memory without blocking,
                  one synchronize per round (PyTorch's cheapest host path)

Host CPU is the process's CPU time (every thread: the driver's, deviceop's, PyTorch's) per
request; wall time per request too. Rounds alternate deviceop and PyTorch; medians over
--rounds after a warm-up round (by default as many as fill about 3 s, 15 to 61: the host's speed
moves within seconds, and one round of a 1-step request lasts 25 ms); results are checked
against each other.

    python experiments/pipeline_cost.py --out pipeline_cost.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deviceop as do

K = do.kernels
B, D = 16, 2048


def build(steps: int, seed: int = 0):
    """The request pipelines (deviceop and PyTorch) over one set of shared weights."""
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(seed)
    w_np = [(rng.standard_normal((D, D)) / np.sqrt(D)).astype(np.float16) for _ in range(2 * steps)]
    s0 = do.streams()[0]
    W = [do.from_numpy(w).sync_on(s0) for w in w_np]
    TW = [torch.from_numpy(w).cuda() for w in w_np]

    def layer(x, w1, w2):
        # as a user writes it: a fresh buffer for every result
        return (
            do.empty((B, D), do.float16)
            .then(lambda h: K.gemm(h, x, w1))
            .map(lambda r: r[0])
            .then(lambda h: do.empty((B, D), do.float16).then(lambda g: K.gelu(g.partition((1, D)), h)))
            .map(lambda r: r[0].tensor)
            .then(lambda g: do.empty((B, D), do.float16).then(lambda y: K.gemm(y, g, w2)))
            .map(lambda r: r[0])
        )

    def request(x_np):
        op = do.from_numpy(x_np)
        for i in range(steps):
            op = op.then(lambda x, i=i: layer(x, W[2 * i], W[2 * i + 1]))
        return do.to_numpy(op)

    def torch_work(x_np):
        x = torch.from_numpy(x_np).cuda(non_blocking=True)
        for i in range(steps):
            x = F.gelu(x @ TW[2 * i], approximate="tanh") @ TW[2 * i + 1]
        return x

    def torch_request(x_np):
        return torch_work(x_np).cpu().numpy()

    return request, torch_work, torch_request


def _cpu_wall(fn) -> tuple[float, float]:
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c0, time.perf_counter() - t0


def one_at_a_time(request, torch_request, xs, rounds: int) -> dict:
    import torch

    def dev() -> None:
        for x in xs:
            request(x).sync()

    def tor() -> None:
        for x in xs:
            torch_request(x)
        torch.cuda.synchronize()

    return _alternate(dev, tor, rounds, len(xs))


def _alternate(dev, tor, rounds: int, n: int) -> dict:
    """Warm up, then ``rounds`` rounds of ``dev`` and ``tor`` in turn (0: as many as fill about
    3 s, from 15 to 61: on a host whose speed moves within seconds, short rounds need many, and
    long ones enough for a steady median)."""
    dev(), tor()  # warm-up: plans, cuBLAS heuristics, pools
    if rounds <= 0:
        t0 = time.perf_counter()
        dev(), tor()
        rounds = min(61, max(15, math.ceil(3.0 / (time.perf_counter() - t0))))
    d, t = [], []
    for _ in range(rounds):
        d.append(_cpu_wall(dev))
        t.append(_cpu_wall(tor))
    return _summarize(d, t, n)


def in_flight(request, torch_work, xs, rounds: int, width: int) -> dict:
    import torch

    loop_policy = None
    try:
        import uvloop

        loop_policy = uvloop.EventLoopPolicy()
    except ImportError:
        pass
    if loop_policy is not None:
        asyncio.set_event_loop_policy(loop_policy)

    async def serve() -> None:
        for i in range(0, len(xs), width):
            await asyncio.gather(*(request(x) for x in xs[i : i + width]))

    pinned = [torch.empty((B, D), dtype=torch.float16).pin_memory() for _ in range(width)]

    def tor() -> None:
        for i in range(0, len(xs), width):
            for k, x in enumerate(xs[i : i + width]):
                pinned[k].copy_(torch_work(x), non_blocking=True)
            torch.cuda.synchronize()
            _ = [p.numpy() for p in pinned]

    loop = asyncio.new_event_loop()
    try:
        return _alternate(lambda: loop.run_until_complete(serve()), tor, rounds, len(xs))
    finally:
        loop.close()


def _summarize(d: list, t: list, n: int) -> dict:
    dc = [c / n * 1e6 for c, _ in d]
    tc = [c / n * 1e6 for c, _ in t]
    return {
        "requests_per_round": n,
        "rounds": len(d),
        "deviceop_cpu_us": statistics.median(dc),
        "torch_cpu_us": statistics.median(tc),
        "cpu_ratio_median_of_rounds": statistics.median(a / b for a, b in zip(dc, tc)),
        "deviceop_wall_us": statistics.median(w / n * 1e6 for _, w in d),
        "torch_wall_us": statistics.median(w / n * 1e6 for _, w in t),
        "deviceop_cpu_us_rounds": dc,
        "torch_cpu_us_rounds": tc,
    }


def check(request, torch_request) -> float:
    x = (np.random.default_rng(1).standard_normal((B, D))).astype(np.float16)
    a = request(x).sync().astype(np.float32)
    b = torch_request(x).astype(np.float32)
    err = float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-6))
    if not err < 2e-2:
        raise SystemExit(f"deviceop and PyTorch disagree: relative max error {err}")
    return err


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default="1,8,32")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument(
        "--rounds", type=int, default=0, help="rounds per measurement (0: enough for about 3 s, at least 15)"
    )
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from exec_modes import machine_info

    xs = [np.random.default_rng(i).standard_normal((B, D)).astype(np.float16) for i in range(a.requests)]
    doc: dict = {
        "experiment": "pipeline_cost",
        "machine": machine_info(),
        "batch": B,
        "width_d": D,
        "in_flight": a.width,
        "rounds": a.rounds or "auto (each result says how many)",
        "results": [],
    }
    for steps in [int(v) for v in a.steps.split(",") if v]:
        request, torch_work, torch_request = build(steps)
        err = check(request, torch_request)
        one = one_at_a_time(request, torch_request, xs[: max(a.requests // 4, 16)], a.rounds)
        many = in_flight(request, torch_work, xs, a.rounds, a.width)
        doc["results"].append({"steps": steps, "max_rel_err_vs_torch": err, "one_at_a_time": one, "in_flight": many})
        for name, r in (("one at a time", one), (f"{a.width} in flight", many)):
            print(
                f"steps={steps:<3} {name:<14} deviceop {r['deviceop_cpu_us']:8.1f} us CPU/req  "
                f"torch {r['torch_cpu_us']:8.1f}  ratio {r['cpu_ratio_median_of_rounds']:.3f}x  "
                f"(wall {r['deviceop_wall_us']:.1f} vs {r['torch_wall_us']:.1f} us/req)",
                flush=True,
            )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
