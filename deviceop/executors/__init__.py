"""Executors: execution contexts, the stream pool, terminals and futures."""

from ._context import ExecutionContext
from ._future import DeviceFuture

__all__ = ["ExecutionContext", "DeviceFuture"]
