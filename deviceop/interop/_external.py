"""Another library's GPU work as an op: ``external(fn, *args, reads=..., writes=...)``.

When the op runs, ``fn(stream, *args)`` enqueues work on the op's stream through its own
library (PyTorch, CuPy, Triton, nvmath, any consumer of ``__cuda_stream__``) and returns. The
ledger orders it like a kernel: ``reads`` and ``writes`` name the memory it touches (deviceop
tensors and partitions, or any DLPack / ``__cuda_array_interface__`` array, wrapped without a
copy), and work on other streams is ordered against it in both directions.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .._core._external import HOOKS, External, external, swap_inside
from .._core._ledger import enqueue
from ..device._tensor import Partition, Tensor
from ._regions import access_of, register

__all__ = ["External", "external"]


def _call_in_order(op: External[Any], cx: Any, args: tuple[Any, ...], acc: list[Any]) -> Any:
    """Host backend: fn runs on the stream's worker in stream order, with numpy arrays for
    tensors; the enqueuing thread waits for it (the host device has nothing to hand over)."""
    from ..kernels._launch import host_array

    arrays = tuple(_host_value(a, host_array) for a in args)
    box: list[Any] = [None, None]
    done = threading.Event()
    stream = cx.stream
    fn = op.fn

    def item() -> None:
        prev = swap_inside(stream)
        try:
            box[0] = fn(stream, *arrays)
        except BaseException as e:  # fn's error is the terminal's, not a device fault
            box[1] = e
        finally:
            swap_inside(prev)
            done.set()

    enqueue(cx, acc, lambda: stream.enqueue(item), op)
    if cx.capturing:
        return None  # recorded: a replay runs fn again; nothing ran now
    be = cx.backend
    while not done.wait(0.05):
        be.raise_if_error()  # work before it failed: the worker skips the rest
    if box[1] is not None:
        raise box[1]
    out = box[0]
    if op.post is not None:
        out, acc2 = op.post(cx, out, args)
        enqueue(cx, acc2, None, op)
    return out


def _host_value(a: Any, host_array: Callable[[Any], Any]) -> Any:
    t = a.tensor if type(a) is Partition else a
    if type(t) is Tensor:
        register(t.buffer)  # arrays fn keeps and names later are this buffer's region
        return host_array(t)
    return a


HOOKS["access_of"] = access_of
HOOKS["call_in_order"] = _call_in_order
