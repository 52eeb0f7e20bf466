"""``await op`` and ``await future``: a short poll while completion is imminent, then a park.

Polling: query the completion event between bare yields to the event loop, for at most the
poll budget. A one-kernel op completes inside it, at close to the cost of a blocking sync,
without blocking the loop. Parking: a host function wakes the loop (see ``_wake``), so long
GPU work costs no CPU. While parked, the event is also re-checked on a backing-off timer:
host functions never run once the context has an error, and the re-check turns that into a
``CudaError`` instead of a hang.

Cancellation and timeouts raise in the awaiting task at once; the GPU work keeps running and
is handed to the stream's watcher thread, which keeps its buffers alive and its ledger
entries in place until the work has really completed.
"""

from __future__ import annotations

import numbers
import time
from typing import Any, Awaitable, Callable

from .._core._op import HOOKS, as_stream, refuse_in_capture, start
from .._errors import SettingError, UsageError
from . import _future
from ._future import DeviceFuture, watch
from ._wake import arm, current_lib, dispatcher

__all__ = ["await_op", "await_future", "set_poll_budget", "poll_budget"]

#: seconds of polling before parking (measured default: see README, "await")
_POLL = [50e-6]
#: first and longest interval of the parked re-check
_RECHECK = (1e-3, 50e-3)


def set_poll_budget(seconds: float) -> None:
    """How long an await polls before it parks (default 50 µs; 0 parks at once).

    Longer budgets shave wake-up latency off medium-length work at the price of CPU time
    spent polling; the default covers a short kernel with margin.
    """
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not 0 <= float(seconds) <= 1:
        raise SettingError(f"poll budget {seconds!r} s is not accepted; use a number from 0 to 1 second (default 50e-6)")
    _POLL[0] = float(seconds)


def poll_budget() -> float:
    """The current poll budget in seconds (see :func:`set_poll_budget`)."""
    return _POLL[0]


def _yielder(lib: str) -> Callable[[], Awaitable[None]]:
    """The cheapest yield to the running loop: a bare ``sleep(0)`` / trio checkpoint."""
    if lib == "trio":
        import trio

        return trio.lowlevel.checkpoint  # type: ignore[no-any-return]
    import asyncio

    return lambda: asyncio.sleep(0)


def _check_timeout(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise UsageError(f"timeout must be None or a number of seconds >= 0, got {timeout!r}")
    t = float(timeout)
    if not t >= 0:
        raise UsageError(f"timeout must be None or a number of seconds >= 0, got {timeout!r}")
    return t


def _timed_out(what: str, timeout: float) -> TimeoutError:
    return TimeoutError(
        f"{what} did not complete within {timeout} s; the GPU work keeps running and its buffers "
        "stay alive until it completes. Await it again (or submit() and keep the future) to get its result."
    )


async def _wait(lib: str, done: Callable[[], bool], arm_fn: Callable[[Any, int], None], deadline: float | None,
                what: str, timeout: float | None, budget: float | None = None) -> None:
    """Return once ``done()``; ``done`` raises CudaError on a context error. ``lib``: the
    running loop's library (:func:`current_lib`)."""
    clock = time.perf_counter
    if done():
        return
    t0 = clock()
    if budget is None:
        budget = _POLL[0]
    if budget:
        y = _yielder(lib)
        while True:
            await y()
            if done():
                return
            now = clock()
            if now - t0 >= budget:
                break
            if deadline is not None and now >= deadline:
                raise _timed_out(what, timeout)  # type: ignore[arg-type]
    import anyio  # imported here: only parked awaits need it, and it costs start-up time

    d = dispatcher(lib)
    waker = anyio.Event()
    tok = d.register(waker)
    try:
        arm_fn(d, tok)
        interval = _RECHECK[0]
        while True:
            limit = interval
            if deadline is not None:
                left = deadline - clock()
                if left <= 0:
                    if done():
                        return
                    raise _timed_out(what, timeout)  # type: ignore[arg-type]
                limit = min(limit, left)
            with anyio.move_on_after(limit):
                await waker.wait()
            if done():
                return
            if waker.is_set():  # woken, yet not done: the context failed; done() raised above
                waker = anyio.Event()
                d.unregister(tok)
                tok = d.register(waker)
            interval = min(interval * 2, _RECHECK[1])
    finally:
        d.unregister(tok)


async def await_op(op: Any, stream: Any, label: str, timeout: float | None = None, poll: float | None = None) -> Any:
    """Enqueue ``op`` on ``stream``; resume when its work is complete; return its output.

    ``poll``: seconds to poll before parking (default: the global poll budget).
    """
    timeout = _check_timeout(timeout)
    lib = current_lib()  # before any work: outside an event loop this raises, whatever the op
    cx, out = start(op, stream, label)
    ev = cx.seal()
    deadline = None if timeout is None else time.perf_counter() + timeout
    try:
        await _wait(lib, ev.query, lambda d, tok: arm(d, tok, stream, ev), deadline, cx.describe(), timeout, poll)
    except BaseException:
        # cancelled, timed out or failed: the work may still run; the watcher finishes it
        watch(stream, ev, cx)
        raise
    cx.finish()
    return out


async def await_future(fut: DeviceFuture[Any], timeout: float | None = None) -> Any:
    """Resume when the submitted work behind ``fut`` is complete; return its output."""
    timeout = _check_timeout(timeout)
    lib = current_lib()
    deadline = None if timeout is None else time.perf_counter() + timeout

    def arm_fut(d: Any, tok: int) -> None:
        ch = d.channel
        fut.add_done_callback(lambda _f: ch.push(tok))

    await _wait(lib, fut.done, arm_fut, deadline, f"submitted work ({fut._cx.describe()})", timeout)
    return fut.result(0)


def wait(op: Any, timeout: float | None = None, stream: Any = None) -> Any:
    """``op.wait(timeout=, stream=)``: the coroutine of ``await op`` (checks first, then consumes)."""
    refuse_in_capture(f"await {op!r}")
    _check_timeout(timeout)
    s = as_stream(stream)
    op._take("await")
    return await_op(op, s, "await", timeout)


HOOKS["await"] = wait
_future.HOOKS["await_future"] = await_future
