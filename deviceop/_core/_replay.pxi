# Graph replays, included by _op.pyx (one compiled module with the op a replay is, and with
# op.graph(), which records through the scope below).
#
# Graph replays: a recorded graph's launch as an op, ordered by the ledger like any other work.
#
# A replay reads the regions its recording touched from a C array (no Python objects on its
# path) and reuses its previous replay's ledger entries on the same stream while nothing else
# was registered since (see ``_ledger.covering``).

cdef struct Span:
    Py_ssize_t lo, hi
    bint write


cdef class _Holds:
    """A completion callback that does nothing: it holds what a replay's work needs alive
    until the replay's execution finishes."""

    cdef readonly tuple held

    def __init__(self, tuple held):
        self.held = held

    def __call__(self):
        pass


@cython.boundscheck(False)
@cython.wraparound(False)
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
    # what the recording's work needs alive besides its buffers (Recording.keep: another
    # library's memory pool, a cuBLAS workspace), held by every replay's execution until it
    # completes, whatever becomes of the graph (an update drops the recording); None: nothing
    cdef object kept

    def __dealloc__(self):
        PyMem_Free(self.spans)

    def _set_replay(self, ex, regions, output, kept=()):
        """Point replays at executable graph ``ex`` (call with the ledger lock held).

        ``regions``: ``(Buffer, lo, hi, write)`` for every region the graph's work touches;
        ``kept``: what else its work needs alive (the recording's ``keep``)."""
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
        self.kept = _Holds(tuple(kept)) if kept else None

    @cython.always_allow_keywords(False)  # (no arguments: the cheapest call)
    def launch(self):
        """An op that replays the graph once, on the stream of the terminal that drives it."""
        cdef GraphLaunch op = GraphLaunch.__new__(GraphLaunch)
        op.source = self
        return op


@cython.boundscheck(False)
@cython.wraparound(False)
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
                if g.kept is not None:
                    cx.on_done(g.kept)
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
            if g.kept is not None:
                cx.on_done(g.kept)
            g.launches += 1
            return g.out
        finally:
            LOCK.drop()


@cython.boundscheck(False)
@cython.wraparound(False)
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


@cython.boundscheck(False)
@cython.wraparound(False)
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
