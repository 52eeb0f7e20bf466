"""Per-thread recording state, and destruction deferred while a thread records a graph.

The driver's thread-local capture mode invalidates a recording when the recording thread calls
something that is not stream-ordered, and destroying an executable graph, a graph, an event or
freeing memory are such calls. Python runs destructors wherever a last reference drops, so
while this thread records, those calls are queued and run when the recording ends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .._process import CORE, renew_at_fork
from ._base import count_recording

__all__ = ["CAPTURE", "StreamPool", "begin", "end", "flush", "release"]


class _CaptureState(threading.local):
    """The graph scope recording on this thread (class default: none) and deferred releases."""

    scope: Any = None
    deferred: list[tuple[Callable[..., Any], tuple[Any, ...]]] | None = None


CAPTURE = _CaptureState()

_count_lock = threading.Lock()
renew_at_fork(globals(), CORE, _count_lock=threading.Lock)  # a thread may hold it at fork()


def begin(scope: Any) -> None:
    """Mark ``scope`` as recording on this thread."""
    with _count_lock:
        count_recording(1)  # (the compiled terminals read the count: while 0, nothing records)
    CAPTURE.scope = scope


def end() -> None:
    """End this thread's recording (after :func:`begin`)."""
    CAPTURE.scope = None
    with _count_lock:
        count_recording(-1)


def release(fn: Callable[..., Any], *args: Any) -> None:
    """Call ``fn(*args)`` now, or when this thread's recording ends if it is recording."""
    if CAPTURE.scope is None:
        fn(*args)
        return
    if CAPTURE.deferred is None:
        CAPTURE.deferred = []
    CAPTURE.deferred.append((fn, args))


def flush() -> None:
    """Run the releases deferred during this thread's recording (call after it ends)."""
    items, CAPTURE.deferred = CAPTURE.deferred, None
    for fn, args in items or ():
        try:
            fn(*args)
        except Exception:
            pass  # best effort, as in the destructors they come from


class StreamPool:
    """Private streams for recordings: no other code enqueues on them, so nothing slips in."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._free: list[Any] = []
        self._lock = threading.Lock()

    def acquire(self) -> Any:
        with self._lock:
            if self._free:
                return self._free.pop()
        return self._make()

    def release(self, stream: Any) -> None:
        with self._lock:
            self._free.append(stream)
