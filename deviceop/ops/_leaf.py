"""Leaf ops: value, and the allocating ops zeros / ones / full / empty."""

from __future__ import annotations

import math
from typing import Any, TypeVar

import numpy as np

from .._core._ledger import enqueue
from .._core._op import Value, value
from .._dtypes import DType, as_dtype, float32
from .._errors import CaptureError, DTypeError
from ..device._tensor import Tensor, as_shape
from ._base import DeviceOp

__all__ = ["Value", "Alloc", "value", "zeros", "ones", "full", "empty", "new_tensor", "refuse_allocation"]

T = TypeVar("T")


def refuse_allocation(cx: Any, what: Any) -> None:
    """Raise CaptureError if ``cx`` records a graph: a replay cannot allocate (paper's GraphNode)."""
    if cx.capturing:
        raise CaptureError(
            f"{what!r} allocates device memory, which a graph cannot record: a replay would write "
            "into memory nobody holds. Allocate before the scope (x = do.zeros(...).sync()) and "
            "record ops on the existing tensors"
        )


def new_tensor(cx: Any, shape: tuple[int, ...], dtype: DType, what: Any = "an allocation", fill: Any = None) -> Tensor:
    """Allocate a tensor on ``cx``'s stream, registered as written by the execution.

    ``fill(tensor)``, if given, enqueues the work that initializes it (under the same
    registration, through the ledger's entry point).
    """
    refuse_allocation(cx, what)
    nbytes = math.prod(shape) * dtype.itemsize
    buf = cx.backend.alloc(nbytes, cx.stream)
    t = Tensor(buf, shape, dtype)
    enqueue(cx, ((buf, 0, nbytes, True),), (lambda: fill(t)) if fill is not None else None, what)
    return t


class Alloc(DeviceOp[Tensor]):
    """Allocate a tensor from the stream-ordered pool and optionally fill it."""

    __slots__ = ("shape", "dtype", "fill", "_name")

    allocates = True

    def __init__(self, name: str, shape: Any, dtype: Any, fill: Any) -> None:
        self._name = name
        self.shape = as_shape(shape)
        self.dtype = as_dtype(dtype)
        if fill is not None:
            try:
                arr = np.array(fill, dtype=self.dtype.np_dtype)
            except (TypeError, ValueError, OverflowError) as e:
                raise DTypeError(f"{name}: fill value {fill!r} does not fit {self.dtype.name}: {e}") from None
            if arr.shape != ():
                raise DTypeError(f"{name}: fill value must be a scalar, got shape {arr.shape}")
            if not self.dtype.is_float and arr != fill:
                raise DTypeError(f"{name}: fill value {fill!r} is not representable in {self.dtype.name}")
            fill = arr
        self.fill = fill

    def __repr__(self) -> str:
        return f"<{self._name}{self.shape} {self.dtype.name}>"

    def _run(self, cx: Any) -> Tensor:
        value = self.fill
        if value is None:
            return new_tensor(cx, self.shape, self.dtype, self)

        def fill(t: Tensor) -> None:
            if not t.nbytes:
                return
            pattern = value.tobytes()
            if len(pattern) <= 4:
                cx.backend.memset(t.buffer, 0, t.nbytes, pattern, cx.stream)
            else:
                cx.backend.htod(t.buffer, 0, np.full(self.shape, value, dtype=self.dtype.np_dtype), cx.stream, cx)

        return new_tensor(cx, self.shape, self.dtype, self, fill)


def zeros(shape: Any, dtype: Any = float32) -> DeviceOp[Tensor]:
    """An op that allocates a tensor filled with zeros."""
    return Alloc("zeros", shape, dtype, 0)


def ones(shape: Any, dtype: Any = float32) -> DeviceOp[Tensor]:
    """An op that allocates a tensor filled with ones."""
    return Alloc("ones", shape, dtype, 1)


def full(shape: Any, value: Any, dtype: Any = float32) -> DeviceOp[Tensor]:
    """An op that allocates a tensor filled with ``value``."""
    return Alloc("full", shape, dtype, value)


def empty(shape: Any, dtype: Any = float32) -> DeviceOp[Tensor]:
    """An op that allocates a tensor without initializing it."""
    return Alloc("empty", shape, dtype, None)
