# The completion reactor's slots, as the other compiled modules call them (the work queue's lanes).
from libc.stdint cimport uint64_t
from ._base cimport Channel

cpdef long long arm(object stream, Channel ch, uint64_t token, bint watch=*) except? -2
cpdef int watch(uint64_t handle) except -1
cpdef bint done(uint64_t handle) except -1
cpdef bint retire(uint64_t handle, bint polled=*) except -1
cpdef int disown(uint64_t handle) except -1
