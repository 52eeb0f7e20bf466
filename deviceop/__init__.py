"""deviceop: composable, awaitable GPU work for Python.

Lazy, typed :class:`DeviceOp` values compose with ``then``, ``map``, ``zip`` and ``shared``
into pipelines that run synchronously (``sync``), are awaited (``await op``, under asyncio,
uvloop or trio) or are submitted (``submit``) across a pool of CUDA streams. The ``host`` backend emulates a device where no GPU is present.
"""

import importlib
from typing import TYPE_CHECKING, Any

from ._dtypes import DType, bfloat16, float16, float32, int32, int64, uint8
from ._errors import (
    BackendError,
    BorrowError,
    CaptureError,
    CompileError,
    CudaError,
    DeviceOpError,
    DTypeError,
    NotATensorError,
    SettingError,
    ShapeError,
    TensorIndexError,
    UsageError,
)
from .device import (
    DeviceOpWarning,
    Partition,
    Stream,
    Tensor,
    backend_name,
    borrow_policy,
    device,
    devices,
    next_stream,
    set_borrow_policy,
    set_host_chaos,
    use_backend,
)
from .device import current as _current
from .ops import DeviceOp, empty, from_numpy, full, ones, to_device, to_numpy, value, zeros

if TYPE_CHECKING:
    from . import executors, graph, interop, kernels
    from .combinators import zip
    from .executors import (
        DeviceFuture,
        enqueue_slice,
        poll_budget,
        set_enqueue_slice,
        set_poll_budget,
        set_wait_policy,
        wait_policy,
    )
    from .interop import external

# The layers above the ops load on first use (start-up time): the modules that register the
# core's hooks when a hook is first called, and the public names they hold, all of them at the
# first use of any (see _load_lazy).
_LAZY = {
    "executors": ("deviceop.executors", None),
    "graph": ("deviceop.graph", None),
    "kernels": ("deviceop.kernels", None),
    "interop": ("deviceop.interop", None),
    "external": ("deviceop.interop", "external"),
    "zip": ("deviceop.combinators", "zip"),
    "DeviceFuture": ("deviceop.executors", "DeviceFuture"),
    "enqueue_slice": ("deviceop.executors", "enqueue_slice"),
    "poll_budget": ("deviceop.executors", "poll_budget"),
    "set_enqueue_slice": ("deviceop.executors", "set_enqueue_slice"),
    "set_poll_budget": ("deviceop.executors", "set_poll_budget"),
    "set_wait_policy": ("deviceop.executors", "set_wait_policy"),
    "wait_policy": ("deviceop.executors", "wait_policy"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'deviceop' has no attribute {name!r}")
    _load_lazy()
    return globals()[name]


def _load_lazy() -> None:
    """Load every lazy name at once and drop the module's ``__getattr__``: CPython specialises
    an attribute load from a module (``do.value`` in a user's loop) only where the module has
    no ``__getattr__``; with one, every such load walks the module's dict."""
    g = globals()
    for name, (mod_name, attr) in _LAZY.items():
        mod = importlib.import_module(mod_name)
        g[name] = mod if attr is None else getattr(mod, attr)
    g.pop("__getattr__", None)


def __dir__() -> list[str]:
    # the public surface is __all__; subpackages that implement it (device, ops, ...) are not part of it
    return sorted({n for n in globals() if n.startswith("_")} | set(__all__))


def streams() -> list[Stream]:
    """The current device's stream pool."""
    return list(_current().streams)


def from_dlpack(obj: Any) -> Tensor:
    """Wrap an array that speaks DLPack (PyTorch, CuPy, JAX; numpy on the host) without a copy.

    See :func:`deviceop.interop.from_dlpack`.
    """
    from .interop import from_dlpack as wrap  # (loaded on first use: start-up time)

    return wrap(obj)


def empty_cache() -> int:
    """Give the current device's cached idle memory blocks back to the driver; return the bytes.

    deviceop keeps the memory of dropped buffers for reuse (a block is cached only once no work
    uses it); allocation failures empty the cache and retry by themselves. The buffers of work
    that has completed but that no thread has finished yet (a future submitted in an event loop
    and not awaited yet) are released first; the future's callbacks still run where it completes.
    """
    return int(_current().empty_cache())


def used_bytes() -> int:
    """Bytes of device memory held by live buffers (cached idle blocks not counted; host: live allocations)."""
    return int(_current().used_bytes())


__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "BorrowError",
    "CaptureError",
    "CompileError",
    "CudaError",
    "DType",
    "DTypeError",
    "DeviceFuture",
    "DeviceOp",
    "DeviceOpError",
    "DeviceOpWarning",
    "NotATensorError",
    "Partition",
    "SettingError",
    "ShapeError",
    "Stream",
    "Tensor",
    "TensorIndexError",
    "UsageError",
    "backend_name",
    "bfloat16",
    "borrow_policy",
    "device",
    "devices",
    "empty",
    "empty_cache",
    "enqueue_slice",
    "executors",
    "external",
    "float16",
    "float32",
    "from_dlpack",
    "from_numpy",
    "full",
    "graph",
    "int32",
    "int64",
    "interop",
    "kernels",
    "next_stream",
    "ones",
    "poll_budget",
    "set_borrow_policy",
    "set_enqueue_slice",
    "set_host_chaos",
    "set_poll_budget",
    "set_wait_policy",
    "streams",
    "to_device",
    "to_numpy",
    "uint8",
    "use_backend",
    "used_bytes",
    "value",
    "wait_policy",
    "zeros",
    "zip",
]
