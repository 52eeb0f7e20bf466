# Launch plans: what other compiled modules of the core use of _launch.

cdef class PlanCache:
    cdef dict d
    cdef public Py_ssize_t max_size
    cdef public Py_ssize_t hits
    cdef public Py_ssize_t misses

    cpdef object get(self, key)
