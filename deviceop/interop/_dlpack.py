"""DLPack in: from_dlpack wraps foreign memory without a copy (``Tensor.__dlpack__``, the way
out, is the core's: ``_core._regions.export``).

Unversioned ``dltensor`` capsules (dlpack.h), which every consumer accepts, read with ctypes
(``_dlstructs``). On the host backend import wraps numpy memory.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._core._base import Buffer, contiguous_strides
from .._core._dlstructs import _USED, _api, _DLManagedTensor, _Imported
from .._core._ledger import ExecutionContext, enqueue
from .._core._regions import buffer_for, host_root, raw_view, span
from .._core._select import current, next_stream
from .._core._tensor import Tensor
from .._core._watch import give
from .._dtypes import from_dl
from .._errors import ShapeError, UsageError

__all__ = ["from_dlpack"]


def from_dlpack(obj: Any) -> Tensor:
    """Wrap an array that speaks DLPack (PyTorch, CuPy, JAX; numpy on the host) without a copy.

    The producer's memory stays alive as long as the tensor (or work using it) does. On cuda the
    producer orders its pending work before a pool stream, and the ledger makes later work on
    any stream wait for that.
    """
    be = current()
    if not be.cuda_memory and isinstance(obj, np.ndarray):
        from .._dtypes import as_dtype

        return _wrap_host(be, obj, as_dtype(obj.dtype, "array dtype"), obj)
    if not hasattr(obj, "__dlpack__"):
        raise UsageError(f"do.from_dlpack() needs an object with __dlpack__, got {type(obj).__name__}")
    stream = next_stream()
    be.make_current()
    cap = obj.__dlpack__(stream=stream.handle_int) if be.cuda_memory else obj.__dlpack__()
    if not _api.PyCapsule_IsValid(cap, b"dltensor"):
        raise UsageError(f"{type(obj).__name__}.__dlpack__() did not return an unconsumed 'dltensor' capsule")
    addr = _api.PyCapsule_GetPointer(cap, b"dltensor")
    mt = _DLManagedTensor.from_address(addr)
    dl = mt.dl_tensor
    dev = (dl.device.device_type, dl.device.device_id)
    if not be.accepts_dlpack_device(dev):
        raise UsageError(
            f"the array lives on DLPack device {dev}, but the {be.name} backend takes {be.dlpack_device}; "
            "move it there first (or select the other backend)"
        )
    if dl.dtype.lanes != 1:
        raise ShapeError("vector (multi-lane) DLPack dtypes are not supported")
    dtype = from_dl(dl.dtype.code, dl.dtype.bits)
    shape = tuple(dl.shape[i] for i in range(dl.ndim))
    strides = tuple(dl.strides[i] for i in range(dl.ndim)) if dl.strides else None
    _api.PyCapsule_SetName(cap, _USED)
    owner = _Imported(addr, cap)
    st = strides if strides is not None else contiguous_strides(shape)
    if any(s < 0 for s in st):
        raise ShapeError("arrays with negative strides are not supported; make a contiguous copy first")
    it = dtype.itemsize
    byte_strides = tuple(s * it for s in st)
    extent = span(0, shape, byte_strides, it)[1]  # (bytes from the first element: its memory is the producer's)
    ptr = int(dl.data or 0) + int(dl.byte_offset)
    if not be.cuda_memory:
        arr = (
            np.lib.stride_tricks.as_strided(
                raw_view(ptr, extent).view(dtype.np_dtype), shape=shape, strides=byte_strides
            )
            if extent
            else np.empty(shape, dtype.np_dtype)
        )
        return _wrap_host(be, arr, dtype, owner)
    # the allocation's region: the same memory wrapped twice is one region in the ledger
    buf = buffer_for(be, ptr, ptr + extent, owner)
    t = Tensor(buf, shape, dtype, strides, ptr - buf.ptr)
    _register_import(stream, buf, t)
    return t


def _wrap_host(be: Any, arr: np.ndarray, dt: Any, owner: Any) -> Tensor:
    it = arr.itemsize
    if any(s % it for s in arr.strides) or any(s < 0 for s in arr.strides):
        raise ShapeError("arrays with negative or unaligned strides are not supported; make a contiguous copy first")
    strides = tuple(s // it for s in arr.strides)
    span = 0 if arr.size == 0 else (sum((n - 1) * s for n, s in zip(arr.shape, strides)) + 1) * it
    ptr = arr.ctypes.data
    buf = buffer_for(be, ptr, ptr + span, (owner, arr), host_root(arr))
    return Tensor(buf, tuple(arr.shape), dt, strides, ptr - buf.ptr)


def _register_import(stream: Any, buf: Buffer, t: Tensor) -> None:
    """Record the producer's pending work as a write on ``stream`` in the ledger."""
    cx = ExecutionContext(stream, "from_dlpack")
    enqueue(cx, ((t, True),), None, "from_dlpack")
    give(stream, cx, cx.seal())  # its stream's watcher ends the registration with the work
