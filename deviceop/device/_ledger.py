"""The access ledger: program order across a pool of streams.

Every buffer keeps a short list of accesses by executions that have not been seen to finish:
``[execution, lo, hi, write]`` with ``lo``/``hi`` byte offsets into the buffer. When an
execution touches a region, earlier unfinished accesses from executions on OTHER streams that
conflict with it (write/any or any/write, overlapping) make the new execution's stream wait
on the earlier execution's completion event. Same-stream work is ordered by the stream itself.

One lock covers "check, launch, register": an execution on another thread cannot slip a
launch in between another execution's check and its registration, so an event recorded on
the earlier execution's stream always covers the conflicting launch.

Finished executions remove their entries (``release``), so the lists stay short.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._errors import BorrowError
from . import _fast

if TYPE_CHECKING:
    from ..executors._context import ExecutionContext
    from ._buffer import Buffer

#: held around check + launch + register; see the module docstring for why (a native lock where
#: the native module is built: its launch paths take it without a Python method call)
LOCK = _fast.make_lock()

_policy = {"mode": "order", "enabled": True}
#: mirrors _policy["enabled"] for the launch path's inlined fast check
ENABLED = [True]


def set_borrow_policy(mode: str) -> None:
    """Choose what a cross-stream conflict does.

    ``"order"`` (default): the later work waits on the earlier work's completion event, so the
    program behaves as if run in issue order. ``"raise"``: raise :class:`BorrowError` naming both
    operations and the buffer instead (strict mode, for finding accidental serialization).
    ``"off"``: no tracking at all (unsafe; only for measuring the ledger's cost).
    """
    if mode not in ("order", "raise", "off"):
        raise ValueError(f"borrow policy {mode!r} is not known; use 'order', 'raise' or 'off'")
    _policy["mode"] = mode
    _policy["enabled"] = ENABLED[0] = mode != "off"


def borrow_policy() -> str:
    """The current borrow policy (see :func:`set_borrow_policy`)."""
    return _policy["mode"]


def touch(cx: "ExecutionContext", buf: "Buffer", lo: int, hi: int, write: bool, what: Any) -> None:
    """Register an access by ``cx``; order it after conflicting in-flight work on other streams.

    Call with LOCK held, right before the launch that performs the access.
    """
    cap = cx.captured
    if cap is not None:
        # recording a graph: nothing runs now, so nothing to order; the replay registers these
        key = (id(buf), lo, hi, write)
        if key not in cap:
            cap[key] = (buf, lo, hi, write)
            cx.buffers.append(buf)
        return
    if not _policy["enabled"]:
        if not cx.buffers or cx.buffers[-1] is not buf:
            cx.buffers.append(buf)  # lifetimes hold even with the ledger off
        return
    acc = buf.accesses
    if acc:
        last = acc[-1]
        if last[0] is cx and last[1] <= lo and last[2] >= hi and (last[3] or not write):
            return  # already covered by this execution (the common chained case)
        stream = cx.stream
        for e in acc:
            ex = e[0]
            if ex is cx or ex.done or ex.stream is stream:
                continue
            if not (write or e[3]) or e[2] <= lo or hi <= e[1]:
                continue
            if _policy["mode"] == "raise":
                kind = "writes" if write else "reads"
                other = "writes" if e[3] else "reads"
                raise BorrowError(
                    f"{what!r} ({cx.describe()}) {kind} bytes [{lo}, {hi}) of {buf.describe()}, while "
                    f"{ex.describe()} still {other} bytes [{e[1]}, {e[2]}) of it. "
                    "Wait for the earlier work (sync/await its result), run both on one stream "
                    "(then/sync_on), or use set_borrow_policy('order') to have deviceop order them."
                )
            cx.wait_for(ex)
    acc.append([cx, lo, hi, write])
    cx.buffers.append(buf)


def _release(cx: "ExecutionContext") -> None:
    """Forget every access of a finished execution."""
    with LOCK:
        for buf in cx.buffers:
            acc = buf.accesses
            if acc:
                buf.accesses = [e for e in acc if e[0] is not cx]


#: the release of finished executions: native (the twin of ``_release``) where built
release = _fast.native.ledger_release if _fast.available() else _release


def in_flight(buf: "Buffer", lo: int, hi: int) -> "ExecutionContext | None":
    """The first unfinished execution touching bytes [lo, hi) of ``buf``, if any."""
    for e in list(buf.accesses):
        ex = e[0]
        if not ex.done and not ex.poll() and e[1] < hi and lo < e[2]:
            return ex
    return None
