# cython: language_level=3
"""DLPack capsules of deviceop tensors (dlpack.h's unversioned ``dltensor``), made in C.

One allocation holds the managed tensor and its shape and strides; ``manager_ctx`` holds a
reference to the exporting tensor, so its memory lives until the consumer calls the deleter (or
the capsule is dropped unconsumed). CuPy exports the same way (``cupy/_core/dlpack.pyx``).
"""

from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_IsValid, PyCapsule_New
from cpython.ref cimport Py_DECREF, Py_INCREF
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint64_t
from libc.stdlib cimport free, malloc

__all__ = ["capsule"]


cdef void _deleter(DLManagedTensor* mt) noexcept with gil:
    # the consumer is done (any thread): drop the tensor's reference, free the block
    if mt == NULL:
        return
    ctx = mt.manager_ctx
    mt.manager_ctx = NULL
    free(mt)
    if ctx != NULL:
        Py_DECREF(<object>ctx)


cdef void _capsule_dtor(object cap) noexcept:
    # a capsule nobody consumed still owns its tensor
    cdef DLManagedTensor* mt
    if PyCapsule_IsValid(cap, b"dltensor"):
        mt = <DLManagedTensor*>PyCapsule_GetPointer(cap, b"dltensor")
        if mt != NULL and mt.deleter != NULL:
            mt.deleter(mt)


def capsule(object owner, size_t data, tuple shape, tuple strides, int code, int bits, int device_type,
            int device_id):
    """A ``dltensor`` capsule of ``data`` (element shape and strides, dtype ``code``/``bits``) on
    DLPack device (``device_type``, ``device_id``); ``owner`` stays alive until it is consumed
    and released, or dropped."""
    cdef Py_ssize_t n = len(shape), i, k = n if n > 0 else 1
    if len(strides) != n:
        raise ValueError("shape and strides differ in length")
    cdef DLManagedTensor* mt = <DLManagedTensor*>malloc(sizeof(DLManagedTensor) + 2 * k * sizeof(int64_t))
    if mt == NULL:
        raise MemoryError()
    cdef int64_t* sh = <int64_t*>(<char*>mt + sizeof(DLManagedTensor))
    cdef int64_t* st = sh + k
    try:
        for i in range(n):
            sh[i] = shape[i]
            st[i] = strides[i]
    except BaseException:
        free(mt)
        raise
    mt.dl_tensor.data = <void*>data
    mt.dl_tensor.device.device_type = device_type
    mt.dl_tensor.device.device_id = device_id
    mt.dl_tensor.ndim = <int32_t>n
    mt.dl_tensor.dtype.code = <uint8_t>code
    mt.dl_tensor.dtype.bits = <uint8_t>bits
    mt.dl_tensor.dtype.lanes = 1
    mt.dl_tensor.shape = sh
    mt.dl_tensor.strides = st
    mt.dl_tensor.byte_offset = 0
    Py_INCREF(owner)
    mt.manager_ctx = <void*>owner
    mt.deleter = _deleter
    try:
        return PyCapsule_New(mt, b"dltensor", <void (*)(object) noexcept>_capsule_dtor)
    except BaseException:
        _deleter(mt)
        raise
