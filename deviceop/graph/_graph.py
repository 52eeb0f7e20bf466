"""CudaGraph: a recorded, instantiated graph; ``launch()`` is the replay as a DeviceOp."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, TypeVar

from .._errors import CaptureError, UsageError
from ..device import _fast, _ledger
from ..ops._base import DeviceOp

__all__ = ["CudaGraph", "GraphLaunch", "Recording"]

T = TypeVar("T")


class _NoReplay:
    """Where the native module is not built: graph launches use DeviceOp's terminals."""

    __slots__ = ()


class _PyGraphBase:
    """Where the native module is not built: ``launch()`` in Python."""

    def launch(self) -> Any:
        """An op that replays the graph once, on the stream of the terminal that drives it."""
        return self._generic_launch()  # type: ignore[attr-defined]


if TYPE_CHECKING or not _fast.available():
    _ReplayBase: type = _NoReplay
    _GraphBase: type = _PyGraphBase
else:  # launch() and sync() / sync_on() of a launch in native calls (the loop of a service), see _native.c
    _ReplayBase = _fast.native.ReplayBase
    _GraphBase = _fast.native.GraphBase


class Recording:
    """What a scope recorded: the driver graph, the outputs and every region the work touches."""

    __slots__ = ("raw", "outputs", "buffers", "regions", "nodes", "stream")

    def __init__(self, raw: Any, outputs: list[Any], buffers: list[Any], regions: tuple[Any, ...], nodes: int, stream: Any) -> None:
        self.raw = raw
        self.outputs = outputs
        self.buffers = buffers
        self.regions = regions
        self.nodes = nodes
        self.stream = stream


class CudaGraph(_GraphBase, Generic[T]):
    """An executable graph of recorded GPU work (a host-backend recording on the host backend).

    ``launch()`` returns a DeviceOp that replays it: sync it, await it, submit it or ``then``
    it. The graph holds every buffer its work references, so they outlive the names that
    created them; each replay registers them with the access ledger like any op, so host
    reads during a replay raise ``BorrowError`` and work on other streams is ordered.

    The replay's output is what the recording produced: the output of the recorded op for
    ``op.graph()`` or a scope with one ``record``; a tuple of the outputs for several.
    Python callbacks in the recorded ops (``map``, ``then``, ``inspect``) ran once, at record
    time; a replay repeats only the GPU work.
    """

    def __init__(self, backend: Any, rec: Recording) -> None:
        self.backend = backend
        self.launches = 0
        #: "captured", then "updated" or "reinstantiated" after each update
        self.last_update = "captured"
        self.updates = {"updated": 0, "reinstantiated": 0}
        self._install(rec, backend.graphs.instantiate(rec.raw, rec.stream) if rec.nodes else None)

    def _install(self, rec: Recording, ex: Any) -> None:
        self._rec = rec
        self._exec = ex
        outs = rec.outputs
        self._output = outs[0] if len(outs) == 1 else tuple(outs)
        be = self.backend
        # the native replay's view (_native.c, replay_core), swapped with the rest under the ledger
        # lock; the last list is where a replay parks its execution context for the next one
        self._fast = (
            (be, int(be.context), ex, getattr(ex, "handle_int", 0), tuple(tuple(r) for r in rec.regions), self._output,
             [None, None])
            if be.name == "cuda" else None
        )

    @property
    def nodes(self) -> int:
        """The number of recorded work items (kernel launches, copies, memsets)."""
        return self._rec.nodes

    @property
    def output(self) -> T:
        """What a replay yields (see the class docstring)."""
        return self._output  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return f"<CudaGraph {self.nodes} nodes on {self.backend.device_label}, {self.launches} launches>"

    if TYPE_CHECKING:

        def launch(self) -> "DeviceOp[T]":
            """An op that replays the graph once, on the stream of the terminal that drives it."""

    def _generic_launch(self) -> "DeviceOp[T]":
        return GraphLaunch(self)

    def update(self, op: DeviceOp[Any]) -> str:
        """Re-record ``op`` and make this graph replay it instead; return what happened.

        ``"updated"``: the executable graph was updated in place (``cuGraphExecUpdate``: the
        same structure with other buffers or scalars), the cheap path. ``"reinstantiated"``:
        the structure differs, so a new executable graph was built. Replays already enqueued
        run the old work; later ones run the new.
        """
        from ._scope import scope

        with scope(update=self) as s:
            s.record(op)
        return self.last_update

    def _replace(self, rec: Recording) -> str:
        """Point this graph at a new recording, in place if the driver can (called by a scope)."""
        graphs = self.backend.graphs
        with _ledger.LOCK:  # not while a launch on another thread reads the executable graph
            old = self._exec
            if old is not None and rec.nodes and self._rec.nodes == rec.nodes and graphs.update(old, rec.raw):
                how, ex = "updated", old
            else:
                how, ex = "reinstantiated", None
        if ex is None and rec.nodes:
            ex = graphs.instantiate(rec.raw, rec.stream)
        with _ledger.LOCK:
            self._install(rec, ex)
        self.last_update = how
        self.updates[how] += 1
        return how


class GraphLaunch(_ReplayBase, DeviceOp[T]):
    """One replay of a :class:`CudaGraph`; its output is the graph's output.

    ``sync()`` and ``sync_on(stream)`` on a pool stream of the graph's backend run in one native
    call where the native module is built; they behave as DeviceOp's (the same ledger
    registration, errors and results).
    """

    __slots__ = ("_g",)

    def __init__(self, g: CudaGraph[T]) -> None:
        self._used = None
        self._g = g

    def __repr__(self) -> str:
        if self._g is None:  # a native replay drops the graph reference of the op it consumed
            return "<launch of a CudaGraph (consumed)>"
        return f"<launch of {self._g!r}>"

    # the generic sync terminals, which ReplayBase's native sync/sync_on fall back to
    def _generic_sync_on(self, stream: Any) -> T:
        return DeviceOp.sync_on(self, stream)

    def _generic_sync(self, stream: Any) -> T:
        if stream is None:
            return DeviceOp.sync(self)
        from ..executors._terminals import run_sync

        self._take("sync()")
        return run_sync(self, stream, "sync()")  # type: ignore[no-any-return]

    def _run(self, cx: Any) -> T:
        g = self._g
        if cx.capturing:
            raise CaptureError(
                f"{self!r} inside a graph recording: graphs do not nest. Record the ops of both "
                "into one scope instead"
            )
        if g.backend is not cx.backend:
            raise UsageError(
                f"{g!r} was recorded on the {g.backend.name} backend, not {cx.backend.name}; record it again there"
            )
        touch = _ledger.touch
        with _ledger.LOCK:
            rec = g._rec
            for buf, lo, hi, write in rec.regions:
                touch(cx, buf, lo, hi, write, self)
            if g._exec is not None:
                g.backend.graphs.launch(g._exec, cx.stream)
            g.launches += 1
            return g._output  # type: ignore[no-any-return]


if _fast.available():  # GraphBase.launch() builds GraphLaunch(g) without running __init__
    _fast.native.set_launch_maker(_fast.maker(GraphLaunch, ("_used", "_g"), GraphLaunch(None)))  # type: ignore[arg-type]
