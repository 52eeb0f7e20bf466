"""Type stub of the compiled module ``deviceop._core._op``: DeviceOp, its run protocol, value."""

from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

from ..graph._graph import CudaGraph
from ._future import DeviceFuture
from ._ledger import ExecutionContext

T = TypeVar("T")
U = TypeVar("U")

class _Hooks(dict[str, Any]):
    load_from: dict[str, str]

HOOKS: _Hooks
SHAREABLE: object

def as_stream(stream: Any) -> Any: ...
def start(op: DeviceOp[Any], stream: Any, label: str) -> tuple[Any, ...]: ...
def hand_over(cx: Any, stream: Any, ev: Any = None) -> int: ...
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
