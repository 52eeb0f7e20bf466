"""DeviceFuture: the result of ``op.submit()``, completed by a per-stream watcher thread."""

from __future__ import annotations

import os
import queue
import threading
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

    __slots__ = ("_callbacks", "_cx", "_error", "_event", "_lock", "_value")

    def __init__(self, cx: Any, value: Any) -> None:
        self._cx = cx
        self._value = value
        self._error: BaseException | None = None
        self._event = threading.Event()
        self._callbacks: list[Callable[[DeviceFuture[T]], Any]] = []
        self._lock = threading.Lock()

    def done(self) -> bool:
        """True once the work has completed (successfully or not)."""
        return self._event.is_set()

    def result(self, timeout: float | None = None) -> T:
        """Wait for completion and return the output; raise its error if it failed."""
        if not self._event.is_set():
            refuse_in_capture("DeviceFuture.result()")
        if not self._event.wait(timeout):
            raise TimeoutError(
                f"submitted work ({self._cx.describe()}) did not complete within {timeout} s; "
                "it keeps running: call result() again to keep waiting"
            )
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[no-any-return]

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait for completion and return the error, or None if it succeeded."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"submitted work did not complete within {timeout} s")
        return self._error

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
        with self._lock:
            self._event.set()
            cbs, self._callbacks = self._callbacks, []
        for fn in cbs:
            try:
                fn(self)
            except Exception:  # a callback's failure must not stop the watcher
                pass

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<DeviceFuture {self._cx.describe()} {state}>"


class _Watcher:
    """One thread per stream: waits on each sealed execution's event in stream order.

    Executions on one stream complete in submission order, so waiting FIFO is exact. The
    events are BLOCKING_SYNC on cuda: the thread sleeps in the driver, costing no CPU.
    """

    def __init__(self, stream: Any) -> None:
        self.q: queue.SimpleQueue[tuple[Any, Any, Any, Any]] = queue.SimpleQueue()
        self.stream = stream
        threading.Thread(target=self._run, name=f"deviceop-watch-{stream.index}", daemon=True).start()

    def _run(self) -> None:
        self.stream.backend.make_current()
        while True:
            ev, cx, fut, then = self.q.get()
            if ev is None:
                return
            err: BaseException | None = None
            try:
                ev.synchronize()
            except CudaError as e:
                err = e
            except BaseException as e:  # pragma: no cover - defensive: never leave a future hanging
                err = CudaError(f"waiting for {cx.describe() if cx else 'stream work'} failed: {e!r}")
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
                except Exception:  # a wake-up's failure must not stop the watcher
                    pass
            ev = cx = fut = then = None


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
    w.q.put((event, cx, fut, then))


def _stop_watchers(backend: Any) -> None:
    """``backend`` runs nothing more: its watchers end once what they were given is done."""
    with _wlock:
        for key, w in list(_watchers.items()):
            if w.stream.backend is backend:
                del _watchers[key]
                w.q.put((None, None, None, None))


on_abandon(_stop_watchers)


def _after_fork_in_child() -> None:
    global _wlock
    _wlock = threading.Lock()  # the watcher threads are the parent's: the child starts its own
    _watchers.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


CORE_HOOKS["watch"] = watch  # the sync terminals hand interrupted executions to the watchers
