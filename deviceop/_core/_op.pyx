# cython: language_level=3, annotation_typing=False
"""DeviceOp, the run protocol, the hot combinators and the terminals.

An op is a single-use description of GPU work; a terminal makes an :class:`ExecutionContext`
on a stream, calls the op's ``_run(cx)`` (which enqueues its work through the ledger and
returns its output, possibly in flight) and waits for it or hands it to the watcher: ``sync``
and ``sync_on`` here, ``await`` through the completion path (``_completion``), ``submit``
through its future (``_future``). ``then``, ``map``, ``inspect`` and ``shared`` are here too,
and graph capture: ``op.graph()`` records through a scope whose graph's replay is an op, so the
replay (``_replay.pxi``) and the scope with CudaGraph (``_graph.pxi``) are compiled into this
module.
"""

cimport cython

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.tuple cimport PyTuple_GET_ITEM
from libc.stdint cimport uint64_t, uintptr_t

from ._base cimport _LOCK as LOCK, Buffer, Driver, StreamBase, make_current, n_recording
from ._ledger cimport Access, ExecutionContext, covering, epoch, new_context, register, retarget, run_all, scan

from ._guards cimport check_timeout, refuse_in_capture, refuse_on_loop

import threading
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from . import _capture
from ._base import STREAM_TYPES
from ._capture import CAPTURE
from ._completion import await_op
from ._future import DeviceFuture, watch_future
from ._watch cimport hand_over
from ._watch import device_failed, sticky

from .._errors import CaptureError, CudaError, NotATensorError, UsageError
from ._select import current, next_stream, stream_of

__all__ = [
    "DeviceOp", "Value", "Chain", "Each", "Shared", "SHAREABLE", "value", "chain", "start", "run_sync",
    "start_sliced", "as_stream", "is_op",
    "GraphBase", "GraphLaunch", "CudaGraph", "GraphScope", "Recording", "scope", "capture",
]

T = TypeVar("T")

#: the ``_used`` mark of ops any number of consumers may take (``shared()``)
cdef object _SHAREABLE = "(shareable)"
SHAREABLE = _SHAREABLE


cpdef object as_stream(object stream):
    """A deviceop stream: ``None`` is the next pool stream; a deviceop stream itself; another
    library's stream (an object with ``__cuda_stream__``) wrapped once per handle."""
    if isinstance(stream, StreamBase):  # every backend's stream
        return stream
    if stream is None:
        return next_stream()
    if type(stream) in STREAM_TYPES:
        return stream
    if hasattr(stream, "__cuda_stream__"):
        return stream_of(stream)
    raise UsageError(
        f"{stream!r} is not a deviceop stream nor another library's; pass one from do.next_stream() "
        "or do.streams(), a stream with __cuda_stream__ (PyTorch, CuPy, cuda.core), or "
        "do.Stream.from_handle(handle)"
    )


cdef inline int _make_current(ExecutionContext cx) except -1:
    if cx.drv is not None:
        make_current(cx.drv)
    else:
        cx.backend.make_current()
    return 0


cdef int _enqueue_failed(ExecutionContext cx, object stream) except -1:
    """After an enqueue of ``cx`` raised, for the asynchronous terminals: what was already
    enqueued completes before its buffers go, without waiting here (an awaiting loop is never
    blocked): the watcher finishes it. The caller re-raises."""
    hand_over(cx, stream)
    return 0


cdef int _finish_when_done(ExecutionContext cx, object stream) except -1:
    """Wait for what ``cx`` enqueued, then finish it (a blocking terminal whose enqueue or wait
    failed, off any event loop: a host read right after sees the work complete). Interrupted,
    or after an error of the wait itself, the watcher finishes it instead."""
    try:
        cx.block_c(False)  # the execution's one blocking wait (see ExecutionContext.block_c)
    except CudaError as e:
        if not sticky(e):
            hand_over(cx, stream)
            return 0
        device_failed(cx.backend, e)
    except BaseException:
        hand_over(cx, stream)
        return 0
    cx.finish_c(False)
    return 0


cdef object _enqueue(ExecutionContext cx, DeviceOp op, object stream):
    """Enqueue ``op`` in ``cx``; on failure the watcher finishes what was already enqueued."""
    _make_current(cx)
    try:
        return op._run(cx)
    except BaseException:
        _enqueue_failed(cx, stream)
        raise


cpdef tuple start(DeviceOp op, object stream, str label):
    """Enqueue ``op`` (already consumed) on ``stream``: ``(execution, output)``.

    On failure while enqueuing, what was already enqueued completes before its buffers go.
    The asynchronous terminals (submit, await) start with this.
    """
    cdef ExecutionContext cx
    if n_recording:
        refuse_in_capture(f"{op!r}.{label}")
    cx = new_context(stream, label, op)
    return cx, _enqueue(cx, op, stream)


cpdef object run_sync(DeviceOp op, object stream, str label):
    """Run ``op`` (already consumed) on ``stream``, wait for the stream, return the output."""
    cdef ExecutionContext cx
    if n_recording:
        refuse_in_capture(f"{op!r}.{label}")
    cx = new_context(stream, label, op)
    _make_current(cx)
    try:
        out = op._run(cx)
    except BaseException:
        _finish_when_done(cx, stream)  # (blocking terminal: it waits, as it would have)
        raise
    try:
        cx.block_c(False)  # the execution's one blocking wait (see ExecutionContext.block_c)
    except CudaError as e:
        if sticky(e):
            cx.finish_c(False)  # the context is lost: nothing more of it runs
            device_failed(cx.backend, e)  # every waiter on the device sees it too
        else:
            hand_over(cx, stream)  # an error of the wait itself: the work may still run
        raise
    except BaseException:
        hand_over(cx, stream)  # KeyboardInterrupt, SystemExit...: the work may still run
        raise
    cx.finish_c(True)
    return out


# what a Tensor or Partition has and an op does not (see DeviceOp.__getattr__)
_TENSOR_ATTRS = frozenset((
    "T", "addr", "buffer", "device", "dtype", "is_contiguous", "nbytes", "ndim", "numpy", "offset",
    "partition", "ptr", "shape", "size", "span", "strides", "view", "grid", "tensor", "tile",
))


cdef class DeviceOp:
    """A description of GPU work whose output is a ``T``.

    Ops are single-use values, like the Rust ops of cuTile Rust (Elibol et al., "Fearless
    Concurrency on the GPU", arXiv:2606.15991) that move into what consumes them:
    composing an op (``then``, ``zip``, as a kernel argument...) or driving it with a terminal
    (``sync``, ``sync_on``, ``submit``, ``await``) consumes it, and using it again raises
    :class:`UsageError`. ``shared()`` makes an op that any number of consumers may use; it
    executes once.
    """

    # (_used starts as None: Cython initializes object fields so, with no __cinit__ to pay for)
    def __init__(self):
        pass

    def __getattr__(self, name):
        # only for names normal lookup did not find: a tensor's attribute asked of the op that
        # will make the tensor (a missing .sync() or await) gets advice, not a bare AttributeError
        if name in _TENSOR_ATTRS:
            if name == "numpy":  # (a host copy inside the pipeline would wait on its own work)
                how = "or have the pipeline copy it to the host: do.to_numpy(op).sync() (or await it)"
            else:
                how = f"or use the result inside the pipeline: op.map(lambda t: t.{name}...)"
            raise NotATensorError(
                f"{type(self).__name__} is an op (a description of GPU work that has not run), not a "
                f"Tensor, so it has no .{name}. Run it first to get its result (t = op.sync(), or "
                f"t = await op), {how}"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}", name=name, obj=self)

    @classmethod
    def __class_getitem__(cls, item):
        return cls

    cpdef object _run(self, ExecutionContext cx):
        """Enqueue this op's work on ``cx.stream`` and return its output (possibly in flight).

        Every concrete op overrides this.
        """
        raise UsageError(f"{type(self).__name__} does not define _run(); subclasses of DeviceOp must")

    cdef int take(self, str by) except -1:
        u = self._used
        if u is not None:
            if u is _SHAREABLE:
                return 0
            raise UsageError(
                f"{self!r} was already consumed by {self._used}; an op runs once. Build a new op "
                "for another run, or call .shared() on it to use one result in several places."
            )
        self._used = by
        return 0

    def _take(self, by):
        """Mark consumed by ``by``; raise UsageError if it already was."""
        self.take(by)

    def __repr__(self):
        return f"<{type(self).__name__}>"

    # -- combinators -----------------------------------------------------------------------
    def then(self, f):
        """Chain: ``f(output)`` returns the next op, which runs on the same stream after this one."""
        return _extend(self, _THEN, ".then()", f)

    def map(self, f):
        """Transform the output on the host with ``f(output)`` (runs when the op is enqueued)."""
        return _extend(self, _MAP, ".map()", f)

    def inspect(self, f):
        """Call ``f(output)`` for its side effect when the op is enqueued; pass the output on."""
        return _extend(self, _INSPECT, ".inspect()", f)

    def first(self):
        """The first element of a tuple output."""
        return _extend(self, _MAP, ".first()", _first)

    def last(self):
        """The last element of a tuple output."""
        return _extend(self, _MAP, ".last()", _last)

    def shared(self):
        """An op that executes this one once; every consumer gets the same output."""
        return Shared(self)

    # -- terminals -------------------------------------------------------------------------
    def sync(self):
        """Run on the next pool stream, wait for completion, return the output.

        Blocks the calling thread: on a thread running an event loop it raises
        :class:`UsageError` (await the op instead)."""
        refuse_on_loop(f"{self!r}.sync()")
        s = next_stream()
        self.take("sync()")
        return run_sync(self, s, "sync()")

    def sync_on(self, stream):
        """Run on ``stream``, wait for completion, return the output (refused on an event
        loop's thread, as :meth:`sync`)."""
        refuse_on_loop(f"{self!r}.sync_on()")
        s = as_stream(stream)
        self.take("sync_on()")
        return run_sync(self, s, "sync_on()")

    def __await__(self):
        """``await op``: run on the next pool stream; resume the task when the work is complete.

        Works under asyncio, uvloop and trio. The event loop is never blocked. Cancelling the
        task raises at once; the GPU work still completes and its buffers stay alive until it does.
        """
        return self.wait().__await__()

    def wait(self, timeout=None, stream=None):
        """``await op.wait(timeout=s, stream=st)``: ``await op`` with a timeout and a chosen stream.

        Raises ``TimeoutError`` if the work is not complete after ``timeout`` seconds (the work
        keeps running).
        """
        if n_recording:  # (the message only when it is raised: this runs on every await)
            refuse_in_capture(f"await {self!r}")
        # checked and consumed here, the coroutine made at once: every call on this path runs
        # cold after a long wait (the host's caches held other work meanwhile)
        if timeout is not None:
            timeout = check_timeout(timeout)
        s = as_stream(stream)
        self.take("await")
        return await_op(self, s, "await", timeout)

    cpdef tuple _start_sliced(self, object stream, str label, double seconds):
        """:func:`start_sliced` of this op (already consumed): how the await path, which lies
        below this module, starts it."""
        return start_sliced(self, stream, label, seconds)

    cdef object _run_group(self, ExecutionContext cx, list ops):
        """Run ``ops`` (this op first) as :class:`Each` does, as one piece of work, or return
        None to have each run on its own (this default). A kind of op that enqueues a batch of
        its own kind cheaper than one at a time overrides it (GEMMs: one graph for the batch)."""
        return None

    def graph(self, stream=None):
        """Record this op into a :class:`~deviceop.graph.CudaGraph` (nothing runs now).

        ``graph.launch()`` replays it and yields this op's output. Allocating ops and nested
        ``sync``/``await`` raise :class:`CaptureError`. ``stream``: record on this pool stream
        instead of a private one.
        """
        return capture(self, stream)

    def submit(self, stream=None):
        """Run on ``stream`` (default: the next pool stream) without waiting; return a future."""
        s = as_stream(stream)
        self.take("submit()")
        cx, out = start(self, s, "submit()")
        fut = DeviceFuture(cx, out)
        watch_future(s, cx.seal(), cx, fut)
        return fut


cdef class _Once:
    """The completion callbacks a shared op's source left on its first execution (a staging
    copy into the output array, a gather into it, a staging block's release): run once, by
    whichever execution consuming the output finishes first, each later one waiting until they
    have run. Every consumer's work completes after the source's (the same stream, or a wait on
    the event recorded after it), so any of them finishing may run them; each consumer's
    terminal returns only after its own finish, so none sees the output before it is filled."""

    cdef list cbs
    cdef object lock
    cdef object error

    def __call__(self):
        with self.lock:  # (a second finisher waits here until the first has filled the output)
            cbs, self.cbs = self.cbs, None
            if cbs is None:
                if self.error is not None:
                    raise self.error
                return
            first = run_all(cbs)
            if first is None:
                return
            # a failed fill fails every consumer; an interrupt is this thread's alone, and the
            # others learn that the output was not filled
            self.error = first if isinstance(first, Exception) else UsageError(
                "this shared op's output was not filled: the thread filling it was interrupted "
                f"({type(first).__name__}); build the op anew"
            )
            raise first


cdef _Once _take_callbacks(ExecutionContext cx, Py_ssize_t n0, Py_ssize_t c0):
    """The completion callbacks added to ``cx`` (past its first ``n0``) and to its children
    made meanwhile (past its first ``c0``), moved into one :class:`_Once` that takes their place
    on ``cx``; None where there are none."""
    cdef ExecutionContext child
    cdef list cbs = []
    if cx._done_cbs is not None and len(cx._done_cbs) > n0:
        cbs.extend(cx._done_cbs[n0:])
        del cx._done_cbs[n0:]
    todo = list(cx.children[c0:])
    while todo:
        child = todo.pop()
        if child._done_cbs:
            cbs.extend(child._done_cbs)
            child._done_cbs = None
        todo.extend(child.children)
    if not cbs:
        return None
    cdef _Once once = _Once.__new__(_Once)
    once.cbs = cbs
    once.lock = threading.RLock()
    if cx._done_cbs is None:
        cx._done_cbs = []
    cx._done_cbs.insert(n0, once)
    return once


class Shared(DeviceOp):
    """Runs its source once, under a lock, in the first consumer's execution.

    An event is recorded after that execution's work; consumers on other streams make their
    stream wait on it (never on a bare flag), consumers on the same stream are already ordered.
    What the source leaves for its execution's completion (a copy into a host array it
    returned) runs when the first of the consumers' executions finishes, before any of them
    returns the output. May be consumed any number of times.
    """

    __slots__ = ("_lock", "_src", "_state")

    def __init__(self, src):
        super().__init__()
        src._take(".shared()")
        self._used = _SHAREABLE  # every consumer may take it
        self._src = src
        self._lock = threading.Lock()
        self._state = None

    def __repr__(self):
        return f"<Shared {'done' if self._state else 'pending'}>"

    def _run(self, cx):
        with self._lock:
            st = self._state
            if st is None:
                src, self._src = self._src, None
                n0 = len(cx._done_cbs) if cx._done_cbs is not None else 0
                c0 = len(cx.children)
                try:
                    out = src._run(cx)
                except BaseException as e:
                    self._state = ("error", e)
                    raise
                if cx.capturing:  # its work exists only in the graph: no event to wait on outside it
                    self._state = ("captured", out, None, cx, None)
                    return out
                once = _take_callbacks(cx, n0, c0)
                ev = cx.backend.new_event()
                cx.stream.record(ev)
                self._state = ("ok", out, ev, cx.stream, once)
                return out
        if st[0] == "error":
            raise UsageError("this shared op failed in its first execution and has no output; build it anew") from st[1]
        kind, out, ev, stream, once = st
        if kind == "captured":
            if stream is not cx:  # (holds the recording's execution context)
                raise CaptureError(
                    "this shared op first ran inside a graph recording, so its output is computed "
                    "only by that graph's replays; consume it inside the same recording, or run it "
                    "(shared) before the scope"
                )
            return out
        if cx.capturing:
            # recording: the replay's ledger registration orders it after that work instead
            # (a recorded wait on an event from outside the recording is refused by the driver)
            return out
        if stream is not cx.stream:
            cx.stream.wait(ev)
        if once is not None:
            cx.on_done(once)  # (a no-op when it runs, where the first execution has run them)
        return out


def _first(x):
    return _pick(x, 0, "first")


def _last(x):
    return _pick(x, -1, "last")


cdef object _pick(x, int i, str name):
    if not isinstance(x, tuple) or not x:
        raise UsageError(f".{name}() needs an op whose output is a non-empty tuple, got {type(x).__name__}")
    return x[i]


def is_op(x):
    """True if ``x`` is a DeviceOp."""
    return isinstance(x, DeviceOp)


# ---- the hot combinators: value, and then / map / inspect chains ------------------------------

cdef class Value(DeviceOp):
    """An op whose output is a given Python value."""

    cdef readonly object x

    def __init__(self, x):
        self.x = x

    def __repr__(self):
        return f"<value {type(self.x).__name__}>"

    cpdef object _run(self, ExecutionContext cx):
        return self.x


def value(x):
    """An op that yields ``x``."""
    cdef Value v = Value.__new__(Value)
    v.x = x
    return v


cdef class Each(DeviceOp):
    """Several ops run in order as one execution, each keeping its own outcome: the output has
    ``(True, output)`` or ``(False, exception)`` per op, and one op's error does not stop the
    others (a work queue's batch: one completion event and one wait for many items)."""

    cdef readonly list ops

    def __init__(self, list ops):
        self.ops = ops

    def __repr__(self):
        return f"<{len(self.ops)} ops, each with its own outcome>"

    cpdef object _run(self, ExecutionContext cx):
        cdef list out
        cdef DeviceOp o
        if len(self.ops) > 1:
            out = (<DeviceOp?>self.ops[0])._run_group(cx, self.ops)
            if out is not None:
                return out
        out = []
        for o in self.ops:
            try:
                out.append((True, o._run(cx)))
            except Exception as e:  # this op's error; the others still run
                out.append((False, e))
        return out


cdef str _THEN = "then"
cdef str _MAP = "map"
cdef str _INSPECT = "inspect"
cdef dict _BY = {"then": ".then()", "map": ".map()", "inspect": ".inspect()"}
cdef dict _KIND = {"then": _THEN, "map": _MAP, "inspect": _INSPECT}


@cython.final
cdef class Chain(DeviceOp):
    """A source op and steps (then / map / inspect) run in order on one stream.

    A chain keeps its steps in a list and runs them in a loop, so a chain of thousands of
    ``then`` calls needs no recursion; extending a chain consumes it and takes over its list.
    """

    cdef readonly DeviceOp src
    cdef list steps  # kind, f, kind, f, ... (flat: no tuple made per step)

    def __repr__(self):
        # (a chain extended since has handed its steps over)
        return f"<Chain {self.src!r} + {len(self.steps or ()) // 2} steps>"

    @cython.boundscheck(False)
    @cython.wraparound(False)
    cpdef object _run(self, ExecutionContext cx):
        cdef list steps = self.steps
        cdef Py_ssize_t i
        out = self.src._run(cx)
        for i in range(0, len(steps), 2):
            out = _step(steps[i], steps[i + 1], out, cx)
        return out


cdef inline object _step(kind, f, out, ExecutionContext cx):
    """Run one step of a chain on ``out``: its output."""
    cdef DeviceOp op
    v = f(out)
    if kind is _THEN:
        if not isinstance(v, DeviceOp):
            _not_an_op(f, v)
        op = v
        op.take(".then()")
        return op._run(cx)
    if kind is _MAP:
        return v
    return out  # inspect: the output passes on


cdef object _not_an_op(f, v):
    raise UsageError(
        f"the function given to .then() ({getattr(f, '__qualname__', f)!r}) returned "
        f"{type(v).__name__}, not a DeviceOp; return an op (do.value(x) for a plain "
        "value) or use .map() for a host-side transform"
    )


cpdef Chain chain(DeviceOp op, str kind, f):
    """Append a step to ``op`` (consuming it); a chain extends its own step list."""
    by = _BY.get(kind)
    if by is None:
        raise UsageError(f"a chain step is then, map or inspect, not {kind!r}")
    return _extend(op, _KIND[kind], by, f)


cdef Chain _extend(DeviceOp op, str kind, str by, f):
    """:func:`chain` with ``kind`` one of the interned constants the step loop compares by
    identity, and ``by`` the combinator's name for errors."""
    cdef Chain c
    cdef list steps
    if not callable(f):
        raise UsageError(f"{by[:-1]}f) needs a function, got {type(f).__name__}")
    op.take(by)
    c = Chain.__new__(Chain)
    if type(op) is Chain:
        c.src = (<Chain>op).src
        steps = (<Chain>op).steps
        (<Chain>op).steps = None  # taken over: the consumed chain keeps no reference
    else:
        c.src = op
        steps = []
    steps.append(kind)
    steps.append(f)
    c.steps = steps
    return c


cdef extern from "<time.h>" nogil:
    """
    static double dvo_now(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
    }
    """
    double dvo_now()


@cython.final
cdef class Slices:
    """A chain's enqueue, in slices of host time, for an await that gives its event loop a turn
    between them (:func:`start_sliced`)."""

    cdef ExecutionContext cx
    cdef object stream
    cdef DeviceOp src  # the chain's source, None once enqueued
    cdef list steps
    cdef Py_ssize_t i
    cdef object out
    cdef readonly Py_ssize_t slices  # slices run so far (the first one by start_sliced)

    @property
    def output(self):
        """The chain's output, once :meth:`run` returned True."""
        return self.out

    def run(self, double seconds):
        """Enqueue the next steps for about ``seconds`` of host time (at least one step); True
        once every step is enqueued. A step that raises: what was enqueued completes before its
        buffers go (as for a whole enqueue), then the error is raised."""
        return self._until(dvo_now() + seconds)

    @cython.boundscheck(False)
    @cython.wraparound(False)
    cdef bint _until(self, double until) except -1:
        """Run the source (first) and the steps (Chain._run's loop) until the clock passes
        ``until`` after one of them; True when none is left."""
        cdef list steps = self.steps
        cdef Py_ssize_t n = len(steps)
        self.slices += 1
        _make_current(self.cx)  # (the loop's other tasks may have made another context current)
        try:
            if self.src is not None:
                self.out = self.src._run(self.cx)
                self.src = None
                # a source that used the slice (an upload and a model's first layers) ends it:
                # the loop's turn comes now, not one step later
                if n and dvo_now() >= until:
                    return False
            while self.i < n:
                self.i += 2
                self.out = _step(steps[self.i - 2], steps[self.i - 1], self.out, self.cx)
                if self.i < n and dvo_now() >= until:
                    return False
        except BaseException:
            _enqueue_failed(self.cx, self.stream)
            raise
        self.steps = None  # (the step functions go with the enqueue)
        return True


cpdef tuple start_sliced(DeviceOp op, object stream, str label, double seconds):
    """:func:`start` for an await that yields to its event loop while a long chain is enqueued:
    ``(execution, output, None)`` when the whole op was enqueued within about ``seconds`` of
    host time, else ``(execution, None, rest)``, where ``rest.run(seconds)`` (a
    :class:`Slices`) enqueues the following steps. A chain's source and each of its steps
    are enqueued whole, and a slice ends after whichever of them passes its time; ops that
    are not chains are enqueued at once."""
    cdef Slices sl
    if seconds <= 0 or type(op) is not Chain:
        cx, out = start(op, stream, label)
        return cx, out, None
    if n_recording:
        refuse_in_capture(f"{op!r}.{label}")
    t0 = dvo_now()
    sl = Slices.__new__(Slices)
    sl.cx = new_context(stream, label, op)
    sl.stream = stream
    sl.src = (<Chain>op).src
    sl.steps = (<Chain>op).steps
    (<Chain>op).steps = None  # handed over to the enqueue, as a chain extended hands its steps on
    if sl._until(t0 + seconds):
        return sl.cx, sl.out, None
    return sl.cx, None, sl


# ---- graph replays, and scoped recording with CudaGraph ------------------------------------------

include "_replay.pxi"
include "_graph.pxi"
