"""GraphCache: one graph per size bucket for inputs whose leading dimension changes.

As serving engines do for batch sizes (the CUDA-graphs article's ``capture_num_tokens``): the
first input of a bucket records ``build(static_input)`` into a graph; every input is copied
into its bucket's static input, padded to the bucket size, and the graph replayed. Inputs
larger than the largest bucket run eagerly and are counted. ``copies=N`` keeps N recordings of
each bucket, used in turn, so that calls from concurrent requests on different streams do not
wait for each other on one recording's buffers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from .._core._guards import blocking_allowed
from .._core._ledger import check_backend, enqueue
from .._core._tensor import Tensor
from .._dtypes import DType, as_dtype
from .._errors import CaptureError, DTypeError, ShapeError, UsageError
from ..ops._base import DeviceOp
from ..ops._leaf import new_tensor
from ..ops._transfer import from_numpy, to_numpy
from ._graph import CudaGraph, scope

__all__ = ["GraphCache", "power_of_two_buckets"]


def power_of_two_buckets(max_size: int) -> list[int]:
    """1, 2, 4, ... up to ``max_size`` (which is included even if it is not a power of two)."""
    if type(max_size) is not int or max_size < 1:
        raise UsageError(f"max_size must be a positive int, got {max_size!r}")
    out = []
    b = 1
    while b < max_size:
        out.append(b)
        b *= 2
    out.append(max_size)
    return out


class _Entry:
    """One bucket's recording: its static input and output, and the lock that keeps each call's
    copy in, replay and copy out contiguous in issue order (calls share those buffers)."""

    __slots__ = ("graph", "inp", "lock", "out")

    def __init__(self, inp: Tensor, graph: CudaGraph[Any], out: Tensor) -> None:
        self.inp = inp
        self.graph = graph
        self.out = out
        self.lock = threading.RLock()


class GraphCache:
    """Replay recorded graphs for inputs of changing leading size (batch, tokens...).

    ``build(x)`` gets the bucket's static input (a contiguous tensor of ``bucket`` rows) and
    returns the op to record, whose output is a Tensor with ``bucket`` rows. It runs outside the
    recording, so it may allocate its outputs there (``y = do.empty(...).sync()``, allowed even
    on an event loop's thread: a bucket is built once, and its recording blocks the caller
    anyway); the op it returns must not allocate. ``cache(x)`` is an op: it copies ``x`` into the static input of
    the smallest bucket that holds it, fills the padding rows with zeros, replays, and yields the
    first ``len(x)`` rows of the output, copied to a new tensor (``copy_out=False``: a view of
    the bucket's static output, overwritten by the next call in that bucket).
    ``cache.run_numpy(array)`` does the same from a host array to a host array, uploading into
    the static input and downloading from the static output with no device copies.

    The calls of one recording are ordered by the ledger in issue order (they share its
    buffers), so concurrent calls on several streams would run one after another.
    ``copies=N`` records up to N copies of each bucket (the first N calls of a bucket each
    record one) and hands calls to them in turn: N calls of a bucket can run at once on N
    streams. Memory grows N-fold; 1 (the default) suits one stream or sequential calls.

    ``stats()`` reports hits, misses (recordings), eager runs and padding waste. Thread-safe:
    calls from several threads each get their own result.
    """

    def __init__(
        self,
        build: Callable[[Tensor], DeviceOp[Any]],
        buckets: Sequence[int] | None = None,
        max_size: int | None = None,
        copy_out: bool = True,
        copies: int = 1,
    ) -> None:
        if not callable(build):
            raise UsageError(f"GraphCache needs a callable build(x) -> DeviceOp, got {type(build).__name__}")
        if buckets is None:
            if max_size is None:
                raise UsageError("GraphCache needs buckets=[...] or max_size=N (buckets 1, 2, 4, ... N)")
            buckets = power_of_two_buckets(max_size)
        given = list(buckets) if isinstance(buckets, Iterable) and not isinstance(buckets, (str, bytes)) else None
        if given is None or any(type(b) is not int or b < 1 for b in given):
            raise UsageError(f"buckets must be a list of positive ints (batch sizes), got {buckets!r}")
        bs: list[int] = sorted(set(given))
        if not bs:
            raise UsageError("buckets must be a list of positive ints (batch sizes), got an empty one")
        if type(copies) is not int or not 1 <= copies <= 64:
            raise UsageError(f"copies must be an int from 1 to 64 (recordings per bucket), got {copies!r}")
        self.buckets = bs
        self.copies = copies
        self._build = build
        self._copy_out = bool(copy_out)
        # per bucket: its recordings (up to `copies`) and the count of calls, which picks the next
        self._entries: dict[tuple[Any, ...], list[_Entry]] = {}
        self._turns: dict[tuple[Any, ...], int] = {}
        self._lock = threading.Lock()
        self._stats = {"calls": 0, "hits": 0, "misses": 0, "eager": 0, "rows": 0, "padded_rows": 0}

    def __repr__(self) -> str:
        n = sum(len(v) for v in self._entries.values())
        return f"<GraphCache buckets={self.buckets} copies={self.copies} graphs={n}>"

    def bucket_for(self, n: int) -> int | None:
        """The bucket an input of ``n`` rows is padded to (None: larger than every bucket)."""
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def __call__(self, x: Tensor) -> DeviceOp[Tensor]:
        """An op yielding ``build``'s output for ``x`` (see the class docstring)."""
        if type(x) is not Tensor:
            raise UsageError(f"GraphCache takes a Tensor, got {type(x).__name__}")
        if not x.shape or x.shape[0] < 1:
            raise ShapeError(f"GraphCache needs a tensor with at least one row, got shape {x.shape}")
        if not x.is_contiguous():
            raise ShapeError("GraphCache copies its input with one memcpy: pass a contiguous tensor")
        return _CacheCall(self, x)

    def run_numpy(self, x: np.ndarray) -> DeviceOp[np.ndarray]:
        """An op from a host array to a host array: ``x`` (a numpy array of at least one row,
        read when the op runs) is uploaded straight into the static input of the smallest bucket
        that holds it (the padding rows zeros), the graph replayed, and the first ``len(x)`` rows
        of the static output downloaded into a new numpy array. It yields what
        ``do.to_numpy(do.from_numpy(x).then(cache))`` yields, without the device tensors of the
        input and output and the device copies between them and the recording: the way to
        serve requests that arrive and leave on the host. An input larger than every bucket
        runs ``build`` eagerly, as ``cache(x)`` does. Calls of one recording are ordered as
        ``cache(x)``'s: the next replay of a recording waits for the download of the last."""
        if not isinstance(x, np.ndarray):
            raise UsageError(
                f"GraphCache.run_numpy takes a numpy.ndarray, got {type(x).__name__}; make one first "
                "(numpy.asarray(x), or numpy.stack(rows) for a list of rows), or call the cache itself "
                "(cache(t)) with a deviceop Tensor"
            )
        if not x.shape or x.shape[0] < 1:
            raise ShapeError(f"GraphCache.run_numpy needs an array with at least one row, got shape {x.shape}")
        try:
            dtype = as_dtype(x.dtype, "GraphCache.run_numpy input dtype")
        except DTypeError:
            raise DTypeError(
                f"GraphCache.run_numpy got an array of {x.dtype}, which deviceop has no dtype for; "
                "convert it first: x.astype(numpy.float32) (or float16, int32, int64, uint8; "
                "ml_dtypes.bfloat16 for bfloat16), the dtype the cache's build expects"
            ) from None
        return _NumpyCall(self, x, dtype)

    def stats(self) -> dict[str, float]:
        """Counters: calls, hits, misses (recordings), eager (too large), rows, padded_rows,
        hit_rate (hits / calls) and padding_waste (padded rows / rows replayed)."""
        s: dict[str, float] = dict(self._stats)
        s["hit_rate"] = s["hits"] / s["calls"] if s["calls"] else 0.0
        replayed = s["rows"] + s["padded_rows"]
        s["padding_waste"] = s["padded_rows"] / replayed if replayed else 0.0
        return s

    def clear(self) -> None:
        """Drop every recorded graph (their memory goes when no work uses it) and the counters."""
        with self._lock:
            self._entries.clear()
            self._turns.clear()
            for k in self._stats:
                self._stats[k] = 0

    # -- at run time ---------------------------------------------------------------------------
    def _record(self, cx: Any, b: int, tail: tuple[int, ...], dtype: DType) -> _Entry:
        inp = new_tensor(cx, (b, *tail), dtype, "GraphCache static input")
        cx.backend.memset(inp.buffer, 0, inp.nbytes, b"\0", cx.stream)  # (new: no other thread sees it)
        with blocking_allowed():  # (once per bucket: build may allocate its outputs with sync())
            op = self._build(inp)
        if not isinstance(op, DeviceOp):
            raise UsageError(f"GraphCache build(x) must return a DeviceOp, got {type(op).__name__}")
        with scope() as s:
            out = s.record(op)
        if type(out) is not Tensor or not out.shape or out.shape[0] != b or not out.is_contiguous():
            raise UsageError(
                f"GraphCache build(x) must return an op whose output is a contiguous Tensor with {b} "
                f"rows (the bucket), got {out!r}; add .map(lambda out: the_tensor) to select it"
            )
        return _Entry(inp, s.graph, out)

    def _eager(self, cx: Any, x: Tensor) -> Tensor:
        """``build(x)`` run as it is, for an input larger than every bucket."""
        with self._lock:
            self._stats["calls"] += 1
            self._stats["eager"] += 1
        with blocking_allowed():
            op = self._build(x)
        if not isinstance(op, DeviceOp):
            raise UsageError(f"GraphCache build(x) must return a DeviceOp, got {type(op).__name__}")
        out = op._run(cx)
        if type(out) is not Tensor:
            raise UsageError(f"GraphCache build(x) must return an op whose output is a Tensor, got {out!r}")
        return out

    def _entry(self, cx: Any, b: int, n: int, tail: tuple[int, ...], dtype: DType) -> _Entry:
        """The recording of bucket ``b`` whose turn it is (recorded first if the bucket has
        fewer than ``copies``), the call of ``n`` rows counted."""
        key = (b, tail, dtype.name, cx.backend)
        with self._lock:
            lst = self._entries.setdefault(key, [])
            turn = self._turns.get(key, 0)
            self._turns[key] = turn + 1
            e = lst[turn % self.copies] if len(lst) == self.copies else None
        hit = e is not None
        if e is None:
            e = self._record(cx, b, tail, dtype)  # (outside the lock: recording runs build and waits)
            with self._lock:
                if len(lst) < self.copies:
                    lst.append(e)
                # else: other threads filled the copies meanwhile; this recording serves this call
        st = self._stats
        with self._lock:
            st["calls"] += 1
            st["hits" if hit else "misses"] += 1
            st["rows"] += n
            st["padded_rows"] += b - n
        return e

    def _run(self, cx: Any, x: Tensor) -> Tensor:
        if cx.capturing:
            raise CaptureError(
                "a GraphCache call inside a graph recording: graphs do not nest; call it outside the scope"
            )
        check_backend(cx, x.buffer.backend, "GraphCache call")
        n = x.shape[0]
        b = self.bucket_for(n)
        if b is None:
            return self._eager(cx, x)
        e = self._entry(cx, b, n, x.shape[1:], x.dtype)
        inp = e.inp
        row = inp.nbytes // b
        be = cx.backend

        def copy_in() -> None:
            be.dtod(inp.buffer, 0, x.buffer, x._span[0], n * row, cx.stream)
            _pad(be, inp, n, b, cx.stream)

        def copy_out(res: Tensor, out: Tensor) -> None:
            be.dtod(res.buffer, 0, out.buffer, out._span[0], res.nbytes, cx.stream)

        # copy in, replay and copy out are enqueued as one: another call of this bucket (another
        # thread) cannot slip between them, so the ledger orders whole calls, in issue order
        with e.lock:
            enqueue(
                cx, ((x.buffer, *x._span, False), (inp.buffer, 0, inp.nbytes, True)), copy_in, "GraphCache input copy"
            )
            out = e.graph.launch()._run(cx)[:n]
            if not self._copy_out:
                return out  # type: ignore[no-any-return]
            # the copy reads the graph's output: registered with the new tensor's write, in one enqueue
            res = new_tensor(cx, out.shape, out.dtype, "GraphCache output copy")
            enqueue(
                cx,
                ((out.buffer, *out._span, False), (res.buffer, 0, res.nbytes, True)),
                lambda: copy_out(res, out),
                "GraphCache output copy",
            )
        return res

    def _run_numpy(self, cx: Any, x: np.ndarray, dtype: DType) -> np.ndarray:
        if cx.capturing:
            raise CaptureError(
                "GraphCache.run_numpy inside a graph recording: graphs do not nest, and its download "
                "completes on the host; call it outside the scope"
            )
        n = x.shape[0]
        b = self.bucket_for(n)
        if b is None:
            return to_numpy(self._eager(cx, from_numpy(x)._run(cx)))._run(cx)
        e = self._entry(cx, b, n, x.shape[1:], dtype)
        inp = e.inp
        be = cx.backend

        def upload() -> None:
            be.htod(inp.buffer, 0, x, cx.stream, cx)  # (a snapshot of x, taken now)
            _pad(be, inp, n, b, cx.stream)

        # upload, replay and download are enqueued as one, as cache(x)'s copies: the download
        # reads the static output, so the next replay of this recording is ordered after it
        with e.lock:
            enqueue(cx, ((inp.buffer, 0, inp.nbytes, True),), upload, "GraphCache input upload")
            out = e.graph.launch()._run(cx)
            return to_numpy(out[:n] if n < b else out)._run(cx)


def _pad(be: Any, inp: Tensor, n: int, b: int, stream: Any) -> None:
    """Zero the padding rows ``n`` to ``b`` of bucket ``b``'s static input ``inp``."""
    if n < b:
        row = inp.nbytes // b
        be.memset(inp.buffer, n * row, (b - n) * row, b"\0", stream)


class _NumpyCall(DeviceOp[np.ndarray]):
    __slots__ = ("_c", "_dtype", "_x")

    def __init__(self, c: GraphCache, x: np.ndarray, dtype: DType) -> None:
        super().__init__()
        self._c = c
        self._x = x
        self._dtype = dtype

    def __repr__(self) -> str:
        return f"<GraphCache.run_numpy, {self._x.shape[0]} rows>"

    def _run(self, cx: Any) -> np.ndarray:
        return self._c._run_numpy(cx, self._x, self._dtype)


class _CacheCall(DeviceOp[Tensor]):
    __slots__ = ("_c", "_x")

    def __init__(self, c: GraphCache, x: Tensor) -> None:
        super().__init__()
        self._c = c
        self._x = x

    def __repr__(self) -> str:
        return f"<GraphCache call, {self._x.shape[0]} rows>"

    def _run(self, cx: Any) -> Tensor:
        return self._c._run(cx, self._x)
