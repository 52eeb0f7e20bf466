"""Another library's work inside deviceop pipelines: its host cost, and a PyTorch MLP served.

1. Host cost of an external step (``do.external``) over calling the library directly. The
   library call is ``torch.add(a, b, out=c)`` on small tensors (a launch of a few µs of host
   time). Per step, median over --reps, after warm-up:

     direct      N calls with PyTorch's current stream set to the stream, then one synchronize
     external    one op chaining N ``do.external`` steps (``reads=(a, b)``, ``writes=(c,)``;
                 PyTorch's current stream set to the op's stream by the user, as for direct),
                 ``sync_on`` the same stream; and the same naming deviceop views of a, b, c
                 made once (``do.from_dlpack``), the cheaper way to name foreign memory
     adapter     the same N steps through ``do.interop.torch`` (which sets the stream and turns
                 deviceop tensors into PyTorch tensors for every call)

   and one op per terminal: ``external(...).sync_on(s)`` against a direct call plus
   ``synchronize``; and deviceop's own part of a step (the external steps with an ``fn`` that
   enqueues nothing). Process CPU, and the calling thread's alone (``*_thread_us``).

2. A PyTorch MLP (8 x Linear(2048, 2048) + GELU, float16, batch 16) served per request from
   one asyncio loop (uvloop): a request copies a numpy input to the GPU, runs the MLP, copies
   the result back. One request at a time and 64 in flight, as

     torch blocking   the handler runs the PyTorch code and ``.cpu()`` (blocks the loop)
     to_thread        ``await asyncio.to_thread(...)`` of the same code
     deviceop         ``await do.from_numpy(x).then(lambda t: do.interop.torch(mlp, t)).then(do.to_numpy)``

   Throughput (requests/s over wall time) and host CPU per request (process CPU time over
   requests, every thread); results checked against the blocking ones.

    python benchmarks/external_cost.py --out external_cost.json
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _harness import description

import deviceop as do


def step_cost(n: int, reps: int, profile: bool = False) -> dict:
    import torch

    s = do.streams()[0]
    ts = torch.cuda.ExternalStream(s.handle_int)
    a = torch.ones(4096, device="cuda")
    b = torch.ones(4096, device="cuda")
    c = torch.empty(4096, device="cuda")
    da = do.from_dlpack(a)
    db = do.from_dlpack(b)
    dc = do.from_dlpack(c)
    torch.cuda.synchronize()

    def lib(stream, *_):
        torch.add(a, b, out=c)

    def noop(stream, *_):
        pass

    def direct():
        with torch.cuda.stream(ts):
            for _ in range(n):
                torch.add(a, b, out=c)
        s.synchronize()

    def chained():
        op = do.value(None)
        for _ in range(n):
            op = op.then(lambda _: do.external(lib, reads=(a, b), writes=(c,)))
        with torch.cuda.stream(ts):
            op.sync_on(s)

    def chained_wrapped():  # the same, naming deviceop views of the tensors made once (from_dlpack)
        op = do.value(None)
        for _ in range(n):
            op = op.then(lambda _: do.external(lib, reads=(da, db), writes=(dc,)))
        with torch.cuda.stream(ts):
            op.sync_on(s)

    def chained_noop():  # deviceop's own part of a step: the same op with fn enqueuing nothing
        op = do.value(None)
        for _ in range(n):
            op = op.then(lambda _: do.external(noop, reads=(a, b), writes=(c,)))
        with torch.cuda.stream(ts):
            op.sync_on(s)

    def adapter():
        op = do.value(None)
        for _ in range(n):
            op = op.then(lambda _: do.interop.torch(lambda x, y, z: torch.add(x, y, out=z), da, db, dc, writes=(dc,)))
        op.sync_on(s)

    def one_direct():
        with torch.cuda.stream(ts):
            torch.add(a, b, out=c)
        s.synchronize()

    def one_external():
        with torch.cuda.stream(ts):
            do.external(lib, reads=(a, b), writes=(c,)).sync_on(s)

    if profile:  # where an external step's host time goes (cProfile, deterministic)
        import cProfile
        import pstats

        for name, f in (("external", chained), ("one_external", one_external), ("adapter", adapter)):
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(20):
                f()
            pr.disable()
            print(f"--- profile: {name} (20 runs)")
            pstats.Stats(pr).sort_stats("tottime").print_stats(14)

    out: dict = {"n": n, "reps": reps}
    fns = {
        "direct": direct,
        "external": chained,
        "external_wrapped": chained_wrapped,
        "external_noop": chained_noop,
        "adapter": adapter,
        "one_direct": one_direct,
        "one_external": one_external,
    }
    for f in fns.values():
        for _ in range(5):
            f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    thread: dict[str, list[float]] = {k: [] for k in fns}  # the calling thread's share
    for _ in range(reps):  # interleaved: drift hits every variant alike
        for k, f in fns.items():
            t0, c0 = time.process_time_ns(), time.thread_time_ns()
            f()
            c1, t1 = time.thread_time_ns(), time.process_time_ns()
            times[k].append((t1 - t0) / 1e3)
            thread[k].append((c1 - c0) / 1e3)
    for k, v in times.items():
        per = n if k in ("direct", "external", "external_wrapped", "external_noop", "adapter") else 1
        out[k + "_us"] = statistics.median(v) / per
        out[k + "_thread_us"] = statistics.median(thread[k]) / per
    out["external_over_direct_us"] = out["external_us"] - out["direct_us"]
    out["external_wrapped_over_direct_us"] = out["external_wrapped_us"] - out["direct_us"]
    out["adapter_over_direct_us"] = out["adapter_us"] - out["direct_us"]
    out["one_external_over_direct_us"] = out["one_external_us"] - out["one_direct_us"]
    return out


#: the MLP's batch, width and layers
B, D, L = 16, 2048, 8


def make_mlp():
    """The served model: L x (Linear(D, D), GELU), float16, on the GPU, seeded."""
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    layers: list = []
    for _ in range(L):
        layers += [nn.Linear(D, D), nn.GELU(approximate="tanh")]
    return nn.Sequential(*layers).half().cuda().eval()


def mlp_service(requests: int, rounds: int, profile: bool = False) -> dict:
    import torch

    mlp = make_mlp()
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((B, D)).astype(np.float16) for _ in range(16)]

    def torch_request(x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return mlp(torch.from_numpy(x).cuda(non_blocking=False)).cpu().numpy()

    def fwd(t):
        with torch.no_grad():
            return mlp(t)

    async def do_request(x: np.ndarray) -> np.ndarray:
        return await do.from_numpy(x).then(lambda t: do.interop.torch(fwd, t)).then(do.to_numpy)

    async def blocking(x):
        return torch_request(x)

    async def to_thread(x):
        return await asyncio.to_thread(torch_request, x)

    kinds = {"torch_blocking": blocking, "to_thread": to_thread, "deviceop": do_request}
    want = [torch_request(x) for x in xs]

    async def run(kind: str, inflight: int) -> tuple[float, float, int]:
        fn = kinds[kind]
        per = requests // inflight
        bad = 0

        async def client(k: int) -> None:
            nonlocal bad
            for i in range(per):
                j = (k + i) % len(xs)
                y = await fn(xs[j])
                if not np.allclose(y.astype(np.float32), want[j].astype(np.float32), rtol=2e-2, atol=2e-2):
                    bad += 1

        t0, c0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(client(k) for k in range(inflight)))
        n = per * inflight
        return n / (time.perf_counter() - t0), (time.process_time() - c0) / n * 1e6, bad

    out: dict = {"batch": B, "width": D, "layers": L, "requests": requests, "rounds": rounds, "rows": []}
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    for inflight in (1, 64):
        res: dict[str, list[tuple[float, float, int]]] = {k: [] for k in kinds}
        for k in kinds:
            runner(run(k, inflight))  # warm-up
        for _ in range(rounds):
            for k in kinds:
                res[k].append(runner(run(k, inflight)))
        for k, v in res.items():
            row = {
                "kind": k,
                "inflight": inflight,
                "req_per_s": statistics.median(r[0] for r in v),
                "cpu_us_per_req": statistics.median(r[1] for r in v),
                "wrong": sum(r[2] for r in v),
            }
            out["rows"].append(row)
            print(
                f"{k:15s} in flight {inflight:3d}: {row['req_per_s']:8.0f} req/s  "
                f"{row['cpu_us_per_req']:7.1f} us CPU/req  wrong {row['wrong']}",
                flush=True,
            )
    if profile:  # one more deviceop round of 64 in flight, profiled, with the collector's and the await's counters
        import cProfile
        import gc
        import pstats

        from deviceop._core import _completion as _await
        from deviceop._core import _reactor

        g0, a0, r0 = [st["collections"] for st in gc.get_stats()], _await.stats(), _reactor.stats()
        pr = cProfile.Profile()
        pr.enable()
        rate = runner(run("deviceop", 64))[0]
        pr.disable()
        g1, a1, r1 = [st["collections"] for st in gc.get_stats()], _await.stats(), _reactor.stats()
        print(
            f"--- profile: deviceop, 64 in flight ({rate:.0f} req/s under the profiler): collections per "
            f"generation {[b - a for a, b in zip(g0, g1)]}, awaits {a1['awaits'] - a0['awaits']}, parked "
            f"{a1['parks'] - a0['parks']}, yields while polling {a1['polls'] - a0['polls']}, reactor "
            f"{ {k: r1[k] - r0[k] for k in ('armed', 'passes', 'sleeps', 'prewakes', 'late_resumes')} }",
            flush=True,
        )
        pstats.Stats(pr).sort_stats("tottime").print_stats(20)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="print a cProfile of the external steps")
    ap.add_argument(
        "--profile-mlp", action="store_true", help="print a cProfile of one more deviceop MLP round, 64 in flight"
    )
    ap.add_argument("--steps-only", action="store_true", help="the external step's cost only, no MLP")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if do.backend_name() != "cuda":
        print("needs the cuda backend (a GPU)")
        return 1
    doc = {"experiment": "external_cost", "steps": step_cost(a.steps, a.reps, a.profile)}
    st = doc["steps"]
    print(
        f"per step, host CPU: direct {st['direct_us']:.2f} us, external {st['external_us']:.2f} us "
        f"(+{st['external_over_direct_us']:.2f}; naming deviceop views made once +{st['external_wrapped_over_direct_us']:.2f}), adapter {st['adapter_us']:.2f} us "
        f"(+{st['adapter_over_direct_us']:.2f}); one op per terminal +{st['one_external_over_direct_us']:.2f} us",
        flush=True,
    )
    print(
        f"  deviceop's part alone (fn enqueuing nothing) {st['external_noop_us']:.2f} us; the calling thread's "
        f"CPU: direct {st['direct_thread_us']:.2f}, external {st['external_thread_us']:.2f} us",
        flush=True,
    )
    if not a.steps_only:
        doc["mlp"] = mlp_service(a.requests, a.rounds, a.profile_mlp)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
