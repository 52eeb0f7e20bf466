"""Type stub of the compiled module ``deviceop._core._base``: buffers and the tensor and partition bases.

Names not declared here are internal to the core and typed ``Any``.
"""

from typing import Any, TypeGuard, TypeVar

from .._dtypes import DType

class StreamBase:
    """The compiled part of every backend's stream."""

    backend: Any
    handle_int: int

class Buffer:
    """Device memory (or a host array on the host backend) and its access list."""

    backend: Any
    ptr: int
    nbytes: int
    host: Any
    owner: Any
    accesses: list[Any]
    last_stream: Any
    def __init__(
        self, backend: Any, ptr: Any, nbytes: int, host: Any = None, owner: Any = None, stream: Any = None
    ) -> None: ...
    def describe(self) -> str: ...

class TensorBase:
    """Fields of a Tensor, declared once for the core."""

    buffer: Buffer
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: DType
    offset: int
    size: int
    addr: int
    def __init__(
        self,
        buffer: Buffer,
        shape: tuple[int, ...],
        dtype: Any,
        strides: tuple[int, ...] | None = None,
        offset: int = 0,
    ) -> None: ...
    @property
    def _span(self) -> tuple[int, int]:
        """The byte range [lo, hi) of the buffer that this view can touch."""

_T = TypeVar("_T", bound=TensorBase)

def tensor_at(
    cls: type[_T], buf: Buffer, shape: tuple[int, ...], dtype: Any, strides: tuple[int, ...], offset: int
) -> _T:
    """What ``cls(buf, shape, dtype, strides, offset)`` makes; a contiguous one from the
    buffer's start without working out its layout again."""

class PartitionBase:
    """Fields of a Partition, declared once for the core."""

    tensor: Any
    tile: tuple[int, ...]
    grid: tuple[int, ...]
    def __init__(self, tensor: TensorBase, tile: tuple[int, ...], grid: tuple[int, ...]) -> None: ...

def plain_shape(shape: object) -> TypeGuard[tuple[int, ...]]:
    """Whether ``shape`` is already a shape: a tuple of non-negative Python ints (not bools)."""

def foreign_of(t: TensorBase) -> Any:
    """What a layer above keeps for tensor ``t`` as another library sees it (None: nothing yet)."""

def set_foreign(t: TensorBase, view: Any) -> None:
    """Keep ``view`` for tensor ``t`` (None: forget it); it must not hold ``t`` itself."""

def known_partition(cls: type[Any], tensor: TensorBase, tile: object) -> Any:
    """A ``cls`` partition of ``tensor`` into tiles ``tile`` if this layout and tile were validated before, else None."""

def remember_partition(p: PartitionBase) -> None:
    """Let later partitions of ``p``'s layout and tile skip validation."""

class BlockCache:
    """Idle device memory blocks kept for reuse."""

    live: int
    cached: int
    def give_block(self, ptr: int, size: int) -> None: ...
    def drain(self) -> list[tuple[int, int]]: ...

def count_recording(delta: int) -> int: ...
def set_current(driver: Any) -> None: ...
def swap_current(driver: Any) -> int: ...
def restore_current(driver: Any, prev: int) -> None: ...
def driver_alloc(driver: Any, be: Any, stream: Any, nbytes: int) -> Buffer: ...
def staged_upload(driver: Any, stream: int, dst: int, src: Any) -> Any:
    """Enqueue a staged copy of array ``src`` to device address ``dst``; what to call at completion, or None."""

def staged_download(driver: Any, stream: int, src: int, out: Any) -> Any:
    """Enqueue a staged copy from device address ``src`` into array ``out``; what to call at completion (it fills ``out``), or None."""

def staging_blocks(driver: Any) -> dict[int, int]:
    """Idle staging blocks of ``driver`` by size class."""

class Lent:
    """A page-locked block lent to the numpy array a copy from the device returns."""

    def __call__(self) -> None: ...

def set_fresh_tensor_hook(fn: Any) -> Any:
    """Call ``fn(tensor)`` with every tensor an allocation makes from now on (None: stop);
    returns the hook set before."""

def lent_bytes() -> int:
    """Page-locked bytes lent to result arrays now (for tests and diagnostics)."""

def set_lend_cap(nbytes: int) -> int:
    """Lend at most ``nbytes`` of page-locked memory to result arrays; returns the previous cap."""

def __getattr__(name: str) -> Any: ...
