"""Where a PyTorch MLP request's time goes, served through deviceop and by PyTorch alone.

The request is the one of ``external_cost.py`` (8 x Linear(2048, 2048) + GELU, float16, batch
16): a numpy input copied to the GPU, the MLP, the result copied back. One request at a time,
wall time per request (median over --reps, after warm-up, variants interleaved):

  torch            ``mlp(torch.from_numpy(x).cuda()).cpu().numpy()`` (blocks)
  torch_fwd        the MLP alone on a tensor already on the GPU, launch only (host time)
  do_sync          ``do.from_numpy(x).then(lambda t: do.interop.torch(fwd, t)).then(do.to_numpy).sync()``
  do_submit        the same op's ``submit()`` alone (host time to enqueue it all)
  do_await         ``await`` of the same op from a uvloop loop, one request after another
  do_external      ``do.external`` naming PyTorch tensors the user made, with the copies in
                   PyTorch: the user's own code on deviceop's stream, no adapter
  adapter_fwd      ``do.interop.torch(fwd, t).submit()`` on a deviceop tensor already there (host)

and a cProfile of the sync and awaited requests (--profile). ``--diagnose`` adds where the
extra time goes (see :func:`diagnose`).

    python experiments/mlp_request_cost.py --out mlp_request_cost.json [--profile]
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deviceop as do


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--diagnose", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if do.backend_name() != "cuda":
        print("needs the cuda backend (a GPU)")
        return 1
    import torch
    from external_cost import B, D, L, make_mlp

    mlp = make_mlp()
    x = np.random.default_rng(0).standard_normal((B, D)).astype(np.float16)
    tx = torch.from_numpy(x).cuda()
    dx = do.from_numpy(x).sync()

    def fwd(t):
        with torch.no_grad():
            return mlp(t)

    def v_torch():
        with torch.no_grad():
            return mlp(torch.from_numpy(x).cuda(non_blocking=False)).cpu().numpy()

    def v_torch_fwd():
        with torch.no_grad():
            mlp(tx)

    def op():
        return do.from_numpy(x).then(lambda t: do.interop.torch(fwd, t)).then(do.to_numpy)

    def v_do_sync():
        return op().sync()

    futs: list = []

    def v_do_submit():
        futs.append(op().submit())

    def v_adapter_fwd():
        futs.append(do.interop.torch(fwd, dx).submit())

    def ext_fn(stream):
        ts = torch.cuda.ExternalStream(stream.handle_int)
        with torch.cuda.stream(ts), torch.no_grad():
            return mlp(torch.from_numpy(x).cuda(non_blocking=False)).cpu().numpy()

    def v_do_external():
        return do.external(ext_fn).sync()

    want = v_torch()
    host_only = {"torch_fwd", "do_submit", "adapter_fwd"}
    fns = {
        "torch": v_torch,
        "torch_fwd": v_torch_fwd,
        "do_sync": v_do_sync,
        "do_submit": v_do_submit,
        "adapter_fwd": v_adapter_fwd,
        "do_external": v_do_external,
    }

    async def awaited(n: int) -> list[float]:
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            y = await op()
            ts.append((time.perf_counter() - t0) * 1e6)
            assert np.allclose(y.astype(np.float32), want.astype(np.float32), rtol=2e-2, atol=2e-2)
        return ts

    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    for f in fns.values():
        for _ in range(10):
            f()
        for fu in futs:
            fu.result()
        futs.clear()
        torch.cuda.synchronize()
    runner(awaited(20))
    times: dict[str, list[float]] = {k: [] for k in fns}
    times["do_await"] = []
    for _ in range(a.reps // 10):
        for k, f in fns.items():
            for _ in range(10):
                t0 = time.perf_counter()
                f()
                times[k].append((time.perf_counter() - t0) * 1e6)
                if k in host_only:  # host time only: let the GPU finish outside the timing
                    for fu in futs:
                        fu.result()
                    futs.clear()
                    torch.cuda.synchronize()
        times["do_await"] += runner(awaited(10))
    out = {
        "experiment": "mlp_request_cost",
        "batch": B,
        "width": D,
        "layers": L,
        "reps": a.reps,
        "median_us": {k: statistics.median(v) for k, v in times.items()},
        "p90_us": {k: sorted(v)[int(0.9 * len(v))] for k, v in times.items()},
    }
    for k in times:
        print(f"{k:12s} median {out['median_us'][k]:8.1f} us   p90 {out['p90_us'][k]:8.1f} us", flush=True)
    if a.diagnose:
        out["diagnose"] = diagnose(op, want, runner, a.reps, mlp, x, tx, dx, fwd, v_torch)
    if a.profile:
        import cProfile
        import pstats

        for name, f in (
            ("do_sync", lambda: [v_do_sync() for _ in range(200)]),
            ("do_await", lambda: runner(awaited(200))),
        ):
            pr = cProfile.Profile()
            pr.enable()
            f()
            pr.disable()
            print(f"--- profile: {name} (200 requests)", flush=True)
            st = pstats.Stats(pr)
            st.sort_stats("tottime").print_stats(25)
            st.sort_stats("cumulative").print_stats(25)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


def diagnose(op, want, runner, reps: int, mlp, x, tx, dx, fwd, torch_request) -> dict:
    """Where the request's extra time goes (printed, and kept in the JSON):

    1. In one uvloop loop, one request after another, with and without the result check
       (``np.allclose``, as ``external_cost.py``'s service does between requests): PyTorch
       blocking, deviceop's op by ``sync_on`` (the loop blocked), and awaited, with the
       awaited request's enqueue and wait apart and the reactor's counters.
    2. The MLP's forward alone (host time, then a synchronize outside the timing) in the ways
       deviceop reaches it: PyTorch's stream set as the adapter sets it, on a PyTorch tensor or
       on one made from a deviceop tensor by DLPack; inside ``do.external``; through
       ``do.interop.torch`` with its output returned or not.
    """
    import torch

    from deviceop._core import _completion as _await
    from deviceop._core import _reactor
    from deviceop.interop import _torch as adapter

    marks: list[float] = []
    real_start = _await.start

    def timed_start(*args):
        r = real_start(*args)
        marks.append(time.perf_counter())
        return r

    _await.start = timed_start
    s = do.streams()[0]
    res: dict = {"loop": {}, "forward": {}}

    def check(y) -> None:
        assert np.allclose(y.astype(np.float32), want.astype(np.float32), rtol=2e-2, atol=2e-2)

    async def loop(kind: str, checked: bool, n: int) -> dict:
        enq, wait, tot = [], [], []
        r0, a0 = _reactor.stats(), _await.stats()
        for _ in range(n):
            marks.clear()
            t0 = time.perf_counter()
            if kind == "torch":
                y = torch_request()
            elif kind == "sync_on":
                y = op().sync_on(s)
            else:
                y = await op().wait(stream=s)
            t1 = time.perf_counter()
            tot.append((t1 - t0) * 1e6)
            if marks:
                enq.append((marks[0] - t0) * 1e6)
                wait.append((t1 - marks[0]) * 1e6)
            if checked:
                check(y)
        r1, a1 = _reactor.stats(), _await.stats()
        return {
            "total_us": statistics.median(tot),
            "enqueue_us": statistics.median(enq) if enq else None,
            "wait_us": statistics.median(wait) if wait else None,
            "parks": a1["parks"] - a0["parks"],
            "reactor": {k: r1[k] - r0[k] for k in ("passes", "sleeps", "prewakes", "late_resumes")},
        }

    kinds = [(k, c) for c in (True, False) for k in ("torch", "sync_on", "await")]
    rows: dict = {f"{k}{'' if c else '_unchecked'}": [] for k, c in kinds}
    for k, c in kinds:
        runner(loop(k, c, 10))
    for _ in range(4):  # in turn, so that a change of the host's speed falls on every variant
        for k, c in kinds:
            rows[f"{k}{'' if c else '_unchecked'}"].append(runner(loop(k, c, reps // 4)))
    for key, rs in rows.items():
        row = {
            f: (statistics.median(r[f] for r in rs) if rs[0][f] is not None else None)
            for f in ("total_us", "enqueue_us", "wait_us")
        }
        row["parks"] = sum(r["parks"] for r in rs)
        res["loop"][key] = row
        print(f"loop {key:18s} {row}", flush=True)
    _await.start = real_start

    st = adapter._streams.get(s.handle_int)
    if st is None:
        ts = torch.cuda.ExternalStream(s.handle_int)
        st = (ts, ts.stream_id, ts.device_index, ts.device_type)
    tv = torch.from_dlpack(dx)

    def under_stream(t):
        def f():
            prev = adapter._enter(torch, st)
            try:
                fwd(t)
            finally:
                adapter._leave(prev)
            torch.cuda.synchronize()

        return f

    def in_external(make):
        def f():
            do.external(lambda stream: fwd(make())).sync_on(s)

        return f

    def none_fwd(t):
        fwd(t)

    fwds = {
        "default_stream": lambda: (fwd(tx), torch.cuda.synchronize()),
        "stream_set": under_stream(tx),
        "stream_set_dlpack_input": under_stream(tv),
        "external": in_external(lambda: tx),
        "external_dlpack_input_each_call": in_external(lambda: torch.from_dlpack(dx)),
        "adapter": lambda: do.interop.torch(fwd, dx).sync_on(s),
        "adapter_output_dropped": lambda: do.interop.torch(none_fwd, dx).sync_on(s),
    }
    times: dict = {k: [] for k in fwds}
    for f in fwds.values():
        for _ in range(10):
            f()
    for _ in range(reps // 5):
        for k, f in fwds.items():
            for _ in range(5):
                t0 = time.perf_counter()
                f()
                times[k].append((time.perf_counter() - t0) * 1e6)
    for k, v in times.items():
        res["forward"][k] = statistics.median(v)
        print(f"forward {k:32s} {statistics.median(v):8.1f} us (host and the GPU's tail)", flush=True)
    # the adapter's parts: fn, its output's conversion (the post step), and dropping the output
    parts: dict = {"fn": [], "outputs": [], "drop": [], "total": []}
    real_outputs = adapter._outputs

    def timed_outputs(cx, out, args):
        t0 = time.perf_counter()
        r = real_outputs(cx, out, args)
        parts["outputs"].append((time.perf_counter() - t0) * 1e6)
        return r

    def timed_fwd(t):
        t0 = time.perf_counter()
        r = fwd(t)
        parts["fn"].append((time.perf_counter() - t0) * 1e6)
        return r

    steps: dict = {k: [] for k in ("checks", "describe", "args", "span", "buffer_for", "tensor")}

    def timed_wrap(cx, t, acc, args):  # adapter._wrap, each step timed (the output is no input)
        c = time.perf_counter
        t0 = c()
        be = cx.backend
        assert t.is_cuda == bool(be.cuda_memory)
        dt = adapter._DTYPES.get(t.dtype)
        t1 = c()
        ptr = int(t.data_ptr())
        shape = tuple(t.shape)
        strides = tuple(t.stride())
        t2 = c()
        for a in args:
            x = a.tensor if type(a) is do.Partition else a
            assert not (type(x) is do.Tensor and x.ptr == ptr and x.shape == shape)
        t3 = c()
        it = t.element_size()
        lo, hi = adapter.span(ptr, shape, tuple(s * it for s in strides), it)
        t4 = c()
        buf = adapter.buffer_for(be, lo, hi, t, lambda: adapter._storage(t))
        t5 = c()
        out = do.Tensor(buf, shape, dt, strides, ptr - buf.ptr)
        acc.append((buf, lo - buf.ptr, hi - buf.ptr, True))
        t6 = c()
        for k, a, b in zip(steps, (t0, t1, t2, t3, t4, t5), (t1, t2, t3, t4, t5, t6)):
            steps[k].append((b - a) * 1e6)
        return out

    real_wrap = adapter._wrap
    adapter._outputs = timed_outputs
    adapter._wrap = timed_wrap
    try:
        for _ in range(reps + 10):
            t0 = time.perf_counter()
            y = do.interop.torch(timed_fwd, dx).sync_on(s)
            t1 = time.perf_counter()
            del y
            t2 = time.perf_counter()
            parts["total"].append((t1 - t0) * 1e6)
            parts["drop"].append((t2 - t1) * 1e6)
    finally:
        adapter._outputs = real_outputs
        adapter._wrap = real_wrap
    res["adapter_parts_us"] = {k: statistics.median(v[10:]) for k, v in parts.items()}
    res["adapter_wrap_steps_us"] = {k: statistics.median(v[10:]) for k, v in steps.items()}
    print(f"the output's conversion, by step (median us): {res['adapter_wrap_steps_us']}", flush=True)
    print(f"adapter parts (median us): {res['adapter_parts_us']}", flush=True)
    return res


if __name__ == "__main__":
    raise SystemExit(main())
