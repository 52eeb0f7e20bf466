"""DeviceFuture: the result of ``op.submit()``, completed by whoever sees its work done first (the
submitting thread, a thread asking it, or its stream's watcher thread)."""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine, Generator
from typing import Any, Generic, TypeVar

from .._core._ledger import on_abandon
from .._core._op import HOOKS as CORE_HOOKS
from .._core._op import refuse_in_capture
from .._errors import CudaError

__all__ = ["DeviceFuture"]

T = TypeVar("T")

_PENDING = object()

#: set by _await when imported: "await_future" (it imports this module, not the reverse)
HOOKS: dict[str, Any] = {}


class DeviceFuture(Generic[T]):
    """A thread-safe handle on submitted GPU work.

    ``done()`` says whether it completed; ``result(timeout)`` waits (raising ``TimeoutError`` if
    it did not complete in time) and returns the op's output, or raises its error (a
    :class:`CudaError` if the device failed). Dropping a future does not cancel or free
    anything early: the work runs to completion and its buffers stay alive until then.
    """

    __slots__ = ("_callbacks", "_cx", "_done_event", "_error", "_event", "_lock", "_value", "_watcher")

    def __init__(self, cx: Any, value: Any) -> None:
        self._cx = cx
        self._value = value
        self._error: BaseException | None = None
        self._event = threading.Event()
        self._callbacks: list[Callable[[DeviceFuture[T]], Any]] = []
        self._lock = threading.Lock()
        self._watcher: _Watcher | None = None  # the stream's watcher, once the work is given to it
        self._done_event: Any = None  # the work's completion event (recorded on its stream)

    def done(self) -> bool:
        """True once the work has completed (successfully or not). Work seen complete here is
        completed on the calling thread (its callbacks run there)."""
        w = self._watcher
        if w is not None and not self._event.is_set():
            w.reap()
        return self._event.is_set()

    def result(self, timeout: float | None = None) -> T:
        """Wait for completion and return the output; raise its error if it failed. Without a
        timeout the calling thread sleeps in the driver until the work completes and
        completes it itself."""
        if not self._wait(timeout):
            raise TimeoutError(
                f"submitted work ({self._cx.describe()}) did not complete within {timeout} s; "
                "it keeps running: call result() again to keep waiting"
            )
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[no-any-return]

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait for completion and return the error, or None if it succeeded."""
        if not self._wait(timeout):
            raise TimeoutError(f"submitted work did not complete within {timeout} s")
        return self._error

    def _wait(self, timeout: float | None) -> bool:
        """Wait for completion; False if ``timeout`` passed first."""
        if self._event.is_set():
            return True
        refuse_in_capture("DeviceFuture.result()")
        w, ev = self._watcher, self._done_event
        if timeout is None and w is not None and ev is not None:
            try:
                ev.synchronize()  # (the local reference keeps the event's handle from reuse)
            except Exception:
                pass  # reap() completes the future with the error
            w.reap()
        return self._event.wait(timeout)

    def add_done_callback(self, fn: Callable[[DeviceFuture[T]], Any]) -> None:
        """Call ``fn(self)`` on completion (at once if already complete), on the completing thread."""
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
        return HOOKS["await_future"](self, timeout)  # type: ignore[no-any-return]

    def _complete(self, error: BaseException | None) -> None:
        if error is not None:
            self._error = error
            self._value = None
        self._done_event = self._watcher = None  # (the event's handle is reused once it goes)
        with self._lock:
            self._event.set()
            cbs, self._callbacks = self._callbacks, []
        for fn in cbs:
            try:
                fn(self)
            except Exception:  # a callback's failure must not stop the thread completing it
                pass

    def __repr__(self) -> str:
        state = "done" if self._event.is_set() else "pending"
        return f"<DeviceFuture {self._cx.describe()} {state}>"


#: while a thread keeps giving a stream work, its watcher looks now and then instead of waking
#: at each completion (the giving thread completes what is done itself, see give): first after
#: _LOOK seconds, then twice as long after each look, up to _LOOK_MAX (each look takes the
#: interpreter's lock from that thread; a pool of streams has a watcher each)
_LOOK = 50e-6
_LOOK_MAX = 500e-6


def _settle(entry: tuple[Any, Any, Any, Any], err: BaseException | None) -> None:
    """An entry's work is done (``err``: why it failed): finish its execution, complete its
    future, call its ``then``."""
    _ev, cx, fut, then = entry
    if cx is not None:
        try:
            cx.finish(ok=err is None)
        except BaseException as e:
            err = err or e
    if fut is not None:
        fut._complete(err)
    if then is not None:
        try:
            then()
        except Exception:  # a wake-up's failure must not stop whoever completes it
            pass


class _Watcher:
    """Completes the work given for one stream, in stream order (executions on one stream
    complete in the order they were enqueued).

    Whoever sees an entry's event complete first completes it (:meth:`reap`): the thread that
    gives the stream more work (``submit``), a thread asking a future (``done``, ``result``),
    or this watcher's thread. While work keeps being given, the watcher looks now and then
    (:data:`_LOOK` to :data:`_LOOK_MAX` seconds apart) rather than waking at each completion:
    each wake-up takes the interpreter's lock, which the giving thread then waits for at its
    next driver call. When no more work comes, it sleeps in the driver until the oldest
    entry's event completes (the events are BLOCKING_SYNC on cuda: no CPU while it waits), and
    when nothing is pending it waits to be given work.
    """

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.pending: deque[tuple[Any, Any, Any, Any]] = deque()
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.given = 0  # entries given so far: the watcher tells a busy stream from a quiet one
        self.idle = False  # the watcher waits for work: give() wakes it
        self.stopping = False
        threading.Thread(target=self._run, name=f"deviceop-watch-{stream.index}", daemon=True).start()

    def give(self, entry: tuple[Any, Any, Any, Any]) -> None:
        """Watch ``entry`` (event, execution, future, then); what is done already is completed
        first, on the calling thread."""
        if self.pending:
            self.reap()
        with self.lock:
            self.pending.append(entry)
            self.given += 1
            wake, self.idle = self.idle, False
        if wake:
            self.wake.set()

    def reap(self) -> None:
        """Complete, on the calling thread and in stream order, every entry whose event has
        completed (a failed context completes them with its error)."""
        done: list[tuple[tuple[Any, Any, Any, Any], BaseException | None]] = []
        try:
            with self.lock:
                while self.pending:
                    err: BaseException | None = None
                    try:
                        if not self.pending[0][0].query():
                            break
                    except CudaError as e:
                        err = e
                    except Exception as e:  # (a closed device, say): never leave a future hanging
                        err = CudaError(f"waiting for work on {self.stream!r} failed: {e!r}")
                    done.append((self.pending.popleft(), err))
        finally:  # (what was taken is completed, whatever interrupted the look)
            for entry, err in done:
                _settle(entry, err)

    def stop(self) -> None:
        """End the thread once what it was given is done."""
        with self.lock:
            self.stopping = True
            wake, self.idle = self.idle, False
        if wake:
            self.wake.set()

    def _run(self) -> None:
        try:
            self.stream.backend.make_current()
        except Exception:  # (events are waited on in any context; the work's own errors show there)
            pass
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
                if head is None or given != seen:
                    seen = given
                    time.sleep(look)  # work is being given: its giver completes what is done
                    look = min(2 * look, _LOOK_MAX)
                else:
                    look = _LOOK
                    try:
                        head[0].synchronize()  # nothing more given since the last look
                    except Exception:
                        pass  # reap() completes the entry with the error
                self.reap()
            except BaseException:  # pragma: no cover - defensive: never leave a future hanging
                time.sleep(_LOOK)


_watchers: dict[int, _Watcher] = {}
_wlock = threading.Lock()


def watch(
    stream: Any,
    event: Any,
    cx: Any = None,
    fut: DeviceFuture[Any] | None = None,
    then: Callable[[], Any] | None = None,
) -> None:
    """Once ``event`` (recorded on ``stream``) completes: finish ``cx``, complete ``fut``, call ``then()``.

    Also used to hand over an execution whose awaiting task was cancelled: its buffers stay
    alive and its ledger entries stay until the GPU work is really done.
    """
    w = _watchers.get(id(stream))
    if w is None or w.stream is not stream:
        with _wlock:
            w = _watchers.get(id(stream))
            if w is None or w.stream is not stream:
                w = _watchers[id(stream)] = _Watcher(stream)
    if fut is not None:
        fut._watcher, fut._done_event = w, event
    w.give((event, cx, fut, then))


def _stop_watchers(backend: Any) -> None:
    """``backend`` runs nothing more: its watchers end once what they were given is done."""
    with _wlock:
        for key, w in list(_watchers.items()):
            if w.stream.backend is backend:
                del _watchers[key]
                w.stop()


on_abandon(_stop_watchers)


def _after_fork_in_child() -> None:
    global _wlock
    _wlock = threading.Lock()  # the watcher threads are the parent's: the child starts its own
    _watchers.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


CORE_HOOKS["watch"] = watch  # the sync terminals hand interrupted executions to the watchers
