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
from typing import Any, Generic, TypeVar

from .._core._ledger import check_backend, enqueue, touch
from .._core._op import DeviceOp
from .._errors import UsageError
from ..device._select import current
from ..device._tensor import Partition, Tensor
from ._regions import access_of, inside, register

__all__ = ["External", "external"]

T = TypeVar("T")


def _named(items: Any, what: str) -> tuple[Any, ...]:
    if type(items) is tuple:
        return items
    if items is None:
        return ()
    if isinstance(items, (Tensor, Partition)) or not isinstance(items, (list, tuple)):
        raise UsageError(
            f"{what} must be a tuple or list of arrays (for one array: ({what[:-1]}_array,)), got {type(items).__name__}"
        )
    return tuple(items)


class External(DeviceOp[T], Generic[T]):
    """The op :func:`external` returns; its output is what ``fn`` returns."""

    __slots__ = ("_acc", "_args", "_fn", "_label", "_lazy", "_post")

    def __init__(
        self,
        fn: Callable[..., T],
        args: tuple[Any, ...],
        reads: Any,
        writes: Any,
        post: Callable[[Any, Any], tuple[Any, list[Any]]] | None = None,
        label: str | None = None,
    ) -> None:
        super().__init__()
        if not callable(fn):
            raise UsageError(f"do.external(fn, ...) needs a callable fn(stream, *args), got {type(fn).__name__}")
        self._fn = fn
        self._label = label
        # foreign arrays are wrapped now: bad input fails before any work, and the wrapper keeps
        # the array alive until the work that uses it has completed
        acc: list[Any] = []
        if reads is not None and not (type(reads) is tuple and not reads):  # (an array has no truth value)
            self._name(acc, reads, False)
        if writes is not None and not (type(writes) is tuple and not writes):
            self._name(acc, writes, True)
        lazy = False
        for i, a in enumerate(args):
            if isinstance(a, DeviceOp):
                a._take(f"argument {i} of {self!r}")
                lazy = True
        self._args = args
        self._acc = acc
        self._lazy = lazy
        self._post = post

    def _name(self, acc: list[Any], items: Any, write: bool) -> None:
        be = None
        for i, x in enumerate(_named(items, "writes" if write else "reads")):
            tp = type(x)
            if tp is Tensor:
                acc.append((x, write))
            elif tp is Partition:
                acc.append((x.tensor, write))
            elif isinstance(x, DeviceOp):
                raise UsageError(f"{self!r}: reads and writes name arrays, not ops; pass the op as an argument")
            else:
                if be is None:
                    be = current()
                acc.append(access_of(x, be, write, (self, write, i)))

    def __repr__(self) -> str:
        label = self._label
        if label is None:
            fn = self._fn
            label = f"external {getattr(fn, '__qualname__', type(fn).__name__)}()"
        return f"<{label}>"

    def _run(self, cx: Any) -> T:
        args = self._args
        if self._lazy:
            args = tuple(a._run(cx) if isinstance(a, DeviceOp) else a for a in args)
        be = cx.backend
        acc = self._acc
        if args:
            for a in args:  # deviceop tensors passed to fn and not named: fn may write them
                t = a.tensor if type(a) is Partition else a
                if type(t) is Tensor and not any(x[0] is t for x in acc):
                    acc.append((t, True))
        for a in acc:
            x = a[0]
            xb = x.buffer.backend if type(x) is Tensor else x.backend
            if xb is not be:
                check_backend(cx, xb, repr(self))
        if be.cuda_memory:
            return enqueue(cx, acc, lambda: self._call_now(cx, args), self)  # type: ignore[no-any-return]
        out: T = self._call_in_order(cx, args, acc)
        return out

    def _call_now(self, cx: Any, args: tuple[Any, ...]) -> Any:
        # under the ledger lock: fn's work is enqueued before any later registration on any
        # thread can look at this execution's accesses
        prev = inside.stream
        inside.stream = cx.stream
        try:
            out = self._fn(cx.stream, *args)
        finally:
            inside.stream = prev
        if self._post is not None:
            out, acc = self._post(cx, out)
            for buf, lo, hi, w in acc:  # what fn made: written by this execution
                touch(cx, buf, lo, hi, w, self)
        return out

    def _call_in_order(self, cx: Any, args: tuple[Any, ...], acc: list[Any]) -> Any:
        """Host backend: fn runs on the stream's worker in stream order, with numpy arrays for
        tensors; the enqueuing thread waits for it (the host device has nothing to hand over)."""
        from ..kernels._launch import host_array

        arrays = tuple(_host_value(a, host_array) for a in args)
        box: list[Any] = [None, None]
        done = threading.Event()
        stream = cx.stream
        fn = self._fn

        def item() -> None:
            prev = inside.stream
            inside.stream = stream
            try:
                box[0] = fn(stream, *arrays)
            except BaseException as e:  # fn's error is the terminal's, not a device fault
                box[1] = e
            finally:
                inside.stream = prev
                done.set()

        enqueue(cx, acc, lambda: stream.enqueue(item), self)
        if cx.capturing:
            return None  # recorded: a replay runs fn again; nothing ran now
        be = cx.backend
        while not done.wait(0.05):
            be.raise_if_error()  # work before it failed: the worker skips the rest
        if box[1] is not None:
            raise box[1]
        out = box[0]
        if self._post is not None:
            out, acc2 = self._post(cx, out)
            enqueue(cx, acc2, None, self)
        return out


def _host_value(a: Any, host_array: Callable[[Any], Any]) -> Any:
    t = a.tensor if type(a) is Partition else a
    if type(t) is Tensor:
        register(t.buffer)  # arrays fn keeps and names later are this buffer's region
        return host_array(t)
    return a


def external(fn: Callable[..., T], *args: Any, reads: Any = (), writes: Any = ()) -> DeviceOp[T]:
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
    return External(fn, args, reads, writes)
