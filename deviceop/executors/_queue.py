"""WorkQueue: many ops over S streams from ONE host thread (asyncio, uvloop or trio).

Tasks pull items and await them, two per stream; while one task waits for its GPU work the
others issue theirs, so S streams stay fed without S threads (paper Appendix B), and a stream's
next batch is already queued behind the one running when that one completes. Back-pressure:
``put`` waits while ``capacity`` items are queued or in flight.

    async with do.executors.WorkQueue(streams=8) as q:
        for x in inputs:
            await q.put(lambda lane, x=x: make_op(x, lane))   # or an op
    q.results()  # ItemResult per item, in put order;  q.stats(): QueueStats
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterable, Iterable, Sequence
from typing import Any

from .._errors import UsageError
from ._await import await_op
from ._queue_stats import (
    ItemResult,
    QueueCancelled,
    QueueStats,
    Recorder,
    check_batch,
    check_capacity,
    lanes_of,
    resolve,
    settle,
    start_batch,
    take_batch,
)
from ._wake import current_lib, event_class

__all__ = ["WorkQueue"]

#: tasks per stream: while one awaits its batch, the other enqueues the next behind it (with one,
#: the stream idles from each completion until its task has noticed it and issued more)
_DEPTH = 2


def _cancelling() -> bool:
    """True if the running asyncio task is being cancelled (trio cancels through scopes only;
    Python 3.10's tasks do not count their cancellations)."""
    import asyncio

    try:
        task = asyncio.current_task()
    except RuntimeError:  # not under asyncio
        return False
    return task is not None and getattr(task, "cancelling", lambda: 0)() > 0


class WorkQueue:
    """Drain ops over ``streams`` (a count or a list of pool streams) from the calling thread.

    ``capacity`` bounds queued plus in-flight items (default ``2 * batch`` per stream, at
    least 4: every stream can run a full batch while its next one waits). Items are DeviceOps
    or callables ``f(lane) -> DeviceOp`` (``lane``: the stream's index, for per-stream
    buffers). An item's error is kept in its result and the queue goes on; ``cancel()`` stops
    the whole queue (work already on the GPU completes and keeps its buffers alive).
    ``on_done``: optional ``async f(result)`` awaited after each item in the task that ran it
    (post-processing, host work), before that task takes its next item. A stream has two
    tasks (one awaits its batch while the other queues the next), so items of one stream may
    reach ``on_done`` out of order; ``result.index`` is the put order.
    ``poll``: seconds an item's task polls for completion in the loop (yielding to the other
    tasks between checks) before it parks on the completion reactor. Default None: up to 3x
    the queue's recent batch latency (at least 2 ms, at most 20 ms). A stream of the queue
    idles from the moment its batch completes until its task notices, so the task polls: while
    several streams are busy the loop has other tasks to run between checks, and polling costs
    little; a batch that runs longer parks and costs no CPU.
    ``batch``: a task takes up to this many items that are already waiting (it never waits
    for more) and runs them as one execution on its stream, awaiting them together. Results
    and errors stay per item; an item's latency then includes the rest of its batch. When
    items arrive faster than the GPU drains them this removes most of the per-item host work;
    when they trickle in, batches are of one. Default 8.
    ``devices``: ``"all"`` or a list of devices (ordinals or labels) to spread the lanes over:
    ``streams`` (a count, default the pool) on each, interleaved. A factory ``f(lane)`` runs
    with its lane's device selected, so what it allocates lives there; ``stats().per_device()``
    gives items and busy time per device.
    """

    batch: int
    streams: list[Any]
    capacity: int
    on_done: Any
    poll: float | None

    def __init__(
        self,
        streams: int | Sequence[Any] | None = None,
        capacity: int | None = None,
        on_done: Any = None,
        poll: float | None = None,
        batch: int = 8,
        devices: Any = None,
    ) -> None:
        self.batch = check_batch(batch)
        if poll is not None and (isinstance(poll, bool) or not isinstance(poll, (int, float)) or not 0 <= poll <= 1):
            raise UsageError(f"poll must be None (learned) or 0 to 1 seconds, got {poll!r}")
        self.poll = None if poll is None else float(poll)
        self._lat = 0.0  # moving average of a batch's start-to-completion time (seconds)
        if on_done is not None and not callable(on_done):
            raise UsageError(f"on_done must be an async callable f(result), got {type(on_done).__name__}")
        self.on_done = on_done
        self.streams = lanes_of(streams, devices)
        self.capacity = check_capacity(capacity, len(self.streams), self.batch)
        self._refill = self.capacity // 2  # a put() waiting at capacity resumes at this many pending
        self._rec = Recorder(self.streams, host_threads=1)
        self._tg: Any = None
        # the queue itself: a deque, and events only for whoever must wait (an idle worker, a
        # put at capacity); anyio's memory streams and semaphores checkpoint on every call,
        # which costs more than the GPU work of a small GEMM
        self._items: deque[tuple[Any, ItemResult]] = deque()
        self._idle: list[Any] = []
        self._space: list[Any] = []
        self._pending = 0
        self._closed = False
        self._state = "new"

    def __repr__(self) -> str:
        return f"<WorkQueue {len(self.streams)} streams, capacity {self.capacity}, {self._state}>"

    async def __aenter__(self) -> WorkQueue:
        import anyio

        if self._state != "new":
            raise UsageError(f"this WorkQueue is {self._state}; a queue runs once, make a new one")
        self._state = "running"
        self._event = event_class(current_lib())
        self._cancelled_exc = anyio.get_cancelled_exc_class()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._rec.begin()
        self._until = [0.0] * len(self.streams)  # per lane: the end of the busy time counted
        for _ in range(_DEPTH):
            for lane, stream in enumerate(self.streams):
                self._tg.start_soon(self._worker, lane, stream)
        return self

    async def __aexit__(self, et: Any, e: Any, tb: Any) -> bool | None:
        self._closed = True  # workers finish what is queued, then stop
        self._wake(self._idle, all_=True)
        if et is not None:
            self._tg.cancel_scope.cancel()
        try:
            return await self._tg.__aexit__(et, e, tb)  # type: ignore[no-any-return]
        except BaseException as g:
            # workers keep their errors per item, so a group holds only the body's exception:
            # raise that one, as a plain 'async with' would
            inner = getattr(g, "exceptions", None)
            if inner and len(inner) == 1:
                raise inner[0] from None
            raise
        finally:
            self._rec.end()
            self._rec.cancel_unfinished()
            self._state = "cancelled" if self._tg.cancel_scope.cancel_called else "done"

    @staticmethod
    def _wake(waiters: list[Any], all_: bool = False) -> None:
        while waiters:
            waiters.pop().set()
            if not all_:
                return

    async def put(self, item: Any) -> None:
        """Queue an op (or ``f(lane) -> op``); waits while ``capacity`` items are pending.

        A put() that waited resumes once at most half the capacity is pending, so a producer
        refills the queue in bursts rather than one item per completed item.
        """
        if self._state == "running" and self._tg.cancel_scope.cancel_called:
            import anyio

            await anyio.lowlevel.checkpoint()  # inside the queue's 'async with': ends the block
            raise QueueCancelled("put() on a WorkQueue that was cancelled; it takes no more items, make a new one")
        if self._state != "running":
            raise UsageError(f"put() on a WorkQueue that is {self._state}; use it inside 'async with'")
        if not callable(item) and not hasattr(item, "_run"):
            resolve(item, 0)  # raises the usage error now, not in a worker
        while self._pending >= self.capacity:
            ev = self._event()
            self._space.append(ev)
            await ev.wait()
        self._add(item)

    def _add(self, item: Any) -> None:
        self._pending += 1
        self._items.append((item, self._rec.add()))
        if self._idle:
            self._wake(self._idle)

    def cancel(self) -> None:
        """Stop the queue: running awaits are cancelled, queued items are reported cancelled."""
        if self._tg is not None:
            self._tg.cancel_scope.cancel()

    async def run(self, items: Iterable[Any] | AsyncIterable[Any]) -> list[ItemResult]:
        """Put every item (an iterable or async iterable), wait for all; return the results."""
        async with self:
            if isinstance(items, AsyncIterable):
                async for it in items:
                    await self.put(it)
            else:
                for it in items:
                    # with room, an op or a factory is queued without a put() coroutine (which
                    # would not wait then either): a small item's host time is the queue's bound
                    if self._pending < self.capacity and (callable(it) or hasattr(it, "_run")):
                        if self._tg.cancel_scope.cancel_called:
                            await self.put(it)  # raises QueueCancelled
                        self._add(it)
                    else:
                        await self.put(it)
        return self.results()

    def results(self) -> list[ItemResult]:
        """One ItemResult per item put, in put order."""
        return list(self._rec.results)

    def stats(self) -> QueueStats:
        """Throughput, latency percentiles, per-stream busy time, CPU time (see QueueStats)."""
        return self._rec.stats()

    async def _worker(self, lane: int, stream: Any) -> None:
        clock = time.perf_counter
        busy = self._rec.busy
        until = self._until
        items = self._items

        def more() -> Any:
            return items.popleft() if items else None

        while True:
            if not items:
                if self._closed:
                    return
                ev = self._event()
                self._idle.append(ev)
                await ev.wait()
                continue
            batch = take_batch(items.popleft(), more, self.batch)
            t0 = clock()
            ops, run = start_batch(batch, lane, t0, "a WorkQueue", stream)
            try:
                if run is not None:
                    budget = self.poll if self.poll is not None else min(max(2e-3, 3.0 * self._lat), 20e-3)
                    settle(ops, await await_op(run, stream, "WorkQueue", None, budget))
            except Exception as e:  # the execution failed as a whole (a CUDA error)
                for r, _ in ops:
                    r.error = r.error or e
            except BaseException:  # cancelled: the await path hands the GPU work to a watcher
                for r, _ in ops:
                    r.error = QueueCancelled(f"item {r.index} was cancelled while it ran on stream {lane}")
                raise
            finally:
                t1 = clock()
                self._lat += 0.1 * (t1 - t0 - self._lat)
                for _, r in batch:
                    r.latency_s = t1 - t0
                # a lane's two tasks overlap: count the time it had something in flight once
                busy[lane] += t1 - max(t0, until[lane]) if t1 > until[lane] else 0.0
                until[lane] = max(until[lane], t1)
                self._pending -= len(batch)
                # a put() waiting at capacity resumes once half the capacity is free, and then
                # puts items until it is full again: woken at every completion, it would put
                # one item per wake-up, and each wake-up costs more than a small GPU item
                if self._space and self._pending <= self._refill:
                    self._wake(self._space, all_=True)
            if self.on_done is not None:
                for _, r in batch:
                    try:
                        await self.on_done(r)
                    except Exception as e:  # kept with the item, like the op's own errors
                        r.error = r.error or e
                    except self._cancelled_exc as e:
                        if self._tg.cancel_scope.cancel_called or _cancelling():
                            raise  # the queue, or the task running it, is being cancelled
                        # on_done itself raised it (asyncio.CancelledError is a BaseException):
                        # an error of this item, not the end of the queue
                        r.error = r.error or e
