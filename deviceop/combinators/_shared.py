"""shared: execute an op once; every consumer gets the same output."""

from __future__ import annotations

import threading
from typing import Any

from .._errors import UsageError
from ..ops._base import DeviceOp

__all__ = ["Shared"]


class Shared(DeviceOp[Any]):
    """Runs its source once, under a lock, in the first consumer's execution.

    An event is recorded after that execution's work; consumers on other streams make their
    stream wait on it (never on a bare flag), consumers on the same stream are already ordered.
    May be consumed any number of times.
    """

    __slots__ = ("_src", "_lock", "_state")

    def __init__(self, src: DeviceOp[Any]) -> None:
        super().__init__()
        src._take(".shared()")
        self._src: DeviceOp[Any] | None = src
        self._lock = threading.Lock()
        self._state: tuple[Any, ...] | None = None

    def _take(self, by: str) -> None:
        pass  # shareable: every consumer may use it

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
                ev = cx.backend.new_event()
                cx.stream.record(ev)
                self._state = ("ok", out, ev, cx.stream)
                return out
        if st[0] == "error":
            raise UsageError(
                "this shared op failed in its first execution and has no output; build it anew"
            ) from st[1]
        _, out, ev, stream = st
        if stream is not cx.stream:
            cx.stream.wait(ev)
        return out
