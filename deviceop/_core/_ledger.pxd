from libc.stdint cimport uint64_t, uintptr_t
from ._base cimport Buffer, Driver, Lock


cdef class Access:
    cdef ExecutionContext cx
    cdef Py_ssize_t lo, hi
    cdef bint write
    cdef uint64_t gen  # cx._gen when the entry last stood for new work of cx's


cdef class ExecutionContext:
    cdef public object stream
    cdef public object backend
    cdef public list buffers
    cdef public bint done
    cdef public object label
    cdef public object op
    cdef public bint capturing
    cdef public object captured
    cdef public tuple children
    cdef public object _event
    cdef public bint _sealed
    cdef readonly tuple _waited  # the executions this one's stream waited for (tests read it)
    cdef tuple _waited_gens  # other._gen when each of _waited was waited for, one each in its order (see wait_for_c)
    cdef readonly uint64_t _gen  # accesses ordered so far (scan, retarget): work it may have enqueued
    cdef uint64_t _sealed_gen  # _gen when it was sealed
    cdef public list _done_cbs
    cdef readonly uintptr_t sh
    cdef readonly Driver drv

    cdef int wait_for_c(self, ExecutionContext other, uint64_t upto) except -1
    cdef object seal_c(self)
    cdef int finish_c(self, bint ok) except -1
    cdef int block_c(self, bint seal) except -1
    cpdef object sealed_event(self)


cdef ExecutionContext new_context(object stream, object label, object op)
cdef object run_all(list cbs)
cdef int order(ExecutionContext cx, Buffer buf, Py_ssize_t lo, Py_ssize_t hi, bint write, object what) except -1
cdef int scan(ExecutionContext cx, Buffer buf, Py_ssize_t lo, Py_ssize_t hi, bint write, object what) except -1
cdef int register(ExecutionContext cx, Buffer buf, Py_ssize_t lo, Py_ssize_t hi, bint write) except -1
cdef int order_tensor(ExecutionContext cx, object t, bint write, object what) except -1
cdef bint ledger_on()
cdef uint64_t epoch() noexcept
cdef Access covering(ExecutionContext cx, Buffer buf, Py_ssize_t lo, Py_ssize_t hi, bint write)
cdef int retarget(ExecutionContext cx, tuple entries, object keep_alive) except -1
cpdef int check_backend(ExecutionContext cx, object be, object what) except -1
