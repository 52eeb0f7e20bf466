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

Finished executions remove their entries (:meth:`ExecutionContext.finish`), so lists stay short.
"""

from ._base cimport _LOCK as LOCK, Buffer, Driver, Lock, TensorBase
from ._base import forget_layouts

import weakref

from .._errors import BackendError, BorrowError, CaptureError, SettingError, UsageError

__all__ = [
    "ExecutionContext", "Access", "enqueue", "abandon", "abandoned", "on_abandon", "check_backend", "touch",
    "release", "in_flight", "held", "set_borrow_policy", "borrow_policy",
]

# 0: order (default), 1: raise, 2: off
cdef int _mode = 0
_MODES = ("order", "raise", "off")


def set_borrow_policy(mode):
    """Choose what a cross-stream conflict does.

    ``"order"`` (default): the later work waits on the earlier work's completion event, so the
    program behaves as if run in issue order. ``"raise"``: raise :class:`BorrowError` naming
    both operations and the buffer instead (strict mode, for finding accidental serialization).
    ``"off"``: no tracking at all (unsafe; only for measuring the ledger's cost).
    """
    global _mode
    if not isinstance(mode, str) or mode not in _MODES:
        raise SettingError(f"borrow policy {mode!r} is not known; use 'order', 'raise' or 'off'")
    _mode = _MODES.index(mode)


def borrow_policy():
    """The current borrow policy (see :func:`set_borrow_policy`)."""
    return _MODES[_mode]


cdef bint ledger_on():
    return _mode != 2


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


cdef class ExecutionContext:
    """One execution of an op tree on one stream: the stream, the buffers it touches, what to do when done.

    Built by a terminal (``sync``, ``submit``...). ``buffers`` keeps every touched buffer alive
    until :meth:`finish`, which the terminal calls once the stream has passed the execution's
    last work; only then are the ledger entries dropped and staging memory returned.
    """

    def __init__(self, stream, label="op", op=None):
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
        return ev

    cdef int wait_for_c(self, ExecutionContext other) except -1:
        if other in self._waited:
            return 0
        other._waited_on = True
        self.stream.wait(other.completion_event())
        self._waited = self._waited + (other,)
        return 0

    def wait_for(self, ExecutionContext other):
        """Make this execution's stream wait for ``other``'s work so far."""
        self.wait_for_c(other)

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

    # -- completion ----------------------------------------------------------------------------
    cdef object seal_c(self):
        ev = self.backend.new_event(True)  # a watcher thread may block on it
        self.stream.record(ev)
        self._event = ev
        self._sealed = True
        return ev

    def seal(self):
        """Record the completion event after the last work of this execution; return it (an
        event a host thread may block on)."""
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
        """Run ``cb`` (on the thread that observes completion) once the work has completed."""
        if self.capturing:  # a replay would not run it: refuse instead of returning stale results
            raise CaptureError(
                "this work needs a host step when the work completes (a staging copy to or from "
                "host memory), which a graph replay cannot run; copy before or after the scope"
            )
        if self._done_cbs is None:
            self._done_cbs = []
        self._done_cbs.append(cb)

    cdef int finish_c(self, bint ok) except -1:
        cdef ExecutionContext child
        if self.done:
            return 0
        self.done = True
        for child in self.children:  # joined into our stream: complete when we are
            child.finish_c(ok)
        cbs = self._done_cbs
        self._done_cbs = None
        try:
            if cbs is not None:
                for cb in cbs:
                    try:
                        cb()  # staging copies and releases: run even after a failure (frees memory)
                    except Exception:
                        if ok:
                            raise
        finally:
            release_c(self)
            self.buffers = []
            self._waited = ()
            self.op = None
        return 0

    def finish(self, ok=True):
        """Mark complete: run completion callbacks, forget ledger entries, drop buffers."""
        self.finish_c(ok)


# (backend, its Driver or None) of the last context made: one pair, replaced whole
cdef tuple _last_driver = (None, None)

# backends that may run nothing more (closed, or inherited across fork()), with the reason
cdef dict _ABANDONED = {}
cdef bint _any_abandoned = False


def abandon(backend, str reason, bint notify=True):
    """From now on, an execution on ``backend`` raises :class:`BackendError` with ``reason``
    (what happened and what to do instead) before any work is enqueued.

    ``notify``: run the :func:`on_abandon` callbacks (which end the backend's threads); not in
    a forked child, where those threads do not exist and their locks may be held."""
    global _last_driver, _any_abandoned
    for k in [k for k, e in _ABANDONED.items() if e[0]() is None]:
        del _ABANDONED[k]  # (weak: a closed device that nothing uses any more is freed)
    _ABANDONED[id(backend)] = (weakref.ref(backend), reason)
    _any_abandoned = True
    _last_driver = (None, None)
    forget_layouts(backend)
    if notify:
        for fn in list(_ON_ABANDON):
            fn(backend)


#: what higher layers do when a backend is abandoned (end its threads): fn(backend)
cdef list _ON_ABANDON = []


def on_abandon(fn):
    """Call ``fn(backend)`` whenever a backend is abandoned (see :func:`abandon`)."""
    _ON_ABANDON.append(fn)


def abandoned(backend):
    """Why ``backend`` may run nothing more, or None if it may."""
    e = _ABANDONED.get(id(backend))
    return e[1] if e is not None and e[0]() is backend else None


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
    be = stream.backend
    cx.stream = stream
    cx.backend = be
    cx.sh = stream.handle_int
    last = _last_driver
    if last[0] is not be:
        if _any_abandoned:
            why = abandoned(be)
            if why is not None:
                raise BackendError(why)
        d = getattr(be, "driver", None)
        last = _last_driver = (be, d if isinstance(d, Driver) else None)
    cx.drv = last[1]
    cx.buffers = []
    cx.done = False
    cx.label = label
    cx.op = op
    cx.capturing = False
    cx.captured = None
    cx.children = ()
    cx._event = None
    cx._sealed = False
    cx._waited = ()
    cx._done_cbs = None
    cx._waited_on = False
    return 0


cdef ExecutionContext new_context(object stream, object label, object op):
    """An ExecutionContext without a Python-level __init__ call (the launch paths' cost)."""
    cdef ExecutionContext cx = ExecutionContext.__new__(ExecutionContext)
    _init(cx, stream, label, op)
    return cx


# ---- the ledger ----------------------------------------------------------------------------

cdef int order(ExecutionContext cx, Buffer buf, Py_ssize_t lo, Py_ssize_t hi, bint write, object what) except -1:
    """Order ``cx``'s access after conflicting in-flight work on other streams; register it.

    Call with ``LOCK`` held, right before the work that performs the access is enqueued.
    """
    cdef list acc
    cdef Access e, last
    cdef ExecutionContext ex
    cdef dict cap = cx.captured
    if cap is not None:
        # recording a graph: nothing runs now, so nothing to order; the replay registers these
        key = (id(buf), lo, hi, write)
        if key not in cap:
            cap[key] = (buf, lo, hi, write)
            cx.buffers.append(buf)
        return 0
    if _mode == 2:
        if not cx.buffers or cx.buffers[len(cx.buffers) - 1] is not buf:
            cx.buffers.append(buf)  # lifetimes hold even with the ledger off
        return 0
    cdef bint covered = False
    acc = buf.accesses
    if acc:
        last = acc[len(acc) - 1]
        if last.cx is cx and last.lo <= lo and last.hi >= hi and (last.write or not write):
            return 0  # already covered by this execution (the common chained case)
        stream = cx.stream
        for e in acc:
            ex = e.cx
            if ex is cx:
                # an earlier access of this execution covers it (views of one allocation named
                # in turn): order it, but register nothing more, so the list stays short
                if e.lo <= lo and e.hi >= hi and (e.write or not write):
                    covered = True
                continue
            if ex.done or ex.stream is stream:
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
            cx.wait_for_c(ex)
        if covered:
            return 0
    e = Access.__new__(Access)
    e.cx = cx
    e.lo = lo
    e.hi = hi
    e.write = write
    acc.append(e)
    cx.buffers.append(buf)
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


cdef int release_c(ExecutionContext cx) except -1:
    cdef Buffer buf
    cdef list acc
    cdef Py_ssize_t i
    cdef Access e
    if not cx.buffers:
        return 0
    LOCK.take()
    try:
        for buf in cx.buffers:
            acc = buf.accesses
            i = len(acc) - 1
            while i >= 0:
                e = acc[i]
                if e.cx is cx:
                    del acc[i]
                i -= 1
    finally:
        LOCK.drop()
    return 0


def release(ExecutionContext cx):
    """Forget every access of a finished execution."""
    release_c(cx)


def in_flight(Buffer buf, Py_ssize_t lo, Py_ssize_t hi):
    """The first unfinished execution touching bytes [lo, hi) of ``buf``, if any."""
    cdef Access e
    for e in list(buf.accesses):
        ex = e.cx
        if not ex.done and not ex.poll() and e.lo < hi and lo < e.hi:
            return ex
    return None


def held(ExecutionContext cx, Buffer buf, Py_ssize_t lo, Py_ssize_t hi, bint write):
    """True if ``cx``'s latest access to ``buf`` already covers [lo, hi) (for ``write``)."""
    cdef list acc = buf.accesses
    cdef Access last
    if not acc:
        return False
    last = acc[len(acc) - 1]
    return last.cx is cx and last.lo <= lo and last.hi >= hi and (last.write or not write)
