"""cuBLAS through nvmath-python's bindings: one handle and one workspace per stream.

nvmath is imported on the first GEMM, not with deviceop: importing it costs about a second.
A handle is bound to its stream once (``cublasSetStream``) and given a workspace of its own,
so cuBLAS never allocates inside a call; that is what makes a GEMM legal in a graph recording.
Handles and workspaces live as long as the backend (streams are never destroyed).

A GEMM recorded in a graph scope uses a workspace of its recording instead
(:func:`recording_workspace`): recordings are made on a few capture streams, one after the
other, and their graphs are replayed on any stream, at once; with the capture stream's
workspace, two replays (or a replay and that stream's own GEMMs) would share one, which
cuBLAS's kernels use for partial sums.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from .._core._capture import CAPTURE
from .._errors import BackendError, CudaError
from .._process import renew_at_fork

__all__ = ["WORKSPACE_BYTES", "call", "cublas", "handle_for", "recording_workspace", "relaxed_capture", "workspace_of"]

# cuBLAS recommends 32 MiB on Hopper for its best kernels (cuBLAS docs, cublasSetWorkspace)
WORKSPACE_BYTES = 32 << 20

_lock = threading.Lock()
renew_at_fork(globals(), _lock=threading.Lock)  # a thread may hold it at fork()
_handles: dict[int, int] = {}  # stream handle -> cublasHandle_t
_workspaces: dict[int, int] = {}  # stream handle -> its workspace (kept for the process's lifetime)
_mod: list[Any] = []
# recordings' workspaces: by recording scope while it records; by device (id of its backend),
# those whose graphs are gone, for the next recordings (never freed: see _Workspace)
_rec_ws: weakref.WeakKeyDictionary[Any, _Workspace] = weakref.WeakKeyDictionary()
_idle_ws: dict[int, list[int]] = {}


def cublas() -> Any:
    """The ``nvmath.bindings.cublas`` module, imported on first use."""
    if not _mod:
        try:
            from nvmath.bindings import cublas as m
        except Exception as e:
            raise BackendError(
                f"GEMM on the cuda backend needs nvmath-python ({type(e).__name__}: {e}); "
                "pip install nvmath-python, and libcublas (CUDA toolkit, or pip install nvidia-cublas)"
            ) from e
        _mod.append(m)
    return _mod[0]


def handle_for(stream: Any) -> int:
    """The cuBLAS handle bound to ``stream`` (a CudaStream), created with its workspace on first use."""
    h = _handles.get(stream.handle_int)
    if h is not None:
        return h
    with _lock:
        h = _handles.get(stream.handle_int)
        if h is None:
            h = _create(stream)
            _handles[stream.handle_int] = h
    return h


def workspace_of(stream: Any) -> int:
    """The device workspace of ``stream``'s handle (create the handle first)."""
    return _workspaces[stream.handle_int]


class _Workspace:
    """A recording's cuBLAS workspace, kept by its recording (``scope.keep``), which its graph
    holds and every replay's execution holds until it finishes: it lives while the graph can
    replay it and while a replay runs. Once all of them are gone it is given back for later
    recordings of its device: no driver call, since a finaliser may run on a thread that
    records a graph."""

    __slots__ = ("__weakref__", "key", "ptr")

    def __init__(self, key: int, ptr: int) -> None:
        self.key = key
        self.ptr = ptr

    def __del__(self) -> None:
        idle = _idle_ws.get(self.key)
        if idle is not None:  # (None: its backend is gone, and its memory with it)
            idle.append(self.ptr)


def recording_workspace(scope: Any, stream: Any) -> int:
    """The workspace of the GEMMs ``scope`` records on ``stream`` (its capture stream): one of
    the scope's own, kept by its graph; a workspace given back by a recording whose graph is
    gone, else a new one."""
    ws = _rec_ws.get(scope)
    if ws is None:
        be = stream.backend
        key = id(be)
        with _lock:
            idle = _idle_ws.get(key)
            if idle is None:
                idle = _idle_ws[key] = []
                weakref.finalize(be, _idle_ws.pop, key, None)
            ptr = idle.pop() if idle else 0
        if not ptr:
            with relaxed_capture(), be.current():
                ptr = _alloc_workspace()
        ws = _rec_ws[scope] = _Workspace(key, ptr)
        scope.keep(ws)
    return ws.ptr


def _alloc_workspace() -> int:
    """A workspace on the current device (cuMemAlloc: call it where a recording allows it)."""
    from cuda.bindings import driver as drv

    err, ws = drv.cuMemAlloc(WORKSPACE_BYTES)
    if err:
        raise CudaError(
            f"cuMemAlloc of the {WORKSPACE_BYTES >> 20} MiB cuBLAS workspace failed ({err.name}); free memory first",
            err.name,
            int(err),
        )
    return int(ws)


class relaxed_capture:
    """Relaxed capture mode on this thread while it records (a no-op otherwise).

    cublasCreate, cuMemAlloc and cuBLASLt's set-up are not stream-ordered: inside this
    thread's recording they would invalidate it, so the thread relaxes for those calls only.
    """

    def __enter__(self) -> None:
        self.prev = None
        if CAPTURE.scope is not None:
            from cuda.bindings import driver as drv

            _, self.prev = drv.cuThreadExchangeStreamCaptureMode(drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)

    def __exit__(self, *exc: Any) -> None:
        if self.prev is not None:
            from cuda.bindings import driver as drv

            drv.cuThreadExchangeStreamCaptureMode(self.prev)


def _create(stream: Any) -> int:
    m = cublas()
    # a handle belongs to the device current when it is made, the workspace is allocated there:
    # the stream's device, whichever device's execution asks first
    with relaxed_capture(), stream.backend.current():
        h = call(m.create)
        try:
            ws = _alloc_workspace()
        except CudaError:
            call(m.destroy, h)
            raise
        _workspaces[stream.handle_int] = ws
        call(m.set_stream, h, stream.handle_int)
        call(m.set_workspace, h, ws, WORKSPACE_BYTES)
        call(m.set_pointer_mode, h, m.PointerMode.HOST)
    handle: int = h
    return handle


def call(fn: Any, *args: Any) -> Any:
    """Call a cuBLAS binding; its errors become :class:`CudaError` naming the cuBLAS status."""
    try:
        return fn(*args)
    except Exception as e:
        status = getattr(e, "status", None)
        name = str(getattr(status, "name", "")) or type(e).__name__
        raise CudaError(
            f"cuBLAS {fn.__name__} failed: {e}. Check the GEMM's shapes and strides; a launch "
            "failure here can also be an earlier kernel's error (run with CUDA_LAUNCH_BLOCKING=1)",
            name,
            int(status) if status is not None else -1,
        ) from e
