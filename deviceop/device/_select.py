"""Backend selection: ``DEVICEOP_BACKEND`` / ``use_backend``; cuda when present, else host."""

from __future__ import annotations

import itertools
import os
import threading
import warnings
from typing import Any

from .._errors import BackendError

__all__ = ["current", "use_backend", "backend_name", "next_stream", "DeviceOpWarning"]


class DeviceOpWarning(UserWarning):
    """Warnings from deviceop (e.g. falling back to the host backend)."""


_state: dict[str, Any] = {"backend": None, "rr": itertools.count(), "cuda": {}}
_lock = threading.Lock()


def _pool_size() -> int:
    try:
        n = int(os.environ.get("DEVICEOP_STREAMS", "4"))
    except ValueError:
        raise BackendError("DEVICEOP_STREAMS must be an integer number of streams, e.g. 4") from None
    if not 1 <= n <= 256:
        raise BackendError(f"DEVICEOP_STREAMS={n} is out of range; use 1 to 256 streams")
    return n


def _make(name: str, streams: int) -> Any:
    if name == "cuda":
        from ._cuda import CudaBackend

        return CudaBackend(streams)
    if name == "host":
        from ._host import HostBackend

        return HostBackend(streams)
    raise BackendError(f"backend {name!r} is not known; use 'cuda' or 'host'")


def use_backend(name: str, streams: int | None = None) -> Any:
    """Select the backend (``"cuda"`` or ``"host"``) and return it.

    Selecting ``"host"`` always starts a fresh emulated device (useful after a deliberate fault);
    selecting ``"cuda"`` again reuses the backend of that pool size. ``streams`` sets the pool size
    (default ``$DEVICEOP_STREAMS`` or 4).
    """
    n = _pool_size() if streams is None else int(streams)
    if not 1 <= n <= 256:
        raise BackendError(f"streams={n} is out of range; use 1 to 256")
    with _lock:
        if name == "cuda":  # one context per process: keep one backend per pool size
            be = _state["cuda"].get(n)
            if be is None:
                be = _state["cuda"][n] = _make(name, n)
        else:
            be = _make(name, n)
        _state["backend"] = be
        return be


def current() -> Any:
    """The selected backend, initializing the default on first use."""
    be = _state["backend"]
    if be is not None:
        return be
    with _lock:
        if _state["backend"] is None:
            name = os.environ.get("DEVICEOP_BACKEND", "").strip().lower()
            n = _pool_size()
            if name:
                _state["backend"] = _make(name, n)
            else:
                try:
                    _state["backend"] = _make("cuda", n)
                except BackendError as e:
                    warnings.warn(
                        f"deviceop: {e}; using the host backend (an emulated device). "
                        "Set DEVICEOP_BACKEND=host to choose it explicitly and silence this.",
                        DeviceOpWarning,
                        stacklevel=3,
                    )
                    _state["backend"] = _make("host", n)
            if _state["backend"].name == "cuda":
                _state["cuda"][n] = _state["backend"]
        return _state["backend"]


def backend_name() -> str:
    """``"cuda"`` or ``"host"``: the backend ops run on."""
    return current().name


def next_stream() -> Any:
    """The next stream of the current device's pool, round-robin."""
    streams = current().streams
    return streams[next(_state["rr"]) % len(streams)]
