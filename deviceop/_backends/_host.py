"""The host backend: an emulated device for machines without a GPU, and for CI.

Each stream is a worker thread executing its queue in order; events, cross-stream waits and
host functions (on one callback thread of their own) behave as on CUDA. A failure inside
enqueued work becomes a sticky context error, as a kernel fault does on CUDA: later work is
skipped, and every synchronize / event wait reports it. Chaos mode delays each queued item by
a random time so that a missing cross-stream dependency shows up as a wrong result.
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .._core._base import Buffer, StreamBase, register_stream_type
from .._core._ledger import abandon
from .._core._watch import reclaim
from .._errors import BackendError, CudaError, DTypeError, SettingError, UsageError

__all__ = ["HostBackend", "set_host_chaos"]

_MAX_CHAOS_S = 10.0


def _chaos_delay(value: Any, what: str) -> float:
    """A chaos delay in seconds: a real number in [0, 10]; SettingError otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise SettingError(f"{what} must be a number of seconds in [0, {_MAX_CHAOS_S:g}], got {value!r}")
    v = float(value)
    if not 0.0 <= v <= _MAX_CHAOS_S:  # (NaN fails this too)
        raise SettingError(f"{what} must be in [0, {_MAX_CHAOS_S:g}] seconds, got {v!r}")
    return v


_chaos = {"max_delay": 0.0}


def set_host_chaos(max_delay_s: float) -> None:
    """Delay every item a host stream executes by a random time in [0, max_delay_s] (0: off).

    ``max_delay_s`` is a number of seconds in [0, 10]; anything else raises
    :class:`~deviceop.SettingError`. ``DEVICEOP_HOST_CHAOS`` sets it for a new host backend.
    """
    _chaos["max_delay"] = _chaos_delay(max_delay_s, "set_host_chaos(max_delay_s)")


class HostEvent:
    """An event on the host backend: complete when the stream reaches the point it was recorded at."""

    __slots__ = ("_flag", "backend")

    def __init__(self, backend: HostBackend) -> None:
        self.backend = backend
        self._flag = threading.Event()
        self._flag.set()  # an event never recorded counts as complete, as on CUDA

    def query(self) -> bool:
        self.backend.raise_if_error()
        return self._flag.is_set()

    def synchronize(self, timeout: float | None = None) -> bool:
        ok = self._flag.wait(timeout)
        self.backend.raise_if_error()
        return ok


class _Worker(threading.local):
    on = False


_worker = _Worker()  # on: this thread is a stream's worker


@register_stream_type
class HostStream(StreamBase):
    """An in-order work queue executed by one worker thread."""

    def __init__(self, backend: HostBackend, index: int) -> None:
        self.backend = backend
        self.index = index
        self.handle_int = 0x5000 + index
        self._q: queue.SimpleQueue[tuple[Callable[[], Any], bool]] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._pending = 0
        self._capture: list[tuple[Callable[[], Any], bool]] | None = None  # recording: items go here
        backend._all_streams.append(self)
        t = threading.Thread(target=self._work, name=f"deviceop-host-stream-{index}", daemon=True)
        t.start()

    def __repr__(self) -> str:
        if self.index < 0:
            return f"<capture stream of {self.backend.device_label}>"
        return f"<Stream {self.index} of {self.backend.device_label}>"

    def enqueue(self, fn: Callable[[], Any], always: bool = False) -> None:
        """Queue ``fn``; ``always`` items (event markers) run even after a context error."""
        cap = self._capture
        if cap is not None:  # recording a graph: keep the work for replays instead of running it
            cap.append((fn, always))
            return
        with self._cond:
            self._pending += 1
        self._q.put((fn, always))

    def _stop(self) -> None:
        """End the worker once the work queued so far has run (the backend is closing)."""
        self._q.put((None, True))  # type: ignore[arg-type]

    def _work(self) -> None:
        _worker.on = True
        be = self.backend
        while True:
            fn, always = self._q.get()
            if fn is None:
                be._stream_ended()
                return
            try:  # nothing may end this loop: a stream whose worker died would hang its waiters
                delay = _chaos["max_delay"]
                if delay:
                    time.sleep(random.random() * delay)
                if always or be.error is None:
                    fn()
            except BaseException as e:  # the emulated device faults; the context is now broken
                be.set_error(e)
            finally:
                with self._cond:
                    self._pending -= 1
                    if not self._pending:
                        self._cond.notify_all()
                fn = None  # type: ignore[assignment]  # drop closure references promptly

    # -- the Stream interface ------------------------------------------------------------------
    def synchronize(self) -> None:
        with self._cond:
            while self._pending:
                self._cond.wait()
        self.backend.raise_if_error()

    def query(self) -> bool:
        self.backend.raise_if_error()
        return self._pending == 0

    def record(self, event: HostEvent) -> None:
        flag = threading.Event()
        event._flag = flag
        self.enqueue(flag.set, always=True)

    def wait(self, event: HostEvent) -> None:
        flag = event._flag
        if not flag.is_set():
            self.enqueue(flag.wait, always=True)

    def notify(self, channel: Any, token: int) -> None:
        """Push ``token`` to ``channel`` once the stream reaches this point (a host function)."""
        self.launch_host_func(lambda: channel.push(token))

    def signal(self, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` in stream order on the stream's worker, not after a context error: how
        the completion reactor's flags are written on this backend (the device's flag write)."""
        self.enqueue(fn)

    def launch_host_func(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the callback thread once prior work is done; the stream waits for it."""
        be = self.backend

        def run() -> None:
            done = threading.Event()
            be.callbacks.put((fn, done))
            done.wait()

        self.enqueue(run)


class _HostRaw:
    """A recorded host graph: the work items in stream order."""

    __slots__ = ("items", "nodes")

    def __init__(self, items: list[tuple[Callable[[], Any], bool]]) -> None:
        self.items = tuple(items)
        self.nodes = len(items)


class _HostExec:
    __slots__ = ("items",)

    def __init__(self, items: tuple[tuple[Callable[[], Any], bool], ...]) -> None:
        self.items = items


class HostGraphs:
    """Graph capture on the host backend: a recording keeps the work, a replay enqueues it again.

    As on CUDA, an update in place needs the same structure; here that is the same number of
    work items (the emulated driver cannot tell kernels apart further).
    """

    def __init__(self, backend: HostBackend) -> None:
        from .._core._capture import StreamPool

        self.backend = backend
        pool = StreamPool(lambda: HostStream(backend, -1))
        self.acquire_stream, self.release_stream = pool.acquire, pool.release

    def begin(self, stream: HostStream) -> None:
        stream._capture = []

    def end(self, stream: HostStream) -> _HostRaw:
        items, stream._capture = stream._capture or [], None
        return _HostRaw(items)

    def nodes(self, raw: _HostRaw) -> int:
        return raw.nodes

    def instantiate(self, raw: _HostRaw, stream: HostStream) -> _HostExec:
        return _HostExec(raw.items)

    def update(self, ex: _HostExec, raw: _HostRaw) -> bool:
        if len(ex.items) != raw.nodes:
            return False
        ex.items = raw.items
        return True

    def launch(self, ex: _HostExec, stream: HostStream) -> None:
        self.backend.raise_if_error()
        for fn, always in ex.items:
            stream.enqueue(fn, always)


class HostBackend:
    """The emulated device (see module docstring)."""

    name = "host"
    #: no driver entry points: the core enqueues host work through this backend's streams
    driver = None
    #: memory is host memory (no __cuda_array_interface__, DLPack as numpy)
    cuda_memory = False
    device_label = "host:0"
    dlpack_device = (1, 0)  # kDLCPU
    device_name = "host (emulated device)"
    compute_capability = (0, 0)
    driver_version = "none"
    arch = "sm_90"  # what built-in kernels are compiled for when asked, e.g. in CI

    def __init__(self, pool_size: int = 4, ordinal: int = 0) -> None:
        self.ordinal = ordinal
        self.device_label = f"host:{ordinal}"
        env = os.environ.get("DEVICEOP_HOST_CHAOS", "").strip()
        if env:
            try:
                value: Any = float(env)
            except ValueError:
                value = env
            _chaos["max_delay"] = _chaos_delay(value, "DEVICEOP_HOST_CHAOS")
        self.error: CudaError | None = None
        self._lock = threading.Lock()
        self._used = 0
        self.callbacks: queue.SimpleQueue[tuple[Callable[[], Any], threading.Event]] = queue.SimpleQueue()
        self._all_streams: list[HostStream] = []  # the pool's and the recordings' (each has a thread)
        self._closing = -1  # streams still running once close() was called
        threading.Thread(target=self._callback_loop, name="deviceop-host-callbacks", daemon=True).start()
        self.streams = [HostStream(self, i) for i in range(pool_size)]
        self.graphs = HostGraphs(self)

    @staticmethod
    def device_count() -> int:
        """Emulated devices: ``$DEVICEOP_HOST_DEVICES`` (default 1), each with its own streams."""
        env = os.environ.get("DEVICEOP_HOST_DEVICES", "1").strip() or "1"
        try:
            n = int(env)
        except ValueError:
            raise BackendError(f"DEVICEOP_HOST_DEVICES must be a number of devices from 1 to 16, got {env!r}") from None
        if not 1 <= n <= 16:
            raise BackendError(f"DEVICEOP_HOST_DEVICES={n} is out of range; use 1 to 16 devices")
        return n

    def close(self, reason: str) -> None:
        """Run nothing more: work already queued completes, then every thread of this device
        ends; an execution on it afterwards raises :class:`BackendError` with ``reason``."""
        abandon(self, reason)
        with self._lock:
            self._closing = len(self._all_streams)
        for st in self._all_streams:
            st._stop()

    def _stream_ended(self) -> None:
        # the callback thread ends after the last stream's: queued host functions still run
        with self._lock:
            self._closing -= 1
            last = self._closing == 0
        if last:
            self.callbacks.put((None, None))  # type: ignore[arg-type]

    def _callback_loop(self) -> None:
        while True:
            fn, done = self.callbacks.get()
            if fn is None:
                return
            try:
                if self.error is None:  # as on CUDA: no host function after a context error
                    fn()
            except BaseException as e:
                self.set_error(e)
            finally:
                done.set()
                fn = None  # type: ignore[assignment]

    # -- errors --------------------------------------------------------------------------------
    def set_error(self, e: BaseException) -> None:
        if self.error is None:
            self.error = CudaError(
                f"CUDA_ERROR_LAUNCH_FAILED: work on the host backend raised "
                f"{type(e).__name__}: {e}. The context is unusable from now on; fix the failing "
                "kernel and start a new process (or do.use_backend('host') for a fresh host device).",
                name="CUDA_ERROR_LAUNCH_FAILED",
                code=719,
            )
            self.error.__cause__ = e

    def raise_if_error(self) -> None:
        if self.error is not None:
            raise self.error

    def make_current(self) -> None:
        """Nothing to make current on the host. Refuses a stream's own worker: work running on
        a stream (the fn of ``do.external``, a kernel's numpy twin) that starts deviceop work
        would wait for its own stream forever."""
        if _worker.on:
            raise UsageError(
                "deviceop was called from work running on a host stream's worker (the fn of "
                "do.external or a kernel's host function); that work must not start deviceop "
                "ops or terminals. Build the deviceop work as a separate op instead"
            )

    def current(self) -> contextlib.nullcontext[None]:
        """Nothing to make current for a block on the host (see the cuda backend's)."""
        return contextlib.nullcontext()

    # -- DLPack --------------------------------------------------------------------------------
    def accepts_dlpack_device(self, dev: tuple[int, int]) -> bool:
        """True for DLPack devices whose memory this backend can address (CPU, CUDA host)."""
        return dev[0] in (1, 3)

    def dlpack_host(self, t: Any) -> Any:
        """A DLPack capsule of host-backend tensor ``t`` (numpy's)."""
        if t.dtype.name == "bfloat16":
            raise DTypeError(
                "a bfloat16 tensor on the host backend cannot be exported through DLPack (numpy has no "
                "bfloat16 DLPack type); use t.numpy(), which returns an ml_dtypes.bfloat16 array"
            )
        b = t.buffer
        return self.array(b, t.offset, t.shape, t.strides, t.dtype.np_dtype).__dlpack__()

    # -- streams and events --------------------------------------------------------------------
    def new_stream(self, index: int) -> HostStream:
        return HostStream(self, index)

    def stream_from_handle(self, handle: int) -> HostStream:
        """The pool stream whose ``handle_int`` is ``handle`` (the emulated device has no others)."""
        for st in self.streams:
            if st.handle_int == handle:
                return st
        raise UsageError(
            f"0x{handle:x} is not a stream of the host backend (its streams are "
            f"{[hex(s.handle_int) for s in self.streams]}); foreign streams exist only on cuda"
        )

    @staticmethod
    def allocation_range(ptr: int) -> None:
        """None: host memory is described by the array that owns it (see ``interop``)."""
        return None

    def new_event(self, host_wait: bool = False) -> HostEvent:
        """An event (``host_wait``: one a host thread will block on; every host event may be)."""
        return HostEvent(self)

    # -- memory --------------------------------------------------------------------------------
    def alloc(self, nbytes: int, stream: HostStream) -> Buffer:
        self.raise_if_error()
        try:
            arr = np.empty(max(nbytes, 1), dtype=np.uint8)
        except MemoryError:
            arr = None
        if arr is None and self.reclaim():
            # as the cuda backend does: completed work that no thread has finished yet lets go
            # of its buffers, then the allocation is tried once more
            try:
                arr = np.empty(max(nbytes, 1), dtype=np.uint8)
            except MemoryError:
                pass
        if arr is None:
            # what the driver's pool says when it is out of memory: an error of this allocation
            # (the context goes on), not a sticky fault
            raise CudaError(
                f"CUDA_ERROR_OUT_OF_MEMORY: the host backend could not allocate {nbytes} bytes; "
                "free tensors you no longer need (and do.empty_cache()), or allocate less",
                name="CUDA_ERROR_OUT_OF_MEMORY",
                code=2,
            ) from None
        with self._lock:
            self._used += nbytes
        return Buffer(self, arr.ctypes.data, nbytes, host=arr, stream=stream)

    def free(self, buf: Buffer) -> None:
        with self._lock:
            self._used -= buf.nbytes

    def reclaim(self) -> int:
        """Finish the executions whose work has completed but which no thread has finished yet
        (:func:`~deviceop._core._watch.reclaim`): their buffers go. Returns how many were
        finished. An allocation that fails calls it, then tries once more."""
        return reclaim(self)

    def empty_cache(self) -> int:
        """Nothing is cached on the host backend: returns 0. Completed work that no thread has
        finished yet lets go of its buffers first (:meth:`reclaim`), as on cuda."""
        self.reclaim()
        return 0

    def used_bytes(self) -> int:
        """Bytes of deviceop-owned memory currently allocated."""
        return self._used

    @staticmethod
    def array(
        buf: Buffer, offset: int, shape: tuple[int, ...], strides: tuple[int, ...], dtype: np.dtype
    ) -> np.ndarray:
        """A numpy view of host-backend memory."""
        it = dtype.itemsize
        a: np.ndarray = np.ndarray(shape, dtype, buffer=buf.host, offset=offset, strides=tuple(s * it for s in strides))
        return a

    def memset(self, buf: Buffer, offset: int, nbytes: int, pattern: bytes, stream: HostStream) -> None:
        dst = buf.host[offset : offset + nbytes]
        pat = np.frombuffer(pattern, dtype=np.uint8)

        def run() -> None:
            dst.reshape(-1, len(pat))[:] = pat

        stream.enqueue(run)

    def htod(self, buf: Buffer, offset: int, src: np.ndarray, stream: HostStream, cx: Any) -> None:
        # snapshot now, as CUDA's staging copy does: later host writes to src do not leak in
        data = np.frombuffer(np.ascontiguousarray(src).tobytes(), dtype=np.uint8)
        dst = buf.host[offset : offset + data.size]
        stream.enqueue(lambda: np.copyto(dst, data))

    def dtoh(self, buf: Buffer, offset: int, nbytes: int, stream: HostStream, cx: Any) -> np.ndarray:
        out = np.empty(nbytes, dtype=np.uint8)
        src = buf.host[offset : offset + nbytes]
        stream.enqueue(lambda: np.copyto(out, src))
        return out

    def dtod(self, dst: Buffer, doff: int, src: Buffer, soff: int, nbytes: int, stream: HostStream) -> None:
        d = dst.host[doff : doff + nbytes]
        s = src.host[soff : soff + nbytes]
        stream.enqueue(lambda: np.copyto(d, s))

    def copy_peer(self, dst: Buffer, doff: int, src: Buffer, soff: int, nbytes: int, stream: HostStream) -> None:
        """Copy between two emulated devices (their memory is host memory), in ``stream``'s order."""
        self.dtod(dst, doff, src, soff, nbytes, stream)

    def launch_host_kernel(self, fn: Callable[..., Any], arrays: tuple[Any, ...], stream: HostStream) -> None:
        stream.enqueue(lambda: fn(*arrays))
