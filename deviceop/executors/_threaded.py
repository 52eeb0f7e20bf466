"""ThreadedQueue: the thread-per-stream way to drain a queue of ops (for comparison, or for code
that is not async). S threads, one stream each, ``sync_on`` per item; same results and stats as
:class:`WorkQueue`, with ``host_threads = S``."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Sequence, Sized
from typing import Any

from .._core._guards import refuse_on_loop
from .._core._lanes import resolve, settle, start_batch, take_batch
from .._core._op import run_sync
from .._errors import UsageError
from ._queue_stats import (
    ItemResult,
    QueueStats,
    Recorder,
    check_batch,
    check_capacity,
    lanes_of,
)

__all__ = ["ThreadedQueue"]

_STOP = object()


class ThreadedQueue:
    """Drain ops over ``streams`` with one host thread per stream.

    ``run(items)`` puts every item (blocking while ``capacity`` are pending; the default as for
    :class:`WorkQueue`), waits for all and
    returns their results; ``cancel()`` (from any thread) stops workers taking new items.
    ``on_done``: optional ``f(result)`` called in the stream's thread after each item.
    ``batch``: as for :class:`WorkQueue`, a thread takes up to this many waiting items and
    runs them as one execution (default 8; 1 for one ``sync_on`` per item).
    ``devices``: as for :class:`WorkQueue`, lanes (and their threads) spread over devices.
    """

    batch: int
    streams: list[Any]
    capacity: int
    on_done: Any

    def __init__(
        self,
        streams: int | Sequence[Any] | None = None,
        capacity: int | None = None,
        on_done: Any = None,
        batch: int = 8,
        devices: Any = None,
    ) -> None:
        self.batch = check_batch(batch)
        if on_done is not None and not callable(on_done):
            raise UsageError(f"on_done must be a callable f(result), got {type(on_done).__name__}")
        self.on_done = on_done
        self.streams = lanes_of(streams, devices)
        self.capacity = check_capacity(capacity, len(self.streams), self.batch)
        self._rec = Recorder(self.streams, host_threads=len(self.streams))
        self._q: queue.Queue[Any] = queue.Queue()
        self._slots = threading.BoundedSemaphore(self.capacity)
        self._cancelled = threading.Event()
        self._fatal: BaseException | None = None  # the first BaseException a worker met
        self._ran = False

    def __repr__(self) -> str:
        return f"<ThreadedQueue {len(self.streams)} streams, capacity {self.capacity}>"

    def run(self, items: Iterable[Any]) -> list[ItemResult]:
        """Run every item; return one ItemResult per item, in order.

        After ``cancel()``, items not yet started are reported cancelled: every item of a
        sized collection (a list, a tuple) gets a result; an open-ended iterable is not read
        further. A BaseException (KeyboardInterrupt, SystemExit) raised in an item's factory,
        in ``on_done`` or in the calling thread cancels the queue and is raised here once the
        workers have stopped (work already on the GPU completes first).
        """
        if self._ran:
            raise UsageError("this ThreadedQueue has run; a queue runs once, make a new one")
        try:
            refuse_on_loop("ThreadedQueue.run()")
        except UsageError:
            raise UsageError(
                "ThreadedQueue.run() would block the running event loop until every item is done, "
                "stalling its other tasks. In a loop use WorkQueue ('await WorkQueue(...).run(items)'), "
                "or run this one in a thread ('await asyncio.to_thread(q.run, items)')"
            ) from None
        self._ran = True
        threads = [
            threading.Thread(target=self._worker, args=(lane, s), name=f"deviceop-queue-{lane}", daemon=True)
            for lane, s in enumerate(self.streams)
        ]
        self._rec.begin()
        for t in threads:
            t.start()
        try:
            for item in items:
                if self._cancelled.is_set():
                    if isinstance(items, Sized):  # reported, not run: a result per item
                        self._rec.add()
                        continue
                    break
                if not callable(item) and not hasattr(item, "_run"):
                    resolve(item, 0)  # the usage error now, in the caller's thread
                self._slots.acquire()  # workers release room for cancelled items too
                self._q.put((item, self._rec.add()))
        except BaseException:
            self._cancelled.set()  # the caller was interrupted: stop the workers too
            raise
        finally:
            for _ in threads:
                self._q.put(_STOP)
            for t in threads:
                t.join()
            self._rec.end()
            self._rec.cancel_unfinished()
        if self._fatal is not None:
            raise self._fatal
        return self.results()

    def cancel(self) -> None:
        """Stop: items not yet started are reported cancelled; running ones complete."""
        self._cancelled.set()

    def results(self) -> list[ItemResult]:
        """One ItemResult per item, in put order."""
        return list(self._rec.results)

    def stats(self) -> QueueStats:
        """Throughput, latency percentiles, per-stream busy time, CPU time (see QueueStats)."""
        return self._rec.stats()

    def _worker(self, lane: int, stream: Any) -> None:
        clock = time.perf_counter
        busy = self._rec.busy
        q = self._q
        stop: list[bool] = []

        def more() -> Any:
            if stop:
                return None
            try:
                got = q.get_nowait()
            except queue.Empty:
                return None
            if got is _STOP:
                stop.append(True)
                return None
            return got

        while not stop:
            got = q.get()
            if got is _STOP:
                return
            batch = take_batch(got, more, self.batch)
            try:
                if not self._cancelled.is_set():
                    self._run_batch(batch, lane, stream, clock, busy)
            except BaseException as e:  # KeyboardInterrupt, SystemExit...: stop the queue, not the thread
                if self._fatal is None:
                    self._fatal = e
                self._cancelled.set()
                for _, r in batch:
                    if r.error is None and r.value is None:
                        r.error = e
            finally:
                for _ in batch:
                    self._slots.release()

    def _run_batch(self, batch: list[Any], lane: int, stream: Any, clock: Any, busy: list[float]) -> None:
        t0 = clock()
        ops, run = start_batch(batch, lane, t0, "a ThreadedQueue", stream)
        try:
            if run is not None:
                settle(ops, run_sync(run, stream, "ThreadedQueue"))
        except Exception as e:
            for r, _ in ops:
                r.error = r.error or e
        finally:
            t1 = clock()
            for _, r in batch:
                r.latency_s = t1 - t0
            busy[lane] += t1 - t0
        if self.on_done is not None:
            for _, r in batch:
                try:
                    self.on_done(r)
                except Exception as e:  # kept with the item, like the op's own errors
                    r.error = r.error or e
