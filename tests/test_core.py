"""The compiled core: the ledger's one entry point, plans keyed by value, threads sharing
kernels, the block cache, and input checks made when an op is built."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from conftest import STUB_DRIVER, needs_gpu
from helpers import pool_of, run_threads

import deviceop as do
from deviceop.device import current as current_backend

K = do.kernels


def test_to_numpy_is_ordered_before_a_later_write_from_another_thread(backend, monkeypatch):
    # widen the window between to_numpy's registration and its copy: the copy's enqueue takes
    # 100 ms; a write issued meanwhile from another thread on another stream must still land
    # after the copy (the ledger's entry point holds the lock across both). On the host backend
    # its dtoh is slowed, on the stub driver the cuMemcpyDtoHAsync call; a GPU cannot be
    # slowed, so there the test checks the order without a widened window.
    s0, s1 = pool_of(2)[:2]
    x = do.full(4096, 1.0, do.float32).sync_on(s0)
    # the write's kernel built beforehand: built inside the window, it would come too late to race
    K.fill(do.empty(4096, do.float32).sync_on(s1).partition((128,)), 0.0).sync_on(s1)
    started = threading.Event()
    if backend == "host":
        be = current_backend()
        real = be.dtoh

        def slow_dtoh(*a, **kw):
            started.set()
            time.sleep(0.1)
            return real(*a, **kw)

        monkeypatch.setattr(be, "dtoh", slow_dtoh)
        entered = started.wait
    elif STUB_DRIVER:
        from stub_driver import emulate

        emulate.set_dtoh_call_delay(0.1)

        def entered(timeout: float) -> bool:
            end = time.monotonic() + timeout
            while emulate.dtoh_calls_waiting() == 0:
                if time.monotonic() > end:
                    return False
                time.sleep(0.001)
            return True
    else:
        entered = lambda timeout: True  # noqa: E731
    got = {}
    reader = threading.Thread(target=lambda: got.setdefault("v", do.to_numpy(x).sync_on(s0)))
    try:
        reader.start()
        assert entered(10)
        K.fill(x.partition((128,)), 2.0).sync_on(s1)  # issued while the copy is being enqueued
        reader.join(30)
    finally:
        monkeypatch.undo()
        if backend == "cuda" and STUB_DRIVER:
            emulate.set_dtoh_call_delay(0)
    assert np.all(got["v"] == 1.0), "the later write reached the copy"
    assert np.all(x.numpy() == 2.0)


def test_threads_calling_the_same_builtins_get_their_own_results(backend):
    rounds, n = 30, 2048

    def worker(k: int) -> None:
        rng = np.random.default_rng(k)
        for r in range(rounds):
            a_np = rng.standard_normal(n).astype(np.float32)
            b_np = rng.standard_normal(n).astype(np.float32)
            a, b = do.from_numpy(a_np).sync(), do.from_numpy(b_np).sync()
            y = do.empty(n, do.float32).sync()
            g = float(k + r)
            K.axpy(y.partition((256,)), a, b, g).sync()  # the same plan for every thread
            np.testing.assert_allclose(y.numpy(), g * a_np + b_np, rtol=1e-5, atol=1e-5)

    errors = run_threads(worker, 8)
    assert not errors, errors[:3]


def test_threads_calling_gemm_get_their_own_results(backend):
    needs_gpu(backend, "cuBLAS")

    def worker(k: int) -> None:
        rng = np.random.default_rng(100 + k)
        for _ in range(10):
            a_np = rng.standard_normal((32, 24)).astype(np.float32)
            b_np = rng.standard_normal((24, 16)).astype(np.float32)
            a, b = do.from_numpy(a_np).sync(), do.from_numpy(b_np).sync()
            c = do.empty((32, 16), do.float32).sync()
            K.gemm(c, a, b).sync()
            np.testing.assert_allclose(c.numpy(), a_np @ b_np, rtol=1e-4, atol=1e-4)

    errors = run_threads(worker, 6)
    assert not errors, errors[:3]


def test_fresh_tensors_of_a_known_shape_reuse_one_plan(backend):
    K.scale.plans.clear()
    K.gemm
    for i in range(20):
        x = do.full(1024, float(i), do.float32).sync()
        y = do.empty(1024, do.float32).sync()
        K.scale(y.partition((128,)), x, 2.0).sync()
        assert np.all(y.numpy() == 2.0 * i)
    assert len(K.scale.plans) == 1 and K.scale.plans.hits >= 19
    # another layout (tile, shape, dtype or alignment) is another plan
    x = do.full(2048, 1.0, do.float32).sync()
    y = do.empty(2048, do.float32).sync()
    K.scale(y.partition((256,)), x, 2.0).sync()
    K.scale(y[1:2041].partition((255,)), x[1:2041], 2.0).sync()  # 4-byte offset: other alignment
    assert len(K.scale.plans) == 3


def test_a_dropped_buffer_is_reused_and_used_bytes_return(backend):
    base = do.used_bytes()
    t = do.empty(1 << 16, do.float32).sync()
    ptr = t.buffer.ptr
    assert do.used_bytes() >= base + (1 << 18)
    del t
    assert do.used_bytes() == base
    if backend == "cuda":  # the idle block serves the next allocation of its size class
        u = do.empty((1 << 16) - 100, do.float32).sync()
        assert u.buffer.ptr == ptr
        del u
        assert do.empty_cache() >= 1 << 18
    else:
        assert do.empty_cache() == 0


def test_fresh_blocks_are_allocated_on_the_allocation_stream(backend):
    # a stream that served a stream-ordered allocation launches and synchronizes more slowly
    # from then on: no execution's stream allocates, the backend's allocation stream does
    if backend != "cuda":
        pytest.skip("the host backend has no driver allocation")
    be = current_backend()
    s = do.streams()[0]
    do.empty_cache()  # the next allocation takes a fresh block
    t = do.full(4099, 2.0, do.float32).sync_on(s)
    assert np.all(t.numpy() == 2.0)
    assert be.alloc_stream.handle_int not in {p.handle_int for p in do.streams()}
    assert "allocation stream" in repr(be.alloc_stream)
    if STUB_DRIVER:  # the stub driver says which stream the allocation named
        from stub_driver import emulate

        assert emulate.last_async_alloc_stream() == be.alloc_stream.handle_int


def _allocation_stream_held(seconds: float) -> tuple[Any, Any, Any]:
    """(the backend, a pool stream, the future of a slow fill): the allocation stream waits for
    ``seconds`` of work on another pool stream, and the block cache is empty."""
    from helpers import slow_fill

    be = current_backend()
    s0, s1 = pool_of(2)[:2]
    gate = do.empty(128, do.float32).sync_on(s0)
    do.empty_cache()  # the next allocation takes a fresh block
    fut = slow_fill(gate, 1.0, seconds).submit(s0)
    ev = be.new_event()
    s0.record(ev)
    be.alloc_stream.wait(ev)
    return be, s1, fut


def test_a_fresh_block_waits_for_work_the_allocation_stream_waits_for(backend):
    # the pool may hand out memory whose allocation waits on other work (memory another stream
    # freed): work on the block waits for the allocation stream to pass it
    if backend != "cuda":
        pytest.skip("the host backend has no driver allocation")
    _, s1, fut = _allocation_stream_held(0.3)
    t0 = time.perf_counter()
    t = do.full(4099, 2.0, do.float32).sync_on(s1)  # a fresh block: its fill runs after the gate
    waited = time.perf_counter() - t0
    assert np.all(t.numpy() == 2.0)
    assert waited >= 0.2, waited
    assert np.all(fut.result(timeout=30)[0].tensor.numpy() == 1.0)


def test_a_failed_wait_for_the_allocation_stream_gives_the_block_back(backend, monkeypatch):
    # a wait that fails leaves the fresh block neither in use nor cached (it may not be ready
    # for other streams): it goes back to the driver in the allocation stream's order
    if backend != "cuda":
        pytest.skip("the host backend has no driver allocation")
    be, s1, fut = _allocation_stream_held(0.3)

    def fail(stream: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(be.driver, "after_alloc", fail)
    base = do.used_bytes()
    with pytest.raises(KeyboardInterrupt):
        do.full(4099, 2.0, do.float32).sync_on(s1)
    assert do.used_bytes() == base
    assert be.blocks.cached == 0
    fut.result(timeout=30)
    monkeypatch.undo()
    assert np.all(do.full(4099, 3.0, do.float32).sync_on(s1).numpy() == 3.0)


def test_buffers_in_flight_are_not_reused(backend):
    # a buffer dropped by its name while work on it runs is held by the work, not cached
    from helpers import slow_fill

    x = do.empty(4096, do.float32).sync()
    ptr = x.buffer.ptr
    fut = slow_fill(x, 3.0, 0.2).submit()
    del x
    y = do.empty(4096, do.float32).sync()
    assert y.buffer.ptr != ptr  # still in use by the slow fill
    out = fut.result(timeout=30)
    assert np.all(out[0].tensor.numpy() == 3.0)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"grid": (2**32 + 1,)}, "grid"),
        ({"grid": (1, 70000)}, "grid"),
        ({"grid": (2.0,)}, "grid"),
        ({"grid": (True,)}, "grid"),
        ({"block": (2048,)}, "block"),
        ({"block": (32, 1, 128)}, "block"),
        ({"shared_mem": -1}, "shared_mem"),
        ({"shared_mem": 1.5}, "shared_mem"),
    ],
)
def test_launch_geometry_out_of_cuda_limits_is_refused_when_built(backend, kw, match):
    k = K.Kernel('extern "C" __global__ void nop(float* y) {}', "nop", params=(K.Out(do.float32),), host=lambda y: None)
    y = do.empty(128, do.float32).sync()
    with pytest.raises(do.UsageError, match=match):
        k(y, **{"grid": (1,), **kw})


def test_allocation_arguments_are_checked_when_built(backend):
    with pytest.raises(do.DTypeError, match="needs a fill value"):
        do.full(3, None)
    with pytest.raises(do.DTypeError, match="float16"):  # (numpy: "overflow", else ours: "overflows")
        do.full(3, 1e10, do.float16)
    with pytest.raises(do.DTypeError, match="must be a number"):
        do.full(3, "1")
    with pytest.raises(do.ShapeError, match="bool"):
        do.zeros(True)
    with pytest.raises(do.ShapeError):
        do.zeros((2, False))
    assert do.full(2, float("inf"), do.float16).sync().numpy().tolist() == [np.inf, np.inf]


def test_stub_driver_marker_is_consistent():
    # the suite knows whether it runs on the stub driver (CI) and skips only GPU-only checks there
    assert isinstance(STUB_DRIVER, bool)


def test_the_python_modules_of_foreign_work_run_compiled():
    # built from their own source by setup.py: the modules every foreign step goes through
    import importlib.machinery

    from deviceop._core import _regions
    from deviceop.interop import _external, _torch

    for m in (_external, _regions, _torch):
        assert m.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)), m.__file__


def test_launch_plans_refuse_bad_layouts_and_arguments(backend):
    from deviceop._core._launch import MAX_PARAMS, LaunchPlan, launch
    from deviceop._core._ledger import ExecutionContext

    be = current_backend()
    if be.driver is None:  # the host backend launches no kernels through plans
        with pytest.raises(do.UsageError, match="launches kernels"):
            LaunchPlan(None, 1, (1, 1, 1), (32, 1, 1), 0, (), (), "k")
        return
    geo = ((1, 1, 1), (32, 1, 1), 0)
    with pytest.raises(do.UsageError, match="bad layout"):
        LaunchPlan(be.driver, 1, *geo, ((7, 0, 0, 0),), (), "k")
    with pytest.raises(do.UsageError, match="at most"):
        LaunchPlan(be.driver, 1, *geo, tuple((1, i, 1, 0) for i in range(MAX_PARAMS + 1)), (), "k")
    p = LaunchPlan(be.driver, 1, *geo, ((0, 0, 0, 0), (1, 0, 1, 0)), (True,), "k")
    cx = ExecutionContext(do.streams()[0], "test")
    with pytest.raises(do.UsageError, match="takes 1 tensors and 1 scalars"):
        launch(cx, p, (), (1.0,))  # refused before anything is read or launched
    with pytest.raises(do.UsageError, match="takes 1 tensors and 1 scalars"):
        launch(cx, p, (do.empty(4).sync(),), ())
    cx.finish()


def test_layers_above_the_ops_load_on_first_use():
    # import deviceop loads the core, the device layer and the ops; graph, kernels, executors
    # and combinators load when first used, through a public name or a hook of DeviceOp
    import os
    import subprocess
    import sys

    code = """
import asyncio, sys
import deviceop as do
lazy = ("deviceop.graph", "deviceop.kernels", "deviceop.executors", "deviceop.combinators")
print(sorted(m for m in lazy if m in sys.modules))
print(do.value(1).shared().sync(), do.value(2).submit().result(timeout=30))
print(asyncio.run(do.value(3).wait(timeout=30)))
t = do.zeros(4).sync()
g = do.value(t).graph()
print(type(g).__name__, g.launch().sync() is t, do.zip(do.value(4), do.value(5)).sync())
print("__getattr__" in vars(do), all(n in vars(do) for n in do.__all__))
"""
    env = dict(os.environ, DEVICEOP_BACKEND="host", PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    # once a lazy name is used, all are loaded and the module has no __getattr__ (with one,
    # CPython does not specialise ``do.x`` loads: each walks the module's dict)
    assert r.stdout.split("\n")[:5] == ["[]", "1 2", "3", "CudaGraph True (4, 5)", "False True"], r.stdout


def test_one_op_consumed_by_many_threads_runs_once(backend):
    # consuming an op is atomic: of the threads driving one op, exactly one runs it
    for _ in range(20):
        calls = []
        op = do.value(1).map(lambda v: calls.append(v) or v)
        errors = run_threads(lambda k: op.sync() if k % 2 else op.submit().result(10), 8)
        assert len(errors) == 7 and all(isinstance(e, do.UsageError) for e in errors)
        assert calls == [1]


def test_the_ledger_lock_is_released_when_enqueued_work_raises(backend):
    # a KeyboardInterrupt (a signal) inside work being enqueued leaves the ledger usable
    from deviceop._core._base import LOCK
    from deviceop._core._ledger import ExecutionContext, enqueue

    cx = ExecutionContext(do.streams()[0], "test")
    t = do.zeros(16, do.float32).sync()

    def interrupted() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        enqueue(cx, ((t, True),), interrupted, "interrupted work")
    cx.finish(False)
    assert not LOCK.locked()
    assert do.to_numpy(t).sync().tolist() == [0.0] * 16
