"""Type stub of the compiled module ``deviceop._core._external``: the op of ``do.external``.

Names not declared here are internal to the core and typed ``Any``.
"""

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from ._base import Buffer
from ._op import DeviceOp

T = TypeVar("T")

class External(DeviceOp[T], Generic[T]):
    """The op :func:`~deviceop.interop.external` returns; its output is what ``fn`` returns."""

    fn: Callable[..., T]
    args: tuple[Any, ...]
    acc: list[Any]
    post: Callable[[Any, Any, tuple[Any, ...]], tuple[Any, list[Any]]] | None
    label: object  # a str, or an object whose str() is the label; None: none
    namer: Callable[[Any, Any, bool, Any], tuple[Any, ...]]
    host_call: Callable[[Any, Any, tuple[Any, ...], list[Any]], Any]
    def __init__(
        self,
        fn: Callable[..., T],
        args: tuple[Any, ...],
        reads: Any = (),
        writes: Any = (),
        post: Callable[[Any, Any, tuple[Any, ...]], tuple[Any, list[Any]]] | None = None,
        label: object = None,
        *,
        namer: Callable[[Any, Any, bool, Any], tuple[Any, ...]],
        host_call: Callable[[Any, Any, tuple[Any, ...], list[Any]], Any],
    ) -> None: ...

def named(items: Any, what: str) -> tuple[Any, ...]:
    """``reads``/``writes`` as a tuple; a bare array or anything else is refused."""

def seen(obj: Any, be: Any, write: bool) -> tuple[Any, int, int, bool] | None:
    """The ledger access ``(buffer, lo, hi, write)`` of a PyTorch tensor described before on
    device ``be`` and unchanged since (the same object and extent), else None."""

def layout(obj: Any) -> tuple[int, tuple[int, ...], tuple[int, ...], int, int, int, int] | None:
    """``(address, shape, element strides, dtype key, device type, lo, hi)`` of a tensor read in
    one C call through its type's DLPack C exchange API; None where its type publishes none."""

def wrapper(be: Any, start: int, nbytes: int, host: Any, owner: Any, accesses: list[Any]) -> Buffer:
    """A Buffer of foreign memory [start, start + nbytes) on device ``be`` that keeps ``owner``
    alive and shares the region's access list ``accesses``."""

def inside_stream() -> Any:
    """The stream whose :func:`~deviceop.interop.external` fn this thread is running, or None."""

def swap_inside(stream: Any) -> Any:
    """Make ``stream`` (None: none) this thread's :func:`inside_stream`; returns the one before."""

def looked_up() -> int:
    """How many times a PyTorch tensor named was looked for in the cache's dict (for tests)."""

def set_of(obj: Any) -> int:
    """The set of slots an object would occupy in the cache (for tests)."""

def remember(obj: Any, be: Any, buf: Any, lo: int, hi: int) -> None:
    """Keep what describing PyTorch tensor ``obj`` found and its extent now, for :func:`seen`
    (held weakly)."""

def same_layout(obj: Any, t: Any) -> bool:
    """Whether array ``obj`` lies exactly on deviceop tensor ``t`` (address, dtype, shape,
    element strides), read through its type's DLPack C exchange API; False where it has none."""

def extent(obj: Any) -> tuple[int, int]:
    """``(address, size in bytes)`` of a PyTorch tensor as the cache compares it."""

def uses_exchange(tp: type) -> bool:
    """Whether tensors of type ``tp`` are read through the DLPack C exchange API (for tests)."""
