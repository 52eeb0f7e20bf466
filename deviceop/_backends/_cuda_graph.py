"""CUDA graphs through the driver: stream capture, instantiate, upload, launch, exec update.

Capture uses ``CU_STREAM_CAPTURE_MODE_THREAD_LOCAL``: only the capturing thread's unsafe calls
are refused, so other threads keep launching and synchronizing while a scope records.
"""

from __future__ import annotations

from typing import Any

from .._core._capture import StreamPool, release
from .._errors import CaptureError
from . import _cuda_driver as _nd
from ._cuda_errors import _drv, check, cuda_error

__all__ = ["CudaGraphs"]


class _Raw:
    """A captured (not yet executable) driver graph; destroyed with this object."""

    __slots__ = ("handle", "nodes")

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.nodes = int(check(_drv.cuGraphGetNodes(handle, 0), "cuGraphGetNodes")[1])

    def __del__(self) -> None:
        try:
            release(_drv.cuGraphDestroy, self.handle)
        except Exception:
            pass


class _Exec:
    """An executable graph. Destroying one in flight is allowed: the driver frees it after it ends."""

    __slots__ = ("handle", "handle_int")

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.handle_int = int(handle)  # for the compiled launch

    def __del__(self) -> None:
        try:
            release(_drv.cuGraphExecDestroy, self.handle)
        except Exception:
            pass


class CudaGraphs:
    """The cuda backend's graph operations, and a pool of private capture streams."""

    #: the size of the driver's kernel node parameters (cuda.bindings' CUDA_KERNEL_NODE_PARAMS),
    #: which GEMM templates check against their own layout of it before updating a node
    kernel_node_params_bytes = _nd.KERNEL_NODE_PARAMS_BYTES

    def __init__(self, backend: Any, new_stream: Any) -> None:
        """``new_stream()`` makes a private stream for recordings."""
        self.backend = backend
        pool = StreamPool(new_stream)
        self.acquire_stream, self.release_stream = pool.acquire, pool.release
        self._mode = _drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL

    def begin(self, stream: Any) -> None:
        err = _drv.cuStreamBeginCapture(stream.handle, self._mode)[0]
        if err:
            e = cuda_error(err, "cuStreamBeginCapture")
            raise CaptureError(
                f"could not start recording on {stream!r}: {e}. Record on a stream no other work "
                "uses (the default: do.graph.scope() without stream=)"
            ) from e

    def end(self, stream: Any) -> _Raw:
        err, g = _drv.cuStreamEndCapture(stream.handle)
        if err:
            e = cuda_error(err, "cuStreamEndCapture")
            raise CaptureError(
                f"the recording was invalidated: {e}. A call the driver cannot record ran on this "
                "thread during the scope (a synchronize, an allocation or a legacy-stream call); "
                "do that before the scope"
            ) from e
        return _Raw(g)

    def nodes(self, raw: _Raw) -> int:
        return raw.nodes

    def kernel_nodes(self, raw: _Raw) -> list[tuple[int, int, Any]] | None:
        """``raw``'s nodes, in the driver's order, as ``(type, node, params)`` (see
        ``_cuda_driver.graph_nodes``: a kernel node's launch and argument bytes, a memset
        node's parameters); None where the driver cannot say (a driver without the queries)."""
        try:
            err, nodes = _nd.graph_nodes(int(raw.handle))
        except Exception:  # (a driver older than cuFuncGetParamInfo: cydriver raises)
            return None
        return None if err else nodes

    def instantiate(self, raw: _Raw, stream: Any) -> _Exec:
        ex = _Exec(check(_drv.cuGraphInstantiate(raw.handle, 0), "cuGraphInstantiate"))
        # upload now, so the first replay costs what every replay costs
        check(_drv.cuGraphUpload(ex.handle, stream.handle), "cuGraphUpload")
        return ex

    def update(self, ex: _Exec, raw: _Raw) -> bool:
        """Update ``ex`` in place to ``raw`` (same topology, other parameters); False if it cannot be."""
        err = _drv.cuGraphExecUpdate(ex.handle, raw.handle)[0]
        if not err:
            return True
        if err == _drv.CUresult.CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE:
            return False
        raise cuda_error(err, "cuGraphExecUpdate")

    def launch(self, ex: _Exec, stream: Any) -> None:
        err = _nd.graph_launch(ex.handle_int, stream.handle_int)
        if err:
            raise cuda_error(err, "cuGraphLaunch")
