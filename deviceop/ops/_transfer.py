"""Transfers as ops: from_numpy, to_numpy (host <-> device) and to_device (device -> device)."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from .._core._alloc import alloc_tensor
from .._core._ledger import abandoned, check_backend, enqueue
from .._dtypes import as_dtype
from .._errors import BackendError, CaptureError, ShapeError, UsageError
from ..device import _tensor
from ..device._select import device_backend
from ..device._tensor import Partition, Tensor
from ._base import DeviceOp
from ._leaf import new_tensor

__all__ = ["FromNumpy", "ToDevice", "ToNumpy", "from_numpy", "resolve_tensor", "to_device", "to_numpy"]


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


class ToDevice(DeviceOp[Tensor]):
    """Copy a tensor (or the tensor an op produces) to a new tensor on another device."""

    __slots__ = ("_dst", "_src")

    allocates = True
    _turn = itertools.count()  # the destination's pool stream for a copy from another device

    def __init__(self, src: Any, dst: Any) -> None:
        super().__init__()
        if isinstance(src, DeviceOp):
            src._take("do.to_device()")
        else:
            resolve_tensor(src, "do.to_device()")
        self._src = src
        self._dst = dst

    def __repr__(self) -> str:
        return f"<to_device {self._dst.device_label}>"

    def _run(self, cx: Any) -> Tensor:
        if cx.capturing:
            raise CaptureError(
                "do.to_device() inside a graph recording: a recording belongs to one device; copy "
                "before or after the scope"
            )
        src = self._src
        t = resolve_tensor(src._run(cx) if isinstance(src, DeviceOp) else src, "do.to_device()")
        dst = self._dst
        if t.buffer.backend is dst:
            return t  # already there: no copy (as torch's .to(device))
        for be in (t.buffer.backend, dst):
            why = abandoned(be)
            if why is not None:
                raise BackendError(f"do.to_device(): {why}")
        if not t.is_contiguous():
            raise ShapeError(
                f"do.to_device() copies a contiguous tensor; {t!r} is a strided view: copy it into a "
                "contiguous tensor on its device first (do.kernels.copy)"
            )
        if cx.backend is dst:
            return self._copy(cx, t)
        # the copy runs on a stream of the destination, which allocates there; this execution's
        # stream waits for it, so the terminal's completion covers it
        fork = cx.backend.new_event()
        cx.stream.record(fork)
        child = cx.fork(dst.streams[next(self._turn) % len(dst.streams)], fork)
        try:
            return self._copy(child, t)
        finally:
            cx.join(child)

    def _copy(self, cx: Any, t: Tensor) -> Tensor:
        lo, hi = t.span
        out: Tensor = alloc_tensor(cx, t.shape, t.dtype, self)
        # the ledger orders the read after writes in flight on the source device's streams, and
        # later writes there after this copy (events recorded on one device, waited on the other's)
        enqueue(
            cx,
            ((t.buffer, lo, hi, False), (out.buffer, 0, out.nbytes, True)),
            lambda: cx.backend.copy_peer(out.buffer, 0, t.buffer, lo, hi - lo, cx.stream),
            self,
        )
        return out


def to_device(tensor: Any, device: Any) -> DeviceOp[Tensor]:
    """An op that copies a tensor (or an op's tensor output) to a new tensor on ``device`` (an
    ordinal or a label such as ``"cuda:1"``; see :func:`deviceop.devices`).

    The copy goes between the devices directly (peer access where the GPUs have it; the driver
    stages it through host memory otherwise) on a stream of the destination. The access ledger
    orders it after work in flight that writes the source, on whichever device, and orders
    later writes of the source after it. A tensor already on ``device`` is the output as it is.
    The device is checked when the op is built; the tensor must be contiguous.
    """
    return ToDevice(tensor, device_backend(device))


_tensor.HOOKS["to_numpy"] = to_numpy
