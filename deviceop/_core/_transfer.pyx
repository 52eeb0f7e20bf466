# cython: language_level=3
"""Copies between host and device memory: the op ``to_numpy`` and the staged copies behind it and
``from_numpy`` (an allocating op, in ``_alloc``).

On a backend whose driver table has the copy entry points (cuda), a copy is C from the op to
the driver (``stage_in`` / ``stage_out`` of ``_base``): the host side goes through a
page-locked staging block, given back when the execution completes; the array's memory is
reached through the buffer protocol; nothing but the output array is a Python object. A
contiguous ``to_numpy`` result lives in the page-locked block itself, lent to the array (the
copy lands there, with no host copy at completion) until the array is gone. Other
backends (host) implement ``htod`` / ``dtoh`` and are called through them. Either way the copy
is ordered, registered and enqueued under the ledger lock, as every access is (see
:func:`~deviceop._core._ledger.enqueue`).
"""

from libc.stdint cimport uintptr_t

import numpy as np

from ._base cimport _LOCK as LOCK, Buffer, Driver, PartitionBase, TensorBase, lend_out, stage_in, stage_out
from ._base import contiguous_strides
from ._ledger cimport ExecutionContext, check_backend, order
from ._op cimport DeviceOp

from .._errors import CaptureError, UsageError

__all__ = ["ToNumpy", "resolve_tensor"]


cdef Driver _copier(ExecutionContext cx):
    """The driver table whose copy entry points serve ``cx``, or None (the backend copies)."""
    cdef Driver d = cx.drv
    if d is None or d.memcpy_htod == NULL or d.pinned is None:
        return None
    return d


cdef int _upload(ExecutionContext cx, Driver d, Buffer buf, Py_ssize_t off, object src) except -1:
    done = stage_in(d, cx.sh, buf.ptr + <uintptr_t>off, src)
    if done is not None:
        cx.on_done(done)
    return 0


cdef int _download(ExecutionContext cx, Driver d, Buffer buf, Py_ssize_t off, object out) except -1:
    done = stage_out(d, cx.sh, buf.ptr + <uintptr_t>off, out)
    if done is not None:
        cx.on_done(done)
    return 0


cpdef TensorBase resolve_tensor(x, what):
    """A Tensor from a Tensor or a Partition; raise UsageError otherwise."""
    if isinstance(x, TensorBase):
        return <TensorBase>x
    if isinstance(x, PartitionBase):
        return (<PartitionBase>x).tensor
    raise UsageError(f"{what} needs a Tensor (or a Partition of one), got {type(x).__name__}")


cdef class ToNumpy(DeviceOp):
    """Copy a tensor (or the tensor an op produces) into a new numpy array."""

    cdef object _src

    def __init__(self, src):
        if isinstance(src, DeviceOp):
            (<DeviceOp>src).take("do.to_numpy()")
        else:
            resolve_tensor(src, "do.to_numpy()")
        self._src = src

    def __repr__(self):
        return "<to_numpy>"

    cpdef object _run(self, ExecutionContext cx):
        cdef TensorBase t
        cdef Driver d
        if cx.capturing:
            raise CaptureError(
                "do.to_numpy() inside a graph recording: the copy to host memory completes on the "
                "host, which a replay cannot repeat. Record the GPU work, then run "
                "do.to_numpy(t) (or t.numpy()) after each replay"
            )
        src = self._src
        t = resolve_tensor((<DeviceOp>src)._run(cx) if isinstance(src, DeviceOp) else src, "do.to_numpy()")
        check_backend(cx, t.buffer.backend, "do.to_numpy()")
        npdt = t.dtype.np_dtype
        contiguous = t.size <= 1 or t.strides == contiguous_strides(t.shape)
        d = _copier(cx)
        # ordered, registered and enqueued atomically: a write issued later on another stream
        # (any thread) is ordered after this copy
        LOCK.take()
        try:
            order(cx, t.buffer, t.lo, t.hi, False, self)
            if d is not None and contiguous:
                # the result's memory is a page-locked block the copy writes directly
                blk = lend_out(d, cx.sh, t.buffer.ptr + <uintptr_t>t.lo, t.hi - t.lo)
                if blk is not None:
                    cx.on_done(blk)  # held until the copy has completed, whatever becomes of the array
                    return np.ndarray(t.shape, dtype=npdt, buffer=blk)
                out = np.empty(t.shape, dtype=npdt)
                _download(cx, d, t.buffer, t.lo, out)
                return out
            if d is not None:
                raw = np.empty(t.hi - t.lo, dtype=np.uint8)
                _download(cx, d, t.buffer, t.lo, raw)
            else:
                raw = cx.backend.dtoh(t.buffer, t.lo, t.hi - t.lo, cx.stream, cx)
        finally:
            LOCK.drop()
        if contiguous:
            return raw.view(npdt).reshape(t.shape)
        return _gathered(cx, t, raw)


cdef class _Gather:
    """At completion: the elements of a strided view, staged as its span's bytes, into ``out``."""

    cdef object out
    cdef object strided

    def __call__(self):
        np.copyto(self.out, self.strided)
        self.strided = None


cdef object _gathered(ExecutionContext cx, TensorBase t, raw):
    """A new C-ordered array of ``t``'s elements, gathered from ``raw`` (the bytes of ``t``'s
    span, filled at completion) when the execution completes."""
    cdef _Gather g = _Gather.__new__(_Gather)
    npdt = t.dtype.np_dtype
    it = npdt.itemsize
    g.strided = np.lib.stride_tricks.as_strided(raw.view(npdt), shape=t.shape, strides=tuple([s * it for s in t.strides]))
    g.out = np.empty(t.shape, dtype=npdt)
    cx.on_done(g)
    return g.out
