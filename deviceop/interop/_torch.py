"""PyTorch code as an op: the stream, the tensor conversions and the outputs done for the user.

PyTorch is imported when an adapter op first runs, never by ``import deviceop``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from .._core._base import foreign_of, set_foreign, tensor_at
from .._core._capture import CAPTURE
from .._core._dlpack import capsule
from .._core._external import External, layout, named, same_layout
from .._core._regions import _is_torch, access_of, buffer_for, register, span
from .._core._tensor import Partition, Tensor
from .._dtypes import as_dtype
from .._errors import CaptureError, DTypeError, UsageError
from ..graph._cache import GraphCache
from ..ops._leaf import empty, zeros
from ._external import call_in_order

__all__ = ["torch", "torch_graphs"]

# per CUstream handle: its torch.cuda.ExternalStream, stream_id, device_index, device_type
_streams: dict[int, tuple[Any, int, int, int]] = {}
_DTYPES: dict[Any, Any] = {}  # deviceop dtype per torch.dtype
_DL_DTYPES: dict[int, Any] = {}  # deviceop dtype per DLPack dtype key (see layout)
_KDLCUDA = 2  # DLPack's device type of CUDA memory
_pools: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # graph scope -> torch.cuda.MemPool
_stream_fns: list[Any] = []  # torch._C's current-stream getter and setter, and device getter (or None)
_TH: list[Any] = []  # the torch module, once imported


def _torch() -> Any:
    """PyTorch, imported on first use (then kept: an import statement costs a lookup each call)."""
    if _TH:
        return _TH[0]
    try:
        import torch as th
    except ImportError:
        raise UsageError("do.interop.torch needs PyTorch; install it (pip install torch)") from None
    _TH.append(th)
    return th


def torch(fn: Callable[..., Any], *args: Any, reads: Any = (), writes: Any = ()) -> External[Any]:
    """An op that calls PyTorch code ``fn(*args)`` (a function or an ``nn.Module``) on the op's
    stream, with deviceop tensors among ``args`` given to it as PyTorch tensors (no copy).

    On cuda, PyTorch's current stream is the op's stream while ``fn`` runs
    (``torch.cuda.ExternalStream``), so the memory PyTorch allocates there is its caching
    allocator's for that stream; the caller's current stream is restored after it (a caller
    that made the op's stream current already saves the switch: it is left current). A
    deviceop tensor reaches ``fn`` as an alias (its own metadata, no autograd history) of a
    PyTorch tensor made when that tensor first reached PyTorch code. Where PyTorch publishes
    the DLPack C exchange API (recent versions), the alias is one object, given to every call
    and to every argument naming that tensor, while its address, dtype, shape, strides and
    ``requires_grad`` are as made; a call that changed them in place (``t_()``,
    ``unsqueeze_()``, ``requires_grad_()``) leaves the next call a new alias, as made. So a change of metadata made through one argument shows through another
    naming the same tensor in that call, and an alias kept from one call (in a module's state)
    is the object later calls get: keep ``t.detach()`` instead. Elsewhere (older PyTorch, a
    tensor without elements) each call gets an alias of its own. On the host backend ``fn``
    gets CPU tensors sharing the host device's memory. The op's output is ``fn``'s, with every
    PyTorch tensor in it (itself, or the items of a tuple or list) turned into a deviceop
    Tensor on the same memory, written by this op and kept alive by it; a PyTorch tensor that
    is one of the deviceop tensors in ``args`` given back (``out=``, in place: the same memory,
    shape, strides and dtype) is that Tensor itself. deviceop tensors in ``args`` are read
    unless ``writes`` names them; ``reads``/``writes`` name more memory, as for
    :func:`~deviceop.interop.external`, whose rules hold here too (``fn`` only enqueues work;
    it calls no deviceop op).
    """
    if not callable(fn):
        raise UsageError(f"do.interop.torch(fn, ...) needs a callable or an nn.Module, got {type(fn).__name__}")
    writes = named(writes, "writes")
    reads = named(reads, "reads")
    written = [x.tensor if type(x) is Partition else x for x in writes]
    extra_r: list[Any] = []
    given: list[int] = []  # the positions of deviceop tensors written: fn may give them back
    for i, a in enumerate(args):
        ta = type(a)
        if ta is Tensor or ta is Partition:
            x = a.tensor if ta is Partition else a
            if any(x is w for w in written):
                given.append(i)
            else:
                extra_r.append(a)
    if extra_r:
        reads = reads + tuple(extra_r)

    def call(stream: Any, *a: Any) -> Any:
        th = _torch()
        if stream.backend.cuda_memory:
            st = _streams.get(stream.handle_int)
            if st is None:
                ts = th.cuda.ExternalStream(stream.handle_int)
                st = _streams[stream.handle_int] = (ts, ts.stream_id, ts.device_index, ts.device_type)
            prev = _enter(th, st)
            try:
                conv = [
                    _view(th, x.tensor if type(x) is Partition else x) if type(x) in (Tensor, Partition) else x
                    for x in a
                ]
                scope = CAPTURE.scope
                if scope is None:
                    out = fn(*conv)
                else:
                    # recording: what PyTorch allocates now is used by every replay, so it comes
                    # from a pool of its own that the graph keeps (PyTorch's caching allocator
                    # would hand it to other work once fn's tensors are dropped)
                    with th.cuda.use_mem_pool(_pool_for(th, scope)):
                        out = fn(*conv)
            finally:
                _leave(prev, st)
            for i in given:  # a written tensor given back as it was (out=, in place): itself
                if out is conv[i]:
                    x = a[i]
                    x = x.tensor if type(x) is Partition else x
                    if same_layout(out, x):
                        return x
            return out
        conv = [
            _from_numpy(th, x) if type(x).__module__ == "numpy" and hasattr(x, "__array_interface__") else x for x in a
        ]
        return fn(*conv)

    return External(
        call, args, reads, writes, post=_outputs, label=_Label(fn), namer=access_of, host_call=call_in_order
    )


class _Label:
    """An adapter op's label, made into text only when shown (a repr, an error message)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __str__(self) -> str:
        fn = self.fn
        return f"do.interop.torch({getattr(fn, '__qualname__', type(fn).__name__)})"

    __repr__ = __str__


def torch_graphs(
    fn: Callable[[Any], Any], buckets: Any = None, max_size: int | None = None, copies: int = 1
) -> GraphCache:
    """PyTorch code ``fn(x)`` (a function or an ``nn.Module`` of one tensor returning one
    tensor) recorded into CUDA graphs, one per size bucket of ``x``'s leading dimension, as
    ``torch.compile(mode="reduce-overhead")`` and serving engines' per-batch-size graphs do, but
    as an op: ``graphs(x)`` is an op yielding ``fn(x)`` for a deviceop Tensor ``x``, awaitable and
    ordered by the ledger like any other.

    The first input of a bucket warms ``fn`` up (one eager call on a zero input of the bucket's
    shape, outside any recording: PyTorch's first calls make plans that cannot be recorded; it
    also gives the output's shape and dtype), allocates the static input and output, and records
    ``fn`` between them. Every call copies ``x`` into its bucket's static input (the padding rows
    zeros), replays, and yields the first ``len(x)`` rows of the output. ``buckets``,
    ``max_size`` and ``copies`` (recordings per bucket, used in turn, so that concurrent calls
    on several streams do not wait on one recording's buffers) are
    :class:`~deviceop.graph.GraphCache`'s, which this returns (``stats()`` counts recordings,
    replays and padding). An input larger than every bucket runs ``fn`` eagerly.

    ``fn`` must suit a CUDA graph (PyTorch's rules): no host synchronization or copy to the
    host, no control flow that depends on values, the same shapes at every replay; rows of the
    output must depend only on the same rows of the input if padding is not to change them
    (true of a batch dimension). What PyTorch allocates while recording comes from a memory
    pool the graph keeps (see :func:`torch`). On the host backend a replay calls ``fn`` again.
    """
    if not callable(fn):
        raise UsageError(f"do.interop.torch_graphs(fn, ...) needs a callable or an nn.Module, got {type(fn).__name__}")
    label = getattr(fn, "__qualname__", type(fn).__name__)

    def build(x: Tensor) -> Any:
        if x.shape[0] > cache.buckets[-1]:
            return torch(fn, x)  # (larger than every bucket: GraphCache runs it eagerly)
        # the warm-up, on an input of its own: the static input's zeros are written on the
        # calling execution's stream, which this synchronous op is not ordered after
        probe = torch(fn, zeros(x.shape, x.dtype)).sync()
        if type(probe) is not Tensor:
            raise UsageError(
                f"do.interop.torch_graphs records code that returns one tensor; {label} returned "
                f"{type(probe).__name__}: wrap it (lambda x: f(x)[0]) to select the tensor"
            )
        y = empty(probe.shape, probe.dtype).sync()
        return torch(lambda a, b: b.copy_(fn(a)), x, y, writes=(y,)).map(lambda _: y)

    cache = GraphCache(build, buckets=buckets, max_size=max_size, copies=copies)
    return cache


def _pool_for(th: Any, scope: Any) -> Any:
    """The PyTorch memory pool of the graph scope recording on this thread (made, and kept by
    the scope's graph, on first use)."""
    pool = _pools.get(scope)
    if pool is None:
        if getattr(th.cuda, "MemPool", None) is None or getattr(th.cuda, "use_mem_pool", None) is None:
            raise CaptureError(
                f"recording PyTorch code in a graph needs torch.cuda.MemPool (PyTorch 2.6 or later); this is "
                f"PyTorch {th.__version__}. Run the PyTorch step outside the recording, or upgrade PyTorch"
            )
        pool = _pools[scope] = th.cuda.MemPool()
        scope.keep(pool)
        # PyTorch keeps one cuBLAS workspace per (handle, stream), and recordings share their
        # stream: dropped now, the workspace this recording uses is allocated again, from its
        # own pool, so two recordings replayed at once on two streams never share one
        clear = getattr(th._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
    return pool


def _view(th: Any, t: Tensor) -> Any:
    """The PyTorch tensor a call gets for deviceop tensor ``t`` (cuda; called inside the op's ``fn``).

    A PyTorch tensor on ``t``'s memory is made once per deviceop Tensor (a DLPack capsule, no
    copy; for one an adapter op returned, the PyTorch tensor it came from, aliased: see _wrap)
    and kept on ``t`` (``foreign_of(t)``: it lives and goes with ``t``), never given to code;
    calls get an alias of it (``detach()``), the same one while its metadata is as made (a C call
    compares its address, dtype, shape and strides with ``t``'s, cheaper than an alias per
    call), a new one after code changed it in place (``t_()``, ``unsqueeze_()``,
    ``requires_grad_()``). The capsule keeps ``t``'s buffer alive, not ``t``. Both are made
    outside inference mode (left for the moment where it is on), so that code run later with
    autograd on may use them. The ledger has ordered the op's stream already: nothing is waited
    for here.
    """
    e = foreign_of(t)
    if e is not None:  # [the PyTorch tensor on t's memory, the alias calls get or None]
        v = e[1]
        if v is not None and not v.requires_grad and same_layout(v, t):
            return v
        # (none yet, where _wrap made the entry; or code changed the one given before)
        v = e[1] = _alias(th, e[0])
        return v
    buf = t.buffer
    register(buf)  # its memory given back by PyTorch (a view of it returned) is this region
    dev_type, dev_id = buf.backend.dlpack_device
    dt = t.dtype
    cap = capsule(buf, t.ptr, t.shape, t.strides, dt.dl_code, dt.itemsize * 8, dev_type, dev_id)
    if th.is_inference_mode_enabled():
        with th.inference_mode(False):
            v0 = th.from_dlpack(cap)
            v = v0.detach()
    else:
        v0 = th.from_dlpack(cap)
        v = v0.detach()
    set_foreign(t, [v0, v])
    return v


def _alias(th: Any, v0: Any) -> Any:
    """A new alias of PyTorch tensor ``v0`` (``detach()``), made outside inference mode."""
    if th.is_inference_mode_enabled():
        with th.inference_mode(False):
            return v0.detach()
    return v0.detach()


def _enter(th: Any, st: tuple[Any, int, int, int]) -> Any:
    """Make the stream of ``st`` (its ExternalStream, stream_id, device_index, device_type)
    PyTorch's current stream; return what :func:`_leave` restores.

    ``with torch.cuda.stream(ts)`` makes Stream objects and compares devices in Python (tens of
    microseconds a call, more than a small op's launch); where the stream is on the current
    device this sets and restores it with PyTorch's own setter and getter, as that context
    manager does, and leaves it as it is where it is current already (code that set it once
    around its calls). Elsewhere (another device, a PyTorch without them) it is the context
    manager.
    """
    fns = _stream_fns
    if not fns:  # looked up once: PyTorch's own stream getter and setter, and its device getter
        c = th._C
        fns.extend(getattr(c, n, None) for n in ("_cuda_getCurrentStream", "_cuda_setStream", "_cuda_getDevice"))
    get, set_, dev = fns
    ts, sid, di, dt = st
    if get is not None and set_ is not None and dev is not None and dev() == di:
        prev = get(di)  # (stream_id, device_index, device_type)
        if prev[0] != sid:
            set_(sid, di, dt)  # (positional: PyTorch parses keywords for longer than the call takes)
        return prev
    ctx = th.cuda.stream(ts)
    ctx.__enter__()
    return ctx


def _leave(prev: Any, st: tuple[Any, int, int, int]) -> None:
    """Restore what :func:`_enter` returned: PyTorch's current stream as it was before the call."""
    if type(prev) is tuple:
        # where it was current already, only if fn changed it (the setter also selects the
        # stream's device, which fn may have changed too): two getters instead of the setter
        get, set_, dev = _stream_fns
        if prev[0] != st[1] or get(prev[1])[0] != prev[0] or dev() != prev[1]:
            set_(prev[0], prev[1], prev[2])
    else:
        prev.__exit__(None, None, None)


def _from_numpy(th: Any, arr: Any) -> Any:
    try:
        return th.from_numpy(arr)
    except TypeError as e:
        raise DTypeError(f"PyTorch cannot share a numpy array of dtype {arr.dtype} ({e}); use another dtype") from None


def _outputs(cx: Any, out: Any, args: tuple[Any, ...]) -> tuple[Any, list[Any]]:
    """fn's output with PyTorch tensors as deviceop Tensors, and their write accesses. A PyTorch
    tensor that is one of the op's deviceop tensors (the same memory, shape, strides and dtype:
    an ``out=`` or in-place result) comes back as that tensor itself."""
    acc: list[Any] = []
    if _is_torch(type(out)):
        return _wrap(cx, out, acc, args), acc
    if isinstance(out, (tuple, list)):
        conv = [_wrap(cx, x, acc, args) if _is_torch(type(x)) else x for x in out]
        return (tuple(conv) if isinstance(out, tuple) else conv), acc
    return out, acc


def _wrap(cx: Any, t: Any, acc: list[Any], args: tuple[Any, ...]) -> Tensor:
    be = cx.backend
    try:
        d = layout(t)  # one C call (PyTorch's DLPack exchange API), where its type has one
    except Exception:  # a tensor DLPack refuses (a conjugate view): read through its getters
        d = None
    if d is None:
        it = t.element_size()
        ptr = int(t.data_ptr())
        shape = tuple(t.shape)
        strides = tuple(t.stride())
        lo, hi = span(ptr, shape, tuple(s * it for s in strides), it)
        on_cuda = t.is_cuda
        key = -1
    else:
        ptr, shape, strides, key, dev, lo, hi = d
        on_cuda = dev == _KDLCUDA
    if on_cuda != bool(be.cuda_memory):
        raise UsageError(
            f"the PyTorch code returned a tensor on {t.device}, but this op runs on the {be.name} backend; "
            "return tensors on the op's device"
        )
    dt = _DL_DTYPES.get(key)
    if dt is None:
        dt = _dtype_of(t)
        if key >= 0:
            _DL_DTYPES[key] = dt
    for a in args:  # an input given back (out=, in place): no second wrapper of its memory
        x = a.tensor if type(a) is Partition else a
        if type(x) is Tensor and x.addr == ptr and x.dtype is dt and x.shape == shape and x.strides == strides:
            xlo, xhi = x.span
            acc.append((x.buffer, xlo, xhi, True))
            return x
    buf = buffer_for(be, lo, hi, t, lambda: _storage(t))
    out = tensor_at(Tensor, buf, shape, dt, strides, ptr - buf.ptr)
    acc.append((buf, lo - buf.ptr, hi - buf.ptr, True))
    if be.cuda_memory and not t.is_inference():
        # the PyTorch tensor a later step gets for ``out`` (see _view): an alias of ``t`` (the
        # same memory, shape, strides and dtype), not a DLPack import of ``out`` (tens of µs
        # more at every step boundary of a model split into steps). An inference tensor is left
        # to the import, which makes a normal one
        set_foreign(out, [t.detach(), None])
    return out


def _dtype_of(t: Any) -> Any:
    """The deviceop dtype of PyTorch tensor ``t`` (DTypeError where there is none)."""
    dt = _DTYPES.get(t.dtype)
    if dt is None:
        try:
            dt = _DTYPES[t.dtype] = as_dtype(str(t.dtype).removeprefix("torch."), "PyTorch output dtype")
        except DTypeError:
            raise DTypeError(
                f"the PyTorch code returned a {t.dtype} tensor, which deviceop has no dtype for; convert it "
                "(float32, float16, bfloat16, int32, int64, uint8) before returning"
            ) from None
    return dt


def _storage(t: Any) -> tuple[int, int]:
    """(start, size) of the PyTorch storage under ``t``: its allocation, as far as we know."""
    st = t.untyped_storage()
    return int(st.data_ptr()), int(st.nbytes())
