"""Errors: bad input fails before any GPU work, with the right class and a message naming it."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import K

import deviceop as do
from deviceop.device import current as current_backend


@pytest.fixture
def tensors(backend):
    z = do.zeros(256, do.float32).sync()
    x = do.ones(256, do.float32).sync()
    h = do.ones(256, do.float16).sync()
    i = do.ones(256, do.int32).sync()
    return z, x, h, i


class _NoWork:
    """Asserts that nothing was allocated or enqueued inside the block."""

    def __enter__(self):
        self.used = do.used_bytes()
        return self

    def __exit__(self, *exc):
        assert do.used_bytes() == self.used
        return False


def test_error_tree():
    for cls in (
        do.BackendError,
        do.BorrowError,
        do.CaptureError,
        do.CompileError,
        do.CudaError,
        do.ShapeError,
        do.DTypeError,
        do.UsageError,
    ):
        assert issubclass(cls, do.DeviceOpError)
    assert issubclass(do.ShapeError, ValueError)
    assert issubclass(do.DTypeError, TypeError)
    assert not issubclass(do.UsageError, do.ShapeError)


# -- dtypes ---------------------------------------------------------------------------------


def test_wrong_input_dtype(tensors):
    z, x, h, _ = tensors
    with _NoWork(), pytest.raises(do.DTypeError, match=r"float16.*float32|float32.*float16"):
        K.add(z.partition((128,)), x, h)  # fails at call time, before any terminal


def test_builtin_rejects_int_tensor(tensors):
    _, _, _, i = tensors
    with pytest.raises(do.DTypeError, match="int32"):
        K.fill(i.partition((128,)), 1.0)


def test_unsupported_dtype_names():
    with pytest.raises(do.DTypeError, match="complex64"):
        do.zeros(4, np.complex64)
    with pytest.raises(do.DTypeError, match="float64"):
        do.from_numpy(np.zeros(4))  # numpy's default float64 is not a deviceop dtype
    with pytest.raises(do.DTypeError, match="bogus"):
        do.ones(4, "bogus")


def test_fill_value_not_representable():
    with pytest.raises(do.DTypeError, match="uint8"):
        do.full(4, 300, do.uint8)
    with pytest.raises(do.DTypeError, match="int32"):
        do.full(4, 1.5, do.int32)


def test_user_kernel_scalar_type_and_range(backend):
    k = K.Kernel("", "s", params=(K.Out(do.float32), do.int32), host=lambda y, n: None)
    y = do.zeros(128, do.float32).sync()
    with pytest.raises(do.DTypeError, match="int32"):
        k(y.partition((128,)), 1.5)
    with pytest.raises(do.DTypeError, match="out of range"):
        k(y.partition((128,)), 2**31)
    with pytest.raises(do.DTypeError, match="int32"):
        k(y.partition((128,)), "3")


def test_user_kernel_tensor_dtype(backend):
    k = K.Kernel("", "s", params=(K.Out(do.float32), K.In(do.int64)), host=lambda y, x: None)
    y = do.zeros(128, do.float32).sync()
    x = do.zeros(128, do.int32).sync()
    with pytest.raises(do.DTypeError, match="int64"):
        k(y.partition((128,)), x)


# -- shapes ---------------------------------------------------------------------------------


def test_mismatched_shapes(tensors):
    z, x, _, _ = tensors
    short = do.ones(128, do.float32).sync()
    with _NoWork(), pytest.raises(do.ShapeError, match=r"\(128,\).*\(256,\)"):
        K.add(z.partition((128,)), x, short)


def test_partition_tiles_must_divide():
    t = do.zeros((16, 64), do.float32).sync()
    with pytest.raises(do.ShapeError, match="does not divide"):
        t.partition((5, 64))
    with pytest.raises(do.ShapeError, match="dimension"):
        t.partition((16,))
    with pytest.raises(do.ShapeError, match="zero"):
        t.partition((0, 64))


def test_partition_tile_not_spanning_rows_for_elementwise(backend):
    t = do.zeros((16, 64), do.float32).sync()
    with pytest.raises(do.ShapeError, match="contiguous"):
        K.fill(t.partition((4, 32)), 1.0)


def test_non_contiguous_input(tensors):
    z, _, _, _ = tensors
    big = do.ones(512, do.float32).sync()
    with _NoWork(), pytest.raises(do.ShapeError, match="non-contiguous"):
        K.scale(z.partition((128,)), big[::2], 2.0)


def test_non_contiguous_output(backend):
    t = do.zeros((16, 64), do.float32).sync()
    with pytest.raises(do.ShapeError, match="non-contiguous"):
        K.fill(t[:, :32].partition((4, 32)), 1.0)


def test_non_contiguous_user_kernel_arg(backend):
    k = K.Kernel("", "s", params=(K.Out(do.float32), K.In(do.float32)), host=lambda y, x: None)
    y = do.zeros(128, do.float32).sync()
    x = do.zeros((128, 2), do.float32).sync()
    with pytest.raises(do.ShapeError, match="non-contiguous"):
        k(y.partition((128,)), x[:, 0])


def test_view_errors(backend):
    t = do.zeros((6, 8), do.float32).sync()
    with pytest.raises(do.ShapeError, match="element counts"):
        t.view((7, 7))
    with pytest.raises(do.ShapeError, match="contiguous"):
        t[:, ::2].view(-1)
    with pytest.raises(do.ShapeError, match="out of range"):
        t[6]
    with pytest.raises(do.ShapeError, match="too many"):
        t[1, 2, 3]


def test_bad_shapes():
    with pytest.raises(do.ShapeError):
        do.zeros((-1, 4))
    with pytest.raises(do.ShapeError):
        do.zeros("abc")


def test_shape_error_in_lazy_arguments_fails_the_terminal(backend):
    op = K.add(do.zeros(256).map(lambda t: t.partition((128,))), do.ones(128), do.ones(256))
    with pytest.raises(do.ShapeError):
        op.sync()


# -- usage ----------------------------------------------------------------------------------


def test_then_closure_must_return_an_op(backend):
    op = do.value(1).then(lambda x: x + 1)
    with pytest.raises(do.UsageError, match=r"DeviceOp.*map|map.*DeviceOp"):
        op.sync()


def test_then_needs_a_callable():
    with pytest.raises(do.UsageError, match="function"):
        do.value(1).then(5)


def test_terminal_twice(backend):
    op = do.zeros(8)
    op.sync()
    with pytest.raises(do.UsageError, match="already consumed"):
        op.sync()
    op2 = do.value(1)
    op2.submit().result(timeout=30)
    with pytest.raises(do.UsageError, match="already consumed"):
        op2.sync_on(do.next_stream())


@pytest.mark.parametrize(
    "compose",
    [
        lambda op: op.map(lambda x: x),
        lambda op: op.then(do.value),
        lambda op: do.zip(op, do.value(0)),
        lambda op: do.to_numpy(op),
        lambda op: K.fill(op, 1.0),
    ],
    ids=["map", "then", "zip", "to_numpy", "kernel-arg"],
)
def test_op_used_after_composing(backend, compose):
    op = do.zeros(256).map(lambda t: t.partition((128,)))
    later = op.inspect(lambda x: None)  # composing consumes op
    with pytest.raises(do.UsageError, match="already consumed"):
        compose(op)
    with pytest.raises(do.UsageError, match="already consumed"):
        op.sync()
    assert later.sync().tensor.shape == (256,)  # the composed op still works


def test_zip_same_op_twice():
    op = do.value(1)
    with pytest.raises(do.UsageError, match="shared"):
        do.zip(op, op)
    with pytest.raises(do.UsageError, match="DeviceOp"):
        do.zip(do.value(1), 2)
    with pytest.raises(do.UsageError):
        do.zip()


def test_builtin_output_must_be_a_partition(tensors):
    z, x, _, _ = tensors
    with pytest.raises(do.UsageError, match="partition"):
        K.scale(z, x, 2.0)
    with pytest.raises(do.UsageError, match="read-only"):
        K.scale(z.partition((128,)), x.partition((128,)), 2.0)
    with pytest.raises(do.UsageError, match="arguments"):
        K.add(z.partition((128,)), x)


def test_user_kernel_needs_a_grid(backend):
    k = K.Kernel("", "s", params=(K.Out(do.float32),), host=lambda y: None)
    y = do.zeros(128).sync()
    with pytest.raises(do.UsageError, match="grid"):
        k(y)
    with pytest.raises(do.UsageError, match="takes 1 argument"):
        k(y.partition((128,)), 3)
    with pytest.raises(do.UsageError, match="block"):
        k(y, grid=(1,), block=(2048,))


def test_from_numpy_needs_an_ndarray():
    with pytest.raises(do.UsageError, match="ndarray"):
        do.from_numpy([1.0, 2.0])


# -- backends -------------------------------------------------------------------------------


def test_bad_backend_name(backend):
    before = current_backend()
    with pytest.raises(do.BackendError, match="tpu"):
        do.use_backend("tpu")
    assert current_backend() is before and do.backend_name() == backend


def test_bad_stream_count():
    with pytest.raises(do.BackendError, match="streams"):
        do.use_backend("host", streams=0)


def test_user_kernel_without_host_impl_on_host(host_backend):
    k = K.Kernel('extern "C" __global__ void nohost(float* y) {}', "nohost", params=(K.Out(do.float32),))
    y = do.zeros(128).sync()
    with pytest.raises(do.UsageError, match="numpy implementation"):
        k(y.partition((128,)))


def _boom(y):
    raise RuntimeError("boom in the numpy kernel")


def test_host_kernel_failure_is_a_cuda_error(host_backend):
    k = K.Kernel("", "boom", params=(K.Out(do.float32),), host=_boom)
    y = do.zeros(128).sync()
    try:
        with pytest.raises(do.CudaError, match="boom in the numpy kernel") as ei:
            k(y.partition((128,))).sync()
        assert ei.value.name == "CUDA_ERROR_LAUNCH_FAILED"
        # the context is broken (sticky), as after a kernel fault on CUDA
        with pytest.raises(do.CudaError):
            do.zeros(8).then(do.to_numpy).sync()
    finally:
        do.use_backend("host")  # a fresh emulated device for the following tests
    np.testing.assert_array_equal(do.ones(8).sync().numpy(), np.ones(8, np.float32))


def test_host_kernel_failure_fails_the_future(host_backend):
    k = K.Kernel("", "boom", params=(K.Out(do.float32),), host=_boom)
    y = do.zeros(128).sync()
    try:
        fut = k(y.partition((128,))).submit()
        with pytest.raises(do.CudaError, match="boom"):
            fut.result(timeout=30)  # never hangs
        assert isinstance(fut.exception(timeout=1), do.CudaError)
    finally:
        do.use_backend("host")


def test_the_host_fallback_warning_names_the_users_line(tmp_path):
    # with no driver, the first use of deviceop warns once, attributed to the user's own line
    # (not to deviceop's source)
    import subprocess
    import sys

    script = tmp_path / "user_program.py"
    script.write_text("import deviceop as do\nx = do.zeros(4, do.float32).sync()  # first use\n")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("DEVICEOP_BACKEND", "DEVICEOP_STUB_DRIVER")}
    env["LD_LIBRARY_PATH"] = str(tmp_path)  # (no stub driver found here)
    r = subprocess.run([sys.executable, "-W", "always", str(script)], capture_output=True, text=True, env=env)
    if "no CUDA driver found" not in r.stderr:
        pytest.skip("a CUDA driver is present: no fallback warning")
    assert r.returncode == 0, r.stderr
    assert f"{script}:2: DeviceOpWarning" in r.stderr, r.stderr
    assert "deviceop/" not in r.stderr.split("DeviceOpWarning")[0], r.stderr
