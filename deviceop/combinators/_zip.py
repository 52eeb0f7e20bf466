"""zip: independent ops whose outputs are combined into a tuple.

The first branch runs on the execution's own stream; each further branch that does GPU work is
forked onto another pool stream (its stream waits on an event recorded at the fork) and joined
back (the execution's stream waits on the branch's end event). Branches are enqueued in order
and the access ledger orders any that do touch the same memory, so the result equals a
sequential run.
"""

from __future__ import annotations

from typing import Any, TypeVar, overload

from .._core._op import Shared, Value
from .._errors import UsageError
from ..ops._base import DeviceOp

__all__ = ["Zip", "zip_ops"]


A = TypeVar("A")
B = TypeVar("B")
C = TypeVar("C")
D = TypeVar("D")


class Zip(DeviceOp[tuple[Any, ...]]):
    """The tuple of its ops' outputs; branches may run concurrently on several pool streams."""

    __slots__ = ("_ops",)

    def __init__(self, ops: tuple[DeviceOp[Any], ...]) -> None:
        super().__init__()
        self._ops = ops

    def __repr__(self) -> str:
        return f"<Zip of {len(self._ops)}>"

    def _run(self, cx: Any) -> tuple[Any, ...]:
        ops = self._ops
        streams = [s for s in cx.backend.streams if s is not cx.stream]
        forkable = [i for i, op in enumerate(ops) if i and type(op) is not Value]
        if not streams or not forkable or cx.capturing:
            return tuple(op._run(cx) for op in ops)
        fork = cx.backend.new_event()
        cx.stream.record(fork)
        outs: list[Any] = []
        children: list[Any] = []
        try:
            for i, op in enumerate(ops):
                if i not in forkable:
                    outs.append(op._run(cx))
                    continue
                child = cx.fork(streams[(len(children)) % len(streams)], fork)
                children.append(child)
                outs.append(op._run(child))
        finally:
            for child in children:  # join even on failure, so the caller's sync covers all work
                cx.join(child)
        return tuple(outs)


@overload
def zip_ops(a: DeviceOp[A], /) -> DeviceOp[tuple[A]]: ...
@overload
def zip_ops(a: DeviceOp[A], b: DeviceOp[B], /) -> DeviceOp[tuple[A, B]]: ...
@overload
def zip_ops(a: DeviceOp[A], b: DeviceOp[B], c: DeviceOp[C], /) -> DeviceOp[tuple[A, B, C]]: ...
@overload
def zip_ops(a: DeviceOp[A], b: DeviceOp[B], c: DeviceOp[C], d: DeviceOp[D], /) -> DeviceOp[tuple[A, B, C, D]]: ...
@overload
def zip_ops(*ops: DeviceOp[Any]) -> DeviceOp[tuple[Any, ...]]: ...
def zip_ops(*ops: DeviceOp[Any]) -> DeviceOp[tuple[Any, ...]]:
    """``do.zip(a, b, ...)``: a ``DeviceOp[tuple]`` of independent ops' outputs."""
    if not ops:
        raise UsageError("do.zip() needs at least one op")
    for i, op in enumerate(ops):
        if not isinstance(op, DeviceOp):
            raise UsageError(
                f"do.zip() argument {i} is {type(op).__name__}, not a DeviceOp; wrap plain values in do.value(x)"
            )
    once = [op for op in ops if not isinstance(op, Shared)]  # a shared op may appear any number of times
    if len({id(op) for op in once}) != len(once):
        raise UsageError("do.zip() got the same op twice; use op.shared() to consume one result twice")
    for op in ops:
        op._take("do.zip()")
    return Zip(ops)
