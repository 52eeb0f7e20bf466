"""Backend and device selection: ``DEVICEOP_BACKEND`` / ``use_backend``, cuda when present, else
host; ``devices()`` and ``device(i)``, a device for the calling thread or task.

A backend object is one device (a CUDA device, or one emulated host device). The process has a
default device (``use_backend``); ``with device(i):`` selects another for the code inside, in
this thread or asyncio/trio task only (a context variable: tasks started inside inherit it,
other threads do not)."""

from __future__ import annotations

import abc
import contextvars
import itertools
import os
import threading
import weakref
from typing import Any

from .._errors import BackendError, DeviceOpWarning, UsageError, warn_user
from .._process import SERVICES, at_fork_child
from ._base import STREAM_TYPES
from ._ledger import abandon

__all__ = [
    "DeviceOpWarning",
    "Stream",
    "backend_name",
    "current",
    "device",
    "device_backend",
    "devices",
    "enter_device",
    "leave_device",
    "next_stream",
    "stream_of",
    "use_backend",
]


# backend: the default device; cuda: CUDA backends by (ordinal, pool size), one context per
# device per process; host: the other emulated devices of the default host device, by ordinal
_state: dict[str, Any] = {"backend": None, "rr": itertools.count(), "cuda": {}, "host": {}, "forked_cuda": False}
#: the device selected by ``with device(i):`` in this thread or task (None: the default)
_selected: contextvars.ContextVar[Any] = contextvars.ContextVar("deviceop_device", default=None)
_lock = threading.Lock()
#: every backend made in this process (abandoned in a forked child)
_made: weakref.WeakSet[Any] = weakref.WeakSet()

_FORKED = (
    "this backend belongs to the parent process: a process made by fork() inherits none of its "
    "threads or device state. Make the tensors and streams in the child after it starts"
)
_FORKED_CUDA = (
    "CUDA cannot be used in a process made by fork() after its parent initialized CUDA (the "
    "driver does not survive fork). Start worker processes with multiprocessing's 'spawn' or "
    "'forkserver' method (multiprocessing.get_context('spawn')), or use do.use_backend('host') "
    "in the child"
)


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # another thread may have held it at fork()
    for be in list(_made):
        abandon(be, _FORKED_CUDA if be.name == "cuda" else _FORKED, notify=False)
    _made.clear()
    _state.update(
        backend=None,
        rr=itertools.count(),
        forked_cuda=_state["forked_cuda"] or bool(_state["cuda"]),
        cuda={},
        host={},
    )


at_fork_child(_after_fork_in_child, SERVICES)


def _pool_size() -> int:
    try:
        n = int(os.environ.get("DEVICEOP_STREAMS", "4"))
    except ValueError:
        raise BackendError("DEVICEOP_STREAMS must be an integer number of streams, e.g. 4") from None
    if not 1 <= n <= 256:
        raise BackendError(f"DEVICEOP_STREAMS={n} is out of range; use 1 to 256 streams")
    return n


def _make(name: str, streams: int, ordinal: int = 0) -> Any:
    if name == "cuda":
        if _state["forked_cuda"]:
            raise BackendError(_FORKED_CUDA)
        from .._backends._cuda import CudaBackend

        be: Any = CudaBackend(streams, ordinal)
    elif name == "host":
        from .._backends._host import HostBackend

        be = HostBackend(streams, ordinal)
    else:
        raise BackendError(f"backend {name!r} is not known; use 'cuda' or 'host'")
    _made.add(be)
    return be


def use_backend(name: str, streams: int | None = None, device: int = 0) -> Any:
    """Select the backend (``"cuda"`` or ``"host"``) and its default device; return it.

    Selecting ``"host"`` always starts a fresh emulated device (useful after a deliberate fault)
    and closes the host devices it replaces: their queued work completes, their threads end,
    and work on their tensors or streams afterwards raises :class:`BackendError`. Selecting
    ``"cuda"`` again reuses the backend of that device and pool size. ``streams`` sets the
    pool size (default ``$DEVICEOP_STREAMS`` or 4); ``device`` the default device's ordinal
    (``do.devices()`` lists them; the host backend has ``$DEVICEOP_HOST_DEVICES``).
    """
    if not isinstance(name, str):
        raise BackendError(f"backend name must be 'cuda' or 'host', got {name!r}")
    if streams is not None and (isinstance(streams, bool) or not isinstance(streams, int)):
        raise BackendError(f"streams must be an int from 1 to 256, got {streams!r}")
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise BackendError(f"device must be a device ordinal (an int >= 0), got {device!r}")
    n = _pool_size() if streams is None else int(streams)
    if not 1 <= n <= 256:
        raise BackendError(f"streams={n} is out of range; use 1 to 256")
    with _lock:
        if name == "cuda":  # one context per device per process: one backend per pool size
            be = _state["cuda"].get((device, n))
            if be is None:
                be = _state["cuda"][device, n] = _make(name, n, device)
        else:
            if name == "host":
                count = _host_count()
                if device >= count:
                    raise BackendError(
                        f"host device {device} requested but DEVICEOP_HOST_DEVICES gives {count}; "
                        "set DEVICEOP_HOST_DEVICES to emulate more"
                    )
            be = _make(name, n, device)
            old = _state["backend"]
            reason = (
                "this host backend was replaced by do.use_backend('host'); use tensors and "
                "streams of the current backend (do.next_stream())"
            )
            replaced = {id(b): b for b in _state["host"].values()}
            if old is not None and old.name == "host":
                replaced[id(old)] = old
            for other in replaced.values():  # each once
                other.close(reason)
            _state["host"] = {device: be}
        _state["backend"] = be
        return be


def _host_count() -> int:
    from .._backends._host import HostBackend

    return HostBackend.device_count()


def current() -> Any:
    """The device selected in this thread or task (``with device(i):``), else the default one,
    initializing the default on first use."""
    be = _selected.get()
    if be is not None:
        return be
    return _default()


def _default() -> Any:
    be = _state["backend"]
    if be is not None:
        return be
    with _lock:
        if _state["backend"] is None:
            name = os.environ.get("DEVICEOP_BACKEND", "").strip().lower()
            n = _pool_size()
            if _state["forked_cuda"] and name in ("", "cuda"):
                raise BackendError(_FORKED_CUDA)  # not the silent host fallback: say what happened
            if name:
                _state["backend"] = _make(name, n)
            else:
                try:
                    _state["backend"] = _make("cuda", n)
                except BackendError as e:
                    warn_user(
                        f"deviceop: {e}; using the host backend (an emulated device). "
                        "Set DEVICEOP_BACKEND=host to choose it explicitly and silence this.",
                        DeviceOpWarning,
                    )
                    _state["backend"] = _make("host", n)
            made: Any = _state["backend"]
            if made.name == "cuda":
                _state["cuda"][0, n] = made
            else:
                _state["host"] = {0: made}
        return _state["backend"]


def devices() -> list[str]:
    """The labels of the devices of the selected backend: ``["cuda:0", "cuda:1"]``, or the
    emulated ``["host:0", ...]`` (``$DEVICEOP_HOST_DEVICES``, default 1)."""
    be = _default()
    return [f"{be.name}:{i}" for i in range(type(be).device_count())]


def device_backend(spec: Any) -> Any:
    """The backend of device ``spec``: an ordinal, or a label such as ``"cuda:1"`` (made on
    first use, with the default device's pool size)."""
    base = _default()
    if isinstance(spec, str):
        kind, _, num = spec.strip().lower().partition(":")
        if kind != base.name:
            raise UsageError(
                f"device {spec!r} is not one of the selected backend's ({base.name}): use "
                f"do.devices() ({', '.join(devices())}), or do.use_backend({kind!r}) first"
            )
        try:
            ordinal = int(num) if num else 0
        except ValueError:
            raise UsageError(f"device label {spec!r} is not like '{base.name}:1'") from None
    elif isinstance(spec, bool) or not isinstance(spec, int):
        raise UsageError(f"a device is an ordinal or a label such as '{base.name}:1', got {spec!r}")
    else:
        ordinal = spec
    count = type(base).device_count()
    if not 0 <= ordinal < count:
        raise UsageError(
            f"device {spec!r} does not exist: the {base.name} backend has {count} "
            f"({', '.join(devices())})"
            + ("; DEVICEOP_HOST_DEVICES sets how many are emulated" if base.name == "host" else "")
        )
    if ordinal == base.ordinal:
        return base
    n = len(base.streams)
    with _lock:
        reg = _state["cuda"] if base.name == "cuda" else _state["host"]
        key = (ordinal, n) if base.name == "cuda" else ordinal
        be = reg.get(key)
        if be is None:
            be = reg[key] = _make(base.name, n, ordinal)
        return be


def enter_device(be: Any) -> contextvars.Token[Any]:
    """Select backend ``be`` in this thread or task until :func:`leave_device` (a queue lane's
    device while it makes the lane's items)."""
    return _selected.set(be)


def leave_device(tok: contextvars.Token[Any]) -> None:
    """Undo :func:`enter_device`."""
    _selected.reset(tok)


class device:
    """``with do.device(i):`` selects device ``i`` (an ordinal or a label such as ``"cuda:1"``)
    for the code inside, in this thread or task: allocations, ``next_stream()``, ``streams()``
    and terminals run there. Tasks started inside inherit it; other threads keep their own.
    ``as`` gives the device's label. A device that does not exist is refused here, before any
    work. Scopes nest; each may be entered once at a time."""

    __slots__ = ("_be", "_tok")

    def __init__(self, spec: Any) -> None:
        self._be = device_backend(spec)
        self._tok: contextvars.Token[Any] | None = None

    def __repr__(self) -> str:
        return f"<device {self._be.device_label}>"

    def __enter__(self) -> str:
        if self._tok is not None:
            raise UsageError(f"{self!r} is already entered; make one do.device(...) per with block")
        self._tok = _selected.set(self._be)
        label: str = self._be.device_label
        return label

    def __exit__(self, *exc: object) -> None:
        tok, self._tok = self._tok, None
        if tok is not None:
            _selected.reset(tok)


def backend_name() -> str:
    """``"cuda"`` or ``"host"``: the backend ops run on."""
    name: str = current().name
    return name


def next_stream() -> Any:
    """The next stream of the current device's pool, round-robin."""
    streams = current().streams
    return streams[next(_state["rr"]) % len(streams)]


class _StreamMeta(abc.ABCMeta):
    def __instancecheck__(cls, obj: Any) -> bool:
        return type(obj) in STREAM_TYPES


class Stream(metaclass=_StreamMeta):
    """A stream deviceop runs work on: one of the pool (``do.next_stream()``, ``do.streams()``)
    or another library's, wrapped with :meth:`from_handle`.

    Every backend's stream is a ``Stream`` (``isinstance`` works); it has ``handle_int`` (the
    CUstream as an int), on cuda ``handle`` (the ``cuda.bindings`` CUstream) and
    ``__cuda_stream__()`` (the stream protocol other libraries read: give
    ``torch.cuda.ExternalStream(s.handle_int)`` or ``cupy.cuda.ExternalStream(s.handle_int)`` to
    PyTorch or CuPy, ``cuda.core``'s ``Device().create_stream(s)``), ``synchronize()`` and
    ``query()``. Terminals (``sync_on``, ``submit(stream=)``, ``wait(stream=)``) also take any
    object with ``__cuda_stream__``. Streams are made by deviceop; this class is not
    instantiated.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        raise UsageError("deviceop streams come from do.next_stream(), do.streams() or do.Stream.from_handle(handle)")

    @staticmethod
    def from_handle(handle: Any) -> Any:
        """The stream for ``handle`` on the current device: a CUstream as an int, or an object
        with ``__cuda_stream__`` (a PyTorch, CuPy or cuda.core stream).

        A pool stream's handle gives that stream; another library's gives one wrapper per
        handle, which deviceop enqueues on and records events on but never destroys: keep the
        library's stream alive while deviceop work on it may run. Work on it is ordered by the
        ledger like work on any other stream.
        """
        return stream_of(handle)


def stream_of(obj: Any) -> Any:
    """A deviceop stream for ``obj``: a deviceop stream itself, an object with
    ``__cuda_stream__``, or a CUstream handle as an int."""
    if type(obj) in STREAM_TYPES:
        return obj
    proto: Any = getattr(obj, "__cuda_stream__", None)
    if proto is not None:
        try:
            got: Any = proto() if callable(proto) else proto
            version, handle = got
        except (TypeError, ValueError):
            raise UsageError(
                f"{type(obj).__name__}.__cuda_stream__ did not give (version, handle); it is not a CUDA stream"
            ) from None
        if version != 0:
            raise UsageError(f"{type(obj).__name__}.__cuda_stream__ speaks version {version}; deviceop reads version 0")
        obj = handle
    if isinstance(obj, bool) or not isinstance(obj, int) or not 0 <= obj < 1 << 64:
        raise UsageError(
            f"{obj!r} is not a stream: pass a deviceop stream (do.next_stream()), an object with "
            "__cuda_stream__ (torch.cuda.Stream, cupy.cuda.Stream, cuda.core Stream) or a CUstream "
            "handle as an int"
        )
    return current().stream_from_handle(int(obj))
