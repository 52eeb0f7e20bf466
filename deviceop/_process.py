"""Process-wide state across ``fork()``: module-level locks renewed in the child.

A child made by ``fork()`` has only the forking thread; a lock another thread held at that
moment would stay held forever. Modules keep their process-wide locks renewable here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

__all__ = ["renew_at_fork"]


def renew_at_fork(namespace: dict[str, Any], **factories: Callable[[], Any]) -> None:
    """After ``fork()``, in the child, rebind each ``namespace[name]`` to ``factory()``.

    Call at module level: ``renew_at_fork(globals(), _lock=threading.Lock)``.
    """

    def renew() -> None:
        for name, make in factories.items():
            namespace[name] = make()

    os.register_at_fork(after_in_child=renew)
