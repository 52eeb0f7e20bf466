"""Process-wide state across ``fork()``, renewed in the child in one place.

A child made by ``fork()`` has only the forking thread: a lock another thread held at that
moment would stay held forever, the threads deviceop started (the streams' watchers, their
janitor, the completion reactor's scanner) do not exist there, and work the parent queued on a
device never completes in the child. Every module that keeps such state registers how to renew
it here, at import; one ``after_in_child`` handler runs the renewals in stage order:

``CORE``      the core's own locks and driver-facing state (the ledger lock, the thread's current
              context, the reactor's slots and mutex, the capture and region tables' locks);
``SERVICES``  what the core runs on them (backends made before the fork are abandoned with a
              message that says what to do; watchers and loop dispatchers start afresh);
``LIBRARIES`` the layers above (the kernels' compiler and cuBLAS locks, the executors' locks).

Within a stage, renewals run in the order they were registered.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable
from typing import Any

__all__ = ["CORE", "LIBRARIES", "SERVICES", "at_fork_child", "renew_at_fork", "renewals"]

CORE, SERVICES, LIBRARIES = 0, 1, 2

_renewals: list[tuple[int, int, str, Callable[[], None]]] = []


def at_fork_child(fn: Callable[[], None], stage: int, name: str | None = None) -> None:
    """Run ``fn()`` in the child after ``fork()``, in ``stage`` (``CORE``, ``SERVICES`` or
    ``LIBRARIES``). Call at import, once per module."""
    if stage not in (CORE, SERVICES, LIBRARIES):
        raise ValueError(f"stage must be CORE, SERVICES or LIBRARIES, got {stage!r}")
    label = name or f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    # in place, in one step (a fork on another thread never sees the list half sorted); the
    # registration number is unique, so the label and function are never compared
    bisect.insort(_renewals, (stage, len(_renewals), label, fn))


def renew_at_fork(namespace: dict[str, Any], stage: int = LIBRARIES, **factories: Callable[[], Any]) -> None:
    """After ``fork()``, in the child, rebind each ``namespace[name]`` to ``factory()``.

    Call at module level: ``renew_at_fork(globals(), _lock=threading.Lock)``.
    """

    def renew() -> None:
        for name, make in factories.items():
            namespace[name] = make()

    at_fork_child(renew, stage, f"{namespace.get('__name__', '?')}: {', '.join(factories)}")


def renewals() -> list[str]:
    """What a forked child renews, in the order it does (for tests and diagnostics)."""
    return [f"{('CORE', 'SERVICES', 'LIBRARIES')[s]}: {label}" for s, _, label, _ in _renewals]


def _in_child() -> None:
    # every renewal runs even if one fails (a lock left held would hang the child later); the
    # first failure is raised at the end, which the interpreter reports
    first: BaseException | None = None
    for _, _, _, fn in list(_renewals):
        try:
            fn()
        except BaseException as e:  # (reported below)
            if first is None:
                first = e
    if first is not None:
        raise first


os.register_at_fork(after_in_child=_in_child)
