# cython: language_level=3, boundscheck=False, wraparound=False
"""Launch plans, the kernel launch path, built-in calls as ops, and graph replays.

A :class:`LaunchPlan` holds what a launch needs once a kernel and its arguments' layout are
known (function, grid, block, the parameter layout and fixed values) and nothing about their
addresses, so fresh tensors of a known shape reuse it: :func:`launch` packs pointers and
scalars into a parameter block on its own stack (``cuLaunchKernel`` copies it before it
returns, so concurrent launches of one plan never share it), orders the tensors' accesses
through the ledger and launches, under the ledger lock.
"""

cimport cython
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.tuple cimport PyTuple_GET_ITEM
from libc.float cimport FLT_MAX
from libc.stdint cimport uint64_t, uint8_t, uint16_t, int32_t, int64_t, uintptr_t

from ._base cimport _LOCK as LOCK, Buffer, Driver, PartitionBase, TensorBase
from ._ledger cimport Access, ExecutionContext, check_backend, covering, epoch, order, order_tensor, register, retarget, scan
from ._op cimport DeviceOp

from .._errors import CaptureError, UsageError

__all__ = [
    "LaunchPlan", "KernelPlan", "PlanCache", "Planned", "BuiltinFront", "launch", "planned", "GraphBase",
    "GraphLaunch", "MAX_PARAMS",
]

DEF MAXP = 24
MAX_PARAMS = MAXP
# parameter sources and C types (layout entries: (source, index, ctype, fixed raw bits))
DEF SRC_TENSOR = 0
DEF SRC_SCALAR = 1
DEF SRC_FIXED = 2
DEF CT_PTR = 0
DEF CT_F32 = 1
DEF CT_I32 = 2
DEF CT_I64 = 3
DEF CT_U8 = 4
DEF CT_U16 = 5


cdef class LaunchPlan:
    """A kernel launch with its geometry and parameter layout, independent of the tensors' addresses.

    ``layout``: one ``(source, index, ctype, fixed)`` per kernel parameter; source 0 takes the
    address of ``tensors[index]``, 1 the value of ``scalars[index]``, 2 the raw bits ``fixed``;
    ctype 0 pointer, 1 float32, 2 int32, 3 int64, 4 uint8, 5 a 16-bit raw value. ``writes``:
    per tensor, whether the kernel writes it.
    """

    cdef readonly object fn
    cdef void* f
    cdef unsigned int g[3]
    cdef unsigned int b[3]
    cdef unsigned int shmem
    cdef int np, nt
    cdef int need_tensors, need_scalars  # how many of each a launch must be given
    cdef signed char src[MAXP]
    cdef signed char idx[MAXP]
    cdef signed char ct[MAXP]
    cdef uint64_t fixed[MAXP]
    cdef bint wr[MAXP]
    cdef Driver drv
    cdef readonly object what
    cdef readonly tuple writes

    def __init__(self, Driver driver, fn, grid, block, unsigned int shmem, layout, writes, what):
        cdef int i
        if driver is None or driver.launch_kernel == NULL:
            raise UsageError("a launch plan needs a backend that launches kernels (cuda)")
        if len(layout) > MAXP:
            raise UsageError(f"{what!r}: kernels take at most {MAXP} parameters, got {len(layout)}")
        if len(writes) > MAXP:
            raise UsageError(f"{what!r}: at most {MAXP} tensor parameters")
        self.drv = driver
        self.fn = fn
        self.f = <void*><uintptr_t>int(fn)
        for i in range(3):
            self.g[i] = grid[i]
            self.b[i] = block[i]
        self.shmem = shmem
        self.np = len(layout)
        self.nt = len(writes)
        for i in range(self.np):
            s, j, c, v = layout[i]
            if s not in (SRC_TENSOR, SRC_SCALAR, SRC_FIXED) or not 0 <= c <= CT_U16 or not 0 <= j < MAXP:
                raise UsageError(f"{what!r}: parameter {i} has a bad layout entry {layout[i]!r}")
            self.src[i] = s
            self.idx[i] = j
            self.ct[i] = c
            self.fixed[i] = v
            if s == SRC_TENSOR:
                self.need_tensors = max(self.need_tensors, j + 1)
            elif s == SRC_SCALAR:
                self.need_scalars = max(self.need_scalars, j + 1)
        for i in range(self.nt):
            self.wr[i] = writes[i]
        self.writes = tuple(writes)
        self.what = what

    @property
    def grid(self):
        return (self.g[0], self.g[1], self.g[2])

    @property
    def block(self):
        return (self.b[0], self.b[1], self.b[2])

    @property
    def layout(self):
        """The parameter layout: one ``(source, index, ctype, fixed)`` per kernel parameter."""
        return tuple((self.src[i], self.idx[i], self.ct[i], self.fixed[i]) for i in range(self.np))

    def __repr__(self):
        return f"<LaunchPlan {self.what!r} grid={self.grid} block={self.block}>"


cdef inline int _pack(LaunchPlan p, tuple tensors, tuple scalars, uint64_t* slots, void** params) except -1:
    cdef int i, c
    cdef object v
    for i in range(p.np):
        c = p.ct[i]
        slots[i] = 0
        if p.src[i] == SRC_TENSOR:
            slots[i] = <uint64_t>(<TensorBase?>tensors[p.idx[i]]).addr
        elif p.src[i] == SRC_SCALAR:
            v = scalars[p.idx[i]]
            if c == CT_F32:
                (<float*>&slots[i])[0] = <float>v
            elif c == CT_I32:
                (<int32_t*>&slots[i])[0] = <int32_t>v
            elif c == CT_I64:
                (<int64_t*>&slots[i])[0] = <int64_t>v
            elif c == CT_U8:
                (<uint8_t*>&slots[i])[0] = <uint8_t>v
            elif c == CT_U16:
                (<uint16_t*>&slots[i])[0] = <uint16_t>v
            else:
                slots[i] = <uint64_t>v
        else:
            slots[i] = p.fixed[i]
        params[i] = &slots[i]
    return 0


cpdef int launch(ExecutionContext cx, LaunchPlan p, tuple tensors, tuple scalars) except -1:
    """Order ``tensors``' accesses through the ledger and launch ``p`` on ``cx.stream``, atomically."""
    cdef uint64_t slots[MAXP]
    cdef void* params[MAXP]
    cdef int j, err
    cdef TensorBase t
    cdef bint need[MAXP]  # registered after the launch (scan found it not yet covered)
    cdef void* sh = <void*>cx.sh
    if cx.drv is not p.drv:
        raise UsageError(f"{p.what!r} was planned for another device than this execution's")
    if len(tensors) < p.need_tensors or len(tensors) < p.nt or len(scalars) < p.need_scalars:
        raise UsageError(
            f"{p.what!r} takes {max(p.need_tensors, p.nt)} tensors and {p.need_scalars} scalars, "
            f"got {len(tensors)} and {len(scalars)}"
        )
    _pack(p, tensors, scalars, slots, params)
    LOCK.take()
    try:
        for j in range(p.nt):
            t = <TensorBase?>tensors[j]
            need[j] = scan(cx, t.buffer, t.lo, t.hi, p.wr[j], p.what)
        with nogil:
            err = p.drv.launch_kernel(p.f, p.g[0], p.g[1], p.g[2], p.b[0], p.b[1], p.b[2], p.shmem, sh, params)
        if not err:  # registered while the kernel runs (still under the lock: atomic for others)
            for j in range(p.nt):
                if need[j]:
                    t = <TensorBase>tensors[j]
                    register(cx, t.buffer, t.lo, t.hi, p.wr[j])
    finally:
        LOCK.drop()
    if err:
        raise p.drv.error(err, f"cuLaunchKernel({getattr(p.what, 'name', p.what)})")
    return 0


cdef class PlanCache:
    """Launch plans by value key, bounded (oldest dropped first); ``hits`` and ``misses`` counted.

    Thread-safe: lookups are single dict operations under the GIL; a plan made twice by racing
    threads is the same plan, and either copy serves.
    """

    def __init__(self, Py_ssize_t max_size=256):
        self.d = {}
        self.max_size = max_size

    cpdef object get(self, key):
        """The plan for ``key``, or None (counted as a hit or a miss)."""
        p = self.d.get(key)
        if p is None:
            self.misses += 1
        else:
            self.hits += 1
        return p

    def put(self, key, plan):
        """Keep ``plan`` for ``key`` (dropping the oldest at the bound); returns ``plan``."""
        d = self.d
        while len(d) >= self.max_size:
            try:
                del d[next(iter(d))]
            except (StopIteration, KeyError, RuntimeError):  # another thread changed it: retry or done
                break
        d[key] = plan
        return plan

    def __len__(self):
        return len(self.d)

    def clear(self):
        """Drop every plan and reset the counters."""
        self.d.clear()
        self.hits = self.misses = 0


cdef class KernelPlan:
    """A built-in's plan for one argument layout: its backend, its launch (cuda) and whether it is empty."""

    cdef readonly object be
    cdef readonly LaunchPlan cuda
    cdef readonly bint empty

    def __init__(self, be, LaunchPlan cuda, bint empty):
        self.be = be
        self.cuda = cuda
        self.empty = empty


cdef class Planned(DeviceOp):
    """A kernel call whose arguments were validated and planned when it was made; its output is
    its arguments (same type in, same type out).

    With ``nt`` > 0 the arguments are ``(out partition, nt - 1 tensors, float scalars...)`` and the
    launch is compiled; with ``nt`` 0 the kernel's ``enqueue(cx, args, opts, plan)`` runs it.
    """

    cdef readonly object kernel
    cdef readonly tuple args
    cdef readonly object opts
    cdef readonly object plan
    cdef int nt

    def __repr__(self):
        return f"<{getattr(self.kernel, 'name', self.kernel)}() call>"

    cpdef object _run(self, ExecutionContext cx):
        cdef KernelPlan p
        cdef tuple args = self.args
        if self.nt > 0:
            p = self.plan
            if p.be is not cx.backend:
                check_backend(cx, p.be, self)
            if p.empty:
                return args
            if p.cuda is not None:
                t0 = (<PartitionBase?>args[0]).tensor
                if self.nt == 1:
                    tensors = (t0,)
                elif self.nt == 2:
                    tensors = (t0, args[1])
                else:
                    tensors = (t0,) + args[1:self.nt]
                launch(cx, p.cuda, tensors, args[self.nt:])
                return args
        self.kernel.enqueue(cx, args, self.opts, self.plan)
        return args


cpdef Planned planned(kernel, tuple args, plan, int nt, opts=None):
    """A :class:`Planned` call of ``kernel``."""
    cdef Planned op = Planned.__new__(Planned)
    op.kernel = kernel
    op.args = args
    op.plan = plan
    op.nt = nt
    op.opts = opts
    return op


cdef class BuiltinFront:
    """The call of a built-in kernel family ``k(out_partition, *tensors, *float_scalars)``.

    ``plans`` maps the arguments' layout (tile, and each tensor's shape, strides, dtype,
    alignment and device) to a :class:`KernelPlan`; a call whose layout is known (fresh tensors
    included) is checked and turned into its op here. Anything else (a first layout, ops as
    arguments, wrong arguments) goes to the subclass's ``_call_slow``, which validates.
    """

    cdef public PlanCache plans
    cdef public int n_args
    cdef public int n_tensors
    cdef public bint check_scalars  # scalars need more than "a float" (the subclass's _check_scalars)

    def __call__(self, *args):
        cdef int nt = self.n_tensors
        cdef int i
        if len(args) != self.n_args:
            return self._call_slow(args)
        out = args[0]
        if not isinstance(out, PartitionBase):
            return self._call_slow(args)
        for i in range(1, nt):
            if not isinstance(args[i], TensorBase):  # an op or a foreign object
                return self._call_slow(args)
        if nt == 1:
            key = (<PartitionBase>out)._key
        elif nt == 2:
            key = ((<PartitionBase>out)._key, (<TensorBase>args[1])._key)
        elif nt == 3:
            key = ((<PartitionBase>out)._key, (<TensorBase>args[1])._key, (<TensorBase>args[2])._key)
        else:
            return self._call_slow(args)
        p = self.plans.get(key)
        if p is None:
            return self._call_slow(args)
        for i in range(nt, self.n_args):
            v = args[i]
            if type(v) is not float or (<double>v > FLT_MAX or <double>v < -FLT_MAX) and <double>v - <double>v == 0.0:
                return self._call_slow(args)  # validated (and converted, or refused: beyond float32) there
        if self.check_scalars:
            self._check_scalars(args)
        return planned(self, args, p, nt)


cdef struct Span:
    Py_ssize_t lo, hi
    bint write


cdef class GraphBase:
    """The compiled part of a CudaGraph: what its replays read, set together under the ledger
    lock (``_set_replay``), and its launch count."""

    cdef public object backend
    cdef public Py_ssize_t launches
    cdef object exec_obj       # the executable graph, None when the recording was empty
    cdef uintptr_t exec_handle  # its handle where the backend launches graphs through the core
    cdef tuple bufs            # the Buffer of every region its work touches...
    cdef Span* spans           # ...and its bytes [lo, hi) and whether it is written (a C array:
    cdef Py_ssize_t n_regions  # a replay reads them without Python objects)
    cdef object out
    # the last replay's ledger entries, which a replay on its stream reuses while the ledger's
    # epoch is the one after its registration (0: none; see _ledger.covering)
    cdef uint64_t reg_epoch
    cdef object reg_stream
    cdef tuple reg_entries

    def __dealloc__(self):
        PyMem_Free(self.spans)

    def _set_replay(self, ex, regions, output):
        """Point replays at executable graph ``ex`` (call with the ledger lock held).

        ``regions``: ``(Buffer, lo, hi, write)`` for every region the graph's work touches."""
        cdef tuple r
        cdef Py_ssize_t i, n
        cdef Span* sp
        regions = tuple(regions)
        for r in regions:
            if len(r) != 4 or not isinstance(r[0], Buffer):
                raise TypeError("a graph region is (Buffer, lo, hi, write)")
        n = len(regions)
        sp = <Span*>PyMem_Malloc(max(n, 1) * sizeof(Span))
        if sp == NULL:
            raise MemoryError()
        for i in range(n):
            r = regions[i]
            sp[i].lo = r[1]
            sp[i].hi = r[2]
            sp[i].write = bool(r[3])
        PyMem_Free(self.spans)
        self.spans = sp
        self.n_regions = n
        self.reg_epoch = 0
        self.reg_stream = None
        self.reg_entries = None
        self.bufs = tuple([r[0] for r in regions])
        self.exec_obj = ex
        self.exec_handle = getattr(ex, "handle_int", 0) if ex is not None else 0
        self.out = output

    @cython.always_allow_keywords(False)  # (no arguments: the cheapest call)
    def launch(self):
        """An op that replays the graph once, on the stream of the terminal that drives it."""
        cdef GraphLaunch op = GraphLaunch.__new__(GraphLaunch)
        op.source = self
        return op


cdef class GraphLaunch(DeviceOp):
    """One replay of a :class:`~deviceop.graph.CudaGraph`; its output is the graph's output.

    A replay registers every region the graph touches with the access ledger, like any op,
    and launches the executable graph on the execution's stream.
    """

    cdef readonly GraphBase source  # the CudaGraph this op replays

    def __init__(self, GraphBase g):
        self.source = g

    def __repr__(self):
        return f"<launch of {self.source!r}>"

    cpdef object _run(self, ExecutionContext cx):
        cdef Driver d = cx.drv
        cdef GraphBase g = self.source
        cdef void* sh = <void*>cx.sh
        cdef Span* sp
        cdef Buffer b
        cdef Py_ssize_t i, n
        cdef uint64_t covered = 0  # regions scan found nothing to register for (the first 64)
        if cx.capturing:
            raise CaptureError(
                f"{self!r} inside a graph recording: graphs do not nest. Record the ops of both "
                "into one scope instead"
            )
        if g.backend is not cx.backend:
            raise UsageError(
                f"{g!r} was recorded on the {g.backend.name} backend, not {cx.backend.name}; record it again there"
            )
        LOCK.take()
        try:
            # (the regions as _set_replay left them: it runs under this lock too)
            sp = g.spans
            n = g.n_regions
            if g.reg_epoch and g.reg_epoch == epoch() and cx.stream is g.reg_stream and cx.captured is None:
                # nothing registered since this graph's last replay, on this stream: its entries
                # still cover every region, and what they waited for, this replay follows
                _replay(g, d, cx, sh)
                retarget(cx, g.reg_entries, g.bufs)
                g.launches += 1
                return g.out
            for i in range(n):
                b = <Buffer>PyTuple_GET_ITEM(g.bufs, i)
                if scan(cx, b, sp[i].lo, sp[i].hi, sp[i].write, self) == 0 and i < 64:
                    covered |= (<uint64_t>1) << i
            _replay(g, d, cx, sh)
            for i in range(n):  # registered while the graph runs (still under the lock)
                if i >= 64 or not (covered >> i) & 1:
                    b = <Buffer>PyTuple_GET_ITEM(g.bufs, i)
                    register(cx, b, sp[i].lo, sp[i].hi, sp[i].write)
            _remember(g, cx)
            g.launches += 1
            return g.out
        finally:
            LOCK.drop()


cdef int _replay(GraphBase g, Driver d, ExecutionContext cx, void* sh) except -1:
    """Launch ``g``'s executable graph on ``cx``'s stream (its ledger work is the caller's)."""
    cdef uintptr_t ex
    cdef int err = 0
    if g.exec_obj is None:
        return 0
    ex = g.exec_handle
    if d is not None and d.graph_launch != NULL and ex:
        with nogil:
            err = d.graph_launch(<void*>ex, sh)
        if err:
            raise d.error(err, "cuGraphLaunch")
    else:
        g.backend.graphs.launch(g.exec_obj, cx.stream)
    return 0


cdef int _remember(GraphBase g, ExecutionContext cx) except -1:
    """Keep the entries that cover ``g``'s regions after ``cx`` registered them, with the epoch
    (none where one is missing, which registration leaves only under another policy)."""
    cdef list found = []
    cdef Access e
    cdef Span* sp = g.spans
    cdef Py_ssize_t i
    g.reg_epoch = 0
    g.reg_entries = None
    g.reg_stream = None
    if not epoch() or cx.captured is not None:
        return 0
    for i in range(g.n_regions):
        e = covering(cx, <Buffer>PyTuple_GET_ITEM(g.bufs, i), sp[i].lo, sp[i].hi, sp[i].write)
        if e is None:
            return 0
        if e not in found:
            found.append(e)
    g.reg_entries = tuple(found)
    g.reg_stream = cx.stream
    g.reg_epoch = epoch()
    return 0
