"""``await op`` / ``await future`` under asyncio, uvloop and trio, on every backend.

The event-loop library comes from anyio's pytest plugin (``anyio_backend``), the device
backend from the suite's ``backend`` fixture, so every test runs on each combination.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import subprocess
import sys
import textwrap
import threading
import time

import anyio
import numpy as np
import pytest
from conftest import needs_gpu
from helpers import long_chain, longest_gap, slow_copy, slow_fill

import deviceop as do
from deviceop._core import _wake

K = do.kernels

LOOPS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    pytest.param(("trio", {}), id="trio"),
]


@pytest.fixture(params=LOOPS)
def anyio_backend(request: pytest.FixtureRequest):
    name, opts = request.param
    if name == "trio":
        pytest.importorskip("trio")
    if opts.get("use_uvloop"):
        pytest.importorskip("uvloop")
    return name, opts


pytestmark = pytest.mark.anyio


@pytest.fixture(params=[1e-3, 0.0], ids=["poll", "park"])
def budget(request: pytest.FixtureRequest):
    """The default poll budget, and 0 (park at once: every await goes through a wake-up)."""
    old = do.poll_budget()
    do.set_poll_budget(request.param)
    yield request.param
    do.set_poll_budget(old)


# -- results -----------------------------------------------------------------------------------
async def test_await_results(backend, anyio_backend, budget) -> None:
    x0 = np.arange(1000, dtype=np.float32)
    x = await do.from_numpy(x0)
    y = await do.zeros(1000, do.float32)
    out = await K.scale(y.partition((100,)), x, 2.0)
    assert out[0].tensor is y and out[1] is x and out[2] == 2.0
    np.testing.assert_array_equal((await do.to_numpy(y)), x0 * 2)
    got = await K.add(y.partition((100,)), y, x).then(lambda o: do.to_numpy(o[0].tensor))
    np.testing.assert_array_equal(got, x0 * 3)
    a, b = await do.zip(do.value(1), do.full(3, 7.0, do.float16).then(do.to_numpy))
    assert a == 1 and b.tolist() == [7.0, 7.0, 7.0]
    assert await do.value("v").map(str.upper) == "V"


async def test_await_counters(backend, anyio_backend, budget) -> None:
    """``stats()`` counts awaits of ops, and polls only while a poll budget allows them."""
    from deviceop._core import _completion as _await

    t = await do.zeros(1024, do.float32)
    c0 = _await.stats()
    for _ in range(5):
        await slow_fill(t, 1.0, 0.002)
    c1 = _await.stats()
    assert c1["awaits"] - c0["awaits"] == 5
    if budget == 0.0:  # no polling at all: each await of the 2 ms work parks
        assert c1["polls"] == c0["polls"] and c1["parks"] - c0["parks"] == 5
    assert set(c1) == {"awaits", "parks", "late", "polls", "enqueue_yields"}


async def test_await_shared_and_submit(backend, anyio_backend, budget) -> None:
    s = do.full(128, 3.0, do.float32).shared()
    t1 = await s
    t2 = await s
    assert t1 is t2
    fut = do.to_numpy(t1).submit()
    got = await fut
    assert got.tolist() == [3.0] * 128 and fut.done()
    assert await fut is got  # awaiting a completed future again returns the same output
    fut2 = slow_fill(t1, 5.0, 0.05).submit()
    assert (await fut2.wait(timeout=30))[0].tensor is t1
    assert (await do.to_numpy(t1))[0] == 5.0


# -- many awaits at once -------------------------------------------------------------------------
async def test_many_concurrent_awaits(backend_kind, anyio_backend) -> None:
    """10 000 ops over 32 streams from one loop: every result right, memory back to baseline."""
    be = do.use_backend(backend_kind, streams=32)
    if backend_kind == "host":
        do.set_host_chaos(0.0001)
    try:
        for s in be.streams:
            s.synchronize()
        gc.collect()
        base = do.used_bytes()
        n_ops = 10_000
        wrong: list[int] = []
        limit = anyio.CapacityLimiter(2000)

        async def one(i: int) -> None:
            async with limit:
                v = float(i % 997)
                got = await do.full(8, v, do.float32).then(do.to_numpy)
                if not (got == v).all():
                    wrong.append(i)

        async with anyio.create_task_group() as tg:
            for i in range(n_ops):
                tg.start_soon(one, i)
        assert wrong == []
        gc.collect()
        for s in be.streams:
            s.synchronize()
        assert do.used_bytes() == base
    finally:
        do.set_host_chaos(0)
        do.use_backend(backend_kind)


# -- cancellation ----------------------------------------------------------------------------------
async def test_cancel_at_random_points(backend, anyio_backend) -> None:
    """Cancelled awaits raise at once; their work completes; the ledger orders later readers."""
    rng = random.Random(1234)
    srcs = [await do.full(256, float(i + 1), do.float32) for i in range(6)]
    dsts = [await do.zeros(256, do.float32) for _ in range(6)]
    for src, dst in zip(srcs, dsts):
        with anyio.move_on_after(rng.uniform(0, 0.03)) as scope:
            await slow_copy(dst, src, 0.05)
        if scope.cancelled_caught:
            # the copy is still running on its stream: a later op reading dst must see it
            assert (await do.to_numpy(dst) == (await do.to_numpy(src))).all()
        else:
            assert ((await do.to_numpy(dst)) == (await do.to_numpy(src))).all()


async def test_cancel_keeps_buffers_alive(backend, anyio_backend) -> None:
    """The task that owned the only names of the buffers is cancelled; the work still completes."""
    gc.collect()
    base = do.used_bytes()
    seen: list[np.ndarray] = []

    async def owner() -> None:
        t = await do.zeros(4096, do.float32)
        await slow_fill(t, 9.0, 0.1).inspect(lambda o: seen.append(o[0].tensor))

    with anyio.move_on_after(0.02) as scope:
        await owner()
    assert scope.cancelled_caught
    t = seen.pop()
    assert (await do.to_numpy(t) == 9.0).all()  # ordered after the cancelled fill
    del t
    # the cancelled execution's watcher gives its buffers back once its work completed (under
    # a sanitizer, which serialises launches, that can take far longer than the fill's 0.1 s)
    deadline = time.monotonic() + 30
    while True:
        await anyio.sleep(0.05)
        gc.collect()
        for s in do.streams():
            s.synchronize()
        if do.used_bytes() == base or time.monotonic() > deadline:
            break
    assert do.used_bytes() == base


# -- long enqueues: the loop gets turns -----------------------------------------------------------
async def test_an_awaited_long_chain_gives_its_loop_turns(backend, anyio_backend) -> None:
    """20 steps of 1 ms of host work: the loop's other task runs between slices of the enqueue;
    with the slice set to 0 it waits for the whole enqueue."""
    from deviceop._core._completion import stats

    assert do.enqueue_slice() == 5e-4
    t = await do.zeros(256, do.float32)
    await K.fill(t.partition((128,)), -1.0)  # the kernel built (a first build is one long step)
    ran: list[int] = []
    y0 = stats()["enqueue_yields"]
    gap, out = await longest_gap(long_chain(t, 20, ran).then(lambda o: do.to_numpy(o[0].tensor)))
    assert (out == 19.0).all() and ran == list(range(20))
    assert stats()["enqueue_yields"] - y0 >= 10
    assert gap < 0.012, f"the loop waited {gap * 1e3:.1f} ms for a turn"
    old = do.enqueue_slice()
    do.set_enqueue_slice(0)
    try:
        ran.clear()
        y0 = stats()["enqueue_yields"]
        gap, out = await longest_gap(long_chain(t, 20, ran).then(lambda o: do.to_numpy(o[0].tensor)))
        assert (out == 19.0).all() and ran == list(range(20))
        assert stats()["enqueue_yields"] == y0
        assert gap >= 0.02  # the whole enqueue held the loop
    finally:
        do.set_enqueue_slice(old)


async def test_a_task_cancelled_between_slices_enqueues_no_later_step(backend, anyio_backend) -> None:
    """Cancelled while its chain is being enqueued: the steps after the turn never run, the work
    enqueued completes (the ledger orders a later reader after it), and the buffers live."""
    t = await do.zeros(256, do.float32)
    await K.fill(t.partition((128,)), -1.0)  # the kernel built
    ran: list[int] = []
    with anyio.move_on_after(0.006) as scope:
        await long_chain(t, 50, ran)
    assert scope.cancelled_caught
    assert 1 <= len(ran) < 50 and ran == list(range(len(ran)))
    assert (await do.to_numpy(t) == float(ran[-1])).all()
    assert await do.value(3).then(lambda x: do.value(x + 1)) == 4  # the device stays usable


async def test_a_source_that_used_the_slice_gives_the_loop_a_turn_before_the_first_step(backend, anyio_backend) -> None:
    """A chain's source alone holds the loop longer than the slice (an upload and a model's
    first layers): the loop gets its turn before the first step, and a cancellation due by
    then enqueues no step at all."""
    from deviceop._core._completion import stats

    order: list[str] = []

    def long_source(stream: object) -> None:
        time.sleep(0.003)
        order.append("source")

    def chain() -> do.DeviceOp[None]:
        return do.external(long_source).then(lambda _: do.value(order.append("step")))

    y0 = stats()["enqueue_yields"]
    await chain()
    assert order == ["source", "step"]
    assert stats()["enqueue_yields"] - y0 == 1  # between the source and the step

    order.clear()
    with anyio.move_on_after(0) as scope:  # due at the first turn
        await chain()
    assert scope.cancelled_caught
    assert order == ["source"]
    assert await do.value(3).then(lambda x: do.value(x + 1)) == 4  # the device stays usable


async def test_another_tasks_work_between_two_steps_is_ordered_by_the_ledger(backend, anyio_backend) -> None:
    """A task reads, during a turn of a chain's enqueue, what the chain's first step writes on
    the GPU (slowly): the ledger orders the read after that write."""
    t = await do.zeros(256, do.float32)
    u = await do.zeros(256, do.float32)
    ran: list[int] = []
    seen: list[tuple[int, np.ndarray]] = []

    async def reader() -> None:
        while not ran:
            await anyio.sleep(0)
        at = len(ran)
        seen.append((at, await do.to_numpy(t)))

    first = do.value(None).then(lambda _: (ran.append(-1), slow_fill(t, 5.0, 0.02))[1])
    async with anyio.create_task_group() as tg:
        tg.start_soon(reader)
        await anyio.sleep(0)
        await long_chain(u, 10, ran, op=first)
    ((at, got),) = seen
    assert at < 11, "the read was enqueued after the whole chain"
    assert (got == 5.0).all()
    assert (await do.to_numpy(u) == 9.0).all()


async def test_a_step_failing_after_a_turn_raises_and_the_work_before_it_completes(backend, anyio_backend) -> None:
    t = await do.zeros(256, do.float32)
    ran: list[int] = []

    def boom(_):
        raise ValueError("step 8 failed")

    with pytest.raises(ValueError, match="step 8 failed"):
        await long_chain(t, 8, ran).map(boom).then(lambda _: do.value(0))
    assert ran == list(range(8))
    assert (await do.to_numpy(t) == 7.0).all()


def test_enqueue_slice_setting() -> None:
    old = do.enqueue_slice()
    for bad in (-1, 2, True, "1ms", None):
        with pytest.raises(do.SettingError, match="enqueue slice"):
            do.set_enqueue_slice(bad)  # type: ignore[arg-type]
    assert do.enqueue_slice() == old
    do.set_enqueue_slice(0.002)
    assert do.enqueue_slice() == 0.002
    do.set_enqueue_slice(old)


async def test_timeout(backend, anyio_backend) -> None:
    t = await do.zeros(128, do.float32)
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match="keeps running"):
        await slow_fill(t, 4.0, 0.3).wait(timeout=0.02)
    assert time.perf_counter() - t0 < 0.25
    assert (await do.to_numpy(t) == 4.0).all()
    fut = slow_fill(t, 6.0, 0.3).submit()
    with pytest.raises(TimeoutError):
        await fut.wait(timeout=0.01)
    assert (await fut.wait(timeout=30))[0].tensor is t
    assert (await do.to_numpy(t))[0] == 6.0


async def test_a_future_submitted_in_a_loop_is_completed_by_that_loop_when_awaited(
    backend, anyio_backend, monkeypatch
) -> None:
    """Its stream's watcher leaves it to the loop for a grace period: the loop's await finishes
    it (its callbacks run there), not a thread that must take the interpreter's lock from the
    loop, even when the loop's thread was busy while the work completed."""
    from deviceop._core import _future

    monkeypatch.setattr(_future, "GRACE", 30.0)
    base = do.used_bytes()
    t = await do.zeros(128, do.float32)
    fut = slow_fill(t, 2.0, 0.005).submit()
    ran_on: list[int] = []
    fut.add_done_callback(lambda f: ran_on.append(threading.get_ident()))
    ev = fut._done_event
    while not ev.query():  # (the loop's thread busy until the work is done; a query completes
        time.sleep(0.001)  # nothing, and the interpreter's lock is free)
    assert (await fut)[0].tensor is t
    assert ran_on == [threading.get_ident()]
    assert (await do.to_numpy(t))[0] == 2.0
    del fut, t, ev  # nothing else holds them, not even the watcher waiting out the grace
    deadline = time.monotonic() + 5
    while do.used_bytes() > base and time.monotonic() < deadline:
        await anyio.sleep(0.01)
    assert do.used_bytes() == base


async def test_a_future_submitted_in_a_loop_and_never_awaited_is_completed_by_its_watcher(
    backend, anyio_backend, monkeypatch
) -> None:
    from deviceop._core import _future

    monkeypatch.setattr(_future, "GRACE", 0.05)
    t = await do.zeros(128, do.float32)
    t0 = time.monotonic()
    fut = slow_fill(t, 3.0, 0.005).submit()
    ran: list[tuple[int, float]] = []
    fut.add_done_callback(lambda f: ran.append((threading.get_ident(), time.monotonic())))
    deadline = time.monotonic() + 10
    while not ran and time.monotonic() < deadline:
        await anyio.sleep(0.01)
    assert ran and ran[0][0] != threading.get_ident()
    assert ran[0][1] - t0 >= 0.05  # (left to the loop until then)


async def test_a_parked_await_of_a_future_is_not_left_to_the_grace(backend, anyio_backend, monkeypatch) -> None:
    """An await that parks asks the watcher to complete the future at once: without that, only
    the park's backing-off re-check (on this thread) would see it complete."""
    from deviceop._core import _completion, _future

    monkeypatch.setattr(_future, "GRACE", 30.0)
    monkeypatch.setattr(_completion, "_RECHECK", (60.0, 60.0))  # (no re-check would see it)
    t = await do.zeros(128, do.float32)
    fut = slow_fill(t, 4.0, 0.5).submit()  # (long past the await's poll: it parks)
    ran_on: list[int] = []
    fut.add_done_callback(lambda f: ran_on.append(threading.get_ident()))
    assert (await fut.wait(timeout=10))[0].tensor is t
    assert ran_on and ran_on[0] != threading.get_ident()


def test_a_future_submitted_outside_a_loop_gets_no_grace(backend, monkeypatch) -> None:
    from deviceop._core import _watch

    graces: list[float] = []
    real = _watch.Watcher.give

    def give(self, waitable, cx, then=None, grace=0.0):  # type: ignore[no-untyped-def]
        if getattr(then, "__name__", "") == "_complete":  # (a future's; not a hand-over)
            graces.append(grace)
        return real(self, waitable, cx, then, grace)

    monkeypatch.setattr(_watch.Watcher, "give", give)
    t = do.zeros(128, do.float32).sync()
    slow_fill(t, 5.0, 0.005).submit().result(timeout=30)

    async def main() -> None:
        await slow_fill(t, 6.0, 0.005).submit()

    asyncio.run(main())
    assert graces == [0.0, 0.05]


async def test_parked_await_costs_little_cpu(backend, anyio_backend) -> None:
    """A long op is awaited by parking, not polling: the process barely uses the CPU."""
    t = await do.zeros(128, do.float32)
    await slow_fill(t, 1.0, 0.01)  # compile and warm up
    c0, w0 = time.process_time(), time.perf_counter()
    await slow_fill(t, 2.0, 0.3)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    assert wall >= 0.25
    assert cpu < 0.1 * wall, f"awaiting used {cpu / wall:.0%} of a core"


# -- several loops -------------------------------------------------------------------------------
def test_two_loops_in_two_threads(backend) -> None:
    errors: list[BaseException] = []

    async def work(k: int) -> None:
        for i in range(50):
            v = float(k * 100 + i)
            got = await do.full(16, v, do.float32).then(do.to_numpy)
            assert (got == v).all()

    def run(lib: str, k: int) -> None:
        try:
            if lib == "trio":
                import trio

                trio.run(work, k)
            else:
                asyncio.run(work(k))
        except BaseException as e:
            errors.append(e)

    libs = ["asyncio", "trio"] if _has("trio") else ["asyncio", "asyncio"]
    threads = [threading.Thread(target=run, args=(lib, k)) for k, lib in enumerate(libs)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors


def _has(mod: str) -> bool:
    try:
        __import__(mod)
        return True
    except ImportError:
        return False


# -- errors --------------------------------------------------------------------------------------
async def test_bad_input(backend, anyio_backend) -> None:
    op = do.value(1)
    with pytest.raises(do.UsageError, match="timeout"):
        op.wait(timeout=-1)
    assert await op == 1
    with pytest.raises(do.UsageError, match="already consumed"):
        await op
    with pytest.raises(do.UsageError, match="not a deviceop stream"):
        do.value(1).wait(stream="s0")
    with pytest.raises(do.UsageError, match="poll budget"):
        do.set_poll_budget(-1)


async def test_await_while_another_thread_imports_trio(backend, anyio_backend, monkeypatch) -> None:
    """A half-imported trio in sys.modules (another thread is importing it) does not break an
    await on any loop: the loop library is asked of sniffio."""
    import types

    if "trio" in str(anyio_backend):
        pytest.skip("under trio, trio is fully imported: this is the asyncio loops' case")
    monkeypatch.setitem(sys.modules, "trio", types.ModuleType("trio"))  # no .lowlevel yet
    do.set_poll_budget(0)  # park: the dispatcher is looked up too
    try:
        t = await do.zeros(64, do.float32)
        assert (await do.to_numpy(t)).tolist() == [0.0] * 64
    finally:
        do.set_poll_budget(1e-3)


def test_await_outside_an_event_loop_says_what_to_use(backend) -> None:
    coro = do.value(1).wait()
    with pytest.raises(do.UsageError, match="running event loop"):
        coro.send(None)
    coro.close()


def test_await_outside_an_event_loop_lets_its_enqueued_work_finish(backend) -> None:
    """The loop is looked up once the work is enqueued: refused there, the work completes and
    its buffers are given back, as for a cancelled await."""
    base = do.used_bytes()
    coro = do.to_numpy(do.full((1 << 16,), 2.0, do.float32)).wait()
    with pytest.raises(do.UsageError, match="running event loop"):
        coro.send(None)
    coro.close()
    deadline = time.monotonic() + 10
    while do.used_bytes() > base and time.monotonic() < deadline:
        time.sleep(0.01)
    assert do.used_bytes() == base
    assert do.to_numpy(do.full((4,), 3.0, do.float32)).sync().tolist() == [3.0] * 4


async def test_host_fault_fails_parked_await(host_backend, anyio_backend) -> None:
    """Host functions never run after a context error; a parked await still fails, promptly."""
    do.set_poll_budget(0)
    try:
        t = await do.zeros(128, do.float32)

        def boom(out: np.ndarray, *rest: object) -> None:
            raise FloatingPointError("planted fault")

        bad = K.Kernel("unused", "boom", params=(K.Out(do.float32),), host=boom)
        before = slow_fill(t, 1.0, 0.05).submit()
        t0 = time.perf_counter()
        with pytest.raises(do.CudaError, match=r"planted fault|LAUNCH_FAILED"):
            await bad(t.partition((128,))).then(lambda o: slow_fill(t, 2.0, 0.01))
        assert time.perf_counter() - t0 < 5
        try:  # ran before the fault (the ledger ordered it first); may still see the sticky error
            await before.wait(timeout=5)
        except do.CudaError:
            pass
        after = slow_fill(t, 3.0, 0.01).submit()  # enqueued on a failed context
        with pytest.raises(do.CudaError):
            await after.wait(timeout=5)
        with pytest.raises(do.CudaError, match="unusable"):
            await do.zeros(4, do.float32)
    finally:
        do.set_poll_budget(1e-3)
        do.use_backend("host")


def test_cuda_fault_fails_future_and_later_work(backend_kind) -> None:
    """An out-of-bounds write in a user kernel: its await raises CudaError, later work says so."""
    if backend_kind != "cuda":
        pytest.skip("a device fault needs a GPU")
    needs_gpu(backend_kind, "a kernel that faults")
    if os.environ.get("DEVICEOP_SANITIZER"):
        pytest.skip("a deliberate out-of-bounds write: compute-sanitizer would count it")
    script = textwrap.dedent(
        """
        import asyncio, deviceop as do
        K = do.kernels
        SRC = 'extern "C" __global__ void oob(float* p) { p[(long long)threadIdx.x << 40] = 1.0f; }'
        k = K.Kernel(SRC, "oob", params=(K.Out(do.float32),))
        async def main():
            t = await do.zeros(32, do.float32)
            fut = do.full(32, 1.0, do.float32).submit()
            try:
                await k(t, grid=(1,), block=(32,))
            except do.CudaError as e:
                print("await:", e.name)
            try:
                fut.result(timeout=30)
                print("future: ok")
            except do.CudaError as e:
                print("future:", e.name)
            try:
                await do.zeros(4, do.float32)
            except do.CudaError as e:
                print("later:", e.name)
        asyncio.run(main())
        """
    )
    env = dict(os.environ, DEVICEOP_BACKEND="cuda", PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("await: CUDA_ERROR_"), r.stdout
    assert lines[1].startswith("future: "), r.stdout  # completed before the fault, or failed with it
    assert lines[2].startswith("later: CUDA_ERROR_"), r.stdout


# -- the wake-up channel -------------------------------------------------------------------------
def test_channel_push_drain() -> None:
    import select

    from deviceop._core._base import Channel

    ch = Channel()
    assert ch.drain() == []
    assert select.select([ch.fileno()], [], [], 0)[0] == []
    n_threads, per = 8, 2000

    def pusher(k: int) -> None:
        for i in range(per):
            ch.push(k * per + i)

    threads = [threading.Thread(target=pusher, args=(k,)) for k in range(n_threads)]
    got: list[int] = []
    for th in threads:
        th.start()
    deadline = time.monotonic() + 30
    while len(got) < n_threads * per and time.monotonic() < deadline:
        if select.select([ch.fileno()], [], [], 1.0)[0]:
            got.extend(ch.drain())
    for th in threads:
        th.join()
    got.extend(ch.drain())
    assert sorted(got) == list(range(n_threads * per))  # every token exactly once, none lost
    assert select.select([ch.fileno()], [], [], 0)[0] == []


async def test_dispatcher_per_loop(backend, anyio_backend) -> None:
    do.set_poll_budget(0)
    try:
        d = _wake.dispatcher()
        assert _wake.dispatcher() is d  # one per loop
        before = d.wakeups
        t = await do.zeros(128, do.float32)
        await slow_fill(t, 1.0, 0.01)
        # the await may end through its re-check timer a moment before the loop's reader (trio:
        # a pump task) dispatches the channel's token; the token still comes, in stream order
        with anyio.fail_after(5):
            while d.wakeups == before:
                await anyio.sleep(0.001)
        assert not d.waiters  # woken through the channel; nothing left waiting
        assert _wake.stats()["dispatchers"] >= 1
    finally:
        do.set_poll_budget(1e-3)


async def test_loop_dispatcher_is_the_running_loops(backend, anyio_backend) -> None:
    """The await's shortcut gives what sniffio and the dispatcher table would: this loop's
    library and dispatcher, again and again."""
    lib, d = _wake.loop_dispatcher()
    assert lib == _wake.current_lib() and d is _wake.dispatcher()
    assert _wake.loop_dispatcher() == (lib, d)


def test_loop_dispatcher_follows_loops_and_threads(backend) -> None:
    """A new loop in the thread, or a loop in another thread, gets its own dispatcher; outside
    a loop the shortcut refuses as the await does."""

    async def get():
        return _wake.loop_dispatcher()

    a = asyncio.run(get())
    b = asyncio.run(get())
    assert a[0] == b[0] == "asyncio" and a[1] is not b[1]
    box = []
    th = threading.Thread(target=lambda: box.append(asyncio.run(get())))
    th.start()
    th.join()
    assert box[0][1] is not b[1]
    with pytest.raises(do.UsageError, match="running event loop"):
        _wake.loop_dispatcher()
    import trio

    assert trio.run(get)[0] == "trio"


def test_loop_dispatcher_follows_trio_runs_and_threads(backend) -> None:
    """Under trio the shortcut gives each run its own dispatcher, the one dispatcher() gives,
    in this thread and in another running at the same time, and an await works in each."""
    import trio

    t = do.zeros(256, do.float32).sync()

    async def get():
        first = _wake.loop_dispatcher()
        await do.kernels.fill(t.partition((128,)), 1.0)
        again = _wake.loop_dispatcher()
        assert again == first and first == ("trio", _wake.dispatcher("trio"))
        return first[1]

    a, b = trio.run(get), trio.run(get)
    assert a is not b
    box: list = []
    gate = threading.Barrier(2)

    async def side():
        gate.wait()  # the two runs overlap
        box.append(await get())

    th = threading.Thread(target=trio.run, args=(side,))
    th.start()

    async def here():
        gate.wait()
        return await get()

    c = trio.run(here)
    th.join()
    assert box and box[0] is not c and c is not b


def test_an_await_records_no_event_a_thread_would_block_on(backend, monkeypatch) -> None:
    """The reactor's flag says when awaited work is done: no completion event is recorded for
    it (on cuda, an event a thread blocks on makes the GPU interrupt the host), while a
    submitted op's watcher thread still blocks on one made for that."""
    t = do.zeros(1024, do.float32).sync()
    be = do.streams()[0].backend
    kinds: list[bool] = []
    real = be.new_event

    def spy(host_wait: bool = False):  # type: ignore[no-untyped-def]
        kinds.append(host_wait)
        return real(host_wait)

    monkeypatch.setattr(be, "new_event", spy)

    async def main() -> None:
        for v in range(3):
            await K.fill(t.partition((256,)), float(v))

    asyncio.run(main())
    assert True not in kinds, kinds
    assert float(t.numpy()[-1]) == 2.0
    K.fill(t.partition((256,)), 5.0).submit().result(10)
    assert True in kinds
    assert float(t.numpy()[-1]) == 5.0
