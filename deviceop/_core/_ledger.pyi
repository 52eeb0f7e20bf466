"""Type stub of the compiled module ``deviceop._core._ledger``: execution contexts and the ledger's entry point.

Names not declared here are internal to the core and typed ``Any``.
"""

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
    def __getattr__(self, name: str) -> Any: ...

def borrow_policy() -> str:
    """The current borrow policy: ``"wait"`` or ``"raise"``."""

def set_borrow_policy(policy: str) -> None:
    """``"wait"`` (default): order conflicting work; ``"raise"``: raise BorrowError instead."""

def __getattr__(name: str) -> Any: ...
