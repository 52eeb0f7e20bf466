"""Executors: execution contexts, the stream pool, terminals, futures, the await path and work
queues (``WorkQueue``: S streams from one host thread; ``ThreadedQueue``: a thread per stream)."""

from ._await import poll_budget, set_poll_budget
from ._context import ExecutionContext
from ._future import DeviceFuture
from ._queue import WorkQueue
from ._queue_stats import ItemResult, QueueCancelled, QueueStats
from ._threaded import ThreadedQueue

__all__ = [
    "ExecutionContext", "DeviceFuture", "set_poll_budget", "poll_budget",
    "WorkQueue", "ThreadedQueue", "ItemResult", "QueueStats", "QueueCancelled",
]
