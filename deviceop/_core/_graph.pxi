# Scoped recording (``with do.graph.scope() as s: s.record(op)``, ``op.graph()``) and CudaGraph, a
# recorded, instantiated graph whose ``launch()`` is the replay (GraphLaunch) as an op. Included
# by _op.pyx: ``op.graph()`` records through this scope, and a graph's replay is an op, so op,
# replay and recording are one compiled module, built from these files.

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
        self._set_replay(ex, tuple(tuple(r) for r in rec.regions), self._output, rec.keep)

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
        with scope(update=self) as s:
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


class GraphScope:
    """Records ops into a graph instead of running them; ``graph`` holds it after the block.

    Nothing runs while recording: ``record(op)`` enqueues the op's work into the recording and
    returns its output (tensors the later records may use). Allocating ops and anything that
    waits (``sync``, ``await``, ``submit``, ``t.numpy()``) raise :class:`CaptureError` at record
    time. The recording always ends when the block does, also on an exception, in which case
    there is no graph. Recording runs on a private stream in thread-local capture mode, so other
    threads' GPU work goes on undisturbed.
    """

    def __init__(self, stream: Any = None, update: CudaGraph[Any] | None = None) -> None:
        if update is not None and not isinstance(update, CudaGraph):
            raise UsageError(f"scope(update=...) takes a CudaGraph to update, got {type(update).__name__}")
        self._given = None if stream is None else as_stream(stream)
        self._update = update
        self._cx: ExecutionContext | None = None
        self._outputs: list[Any] = []
        self._graph: CudaGraph[Any] | None = None
        self._error: BaseException | None = None
        self._keep: list[Any] = []
        self._state = "new"

    def __repr__(self) -> str:
        return f"<graph scope ({self._state}, {len(self._outputs)} records)>"

    def __enter__(self) -> GraphScope:
        if self._state != "new":
            raise UsageError("a graph scope is used once; open a new do.graph.scope() for another recording")
        if CAPTURE.scope is not None:
            raise CaptureError(
                f"graph scopes do not nest ({CAPTURE.scope!r} is already recording on this thread); "
                "record everything into the outer scope"
            )
        be = current() if self._update is None else self._update.backend
        if self._given is not None and self._given.backend is not be:
            raise UsageError(f"{self._given!r} belongs to the {self._given.backend.name} backend, not {be.name}")
        be.make_current()
        stream = self._given if self._given is not None else be.graphs.acquire_stream()
        cx = ExecutionContext(stream, "graph recording")
        cx.capturing = True
        cx.captured = {}
        try:
            be.graphs.begin(stream)
        except BaseException:
            self._release(be, stream)
            raise
        self._cx = cx
        self._state = "recording"
        _capture.begin(self)
        return self

    def record(self, op: DeviceOp[T]) -> T:
        """Record ``op`` (consuming it) without running it; return its output."""
        if self._state != "recording":
            raise UsageError(f"record() works inside the with-block of its scope; this scope is {self._state}")
        if CAPTURE.scope is not self:
            raise UsageError("record() must be called on the thread that opened the scope")
        if not isinstance(op, DeviceOp):
            raise UsageError(f"record() takes a DeviceOp, got {type(op).__name__}; wrap values in do.value(x)")
        cx = self._cx
        assert cx is not None  # set while the scope is recording (checked above)
        op._take("graph record()")
        try:
            out = op._run(cx)
        except BaseException as e:
            # part of the op may already be recorded: this recording cannot become a graph
            self._error = e
            raise
        self._outputs.append(out)
        return out

    def keep(self, obj: Any) -> None:
        """Keep ``obj`` alive as long as the graph replays this recording (for adapters whose
        library's recorded work uses memory only ``obj`` owns, such as a PyTorch memory pool)."""
        if self._state != "recording":
            raise UsageError(f"keep() works while its scope records; this scope is {self._state}")
        self._keep.append(obj)

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        cx = self._cx
        assert cx is not None
        be, stream = cx.backend, cx.stream
        self._state = "closed"
        try:
            try:
                raw = be.graphs.end(stream)  # always end the capture, whatever happened in the block
            except CaptureError as err:
                self._error = self._error or err
                raw = None
                if et is None:
                    raise
            finally:
                _capture.end()
                cx.capturing = False
                _capture.flush()  # destructors that ran while recording
            if et is not None or self._error is not None or raw is None:
                if self._error is None:
                    self._error = e
                cx.captured = None
                cx.finish(ok=False)
                return
            regions = tuple(cx.captured.values())
            cx.captured = None
            rec = Recording(
                raw, self._outputs, list(cx.buffers or ()), regions, be.graphs.nodes(raw), stream, tuple(self._keep)
            )
            cx.buffers = []  # the recording holds them now; the context held no ledger entries
            cx.finish()
            if self._update is not None:
                self._update._replace(rec)
                self._graph = self._update
            else:
                self._graph = CudaGraph(be, rec)
        finally:
            # after the upload that instantiation enqueues on it: a stream back in the pool may
            # start another recording at once
            self._release(be, stream)

    def _release(self, be: Any, stream: Any) -> None:
        if self._given is None:
            be.graphs.release_stream(stream)

    @property
    def graph(self) -> CudaGraph[Any]:
        """The recorded graph (after the with-block)."""
        if self._graph is not None:
            return self._graph
        if self._state != "closed":
            raise UsageError("the graph exists after the with-block ends")
        raise CaptureError(
            f"the recording failed, so there is no graph (partial work is never replayed); the cause: {self._error!r}"
        ) from self._error

    @property
    def update_result(self) -> str:
        """For ``scope(update=g)``: ``"updated"`` (in place) or ``"reinstantiated"``."""
        if self._update is None or self._graph is None:
            raise UsageError("update_result exists after a successful scope(update=graph)")
        return self._update.last_update


def scope(stream: Any = None, update: CudaGraph[Any] | None = None) -> GraphScope:
    """``with do.graph.scope() as s: s.record(op)``; then ``s.graph`` is the :class:`CudaGraph`.

    ``stream``: record on this pool stream instead of a private one (no other thread may use it
    meanwhile). ``update``: an existing graph to point at the new recording, updated in place
    when the structure is the same (see :meth:`CudaGraph.update`).
    """
    return GraphScope(stream, update)


def capture(op: DeviceOp[T], stream: Any = None) -> CudaGraph[T]:
    """Record ``op`` into a new graph (``op.graph()``)."""
    if not isinstance(op, DeviceOp):
        raise UsageError(f"capture() takes a DeviceOp, got {type(op).__name__}")
    with scope(stream) as s:
        s.record(op)
    return s.graph
