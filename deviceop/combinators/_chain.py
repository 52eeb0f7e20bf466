"""then / map / inspect: a chain of steps after a source op, run in order on one stream.

A chain keeps its steps in a list and runs them in a loop, so a chain of thousands of ``then``
calls needs no recursion; extending a chain consumes it and takes over its list (O(1)).
"""

from __future__ import annotations

from typing import Any, Callable

from .._core._launch import run_steps
from .._errors import UsageError
from ..ops._base import DeviceOp

__all__ = ["Chain", "chain"]


class Chain(DeviceOp[Any]):
    __slots__ = ("_src", "_steps")

    def __init__(self, src: DeviceOp[Any], steps: list[tuple[str, Callable[[Any], Any]]]) -> None:
        self._used = None
        self._src = src
        self._steps = steps

    def __repr__(self) -> str:
        return f"<Chain {self._src!r} + {len(self._steps)} steps>"

    def then(self, f: Callable[[Any], Any]) -> "Chain":
        """As :meth:`DeviceOp.then`; a chain extends its own step list (the common, long case)."""
        if self._used is not None or not callable(f):
            return chain(self, "then", f)  # raises the usage error
        self._used = ".then()"
        steps = self._steps
        steps.append(("then", f))
        return Chain(self._src, steps)

    def _run(self, cx: Any) -> Any:
        steps = self._steps
        i, v = run_steps(cx, self._src._run(cx), steps, DeviceOp)
        if i != len(steps):
            _not_an_op(steps[i][1], v)
        return v


def _not_an_op(f: Any, v: Any) -> None:
    raise UsageError(
        f"the function given to .then() ({getattr(f, '__qualname__', f)!r}) returned "
        f"{type(v).__name__}, not a DeviceOp; return an op (do.value(x) for a plain "
        "value) or use .map() for a host-side transform"
    )


def chain(op: DeviceOp[Any], kind: str, f: Callable[[Any], Any]) -> Chain:
    """Append a step to ``op`` (consuming it)."""
    if not callable(f):
        raise UsageError(f".{kind}() needs a function, got {type(f).__name__}")
    if op._used is None:
        op._used = f".{kind}()"
    else:
        op._take(f".{kind}()")  # raises: already consumed
    if type(op) is Chain:
        op._steps.append((kind, f))
        return Chain(op._src, op._steps)
    return Chain(op, [(kind, f)])
