"""then / map / inspect: a chain of steps after a source op, run in order on one stream.

A chain keeps its steps in a list and runs them in a loop, so a chain of thousands of ``then``
calls needs no recursion; extending a chain consumes it and takes over its list (O(1)).
"""

from __future__ import annotations

from typing import Any, Callable

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

    def _run(self, cx: Any) -> Any:
        out = self._src._run(cx)
        for kind, f in self._steps:
            if kind == "then":
                nxt = f(out)
                if not isinstance(nxt, DeviceOp):
                    raise UsageError(
                        f"the function given to .then() ({getattr(f, '__qualname__', f)!r}) returned "
                        f"{type(nxt).__name__}, not a DeviceOp; return an op (do.value(x) for a plain "
                        "value) or use .map() for a host-side transform"
                    )
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
