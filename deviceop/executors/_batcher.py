"""Batcher: concurrent requests gathered into one batched op (dynamic batching).

``await b(x)`` adds ``x`` to the batch being gathered and waits for its own result. A batch is
run when it holds ``max_batch`` requests, or ``max_delay`` seconds after its first request
arrived, whichever comes first: ``fn(items)`` builds one op whose output is a list with one
result per item, in order; the batch's op is awaited on the next pool stream while the next
batch gathers, so batches overlap on the stream pool. This is Triton's dynamic batcher and Ray
Serve's ``@serve.batch`` for deviceop ops.

    b = Batcher(lambda xs: model_op(stack(xs)).map(split), max_batch=32, max_delay=0.002)
    y = await b(x)          # from each request handler

No background task is needed: the first request of a batch leads it (waits for it to fill or
for its delay, runs it, hands out the results; under asyncio in a task of its own, which a
native cancellation of the leading request's task cannot stop). Errors stay per request where
they can: a result that is an exception instance is raised to its own caller only; ``fn``
raising, or the batch's op failing, fails every request of that batch (and none of the next).
A cancelled caller gets no result; the others of its batch are not affected (a cancelled
leader's batch still runs for the others; the leader raises its cancellation).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import anyio

from .._core._completion import sleep_or_wake, waker_class
from .._core._op import DeviceOp
from .._core._wake import current_lib, on_asyncio_loop
from .._errors import UsageError

__all__ = ["Batcher"]

X = TypeVar("X")
R = TypeVar("R")

_PENDING = object()


class _Request:
    __slots__ = ("done", "error", "item", "result")

    def __init__(self, item: Any, done: Any) -> None:
        self.item = item
        self.result: Any = _PENDING
        self.error: BaseException | None = None
        # the await path's one-waiter waker (a bare future under asyncio), not an anyio Event:
        # made and awaited per request, the Event cost the loop's thread microseconds more
        self.done = done


class _Batch:
    __slots__ = ("full", "requests", "started")

    def __init__(self, full: Any) -> None:
        self.requests: list[_Request] = []
        # set when the batch is full: the await path's one-waiter waker, which the leader waits
        # on with its loop timer (an anyio deadline re-checks itself at every early uvloop
        # timer, spinning the loop for up to a millisecond at the end of each batch's delay)
        self.full = full
        self.started = False


def _raise_interrupt(t: Any) -> None:
    """Done callback of a batch's task whose leader was cancelled: its interrupt, raised."""
    if not t.cancelled() and t.exception() is None and t.result() is not None:
        raise t.result()


class Batcher(Generic[X, R]):
    """Gather concurrent ``await b(x)`` calls into batches of at most ``max_batch``, each run as
    one op ``fn(items)`` whose output is a list of ``len(items)`` results (see the module doc).

    ``max_delay``: seconds a batch waits for more requests after its first (0: run at once with
    whatever has arrived). A Batcher belongs to the event loop (asyncio, uvloop or trio) that
    first calls it; it is not thread-safe. ``stats()`` gives batches, requests and sizes.
    """

    fn: Callable[[list[X]], DeviceOp[Sequence[R]]]
    max_batch: int
    max_delay: float

    def __init__(
        self, fn: Callable[[list[X]], DeviceOp[Sequence[R]]], max_batch: int = 32, max_delay: float = 0.002
    ) -> None:
        if not callable(fn):
            raise UsageError(f"Batcher(fn, ...) needs a callable fn(items) -> op of a list, got {type(fn).__name__}")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise UsageError(f"max_batch must be an int >= 1, got {max_batch!r}")
        if (
            isinstance(max_delay, bool)
            or not isinstance(max_delay, (int, float))
            or not math.isfinite(max_delay)
            or not 0 <= max_delay <= 60
        ):
            raise UsageError(f"max_delay must be 0 to 60 seconds, got {max_delay!r}")
        self.fn = fn
        self.max_batch = max_batch
        self.max_delay = float(max_delay)
        self._open: _Batch | None = None
        self._loop: object = None
        self._lib = ""  # the loop's library, and its waker class, from the first call
        self._waker: Any = None
        self._batches = 0
        self._requests = 0
        self._largest = 0
        self._failed = 0
        self._leading: set[Any] = set()  # asyncio: the batches' tasks, held until they end

    def _check_loop(self) -> None:
        if self._lib == "asyncio" and on_asyncio_loop(self._loop):
            return  # (its loop, known without asking sniffio: this runs at every request)
        lib = current_lib()
        if lib == "trio":
            import trio

            loop: object = trio.lowlevel.current_trio_token()
        else:
            import asyncio

            loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop  # (held, not its id: a later loop could reuse the address)
            self._lib = lib
            self._waker = waker_class(lib)
        elif self._loop is not loop:
            raise UsageError("a Batcher belongs to the event loop that first called it; make one per loop")

    async def __call__(self, item: X) -> R:
        """Add ``item`` to the gathering batch and wait for its result."""
        self._check_loop()
        req = _Request(item, self._waker())
        b = self._open
        if b is None or b.started or len(b.requests) >= self.max_batch:
            b = self._open = _Batch(self._waker())
        b.requests.append(req)
        self._requests += 1
        if len(b.requests) == 1:
            if self._lib == "trio":
                await self._lead_shielded(b)
                # its own result is handed out: a cancellation that came while it led
                # (shielded) is raised at this checkpoint (a set Event's wait would not yield)
                await anyio.lowlevel.checkpoint()
            else:
                await self._lead_in_task(b)  # (a cancellation is raised in it at once)
        elif len(b.requests) >= self.max_batch:
            b.full.set()
        if self._lib == "trio":
            await req.done.wait()
        else:
            await req.done  # (a cancelled caller cancels its future; set() then leaves it)
        if req.error is not None:
            raise req.error
        result: R = req.result
        return result

    async def _lead_in_task(self, b: _Batch) -> None:
        """Under asyncio the batch runs in a task of its own: a cancel scope's shield does not
        stop a native cancellation of the leading request's task (``task.cancel()``, a
        framework cancelling the handler of a client gone), which would leave the batch
        unrun and its other requests waiting forever. The leader then raises its cancellation
        at once; the batch goes on for the others."""
        import asyncio

        t = asyncio.ensure_future(self._lead_catching(b))
        self._leading.add(t)
        t.add_done_callback(self._leading.discard)
        try:
            interrupt = await asyncio.shield(t)
        except asyncio.CancelledError:
            t.add_done_callback(_raise_interrupt)  # (the leader is gone: not lost with it)
            raise
        if interrupt is not None:
            raise interrupt

    async def _lead_catching(self, b: _Batch) -> BaseException | None:
        # KeyboardInterrupt or SystemExit in fn is handed to the leader to raise: raised by a
        # task, asyncio would raise it out of the event loop past the leader
        try:
            await self._run_batch(b)
        except (KeyboardInterrupt, SystemExit) as e:
            return e
        return None

    async def _lead_shielded(self, b: _Batch) -> None:
        # trio: the batch runs in the leader's task, shielded so that the leader's cancellation
        # cannot strand the others (it is raised at the checkpoint after). Under asyncio it runs
        # in a task of its own (_lead_in_task), which no cancel scope of the leader's reaches
        # (only a native cancel of that task, as at the loop's end): no shield there
        with anyio.CancelScope(shield=True):
            await self._run_batch(b)

    async def _run_batch(self, b: _Batch) -> None:
        if len(b.requests) < self.max_batch and self.max_delay > 0:
            await sleep_or_wake(self._lib, b.full, self.max_delay)
        b.started = True
        if self._open is b:
            self._open = None
        reqs = b.requests
        self._batches += 1
        self._largest = max(self._largest, len(reqs))
        try:
            op = self.fn([r.item for r in reqs])
            if not isinstance(op, DeviceOp):
                raise UsageError(f"Batcher fn returned {type(op).__name__}, not a DeviceOp of a list")
            out = await op
            try:
                results = list(out)
            except TypeError:
                raise UsageError(
                    f"Batcher fn's op gave {type(out).__name__}; its output must be a list of results"
                ) from None
            if len(results) != len(reqs):
                raise UsageError(
                    f"Batcher fn's op gave {len(results)} results for a batch of {len(reqs)}; give one per item"
                )
        except Exception as e:
            self._failed += 1
            for r in reqs:
                r.error = e
                r.done.set()
            return
        except BaseException as e:  # KeyboardInterrupt, SystemExit in fn: raised by the leader,
            self._failed += 1  # and the others told instead of left waiting
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                why = f"interrupted ({type(e).__name__} in the request leading it)"
            else:  # (asyncio: the batch's own task cancelled, as when its event loop closes)
                why = f"cancelled ({type(e).__name__}: the task running it was cancelled)"
            err = UsageError(f"this request's batch was {why}; retry it")
            for r in reqs:
                r.error = err
                r.done.set()
            raise
        for r, v in zip(reqs, results):
            if isinstance(v, BaseException):
                r.error = v
            else:
                r.result = v
            r.done.set()

    def stats(self) -> dict[str, float]:
        """``batches``, ``requests``, ``mean_batch``, ``largest_batch`` and ``failed_batches`` so far."""
        return {
            "batches": self._batches,
            "requests": self._requests,
            "mean_batch": self._requests / self._batches if self._batches else 0.0,
            "largest_batch": self._largest,
            "failed_batches": self._failed,
        }

    def __repr__(self) -> str:
        return f"Batcher(max_batch={self.max_batch}, max_delay={self.max_delay})"
