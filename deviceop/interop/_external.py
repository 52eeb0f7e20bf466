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

from .._core._external import External, swap_inside
from .._core._ledger import enqueue
from .._core._regions import access_of, register
from .._core._tensor import Partition, Tensor

__all__ = ["External", "external"]


def external(fn: Callable[..., Any], *args: Any, reads: Any = (), writes: Any = ()) -> External[Any]:
    """An op that runs another library's GPU work: ``fn(stream, *args)`` on the op's stream.

    On cuda, ``fn`` enqueues work on ``stream`` through its own library
    (``torch.cuda.ExternalStream(stream.handle_int)``, ``cupy.cuda.ExternalStream``, Triton,
    any consumer of ``stream.__cuda_stream__()``) and returns; the op's output is what it
    returns. On the host backend ``fn`` runs in stream order on the stream's worker thread,
    with numpy arrays in place of deviceop tensors, and the enqueuing thread waits for it.

    ``reads`` and ``writes`` name the memory ``fn``'s work touches: deviceop Tensors and
    Partitions, or any array with ``__dlpack__`` or ``__cuda_array_interface__`` (a PyTorch or
    CuPy tensor; a numpy array on the host backend), wrapped without a copy and kept alive
    until the work has completed. The ledger orders the work like a kernel's: after
    conflicting work in flight on other streams, and later conflicting work after it. The same
    memory reached through two wrappers is one region. deviceop tensors among ``args`` that
    neither list names count as written. Arguments may be ops; they run first, in the same
    execution.

    ``fn`` runs while deviceop's ledger is held (so that no other thread's work slips between
    the ordering and the enqueue): it must only enqueue work and return, and must call no
    deviceop op, terminal or import (that raises :class:`~deviceop.UsageError`). Inside it,
    deviceop tensors export to other libraries (``torch.from_dlpack(t)``) without waiting.
    An exception from ``fn`` is raised by the terminal; work ``fn`` enqueued before raising
    completes first, and the device stays usable.

    In a graph recording (``do.graph``) ``fn`` is called with the capturing stream on cuda, so
    its library's work is recorded (the library must be able to record: PyTorch allocates
    nothing new during capture only with memory it has cached; prefer ``out=`` variants); on
    the host backend a replay calls ``fn`` again.
    """
    return External(fn, args, reads, writes, namer=access_of, host_call=call_in_order)


def call_in_order(op: External[Any], cx: Any, args: tuple[Any, ...], acc: list[Any]) -> Any:
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
