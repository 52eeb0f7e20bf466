"""submit: the asynchronous terminal whose result is a future (``start`` and ``sync`` are compiled)."""

from __future__ import annotations

from typing import Any

from .._core._op import HOOKS, as_stream, start
from ._future import DeviceFuture, watch_future

__all__ = ["run_submit", "submit"]


def run_submit(op: Any, stream: Any, label: str) -> DeviceFuture[Any]:
    """Execute ``op`` on ``stream`` without waiting; return a future for its output."""
    cx, out = start(op, stream, label)
    fut: DeviceFuture[Any] = DeviceFuture(cx, out)
    watch_future(stream, cx.seal(), cx, fut)
    return fut


def submit(op: Any, stream: Any = None) -> DeviceFuture[Any]:
    """``op.submit(stream=None)``: run on ``stream`` (default: the next pool stream) without waiting."""
    s = as_stream(stream)
    op._take("submit()")
    return run_submit(op, s, "submit()")


HOOKS["submit"] = submit
