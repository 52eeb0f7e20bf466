"""The asynchronous terminals: submit and the start of an await (``sync`` lives in the core)."""

from __future__ import annotations

from typing import Any

from .._core._ledger import ExecutionContext
from .._core._op import HOOKS, as_stream, refuse_in_capture
from ._future import DeviceFuture, watch

__all__ = ["start", "run_submit", "submit"]


def start(op: Any, stream: Any, label: str) -> tuple[ExecutionContext, Any]:
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


def run_submit(op: Any, stream: Any, label: str) -> DeviceFuture[Any]:
    """Execute ``op`` on ``stream`` without waiting; return a future for its output."""
    cx, out = start(op, stream, label)
    fut: DeviceFuture[Any] = DeviceFuture(cx, out)
    watch(stream, cx.seal(), cx, fut)
    return fut


def submit(op: Any, stream: Any = None) -> DeviceFuture[Any]:
    """``op.submit(stream=None)``: run on ``stream`` (default: the next pool stream) without waiting."""
    s = as_stream(stream)
    op._take("submit()")
    return run_submit(op, s, "submit()")


HOOKS["submit"] = submit
