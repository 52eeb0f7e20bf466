"""Executors: execution contexts, the stream pool, terminals, futures, the await path and work
queues (``WorkQueue``: S streams from one host thread; ``ThreadedQueue``: a thread per stream) and
``Batcher`` (concurrent requests gathered into batched ops)."""

from typing import TYPE_CHECKING

from .._core._completion import (
    enqueue_slice,
    poll_budget,
    set_enqueue_slice,
    set_poll_budget,
    set_wait_policy,
    wait_policy,
)
from .._core._future import DeviceFuture
from .._core._ledger import ExecutionContext

if TYPE_CHECKING:
    from ._batcher import Batcher
    from ._queue import WorkQueue
    from ._queue_stats import ItemResult, QueueCancelled, QueueStats
    from ._threaded import ThreadedQueue

__all__ = [
    "Batcher",
    "DeviceFuture",
    "ExecutionContext",
    "ItemResult",
    "QueueCancelled",
    "QueueStats",
    "ThreadedQueue",
    "WorkQueue",
    "enqueue_slice",
    "poll_budget",
    "set_enqueue_slice",
    "set_poll_budget",
    "set_wait_policy",
    "wait_policy",
]

# the work queues load on first use: every millisecond of import is start-up time
_LAZY = {
    "WorkQueue": "._queue",
    "Batcher": "._batcher",
    "ThreadedQueue": "._threaded",
    "ItemResult": "._queue_stats",
    "QueueStats": "._queue_stats",
    "QueueCancelled": "._queue_stats",
}


def __getattr__(name: str) -> object:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'deviceop.executors' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({n for n in globals() if n.startswith("_")} | set(__all__))
