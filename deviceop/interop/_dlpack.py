"""DLPack both ways: Tensor.__dlpack__ (export) and from_dlpack (wrap foreign memory, no copy).

Unversioned ``dltensor`` capsules (dlpack.h), which every consumer accepts: exports are made in
C by the core (``_core._dlpack``), imports read with ctypes (``_dlstructs``). On the host
backend export delegates to numpy; import wraps numpy memory.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._core._base import LOCK, Buffer
from .._core._dlpack import capsule
from .._core._ledger import ExecutionContext, enqueue, in_flight
from .._core._watch import give
from .._dtypes import from_dl
from .._errors import ShapeError, UsageError
from ..device import _tensor
from ..device._select import current, next_stream
from ..device._tensor import Tensor
from ._dlstructs import _USED, _api, _DLManagedTensor, _Imported
from ._regions import buffer_for, host_root, inside_stream, raw_view, register

__all__ = ["export", "from_dlpack"]


def export(t: Tensor, stream: Any) -> Any:
    """A ``dltensor`` capsule for ``t``; orders the consumer's ``stream`` after work in flight.

    Inside the fn of :func:`~deviceop.interop.external` the ledger has already ordered the op's
    stream after the work in flight, so a consumer on that stream waits for nothing more (and
    on the host backend the fn runs in stream order, so the tensor may be read).
    """
    be = t.buffer.backend
    register(t.buffer)  # wrapped back later, its memory is this buffer's region
    mine = inside_stream()
    if not be.cuda_memory:
        if mine is None:
            t.check_host_access("export")  # a host consumer reads at once: nothing may be in flight
        return be.dlpack_host(t)  # numpy owns the capsule's lifetime
    if mine is not None:
        if stream not in (-1, mine.handle_int):
            ev = be.new_event()  # another stream of the consumer: after our work so far
            mine.record(ev)
            be.foreign_wait(stream, ev)
    else:
        ex = in_flight(t.buffer, *t.span)
        if ex is not None and stream != -1:
            with LOCK:
                ev = ex.completion_event()
            be.foreign_wait(stream, ev)  # the consumer's stream waits for the work in flight
    dev_type, dev_id = be.dlpack_device
    return capsule(t, t.ptr, t.shape, t.strides, t.dtype.dl_code, t.dtype.itemsize * 8, dev_type, dev_id)


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
    t0 = Tensor(Buffer(be, 0, 0, owner=owner), shape, dtype, strides)
    if any(s < 0 for s in t0.strides):
        raise ShapeError("arrays with negative strides are not supported; make a contiguous copy first")
    ptr = int(dl.data or 0) + int(dl.byte_offset)
    if not be.cuda_memory:
        it = dtype.itemsize
        arr = (
            np.lib.stride_tricks.as_strided(
                raw_view(ptr, t0.span[1]).view(dtype.np_dtype), shape=shape, strides=tuple(s * it for s in t0.strides)
            )
            if t0.span[1]
            else np.empty(shape, dtype.np_dtype)
        )
        return _wrap_host(be, arr, dtype, owner)
    # the allocation's region: the same memory wrapped twice is one region in the ledger
    buf = buffer_for(be, ptr, ptr + t0.span[1], owner)
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


_tensor.HOOKS["dlpack_export"] = export
