"""Test helpers: slow kernels (both backends), tolerances, reference conversions."""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable

import anyio
import numpy as np

import deviceop as do

K = do.kernels

FLOAT_DTYPES = (do.float16, do.bfloat16, do.float32)
ALL_DTYPES = (do.float16, do.bfloat16, do.float32, do.int32, do.int64, do.uint8)

# relative tolerance of one rounding to the dtype (plus a little): the device computes in
# float32 and rounds once to the output dtype
RTOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2e-6}
ATOL = {"float16": 1e-3, "bfloat16": 1e-2, "float32": 1e-6}


def live(buf: object) -> list[object]:
    """The ledger entries of ``buf`` whose executions have not finished (a finished execution's
    entry stays until the next registration on the buffer reuses it)."""
    return [a for a in buf.accesses if not a.execution.done]  # type: ignore[attr-defined]


_CLOCK_HZ = 2.0e9  # cycles per second assumed for the spin kernels on a GPU

SLOW_SRC = r"""
extern "C" __global__ void slow_fill(float* out, float v, long long n, long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) { }
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = v;
}
extern "C" __global__ void slow_copy(float* out, const float* x, long long n, long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) { }
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = x[i];
}
"""


def _host_slow_fill(out: np.ndarray, v: np.float32, n: np.int64, cycles: np.int64) -> None:
    time.sleep(float(cycles) / _CLOCK_HZ)
    out.reshape(-1)[: int(n)] = v


def _host_slow_copy(out: np.ndarray, x: np.ndarray, n: np.int64, cycles: np.int64) -> None:
    time.sleep(float(cycles) / _CLOCK_HZ)
    out.reshape(-1)[: int(n)] = x.reshape(-1)[: int(n)]


slow_fill_k = K.Kernel(
    SLOW_SRC, "slow_fill", params=(K.Out(do.float32), do.float32, do.int64, do.int64), host=_host_slow_fill
)
slow_copy_k = K.Kernel(
    SLOW_SRC, "slow_copy", params=(K.Out(do.float32), K.In(do.float32), do.int64, do.int64), host=_host_slow_copy
)


def cycles(seconds: float) -> int:
    return int(seconds * _CLOCK_HZ)


def slow_fill(t: do.Tensor, v: float, seconds: float = 0.2) -> do.DeviceOp:
    """An op that waits about ``seconds`` on the device, then writes ``v`` to every element of t."""
    return slow_fill_k(t.partition((128,)), v, t.size, cycles(seconds))


def slow_copy(out: do.Tensor, x: do.Tensor, seconds: float = 0.2) -> do.DeviceOp:
    """An op that waits about ``seconds`` on the device, then copies x into out."""
    return slow_copy_k(out.partition((128,)), x, out.size, cycles(seconds))


def ref(a: np.ndarray) -> np.ndarray:
    """float64 reference values of an array of any supported dtype."""
    return np.asarray(a).astype(np.float64)


def random_array(rng: np.random.Generator, shape: tuple[int, ...], dtype: do.DType) -> np.ndarray:
    """Fresh random values of ``dtype`` (floats: normal; ints: across a good part of the range)."""
    if dtype.is_float:
        return rng.standard_normal(shape).astype(dtype.np_dtype)
    info = np.iinfo(dtype.np_dtype)
    lo, hi = max(info.min, -(2**40)), min(info.max, 2**40)
    return rng.integers(lo, hi, size=shape, endpoint=True, dtype=dtype.np_dtype)


def run_threads(worker: Callable[[int], None], n: int, timeout: float = 120.0) -> list[BaseException]:
    """Run ``worker(k)`` for k in range(n), each on its own thread; return what they raised."""
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            worker(k)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a worker thread hangs"
    return errors


def pool_of(n: int) -> list:
    """At least ``n`` streams of the selected backend, for a test that needs distinct streams.

    Under ``DEVICEOP_STREAMS=1`` (or any smaller pool) a pool of ``n`` is selected first, so
    call this before making the test's tensors: they must live on the device it returns.
    """
    st = do.streams()
    if len(st) < n:
        do.use_backend(do.backend_name(), streams=n)
        st = do.streams()
    return st


def idle_cores(seconds: float = 0.2) -> float:
    """How many of the machine's cores were idle over the next ``seconds`` (its whole count
    where the kernel does not say: /proc/stat is Linux's)."""

    def sample() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        return v[3] + (v[4] if len(v) > 4 else 0), sum(v)  # (idle and I/O wait, all)

    a = sample()
    time.sleep(seconds)
    b = sample()
    n = os.cpu_count() or 1
    if a is None or b is None or b[1] == a[1]:
        return float(n)
    return n * (b[0] - a[0]) / (b[1] - a[1])


def busy(seconds: float) -> None:
    """Host work on the calling thread (a library enqueueing many kernels)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def long_chain(
    t: do.Tensor, steps: int, ran: list[int], seconds: float = 0.001, op: do.DeviceOp | None = None
) -> do.DeviceOp:
    """``op`` (default: a value) then ``steps`` steps, each ``seconds`` of host work then a fill
    of ``t`` with its index (noted in ``ran`` when it runs)."""

    def step(i: int):
        def f(_):
            ran.append(i)
            busy(seconds)
            return K.fill(t.partition((128,)), float(i))

        return f

    if op is None:
        op = do.value(None)
    for i in range(steps):
        op = op.then(step(i))
    return op


async def longest_gap(awaitable) -> tuple[float, object]:
    """Await ``awaitable`` beside a task that takes every turn the loop gives it: the longest
    time that task waited for a turn meanwhile, and the result."""
    turns: list[float] = []
    result: list[object] = []
    async with anyio.create_task_group() as tg:

        async def other() -> None:
            while True:
                turns.append(time.perf_counter())
                await anyio.sleep(0)

        tg.start_soon(other)
        await anyio.sleep(0)
        t0 = time.perf_counter()
        result.append(await awaitable)
        t1 = time.perf_counter()
        tg.cancel_scope.cancel()
    inside = [t0, *(x for x in turns if t0 <= x <= t1), t1]
    return max(b - a for a, b in itertools.pairwise(inside)), result[0]
