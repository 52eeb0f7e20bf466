"""shared: execute an op once; every consumer gets the same output."""

from __future__ import annotations

import threading
from typing import Any

from .._core._op import SHAREABLE
from .._errors import CaptureError, UsageError
from ..ops._base import DeviceOp

__all__ = ["Shared"]


class Shared(DeviceOp[Any]):
    """Runs its source once, under a lock, in the first consumer's execution.

    An event is recorded after that execution's work; consumers on other streams make their
    stream wait on it (never on a bare flag), consumers on the same stream are already ordered.
    May be consumed any number of times.
    """

    __slots__ = ("_lock", "_src", "_state")

    def __init__(self, src: DeviceOp[Any]) -> None:
        super().__init__()
        src._take(".shared()")
        self._used = SHAREABLE  # every consumer may take it
        self._src: DeviceOp[Any] | None = src
        self._lock = threading.Lock()
        self._state: tuple[Any, ...] | None = None

    def __repr__(self) -> str:
        return f"<Shared {'done' if self._state else 'pending'}>"

    def _run(self, cx: Any) -> Any:
        with self._lock:
            st = self._state
            if st is None:
                src, self._src = self._src, None
                try:
                    out = src._run(cx)  # type: ignore[union-attr]
                except BaseException as e:
                    self._state = ("error", e)
                    raise
                if cx.capturing:  # its work exists only in the graph: no event to wait on outside it
                    self._state = ("captured", out, None, cx)
                    return out
                ev = cx.backend.new_event()
                cx.stream.record(ev)
                self._state = ("ok", out, ev, cx.stream)
                return out
        if st[0] == "error":
            raise UsageError("this shared op failed in its first execution and has no output; build it anew") from st[1]
        kind, out, ev, stream = st
        if kind == "captured":
            if stream is not cx:  # (holds the recording's execution context)
                raise CaptureError(
                    "this shared op first ran inside a graph recording, so its output is computed "
                    "only by that graph's replays; consume it inside the same recording, or run it "
                    "(shared) before the scope"
                )
            return out
        if cx.capturing:
            # recording: the replay's ledger registration orders it after that work instead
            # (a recorded wait on an event from outside the recording is refused by the driver)
            return out
        if stream is not cx.stream:
            cx.stream.wait(ev)
        return out
