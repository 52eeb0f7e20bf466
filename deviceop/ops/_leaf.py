"""Leaf ops: value, and the allocating ops zeros / ones / full / empty."""

from __future__ import annotations

from typing import Any, TypeVar

from .._core._alloc import Alloc, alloc_tensor, empty_op, refuse_allocation
from .._core._ledger import enqueue
from .._core._op import Value, value
from .._core._tensor import Tensor
from .._dtypes import DType, float32
from .._errors import DTypeError
from ._base import DeviceOp

__all__ = ["Alloc", "Value", "empty", "full", "new_tensor", "ones", "refuse_allocation", "value", "zeros"]

T = TypeVar("T")


def new_tensor(cx: Any, shape: tuple[int, ...], dtype: DType, what: Any = "an allocation", fill: Any = None) -> Tensor:
    """Allocate a tensor on ``cx``'s stream, registered as written by the execution.

    ``fill(tensor)``, if given, enqueues the work that initializes it, through the ledger's
    entry point.
    """
    t = alloc_tensor(cx, shape, dtype, what)
    if fill is not None:
        enqueue(cx, ((t.buffer, 0, t.nbytes, True),), lambda: fill(t), what)
    out: Tensor = t
    return out


def zeros(shape: Any, dtype: Any = float32) -> DeviceOp[Tensor]:
    """An op that allocates a tensor filled with zeros."""
    return Alloc("zeros", shape, dtype, 0)


def ones(shape: Any, dtype: Any = float32) -> DeviceOp[Tensor]:
    """An op that allocates a tensor filled with ones."""
    return Alloc("ones", shape, dtype, 1)


def full(shape: Any, value: Any, dtype: Any = float32) -> DeviceOp[Tensor]:
    """An op that allocates a tensor filled with ``value`` (a number that fits ``dtype``)."""
    if value is None:
        raise DTypeError("do.full() needs a fill value, got None; use do.empty(shape, dtype) for uninitialized memory")
    return Alloc("full", shape, dtype, value)


def empty(shape: Any, dtype: Any = float32) -> DeviceOp[Tensor]:
    """An op that allocates a tensor without initializing it."""
    return empty_op(shape, dtype)
