# cython: language_level=3, boundscheck=False, wraparound=False
"""GEMM's compiled path: a planned call as an op, its cublasLtMatmul call, and replays of calls
that repeat (one recording per plan, scalars and stream, replayed on any buffers, or per exact
call where that cannot be made) and of a work queue's batches of calls that repeat exactly,
ordered through the ledger.

The kernels layer (``deviceop.kernels._gemm``) validates, makes the plan (descriptors and
algorithm, once per problem layout) and handles what is not a plain cuBLASLt call (the host
backend, cublasGemmEx, nvmath's binding); what runs per GEMM is here: the call of a known
layout becomes its op without Python-level validation, and running it orders the three tensors
and enqueues the call (or its recorded graph) under the ledger lock.
"""

cimport cython
from libc.float cimport FLT_MAX
from libc.stdint cimport int64_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

from ._base cimport _LOCK as LOCK, Driver, PartitionBase, TensorBase
from ._launch cimport PlanCache
from ._ledger cimport ExecutionContext, check_backend, order_tensor
from ._op cimport DeviceOp

from .._errors import UsageError

__all__ = [
    "COST", "COST_MAX", "GemmCall", "GemmLauncher", "GemmPlan", "GemmTemplate", "HOT", "KPARAMS_BYTES", "MAX",
    "Replays",
]

#: calls of one key (plan, scalars and stream; or the exact call) before it is recorded (a key
#: seen once or twice is not worth it)
HOT = 3
#: graphs kept (``Replays.limit``): a service's working set of exact calls (64 requests in flight
#: of an 8-step pipeline make about a thousand) with room for a second model's
MAX = 4096
#: replays a recording must be worth until the table has measured its own (a record + instantiate
#: costs about this many replays' saving on a typical host)
COST = 16.0
#: the most a recording is priced at, measured or not: where replays save (almost) nothing,
#: recordings become rare but never stop, so a pattern that starts to repeat is caught again
COST_MAX = 64 * COST


cdef inline int64_t _now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec

ctypedef int (*ltmatmul_t)(void*, void*, const void*, const void*, void*, const void*, void*,
                           const void*, const void*, void*, void*, void*, const void*, void*,
                           size_t, void*) noexcept nogil


cdef class GemmPlan:
    """A GEMM problem's layout (no addresses): what its compiled call reads; the kernels layer's
    geometry extends it (leading dimensions, transposes, alignment).

    ``lt_call``: ``(cublasLtMatmul's address, handle, descriptor, layouts of A, B and C, algorithm)``
    as ints once a plain cuBLASLt plan exists, else None.
    """

    cdef public object be
    cdef public Py_ssize_t m, n, k
    cdef public bint swap
    cdef uintptr_t lt[7]
    cdef object _lt_call

    @property
    def lt_call(self):
        return self._lt_call

    @lt_call.setter
    def lt_call(self, value):
        cdef int i
        if value is not None and len(value) != 7:
            raise TypeError("lt_call has 7 entries: fn, handle, desc, layout a, b, c, algo")
        for i in range(7):
            self.lt[i] = 0 if value is None else <uintptr_t>value[i]
        self._lt_call = value


@cython.final
cdef class _Entry:
    """A recorded call's executable (None: its recording failed) and whether it was replayed
    since eviction last passed it."""

    cdef object ex
    cdef uintptr_t handle
    cdef bint used


cdef class Replays:
    """Graph executables by GEMM call key, recorded once a key is hot and the credit allows.

    ``record(backend, stream, call)`` records ``call(stream_handle)`` into an executable graph
    (None on failure); see ``deviceop.kernels._gemm_replay``. Call with the ledger lock held.

    What a recording costs, in replays' savings, is measured as calls run (:meth:`observe`): the
    host time of a recording, of a direct call and of a replay. Until all three are known it is
    ``COST``; where a replay saves (almost) nothing it is ``COST_MAX``, and recordings become
    rare. ``bank``: another table whose credit this one's recordings spend and its replays
    earn, and whose measurements price them (batches of GEMMs draw on the calls' table).
    """

    cdef dict _seen
    cdef dict _execs  # key -> _Entry (its executable None if recording it failed), oldest first
    cdef object _record
    cdef public Py_ssize_t recorded
    cdef public Py_ssize_t replays
    cdef public Py_ssize_t evicted  # entries dropped to keep at most ``limit`` (failed recordings too)
    cdef Py_ssize_t _limit
    cdef public double credit
    # host seconds (moving averages; 0: not measured yet)
    cdef public double direct_s, replay_s, record_s
    cdef Replays _bank  # the table whose credit and price this one's recordings use (itself by default)

    def __init__(self, record, bank=None):
        self._seen = {}
        self._execs = {}
        self._record = record
        self._limit = MAX
        self.credit = 4 * COST  # a few recordings up front: a queue's first problems pay back at once
        self.direct_s = self.replay_s = self.record_s = 0.0
        if bank is not None and not isinstance(bank, Replays):
            raise UsageError(f"a replay table's bank is another replay table, got {type(bank).__name__}")
        self._bank = self if bank is None else <Replays>bank

    @property
    def bank(self):
        """The table whose credit this one's recordings spend and its replays earn, and whose
        measurements price them (this table itself, unless it was made with another)."""
        return self._bank

    def __len__(self):
        return len(self._execs)

    @property
    def limit(self):
        """The most entries kept (``MAX`` by default): recordings, and recordings that failed
        (remembered so that they are not tried again); the oldest go first, but one replayed
        since eviction last passed it is kept once more."""
        return self._limit

    @limit.setter
    def limit(self, value):
        if type(value) is not int or value < 1:
            raise UsageError(f"the GEMM replay table's limit is a whole number of at least 1, got {value!r}")
        self._limit = value

    @property
    def cost(self):
        """What one recording costs, in replays: its host time over what a replay saves against
        a direct call (``COST`` until measured; at most ``COST_MAX``, which is also the price
        where a replay saves next to nothing); the bank's price where the table has one."""
        return self._bank.cost_c()

    cdef double cost_c(self) noexcept:
        cdef double saving, c
        if self.record_s == 0.0 or self.direct_s == 0.0 or self.replay_s == 0.0:
            return COST
        saving = self.direct_s - self.replay_s
        if saving <= self.direct_s / 64:
            return COST_MAX
        c = self.record_s / saving
        return c if c < COST_MAX else COST_MAX

    def observe(self, bint replayed, double seconds):
        """Count the host time of one call: a replay (``replayed``) or a direct call."""
        self.observe_c(replayed, seconds)

    # (cdef: on the GEMM's launch path, a cpdef would look for a Python override at every call,
    # the table being subclassed in Python)
    cdef inline void observe_c(self, bint replayed, double seconds) noexcept:
        if replayed:
            self.replay_s = seconds if self.replay_s == 0.0 else self.replay_s + (seconds - self.replay_s) / 16
        else:
            self.direct_s = seconds if self.direct_s == 0.0 else self.direct_s + (seconds - self.direct_s) / 16

    cdef inline uintptr_t find(self, key) except? 0:
        cdef _Entry e = self._execs.get(key)
        if e is None or e.handle == 0:  # not recorded, or its recording failed (miss() tells them apart)
            return 0
        self._replayed(e)
        return e.handle

    cdef inline void _replayed(self, _Entry e) noexcept:
        e.used = True
        self.replays += 1
        cdef Replays b = self._bank
        if b.credit < 8 * b.cost_c():
            b.credit += 1.0

    cdef int retire(self, key) except -1:
        """Treat ``key``'s recording as failed from now on (its calls go direct, or where it is a
        template's key, to exact calls' graphs): a recording whose launch cannot be prepared.
        Its executable goes with the entry (the driver frees one still running once it ends)."""
        cdef _Entry e = self._execs.get(key)
        if e is not None and e.handle:
            e.handle = 0
            e.ex = None
        return 0

    cdef object miss_ex(self, key, backend, stream, call):
        """:meth:`miss`, returning the recorded object (None: not recorded now)."""
        if self.miss(key, backend, stream, call) == 0:
            return None
        return (<_Entry>self._execs[key]).ex

    cdef uintptr_t miss(self, key, backend, stream, call) except? 0:
        cdef Replays b = self._bank
        cdef double cost = b.cost_c()
        cdef int64_t t0
        if key in self._execs:
            return 0  # recording this one failed before: stay direct
        n = self._seen.get(key, 0) + 1
        if n < HOT or b.credit < cost:
            if n >= 2 * HOT:
                # seen twice as often as a hot call and still direct for want of credit: its
                # recording would have been replayed that often. It earns as a replay does, so a
                # wide pattern that repeats (64 requests in flight, each on buffers of its own,
                # make some 880 calls a round) is recorded within tens of rounds, not only as fast
                # as the few calls recorded so far earn by their replays
                if b.credit < 8 * cost:
                    b.credit += 1.0
            elif n >= HOT:
                b.credit += 1.0 / cost  # hot, but recordings have not paid lately
            if len(self._seen) >= 4 * self._limit:
                self._seen.clear()
            self._seen[key] = n
            return 0
        self._seen.pop(key, None)
        b.credit -= cost
        t0 = _now_ns()
        ex = self._record(backend, stream, call)
        t = (_now_ns() - t0) * 1e-9
        self.record_s = t if self.record_s == 0.0 else self.record_s + (t - self.record_s) / 4
        cdef _Entry e = _Entry.__new__(_Entry)
        if ex is not None:
            e.handle = <uintptr_t>ex.handle_int  # (read first: an entry is whole once stored)
            e.ex = ex
        self._make_room()
        self._execs[key] = e
        if e.handle == 0:
            return 0
        self.recorded += 1
        return e.handle

    cdef int _make_room(self) except -1:
        """Drop entries, oldest first, until one more fits; an entry replayed since it was last
        looked at here gets a second chance (moved to the newest end, unmarked), so the graphs
        in use stay while those of addresses that did not come back go."""
        cdef _Entry e
        execs = self._execs
        # (ends: each turn drops an entry or unmarks one, and nothing marks one meanwhile)
        while execs and len(execs) >= self._limit:
            key = next(iter(execs))
            e = execs.pop(key)
            if e.used:
                e.used = False
                execs[key] = e
                continue
            self.evicted += 1
        return 0

    def get(self, key, backend, stream, call):
        """The graph handle (an int) to launch for ``key``, or 0 to make the call directly.

        ``call(stream_handle)`` enqueues the call on a stream and returns its status; it is
        used once, to record.
        """
        cdef uintptr_t h = self.find(key)
        return h if h else self.miss(key, backend, stream, call)

    def executables(self):
        """The recorded executables (failed recordings left out), oldest first."""
        cdef _Entry e
        cdef list out = []
        for e in self._execs.values():
            if e.ex is not None:
                out.append(e.ex)
        return out

    def clear(self):
        """Forget every recording, hot count and measurement; the credit starts again."""
        self._execs.clear()
        self._seen.clear()
        self.credit = 4 * COST
        self.direct_s = self.replay_s = self.record_s = 0.0


cdef class _LtCalls:
    """cublasLtMatmul calls made in order on the stream they are given (what a recording of one
    call, or of a batch of calls, records): each call's key is ``(plan, pa, pb, pc, alpha, beta,
    stream)``. ``template``: one call, to be recorded as a :class:`GemmTemplate` (replayed on
    any pointers) rather than for its own pointers."""

    cdef list keys
    cdef uintptr_t ws
    cdef size_t ws_bytes
    cdef readonly bint template

    @property
    def pointers(self):
        """The first call's ``(pa, pb, pc)``: its two operands as its key holds them (cuBLAS's B
        and A: the row-major product runs as the column-major one of the transposes), and the
        output."""
        k = <tuple>self.keys[0]
        return (k[1], k[2], k[3])

    def shifted(self, uint64_t da, uint64_t db, uint64_t dc):
        """The same calls with every call's pointers moved by ``da``, ``db``, ``dc`` bytes: what
        a template's second and third recordings record (never run, only captured)."""
        cdef _LtCalls c = _LtCalls.__new__(_LtCalls)
        c.keys = [(k[0], <uint64_t>(k[1] + da), <uint64_t>(k[2] + db), <uint64_t>(k[3] + dc)) + k[4:]
                  for k in self.keys]
        c.ws, c.ws_bytes, c.template = self.ws, self.ws_bytes, self.template
        return c

    def __call__(self, uintptr_t on):
        cdef int status
        for k in self.keys:
            status = _lt(<GemmPlan>k[0], k[1], k[2], k[3], k[4], k[5], self.ws, self.ws_bytes, on)
            if status:
                return status
        return 0


cdef int _lt(GemmPlan p, uintptr_t pa, uintptr_t pb, uintptr_t pc, float alpha, float beta, uintptr_t ws,
             size_t ws_bytes, uintptr_t stream) noexcept nogil:
    # row-major c = a @ b as column-major c^T = b^T a^T: cuBLAS's A is our b; D is C (in place)
    cdef ltmatmul_t fn = <ltmatmul_t>p.lt[0]
    return fn(<void*>p.lt[1], <void*>p.lt[2], &alpha, <void*>pb, <void*>p.lt[3], <void*>pa, <void*>p.lt[4],
              &beta, <void*>pc, <void*>p.lt[5], <void*>pc, <void*>p.lt[5], <void*>p.lt[6], <void*>ws, ws_bytes,
              <void*>stream)


cdef struct kparams_t:
    # CUDA_KERNEL_NODE_PARAMS_v2, the layout cuGraphExecKernelNodeSetParams takes (the driver's ABI)
    void* func
    unsigned int gx, gy, gz, bx, by, bz, shmem
    void** kernel_params
    void** extra
    void* kern
    void* ctx

cdef struct patch_t:
    size_t off    # the 8-byte word at this offset of the node's argument block
    int which     # holds pointer 0, 1 or 2 of the call (its key's pa, pb, pc)
    uint64_t rel  # plus this (modulo 2**64)

cdef struct tnode_t:
    void* node        # the captured graph's node the executable was made from
    kparams_t p       # its launch, with the argument block below
    char* args        # the argument block, patched in place
    void** slots      # per parameter, its address in ``args`` (NULL where the block is one buffer)
    void* extra[5]    # the block as one buffer: CU_LAUNCH_PARAM_BUFFER_POINTER/SIZE, END
    size_t size
    patch_t* patches
    int n_patches
    int uses          # which pointers its patches hold (bit i: pointer i)


#: the size of the driver's kernel node parameters as laid out here (the backend checks its own
#: against it before templates are made)
KPARAMS_BYTES = sizeof(kparams_t)


cdef class GemmTemplate:
    """One cuBLASLt call recorded once and replayed on any buffers: before a launch for other
    pointers than the last, the words of its kernels' arguments that hold the pointers are
    rewritten (``cuGraphExecKernelNodeSetParams``, which applies to the launches that follow,
    not to those in flight).

    Made by the kernels layer (``deviceop.kernels._gemm_replay``), which finds those words by
    recording the call three times on different pointers. ``nodes``: per kernel node of the
    graph, ``(node, function, kernel, grid, block, shared memory, by_buffer, arguments, layout,
    patches)``, ``patches`` a list of ``(offset, which, rel)``; ``pointers``: the recording's own
    (what the executable holds now)."""

    cdef tnode_t* nodes
    cdef int n
    cdef readonly object ex       # the executable
    cdef object raw               # the captured graph, whose nodes name the executable's
    cdef readonly uintptr_t handle_int
    cdef uintptr_t cur[3]         # the pointers the executable holds (0s: not known)

    def __cinit__(self, ex, raw, nodes, pointers):
        cdef tnode_t* t
        cdef int i, j
        self.nodes = <tnode_t*>calloc(max(len(nodes), 1), sizeof(tnode_t))
        if self.nodes == NULL:
            raise MemoryError()
        for i in range(len(nodes)):
            node, func, kern, grid, block, shmem, by_buffer, data, layout, patches = nodes[i]
            t = &self.nodes[i]
            self.n = i + 1
            t.node = <void*><uintptr_t>node
            t.p.func, t.p.kern, t.p.ctx = <void*><uintptr_t>func, <void*><uintptr_t>kern, NULL
            t.p.gx, t.p.gy, t.p.gz = grid
            t.p.bx, t.p.by, t.p.bz = block
            t.p.shmem = shmem
            t.size = len(data)
            t.args = <char*>calloc(max(t.size, 1), 1)
            t.patches = <patch_t*>calloc(max(len(patches), 1), sizeof(patch_t))
            if t.args == NULL or t.patches == NULL:
                raise MemoryError()
            memcpy(t.args, <const char*>data, t.size)
            for j in range(len(patches)):
                off, which, rel = patches[j]
                if off < 0 or off + 8 > t.size or which not in (0, 1, 2):
                    raise ValueError(f"a template's patch {patches[j]!r} is outside its {t.size}-byte block")
                t.patches[j].off, t.patches[j].which, t.patches[j].rel = off, which, <uint64_t>rel
                t.uses |= 1 << <int>which
            t.n_patches = len(patches)
            if by_buffer:
                t.extra[0], t.extra[1] = <void*>1, <void*>t.args
                t.extra[2], t.extra[3], t.extra[4] = <void*>2, <void*>&t.size, NULL
                t.p.extra = t.extra
            else:
                t.slots = <void**>calloc(max(len(layout), 1), sizeof(void*))
                if t.slots == NULL:
                    raise MemoryError()
                for j in range(len(layout)):
                    off, size = layout[j]
                    if off < 0 or off + size > t.size:
                        raise ValueError(f"a template's parameter at {off} is outside its {t.size}-byte block")
                    t.slots[j] = t.args + <size_t>off
                t.p.kernel_params = t.slots
        self.ex, self.raw = ex, raw
        self.handle_int = ex.handle_int
        self.cur[0], self.cur[1], self.cur[2] = pointers

    def __dealloc__(self):
        cdef int i
        if self.nodes != NULL:
            for i in range(self.n):
                free(self.nodes[i].args)
                free(self.nodes[i].slots)
                free(self.nodes[i].patches)
            free(self.nodes)

    @property
    def pointers(self):
        """The pointers the executable holds now (the key's pa, pb, pc; 0s: unknown)."""
        return (self.cur[0], self.cur[1], self.cur[2])

    cdef int point(self, Driver d, uintptr_t pa, uintptr_t pb, uintptr_t pc) noexcept nogil:
        """Make the executable's next launches use these pointers (nothing where it does);
        the driver's error, or 0."""
        cdef int i, j, err
        cdef tnode_t* t
        cdef uintptr_t ptr[3]
        cdef int moved = (self.cur[0] != pa) | (self.cur[1] != pb) << 1 | (self.cur[2] != pc) << 2
        if moved == 0:
            return 0
        if d.exec_kernel_set == NULL:
            return 801  # CUDA_ERROR_NOT_SUPPORTED (a template is only made where the call exists)
        ptr[0], ptr[1], ptr[2] = pa, pb, pc
        self.cur[0] = self.cur[1] = self.cur[2] = 0  # (until every node holds the new ones)
        for i in range(self.n):
            t = &self.nodes[i]
            if t.uses & moved == 0:
                continue  # (its words hold none of the pointers that moved: an update costs the host)
            for j in range(t.n_patches):
                (<uint64_t*>(t.args + t.patches[j].off))[0] = ptr[t.patches[j].which] + t.patches[j].rel
            err = d.exec_kernel_set(<void*>self.handle_int, t.node, &t.p)
            if err:
                return err
        self.cur[0], self.cur[1], self.cur[2] = pa, pb, pc
        return 0


cdef class GemmLauncher:
    """The compiled half of the GEMM kernel (the kernels layer subclasses it).

    ``plans``: geometry by layout key; ``blas``: per stream handle, ``(cuBLAS handle, workspace
    address)``; ``replays``: graphs of repeated calls; ``batch_replays``: graphs of repeated
    batches of calls (None: batches run call by call); ``mode``: 0 cuBLASLt with replays, 1
    cuBLASLt only, 2 cublasGemmEx (the subclass's ``enqueue``); ``status_error(status, call)``
    makes the error for a cuBLAS status.
    """

    cdef public PlanCache plans
    cdef public dict blas
    cdef public Replays replays
    cdef public Replays batch_replays
    cdef public int mode
    cdef public size_t ws_bytes
    cdef public object status_error

    def __repr__(self):
        return "gemm()"

    cpdef object fast(self, c, a, b, alpha, beta, tf32):
        """The op of a call whose layout is planned, or None (the caller validates and plans)."""
        cdef TensorBase ct, ta, tb
        if type(alpha) is not float or type(beta) is not float or (tf32 is not True and tf32 is not False):
            return None
        if not (-FLT_MAX <= <double>alpha <= FLT_MAX and -FLT_MAX <= <double>beta <= FLT_MAX):
            return None  # refused (or NaN passed on) by the caller's checks
        if isinstance(c, PartitionBase):
            ct = (<PartitionBase>c).tensor
        elif isinstance(c, TensorBase):
            ct = <TensorBase>c
        else:
            return None
        if not isinstance(a, TensorBase) or not isinstance(b, TensorBase):
            return None
        ta, tb = <TensorBase>a, <TensorBase>b
        if ta.buffer is ct.buffer or tb.buffer is ct.buffer:
            return None  # one allocation: the caller checks the spans do not overlap
        # the layout, and the addresses' alignment up to 256 bytes (cuBLASLt's heuristic uses it)
        p = self.plans.get((tf32, ct._key, ta._key, tb._key, ct.addr & 255, ta.addr & 255, tb.addr & 255))
        if p is None:
            return None
        return gemm_call(self, (c, a, b), (alpha, beta, tf32), <GemmPlan>p)

    cpdef int run_lt(self, ExecutionContext cx, GemmPlan p, TensorBase c, TensorBase a, TensorBase b,
                     float alpha, float beta, uintptr_t ws) except -1:
        """Order c (written), a and b (read) and enqueue the cuBLASLt call, or its recorded graph
        once calls of its plan, scalars and stream repeat (see :meth:`_one`), on ``cx.stream``,
        atomically."""
        cdef uintptr_t pa = b.addr if p.swap else a.addr
        cdef uintptr_t pb = a.addr if p.swap else b.addr
        cdef uintptr_t pc = c.addr
        cdef int err = 0, status = 0
        cdef int64_t ns = 0
        cdef Driver d = cx.drv
        if p.lt[0] == 0 or d is None:
            raise TypeError("run_lt: this GEMM has no plain cuBLASLt plan, or the execution no driver")
        LOCK.take()
        try:
            order_tensor(cx, c, True, self)
            order_tensor(cx, a, False, self)
            order_tensor(cx, b, False, self)
            self._one(cx, p, pa, pb, pc, alpha, beta, ws, self.mode == 0 and cx.captured is None, None, &err,
                      &status, &ns)
        finally:
            LOCK.drop()
        if err:
            raise d.error(err, "cuGraphLaunch (a recorded GEMM)")
        if status:
            raise self.status_error(status, "cublasLtMatmul")
        return 0

    cdef int _one(self, ExecutionContext cx, GemmPlan p, uintptr_t pa, uintptr_t pb, uintptr_t pc, float alpha,
                  float beta, uintptr_t ws, bint replay, object key, int* err, int* status, int64_t* ns) except -1:
        """Enqueue one ordered call on ``cx.stream``; with ``replay``, as a recorded graph once
        calls of its plan, scalars and stream repeat: its template (:class:`GemmTemplate`, on
        these pointers), or where that could not be made, the exact call's graph once it
        repeats (``key``: the call's key if the caller has it, else made here); else the
        cuBLASLt call. The driver's error (0: none) in ``err``, cuBLAS's status in ``status``;
        the launch's host time is added to ``ns``. Call with the ledger lock held."""
        cdef uintptr_t ex = 0
        cdef uintptr_t sh = cx.sh
        cdef Driver d = cx.drv
        cdef int e = 0, st = 0
        cdef int64_t t0
        cdef _LtCalls call
        cdef Replays r = self.replays
        cdef GemmTemplate t = None
        cdef _Entry te = None
        cdef tuple k
        cdef bint retire = False
        if replay:
            if key is None:  # (the exact call's key is made only where it is needed)
                tk = (p, alpha, beta, cx.sh)
            else:
                k = <tuple>key
                tk = (k[0], k[4], k[5], k[6])
            te = r._execs.get(tk)
            if te is not None and te.handle:
                r._replayed(te)
                t = <GemmTemplate>te.ex
            elif te is None:  # not hot yet, or hot now: recorded here
                if key is None:
                    key = (p, pa, pb, pc, tk[1], tk[2], tk[3])
                call = _LtCalls.__new__(_LtCalls)
                call.keys, call.ws, call.ws_bytes, call.template = [key], ws, self.ws_bytes, True
                t = r.miss_ex(tk, cx.backend, cx.stream, call)
                te = r._execs.get(tk) if t is None else None
            if t is None and te is not None:  # its template failed: graphs of exact calls
                if key is None:
                    key = (p, pa, pb, pc, tk[1], tk[2], tk[3])
                ex = r.find(key)
                if ex == 0:
                    call = _LtCalls.__new__(_LtCalls)
                    call.keys, call.ws, call.ws_bytes = [key], ws, self.ws_bytes
                    ex = r.miss(key, cx.backend, cx.stream, call)
        with nogil:
            t0 = _now_ns()
            if t is not None:
                if t.point(d, pa, pb, pc) == 0:
                    e = d.graph_launch(<void*>t.handle_int, <void*>sh)
                else:  # (not expected: the template was made with this call) the call itself
                    retire = True
                    st = _lt(p, pa, pb, pc, alpha, beta, ws, self.ws_bytes, sh)
            elif ex:
                e = d.graph_launch(<void*>ex, <void*>sh)
            else:
                st = _lt(p, pa, pb, pc, alpha, beta, ws, self.ws_bytes, sh)
            t0 = _now_ns() - t0
        if retire:  # its key's calls go to exact graphs from now on, as where it could not be made
            r.retire(tk)
        if replay:  # what a replay saves decides whether recordings pay (Replays.cost)
            r.observe_c(ex != 0 or (t is not None and not retire), t0 * 1e-9)
        err[0] = e
        status[0] = st
        ns[0] += t0
        return 0

    cdef list run_lt_group(self, ExecutionContext cx, list ops, uintptr_t ws):
        """Order and enqueue a batch of planned cuBLASLt GEMMs (``GemmCall``s of this kernel, with
        replays on) on ``cx.stream``, atomically: as one recorded graph once the same batch (every
        call's key, in order) repeats, else call by call as :meth:`run_lt` makes them (each its
        own replay once it repeats). Each call's ``(True, args)`` or ``(False, error)``, as
        :class:`Each` gives them.

        An exception other than a call's own error (out of memory, an interrupt) leaves from the
        middle of the batch, what was enqueued enqueued: the whole execution fails, as any op's
        does, and its watcher keeps the buffers until that work completes."""
        cdef Replays batches = self.batch_replays
        cdef uintptr_t sh = cx.sh
        cdef uintptr_t ex = 0
        cdef int err = 0, st = 0
        cdef int64_t ns = 0
        cdef Driver d = cx.drv
        cdef GemmCall o
        cdef GemmPlan p
        cdef TensorBase ct, ta, tb
        cdef _LtCalls batch
        cdef Py_ssize_t i, j, n = len(ops)
        cdef tuple k
        cdef object osh = sh  # (boxed once for every call's key)
        cdef list out = [None] * n
        cdef list keys = []  # each ordered call's key, as run_lt makes it
        cdef list at = []  # the index in ``ops`` of each call in ``keys``
        cdef list failed = []  # (index, driver error, cuBLAS status): errors made once the lock is dropped
        LOCK.take()
        try:
            for i in range(n):
                o = <GemmCall>ops[i]
                p = o.plan
                try:  # (a call that cannot be ordered gets its error; the others still run)
                    c = o.args[0]
                    ct = (<PartitionBase>c).tensor if isinstance(c, PartitionBase) else <TensorBase?>c
                    ta, tb = <TensorBase?>o.args[1], <TensorBase?>o.args[2]
                    order_tensor(cx, ct, True, self)
                    order_tensor(cx, ta, False, self)
                    order_tensor(cx, tb, False, self)
                except Exception as e:
                    out[i] = (False, e)
                    continue
                keys.append((p, tb.addr if p.swap else ta.addr, ta.addr if p.swap else tb.addr, ct.addr, o.alpha,
                             o.beta, osh))
                at.append(i)
            if len(keys) > 1 and batches is not None:
                bkey = tuple(keys)
                ex = batches.find(bkey)
                if ex == 0:
                    batch = _LtCalls.__new__(_LtCalls)
                    batch.keys, batch.ws, batch.ws_bytes = keys, ws, self.ws_bytes
                    ex = batches.miss(bkey, cx.backend, cx.stream, batch)
            if ex:
                with nogil:
                    ns = _now_ns()
                    err = d.graph_launch(<void*>ex, <void*>sh)
                    ns = _now_ns() - ns
                batches.observe_c(True, ns * 1e-9)
            else:  # call by call, each its own replay once it repeats (a batch's calls may, where it does not)
                for j in range(len(keys)):
                    k = <tuple>keys[j]
                    self._one(cx, <GemmPlan>k[0], k[1], k[2], k[3], k[4], k[5], ws, True, k, &err, &st, &ns)
                    if err or st:
                        failed.append((at[j], err, st))
                if len(keys) > 1 and batches is not None:  # (the launches' time: what a replay would save)
                    batches.observe_c(False, ns * 1e-9)
        finally:
            LOCK.drop()
        if ex and err:
            for i in at:
                out[i] = (False, d.error(err, "cuGraphLaunch (a recorded batch of GEMMs)"))
            return out
        for code in failed:
            i, err, st = code
            out[i] = (False, d.error(err, "cuGraphLaunch (a recorded GEMM)") if err else
                      self.status_error(st, "cublasLtMatmul"))
        for i in at:
            if out[i] is None:
                out[i] = (True, (<GemmCall>ops[i]).args)
        return out


cdef class GemmCall(DeviceOp):
    """A planned GEMM; its output is its arguments ``(c, a, b)``."""

    cdef readonly GemmLauncher kernel
    cdef readonly tuple args
    cdef readonly tuple opts
    cdef readonly GemmPlan plan
    cdef float alpha, beta

    def __repr__(self):
        return "<gemm() call>"

    cpdef object _run(self, ExecutionContext cx):
        cdef GemmPlan p = self.plan
        cdef GemmLauncher k = self.kernel
        cdef tuple args = self.args
        if p.be is not cx.backend:
            check_backend(cx, p.be, "gemm()")
        if p.m == 0 or p.n == 0:
            return args
        if p.lt[0] != 0 and k.mode != 2 and cx.drv is not None and not cx.capturing:
            # (recorded: the kernels layer gives the call the recording's own workspace)
            blas = k.blas.get(cx.sh)
            if blas is not None:
                c = args[0]
                ct = (<PartitionBase>c).tensor if isinstance(c, PartitionBase) else c
                k.run_lt(cx, p, ct, args[1], args[2], self.alpha, self.beta, (<tuple>blas)[1])
                return args
        k.enqueue(cx, args, self.opts, p)  # the kernels layer: first call, other paths
        return args

    cdef object _run_group(self, ExecutionContext cx, list ops):
        # a batch of GEMMs that all take the compiled cuBLASLt path (as _run would, call by
        # call) runs as one piece of work: one graph launch once the batch repeats
        cdef GemmLauncher k = self.kernel
        cdef GemmCall o
        cdef GemmPlan p
        if k.mode != 0 or k.batch_replays is None or cx.captured is not None or cx.drv is None:
            return None
        blas = k.blas.get(cx.sh)
        if blas is None:
            return None
        for x in ops:
            if type(x) is not type(self):
                return None
            o = <GemmCall>x
            p = o.plan
            if o.kernel is not k or p.be is not cx.backend or p.lt[0] == 0 or p.m == 0 or p.n == 0:
                return None
        return k.run_lt_group(cx, ops, (<tuple>blas)[1])


cpdef GemmCall gemm_call(GemmLauncher kernel, tuple args, tuple opts, GemmPlan plan):
    """The op of a validated GEMM call: ``opts`` is ``(alpha, beta, tf32)``."""
    cdef GemmCall op = GemmCall.__new__(GemmCall)
    op.kernel = kernel
    op.args = args
    op.opts = opts
    op.plan = plan
    op.alpha = opts[0]
    op.beta = opts[1]
    return op
