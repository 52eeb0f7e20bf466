"""Tensors: allocation ops, numpy round trips for every dtype, metadata, views, partitions."""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest
from helpers import ALL_DTYPES, FLOAT_DTYPES, K, random_array, run_threads, slow_fill

import deviceop as do
from deviceop._core._base import lent_bytes, set_lend_cap, staging_blocks
from deviceop.device import current as current_backend

DT_IDS = [d.name for d in ALL_DTYPES]


def _expected_device(backend: str) -> str:
    return "host:0" if backend == "host" else "cuda:0"


@pytest.mark.parametrize("dt", ALL_DTYPES, ids=DT_IDS)
def test_from_numpy_round_trip(backend, dt):
    rng = np.random.default_rng()
    a = random_array(rng, (7, 33), dt)
    t = do.from_numpy(a).sync()
    b = t.numpy()
    assert b.dtype == dt.np_dtype and b.shape == a.shape
    np.testing.assert_array_equal(b.view(np.uint8), a.view(np.uint8))  # bit-exact
    # to_numpy as an op gives the same
    np.testing.assert_array_equal(do.to_numpy(t).sync().view(np.uint8), a.view(np.uint8))


@pytest.mark.parametrize("dt", ALL_DTYPES, ids=DT_IDS)
def test_from_numpy_snapshots_the_array(backend, dt):
    a = np.zeros(16, dt.np_dtype)
    op = do.from_numpy(a).then(do.to_numpy)
    out = op.sync()
    a[:] = 1  # after the copy ran: must not change the device tensor
    np.testing.assert_array_equal(out, np.zeros(16, dt.np_dtype))


@pytest.mark.parametrize(
    "make",
    [
        lambda a: np.asfortranarray(a),
        lambda a: a[:, ::2],
        lambda a: a.T,
        lambda a: a[::-1],
    ],
    ids=["fortran", "strided", "transposed", "reversed"],
)
def test_from_numpy_of_a_non_contiguous_array_copies_its_elements_in_order(backend, make):
    a = make(np.arange(8 * 6, dtype=np.float32).reshape(8, 6))
    t = do.from_numpy(a).sync()
    assert t.shape == a.shape and t.is_contiguous()
    np.testing.assert_array_equal(t.numpy(), a)


#: the staging classes a 16 KiB copy may take: its own, or an idle one up to 16 times larger
_FROM_16K = {16384 << k for k in range(5)}


def _idle_staging() -> int:
    return sum(staging_blocks(current_backend().driver).values())


def test_staging_blocks_are_reused_and_given_back_after_each_execution(backend):
    if backend == "host":
        pytest.skip("the host backend copies without staging blocks")
    a = np.arange(3000, dtype=np.float32)
    do.to_numpy(do.from_numpy(a)).sync()  # the size classes this test uses exist now
    idle = _idle_staging()
    for k in range(50):
        np.testing.assert_array_equal(do.to_numpy(do.from_numpy(a + k)).sync(), a + k)
    assert _idle_staging() == idle, "each copy gives its staging block back when it completes"
    # a failure while enqueuing: what was enqueued completes, its blocks come back
    t = do.from_numpy(a).sync()

    def fail(_arr):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        do.to_numpy(t).map(fail).then(lambda _: do.value(0)).sync()
    assert _idle_staging() == idle


def test_a_copy_takes_an_idle_larger_staging_block_before_it_allocates(backend):
    """A copy whose size class has no idle block takes the smallest idle block of up to 16 times
    its size (cuMemHostAlloc costs milliseconds on the enqueuing thread); the block goes back to
    its own class afterwards."""
    if backend == "host":
        pytest.skip("the host backend copies without staging blocks")
    small = 256 << 10
    classes = [small << k for k in range(1, 5)]
    r = do.to_numpy(do.from_numpy(np.ones(900 << 10, np.uint8))).sync()  # a 1 MiB block idles after
    del r
    gc.collect()
    t = do.from_numpy(np.arange(200 << 10, dtype=np.uint8)).sync()
    held = []  # results holding the small class's idle blocks: none idle after
    while staging_blocks(current_backend().driver).get(small, 0):
        held.append(do.to_numpy(t).sync())
    before = staging_blocks(current_backend().driver)
    taken = next(c for c in classes if before.get(c, 0))
    r = do.to_numpy(t).sync()
    np.testing.assert_array_equal(r, np.arange(200 << 10, dtype=np.uint8))
    after = staging_blocks(current_backend().driver)
    assert after.get(small, 0) == 0 and after[taken] == before[taken] - 1, (before, after)
    assert all(after.get(c, 0) == before.get(c, 0) for c in classes if c != taken)
    del r
    gc.collect()
    assert staging_blocks(current_backend().driver)[taken] == before[taken]  # back to its own class
    held.clear()


def test_to_numpy_results_live_in_lent_page_locked_blocks(backend):
    """A contiguous result's memory is a staging block lent to the array (the copy lands there):
    the array and its views keep it; it goes back to the pool, and is reused, when they are gone."""
    if backend == "host":
        pytest.skip("the host backend copies without staging blocks")
    base = lent_bytes()
    a = np.arange(3000, dtype=np.float32)
    do.to_numpy(do.from_numpy(a)).sync()  # the size classes this test uses exist now
    idle = _idle_staging()
    r = do.to_numpy(do.from_numpy(a)).sync()
    np.testing.assert_array_equal(r, a)
    assert r.flags.writeable and r.flags.c_contiguous and r.shape == a.shape
    # its class, or a larger idle one (a copy takes one before it allocates)
    lent = lent_bytes() - base
    assert lent in _FROM_16K and _idle_staging() == idle - 1, (lent, _idle_staging(), idle)
    v = r[10:]
    del r
    gc.collect()
    assert lent_bytes() == base + lent  # a view keeps the block
    v[0] = -1.0
    np.testing.assert_array_equal(v[1:], a[11:])
    del v
    gc.collect()
    assert lent_bytes() == base and _idle_staging() == idle
    # many results at once, each its own block; all come back
    rs = [do.to_numpy(do.from_numpy(a + k)).sync() for k in range(20)]
    for k, r in enumerate(rs):
        np.testing.assert_array_equal(r, a + k)
    del rs, r
    gc.collect()
    assert lent_bytes() == base


def test_a_lent_block_stays_with_its_execution_until_the_copy_completes(backend):
    """Dropping the result (and its future) while the copy is still to run does not give the
    block back early: the execution holds it until the work has completed."""
    if backend == "host":
        pytest.skip("the host backend copies without staging blocks")
    base = lent_bytes()
    t = do.zeros(4096, do.float32).sync()
    fut = do.to_numpy(slow_fill(t, 3.0, 0.3).map(lambda _: t)).submit()
    del fut
    gc.collect()
    assert lent_bytes() - base in _FROM_16K
    deadline = time.monotonic() + 10
    while lent_bytes() != base and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lent_bytes() == base
    np.testing.assert_array_equal(t.numpy(), np.full(4096, 3.0, np.float32))


def test_past_the_lending_cap_results_are_copied_into_memory_of_their_own(backend):
    if backend == "host":
        pytest.skip("the host backend copies without staging blocks")
    a = np.arange(1000, dtype=np.int32)
    base = lent_bytes()
    prev = set_lend_cap(0)
    try:
        r = do.to_numpy(do.from_numpy(a)).sync()
        assert r.base is None and lent_bytes() == base
        np.testing.assert_array_equal(r, a)
    finally:
        set_lend_cap(prev)
    with pytest.raises(do.UsageError, match="bytes >= 0"):
        set_lend_cap(-1)


@pytest.mark.parametrize("shape", [(), (0,), (5,), (3, 4), (2, 0, 3), (16, 2048)])
def test_an_allocated_tensor_has_the_layout_a_tensor_made_on_its_buffer_has(backend, shape):
    """Allocations make their tensors from a table of layouts seen before; every field is what
    the Tensor constructor works out, for fresh buffers of a known layout too."""
    from deviceop._core._tensor import Tensor

    for dt in (do.float16, do.float32, do.int64):
        for _ in range(2):  # the second time from the table
            t = do.empty(shape, dt).sync()
            u = Tensor(t.buffer, shape, dt)
            assert type(t) is Tensor
            fields = ("shape", "strides", "size", "offset", "addr", "_span", "_key", "nbytes", "dtype")
            assert [getattr(t, f) for f in fields] == [getattr(u, f) for f in fields]


def test_a_tensor_made_at_a_layout_has_every_field_the_constructor_gives(backend):
    """``tensor_at`` (how wrapped foreign outputs are made) gives what the constructor gives,
    through its table of layouts for a contiguous tensor at the buffer's start and through the
    constructor otherwise; no fresh-tensor hook sees it (it allocates nothing)."""
    from deviceop._core._base import set_fresh_tensor_hook, tensor_at
    from deviceop._core._tensor import Tensor

    buf = do.empty((64,), do.float32).sync().buffer
    seen = []
    prev = set_fresh_tensor_hook(seen.append)  # (the stub driver's, under it)
    try:
        for shape, strides, off in [((4, 16), (16, 1), 0), ((16, 4), (1, 16), 0), ((4, 8), (8, 1), 32), ((), (), 0)]:
            t = tensor_at(Tensor, buf, shape, do.float32, strides, off)
            u = Tensor(buf, shape, do.float32, strides, off)
            assert type(t) is Tensor
            fields = ("shape", "strides", "size", "offset", "addr", "_span", "_key", "nbytes", "dtype")
            assert [getattr(t, f) for f in fields] == [getattr(u, f) for f in fields]
    finally:
        set_fresh_tensor_hook(prev)
    assert seen == []


def test_forgetting_a_devices_layouts_forgets_its_fresh_tensor_layouts(backend):
    """A device's layout ids are dropped when it closes; allocations then work the layout out
    again (the table of fresh layouts holds nothing of the device either)."""
    from deviceop._core._base import forget_layouts
    from deviceop._core._tensor import Tensor

    t1 = do.empty((7, 3), do.float32).sync()
    t1b = do.empty((7, 3), do.float32).sync()
    assert t1b._key == t1._key
    forget_layouts(t1.buffer.backend)
    t2 = do.empty((7, 3), do.float32).sync()
    assert t2._key != t1._key and t2._key == Tensor(t2.buffer, (7, 3), do.float32)._key


def test_threads_copying_through_the_staging_pool_get_their_own_data(backend):
    rounds = 40

    def worker(k: int) -> None:
        rng = np.random.default_rng(k)
        s = do.streams()[k % len(do.streams())]
        for _ in range(rounds):
            n = int(rng.integers(1, 40_000))  # several size classes, taken and given back at once
            a = rng.standard_normal(n).astype(np.float32)
            np.testing.assert_array_equal(do.to_numpy(do.from_numpy(a)).sync_on(s), a)

    assert run_threads(worker, 6) == []


@pytest.mark.parametrize("dt", ALL_DTYPES, ids=DT_IDS)
def test_zeros_ones_full_empty(backend, dt):
    shape = (5, 12)
    z = do.zeros(shape, dt).sync()
    o = do.ones(shape, dt).sync()
    e = do.empty(shape, dt).sync()
    v = 2**40 + 3 if dt is do.int64 else (200 if dt is do.uint8 else (-7 if not dt.is_float else 1.5))
    f = do.full(shape, v, dt).sync()
    for t in (z, o, e, f):
        assert t.shape == shape and t.dtype is dt
        assert t.nbytes == 60 * dt.itemsize
        assert t.device == _expected_device(backend)
        assert t.ndim == 2 and len(t) == 5
    np.testing.assert_array_equal(z.numpy(), np.zeros(shape, dt.np_dtype))
    np.testing.assert_array_equal(o.numpy(), np.ones(shape, dt.np_dtype))
    np.testing.assert_array_equal(f.numpy(), np.full(shape, v, dt.np_dtype))
    assert e.numpy().shape == shape and e.numpy().dtype == dt.np_dtype


@pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=[d.name for d in FLOAT_DTYPES])
def test_full_nan_and_negative(backend, dt):
    assert np.isnan(do.full(9, np.nan, dt).sync().numpy().astype(np.float32)).all()
    np.testing.assert_array_equal(do.full(9, -0.5, dt).sync().numpy(), np.full(9, -0.5, dt.np_dtype))


def test_dtype_given_as_numpy_dtype_or_name(backend):
    assert do.zeros(3, np.int32).sync().dtype is do.int32
    assert do.zeros(3, "bfloat16").sync().dtype is do.bfloat16
    assert do.zeros(3).sync().dtype is do.float32  # the default


def test_zero_size_tensor(backend):
    t = do.zeros((0, 4), do.float32).sync()
    assert t.shape == (0, 4) and t.nbytes == 0
    assert t.numpy().shape == (0, 4)


def test_scalar_shape_int(backend):
    t = do.ones(10, do.int64).sync()
    assert t.shape == (10,)


def test_view_shares_memory(backend):
    t = do.zeros((8, 64), do.float32).sync()
    v = t.view(-1)
    assert v.shape == (512,) and v.buffer is t.buffer
    K.fill(v.partition((128,)), 4.0).sync()
    np.testing.assert_array_equal(t.numpy(), np.full((8, 64), 4.0, np.float32))
    assert t.view((4, 128)).shape == (4, 128)


def test_a_view_made_by_hand_must_stay_inside_its_buffer(backend):
    """The constructor refuses a view reaching outside its buffer or with strides that do not
    match its shape (kernels, copies and the ledger take a view's span as given)."""
    from deviceop._core._tensor import Tensor

    t = do.zeros(4, do.float32).sync()
    for shape, strides, offset in [((256,), None, 0), ((2,), (1,), 12), ((4,), (-1,), 0), ((2, 2), (2, 1), 4)]:
        with pytest.raises(do.ShapeError, match=r"reaches bytes \[-?\d+, \d+\) of a buffer of 16"):
            Tensor(t.buffer, shape, do.float32, strides, offset)
    with pytest.raises(do.ShapeError, match="needs 1 strides"):
        Tensor(t.buffer, (4,), do.float32, (1, 1), 0)
    assert Tensor(t.buffer, (4,), do.float32, (-1,), 12).span == (0, 16)  # (reversed: inside)
    assert Tensor(t.buffer, (0,), do.float32, (1,), 16).size == 0
    with pytest.raises(do.ShapeError, match="int or a tuple of ints"):
        t.view("ab")


def test_kernel_writes_through_a_row_slice(backend):
    t = do.zeros((8, 64), do.float32).sync()
    s = t[2:5]
    assert s.shape == (3, 64) and s.is_contiguous() and s.buffer is t.buffer
    K.fill(s.partition((1, 64)), 5.0).sync()
    expect = np.zeros((8, 64), np.float32)
    expect[2:5] = 5.0
    np.testing.assert_array_equal(t.numpy(), expect)


def test_kernel_writes_through_an_index_and_a_view_of_a_slice(backend):
    t = do.full((4, 8, 32), -1.0, do.float16).sync()
    row = t[1, 3]  # shape (32,), offset into the middle of the buffer
    K.fill(row.partition((32,)), 2.0).sync()
    sub = t[2:4].view((2, 256))
    K.fill(sub.partition((1, 256)), 3.0).sync()
    expect = np.full((4, 8, 32), -1.0, np.float16)
    expect[1, 3] = 2.0
    expect[2:4] = 3.0
    np.testing.assert_array_equal(t.numpy(), expect)


@pytest.mark.parametrize(
    "key",
    [
        np.s_[:, 1:7:2],
        np.s_[1::2],
        np.s_[::3, ::2],
        np.s_[..., 2],
        np.s_[3],
        np.s_[2:5, 4],
        np.s_[-1, -3:],
    ],
    ids=["cols-step", "rows-step", "both-steps", "ellipsis", "int", "slice-int", "negative"],
)
@pytest.mark.parametrize("dt", [do.float32, do.bfloat16, do.int64, do.uint8], ids=lambda d: d.name)
def test_non_contiguous_slices_read_back(backend, key, dt):
    rng = np.random.default_rng()
    a = random_array(rng, (6, 8), dt)
    t = do.from_numpy(a).sync()
    s = t[key]
    expect = a[key]
    assert s.shape == expect.shape
    got = s.numpy()
    np.testing.assert_array_equal(got.view(np.uint8), np.ascontiguousarray(expect).view(np.uint8))
    np.testing.assert_array_equal(do.to_numpy(s).sync(), expect)


def test_strided_slice_is_not_contiguous(backend):
    t = do.zeros((6, 8), do.float32).sync()
    assert t.is_contiguous()
    assert not t[:, ::2].is_contiguous()
    assert not t[:, 1:3].is_contiguous()
    assert t[1:3].is_contiguous()


def test_partition_grid(backend):
    t = do.zeros((16, 64), do.float32).sync()
    p = t.partition((4, 64))
    assert p.grid == (4, 1) and p.tile == (4, 64)
    assert p.tensor is t and p.shape == (16, 64) and p.dtype is do.float32
    assert t.partition((4, 32)).grid == (4, 2)
    assert t.partition((1, 1)).grid == (16, 64)
    assert do.zeros(1024).sync().partition((128,)).grid == (8,)
    assert do.zeros((2, 4, 8)).sync().partition((1, 2, 8)).grid == (2, 2, 1)


def test_partitions_of_a_known_layout_skip_validation_and_equal_validated_ones(backend, monkeypatch):
    from deviceop._core import _tensor

    first = do.zeros((16, 64), do.float32).sync().partition((4, 64))
    validated = []
    real_init = _tensor.Partition.__init__

    def counting_init(self, tensor, tile):
        validated.append(tile)
        real_init(self, tensor, tile)

    monkeypatch.setattr(_tensor.Partition, "__init__", counting_init)
    fresh = do.zeros((16, 64), do.float32).sync()  # a new tensor of the same layout
    p = fresh.partition((4, 64))
    assert validated == []
    assert type(p) is do.Partition and p.tensor is fresh
    assert (p.tile, p.grid, p._key) == (first.tile, first.grid, first._key)
    assert repr(p) == repr(first)
    # what is not plainly the same tile is validated (and refused) as before
    for bad, match in (((True, 64), "non-negative"), ((4.0, 64), "non-negative"), ((5, 64), "divide")):
        with pytest.raises(do.ShapeError, match=match):
            fresh.partition(bad)
    assert fresh.partition([4, 64]).grid == (4, 1)  # a list: validated, then equal
    assert validated == [(True, 64), (4.0, 64), (5, 64), [4, 64]]
    # another layout (strides) with the same shape is its own entry
    view = do.zeros((16, 128), do.float32).sync()[:, ::2]
    assert view.partition((4, 64)).grid == (4, 1) and validated[-1] == (4, 64)


def test_numpy_after_sync_is_a_copy(backend):
    t = do.full(32, 1.0, do.float32).sync()
    a = t.numpy()
    a[:] = 99
    np.testing.assert_array_equal(t.numpy(), np.full(32, 1.0, np.float32))


def test_repr_names_shape_and_dtype(backend):
    r = repr(do.zeros((2, 3), do.int32).sync())
    assert "(2, 3)" in r and "int32" in r
