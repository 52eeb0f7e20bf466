# cython: language_level=3
"""The op behind ``do.external`` and ``do.interop.torch``: another library's work, ordered by the ledger.

Its construction names the memory the work touches; its run orders and registers those
accesses and calls ``fn`` under the ledger lock, in one compiled path. What it needs from the
layer that makes it, naming a foreign array (``interop``'s regions) and the host backend's call
in stream order, that layer hands to each op it makes (``namer=``, ``host_call=``).
"""

cimport cython
from cpython.contextvars cimport get_value
from cpython.object cimport PyObject
from cpython.long cimport PyLong_AsVoidPtr, PyLong_FromVoidPtr
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_IsValid
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.weakref cimport PyWeakref_NewRef
from libc.stdint cimport int32_t, int64_t, uintptr_t

from ._base cimport _LOCK as LOCK, Buffer, PartitionBase, TensorBase, contiguous_strides, make_current
from ._dlpack cimport DLPackExchangeAPI, DLPackExchangeAPIHeader, DLTensor, DLTensorFromPyObjectNoSync
from ._ledger cimport ExecutionContext, check_backend, order, order_tensor
from ._op cimport DeviceOp

from .._errors import UsageError
from ._select import _selected, _state, current

__all__ = ["External", "inside_stream", "layout", "named", "remember", "same_layout", "seen", "swap_inside", "wrapper"]


# the stream whose ``external`` fn this thread is running (exports inside it need no wait): a C
# thread-local, as a threading.local's attribute costs more than the rest of a step's call
cdef extern from *:
    """
    static __thread PyObject *dvo_inside = NULL;  /* a strong reference, or NULL */

    /* Make s (None: none) this thread's inside stream; returns the one before (a new reference). */
    static PyObject *dvo_inside_swap(PyObject *s) {
        PyObject *prev = dvo_inside;
        if (s == Py_None) {
            dvo_inside = NULL;
        } else {
            Py_INCREF(s);
            dvo_inside = s;
        }
        if (prev == NULL) {
            Py_RETURN_NONE;
        }
        return prev;  /* the reference the thread-local held passes to the caller */
    }

    static PyObject *dvo_inside_get(void) {
        PyObject *s = dvo_inside != NULL ? dvo_inside : Py_None;
        Py_INCREF(s);
        return s;
    }
    """
    object dvo_inside_swap(object s)
    object dvo_inside_get()


def inside_stream():
    """The stream whose :func:`~deviceop.interop.external` fn this thread is running, or None."""
    return dvo_inside_get()


def swap_inside(stream):
    """Make ``stream`` (None: none) this thread's :func:`inside_stream`; returns the one before,
    which the caller puts back when its fn returns."""
    return dvo_inside_swap(stream)


cdef object _SELECTED = _selected
cdef dict _STATE = _state


cdef inline object _current():
    """``current()`` without the Python call where a device is selected or made already."""
    be = get_value(_SELECTED, None)
    if be is None:
        be = _STATE.get("backend")  # (PyDict_GetItem would save and restore the error state)
        if be is None:
            return current()
    return be


# ---- foreign arrays named again and again (a model's inputs and outputs) ----------------------

# a tensor's data address and size, read through its type's own descriptors (found once per
# type): a step names a tensor again and again, and Python's attribute lookup on a PyTorch
# tensor costs as much as PyTorch's own getter
cdef extern from *:
    """
    /* d(obj) for a method descriptor of METH_NOARGS, obj an instance of its type */
    static PyObject *dvo_call_noargs(PyObject *d, PyObject *obj) {
        PyMethodDef *m = ((PyMethodDescrObject *)d)->d_method;
        return m->ml_meth(obj, NULL);
    }
    static int dvo_is_noargs(PyObject *d) {
        return Py_IS_TYPE(d, &PyMethodDescr_Type)
            && (((PyMethodDescrObject *)d)->d_method->ml_flags & ~METH_COEXIST) == METH_NOARGS;
    }
    /* d.__get__(obj) for a getset descriptor with a getter, obj an instance of its type */
    static PyObject *dvo_get(PyObject *d, PyObject *obj) {
        PyGetSetDef *g = ((PyGetSetDescrObject *)d)->d_getset;
        return g->get(obj, g->closure);
    }
    static int dvo_is_getset(PyObject *d) {
        return Py_IS_TYPE(d, &PyGetSetDescr_Type) && ((PyGetSetDescrObject *)d)->d_getset->get != NULL;
    }
    /* ref() without a call: the referent (a new reference), or None */
    static PyObject *dvo_deref(PyObject *ref) {
    #if PY_VERSION_HEX >= 0x030D0000
        PyObject *o;
        if (PyWeakref_GetRef(ref, &o) < 0) return NULL;
        if (o == NULL) Py_RETURN_NONE;
        return o;
    #else
        PyObject *o = PyWeakref_GET_OBJECT(ref);  /* (ref is a weakref: no check needed) */
        Py_INCREF(o);
        return o;
    #endif
    }
    /* ref() is obj, without a reference where the API allows it */
    static int dvo_refers_to(PyObject *ref, PyObject *obj) {
    #if PY_VERSION_HEX >= 0x030D0000
        PyObject *o;
        if (PyWeakref_GetRef(ref, &o) <= 0) { PyErr_Clear(); return 0; }
        Py_DECREF(o);
        return o == obj;
    #else
        return PyWeakref_GET_OBJECT(ref) == obj;
    #endif
    }
    """
    object dvo_call_noargs(object d, object obj)
    bint dvo_is_noargs(object d)
    object dvo_get(object d, object obj)
    bint dvo_is_getset(object d)
    object dvo_deref(object ref)
    bint dvo_refers_to(object ref, object obj)


cdef class _Reader:
    """How to read a tensor's *extent* of one type: its first byte's address and its size in
    bytes, compared each time it is named again (a change means it is described anew).

    Where the type publishes the DLPack C exchange API (recent PyTorch), one C call
    fills a DLTensor and the extent is the byte span its shape and strides reach (an in-place
    change of either that moves the span is seen). Else ``data_ptr()`` and ``nbytes``, read
    through the type's descriptors where they are PyTorch's C ones (a subclass may override
    either), in Python otherwise."""

    cdef DLTensorFromPyObjectNoSync dl  # the type's own exchange function, or NULL
    cdef object data_ptr  # the method descriptor, or None: call obj.data_ptr()
    cdef object nbytes    # the getset descriptor, or None: read obj.nbytes

    cdef int extent(self, obj, uintptr_t* ptr, Py_ssize_t* size) except -1:
        cdef DLTensor t
        cdef int64_t lo, hi, it
        if self.dl != NULL:
            _fill(self, obj, &t)
            if not _reach(&t, &lo, &hi):  # no bytes (and producers may give no address)
                ptr[0] = 0
                size[0] = 0
                return 0
            it = _itemsize(&t)
            ptr[0] = <uintptr_t>t.data + <uintptr_t>t.byte_offset + <uintptr_t>(lo * it)
            size[0] = <Py_ssize_t>((hi - lo + 1) * it)
            return 0
        ptr[0] = <uintptr_t>PyLong_AsVoidPtr(
            dvo_call_noargs(self.data_ptr, obj) if self.data_ptr is not None else obj.data_ptr()
        )
        size[0] = dvo_get(self.nbytes, obj) if self.nbytes is not None else obj.nbytes
        return 0


cdef dict _READERS = {}  # by type


cdef object _found(tp, str name):
    """What ``tp.name`` resolves to in its MRO, before any binding (None: not found)."""
    for k in tp.__mro__:
        d = k.__dict__.get(name)
        if d is not None:
            return d
    return None


cdef DLTensorFromPyObjectNoSync _exchange(tp) except? NULL:
    """The DLTensor function of the exchange API ``tp`` itself publishes (a subclass would
    bypass its overrides), of DLPack major version 1; NULL where there is none."""
    cap = tp.__dict__.get("__dlpack_c_exchange_api__")
    if cap is None or not PyCapsule_IsValid(cap, b"dlpack_exchange_api"):
        return NULL
    cdef DLPackExchangeAPIHeader* h = <DLPackExchangeAPIHeader*>PyCapsule_GetPointer(cap, b"dlpack_exchange_api")
    while h != NULL and h.version.major > 1:  # a newer API links the older ones
        h = h.prev_api
    if h == NULL or h.version.major != 1:
        return NULL
    return (<DLPackExchangeAPI*>h).dltensor_from_py_object_no_sync


cdef _Reader _reader(tp):
    r = _READERS.get(tp)
    if r is not None:
        return <_Reader>r
    cdef _Reader rd = _Reader.__new__(_Reader)
    rd.dl = _exchange(tp)
    d = _found(tp, "data_ptr")
    if d is not None and dvo_is_noargs(d):
        rd.data_ptr = d
    d = _found(tp, "nbytes")
    if d is not None and dvo_is_getset(d):
        rd.nbytes = d
    _READERS[tp] = rd
    return rd


def extent(obj):
    """``(address, size in bytes)`` of a PyTorch tensor as the cache compares it (see
    :class:`_Reader`)."""
    cdef uintptr_t ptr
    cdef Py_ssize_t size
    _reader(type(obj)).extent(obj, &ptr, &size)
    return ptr, size


def layout(obj):
    """``(address, shape, element strides, dtype key, device type, lo, hi)`` of a tensor, read
    in one C call through the DLPack C exchange API its own type publishes (rather than six
    getters of a PyTorch tensor: this runs at every step that returns one); ``lo``/``hi``: the
    byte span its shape and strides reach, as addresses; the dtype key: ``code << 16 | bits << 8
    | lanes``. None where its type publishes none (older PyTorch, subclasses)."""
    cdef _Reader r = _reader(type(obj))
    cdef DLTensor t
    cdef int64_t lo, hi, it
    cdef int32_t i
    if r.dl == NULL:
        return None
    _fill(r, obj, &t)
    cdef uintptr_t ptr = <uintptr_t>t.data + <uintptr_t>t.byte_offset
    shape = tuple([t.shape[i] for i in range(t.ndim)])
    if t.strides != NULL:
        strides = tuple([t.strides[i] for i in range(t.ndim)])
    else:  # compact, row-major
        strides = contiguous_strides(shape)
    key = (<int>t.dtype.code << 16) | (<int>t.dtype.bits << 8) | <int>t.dtype.lanes
    if not _reach(&t, &lo, &hi):
        return ptr, shape, strides, key, t.device.device_type, ptr, ptr
    it = _itemsize(&t)
    return (ptr, shape, strides, key, t.device.device_type,
            ptr + <uintptr_t>(lo * it), ptr + <uintptr_t>((hi + 1) * it))


def same_layout(obj, TensorBase t not None):
    """Whether array ``obj`` lies exactly on deviceop tensor ``t`` as made: the same first
    element's address, dtype, shape and element strides, read in one C call through the DLPack
    C exchange API its type publishes (False where it publishes none: the caller makes a new
    one). A PyTorch tensor handed to code again and again is checked this way for in-place
    changes of its metadata (``t_()``, ``unsqueeze_()``, ``as_strided_()``, ``.data =``)."""
    cdef _Reader r = _reader(type(obj))
    cdef DLTensor d
    cdef int32_t i
    cdef int64_t acc = 1, s
    cdef tuple shape = t.shape, strides = t.strides
    dt = t.dtype
    if r.dl == NULL:
        return False
    _fill(r, obj, &d)
    if d.ndim != len(shape) or <uintptr_t>d.data + <uintptr_t>d.byte_offset != t.addr:
        return False
    if d.dtype.lanes != 1 or d.dtype.code != <int>dt.dl_code or d.dtype.bits != <int>dt.itemsize * 8:
        return False
    for i in range(d.ndim - 1, -1, -1):
        s = d.strides[i] if d.strides != NULL else acc
        acc *= d.shape[i]
        if d.shape[i] != <int64_t>shape[i] or s != <int64_t>strides[i]:
            return False
    return True


cdef int _fill(_Reader r, obj, DLTensor* t) except -1:
    if r.dl(<void*>obj, t) != 0:
        return -1  # (the producer set the exception)
    return 0


@cython.cdivision(True)
cdef inline int64_t _itemsize(DLTensor* t) noexcept:
    return (<int64_t>t.dtype.bits * t.dtype.lanes + 7) // 8


cdef bint _reach(DLTensor* t, int64_t* lo, int64_t* hi) noexcept:
    """The element offsets of ``t``'s lowest and highest elements from its first (by its shape
    and strides; compact row-major where it gives none); False where it has no elements."""
    cdef int64_t acc = 1, s
    cdef int32_t i
    lo[0] = 0
    hi[0] = 0
    for i in range(t.ndim - 1, -1, -1):
        if t.shape[i] == 0:
            return False
        s = t.strides[i] if t.strides != NULL else acc
        acc *= t.shape[i]
        if s < 0:
            lo[0] += (t.shape[i] - 1) * s
        else:
            hi[0] += (t.shape[i] - 1) * s
    return True


def uses_exchange(tp):
    """Whether tensors of type ``tp`` are read through the DLPack C exchange API (for tests)."""
    return _reader(tp).dl != NULL


cdef class Seen:
    """A PyTorch tensor as last described: the tensor (weak) and its address, its extent then
    (with the reader of its type), the device, its region (start, size, host view, access
    list), its byte range there, and its last wrapper (weak)."""

    cdef object ref
    cdef uintptr_t addr
    cdef _Reader reader
    cdef uintptr_t ptr         # the extent then: first byte's address
    cdef Py_ssize_t size_then  # and size in bytes
    cdef object be
    cdef uintptr_t start
    cdef Py_ssize_t nbytes
    cdef object host
    cdef list accesses
    cdef Py_ssize_t lo, hi
    cdef object last


# by id() of the tensor; an entry goes when its tensor does
cdef dict SEEN = {}

# the entries found last, by their tensor's address: a step names the same few tensors again
# and again, and this finds them without making an int of the address to look it up in SEEN.
# Two ways per set: two tensors a step names whose addresses fall in one set must not evict
# each other on every step (a miss costs an int, a dict lookup and a slot write).
cdef enum:
    N_SETS = 64
cdef list _SLOTS = [None] * (2 * N_SETS)


cdef inline Py_ssize_t _set_of(uintptr_t addr) noexcept:
    """The first slot of the set of an object address (Fibonacci hashing: object addresses
    share their low bits and are spaced by their allocator's strides)."""
    return <Py_ssize_t>((<unsigned long long>addr * 0x9E3779B97F4A7C15ULL) >> 58) * 2


cdef inline void _keep(Seen e):
    """Make ``e`` the set's most recent entry; the older one moves to the set's second way
    (an entry of the same tensor is replaced, not kept twice)."""
    cdef Py_ssize_t i = _set_of(e.addr)
    x = _SLOTS[i]
    y = _SLOTS[i + 1]
    if x is not None and (<Seen>x).addr != e.addr:
        _SLOTS[i + 1] = x
    elif y is not None and (<Seen>y).addr == e.addr:
        _SLOTS[i + 1] = None
    _SLOTS[i] = e


cdef class _Forget:
    cdef object key

    def __call__(self, ref):
        e = SEEN.get(self.key)
        if e is not None and (<Seen>e).ref is ref:
            del SEEN[self.key]
            i = _set_of((<Seen>e).addr)
            if _SLOTS[i] is e:
                _SLOTS[i] = None
            if _SLOTS[i + 1] is e:
                _SLOTS[i + 1] = None


# one access an external op names: a byte range [lo, hi) of its target (a wrapper Buffer of a
# foreign array's region), or a deviceop tensor (``tensor``: the ledger takes its span); read
# or written. The targets themselves are in a list beside (the collector sees them).
cdef struct Acc:
    Py_ssize_t lo, hi
    bint write, tensor

cdef enum:
    N_INLINE = 4  # accesses held in the op itself (more: a heap array)


@cython.boundscheck(False)
@cython.wraparound(False)
cdef inline object _in_slots(obj):
    """The entry of ``obj`` in the slots, or None (not found there)."""
    cdef uintptr_t addr = <uintptr_t><void*>obj
    cdef Py_ssize_t i = _set_of(addr)
    x = _SLOTS[i]
    if x is not None and (<Seen>x).addr == addr:
        return x
    x = _SLOTS[i + 1]
    if x is not None and (<Seen>x).addr == addr:
        return x
    return None


cdef Py_ssize_t _looked_up = 0  # entries looked for in SEEN: not found in the slots


def looked_up():
    """How many times a PyTorch tensor named was looked for in the cache's dict, not found in
    its slots (for tests)."""
    return _looked_up


def set_of(obj):
    """The set of slots an object would occupy (for tests)."""
    return _set_of(<uintptr_t><void*>obj) // 2


cdef object _seen(obj, be, Py_ssize_t* lo, Py_ssize_t* hi):
    """The wrapper Buffer of PyTorch tensor ``obj`` if it was described before on device ``be``
    and is unchanged since, with its byte range there in ``lo``/``hi``; else None."""
    global _looked_up
    cdef Seen e
    cdef uintptr_t ptr
    cdef Py_ssize_t size
    x = _in_slots(obj)
    if x is None:
        _looked_up += 1
        x = SEEN.get(PyLong_FromVoidPtr(<void*>obj))
        if x is None:
            return None
        _keep(<Seen>x)
    e = <Seen>x
    if not dvo_refers_to(e.ref, obj) or e.be is not be:
        return None
    e.reader.extent(obj, &ptr, &size)
    if ptr != e.ptr or size != e.size_then:
        return None
    b = dvo_deref(e.last)
    if b is None:
        b = wrapper(be, e.start, e.nbytes, e.host, obj, e.accesses)
        e.last = PyWeakref_NewRef(b, None)
    lo[0] = e.lo
    hi[0] = e.hi
    return b


def seen(obj, be, bint write):
    """The ledger access ``(buffer, lo, hi, write)`` of a PyTorch tensor described before on
    device ``be`` and unchanged since (the same object and extent: see :class:`_Reader`), else
    None.

    Through the DLPack C exchange API the extent is the byte span the tensor's shape and
    strides reach, so any in-place change of the bytes it spans is seen (``resize_``, ``set_``,
    ``as_strided_``), and one that keeps them (``t_``, ``squeeze_``) needs no new description.
    Through ``data_ptr()`` and ``nbytes`` (older PyTorch, subclasses) the size in bytes stands
    for the span: ``as_strided_`` and ``set_`` with new strides over as many bytes escape both.

    Its region lives (the tensor is one of its users); its last wrapper serves again while
    something (work in flight) keeps it, else a new one is made, which keeps the tensor alive.
    """
    cdef Py_ssize_t lo, hi
    b = _seen(obj, be, &lo, &hi)
    return None if b is None else (b, lo, hi, write)


cpdef Buffer wrapper(be, uintptr_t start, Py_ssize_t nbytes, host, owner, list accesses):
    """A Buffer of foreign memory [start, start + nbytes) on device ``be`` that keeps ``owner``
    alive and shares the region's access list ``accesses``."""
    cdef Buffer buf = Buffer.__new__(Buffer)
    buf.backend = be
    buf.ptr = start
    buf.nbytes = nbytes
    buf.host = host
    buf.owner = owner
    buf.accesses = accesses
    return buf


def remember(obj, be, Buffer buf, Py_ssize_t lo, Py_ssize_t hi):
    """Keep what describing PyTorch tensor ``obj`` found (its wrapper ``buf`` of its region,
    with the byte range [lo, hi) of the region) and its extent now, for :func:`seen`. Held
    weakly: the tensor's death forgets it."""
    cdef Seen e = Seen.__new__(Seen)
    cdef _Forget f = _Forget.__new__(_Forget)
    e.reader = _reader(type(obj))
    e.reader.extent(obj, &e.ptr, &e.size_then)
    f.key = PyLong_FromVoidPtr(<void*>obj)
    e.ref = PyWeakref_NewRef(obj, f)
    e.addr = <uintptr_t><void*>obj
    e.be = be
    e.start = buf.ptr
    e.nbytes = buf.nbytes
    e.host = buf.host
    e.accesses = buf.accesses
    e.lo = lo
    e.hi = hi
    e.last = PyWeakref_NewRef(buf, None)
    SEEN[f.key] = e
    _keep(e)


cpdef tuple named(items, str what):
    """``reads``/``writes`` as a tuple; a bare array or anything else is refused."""
    if type(items) is tuple:
        return <tuple>items
    if items is None:
        return ()
    if isinstance(items, (TensorBase, PartitionBase)) or not isinstance(items, (list, tuple)):
        raise UsageError(
            f"{what} must be a tuple or list of arrays (for one array: ({what[:-1]}_array,)), got {type(items).__name__}"
        )
    return tuple(items)


@cython.final  # (its _run is called without a look for an override)
cdef class External(DeviceOp):
    """The op :func:`~deviceop.interop.external` returns; its output is what ``fn`` returns."""

    cdef readonly object fn
    cdef readonly tuple args
    cdef list _tg                # the targets of the accesses, in naming order (_n of them set)
    cdef Acc* _ac                # their ranges and kinds: _inline, or a heap array of _cap
    cdef Acc _inline[N_INLINE]
    cdef Py_ssize_t _n, _cap
    cdef readonly object post    # post(cx, out, args) -> (out, [(buffer, lo, hi, write)]) or None
    cdef readonly object label
    # what the op needs from the layer that makes it (deviceop.interop), handed to it there:
    # namer(x, backend, write, key) -> a ledger access for a foreign array (its region), and
    # host_call(op, cx, args, accesses) -> fn's output, run in stream order on a device without
    # driver memory (the host backend)
    cdef readonly object namer
    cdef readonly object host_call
    cdef bint lazy

    def __init__(self, fn, tuple args, reads=(), writes=(), post=None, label=None, *, namer, host_call):
        if not callable(namer) or not callable(host_call):
            raise UsageError("External(...) needs namer= and host_call= callables; use do.external or do.interop.torch")
        self.namer = namer
        self.host_call = host_call
        _init(self, fn, args, reads, writes, post, label)

    def __dealloc__(self):
        if self._ac != NULL and self._ac != &self._inline[0]:
            PyMem_Free(self._ac)

    @property
    def acc(self):
        """What the op names, as the ledger's accesses: ``(tensor, write)`` or
        ``(buffer, lo, hi, write)``, in naming order."""
        cdef Py_ssize_t i
        return [
            (self._tg[i], self._ac[i].write) if self._ac[i].tensor
            else (self._tg[i], self._ac[i].lo, self._ac[i].hi, self._ac[i].write)
            for i in range(self._n)
        ]

    cdef int _room(self, Py_ssize_t n) except -1:
        """Room for ``n`` accesses in all (made once at construction; grown only for deviceop
        tensors among ``args`` that no list names)."""
        cdef Acc* ac
        cdef Py_ssize_t i
        if n <= self._cap:
            return 0
        if n <= N_INLINE and self._ac == NULL:
            ac = &self._inline[0]
        else:
            ac = <Acc*>PyMem_Malloc(n * sizeof(Acc))
            if ac == NULL:
                raise MemoryError()
        for i in range(self._n):
            ac[i] = self._ac[i]
        if self._ac != NULL and self._ac != &self._inline[0]:
            PyMem_Free(self._ac)
        self._ac = ac
        if self._tg is None:
            self._tg = [None] * n
        else:
            self._tg.extend([None] * (n - len(self._tg)))
        self._cap = n
        return 0

    @cython.boundscheck(False)
    @cython.wraparound(False)
    cdef inline int _put(self, target, Py_ssize_t lo, Py_ssize_t hi, bint write, bint tensor) except -1:
        cdef Py_ssize_t i = self._n
        if i == self._cap:
            self._room(i + 1)
        self._tg[i] = target
        self._ac[i].lo = lo
        self._ac[i].hi = hi
        self._ac[i].write = write
        self._ac[i].tensor = tensor
        self._n = i + 1
        return 0

    cdef int _put_access(self, tuple a) except -1:
        """Put a ledger access tuple: ``(tensor, write)`` or ``(buffer, lo, hi, write)``."""
        if len(a) == 2:
            return self._put(a[0], 0, 0, a[1], True)
        return self._put(<Buffer>a[0], a[1], a[2], a[3], False)

    def __repr__(self):
        label = self.label
        if label is None:
            fn = self.fn
            label = f"external {getattr(fn, '__qualname__', type(fn).__name__)}()"
        return f"<{label}>"

    @cython.boundscheck(False)
    @cython.wraparound(False)
    cdef object _name(self, tuple items, bint write, object be):
        """Put the accesses of ``items``; returns the device foreign arrays were named on
        (looked up once, at the first foreign array, and handed to the next call)."""
        cdef Py_ssize_t i, lo, hi
        for i in range(len(items)):
            x = items[i]
            if isinstance(x, TensorBase):
                self._put(x, 0, 0, write, True)
            else:
                if be is None:
                    be = _current()
                b = _seen(x, be, &lo, &hi)  # (first: a PyTorch tensor named before is the common case)
                if b is not None:
                    self._put(b, lo, hi, write, False)
                elif isinstance(x, PartitionBase):
                    self._put((<PartitionBase>x).tensor, 0, 0, write, True)
                elif isinstance(x, DeviceOp):
                    raise UsageError(f"{self!r}: reads and writes name arrays, not ops; pass the op as an argument")
                else:
                    self._put_access(self.namer(x, be, write, (self, write, i)))
        return be

    @cython.boundscheck(False)
    @cython.wraparound(False)
    cpdef object _run(self, ExecutionContext cx):
        cdef tuple args = self.args
        cdef list tg
        cdef Acc* ac
        cdef bint seen
        cdef Py_ssize_t i
        be = cx.backend
        if self.lazy:
            args = tuple([(<DeviceOp>x)._run(cx) if isinstance(x, DeviceOp) else x for x in args])
        for x in args:  # deviceop tensors passed to fn and not named: fn may write them
            t = (<PartitionBase>x).tensor if isinstance(x, PartitionBase) else x
            if isinstance(t, TensorBase):
                seen = False
                for i in range(self._n):
                    if self._tg[i] is t:
                        seen = True
                        break
                if not seen:
                    self._put(t, 0, 0, True, True)
        tg = self._tg
        ac = self._ac
        for i in range(self._n):
            x = tg[i]
            xb = (<TensorBase>x).buffer.backend if ac[i].tensor else (<Buffer>x).backend
            if xb is not be:
                check_backend(cx, xb, repr(self))
        if cx.drv is None and not be.cuda_memory:  # (a cuda device has its driver)
            return self.host_call(self, cx, args, self.acc)
        LOCK.take()
        try:
            # under the ledger lock: fn's work is enqueued before any later registration on
            # any thread can look at this execution's accesses
            for i in range(self._n):
                if ac[i].tensor:
                    order_tensor(cx, tg[i], ac[i].write, self)
                else:
                    order(cx, <Buffer>tg[i], ac[i].lo, ac[i].hi, ac[i].write, self)
            return _call(self, cx, args)
        finally:
            LOCK.drop()


cdef object _call(External op, ExecutionContext cx, tuple args):
    cdef tuple b
    stream = cx.stream
    prev = dvo_inside_swap(stream)
    try:
        out = op.fn(stream, *args) if args else op.fn(stream)
    finally:
        dvo_inside_swap(prev)
        if cx.drv is not None:
            make_current(cx.drv)  # fn may have switched the thread to another device (torch.cuda.set_device)
    if op.post is not None:
        out, made = op.post(cx, out, args)
        for b in made:  # what fn made: written by this execution
            order(cx, <Buffer>b[0], b[1], b[2], b[3], op)
    return out


cdef int _init(External op, fn, tuple args, reads, writes, post, label) except -1:
    cdef bint lazy = False
    cdef Py_ssize_t i
    if not callable(fn):
        raise UsageError(f"do.external(fn, ...) needs a callable fn(stream, *args), got {type(fn).__name__}")
    op.fn = fn
    op.label = label
    op.post = post
    cdef tuple rt = named(reads, "reads")
    cdef tuple wt = named(writes, "writes")
    op._room(len(rt) + len(wt))  # sized once
    # foreign arrays are wrapped now: bad input fails before any work, and the wrapper keeps
    # the array alive until the work that uses it has completed
    be = None
    if len(rt):
        be = op._name(rt, False, be)
    if len(wt):
        op._name(wt, True, be)
    for i in range(len(args)):
        x = args[i]
        if isinstance(x, DeviceOp):
            (<DeviceOp>x).take(f"argument {i} of {op!r}")
            lazy = True
    op.args = args
    op.lazy = lazy
    return 0
