"""Foreign GPU work as ops (do.external, do.interop.torch), foreign memory and foreign streams.

The "foreign library" here is the CUDA driver called directly through cuda.bindings on cuda
(the stub driver in CI), and numpy on the host backend, where fn runs on the stream's worker.
Ordering tests make the earlier work slow (0.2 s) so a missing dependency shows as a wrong value.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref

import numpy as np
import pytest
from helpers import K, pool_of, run_threads, slow_fill

import deviceop as do
from deviceop._core._base import foreign_of, set_foreign

# -- a foreign library: raw driver calls on cuda, numpy on the host ---------------------------


def _cuda() -> bool:
    return do.backend_name() == "cuda"


def _torch():
    """PyTorch for this backend's tensors (the test skips without it, or on cuda without its CUDA build)."""
    torch = pytest.importorskip("torch")
    if _cuda() and not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    return torch


def _torch_on_cuda(on_host: str):
    """PyTorch with CUDA, for a test of the cuda backend alone (``on_host``: why it skips there)."""
    torch = pytest.importorskip("torch")
    if not _cuda():
        pytest.skip(on_host)
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    return torch


def _ptr(x) -> int:
    if isinstance(x, do.Tensor):
        return x.ptr
    return int(x.__cuda_array_interface__["data"][0])


def lib_fill(stream, dst, value: float, n: int):
    """Write ``value`` to ``n`` float32 elements of ``dst`` on ``stream``."""
    if n == 0:
        return "filled"
    if not _cuda():
        np.asarray(dst).reshape(-1)[:n] = value
        return "filled"
    from cuda.bindings import driver as drv

    (err,) = drv.cuMemsetD32Async(_ptr(dst), int(np.float32(value).view(np.uint32)), n, stream.handle_int)
    assert int(err) == 0, err
    return "filled"


def lib_copy(stream, dst, src, nbytes: int):
    """Copy ``nbytes`` from ``src`` to ``dst`` on ``stream``."""
    if not _cuda():
        np.asarray(dst).reshape(-1).view(np.uint8)[:nbytes] = np.asarray(src).reshape(-1).view(np.uint8)[:nbytes]
        return None
    from cuda.bindings import driver as drv

    (err,) = drv.cuMemcpyDtoDAsync(_ptr(dst), _ptr(src), nbytes, stream.handle_int)
    assert int(err) == 0, err
    return None


class DevArray:
    """A foreign float32 array: device memory from cuMemAlloc on cuda (freed when dropped), a
    numpy array on the host. Speaks __cuda_array_interface__ / is an ndarray."""

    def __init__(self, n: int):
        self.n = n
        if _cuda():
            from cuda.bindings import driver as drv

            err, p = drv.cuMemAlloc(4 * n)
            assert int(err) == 0
            self.p = int(p)
            self.__cuda_array_interface__ = {
                "data": (self.p, False),
                "shape": (n,),
                "typestr": "<f4",
                "version": 3,
                "strides": None,
            }
        else:
            self.arr = np.zeros(n, np.float32)

    @property
    def obj(self):
        return self if _cuda() else self.arr

    def __del__(self):
        if getattr(self, "p", None):
            from cuda.bindings import driver as drv

            drv.cuMemFree(self.p)


def _numpy_of(x: DevArray) -> np.ndarray:
    return do.to_numpy(do.from_dlpack(x.arr) if not _cuda() else _as_tensor(x)).sync()


def _as_tensor(x: DevArray) -> do.Tensor:
    """A deviceop view of a DevArray through the external path's wrapper (cuda)."""
    from deviceop._core._regions import access_of
    from deviceop.device import current

    buf, lo, _hi, _ = access_of(x.obj, current(), False, "test")
    return do.Tensor(buf, (x.n,), do.float32, None, lo)


# -- ordering in both directions ----------------------------------------------------------------


def test_external_runs_after_deviceop_write_on_another_stream(backend):
    s = pool_of(2)
    x = do.zeros(1024, do.float32).sync()
    y = do.zeros(1024, do.float32).sync()
    slow_fill(x, 4.0, 0.2).submit(stream=s[0])
    out = do.external(lib_copy, y, x, x.nbytes, reads=(x,), writes=(y,)).sync_on(s[1])
    assert out is None
    np.testing.assert_array_equal(y.numpy(), np.full(1024, 4.0, np.float32))


def test_deviceop_runs_after_external_write_on_another_stream(backend):
    s = pool_of(2)
    x = do.zeros(1024, do.float32).sync()
    z = do.zeros(128, do.float32).sync()
    y = do.zeros(1024, do.float32).sync()
    # the external fill comes after 0.2 s of other work on stream 0
    op = slow_fill(z, 1.0, 0.2).then(lambda _: do.external(lib_fill, x, 9.0, 1024, writes=(x,)))
    fut = op.submit(stream=s[0])
    K.copy(y.partition((128,)), x).sync_on(s[1])
    np.testing.assert_array_equal(y.numpy(), np.full(1024, 9.0, np.float32))
    assert fut.result() == "filled"


def test_external_read_then_deviceop_write_waits_for_the_read(backend):
    s = pool_of(2)
    x = do.full(1024, 2.0, do.float32).sync()
    z = do.zeros(128, do.float32).sync()
    y = do.zeros(1024, do.float32).sync()
    op = slow_fill(z, 1.0, 0.2).then(lambda _: do.external(lib_copy, y, x, x.nbytes, reads=(x,), writes=(y,)))
    fut = op.submit(stream=s[0])
    K.fill(x.partition((128,)), 5.0).sync_on(s[1])  # a later write must not land before the read
    fut.result()
    np.testing.assert_array_equal(y.numpy(), np.full(1024, 2.0, np.float32))
    np.testing.assert_array_equal(x.numpy(), np.full(1024, 5.0, np.float32))


def test_undeclared_tensor_arguments_count_as_written(backend):
    s = pool_of(2)
    x = do.zeros(1024, do.float32).sync()
    z = do.zeros(128, do.float32).sync()
    y = do.zeros(1024, do.float32).sync()
    fut = slow_fill(z, 1.0, 0.2).then(lambda _: do.external(lib_fill, x, 3.0, 1024)).submit(stream=s[0])
    K.copy(y.partition((128,)), x).sync_on(s[1])
    fut.result()
    np.testing.assert_array_equal(y.numpy(), np.full(1024, 3.0, np.float32))


def test_many_named_arrays_and_undeclared_arguments_are_all_ordered(backend):
    """An op naming more arrays than it holds in itself, with undeclared tensor arguments on top:
    every access is kept in naming order, and the undeclared ones count as written."""
    s = pool_of(2)
    z = do.zeros(128, do.float32).sync()
    rs = [do.zeros(128, do.float32).sync() for _ in range(3)]
    ws = [do.zeros(128, do.float32).sync() for _ in range(3)]
    u1, u2 = do.zeros(1024, do.float32).sync(), do.zeros(1024, do.float32).sync()
    y = do.zeros(1024, do.float32).sync()

    def fill_both(stream, a, b):
        lib_fill(stream, a, 1.0, 1024)
        return lib_fill(stream, b, 6.0, 1024)

    op = do.external(fill_both, u1, u2, reads=tuple(rs), writes=tuple(ws))
    assert [(a[0], a[-1]) for a in op.acc] == [(t, False) for t in rs] + [(t, True) for t in ws]
    fut = slow_fill(z, 1.0, 0.2).then(lambda _: op).submit(stream=s[0])
    K.copy(y.partition((128,)), u2).sync_on(s[1])  # must wait for fill_both's write of u2
    assert fut.result() == "filled"
    np.testing.assert_array_equal(y.numpy(), np.full(1024, 6.0, np.float32))
    assert [(a[0], a[-1]) for a in op.acc][6:] == [(u1, True), (u2, True)]


# -- foreign memory ---------------------------------------------------------------------------


def test_foreign_memory_is_ordered_like_deviceop_memory(backend):
    s = pool_of(2)
    a = DevArray(1024)
    z = do.zeros(128, do.float32).sync()
    y = do.zeros(1024, do.float32).sync()
    fut = (
        slow_fill(z, 1.0, 0.2)
        .then(lambda _: do.external(lib_fill, a.obj, 6.0, 1024, writes=(a.obj,)))
        .submit(stream=s[0])
    )
    # another wrapper of the same memory, read on another stream
    src = _as_tensor(a) if _cuda() else do.from_dlpack(a.arr)
    K.copy(y.partition((128,)), src).sync_on(s[1])
    fut.result()
    np.testing.assert_array_equal(y.numpy(), np.full(1024, 6.0, np.float32))


def test_a_region_lives_while_one_of_its_users_does_and_forgets_dead_ones(host_backend):
    """A region of foreign memory is live while one of its users (wrappers, the foreign array)
    is; users are held weakly, and dead ones are dropped as new ones come, so a region named
    again and again keeps a bounded table."""
    from deviceop._core._regions import _Region

    class User:
        pass

    r = _Region(0, 64, [], None)
    assert not r.alive()
    users = [User() for _ in range(100)]
    for u in users:
        r.add(u)
    del u
    assert r.alive() and len(r.users) == 100
    del users[1:]
    assert r.alive()  # the oldest user still lives
    for _ in range(20):  # 1,000 more users, 50 alive at a time (a step's wrappers, until their work completes)
        batch = [User() for _ in range(50)]
        for u in batch:
            r.add(u)
    del batch, u
    assert r.alive() and len(r.users) <= 128  # pruned at twice the users alive at the last pruning
    users.clear()
    assert not r.alive()


def test_a_region_nothing_uses_serves_anew_when_its_allocation_comes_back(host_backend):
    """A caching allocator hands the same block out again and again: the region of that
    allocation, once nothing uses it, serves the next wrapper with an empty access list (not
    one of the work before), and is not taken over while it lives, nor by another allocation
    at the same address."""
    from deviceop._core._regions import _table, buffer_for
    from deviceop.device import current

    class Owner:
        pass

    be = current()
    base = np.zeros(1024, np.uint8)
    p = base.ctypes.data
    o1 = Owner()
    b1 = buffer_for(be, p, p + 64, o1, (p, 256))
    first = _table(be)[1][p]
    old_list = b1.accesses
    # a live user: the region is shared, not made anew
    o2 = Owner()
    b2 = buffer_for(be, p + 64, p + 128, o2, (p, 256))
    assert b2.accesses is old_list and _table(be)[1][p] is first
    del b1, b2, o1, o2
    gc.collect()
    assert not first.alive()
    o3 = Owner()
    b3 = buffer_for(be, p + 16, p + 32, o3, lambda: (p, 256))
    assert _table(be)[1][p] is first and first.alive()  # the same region, in use again
    assert (b3.ptr, b3.nbytes) == (p, 256) and b3.accesses == [] and b3.accesses is not old_list
    del b3, o3
    gc.collect()
    # another allocation at the address (a different size): a region of its own
    o4 = Owner()
    b4 = buffer_for(be, p, p + 64, o4, (p, 512))
    assert _table(be)[1][p] is not first and (b4.ptr, b4.nbytes) == (p, 512)
    # deviceop's own buffers, registered as they leave (DLPack, external): a block of its pool
    # given out again gets the region of before, with the new buffer's access list
    from deviceop._core._base import Buffer
    from deviceop._core._regions import register

    q = p + 768
    d1 = Buffer(be, q, 128)
    register(d1)
    own = _table(be)[1][q]
    assert own.accesses is d1.accesses
    del d1
    gc.collect()
    d2 = Buffer(be, q, 128)
    register(d2)
    assert _table(be)[1][q] is own and own.accesses is d2.accesses and own.alive()
    np.testing.assert_array_equal(base, 0)  # (kept alive to here: the addresses are its)


def test_same_memory_through_two_wrappers_is_one_region(backend):
    from deviceop._core._regions import access_of
    from deviceop.device import current

    a = DevArray(256)
    b1 = access_of(a.obj, current(), False, "t")[0]
    b2 = access_of(a.obj, current(), True, "t")[0]
    assert b1 is not b2 and b1.accesses is b2.accesses and b1.ptr == b2.ptr
    # a deviceop tensor exported and wrapped back shares the tensor's own access list
    t = do.zeros(256, do.float32).sync()

    class Producer:  # a library that hands the tensor on through DLPack
        def __init__(self, t):
            self.t = t

        def __dlpack__(self, stream=None):
            return self.t.__dlpack__(stream=stream)

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

    back = do.from_dlpack(Producer(t))
    assert back.buffer.accesses is t.buffer.accesses
    assert back.ptr == t.ptr
    view = do.from_dlpack(Producer(t[128:]))
    assert view.buffer.accesses is t.buffer.accesses and view.ptr == t.ptr + 512


def test_foreign_array_lives_until_the_work_completes(backend):
    a = DevArray(1024)
    ref = weakref.ref(a.obj)
    z = do.zeros(128, do.float32).sync()
    # the execution stays in flight for 0.2 s after the external step (on the host backend the
    # enqueuing thread waits for fn itself, so the slow work comes after it)
    fut = do.external(lib_fill, None, 0.0, 0, writes=(a.obj,)).then(lambda _: slow_fill(z, 1.0, 0.2)).submit()
    del a
    gc.collect()
    assert ref() is not None, "the foreign array was dropped while work naming it was in flight"
    fut.result()
    del fut
    gc.collect()
    assert ref() is None, "the foreign array is kept after its work completed"


# -- errors and bad input ----------------------------------------------------------------------


def test_fn_raising_is_raised_by_the_terminal_and_the_device_stays_usable(backend):
    def bad(stream, x):
        lib_fill(stream, x, 1.0, x.size)
        raise KeyError("from the library")

    x = do.zeros(256, do.float32).sync()
    with pytest.raises(KeyError, match="from the library"):
        do.external(bad, x).sync()
    np.testing.assert_array_equal(x.numpy(), np.ones(256, np.float32))  # its work completed
    assert do.full(4, 2.0, do.float32).sync().numpy().tolist() == [2.0] * 4


def test_deviceop_called_inside_fn_raises_instead_of_hanging(backend):
    def calls_deviceop(stream):
        return do.zeros(4, do.float32).sync()

    with pytest.raises(do.UsageError, match="deviceop op"):
        do.external(calls_deviceop).sync()
    assert do.full(4, 1.0, do.float32).sync().numpy().tolist() == [1.0] * 4


def test_bad_input_fails_when_the_op_is_built(backend):
    x = do.zeros(8, do.float32).sync()
    with pytest.raises(do.UsageError, match="callable"):
        do.external(42)
    with pytest.raises(do.UsageError, match="tuple or list"):
        do.external(lib_fill, reads=x)
    with pytest.raises(do.UsageError, match="tuple or list"):
        do.external(lib_fill, writes=np.zeros(4, np.float32))
    with pytest.raises(do.UsageError, match="not an array deviceop can name"):
        do.external(lib_fill, reads=("not an array",))
    with pytest.raises(do.UsageError, match="reads and writes name arrays"):
        do.external(lib_fill, writes=(do.zeros(4, do.float32),))
    if _cuda():
        with pytest.raises(do.UsageError, match="'cpu' memory"):
            do.external(lib_fill, reads=(np.zeros(4, np.float32),))


def test_output_is_what_fn_returns_and_args_may_be_ops(backend):
    out = do.external(lambda stream, t, k: (t.shape, k), do.zeros((4, 8), do.float32), 7).sync()
    assert out == ((4, 8), 7)
    x = do.zeros(64, do.float32).sync()
    y = do.external(lib_fill, x, 2.5, 64, writes=(x,)).map(lambda _: x).then(do.to_numpy).sync()
    np.testing.assert_array_equal(y, np.full(64, 2.5, np.float32))


def test_fn_gets_numpy_arrays_on_host(host_backend):
    seen = []
    do.external(
        lambda stream, t: seen.append((type(t), threading.current_thread().name, stream)), do.zeros(4, do.float32)
    ).sync()
    kind, thread, stream = seen[0]
    assert kind is np.ndarray and thread.startswith("deviceop-host-stream")
    assert isinstance(stream, do.Stream)


def test_tensors_export_inside_fn_without_borrow_error(backend):
    x = do.full(16, 3.0, do.float32).sync()

    def export(stream, t):
        if _cuda():
            cap = x.__dlpack__(stream=stream.handle_int)  # x is in flight in this execution
            return type(cap).__name__
        return float(np.from_dlpack(x)[0])

    assert do.external(export, x).sync() in ("PyCapsule", 3.0)


# -- await, threads, capture -------------------------------------------------------------------


@pytest.mark.anyio
async def test_await_external(backend, anyio_backend):
    x = await do.zeros(512, do.float32)
    assert await do.external(lib_fill, x, 8.0, 512, writes=(x,)) == "filled"
    np.testing.assert_array_equal((await do.to_numpy(x)), np.full(512, 8.0, np.float32))


def test_threads_run_externals_on_their_own_tensors(backend):
    def worker(k: int) -> None:
        for i in range(10):
            x = do.zeros(256, do.float32).sync()
            y = do.zeros(256, do.float32).sync()
            v = float(k * 100 + i)
            op = (
                K.fill(x.partition((128,)), v)
                .then(lambda _: do.external(lib_copy, y, x, x.nbytes, reads=(x,), writes=(y,)))
                .map(lambda _: y)
            )
            np.testing.assert_array_equal(op.then(do.to_numpy).sync(), np.full(256, v, np.float32))

    assert run_threads(worker, 4) == []


def test_recorded_in_a_graph_and_replayed(backend):
    x = do.zeros(256, do.float32).sync()
    calls = []

    def fill(stream, t, v):
        calls.append(1)
        return lib_fill(stream, t, v, 256)

    with do.graph.scope() as s:
        s.record(do.external(fill, x, 4.0, writes=(x,)))
    g = s.graph
    K.fill(x.partition((128,)), 0.0).sync()
    g.launch().sync()
    np.testing.assert_array_equal(x.numpy(), np.full(256, 4.0, np.float32))
    assert len(calls) == 1  # cuda: called while recording; host: by the replay


# -- foreign streams ---------------------------------------------------------------------------


class _StreamLike:
    def __init__(self, handle: int):
        self.h = handle

    def __cuda_stream__(self):
        return (0, self.h)


def test_pool_streams_from_handle_and_protocol(backend):
    s = do.streams()[0]
    assert do.Stream.from_handle(s.handle_int) is s
    assert do.Stream.from_handle(_StreamLike(s.handle_int)) is s
    assert do.zeros(4, do.float32).sync_on(_StreamLike(s.handle_int)).numpy().tolist() == [0.0] * 4
    assert isinstance(s, do.Stream) and not isinstance(object(), do.Stream)
    if _cuda():
        assert s.__cuda_stream__() == (0, s.handle_int)
    for bad in ("s0", -1, 1 << 64):  # (a handle past 64 bits was a raw OverflowError on cuda)
        with pytest.raises(do.UsageError, match="not a stream"):
            do.Stream.from_handle(bad)
    with pytest.raises(do.UsageError):
        do.Stream()
    if not _cuda():
        with pytest.raises(do.UsageError, match="not a stream of the host backend"):
            do.Stream.from_handle(12345)


def test_foreign_stream_is_ordered_by_the_ledger(backend):
    if not _cuda():
        pytest.skip("foreign streams exist on cuda only")
    from cuda.bindings import driver as drv

    err, hs = drv.cuStreamCreate(1)
    assert int(err) == 0
    fs = _StreamLike(int(hs))
    wrapped = do.Stream.from_handle(fs)
    assert do.Stream.from_handle(int(hs)) is wrapped and "foreign" in repr(wrapped)
    x = do.zeros(1024, do.float32).sync()
    y = do.zeros(1024, do.float32).sync()
    slow_fill(x, 7.0, 0.2).submit()
    K.copy(y.partition((128,)), x).sync_on(fs)
    np.testing.assert_array_equal(y.numpy(), np.full(1024, 7.0, np.float32))
    fut = K.fill(x.partition((128,)), 1.0).submit(stream=fs)
    fut.result()
    np.testing.assert_array_equal(x.numpy(), np.full(1024, 1.0, np.float32))


# -- PyTorch --------------------------------------------------------------------------------------


def test_torch_module_through_the_adapter(backend):
    torch = _torch()
    s = pool_of(2)  # first: under DEVICEOP_STREAMS=1 this selects a new device
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8)
    if _cuda():
        lin = lin.cuda()
    x0 = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    x = do.from_numpy(x0).sync()

    def fwd(t):
        with torch.no_grad():
            return torch.relu(lin(t))

    out = do.interop.torch(fwd, x).sync()
    assert type(out) is do.Tensor and out.shape == (4, 8) and out.dtype is do.float32
    w = lin.weight.detach().cpu().numpy()
    b = lin.bias.detach().cpu().numpy()
    np.testing.assert_allclose(out.numpy(), np.maximum(x0 @ w.T + b, 0), rtol=1e-5, atol=1e-5)
    # the output is deviceop memory written by the op: another stream's reader waits for it
    y = do.zeros((4, 8), do.float32).sync()
    op = do.interop.torch(fwd, x).then(lambda o: K.copy(y.view(32).partition((32,)), o.view(32)))
    op.sync_on(s[1])
    np.testing.assert_allclose(y.numpy(), out.numpy(), rtol=1e-6)


def test_torch_adapter_gives_back_an_input_written_in_place_as_that_tensor(backend):
    """PyTorch code that returns one of its deviceop inputs (``out=``, in place) gives back that
    very Tensor, written by the op (no second wrapper of its memory); a view of it is a new one."""
    torch = _torch()
    s = pool_of(2)
    x = do.full((4, 8), 2.0, do.float32).sync()
    y = do.zeros((4, 8), do.float32).sync()
    out = do.interop.torch(lambda a, b: torch.add(a, a, out=b), x, y, writes=(y,)).sync()
    assert out is y
    np.testing.assert_array_equal(y.numpy(), np.full((4, 8), 4.0, np.float32))
    # in place, not named in writes: still the input itself, and the op's write is ordered
    # before a reader on another stream
    z = do.zeros((4, 8), do.float32).sync()
    seen = []

    def copy(o):  # type: ignore[no-untyped-def]
        seen.append(o)
        return K.copy(z.view(32).partition((32,)), o.view(32))

    do.interop.torch(lambda a: a.mul_(3.0), x).then(copy).sync_on(s[1])
    assert seen[0] is x
    np.testing.assert_array_equal(z.numpy(), np.full((4, 8), 6.0, np.float32))
    both = do.interop.torch(lambda a, b: (b, a[1:]), x, y).sync()
    assert both[0] is y and both[1] is not x and both[1].shape == (3, 8)
    np.testing.assert_array_equal(both[1].numpy(), np.full((3, 8), 6.0, np.float32))
    # a partition's tensor is given to the code whole: returning it gives back the tensor
    assert do.interop.torch(lambda a: a, x.partition((2, 8))).sync() is x


def test_torch_adapter_gives_calls_an_alias_of_a_tensor_used_again(backend):
    """The PyTorch tensor on a deviceop tensor's memory is made once and calls get an alias of
    it: the same memory, the same object while its metadata is as made, a new alias after a
    call changed its shape, strides or requires_grad in place (the next call's is as it was),
    usable with autograd after a call under inference mode; it goes with the deviceop tensor
    and does not keep its memory."""
    torch = _torch_on_cuda("on the host backend fn gets CPU tensors made for each call")
    x = do.full((4, 8), 1.0, do.float32).sync()
    seen = []

    def reshape_in_place(t):
        seen.append((t, t.data_ptr(), tuple(t.shape)))
        t.t_()  # (8, 4) from now on: this call's alias only
        return t.sum()

    for _ in range(3):
        do.interop.torch(reshape_in_place, x).sync()
    assert [s[2] for s in seen] == [(4, 8)] * 3
    assert {s[1] for s in seen} == {x.ptr} and len({id(s[0]) for s in seen}) == 3
    kept = []
    for _ in range(2):  # left as made: the same alias again
        do.interop.torch(lambda t: kept.append(t), x).sync()
    assert kept[0] is kept[1] and tuple(kept[0].shape) == (4, 8)
    do.interop.torch(lambda t: t.unsqueeze_(0).requires_grad_(), x).sync()
    do.interop.torch(lambda t: kept.append(t), x).sync()
    assert kept[2] is not kept[0] and tuple(kept[2].shape) == (4, 8) and not kept[2].requires_grad
    do.interop.torch(lambda t: t.requires_grad_(), x).sync()  # autograd alone: a new alias too
    do.interop.torch(lambda t: kept.append(t), x).sync()
    assert kept[3] is not kept[2] and not kept[3].requires_grad
    do.interop.torch(lambda t: setattr(t, "data", t.view(torch.int32)), x).sync()  # another dtype
    do.interop.torch(lambda t: kept.append(t), x).sync()
    assert kept[4] is not kept[3] and kept[4].dtype == torch.float32
    kept.clear()
    # a written tensor given back as it was is that tensor; given back changed, a new one
    y = do.full((4, 8), 1.0, do.float32).sync()
    assert do.interop.torch(lambda b: b.mul_(2.0), y, writes=(y,)).sync() is y
    part = y.partition((2, 8))
    assert do.interop.torch(lambda b: b.mul_(2.0), part, writes=(part,)).sync() is y
    yt = do.interop.torch(lambda b: b.t_(), y, writes=(y,)).sync()
    assert yt is not y and yt.shape == (8, 4) and yt.ptr == y.ptr
    np.testing.assert_array_equal(y.numpy(), np.full((4, 8), 4.0, np.float32))
    with torch.inference_mode():
        do.interop.torch(lambda t: t.mul_(2.0), x).sync()  # in place: written, x itself back
    w = torch.ones(8, device="cuda", requires_grad=True)
    got = []
    do.interop.torch(lambda t: got.append((t @ w).sum()), x).sync()
    got[0].backward()  # an inference tensor would refuse to be saved for backward
    np.testing.assert_array_equal(w.grad.cpu().numpy(), np.full(8, 8.0, np.float32))
    # a tensor first given to PyTorch code under inference mode serves autograd later too
    z = do.full((4, 8), 1.0, do.float32).sync()
    with torch.inference_mode():
        do.interop.torch(lambda t: t.sum(), z).sync()
    w.grad = None
    do.interop.torch(lambda t: got.append((t @ w).sum()), z).sync()
    got[-1].backward()
    np.testing.assert_array_equal(w.grad.cpu().numpy(), np.full(8, 4.0, np.float32))
    # the alias cache holds the deviceop tensor weakly and its buffer only through the alias:
    # once both are dropped, the memory goes back
    seen.clear()
    got.clear()
    ref = weakref.ref(x.buffer)
    del x
    gc.collect()
    assert ref() is None


def test_a_tensor_an_adapter_step_returned_reaches_the_next_as_an_alias_of_pytorchs(backend):
    """A deviceop tensor that PyTorch code returned (a model split into steps) reaches the next
    adapter step as an alias of the PyTorch tensor it came from: the same memory, shape,
    strides and storage, without autograd history, its own metadata (a call that changed it in
    place leaves the next call a new alias); an inference tensor is imported anew (usable with
    autograd). The cache goes with the deviceop tensor."""
    torch = _torch_on_cuda("on the host backend fn gets CPU tensors made for each call")
    made = []
    w = torch.ones(8, 4, device="cuda", requires_grad=True)

    def first(t):  # a new tensor with autograd history, as a model's layer returns
        made.append(t @ w)
        return made[-1]

    seen = []

    def second(h):
        seen.append((h, h.data_ptr(), tuple(h.shape), h.stride(), h.requires_grad))
        h.t_()  # this call's alias only
        return h.sum()

    x = do.full((4, 8), 1.0, do.float32).sync()
    out = do.interop.torch(first, x).sync()
    assert type(out) is do.Tensor and out.shape == (4, 4) and out.ptr == made[0].data_ptr()
    for _ in range(2):
        do.interop.torch(second, out).sync()
    r = made[0]
    assert [s[1:] for s in seen] == [(r.data_ptr(), (4, 4), r.stride(), False)] * 2
    assert seen[0][0] is not seen[1][0] and seen[0][0] is not r
    assert seen[0][0].untyped_storage().data_ptr() == r.untyped_storage().data_ptr()
    assert r.shape == (4, 4) and r.requires_grad  # PyTorch's own tensor left as it was
    np.testing.assert_array_equal(out.numpy(), np.full((4, 4), 8.0, np.float32))
    # returned under inference mode: the next step, with autograd on, gets a normal tensor
    with torch.inference_mode():
        inf = do.interop.torch(lambda t: t * 2.0, x).sync()
    v = torch.ones(8, device="cuda", requires_grad=True)
    got = []
    do.interop.torch(lambda t: got.append((t @ v).sum()), inf).sync()
    got[0].backward()
    np.testing.assert_array_equal(v.grad.cpu().numpy(), np.full(8, 8.0, np.float32))
    # the entry is the deviceop tensor's: PyTorch's tensor goes with it
    assert foreign_of(out) is not None and foreign_of(out)[0].data_ptr() == r.data_ptr()
    ref = weakref.ref(r)
    seen.clear()
    made.clear()
    del out, r
    gc.collect()
    assert ref() is None


@pytest.mark.anyio
async def test_torch_awaited(backend, anyio_backend):
    _torch()  # (skips without PyTorch)
    x = await do.full((2, 3), 2.0, do.float32)
    out = await do.interop.torch(lambda t: t * 3, x)
    np.testing.assert_array_equal((await do.to_numpy(out)), np.full((2, 3), 6.0, np.float32))


def test_torch_adapter_sets_the_ops_stream_and_restores_the_callers(backend):
    torch = _torch_on_cuda("PyTorch's current stream is a CUDA stream")
    s = pool_of(1)[0]
    mine = torch.cuda.Stream()
    seen = []

    def fn(t):
        seen.append(torch.cuda.current_stream().cuda_stream)
        return t * 2

    def boom(t):
        seen.append(torch.cuda.current_stream().cuda_stream)
        raise RuntimeError("fn failed")

    x = do.full((4,), 1.0, do.float32).sync()
    with torch.cuda.stream(mine):
        out = do.interop.torch(fn, x).sync_on(s)
        assert torch.cuda.current_stream().cuda_stream == mine.cuda_stream  # the caller's, back
        with pytest.raises(RuntimeError, match="fn failed"):
            do.interop.torch(boom, x).sync_on(s)
        assert torch.cuda.current_stream().cuda_stream == mine.cuda_stream
    assert seen == [s.handle_int, s.handle_int]  # fn ran with the op's stream current
    np.testing.assert_array_equal(out.numpy(), np.full(4, 2.0, np.float32))


def test_torch_adapter_on_the_stream_current_already_leaves_it_current(backend, monkeypatch):
    """Code that made the op's stream PyTorch's current one around its calls: fn runs there,
    PyTorch's stream setter is not called, and the stream is current after the call, even where
    fn changed PyTorch's current stream (then it is set back)."""
    torch = _torch_on_cuda("PyTorch's current stream is a CUDA stream")
    from deviceop.interop import _torch as adapter

    s = pool_of(1)[0]
    ts = torch.cuda.ExternalStream(s.handle_int)
    other = torch.cuda.Stream()
    seen = []
    sets = []

    def fn(t):
        seen.append(torch.cuda.current_stream().cuda_stream)
        return t + 1

    def moves(t):  # leaves another stream current (a bug of fn's, which the adapter undoes)
        seen.append(torch.cuda.current_stream().cuda_stream)
        torch.cuda.set_stream(other)
        return t + 1

    x = do.full((4,), 1.0, do.float32).sync()
    do.interop.torch(fn, x).sync_on(s)  # (the adapter's lookups made)
    seen.clear()
    get, set_, dev = adapter._stream_fns
    monkeypatch.setattr(adapter, "_stream_fns", [get, lambda *a: sets.append(a) or set_(*a), dev])
    with torch.cuda.stream(ts):
        y = do.interop.torch(fn, x).sync_on(s)
        assert torch.cuda.current_stream().cuda_stream == s.handle_int and sets == []
        z = do.interop.torch(moves, y).sync_on(s)
        assert torch.cuda.current_stream().cuda_stream == s.handle_int and len(sets) == 1
    assert seen == [s.handle_int, s.handle_int]
    np.testing.assert_array_equal(z.numpy(), np.full(4, 3.0, np.float32))
    # not current: set for the call and restored after it
    sets.clear()
    do.interop.torch(fn, x).sync_on(s)
    assert len(sets) == 2 and seen[-1] == s.handle_int


def test_torch_module_recorded_in_a_graph_and_replayed(backend):
    """A PyTorch module through the adapter inside do.graph.scope: the replay runs it again on
    new input, and what PyTorch allocated while recording stays the graph's (other PyTorch work
    afterwards does not get that memory)."""
    torch = _torch_on_cuda("the host backend runs fn at each replay; this is cuda's recording of PyTorch's kernels")
    if getattr(torch.cuda, "MemPool", None) is None:
        pytest.skip("PyTorch without torch.cuda.MemPool")
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 32)).cuda()
    rng = np.random.default_rng(0)

    def fwd(t):
        with torch.no_grad():
            return mlp(t)

    def eager(x0):
        with torch.no_grad():
            return mlp(torch.from_numpy(x0).cuda()).cpu().numpy()

    x = do.zeros((8, 64), do.float32).sync()
    do.interop.torch(fwd, x).sync()  # warm-up: cuBLAS's handle and workspace for the stream
    with do.graph.scope() as sc:
        out = sc.record(do.interop.torch(fwd, x))
    g = sc.graph
    assert g.nodes >= 3 and type(out) is do.Tensor and out.shape == (8, 32)
    for _ in range(3):
        x0 = rng.standard_normal((8, 64)).astype(np.float32)
        do.from_numpy(x0).then(lambda t: K.copy(x.view(512).partition((128,)), t.view(512))).sync()
        got = g.launch().then(do.to_numpy).sync()
        np.testing.assert_allclose(got, eager(x0), rtol=2e-3, atol=2e-3)
    # what PyTorch allocated while recording (fn's intermediates, freed since) is in a pool the
    # graph keeps: PyTorch's other work does not get that memory while the graph can replay
    pools = [k for k in g._rec.keep if isinstance(k, torch.cuda.MemPool)]
    assert len(pools) == 1
    segs = [(sg["address"], sg["address"] + sg["total_size"]) for sg in pools[0].snapshot()]
    assert segs  # the recording's allocations came from it
    junk = [torch.full((n,), 7.0, device="cuda") for n in (1024, 2048, 32 * 8, 128 * 8) for _ in range(16)]
    assert not any(lo <= j.data_ptr() < hi for j in junk for lo, hi in segs)
    got = g.launch().then(do.to_numpy).sync()
    np.testing.assert_allclose(got, eager(x0), rtol=2e-3, atol=2e-3)


def test_torch_graphs_records_a_module_per_bucket_and_replays_it(backend):
    """do.interop.torch_graphs: one recording per bucket (warmed up first), inputs padded to
    their bucket, the rows of the input's length back; too large runs eagerly."""
    torch = _torch()
    if _cuda() and getattr(torch.cuda, "MemPool", None) is None:
        pytest.skip("PyTorch without torch.cuda.MemPool")
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).eval()
    if _cuda():
        mlp = mlp.cuda()

    def fwd(t):
        with torch.no_grad():
            return mlp(t)

    def eager(x0):
        with torch.no_grad():
            t = torch.from_numpy(x0)
            return mlp(t.cuda() if _cuda() else t).cpu().numpy()

    graphs = do.interop.torch_graphs(fwd, buckets=[4, 8])
    rng = np.random.default_rng(0)
    for n in (3, 4, 1, 7, 8, 3):
        x0 = rng.standard_normal((n, 16)).astype(np.float32)
        got = do.from_numpy(x0).then(graphs).then(do.to_numpy).sync()
        assert got.shape == (n, 8)
        np.testing.assert_allclose(got, eager(x0), rtol=2e-3, atol=2e-3)
    st = graphs.stats()
    assert st["misses"] == 2 and st["hits"] == 4 and st["eager"] == 0
    x0 = rng.standard_normal((9, 16)).astype(np.float32)  # larger than every bucket: eager
    got = do.from_numpy(x0).then(graphs).then(do.to_numpy).sync()
    np.testing.assert_allclose(got, eager(x0), rtol=2e-3, atol=2e-3)
    assert graphs.stats()["eager"] == 1


def test_torch_graphs_refuses_what_it_cannot_record(host_backend):
    torch = pytest.importorskip("torch")
    with pytest.raises(do.UsageError, match="callable"):
        do.interop.torch_graphs(42)  # type: ignore[arg-type]
    graphs = do.interop.torch_graphs(lambda t: (t * 2, t), buckets=[4])
    with pytest.raises(do.UsageError, match="returns one tensor"):
        do.from_numpy(np.ones((2, 3), np.float32)).then(graphs).sync()
    assert torch is not None


def test_torch_adapter_bad_input(host_backend):
    pytest.importorskip("torch")
    x = do.zeros(4, do.float32).sync()
    with pytest.raises(do.UsageError, match="callable"):
        do.interop.torch(3, x)
    with pytest.raises(do.UsageError, match="tuple or list"):
        do.interop.torch(lambda t: t, x, writes=np.zeros(4, np.float32))


def test_torch_tensors_as_reads_and_writes(host_backend):
    torch = pytest.importorskip("torch")
    src = torch.arange(64, dtype=torch.float32)
    dst = torch.zeros(64)
    do.external(lambda stream: dst.copy_(src), reads=(src,), writes=(dst,)).sync()
    assert torch.equal(dst, src)
    from deviceop._core._regions import access_of
    from deviceop.device import current

    a = access_of(dst, current(), False, "t")[0]
    b = access_of(dst[8:], current(), False, "t")[0]
    assert a.accesses is b.accesses  # one storage, one region


def test_a_torch_tensor_named_again_after_changing_in_place_is_described_again(host_backend):
    """A PyTorch tensor named again is not described again while its data address and size in
    bytes stay; after an in-place change of either, its byte range and region are the new ones."""
    torch = pytest.importorskip("torch")
    from deviceop._core._regions import access_of
    from deviceop.device import current

    be = current()
    t = torch.zeros(64)
    buf, lo, hi, w = access_of(t, be, True, "t")
    assert (hi - lo, w) == (256, True)
    again = access_of(t, be, False, "t")
    assert again[0].accesses is buf.accesses and again[1:] == (lo, hi, False)
    t.resize_(16)  # smaller: the same address, another shape
    assert access_of(t, be, True, "t")[1:3] == (lo, lo + 64)
    other = torch.ones(1024)
    t.set_(other)  # another storage: another address and region
    buf3, lo3, hi3, _ = access_of(t, be, True, "t")
    assert hi3 - lo3 == 4096 and buf3.accesses is not buf.accesses
    assert buf3.accesses is access_of(other, be, False, "o")[0].accesses
    # the wrapper keeps the tensor alive while work uses it; the cache itself does not
    ref = weakref.ref(t)
    del t, buf, again, buf3  # (each wrapper keeps its tensor alive)
    gc.collect()
    assert ref() is None


def test_many_torch_tensors_named_in_turn_keep_their_own_accesses(host_backend):
    """More tensors than the compiled cache finds without a lookup, named in turn twice, and
    tensors made where dead ones were (often at their address): every access is its own
    tensor's, with its own byte range."""
    torch = pytest.importorskip("torch")
    from deviceop._core._regions import access_of
    from deviceop.device import current

    be = current()
    ts = [torch.zeros(16 + i) for i in range(200)]
    for _ in range(2):
        for i, t in enumerate(ts):
            buf, lo, hi, _ = access_of(t, be, False, "t")
            assert buf.owner is t and hi - lo == 4 * (16 + i)
    for i in range(300):
        t = torch.zeros(8 + i % 7)
        buf, lo, hi, _ = access_of(t, be, False, "t")
        assert buf.owner is t and hi - lo == 4 * (8 + i % 7)
        del t, buf


def test_torch_tensor_subclasses_named_again_are_recognised(host_backend):
    """A Parameter is read through PyTorch's own C getters; a subclass that overrides ``nbytes``
    in Python is read through its override. Both are recognised when named again, and a change
    of size in place is seen."""
    torch = pytest.importorskip("torch")
    from deviceop._core._regions import access_of
    from deviceop.device import current

    class Counted(torch.Tensor):
        reads = 0

        @property
        def nbytes(self):
            type(self).reads += 1
            return super().nbytes

    be = current()
    p = torch.nn.Parameter(torch.zeros(32))
    t = torch.zeros(16).as_subclass(Counted)
    for x, n in ((p, 128), (t, 64)):
        first = access_of(x, be, False, "x")
        again = access_of(x, be, True, "x")
        assert again[0].accesses is first[0].accesses and again[1:] == (first[1], first[1] + n, True)
    assert Counted.reads >= 2  # described, then checked through the override
    with torch.no_grad():
        t.resize_(8)
    buf, lo, hi, _ = access_of(t, be, False, "t")
    assert hi - lo == 32 and buf.owner is t


def count_descriptions(monkeypatch) -> list:
    """The shapes of the foreign arrays described (interop's ``_describe``) from now on."""
    from deviceop._core import _regions

    calls: list = []
    describe = _regions._describe

    def counting(obj, be, what):
        calls.append(obj.shape)
        return describe(obj, be, what)

    monkeypatch.setattr(_regions, "_describe", counting)
    return calls


def test_a_torch_tensor_named_by_many_ops_is_described_once(host_backend, monkeypatch):
    """Ops naming the same unchanged PyTorch tensor reuse its description (the compiled cache):
    it is described once, and again only after an in-place change of the bytes it spans (a
    change of shape over the same bytes needs none); every op registers the same region, and
    the op's wrapper keeps the tensor alive."""
    torch = pytest.importorskip("torch")
    calls = count_descriptions(monkeypatch)
    t = torch.zeros(64)
    ops = [do.external(lambda stream: None, reads=(t,), writes=(t,)) for _ in range(5)]
    assert len(calls) == 1
    bufs = {id(a[0].accesses) for op in ops for a in op.acc}
    assert len(bufs) == 1 and all(a[0].owner is t for op in ops for a in op.acc)
    assert all(a[1:3] == (0, 256) for op in ops for a in op.acc)
    for op in ops:
        op.sync()
    t.unsqueeze_(0)  # another shape over the same bytes: the description holds
    do.external(lambda stream: None, writes=(t,)).sync()
    assert len(calls) == 1
    t.resize_(32)  # fewer bytes at the same address: described again
    assert do.external(lambda stream: None, writes=(t,)).acc[0][1:3] == (0, 128)
    assert len(calls) == 2
    t.resize_(64)  # grown back in place (its storage had room): the span grows with it
    op = do.external(lambda stream: None, writes=(t,))
    assert op.acc[0][1:3] == (0, 256) and len(calls) == 3
    op.sync()
    ref = weakref.ref(t)
    del t, ops, op
    gc.collect()
    assert ref() is None  # the cache holds the tensor weakly


def test_a_torch_tensor_is_compared_by_the_span_its_shape_and_strides_reach(host_backend, monkeypatch):
    """Where PyTorch publishes the DLPack C exchange API, a tensor named again is compared by
    the bytes its shape and strides reach: ``as_strided_`` over fewer bytes at the same address
    is described again, a transpose over the same bytes is not. Subclasses are read through
    their descriptors (a subclass may override them)."""
    torch = pytest.importorskip("torch")
    from deviceop._core import _external

    if not _external.uses_exchange(torch.Tensor):
        pytest.skip("this PyTorch has no DLPack C exchange API")
    assert not _external.uses_exchange(torch.nn.Parameter)
    t = torch.zeros(64)
    base = t.data_ptr()
    assert _external.extent(t) == (base, 256)
    assert _external.extent(t[::2]) == (base, 252)  # 32 elements 8 bytes apart: 31 * 8 + 4
    assert _external.extent(t[3:5]) == (base + 12, 8)
    assert _external.extent(t.view(8, 8).t()) == (base, 256)
    assert _external.extent(t[:0]) == (0, 0)  # no bytes
    assert _external.extent(torch.zeros(()))[1] == 4
    calls = count_descriptions(monkeypatch)
    m = torch.zeros(8, 8)
    assert do.external(lambda stream: None, writes=(m,)).acc[0][1:3] == (0, 256)
    m.t_()  # the same bytes: the description holds
    do.external(lambda stream: None, writes=(m,)).sync()
    assert len(calls) == 1
    m.as_strided_((8,), (8,))  # a column: 7 * 32 + 4 bytes from the same address
    assert do.external(lambda stream: None, writes=(m,)).acc[0][1:3] == (0, 228)
    assert len(calls) == 2


def test_a_torch_tensors_layout_is_read_in_one_call_as_its_getters_give_it(host_backend):
    """``layout`` (what the adapter reads of every tensor PyTorch code returns) gives what the
    tensor's getters give: address, shape, element strides, the byte span they reach, its
    DLPack dtype and device; None for a subclass (which may override the getters)."""
    torch = pytest.importorskip("torch")
    from deviceop._core import _external
    from deviceop._core._regions import span

    if not _external.uses_exchange(torch.Tensor):
        pytest.skip("this PyTorch has no DLPack C exchange API")
    z = torch.zeros(64)
    cases = [
        z,
        z.view(8, 8).t(),
        z[::3],
        z.view(8, 8)[2:5, 1::2],
        z.flip(0),  # a copy: PyTorch has no negative strides
        z[:0].view(0, 4),
        torch.zeros(()),
        torch.zeros(5, 1, 3, dtype=torch.float16),
        torch.zeros(4, 4, dtype=torch.bfloat16).t(),
        torch.zeros(3, dtype=torch.int64),
        torch.zeros(3, dtype=torch.uint8),
    ]
    codes = {}
    for t in cases:
        ptr, shape, strides, key, dev, lo, hi = _external.layout(t)
        it = t.element_size()
        assert (ptr, shape, strides) == (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        assert (lo, hi) == span(t.data_ptr(), tuple(t.shape), tuple(s * it for s in t.stride()), it)
        assert dev == 1 and (key >> 8) & 0xFF == 8 * it and key & 0xFF == 1  # CPU; bits; one lane
        assert codes.setdefault(t.dtype, key) == key
    assert len(set(codes.values())) == len(codes)  # each dtype its own key
    assert _external.layout(torch.nn.Parameter(torch.zeros(2))) is None


def test_asyncio_gather_of_externals(backend):
    async def main():
        xs = [await do.zeros(128, do.float32) for _ in range(8)]
        outs = await asyncio.gather(*(do.external(lib_fill, x, float(i), 128, writes=(x,)) for i, x in enumerate(xs)))
        return xs, outs

    xs, outs = asyncio.run(main())
    assert outs == ["filled"] * 8
    for i, x in enumerate(xs):
        np.testing.assert_array_equal(x.numpy(), np.full(128, float(i), np.float32))


def test_deviceop_streams_out_to_torch_and_cupy(backend):
    """PyTorch and CuPy run on a deviceop stream through its handle; the ledger orders deviceop
    work after theirs once named (an external step with no work of its own)."""
    if not _cuda():
        pytest.skip("CUDA streams")
    s = do.streams()[0]
    assert s.__cuda_stream__() == (0, s.handle_int) and int(s.handle) == s.handle_int
    ran = 0
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        ts = torch.cuda.ExternalStream(s.handle_int)
        assert ts.cuda_stream == s.handle_int
        x = torch.zeros(1024, device="cuda")
        # (zeros ran on PyTorch's stream: the fill on ours waits for it, as PyTorch's rules ask;
        # without it a sanitizer's timing lets the zeros land after the fill)
        ts.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(ts):
            x.fill_(3.0)
        t = do.from_dlpack(x)
        np.testing.assert_array_equal(do.to_numpy(t).sync_on(s), np.full(1024, 3.0, np.float32))
        ran += 1
    try:
        import cupy
    except ImportError:
        cupy = None
    if cupy is not None:
        cs = cupy.cuda.ExternalStream(s.handle_int)
        with cs:
            y = cupy.full(512, 5.0, dtype=cupy.float32)
        np.testing.assert_array_equal(do.to_numpy(do.from_dlpack(y)).sync_on(s), np.full(512, 5.0, np.float32))
        ran += 1
    if not ran:
        pytest.skip("neither PyTorch with CUDA nor CuPy is installed")


def test_torch_tensors_in_one_set_of_the_cache_are_found_without_a_lookup(host_backend):
    """Two PyTorch tensors whose addresses fall in one set of the compiled cache's slots, named
    in turn again and again (a step's inputs), are both found in the slots: naming them looks
    nothing up in the cache's dict. A third tensor in the set takes the older way, and all
    three keep their own accesses."""
    torch = pytest.importorskip("torch")
    from deviceop._core import _external
    from deviceop._core._regions import access_of
    from deviceop.device import current

    be = current()
    ts = [torch.zeros(16) for _ in range(400)]
    by_set: dict[int, list] = {}
    for t in ts:
        by_set.setdefault(_external.set_of(t), []).append(t)
    group = max(by_set.values(), key=len)
    assert len(group) >= 3  # 400 tensors in 64 sets
    a, b, c = group[:3]
    for t in (a, b):
        access_of(t, be, False, "t")  # described and remembered
    before = _external.looked_up()
    for _ in range(10):
        for t in (a, b):
            assert _external.seen(t, be, False)[0].owner is t
    assert _external.looked_up() == before
    for t in (c, a, b, c):
        buf, lo, hi, _ = access_of(t, be, True, "t")
        assert buf.owner is t and hi - lo == 64


def test_adapter_alias_cache_gives_one_alias_while_its_metadata_is_as_made(host_backend):
    """The adapter's alias cache itself (``_view``), on host memory (PyTorch's CPU build reads it
    through the same DLPack exchange): one alias while its address, dtype, shape, strides and
    requires_grad are as made, a new one as made after any of them changed in place, made
    outside inference mode; an entry the adapter made of a PyTorch output gets its alias at the
    first call."""
    torch = pytest.importorskip("torch")
    from deviceop._core._external import same_layout, uses_exchange
    from deviceop.interop import _torch as adapter

    if not uses_exchange(torch.Tensor):
        pytest.skip("this PyTorch publishes no DLPack exchange API: every call gets an alias of its own")
    x = do.full((4, 8), 1.0, do.float32).sync()
    v = adapter._view(torch, x)
    assert adapter._view(torch, x) is v and same_layout(v, x) and v.data_ptr() == x.ptr
    changes = [
        lambda t: t.t_(),
        lambda t: t.unsqueeze_(0),
        lambda t: t.requires_grad_(),
        lambda t: setattr(t, "data", t.view(torch.int32)),
        lambda t: t.as_strided_((2, 8), (8, 1), 8),
    ]
    for change in changes:
        change(v)
        assert not same_layout(v, x) or v.requires_grad
        w = adapter._view(torch, x)
        assert w is not v and tuple(w.shape) == (4, 8) and w.stride() == (8, 1)
        assert w.dtype == torch.float32 and not w.requires_grad and w.data_ptr() == x.ptr
        v = w
    with torch.inference_mode():
        v.t_()
        w = adapter._view(torch, x)
    assert not w.is_inference() and tuple(w.shape) == (4, 8)
    # an entry made of a PyTorch output (as _wrap makes it): its alias at the first call
    y = do.full((2, 3), 5.0, do.float32).sync()
    made = torch.from_dlpack(y)
    set_foreign(y, [made.detach(), None])
    a = adapter._view(torch, y)
    assert a is not made and a.data_ptr() == made.data_ptr() and adapter._view(torch, y) is a
    assert not same_layout(torch.ones(3), y)  # another tensor entirely
    set_foreign(y, None)
