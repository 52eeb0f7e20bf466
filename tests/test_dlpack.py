"""Interop: DLPack both ways, __cuda_array_interface__, torch and cupy round trips."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from helpers import K, pool_of, slow_copy, slow_fill

import deviceop as do

N = 1024


def _require(backend: str, name: str) -> None:
    if do.backend_name() != name:
        pytest.skip(f"{name} backend only")


# -- host: numpy ----------------------------------------------------------------------------


def test_numpy_from_dlpack_shares_memory(host_backend):
    a = np.arange(256, dtype=np.float32)
    t = do.from_numpy(a).sync()
    assert t.__dlpack_device__() == (1, 0)
    n = np.from_dlpack(t)
    np.testing.assert_array_equal(n, a)
    assert n.ctypes.data == t.ptr
    # a device write shows through the numpy view
    K.fill(t.partition((128,)), 7.0).sync()
    np.testing.assert_array_equal(n, np.full(256, 7.0, np.float32))


def test_numpy_from_dlpack_of_a_slice(host_backend):
    a = np.arange(48, dtype=np.int32).reshape(6, 8)
    t = do.from_numpy(a).sync()
    n = np.from_dlpack(t[1:5, ::2])
    np.testing.assert_array_equal(n, a[1:5, ::2])


def test_do_from_dlpack_wraps_numpy_without_copy(host_backend):
    a = np.zeros((4, 64), np.float32)
    t = do.from_dlpack(a)
    assert type(t) is do.Tensor and t.shape == (4, 64) and t.dtype is do.float32
    assert t.ptr == a.ctypes.data
    K.fill(t.partition((1, 64)), 3.0).sync()
    np.testing.assert_array_equal(a, np.full((4, 64), 3.0, np.float32))  # written in place
    a[0, 0] = -1
    assert t.numpy()[0, 0] == -1


DL_DTYPES = [do.float16, do.bfloat16, do.float32, do.int32, do.int64, do.uint8]
DL_IDS = ["float16", "bfloat16", "float32", "int32", "int64", "uint8"]


@pytest.mark.parametrize("dt", DL_DTYPES, ids=DL_IDS)
def test_do_from_dlpack_dtypes(host_backend, dt):
    a = np.arange(32).astype(dt.np_dtype)
    t = do.from_dlpack(a)
    assert t.dtype is dt and t.ptr == a.ctypes.data
    np.testing.assert_array_equal(t.numpy(), a)


@pytest.mark.parametrize("dt", DL_DTYPES, ids=DL_IDS)
def test_numpy_from_dlpack_dtypes(host_backend, dt):
    a = np.arange(32).astype(dt.np_dtype)
    t = do.from_numpy(a).sync()
    if dt is do.bfloat16:
        # numpy's DLPack has no bfloat16: deviceop says so instead of handing over a capsule
        with pytest.raises(do.DTypeError, match=r"t\.numpy"):
            np.from_dlpack(t)
        np.testing.assert_array_equal(t.numpy(), a)  # the documented way
        return
    n = np.from_dlpack(t)
    assert n.dtype == dt.np_dtype and n.ctypes.data == t.ptr
    np.testing.assert_array_equal(n, a)


def test_do_from_dlpack_keeps_owner_alive(host_backend):
    a = np.arange(1024, dtype=np.float32)
    expect = a.copy()
    t = do.from_dlpack(a)
    del a
    gc.collect()
    np.testing.assert_array_equal(t.numpy(), expect)


def test_do_from_dlpack_of_a_strided_numpy_array(host_backend):
    a = np.arange(64, dtype=np.float32).reshape(8, 8)
    t = do.from_dlpack(a[:, ::2])
    assert not t.is_contiguous()
    np.testing.assert_array_equal(t.numpy(), a[:, ::2])


def test_host_has_no_cuda_array_interface(host_backend):
    t = do.zeros(4).sync()
    assert not hasattr(t, "__cuda_array_interface__")


def test_from_dlpack_rejects_non_dlpack(host_backend):
    with pytest.raises(do.UsageError, match="__dlpack__"):
        do.from_dlpack([1, 2, 3])


def test_from_dlpack_rejects_unsupported_dtype(host_backend):
    with pytest.raises(do.DTypeError, match="float64"):
        do.from_dlpack(np.zeros(4))


# -- both backends: deviceop <-> deviceop ----------------------------------------------------


def test_dlpack_round_trip_through_deviceop(backend):
    x = np.arange(512, dtype=np.float32)
    t = do.from_numpy(x).sync()
    u = do.from_dlpack(t)
    assert u.ptr == t.ptr and u.shape == t.shape and u.dtype is t.dtype
    K.fill(u.partition((128,)), 2.0).sync()
    np.testing.assert_array_equal(t.numpy(), np.full(512, 2.0, np.float32))
    del t
    gc.collect()
    np.testing.assert_array_equal(u.numpy(), np.full(512, 2.0, np.float32))  # owner kept alive


def test_dlpack_device(backend):
    t = do.zeros(4).sync()
    assert t.__dlpack_device__() == ((1, 0) if backend == "host" else (2, 0))


# -- cuda ---------------------------------------------------------------------------------


def test_cuda_array_interface(backend):
    _require(backend, "cuda")
    t = do.from_numpy(np.arange(64, dtype=np.float32).reshape(8, 8)).sync()
    cai = t.__cuda_array_interface__
    assert cai["shape"] == (8, 8) and cai["typestr"] == "<f4" and cai["version"] == 3
    assert cai["data"] == (t.ptr, False) and cai["strides"] is None
    s = t[:, ::2]
    cs = s.__cuda_array_interface__
    assert cs["strides"] == (32, 8) and cs["data"][0] == t.ptr
    with pytest.raises(do.DTypeError, match="bfloat16"):
        do.zeros(4, do.bfloat16).sync().__cuda_array_interface__


def test_torch_round_trip(backend):
    _require(backend, "cuda")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    x = torch.arange(1024, dtype=torch.float32, device="cuda")
    t = do.from_dlpack(x)
    assert t.ptr == x.data_ptr() and t.shape == (1024,)
    K.scale(t.partition((128,)), t, 2.0).sync()
    torch.cuda.synchronize()
    assert torch.equal(x, 2 * torch.arange(1024, dtype=torch.float32, device="cuda"))
    del x
    gc.collect()
    np.testing.assert_array_equal(t.numpy(), 2 * np.arange(1024, dtype=np.float32))
    # and back: torch views deviceop memory
    u = do.full(256, 5.0, do.bfloat16).sync()
    y = torch.from_dlpack(u)
    assert y.data_ptr() == u.ptr and y.dtype == torch.bfloat16
    K.fill(u.partition((128,)), 6.0).sync()
    torch.cuda.synchronize()
    assert bool((y == 6.0).all())
    del u
    gc.collect()
    assert bool((y == 6.0).all())  # torch keeps the deviceop buffer alive


def test_cupy_round_trip(backend):
    _require(backend, "cuda")
    cp = pytest.importorskip("cupy")
    x = cp.arange(512, dtype=cp.float16)
    t = do.from_dlpack(x)
    assert t.ptr == x.data.ptr and t.dtype is do.float16
    K.fill(t.partition((128,)), 1.5).sync()
    cp.cuda.Device().synchronize()
    assert bool((x == 1.5).all())
    del x
    gc.collect()
    np.testing.assert_array_equal(t.numpy(), np.full(512, 1.5, np.float16))
    u = do.full(256, 3.0, do.float32).sync()
    y = cp.asarray(u)  # __cuda_array_interface__
    assert y.data.ptr == u.ptr
    y2 = cp.from_dlpack(u)
    assert y2.data.ptr == u.ptr
    del u
    gc.collect()
    assert bool((y2 == 3.0).all())


def test_export_capsule_lifetimes(backend):
    """The exporting tensor lives while a capsule of it is unconsumed or consumed and not yet
    released, and not a moment longer; many exports leak nothing."""
    _require(backend, "cuda")
    import sys
    import weakref

    from deviceop._core._dlstructs import _api, _DLManagedTensor, _Imported

    t = do.full(64, 2.0, do.float32).sync()
    base = sys.getrefcount(t)
    for _ in range(2000):
        cap = t.__dlpack__(stream=-1)
        del cap  # dropped unconsumed: the capsule's destructor releases the tensor
    assert sys.getrefcount(t) == base
    cap = t.__dlpack__(stream=-1)
    assert sys.getrefcount(t) == base + 1
    mt = _DLManagedTensor.from_address(_api.PyCapsule_GetPointer(cap, b"dltensor"))
    dl = mt.dl_tensor
    assert (dl.data, dl.ndim, dl.shape[0], dl.strides[0], dl.dtype.code, dl.dtype.bits) == (t.ptr, 1, 64, 1, 2, 32)
    assert (dl.device.device_type, dl.device.device_id) == tuple(t.__dlpack_device__())
    del dl, mt
    ref = weakref.ref(t.buffer)
    _api.PyCapsule_SetName(cap, b"used_dltensor")  # consumed, as a consumer does
    owner = _Imported(_api.PyCapsule_GetPointer(cap, b"used_dltensor"), cap)
    del t, cap
    gc.collect()
    assert ref() is not None, "the exported memory went while the consumer still held it"
    del owner  # the consumer releases it: its deleter drops the tensor
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("how", ["dlpack", "cai"])
def test_an_exported_tensor_is_read_after_every_execution_in_flight_on_it(backend, how):
    """A read of the tensor on stream 0, then a write of it on stream 1 (ordered after that
    read): a consumer's read on stream 2 sees the write, whichever of the two the export finds."""
    _require(backend, "cuda")
    from deviceop.device import current

    be = current()
    s0, s1, s2 = pool_of(3)[:3]
    t = do.full(N, 1.0, do.float32).sync()
    u, v = do.zeros(N, do.float32).sync(), do.zeros(N, do.float32).sync()
    fr = slow_copy(u, t, 0.3).submit(s0)
    fw = slow_fill(t, 7.0, 0.3).submit(s1)
    if how == "dlpack":
        cap = t.__dlpack__(stream=s2.handle_int)  # (what torch.from_dlpack(t) asks on its stream)
    else:
        h = t.__cuda_array_interface__["stream"]  # a CAI v3 consumer waits for this stream
        ev = be.new_event()
        next(x for x in be.streams if x.handle_int == h).record(ev)
        s2.wait(ev)
    be.dtod(v.buffer, 0, t.buffer, 0, t.nbytes, s2)  # the consumer's read, on its stream
    fr.result(timeout=30)
    fw.result(timeout=30)
    s2.synchronize()
    assert (v.numpy() == 7.0).all() and (u.numpy() == 1.0).all()
    if how == "dlpack":
        del cap


def test_an_exported_tensor_is_written_after_every_read_in_flight_on_it(backend):
    """A write of the tensor on stream 0, then a read of it on stream 1: a consumer that writes
    the tensor on stream 2 does so after that read, not into it."""
    _require(backend, "cuda")
    from deviceop.device import current

    be = current()
    s0, s1, s2 = pool_of(3)[:3]
    t = do.zeros(N, do.float32).sync()
    u = do.zeros(N, do.float32).sync()
    fw = slow_fill(t, 1.0, 0.3).submit(s0)
    fr = slow_copy(u, t, 0.3).submit(s1)
    cap = t.__dlpack__(stream=s2.handle_int)
    be.memset(t.buffer, 0, t.nbytes, np.float32(5.0).tobytes(), s2)  # (torch: t_torch.fill_(5))
    fw.result(timeout=30)
    fr.result(timeout=30)
    s2.synchronize()
    assert (u.numpy() == 1.0).all() and (t.numpy() == 5.0).all()
    del cap
