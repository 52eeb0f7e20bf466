# The lowest layer of the compiled core: what every other layer and the backends share.
from libc.stdint cimport uint64_t, uintptr_t

cdef extern from "<semaphore.h>" nogil:
    ctypedef struct sem_t:
        pass
    int sem_init(sem_t*, int, unsigned int)
    int sem_destroy(sem_t*)
    int sem_wait(sem_t*)
    int sem_trywait(sem_t*)
    int sem_post(sem_t*)

cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    int pthread_mutex_init(pthread_mutex_t*, void*)
    int pthread_mutex_destroy(pthread_mutex_t*)
    int pthread_mutex_lock(pthread_mutex_t*)
    int pthread_mutex_unlock(pthread_mutex_t*)

# driver entry points a backend hands to the core (chosen once, when the backend is made)
ctypedef int (*launch_kernel_t)(void* f, unsigned int gx, unsigned int gy, unsigned int gz,
                                unsigned int bx, unsigned int by, unsigned int bz, unsigned int shmem,
                                void* stream, void** params) noexcept nogil
ctypedef int (*graph_launch_t)(void* ex, void* stream) noexcept nogil
# cuGraphExecKernelNodeSetParams (v2 parameters): a kernel node's arguments in an executable
# graph, for its next launches
ctypedef int (*exec_kernel_set_t)(void* ex, void* node, const void* params) noexcept nogil
ctypedef int (*stream_sync_t)(void* stream) noexcept nogil
ctypedef int (*stream_query_t)(void* stream) noexcept nogil
ctypedef int (*event_record_t)(void* ev, void* stream) noexcept nogil
ctypedef int (*event_query_t)(void* ev) noexcept nogil
ctypedef int (*ctx_set_t)(void* ctx) noexcept nogil
ctypedef int (*ctx_get_t)(void** ctx) noexcept nogil
ctypedef int (*mem_alloc_t)(uintptr_t* ptr, size_t nbytes, void* stream) noexcept nogil
ctypedef int (*mem_free_t)(uintptr_t ptr, void* stream) noexcept nogil
# completion flags (the reactor): a 32-bit write in stream order, a host function, and making
# host memory writable by the device (its device address)
ctypedef int (*write_value32_t)(void* stream, uintptr_t addr, unsigned int value) noexcept nogil
ctypedef int (*host_func_t)(void* stream, void (*fn)(void*) noexcept nogil, void* data) noexcept nogil
ctypedef int (*host_register_t)(void* ptr, size_t nbytes, uintptr_t* device_addr) noexcept nogil
# copies between host and device memory (host side page-locked), and page-locked host memory
ctypedef int (*memcpy_htod_t)(uintptr_t dst, const void* src, size_t nbytes, void* stream) noexcept nogil
ctypedef int (*memcpy_dtoh_t)(void* dst, uintptr_t src, size_t nbytes, void* stream) noexcept nogil
ctypedef int (*host_alloc_t)(void** ptr, size_t nbytes) noexcept nogil


cdef class StreamBase:
    cdef public object backend
    cdef public uintptr_t handle_int
    cdef object __weakref__


cdef class Lock:
    cdef sem_t sem
    cdef bint ready
    cdef public bint _locked
    cdef unsigned long owner  # the thread holding it (0: none): a holder's second take raises
    cdef int take(self) except -1
    cdef void drop(self) noexcept nogil


cdef class BlockCache:
    cdef dict free
    cdef readonly Py_ssize_t live
    cdef readonly Py_ssize_t cached
    cdef uintptr_t take(self, Py_ssize_t size)
    cdef void count(self, Py_ssize_t size)
    cdef int give(self, uintptr_t ptr, Py_ssize_t size) except -1


cdef Py_ssize_t block_size(Py_ssize_t n) noexcept


cdef class Buffer:
    cdef public BlockCache cache
    cdef public object backend
    cdef readonly uintptr_t ptr
    cdef readonly Py_ssize_t nbytes
    cdef public object host
    cdef public object owner
    cdef public list accesses
    cdef public object last_stream
    cdef object __weakref__


cdef class TensorBase:
    cdef readonly Buffer buffer
    cdef readonly tuple shape
    cdef readonly tuple strides
    cdef readonly object dtype
    cdef readonly Py_ssize_t offset
    cdef readonly Py_ssize_t size
    cdef readonly uintptr_t addr
    cdef readonly Py_ssize_t _key
    cdef Py_ssize_t lo, hi  # the byte span [lo, hi) of the buffer this view can touch
    # what a layer above keeps for this tensor as another library sees it (interop's PyTorch
    # tensor on its memory): kept on the tensor, it lives and goes with it; the core never reads
    # it (foreign_of, set_foreign)
    cdef object _foreign
    cdef object __weakref__


cdef TensorBase new_contiguous(type cls, Buffer buf, tuple shape, dtype)
cpdef TensorBase tensor_at(type cls, Buffer buf, tuple shape, dtype, tuple strides, Py_ssize_t offset)
cpdef bint plain_shape(shape)
cpdef tuple contiguous_strides(tuple shape)
cpdef object foreign_of(TensorBase t)
cpdef int set_foreign(TensorBase t, object view) except -1


cdef class PartitionBase:
    cdef readonly TensorBase tensor
    cdef readonly tuple tile
    cdef readonly tuple grid
    cdef readonly Py_ssize_t _key
    cdef object __weakref__


cdef struct chan_t:
    pthread_mutex_t mu
    int fd
    uint64_t* buf
    size_t n
    size_t cap
    long refs

cdef int chan_push(chan_t* c, uint64_t token) noexcept nogil
cdef void chan_unref(chan_t* c) noexcept nogil


cdef class Channel:
    cdef chan_t* c
    cdef chan_t* ref(self) except NULL


cdef class Driver:
    cdef launch_kernel_t launch_kernel
    cdef graph_launch_t graph_launch
    cdef exec_kernel_set_t exec_kernel_set
    cdef stream_sync_t stream_sync
    cdef event_record_t event_record
    cdef event_query_t event_query
    cdef ctx_set_t ctx_set
    cdef ctx_get_t ctx_get
    cdef mem_alloc_t mem_alloc
    cdef mem_free_t mem_free
    cdef stream_query_t stream_query
    cdef write_value32_t write_value32
    cdef host_func_t host_func
    cdef host_register_t host_register
    cdef memcpy_htod_t memcpy_htod
    cdef memcpy_dtoh_t memcpy_dtoh
    cdef host_alloc_t host_alloc
    cdef void* context
    cdef dict pinned          # idle page-locked staging blocks: size class -> list of addresses
    cdef public BlockCache blocks
    cdef public object error   # error(code, call) -> CudaError: the backend's error maker
    # the stream fresh blocks are allocated on (0: the execution's own), and what makes a block
    # allocated there usable on another stream when the allocation waits on other work
    cdef public uintptr_t alloc_stream
    cdef public object after_alloc  # after_alloc(stream): order ``stream`` after the allocation stream


cpdef Buffer driver_alloc(Driver d, object backend, object stream, Py_ssize_t nbytes)

cdef Lock _LOCK
cdef int n_recording  # graph recordings open on any thread (see count_recording)

cdef int make_current(Driver d) except -1


cdef object stage_in(Driver d, uintptr_t stream, uintptr_t dst, object src)
cdef object stage_out(Driver d, uintptr_t stream, uintptr_t src, object out)
cdef object lend_out(Driver d, uintptr_t stream, uintptr_t src, Py_ssize_t n)
