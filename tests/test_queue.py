"""Work queues: WorkQueue (one thread, S streams, asyncio/uvloop/trio) and ThreadedQueue."""

from __future__ import annotations

import gc
import itertools
import os
import time

import anyio
import numpy as np
import pytest
from conftest import needs_gpu
from helpers import long_chain, longest_gap, slow_fill

import deviceop as do
from deviceop.executors import ItemResult, QueueCancelled, ThreadedQueue, WorkQueue

K = do.kernels
# under compute-sanitizer (tests/sanitize.sh sets this) each enqueue takes longer than the
# tests' short kernels run, so a queue rightly keeps its work on the first lanes that come free:
# the tests that check the work spreads over every lane check it only at the GPU's own speed
SANITIZED = bool(os.environ.get("DEVICEOP_SANITIZER"))
LOOPS = [
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("trio", {}), id="trio"),
]


def _lane_buffers(n_lanes: int, size: int = 256) -> list[do.Tensor]:
    return [do.zeros(size, do.float32).sync() for _ in range(n_lanes)]


def _items(bufs: list[do.Tensor], count: int):
    # item i fills its lane's buffer with i; its output says which value it wrote
    return [
        lambda lane, i=i: K.fill(bufs[lane].partition((128,)), float(i)).map(lambda out, i=i: (i, out[0].tensor))
        for i in range(count)
    ]


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("streams", [1, 3, 6])
def test_work_queue_runs_every_item_in_order_of_results(backend, loop, streams):
    bufs = _lane_buffers(streams)

    async def main():
        q = WorkQueue(streams=streams, capacity=4)
        res = await q.run(_items(bufs, 40))
        return q, res

    q, res = anyio.run(main, backend=loop[0], backend_options=loop[1])
    assert [r.index for r in res] == list(range(40))
    assert all(r.ok for r in res), [r.error for r in res if not r.ok]
    assert [r.value[0] for r in res] == list(range(40))
    assert {r.lane for r in res} <= set(range(streams))
    st = q.stats()
    assert st.items == 40 and st.errors == 0 and st.cancelled == 0 and st.host_threads == 1
    assert st.throughput > 0 and 0 <= st.latency_p50 <= st.latency_p90 <= st.latency_p99
    assert len(st.busy_s) == streams and sum(st.busy_s) > 0
    # every lane's buffer holds the last value some item wrote there
    for lane in range(streams):
        last = [r.value[0] for r in res if r.lane == lane]
        if last:
            assert (bufs[lane].numpy() == last[-1]).all()


def _pending_after_each_put(streams: int, capacity: int, batch: int, n: int, seconds: float):
    """Put n slow items one by one; after each put, how many are queued or in flight (no await
    between the put and the count: nothing completes in between)."""
    bufs = _lane_buffers(streams)
    counts = []

    async def main():
        q = WorkQueue(streams=streams, capacity=capacity, batch=batch)
        async with q:
            for _ in range(n):
                await q.put(lambda lane: slow_fill(bufs[lane], 1.0, seconds))
                counts.append(sum(1 for r in q.results() if r.latency_s == 0.0))
        return q

    return anyio.run(main), counts


def test_work_queue_back_pressure_bounds_pending_items(backend):
    # put returns only while at most `capacity` items are queued or in flight
    q, seen = _pending_after_each_put(2, 3, 8, 12, 0.002)
    assert q.stats().items == 12 and max(seen) <= 3 and seen[-1] >= 1


def test_work_queue_put_at_capacity_resumes_at_half_and_refills(backend):
    # a producer at capacity is woken once half the capacity is free, not at every completion:
    # a put that waited returns with at most half the capacity plus its own item pending (woken
    # at every completion, it would return with the queue full again, every time)
    q, after = _pending_after_each_put(1, 4, 1, 20, 0.005)
    assert q.stats().items == 20
    assert max(after) <= 4 and after[:4] == [1, 2, 3, 4]
    assert sum(1 for n in after[4:] if n <= 3) >= 4, after


def test_work_queue_keeps_a_streams_next_batch_queued_behind_the_running_one(backend):
    # two executions in flight per stream: while one runs the next is queued behind it, so
    # each item's latency includes the one ahead of it (with one the stream would idle between
    # items and the latencies would add up to the run); busy time counts overlap once
    bufs = _lane_buffers(1)

    async def main():
        q = WorkQueue(streams=1, batch=1)
        await q.run([lambda lane: slow_fill(bufs[lane], 1.0, 0.01) for _ in range(16)])
        return q

    q = anyio.run(main)
    st, res = q.stats(), q.results()
    assert all(r.ok for r in res), [r.error for r in res if not r.ok]
    assert sum(r.latency_s for r in res) > 1.3 * st.seconds
    assert 0 < st.busy_s[0] <= st.seconds


@pytest.mark.parametrize("queue", ["work", "threaded"])
def test_default_capacity_feeds_every_lane_a_full_batch(backend, queue):
    # the default bound leaves room for each lane's running batch and the next one: with a
    # bound of one batch in all, the first lane would take every waiting item and the others
    # would idle until it finished
    assert WorkQueue(streams=4, batch=8).capacity == 64
    assert WorkQueue(streams=3, batch=1).capacity == 12
    assert ThreadedQueue(streams=2, batch=5).capacity == 20
    bufs = _lane_buffers(4)
    items = [lambda lane: slow_fill(bufs[lane], 1.0, 0.005) for _ in range(64)]
    if queue == "work":

        async def main():
            q = WorkQueue(streams=4, batch=8)
            await q.run(items)
            return q

        q = anyio.run(main)
    else:
        q = ThreadedQueue(streams=4, batch=8)
        q.run(items)
    res = q.results()
    assert all(r.ok for r in res), [r.error for r in res if not r.ok]
    if not SANITIZED:
        assert {r.lane for r in res} == {0, 1, 2, 3}


def test_work_queue_keeps_errors_per_item_and_goes_on(backend):
    bufs = _lane_buffers(2)

    def bad(lane):
        return K.add(bufs[lane].partition((100,)), bufs[lane], bufs[lane])  # 100 does not divide 256

    def not_an_op(lane):
        return 42

    async def main():
        q = WorkQueue(streams=2)
        return q, await q.run([_items(bufs, 1)[0], bad, not_an_op, _items(bufs, 2)[1]])

    q, res = anyio.run(main)
    assert res[0].ok and res[3].ok
    assert isinstance(res[1].error, do.ShapeError)
    assert isinstance(res[2].error, do.UsageError) and "not a DeviceOp" in str(res[2].error)
    with pytest.raises(do.ShapeError):
        res[1].unwrap()
    assert q.stats().errors == 2


@pytest.mark.parametrize("batch", [1, 4])
def test_an_execution_counts_one_await_and_a_batch_that_failed_whole_none(backend, batch):
    # the compiled lanes count an await per execution that went in flight; a batch whose every
    # item failed to make its op (an op consumed already, a factory that raised) goes nowhere
    from deviceop._core._completion import stats

    bufs = _lane_buffers(1)
    used = K.fill(bufs[0].partition((128,)), 1.0)
    used.sync()

    def boom(lane):
        raise ValueError("no op")

    async def main():
        q = WorkQueue(streams=1, batch=batch)
        a0 = stats()["awaits"]
        async with q:
            await q.put(used)  # consumed already: its error, no execution
            await q.put(boom)
        mid = stats()["awaits"] - a0
        q2 = WorkQueue(streams=1, batch=batch)
        res = await q2.run(_items(bufs, 8))
        return q.results(), mid, res, stats()["awaits"] - a0 - mid

    failed, mid, res, n = anyio.run(main)
    assert "already consumed" in str(failed[0].error) and isinstance(failed[1].error, ValueError)
    assert [r.lane for r in failed] == [0, 0]
    assert mid == 0
    assert 8 // batch <= n <= 8 and all(r.ok for r in res)
    # the compiled pass fills in every result: its lane, its wait in the queue, its latency
    assert all(r.lane == 0 and r.queued_s >= 0 and r.latency_s > 0 for r in res)


def test_work_queue_cancel_stops_everything(backend):
    bufs = _lane_buffers(2)

    async def main():
        q = WorkQueue(streams=2, capacity=100)
        async with q:
            for _ in range(20):
                await q.put(lambda lane: slow_fill(bufs[lane], 2.0, 0.05))
            await anyio.sleep(0.02)
            q.cancel()
            await anyio.sleep(0)  # the body is inside the queue's cancel scope
        return q

    t = time.perf_counter()
    q = anyio.run(main)
    assert time.perf_counter() - t < 0.5, "cancel must not wait for queued work"
    res = q.results()
    assert len(res) == 20
    assert any(isinstance(r.error, QueueCancelled) for r in res)
    assert q.stats().cancelled >= 18
    with pytest.raises(do.UsageError, match="runs once"):
        anyio.run(q.__aenter__)
    # buffers are usable again once the in-flight fills complete
    do.to_numpy(bufs[0]).sync()


def test_work_queue_async_iterator_source(backend):
    bufs = _lane_buffers(3)

    async def gen():
        for it in _items(bufs, 10):
            await anyio.sleep(0)
            yield it

    async def main():
        return await WorkQueue(streams=3).run(gen())

    res = anyio.run(main)
    assert [r.value[0] for r in res] == list(range(10))


def test_work_queue_bad_arguments(backend):
    with pytest.raises(do.UsageError, match="at least one stream"):
        WorkQueue(streams=0)
    with pytest.raises(do.UsageError, match="capacity"):
        WorkQueue(streams=2, capacity=0)
    with pytest.raises(do.UsageError, match="not a deviceop stream"):
        WorkQueue(streams=["s0"])
    for q in (WorkQueue, ThreadedQueue):  # neither a count nor a list (were TypeErrors)
        for bad in (True, 2.0, "s0"):
            with pytest.raises(do.UsageError, match="number of streams or a list"):
                q(streams=bad)
        assert len(q(streams=iter(do.streams()[:1])).streams) == 1  # (any iterable of streams)

    async def put_outside():
        await WorkQueue(streams=1).put(lambda lane: None)

    with pytest.raises(do.UsageError, match="inside 'async with'"):
        anyio.run(put_outside)

    async def put_junk():
        async with WorkQueue(streams=1) as q:
            await q.put(3)

    with pytest.raises(do.UsageError, match="DeviceOps or callables"):
        anyio.run(put_junk)

    # run() queues items a queue's worth at a time; one that is not an item among them is refused
    # when its turn comes, and the items after it are not queued
    seen = []

    def item(lane):
        return do.value(lane)

    def items():
        for i in range(8):
            seen.append(i)
            yield 3 if i == 6 else item

    async def run_junk():
        await WorkQueue(streams=1, capacity=4).run(items())

    with pytest.raises(do.UsageError, match="DeviceOps or callables"):
        anyio.run(run_junk)
    assert seen == list(range(7))


def test_lanes_feed_queues_until_capacity_a_non_item_or_the_end():
    # the compiled feed behind run(): each call queues the item it is given, then more, while the
    # queue has room and they are items; it returns the first it did not queue, or END
    from collections import deque

    from deviceop._core._completion import COUNTS
    from deviceop._core._lanes import END, Lanes
    from deviceop.executors import ItemResult

    items: deque = deque()
    results: list = []
    lanes = Lanes([None], items, results, ItemResult, [0.0], [], 2, 8, COUNTS, None, Exception)
    f = lambda lane: do.value(lane)  # noqa: E731
    it = iter([f, f, f, "junk", f])
    assert lanes.feed(f, it, 3) is f and lanes.pending == 3  # full: the fourth comes back
    assert [r.index for r in results] == [0, 1, 2] and [p[0] for p in items] == [f, f, f]
    assert lanes.feed(f, it, 10) == "junk" and lanes.pending == 4
    assert lanes.feed(f, iter([]), 10) is END and lanes.pending == 5
    assert lanes.feed("junk", iter([f]), 10) == "junk" and lanes.pending == 5  # (not an item: not queued)
    lanes.stopped = True  # (the queue cancelled)
    assert lanes.feed(f, iter([f]), 10) is f and lanes.pending == 5


def test_work_queue_more_streams_than_the_pool(backend):
    n = len(do.streams()) + 3
    bufs = _lane_buffers(n)

    async def main():
        q = WorkQueue(streams=n)
        return q, await q.run(_items(bufs, 3 * n))

    q, res = anyio.run(main)
    assert all(r.ok for r in res) and len(q.streams) == n and len({id(s) for s in q.streams}) == n


@pytest.mark.parametrize("streams", [1, 4])
def test_threaded_queue_matches(backend, streams):
    bufs = _lane_buffers(streams)
    q = ThreadedQueue(streams=streams, capacity=3)
    res = q.run(_items(bufs, 30))
    assert all(isinstance(r, ItemResult) and r.ok for r in res)
    assert [r.value[0] for r in res] == list(range(30))
    st = q.stats()
    assert st.items == 30 and st.host_threads == streams and len(st.busy_s) == streams
    with pytest.raises(do.UsageError, match="runs once"):
        q.run([])


def test_threaded_queue_errors_and_cancel(backend):
    bufs = _lane_buffers(2)
    q = ThreadedQueue(streams=2, capacity=2)

    def items():
        yield lambda lane: 42
        for i in range(30):
            if i == 3:
                q.cancel()
            yield lambda lane: slow_fill(bufs[lane], 1.0, 0.01)

    res = q.run(items())
    assert isinstance(res[0].error, do.UsageError)
    assert len(res) < 31 or any(isinstance(r.error, QueueCancelled) for r in res)
    assert q.stats().items == len(res)


def test_work_queue_run_stops_when_its_iterator_cancels_it(backend):
    # run() queues a queue's worth of items at a time: an iterator whose own code cancels the
    # queue is asked for no more items, and the one it gave then is not queued
    pulled = []

    async def main():
        q = WorkQueue(streams=2, capacity=100)

        def items():
            for i in range(30):
                pulled.append(i)
                if i == 3:
                    q.cancel()
                yield lambda lane: do.value(lane)

        return await q.run(items())

    res = anyio.run(main)
    assert pulled == [0, 1, 2, 3] and len(res) == 3


def test_gemm_queue_results(backend):
    """The bimodal pattern in miniature: per-lane outputs, shared inputs, checked values."""
    needs_gpu(backend, "cuBLAS")
    rng = np.random.default_rng(0)
    a = rng.standard_normal((32, 16)).astype(np.float32)
    b = rng.standard_normal((16, 24)).astype(np.float32)
    da, db = do.from_numpy(a).sync(), do.from_numpy(b).sync()
    outs = [do.zeros((32, 24), do.float32).sync() for _ in range(3)]
    items = [lambda lane: K.gemm(outs[lane], da, db) for _ in range(9)]

    async def main():
        return await WorkQueue(streams=3).run(items)

    for r in anyio.run(main):
        np.testing.assert_allclose(r.unwrap()[0].numpy(), a @ b, rtol=1e-4, atol=1e-4)


def test_on_done_hooks_run_per_item_in_their_lane(backend):
    bufs = _lane_buffers(2)
    seen_async, seen_threads = [], []

    async def hook(r):
        await anyio.sleep(0)
        seen_async.append((r.index, r.lane))
        if r.index == 3:
            raise ValueError("post-processing failed")

    async def main():
        return await WorkQueue(streams=2, on_done=hook).run(_items(bufs, 6))

    res = anyio.run(main)
    assert sorted(i for i, _ in seen_async) == list(range(6))
    assert all(lane == res[i].lane for i, lane in seen_async)
    assert isinstance(res[3].error, ValueError) and res[2].ok
    q = ThreadedQueue(streams=2, on_done=lambda r: seen_threads.append(r.index))
    q.run(_items(bufs, 5))
    assert sorted(seen_threads) == list(range(5))
    with pytest.raises(do.UsageError, match="on_done"):
        WorkQueue(streams=1, on_done=3)


def test_a_plain_function_as_on_done_is_called_and_the_items_succeed(backend):
    bufs = _lane_buffers(2)
    seen = []

    async def main():
        return await WorkQueue(streams=2, on_done=lambda r: seen.append(r.index)).run(_items(bufs, 6))

    res = anyio.run(main)
    assert sorted(seen) == list(range(6)) and all(r.ok for r in res)


def test_a_threaded_queue_refuses_to_block_a_running_loop(backend):
    bufs = _lane_buffers(2)

    async def main():
        with pytest.raises(do.UsageError, match=r"block the running event loop.*WorkQueue.*to_thread"):
            ThreadedQueue(streams=2).run(_items(bufs, 2))
        q = ThreadedQueue(streams=2)
        return await anyio.to_thread.run_sync(q.run, _items(bufs, 4))  # (the advice works)

    assert all(r.ok for r in anyio.run(main))


def test_poll_argument_is_checked(backend):
    for bad in (-1, 2, "x", True):
        with pytest.raises(do.UsageError, match="poll"):
            WorkQueue(streams=1, poll=bad)
    bufs = _lane_buffers(2)

    async def main():
        return await WorkQueue(streams=2, poll=0).run(_items(bufs, 6))  # park at once: still correct

    assert [r.value[0] for r in anyio.run(main)] == list(range(6))


@pytest.mark.parametrize("batch", [1, 3, 16])
def test_batches_keep_per_item_outcomes(backend, batch):
    bufs = _lane_buffers(2)

    def bad(lane):
        return K.add(bufs[lane].partition((100,)), bufs[lane], bufs[lane])  # fails when enqueued

    items = _items(bufs, 10)
    items[4] = bad

    async def main():
        q = WorkQueue(streams=2, capacity=10, batch=batch)
        async with q:
            for it in items:  # all queued before a task takes any: batches of up to `batch`
                await q.put(it)
        return q.results()

    res = anyio.run(main)
    assert isinstance(res[4].error, do.ShapeError)
    assert [r.value[0] for i, r in enumerate(res) if i != 4] == [i for i in range(10) if i != 4]
    tq = ThreadedQueue(streams=2, capacity=10, batch=batch)
    tres = tq.run([*items[:4], bad, *_items(bufs, 10)[5:]])
    assert isinstance(tres[4].error, do.ShapeError)
    assert all(r.ok for i, r in enumerate(tres) if i != 4)
    for lane in range(2):
        last = [r.value[0] for r in tres if r.lane == lane and r.ok]
        if last:
            assert (bufs[lane].numpy() == last[-1]).all()


def test_batch_argument_is_checked(backend):
    for bad in (0, -2, 1.5, True):
        with pytest.raises(do.UsageError, match="batch"):
            WorkQueue(streams=1, batch=bad)
        with pytest.raises(do.UsageError, match="batch"):
            ThreadedQueue(streams=1, batch=bad)


def _in_thread(fn, timeout: float = 20.0):
    """fn() in a thread: ("ok", value) or ("raised", exception); a hang fails the test."""
    import threading

    out: list = []

    def run() -> None:
        try:
            out.append(("ok", fn()))
        except BaseException as e:
            out.append(("raised", e))

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(timeout)
    assert not th.is_alive(), f"hung for {timeout} s"
    return out[0]


def _values(n: int):
    return [lambda lane, i=i: do.value(i) for i in range(n)]


@pytest.mark.parametrize("where", ["factory", "on_done"])
@pytest.mark.parametrize("exc", [SystemExit, KeyboardInterrupt])
def test_threaded_queue_base_exception_cancels_and_is_raised(backend, where, exc):
    def bad_factory(lane):
        raise exc("stop")

    def bad_on_done(r):
        if r.index == 3:
            raise exc("stop")

    items = _values(40)
    if where == "factory":
        items[3] = bad_factory
    q = ThreadedQueue(streams=2, batch=1, on_done=bad_on_done if where == "on_done" else None)
    kind, e = _in_thread(lambda: q.run(items))
    assert kind == "raised" and isinstance(e, exc)
    res = q.results()
    assert len(res) >= 4 and all(r.value == r.index or r.error is not None for r in res)


def test_threaded_queue_cancel_reports_every_item_of_a_list(backend):
    q = ThreadedQueue(streams=2)
    q.cancel()
    kind, res = _in_thread(lambda: q.run(_values(30)))
    assert kind == "ok" and len(res) == 30 and all(isinstance(r.error, QueueCancelled) for r in res)
    # an open-ended iterable is not read after a cancel
    q2 = ThreadedQueue(streams=2)
    q2.cancel()
    kind, res = _in_thread(lambda: q2.run(iter(_values(30))))
    assert kind == "ok" and res == []


def test_work_queue_put_after_cancel_says_cancelled(backend):
    reached = []

    async def main():
        async with WorkQueue(streams=2) as q:
            q.cancel()
            await q.put(do.value(1))  # the cancelled queue's block ends here, as anyio's scopes do
            reached.append(True)
        assert q.results() == [] and not reached
        with pytest.raises(do.UsageError, match="cancelled"):
            await q.put(do.value(2))
        # where the cancellation cannot reach (a shielded scope): said at once
        async with WorkQueue(streams=2) as q2:
            q2.cancel()
            with anyio.CancelScope(shield=True):
                with pytest.raises(QueueCancelled, match="cancelled"):
                    await q2.put(do.value(3))

    anyio.run(main)


def test_work_queue_on_done_raising_cancelled_error_is_kept_per_item(backend):
    import asyncio

    async def on_done(r):
        if r.index % 2:
            raise asyncio.CancelledError("from on_done")

    async def main():
        return await WorkQueue(streams=2, on_done=on_done, batch=1).run(_values(10))

    res = asyncio.run(main())
    assert [r.value for r in res] == list(range(10))
    assert [type(r.error).__name__ for r in res] == ["NoneType", "CancelledError"] * 5


@pytest.mark.parametrize("loop", LOOPS)
def test_work_queue_base_exception_in_a_factory_is_raised(backend, loop):
    items = _values(20)

    def bad(lane):
        raise SystemExit("stop")

    items[5] = bad
    q = WorkQueue(streams=2, batch=1)
    with pytest.raises(SystemExit):  # in this thread: the loop's leftovers are collected here
        anyio.run(q.run, items, backend=loop[0], backend_options=loop[1])
    gc.collect()
    assert "cancelled" in repr(q)


def test_threaded_queue_cancel_from_another_thread(backend):
    import threading

    bufs = _lane_buffers(2)
    q = ThreadedQueue(streams=2, capacity=2, batch=1)
    items = [lambda lane: slow_fill(bufs[lane], 1.0, 0.01) for _ in range(60)]
    threading.Timer(0.05, q.cancel).start()
    kind, res = _in_thread(lambda: q.run(items))
    assert kind == "ok" and len(res) == 60  # every item of the list reported
    done = [r for r in res if r.error is None]
    assert done and any(isinstance(r.error, QueueCancelled) for r in res)
    assert all(r.error is None or isinstance(r.error, QueueCancelled) for r in res)


@pytest.mark.parametrize("loop", LOOPS[:2])
def test_work_queue_drives_every_stream_from_one_task(backend, loop):
    # one driver task keeps two executions in flight per stream: however many streams, the
    # queue adds one task to the loop (a task per stream would add a task switch per item)
    import asyncio

    streams = 6
    bufs = _lane_buffers(streams)
    seen: list[int] = []

    async def main():
        q = WorkQueue(streams=streams, batch=1)
        before = len(asyncio.all_tasks())
        async with q:
            for i in range(30):
                await q.put(lambda lane, i=i: slow_fill(bufs[lane], float(i), 0.002))
                seen.append(len(asyncio.all_tasks()) - before)
        return q

    q = anyio.run(main, backend=loop[0], backend_options=loop[1])
    assert all(r.ok for r in q.results())
    assert set(seen) == {1}, seen
    if not SANITIZED:
        assert {r.lane for r in q.results()} == set(range(streams))


def test_on_done_hooks_hold_their_streams_place_until_they_return(backend):
    # a lane keeps two executions in flight, an item whose hook still runs counting as one:
    # with every hook taking 50 ms, the third item on one stream starts only once a hook of the
    # first two has returned; hooks of different items run at the same time
    bufs = _lane_buffers(1)
    running, most = [0], [0]

    async def hook(r):
        running[0] += 1
        most[0] = max(most[0], running[0])
        await anyio.sleep(0.05)
        running[0] -= 1

    async def main():
        return await WorkQueue(streams=1, batch=1, on_done=hook).run(_items(bufs, 4))

    res = anyio.run(main)
    assert all(r.ok for r in res), [r.error for r in res if not r.ok]
    assert [r.value[0] for r in res] == [0, 1, 2, 3]
    assert res[2].queued_s >= 0.045 and res[3].queued_s >= 0.045
    assert most[0] == 2


def test_a_long_chain_item_gives_the_loop_turns_while_it_is_enqueued(backend):
    # an item that is a chain of 20 steps of 1 ms of host work: the queue enqueues it a slice
    # at a time (do.set_enqueue_slice), and the loop's other tasks run in between
    from deviceop._core._completion import stats

    t = do.zeros(256, do.float32).sync()
    K.fill(t.partition((128,)), -1.0).sync()  # the kernel built (a first build is one long step)
    ran: list[int] = []

    async def main():
        q = WorkQueue(streams=1, batch=1)
        y0 = stats()["enqueue_yields"]
        gap, res = await longest_gap(q.run([lambda lane: long_chain(t, 20, ran)]))
        return gap, res, stats()["enqueue_yields"] - y0

    gap, res, yields = anyio.run(main)
    assert res[0].ok and ran == list(range(20))
    assert (t.numpy() == 19.0).all()
    assert yields >= 10
    assert gap < 0.012, f"the loop waited {gap * 1e3:.1f} ms for a turn"


class _MovingLanes:
    """Lanes whose every pass moves (a completion found, an item issued) for ``seconds``, each
    pass taking ``pass_s`` of host work; then nothing is in flight and the queue is done."""

    def __init__(self, seconds: float, pass_s: float) -> None:
        self.seconds, self.pass_s = seconds, pass_s
        self.passes = 0
        self.until: float | None = None
        self.in_flight = True
        self.lat = 0.0

    def bind(self, *args: object) -> None:
        pass

    def collect(self, seen: bool) -> bool:
        now = time.perf_counter()
        if self.until is None:
            self.until = now + self.seconds
        while time.perf_counter() < now + self.pass_s:
            pass
        self.passes += 1
        if time.perf_counter() >= self.until:
            self.in_flight = False
            return False
        return True

    def issue(self, slice_s: float) -> bool:
        return False

    def any_held(self) -> bool:
        return False

    def abandon_all(self) -> None:
        pass


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("slice_s", [0.0, 2e-3])
def test_the_driver_gives_the_loop_a_turn_once_an_enqueue_slice_has_passed(backend, monkeypatch, loop, slice_s):
    # while every pass moves, the driver runs passes back to back and gives the loop a turn
    # once an enqueue slice has passed since the last (0: after every pass), not after each
    import deviceop.executors._queue as queue_module
    from deviceop._core import _completion

    turns: list[float] = []

    def counting(lib: str):
        y = _completion.yielder(lib)

        async def turn() -> None:
            turns.append(time.perf_counter())
            await y()

        return turn

    monkeypatch.setattr(queue_module, "yielder", counting)
    lanes = _MovingLanes(0.1, 50e-6)
    q = WorkQueue(streams=1)
    q._lanes = lanes
    q._closed = True
    old = _completion.enqueue_slice()
    _completion.set_enqueue_slice(slice_s)
    try:
        anyio.run(q._drive, backend=loop[0], backend_options=loop[1])
    finally:
        _completion.set_enqueue_slice(old)
    assert lanes.passes > 200
    if slice_s == 0:
        assert len(turns) >= lanes.passes - 2
    else:
        # about one a slice (0.1 s / 2 ms = 50), never one a pass
        assert 5 <= len(turns) <= 60, (len(turns), lanes.passes)
        assert min(b - a for a, b in itertools.pairwise(turns)) >= slice_s * 0.9


def test_a_cancelled_queue_enqueues_no_later_step_of_a_chain_under_way(backend):
    t = do.zeros(256, do.float32).sync()
    K.fill(t.partition((128,)), -1.0).sync()
    ran: list[int] = []

    async def main():
        q = WorkQueue(streams=1, batch=1)
        with anyio.move_on_after(0.006):
            await q.run([lambda lane: long_chain(t, 50, ran)])
        return q

    q = anyio.run(main)
    assert 1 <= len(ran) < 50 and ran == list(range(len(ran)))
    assert isinstance(q.results()[0].error, QueueCancelled)
    # what was enqueued completes (the ledger orders the read after it), the buffer lives
    assert (do.to_numpy(t).sync() == float(ran[-1])).all()


def test_a_device_fault_fails_its_items_and_the_queue_ends(host_backend):
    # a kernel that faults on a parked queue (poll=0): its item, and the items enqueued after
    # it on the failed context, get a CudaError; the queue does not hang
    do.set_poll_budget(0)
    try:
        t = do.zeros(128, do.float32).sync()

        def boom(out: np.ndarray, *rest: object) -> None:
            raise FloatingPointError("planted fault")

        bad = K.Kernel("unused", "boom", params=(K.Out(do.float32),), host=boom)
        items = [
            lambda lane: slow_fill(t, 1.0, 0.02),
            lambda lane: bad(t.partition((128,))),
            lambda lane: slow_fill(t, 2.0, 0.01),
        ]

        async def main():
            return await WorkQueue(streams=1, batch=1, poll=0).run(items)

        t0 = time.perf_counter()
        res = anyio.run(main)
        assert time.perf_counter() - t0 < 5
        assert isinstance(res[1].error, do.CudaError)
        assert isinstance(res[2].error, do.CudaError)
        assert res[0].ok or isinstance(res[0].error, do.CudaError)  # may see the sticky error
    finally:
        do.set_poll_budget(1e-3)
        do.use_backend("host")


def test_a_busy_queue_gives_the_loop_turns(backend):
    # items that complete as fast as they are issued keep the driver busy; it still gives the
    # loop a turn once an enqueue slice has passed, and whenever nothing can move, so a ticker
    # task runs throughout
    ticks: list[float] = []

    async def main():
        async with anyio.create_task_group() as tg:

            async def ticker():
                while True:
                    ticks.append(time.perf_counter())
                    await anyio.sleep(0)

            tg.start_soon(ticker)
            t0 = time.perf_counter()
            res = await WorkQueue(streams=4, batch=1).run(_values(2000))
            t1 = time.perf_counter()
            tg.cancel_scope.cancel()
        return res, t0, t1

    res, t0, t1 = anyio.run(main)
    assert [r.value for r in res] == list(range(2000))
    inside = [x for x in ticks if t0 <= x <= t1]
    assert len(inside) >= 20


def test_a_tiny_enqueue_slice_still_issues_every_item(backend):
    # each pass of the queue issues at least one execution, however short the enqueue slice
    old = do.enqueue_slice()
    do.set_enqueue_slice(1e-9)
    try:

        async def main():
            with anyio.fail_after(20):
                return await WorkQueue(streams=2, batch=1).run(_values(30))

        assert [r.value for r in anyio.run(main)] == list(range(30))
    finally:
        do.set_enqueue_slice(old)
