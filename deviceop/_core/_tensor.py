"""Tensor (a typed, strided view of a Buffer) and Partition (an exclusive split into tiles)."""

from __future__ import annotations

import inspect
import math
from typing import Any

import numpy as np

from .._dtypes import DType
from .._errors import BackendError, BorrowError, DTypeError, ShapeError, TensorIndexError
from ._base import (
    LOCK,
    PartitionBase,
    TensorBase,
    contiguous_strides,
    known_partition,
    plain_shape,
    remember_partition,
)
from ._guards import refuse_on_loop
from ._ledger import every_in_flight, in_flight, lost
from ._op import run_sync
from ._regions import export
from ._select import current, next_stream
from ._transfer import ToNumpy

__all__ = ["Partition", "Tensor", "as_shape"]


def as_shape(shape: Any, what: str = "shape") -> tuple[int, ...]:
    """Normalize an int or a sequence of ints into a shape tuple, rejecting bad input."""
    if plain_shape(shape):
        return shape  # the common case, already a shape
    if isinstance(shape, (bool, np.bool_)):
        raise ShapeError(f"{what} must be an int or a sequence of ints, got {shape!r} (a bool)")
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    try:
        out = tuple(int(s) for s in shape)
    except (TypeError, ValueError):
        raise ShapeError(f"{what} must be an int or a sequence of ints, got {shape!r}") from None
    if any(s < 0 for s in out) or any(
        isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, np.integer)) for s in shape
    ):
        raise ShapeError(f"{what} {shape!r} must contain non-negative integers")
    return out


class Tensor(TensorBase):
    """A typed view of device memory: ``shape``, ``dtype``, element ``strides``, byte ``offset``.

    ``Tensor(buffer, shape, dtype, strides=None, offset=0)`` (:class:`ShapeError` where the view
    would reach outside ``buffer``); ``addr`` is the first element's address. Views (``view``, ``t[...]``) share the buffer. Tensors are produced by ops
    (``zeros``, ``from_numpy``...) and returned by ops that use them; while work that uses one is
    in flight, host access (``numpy()``) raises :class:`BorrowError`. The fields are read-only.
    """

    __slots__ = ()

    # ---- metadata -------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes covered by the elements (size * itemsize)."""
        return self.size * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    @property
    def device(self) -> str:
        """Where the memory lives: its device's label, ``"cuda:0"`` or ``"host:0"``."""
        label: str = self.buffer.backend.device_label
        return label

    @property
    def ptr(self) -> int:
        """Address of the first element (host backend: address in host memory)."""
        return self.addr

    @property
    def span(self) -> tuple[int, int]:
        """The byte range [lo, hi) of the buffer that this view can touch."""
        return self._span

    def is_contiguous(self) -> bool:
        """True when elements are laid out densely in row-major order."""
        return self.size <= 1 or self.strides == contiguous_strides(self.shape)

    def __repr__(self) -> str:
        return f"Tensor(shape={self.shape}, dtype={self.dtype.name}, device={self.device!r})"

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    # ---- views ----------------------------------------------------------------------------
    def view(self, shape: Any) -> Tensor:
        """The same memory with another shape (one dimension may be -1). Needs a contiguous tensor."""
        if isinstance(shape, (int, np.integer)):
            shape = (int(shape),)
        try:
            shape = tuple(int(s) for s in shape)
        except (TypeError, ValueError):
            raise ShapeError(f"view shape must be an int or a tuple of ints, got {shape!r}") from None
        if shape.count(-1) > 1:
            raise ShapeError(f"view {shape}: at most one dimension may be -1")
        if -1 in shape:
            known = math.prod(s for s in shape if s != -1)
            if known == 0 or self.size % known:
                raise ShapeError(f"cannot view {self.shape} as {shape}: sizes do not divide")
            shape = tuple(self.size // known if s == -1 else s for s in shape)
        shape = as_shape(shape, "view shape")
        if math.prod(shape) != self.size:
            raise ShapeError(
                f"cannot view a tensor of shape {self.shape} ({self.size} elements) as {shape} "
                f"({math.prod(shape)} elements); the element counts must match"
            )
        if not self.is_contiguous():
            raise ShapeError(
                f"view needs a contiguous tensor, but this one has strides {self.strides}; "
                "copy it first (do.kernels.copy or to_numpy/from_numpy)"
            )
        return Tensor(self.buffer, shape, self.dtype, None, self.offset)

    def __getitem__(self, key: Any) -> Tensor:
        if not isinstance(key, tuple):
            key = (key,)
        if any(k is Ellipsis for k in key):
            i = key.index(Ellipsis)
            key = key[:i] + (slice(None),) * (self.ndim - len(key) + 1) + key[i + 1 :]
        if len(key) > self.ndim:
            raise ShapeError(f"too many indices ({len(key)}) for a tensor of {self.ndim} dimensions")
        offset = self.offset
        shape: list[int] = []
        strides: list[int] = []
        it = self.dtype.itemsize
        for d, k in enumerate(key):
            n, st = self.shape[d], self.strides[d]
            if isinstance(k, (int, np.integer)):
                i = int(k) + (n if k < 0 else 0)
                if not 0 <= i < n:
                    raise TensorIndexError(f"index {int(k)} is out of range for dimension {d} of size {n}")
                offset += i * st * it
            elif isinstance(k, slice):
                if k.step is not None and not isinstance(k.step, (int, np.integer)):
                    raise ShapeError(f"slice steps are ints, got {k.step!r}")
                if k.step is not None and k.step <= 0:
                    raise ShapeError("negative or zero slice steps are not supported; use numpy for that")
                start, stop, step = k.indices(n)
                if step <= 0:
                    raise ShapeError("negative or zero slice steps are not supported; use numpy for that")
                cnt = max(0, (stop - start + step - 1) // step)
                offset += start * st * it if cnt else 0
                shape.append(cnt)
                strides.append(st * step)
            else:
                raise ShapeError(f"index {k!r} is not supported; use ints and slices")
        shape.extend(self.shape[len(key) :])
        strides.extend(self.strides[len(key) :])
        return Tensor(self.buffer, tuple(shape), self.dtype, tuple(strides), offset)

    @property
    def T(self) -> Tensor:
        """The transposed view (dimensions reversed), sharing memory, as numpy's ``.T``."""
        return Tensor(self.buffer, self.shape[::-1], self.dtype, self.strides[::-1], self.offset)

    def partition(self, tile: Any) -> Partition:
        """Split this tensor into exclusive tiles of shape ``tile``; gives a kernel's launch grid."""
        p = known_partition(Partition, self, tile)
        if p is None:
            p = Partition(self, tile)  # validates
            remember_partition(p)
        return p  # type: ignore[no-any-return]

    # ---- host access ----------------------------------------------------------------------
    def check_host_access(self, verb: str = "read") -> None:
        """Raise BorrowError if work that touches this tensor's memory is still in flight
        (BackendError if its device is the parent's, in a process made by fork())."""
        why = lost(self.buffer.backend)
        if why is not None:  # (its work would never be seen to complete)
            raise BackendError(f"cannot {verb} {self!r} from the host: {why}")
        ex = in_flight(self.buffer, *self._span)
        if ex is not None:
            raise BorrowError(
                f"cannot {verb} {self!r} from the host: {ex.describe()} that uses it is still in "
                "flight. sync()/await the op that produced it first, or read it with "
                "do.to_numpy(t) as part of the pipeline."
            )

    def numpy(self) -> np.ndarray:
        """Copy to a new numpy array (blocking), on a stream of the tensor's own device (whatever
        device is selected). Raises BorrowError while the tensor is in flight, and UsageError on
        a thread that runs an event loop (the copy waits behind whatever its stream runs):
        ``await do.to_numpy(t)`` there."""
        self.check_host_access()
        refuse_on_loop(f"{self!r}.numpy()")
        be = self.buffer.backend
        op = ToNumpy(self)
        op._take("numpy()")
        out: np.ndarray = run_sync(op, next_stream() if be is current() else be.streams[0], "numpy()")
        return out

    # ---- interop --------------------------------------------------------------------------
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        if not self.buffer.backend.cuda_memory:
            raise AttributeError("__cuda_array_interface__ exists only for tensors on the cuda backend")
        if self.dtype.name == "bfloat16":
            raise DTypeError("__cuda_array_interface__ has no bfloat16 type; use DLPack (torch.from_dlpack(t))")
        it = self.dtype.itemsize
        return {
            "shape": self.shape,
            "typestr": self.dtype.np_dtype.str,
            "data": (self.ptr, False),
            "strides": None if self.is_contiguous() else tuple(s * it for s in self.strides),
            "version": 3,
            "stream": self._producing_stream(),
        }

    def _producing_stream(self) -> int | None:
        """The stream a ``__cuda_array_interface__`` consumer synchronises with: the one of the
        work in flight on this tensor; where that work runs on several streams, the last of them,
        made to wait for the others' work so far (a consumer may read what any of it writes, or
        write what any of it reads); None where nothing is in flight."""
        found = every_in_flight(self.buffer, *self._span)
        if not found:
            return None
        last = found[-1].stream
        for ex in found[:-1]:
            if ex.stream is not last:
                with LOCK:
                    ev = ex.completion_event()
                last.wait(ev)
        return int(last.handle_int)

    def __dlpack__(
        self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None, copy: Any = None
    ) -> Any:
        return export(self, stream)

    def __dlpack_device__(self) -> tuple[int, int]:
        dev: tuple[int, int] = self.buffer.backend.dlpack_device
        return dev


# the constructor is compiled (TensorBase), so inspect.signature cannot read it: say it here
Tensor.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [
        inspect.Parameter("buffer", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="Buffer"),
        inspect.Parameter("shape", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="tuple[int, ...]"),
        inspect.Parameter("dtype", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="DType"),
        inspect.Parameter("strides", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None),
        inspect.Parameter("offset", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=0),
    ]
)


class Partition(PartitionBase):
    """An exclusive split of ``tensor`` into tiles of shape ``tile``.

    Passed to a kernel, a partition is written (each program owns one tile) and gives the grid:
    ``grid[d] = tensor.shape[d] // tile[d]``. Tiles must divide the tensor exactly.
    """

    __slots__ = ()

    def __init__(self, tensor: Tensor, tile: Any) -> None:
        if isinstance(tensor, Partition):
            raise ShapeError("cannot partition a partition; partition its .tensor instead")
        if not isinstance(tensor, TensorBase):
            raise ShapeError(f"a partition splits a deviceop Tensor, got {type(tensor).__name__}")
        tile = as_shape(tile, "tile shape")
        shape = tensor.shape
        if len(tile) != len(shape):
            raise ShapeError(
                f"tile shape {tile} has {len(tile)} dimensions but the tensor has shape "
                f"{shape}; give one tile extent per dimension"
            )
        if len(tile) > 3:
            raise ShapeError(f"partitions have at most 3 dimensions (a CUDA grid), got {len(tile)}")
        grid = []
        for d in range(len(tile)):
            t, s = tile[d], shape[d]
            if t == 0:
                raise ShapeError(f"tile shape {tile} has a zero extent; tiles must be non-empty")
            if s % t:
                raise ShapeError(
                    f"tile shape {tile} does not divide tensor shape {shape}: dimension {d} has "
                    f"{s} elements, not a multiple of {t}. Pick a tile that divides it, or pad the tensor."
                )
            grid.append(s // t)
        PartitionBase.__init__(self, tensor, tile, tuple(grid))

    @property
    def shape(self) -> tuple[int, ...]:
        """The partitioned tensor's shape."""
        shape: tuple[int, ...] = self.tensor.shape
        return shape

    @property
    def dtype(self) -> DType:
        """The partitioned tensor's dtype."""
        dt: DType = self.tensor.dtype
        return dt

    def __repr__(self) -> str:
        return f"Partition({self.tensor!r}, tile={self.tile}, grid={self.grid})"
