"""Transfers as ops: from_numpy, to_numpy (host <-> device) and to_device (device -> device)."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from .._core._alloc import FromNumpy, alloc_tensor
from .._core._ledger import abandoned, enqueue
from .._core._select import device_backend
from .._core._tensor import Tensor
from .._core._transfer import ToNumpy, resolve_tensor
from .._errors import BackendError, CaptureError, ShapeError
from ._base import DeviceOp

__all__ = ["FromNumpy", "ToDevice", "ToNumpy", "from_numpy", "resolve_tensor", "to_device", "to_numpy"]


def from_numpy(array: Any) -> DeviceOp[Tensor]:
    """An op that copies a numpy array to a new device tensor.

    The array is read when the op runs (a snapshot: later changes to it do not reach the
    tensor). On cuda the copy goes through a page-locked staging block (see
    :mod:`deviceop._core._transfer`).
    """
    return FromNumpy(array)


def to_numpy(tensor: Any) -> DeviceOp[np.ndarray]:
    """An op that copies a tensor (or an op's tensor output) to a new numpy array.

    The array is filled when the execution completes: the terminal returns it then. On cuda,
    a contiguous tensor's array lives in page-locked memory that the copy writes directly (no
    host copy at completion): a staging block lent to the array (its ``base``) and given back
    to deviceop's pool once the array and its views are gone. At most 256 MiB are lent at once;
    past that, arrays get memory of their own through a staged copy.
    """
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
        t: Tensor = resolve_tensor(src._run(cx) if isinstance(src, DeviceOp) else src, "do.to_device()")
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
            # the destination's context while the copy is enqueued there, this execution's after
            with dst.current():
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
