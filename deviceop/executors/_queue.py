"""WorkQueue: many ops over S streams from ONE host thread (asyncio, uvloop or trio).

One driver task keeps two executions in flight per stream: it enqueues a stream's next batch
behind the one running, notices completions by the completion reactor's flags (polling while
they are due, parked otherwise), and hands out the results, so S streams stay fed without S
threads (paper Appendix B) and without a task switch per item. Back-pressure: ``put`` waits
while ``capacity`` items are queued or in flight.

    async with do.executors.WorkQueue(streams=8) as q:
        for x in inputs:
            await q.put(lambda lane, x=x: make_op(x, lane))   # or an op
    q.results()  # ItemResult per item, in put order;  q.stats(): QueueStats
"""

from __future__ import annotations

import inspect
import time
from collections import deque
from collections.abc import AsyncIterable, Iterable, Sequence
from typing import Any

from .._core._completion import COUNTS, SLICE, park_until, poll_until, waker_class, yielder
from .._core._lanes import END, Lanes, resolve
from .._core._select import current
from .._core._wake import current_lib, event_class, loop_dispatcher
from .._errors import UsageError
from ._queue_stats import (
    ItemResult,
    QueueCancelled,
    QueueStats,
    Recorder,
    check_batch,
    check_capacity,
    lanes_of,
)

__all__ = ["WorkQueue"]


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
    ``on_done``: optional ``async f(result)`` awaited after each item (post-processing, host
    work; a plain ``f(result)`` is called), in a task per completed batch that awaits its
    items' hooks in turn; until it returns, that batch keeps its place among its stream's two
    in flight (a slow hook holds its stream back, not the queue). Hooks of different batches run concurrently, so items may
    reach ``on_done`` out of order; ``result.index`` is the put order.
    ``poll``: seconds the queue polls for a completion in the loop (yielding to the other
    tasks between checks) before it parks on the completion reactor. Default None: up to 3x
    the queue's recent batch latency (at least 2 ms, at most 20 ms). A stream of the queue
    idles from the moment its batch completes until the queue notices, so it polls: one check
    covers every stream, and the loop's other tasks run between checks; work that runs longer
    parks and costs no CPU.
    ``batch``: a stream with room takes up to this many items that are already waiting (it
    never waits for more) and runs them as one execution, awaited together. Results
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
        if on_done is not None and not callable(on_done):
            raise UsageError(f"on_done must be a callable f(result) (async or not), got {type(on_done).__name__}")
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
        # the lanes' executions, and what finishing one updates, in the compiled core: a small
        # item's host time is the queue's bound
        self._lanes = Lanes(
            self.streams,
            self._items,
            self._rec.results,
            ItemResult,
            self._rec.busy,
            self._space,
            self._refill,
            self.batch,
            COUNTS,
            None if on_done is None else self._start_hooks,
            QueueCancelled,
        )
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
        self._tg.start_soon(self._drive)
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
        while self._lanes.pending >= self.capacity:
            ev = self._event()
            self._space.append(ev)
            await ev.wait()
        self._add(item)

    def _add(self, item: Any) -> None:
        self._lanes.add(item)
        if self._idle:
            self._wake(self._idle)

    def cancel(self) -> None:
        """Stop the queue: running awaits are cancelled, queued items are reported cancelled."""
        self._lanes.stopped = True  # (run() queues no more, even while its iterator's own code runs)
        if self._tg is not None:
            self._tg.cancel_scope.cancel()

    async def run(self, items: Iterable[Any] | AsyncIterable[Any]) -> list[ItemResult]:
        """Put every item (an iterable or async iterable), wait for all; return the results."""
        async with self:
            if isinstance(items, AsyncIterable):
                async for it in items:
                    await self.put(it)
            else:
                # with room, ops and factories are queued by the compiled lanes a queue's worth at
                # a time, without a put() coroutine (which would not wait then either): a small
                # item's host time is the queue's bound. put() takes the rest: an item when the
                # queue is full (it waits for room), one that is not an item (it raises), any
                # once the queue is cancelled (it ends the block), by the iterator's own code too
                it = iter(items)
                nxt = next(it, END)
                while nxt is not END:
                    nxt = self._lanes.feed(nxt, it, self.capacity)
                    if self._idle:
                        self._wake(self._idle)
                    if nxt is not END:
                        await self.put(nxt)
                        nxt = next(it, END)
        return self.results()

    def results(self) -> list[ItemResult]:
        """One ItemResult per item put, in put order."""
        return list(self._rec.results)

    def stats(self) -> QueueStats:
        """Throughput, latency percentiles, per-stream busy time, CPU time (see QueueStats)."""
        return self._rec.stats()

    async def _drive(self) -> None:
        """The queue's one driver task: keeps up to two executions in flight per lane (one
        running, the next queued behind it), notices their completions by the reactor's flags,
        and waits only when nothing can move, as every await waits (the core's poll and park):
        polling (yielding to the loop) while completions are due soon, parked on the reactor's
        wake-up or a new item otherwise, with the same backing-off re-check for a faulted
        context. While passes keep moving it runs them back to back, and gives the loop a turn
        once an enqueue slice (``SLICE``) has passed since the last. The passes themselves
        (finishing what completed, issuing what fits) are the compiled lanes'."""
        lib, d = loop_dispatcher()
        tok = d.register(None)
        clock = time.perf_counter
        y = yielder(lib)
        new_waker = waker_class(lib)
        lanes = self._lanes
        items = self._items
        last = clock()  # the last completion, issue or wake-up: polling counts from here
        turn_at = last  # when the loop's other tasks are due a turn, at the latest
        seen = True  # completions are seen while polling (not after a park): their moment is known
        # item factories run with their lane's device selected: where every lane is on the
        # device selected already, nothing is selected around each execution
        lanes.bind(d.channel, tok, all(s.backend is current() for s in self.streams))
        try:
            while True:
                moved = lanes.collect(seen)
                if lanes.issue(SLICE[0]):
                    moved = True
                seen = True
                if moved:
                    last = clock()
                    if last >= turn_at:
                        # the producer, and the loop's other tasks, get a turn once an enqueue
                        # slice has passed since their last: a turn after every pass that moved
                        # costs a small item's loop more than its own bookkeeping, and the next
                        # pass often moves as well (completions come while an item is issued)
                        await y()
                        turn_at = clock() + SLICE[0]
                    continue
                if not lanes.in_flight:  # nothing on the GPU: wait for an item, a hook, or the end
                    if self._closed and not items and not lanes.any_held():
                        return
                    w = new_waker()
                    self._idle.append(w)
                    await (w.wait() if lib == "trio" else w)
                    last = clock()
                    turn_at = last + SLICE[0]
                    continue
                budget = self.poll if self.poll is not None else min(max(2e-3, 3.0 * lanes.lat), 20e-3)
                left = budget - (clock() - last)
                if left > 0 and await poll_until(lib, lanes.ready, left, None):
                    turn_at = clock() + SLICE[0]  # (polling yielded to the loop)
                    continue
                # park: the reactor wakes the loop once a watched flag is written, a new item or a
                # returned on_done hook wakes it too; a faulted context never writes its flags,
                # and the re-check (its stream's query) finishes its executions with the error
                try:
                    await park_until(
                        lib,
                        d,
                        tok,
                        lanes.ready,
                        lanes.check_all,
                        None,
                        "a WorkQueue",
                        None,
                        watch=lanes.watch_all,
                        wakers=self._idle,
                        any_wake=True,  # a pre-wake: the driver polls until the completion
                    )
                finally:
                    d.waiters.pop(tok, None)
                seen = False
                last = clock()
                turn_at = last + SLICE[0]
        except BaseException:
            # cancelled (or a BaseException from a factory): the GPU work keeps running, and the
            # streams' watchers keep its buffers alive until it completes
            lanes.abandon_all()
            raise
        finally:
            d.unregister(tok)

    def _start_hooks(self, lane: int, results: list[ItemResult]) -> None:
        """An execution completed: its items' on_done hooks run in a task of their own."""
        self._tg.start_soon(self._after, lane, results)

    async def _after(self, lane: int, results: list[ItemResult]) -> None:
        """The on_done hook for each item of an execution, in a task of its own; the lane's
        place is held until it returns."""
        try:
            for r in results:
                try:
                    x = self.on_done(r)
                    if inspect.isawaitable(x):  # (an async hook; a plain one has run already)
                        await x
                except Exception as e:  # kept with the item, like the op's own errors
                    r.error = r.error or e
                except self._cancelled_exc as e:
                    if self._tg.cancel_scope.cancel_called or _cancelling():
                        raise  # the queue, or the task running it, is being cancelled
                    # on_done itself raised it (asyncio.CancelledError is a BaseException):
                    # an error of this item, not the end of the queue
                    r.error = r.error or e
        finally:
            self._lanes.release(lane)
            self._wake(self._idle, all_=True)
