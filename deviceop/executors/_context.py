"""ExecutionContext: one execution of an op tree on one stream."""

from __future__ import annotations

from typing import Any, Callable

from .._errors import CaptureError
from ..device import _ledger
from ..device._capture import CAPTURE

__all__ = ["ExecutionContext", "CAPTURE", "refuse_in_capture", "context_maker"]


def refuse_in_capture(what: str) -> None:
    """Raise CaptureError if this thread is recording a graph: ``what`` would wait or run now."""
    sc = CAPTURE.scope
    if sc is not None:
        raise CaptureError(
            f"{what} inside a graph recording: a graph records GPU work, it cannot wait for "
            f"results or run other work now ({sc!r} is recording on this thread). Run it before "
            "or after the scope, and record only the ops themselves"
        )


class ExecutionContext:
    """The stream an execution runs on, the buffers it touches and what to do when it is done.

    Built by a terminal (``sync``, ``submit``...). ``buffers`` keeps every touched buffer alive
    until :meth:`finish`, which the terminal calls once the stream has passed the execution's
    last work; only then are the ledger entries dropped and staging memory returned.
    """

    __slots__ = (
        "stream", "sh", "backend", "buffers", "done", "label", "op", "capturing", "captured", "children",
        "_event", "_sealed", "_waited", "_done_cbs", "_waited_on",
    )

    def __init__(self, stream: Any, label: str = "op", op: Any = None) -> None:
        self.stream = stream
        self.sh = getattr(stream, "handle_int", 0)  # the stream handle, for the native launch paths
        self.op = op
        self.backend = stream.backend
        self.buffers: list[Any] = []
        self.done = False
        self.label = label
        self.capturing = False
        # while recording a graph: (buffer id, lo, hi, write) -> (buffer, lo, hi, write)
        self.captured: dict[tuple[int, int, int, bool], tuple[Any, int, int, bool]] | None = None
        self.children: tuple[ExecutionContext, ...] = ()  # (tuples: most executions have none)
        self._event: Any = None
        self._sealed = False
        self._waited: tuple[ExecutionContext, ...] = ()
        self._done_cbs: list[Callable[[], Any]] | None = None
        # another execution's stream waited on this one (and remembers it in its _waited): the
        # native graph replay then never reuses this context for a later replay
        self._waited_on = False

    def describe(self) -> str:
        what = f" of {self.op!r}" if self.op is not None else ""
        return f"{self.label}{what} on {self.stream!r}"

    def __repr__(self) -> str:
        return f"<ExecutionContext {self.describe()}{' done' if self.done else ''}>"

    # -- cross-stream ordering (called with the ledger lock held) ----------------------------
    def completion_event(self) -> Any:
        """An event that completes when the work enqueued so far by this execution is done."""
        ev = self._event
        if ev is None or not self._sealed:
            ev = self.backend.new_event()
            self.stream.record(ev)
            self._event = ev
        return ev

    def wait_for(self, other: "ExecutionContext") -> None:
        """Make this execution's stream wait for ``other``'s work so far."""
        if other in self._waited:
            return
        other._waited_on = True
        self.stream.wait(other.completion_event())
        self._waited += (other,)

    # -- fork / join (zip) ----------------------------------------------------------------------
    def fork(self, stream: Any, after: Any) -> "ExecutionContext":
        """A child execution on ``stream`` that starts after event ``after`` (recorded on ours)."""
        child = ExecutionContext(stream, f"{self.label} (zip branch)")
        stream.wait(after)
        self.children += (child,)
        return child

    def join(self, child: "ExecutionContext") -> None:
        """Make our stream wait for everything the child enqueued so far."""
        ev = self.backend.new_event()
        child.stream.record(ev)
        self.stream.wait(ev)
        child._event = ev
        child._sealed = True

    # -- completion ----------------------------------------------------------------------------
    def seal(self) -> Any:
        """Record the completion event after the last work of this execution; return it."""
        ev = self.backend.new_event()
        self.stream.record(ev)
        self._event = ev
        self._sealed = True
        return ev

    def poll(self) -> bool:
        """True once the execution is known to be complete."""
        if self.done:
            return True
        ev = self._event
        if self._sealed and ev is not None:
            try:
                return ev.query()
            except Exception:
                return True  # a failed context runs nothing more
        return False

    def on_done(self, cb: Callable[[], Any]) -> None:
        """Run ``cb`` (on the thread that observes completion) once the work has completed."""
        if self.capturing:  # a replay would not run it: refuse instead of returning stale results
            raise CaptureError(
                "this work needs a host step when the work "
                "completes (a staging copy to or from host memory), which a graph replay cannot run; "
                "copy before or after the scope"
            )
        if self._done_cbs is None:
            self._done_cbs = []
        self._done_cbs.append(cb)

    def finish(self, ok: bool = True) -> None:
        """Mark complete: run completion callbacks, forget ledger entries, drop buffers."""
        if self.done:
            return
        self.done = True
        for child in self.children:  # joined into our stream: complete when we are
            child.finish(ok)
        cbs, self._done_cbs = self._done_cbs, None
        try:
            for cb in cbs or ():
                try:
                    cb()  # staging copies and releases: run even after a failure (frees memory)
                except Exception:
                    if ok:
                        raise
        finally:
            _ledger.release(self)
            self.buffers = []
            self._waited = ()
            self.op = None


def context_maker() -> Any:
    """A native factory ``make(stream, sh, backend, op, label)`` of ExecutionContexts, or None.

    It builds what ``ExecutionContext(stream, label, op)`` builds without running ``__init__``
    (the defaults are read from an instance that ``__init__`` built): the native graph replay
    (``replay_core`` in ``_native.c``) makes one when its graph has none parked.
    """
    from types import SimpleNamespace

    from ..device import _fast

    proto = ExecutionContext(SimpleNamespace(backend=None, handle_int=0))
    return _fast.maker(ExecutionContext, ("stream", "sh", "backend", "op", "label"), proto)
