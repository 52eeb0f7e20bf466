"""From a terminal's call to the first line of an op's ``fn``: what each part of a small op costs.

In one uvloop loop, each measured after 2 ms of yielding to the loop (the core awake), 300
times, the first 50 dropped; medians and p90 in µs:

  await ext -> fn                   ``await do.external(fn, x).wait(stream=)``, x a deviceop tensor
  await adapter(cached view) -> fn  the same through ``do.interop.torch`` (x's PyTorch view made before)
  sync_on adapter -> fn             the same with ``sync_on``
  await ext(upload N) -> fn         ``do.external(fn, do.from_numpy(a))``: the upload first
  await adapter(upload 128KB, new view) -> fn
                                    the speech example's first step: a new tensor to PyTorch
  from_numpy 128KB sync_on total    the upload alone, to its completion
  torch .to(cuda) 128KB             PyTorch's blocking upload of the same array

    python experiments/await_to_fn_cost.py
"""

import asyncio
import statistics
import time

import numpy as np
import torch

import deviceop as do

s = do.next_stream()
x = do.zeros((32000,), do.float32).sync_on(s)
small = np.zeros(1000, np.float32)
ctx = np.zeros(32000, np.float32)
mark = [0.0]


def fn(stream, *a):
    mark[0] = time.perf_counter()


def tfn(t):
    mark[0] = time.perf_counter()
    return None


async def hot(sec):
    t = time.perf_counter() + sec
    while time.perf_counter() < t:
        await asyncio.sleep(0)


async def main():
    res = {}

    def rec(k, v):
        res.setdefault(k, []).append(v)

    for _ in range(300):
        await hot(2e-3)
        t0 = time.perf_counter()
        await do.external(fn, x).wait(stream=s)
        rec("await ext -> fn", mark[0] - t0)
        await hot(2e-3)
        t0 = time.perf_counter()
        await do.interop.torch(tfn, x).wait(stream=s)
        rec("await adapter(cached view) -> fn", mark[0] - t0)
        await hot(2e-3)
        t0 = time.perf_counter()
        do.interop.torch(tfn, x).sync_on(s)
        rec("sync_on adapter -> fn", mark[0] - t0)
        await hot(2e-3)
        t0 = time.perf_counter()
        await do.external(fn, do.from_numpy(small)).wait(stream=s)
        rec("await ext(upload 4KB) -> fn", mark[0] - t0)
        await hot(2e-3)
        t0 = time.perf_counter()
        await do.external(fn, do.from_numpy(ctx)).wait(stream=s)
        rec("await ext(upload 128KB) -> fn", mark[0] - t0)
        await hot(2e-3)
        t0 = time.perf_counter()
        do.external(fn, do.from_numpy(ctx)).sync_on(s)
        rec("sync_on ext(upload 128KB) -> fn", mark[0] - t0)
        await hot(2e-3)
        t0 = time.perf_counter()
        await do.interop.torch(tfn, do.from_numpy(ctx)).wait(stream=s)
        rec("await adapter(upload 128KB, new view) -> fn", mark[0] - t0)
        await hot(2e-3)
        t0 = time.perf_counter()
        do.from_numpy(ctx).sync_on(s)
        rec("from_numpy 128KB sync_on total", time.perf_counter() - t0)
        await hot(2e-3)
        t0 = time.perf_counter()
        torch.from_numpy(ctx).to("cuda")
        rec("torch .to(cuda) 128KB", time.perf_counter() - t0)
    for k, v in res.items():
        v = v[50:]
        print(f"{k:45s} p50 {statistics.median(v) * 1e6:7.1f} us  p90 {np.percentile(v, 90) * 1e6:7.1f} us")


import uvloop

uvloop.run(main())
