"""Executors: execution contexts, the stream pool, terminals, futures and the await path."""

from ._await import poll_budget, set_poll_budget
from ._context import ExecutionContext
from ._future import DeviceFuture

__all__ = ["ExecutionContext", "DeviceFuture", "set_poll_budget", "poll_budget"]
