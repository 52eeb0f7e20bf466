"""An execution ends only by completing or by being handed to its stream's watcher: nothing it
uses is freed while its work runs, whatever exception or cancellation comes between; failure
paths never block an event loop; blocking terminals are refused on a loop's thread; a fault is
scoped by its kind."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import time
from collections.abc import Iterator

import anyio
import pytest
from conftest import STUB_DRIVER
from helpers import longest_gap, slow_copy, slow_fill

import deviceop as do
from deviceop._backends._host import HostStream
from deviceop._core import _reactor
from deviceop._core._op import start
from deviceop.executors import WorkQueue

N = 4096


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    if request.param == "trio":
        pytest.importorskip("trio")
    return request.param


#: how long a watched fill runs: long enough that a loaded host still checks its block before it
#: ends (the check is skipped, not passed, where it did not)
FILL_S = 1.0


def _settled() -> None:
    """Earlier work settled (its blocks back), so that the bytes in use move only with what
    the test does next."""
    from deviceop._core._watch import watcher_for

    for st in do.streams():
        st.synchronize()
        watcher_for(st).reap()  # (also what its watcher leaves to a loop for now: a test's future)
    deadline = time.monotonic() + 5
    last = -1
    while time.monotonic() < deadline and do.used_bytes() != last:
        last = do.used_bytes()
        gc.collect()
        time.sleep(0.02)


def _watched_fill(refs: list, seconds: float) -> do.DeviceOp:
    """A fill of a fresh buffer (only the execution holds it) lasting about ``seconds``; ``refs``
    gets the device's bytes in use before the buffer was made."""
    _settled()
    refs.append(do.used_bytes())
    refs.append(time.monotonic())  # (about when the fill starts: see _held_until_done)
    return do.zeros(N, do.float32).then(lambda t: slow_fill(t, 1.0, seconds))


def _held_until_done(refs: list, seconds: float) -> None:
    """The fill's block is still in use now (its work runs for about ``seconds`` after it was
    made: it was neither freed nor cached for reuse, even by a garbage collection) and goes back
    once the work completed. (A host too loaded to get here before the fill can have ended
    cannot tell an early release from a due one: the test is skipped then, not passed.)"""
    base, made = refs[0], refs[1]
    gc.collect()
    if do.used_bytes() <= base and time.monotonic() - made >= 0.9 * seconds:
        pytest.skip("the host was too slow to reach the check before the fill could have ended")
    assert do.used_bytes() > base, "the block was released while its work was in flight"
    deadline = time.monotonic() + 30
    while do.used_bytes() > base:
        assert time.monotonic() < deadline, "the block was never released"
        time.sleep(0.01)
        gc.collect()


def test_a_dropped_unfinished_execution_is_handed_to_the_watcher(backend):
    # no terminal waits and no exception site hands it over: the context's finaliser does
    refs: list = []
    op = _watched_fill(refs, FILL_S)
    op._take("test")
    cx, out = start(op, do.next_stream(), "test")
    del cx, out
    _held_until_done(refs, FILL_S)
    assert do.zeros(4).sync().numpy().tolist() == [0.0] * 4


@pytest.mark.parametrize("exc", [MemoryError, OSError, RuntimeError, do.SettingError])
def test_a_failure_while_arming_a_queue_execution_keeps_its_buffers(host_backend, monkeypatch, exc):
    # the queue enqueues a batch, then arms its completion; any exception there leaves the
    # execution out of its lane: it must still hold its buffers until its work is done
    real = HostStream.signal
    raised: list = []

    def failing(self, fn):
        if not raised:
            raised.append(True)
            raise exc("injected while arming")
        real(self, fn)

    monkeypatch.setattr(HostStream, "signal", failing)
    refs: list = []

    async def main() -> None:
        async with WorkQueue(streams=1, batch=1) as q:
            await q.put(_watched_fill(refs, FILL_S))

    with pytest.raises(exc, match="injected"):
        asyncio.run(main())
    monkeypatch.setattr(HostStream, "signal", real)
    _held_until_done(refs, FILL_S)
    assert _reactor.stats()["pending"] == 0


def test_an_await_whose_arming_fails_keeps_its_buffers(host_backend, monkeypatch):
    real = HostStream.signal

    def failing(self, fn):
        raise MemoryError("injected while arming")

    monkeypatch.setattr(HostStream, "signal", failing)
    refs: list = []
    with pytest.raises(MemoryError, match="injected"):
        asyncio.run(_await(_watched_fill(refs, FILL_S)))
    monkeypatch.setattr(HostStream, "signal", real)
    _held_until_done(refs, FILL_S)


async def _await(op: do.DeviceOp) -> object:
    return await op


@pytest.mark.anyio
async def test_a_failing_step_does_not_block_the_loop(backend, anyio_backend):
    # a chain whose step raises after earlier steps were enqueued behind another task's long
    # work: its buffers go to the watcher, the loop is not held while that work runs
    s = do.next_stream()
    t = await do.zeros(N, do.float32)
    long_work = slow_fill(t, 3.0, 0.8).submit(s)

    def fail(_: object) -> do.DeviceOp:
        raise ValueError("a step's own error")

    async def failing() -> str:
        op = do.zeros(N, do.float32).then(lambda u: slow_fill(u, 1.0, 0.01)).then(fail)
        try:
            await op.wait(stream=s)
        except ValueError:
            return "raised"
        return "no error"

    gap, got = await longest_gap(failing())
    assert got == "raised"
    assert gap < 0.3, f"the loop was held for {gap:.3f} s on a failure path"
    await long_work


@pytest.mark.anyio
async def test_blocking_terminals_are_refused_on_a_running_loop(backend, anyio_backend):
    op = do.zeros(4, do.float32)
    with pytest.raises(do.UsageError, match=r"would block the running .* event loop.*[Aa]wait"):
        op.sync()
    with pytest.raises(do.UsageError, match="would block"):
        do.zeros(4, do.float32).sync_on(do.next_stream())
    fut = slow_fill(await do.zeros(N, do.float32), 1.0, 0.2).submit()
    with pytest.raises(do.UsageError, match="would block"):
        fut.result()
    with pytest.raises(TimeoutError):
        fut.result(timeout=0)  # does not wait: allowed
    await fut
    assert fut.result() is not None  # done: nothing to wait for
    t = await do.full(4, 2.0, do.float32)
    with pytest.raises(do.UsageError, match=r"numpy\(\) would block"):
        t.numpy()  # its copy would wait behind whatever the pool stream runs
    assert (await do.to_numpy(t)).tolist() == [2.0] * 4
    # in a worker thread the same calls block that thread only
    assert (await anyio.to_thread.run_sync(lambda: do.full(2, 1.0).sync().numpy().tolist())) == [1.0, 1.0]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, "1", True, 10**400])
def test_timeouts_are_checked_alike(backend, bad):
    fut = do.value(1).submit()
    with pytest.raises(do.UsageError, match="timeout"):
        fut.result(timeout=bad)
    with pytest.raises(do.UsageError, match="timeout"):
        fut.exception(timeout=bad)
    with pytest.raises(do.UsageError, match="timeout"):
        do.value(1).wait(timeout=bad)
    assert fut.result(timeout=30) == 1


def test_a_timed_out_await_says_how_to_get_the_result(backend):
    async def main() -> None:
        t = await do.zeros(N, do.float32)
        await slow_fill(t, 1.0, 0.3).wait(timeout=0.01)

    with pytest.raises(TimeoutError, match=r"submit\(\)") as e:
        asyncio.run(main())
    assert "Await it again" not in str(e.value)


def _fail_next_arming(backend: str, monkeypatch) -> None:
    """The fault switch: the next arming of a completion flag fails with an error of that call
    (CUDA_ERROR_INVALID_VALUE), on the host backend or the stub driver."""
    if backend == "host":
        real = HostStream.signal
        calls: list = []

        def failing(self, fn):
            if not calls:
                calls.append(1)
                raise do.CudaError("CUDA_ERROR_INVALID_VALUE: injected", name="CUDA_ERROR_INVALID_VALUE", code=1)
            real(self, fn)

        monkeypatch.setattr(HostStream, "signal", failing)
    elif STUB_DRIVER:
        from stub_driver import emulate

        emulate.fail_next_write(1)
    else:
        pytest.skip("the fault switch is the host backend's or the stub driver's")


def test_a_non_sticky_error_fails_only_its_own_await(backend, monkeypatch):
    # an error of one call (here: arming the completion flag) fails that await; another await
    # on the device completes, and no slot of the device is retired
    before = _reactor.stats()["quarantined"]

    async def main() -> list:
        t = await do.zeros(N, do.float32)
        _fail_next_arming(backend, monkeypatch)
        return await asyncio.gather(slow_fill(t, 1.0, 0.2).wait(), do.full(4, 3.0).wait(), return_exceptions=True)

    bad, ok = asyncio.run(main())
    assert isinstance(bad, do.CudaError) and bad.code == 1
    assert not isinstance(ok, BaseException)
    assert _reactor.stats()["quarantined"] == before
    assert do.full(2, 1.0).sync().numpy().tolist() == [1.0, 1.0]


def test_an_error_arming_a_queue_execution_fails_its_items_only(backend, monkeypatch):
    # the batch's work is in flight when its arming fails: its items get the error and the queue
    # ends without waiting for it, its buffers stay until its work completes, and the queue and
    # the device go on
    refs: list = []

    async def main(fail: bool) -> list:
        async with WorkQueue(streams=1, batch=1) as q:
            if fail:
                _fail_next_arming(backend, monkeypatch)
                await q.put(_watched_fill(refs, FILL_S))
            else:
                await q.put(lambda lane: do.full(4, 2.0))
        return q.results()

    (res,) = asyncio.run(main(True))
    assert isinstance(res.error, do.CudaError) and res.error.code == 1
    _held_until_done(refs, FILL_S)
    (res,) = asyncio.run(main(False))
    assert res.unwrap().numpy().tolist() == [2.0] * 4


def test_a_sticky_fault_retires_the_slot_of_a_timed_out_await(host_backend):
    # the await that timed out handed its execution to the watcher and left its slot armed; the
    # device then faults, so the flag is never written: the watcher sees the fault and retires
    # every slot of the device, and the scanner parks
    from helpers import slow_fill_k

    def fault(*_: object) -> None:
        raise ZeroDivisionError("the kernel faults")

    bad = do.kernels.Kernel(
        'extern "C" __global__ void bad(float* x) {}', "bad", params=(do.kernels.Out(do.float32),), host=fault
    )

    async def main() -> None:
        s = do.next_stream()
        t = await do.zeros(N, do.float32)
        with pytest.raises(TimeoutError):
            await slow_fill_k(t.partition((128,)), 1.0, t.size, 10**8).wait(timeout=0.01, stream=s)
        u = await do.zeros(128, do.float32)
        with pytest.raises(do.CudaError):
            await bad(u.partition((128,))).wait(stream=s)

    asyncio.run(main())
    deadline = time.monotonic() + 30
    while _reactor.stats()["pending"]:
        assert time.monotonic() < deadline, "a slot of the faulted device stayed armed"
        time.sleep(0.01)
    do.use_backend("host")  # (a fresh device for the tests after)


@pytest.mark.anyio
async def test_an_execution_offers_one_wait_to_loops_and_threads(backend, anyio_backend):
    t = await do.zeros(N, do.float32)
    op = slow_fill(t, 4.0, 0.3)
    op._take("test")
    cx, _ = start(op, do.next_stream(), "test")
    with pytest.raises(TimeoutError):
        await cx.completed(timeout=0.01)  # the work goes on
    assert not cx.wait_completed(timeout=0.0)
    await cx.completed(timeout=30)
    assert cx.wait_completed(timeout=0.0)  # complete: the blocking twin agrees at once
    cx.finish()
    assert (await do.to_numpy(t) == 4.0).all()
    with pytest.raises(do.UsageError, match="timeout"):
        await cx.completed(timeout=math.nan)


def test_hostile_sizes_raise_deviceop_errors(backend):
    from deviceop.executors import ThreadedQueue

    with pytest.raises(do.UsageError, match="at most 256"):
        WorkQueue(streams=10**9)
    with pytest.raises(do.UsageError, match="at most 256"):
        ThreadedQueue(streams=10**9)
    with pytest.raises(do.UsageError, match="batch"):
        WorkQueue(batch=10**20)
    with pytest.raises(do.UsageError, match="capacity"):
        WorkQueue(capacity=10**20)
    t = do.zeros(8).sync()
    with pytest.raises(do.ShapeError, match="slice steps"):
        t[::0]
    with pytest.raises(do.ShapeError, match="slice steps"):
        t[::"x"]


def test_an_allocation_the_host_cannot_make_is_a_cuda_error(host_backend, monkeypatch):
    import numpy

    real = numpy.empty

    def refuse(shape, dtype=float, *a, **k):
        if shape == 1 << 30:
            raise MemoryError("Unable to allocate")
        return real(shape, dtype, *a, **k)

    monkeypatch.setattr(numpy, "empty", refuse)
    with pytest.raises(do.CudaError, match=r"OUT_OF_MEMORY.*allocate less") as e:
        do.empty(1 << 30, do.uint8).sync()
    assert e.value.code == 2
    monkeypatch.setattr(numpy, "empty", real)
    assert do.zeros(2).sync().numpy().tolist() == [0.0, 0.0]  # not a sticky fault


@contextlib.contextmanager
def _device_full(backend: str) -> Iterator[None]:
    """Within it, an allocation that needs device memory beyond what is in use on entry fails
    as on a full device (CUDA_ERROR_OUT_OF_MEMORY), on the host backend or the stub driver."""
    if backend == "host":
        import numpy

        real = numpy.empty
        cap = do.used_bytes()

        def refuse(shape, dtype=float, *a, **k):  # type: ignore[no-untyped-def]
            if isinstance(shape, int) and do.used_bytes() + shape > cap:
                raise MemoryError("Unable to allocate")
            return real(shape, dtype, *a, **k)

        numpy.empty = refuse
        try:
            yield
        finally:
            numpy.empty = real
    elif STUB_DRIVER:
        from stub_driver import emulate

        emulate.set_pool_cap(emulate.pool_used())
        try:
            yield
        finally:
            emulate.set_pool_cap(0)
    else:
        pytest.skip("a full device is the host backend's or the stub driver's")


def _copy_of_a_fresh_buffer(dst: do.Tensor, v: float) -> do.DeviceOp:
    # (the fresh buffer is the execution's alone, not part of its value: it goes back when the
    # execution finishes)
    return slow_copy(dst, do.full(dst.size, v, do.float32), 0.005).map(lambda out: out[0].tensor)


def _until_complete(fut: do.DeviceFuture) -> None:
    # its work completes on the device; a query finishes nothing (a blocking wait is refused
    # on a loop's thread)
    ev = fut._done_event
    deadline = time.monotonic() + 30
    while not ev.query():
        assert time.monotonic() < deadline
        time.sleep(0.001)


async def test_a_full_device_takes_back_the_buffers_of_completed_work_left_to_a_loop(
    backend, anyio_backend, monkeypatch
):
    """A future submitted in a loop and not awaited yet is left to that loop by its stream's
    watcher (its grace): its buffers are held after its work completed. An allocation that
    finds the device full finishes that execution, so its blocks go back, and succeeds; the
    future's callbacks do not run on the allocating thread but where the future completes."""
    from deviceop._core import _future

    monkeypatch.setattr(_future, "GRACE", 60.0)
    dst = await do.zeros(1 << 20, do.float32)
    _settled()
    do.empty_cache()  # (a cached block would serve the allocation below)
    fut = _copy_of_a_fresh_buffer(dst, 7.0).submit()
    ran: list[int] = []
    fut.add_done_callback(lambda f: ran.append(1))
    _until_complete(fut)  # (nobody finished it)
    held = do.used_bytes()
    with _device_full(backend):
        x = await do.full(1 << 20, 1.0, do.float32)  # needs the block the future's execution holds
    assert do.used_bytes() == held  # (its block went back; x took as much)
    assert ran == []
    assert (await fut) is dst
    assert ran == [1]
    assert (await do.to_numpy(dst) == 7.0).all() and (await do.to_numpy(x) == 1.0).all()
    with _device_full(backend), pytest.raises(do.CudaError, match="OUT_OF_MEMORY"):
        await do.full(1 << 21, 1.0, do.float32)  # (nothing to take back: still an error)
    assert (await do.to_numpy(x) == 1.0).all()  # (an error of that allocation only)


async def test_a_full_device_serves_the_allocation_from_the_reclaimed_block_and_keeps_the_idle_ones(
    backend, anyio_backend, monkeypatch
):
    """The block that completed work gives back, of the size asked, serves the allocation from
    the cache: the idle blocks of other sizes stay cached, not given back to the driver."""
    if backend == "host":
        pytest.skip("the host backend caches no blocks")
    from deviceop._core import _future
    from deviceop.device import current

    monkeypatch.setattr(_future, "GRACE", 60.0)
    be = current()
    dst = await do.zeros(1 << 20, do.float32)
    _settled()
    do.empty_cache()
    other = await do.zeros(1 << 16, do.float32)  # (another size class)
    del other
    _settled()
    cached = be.blocks.cached
    assert cached >= 1 << 18
    fut = _copy_of_a_fresh_buffer(dst, 7.0).submit()
    _until_complete(fut)
    held = do.used_bytes()
    reclaimed: list[int] = []
    real_reclaim = be.reclaim

    def reclaim() -> int:
        reclaimed.append(real_reclaim())
        return reclaimed[-1]

    monkeypatch.setattr(be, "reclaim", reclaim)
    with _device_full(backend):
        x = await do.full(1 << 20, 1.0, do.float32)  # the future's block, taken from the cache
    # (the allocation found the device full and finished the future's execution itself)
    assert len(reclaimed) == 1 and reclaimed[0] >= 1
    assert do.used_bytes() == held  # (its block went back; x took as much)
    assert be.blocks.cached == cached  # (the idle block of the other size is still there)
    assert (await fut) is dst
    assert (await do.to_numpy(dst) == 7.0).all() and (await do.to_numpy(x) == 1.0).all()


async def test_empty_cache_takes_back_the_buffers_of_completed_work_left_to_a_loop(backend, anyio_backend, monkeypatch):
    from deviceop._core import _future

    monkeypatch.setattr(_future, "GRACE", 60.0)
    dst = await do.zeros(1 << 18, do.float32)
    _settled()
    base = do.used_bytes()
    fut = _copy_of_a_fresh_buffer(dst, 5.0).submit()
    ran: list[int] = []
    fut.add_done_callback(lambda f: ran.append(1))
    _until_complete(fut)
    assert do.used_bytes() >= base + (1 << 20)  # held while the loop has not taken it
    do.empty_cache()
    assert do.used_bytes() == base
    assert ran == []
    assert (await fut) is dst and ran == [1]
    assert (await do.to_numpy(dst) == 5.0).all()


def test_an_execution_dropped_while_this_thread_records_a_graph(backend):
    # its finaliser runs inside the recording: it only queues the execution (a query or an event
    # recorded on this thread would end the recording); the janitor hands it over
    refs: list = []
    fut = do.value(1).submit()
    x = do.ones(256).sync()
    y = do.zeros(256).sync()
    do.kernels.scale(y.partition((128,)), x, 1.0).sync()  # compiled and loaded before the timing
    op = _watched_fill(refs, FILL_S)  # (the bytes in use measured now; a recording and a collection follow)
    op._take("test")
    cx, out = start(op, do.next_stream(), "test")
    with do.graph.scope() as s:
        del cx, out
        gc.collect()  # the execution's finaliser runs here, during the recording
        fut.done()  # looks at nothing while recording
        s.record(do.kernels.scale(y.partition((128,)), x, 3.0))
    _held_until_done(refs, FILL_S)  # (first: a replay on the fill's stream would wait for it)
    s.graph.launch().sync()
    assert y.numpy().tolist() == [3.0] * 256


def test_await_a_future_of_a_replaced_host_device(host_backend):
    # queued work of a closed device completes; its future is awaited to the end
    do.set_host_chaos(0.01)
    t = do.zeros(1 << 12, do.float32).sync()
    fut = do.kernels.fill(t.partition((1 << 12,)), 3.0).submit()
    do.use_backend("host")

    async def main() -> object:
        return await fut.wait(timeout=20)

    assert asyncio.run(main()) is not None


def test_an_interrupt_while_futures_are_settled_leaves_none_of_them_pending(backend, monkeypatch):
    """A callback's KeyboardInterrupt (a Ctrl-C landing while a thread settles futures) reaches
    that thread once every future taken with it is settled: none is left pending with its
    execution unfinished, and the future's other callbacks run."""
    from deviceop._core import _future

    monkeypatch.setattr(_future, "GRACE", 60.0)  # (left to the loop: this thread settles both)
    t1, t2 = do.zeros(4096, do.float32).sync(), do.zeros(4096, do.float32).sync()
    s = do.next_stream()
    ran: list[int] = []

    def interrupt(f: do.DeviceFuture[object]) -> None:
        raise KeyboardInterrupt("while settling")

    async def main() -> tuple[do.DeviceFuture[object], do.DeviceFuture[object]]:
        f1 = slow_fill(t1, 1.0, 0.1).submit(s)
        f2 = slow_fill(t2, 2.0, 0.1).submit(s)  # (the same stream: settled in the same pass)
        f1.add_done_callback(interrupt)
        f1.add_done_callback(lambda f: ran.append(1))
        _until_complete(f2)
        with pytest.raises(KeyboardInterrupt, match="while settling"):
            f1.done()
        return f1, f2

    f1, f2 = asyncio.run(main())
    assert ran == [1]
    assert f2._cx.done and f2.done() and f1.done()
    assert f2.result(timeout=5)[1] == 2.0 and f1.result(timeout=5)[1] == 1.0  # (the kernel's arguments)


def test_an_interrupt_in_a_completion_callback_runs_the_others_and_releases_the_buffers(backend):
    """An execution's completion callbacks (staging copies, releases) all run when one of them
    raises KeyboardInterrupt; the interrupt is raised after them, its buffers are dropped."""
    cx, _ = start(do.zeros(4096, do.float32), do.next_stream(), "test")
    ran: list[int] = []

    def interrupt() -> None:
        raise KeyboardInterrupt("in a callback")

    cx.on_done(interrupt)
    cx.on_done(lambda: ran.append(1))
    cx.wait_completed()
    with pytest.raises(KeyboardInterrupt, match="in a callback"):
        cx.finish(False)  # (a failed execution's callbacks' errors are not raised; an interrupt is)
    assert ran == [1] and cx.done and cx.buffers is None


def test_a_future_refuses_a_callback_that_is_not_callable(backend):
    fut = do.zeros(16, do.float32).submit()
    with pytest.raises(do.UsageError, match="needs a callable, got int"):
        fut.add_done_callback(42)  # type: ignore[arg-type]
    fut.result(timeout=30)
    with pytest.raises(do.UsageError, match="needs a callable, got int"):
        fut.add_done_callback(42)  # type: ignore[arg-type]
