# cython: language_level=3, boundscheck=False, wraparound=False
"""The access ledger and the execution context: program order across a pool of streams.

Every buffer keeps a short list of accesses by executions not yet seen to finish (``Access``:
execution, byte range, write). When an execution touches a region, earlier unfinished
accesses from executions on OTHER streams that conflict with it (write/any or any/write,
overlapping) make the new execution's stream wait on the earlier execution's completion
event. Same-stream work is ordered by the stream itself.

:func:`enqueue` is the one entry point for work: under the ledger lock it orders the work
after conflicting in-flight work, registers its accesses and enqueues it, so no execution on
another thread can slip a launch between another's check and its registration. The compiled
paths (kernel launches, GEMM, graph replays, from_numpy / to_numpy copies) use the same steps
(:func:`order` under ``LOCK``).

A finished execution (:meth:`ExecutionContext.finish`) marks itself done and edits no list: the
next registration on a buffer overwrites one finished entry in place and drops any others, so
lists stay short and finishing takes no lock.
"""

cimport cython
from libc.stdint cimport uint64_t

from ._base cimport _LOCK as LOCK, Buffer, Driver, Lock, StreamBase, TensorBase
from ._base import forget_layouts

cdef extern from *:
    """
    #if PY_VERSION_HEX >= 0x030D0000
    #define dvo_ledger_finalizing() Py_IsFinalizing()
    #else
    #define dvo_ledger_finalizing() _Py_IsFinalizing()
    #endif
    """
    int _Py_IsFinalizing "dvo_ledger_finalizing" ()

import weakref

from ._completion import completed, wait_completed
from ._reactor import fail_context
from ._watch import orphaned, stop_watchers

from .._errors import BackendError, BorrowError, CaptureError, SettingError, UsageError

__all__ = [
    "ExecutionContext", "Access", "enqueue", "abandon", "abandoned", "lost", "check_backend", "touch",
    "in_flight", "every_in_flight", "held", "set_borrow_policy", "borrow_policy",
]

# 0: order (default), 1: raise, 2: off
cdef int _mode = 0
# bumped whenever a registration edits an access list (or the policy changes): a graph replay
# whose previous replay on the same stream left the epoch as it is finds every list as that
# replay left it (see covering)
cdef uint64_t _epoch = 1
_MODES = ("order", "raise", "off")


def set_borrow_policy(mode):
    """Choose what a cross-stream conflict does.

    ``"order"`` (default): the later work waits on the earlier work's completion event, so the
    program behaves as if run in issue order. ``"raise"``: raise :class:`BorrowError` naming
    both operations and the buffer instead (strict mode, for finding accidental serialization).
    ``"off"``: no tracking at all (unsafe; only for measuring the ledger's cost).
    """
    global _mode, _epoch
    if not isinstance(mode, str) or mode not in _MODES:
        raise SettingError(f"borrow policy {mode!r} is not known; use 'order', 'raise' or 'off'")
    _mode = _MODES.index(mode)
    _epoch += 1


def borrow_policy():
    """The current borrow policy (see :func:`set_borrow_policy`)."""
    return _MODES[_mode]


cdef bint ledger_on():
    return _mode != 2


cdef uint64_t epoch() noexcept:
    """The ledger's epoch under the ``order`` policy (see :func:`covering`); 0 under the others."""
    return _epoch if _mode == 0 else 0


@cython.freelist(64)  # one or more per execution: made and dropped on every launch path
cdef class Access:
    """One in-flight access: ``cx`` touches bytes [lo, hi) of a buffer, writing or not."""

    def __repr__(self):
        return f"<Access {'write' if self.write else 'read'} [{self.lo}, {self.hi}) by {self.cx!r}>"

    @property
    def execution(self):
        return self.cx

    @property
    def span(self):
        return (self.lo, self.hi)

    @property
    def writes(self):
        return self.write


# (no freelist: a context taken from one would keep its predecessor's "finalised" mark, and its
# own finaliser, which hands it to the watcher if it is dropped unfinished, would never run)
cdef object run_all(list cbs):
    """Call every callback of ``cbs`` (each may free memory: one raising, an interrupt too,
    stops none of the others); return the first exception raised, or None."""
    first = None
    for cb in cbs:
        try:
            cb()
        except BaseException as e:
            if first is None:
                first = e
    return first


cdef class ExecutionContext:
    """One execution of an op tree on one stream: the stream, the buffers it touches, what to do when done.

    Built by a terminal (``sync``, ``submit``...). ``buffers`` (None until the first, and again
    once finished) keeps every touched buffer alive until :meth:`finish`, which the terminal
    calls once the stream has passed the execution's last work; only then do its ledger entries
    stop counting and its staging memory go back.
    """

    def __init__(self, stream, label="op", op=None):
        if self.stream is not None:
            raise UsageError("an ExecutionContext is made once; make a new one instead")
        _init(self, stream, label, op)

    def describe(self):
        """A short description for messages."""
        what = f" of {self.op!r}" if self.op is not None else ""
        return f"{self.label}{what} on {self.stream!r}"

    def __repr__(self):
        return f"<ExecutionContext {self.describe()}{' done' if self.done else ''}>"

    # -- cross-stream ordering (called with the ledger lock held) ----------------------------
    def completion_event(self):
        """An event that completes when the work enqueued so far by this execution is done."""
        ev = self._event
        if ev is None or not self._sealed:
            ev = self.backend.new_event()
            self.stream.record(ev)
            self._event = ev
        elif self._gen != self._sealed_gen:
            # work ordered after it was sealed (not by deviceop's own paths, which seal last):
            # an event after that work, the sealed one kept for those who block on it
            ev = self.backend.new_event()
            self.stream.record(ev)
        return ev

    cdef int wait_for_c(self, ExecutionContext other, uint64_t upto) except -1:
        # once per other execution, while none of its entries that this one meets stands for
        # work newer than that wait (``upto``: the entry's gen): an event recorded after its
        # work so far covers it. An entry that has since stood for more (an interleaved step
        # of its chain, another thread's; or others' work on its stream it supersedes: see
        # _superseded) is waited for again, after that work
        cdef tuple w = self._waited
        cdef Py_ssize_t i, at = -1
        for i in range(len(w)):
            if w[i] is other:
                if <uint64_t>self._waited_gens[i] >= upto:
                    return 0
                at = i
                break
        self.stream.wait(other.completion_event())
        if at < 0:
            self._waited = w + (other,)
            self._waited_gens = self._waited_gens + (other._gen,)
        else:
            g = list(self._waited_gens)
            g[at] = other._gen
            self._waited_gens = tuple(g)
        return 0

    def wait_for(self, ExecutionContext other):
        """Make this execution's stream wait for ``other``'s work so far."""
        self.wait_for_c(other, other._gen)

    # -- fork / join (zip) ----------------------------------------------------------------------
    def fork(self, stream, after):
        """A child execution on ``stream`` that starts after event ``after`` (recorded on ours)."""
        cdef ExecutionContext child = new_context(stream, f"{self.label} (zip branch)", None)
        stream.wait(after)
        self.children = self.children + (child,)
        return child

    def join(self, ExecutionContext child):
        """Make our stream wait for everything the child enqueued so far."""
        ev = child.backend.new_event()  # (the child's device records it: a copy to another device)
        child.stream.record(ev)
        self.stream.wait(ev)
        child._event = ev
        child._sealed = True
        child._sealed_gen = child._gen

    # -- completion ----------------------------------------------------------------------------
    cdef object seal_c(self):
        ev = self.backend.new_event(True)  # a watcher thread may block on it
        self.stream.record(ev)
        self._event = ev
        self._sealed = True
        self._sealed_gen = self._gen
        return ev

    def seal(self):
        """Record the completion event after the last work of this execution; return it (an
        event a host thread may block on)."""
        return self.seal_c()

    cpdef object sealed_event(self):
        """Its completion event, one a host thread may block on: the one recorded when it was
        sealed, else one recorded now after its work so far; None once it is finished."""
        if self._sealed:
            return self._event
        if self.done:
            return None
        return self.seal_c()

    def poll(self):
        """True once the execution is known to be complete."""
        if self.done:
            return True
        ev = self._event
        if self._sealed and ev is not None:
            try:
                return ev.query()
            except Exception:
                return True  # a failed context runs nothing more
        return False

    def on_done(self, cb):
        """Run ``cb`` (on the thread that observes completion) once the work has completed; at
        once, on this thread, where it has finished already (then an exception ``cb`` raises
        reaches this caller, where :meth:`finish` would have collected it)."""
        if self.capturing:  # a replay would not run it: refuse instead of returning stale results
            raise CaptureError(
                "this work needs a host step when the work completes (a staging copy to or from "
                "host memory), which a graph replay cannot run; copy before or after the scope"
            )
        if self.done:
            # (finished since the caller looked, on another thread: its callbacks ran already,
            # and one added now would never run, holding what it releases for good)
            cb()
            return
        if self._done_cbs is None:
            self._done_cbs = []
        self._done_cbs.append(cb)

    cdef int finish_c(self, bint ok) except -1:
        cdef ExecutionContext child
        if self.done:
            return 0
        self.done = True
        cbs = self._done_cbs
        self._done_cbs = None
        first = None
        try:
            for child in self.children:  # joined into our stream: complete when we are
                try:
                    child.finish_c(ok)
                except BaseException as e:
                    if first is None:
                        first = e
            if cbs is not None:
                err = run_all(cbs)  # staging copies and releases: every one runs (each frees memory)
                if first is None:
                    first = err
        finally:
            # the ledger entries stay, marked finished by ``done``: the next registration on each
            # buffer reuses or drops them (order), so finishing costs no lock and no list edits
            self.buffers = None  # (a later keep() makes a new list)
            self._waited = ()
            self._waited_gens = ()
            self.op = None
            self._event = None
            self._sealed = False
        if first is not None and (ok or not isinstance(first, Exception)):
            raise first
        return 0

    def finish(self, ok=True):
        """Mark complete: run completion callbacks, drop buffers; its ledger entries stop counting."""
        self.finish_c(ok)

    # -- waiting: the one completion primitive of every waiter ----------------------------------
    def completed(self, timeout=None):
        """``await cx.completed(timeout=None)``: resume once this execution's work is complete,
        under asyncio, uvloop or trio, without blocking the loop (a completion slot the GPU
        flags, polled while due soon, else parked on the reactor's wake-up, with a backing-off
        re-check for a faulted context). ``TimeoutError`` after ``timeout`` seconds; the work
        goes on. Finishes nothing: whoever owns the execution does. ``BackendError`` at once
        where its device runs nothing more (a flag armed there would never be written)."""
        why = abandoned(self.backend) if not self.done else None
        if why is not None:
            raise BackendError(f"cannot wait for {self.describe()}: {why}")
        return completed(self, timeout)

    def wait_completed(self, timeout=None):
        """The blocking twin of :meth:`completed`, for threads: True once the work is complete,
        False if ``timeout`` seconds passed first. Without a timeout the thread sleeps in the
        driver (the GIL released) until then. Finishes nothing, as :meth:`completed`."""
        return wait_completed(self, timeout)

    cdef int block_c(self, bint seal) except -1:
        """Block, without the GIL, until the work is complete: on the completion event where the
        execution was sealed (or ``seal``: one is recorded after its work so far), else on its
        stream, which completes once this work and whatever was enqueued on the stream after it
        have (the cheapest wait, for a terminal whose thread enqueued the work just now). The
        one blocking wait of every thread that waits for an execution (``sync``,
        ``wait_completed``, a future's ``result``, a ThreadedQueue); raises the stream's
        CudaError where its context failed."""
        cdef Driver d = self.drv
        cdef int err
        cdef void* sh = <void*>self.sh
        if self.done:
            return 0
        ev = self.sealed_event() if seal or self._sealed else None
        if ev is not None:
            ev.synchronize()
        elif d is not None and d.stream_sync != NULL:
            with nogil:
                err = d.stream_sync(sh)
            if err:
                raise d.error(err, "cuStreamSynchronize")
        else:
            self.stream.synchronize()
        return 0

    def _block(self):
        """:meth:`block_c` on the execution's own event (sealed now if it was not), for the
        core's Python modules (``wait_completed``): later work on its stream is not waited for."""
        self.block_c(True)

    def __del__(self):
        # The invariant, held here rather than at each exception site: an execution ends only by
        # completing or by being handed to its stream's watcher. One dropped unfinished (an
        # exception of any type between its enqueue and its wait, a cancelled or dropped waiter,
        # a cycle collected) goes to the watcher, which keeps its buffers until its work is done.
        # (A recording ran nothing; at interpreter exit nothing can be waited for.)
        if self.done or self.capturing or self.stream is None or _Py_IsFinalizing():
            return
        if self.buffers is None and self._done_cbs is None and not self.children:
            self.done = True  # it holds nothing that work could still use
            return
        if _any_abandoned and lost(self.backend) is not None:
            return  # the parent's work, in a child made by fork(): it never completes here
        # A finaliser runs wherever a garbage collection happens: on any thread, holding any lock,
        # perhaps while that thread records a graph. So it only queues the execution; the
        # watchers' janitor thread records its event and hands it to its stream's watcher.
        orphaned(self)


# (backend, its Driver or None) of the last context made: one pair, replaced whole
cdef tuple _last_driver = (None, None)

# backends that may run nothing more (closed, or inherited across fork()), with the reason
cdef dict _ABANDONED = {}
cdef bint _any_abandoned = False


def abandon(backend, str reason, bint notify=True):
    """From now on, an execution on ``backend`` raises :class:`BackendError` with ``reason``
    (what happened and what to do instead) before any work is enqueued.

    ``notify``: end the backend's watcher threads once what they hold is finished, and retire
    every completion slot armed on it (nothing more of it runs); not in a forked child, where
    those threads do not exist and the reactor starts afresh."""
    global _last_driver, _any_abandoned
    for k in [k for k, e in _ABANDONED.items() if e[0]() is None]:
        del _ABANDONED[k]  # (weak: a closed device that nothing uses any more is freed)
    _ABANDONED[id(backend)] = (weakref.ref(backend), reason, not notify)
    _any_abandoned = True
    _last_driver = (None, None)
    forget_layouts(backend)
    if notify:
        stop_watchers(backend)
        fail_context(backend)


def abandoned(backend):
    """Why ``backend`` may run nothing more, or None if it may."""
    e = _ABANDONED.get(id(backend))
    return e[1] if e is not None and e[0]() is backend else None


def lost(backend):
    """Why work already queued on ``backend`` will never complete in this process (it is the
    parent's, in a process made by fork()), or None (a closed backend still completes it)."""
    e = _ABANDONED.get(id(backend))
    return e[1] if e is not None and e[0]() is backend and e[2] else None


cpdef int check_backend(ExecutionContext cx, object be, object what) except -1:
    """Raise unless ``be``, the device ``what``'s tensors live on, is the execution's.

    :class:`BackendError` where that device may run nothing more (see :func:`abandon`),
    :class:`UsageError` where it is another live device.
    """
    if be is cx.backend:
        return 0
    why = abandoned(be)
    if why is not None:
        raise BackendError(f"{what}: {why}")
    raise UsageError(
        f"{what}: its tensors live on another device ({be.device_label}) than this execution's "
        f"stream ({cx.backend.device_label}); run it on a stream of the tensors' device"
    )


cdef inline int _init(ExecutionContext cx, stream, label, op) except -1:
    global _last_driver
    if isinstance(stream, StreamBase):
        be = (<StreamBase>stream).backend
        cx.sh = (<StreamBase>stream).handle_int
    else:  # a stand-in (a backend's capture helper, a test double)
        be = stream.backend
        cx.sh = stream.handle_int
    cx.stream = stream
    cx.backend = be
    last = _last_driver
    if last[0] is not be:
        if _any_abandoned:
            why = abandoned(be)
            if why is not None:
                raise BackendError(why)
        d = getattr(be, "driver", None)
        last = _last_driver = (be, d if isinstance(d, Driver) else None)
    cx.drv = last[1]
    cx.label = label
    cx.op = op
    cx.children = ()
    cx._waited = ()
    cx._waited_gens = ()
    # the others start as a new object's fields do (None, False): buffers (made by the first
    # buffer held, see keep), done, capturing, captured, _event, _sealed, _done_cbs
    return 0


cdef ExecutionContext new_context(object stream, object label, object op):
    """An ExecutionContext without a Python-level __init__ call (the launch paths' cost)."""
    cdef ExecutionContext cx = ExecutionContext.__new__(ExecutionContext)
    _init(cx, stream, label, op)
    return cx


# ---- the ledger ----------------------------------------------------------------------------

cdef inline int keep(ExecutionContext cx, Buffer buf) except -1:
    """Hold ``buf`` until ``cx`` finishes (its list is made by the first buffer it holds: a
    replay makes it after its launch)."""
    if cx.buffers is None:
        cx.buffers = [buf]
    else:
        cx.buffers.append(buf)
    return 0


cdef int order(ExecutionContext cx, Buffer buf, Py_ssize_t lo, Py_ssize_t hi, bint write, object what) except -1:
    """Order ``cx``'s access after conflicting in-flight work on other streams; register it.

    Call with ``LOCK`` held, right before the work that performs the access is enqueued. (A
    path that enqueues one piece of work calls :func:`scan` before it and :func:`register`
    after it instead, under one hold of the lock, so the registration's bookkeeping runs while
    the GPU already works.)
    """
    if scan(cx, buf, lo, hi, write, what):
        register(cx, buf, lo, hi, write)
    return 0


cdef int scan(ExecutionContext cx, Buffer buf, Py_ssize_t lo, Py_ssize_t hi, bint write, object what) except -1:
    """Make ``cx``'s stream wait for in-flight work on other streams that conflicts with its
    access (or raise :class:`BorrowError` under the ``raise`` policy). With ``LOCK`` held,
    before the work. Returns 1 if the access is to be registered (:func:`register`, after the
    work, before the lock is dropped), 0 if there is nothing to register (covered by this
    execution's newest entry, recorded by a graph capture, or the ledger is off)."""
    cdef list acc
    cdef Access e, last
    cdef ExecutionContext ex
    cdef Py_ssize_t i, n
    cdef dict cap = cx.captured
    cx._gen += 1  # this access's number: an entry that stands for it carries it (Access.gen)
    if cap is not None:
        # recording a graph: nothing runs now, so nothing to order; the replay registers these
        key = (id(buf), lo, hi, write)
        if key not in cap:
            cap[key] = (buf, lo, hi, write)
            keep(cx, buf)
        return 0
    if _mode == 2:
        if not cx.buffers or cx.buffers[len(cx.buffers) - 1] is not buf:
            keep(cx, buf)  # lifetimes hold even with the ledger off
        return 0
    acc = buf.accesses
    n = len(acc)
    if n == 0:
        return 1
    last = acc[n - 1]
    if last.cx is cx and last.lo <= lo and last.hi >= hi and (last.write or not write):
        last.gen = cx._gen  # (it stands for this access too)
        return 0  # already covered by this execution (the common chained case): ordered then
    stream = cx.stream
    for i in range(n):
        e = acc[i]
        ex = e.cx
        if ex is cx or ex.done or ex.stream is stream:
            continue
        if not (write or e.write) or e.hi <= lo or hi <= e.lo:
            continue
        if _mode == 1:
            kind = "writes" if write else "reads"
            other = "writes" if e.write else "reads"
            raise BorrowError(
                f"{what!r} ({cx.describe()}) {kind} bytes [{lo}, {hi}) of {buf.describe()}, while "
                f"{ex.describe()} still {other} bytes [{e.lo}, {e.hi}) of it. "
                "Wait for the earlier work (sync/await its result), run both on one stream "
                "(then/sync_on), or use set_borrow_policy('order') to have deviceop order them."
            )
        cx.wait_for_c(ex, e.gen)
    return 1


cdef inline bint _superseded(Access e, ExecutionContext cx, Py_ssize_t lo, Py_ssize_t hi, bint write):
    """Whether entry ``e`` (another execution's) orders nothing that ``cx``'s access of
    [lo, hi) (writing or not), registered now, does not: its execution finished, or it ran on
    ``cx``'s stream before this access and this access covers it (its span, and a write if it
    wrote). Work that waits for ``cx`` then waits for the older execution as well: ``cx``'s
    event is recorded after this access on that stream (a new one for every waiter that has not
    waited for ``cx`` since: ExecutionContext.wait_for_c; not where ``cx`` is sealed already,
    its event made before this access), and its completion follows the older one's."""
    cdef ExecutionContext ex = e.cx
    if ex.done:
        return True
    return (
        ex.stream is cx.stream
        and lo <= e.lo
        and e.hi <= hi
        and (write or not e.write)
        and not cx._sealed
    )


cdef inline bint _written_after(list acc, Py_ssize_t i, Py_ssize_t lo, Py_ssize_t hi):
    """Whether an entry after ``acc[i]`` writes bytes of [lo, hi) (finished or not: a graph's
    replay hands its finished entries to its next execution)."""
    cdef Access e
    cdef Py_ssize_t j
    for j in range(i + 1, len(acc)):
        e = acc[j]
        if e.write and e.lo < hi and lo < e.hi:
            return True
    return False


cdef int register(ExecutionContext cx, Buffer buf, Py_ssize_t lo, Py_ssize_t hi, bint write) except -1:
    """Register ``cx``'s access (after :func:`scan`, with ``LOCK`` still held) and keep the
    buffer alive until ``cx`` finishes.

    An access already covered by an earlier one of ``cx`` (views of one allocation named in
    turn) registers nothing more, so the list stays short. An entry that no longer orders
    anything is overwritten in place, and any others like it dropped: a finished execution's
    (a finished execution edits no list itself, so finishing costs nothing after its wait),
    and one that this access supersedes (see :func:`_superseded`), so that a buffer many
    executions read at once on one stream (a model's weights under many requests in flight)
    keeps one entry per stream, and every scan of it stays short.
    """
    global _epoch
    cdef list acc
    cdef Access e, last
    cdef Access spare = None
    cdef Py_ssize_t i, n, stale = 0
    if cx.captured is not None or _mode == 2:
        return 0  # (scan did what these need)
    acc = buf.accesses
    n = len(acc)
    if n:
        last = acc[n - 1]
        if last.cx is cx and last.lo <= lo and last.hi >= hi and (last.write or not write):
            last.gen = cx._gen
            return 0  # covered by this execution's newest entry (the common chained case)
    for i in range(n):
        e = acc[i]
        if e.cx is cx:
            if e.lo <= lo and e.hi >= hi and (e.write or not write):
                e.gen = cx._gen  # (it stands for this access too: a waiter for cx waits again)
                if i != n - 1 and (write or _written_after(acc, i, lo, hi)):
                    # covered by an older entry of cx's, with others' after it that this access
                    # conflicts with: it goes last, and the list counts as changed, so that
                    # neither another execution's quick check (its own entry the newest) nor
                    # a graph's replay that keeps its entries (the epoch unchanged) misses it
                    _epoch += 1
                    del acc[i]
                    acc.append(e)
                return 0
        elif _superseded(e, cx, lo, hi, write):
            stale += 1
            if spare is None or i == n - 1:
                spare = e  # the last one if it is stale: it stays last
    _epoch += 1  # the list changes
    if stale > 1:  # several stale entries (streams that ran at once, readers on one stream): keep only the spare
        acc[:] = [e for e in acc if e is spare or (<Access>e).cx is cx or not _superseded(e, cx, lo, hi, write)]
        n = len(acc)
    if spare is not None:
        last = acc[n - 1]
        if last is not spare:  # the newest entry goes last (scan's quick check reads it)
            acc[acc.index(spare)] = last
            acc[n - 1] = spare
        e = spare
    else:
        e = Access.__new__(Access)
        acc.append(e)
    e.cx = cx
    e.lo = lo
    e.hi = hi
    e.write = write
    e.gen = cx._gen
    keep(cx, buf)
    return 0


cdef Access covering(ExecutionContext cx, Buffer buf, Py_ssize_t lo, Py_ssize_t hi, bint write):
    """``cx``'s entry in ``buf``'s list that covers its access (after :func:`register`), or None.

    A graph replay keeps these with the :func:`epoch` after its registration. While the epoch
    stays, no list changed: a later replay on the same stream hands the same entries to its
    execution (:func:`retarget`) instead of scanning and registering. Nothing it would have
    waited for is new (the earlier replay, before it on the stream, waited already), and an
    entry kept though it covers more (a write, a wider span: another op of that execution
    registered it) only orders later work more than needed.
    """
    cdef list acc = buf.accesses
    cdef Access e
    cdef Py_ssize_t i
    for i in range(len(acc) - 1, -1, -1):
        e = acc[i]
        if e.cx is cx and e.lo <= lo and e.hi >= hi and (e.write or not write):
            return e
    return None


cdef int retarget(ExecutionContext cx, tuple entries, object keep_alive) except -1:
    """Hand ``entries`` (from :func:`covering`, the epoch unchanged) to ``cx``, which keeps
    ``keep_alive`` (what holds their buffers) until it finishes. With ``LOCK`` held."""
    cdef Access e
    cx._gen += 1  # (its replay is work that those who waited for cx before have not waited for)
    for e in entries:
        e.cx = cx
        e.gen = cx._gen
    if cx.buffers is None:
        cx.buffers = [keep_alive]
    else:
        cx.buffers.append(keep_alive)
    return 0


cdef int order_tensor(ExecutionContext cx, object t, bint write, object what) except -1:
    """:func:`order` for a tensor's byte span."""
    cdef TensorBase tb = <TensorBase?>t
    return order(cx, tb.buffer, tb.lo, tb.hi, write, what)


def touch(ExecutionContext cx, Buffer buf, Py_ssize_t lo, Py_ssize_t hi, bint write, what):
    """Register an access by ``cx`` and order it (call with ``LOCK`` held, right before the work)."""
    order(cx, buf, lo, hi, write, what)


def enqueue(ExecutionContext cx, accesses, work, what):
    """The one entry point for work: order, register and enqueue it, atomically.

    ``accesses``: ``(buffer, lo, hi, write)`` byte ranges the work reads or writes, or tensors
    (read) and ``(tensor, write)`` pairs. ``work()`` enqueues the work on ``cx.stream`` and
    its result is returned. Under the ledger lock: the work is ordered after conflicting
    in-flight work on other streams, its accesses are registered, then it is enqueued, so a
    later registration on any thread sees it and is ordered after it.
    """
    LOCK.take()
    try:
        for a in accesses:
            if type(a) is tuple:
                if len(a) == 4:
                    order(cx, a[0], a[1], a[2], a[3], what)
                else:
                    order_tensor(cx, a[0], a[1], what)
            else:
                order_tensor(cx, a, False, what)
        return work() if work is not None else None
    finally:
        LOCK.drop()


def in_flight(Buffer buf, Py_ssize_t lo, Py_ssize_t hi):
    """The first unfinished execution touching bytes [lo, hi) of ``buf``, if any."""
    cdef Access e
    for e in list(buf.accesses):
        ex = e.cx
        if not ex.done and not ex.poll() and e.lo < hi and lo < e.hi:
            return ex
    return None


def every_in_flight(Buffer buf, Py_ssize_t lo, Py_ssize_t hi):
    """Every unfinished execution touching bytes [lo, hi) of ``buf``, reading or writing, once
    each, in the order their accesses were registered."""
    cdef Access e
    cdef list found = []
    for e in list(buf.accesses):
        ex = e.cx
        if not ex.done and e.lo < hi and lo < e.hi and not any(x is ex for x in found) and not ex.poll():
            found.append(ex)
    return found


def held(ExecutionContext cx, Buffer buf, Py_ssize_t lo, Py_ssize_t hi, bint write):
    """True if ``cx``'s latest access to ``buf`` already covers [lo, hi) (for ``write``)."""
    cdef list acc = buf.accesses
    cdef Access last
    if not acc:
        return False
    last = acc[len(acc) - 1]
    return last.cx is cx and last.lo <= lo and last.hi >= hi and (last.write or not write)
