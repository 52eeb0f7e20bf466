# cython: language_level=3
"""The op behind ``do.external`` and ``do.interop.torch``: another library's work, ordered by the ledger.

Its construction names the memory the work touches; its run orders and registers those
accesses and calls ``fn`` under the ledger lock, in one compiled path. What needs the layers
above is registered by them in :data:`HOOKS`: naming a foreign array (``interop``'s regions)
and the host backend's call in stream order.
"""

from cpython.contextvars cimport get_value
from cpython.long cimport PyLong_FromVoidPtr
from cpython.weakref cimport PyWeakref_NewRef
from libc.stdint cimport uintptr_t

from ._base cimport _LOCK as LOCK, Buffer, PartitionBase, TensorBase, make_current
from ._ledger cimport ExecutionContext, check_backend, order, order_tensor
from ._op cimport DeviceOp

import threading

from .._errors import UsageError
from ..device._select import _selected, _state, current

__all__ = ["External", "HOOKS", "inside", "named", "new_external", "remember", "seen", "wrapper"]


class _Inside(threading.local):
    stream = None


#: the stream whose ``external`` fn this thread is running (exports inside it need no wait)
inside = _Inside()

#: registered by ``deviceop.interop``: ``access_of(obj, backend, write, what)`` names a foreign
#: array; ``call_in_order(op, cx, args, acc)`` runs fn on a host backend's stream worker
HOOKS = {}


cdef object _SELECTED = _selected
cdef dict _STATE = _state


cdef inline object _current():
    """``current()`` without the Python call where a device is selected or made already."""
    be = get_value(_SELECTED, None)
    if be is None:
        be = _STATE["backend"]
        if be is None:
            be = current()
    return be


# ---- foreign arrays named again and again (a model's inputs and outputs) ----------------------

cdef class Seen:
    """A PyTorch tensor as last described: the tensor (weak), its data address and shape then,
    the device, its region (start, size, host view, access list), its byte range there, and
    its last wrapper (weak)."""

    cdef object ref
    cdef uintptr_t ptr
    cdef object shape
    cdef object be
    cdef uintptr_t start
    cdef Py_ssize_t nbytes
    cdef object host
    cdef list accesses
    cdef Py_ssize_t lo, hi
    cdef object last


# by id() of the tensor; an entry goes when its tensor does
cdef dict SEEN = {}


cdef class _Forget:
    cdef object key

    def __call__(self, ref):
        e = SEEN.get(self.key)
        if e is not None and (<Seen>e).ref is ref:
            del SEEN[self.key]


cpdef object seen(obj, be, bint write):
    """The ledger access ``(buffer, lo, hi, write)`` of a PyTorch tensor described before on
    device ``be`` and unchanged since (the same object, data address and shape), else None.

    Its region lives (the tensor is one of its users); its last wrapper serves again while
    something (work in flight) keeps it, else a new one is made, which keeps the tensor alive.
    """
    cdef Seen e
    x = SEEN.get(PyLong_FromVoidPtr(<void*>obj))
    if x is None:
        return None
    e = <Seen>x
    if e.ref() is not obj or e.be is not be or <uintptr_t>obj.data_ptr() != e.ptr or obj.shape != e.shape:
        return None
    b = e.last()
    if b is None:
        b = wrapper(be, e.start, e.nbytes, e.host, obj, e.accesses)
        e.last = PyWeakref_NewRef(b, None)
    return (b, e.lo, e.hi, write)


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


def remember(obj, uintptr_t ptr, shape, be, Buffer buf, Py_ssize_t lo, Py_ssize_t hi):
    """Keep what describing PyTorch tensor ``obj`` found (its data address and shape, and its
    wrapper ``buf`` of its region, with the byte range [lo, hi) of the region), for
    :func:`seen`. Held weakly: the tensor's death forgets it."""
    cdef Seen e = Seen.__new__(Seen)
    cdef _Forget f = _Forget.__new__(_Forget)
    f.key = PyLong_FromVoidPtr(<void*>obj)
    e.ref = PyWeakref_NewRef(obj, f)
    e.ptr = ptr
    e.shape = shape
    e.be = be
    e.start = buf.ptr
    e.nbytes = buf.nbytes
    e.host = buf.host
    e.accesses = buf.accesses
    e.lo = lo
    e.hi = hi
    e.last = PyWeakref_NewRef(buf, None)
    SEEN[f.key] = e


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


cdef class External(DeviceOp):
    """The op :func:`~deviceop.interop.external` returns; its output is what ``fn`` returns."""

    cdef readonly object fn
    cdef readonly tuple args
    cdef readonly list acc       # (tensor, write) or (buffer, lo, hi, write), in naming order
    cdef readonly object post    # post(cx, out, args) -> (out, [(buffer, lo, hi, write)]) or None
    cdef readonly object label
    cdef bint lazy

    def __init__(self, fn, tuple args, reads=(), writes=(), post=None, label=None):
        _init(self, fn, args, reads, writes, post, label)

    def __repr__(self):
        label = self.label
        if label is None:
            fn = self.fn
            label = f"external {getattr(fn, '__qualname__', type(fn).__name__)}()"
        return f"<{label}>"

    cdef object _name(self, items, bint write, object be):
        """Append the accesses of ``items``; returns the device foreign arrays were named on
        (looked up once, at the first foreign array, and handed to the next call)."""
        cdef Py_ssize_t i = 0
        cdef list acc = self.acc
        for x in named(items, "writes" if write else "reads"):
            if isinstance(x, TensorBase):
                acc.append((x, write))
            elif isinstance(x, PartitionBase):
                acc.append(((<PartitionBase>x).tensor, write))
            elif isinstance(x, DeviceOp):
                raise UsageError(f"{self!r}: reads and writes name arrays, not ops; pass the op as an argument")
            else:
                if be is None:
                    be = _current()
                a = seen(x, be, write)
                acc.append(a if a is not None else HOOKS["access_of"](x, be, write, (self, write, i)))
            i += 1
        return be

    cpdef object _run(self, ExecutionContext cx):
        cdef tuple args = self.args
        cdef list acc = self.acc
        cdef tuple a
        cdef bint seen
        be = cx.backend
        if self.lazy:
            args = tuple([(<DeviceOp>x)._run(cx) if isinstance(x, DeviceOp) else x for x in args])
        for x in args:  # deviceop tensors passed to fn and not named: fn may write them
            t = (<PartitionBase>x).tensor if isinstance(x, PartitionBase) else x
            if isinstance(t, TensorBase):
                seen = False
                for a in acc:
                    if a[0] is t:
                        seen = True
                        break
                if not seen:
                    acc.append((t, True))
        for a in acc:
            x = a[0]
            xb = (<TensorBase>x).buffer.backend if isinstance(x, TensorBase) else (<Buffer>x).backend
            if xb is not be:
                check_backend(cx, xb, repr(self))
        if not be.cuda_memory:
            return HOOKS["call_in_order"](self, cx, args, acc)
        LOCK.take()
        try:
            # under the ledger lock: fn's work is enqueued before any later registration on
            # any thread can look at this execution's accesses
            for a in acc:
                if len(a) == 2:
                    order_tensor(cx, a[0], a[1], self)
                else:
                    order(cx, <Buffer>a[0], a[1], a[2], a[3], self)
            return _call(self, cx, args)
        finally:
            LOCK.drop()


cdef object _call(External op, ExecutionContext cx, tuple args):
    cdef tuple b
    st = inside
    prev = st.stream
    st.stream = cx.stream
    try:
        out = op.fn(cx.stream, *args)
    finally:
        st.stream = prev
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
    op.acc = []
    # foreign arrays are wrapped now: bad input fails before any work, and the wrapper keeps
    # the array alive until the work that uses it has completed
    be = None
    if reads is not None and not (type(reads) is tuple and not reads):  # (an array has no truth value)
        be = op._name(reads, False, be)
    if writes is not None and not (type(writes) is tuple and not writes):
        op._name(writes, True, be)
    for i in range(len(args)):
        x = args[i]
        if isinstance(x, DeviceOp):
            (<DeviceOp>x).take(f"argument {i} of {op!r}")
            lazy = True
    op.args = args
    op.lazy = lazy
    return 0


def new_external(fn, tuple args, reads, writes):
    """``External(fn, args, reads, writes)`` without the constructor's argument parsing."""
    cdef External op = External.__new__(External)
    _init(op, fn, args, reads, writes, None, None)
    return op
