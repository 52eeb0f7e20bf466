from ._ledger cimport ExecutionContext


cdef class DeviceOp:
    cdef public object _used
    cpdef object _run(self, ExecutionContext cx)
    cdef int take(self, str by) except -1


cpdef object run_sync(DeviceOp op, object stream, str label)
cpdef tuple start(DeviceOp op, object stream, str label)
cpdef object as_stream(object stream)
cpdef object check_timeout(object timeout)
cpdef int refuse_on_loop(str what) except -1
cpdef int warn_on_loop(str what, str instead) except -1
cpdef int refuse_in_capture(str what) except -1
cpdef int hand_over(ExecutionContext cx, object stream, object ev=*) except -1
