"""Foreign memory in the ledger: one region per allocation, whichever wrapper reaches it.

The ledger keeps in-flight accesses per :class:`Buffer`. Memory deviceop did not allocate (a
PyTorch or CuPy tensor; a numpy array on the host backend) is reached through wrappers, and the
same memory may be reached through several: a tensor wrapped twice, a deviceop tensor exported
and wrapped back. Each wrapper gets its own Buffer, which keeps its library's object alive for
as long as the wrapper or work using it lives; all Buffers of one allocation share one access
list, their addresses counted from the allocation's start, so the ledger sees one region.

An allocation is found by address: deviceop buffers that leave through DLPack or ``external``
are registered here; other memory is looked up in the driver (``cuMemGetAddressRange``) on cuda
and by the numpy array that owns it on the host backend.
"""

from __future__ import annotations

import bisect
import ctypes
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from .._errors import UsageError
from .._process import CORE, renew_at_fork
from ._base import LOCK, Buffer, PartitionBase, TensorBase
from ._dlpack import capsule
from ._dlstructs import describe_dlpack
from ._external import (
    inside_stream,  # (re-exported: the stream whose external fn runs)
    remember,
    seen,
    wrapper,
)
from ._ledger import every_in_flight

__all__ = ["access_of", "buffer_for", "export", "host_root", "inside_stream", "raw_view", "register", "span"]


class _Region:
    """One allocation [start, end) of a device: its access list and the buffers that share it."""

    __slots__ = ("accesses", "bound", "end", "host", "start", "users")

    def __init__(self, start: int, end: int, accesses: list[Any], host: Any) -> None:
        self.start = start
        self.end = end
        self.accesses = accesses
        # wrapper Buffers and the foreign arrays, by id, as weak references (never compared: a
        # WeakSet compares its members with ==, which a PyTorch tensor answers elementwise; a
        # WeakValueDictionary costs microseconds to make, and a region is made per new tensor)
        self.users: dict[int, Any] = {}
        self.bound = 16  # past this many users, the dead ones are dropped
        self.host = host

    def add(self, obj: Any) -> None:
        """Count ``obj`` as a user: the region lives while one of its users does."""
        users = self.users
        if len(users) >= self.bound:
            for k in [k for k, ref in users.items() if ref() is None]:
                del users[k]
            self.bound = max(16, 2 * len(users))
        users[id(obj)] = weakref.ref(obj)

    def alive(self) -> bool:
        """Whether a user lives (the newest first: the likeliest to)."""
        for ref in reversed(self.users.values()):  # noqa: SIM110 (compiled, a loop makes no generator)
            if ref() is not None:
                return True
        return False


# per device: sorted region starts and the regions by start
_tables: dict[int, tuple[list[int], dict[int, _Region]]] = {}
_lock = threading.Lock()
_inserts = [0]
renew_at_fork(globals(), CORE, _lock=threading.Lock)  # a thread may hold it at fork()


def _table(be: Any) -> tuple[list[int], dict[int, _Region]]:
    t = _tables.get(id(be))
    if t is None:
        t = _tables[id(be)] = ([], {})
        weakref.finalize(be, _tables.pop, id(be), None)
    return t


def _find(table: tuple[list[int], dict[int, _Region]], lo: int, hi: int) -> _Region | None:
    starts, regions = table
    i = bisect.bisect_right(starts, lo) - 1
    if i < 0:
        return None
    r = regions[starts[i]]
    if r.end >= hi and r.alive():
        return r
    return None


def _drop(table: tuple[list[int], dict[int, _Region]], r: _Region) -> None:
    starts, regions = table
    if regions.get(r.start) is r:
        del regions[r.start]
        starts.pop(bisect.bisect_left(starts, r.start))


def _insert(table: tuple[list[int], dict[int, _Region]], r: _Region) -> bool:
    """Add ``r`` unless a live region overlaps it; dead ones in the way are dropped."""
    starts, regions = table
    _inserts[0] += 1
    if _inserts[0] % 256 == 0:  # regions of freed memory: forget them now and then
        for dead in [x for x in regions.values() if not x.alive()]:
            _drop(table, dead)
    i = bisect.bisect_right(starts, r.start) - 1
    j = i if i >= 0 else 0
    while j < len(starts) and starts[j] < r.end:
        x = regions[starts[j]]
        if x.end > r.start:
            if x.alive():
                return False
            _drop(table, x)
            continue
        j += 1
    pos = bisect.bisect_left(starts, r.start)
    starts.insert(pos, r.start)
    regions[r.start] = r
    return True


def register(buf: Buffer) -> None:
    """Make deviceop-owned ``buf`` findable by address (it is leaving through DLPack or
    ``external``): wrappers of its memory share its access list."""
    if buf.owner is not None:
        return  # already a wrapper of some region
    end = buf.ptr + max(buf.nbytes, 1)
    with _lock:
        table = _table(buf.backend)
        r = _find(table, buf.ptr, end)
        if r is not None and r.accesses is buf.accesses:
            return
        r = _revived(table, buf.ptr, end, buf.accesses)
        if r is not None:
            r.host = buf.host
            r.add(buf)
            return
        r = _Region(buf.ptr, end, buf.accesses, buf.host)
        r.add(buf)
        _insert(table, r)


def _locate(be: Any, lo: int, hi: int, root: Any) -> _Region:
    """The region of device ``be`` holding memory [lo, hi) (call with ``_lock`` held): a known
    one, else its allocation's (``root`` where the caller knows it: (start, size), or a
    function returning that, called only then; else the driver's)."""
    table = _table(be)
    r = _find(table, lo, max(hi, lo + 1))
    if r is None:
        if callable(root):
            root = root()
        rng = root if root is not None else be.allocation_range(lo)
        if rng is None or not (rng[0] <= lo and hi <= rng[0] + rng[1]):
            rng = (lo, max(hi - lo, 1))
        start, end = int(rng[0]), int(rng[0]) + int(rng[1])
        r = _revived(table, start, end, [])
        if r is None:
            r = _Region(start, end, [], raw_view(start, end - start) if not be.cuda_memory else None)
            _insert(table, r)  # (refused where a live region overlaps: then this one stands alone)
    return r


def _revived(table: tuple[list[int], dict[int, _Region]], start: int, end: int, accesses: list[Any]) -> _Region | None:
    """The region of allocation [start, end) if nothing uses it any more, made to serve anew with
    ``accesses`` (call with ``_lock`` held); else None.

    A caching allocator (PyTorch's, deviceop's own) hands the same block out again and again:
    its region of before serves the next wrapper instead of a new one inserted in its place.
    Nothing uses it: no wrapper, no array, no work in flight (work keeps its buffers), so none
    of its accesses of before is still owed."""
    r = table[1].get(start)
    if r is None or r.end != end or r.alive():
        return None
    r.accesses = accesses
    r.users.clear()
    r.bound = 16
    return r


def _wrapper(be: Any, r: _Region, owner: Any) -> Buffer:
    """A Buffer of region ``r`` that keeps ``owner`` alive, sharing the region's access list."""
    return wrapper(be, r.start, r.end - r.start, r.host, owner, r.accesses)


def buffer_for(
    be: Any, lo: int, hi: int, owner: Any, root: tuple[int, int] | Callable[[], tuple[int, int]] | None = None
) -> Buffer:
    """A Buffer for memory [lo, hi) of device ``be`` that keeps ``owner`` alive: its allocation's
    region (``root``: the allocation's (start, size) where the caller knows it, or a function
    giving it, called only where no known region holds [lo, hi))."""
    with _lock:
        r = _locate(be, lo, hi, root)
        buf = _wrapper(be, r, owner)
        r.add(buf)
    return buf


def raw_view(ptr: int, nbytes: int) -> np.ndarray:
    """A uint8 numpy view of host memory [ptr, ptr + nbytes) (owned elsewhere)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr))


def host_root(arr: np.ndarray) -> tuple[int, int]:
    """(start, size) of the memory owning numpy array ``arr`` (its base chain's last array)."""
    root = arr
    while isinstance(root.base, np.ndarray):
        root = root.base
    return int(root.__array_interface__["data"][0]), int(root.nbytes)


def span(ptr: int, shape: tuple[int, ...], strides: tuple[int, ...] | None, itemsize: int) -> tuple[int, int]:
    """Byte range [lo, hi) touched by an array at ``ptr`` (strides in bytes; None: row-major)."""
    n = 1
    for s in shape:
        n *= s
    if n == 0:
        return ptr, ptr
    if strides is None:
        return ptr, ptr + n * itemsize
    lo = hi = 0
    for s, st in zip(shape, strides):
        if st < 0:
            lo += (s - 1) * st
        else:
            hi += (s - 1) * st
    return ptr + lo, ptr + hi + itemsize


def access_of(obj: Any, be: Any, write: bool, what: Any) -> tuple[Any, ...]:
    """What the ledger registers for ``obj`` named in ``reads``/``writes``: ``(tensor, write)``
    for deviceop tensors and partitions, ``(buffer, lo, hi, write)`` for another library's
    array (wrapped without a copy, kept alive by the buffer). ``what`` names ``obj`` in error
    messages: a string, or ``(op, write, index)`` (made into one only for a message)."""
    a = seen(obj, be, write)  # a PyTorch tensor described before, unchanged
    if a is not None:
        return a
    if isinstance(obj, PartitionBase):
        obj = obj.tensor
    if isinstance(obj, TensorBase):
        return (obj, write)
    tp = type(obj)
    is_torch = _is_torch(tp)
    ptr, shape, strides, itemsize, _device = _describe(obj, be, what)
    lo, hi = span(ptr, shape, strides, itemsize)
    root = None
    if isinstance(obj, np.ndarray):
        root = host_root(obj)
    elif is_torch:  # a PyTorch tensor: its storage
        st = obj.untyped_storage()
        root = (int(st.data_ptr()), int(st.nbytes()))
    with _lock:
        r = _locate(be, lo, hi, root)
        buf = _wrapper(be, r, obj)
        r.add(buf)
        if is_torch:
            r.add(obj)  # the region lives as long as the tensor does
            remember(obj, be, buf, lo - r.start, hi - r.start)
    return (buf, lo - buf.ptr, hi - buf.ptr, write)


_ITEMSIZE: dict[str, int] = {}
_TORCH: dict[type, bool] = {}


def _is_torch(tp: type) -> bool:
    """Whether ``tp`` is PyTorch's tensor or a subclass of it (``nn.Parameter``, a user's)."""
    t = _TORCH.get(tp)
    if t is None:
        t = _TORCH[tp] = any(k.__module__ == "torch" and k.__name__ == "Tensor" for k in tp.__mro__)
    return t


def _describe(obj: Any, be: Any, what: Any) -> tuple[int, tuple[int, ...], tuple[int, ...] | None, int, str]:
    """(address, shape, byte strides or None, itemsize, 'cuda'|'cpu') of a foreign array."""
    if _is_torch(type(obj)):
        dev = obj.device.type
        _check_device(dev, be, what, obj)
        it = obj.element_size()
        return int(obj.data_ptr()), tuple(obj.shape), tuple(s * it for s in obj.stride()), it, dev
    if be.cuda_memory:
        cai = getattr(obj, "__cuda_array_interface__", None)
        if cai is not None:
            ts = cai["typestr"]
            it = _ITEMSIZE.get(ts)
            if it is None:
                it = _ITEMSIZE[ts] = np.dtype(ts).itemsize
            st = cai.get("strides")
            return int(cai["data"][0]), tuple(cai["shape"]), tuple(st) if st else None, it, "cuda"
        if isinstance(obj, np.ndarray):
            _check_device("cpu", be, what, obj)
    else:
        if isinstance(obj, np.ndarray):
            return int(obj.__array_interface__["data"][0]), obj.shape, obj.strides, obj.itemsize, "cpu"
        if hasattr(obj, "__cuda_array_interface__"):
            _check_device("cuda", be, what, obj)
    what = _what(what)
    if hasattr(obj, "__dlpack__"):
        return describe_dlpack(obj, be, what)
    raise UsageError(
        f"{what}: {type(obj).__name__} is not an array deviceop can name; pass a deviceop Tensor or "
        "Partition, or an array with __dlpack__ or __cuda_array_interface__ (PyTorch, CuPy; numpy "
        "on the host backend)"
    )


def _what(what: Any) -> str:
    if type(what) is tuple:
        op, write, i = what
        return f"{'writes' if write else 'reads'}[{i}] of {op!r}"
    return str(what)


def _check_device(dev: str, be: Any, what: Any, obj: Any) -> None:
    want = "cuda" if be.cuda_memory else "cpu"
    if dev != want:
        what = _what(what)
        raise UsageError(
            f"{what}: this {type(obj).__name__} lives on {dev!r} memory, but the {be.name} backend's "
            f"work touches {want!r} memory; move it there first"
        )


def export(t: Any, stream: Any) -> Any:
    """A ``dltensor`` capsule for ``t``; orders the consumer's ``stream`` after work in flight.

    Inside the fn of :func:`~deviceop.interop.external` the ledger has already ordered the op's
    stream after the work in flight, so a consumer on that stream waits for nothing more (and
    on the host backend the fn runs in stream order, so the tensor may be read).
    """
    be = t.buffer.backend
    register(t.buffer)  # wrapped back later, its memory is this buffer's region
    mine = inside_stream()
    if not be.cuda_memory:
        if mine is None:
            t.check_host_access("export")  # a host consumer reads at once: nothing may be in flight
        return be.dlpack_host(t)  # numpy owns the capsule's lifetime
    if mine is not None:
        if stream not in (-1, mine.handle_int):
            ev = be.new_event()  # another stream of the consumer: after our work so far
            mine.record(ev)
            be.foreign_wait(stream, ev)
    elif stream != -1:
        # the consumer's stream waits for every execution in flight on the tensor, on any
        # stream: it may read what one writes, or write what one still reads
        for ex in every_in_flight(t.buffer, *t.span):
            with LOCK:
                ev = ex.completion_event()
            be.foreign_wait(stream, ev)
    dev_type, dev_id = be.dlpack_device
    return capsule(t, t.ptr, t.shape, t.strides, t.dtype.dl_code, t.dtype.itemsize * 8, dev_type, dev_id)
