"""The cuda backend: the CUDA driver API through cuda.bindings (cuda-python).

One primary context per device (``CudaBackend(ordinal)``), a pool of non-blocking streams, events of two kinds (see
:class:`CudaEvent`), stream-ordered allocation from the device's default memory pool (kept
cached: release threshold at its maximum), page-locked staging for host copies
(``deviceop._core._base``). Driver calls release the GIL inside cuda.bindings.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from .._core import _capture
from .._core._base import (
    BlockCache,
    Buffer,
    StreamBase,
    driver_alloc,
    register_stream_type,
    restore_current,
    set_current,
    size_class,
    staged_download,
    staged_upload,
    swap_current,
)
from .._core._capture import release
from .._core._watch import reclaim
from .._errors import BackendError, CudaError
from . import _cuda_driver as _nd
from ._cuda_errors import _drv, check, cuda_error
from ._cuda_graph import CudaGraphs

__all__ = ["CudaBackend", "CudaEvent", "CudaStream", "check", "cuda_error"]


class CudaEvent:
    """A CUDA event, timing disabled, of one of two kinds.

    ``host_wait=True``: BLOCKING_SYNC, for an event a host thread blocks on (a future's
    watcher sleeps in the driver instead of spinning). Such an event makes the GPU interrupt
    the host when it completes, which the driver's event-handler thread then serves: host CPU for
    every such event. Every other event (ordering one
    stream after another, a completion looked at with ``query``) is a plain one.

    Handles are reused: a dropped event's handle goes to its kind's free list and the next event
    of that kind takes it, so a queue of short executions does not create and destroy an event
    each (a later record replaces an earlier one; waits already enqueued keep the record they saw).
    """

    __slots__ = ("backend", "handle_int", "host_wait")

    _FLAGS: int = 0  # set when a backend is made: CU_EVENT_DISABLE_TIMING
    _HOST_WAIT_FLAGS: int = 0  # with CU_EVENT_BLOCKING_SYNC
    _FREE_MAX = 256

    def __init__(self, backend: CudaBackend, host_wait: bool = False) -> None:
        self.backend = backend
        self.host_wait = host_wait
        # per backend: an event belongs to its device's context
        free = backend.free_host_wait_events if host_wait else backend.free_events
        if free:
            try:
                self.handle_int = free.pop()
                return
            except IndexError:  # another thread took the last one
                pass
        # cuEventCreate makes the event in the current context, which may be another device's
        # (the join of a copy to another device); it must be the stream's that records it
        with backend.current():
            err, self.handle_int = _nd.event_create(CudaEvent._HOST_WAIT_FLAGS if host_wait else CudaEvent._FLAGS)
        if err:
            raise cuda_error(err, "cuEventCreate")

    @property
    def handle(self) -> int:
        """The CUevent, as an int."""
        return self.handle_int

    def query(self) -> bool:
        err = _nd.event_query(self.handle_int)
        if not err:
            return True
        if err == 600:  # CUDA_ERROR_NOT_READY
            return False
        raise cuda_error(err, "cuEventQuery")

    def synchronize(self, timeout: float | None = None) -> bool:
        err = _nd.event_sync(self.handle_int)
        if err:
            raise cuda_error(err, "cuEventSynchronize")
        return True

    def __del__(self) -> None:
        try:
            h = self.handle_int
            free = self.backend.free_host_wait_events if self.host_wait else self.backend.free_events
            if len(free) < CudaEvent._FREE_MAX and _capture.CAPTURE.scope is None:
                free.append(h)
                return
            release(_nd.event_destroy, h)
        except Exception:  # creation failed, or interpreter shutdown
            pass


_FOREIGN = -2  # the index of a stream wrapped from another library's handle
_ALLOC = -3  # the index of the backend's allocation stream


@register_stream_type
class CudaStream(StreamBase):
    """A non-blocking CUDA stream of the pool."""

    # backend and handle_int are the compiled base's fields, which an execution context reads
    __slots__ = ("handle", "index")

    def __init__(self, backend: CudaBackend, index: int) -> None:
        self.backend = backend
        self.index = index
        self.handle = check(_drv.cuStreamCreate(int(_drv.CUstream_flags.CU_STREAM_NON_BLOCKING)), "cuStreamCreate")
        self.handle_int = int(self.handle)

    @classmethod
    def foreign(cls, backend: CudaBackend, handle: int) -> CudaStream:
        """A stream made by another library (``handle``, a CUstream as an int), not owned: deviceop
        enqueues on it and records events on it, and never destroys it."""
        s = cls.__new__(cls)
        s.backend = backend
        s.index = _FOREIGN
        s.handle = _drv.CUstream(handle)
        s.handle_int = handle
        return s

    def __repr__(self) -> str:
        if self.index == _FOREIGN:
            return f"<foreign stream 0x{self.handle_int:x} of {self.backend.device_label}>"
        if self.index == _ALLOC:
            return f"<allocation stream of {self.backend.device_label}>"
        if self.index < 0:
            return f"<capture stream of {self.backend.device_label}>"
        return f"<Stream {self.index} of {self.backend.device_label}>"

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle_int)

    def synchronize(self) -> None:
        err = _nd.stream_sync(self.handle_int)
        if err:
            raise cuda_error(err, "cuStreamSynchronize")

    def query(self) -> bool:
        err = _drv.cuStreamQuery(self.handle)[0]
        if not err:
            return True
        if err == _drv.CUresult.CUDA_ERROR_NOT_READY:
            return False
        raise cuda_error(err, "cuStreamQuery")

    def record(self, event: CudaEvent) -> None:
        err = _nd.event_record(event.handle_int, self.handle_int)
        if err:
            raise cuda_error(err, "cuEventRecord")

    def wait(self, event: CudaEvent) -> None:
        err = _nd.stream_wait(self.handle_int, event.handle_int)
        if err:
            raise cuda_error(err, "cuStreamWaitEvent")

    def notify(self, channel: Any, token: int) -> None:
        """Push ``token`` to ``channel`` once the stream reaches this point (no GIL, no CUDA call
        on the driver's thread). A failure means the context is failing: the waiter's re-check
        reports it, so it is not raised here."""
        _nd.notify(channel, self.handle_int, token)


class CudaBackend:
    """The CUDA driver backend for device ``ordinal``."""

    name = "cuda"
    #: memory is CUDA device memory (exported through __cuda_array_interface__ and DLPack)
    cuda_memory = True

    def __init__(self, pool_size: int = 4, ordinal: int = 0) -> None:
        if _drv is None:
            raise BackendError("cuda-python is not importable; install deviceop's dependencies")
        try:
            check(_drv.cuInit(0), "cuInit")
        except CudaError as e:
            raise BackendError(f"no usable CUDA device: {e}") from e
        except Exception as e:  # cuda-python raises DynamicLibNotFoundError without a driver
            # (the library's own text, chained below, tells a machine without a GPU to install a
            # display driver: the name of the error says enough here)
            raise BackendError(
                f"no CUDA driver found: this machine has no NVIDIA GPU, or its driver is not installed "
                f"({type(e).__name__})"
            ) from e
        n = check(_drv.cuDeviceGetCount(), "cuDeviceGetCount")
        if n <= ordinal:
            raise BackendError(f"CUDA device {ordinal} requested but {n} device(s) are present")
        self.device = check(_drv.cuDeviceGet(ordinal), "cuDeviceGet")
        self.ordinal = ordinal
        self.context = check(_drv.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        self.blocks = BlockCache()
        # the compiled core's entry points into the driver, for this context
        self.driver = _nd.make_driver(int(self.context), cuda_error, self.blocks)
        self.make_current()
        self.device_label = f"cuda:{ordinal}"
        self.dlpack_device = (2, ordinal)  # kDLCUDA
        self.device_name = check(_drv.cuDeviceGetName(256, self.device), "cuDeviceGetName").split(b"\0")[0].decode()
        A = _drv.CUdevice_attribute
        cc = (
            check(
                _drv.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.device),
                "cuDeviceGetAttribute",
            ),
            check(
                _drv.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.device),
                "cuDeviceGetAttribute",
            ),
        )
        self.compute_capability = cc
        self.arch = f"sm_{cc[0]}{cc[1]}"
        self.sm_count = check(
            _drv.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self.device), "cuDeviceGetAttribute"
        )
        v = check(_drv.cuDriverGetVersion(), "cuDriverGetVersion")
        self.driver_version = f"{v // 1000}.{(v % 1000) // 10}"
        self.mempool = check(_drv.cuDeviceGetDefaultMemPool(self.device), "cuDeviceGetDefaultMemPool")
        # keep freed memory in the pool: returning it to the OS at every sync costs milliseconds
        check(
            _drv.cuMemPoolSetAttribute(
                self.mempool,
                _drv.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                _drv.cuuint64_t(0xFFFFFFFFFFFFFFFF),
            ),
            "cuMemPoolSetAttribute",
        )
        CudaEvent._FLAGS = int(_drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        CudaEvent._HOST_WAIT_FLAGS = CudaEvent._FLAGS | int(_drv.CUevent_flags.CU_EVENT_BLOCKING_SYNC)
        self.free_events: list[int] = []  # handles of dropped events, by kind
        self.free_host_wait_events: list[int] = []
        self.streams = [CudaStream(self, i) for i in range(pool_size)]
        # fresh device blocks are allocated (and given back) on a stream of their own, which runs
        # nothing else: a stream that served a stream-ordered allocation launches and
        # synchronizes more slowly from then on (see driver_alloc)
        self.alloc_stream = CudaStream(self, _ALLOC)
        self.driver.alloc_stream = self.alloc_stream.handle_int
        self.driver.after_alloc = self._after_alloc
        self._modules: dict[bytes, Any] = {}
        self._mod_lock = threading.Lock()
        self._foreign_streams: dict[int, CudaStream] = {}
        self.graphs = CudaGraphs(self, lambda: CudaStream(self, -1))

    @staticmethod
    def device_count() -> int:
        """CUDA devices present (``cuDeviceGetCount``)."""
        return int(check(_drv.cuDeviceGetCount(), "cuDeviceGetCount"))

    # -- context -------------------------------------------------------------------------------
    def make_current(self) -> None:
        """Make this device's primary context current on the calling thread: the compiled
        core's check, which asks the driver what is current (another library may have switched
        the thread to another device since), then sets it where it differs."""
        set_current(self.driver)

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """This device's context current for the block and the thread's previous one after it:
        driver calls made for this device in the middle of another device's execution (a copy
        between devices, a library handle made on first use)."""
        prev = swap_current(self.driver)
        try:
            yield
        finally:
            restore_current(self.driver, prev)

    def raise_if_error(self) -> None:
        """Raise CudaError if the context has a sticky error."""
        with self.current():
            err = _drv.cuStreamQuery(self.streams[0].handle)[0]
        if err and err != _drv.CUresult.CUDA_ERROR_NOT_READY:
            raise cuda_error(err, "context check")

    # -- DLPack --------------------------------------------------------------------------------
    def accepts_dlpack_device(self, dev: tuple[int, int]) -> bool:
        """True for this device's DLPack device (kDLCUDA, ordinal)."""
        return tuple(dev) == tuple(self.dlpack_device)

    def foreign_wait(self, stream: Any, event: CudaEvent) -> None:
        """Make a DLPack consumer's stream (a CUstream int; None, 1: legacy, 2: per-thread) wait on ``event``."""
        handle = {
            None: int(_drv.CU_STREAM_LEGACY),
            1: int(_drv.CU_STREAM_LEGACY),
            2: int(_drv.CU_STREAM_PER_THREAD),
        }.get(stream, stream)
        err = _nd.stream_wait(int(handle or 0), event.handle_int)
        if err:
            raise cuda_error(err, "cuStreamWaitEvent (DLPack consumer stream)")

    # -- streams and events --------------------------------------------------------------------
    def new_stream(self, index: int) -> CudaStream:
        with self.current():  # a stream belongs to the current context
            return CudaStream(self, index)

    def stream_from_handle(self, handle: int) -> CudaStream:
        """The stream for CUstream ``handle``: the pool's own, or one wrapper per foreign handle
        (the ledger tells streams apart by identity). 0 is the legacy default stream."""
        for st in self.streams:
            if st.handle_int == handle:
                return st
        with self._mod_lock:
            found = self._foreign_streams.get(handle)
            if found is None:
                found = self._foreign_streams[handle] = CudaStream.foreign(self, handle)
            st = found
        return st

    def allocation_range(self, ptr: int) -> tuple[int, int] | None:
        """``(base, size)`` of the device allocation holding address ``ptr``, or None if the
        driver knows none (the ledger's region for foreign memory). Asked while another
        device's execution runs (its memory named by an op there): that device's context after."""
        prev = swap_current(self.driver)
        try:
            err, base, size = _drv.cuMemGetAddressRange(ptr)
        finally:
            restore_current(self.driver, prev)
        if err:
            return None
        return int(base), int(size)

    def new_event(self, host_wait: bool = False) -> CudaEvent:
        """An event; ``host_wait``: one a host thread will block on (see :class:`CudaEvent`)."""
        return CudaEvent(self, host_wait)

    # -- memory --------------------------------------------------------------------------------
    def _after_alloc(self, stream: CudaStream) -> None:
        """Order ``stream`` after what the allocation stream has enqueued (an allocation that
        waits on memory another stream freed into the pool)."""
        ev = self.new_event()
        self.alloc_stream.record(ev)
        stream.wait(ev)

    def alloc(self, nbytes: int, stream: CudaStream) -> Buffer:
        """A buffer of ``nbytes``: a cached idle block of its size class, else one from the pool
        (:func:`~deviceop._core._base.driver_alloc`; a cached block serves any stream at once)."""
        return driver_alloc(self.driver, self, stream, nbytes)

    def free(self, buf: Buffer) -> None:
        """Return ``buf``'s block to the cache (no driver call: safe while a thread records)."""
        self.blocks.give_block(buf.ptr, size_class(buf.nbytes))

    def reclaim(self) -> int:
        """Finish the executions of this device whose work has completed but which no thread has
        finished yet (:func:`~deviceop._core._watch.reclaim`): their blocks go back to the cache.
        Returns how many were finished. An allocation that finds the device full calls it first."""
        return reclaim(self)

    def empty_cache(self) -> int:
        """Give every cached (idle) block back to the driver's pool; return the bytes freed.
        The executions of this device whose work has completed but which no thread has finished
        yet are finished first (:meth:`reclaim`): their blocks go too."""
        self.reclaim()
        freed = 0
        with self.current():
            for ptr, size in self.blocks.drain():
                release(_nd.mem_free_async, ptr, self.alloc_stream.handle_int)
                freed += size
        return freed

    def used_bytes(self) -> int:
        """Bytes of device memory held by live buffers (cached idle blocks not counted)."""
        return self.blocks.live

    def memset(self, buf: Buffer, offset: int, nbytes: int, pattern: bytes, stream: CudaStream) -> None:
        k = len(pattern)
        if k not in (1, 2, 4):
            raise ValueError("memset pattern must be 1, 2 or 4 bytes")
        err = _nd.memset_async(buf.ptr + offset, int.from_bytes(pattern, "little"), nbytes // k, k, stream.handle_int)
        if err:
            raise cuda_error(err, "cuMemsetAsync")

    def htod(self, buf: Buffer, offset: int, src: np.ndarray, stream: CudaStream, cx: Any) -> None:
        """Enqueue on ``stream`` (the execution ``cx``'s) a copy of ``src`` into ``buf`` at
        ``offset``, staged through a page-locked block given back when ``cx`` completes."""
        done = staged_upload(self.driver, stream.handle_int, buf.ptr + offset, src)
        if done is not None:
            cx.on_done(done)

    def dtoh(self, buf: Buffer, offset: int, nbytes: int, stream: CudaStream, cx: Any) -> np.ndarray:
        """Enqueue on ``stream`` (the execution ``cx``'s) a copy of ``nbytes`` of ``buf`` at
        ``offset``; the uint8 array returned is filled when ``cx`` completes."""
        out = np.empty(nbytes, dtype=np.uint8)
        done = staged_download(self.driver, stream.handle_int, buf.ptr + offset, out)
        if done is not None:
            cx.on_done(done)
        return out

    def dtod(self, dst: Buffer, doff: int, src: Buffer, soff: int, nbytes: int, stream: CudaStream) -> None:
        err = _nd.memcpy_dtod_async(dst.ptr + doff, src.ptr + soff, nbytes, stream.handle_int)
        if err:
            raise cuda_error(err, "cuMemcpyDtoDAsync")

    def copy_peer(self, dst: Buffer, doff: int, src: Buffer, soff: int, nbytes: int, stream: CudaStream) -> None:
        """Copy from ``src`` on another device into ``dst`` on this one, on ``stream``
        (``cuMemcpyPeerAsync``: direct where the devices have peer access, staged otherwise)."""
        if src.backend is self:
            self.dtod(dst, doff, src, soff, nbytes, stream)
            return
        check(
            _drv.cuMemcpyPeerAsync(
                dst.ptr + doff, self.context, src.ptr + soff, src.backend.context, nbytes, stream.handle
            ),
            "cuMemcpyPeerAsync",
        )

    # -- modules -------------------------------------------------------------------------------
    def load_function(self, cubin: bytes, name: str) -> Any:
        """The CUfunction ``name`` from ``cubin`` (modules are loaded once per image)."""
        with self._mod_lock, self.current():  # a module loads into the current context
            mod = self._modules.get(cubin)
            if mod is None:
                mod = check(_drv.cuModuleLoadData(cubin), "cuModuleLoadData")
                self._modules[cubin] = mod
        return check(_drv.cuModuleGetFunction(mod, name.encode()), f"cuModuleGetFunction({name!r})")
