"""Type stub of the compiled module ``deviceop._core._op``: DeviceOp, its run protocol, value."""

from collections.abc import Callable, Generator
from types import TracebackType
from typing import Any, Generic, TypeVar

from ._future import DeviceFuture
from ._ledger import ExecutionContext

T = TypeVar("T")
U = TypeVar("U")

SHAREABLE: object

def as_stream(stream: Any) -> Any: ...
def start(op: DeviceOp[Any], stream: Any, label: str) -> tuple[Any, ...]: ...
def run_sync(op: DeviceOp[T], stream: Any, label: str) -> T: ...

class DeviceOp(Generic[T]):
    """A description of GPU work whose output is a ``T``; single use (see ``shared``)."""

    def __init__(self) -> None: ...
    def _run(self, cx: ExecutionContext) -> T: ...
    def _take(self, by: str) -> None: ...
    def _start_sliced(self, stream: Any, label: str, seconds: float) -> tuple[Any, Any, Any]: ...
    def then(self, f: Callable[[T], DeviceOp[U]]) -> DeviceOp[U]:
        """Chain: ``f(output)`` returns the next op, which runs on the same stream after this one."""
    def map(self, f: Callable[[T], U]) -> DeviceOp[U]:
        """Transform the output on the host with ``f(output)`` (runs when the op is enqueued)."""
    def inspect(self, f: Callable[[T], object]) -> DeviceOp[T]:
        """Call ``f(output)`` for its side effect when the op is enqueued; pass the output on."""
    def first(self) -> DeviceOp[Any]:
        """The first element of a tuple output."""
    def last(self) -> DeviceOp[Any]:
        """The last element of a tuple output."""
    def shared(self) -> DeviceOp[T]:
        """An op that executes this one once; every consumer gets the same output."""
    def sync(self) -> T:
        """Run on the next pool stream, wait for completion, return the output."""
    def sync_on(self, stream: Any) -> T:
        """Run on ``stream``, wait for completion, return the output."""
    def __await__(self) -> Generator[Any, None, T]:
        """``await op``: run on the next pool stream; resume the task when the work is complete."""
    def wait(self, timeout: float | None = None, stream: Any = None) -> _Awaitable[T]:
        """``await op.wait(timeout=s, stream=st)``: ``await op`` with a timeout and a chosen stream."""
    def graph(self, stream: Any = None) -> CudaGraph[T]:
        """Record this op into a CudaGraph (nothing runs now)."""
    def submit(self, stream: Any = None) -> DeviceFuture[T]:
        """Run on ``stream`` (default: the next pool stream) without waiting; return a future."""

class _Awaitable(Generic[T]):
    def __await__(self) -> Generator[Any, None, T]: ...

class Shared(DeviceOp[T]):
    """Runs its source once, under a lock, in the first consumer's execution."""

    def __init__(self, src: DeviceOp[T]) -> None: ...

class Value(DeviceOp[T]):
    """An op whose output is a given Python value."""

    x: T
    def __init__(self, x: T) -> None: ...

class Chain(DeviceOp[T]):
    """A then / map / inspect step after an op."""

class Each(DeviceOp[list[tuple[bool, Any]]]):
    """Several ops run in order as one execution, each keeping its own outcome."""

    ops: list[DeviceOp[Any]]

    def __init__(self, ops: list[DeviceOp[Any]]) -> None: ...

def is_op(x: object) -> bool:
    """True if ``x`` is a DeviceOp."""

def value(x: T) -> Value[T]:
    """An op that yields ``x``."""

def chain(op: DeviceOp[Any], kind: str, f: Callable[..., Any]) -> Chain[Any]: ...

class Slices:
    """The rest of a chain's enqueue, run a slice of host time at a time (``start_sliced``)."""

    slices: int
    @property
    def output(self) -> Any:
        """The chain's output, once :meth:`run` returned True."""
    def run(self, seconds: float) -> bool:
        """Enqueue the next steps for about ``seconds`` of host time; True once all are."""

def start_sliced(op: DeviceOp[Any], stream: Any, label: str, seconds: float) -> tuple[Any, Any, Slices | None]:
    """:func:`start` in slices of about ``seconds`` of host time for a chain."""

class GraphBase:
    """The compiled part of a CudaGraph: what its replays read, and its launch count."""

    backend: Any
    launches: int
    def _set_replay(self, ex: Any, regions: Any, output: Any) -> None: ...

class GraphLaunch(DeviceOp[T], Generic[T]):
    """One replay of a recorded graph: an op whose output is the recorded op's output."""

class Recording:
    """What a scope recorded: the driver graph, the outputs and every region the work touches."""

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
    ) -> None: ...

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

    backend: Any
    launches: int
    last_update: str
    updates: dict[str, int]

    def __init__(self, backend: Any, rec: Recording) -> None: ...
    def _install(self, rec: Recording, ex: Any) -> None: ...
    @property
    def nodes(self) -> int:
        """The number of recorded work items (kernel launches, copies, memsets)."""

    @property
    def output(self) -> T:
        """What a replay yields (see the class docstring)."""

    def __repr__(self) -> str: ...
    def launch(self) -> DeviceOp[T]:
        """An op that replays the graph once, on the stream of the terminal that drives it."""

    def update(self, op: DeviceOp[Any]) -> str:
        """Re-record ``op`` and make this graph replay it instead; return what happened.

        ``"updated"``: the executable graph was updated in place (``cuGraphExecUpdate``: the
        same structure with other buffers or scalars), the cheap path. ``"reinstantiated"``:
        the structure differs, so a new executable graph was built. Replays already enqueued
        run the old work; later ones run the new.
        """

    def _replace(self, rec: Recording) -> str:
        """Point this graph at a new recording, in place if the driver can (called by a scope)."""

class GraphScope:
    """Records ops into a graph instead of running them; ``graph`` holds it after the block.

    Nothing runs while recording: ``record(op)`` enqueues the op's work into the recording and
    returns its output (tensors the later records may use). Allocating ops and anything that
    waits (``sync``, ``await``, ``submit``, ``t.numpy()``) raise :class:`CaptureError` at record
    time. The recording always ends when the block does, also on an exception, in which case
    there is no graph. Recording runs on a private stream in thread-local capture mode, so other
    threads' GPU work goes on undisturbed.
    """

    def __init__(self, stream: Any = None, update: CudaGraph[Any] | None = None) -> None: ...
    def __repr__(self) -> str: ...
    def __enter__(self) -> GraphScope: ...
    def record(self, op: DeviceOp[T]) -> T:
        """Record ``op`` (consuming it) without running it; return its output."""

    def keep(self, obj: Any) -> None:
        """Keep ``obj`` alive as long as the graph replays this recording (for adapters whose
        library's recorded work uses memory only ``obj`` owns, such as a PyTorch memory pool)."""

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None: ...
    def _release(self, be: Any, stream: Any) -> None: ...
    @property
    def graph(self) -> CudaGraph[Any]:
        """The recorded graph (after the with-block)."""

    @property
    def update_result(self) -> str:
        """For ``scope(update=g)``: ``"updated"`` (in place) or ``"reinstantiated"``."""

def scope(stream: Any = None, update: CudaGraph[Any] | None = None) -> GraphScope:
    """``with do.graph.scope() as s: s.record(op)``; then ``s.graph`` is the :class:`CudaGraph`.

    ``stream``: record on this pool stream instead of a private one (no other thread may use it
    meanwhile). ``update``: an existing graph to point at the new recording, updated in place
    when the structure is the same (see :meth:`CudaGraph.update`).
    """

def capture(op: DeviceOp[T], stream: Any = None) -> CudaGraph[T]:
    """Record ``op`` into a new graph (``op.graph()``)."""
