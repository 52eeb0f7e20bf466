"""DeviceOp: lazy, typed GPU work. Building an op does nothing; a terminal drives it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Coroutine, Generator, Generic, TypeVar

from .._errors import UsageError

if TYPE_CHECKING:
    from ..executors._context import ExecutionContext
    from ..executors._future import DeviceFuture
    from ..graph._graph import CudaGraph

__all__ = ["DeviceOp", "is_op"]

T = TypeVar("T")
U = TypeVar("U")

# filled in by deviceop.combinators (which imports this module) to avoid an import cycle
_combinators: dict[str, Any] = {}


class DeviceOp(Generic[T]):
    """A description of GPU work whose output is a ``T``.

    Ops are single-use values, like the paper's Rust ops that move into what consumes them:
    composing an op (``then``, ``zip``, as a kernel argument...) or driving it with a terminal
    (``sync``, ``sync_on``, ``submit``) consumes it, and using it again raises
    :class:`UsageError`. ``shared()`` makes an op that any number of consumers may use; it
    executes once.
    """

    __slots__ = ("_used",)

    def __init__(self) -> None:
        self._used: str | None = None

    # -- to implement ----------------------------------------------------------------------
    def _run(self, cx: "ExecutionContext") -> T:
        """Enqueue this op's work on ``cx.stream`` and return its output (possibly in flight).

        Every concrete op overrides this. (No ABCMeta: its isinstance checks cost too much on
        the launch path.)
        """
        raise UsageError(f"{type(self).__name__} does not define _run(); subclasses of DeviceOp must")

    def _take(self, by: str) -> None:
        """Mark consumed by ``by``; raise if it already was."""
        if self._used is not None:
            raise UsageError(
                f"{self!r} was already consumed by {self._used}; an op runs once. Build a new op "
                "for another run, or call .shared() on it to use one result in several places."
            )
        self._used = by

    def __repr__(self) -> str:
        return f"<{type(self).__name__}>"

    # -- combinators -----------------------------------------------------------------------
    def then(self, f: "Callable[[T], DeviceOp[U]]") -> "DeviceOp[U]":
        """Chain: ``f(output)`` returns the next op, which runs on the same stream after this one."""
        return _combinators["chain"](self, "then", f)

    def map(self, f: Callable[[T], U]) -> "DeviceOp[U]":
        """Transform the output on the host with ``f(output)`` (runs when the op is enqueued)."""
        return _combinators["chain"](self, "map", f)

    def inspect(self, f: Callable[[T], Any]) -> "DeviceOp[T]":
        """Call ``f(output)`` for its side effect when the op is enqueued; pass the output on."""
        return _combinators["chain"](self, "inspect", f)

    def first(self) -> "DeviceOp[Any]":
        """The first element of a tuple output."""
        return _combinators["chain"](self, "map", _first)

    def last(self) -> "DeviceOp[Any]":
        """The last element of a tuple output."""
        return _combinators["chain"](self, "map", _last)

    def shared(self) -> "DeviceOp[T]":
        """An op that executes this one once; every consumer gets the same output."""
        return _combinators["shared"](self)

    # -- terminals -------------------------------------------------------------------------
    def sync(self) -> T:
        """Run on the next pool stream, wait for completion, return the output."""
        from ..device import next_stream
        from ..executors._terminals import run_sync

        self._take("sync()")
        return run_sync(self, next_stream(), "sync()")  # type: ignore[no-any-return]

    def sync_on(self, stream: Any) -> T:
        """Run on ``stream``, wait for completion, return the output."""
        from ..executors._terminals import as_stream, run_sync

        s = as_stream(stream)
        self._take("sync_on()")
        return run_sync(self, s, "sync_on()")  # type: ignore[no-any-return]

    def __await__(self) -> "Generator[Any, None, T]":
        """``await op``: run on the next pool stream; resume the task when the work is complete.

        Works under asyncio, uvloop and trio. The event loop is never blocked: the await polls
        briefly, then parks until a host function wakes it. Cancelling the task raises at once;
        the GPU work still completes and its buffers stay alive until it does.
        """
        return self.wait().__await__()

    def wait(self, timeout: float | None = None, stream: Any = None) -> "Coroutine[Any, Any, T]":
        """``await op.wait(timeout=s, stream=st)``: ``await op`` with a timeout and a chosen stream.

        Raises ``TimeoutError`` if the work is not complete after ``timeout`` seconds (the work
        keeps running).
        """
        from ..executors._await import await_op, _check_timeout
        from ..executors._context import refuse_in_capture
        from ..executors._terminals import as_stream

        refuse_in_capture(f"await {self!r}")
        _check_timeout(timeout)
        s = as_stream(stream)
        self._take("await")
        return await_op(self, s, "await", timeout)  # type: ignore[no-any-return]

    def graph(self, stream: Any = None) -> "CudaGraph[T]":
        """Record this op into a :class:`~deviceop.graph.CudaGraph` (nothing runs now).

        ``graph.launch()`` replays it and yields this op's output. Allocating ops and nested
        ``sync``/``await`` raise :class:`CaptureError`. ``stream``: record on this pool stream
        instead of a private one.
        """
        from ..graph._scope import capture

        return capture(self, stream)

    def submit(self, stream: Any = None) -> "DeviceFuture[T]":
        """Run on ``stream`` (default: the next pool stream) without waiting; return a future."""
        from ..executors._terminals import as_stream, run_submit

        s = as_stream(stream)
        self._take("submit()")
        return run_submit(self, s, "submit()")


def _first(x: Any) -> Any:
    return _pick(x, 0, "first")


def _last(x: Any) -> Any:
    return _pick(x, -1, "last")


def _pick(x: Any, i: int, name: str) -> Any:
    if not isinstance(x, tuple) or not x:
        raise UsageError(f".{name}() needs an op whose output is a non-empty tuple, got {type(x).__name__}")
    return x[i]


def is_op(x: Any) -> bool:
    """True if ``x`` is a DeviceOp."""
    return isinstance(x, DeviceOp)
