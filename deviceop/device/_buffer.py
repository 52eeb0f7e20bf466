"""Buffer: one allocation (or one wrapped foreign allocation) on a backend."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["Buffer"]


class Buffer:
    """Device memory: ``ptr`` and ``nbytes`` on ``backend``.

    ``host`` is the backing numpy uint8 array on the host backend (None on cuda). ``owner``
    keeps a foreign allocation (DLPack, ``__cuda_array_interface__``) alive. ``accesses`` is the
    access ledger's list for this buffer. Owned memory is returned to the backend's pool when
    the last reference goes; executions in flight hold references, so that never happens early.
    """

    __slots__ = ("backend", "ptr", "nbytes", "host", "owner", "accesses", "last_stream", "__weakref__")

    def __init__(
        self, backend: Any, ptr: int, nbytes: int, host: Any = None, owner: Any = None,
        stream: Any = None,
    ) -> None:
        self.backend = backend
        self.ptr = ptr
        self.nbytes = nbytes
        self.host = host
        self.owner = owner
        self.accesses: list[list[Any]] = []
        self.last_stream = stream

    def describe(self) -> str:
        return f"buffer 0x{self.ptr:x} ({self.nbytes} bytes, {self.backend.name})"

    def __repr__(self) -> str:
        return f"<Buffer {self.describe()}>"

    def __del__(self) -> None:
        if self.owner is not None or sys.is_finalizing():
            return
        try:
            self.backend.free(self)
        except Exception:
            # a destructor must not raise; a context that already failed cannot free anyway
            pass
