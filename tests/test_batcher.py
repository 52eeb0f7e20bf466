"""Batcher: concurrent requests gathered into batched ops, per-request results and errors, on
asyncio, uvloop and trio (anyio.run with each), on every backend."""

from __future__ import annotations

import time

import anyio
import numpy as np
import pytest

import deviceop as do
from deviceop.executors import Batcher

K = do.kernels
LOOPS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    pytest.param(("trio", {}), id="trio"),
]


def _run(loop, main):
    name, opts = loop
    if name == "trio":
        pytest.importorskip("trio")
    if opts.get("use_uvloop"):
        pytest.importorskip("uvloop")
    return anyio.run(main, backend=name, backend_options=opts)


def _scale_rows(sizes: list[int]):
    """fn(items): one batched GPU op for the batch (rows stacked, scaled by 2 on the device),
    its output one numpy row per item."""

    def fn(items: list[np.ndarray]) -> do.DeviceOp[list[np.ndarray]]:
        sizes.append(len(items))
        x = np.stack(items)

        def scale(out: do.Tensor) -> do.DeviceOp:  # out: allocated as part of the op
            op = do.from_numpy(x).then(lambda t: K.scale(out.partition((1, x.shape[1])), t, 2.0))
            return op.then(lambda _: do.to_numpy(out))

        return do.empty(x.shape, do.float32).then(scale).map(list)

    return fn


@pytest.mark.parametrize("loop", LOOPS)
def test_concurrent_requests_are_batched_and_each_gets_its_result(backend, loop):
    sizes: list[int] = []
    b = Batcher(_scale_rows(sizes), max_batch=4, max_delay=0.05)
    got: dict[int, np.ndarray] = {}

    async def one(i: int) -> None:
        got[i] = await b(np.full(64, i, np.float32))

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for i in range(10):
                tg.start_soon(one, i)

    _run(loop, main)
    assert sorted(got) == list(range(10))
    for i, row in got.items():
        np.testing.assert_array_equal(row, np.full(64, 2 * i, np.float32))
    assert sum(sizes) == 10 and max(sizes) <= 4 and len(sizes) <= 4, sizes  # gathered, never beyond max_batch
    st = b.stats()
    assert st["batches"] == len(sizes) and st["requests"] == 10 and st["largest_batch"] == max(sizes)


def test_a_lone_request_runs_after_max_delay(backend):
    sizes: list[int] = []
    b = Batcher(_scale_rows(sizes), max_batch=8, max_delay=0.05)

    async def main() -> float:
        t0 = time.perf_counter()
        await b(np.ones(8, np.float32))
        return time.perf_counter() - t0

    dt = anyio.run(main)
    assert sizes == [1]
    assert 0.045 <= dt < 2.0  # waited for company, then ran alone


@pytest.mark.parametrize("loop", LOOPS[:2])
def test_a_batch_waiting_for_its_delay_does_not_spin_the_loop(host_backend, loop, monkeypatch):
    """The delay is one loop timer. An anyio deadline checks itself again whenever its timer
    fires before the deadline, which uvloop's millisecond timers do at the end of nearly every
    wait: it spun the loop for up to a millisecond per batch (tens of re-checks each)."""
    backend_mod = pytest.importorskip("anyio._backends._asyncio")
    scope = backend_mod.CancelScope
    if not hasattr(scope, "_timeout"):
        pytest.skip("this anyio checks its deadlines differently")
    checks = [0]
    real = scope._timeout

    def counted(self):  # type: ignore[no-untyped-def]
        checks[0] += 1
        return real(self)

    monkeypatch.setattr(scope, "_timeout", counted)
    b = Batcher(lambda xs: do.value(list(xs)), max_batch=8, max_delay=0.003)

    async def main() -> list[int]:
        return [await b(i) for i in range(30)]

    assert _run(loop, main) == list(range(30))
    assert checks[0] <= 30, checks[0]  # about one per batch at most, not tens


def test_a_full_batch_runs_without_waiting_for_its_delay(backend):
    sizes: list[int] = []
    b = Batcher(_scale_rows(sizes), max_batch=3, max_delay=30.0)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(b, np.full(8, i, np.float32))

    t0 = time.perf_counter()
    anyio.run(main)
    assert sizes == [3] and time.perf_counter() - t0 < 10


@pytest.mark.parametrize("loop", LOOPS)
def test_errors_stay_with_their_requests(host_backend, loop):
    def fn(items: list[int]) -> do.DeviceOp[list[object]]:
        if 13 in items:
            raise ValueError("thirteen")  # fails its whole batch
        return do.value([ValueError(f"odd {x}") if x % 2 else x * 10 for x in items])

    b = Batcher(fn, max_batch=2, max_delay=0.01)
    out: dict[int, object] = {}

    async def one(i: int) -> None:
        try:
            out[i] = await b(i)
        except ValueError as e:
            out[i] = str(e)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for i in (2, 3):  # one batch: a result and a per-request error
                tg.start_soon(one, i)
        async with anyio.create_task_group() as tg:
            for i in (13, 4):  # fn raises: both fail
                tg.start_soon(one, i)
        out[6] = await b(6)  # the Batcher goes on

    _run(loop, main)
    assert out == {2: 20, 3: "odd 3", 13: "thirteen", 4: "thirteen", 6: 60}
    assert b.stats()["failed_batches"] == 1


def test_a_wrong_number_of_results_is_refused(host_backend):
    b = Batcher(lambda items: do.value(items[:-1]), max_batch=4, max_delay=0.0)

    async def main() -> None:
        await b(1)

    with pytest.raises(do.UsageError, match="0 results for a batch of 1"):
        anyio.run(main)
    b2 = Batcher(lambda items: 3, max_delay=0.0)
    with pytest.raises(do.UsageError, match="not a DeviceOp"):
        anyio.run(lambda: b2(1))
    b3 = Batcher(lambda items: do.value(5), max_delay=0.0)
    with pytest.raises(do.UsageError, match="must be a list"):
        anyio.run(lambda: b3(1))


def test_bad_arguments():
    with pytest.raises(do.UsageError, match="callable"):
        Batcher(3)  # type: ignore[arg-type]
    for bad in (0, -1, 2.5, True):
        with pytest.raises(do.UsageError, match="max_batch"):
            Batcher(lambda xs: do.value(xs), max_batch=bad)  # type: ignore[arg-type]
    for bad in (-0.1, float("nan"), float("inf"), "1", 61):
        with pytest.raises(do.UsageError, match="max_delay"):
            Batcher(lambda xs: do.value(xs), max_delay=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("loop", LOOPS)
def test_cancelled_requests_do_not_disturb_their_batch(host_backend, loop):
    calls: list[list[int]] = []

    def fn(items: list[int]) -> do.DeviceOp[list[int]]:
        calls.append(list(items))
        return do.value([x + 1 for x in items])

    b = Batcher(fn, max_batch=8, max_delay=0.1)
    out: dict[int, int] = {}

    async def one(i: int) -> None:
        out[i] = await b(i)

    async def main() -> None:
        with anyio.fail_after(20):  # a stranded batch would hang its requests: fail instead
            await requests()

    async def requests() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(one, 0)  # the leader
            await anyio.sleep(0.01)
            with anyio.CancelScope() as cs:  # a follower, cancelled while its batch gathers
                cs.cancel()
                await one(1)
            tg.start_soon(one, 2)

        # the leader itself cancelled: its batch still runs for the others
        async def late(i: int) -> None:
            await anyio.sleep(0.01)
            await one(i)

        async with anyio.create_task_group() as tg:
            tg.start_soon(late, 11)
            with anyio.move_on_after(0.02):
                await one(10)

    _run(loop, main)
    assert out == {0: 1, 2: 3, 11: 12}
    assert calls[0] == [0, 1, 2] and calls[1] == [10, 11]


def test_one_batcher_belongs_to_one_loop(host_backend):
    b = Batcher(lambda xs: do.value(list(xs)), max_delay=0.0)
    assert anyio.run(lambda: b(1)) == 1
    with pytest.raises(do.UsageError, match="event loop that first called it"):
        anyio.run(lambda: b(2))
    with pytest.raises(do.UsageError, match="event loop"):
        b(3).send(None)  # outside a loop: refused before anything runs
    pytest.importorskip("trio")
    with pytest.raises(do.UsageError, match="event loop that first called it"):
        anyio.run(lambda: b(4), backend="trio")


def test_the_batchers_loop_check_reads_what_sniffio_would(host_backend):
    # the Batcher's check at every request: its own asyncio loop, known without asking sniffio,
    # where sniffio would say asyncio (asyncio.run, or anyio.run, which names asyncio to it)
    import asyncio

    import sniffio

    from deviceop._core._wake import on_asyncio_loop

    other = asyncio.new_event_loop()

    async def main() -> tuple[bool, bool, str]:
        here = asyncio.get_running_loop()
        return on_asyncio_loop(here), on_asyncio_loop(other), sniffio.current_async_library()

    async def named_trio() -> bool:  # a library naming itself to sniffio: not asyncio's reading
        token = sniffio.current_async_library_cvar.set("trio")
        try:
            return on_asyncio_loop(asyncio.get_running_loop())
        finally:
            sniffio.current_async_library_cvar.reset(token)

    try:
        assert asyncio.run(main()) == (True, False, "asyncio")
        assert anyio.run(main) == (True, False, "asyncio")
        assert asyncio.run(named_trio()) is False
        assert not on_asyncio_loop(other)  # no loop runs here
    finally:
        other.close()
    trio = pytest.importorskip("trio")

    async def under_trio() -> bool:
        return on_asyncio_loop(other)

    assert trio.run(under_trio) is False


@pytest.mark.parametrize("runner", ["asyncio.run", "anyio.run"])
def test_a_batcher_on_its_loop_does_not_ask_sniffio_at_every_request(host_backend, monkeypatch, runner):
    import asyncio

    from deviceop.executors import _batcher

    asked = []
    real = _batcher.current_lib
    monkeypatch.setattr(_batcher, "current_lib", lambda: asked.append(1) or real())
    b = Batcher(lambda xs: do.value(list(xs)), max_batch=4, max_delay=0.0)

    async def main() -> list[int]:
        return list(await asyncio.gather(*(b(i) for i in range(20))))

    out = asyncio.run(main()) if runner == "asyncio.run" else anyio.run(main)
    assert out == list(range(20))
    assert len(asked) == 1  # the first request, which binds the Batcher to its loop


def test_an_interrupted_batch_tells_its_other_requests(host_backend):
    def fn(items: list[int]) -> do.DeviceOp[list[int]]:
        raise SystemExit(3)  # (KeyboardInterrupt alike) raised by the leading request

    b = Batcher(fn, max_batch=8, max_delay=0.05)
    seen: dict[str, object] = {}

    async def leader() -> None:
        try:
            await b(1)
        except SystemExit as e:
            seen["leader"] = e.code

    async def follower() -> None:
        await anyio.sleep(0.01)
        try:
            await b(2)
        except do.UsageError as e:
            seen["follower"] = str(e)

    async def main() -> None:
        with anyio.fail_after(20):  # a follower left waiting would hang: fail instead
            async with anyio.create_task_group() as tg:
                tg.start_soon(leader)
                tg.start_soon(follower)

    anyio.run(main)
    assert seen["leader"] == 3 and "interrupted (SystemExit" in str(seen["follower"])


def test_a_cancelled_batch_says_so_to_its_other_requests(host_backend):
    # the batch's own task cancelled while it runs (asyncio, as when its loop closes): the other
    # requests are told that, not that their leading request was interrupted
    import asyncio

    def fn(items: list[int]) -> do.DeviceOp[list[int]]:
        raise asyncio.CancelledError  # (what a cancellation of the batch's task raises in it)

    b = Batcher(fn, max_batch=8, max_delay=0.05)

    async def follower() -> int:
        await asyncio.sleep(0.01)
        return await b(2)

    async def main() -> list[object]:
        return await asyncio.wait_for(asyncio.gather(b(1), follower(), return_exceptions=True), 20)

    leader, other = asyncio.run(main())
    assert isinstance(leader, asyncio.CancelledError)
    assert isinstance(other, do.UsageError) and "cancelled (CancelledError" in str(other)
    assert b.stats()["failed_batches"] == 1


@pytest.mark.parametrize("loop", LOOPS[:2])
def test_a_leader_whose_task_is_cancelled_still_runs_its_batch(host_backend, loop):
    """``task.cancel()`` of the request leading a batch (a framework cancelling the handler of
    a client gone) raises CancelledError in that request at once; its batch still runs, and the
    other requests get their results instead of waiting forever."""
    import asyncio

    b = Batcher(lambda xs: do.value([10 * x for x in xs]), max_batch=4, max_delay=0.05)

    async def main() -> list:
        lead = asyncio.ensure_future(b(1))
        await asyncio.sleep(0.01)  # the leader waits for its batch's delay
        follower = asyncio.ensure_future(b(2))
        await asyncio.sleep(0.005)
        lead.cancel()
        with anyio.fail_after(10):  # a follower left waiting would hang: fail instead
            return await asyncio.gather(lead, follower, return_exceptions=True)

    got = _run(loop, main)
    assert isinstance(got[0], asyncio.CancelledError) and got[1] == 20
    assert b.stats()["batches"] == 1
