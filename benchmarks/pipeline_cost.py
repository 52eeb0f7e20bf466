"""Host CPU per request of a service's pipeline, written as a user writes it, beside PyTorch.

One request: ``from_numpy`` of a (16, 2048) float16 input, then S steps of (gemm, gelu, gemm),
each into buffers allocated for the request, then ``to_numpy``. Weights are shared. The same
work in PyTorch (``torch.matmul``, ``F.gelu(approximate="tanh")``, ``.cpu()``) in the same
process. Measured for S in {1, 8, 32}:

  one at a time   deviceop ``request(x).sync()``, and ``await request(x)`` in turn in one
                  loop (uvloop), also with each request in a task of its own (as ``gather``
                  makes them: the tasks' own cost); PyTorch with a ``.cpu()`` per request
  64 in flight    deviceop: 64 requests gathered in that loop (``asyncio.gather``, a task
                  each), and 64 submitted in that loop then each future awaited in turn
                  ("start now, await later"); PyTorch: the 64 requests' work enqueued, each
                  copied to pinned memory without blocking, one synchronize per round
                  (PyTorch's cheapest host path)

Host CPU is the process's CPU time (every thread: the driver's, deviceop's, PyTorch's) per
request; wall time per request too. Rounds run every variant in turn; medians over --rounds
(by default as many as fill about 3 s, 15 to 61: the host's speed moves within seconds) after a
warm-up: at least two passes over every variant, more while any deviceop variant records more
than one GEMM in a pass (a service runs for hours: its steady state is measured), stopping after
the first pass past --warmup seconds (each result says how many passes and seconds it took, and
whether that check was met). The ratios
of the gathered requests' CPU to the others' are taken per round, then the median. Results
are checked against PyTorch's.

    python benchmarks/pipeline_cost.py --out pipeline_cost.json
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

from _harness import description

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


def variants(request, torch_work, torch_request, xs, width: int) -> tuple[dict, asyncio.AbstractEventLoop]:
    """The five ways to serve ``xs``, each a callable that serves them all: deviceop synchronous
    one at a time, awaited one at a time and ``width`` gathered in one loop (uvloop where
    installed); PyTorch one at a time and ``width`` in flight."""
    import torch

    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()

    def sync_one() -> None:
        for x in xs:
            request(x).sync()

    async def awaited() -> None:
        for x in xs:
            await request(x)

    async def awaited_tasks() -> None:
        # one at a time as well, each in a task of its own as asyncio.gather makes: what the
        # gathered requests' tasks cost apart from having 64 requests alive at once
        for x in xs:
            await asyncio.ensure_future(request(x))

    async def gathered() -> None:
        for i in range(0, len(xs), width):
            await asyncio.gather(*(request(x) for x in xs[i : i + width]))

    async def submitted() -> None:
        for i in range(0, len(xs), width):
            futs = [request(x).submit() for x in xs[i : i + width]]
            for f in futs:
                await f

    pinned = [torch.empty((B, D), dtype=torch.float16).pin_memory() for _ in range(width)]

    def torch_one() -> None:
        for x in xs:
            torch_request(x)
        torch.cuda.synchronize()

    def torch_in_flight() -> None:
        for i in range(0, len(xs), width):
            for k, x in enumerate(xs[i : i + width]):
                pinned[k].copy_(torch_work(x), non_blocking=True)
            torch.cuda.synchronize()
            _ = [p.numpy() for p in pinned]

    return {
        "deviceop_sync_one_at_a_time": sync_one,
        "deviceop_awaited_one_at_a_time": lambda: loop.run_until_complete(awaited()),
        "deviceop_tasks_one_at_a_time": lambda: loop.run_until_complete(awaited_tasks()),
        "deviceop_gathered": lambda: loop.run_until_complete(gathered()),
        "deviceop_submitted": lambda: loop.run_until_complete(submitted()),
        "torch_one_at_a_time": torch_one,
        "torch_in_flight": torch_in_flight,
    }, loop


def measure(fns: dict, rounds: int, n: int, gemm_counts=None, warmup_s: float = 20.0) -> dict:
    """Warm up, then ``rounds`` rounds of every variant in turn (0: as many as fill about 3 s,
    from 15 to 61: on a host whose speed moves within seconds, short rounds need many, and
    long ones enough for a steady median). Per request: CPU and wall medians; ratios of the
    gathered requests' CPU to the one-at-a-time variants', per round, then the median.
    ``gemm_counts``: a function giving the GEMM replay table's (recordings, replays) so far;
    each variant's GEMMs replayed per request and recordings per round are then reported (a
    GEMM not replayed is a direct cuBLASLt call, which costs more host time). The warm-up
    makes at least two passes over every variant, more while any deviceop variant records more
    than one GEMM in a pass, and stops after the first pass past ``warmup_s``;
    ``warmup`` reports its passes, seconds and whether that check was met (``settled``; None
    without ``gemm_counts``: one pass)."""
    t_warm = time.perf_counter()
    passes = 0
    settled: bool | None = None
    while True:  # warm-up: plans, cuBLAS heuristics, pools, and the GEMM replay table's recordings
        # a service runs for hours: measure once no variant records more than one GEMM in a pass,
        # or after warmup_s. Each variant on its own: 64 requests in flight hold 64 sets of
        # buffers, whose calls are many more keys than one request's, recorded as fast as
        # replays earn the credit; and not as a share of its replays, which a variant whose
        # recordings the credit paces stays under while it still records
        settled = True
        for k, f in fns.items():
            g0 = gemm_counts() if gemm_counts else (0, 0)
            f()
            g1 = gemm_counts() if gemm_counts else (0, 0)
            if k.startswith("deviceop") and g1[0] - g0[0] > 1:
                settled = False
        passes += 1
        if gemm_counts is None:
            settled = None
            break
        if (settled and passes >= 2) or time.perf_counter() - t_warm > warmup_s:
            break
    warm = {"passes": passes, "seconds": time.perf_counter() - t_warm, "settled": settled}
    if rounds <= 0:
        t0 = time.perf_counter()
        for f in fns.values():
            f()
        rounds = min(61, max(15, math.ceil(3.0 / (time.perf_counter() - t0))))
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in fns}
    gemms = {k: [0, 0] for k in fns}  # recordings, replays during the variant's rounds
    for _ in range(rounds):
        for k, f in fns.items():
            g0 = gemm_counts() if gemm_counts else (0, 0)
            c, w = _cpu_wall(f)
            g1 = gemm_counts() if gemm_counts else (0, 0)
            gemms[k][0] += g1[0] - g0[0]
            gemms[k][1] += g1[1] - g0[1]
            got[k].append((c / n * 1e6, w / n * 1e6))
    out: dict = {"requests_per_round": n, "rounds": rounds, "warmup": warm}
    for k, v in got.items():
        out[k] = {
            "cpu_us": statistics.median(c for c, _ in v),
            "wall_us": statistics.median(w for _, w in v),
            "cpu_us_min_max": [min(c for c, _ in v), max(c for c, _ in v)],
        }
        if gemm_counts and k.startswith("deviceop"):
            out[k]["gemm_recorded_per_round"] = gemms[k][0] / rounds
            out[k]["gemm_replayed_per_request"] = gemms[k][1] / (rounds * n)

    def per_round(num: str, den: str) -> tuple[float, list[float]]:
        r = [a / b for (a, _), (b, _) in zip(got[num], got[den])]
        return statistics.median(r), [min(r), max(r)]

    for base in (
        "deviceop_awaited_one_at_a_time",
        "deviceop_tasks_one_at_a_time",
        "deviceop_sync_one_at_a_time",
        "torch_in_flight",
    ):
        out[f"gathered_cpu_over_{base}"], out[f"gathered_cpu_over_{base}_min_max"] = per_round(
            "deviceop_gathered", base
        )
    out["awaited_cpu_over_torch_one_at_a_time"], out["awaited_cpu_over_torch_one_at_a_time_min_max"] = per_round(
        "deviceop_awaited_one_at_a_time", "torch_one_at_a_time"
    )
    if "deviceop_submitted" in got:
        key = "submitted_cpu_over_deviceop_awaited_one_at_a_time"
        out[key], out[f"{key}_min_max"] = per_round("deviceop_submitted", "deviceop_awaited_one_at_a_time")
    return out


def check(request, torch_request) -> float:
    x = (np.random.default_rng(1).standard_normal((B, D))).astype(np.float16)
    a = request(x).sync().astype(np.float32)
    b = torch_request(x).astype(np.float32)
    err = float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-6))
    if not err < 2e-2:
        raise SystemExit(f"deviceop and PyTorch disagree: relative max error {err}")
    return err


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--steps", default="1,8,32")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument(
        "--rounds", type=int, default=0, help="rounds per measurement (0: enough for about 3 s, at least 15)"
    )
    ap.add_argument(
        "--warmup", type=float, default=20.0, help="seconds after which the warm-up stops (after that pass)"
    )
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if not 0 <= a.warmup < math.inf:
        ap.error(f"--warmup is a number of seconds, 0 or more, got {a.warmup}")
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
        fns, loop = variants(request, torch_work, torch_request, xs, a.width)
        from deviceop.kernels._gemm import GEMM  # (what the GEMM replay table learned, for the record)

        rp = GEMM.replays
        try:
            # each request makes 2 * steps GEMMs: how many of them a variant replays
            r = measure(fns, a.rounds, len(xs), lambda: (rp.recorded, rp.replays), a.warmup)
        finally:
            loop.close()
        r["gemm_replays"] = {
            "recorded": rp.recorded,
            "replays": rp.replays,
            "cost": rp.cost,
            "kept": len(rp),  # (entries: recordings, and failed ones remembered)
            "evicted": rp.evicted,
        }
        doc["results"].append({"steps": steps, "max_rel_err_vs_torch": err, **r})
        line = "  ".join(f"{k.replace('deviceop_', '')} {r[k]['cpu_us']:.0f}" for k in fns)
        print(f"steps={steps:<3} CPU us/request: {line}", flush=True)
        print(
            f"          gathered / awaited one at a time {r['gathered_cpu_over_deviceop_awaited_one_at_a_time']:.3f}x"
            f"  / as tasks one at a time {r['gathered_cpu_over_deviceop_tasks_one_at_a_time']:.3f}x"
            f"  / sync one at a time {r['gathered_cpu_over_deviceop_sync_one_at_a_time']:.3f}x"
            f"  / torch in flight {r['gathered_cpu_over_torch_in_flight']:.3f}x"
            f"  (after {r['warmup']['passes']} warm-up passes, {r['warmup']['seconds']:.1f} s"
            f"{'' if r['warmup']['settled'] else ', still recording'})",
            flush=True,
        )
        print(
            f"          submitted then awaited / awaited one at a time "
            f"{r['submitted_cpu_over_deviceop_awaited_one_at_a_time']:.3f}x",
            flush=True,
        )
        print(
            f"          GEMMs replayed of {2 * steps} a request: "
            + "  ".join(
                f"{k.replace('deviceop_', '')} {r[k]['gemm_replayed_per_request']:.1f}"
                for k in fns
                if k in r and "gemm_replayed_per_request" in r[k]
            ),
            flush=True,
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
