"""Kernels: built-ins against a float64 reference, kernel calls as ops, user kernels, NVRTC."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import ATOL, FLOAT_DTYPES, RTOL, K, ref

import deviceop as do

F_IDS = [d.name for d in FLOAT_DTYPES]
SHAPES = [((1024,), (128,)), ((16, 64), (4, 64)), ((3000,), (1000,)), ((8, 4, 32), (2, 4, 32))]
S_IDS = ["1d", "rows", "odd-tile", "3d"]


def _poisoned(shape, dt) -> do.Tensor:
    return do.full(shape, np.nan, dt).sync()


def _check(out: np.ndarray, expect64: np.ndarray, dt: do.DType) -> None:
    got = ref(out)
    assert not np.isnan(got).any(), f"{np.isnan(got).sum()} elements were never written"
    np.testing.assert_allclose(got, expect64, rtol=RTOL[dt.name], atol=ATOL[dt.name])


def _rand(shape, dt, scale=1.0):
    rng = np.random.default_rng()
    return (rng.standard_normal(shape) * scale).astype(dt.np_dtype)


@pytest.mark.parametrize("shape,tile", SHAPES, ids=S_IDS)
@pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=F_IDS)
def test_fill(backend, dt, shape, tile):
    v = float(np.random.default_rng().standard_normal())
    out = _poisoned(shape, dt)
    K.fill(out.partition(tile), v).sync()
    expect = np.full(shape, ref(np.array(v, dt.np_dtype)))  # v rounded once to dt
    np.testing.assert_array_equal(ref(out.numpy()), expect)


@pytest.mark.parametrize("shape,tile", SHAPES, ids=S_IDS)
@pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=F_IDS)
def test_scale(backend, dt, shape, tile):
    x = _rand(shape, dt)
    g = float(np.random.default_rng().uniform(-3, 3))
    out = _poisoned(shape, dt)
    xt = do.from_numpy(x).sync()
    K.scale(out.partition(tile), xt, g).sync()
    _check(out.numpy(), ref(x) * np.float64(np.float32(g)), dt)
    np.testing.assert_array_equal(xt.numpy(), x)  # the input is untouched


@pytest.mark.parametrize("shape,tile", SHAPES, ids=S_IDS)
@pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=F_IDS)
def test_add(backend, dt, shape, tile):
    x, y = _rand(shape, dt), _rand(shape, dt, 10.0)
    out = _poisoned(shape, dt)
    K.add(out.partition(tile), do.from_numpy(x).sync(), do.from_numpy(y).sync()).sync()
    _check(out.numpy(), ref(x) + ref(y), dt)


@pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=F_IDS)
def test_add_in_place(backend, dt):
    # out aliases an input: elementwise, so the result is still x + y
    x, y = _rand(512, dt), _rand(512, dt)
    xt = do.from_numpy(x).sync()
    K.add(xt.partition((128,)), xt, do.from_numpy(y).sync()).sync()
    _check(xt.numpy(), ref(x) + ref(y), dt)


def test_add_with_kernel_arguments_as_ops(backend):
    # the paper's form: every argument is an op producing it
    rng = np.random.default_rng()
    x = rng.standard_normal(1024).astype(np.float32)
    y = rng.standard_normal(1024).astype(np.float32)
    op = K.add(
        do.full(1024, np.nan, do.float32).map(lambda t: t.partition((128,))),
        do.from_numpy(x),
        do.from_numpy(y),
    )
    zp, xt, yt = op.sync()
    assert type(zp) is do.Partition and type(xt) is do.Tensor and type(yt) is do.Tensor
    _check(zp.tensor.numpy(), ref(x) + ref(y), do.float32)
    np.testing.assert_array_equal(xt.numpy(), x)


def test_kernel_arguments_mixing_ops_and_values(backend):
    x = np.arange(256, dtype=np.float32)
    xt = do.from_numpy(x).sync()
    out = do.full(256, np.nan, do.float32).sync()
    p, t = K.scale(out.partition((64,)), do.value(xt), 0.5).sync()[:2]
    assert t is xt and p.tensor is out
    np.testing.assert_array_equal(out.numpy(), x * 0.5)


def test_kernel_output_is_its_arguments(backend):
    z = do.full(256, np.nan, do.float32).sync()
    x = do.ones(256, do.float32).sync()
    y = do.full(256, 2.0, do.float32).sync()
    zp = z.partition((128,))
    out = K.add(zp, x, y).sync()
    assert type(out) is tuple and len(out) == 3
    assert out[0] is zp and out[1] is x and out[2] is y
    assert [type(a) for a in out] == [do.Partition, do.Tensor, do.Tensor]
    np.testing.assert_array_equal(z.numpy(), np.full(256, 3.0, np.float32))
    # scalars come back as given
    fo = K.fill(zp, 1.25).sync()
    assert fo[0] is zp and fo[1] == 1.25


def test_kernel_ops_chain_with_then(backend):
    x = np.linspace(-1, 1, 512, dtype=np.float32)
    out = (
        do.zip(do.from_numpy(x), do.empty(512, do.float32))
        .then(lambda xy: K.scale(xy[1].partition((128,)), xy[0], 2.0))
        .then(lambda r: K.add(r[0], r[0].tensor, r[1]))  # out = 2x + x
        .first()
        .then(lambda p: do.to_numpy(p.tensor))
        .sync()
    )
    np.testing.assert_allclose(out, 3 * x, rtol=1e-6)


def test_same_kernel_called_again_with_new_tensors(backend):
    # the second call must use the new tensors, not anything remembered from the first
    for i in range(3):
        x = np.full(256, float(i), np.float32)
        out = do.full(256, np.nan, do.float32).sync()
        K.scale(out.partition((128,)), do.from_numpy(x).sync(), 2.0).sync()
        np.testing.assert_array_equal(out.numpy(), np.full(256, 2.0 * i, np.float32))


def test_empty_tensor_launches_nothing(backend):
    t = do.zeros((0,), do.float32).sync()
    out = K.fill(t.partition((1,)), 1.0).sync()
    assert out[0].tensor is t


# -- user kernels ---------------------------------------------------------------------------

AXPB_SRC = r"""
extern "C" __global__ void axpb(float* y, const float* x, int n) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = 2.0f * x[i] + (float)n;
}
"""


def _axpb_host(y, x, n):
    y[:n] = 2.0 * x[:n] + np.float32(n)


def _axpb() -> K.Kernel:
    return K.Kernel(AXPB_SRC, "axpb", params=(K.Out(do.float32), K.In(do.float32), do.int32), host=_axpb_host)


def test_user_kernel_grid_from_partition(backend):
    k = _axpb()
    n = 1024
    x = np.random.default_rng().standard_normal(n).astype(np.float32)
    y = do.full(n, np.nan, do.float32).sync()
    yp = y.partition((128,))  # grid 8, default block 128: covers n exactly
    out = k(yp, do.from_numpy(x).sync(), n).sync()
    assert out[0] is yp and out[2] == n
    _check(y.numpy(), 2.0 * ref(x) + n, do.float32)


def test_user_kernel_explicit_grid_and_block(backend):
    k = _axpb()
    n = 1000
    x = np.random.default_rng().standard_normal(n).astype(np.float32)
    y = do.full(n, np.nan, do.float32).sync()
    out = k(y, do.from_numpy(x).sync(), n, grid=(4,), block=(256,)).sync()
    assert out[0] is y
    _check(y.numpy(), 2.0 * ref(x) + n, do.float32)


def test_user_kernel_arguments_as_ops(backend):
    k = _axpb()
    x = np.arange(256, dtype=np.float32)
    yp, _xt, _n = k(do.full(256, np.nan, do.float32).map(lambda t: t.partition((64,))), do.from_numpy(x), 256).sync()
    np.testing.assert_array_equal(yp.tensor.numpy(), 2 * x + 256)


def test_user_kernel_int64_and_uint8_params(backend):
    src = r"""
    extern "C" __global__ void bump(long long* y, const unsigned char* x, long long add) {
      long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
      y[i] = (long long)x[i] + add;
    }
    """

    def host(y, x, add):
        y[:] = x.astype(np.int64) + add

    k = K.Kernel(src, "bump", params=(K.Out(do.int64), K.In(do.uint8), do.int64), host=host)
    x = np.random.default_rng().integers(0, 256, 256, dtype=np.uint8)
    y = do.full(256, -1, do.int64).sync()
    k(y.partition((128,)), do.from_numpy(x).sync(), 2**40).sync()
    np.testing.assert_array_equal(y.numpy(), x.astype(np.int64) + 2**40)


def test_user_kernel_inout(backend):
    src = r"""
    extern "C" __global__ void twice(float* y) {
      long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
      y[i] = 2.0f * y[i];
    }
    """

    def host(y):
        y *= 2

    k = K.Kernel(src, "twice", params=(K.InOut(do.float32),), host=host, block=(64,))
    t = do.from_numpy(np.arange(128, dtype=np.float32)).sync()
    k(t.partition((64,))).sync()
    np.testing.assert_array_equal(t.numpy(), 2 * np.arange(128, dtype=np.float32))


def test_user_kernel_default_block_is_read_only(backend):
    # the compiled call front holds the default block too: reassigning it would split the paths
    k = K.Kernel('extern "C" __global__ void f(float* y) {}', "f", params=(K.Out(do.float32),), block=(64,))
    assert k.block == (64, 1, 1)
    with pytest.raises(AttributeError):
        k.block = (256, 1, 1)  # type: ignore[misc]
    assert k.block == (64, 1, 1)


def test_user_kernel_known_layout_is_planned_once_and_hit_after(backend):
    # a fresh tensor of a known shape takes the compiled call: the same plan, counted as a hit
    k = _axpb()
    n = 512
    x = do.from_numpy(np.arange(n, dtype=np.float32)).sync()
    k(do.full(n, np.nan, do.float32).sync().partition((128,)), x, n).sync()
    misses, hits = k.plans.misses, k.plans.hits
    for i in range(3):
        y = do.full(n, np.nan, do.float32).sync()
        out = k(y.partition((128,)), x, n - i).sync()
        assert out[2] == n - i
        np.testing.assert_array_equal(y.numpy()[: n - i], 2 * np.arange(n - i, dtype=np.float32) + (n - i))
        assert np.isnan(y.numpy()[n - i :]).all()
    assert (k.plans.misses, k.plans.hits) == (misses, hits + 3)
    # an explicit grid and block of a known layout too, given as tuples or as ints
    y = do.full(n, np.nan, do.float32).sync()
    k(y, x, n, grid=(2,), block=(256,)).sync()
    k(y, x, n, grid=2, block=256).sync()
    k(y, x, n, grid=(2, 1, 1), block=(256, 1, 1)).sync()
    assert k.plans.misses == misses + 1
    np.testing.assert_array_equal(y.numpy(), 2 * np.arange(n, dtype=np.float32) + n)


def test_user_kernel_scalar_kinds_after_a_plan(backend):
    # scalars the compiled call does not take as they are (numpy scalars, a float that is an
    # integer for an int parameter, an int for a float parameter, a 16-bit float) still launch
    # with the value given
    src = r"""
    extern "C" __global__ void mix(float* y, float a, int b, __half c) {
      long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
      y[i] = a + (float)b + __half2float(c);
    }
    """

    def host(y, a, b, c):
        y[:] = np.float32(a) + np.float32(b) + np.float32(c)

    k = K.Kernel(
        "#include <cuda_fp16.h>\n" + src, "mix", params=(K.Out(do.float32), do.float32, do.int32, do.float16), host=host
    )
    y = do.full(64, np.nan, do.float32).sync()
    yp = y.partition((64,))
    for a, b, c, expect in [
        (1.5, 2, 0.25, 3.75),
        (np.float32(1.5), np.int64(2), np.float16(0.5), 4.0),
        (3, 4.0, 1, 8.0),
        (-2.0, -3, -0.5, -5.5),
    ]:
        k(yp, a, b, c).sync()
        np.testing.assert_array_equal(y.numpy(), np.full(64, expect, np.float32))


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda k, yp, x: k(yp, x, True), "int32 scalar"),
        (lambda k, yp, x: k(yp, x, 2.5), "integer"),
        (lambda k, yp, x: k(yp, x, 2**31), "out of range"),
        (lambda k, yp, x: k(yp, x, -(2**31) - 1), "out of range"),
        (lambda k, yp, x: k(yp, x, "3"), "int32 scalar"),
        (lambda k, yp, x: k(yp, x), "takes 3 arguments"),
        (lambda k, yp, x: k(yp, x, 3, 4), "takes 3 arguments"),
        (lambda k, yp, x: k(yp, x, 3, grid=(True,)), "grid"),
        (lambda k, yp, x: k(yp, x, 3, grid=(-1,)), "grid"),
        (lambda k, yp, x: k(yp, x, 3, grid=(1, 2**16)), "grid"),
        (lambda k, yp, x: k(yp, x, 3, grid=(1, 1, 1, 1)), "grid"),
        (lambda k, yp, x: k(yp, x, 3, block=(2048,)), "block"),
        (lambda k, yp, x: k(yp, x, 3, block=(64, 64)), "block"),
        (lambda k, yp, x: k(yp, x, 3, block=0), "block"),
        (lambda k, yp, x: k(yp, x, 3, block=(1.0,)), "block"),
        (lambda k, yp, x: k(yp, x, 3, shared_mem=-1), "shared_mem"),
        (lambda k, yp, x: k(yp, x, 3, shared_mem=True), "shared_mem"),
        (lambda k, yp, x: k(yp, x, 3, grid=2**63), "grid"),
    ],
)
def test_user_kernel_bad_calls_after_a_plan_raise(backend, call, match):
    # the layout has a plan (the compiled call would take a good call): a bad one is still refused
    k = _axpb()
    x = do.from_numpy(np.zeros(256, np.float32)).sync()
    yp = do.zeros(256, do.float32).sync().partition((128,))
    k(yp, x, 3).sync()
    with pytest.raises(do.DeviceOpError, match=match):
        call(k, yp, x)


def test_user_kernel_float_scalar_beyond_float32_refused_after_a_plan(backend):
    src = r"""
    extern "C" __global__ void put(float* y, float v) { y[blockIdx.x * blockDim.x + threadIdx.x] = v; }
    """

    def host(y, v):
        y[:] = v

    k = K.Kernel(src, "put", params=(K.Out(do.float32), do.float32), host=host)
    y = do.zeros(128, do.float32).sync()
    k(y.partition((128,)), 1.0).sync()
    with pytest.raises(do.DTypeError, match="out of range"):
        k(y.partition((128,)), 1e39)
    k(y.partition((128,)), float("inf")).sync()  # not finite: passed on as it is
    assert np.isinf(y.numpy()).all()
    k(y.partition((128,)), 2**30).sync()  # an int for a float parameter, beyond float's exact ints
    np.testing.assert_array_equal(y.numpy(), np.full(128, 2**30, np.float32))


# -- NVRTC (no GPU needed) --------------------------------------------------------------------


def test_compile_builtins_for_sm90():
    cubin = do.kernels.compile_builtins("sm_90")
    assert isinstance(cubin, bytes) and cubin[:4] == b"\x7fELF"
    names = do.kernels.builtin_names()
    assert len(names) == 14 * 3  # 9 elementwise + 5 row-wise, 3 dtypes each
    for name in names:
        assert name.encode() in cubin, f"{name} missing from the built-ins CUBIN"


def test_user_kernel_compiles_for_sm90():
    cubin = _axpb().compile("sm_90")
    assert cubin[:4] == b"\x7fELF" and b"axpb" in cubin
