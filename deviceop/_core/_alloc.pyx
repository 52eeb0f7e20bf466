# cython: language_level=3
"""Allocation as an op: zeros / ones / full / empty, and the allocation every op shares.

A tensor's memory comes from the backend's cache of idle blocks when it has one of the size
class (see :class:`~deviceop._core._base.BlockCache`), else from the driver's pool; either way
in C on cuda. The new buffer is registered as written by the execution through the ledger.
"""

import math

import numpy as np

from ._base cimport _LOCK as LOCK, Buffer, Driver, TensorBase, driver_alloc, new_contiguous, plain_shape
from ._ledger cimport ExecutionContext, order
from ._op cimport DeviceOp
from ._transfer cimport _copier, _upload

from .._dtypes import DType, as_dtype
from .._errors import CaptureError, DTypeError, ShapeError, UsageError
from ._tensor import Tensor, as_shape

__all__ = ["Alloc", "FromNumpy", "alloc_tensor", "empty_op", "refuse_allocation"]

#: no allocation can be larger (2^48 bytes: 256 TiB); larger shapes are mistakes, refused when built
MAX_BYTES = 1 << 48
cdef Py_ssize_t _MAX_BYTES = MAX_BYTES


cpdef int refuse_allocation(ExecutionContext cx, what) except -1:
    """Raise CaptureError if ``cx`` records a graph: a replay cannot allocate (paper's GraphNode)."""
    if cx.capturing:
        raise CaptureError(
            f"{what!r} allocates device memory, which a graph cannot record: a replay would write "
            "into memory nobody holds. Allocate before the scope (x = do.zeros(...).sync()) and "
            "record ops on the existing tensors"
        )
    return 0


cdef Buffer _block(ExecutionContext cx, Py_ssize_t nbytes):
    cdef Driver d = cx.drv
    if d is None or d.mem_alloc == NULL or d.blocks is None:
        return cx.backend.alloc(nbytes, cx.stream)  # a backend without compiled allocation (host)
    return driver_alloc(d, cx.backend, cx.stream, nbytes)


cpdef object alloc_tensor(ExecutionContext cx, tuple shape, dtype, what):
    """A new tensor on ``cx``'s stream, registered as written by the execution (not filled)."""
    cdef Py_ssize_t nbytes = dtype.itemsize, n
    cdef Buffer buf
    for n in shape:
        nbytes *= n
    refuse_allocation(cx, what)
    buf = _block(cx, nbytes)
    t = new_contiguous(Tensor, buf, shape, dtype)
    LOCK.take()  # a new buffer conflicts with nothing; registered as every access is
    try:
        order(cx, buf, 0, nbytes, True, what)
    finally:
        LOCK.drop()
    return t


cdef class Alloc(DeviceOp):
    """Allocate a tensor (from the cache of idle blocks or the driver's pool) and optionally fill it."""

    cdef readonly str name
    cdef readonly tuple shape
    cdef readonly object dtype
    cdef readonly object fill

    allocates = True

    def __init__(self, str name, shape, dtype, fill):
        self.name = name
        self.shape = as_shape(shape)
        self.dtype = dtype if type(dtype) is DType else as_dtype(dtype)
        if math.prod(self.shape) * self.dtype.itemsize > MAX_BYTES:
            raise ShapeError(
                f"{name}{self.shape} of {self.dtype.name} would take {math.prod(self.shape) * self.dtype.itemsize} bytes, "
                f"more than any device holds (limit {MAX_BYTES} bytes); check the shape"
            )
        if fill is not None:
            dt = self.dtype
            if isinstance(fill, (bool, np.bool_)) or not isinstance(fill, (int, float, np.integer, np.floating)):
                raise DTypeError(f"{name}: the fill value must be a number, got {type(fill).__name__}")
            try:
                with np.errstate(over="raise", invalid="raise"):
                    arr = np.array(fill, dtype=dt.np_dtype)
            except (TypeError, ValueError, OverflowError, FloatingPointError) as e:
                raise DTypeError(f"{name}: fill value {fill!r} does not fit {dt.name}: {e}") from None
            if arr.shape != ():
                raise DTypeError(f"{name}: fill value must be a scalar, got shape {arr.shape}")
            if not dt.is_float and arr != fill:
                raise DTypeError(f"{name}: fill value {fill!r} is not representable in {dt.name}")
            if dt.is_float and np.isinf(arr.astype(np.float64)) and not math.isinf(float(fill)):
                raise DTypeError(f"{name}: fill value {fill!r} overflows {dt.name} (it would become inf)")
            fill = arr
        self.fill = fill

    def __repr__(self):
        return f"<{self.name}{self.shape} {self.dtype.name}>"

    cpdef object _run(self, ExecutionContext cx):
        t = alloc_tensor(cx, self.shape, self.dtype, self)
        value = self.fill
        if value is None or not t.nbytes:
            return t
        pattern = value.tobytes()
        be = cx.backend
        if len(pattern) <= 4:
            be.memset(t.buffer, 0, t.nbytes, pattern, cx.stream)
        else:
            be.htod(t.buffer, 0, np.full(self.shape, value, dtype=self.dtype.np_dtype), cx.stream, cx)
        return t


cpdef Alloc empty_op(shape, dtype):
    """``Alloc("empty", shape, dtype, None)``: a request's fresh buffer, made without the
    checks' Python calls when ``shape`` is a plain shape and ``dtype`` a DType whose size is
    in range (anything else goes through ``Alloc``, which checks it and says what is wrong)."""
    cdef Alloc a
    cdef Py_ssize_t n
    cdef Py_ssize_t nbytes
    if type(dtype) is DType and plain_shape(shape):
        nbytes = dtype.itemsize
        for n in <tuple>shape:
            if n and nbytes > _MAX_BYTES // n:
                break
            nbytes *= n
        else:
            a = Alloc.__new__(Alloc)
            a.name = "empty"
            a.shape = shape
            a.dtype = dtype
            a.fill = None
            return a
    return Alloc("empty", shape, dtype, None)


cdef class FromNumpy(DeviceOp):
    """Allocate a tensor and copy a numpy array into it (the array is read when the op runs)."""

    cdef object _array
    cdef readonly object dtype

    allocates = True

    def __init__(self, array):
        if not isinstance(array, np.ndarray):
            raise UsageError(
                f"do.from_numpy() needs a numpy.ndarray, got {type(array).__name__}; make one first, "
                "of a dtype deviceop has (numpy.asarray(x, dtype=numpy.float32); or numpy.float16, "
                "int32, int64, uint8, ml_dtypes.bfloat16), or use do.from_dlpack(x) for GPU arrays"
            )
        try:
            self.dtype = as_dtype(array.dtype, "array dtype")
        except DTypeError:
            raise DTypeError(
                f"do.from_numpy() got an array of {array.dtype}, which deviceop has no dtype for; "
                "convert it first: x.astype(numpy.float32) (or float16, int32, int64, uint8; "
                "ml_dtypes.bfloat16 for bfloat16)"
            ) from None
        self._array = array

    def __repr__(self):
        return f"<from_numpy{self._array.shape} {self.dtype.name}>"

    cpdef object _run(self, ExecutionContext cx):
        a = self._array
        cdef TensorBase t = alloc_tensor(cx, a.shape, self.dtype, self)
        cdef Driver d
        if not t.size:
            return t
        d = _copier(cx)
        LOCK.take()
        try:
            order(cx, t.buffer, 0, t.hi, True, self)  # registered by the allocation: covered
            if d is not None:
                _upload(cx, d, t.buffer, 0, a)
            else:
                cx.backend.htod(t.buffer, 0, a, cx.stream, cx)
        finally:
            LOCK.drop()
        return t
