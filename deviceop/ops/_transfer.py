"""Host <-> device transfers as ops: from_numpy, to_numpy."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._core._ledger import check_backend, enqueue
from .._dtypes import as_dtype
from .._errors import CaptureError, UsageError
from ..device import _tensor
from ..device._tensor import Partition, Tensor
from ._base import DeviceOp
from ._leaf import new_tensor

__all__ = ["FromNumpy", "ToNumpy", "from_numpy", "resolve_tensor", "to_numpy"]


class FromNumpy(DeviceOp[Tensor]):
    """Allocate a tensor and copy a numpy array into it (read when the op runs)."""

    __slots__ = ("_array", "dtype")

    allocates = True

    def __init__(self, array: Any) -> None:
        super().__init__()
        if not isinstance(array, np.ndarray):
            raise UsageError(
                f"do.from_numpy() needs a numpy.ndarray, got {type(array).__name__}; "
                "use numpy.asarray(x) first, or do.from_dlpack(x) for GPU arrays"
            )
        self.dtype = as_dtype(array.dtype, "array dtype")
        self._array = array

    def __repr__(self) -> str:
        return f"<from_numpy{self._array.shape} {self.dtype.name}>"

    def _run(self, cx: Any) -> Tensor:
        a = self._array

        def copy(t: Tensor) -> None:
            if t.nbytes:
                cx.backend.htod(t.buffer, 0, a, cx.stream, cx)

        return new_tensor(cx, tuple(a.shape), self.dtype, self, copy)


def from_numpy(array: Any) -> DeviceOp[Tensor]:
    """An op that copies a numpy array to a new device tensor."""
    return FromNumpy(array)


def resolve_tensor(x: Any, what: str) -> Tensor:
    """A Tensor from a Tensor or a Partition; raise UsageError otherwise."""
    if type(x) is Tensor:
        return x
    if type(x) is Partition:
        t: Tensor = x.tensor
        return t
    raise UsageError(f"{what} needs a Tensor (or a Partition of one), got {type(x).__name__}")


class ToNumpy(DeviceOp[np.ndarray]):
    """Copy a tensor (or the tensor an op produces) into a new numpy array."""

    __slots__ = ("_src",)

    def __init__(self, src: Any) -> None:
        super().__init__()
        if isinstance(src, DeviceOp):
            src._take("do.to_numpy()")
        else:
            resolve_tensor(src, "do.to_numpy()")
        self._src = src

    def _run(self, cx: Any) -> np.ndarray:
        if cx.capturing:
            raise CaptureError(
                "do.to_numpy() inside a graph recording: the copy to host memory completes on the "
                "host, which a replay cannot repeat. Record the GPU work, then run "
                "do.to_numpy(t) (or t.numpy()) after each replay"
            )
        src = self._src
        t = resolve_tensor(src._run(cx) if isinstance(src, DeviceOp) else src, "do.to_numpy()")
        check_backend(cx, t.buffer.backend, "do.to_numpy()")
        lo, hi = t.span
        # ordered, registered and enqueued atomically: a write issued later on another stream
        # (any thread) is ordered after this copy
        raw = enqueue(
            cx, ((t.buffer, lo, hi, False),), lambda: cx.backend.dtoh(t.buffer, lo, hi - lo, cx.stream, cx), self
        )
        npdt = t.dtype.np_dtype
        if t.is_contiguous():
            arr: np.ndarray = raw.view(npdt).reshape(t.shape)
            return arr
        it = npdt.itemsize
        strided = np.lib.stride_tricks.as_strided(
            raw.view(npdt), shape=t.shape, strides=tuple(s * it for s in t.strides)
        )
        out = np.empty(t.shape, dtype=npdt)
        cx.on_done(lambda: np.copyto(out, strided))
        return out


def to_numpy(tensor: Any) -> DeviceOp[np.ndarray]:
    """An op that copies a tensor (or an op's tensor output) to a new numpy array."""
    return ToNumpy(tensor)


_tensor.HOOKS["to_numpy"] = to_numpy
