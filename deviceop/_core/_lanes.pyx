# cython: language_level=3
"""A work queue's lanes: the items' batches and, for the one-thread queue, its passes over S
streams' executions.

A lane is a stream with up to two executions in flight (one running, the next queued behind
it); an execution (:class:`Run`) is a batch of items enqueued as one op, whose completion a
reactor slot flags. :meth:`Lanes.collect` finishes what completed (outputs, latencies, the
lanes' busy time) and :meth:`Lanes.issue` enqueues the next batches, so the queue's driver task
(deviceop.executors.WorkQueue) only waits around them: an item's host time is the queue's
bound when items are small, and here it is spent without the interpreter's per-call cost.
The ThreadedQueue shares the batching (:func:`take_batch`, :func:`start_batch`,
:func:`settle`).

Not thread-safe: a Lanes is driven by its queue's one task, on its event loop's thread.
"""

cimport cython

from ._ledger cimport ExecutionContext
from ._op cimport DeviceOp
from ._watch cimport hand_over
from ._reactor cimport arm as r_arm
from ._reactor cimport disown as r_disown
from ._reactor cimport done as r_done
from ._reactor cimport retire as r_retire
from ._reactor cimport watch as r_watch

from time import perf_counter

from .._errors import CudaError, UsageError
from ._select import enter_device, leave_device
from ._op import Each, start_sliced
from ._watch import device_failed

__all__ = ["END", "Lanes", "Run", "new_result", "resolve", "start_batch", "settle", "take_batch"]

# executions in flight per lane: while one runs, the next is queued behind it (with one, the
# stream idles from each completion until the driver has noticed it and issued more)
cdef enum:
    _DEPTH = 2

DEPTH = _DEPTH

cdef double _INF = float("inf")

#: what :meth:`Lanes.feed` returns once its iterator is exhausted
END = object()


cpdef object resolve(object item, Py_ssize_t lane):
    """An item is an op, or a callable ``f(lane) -> op`` (to use per-stream buffers)."""
    if isinstance(item, DeviceOp):
        return item
    if callable(item):
        op = item(lane)
        if not isinstance(op, DeviceOp):
            raise UsageError(f"a work-queue item factory returned {type(op).__name__}, not a DeviceOp")
        return op
    raise UsageError(f"work-queue items are DeviceOps or callables f(lane) -> DeviceOp, got {type(item).__name__}")


cpdef object new_result(list results, object cls):
    """An item's result, ``cls(index)``, appended to ``results``; its ``queued_s`` holds the put
    time until the item starts."""
    r = cls(len(results))
    r.queued_s = perf_counter()
    results.append(r)
    return r


cpdef list take_batch(object first, object more, Py_ssize_t limit):
    """``first`` plus up to ``limit - 1`` more from ``more()`` (which returns None when empty)."""
    cdef list batch = [first]
    while len(batch) < limit:
        nxt = more()
        if nxt is None:
            break
        batch.append(nxt)
    return batch


cdef tuple _start(list batch, Py_ssize_t lane, double t0, str who):
    cdef list ops = []
    cdef DeviceOp op
    for item, r in batch:
        r.queued_s = t0 - r.queued_s
        r.lane = lane
        try:
            op = resolve(item, lane)
            op.take(who)  # raises: already consumed
            ops.append((r, op))
        except Exception as e:  # kept per item; the queue goes on
            r.error = e
    if not ops:
        return ops, None
    # one op's items in one execution: one completion event, one wait (Each keeps their outcomes)
    return ops, (ops[0][1] if len(ops) == 1 else Each([p[1] for p in ops]))


cpdef tuple start_batch(list batch, Py_ssize_t lane, double t0, str who, object stream, bint selected=False):
    """Mark a batch's items started on ``lane``; return (their (result, op) pairs, the op to run).

    An item whose op cannot be made gets its error now and is left out; the op to run is the
    item's own op for a batch of one, an ``Each`` of them otherwise, None if nothing is left.
    Factories ``f(lane)`` run with the lane's device selected (what they allocate lives there);
    ``selected``: it is selected already (a queue whose lanes are all on the device its
    driver runs with).
    """
    if selected:
        return _start(batch, lane, t0, who)
    tok = enter_device(stream.backend)
    try:
        return _start(batch, lane, t0, who)
    finally:
        leave_device(tok)


cpdef settle(list ops, object out):
    """Give each item its output (or its own error) from what the batch's op returned."""
    if len(ops) == 1:
        ops[0][0].value = out
        return
    for p, o in zip(ops, out):
        if o[0]:
            p[0].value = o[1]
        else:
            p[0].error = o[1]


@cython.final
cdef class Run:
    """One execution of a lane: a batch's items, enqueued as one op, awaited by its completion
    slot (or, where every slot is armed, its event)."""

    cdef readonly Py_ssize_t lane
    cdef readonly object stream
    cdef readonly list batch  # [(item, ItemResult)]
    cdef readonly list ops  # [(ItemResult, op)] of the items whose op was made
    cdef readonly double t0
    cdef ExecutionContext cx  # None: nothing in flight (never enqueued, failed, handed over)
    cdef object out
    cdef object rest  # a chain's enqueue still under way (Slices), else None
    cdef object ev
    cdef long long h  # the reactor slot's handle, -1 for none
    cdef bint watched

    def __cinit__(self, Py_ssize_t lane, object stream, list batch):
        self.lane = lane
        self.stream = stream
        self.batch = batch
        self.ops = []
        self.t0 = perf_counter()
        self.h = -1

    cdef bint start(self, object ch, object tok, bint selected, double slice_s) except -1:
        """Enqueue the batch (its first slice, for a long chain); True if it went in flight.
        ``ops`` is left empty if nothing did."""
        self.ops, op = start_batch(self.batch, self.lane, self.t0, "a WorkQueue", self.stream, selected)
        if op is None:
            return False
        try:
            self.cx, self.out, self.rest = start_sliced(op, self.stream, "WorkQueue", slice_s)
        except Exception as e:  # the execution failed as a whole (what it enqueued completed)
            self._fail(e)
            self.ops = []
            return False
        if self.rest is None:
            self._arm(ch, tok)
        return True

    cdef bint resume(self, double seconds, object ch, object tok) except -1:
        """Enqueue the chain's next slice; True once all of it is enqueued (and armed)."""
        try:
            if not self.rest.run(seconds):
                return False
        except Exception as e:  # a step failed: what was enqueued completed (Slices.run)
            self._fail(e)
            self.rest = None
            self.cx = None
            return True
        self.out, self.rest = self.rest.output, None
        self._arm(ch, tok)
        return True

    cdef int _arm(self, object ch, object tok) except -1:
        # unwatched: the driver looks itself while it polls; it watches the slot when it parks
        try:
            self.h = r_arm(self.stream, ch, tok, False)
            if self.h < 0:  # every slot is armed: the stream's host function wakes the loop
                self.ev = self.cx.seal_c()
                self.stream.notify(ch, tok)
                self.watched = True
        except CudaError as e:  # this execution fails (a sticky error: the device's too)
            device_failed(self.stream.backend, e)
            self._release()
            self._fail(e)
        except BaseException:
            # anything else (out of memory, an interrupt): the work enqueued is in flight and
            # nobody will wait for it here; the watcher keeps its buffers until it completes
            self._release()
            raise
        return 0

    cdef bint complete(self) except -1:
        """True once the work is done (or failed to enqueue: nothing to wait for); False while
        a chain is still being enqueued."""
        if self.cx is None:
            return True
        if self.rest is not None:
            return False
        return bool(r_done(self.h)) if self.h >= 0 else bool(self.ev.query())

    cdef bint watch(self) except -1:
        """Have the reactor wake the loop at this execution's completion; True if it is
        complete already."""
        if self.cx is None:
            return True
        if self.rest is not None:
            return False
        if not self.watched:
            self.watched = True
            r_watch(self.h)
        return self.complete()

    cdef bint check(self) except -1:
        """The parked re-check: False if the stream's context failed (the items get its
        error, every await on the device is woken to see it)."""
        if self.rest is not None or self.cx is None:
            return True
        try:
            self.stream.query() if self.h >= 0 else self.ev.query()
        except CudaError as e:
            device_failed(self.stream.backend, e)  # sticky: every await on the device sees it too
            self._release()
            self._fail(e)
            return False
        return True

    cdef int settle(self, bint seen) except -1:
        """The work completed: retire its slot, finish the execution, hand out the outputs."""
        if self.cx is None:
            return 0
        if self.h >= 0 and not r_retire(self.h, seen):
            r_disown(self.h)
        self.cx.finish_c(True)
        settle(self.ops, self.out)
        return 0

    cdef int abandon(self, object cancelled) except -1:
        """Nobody waits any more (the queue is cancelled): the stream's watcher finishes the
        execution, its items are reported cancelled (``cancelled``: the error's class)."""
        if self.cx is None:
            return 0
        for p in self.ops:
            r = p[0]
            r.error = r.error or cancelled(f"item {r.index} was cancelled while it ran on stream {self.lane}")
        self._release()
        return 0

    cdef int _release(self) except -1:
        """Hand the execution to the stream's watcher (it keeps the buffers alive until the work
        completes) and let its slot go."""
        hand_over(self.cx, self.stream, self.ev)
        if self.h >= 0 and not r_retire(self.h, False):
            r_disown(self.h)
        self.cx = None
        self.h = -1
        return 0

    cdef int _fail(self, object e) except -1:
        for p in self.ops:
            r = p[0]
            r.error = r.error or e
        return 0


@cython.final
cdef class Lanes:
    """The one-thread queue's executions, per lane, and what finishing them updates.

    ``items``: the queue's deque of ``(item, ItemResult)``; ``results``: every item's result in
    put order (the recorder's list), made by ``result_cls(index)``; ``busy``: the recorder's per-lane
    busy seconds (updated in place); ``space``: events of put()s waiting for room, set once at
    most ``refill`` items are pending; ``held``: per lane, executions whose on_done hooks run
    (they keep their place among the lane's two); ``after(lane, results)``: starts those
    hooks, or None.
    """

    cdef list streams
    cdef list runs  # per lane: its executions in flight, oldest first
    cdef readonly list held
    cdef list busy
    cdef list until  # per lane: the end of the busy time counted
    cdef object items
    cdef list space
    cdef dict counts
    cdef object after
    cdef object cancelled
    cdef object result_cls
    cdef list results
    cdef object ch
    cdef object tok
    cdef Py_ssize_t n, batch, refill
    cdef bint selected
    cdef readonly Py_ssize_t slicing  # executions whose chain is still being enqueued a slice at a time
    cdef public Py_ssize_t pending  # items queued or in flight
    cdef public bint stopped  # the queue was cancelled: feed() queues no more
    cdef readonly double lat  # moving average of an execution's start-to-completion time (s)

    def __cinit__(self, list streams, object items, list results, object result_cls, list busy, list space,
                  Py_ssize_t refill, Py_ssize_t batch, dict counts, object after, object cancelled):
        self.streams = streams
        self.n = len(streams)
        self.runs = [[] for _ in range(self.n)]
        self.held = [0] * self.n
        self.until = [0.0] * self.n
        self.busy = busy
        self.items = items
        self.results = results
        self.result_cls = result_cls
        self.space = space
        self.refill = refill
        self.batch = batch
        self.counts = counts
        self.after = after
        self.cancelled = cancelled

    def add(self, item):
        """Queue ``item`` (an op or a factory): its result (``result_cls(index)``, its put time
        in ``queued_s`` until it starts) joins ``results``; it is pending from now."""
        self.items.append((item, new_result(self.results, self.result_cls)))
        self.pending += 1

    def feed(self, item, it, Py_ssize_t capacity):
        """Queue ``item`` and then items from iterator ``it`` while fewer than ``capacity`` are
        pending, each is an op or a callable and the queue is not cancelled (``stopped``: the
        iterator's own code may cancel it); return the first one not queued (``item`` itself if
        it was not; the caller ``put()``s it: it waits for room, or raises the usage error or
        QueueCancelled), or :data:`END` once ``it`` is exhausted. One call for a queue's worth
        of items: the interpreter runs no loop turn per item."""
        items = self.items
        results = self.results
        cls = self.result_cls
        while not (self.stopped or self.pending >= capacity or not (callable(item) or hasattr(item, "_run"))):
            items.append((item, new_result(results, cls)))
            self.pending += 1
            item = next(it, END)
            if item is END:
                break
        return item

    def bind(self, ch, tok, bint selected):
        """The driver's reactor channel and token (its wake-ups), and whether every lane's
        device is selected already (then nothing is selected around each execution)."""
        self.ch, self.tok, self.selected = ch, tok, selected

    def release(self, Py_ssize_t lane):
        """An execution's on_done hooks returned: its place on ``lane`` is free."""
        self.held[lane] -= 1

    @property
    def in_flight(self):
        """True while any lane has an execution in flight."""
        cdef list q
        for q in self.runs:
            if q:
                return True
        return False

    def any_held(self):
        """True while any execution's on_done hooks run."""
        return any(self.held)

    @cython.boundscheck(False)
    @cython.wraparound(False)
    def collect(self, bint seen):
        """Finish every execution whose completion is flagged (a lane's complete in their
        order, so its first decides); True if any did. ``seen``: completions are seen while
        polling, so their moment is known (the reactor learns from it)."""
        cdef list q
        cdef Run r
        cdef bint moved = False
        for q in self.runs:
            while q:
                r = <Run>q[0]
                if not r.complete():
                    break
                del q[0]
                self._finish(r, perf_counter(), seen)
                moved = True
        return moved

    def issue(self, double slice_s):
        """Enqueue new work, each lane up to two executions (an on_done hook's execution
        holds its place until the hook returns); a long chain is enqueued a slice per call, so
        the loop's other tasks get their turns meanwhile. A call issues at least one execution
        however short ``slice_s`` (0: no limit). True if anything moved."""
        cdef Py_ssize_t lane
        cdef list q
        cdef Run run
        cdef bint moved = False, issued = False
        cdef double seconds = slice_s if slice_s > 0 else _INF
        items = self.items
        if not items and not self.slicing:
            return False  # nothing queued and no chain under way: no lane has anything to do
        cdef double slice_end = perf_counter() + seconds
        for lane in range(self.n):
            q = <list>self.runs[lane]
            if q and (<Run>q[-1]).rest is not None:
                moved = True
                self.counts["enqueue_yields"] += 1  # the loop had its turn since the last slice
                if not (<Run>q[-1]).resume(seconds, self.ch, self.tok):
                    continue
                self.slicing -= 1
            while items and len(q) + <Py_ssize_t>self.held[lane] < _DEPTH and (not issued or perf_counter() < slice_end):
                issued = True
                moved = True
                run = Run(lane, self.streams[lane], self._take())
                if run.start(self.ch, self.tok, self.selected, slice_s):
                    self.counts["awaits"] += 1
                if run.rest is not None:
                    self.slicing += 1
                if run.ops:
                    q.append(run)
                else:
                    self._finish(run, perf_counter(), False)  # every item failed to make its op
        return moved

    cdef list _take(self):
        """The next batch: the first item waiting and up to ``batch - 1`` more already waiting."""
        items = self.items
        cdef list b = [items.popleft()]
        while len(b) < self.batch and items:
            b.append(items.popleft())
        return b

    def ready(self):
        """True if a pass would move something: an execution's completion is flagged (or its
        stream's context failed), a chain's enqueue is under way, or an item waits while a lane
        has room. (A queue's driver polls and parks on this.)"""
        cdef list q
        cdef Py_ssize_t lane
        cdef bint room = False
        if self.slicing:
            return True
        for lane in range(self.n):
            q = <list>self.runs[lane]
            if q and (<Run>q[0]).complete():
                return True
            if len(q) + <Py_ssize_t>self.held[lane] < _DEPTH:
                room = True
        return room and len(self.items) > 0

    def watch_all(self):
        """Have the reactor wake the loop at each execution's completion; True (and stop) at
        the first that is complete already."""
        cdef list q
        cdef Run r
        for q in self.runs:
            for r in q:
                if r.watch():
                    return True
        return False

    def check_all(self):
        """The parked re-check: an execution whose stream's context failed is finished with
        its error; True if any was."""
        cdef list q
        cdef Run r
        cdef bint any_failed = False
        for q in self.runs:
            for r in [r for r in q if not r.check()]:
                q.remove(r)
                self._finish(r, perf_counter(), False)
                any_failed = True
        return any_failed

    def abandon_all(self):
        """The queue is cancelled: the streams' watchers finish the work in flight."""
        cdef list q
        cdef Run r
        for q in self.runs:
            for r in q:
                r.abandon(self.cancelled)

    cdef int _finish(self, Run run, double t1, bint seen) except -1:
        """An execution completed (or failed): its items get their outputs and latencies, the
        lane its busy time, a put() waiting for room its turn, on_done its items."""
        run.settle(seen)
        cdef Py_ssize_t lane = run.lane
        cdef double t0 = run.t0, u = self.until[lane]
        self.lat += 0.1 * (t1 - t0 - self.lat)
        for p in run.batch:
            p[1].latency_s = t1 - t0
        # a lane's two executions overlap: count the time it had something in flight once
        if t1 > u:
            self.busy[lane] += t1 - (t0 if t0 > u else u)
            self.until[lane] = t1
        self.pending -= len(run.batch)
        # a put() waiting at capacity resumes once half the capacity is free, and then puts
        # items until it is full again: woken at every completion, it would put one item per
        # wake-up, and each wake-up costs more than a small GPU item
        space = self.space
        if space and self.pending <= self.refill:
            while space:
                space.pop().set()
        if self.after is not None:
            self.held[lane] += 1
            self.after(lane, [p[1] for p in run.batch])
        return 0
