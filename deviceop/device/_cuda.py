"""The cuda backend: the CUDA driver API through cuda.bindings (cuda-python).

One primary context on device 0, a pool of non-blocking streams, events created with
BLOCKING_SYNC (a waiting thread sleeps instead of spinning), stream-ordered allocation from the
device's default memory pool (kept cached: release threshold at its maximum), pinned staging
for host copies. Driver calls release the GIL inside cuda.bindings.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from .._errors import BackendError, CudaError
from . import _capture, _fast
from ._buffer import Buffer
from ._capture import release

__all__ = ["CudaBackend", "check"]

try:
    from cuda.bindings import driver as _drv
except Exception:  # pragma: no cover - cuda-python is a dependency; kept for broken installs
    _drv = None  # type: ignore[assignment]


def _error_text(err: Any) -> tuple[str, str]:
    try:
        if type(err) is int:  # from the native paths
            err = _drv.CUresult(err)
        _, name = _drv.cuGetErrorName(err)
        _, text = _drv.cuGetErrorString(err)
        return name.decode(), text.decode()
    except Exception:
        return f"CUresult {int(err)}", "unknown error"


def cuda_error(err: Any, call: str) -> CudaError:
    """A CudaError carrying the driver's error name and explanation."""
    name, text = _error_text(err)
    return CudaError(f"{call} failed with {name}: {text}", name=name, code=int(err))


def check(result: Any, call: str) -> Any:
    """Unpack a cuda.bindings result tuple, raising CudaError on failure."""
    err = result[0]
    if err:
        raise cuda_error(err, call)
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


class CudaEvent:
    """A CUDA event (timing disabled; waits sleep rather than spin).

    Handles are reused: a dropped event's handle goes to a small free list and the next event
    takes it, so a queue of short executions does not create and destroy an event each (a
    later record replaces an earlier one; waits already enqueued keep the record they saw).
    """

    __slots__ = ("backend", "handle", "handle_int")

    _FLAGS = 0
    _FREE_MAX = 256

    def __init__(self, backend: "CudaBackend") -> None:
        self.backend = backend
        free = backend.free_events  # per backend: an event belongs to its device's context
        if free:
            try:
                self.handle, self.handle_int = free.pop()
                return
            except IndexError:  # another thread took the last one
                pass
        self.handle = check(_drv.cuEventCreate(CudaEvent._FLAGS), "cuEventCreate")
        self.handle_int = int(self.handle)

    def query(self) -> bool:
        nd = _fast.DRIVER[0]
        err = nd.event_query(self.handle_int) if nd is not None else _drv.cuEventQuery(self.handle)[0]
        if not err:
            return True
        if err == 600:  # CUDA_ERROR_NOT_READY
            return False
        raise cuda_error(err, "cuEventQuery")

    def synchronize(self, timeout: float | None = None) -> bool:
        check(_drv.cuEventSynchronize(self.handle), "cuEventSynchronize")
        return True

    def __del__(self) -> None:
        try:
            h = self.handle
            free = self.backend.free_events
            if len(free) < CudaEvent._FREE_MAX and _capture.CAPTURE.scope is None:
                free.append((h, self.handle_int))
                return
            release(_drv.cuEventDestroy, h)
        except Exception:  # creation failed, or interpreter shutdown
            pass


class CudaStream:
    """A non-blocking CUDA stream of the pool."""

    # slots: the native graph replay reads backend and handle_int at a fixed offset
    __slots__ = ("backend", "index", "handle", "handle_int", "__weakref__")

    def __init__(self, backend: "CudaBackend", index: int) -> None:
        self.backend = backend
        self.index = index
        self.handle = check(_drv.cuStreamCreate(int(_drv.CUstream_flags.CU_STREAM_NON_BLOCKING)), "cuStreamCreate")
        self.handle_int = int(self.handle)

    def __repr__(self) -> str:
        if self.index < 0:
            return f"<capture stream of {self.backend.device_label}>"
        return f"<Stream {self.index} of {self.backend.device_label}>"

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle_int)

    def synchronize(self) -> None:
        nd = _fast.DRIVER[0]
        err = nd.stream_sync(self.handle_int) if nd is not None else _drv.cuStreamSynchronize(self.handle)[0]
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
        nd = _fast.DRIVER[0]
        err = nd.event_record(event.handle_int, self.handle_int) if nd is not None else _drv.cuEventRecord(event.handle, self.handle)[0]
        if err:
            raise cuda_error(err, "cuEventRecord")

    def wait(self, event: CudaEvent) -> None:
        err = _drv.cuStreamWaitEvent(self.handle, event.handle, 0)[0]
        if err:
            raise cuda_error(err, "cuStreamWaitEvent")


class _PinnedPool:
    """Reusable page-locked host buffers, by power-of-two size class."""

    def __init__(self) -> None:
        self._free: dict[int, list[int]] = {}
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> tuple[int, int]:
        size = max(4096, 1 << (max(nbytes, 1) - 1).bit_length())
        with self._lock:
            lst = self._free.get(size)
            if lst:
                return lst.pop(), size
        return check(_drv.cuMemHostAlloc(size, 0), "cuMemHostAlloc"), size

    def release(self, ptr: int, size: int) -> None:
        with self._lock:
            self._free.setdefault(size, []).append(ptr)


def _host_view(ptr: int, nbytes: int) -> np.ndarray:
    import ctypes

    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


class CudaBackend:
    """The CUDA driver backend for device ``ordinal``."""

    name = "cuda"

    def __init__(self, pool_size: int = 4, ordinal: int = 0) -> None:
        if _drv is None:
            raise BackendError("cuda-python is not importable; install deviceop's dependencies")
        try:
            check(_drv.cuInit(0), "cuInit")
        except CudaError as e:
            raise BackendError(f"no usable CUDA device: {e}") from e
        except Exception as e:  # cuda-python raises DynamicLibNotFoundError without a driver
            raise BackendError(f"no CUDA driver found ({type(e).__name__}: {e})") from e
        n = check(_drv.cuDeviceGetCount(), "cuDeviceGetCount")
        if n <= ordinal:
            raise BackendError(f"CUDA device {ordinal} requested but {n} device(s) are present")
        self.device = check(_drv.cuDeviceGet(ordinal), "cuDeviceGet")
        self.ordinal = ordinal
        self.context = check(_drv.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        self._tls = threading.local()
        self.make_current()
        self.device_label = f"cuda:{ordinal}"
        self.dlpack_device = (2, ordinal)  # kDLCUDA
        self.device_name = check(_drv.cuDeviceGetName(256, self.device), "cuDeviceGetName").split(b"\0")[0].decode()
        A = _drv.CUdevice_attribute
        cc = (
            check(_drv.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.device), "cuDeviceGetAttribute"),
            check(_drv.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.device), "cuDeviceGetAttribute"),
        )
        self.compute_capability = cc
        self.arch = f"sm_{cc[0]}{cc[1]}"
        self.sm_count = check(_drv.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self.device), "cuDeviceGetAttribute")
        v = check(_drv.cuDriverGetVersion(), "cuDriverGetVersion")
        self.driver_version = f"{v // 1000}.{(v % 1000) // 10}"
        self.mempool = check(_drv.cuDeviceGetDefaultMemPool(self.device), "cuDeviceGetDefaultMemPool")
        # keep freed memory in the pool: returning it to the OS at every sync costs milliseconds
        check(
            _drv.cuMemPoolSetAttribute(
                self.mempool, _drv.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                _drv.cuuint64_t(0xFFFFFFFFFFFFFFFF),
            ),
            "cuMemPoolSetAttribute",
        )
        CudaEvent._FLAGS = int(_drv.CUevent_flags.CU_EVENT_DISABLE_TIMING) | int(_drv.CUevent_flags.CU_EVENT_BLOCKING_SYNC)
        self.pinned = _PinnedPool()
        self.free_events: list[tuple[Any, int]] = []  # (handle, handle as int) of dropped events
        self.streams = [CudaStream(self, i) for i in range(pool_size)]
        self._modules: dict[bytes, Any] = {}
        self._mod_lock = threading.Lock()
        from ._cuda_graph import CudaGraphs

        self.graphs = CudaGraphs(self)
        # the native launch and host-function paths bind to the libcuda loaded above
        self.native = _fast.enable_driver()

    # -- context -------------------------------------------------------------------------------
    def make_current(self) -> None:
        """Make the primary context current on the calling thread (once per thread)."""
        tls = self._tls
        if not getattr(tls, "ok", False):
            check(_drv.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
            tls.ok = True

    def raise_if_error(self) -> None:
        """Raise CudaError if the context has a sticky error."""
        self.make_current()
        err = _drv.cuStreamQuery(self.streams[0].handle)[0]
        if err and err != _drv.CUresult.CUDA_ERROR_NOT_READY:
            raise cuda_error(err, "context check")

    # -- streams and events --------------------------------------------------------------------
    def new_stream(self, index: int) -> CudaStream:
        return CudaStream(self, index)

    def new_event(self) -> CudaEvent:
        return CudaEvent(self)

    # -- memory --------------------------------------------------------------------------------
    def alloc(self, nbytes: int, stream: CudaStream) -> Buffer:
        err, ptr = _drv.cuMemAllocAsync(max(nbytes, 1), stream.handle)
        if err:
            raise cuda_error(err, f"cuMemAllocAsync({nbytes} bytes)")
        return Buffer(self, int(ptr), nbytes, stream=stream)

    def free(self, buf: Buffer) -> None:
        self.make_current()
        stream = buf.last_stream if buf.last_stream is not None else self.streams[0]
        release(_drv.cuMemFreeAsync, buf.ptr, stream.handle)

    def used_bytes(self) -> int:
        """Bytes of the device memory pool currently handed out."""
        v = check(
            _drv.cuMemPoolGetAttribute(self.mempool, _drv.CUmemPool_attribute.CU_MEMPOOL_ATTR_USED_MEM_CURRENT),
            "cuMemPoolGetAttribute",
        )
        return int(v)

    def memset(self, buf: Buffer, offset: int, nbytes: int, pattern: bytes, stream: CudaStream) -> None:
        ptr = buf.ptr + offset
        k = len(pattern)
        if k == 1:
            r = _drv.cuMemsetD8Async(ptr, pattern[0], nbytes, stream.handle)
        elif k == 2:
            r = _drv.cuMemsetD16Async(ptr, int.from_bytes(pattern, "little"), nbytes // 2, stream.handle)
        elif k == 4:
            r = _drv.cuMemsetD32Async(ptr, int.from_bytes(pattern, "little"), nbytes // 4, stream.handle)
        else:
            raise ValueError("memset pattern must be 1, 2 or 4 bytes")
        check(r, "cuMemsetAsync")

    def htod(self, buf: Buffer, offset: int, src: np.ndarray, stream: CudaStream, cx: Any) -> None:
        data = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
        n = data.size
        if n == 0:
            return
        ptr, size = self.pinned.acquire(n)
        np.copyto(_host_view(ptr, n), data)
        check(_drv.cuMemcpyHtoDAsync(buf.ptr + offset, ptr, n, stream.handle), "cuMemcpyHtoDAsync")
        cx.on_done(lambda: self.pinned.release(ptr, size))

    def dtoh(self, buf: Buffer, offset: int, nbytes: int, stream: CudaStream, cx: Any) -> np.ndarray:
        out = np.empty(nbytes, dtype=np.uint8)
        if nbytes == 0:
            return out
        ptr, size = self.pinned.acquire(nbytes)
        check(_drv.cuMemcpyDtoHAsync(ptr, buf.ptr + offset, nbytes, stream.handle), "cuMemcpyDtoHAsync")

        def finish() -> None:
            np.copyto(out, _host_view(ptr, nbytes))
            self.pinned.release(ptr, size)

        cx.on_done(finish)
        return out

    def dtod(self, dst: Buffer, doff: int, src: Buffer, soff: int, nbytes: int, stream: CudaStream) -> None:
        check(_drv.cuMemcpyDtoDAsync(dst.ptr + doff, src.ptr + soff, nbytes, stream.handle), "cuMemcpyDtoDAsync")

    # -- modules -------------------------------------------------------------------------------
    def load_function(self, cubin: bytes, name: str) -> Any:
        """The CUfunction ``name`` from ``cubin`` (modules are loaded once per image)."""
        with self._mod_lock:
            mod = self._modules.get(cubin)
            if mod is None:
                mod = check(_drv.cuModuleLoadData(cubin), "cuModuleLoadData")
                self._modules[cubin] = mod
        return check(_drv.cuModuleGetFunction(mod, name.encode()), f"cuModuleGetFunction({name!r})")
