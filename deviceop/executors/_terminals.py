"""The terminals that drive an op: sync_on (and sync), submit."""

from __future__ import annotations

from typing import Any

from .._errors import UsageError
from ._context import ExecutionContext, refuse_in_capture
from ._future import DeviceFuture, watch

__all__ = ["run_sync", "run_submit", "as_stream"]


def as_stream(stream: Any) -> Any:
    """Accept a deviceop pool stream; reject anything else with a clear message."""
    if stream is None:
        from ..device import next_stream

        return next_stream()
    if hasattr(stream, "backend") and hasattr(stream, "synchronize") and hasattr(stream, "record"):
        return stream
    raise UsageError(
        f"{stream!r} is not a deviceop stream; pass one from do.next_stream() or do.streams()"
    )


def _start(op: Any, stream: Any, label: str) -> tuple[ExecutionContext, Any]:
    """Enqueue ``op`` on ``stream``; on failure wait for what was enqueued, then release it."""
    refuse_in_capture(f"{op!r}.{label}")
    stream.backend.make_current()
    cx = ExecutionContext(stream, label, op)
    try:
        return cx, op._run(cx)
    except BaseException:
        # work already enqueued must complete before its buffers may go
        try:
            stream.synchronize()
        finally:
            cx.finish(ok=False)
        raise


def run_sync(op: Any, stream: Any, label: str) -> Any:
    """Execute ``op`` on ``stream``, wait for the stream, return the output."""
    cx, out = _start(op, stream, label)
    try:
        stream.synchronize()
    except BaseException:
        cx.finish(ok=False)
        raise
    cx.finish()
    return out


def run_submit(op: Any, stream: Any, label: str) -> DeviceFuture[Any]:
    """Execute ``op`` on ``stream`` without waiting; return a future for its output."""
    cx, out = _start(op, stream, label)
    fut: DeviceFuture[Any] = DeviceFuture(cx, out)
    watch(stream, cx.seal(), cx, fut)
    return fut
