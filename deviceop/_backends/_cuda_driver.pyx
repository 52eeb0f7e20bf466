# cython: language_level=3
"""The cuda backend's driver entry points, called through ``cuda.bindings.cydriver``.

cuda.bindings' Python layer spends about as long converting its arguments as the driver spends
launching; these take plain integers prepared once and release the GIL around the call. The
driver library itself is found and loaded by cuda.bindings (its first call), so importing this
module never needs a GPU. :func:`make_driver` fills the compiled core's :class:`Driver` table
once, when the backend is made.
"""

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport uintptr_t, uint64_t
from cuda.bindings cimport cydriver
from cuda.bindings.cydriver cimport CUresult, CUstream, CUevent, CUfunction, CUgraphExec, CUcontext

from .._core._base cimport (
    BlockCache, Channel, Driver, chan_push, chan_t, chan_unref, ctx_get_t, ctx_set_t, event_query_t,
    event_record_t, exec_kernel_set_t, graph_launch_t, stream_sync_t,
)

__all__ = [
    "make_driver", "event_record", "event_query", "event_create", "event_destroy", "event_sync", "stream_sync",
    "stream_wait", "graph_launch", "graph_nodes", "KERNEL_NODE_PARAMS_BYTES", "notify", "mem_free_async",
    "memcpy_dtod_async", "memset_async", "NOT_READY",
]

import os

NOT_READY = 600  # CUDA_ERROR_NOT_READY


ctypedef int (*cu_launch_kernel_t)(void* f, unsigned int gx, unsigned int gy, unsigned int gz,
                                   unsigned int bx, unsigned int by, unsigned int bz, unsigned int shmem,
                                   void* stream, void** params, void** extra) noexcept nogil

# cuLaunchKernel in the driver library itself (see make_driver), NULL until resolved
cdef cu_launch_kernel_t _cu_launch = NULL


cdef int _launch(void* f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                 unsigned int by, unsigned int bz, unsigned int shmem, void* stream, void** params) noexcept nogil:
    if _cu_launch != NULL:
        return _cu_launch(f, gx, gy, gz, bx, by, bz, shmem, stream, params, NULL)
    return <int>cydriver.cuLaunchKernel(<CUfunction>f, gx, gy, gz, bx, by, bz, shmem, <CUstream>stream, params, NULL)


cdef int _graph_launch(void* ex, void* stream) noexcept nogil:
    return <int>cydriver.cuGraphLaunch(<CUgraphExec>ex, <CUstream>stream)


cdef int _exec_kernel_set(void* ex, void* node, const void* params) noexcept nogil:
    return <int>cydriver.cuGraphExecKernelNodeSetParams(<cydriver.CUgraphExec>ex, <cydriver.CUgraphNode>node,
                                                         <const cydriver.CUDA_KERNEL_NODE_PARAMS*>params)


cdef int _stream_sync(void* stream) noexcept nogil:
    return <int>cydriver.cuStreamSynchronize(<CUstream>stream)


cdef int _event_record(void* ev, void* stream) noexcept nogil:
    return <int>cydriver.cuEventRecord(<CUevent>ev, <CUstream>stream)


cdef int _event_query(void* ev) noexcept nogil:
    return <int>cydriver.cuEventQuery(<CUevent>ev)


cdef int _ctx_set(void* ctx) noexcept nogil:
    return <int>cydriver.cuCtxSetCurrent(<CUcontext>ctx)


cdef int _ctx_get(void** ctx) noexcept nogil:
    return <int>cydriver.cuCtxGetCurrent(<CUcontext*>ctx)


cdef int _mem_alloc(uintptr_t* ptr, size_t nbytes, void* stream) noexcept nogil:
    cdef cydriver.CUdeviceptr p = 0
    cdef int err = <int>cydriver.cuMemAllocAsync(&p, nbytes, <CUstream>stream)
    ptr[0] = <uintptr_t>p
    return err


cdef int _mem_free(uintptr_t ptr, void* stream) noexcept nogil:
    return <int>cydriver.cuMemFreeAsync(<cydriver.CUdeviceptr>ptr, <CUstream>stream)


cdef int _stream_query(void* stream) noexcept nogil:
    return <int>cydriver.cuStreamQuery(<CUstream>stream)


cdef int _write_value32(void* stream, uintptr_t addr, unsigned int value) noexcept nogil:
    return <int>cydriver.cuStreamWriteValue32(<CUstream>stream, <cydriver.CUdeviceptr>addr, value, 0)


cdef int _host_func(void* stream, void (*fn)(void*) noexcept nogil, void* data) noexcept nogil:
    return <int>cydriver.cuLaunchHostFunc(<CUstream>stream, <cydriver.CUhostFn>fn, data)


cdef int _host_register(void* ptr, size_t nbytes, uintptr_t* device_addr) noexcept nogil:
    # PORTABLE: one registration serves every context of the process (every device)
    cdef cydriver.CUdeviceptr d = 0
    cdef int err = <int>cydriver.cuMemHostRegister(
        ptr, nbytes, cydriver.CU_MEMHOSTREGISTER_PORTABLE | cydriver.CU_MEMHOSTREGISTER_DEVICEMAP)
    if err:
        return err
    err = <int>cydriver.cuMemHostGetDevicePointer(&d, ptr, 0)
    device_addr[0] = <uintptr_t>d
    return err


cdef int _memcpy_htod(uintptr_t dst, const void* src, size_t n, void* stream) noexcept nogil:
    return <int>cydriver.cuMemcpyHtoDAsync(<cydriver.CUdeviceptr>dst, src, n, <CUstream>stream)


cdef int _memcpy_dtoh(void* dst, uintptr_t src, size_t n, void* stream) noexcept nogil:
    return <int>cydriver.cuMemcpyDtoHAsync(dst, <cydriver.CUdeviceptr>src, n, <CUstream>stream)


cdef int _host_alloc(void** ptr, size_t n) noexcept nogil:
    # PORTABLE: a staging block serves copies of every device's context
    return <int>cydriver.cuMemHostAlloc(ptr, n, cydriver.CU_MEMHOSTALLOC_PORTABLE)


cdef void* _entry(const char* name, unsigned long long flags, void* fallback) noexcept:
    """``name``'s entry point in the driver library, for the CUDA version cydriver declares
    (the signatures this module calls it with) or the driver's own where that is older (a
    version newer than the driver's is refused with CUDA_ERROR_INVALID_VALUE, and every call
    would then take cydriver's longer path); ``fallback`` if the driver does not give it."""
    cdef void* fn = NULL
    cdef cydriver.CUdriverProcAddressQueryResult status
    cdef int version = 0
    try:
        if cydriver.cuDriverGetVersion(&version) != cydriver.CUDA_SUCCESS or version <= 0:
            return fallback
        if version > cydriver.CUDA_VERSION:
            version = cydriver.CUDA_VERSION
        err = cydriver.cuGetProcAddress(name, &fn, version, flags, &status)
    except Exception:  # a driver without cuGetProcAddress
        return fallback
    if err != cydriver.CUDA_SUCCESS or status != cydriver.CU_GET_PROC_ADDRESS_SUCCESS or fn == NULL:
        return fallback
    return fn


def make_driver(uintptr_t context, error, BlockCache blocks):
    """The core's entry-point table for the primary context ``context``; ``error(code, call)``
    makes the backend's CudaError; ``blocks`` is the backend's cache of idle memory blocks.

    The calls on every launch path (launches, graph replays, waits, events, the current
    context) go to the driver library's own entry points, resolved here once: each call
    through cydriver passes two more layers (its wrapper and its loader's), a visible share
    of a graph replay. The others go through cydriver."""
    global _cu_launch
    cdef Driver d = Driver.__new__(Driver)
    # the default stream's semantics cuda.bindings uses (its environment switch), so handle 0
    # means the same stream to both
    cdef unsigned long long flags = (
        cydriver.CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
        if os.environ.get("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM", "0") not in ("", "0")
        else cydriver.CU_GET_PROC_ADDRESS_DEFAULT
    )
    d.mem_alloc = _mem_alloc
    d.mem_free = _mem_free
    d.stream_query = _stream_query
    d.blocks = blocks
    d.launch_kernel = _launch
    # (CUresult is a C enum, an int: the driver's functions have the table's signatures)
    _cu_launch = <cu_launch_kernel_t>_entry(b"cuLaunchKernel", flags, NULL)
    d.graph_launch = <graph_launch_t>_entry(b"cuGraphLaunch", flags, <void*>_graph_launch)
    d.exec_kernel_set = <exec_kernel_set_t>_entry(b"cuGraphExecKernelNodeSetParams", flags, <void*>_exec_kernel_set)
    d.stream_sync = <stream_sync_t>_entry(b"cuStreamSynchronize", flags, <void*>_stream_sync)
    d.event_record = <event_record_t>_entry(b"cuEventRecord", flags, <void*>_event_record)
    d.event_query = <event_query_t>_entry(b"cuEventQuery", flags, <void*>_event_query)
    d.ctx_set = <ctx_set_t>_entry(b"cuCtxSetCurrent", flags, <void*>_ctx_set)
    d.ctx_get = <ctx_get_t>_entry(b"cuCtxGetCurrent", flags, <void*>_ctx_get)
    d.write_value32 = _write_value32
    d.host_func = _host_func
    d.host_register = _host_register
    d.memcpy_htod = _memcpy_htod
    d.memcpy_dtoh = _memcpy_dtoh
    d.host_alloc = _host_alloc
    d.pinned = {}
    d.context = <void*>context
    d.error = error
    return d


def event_record(uintptr_t ev, uintptr_t stream):
    """cuEventRecord -> CUresult."""
    return _event_record(<void*>ev, <void*>stream)


def event_query(uintptr_t ev):
    """cuEventQuery -> CUresult (0 complete, 600 not ready)."""
    return _event_query(<void*>ev)


def stream_sync(uintptr_t stream):
    """cuStreamSynchronize -> CUresult; the GIL is released while waiting."""
    cdef int err
    with nogil:
        err = _stream_sync(<void*>stream)
    return err


def stream_wait(uintptr_t stream, uintptr_t ev):
    """cuStreamWaitEvent -> CUresult."""
    return <int>cydriver.cuStreamWaitEvent(<CUstream>stream, <CUevent>ev, 0)


def graph_launch(uintptr_t ex, uintptr_t stream):
    """cuGraphLaunch -> CUresult."""
    cdef int err
    with nogil:
        err = _graph_launch(<void*>ex, <void*>stream)
    return err


#: the size of the driver's kernel node parameters (CUDA_KERNEL_NODE_PARAMS_v2), which the
#: compiled core's GEMM templates lay out themselves (``_core._gemm.KPARAMS_BYTES``)
KERNEL_NODE_PARAMS_BYTES = sizeof(cydriver.CUDA_KERNEL_NODE_PARAMS)

ctypedef int (*param_count_t)(void* func, size_t* count) noexcept nogil
cdef param_count_t _count_fn = NULL
cdef bint _count_looked_up = False


cdef param_count_t _param_count() noexcept:
    """cuFuncGetParamCount where the driver (and cydriver's CUDA version) has it, else NULL;
    looked up once."""
    global _count_fn, _count_looked_up
    if not _count_looked_up:
        _count_fn = <param_count_t>_entry(b"cuFuncGetParamCount", cydriver.CU_GET_PROC_ADDRESS_DEFAULT, NULL)
        _count_looked_up = True
    return _count_fn


def graph_nodes(uintptr_t graph):
    """``(CUresult, nodes)``: the nodes of a captured graph, in the driver's order, each
    ``(type, node, params)``, with ``type`` a CUgraphNodeType and ``params``, for a kernel node,
    ``(function, kernel, grid, block, shared memory, by_buffer, arguments, layout)``:
    ``arguments`` the bytes of its argument block (as one buffer where the launch passed one,
    ``by_buffer`` True, else its parameters laid out at their offsets, ``layout`` their
    ``(offset, size)``s) or None where they cannot be read; for a memset node its parameters'
    tuple; None for other nodes. Where the driver refuses a query, its result and no nodes."""
    cdef size_t n = 0, i, j, off, size, total, count = 0
    cdef param_count_t count_fn
    cdef cydriver.CUgraphNode* nodes = NULL
    cdef cydriver.CUgraphNodeType t
    cdef cydriver.CUDA_KERNEL_NODE_PARAMS kp
    cdef cydriver.CUDA_MEMSET_NODE_PARAMS mp
    cdef void** ex
    cdef char* buf
    cdef size_t bufsize
    err = cydriver.cuGraphGetNodes(<cydriver.CUgraph>graph, NULL, &n)
    if err:
        return int(err), []
    out = []
    if n == 0:
        return 0, out
    nodes = <cydriver.CUgraphNode*>PyMem_Malloc(n * sizeof(cydriver.CUgraphNode))
    if nodes == NULL:
        raise MemoryError()
    try:
        err = cydriver.cuGraphGetNodes(<cydriver.CUgraph>graph, nodes, &n)
        if err:
            return int(err), []
        for i in range(n):
            err = cydriver.cuGraphNodeGetType(nodes[i], &t)
            if err:
                return int(err), []
            info = None
            if t == cydriver.CU_GRAPH_NODE_TYPE_KERNEL:
                err = cydriver.cuGraphKernelNodeGetParams(nodes[i], &kp)
                if err:
                    return int(err), []
                data = layout = None
                by_buffer = kp.kernelParams == NULL
                if kp.kernelParams != NULL and kp.func != NULL:
                    # (the count first: asking past the last parameter is an API error that
                    # compute-sanitizer reports; without the count, no arguments are read)
                    count_fn = _param_count()
                    if count_fn != NULL and count_fn(kp.func, &count) == 0:
                        parts = []
                        total = 0
                        for j in range(count):
                            if cydriver.cuFuncGetParamInfo(kp.func, j, &off, &size) != cydriver.CUDA_SUCCESS:
                                parts = None
                                break
                            parts.append((off, size))
                            total = max(total, off + size)
                        if parts is not None:
                            b = bytearray(total)
                            for j in range(len(parts)):
                                off, size = parts[j]
                                b[off:off + size] = (<char*>kp.kernelParams[j])[:size]
                            data = bytes(b)
                            layout = tuple(parts)
                elif kp.extra != NULL:
                    ex = kp.extra
                    buf = NULL
                    bufsize = 0
                    j = 0
                    while j < 16 and ex[j] != NULL:  # CU_LAUNCH_PARAM_END
                        if <uintptr_t>ex[j] == 1:  # CU_LAUNCH_PARAM_BUFFER_POINTER
                            buf = <char*>ex[j + 1]
                        elif <uintptr_t>ex[j] == 2:  # CU_LAUNCH_PARAM_BUFFER_SIZE
                            bufsize = (<size_t*>ex[j + 1])[0]
                        j += 2
                    if buf != NULL and bufsize:
                        data = buf[:bufsize]
                info = (<uintptr_t>kp.func, <uintptr_t>kp.kern, (kp.gridDimX, kp.gridDimY, kp.gridDimZ),
                        (kp.blockDimX, kp.blockDimY, kp.blockDimZ), kp.sharedMemBytes, by_buffer, data, layout)
            elif t == cydriver.CU_GRAPH_NODE_TYPE_MEMSET:
                err = cydriver.cuGraphMemsetNodeGetParams(nodes[i], &mp)
                if err:
                    return int(err), []
                info = (<uintptr_t>mp.dst, mp.pitch, mp.value, mp.elementSize, mp.width, mp.height)
            out.append((<int>t, <uintptr_t>nodes[i], info))
    finally:
        PyMem_Free(nodes)
    return 0, out


cdef struct note_t:
    chan_t* c
    uint64_t token


cdef void _notify_cb(void* ud) noexcept nogil:
    # on the driver's thread: no GIL, no CUDA call
    cdef note_t* n = <note_t*>ud
    chan_push(n.c, n.token)
    chan_unref(n.c)
    free(n)


from libc.stdlib cimport malloc, free


def notify(Channel ch, uintptr_t stream, uint64_t token):
    """Push ``token`` to ``ch`` once ``stream`` reaches this point (a host function that needs no
    GIL); returns the CUresult (non-zero: nothing was enqueued)."""
    cdef note_t* n = <note_t*>malloc(sizeof(note_t))
    cdef int err
    if n == NULL:
        raise MemoryError()
    n.c = ch.ref()
    n.token = token
    err = <int>cydriver.cuLaunchHostFunc(<CUstream>stream, _notify_cb, n)
    if err:
        chan_unref(n.c)
        free(n)
    return err


# ---- memory and events: the per-request calls (cuda.bindings' Python layer costs microseconds;
# allocation itself goes through the core's table, driver_alloc) ----

def mem_free_async(uintptr_t ptr, uintptr_t stream):
    """cuMemFreeAsync -> CUresult."""
    return <int>cydriver.cuMemFreeAsync(<cydriver.CUdeviceptr>ptr, <CUstream>stream)


def memcpy_dtod_async(uintptr_t dst, uintptr_t src, size_t n, uintptr_t stream):
    """cuMemcpyDtoDAsync -> CUresult."""
    return <int>cydriver.cuMemcpyDtoDAsync(<cydriver.CUdeviceptr>dst, <cydriver.CUdeviceptr>src, n, <CUstream>stream)


def memset_async(uintptr_t dst, unsigned int value, size_t count, int width, uintptr_t stream):
    """cuMemsetD8/D16/D32Async of ``count`` elements of ``width`` bytes -> CUresult."""
    if width == 1:
        return <int>cydriver.cuMemsetD8Async(<cydriver.CUdeviceptr>dst, <unsigned char>value, count, <CUstream>stream)
    if width == 2:
        return <int>cydriver.cuMemsetD16Async(<cydriver.CUdeviceptr>dst, <unsigned short>value, count, <CUstream>stream)
    if width == 4:
        return <int>cydriver.cuMemsetD32Async(<cydriver.CUdeviceptr>dst, value, count, <CUstream>stream)
    raise ValueError("memset width must be 1, 2 or 4 bytes")


def event_create(unsigned int flags):
    """cuEventCreate -> (CUresult, event)."""
    cdef CUevent ev = NULL
    cdef int err = <int>cydriver.cuEventCreate(&ev, flags)
    return err, <uintptr_t>ev


def event_destroy(uintptr_t ev):
    """cuEventDestroy -> CUresult."""
    return <int>cydriver.cuEventDestroy(<CUevent>ev)


def event_sync(uintptr_t ev):
    """cuEventSynchronize -> CUresult; the GIL is released while waiting."""
    cdef int err
    with nogil:
        err = <int>cydriver.cuEventSynchronize(<CUevent>ev)
    return err
