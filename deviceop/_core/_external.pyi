"""Type stub of the compiled module ``deviceop._core._external``: the op of ``do.external``.

Names not declared here are internal to the core and typed ``Any``.
"""

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from ._base import Buffer
from ._op import DeviceOp

T = TypeVar("T")

HOOKS: dict[str, Any]
inside: Any

class External(DeviceOp[T], Generic[T]):
    """The op :func:`~deviceop.interop.external` returns; its output is what ``fn`` returns."""

    fn: Callable[..., T]
    args: tuple[Any, ...]
    acc: list[Any]
    post: Callable[[Any, Any, tuple[Any, ...]], tuple[Any, list[Any]]] | None
    label: str | None
    def __init__(
        self,
        fn: Callable[..., T],
        args: tuple[Any, ...],
        reads: Any = (),
        writes: Any = (),
        post: Callable[[Any, Any, tuple[Any, ...]], tuple[Any, list[Any]]] | None = None,
        label: str | None = None,
    ) -> None: ...

def named(items: Any, what: str) -> tuple[Any, ...]:
    """``reads``/``writes`` as a tuple; a bare array or anything else is refused."""

def seen(obj: Any, be: Any, write: bool) -> tuple[Any, int, int, bool] | None:
    """The ledger access ``(buffer, lo, hi, write)`` of a PyTorch tensor described before on
    device ``be`` and unchanged since, else None."""

def wrapper(be: Any, start: int, nbytes: int, host: Any, owner: Any, accesses: list[Any]) -> Buffer:
    """A Buffer of foreign memory [start, start + nbytes) on device ``be`` that keeps ``owner``
    alive and shares the region's access list ``accesses``."""

def remember(obj: Any, ptr: int, shape: Any, be: Any, buf: Any, lo: int, hi: int) -> None:
    """Keep what describing PyTorch tensor ``obj`` found, for :func:`seen` (held weakly)."""

def new_external(fn: Callable[..., T], args: tuple[Any, ...], reads: Any, writes: Any) -> External[T]:
    """``External(fn, args, reads, writes)`` without the constructor's argument parsing."""

def __getattr__(name: str) -> Any: ...
