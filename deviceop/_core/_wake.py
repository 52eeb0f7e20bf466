"""Wake-ups for parked awaits: one channel per event loop.

An await registers a token with its loop's dispatcher and arms a completion slot with the
channel (``deviceop._core._reactor``): the reactor's scanner thread pushes the token once the
GPU has written the slot's flag, writing the channel's eventfd once per batch. (Where no slot
is free, the stream's host function pushes it: ``stream.notify``.) The loop watches the fd
(asyncio/uvloop: ``add_reader``; trio: a system task in ``wait_readable``) and sets the
awaiting task's event. Only this installation differs between event-loop libraries; the
await path itself is one anyio code path.
"""

from __future__ import annotations

import itertools
import sys
import threading
import weakref
from typing import Any

import sniffio

from .._errors import UsageError
from .._process import SERVICES, at_fork_child
from ._base import Channel

__all__ = ["Dispatcher", "current_lib", "dispatcher", "loop_dispatcher", "on_asyncio_loop"]


def current_lib() -> str:
    """``"trio"`` or ``"asyncio"``: the event-loop library running the calling task.

    Asked of sniffio, which each library tells what runs in this thread or task, rather than
    read from ``sys.modules`` (a module another thread is still importing is half made).
    """
    try:
        lib = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        lib = None
    if lib in ("trio", "asyncio"):
        return lib
    raise UsageError(
        "await needs a running event loop (asyncio, uvloop or trio)"
        + (f", not {lib}" if lib else "")
        + "; outside one use op.sync() or op.submit().result()"
    )


class Dispatcher:
    """Tokens to waiters for one event loop; ``dispatch`` runs on that loop's thread."""

    def __init__(self) -> None:
        self.channel = Channel()
        self.waiters: dict[int, Any] = {}
        self._seq = itertools.count(1)
        self.wakeups = 0

    def register(self, waker: Any) -> int:
        tok = next(self._seq)
        self.waiters[tok] = waker
        return tok

    def unregister(self, tok: int) -> None:
        self.waiters.pop(tok, None)

    def dispatch(self) -> None:
        self.wakeups += 1
        pop = self.waiters.pop
        for tok in self.channel.drain():
            w = pop(tok, None)
            if w is not None:  # None: that await was cancelled or timed out meanwhile
                w.set()


_lock = threading.Lock()
# weak: a loop that is gone takes its dispatcher along (its channel's eventfd closes then)
_asyncio: weakref.WeakKeyDictionary[Any, Dispatcher] = weakref.WeakKeyDictionary()
_trio: dict[Any, Dispatcher] = {}


def _after_fork_in_child() -> None:
    # the parent's loops and channels are not the child's: a loop in the child installs its own
    global _lock
    _lock = threading.Lock()
    _asyncio.clear()
    _trio.clear()


at_fork_child(_after_fork_in_child, SERVICES)


def dispatcher(lib: str | None = None) -> Dispatcher:
    """The running event loop's dispatcher, installed on first use (``lib``: see :func:`current_lib`)."""
    if lib is None:
        lib = current_lib()
    d: Dispatcher | None = None
    if lib == "asyncio":
        import asyncio

        loop = asyncio.get_running_loop()
        d = _asyncio.get(loop)
        if d is None:
            with _lock:
                for old in [lp for lp in _asyncio if lp.is_closed()]:
                    del _asyncio[old]  # its channel closes once no notification is pending
                d = _asyncio[loop] = Dispatcher()
            loop.add_reader(d.channel.fileno(), d.dispatch)
        return d
    if lib == "trio":
        import trio

        if not _trio_token:
            _trio_token.append(trio.lowlevel.current_trio_token)
        token = trio.lowlevel.current_trio_token()
        d = _trio.get(token)
        if d is None:
            d = Dispatcher()
            with _lock:
                _trio[token] = d
            trio.lowlevel.spawn_system_task(_trio_pump, d, token, name="deviceop wake-ups")
    if d is None:
        raise UsageError(f"deviceop awaits under asyncio, uvloop or trio, not {lib!r}")
    return d


_sniffed = sniffio.thread_local
_sniffed_cvar = sniffio.current_async_library_cvar


#: trio.lowlevel.current_trio_token, once trio has run an await (deviceop does not import trio)
_trio_token: list[Any] = []


class _Last(threading.local):
    #: the last asyncio loop an await in this thread ran on, and its dispatcher (both weakly)
    pair: tuple[Any, Any] | None = None


_last = _Last()


def _asyncio_loop_here() -> Any:
    """The asyncio loop running in this thread where sniffio's answer would be asyncio (nothing
    names another library to it; ``anyio.run`` names asyncio), else None: what sniffio reads
    first, read without its call."""
    if _sniffed.name is not None or _sniffed_cvar.get() not in (None, "asyncio"):
        return None
    aio = sys.modules.get("asyncio")
    return aio._get_running_loop() if aio is not None else None


def on_asyncio_loop(loop: Any) -> bool:
    """Whether the calling task runs on asyncio event loop ``loop``, read as
    :func:`loop_dispatcher` reads it: a check cheap enough for every call of an object that
    belongs to one loop. False does not mean another loop: ask :func:`current_lib` then."""
    return loop is not None and _asyncio_loop_here() is loop


def loop_dispatcher() -> tuple[str, Dispatcher]:
    """``(current_lib(), dispatcher())`` at a fraction of the cost, for every await.

    What sniffio would be told first (trio, or a library that names itself) is read as
    sniffio reads it; else a running asyncio loop in this thread is asyncio's, and the loop the
    thread last awaited on keeps its dispatcher at hand.
    """
    d: Dispatcher | None
    name = _sniffed.name
    if name == "trio" and _trio_token:
        # (trio names itself in sniffio's thread-local while it runs) this run's dispatcher, once
        # installed, without sniffio's and dispatcher()'s calls: each runs cold after a long wait
        d = _trio.get(_trio_token[0]())
        if d is not None:
            return "trio", d
    else:
        loop = _asyncio_loop_here()
        if loop is not None:
            p = _last.pair
            if p is not None and p[0]() is loop:
                d = p[1]()
                if d is not None:
                    return "asyncio", d
            d = dispatcher("asyncio")
            _last.pair = (weakref.ref(loop), weakref.ref(d))
            return "asyncio", d
    lib = current_lib()
    return lib, dispatcher(lib)


async def _trio_pump(d: Dispatcher, token: Any) -> None:
    import trio

    try:
        fd = d.channel.fileno()
        while True:
            await trio.lowlevel.wait_readable(fd)
            d.dispatch()
    finally:
        with _lock:
            _trio.pop(token, None)


def stats() -> dict[str, int]:
    """Installed dispatchers and their wake-ups (for tests and diagnostics)."""
    with _lock:
        ds = list(_asyncio.values()) + list(_trio.values())
    return {"dispatchers": len(ds), "wakeups": sum(d.wakeups for d in ds), "waiting": sum(len(d.waiters) for d in ds)}


def event_class(lib: str) -> Any:
    """The loop library's own event class (``asyncio.Event`` or ``trio.Event``).

    ``anyio.Event()`` asks sniffio which library runs at every creation; the queues and parked
    awaits make one per wait, so they take the class once.
    """
    if lib == "trio":
        import trio

        return trio.Event
    import asyncio

    return asyncio.Event
