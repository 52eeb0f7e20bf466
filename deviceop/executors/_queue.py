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

import time
from collections import deque
from collections.abc import AsyncIterable, Iterable, Sequence
from typing import Any

from .._core import _reactor
from .._core._op import hand_over, start_sliced
from .._errors import CudaError, UsageError
from ..device import current
from ._await import _COUNTS as COUNTS
from ._await import _RECHECK as RECHECK
from ._await import _SLICE as SLICE
from ._await import _sleep_or_wake as sleep_or_wake
from ._await import _waker_class, _yielder
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
from ._wake import current_lib, event_class, loop_dispatcher

__all__ = ["WorkQueue"]

#: executions in flight per stream: while one runs, the next is queued behind it (with one, the
#: stream idles from each completion until the driver has noticed it and issued more)
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
    ``on_done``: optional ``async f(result)`` awaited after each item (post-processing, host
    work), in a task per completed batch that awaits its items' hooks in turn; until it
    returns, that batch keeps its place among its stream's two in flight (a slow hook holds
    its stream back, not the queue). Hooks of different batches run concurrently, so items may
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
        self._held = [0] * len(self.streams)  # per lane: executions whose on_done hooks run
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

    async def _drive(self) -> None:
        """The queue's one driver task: keeps up to two executions in flight per lane (one
        running, the next queued behind it), notices their completions by the reactor's flags,
        and waits only when nothing can move: polling (yielding to the loop) while completions
        are due soon, parked on the reactor's wake-up or a new item otherwise."""
        lib, d = loop_dispatcher()
        tok = d.register(None)
        clock = time.perf_counter
        y = _yielder(lib)
        new_waker = _waker_class(lib)
        counts = COUNTS
        done = _reactor.done
        lanes = len(self.streams)
        runs: list[deque[_Run]] = [deque() for _ in range(lanes)]
        held = self._held
        items = self._items
        slicing = 0  # executions whose chain is still being enqueued a slice at a time
        last = clock()  # the last completion, issue or wake-up: polling counts from here
        interval = RECHECK[0]
        seen = True  # completions are seen while polling (not after a park): their moment is known

        def more() -> Any:
            return items.popleft() if items else None

        batch = self.batch
        # item factories run with their lane's device selected: where every lane is on the
        # device selected already, nothing is selected around each execution
        selected = all(s.backend is current() for s in self.streams)
        try:
            while True:
                moved = False
                # completions: a lane's executions complete in their order, so its first decides
                # (an armed slot's flag read directly: this runs for every lane at every pass)
                for q in runs:
                    while q and (done(q[0].h) if q[0].h >= 0 else q[0].complete()):
                        self._finish(q.popleft(), clock(), seen)
                        moved = True
                # then new work, each lane up to two executions (and an on_done hook's item
                # holds its place until the hook returns); a long chain is enqueued a slice per
                # pass, so the loop's other tasks get their turns meanwhile
                slice_end = clock() + (SLICE[0] or float("inf"))
                issued = False  # a pass issues at least one execution, however short the slice
                # (with nothing queued and no chain under way, no lane has anything to do)
                for lane in range(lanes) if items or slicing else ():
                    q = runs[lane]
                    if q and q[-1].rest is not None:
                        moved = True
                        counts["enqueue_yields"] += 1  # the loop had its turn since the last slice
                        if not q[-1].resume(SLICE[0] or float("inf"), d.channel, tok):
                            continue
                        slicing -= 1
                    while items and len(q) + held[lane] < _DEPTH and (not issued or clock() < slice_end):
                        issued = True
                        first = items.popleft()
                        run = _Run(lane, self.streams[lane], take_batch(first, more, batch) if batch > 1 else [first])
                        run.start(d.channel, tok, selected)
                        slicing += run.rest is not None
                        if run.ops:
                            q.append(run)
                        else:
                            self._finish(run, clock(), False)  # every item failed to make its op
                        moved = True
                seen = True
                if moved:
                    last = clock()
                    interval = RECHECK[0]
                    await y()  # the producer, and the loop's other tasks, get a turn
                    continue
                if not any(runs):  # nothing on the GPU: wait for an item, a hook, or the end
                    if self._closed and not items and not any(held):
                        return
                    w = new_waker()
                    self._idle.append(w)
                    await (w.wait() if lib == "trio" else w)
                    last = clock()
                    continue
                budget = self.poll if self.poll is not None else min(max(2e-3, 3.0 * self._lat), 20e-3)
                if clock() - last < budget:
                    counts["polls"] += 1
                    await y()
                    continue
                # park: the reactor wakes the loop once a watched flag is written; a new item or
                # a returned on_done hook wakes it too
                counts["parks"] += 1
                w = new_waker()
                d.waiters[tok] = w
                self._idle.append(w)
                if any(r.watch() for q in runs for r in q):
                    last = clock()  # completed meanwhile
                    continue
                timed_out = await sleep_or_wake(lib, w, interval)
                d.waiters.pop(tok, None)
                if w in self._idle:
                    self._idle.remove(w)
                seen = False
                if timed_out:
                    interval = min(interval * 2, RECHECK[1])
                else:
                    last = clock()
                # a faulted context never writes its flags (the reactor wakes its waiters, or
                # the timer ends the park): its stream's query raises then
                for q in runs:
                    for run in [r for r in q if not r.check()]:
                        q.remove(run)
                        self._finish(run, clock(), False)
        except BaseException:
            # cancelled (or a BaseException from a factory): the GPU work keeps running, and the
            # streams' watchers keep its buffers alive until it completes
            for q in runs:
                for run in q:
                    run.abandon()
            raise
        finally:
            d.unregister(tok)

    def _finish(self, run: _Run, t1: float, seen: bool) -> None:
        """An execution completed (or failed): its items get their outputs and latencies, the
        lane its busy time, a put() waiting for room its turn, on_done its items."""
        run.settle(seen)
        lane, t0 = run.lane, run.t0
        self._lat += 0.1 * (t1 - t0 - self._lat)
        for _, r in run.batch:
            r.latency_s = t1 - t0
        # a lane's two executions overlap: count the time it had something in flight once
        until = self._until
        if t1 > until[lane]:
            self._rec.busy[lane] += t1 - max(t0, until[lane])
            until[lane] = t1
        self._pending -= len(run.batch)
        # a put() waiting at capacity resumes once half the capacity is free, and then puts
        # items until it is full again: woken at every completion, it would put one item per
        # wake-up, and each wake-up costs more than a small GPU item
        if self._space and self._pending <= self._refill:
            self._wake(self._space, all_=True)
        if self.on_done is not None:
            self._held[lane] += 1
            self._tg.start_soon(self._after, lane, [r for _, r in run.batch])

    async def _after(self, lane: int, results: list[ItemResult]) -> None:
        """The on_done hook for each item of an execution, in a task of its own; the lane's
        place is held until it returns."""
        try:
            for r in results:
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
        finally:
            self._held[lane] -= 1
            self._wake(self._idle, all_=True)


class _Run:
    """One execution of a lane: a batch's items, enqueued as one op, awaited by its completion
    slot (or, where every slot is armed, its event)."""

    __slots__ = ("batch", "cx", "ev", "h", "lane", "ops", "out", "rest", "stream", "t0", "watched")

    def __init__(self, lane: int, stream: Any, batch: list[tuple[Any, ItemResult]]) -> None:
        self.lane, self.stream, self.batch = lane, stream, batch
        self.t0 = time.perf_counter()
        self.cx: Any = None
        self.out: Any = None
        self.rest: Any = None
        self.ev: Any = None
        self.h = -1
        self.watched = False
        self.ops: list[Any] = []

    def start(self, ch: Any, tok: int, selected: bool) -> None:
        """Enqueue the batch (its first slice, for a long chain); ``ops`` is left empty if
        nothing went in flight. ``selected``: the lane's device is selected already."""
        self.ops, op = start_batch(self.batch, self.lane, self.t0, "a WorkQueue", self.stream, selected)
        if op is None:
            return
        try:
            self.cx, self.out, self.rest = start_sliced(op, self.stream, "WorkQueue", SLICE[0])
        except Exception as e:  # the execution failed as a whole (what it enqueued completed)
            self._fail(e)
            self.ops = []
            return
        if self.rest is None:
            self._arm(ch, tok)
        COUNTS["awaits"] += 1

    def resume(self, seconds: float, ch: Any, tok: int) -> bool:
        """Enqueue the chain's next slice; True once all of it is enqueued (and armed)."""
        try:
            if not self.rest.run(seconds):
                return False
        except Exception as e:  # a step failed: what was enqueued completed (Slices.run)
            self._fail(e)
            self.rest = self.cx = None
            return True
        self.out, self.rest = self.rest.output, None
        self._arm(ch, tok)
        return True

    def _arm(self, ch: Any, tok: int) -> None:
        # unwatched: the driver looks itself while it polls; it watches the slot when it parks
        try:
            self.h = _reactor.arm(self.stream, ch, tok, False)
        except CudaError as e:
            _reactor.fail_context(self.stream.backend)
            self._release()
            self._fail(e)
            return
        if self.h < 0:  # every slot is armed: the stream's host function wakes the loop
            self.ev = self.cx.seal()
            self.stream.notify(ch, tok)
            self.watched = True

    def complete(self) -> bool:
        """True once the work is done (or failed to enqueue: nothing to wait for); False while
        a chain is still being enqueued."""
        if self.cx is None:
            return True
        if self.rest is not None:
            return False
        return bool(_reactor.done(self.h)) if self.h >= 0 else bool(self.ev.query())

    def watch(self) -> bool:
        """Have the reactor wake the loop at this execution's completion; True if it is
        complete already."""
        if self.cx is None:
            return True
        if self.rest is not None:
            return False
        if not self.watched:
            self.watched = True
            _reactor.watch(self.h)
        return self.complete()

    def check(self) -> bool:
        """The parked re-check: False if the stream's context failed (the items get its
        error, every await on the device is woken to see it)."""
        if self.rest is not None or self.cx is None:
            return True
        try:
            self.stream.query() if self.h >= 0 else self.ev.query()
        except CudaError as e:
            _reactor.fail_context(self.stream.backend)  # every await on that device sees it too
            self._release()
            self._fail(e)
            return False
        return True

    def settle(self, seen: bool) -> None:
        """The work completed: retire its slot, finish the execution, hand out the outputs."""
        if self.cx is None:
            return
        if self.h >= 0 and not _reactor.retire(self.h, seen):
            _reactor.disown(self.h)
        self.cx.finish()
        settle(self.ops, self.out)

    def abandon(self) -> None:
        """Nobody waits any more (the queue is cancelled): the stream's watcher finishes the
        execution, its items are reported cancelled."""
        if self.cx is None:
            return
        for r, _ in self.ops:
            r.error = r.error or QueueCancelled(f"item {r.index} was cancelled while it ran on stream {self.lane}")
        self._release()

    def _release(self) -> None:
        """Hand the execution to the stream's watcher (it keeps the buffers alive until the work
        completes) and let its slot go."""
        hand_over(self.cx, self.stream, self.ev)
        if self.h >= 0 and not _reactor.retire(self.h, False):
            _reactor.disown(self.h)
        self.cx = None
        self.h = -1

    def _fail(self, e: BaseException) -> None:
        for r, _ in self.ops:
            r.error = r.error or e
