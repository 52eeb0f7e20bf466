from ._ledger cimport ExecutionContext


cdef class DeviceOp:
    cdef public object _used
    cpdef object _run(self, ExecutionContext cx)
    cdef int take(self, str by) except -1
    cpdef tuple _start_sliced(self, object stream, str label, double seconds)
    cdef object _run_group(self, ExecutionContext cx, list ops)


cpdef object run_sync(DeviceOp op, object stream, str label)
cpdef tuple start(DeviceOp op, object stream, str label)
cpdef object as_stream(object stream)
