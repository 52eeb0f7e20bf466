"""``await op`` and ``await future``: the completion reactor, with a short poll when completion is imminent.

An awaited execution arms a completion slot on its stream (see ``deviceop._core._reactor``):
the GPU writes a flag after the work, one scanner thread sees it and wakes the loop through
its channel. No completion event is recorded (an event a thread could block on makes the GPU
interrupt the host). When the await polls in its loop is learned: when the stream's recent
executions say completion is due soon (within the reactor's pre-wake lead), the task polls between bare
yields to the loop, which beats any cross-thread wake-up for a short kernel (work due within
10 µs, with no other await's work pending, is looked for without yielding for up to 15 µs:
one yield costs more, 5 µs under trio); otherwise it parks and the reactor pre-wakes it
shortly before the predicted completion to poll then. Such polls
last until shortly past the predicted completion (the reactor bounds them by the wake-up
lateness it learned); the poll budget (default 1 ms; 0: never poll) bounds the poll of work
whose duration is not learned yet.

While parked, the stream is also queried on a backing-off timer (20 ms, doubling to 200 ms:
every wake-up of an idle thread costs CPU time): a faulted context never writes its flags, and
the re-check turns that into a ``CudaError`` (and retires every slot armed on that device)
instead of a hang. Where every slot is armed, the await falls back to
the stream's host-function notification.

Cancellation and timeouts raise in the awaiting task at once; the GPU work keeps running and
is handed to the stream's watcher thread, which keeps its buffers alive and its ledger
entries in place until the work has really completed.
"""

from __future__ import annotations

import functools
import numbers
import time
from collections.abc import Awaitable, Callable
from typing import Any

from .._errors import CudaError, SettingError
from . import _reactor
from ._guards import check_timeout, refuse_on_loop
from ._wake import event_class, loop_dispatcher
from ._watch import device_failed, hand_over

__all__ = [
    "COUNTS",
    "RECHECK",
    "SLICE",
    "await_future",
    "await_op",
    "completed",
    "enqueue_slice",
    "park_until",
    "poll_budget",
    "poll_until",
    "set_enqueue_slice",
    "set_poll_budget",
    "set_wait_policy",
    "sleep_or_wake",
    "stats",
    "wait_completed",
    "wait_policy",
    "waker_class",
    "yielder",
]

#: the longest poll of work whose duration is not learned (polls around a prediction: see set_poll_budget)
_POLL = [1e-3]
#: a stream whose durations are not learned yet: poll this long, then park
_POLL_UNKNOWN = 20e-6
#: work predicted to complete within this long, with no other await's work pending, is looked
#: for without yielding to the loop for up to that long + _SPIN_SLACK (a yield to the loop and
#: back costs about as much as this wait, more under trio than under uvloop)
_SPIN = 10e-6
_SPIN_SLACK = 5e-6
#: polling goes on this long past the predicted completion before the task parks
_POLL_SLACK = 50e-6
#: first and longest interval of the parked re-check
_RECHECK = (20e-3, 200e-3)
#: the host time an awaited chain is enqueued for before the loop gets a turn (set_enqueue_slice)
_SLICE = [0.5e-3]
#: counters (see :func:`stats`)
_COUNTS = {"awaits": 0, "parks": 0, "late": 0, "polls": 0, "enqueue_yields": 0}
#: for the work queue's driver, which polls and parks on the same terms as an await
COUNTS = _COUNTS
RECHECK = _RECHECK
SLICE = _SLICE


def stats() -> dict[str, int]:
    """Counters, for diagnostics: ``awaits`` of ops (and executions a WorkQueue awaited),
    ``parks``, ``late``: parks that the
    re-check timer ended with the work complete and no wake-up delivered (for work much
    shorter than the 20 ms interval, a wake-up lost or late by about that much), and
    ``polls``: yields to the loop while polling (each lets every other ready task run; many
    awaits polling at once make every loop turn longer), and ``enqueue_yields``: turns given to
    the loop in the middle of enqueuing a long chain (see :func:`set_enqueue_slice`). Awaits in several threads at once
    may miss a count."""
    return dict(_COUNTS)


def set_poll_budget(seconds: float) -> None:
    """The longest an await polls in its event loop for work whose duration its stream has not
    learned yet (default 1 ms; 0: never poll, park at once).

    Otherwise an await polls only around the predicted completion of its work: from the start
    for short work, or from the moment the completion reactor pre-wakes it, shortly before the
    completion its stream's recent executions predict, until shortly past it (50 µs + 1/64 of
    the work's duration). How early a pre-wake comes is the wake-up lateness the reactor learned
    (its own and the loop's, at most about 2 ms). Polling yields to the loop between checks, so
    other tasks run meanwhile; work that runs late parks again.
    """
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not 0 <= float(seconds) <= 1:
        raise SettingError(
            f"a poll budget of {seconds!r} is not accepted; use a number of seconds from 0 to 1 (default 1e-3)"
        )
    _POLL[0] = float(seconds)


def poll_budget() -> float:
    """The current poll budget in seconds (see :func:`set_poll_budget`)."""
    return _POLL[0]


def set_enqueue_slice(seconds: float) -> None:
    """How long an awaited chain's enqueue may hold its event loop (default 0.5 ms; 0: the whole
    op is enqueued at once).

    Enqueuing is host work on the loop's thread: a chain whose steps call a library that
    enqueues many kernels (a PyTorch model through :func:`~deviceop.interop.torch`) can take
    milliseconds. ``await op`` enqueues a chain's source and steps in turn, and once this much
    host time has passed since the loop last ran, gives the loop a turn before the next step
    (after the source too), so its other tasks, timers and I/O are not held up. A task
    cancelled during such a turn enqueues no later step; what it enqueued completes, its
    buffers kept alive until then. A step itself is never split: a long step holds the loop for
    as long as it takes (split the work into steps). Synchronous terminals (``sync``,
    ``sync_on``), ``submit`` and ops that are not chains enqueue at once.

    During such a turn another task's work may be enqueued between two steps of the chain; the
    ledger orders it by the memory it touches, as any two executions in flight, so a later
    step sees the writes of whatever was enqueued before it. Tasks that touch the same memory
    while the chain is awaited race either way; set 0 to have every chain enqueued whole.

    A :class:`~deviceop.executors.WorkQueue`'s driver gives the loop a turn on the same terms
    while its passes keep moving (finishing and issuing executions back to back; 0: a turn
    after every pass).
    """
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not 0 <= float(seconds) <= 1:
        raise SettingError(
            f"enqueue slice {seconds!r} s is not accepted; use a number from 0 to 1 second (default 5e-4)"
        )
    _SLICE[0] = float(seconds)


def enqueue_slice() -> float:
    """The current enqueue slice in seconds (see :func:`set_enqueue_slice`)."""
    return _SLICE[0]


def set_wait_policy(policy: str) -> None:
    """How the completion reactor's scanner waits while awaited work runs.

    ``"adaptive"`` (default): it learns each stream's execution times and how late sleeping
    threads wake, sleeps, and pre-wakes the awaiting task shortly before the predicted
    completion so that the task polls around it (a percent or two of a core while a long op
    runs; the benchmarks page has the figures). ``"spin"``: it spins while anything is awaited (one core busy
    meanwhile) and pre-wakes awaiting tasks as ``"adaptive"`` does (a parked loop's own
    wake-up is what a long await would otherwise wait for). ``"block"``: it never polls; each
    awaited execution ends with a host function that wakes it (slowest wake-ups, no polling
    CPU). ``DEVICEOP_WAIT_POLICY`` sets it at import. Anything else raises :class:`~deviceop.SettingError`.
    """
    if not isinstance(policy, str):
        raise SettingError(f"wait policy must be one of {_reactor.POLICIES}, got {policy!r}")
    _reactor.set_policy(policy)


def wait_policy() -> str:
    """The completion reactor's CPU policy (see :func:`set_wait_policy`)."""
    return _reactor.policy()  # type: ignore[no-any-return]


def yielder(lib: str) -> Callable[[], Awaitable[None]]:
    """The cheapest yield to the running loop: a bare ``sleep(0)`` / trio checkpoint."""
    if lib == "trio":
        import trio

        return trio.lowlevel.checkpoint
    import asyncio

    return lambda: asyncio.sleep(0)


def _timed_out(cx: Any, timeout: float) -> TimeoutError:
    """The error of an await that timed out: an op's (``cx`` its execution, run once: only a
    future can be awaited again) or a future's (``cx`` a description of its work)."""
    if isinstance(cx, str):
        return TimeoutError(
            f"{cx} did not complete within {timeout} s; the GPU work keeps running. Await the "
            "future again (await fut.wait(timeout=...)) to keep waiting for its result"
        )
    return TimeoutError(
        f"{cx.describe()} did not complete within {timeout} s; the GPU work keeps running and its "
        "buffers stay alive until it completes. An op runs once: to wait longer for a result, "
        "submit() it and await the future with a timeout (await fut.wait(timeout=...)), which "
        "can be awaited again"
    )


async def sleep_or_wake(lib: str, waker: Any, limit: float) -> bool:
    """Wait until ``waker`` is set or ``limit`` seconds pass; True if the time ran out.

    Under asyncio a plain ``loop.call_later`` timer: a cancel scope's deadline re-arms itself
    whenever uvloop's millisecond timers fire a little early, which spins the loop for up to a
    millisecond at every re-check.
    """
    if lib == "trio":
        import anyio

        with anyio.move_on_after(limit):
            await waker.wait()
        return not waker.is_set()
    import asyncio

    fired = False

    def fire() -> None:
        nonlocal fired
        fired = True
        waker.set()

    handle = asyncio.get_running_loop().call_later(limit, fire)
    try:
        await waker
    finally:
        handle.cancel()
    return fired


def waker_class(lib: str) -> Any:
    """What a parked await waits on: trio's Event, or under asyncio a bare future with the
    Event's ``set`` (one wait, one waiter: an ``asyncio.Event``'s waiter list and extra future
    make every park dearer)."""
    return event_class(lib) if lib == "trio" else _future_waker()


@functools.cache
def _future_waker() -> Any:
    import asyncio  # not at import: deviceop does not import asyncio until a loop awaits

    class FutureWaker(asyncio.Future):  # type: ignore[type-arg]
        __slots__ = ()

        def set(self) -> None:
            if not self.done():
                self.set_result(None)

    return FutureWaker


async def _park(
    lib: str,
    d: Any,
    tok: int,
    done: Callable[[], bool],
    check: Callable[[], bool],
    deadline: float | None,
    cx: Any,
    timeout: float | None,
    h: int = -1,
    watch: Callable[[], bool] | None = None,
    wakers: list[Any] | None = None,
    any_wake: bool = False,
) -> bool:
    """Wait for ``tok`` on ``d``'s channel until ``done()``; ``check()`` (a query of the stream,
    or of the event where every slot is armed) is the re-check that raises CudaError on a
    context error (or, for several executions, finishes the failed ones and says so). ``h``:
    the reactor slot, whose pre-wake (the token before the flag) starts a poll until the
    predicted completion. ``watch()``: has the reactor wake this token at the completion of
    whatever ``done()`` waits for (several slots); True if one is complete already.
    ``wakers``: a list the current waker joins while parked, so that others can wake the
    task too (a new item for a queue). ``any_wake``: return at any wake-up but the re-check
    timer's (a waiter of several slots polls after the reactor's pre-wake itself). True if the
    task saw the completion while polling (the moment it saw it is the completion's)."""

    clock = time.perf_counter
    interval = _RECHECK[0]
    new_event = waker_class(lib)
    _COUNTS["parks"] += 1
    if h >= 0:
        _reactor.watch(h)  # armed unwatched (the task looked itself until now): the scanner's turn
    while True:
        waker = new_event()
        d.waiters[tok] = waker
        if wakers is not None:
            wakers.append(waker)
        try:
            if done() or (watch is not None and watch()):
                return False
            limit = interval
            if deadline is not None:
                left = deadline - clock()
                if left <= 1e-3:  # loop timers are good to a millisecond
                    if check():
                        return False
                    raise _timed_out(cx, timeout)  # type: ignore[arg-type]
                limit = min(limit, left)
            timed_out = await sleep_or_wake(lib, waker, limit)
        finally:
            if wakers is not None and waker in wakers:
                wakers.remove(waker)
        if done() or check():
            if h >= 0:
                _reactor.resumed(h)  # a pre-wake this task answers only now: its loop's lateness
            if timed_out and limit == interval:
                _COUNTS["late"] += 1
            return False
        if any_wake and not timed_out:
            return False
        # woken, yet not done: by a pre-wake, or by the re-check timer (which may fire together
        # with the pre-wake, or before it, when the work takes about as long as the interval);
        # either way, near the predicted completion the task polls for it
        span = _reactor.prewoken(h) if h >= 0 else None
        if span is not None and _POLL[0]:
            if await _poll(lib, done, span, deadline):
                return True
            _reactor.overdue(h)  # still running past the prediction: it takes longer than learned
        if timed_out:
            interval = min(interval * 2, _RECHECK[1])


def _spin(done: Callable[[], bool], spin: float, deadline: float | None) -> bool:
    """Check ``done()`` without yielding to the loop for at most ``spin`` seconds (and not past
    ``deadline``); True once it is."""
    clock = time.perf_counter
    t0 = clock()
    if deadline is not None:
        spin = min(spin, deadline - t0)
    while clock() - t0 < spin:
        if done():
            return True
    return False


async def _poll(lib: str, done: Callable[[], bool], budget: float, deadline: float | None) -> bool:
    """Yield to the loop and check, for at most ``budget`` seconds (and not past ``deadline``);
    True once ``done()``."""
    clock = time.perf_counter
    t0 = clock()
    y = yielder(lib)
    counts = _COUNTS
    while True:
        await y()
        counts["polls"] += 1
        if done():
            return True
        now = clock()
        if now - t0 >= budget or (deadline is not None and now >= deadline):
            return False


# the loop-side wait's two phases, for a waiter of several executions at once (a WorkQueue's
# driver): the same poll and the same park, re-check and back-off as every other await's
poll_until = _poll
park_until = _park


async def _enqueue_rest(lib: str, cx: Any, stream: Any, rest: Any) -> Any:
    """Enqueue the rest of a chain (``rest``, from ``start_sliced``), a slice at a time, giving
    the loop a turn before each; returns the chain's output."""
    y = yielder(lib)
    while True:
        try:
            await y()
        except BaseException:
            # cancelled during the turn: no later step is enqueued; the work enqueued so far
            # completes before its buffers go (a step that fails is handled by rest.run)
            hand_over(cx, stream)
            raise
        _COUNTS["enqueue_yields"] += 1
        if rest.run(_SLICE[0] or float("inf")):
            return rest.output


async def await_op(op: Any, stream: Any, label: str, timeout: float | None = None, poll: float | None = None) -> Any:
    """Enqueue ``op`` on ``stream``; resume when its work is complete; return its output.

    ``poll``: seconds to poll in the loop before parking (default: learned, at most the poll
    budget; see :func:`set_poll_budget`).
    """
    if timeout is not None:
        timeout = check_timeout(timeout)
    cx, out, rest = op._start_sliced(stream, label, _SLICE[0])
    # The loop's dispatcher is looked up once the work is enqueued: the lookup runs cold after a
    # long wait (microseconds), and the GPU runs meanwhile. Outside a running loop it raises; the
    # work enqueued completes first (its buffers held until then), as for a cancelled await
    try:
        lib, d = loop_dispatcher()
    except BaseException:
        hand_over(cx, stream)
        raise
    if rest is not None:  # a long chain: the loop gets a turn between slices of its enqueue
        out = await _enqueue_rest(lib, cx, stream, rest)
    _COUNTS["awaits"] += 1
    deadline = None if timeout is None else time.perf_counter() + timeout
    try:
        await _wait(cx, stream, lib, d, deadline, timeout, poll, cx)
    except BaseException:
        # cancelled, timed out or failed: the work may still run; the watcher finishes it
        hand_over(cx, stream)
        raise
    cx.finish()
    return out


async def _wait(
    cx: Any, stream: Any, lib: str, d: Any, deadline: float | None, timeout: float | None, poll: float | None, who: Any
) -> None:
    """The one wait for an execution's completion in an event loop (``ExecutionContext.completed``,
    ``await op``, ``await future``): arm a completion slot after the work enqueued on ``stream``
    so far, then look for it without yielding while it is due within microseconds, poll between
    yields to the loop while it is due soon, else park until the reactor wakes the loop, with a
    backing-off re-check that turns a faulted context into its ``CudaError``. Finishes nothing
    and hands nothing over: the caller decides. ``who``: the execution, or a description of the
    work, for a timeout's message."""
    tok = d.register(None)
    h = -1
    polled = False  # the completion seen by this task while it looked every loop turn
    try:
        # unwatched: most short awaits see their flag while polling, and a parked scanner
        # thread is woken only if this one parks
        h = _reactor.arm(stream, d.channel, tok, False)
        if h < 0:
            # every slot is armed: the stream's host function wakes this loop, the execution's
            # event says when it is done (no event otherwise: an event a thread could block on
            # costs the host an interrupt)
            ev = cx.sealed_event()
            if ev is None:
                return  # finished meanwhile
            stream.notify(d.channel, tok)
            done: Callable[[], bool] = ev.query
            check: Callable[[], bool] = done
        else:
            done = functools.partial(_reactor.done, h)
            # the parked re-check: a faulted context never writes the flag, and the stream's
            # query raises its error (it is complete once this work and any later work are)
            check = stream.query
        if not done():
            spin = 0.0
            if poll is None:
                rem, alone = _reactor.expected(h) if h >= 0 else (-1.0, False)
                budget = _POLL[0]
                if rem < 0:  # not learned yet
                    poll = min(budget, _POLL_UNKNOWN)
                elif rem > 0:  # too soon for a pre-wake: poll from the start until just past it
                    poll = rem + _POLL_SLACK if budget else 0.0
                    if poll and alone and rem <= _SPIN:
                        # due within microseconds, and no other await's work pending (a queue
                        # feeding other streams meanwhile would wait): one yield to the loop
                        # costs more than looking until then
                        spin = rem + _SPIN_SLACK
                else:  # the reactor pre-wakes this task shortly before the completion
                    poll = 0.0
            if (spin and _spin(done, spin, deadline)) or (poll and await _poll(lib, done, poll - spin, deadline)):
                polled = True
            else:
                polled = await _park(lib, d, tok, done, check, deadline, who, timeout, h)
    except CudaError as e:
        # a sticky error (the context is lost) wakes every await on the device to see it; an
        # error of one call fails this execution only
        device_failed(stream.backend, e)
        raise
    finally:
        d.waiters.pop(tok, None)  # (unregister's work, without its call: the return path runs cold)
        if h >= 0 and not _reactor.retire(h, polled):
            _reactor.disown(h)


async def completed(cx: Any, timeout: float | None = None) -> None:
    """``await cx.completed(timeout)``: resume once execution ``cx``'s work is complete (see
    :func:`_wait`); ``TimeoutError`` after ``timeout`` seconds (the work goes on). Neither
    finishes nor hands over ``cx``: whoever owns it does."""
    timeout = check_timeout(timeout)
    if cx.done:
        return
    lib, d = loop_dispatcher()
    deadline = None if timeout is None else time.perf_counter() + timeout
    await _wait(cx, cx.stream, lib, d, deadline, timeout, None, cx)


def wait_completed(cx: Any, timeout: float | None = None) -> bool:
    """The blocking twin of :func:`completed`, for threads: True once ``cx``'s work is complete,
    False if ``timeout`` seconds passed first. Without a timeout the thread sleeps in the driver
    (``ExecutionContext.block_c`` on the execution's event, recorded now if it has none); with one, it checks
    the execution's completion event (one is recorded after its work so far if it has none)
    with growing pauses."""
    timeout = check_timeout(timeout)
    if cx.done:
        return True
    if timeout != 0:
        refuse_on_loop(f"{cx.describe()}: wait_completed()")
    if timeout is None:
        cx._block()
        return True
    ev = cx.sealed_event()
    if ev is None:
        return True  # finished meanwhile
    deadline = time.perf_counter() + timeout
    pause = 20e-6
    while not ev.query():
        left = deadline - time.perf_counter()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(2 * pause, 1e-3)
    return True


async def await_future(fut: Any, timeout: float | None = None, hurry: Callable[[], None] | None = None) -> Any:
    """Resume when the submitted work behind ``fut`` (a DeviceFuture) is complete; return its
    output. The future completes when its own event does (whoever sees it first finishes it:
    this task while it polls, else its stream's watcher): poll while it is due soon, else park
    until its completion callback wakes the loop, as an op's wait does. ``hurry()``: called
    when the task parks, to have the stream's watcher look for the completion from then on
    (a future submitted on a loop's thread is left to that loop for a grace period)."""
    timeout = check_timeout(timeout)
    lib, d = loop_dispatcher()
    deadline = None if timeout is None else time.perf_counter() + timeout
    if not fut.done() and not await _poll(lib, fut.done, _POLL[0], deadline):
        tok = d.register(None)
        ch = d.channel
        fut.add_done_callback(lambda _f: ch.push(tok))
        if hurry is not None:
            hurry()  # (the watcher completes it as soon as its work is done, grace or not)
        try:
            await _park(lib, d, tok, fut.done, fut.done, deadline, f"submitted work ({fut._cx.describe()})", timeout)
        finally:
            d.unregister(tok)
    return fut.result(0)
