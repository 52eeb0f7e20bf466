"""then / map / inspect: a chain of steps after a source op, run in order on one stream.

A chain keeps its steps in a list and runs them in a loop, so a chain of thousands of ``then``
calls needs no recursion; extending a chain consumes it and takes over its list (O(1)).
"""

from __future__ import annotations

from typing import Any, Callable

from .._errors import UsageError
from ..device import _fast
from ..device._ledger import ENABLED as _LEDGER_ON
from ..ops._base import DeviceOp

# the step loop in C where the native module is built (the Python loop below is its twin)
_STEPS = _fast.steps()

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
        out = self._src._run(cx)
        steps = self._steps
        if _STEPS is not None:
            i, v = _STEPS(cx, out, steps, DeviceOp, _fast.PLANNED[0], _fast.RUN_PLANNED[0] is not None and _LEDGER_ON[0])
            if i == len(steps):
                return v
            _not_an_op(steps[i][1], v)
        for kind, f in steps:
            if kind == "then":
                nxt = f(out)
                if not isinstance(nxt, DeviceOp):
                    _not_an_op(f, nxt)
                if nxt._used is None:
                    nxt._used = ".then()"
                else:
                    nxt._take(".then()")  # raises: already consumed
                out = nxt._run(cx)
            elif kind == "map":
                out = f(out)
            else:
                f(out)
        return out


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
