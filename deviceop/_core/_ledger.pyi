"""Type stub of the compiled module ``deviceop._core._ledger``: execution contexts and the ledger's entry point.

Names not declared here are internal to the core and typed ``Any``.
"""

from collections.abc import Coroutine
from typing import Any

class ExecutionContext:
    """One execution of an op on one stream: its buffers, completion and ledger entries."""

    stream: Any
    backend: Any
    buffers: list[Any] | None
    done: bool
    label: Any
    op: Any
    capturing: bool
    captured: Any
    children: tuple[Any, ...]
    def __init__(self, stream: Any, label: Any = ..., *args: Any, **kwargs: Any) -> None: ...
    def completed(self, timeout: float | None = None) -> Coroutine[Any, Any, None]:
        """``await cx.completed(timeout)``: resume once the work is complete, without blocking the loop."""
    def wait_completed(self, timeout: float | None = None) -> bool:
        """The blocking twin of :meth:`completed`, for threads: True once complete, False on timeout."""
    def sealed_event(self) -> Any:
        """Its completion event (sealed now if it was not); None once finished."""
    def finish(self, ok: bool = True) -> None:
        """Mark complete: run completion callbacks, drop buffers."""
    def __getattr__(self, name: str) -> Any: ...

def borrow_policy() -> str:
    """The current borrow policy: ``"order"``, ``"raise"`` or ``"off"``."""

def set_borrow_policy(mode: str) -> None:
    """``"order"`` (default): order conflicting work; ``"raise"``: raise BorrowError instead;
    ``"off"``: no tracking (only to measure the ledger's cost)."""

def __getattr__(name: str) -> Any: ...
