"""Kernel parameter declarations: In, Out, InOut tensors, and scalars by dtype."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._dtypes import DType, as_dtype

__all__ = ["In", "InOut", "Out", "TensorParam"]


@dataclass(frozen=True)
class TensorParam:
    """A tensor parameter: passed to the kernel as a pointer to its first element."""

    dtype: DType
    write: bool
    read: bool
    kind: str

    def __repr__(self) -> str:
        return f"{self.kind}({self.dtype.name})"


def In(dtype: Any) -> TensorParam:
    """A read-only tensor parameter (``const T*``): pass a Tensor."""
    return TensorParam(as_dtype(dtype), False, True, "In")


def Out(dtype: Any) -> TensorParam:
    """A written tensor parameter (``T*``): pass a Partition (or a Tensor with an explicit grid)."""
    return TensorParam(as_dtype(dtype), True, False, "Out")


def InOut(dtype: Any) -> TensorParam:
    """A read-and-written tensor parameter (``T*``): pass a Partition (or a Tensor with a grid)."""
    return TensorParam(as_dtype(dtype), True, True, "InOut")
