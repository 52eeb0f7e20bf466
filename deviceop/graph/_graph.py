"""CudaGraph: a recorded, instantiated graph; ``launch()`` is the replay as a DeviceOp."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, TypeVar

from .._core._base import LOCK
from .._core._op import DeviceOp
from .._core._replay import GraphBase, GraphLaunch

__all__ = ["HOOKS", "CudaGraph", "GraphLaunch", "Recording"]

T = TypeVar("T")

#: set by _scope when imported (it imports this module): "scope"
HOOKS: dict[str, Any] = {}


class Recording:
    """What a scope recorded: the driver graph, the outputs and every region the work touches."""

    __slots__ = ("buffers", "keep", "nodes", "outputs", "raw", "regions", "stream")
    raw: Any
    outputs: list[Any]
    buffers: list[Any]
    regions: tuple[Any, ...]
    nodes: int
    stream: Any
    keep: tuple[Any, ...]

    def __init__(
        self,
        raw: Any,
        outputs: list[Any],
        buffers: list[Any],
        regions: tuple[Any, ...],
        nodes: int,
        stream: Any,
        keep: tuple[Any, ...] = (),
    ) -> None:
        self.raw = raw
        self.outputs = outputs
        self.buffers = buffers
        self.regions = regions
        self.nodes = nodes
        self.stream = stream
        self.keep = keep  # what the recorded work needs alive besides buffers (another library's memory pool)


class CudaGraph(GraphBase, Generic[T]):
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

    # slots: a replay's ``g.launch()`` finds its method without an instance dictionary
    __slots__ = ("__weakref__", "_exec", "_output", "_rec", "last_update", "updates")
    backend: Any
    launches: int
    last_update: str
    updates: dict[str, int]

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
        self._output: Any = outs[0] if len(outs) == 1 else tuple(outs)
        # what a replay reads (compiled fields, set together under the ledger lock): the
        # executable graph, the regions its work touches, the output
        self._set_replay(ex, tuple(tuple(r) for r in rec.regions), self._output)

    @property
    def nodes(self) -> int:
        """The number of recorded work items (kernel launches, copies, memsets)."""
        return self._rec.nodes

    @property
    def output(self) -> T:
        """What a replay yields (see the class docstring)."""
        out: T = self._output  # the recorded op's output, a T
        return out

    def __repr__(self) -> str:
        return f"<CudaGraph {self.nodes} nodes on {self.backend.device_label}, {self.launches} launches>"

    if TYPE_CHECKING:

        def launch(self) -> DeviceOp[T]:
            """An op that replays the graph once, on the stream of the terminal that drives it."""
            ...

    def update(self, op: DeviceOp[Any]) -> str:
        """Re-record ``op`` and make this graph replay it instead; return what happened.

        ``"updated"``: the executable graph was updated in place (``cuGraphExecUpdate``: the
        same structure with other buffers or scalars), the cheap path. ``"reinstantiated"``:
        the structure differs, so a new executable graph was built. Replays already enqueued
        run the old work; later ones run the new.
        """
        with HOOKS["scope"](update=self) as s:
            s.record(op)
        return self.last_update

    def _replace(self, rec: Recording) -> str:
        """Point this graph at a new recording, in place if the driver can (called by a scope)."""
        graphs = self.backend.graphs
        with LOCK:  # not while a launch on another thread reads the executable graph
            old = self._exec
            if old is not None and rec.nodes and self._rec.nodes == rec.nodes and graphs.update(old, rec.raw):
                how, ex = "updated", old
            else:
                how, ex = "reinstantiated", None
        if ex is None and rec.nodes:
            ex = graphs.instantiate(rec.raw, rec.stream)
        with LOCK:
            self._install(rec, ex)
        self.last_update = how
        self.updates[how] += 1
        return how
