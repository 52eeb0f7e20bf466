# cython: language_level=3, annotation_typing=False
"""The watcher: where an execution goes when nobody waits for it any more.

An execution ends only by completing or by being handed to its stream's watcher, which finishes
it (drops its buffers, runs its completion callbacks, ends its ledger entries) once its work is
complete on the device. Whoever sees an entry complete first finishes it (:meth:`Watcher.reap`):
the thread that gives the stream more work, a thread asking a future, or the watcher's own
thread. Entries of one stream complete in stream order.

An entry may come with a grace period (a future submitted on a thread running an event loop,
which that loop most likely awaits): the watcher's thread neither waits for it nor finishes it
until the grace has passed, leaving it to the threads that ask or give, unless someone waiting
for it asks the thread to look (:meth:`Watcher.hurry`) or an entry without a grace is given
after it (stream order: watching that one means finishing those before it). A grace ends no
sooner than those of the entries before it. Finishing an execution on another thread than the
one that uses its results takes the interpreter's lock from that thread and leaves both with
cold caches, which costs more host CPU than the finishing itself. An allocation that finds the
device full does not wait for any of that (:func:`reclaim`): it finishes the executions of the
entries whose work completed at once, so that their blocks go back, and leaves the rest of
each entry (a future's completion, which may run the user's callbacks) where it was.

A fault is scoped by its kind (:func:`sticky`): a sticky error (the context is lost: an illegal
address, a launch failure, an assert) fails every execution of that device and retires every
completion slot armed on it (:func:`deviceop._core._reactor.fail_context`), since the device
will never write them; a non-sticky one is an error of one call and fails only the execution
that met it.

This module imports nothing above the core: what it finishes is any object with the execution
context's ``finish(ok)``; what it waits on is any object with ``query()`` and ``synchronize()``
(an event, or the stream itself where no event could be recorded).
"""

import queue
import threading
import time
from collections import deque

from .._errors import CudaError
from .._process import SERVICES, at_fork_child
from ._capture import CAPTURE
from ._reactor import fail_context

__all__ = ["Watcher", "give", "hand_over", "orphaned", "reclaim", "sticky", "stop_watchers", "watcher_for"]

# Driver errors after which the context can run nothing more (CUDA's "sticky" errors) and a few
# that leave the device unusable to this process; any other CudaError is an error of one call.
STICKY_CODES = frozenset({
    4,    # CUDA_ERROR_DEINITIALIZED
    214,  # CUDA_ERROR_ECC_UNCORRECTABLE
    700,  # CUDA_ERROR_ILLEGAL_ADDRESS
    702,  # CUDA_ERROR_LAUNCH_TIMEOUT
    709,  # CUDA_ERROR_CONTEXT_IS_DESTROYED
    710,  # CUDA_ERROR_ASSERT
    714,  # CUDA_ERROR_HARDWARE_STACK_ERROR
    715,  # CUDA_ERROR_ILLEGAL_INSTRUCTION
    716,  # CUDA_ERROR_MISALIGNED_ADDRESS
    717,  # CUDA_ERROR_INVALID_ADDRESS_SPACE
    718,  # CUDA_ERROR_INVALID_PC
    719,  # CUDA_ERROR_LAUNCH_FAILED
    999,  # CUDA_ERROR_UNKNOWN: nothing says the context survived
})


cpdef bint sticky(object err):
    """True if ``err`` (a :class:`~deviceop.CudaError`) leaves its context unable to run anything
    more; False for an error of one call."""
    return isinstance(err, CudaError) and getattr(err, "code", -1) in STICKY_CODES


cpdef int device_failed(object backend, object err) except -1:
    """A sticky ``err`` was seen on ``backend``: retire every completion slot armed on it and wake
    the awaits parked on them (they see the error by their re-check). A non-sticky error fails
    only its own execution: nothing else is touched."""
    if sticky(err):
        fail_context(backend)
    return 0


#: while a thread keeps giving a stream work, its watcher looks now and then instead of waking
#: at each completion (the giving thread completes what is done itself, see give): first after
#: _LOOK seconds, then twice as long after each look, up to _LOOK_MAX (each look takes the
#: interpreter's lock from that thread; a pool of streams has a watcher each)
cdef double _LOOK = 50e-6
cdef double _LOOK_MAX = 500e-6


cdef object _settle(list entry, object err):
    """An entry's work is done (``err``: why it failed): finish its execution, then call its
    ``then(err)``."""
    cx = entry[1]
    then = entry[2]
    if cx is not None:
        try:
            cx.finish(err is None)
        except BaseException as e:
            err = err or e
    if then is not None:
        try:
            then(err)
        except Exception:  # a completion callback's failure must not stop whoever completes it
            pass


cdef int _settle_all(object backend, list done) except -1:
    """Settle every ``(entry, err)`` of ``done``, taken off the watcher: an interrupt raised
    while settling one (a callback's ``KeyboardInterrupt``, a signal on this thread) is raised
    only once every other is settled too, none of them left unfinished and its future pending."""
    first = None
    for entry, err in done:
        try:
            if err is not None:
                device_failed(backend, err)
            _settle(entry, err)
        except BaseException as e:
            if first is None:
                first = e
    if first is not None:
        raise first
    return 0


class _Early:
    """An entry's execution finished ahead of its entry (:meth:`Watcher.reclaim`). Whoever
    settles the entry finishes the execution itself if nobody has begun to (the reclaiming
    thread was interrupted first), else waits until that finishing has ended (a staging copy
    into the results' array, say), and sees what it raised."""

    __slots__ = ("claim", "cx", "ended", "err", "owner")

    def __init__(self, cx):
        self.cx = cx
        self.err = None
        self.ended = threading.Event()
        self.claim = threading.Lock()  # taken, never given back, by the thread that finishes it
        self.owner = 0

    def run(self):
        """Finish the execution, unless another thread has begun to."""
        if not self.claim.acquire(False):
            return
        self.owner = threading.get_ident()
        try:
            self.cx.finish(True)
        except BaseException as e:
            self.err = e  # (the entry's callback sees it, as a settle's own finish() shows it)
            if not isinstance(e, Exception):
                raise  # (an interrupt reaches this thread as well)
        finally:
            self.cx = None
            self.ended.set()

    def busy_here(self):
        """This very thread is finishing it (a finaliser run by that finishing came back here)."""
        return self.owner == threading.get_ident() and not self.ended.is_set()

    def finish(self, ok):
        self.run()
        self.ended.wait()
        if self.err is not None:
            raise self.err


cdef inline bint _in_grace(list entry, double now, object eager):
    # given with a grace that has not passed, and nobody asked the watcher's thread to look
    return entry[3] > now and entry[4] > eager


class Watcher:
    """Finishes the executions given for one stream, in stream order.

    While work keeps being given, the thread looks now and then (50 µs doubling to 500 µs
    apart) rather than waking at each completion: each wake-up takes the interpreter's lock,
    which the giving thread then waits for at its next driver call. When no more work comes, it
    sleeps in the driver until the oldest entry completes (the events are made for blocking
    waits on cuda: no CPU while it waits), and when nothing is pending it waits to be given work.
    While the oldest entry is in its grace it waits for the grace to end (or for
    :meth:`hurry`, or an entry without a grace), and its looks stop at the first entry in one.
    """

    def __init__(self, stream):
        self.stream = stream
        self.pending = deque()
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.given = 0  # entries given so far: the thread tells a busy stream from a quiet one
        self.idle = False  # the thread waits for work: give() wakes it
        self.eager = 0  # the entries given up to this one are the thread's to look at, grace or not
        self.holding = 0.0  # the thread leaves a grace's entries alone until then: give() may wake it
        self.stopping = False
        threading.Thread(target=self._run, name=f"deviceop-watch-{getattr(stream, 'index', '?')}", daemon=True).start()

    def give(self, waitable, cx, then=None, double grace=0.0):
        """Finish ``cx`` and call ``then(err)`` once ``waitable`` (an event recorded after its work,
        or the stream) completes; what is complete already is finished first, on this thread.
        ``grace``: seconds during which the watcher's thread leaves the entry to others (see
        :meth:`hurry`). Returns the entry's number (for :meth:`hurry`)."""
        if self.pending:
            self.reap()
        cdef double until = time.monotonic() + grace if grace > 0 else 0.0
        with self.lock:
            self.given += 1
            if until and self.pending and self.pending[-1][3] > until:
                until = self.pending[-1][3]  # (no sooner than those before it: stream order)
            self.pending.append([waitable, cx, then, until, self.given])
            if not until:
                self.eager = self.given  # (its watch covers those before it: stream order)
            # a thread waiting out a grace looks again for an entry that wants a look sooner
            # (one without a grace; or with one ending sooner, the entry it waits for finished)
            wake = self.idle or (self.holding and (not until or until < self.holding))
            self.idle = False
            seq = self.given
        if wake:
            self.wake.set()
        return seq

    def hurry(self, seq):
        """A task waits for entry number ``seq`` (as :meth:`give` returned it) and looks for
        its completion only now and then (a parked await's re-check): the watcher's thread
        looks after it, and the entries before it, from now on, grace or not."""
        with self.lock:
            if seq <= self.eager:
                return
            self.eager = seq
            # (a thread holding for a later entry: the one asked for was finished meanwhile)
            wake = self.holding and self.pending and self.pending[0][4] <= seq
        if wake:
            self.wake.set()

    def reap(self, bint final=False, bint graced=False):
        """Finish, on the calling thread and in stream order, every entry whose work completed
        (a sticky error finishes them with it). Nothing on a thread that records a graph: a query
        there would end the recording. ``final``: the watcher's own thread, after a wait that
        failed: an error of one call that the stream's own query repeats ends the entry.
        ``graced``: the watcher's own thread, which stops at the first entry in its grace."""
        if CAPTURE.scope is not None:
            return
        done = []
        cdef double now = time.monotonic() if graced else 0.0
        try:
            with self.lock:
                while self.pending:
                    head = self.pending[0]
                    if graced and _in_grace(head, now, self.eager):
                        break
                    if type(head[1]) is _Early and head[1].busy_here():
                        break  # (settled later, once this thread has finished its execution)
                    err = None
                    try:
                        if not head[0].query():
                            break
                    except CudaError as e:
                        if not sticky(e):
                            if head[0] is not self.stream:
                                # the event itself failed (an error of that call): the stream's
                                # own completion bounds the work instead; never release it early
                                head[0] = self.stream
                                continue
                            if not final:
                                break  # (the watcher's thread decides, after waiting)
                        err = e
                    except Exception as e:  # (a closed device, say): never leave a waiter hanging
                        err = CudaError(f"waiting for work on {self.stream!r} failed: {e!r}")
                    done.append((self.pending.popleft(), err))
        finally:  # (what was taken is finished, whatever interrupted the look)
            _settle_all(self.stream.backend, done)

    def reclaim(self):
        """Finish now, on this thread, the executions of the entries whose work completed, in
        grace or not, so that their buffers go back to the cache; the rest of each entry (its
        ``then``: a future's completion, which may run the user's callbacks) stays for whoever
        finishes the entry. For an allocation that failed: it frees memory without running
        callbacks on a thread that is enqueueing work. Returns how many were finished."""
        if CAPTURE.scope is not None:
            return 0
        early = []
        # finished outside the lock: finishing drops objects whose finalisers may give this
        # stream work. One marked and not run (an interrupt) is run by whoever settles its entry
        try:
            with self.lock:
                for entry in self.pending:
                    try:
                        if not entry[0].query():
                            break  # (stream order: nothing after it has completed either)
                    except Exception:
                        break  # (an error of the work: reap() finishes the entry with it)
                    cx = entry[1]
                    if cx is not None and type(cx) is not _Early:
                        e = _Early(cx)
                        entry[1] = e
                        early.append(e)
        finally:
            for e in early:
                e.run()
        return len(early)

    def stop(self):
        """End the thread once what it was given is finished."""
        with self.lock:
            self.stopping = True
            wake, self.idle = self.idle or self.holding, False
        if wake:
            self.wake.set()

    def _run(self):
        try:
            self.stream.backend.make_current()
        except Exception:  # (events are waited on in any context; the work's own errors show there)
            pass
        cdef double grace = 0.0, now
        seen = 0
        look = _LOOK
        while True:
            try:
                with self.lock:
                    head = self.pending[0] if self.pending else None
                    given = self.given
                    if head is None and (given == seen or self.stopping):
                        if self.stopping:
                            return
                        self.idle = True
                if head is None and given == seen:
                    self.wake.wait()
                    self.wake.clear()
                    seen = self.given  # woken by one entry: wait for it in the driver at once
                    look = _LOOK
                    continue
                if head is not None and head[3]:
                    with self.lock:
                        head = self.pending[0] if self.pending else None
                        grace = 0.0
                        now = time.monotonic()
                        if head is not None and not self.stopping and _in_grace(head, now, self.eager):
                            grace = head[3] - now
                            self.holding = head[3]
                    if head is None:
                        continue
                    if grace > 0:
                        # the oldest entry is left to the threads that use its results for now
                        # (give, hurry and stop wake this thread early); not held meanwhile:
                        # once they finish it, what it references goes with it
                        seen = given
                        head = None
                        self.wake.wait(grace)
                        self.wake.clear()
                        with self.lock:
                            self.holding = 0.0
                        continue
                if head is None or given != seen:
                    seen = given
                    head = None
                    time.sleep(look)  # work is being given: its giver finishes what is done
                    look = min(2 * look, _LOOK_MAX)
                else:
                    look = _LOOK
                    try:
                        head[0].synchronize()  # nothing more given since the last look
                    except Exception:
                        # the wait failed: reap() finishes the entry with the error
                        self.reap(True, not self.stopping)
                        continue
                head = None
                self.reap(False, not self.stopping)  # (stopping: graces end)
            except BaseException:  # pragma: no cover - defensive: never leave a waiter hanging
                time.sleep(_LOOK)


_watchers = {}
_wlock = threading.Lock()


def watcher_for(stream):
    """The watcher of ``stream`` (started on first use)."""
    w = _watchers.get(id(stream))
    if w is None or w.stream is not stream:
        with _wlock:
            w = _watchers.get(id(stream))
            if w is None or w.stream is not stream:
                w = _watchers[id(stream)] = Watcher(stream)
    return w


cpdef int hand_over(object cx, object stream, object ev=None) except -1:
    """Its terminal stops waiting while the work may still run (an interrupt, a cancelled or
    timed-out await, a failed enqueue): the stream's watcher finishes the execution once the
    work is really done, so its buffers and ledger entries hold until then. ``ev``: its
    completion event if one was recorded (by default the one it was sealed with); otherwise one
    is recorded now (after the work enqueued so far: this execution's, perhaps later work too).
    Never blocks."""
    if not cx.done:
        if ev is None and cx._sealed:
            ev = cx._event
        give(stream, cx, ev)
    return 0


cpdef object give(object stream, object cx, object ev=None, object then=None):
    """Hand execution ``cx`` (None: only ``then``) to ``stream``'s watcher: once its work is
    complete, it is finished and ``then(err)`` called. ``ev``: an event recorded after its work;
    where None, one is recorded now (after the work enqueued on the stream so far); where that
    fails, the stream's own completion stands for it. Returns the watcher."""
    w = watcher_for(stream)
    if ev is None:
        try:
            ev = cx.seal() if cx is not None else stream
        except CudaError as e:
            if sticky(e):  # the context is lost: nothing of it runs any more
                device_failed(stream.backend, e)
                _settle([None, cx, then], e)
                return w
            ev = stream
    w.give(ev, cx, then)
    return w


# Executions dropped unfinished, queued by their finaliser (which may run on any thread, holding
# any lock, or while that thread records a graph: it only puts them here); the janitor thread
# records each one's event and hands it to its stream's watcher.
_orphans = queue.SimpleQueue()


cpdef int orphaned(object cx) except -1:
    """Queue ``cx``, dropped unfinished, for its stream's watcher (safe in a finaliser)."""
    _orphans.put(cx)
    return 0


def _janitor():
    while True:
        cx = _orphans.get()
        try:
            if not cx.done:
                cx.backend.make_current()
                hand_over(cx, cx.stream)
        except BaseException:
            pass  # (a device that cannot record any more: nothing to wait for there)
        cx = None


def _start_janitor():
    threading.Thread(target=_janitor, name="deviceop-janitor", daemon=True).start()


_start_janitor()


def reclaim(backend):
    """Finish the completed executions that ``backend``'s watchers hold, leaving their entries'
    callbacks to whoever finishes the entries (:meth:`Watcher.reclaim`); returns how many. An
    allocation that failed calls it before it tries again."""
    with _wlock:
        mine = [w for w in _watchers.values() if w.stream.backend is backend]
    return sum([w.reclaim() for w in mine])


def stop_watchers(backend):
    """``backend`` runs nothing more: its watchers end once what they were given is finished."""
    with _wlock:
        for key, w in list(_watchers.items()):
            if w.stream.backend is backend:
                del _watchers[key]
                w.stop()


def _after_fork_in_child():
    global _wlock, _orphans
    _wlock = threading.Lock()  # the watcher threads are the parent's: the child starts its own
    _watchers.clear()
    _orphans = queue.SimpleQueue()  # (the parent's executions never complete here)
    _start_janitor()


at_fork_child(_after_fork_in_child, SERVICES)
