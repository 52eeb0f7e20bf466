# cython: language_level=3, boundscheck=False, wraparound=False
"""Launch plans, the kernel launch path, and kernel calls (built-in and user kernels) as ops.

A :class:`LaunchPlan` holds what a launch needs once a kernel and its arguments' layout are
known (function, grid, block, the parameter layout and fixed values) and nothing about their
addresses, so fresh tensors of a known shape reuse it: :func:`launch` packs pointers and
scalars into a parameter block on its own stack (``cuLaunchKernel`` copies it before it
returns, so concurrent launches of one plan never share it), orders the tensors' accesses
through the ledger and launches, under the ledger lock.
"""

from libc.float cimport FLT_MAX
from libc.stdint cimport uint64_t, uint8_t, uint16_t, int32_t, int64_t, uintptr_t

from ._base cimport _LOCK as LOCK, Driver, PartitionBase, TensorBase
from ._ledger cimport ExecutionContext, check_backend, register, scan
from ._op cimport DeviceOp

from .._errors import UsageError

__all__ = [
    "LaunchPlan", "KernelPlan", "PlanCache", "Planned", "BuiltinFront", "UserFront", "UserPlan", "launch", "planned",
    "MAX_PARAMS", "P_KINDS",
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


# what a user kernel's parameter takes, for its compiled call (UserFront): a tensor (or a
# partition), a scalar of one of the C types the launch packs as given, or a scalar the Python
# call converts (16-bit floats: their raw bits)
DEF P_TENSOR = -1
DEF P_OTHER = -2
P_KINDS = {"tensor": P_TENSOR, "other": P_OTHER, "float32": CT_F32, "int32": CT_I32, "int64": CT_I64, "uint8": CT_U8}


cdef class UserPlan:
    """A user kernel's launch for one argument layout: its backend, its launch (cuda; None on the
    host backend or for an empty grid), whether the grid is empty, which arguments are tensors
    and which scalars (indices into the call's arguments), whether each tensor is written, and
    the C type of each scalar (``P_OTHER``: converted by the kernel's Python ``enqueue``)."""

    cdef readonly object be
    cdef readonly LaunchPlan cuda
    cdef readonly bint empty
    cdef readonly tuple tensor_idx
    cdef readonly tuple scalar_idx
    cdef readonly tuple writes
    cdef tuple scalar_kinds

    def __init__(self, be, LaunchPlan cuda, bint empty, tuple tensor_idx, tuple scalar_idx, tuple writes,
                 tuple scalar_kinds):
        if len(scalar_kinds) != len(scalar_idx):
            raise UsageError("a user kernel's plan needs one kind per scalar")
        self.be = be
        self.cuda = cuda
        self.empty = empty
        self.tensor_idx = tensor_idx
        self.scalar_idx = scalar_idx
        self.writes = writes
        self.scalar_kinds = scalar_kinds

    cdef bint run(self, ExecutionContext cx, tuple args) except -1:
        """Launch on ``cx`` if it takes nothing of Python: True once launched (or nothing to
        launch); False leaves it to the kernel's ``enqueue`` (another backend than planned, the
        host backend, a scalar to convert)."""
        cdef Py_ssize_t k, n
        cdef int kind
        if self.be is not cx.backend:
            return False  # (enqueue raises the error, or runs it on a backend it was planned for)
        if self.empty:
            return True
        if self.cuda is None:
            return False
        n = len(self.scalar_idx)
        scalars = [None] * n
        for k in range(n):
            v = args[<Py_ssize_t>self.scalar_idx[k]]
            kind = self.scalar_kinds[k]
            if kind == CT_F32:
                if type(v) is not float:
                    if type(v) is not int:
                        return False
                    v = float(v)
            elif kind == P_OTHER or type(v) is not int:
                return False
            scalars[k] = v
        n = len(self.tensor_idx)
        tensors = [None] * n
        for k in range(n):
            a = args[<Py_ssize_t>self.tensor_idx[k]]
            if isinstance(a, PartitionBase):
                a = (<PartitionBase>a).tensor
            tensors[k] = a
        launch(cx, self.cuda, tuple(tensors), tuple(scalars))
        return True


cdef object _dim3(object x, bint grid):
    """``x`` (an int, or a tuple of 1 to 3 ints) as 3 ints within CUDA's limits, or None for
    anything else (the kernel's Python call then says what is wrong)."""
    cdef long long v[3]
    cdef Py_ssize_t n, i
    v[1] = v[2] = 1
    try:
        if type(x) is int:
            v[0] = x
            n = 1
        elif type(x) is tuple:
            n = len(<tuple>x)
            if n < 1 or n > 3:
                return None
            for i in range(n):
                if type((<tuple>x)[i]) is not int:
                    return None
                v[i] = (<tuple>x)[i]
        else:
            return None
    except OverflowError:
        return None
    if grid:
        if not (0 <= v[0] <= 2147483647 and 0 <= v[1] <= 65535 and 0 <= v[2] <= 65535):
            return None
    elif not (1 <= v[0] <= 1024 and 1 <= v[1] <= 1024 and 1 <= v[2] <= 64 and v[0] * v[1] * v[2] <= 1024):
        return None
    if n == 3:
        return x
    return (v[0], v[1], v[2])


cdef class UserFront:
    """The compiled call of a user :class:`~deviceop.kernels.Kernel`: arguments whose layout has
    a plan (fresh tensors of a known shape included) are checked and turned into the op here;
    :meth:`call` returns None for anything else (a first layout, ops or foreign objects as
    arguments, scalars of other types, wrong arguments), which the kernel's Python call
    validates and plans."""

    cdef object kernel
    cdef PlanCache plans
    cdef tuple kinds
    cdef tuple block

    def __init__(self, kernel, PlanCache plans, tuple kinds, tuple block):
        self.kernel = kernel
        self.plans = plans
        self.kinds = kinds
        self.block = block

    def call(self, tuple args, grid, block, shared_mem):
        """The op of ``kernel(*args, grid=, block=, shared_mem=)``, or None (see the class)."""
        cdef Py_ssize_t i, n = len(self.kinds)
        cdef int kind
        cdef double f
        if len(args) != n or type(shared_mem) is not int or not 0 <= shared_mem < 2147483648:
            return None
        g = None
        if grid is not None:
            g = _dim3(grid, True)
            if g is None:
                return None
        b = self.block
        if block is not None:
            b = _dim3(block, False)
            if b is None:
                return None
        opts = (g, b, shared_mem)
        key = [opts]
        for i in range(n):
            a = args[i]
            kind = self.kinds[i]
            if kind == P_TENSOR:
                if isinstance(a, PartitionBase):
                    key.append((<PartitionBase>a)._key)
                elif isinstance(a, TensorBase):
                    key.append((<TensorBase>a)._key)
                else:
                    return None
            elif kind == CT_F32:
                if type(a) is float:
                    f = a
                    if (f > FLT_MAX or f < -FLT_MAX) and f - f == 0.0:  # finite, beyond float32
                        return None
                elif type(a) is not int or not -16777216 <= a <= 16777216:
                    return None
            elif type(a) is not int:
                return None
            elif kind == CT_I32:
                if not -2147483648 <= a <= 2147483647:
                    return None
            elif kind == CT_I64:
                if not -9223372036854775808 <= a <= 9223372036854775807:
                    return None
            elif kind == CT_U8:
                if not 0 <= a <= 255:
                    return None
            else:
                return None
        p = self.plans.d.get(tuple(key))
        if p is None:
            return None  # (the Python call plans it, and counts the miss)
        self.plans.hits += 1
        return planned(self.kernel, args, p, 0, opts)


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
        if type(self.plan) is UserPlan and (<UserPlan>self.plan).run(cx, args):
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
