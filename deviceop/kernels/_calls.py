"""The call types of the built-in kernels, for type checkers.

A built-in call returns an op whose output is its arguments, ops among them replaced by their
outputs: the output Partition, the input Tensors and the scalars as floats. Each family's
``Protocol`` says so, so that ``zp, x, y = K.add(z, x, y).sync()`` types ``zp`` as a Partition
and ``x``, ``y`` as Tensors. (A user ``Kernel``'s parameters are known only at run time: its call
gives ``DeviceOp[tuple[Any, ...]]``, as CuPy's RawKernel gives no types either.)
"""

from __future__ import annotations

from typing import Protocol, TypeAlias

from .._core._op import DeviceOp
from .._core._tensor import Partition, Tensor

__all__ = ["Axpy", "Binary", "Fill", "RmsNorm", "Scale", "Unary"]

#: an output argument: a Partition, or an op producing one
P: TypeAlias = "Partition | DeviceOp[Partition]"
#: an input argument: a Tensor, or an op producing one
X: TypeAlias = "Tensor | DeviceOp[Tensor]"


class Unary(Protocol):
    """``k(out, x)``: copy, relu, gelu, silu; row-wise sum, max, softmax."""

    def __call__(self, out: P, x: X, /) -> DeviceOp[tuple[Partition, Tensor]]: ...


class Binary(Protocol):
    """``k(out, x, y)``: add, mul; ``matvec(out, a, x)``."""

    def __call__(self, out: P, x: X, y: X, /) -> DeviceOp[tuple[Partition, Tensor, Tensor]]: ...


class Fill(Protocol):
    """``fill(out, value)``."""

    def __call__(self, out: P, value: float, /) -> DeviceOp[tuple[Partition, float]]: ...


class Scale(Protocol):
    """``scale(out, x, g)``: out = x * g."""

    def __call__(self, out: P, x: X, g: float, /) -> DeviceOp[tuple[Partition, Tensor, float]]: ...


class Axpy(Protocol):
    """``axpy(out, x, y, a)``: out = a * x + y."""

    def __call__(self, out: P, x: X, y: X, a: float, /) -> DeviceOp[tuple[Partition, Tensor, Tensor, float]]: ...


class RmsNorm(Protocol):
    """``rms_norm(out, x, w, eps=1e-6)``."""

    def __call__(
        self, out: P, x: X, w: X, eps: float = ..., /
    ) -> DeviceOp[tuple[Partition, Tensor, Tensor, float]]: ...
