"""The optional native module (``deviceop._native``): which of its paths are on.

Built by ``pip install`` where a C compiler exists. Without it, or with ``DEVICEOP_NATIVE=0``,
launches go through cuda.bindings and await wake-ups through a watcher thread; behaviour is
the same, only slower.
"""

from __future__ import annotations

import os
from typing import Any

try:
    from .. import _native as native
except ImportError:  # no compiler at install time: the pure-Python paths serve
    native = None

__all__ = [
    "native", "LAUNCH", "LAUNCH_HELD", "RUN_PLANNED", "PLANNED", "DRIVER", "REPLAY", "enable_driver", "available",
    "steps", "make_lock", "maker", "Channel",
]

#: [native launch function or None]; read on the launch path, set once the driver is loaded
LAUNCH: list[Any] = [None]
#: [native "launch if the execution already holds every region" or None]
LAUNCH_HELD: list[Any] = [None]
#: [native "planned elementwise launch in one call" or None]
RUN_PLANNED: list[Any] = [None]
#: [the op type the native step loop may launch directly]: set by kernels._elementwise
PLANNED: list[Any] = [type(None)]
#: [True once cuLaunchHostFunc can be called natively]
NOTIFY: list[bool] = [False]
#: [the native module once its driver entry points are bound, else None]: held_all, lt_matmul,
#: graph_launch, event_record, event_query
DRIVER: list[Any] = [None]
#: [True while graph launches' sync terminals replay in one native call (_native.ReplayBase), else None]
REPLAY: list[Any] = [None]


def available() -> bool:
    """True if the native module is built and not disabled by ``DEVICEOP_NATIVE=0``."""
    return native is not None and os.environ.get("DEVICEOP_NATIVE", "1") != "0"


def make_lock() -> Any:
    """The ledger's lock: the native Lock (native launches take it without a method call) or threading.Lock."""
    if available():
        lock = native.Lock()
        native.set_lock(lock)
        return lock
    import threading

    return threading.Lock()


def maker(cls: type, args: tuple[str, ...], proto: Any) -> Any:
    """A native factory of ``cls`` objects (slots ``args`` from the call, the rest as in ``proto``), or None.

    ``proto`` is an instance built by ``cls.__init__``, so the defaults have one source; an
    empty list in it becomes a fresh empty list per object.
    """
    if not available():
        return None
    slots = [n for c in cls.__mro__ for n in getattr(c, "__slots__", ()) if n != "__weakref__"]
    fixed = tuple((n, getattr(proto, n)) for n in slots if n not in args and hasattr(proto, n))
    return native.Maker(cls, args, fixed)


def steps() -> Any:
    """The native step loop of then/map chains (needs no driver), or None."""
    return native.run_steps if available() else None


def enable_driver() -> bool:
    """Bind the native launch/host-function paths to the libcuda cuda.bindings loaded."""
    if not available() or not native.load_driver():
        LAUNCH[0] = LAUNCH_HELD[0] = RUN_PLANNED[0] = DRIVER[0] = REPLAY[0] = None
        NOTIFY[0] = False
        return False
    from ..executors._context import context_maker
    from . import _ledger
    from ._capture import CAPTURE, RECORDING
    from ._cuda import CudaStream, cuda_error
    from ._select import next_stream

    native.set_lock(_ledger.LOCK)
    native.set_replay(
        context_maker(), CAPTURE, RECORDING, CudaStream, _ledger.touch, _ledger.ENABLED, cuda_error, next_stream, REPLAY
    )
    REPLAY[0] = True
    LAUNCH[0] = native.launch
    LAUNCH_HELD[0] = native.launch_held
    RUN_PLANNED[0] = native.run_planned
    DRIVER[0] = native
    NOTIFY[0] = True
    return True


class _PyChannel:
    """The pure-Python twin of ``_native.Channel``: a token queue plus a wake-up fd."""

    def __init__(self) -> None:
        import threading

        self._lock = threading.Lock()
        self._q: list[int] = []
        if hasattr(os, "eventfd"):
            self._r = self._w = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        else:  # pragma: no cover - not Linux
            self._r, self._w = os.pipe()
            os.set_blocking(self._r, False)
            os.set_blocking(self._w, False)

    def fileno(self) -> int:
        return self._r

    def push(self, token: int) -> None:
        with self._lock:
            self._q.append(token)
            if len(self._q) == 1:
                try:
                    os.write(self._w, (1).to_bytes(8, "little"))
                except BlockingIOError:
                    pass  # the counter is already set: the reader wakes anyway

    def drain(self) -> list[int]:
        try:  # reset the fd before taking the queue, so a racing push is never lost
            while os.read(self._r, 64) and self._r != self._w:
                pass
        except BlockingIOError:
            pass
        with self._lock:
            q, self._q = self._q, []
        return q

    def __del__(self) -> None:
        for fd in {self._r, self._w}:
            try:
                os.close(fd)
            except OSError:
                pass


def Channel() -> Any:
    """A wake-up channel: native where built, else the Python twin."""
    if available():
        return native.Channel()
    return _PyChannel()
