"""DeviceFuture: the result of ``op.submit()``, completed by whoever sees its work done first (the
submitting thread, a thread asking it, or its stream's watcher thread)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Coroutine, Generator
from typing import Any, Generic, TypeVar

from .._errors import BackendError, UsageError
from ._completion import await_future
from ._guards import check_timeout, loop_here, refuse_in_capture, refuse_on_loop
from ._ledger import lost
from ._watch import Watcher, watcher_for

__all__ = ["DeviceFuture"]

T = TypeVar("T")

_PENDING = object()


class DeviceFuture(Generic[T]):
    """A thread-safe handle on submitted GPU work.

    ``done()`` says whether it completed; ``result(timeout)`` waits (raising ``TimeoutError`` if
    it did not complete in time) and returns the op's output, or raises its error (a
    :class:`CudaError` if the device failed). Dropping a future does not cancel or free
    anything early: the work runs to completion and its buffers stay alive until then.

    It is not a :class:`concurrent.futures.Future` (``concurrent.futures.wait`` and
    ``asyncio.wrap_future`` do not take it, and it has no ``cancel()``: work on the GPU cannot be
    cancelled): ``await`` it in an event loop (asyncio, uvloop, trio), call ``result()`` in a
    thread, or give ``add_done_callback`` a function.
    """

    __slots__ = ("_callbacks", "_cx", "_done_event", "_error", "_event", "_lock", "_seq", "_value", "_watcher")

    def __init__(self, cx: Any, value: Any) -> None:
        self._cx = cx
        self._value = value
        self._error: BaseException | None = None
        self._event = threading.Event()
        self._callbacks: list[Callable[[DeviceFuture[T]], Any]] = []
        self._lock = threading.Lock()
        self._watcher: Watcher | None = None  # the stream's watcher, once the work is given to it
        self._done_event: Any = None  # the work's completion event (recorded on its stream)
        self._seq = 0  # its entry's number with the watcher (see watch_future)

    def done(self) -> bool:
        """True once the work has completed (successfully or not). Work seen complete here is
        completed on the calling thread (its callbacks run there)."""
        w = self._watcher
        if w is not None and not self._event.is_set() and lost(self._cx.backend) is None:
            w.reap()  # (not for the parent's work in a child made by fork(): its watcher is gone)
        return self._event.is_set()

    def result(self, timeout: float | None = None) -> T:
        """Wait for completion and return the output; raise its error if it failed. Without a
        timeout the calling thread sleeps in the driver until the work completes and
        completes it itself. ``timeout``: None or a finite number of seconds >= 0 (0: do not
        wait). A wait on a thread that runs an event loop raises :class:`UsageError` (await the
        future instead); ``result(0)`` and the result of a done future never wait."""
        if not self._wait(timeout, "result"):
            raise TimeoutError(
                f"submitted work ({self._cx.describe()}) did not complete within {timeout} s; "
                "it keeps running: call result() again to keep waiting"
            )
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[no-any-return]

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait for completion and return the error, or None if it succeeded (``timeout`` and
        event loops as for :meth:`result`)."""
        if not self._wait(timeout, "exception"):
            raise TimeoutError(
                f"submitted work ({self._cx.describe()}) did not complete within {timeout} s; "
                "it keeps running: call exception() again to keep waiting"
            )
        return self._error

    def _wait(self, timeout: float | None, what: str) -> bool:
        """Wait for completion; False if ``timeout`` passed first."""
        timeout = check_timeout(timeout)
        if self._event.is_set():
            return True
        self._check_device()
        refuse_in_capture(f"DeviceFuture.{what}()")  # (before done(): a query would end a recording)
        if self.done():
            return True
        if timeout == 0:
            return False
        refuse_on_loop(f"DeviceFuture.{what}()")
        # the execution's blocking wait (its event), then whoever sees it complete first
        # finishes it: this thread, unless the watcher's thread is doing so right now
        if not self._cx.wait_completed(timeout):
            return self.done()
        w = self._watcher
        if w is not None:
            w.reap()
        return self._event.wait(timeout)

    def _check_device(self) -> None:
        """BackendError if the work will never complete in this process (its device is the
        parent's, in a process made by fork())."""
        why = lost(self._cx.backend)
        if why is not None:
            raise BackendError(f"this future's work ({self._cx.describe()}) will not complete here: {why}")

    def add_done_callback(self, fn: Callable[[DeviceFuture[T]], Any]) -> None:
        """Call ``fn(self)`` on completion (at once if already complete), on the completing thread.
        A future submitted on an event loop's thread is left to that loop for 50 ms: not awaited
        there, it is completed by its stream's watcher thread when its work is done, or 50 ms
        after its submission if that is later (see the ops page)."""
        if not callable(fn):
            raise UsageError(f"add_done_callback(fn) needs a callable, got {type(fn).__name__}")
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def __await__(self) -> Generator[Any, None, T]:
        """``await future``: resume when the work is complete (asyncio, uvloop, trio); never blocks the loop."""
        return self.wait().__await__()

    def wait(self, timeout: float | None = None) -> Coroutine[Any, Any, T]:
        """``await future.wait(timeout=s)``: raise ``TimeoutError`` if not complete in time (the work keeps running)."""
        refuse_in_capture("await DeviceFuture")
        if not self._event.is_set():
            self._check_device()
        return await_future(self, timeout, self._hurry)

    def _hurry(self) -> None:
        """A task parks until the future completes: the watcher's thread completes it as soon
        as its work is done, grace period or not (see watch_future)."""
        w = self._watcher
        if w is not None:
            w.hurry(self._seq)

    def _complete(self, error: BaseException | None) -> None:
        """The work completed (``error``: why it failed); called once, by whoever saw it."""
        if error is not None:
            self._error = error
            self._value = None
        self._done_event = self._watcher = None  # (the event's handle is reused once it goes)
        with self._lock:
            self._event.set()
            cbs, self._callbacks = self._callbacks, []
        interrupt = None
        for fn in cbs:
            try:
                fn(self)
            except Exception:  # a callback's failure must not stop the thread completing it
                pass
            except BaseException as e:  # (an interrupt: raised once every callback has run)
                if interrupt is None:
                    interrupt = e
        if interrupt is not None:
            raise interrupt

    def __repr__(self) -> str:
        state = "done" if self._event.is_set() else "pending"
        return f"<DeviceFuture {self._cx.describe()} {state}>"


#: how long the stream's watcher thread leaves a future submitted on an event loop's thread to
#: that loop (which finishes it when it awaits the future, or gives the stream more work)
GRACE = 0.05


def watch_future(stream: Any, event: Any, cx: Any, fut: DeviceFuture[Any]) -> None:
    """Complete ``fut`` once ``event`` (recorded on ``stream`` after ``cx``'s work) completes:
    ``cx`` is finished by the stream's watcher, or by whoever sees the event complete first.

    Submitted on a thread running an event loop, the future is most likely awaited there: the
    watcher's thread leaves it to that loop for :data:`GRACE` seconds (an await that parks asks
    it to look at once), so that the loop that uses the results also finishes the work, rather
    than a thread that must take the interpreter's lock from it to do so."""
    fut._done_event = event
    fut._watcher = w = watcher_for(stream)
    # (a number, not the entry: the future may be completed before it is stored, and the entry
    # holds the future's completion, which holds the future)
    fut._seq = w.give(event, cx, fut._complete, GRACE if loop_here() is not None else 0.0)
