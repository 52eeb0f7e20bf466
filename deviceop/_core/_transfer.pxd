from ._base cimport Buffer, Driver
from ._ledger cimport ExecutionContext

cdef Driver _copier(ExecutionContext cx)
cdef int _upload(ExecutionContext cx, Driver d, Buffer buf, Py_ssize_t off, object src) except -1
cdef int _download(ExecutionContext cx, Driver d, Buffer buf, Py_ssize_t off, object out) except -1
