# cython: language_level=3, boundscheck=False, wraparound=False
"""The lowest layer of the compiled core: the ledger lock, device buffers, wake-up channels,
and the table of driver entry points a backend hands to the core.

Nothing here imports another deviceop module (but its errors) or a driver binding: backends fill a
:class:`Driver` with their entry points, and the layers above call through it.
"""

from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_FORMAT, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.exc cimport PyErr_SetFromErrno
from cpython.pythread cimport PyThread_get_thread_ident

cdef extern from *:
    """
    #if PY_VERSION_HEX >= 0x030D0000
    #define dvo_is_finalizing() Py_IsFinalizing()
    #else
    #define dvo_is_finalizing() _Py_IsFinalizing()
    #endif
    """
    int _Py_IsFinalizing "dvo_is_finalizing" ()
from libc.errno cimport errno, EINTR, EAGAIN
from libc.stdlib cimport malloc, realloc, free
from libc.string cimport memcpy
from libc.stdint cimport uint64_t

from .._errors import ShapeError, UsageError
from .._process import CORE, at_fork_child

cdef extern from "<unistd.h>" nogil:
    ssize_t write(int, const void*, size_t)
    ssize_t read(int, void*, size_t)
    int close(int)

cdef extern from *:
    """
    static __thread void *dvo_current_ctx = NULL;  /* the context this thread made current */
    """
    void* dvo_current_ctx

cdef extern from "<sys/eventfd.h>" nogil:
    int eventfd(unsigned int, int)
    int EFD_NONBLOCK
    int EFD_CLOEXEC

__all__ = [
    "staged_upload", "staged_download", "staging_blocks", "Lock", "LOCK", "StreamBase", "count_recording", "Buffer", "BlockCache", "Channel", "Driver", "STREAM_TYPES", "register_stream_type", "size_class",
    "driver_alloc", "TensorBase", "PartitionBase", "layout_id", "forget_layouts", "contiguous_strides",
    "plain_shape", "known_partition", "remember_partition", "foreign_of", "set_foreign",
]

#: the stream classes of the backends (each registers its own): what terminals accept as a stream
STREAM_TYPES = set()


cdef class StreamBase:
    """The compiled part of every backend's stream: the backend it belongs to and its handle
    (a CUstream as an int on cuda), read by an execution context without attribute lookups.
    Backends subclass it; a subclass is a stream the terminals accept once registered with
    :func:`register_stream_type`."""


def register_stream_type(cls):
    """Make ``cls`` (a backend's stream class) a stream the terminals accept; returns ``cls``."""
    STREAM_TYPES.add(cls)
    return cls


cdef class Lock:
    """A non-reentrant lock like ``threading.Lock``, taken by compiled paths without a method call.

    A POSIX semaphore rather than a PyThread lock: CPython 3.11/3.12 read the monotonic clock on
    every acquire of theirs (a deadline is computed even for a try), a measurable share of a
    graph replay. Any thread may give it back, as with ``threading.Lock``.
    """

    def __cinit__(self):
        if sem_init(&self.sem, 0, 1) != 0:
            PyErr_SetFromErrno(OSError)
        self.ready = True

    def __dealloc__(self):
        if self.ready:
            sem_destroy(&self.sem)

    cdef int take(self) except -1:
        cdef int r
        cdef unsigned long me = PyThread_get_thread_ident()
        if sem_trywait(&self.sem) != 0:
            if self.owner == me and self._locked:
                # the holder asking again would wait for itself forever: say so instead
                raise UsageError(
                    "deviceop was called from code that runs while this thread holds deviceop's "
                    "ledger (the fn of do.external, which runs as its work is enqueued); inside "
                    "it, enqueue work on the given stream through your own library and call no "
                    "deviceop op, terminal or import. Build that work as a separate op instead"
                )
            with nogil:
                r = sem_wait(&self.sem)
                while r != 0 and errno == EINTR:
                    r = sem_wait(&self.sem)
            if r != 0:
                PyErr_SetFromErrno(OSError)
        self._locked = True
        self.owner = me
        return 0

    cdef void drop(self) noexcept nogil:
        self._locked = False
        self.owner = 0
        sem_post(&self.sem)

    def acquire(self):
        """Take the lock, waiting if another thread holds it; returns True."""
        self.take()
        return True

    def release(self):
        """Give the lock back (from any thread); RuntimeError if it is not held."""
        if not self._locked:
            raise RuntimeError("release of an unlocked lock")
        self.drop()

    def locked(self):
        """True while some thread holds the lock."""
        return self._locked

    def __enter__(self):
        self.take()
        return True

    def __exit__(self, *exc):
        self.drop()
        return False


#: the access ledger's lock: held around "order, register, enqueue" (see _ledger)
_LOCK = Lock()
LOCK = _LOCK

# while 0, no thread can be recording a graph, so the terminals skip the per-thread lookup
n_recording = 0


def count_recording(int delta):
    """Add ``delta`` to the number of graph recordings open on any thread (the capture layer
    calls it, under its own lock, as a recording begins and ends); returns the new number."""
    global n_recording
    n_recording += delta
    return n_recording


def _after_fork_in_child():
    """A forked child has only the forking thread: a lock another thread held stays held, and
    this thread's current context belongs to the parent. Start both afresh."""
    global dvo_current_ctx
    sem_destroy(&_LOCK.sem)
    sem_init(&_LOCK.sem, 0, 1)
    _LOCK._locked = False
    dvo_current_ctx = NULL


at_fork_child(_after_fork_in_child, CORE)


cdef Py_ssize_t block_size(Py_ssize_t n) noexcept:
    """The size class of an allocation: 512-byte steps up to 1 MiB, then eighths of a power of two."""
    cdef Py_ssize_t step
    cdef int bits = 0
    if n <= (1 << 20):
        return max((n + 511) & ~(<Py_ssize_t>511), 512)
    while (n >> bits) > 1:
        bits += 1
    step = (<Py_ssize_t>1) << (bits + 1 - 4)
    return (n + step - 1) // step * step


def size_class(Py_ssize_t n):
    """The block size an allocation of ``n`` bytes takes (see :class:`BlockCache`)."""
    return block_size(n)


cdef class BlockCache:
    """Idle device memory blocks by size class, reused at once by later allocations.

    A backend caches a buffer's block when the buffer is dropped, and deviceop drops a buffer
    only once every execution that used it has finished (executions hold their buffers until
    then), so a cached block is idle and serves any stream at once, with no event. Its methods
    run under the GIL without calling Python, so they are atomic with respect to other threads.
    ``live``: bytes of blocks in use; ``cached``: bytes of idle blocks.
    """

    def __cinit__(self):
        self.free = {}

    cdef uintptr_t take(self, Py_ssize_t size):
        cdef list lst = self.free.get(size)
        if lst:
            self.cached -= size
            self.live += size
            return <uintptr_t>lst.pop()
        return 0

    cdef void count(self, Py_ssize_t size):
        self.live += size

    cdef int give(self, uintptr_t ptr, Py_ssize_t size) except -1:
        cdef list lst = self.free.get(size)
        if lst is None:
            lst = self.free[size] = []
        lst.append(ptr)
        self.live -= size
        self.cached += size
        return 0

    def take_block(self, Py_ssize_t size):
        """A cached block of ``size`` bytes, or 0 (counted live)."""
        return self.take(size)

    def count_block(self, Py_ssize_t size):
        """A new block of ``size`` bytes went into use."""
        self.count(size)

    def give_block(self, uintptr_t ptr, Py_ssize_t size):
        """Return a block (now idle) to the cache."""
        self.give(ptr, size)

    def drain(self):
        """Take every cached block out of the cache: a list of (address, size)."""
        out = [(p, size) for size, lst in self.free.items() for p in lst]
        self.free = {}
        self.cached = 0
        return out


cdef class Buffer:
    """Device memory: ``ptr`` and ``nbytes`` on ``backend``.

    ``host`` is the backing numpy uint8 array on the host backend (None on cuda). ``owner``
    keeps a foreign allocation (DLPack, ``__cuda_array_interface__``) alive; owned memory
    (``owner`` None) goes back to the backend's pool when the last reference goes. Executions
    in flight hold references, so that never happens early. ``accesses`` is the access
    ledger's list for this buffer.
    """

    def __init__(self, backend, ptr, Py_ssize_t nbytes, host=None, owner=None, stream=None):
        self.backend = backend
        self.ptr = ptr
        self.nbytes = nbytes
        self.host = host
        self.owner = owner
        self.accesses = []
        self.last_stream = stream

    def describe(self):
        """A short description for messages."""
        return f"buffer 0x{self.ptr:x} ({self.nbytes} bytes, {getattr(self.backend, 'name', '?')})"

    def __repr__(self):
        return f"<Buffer {self.describe()}>"

    def __del__(self):
        if self.owner is not None or self.backend is None or _Py_IsFinalizing():
            return  # (at interpreter shutdown the modules a free needs may already be gone)
        acc = self.accesses
        if acc:
            # Collected in one garbage pass with an execution that still uses it (an unfinished
            # execution and its buffers form a cycle through the ledger): that execution's own
            # finaliser hands it to its stream's watcher, which keeps this buffer alive; the
            # block goes back once every such execution has finished, not now.
            busy = [a.execution for a in acc if not a.execution.done and not a.execution.capturing]
            if busy:
                _release_after(self, busy)
                return
        self._release()

    def _release(self):
        """Give the block back (to the cache, or to the backend)."""
        if self.cache is not None:  # idle now (see BlockCache): straight back to the cache
            self.cache.give(self.ptr, block_size(self.nbytes))
            return
        try:
            self.backend.free(self)
        except Exception:
            # a destructor must not raise; a context that already failed cannot free anyway
            pass


cdef object _release_after(Buffer buf, list executions):
    """Release ``buf``'s block once every one of ``executions`` has finished."""
    left = [len(executions)]

    def one_finished():
        left[0] -= 1
        if left[0] == 0:
            buf._release()

    for cx in executions:
        cx.on_done(one_finished)


# ---- tensors: the fields every compiled path reads ---------------------------------------------

# layouts (device, shape, strides, dtype, alignment; a partition's tile) as small ints, so a
# launch plan's key hashes a few ints on every call instead of nested tuples. Bounded: when
# cleared, later tensors get new ids (a plan is then made again; never a wrong one).
cdef dict _LAYOUTS = {}
cdef Py_ssize_t _next_layout = 1
cdef dict _CONTIG = {}


cpdef Py_ssize_t layout_id(tuple key) except -1:
    """The small int standing for layout ``key``."""
    global _next_layout
    i = _LAYOUTS.get(key)
    if i is None:
        if len(_LAYOUTS) >= 65536:
            _LAYOUTS.clear()
        i = _LAYOUTS[key] = _next_layout
        _next_layout += 1
    return i


def forget_layouts(backend):
    """Drop the layout ids of ``backend``'s tensors (it runs nothing more): the table holds no
    device that is gone."""
    for k in [k for k in _LAYOUTS if k and k[0] is backend]:
        del _LAYOUTS[k]
    for k in [k for k in _FRESH if k[0] is backend]:
        del _FRESH[k]


# fresh contiguous tensors by (device, shape, dtype, address alignment): (strides, size, bytes,
# layout id); what TensorBase.__init__ would work out, once per layout. Bounded.
cdef dict _FRESH = {}
#: called with each tensor an allocation makes, where set (see set_fresh_tensor_hook)
cdef object _FRESH_HOOK = None


def set_fresh_tensor_hook(fn):
    """Call ``fn(tensor)`` with every tensor an allocation makes from now on (None: stop). For
    harnesses that map device addresses to tensors, such as the stub driver's kernels: these
    tensors are made without ``Tensor.__init__``. Returns the hook set before."""
    global _FRESH_HOOK
    if fn is not None and not callable(fn):
        raise UsageError(f"the fresh-tensor hook must be callable or None, got {type(fn).__name__}")
    prev = _FRESH_HOOK
    _FRESH_HOOK = fn
    return prev


cdef TensorBase new_contiguous(type cls, Buffer buf, tuple shape, dtype):
    """A ``cls`` tensor (TensorBase or a subclass) of shape ``shape`` over ``buf`` from its start,
    contiguous: what ``cls(buf, shape, dtype)`` makes, without working out its layout again."""
    cdef TensorBase t = _contiguous(cls, buf, shape, dtype)
    if _FRESH_HOOK is not None:
        _FRESH_HOOK(t)
    return t


cpdef TensorBase tensor_at(type cls, Buffer buf, tuple shape, dtype, tuple strides, Py_ssize_t offset):
    """What ``cls(buf, shape, dtype, strides, offset)`` makes (``cls``: TensorBase or a
    subclass); a contiguous one from the buffer's start without working out its layout again
    (the tensors another library's code returns, wrapped at every call)."""
    if offset == 0 and strides == contiguous_strides(shape):
        return _contiguous(cls, buf, shape, dtype)
    return cls(buf, shape, dtype, strides, offset)


cdef TensorBase _contiguous(type cls, Buffer buf, tuple shape, dtype):
    cdef TensorBase t = TensorBase.__new__(cls)
    cdef Py_ssize_t size = 1, n
    cdef tuple e
    be = buf.backend
    k = (be, shape, dtype, buf.ptr & 15)
    x = _FRESH.get(k)
    if x is None:
        for n in shape:
            size *= n
        strides = contiguous_strides(shape)
        x = (strides, size, size * dtype.itemsize, layout_id((be, shape, strides, dtype, buf.ptr & 15)))
        if len(_FRESH) >= 1024:
            _FRESH.clear()
        _FRESH[k] = x
    e = <tuple>x
    t.buffer = buf
    t.shape = shape
    t.dtype = dtype
    t.offset = 0
    t.strides = <tuple>e[0]
    t.size = <Py_ssize_t>e[1]
    t.addr = buf.ptr
    t.lo = 0
    t.hi = <Py_ssize_t>e[2]
    t._key = <Py_ssize_t>e[3]
    return t


cpdef tuple contiguous_strides(tuple shape):
    """The row-major element strides of ``shape`` (cached)."""
    st = _CONTIG.get(shape)
    if st is None:
        out = []
        acc = 1
        for s in reversed(shape):
            out.append(acc)
            acc *= max(s, 1)
        st = tuple(reversed(out))
        if len(_CONTIG) >= 1024:
            _CONTIG.clear()
        _CONTIG[shape] = st
    return st


cpdef object foreign_of(TensorBase t):
    """What a layer above keeps for tensor ``t`` as another library sees it (None: nothing
    yet): interop's PyTorch tensor on ``t``'s memory. It lives as long as ``t`` and goes with it."""
    return t._foreign


cpdef int set_foreign(TensorBase t, object view) except -1:
    """Keep ``view`` for tensor ``t`` (see :func:`foreign_of`; None: forget it). ``view`` must
    not hold ``t`` itself (it would keep ``t`` alive by a cycle)."""
    t._foreign = view
    return 0


cdef class TensorBase:
    """The fields of a :class:`~deviceop.Tensor`, declared once for every compiled path.

    ``buffer``, ``shape``, ``dtype``, element ``strides``, byte ``offset``, ``size``, ``addr``
    (the first element's address) and ``_key`` (its layout: what launch plans are keyed by).
    """

    def __init__(self, Buffer buffer not None, tuple shape, dtype, strides=None, Py_ssize_t offset=0):
        cdef Py_ssize_t size = 1, it = dtype.itemsize, lo = 0, hi = 0, n, st
        for n in shape:
            size *= n
        self.buffer = buffer
        self.shape = shape
        self.dtype = dtype
        self.offset = offset
        self.size = size
        self.addr = buffer.ptr + offset
        if strides is None:  # the common case: a fresh, contiguous tensor
            self.strides = contiguous_strides(shape)
            self.lo = offset
            self.hi = offset + size * it
        else:
            self.strides = <tuple?>strides
            if len(self.strides) != len(shape):
                raise ShapeError(f"a tensor of shape {shape} needs {len(shape)} strides, got {strides!r}")
            if size == 0:
                self.lo = self.hi = offset
            else:
                for n, st in zip(shape, strides):
                    if st < 0:
                        lo += (n - 1) * st
                    else:
                        hi += (n - 1) * st
                self.lo = offset + lo * it
                self.hi = offset + (hi + 1) * it
        if size and (self.lo < 0 or self.hi > buffer.nbytes):
            # (a view made by hand: kernels, copies and the ledger take its span as given)
            raise ShapeError(
                f"a tensor of shape {shape}, strides {self.strides} at byte offset {offset} reaches bytes "
                f"[{self.lo}, {self.hi}) of a buffer of {buffer.nbytes}; make views with slicing, view() or "
                "the transpose, which stay inside their buffer"
            )
        # everything about the layout but the address itself (its alignment decides vectorized
        # access); the backend decides the device
        self._key = layout_id((buffer.backend, shape, self.strides, dtype, self.addr & 15))

    @property
    def _span(self):
        """The byte range [lo, hi) of the buffer that this view can touch."""
        return (self.lo, self.hi)


cdef class PartitionBase:
    """The fields of a :class:`~deviceop.Partition`: ``tensor``, ``tile``, ``grid`` and ``_key``."""

    def __init__(self, TensorBase tensor not None, tuple tile, tuple grid):
        self.tensor = tensor
        self.tile = tile
        self.grid = grid
        self._key = layout_id((tile, tensor._key))


cpdef bint plain_shape(shape):
    """Whether ``shape`` is already a shape: a tuple of non-negative Python ints (not bools)."""
    if type(shape) is not tuple:
        return False
    for s in <tuple>shape:
        if type(s) is not int or s < 0:
            return False
    return True


# partitions already validated, by (tensor layout id, tile): (grid, partition layout id). A
# layout id is never given to another layout, so an entry stays right; bounded.
cdef dict _PARTITIONS = {}


cpdef object known_partition(type cls, TensorBase tensor, tile):
    """A ``cls`` partition of ``tensor`` into tiles ``tile`` if one of this layout and tile was
    made before (no validation needed), else None."""
    cdef PartitionBase p
    if not plain_shape(tile):
        return None  # (True, 4) equals (1, 4) as a key, but is refused as a tile
    hit = _PARTITIONS.get((tensor._key, tile))
    if hit is None:
        return None
    p = cls.__new__(cls)
    p.tensor = tensor
    p.tile = tile
    p.grid = (<tuple>hit)[0]
    p._key = (<tuple>hit)[1]
    return p


cpdef int remember_partition(PartitionBase p) except -1:
    """Let later partitions of ``p``'s layout and tile skip validation (``p`` was validated)."""
    if len(_PARTITIONS) >= 4096:
        _PARTITIONS.clear()
    _PARTITIONS[(p.tensor._key, p.tile)] = (p.grid, p._key)
    return 0


# ---- wake-up channels ------------------------------------------------------------------------

cdef int chan_push(chan_t* c, uint64_t token) noexcept nogil:
    """Queue ``token`` and wake the reader; safe on any thread without the GIL."""
    cdef uint64_t one = 1
    cdef uint64_t* nb
    pthread_mutex_lock(&c.mu)
    if c.n == c.cap:
        nb = <uint64_t*>realloc(c.buf, (c.cap * 2 if c.cap else 64) * sizeof(uint64_t))
        if nb == NULL:
            pthread_mutex_unlock(&c.mu)
            return -1
        c.buf = nb
        c.cap = c.cap * 2 if c.cap else 64
    c.buf[c.n] = token
    c.n += 1
    if c.n == 1:
        write(c.fd, &one, 8)  # EAGAIN: the counter is already set, the reader wakes anyway
    pthread_mutex_unlock(&c.mu)
    return 0


cdef void chan_unref(chan_t* c) noexcept nogil:
    cdef bint last
    pthread_mutex_lock(&c.mu)
    c.refs -= 1
    last = c.refs == 0
    pthread_mutex_unlock(&c.mu)
    if last:
        close(c.fd)
        free(c.buf)
        pthread_mutex_destroy(&c.mu)
        free(c)


cdef class Channel:
    """A wake-up channel: tokens pushed by host functions (no GIL) or Python, drained by an event loop.

    The loop watches :meth:`fileno` for readability and calls :meth:`drain`. A pending host
    function holds a reference to the channel's C state, so dropping the Python object while
    notifications are in flight is safe.
    """

    def __cinit__(self):
        cdef chan_t* c = <chan_t*>malloc(sizeof(chan_t))
        if c == NULL:
            raise MemoryError()
        c.fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)
        if c.fd < 0:
            free(c)
            PyErr_SetFromErrno(OSError)
        pthread_mutex_init(&c.mu, NULL)
        c.buf = NULL
        c.n = c.cap = 0
        c.refs = 1
        self.c = c

    def __dealloc__(self):
        if self.c != NULL:
            chan_unref(self.c)
            self.c = NULL

    cdef chan_t* ref(self) except NULL:
        """A reference for a pending notification (released by chan_unref)."""
        pthread_mutex_lock(&self.c.mu)
        self.c.refs += 1
        pthread_mutex_unlock(&self.c.mu)
        return self.c

    def fileno(self):
        """The fd to watch for readability."""
        return self.c.fd

    def push(self, uint64_t token):
        """Queue a token and wake the reader (any thread)."""
        if chan_push(self.c, token) != 0:
            raise MemoryError("wake-up channel: out of memory")

    def drain(self):
        """The tokens pushed since the last drain (resets the fd first, so no push is lost)."""
        cdef uint64_t v
        cdef size_t i
        read(self.c.fd, &v, 8)
        pthread_mutex_lock(&self.c.mu)
        out = [self.c.buf[i] for i in range(self.c.n)]
        self.c.n = 0
        pthread_mutex_unlock(&self.c.mu)
        return out

    def pending(self):
        """The number of references held by notifications still in flight."""
        return self.c.refs - 1


cdef class Driver:
    """Driver entry points for the compiled core, filled once by a backend (cuda); empty on host.

    ``error(code, call)`` turns a driver result code into the backend's ``CudaError``.
    """

    def has_launch(self):
        """True if kernels can be launched through this table."""
        return self.launch_kernel != NULL


cdef inline void* _current_ctx(Driver d) noexcept:
    # asked of the driver: another library may have changed the thread's context since deviceop
    # last set it (PyTorch's torch.cuda.set_device, a cudaSetDevice), so deviceop's own record
    # serves only a table without the query
    cdef void* cur = NULL
    if d.ctx_get != NULL and d.ctx_get(&cur) == 0:
        return cur
    return dvo_current_ctx


cdef int make_current(Driver d) except -1:
    """Make ``d``'s context current on this thread unless it is (a driver query; one call more
    when it is not)."""
    global dvo_current_ctx
    cdef int err
    if d.ctx_set == NULL or _current_ctx(d) == d.context:
        return 0
    err = d.ctx_set(d.context)
    if err:
        raise d.error(err, "cuCtxSetCurrent")
    dvo_current_ctx = d.context
    return 0


def set_current(Driver d):
    """Make ``d``'s context current on the calling thread (see :func:`make_current`): the one
    record of the current context, which every device's backend goes through."""
    make_current(d)


def swap_current(Driver d):
    """Make ``d``'s context current on the calling thread and return the context that was (0 if
    none was known), for :func:`restore_current`: a call made for another device in the middle
    of an execution, whose later driver calls need its own device's context back."""
    cdef void* prev = _current_ctx(d)
    make_current(d)
    return <uintptr_t>prev


def restore_current(Driver d, uintptr_t prev):
    """Make context ``prev`` (from :func:`swap_current`) current again; 0 leaves ``d``'s."""
    global dvo_current_ctx
    cdef int err
    if prev == 0 or d.ctx_set == NULL or <void*>prev == _current_ctx(d):
        return
    err = d.ctx_set(<void*>prev)
    if err:
        raise d.error(err, "cuCtxSetCurrent")
    dvo_current_ctx = <void*>prev


cdef int _ready_on(Driver d, void* ash, object stream) except -1:
    """Make what was just allocated on the allocation stream ``ash`` usable on ``stream``."""
    cdef int err = 1
    if d.stream_query != NULL:
        with nogil:
            err = d.stream_query(ash)
        if err == 0:
            return 0  # the allocation stream has passed it: usable by any stream now
        if err != 600:  # CUDA_ERROR_NOT_READY
            raise d.error(err, "cuStreamQuery")
    d.after_alloc(stream)
    return 0


cpdef Buffer driver_alloc(Driver d, object backend, object stream, Py_ssize_t nbytes):
    """A buffer of ``nbytes`` on ``stream``: a cached idle block of its size class, else one from
    the driver's pool (``d.mem_alloc``). When the pool is out of memory, the executions whose
    work has completed but which no thread has finished yet are finished first
    (``backend.reclaim()``): their blocks go back to the cache, and one of this size class is
    taken from there, the other idle blocks kept. Without one, every idle block goes back to
    the pool (``backend.empty_cache()``) and the allocation is tried once more.
    The buffer returns its block to the cache when it is dropped.

    A fresh block is allocated on the driver's allocation stream (``d.alloc_stream``) where it
    has one, not on ``stream``: a stream that served a stream-ordered allocation launches and
    synchronizes more slowly from then on (every later graph replay on it pays), and the
    block cache, not the driver's stream order, is what keeps blocks from being reused while in
    use. The block is ready for ``stream`` once the allocation stream has passed the allocation;
    where the pool made it wait on other work (memory another stream freed), ``stream`` is
    ordered after it (``d.after_alloc``)."""
    cdef BlockCache blocks = d.blocks
    cdef Py_ssize_t size = block_size(nbytes if nbytes > 0 else 1)
    cdef uintptr_t ptr = blocks.take(size)
    cdef void* sh = <void*><uintptr_t>stream.handle_int
    cdef void* ash = <void*>d.alloc_stream if d.alloc_stream else sh
    cdef int err = 0
    cdef bint fresh = ptr == 0
    cdef Buffer buf
    if fresh:
        with nogil:
            err = d.mem_alloc(&ptr, size, ash)
        if err == 2:  # CUDA_ERROR_OUT_OF_MEMORY: completed work's blocks go back to the cache
            backend.reclaim()
            # (idle, ready for any stream, counted live by take; also one another thread gave
            # back meanwhile, whatever this reclaim found)
            ptr = blocks.take(size)
            if ptr != 0:
                fresh = False
                err = 0
            else:  # none of this size: every idle block goes back to the pool, and once more
                backend.empty_cache()
                with nogil:
                    err = d.mem_alloc(&ptr, size, ash)
        if err:
            raise d.error(err, f"cuMemAllocAsync({nbytes} bytes)")
    if fresh:
        blocks.count(size)
        if ash != sh:
            try:
                _ready_on(d, ash, stream)
            except BaseException:
                # never handed out, and perhaps not ready for other streams: back to the driver
                # in the allocation stream's order, not to the cache
                blocks.live -= size
                if d.mem_free != NULL:
                    d.mem_free(ptr, ash)
                raise
    buf = Buffer.__new__(Buffer)
    buf.backend = backend
    buf.ptr = ptr
    buf.nbytes = nbytes
    buf.accesses = []
    buf.last_stream = stream
    buf.cache = blocks
    return buf


# ---- staged copies between host and device memory -------------------------------------------
# The host side of a copy goes through a page-locked staging block (the DMA engine reads or
# writes it while the host goes on). Blocks come in power-of-two size classes from 4 KiB, are
# kept per device once allocated (cuMemHostAlloc costs milliseconds) and are taken and given
# back under the GIL, which makes the free lists' one-step updates atomic without a lock. A copy
# takes an idle block of a larger class (up to 16 times its own) before it allocates: a program
# whose copies got smaller (a service's batches at a lighter load) would otherwise allocate a
# set of blocks per class, milliseconds each on the thread that enqueues, while larger ones idle.

#: copies at least this large run with the GIL released (other threads go on meanwhile)
cdef Py_ssize_t _NOGIL_BYTES = 1 << 20


cdef inline Py_ssize_t _staging_class(Py_ssize_t n) noexcept:
    cdef Py_ssize_t s = 4096
    while s < n:
        s <<= 1
    return s


#: a copy takes an idle staging block of up to this many classes above its own before it allocates
cdef int _STAGING_UP = 4


cdef uintptr_t _take_staging(Driver d, Py_ssize_t* size) except 0:
    """An idle staging block of ``size[0]`` bytes (a class), else the smallest idle one of up to
    ``_STAGING_UP`` classes larger, else a new one; ``size[0]`` becomes the class of the block."""
    cdef void* p = NULL
    cdef int err, up
    cdef Py_ssize_t s = size[0]
    pinned = d.pinned
    for up in range(_STAGING_UP + 1):
        lst = pinned.get(s)
        if lst:
            size[0] = s
            return <uintptr_t>lst.pop()
        s <<= 1
    with nogil:
        err = d.host_alloc(&p, <size_t>size[0])
    if err:
        raise d.error(err, "cuMemHostAlloc")
    return <uintptr_t>p


cdef int _give_staging(Driver d, uintptr_t p, Py_ssize_t size) except -1:
    lst = d.pinned.get(size)
    if lst is None:
        lst = d.pinned.setdefault(size, [])
    lst.append(p)
    return 0


cdef inline void _host_copy(void* dst, const void* src, Py_ssize_t n) noexcept:
    if n >= _NOGIL_BYTES:
        with nogil:
            memcpy(dst, src, <size_t>n)
    else:
        memcpy(dst, src, <size_t>n)


cdef class StagedIn:
    """What a copy to the device leaves to do once it completes: give its staging block back."""

    cdef Driver d
    cdef uintptr_t p
    cdef Py_ssize_t size

    def __call__(self):
        if self.p:
            _give_staging(self.d, self.p, self.size)
            self.p = 0


cdef class StagedOut:
    """What a copy from the device leaves to do once it completes: copy the staged bytes into
    ``out`` and give the staging block back (also after a failure, when ``out`` is never
    handed out)."""

    cdef Driver d
    cdef uintptr_t p
    cdef Py_ssize_t size
    cdef object out

    def __call__(self):
        cdef Py_buffer view
        if not self.p:
            return
        try:
            PyObject_GetBuffer(self.out, &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
            try:
                _host_copy(view.buf, <const void*>self.p, view.len)
            finally:
                PyBuffer_Release(&view)
        finally:
            self.out = None
            _give_staging(self.d, self.p, self.size)
            self.p = 0


cdef object stage_in(Driver d, uintptr_t stream, uintptr_t dst, object src):
    """Enqueue on ``stream`` a copy of array ``src`` (read now: a snapshot) to device address
    ``dst``; return what to call once the stream has passed it (None for no bytes)."""
    cdef Py_buffer view
    cdef Py_ssize_t n, size
    cdef uintptr_t p
    cdef int err
    cdef StagedIn done
    try:
        PyObject_GetBuffer(src, &view, PyBUF_C_CONTIGUOUS)
    except (BufferError, ValueError):  # a strided or Fortran-ordered array: its C-ordered copy
        src = src.copy(order="C")  # (a numpy array's own copy: no numpy import here)
        PyObject_GetBuffer(src, &view, PyBUF_C_CONTIGUOUS)
    try:
        n = view.len
        if n == 0:
            return None
        size = _staging_class(n)
        p = _take_staging(d, &size)
        _host_copy(<void*>p, view.buf, n)
    finally:
        PyBuffer_Release(&view)
    with nogil:  # (the driver may block: a full queue)
        err = d.memcpy_htod(dst, <const void*>p, <size_t>n, <void*>stream)
    if err:
        _give_staging(d, p, size)
        raise d.error(err, "cuMemcpyHtoDAsync")
    done = StagedIn.__new__(StagedIn)
    done.d = d
    done.p = p
    done.size = size
    return done


cdef uintptr_t _staged_dtoh(Driver d, uintptr_t stream, uintptr_t src, Py_ssize_t n, Py_ssize_t* size) except 0:
    """A staging block of class ``size[0]`` (or larger: see :func:`_take_staging`) into which a
    copy of ``n`` bytes from device address ``src`` is enqueued on ``stream`` (the block goes
    back if the driver refuses the copy)."""
    cdef uintptr_t p = _take_staging(d, size)
    cdef int err
    with nogil:
        err = d.memcpy_dtoh(<void*>p, src, <size_t>n, <void*>stream)
    if err:
        _give_staging(d, p, size[0])
        raise d.error(err, "cuMemcpyDtoHAsync")
    return p


cdef object stage_out(Driver d, uintptr_t stream, uintptr_t src, object out):
    """Enqueue on ``stream`` a copy from device address ``src`` into C-contiguous array ``out``
    (all its bytes); return what to call once the stream has passed it, which fills ``out``
    (None for no bytes)."""
    cdef Py_ssize_t n = out.nbytes
    cdef Py_ssize_t size
    cdef uintptr_t p
    cdef StagedOut done
    if n == 0:
        return None
    size = _staging_class(n)
    p = _staged_dtoh(d, stream, src, n, &size)
    done = StagedOut.__new__(StagedOut)
    done.d = d
    done.p = p
    done.size = size
    done.out = out
    return done


#: page-locked bytes lent to result arrays at most (past it, results are copied out of a staging
#: block): page-locked memory cannot be swapped, and a program keeping many results would pin them all
cdef Py_ssize_t _LEND_CAP = 256 << 20
cdef const char* _BYTE_FORMAT = "B"
cdef Py_ssize_t _lent = 0


cdef class Lent:
    """A page-locked block lent to the numpy array a copy from the device returns: the copy
    writes the array's memory directly, with no host copy when it completes. The block goes
    back to its device's pool once the array and every view of it are gone; the execution
    holds it too (as a completion callback that does nothing) until the copy has completed."""

    cdef Driver d
    cdef uintptr_t p
    cdef Py_ssize_t size
    cdef Py_ssize_t n

    def __getbuffer__(self, Py_buffer* view, int flags):
        view.buf = <void*>self.p
        view.len = self.n
        view.readonly = 0
        view.itemsize = 1
        view.format = <char*>_BYTE_FORMAT if flags & PyBUF_FORMAT else NULL
        view.ndim = 1
        view.shape = &self.n
        view.strides = NULL
        view.suboffsets = NULL
        view.internal = NULL
        view.obj = self

    def __releasebuffer__(self, Py_buffer* view):
        pass

    def __call__(self):
        pass

    def __dealloc__(self):
        global _lent
        if self.p and not _Py_IsFinalizing():
            _lent -= self.size
            _give_staging(self.d, self.p, self.size)
        self.p = 0


cdef object lend_out(Driver d, uintptr_t stream, uintptr_t src, Py_ssize_t n):
    """Enqueue on ``stream`` a copy of ``n`` bytes from device address ``src`` into a page-locked
    block lent to the caller's result (see :class:`Lent`); None where none is lent (no bytes,
    or as many are lent as the cap allows): then copy through :func:`stage_out`."""
    global _lent
    cdef Py_ssize_t size
    cdef Lent blk
    if n == 0:
        return None
    size = _staging_class(n)
    if _lent + size > _LEND_CAP:
        return None
    blk = Lent.__new__(Lent)
    blk.d = d
    blk.p = _staged_dtoh(d, stream, src, n, &size)
    blk.size = size
    blk.n = n
    _lent += size
    return blk


def lent_bytes():
    """Page-locked bytes lent to result arrays now (for tests and diagnostics)."""
    return _lent


def set_lend_cap(Py_ssize_t nbytes):
    """Lend at most ``nbytes`` of page-locked memory to result arrays (default 256 MiB; 0: never,
    every result is copied into memory of its own); returns the previous cap."""
    global _LEND_CAP
    if nbytes < 0:
        raise UsageError(f"the lending cap is a number of bytes >= 0, got {nbytes}")
    prev = _LEND_CAP
    _LEND_CAP = nbytes
    return prev


def staged_upload(Driver d, uintptr_t stream, uintptr_t dst, src):
    """:func:`stage_in` for backends: the callable to run at completion, or None."""
    return stage_in(d, stream, dst, src)


def staged_download(Driver d, uintptr_t stream, uintptr_t src, out):
    """:func:`stage_out` for backends: the callable to run at completion (it fills ``out``), or None."""
    return stage_out(d, stream, src, out)


def staging_blocks(Driver d):
    """``{size class: idle staging blocks}`` of ``d`` (for tests and diagnostics)."""
    return {k: len(v) for k, v in d.pinned.items()} if d.pinned is not None else {}
