"""Bad input that used to escape the error contract: settings, indexing, timeouts, scalars and
sizes are checked when given, with deviceop errors that also derive from the matching built-in."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import pool_of

import deviceop as do

K = do.kernels


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1, 11, "0.1", None, True])
def test_host_chaos_settings_out_of_range_are_refused(bad):
    with pytest.raises(do.SettingError):
        do.set_host_chaos(bad)
    assert isinstance(do.SettingError("x"), (do.UsageError, ValueError))


def test_a_bad_chaos_environment_value_is_refused_when_the_backend_is_made():
    env = dict(os.environ, DEVICEOP_BACKEND="host", DEVICEOP_HOST_CHAOS="-1", PYTHONPATH=os.pathsep.join(sys.path))
    code = "import deviceop as do\ntry:\n    do.zeros(4).sync()\nexcept do.SettingError as e:\n    print('refused:', e)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and r.stdout.startswith("refused: DEVICEOP_HOST_CHAOS"), (r.stdout, r.stderr)


def test_a_stream_worker_survives_its_own_failure(host_backend, monkeypatch):
    # whatever fails in a worker's loop (here its chaos delay, set around the checks), the
    # worker goes on: the context records the error and waits report it instead of hanging
    import threading

    from deviceop._backends import _host

    s = do.streams()[0]
    monkeypatch.setitem(_host._chaos, "max_delay", float("nan"))
    s.enqueue(lambda: None)
    out = []

    def wait() -> None:
        try:
            s.synchronize()
            out.append("ok")
        except do.CudaError:
            out.append("error")

    th = threading.Thread(target=wait, daemon=True)
    th.start()
    th.join(10)
    monkeypatch.setitem(_host._chaos, "max_delay", 0.0)
    assert out == ["error"], "the stream's worker died: its waiters hang"
    do.use_backend("host")


def test_settings_refuse_wrong_types():
    with pytest.raises(do.SettingError):
        do.set_poll_budget("0.001")
    with pytest.raises(do.SettingError):
        do.set_poll_budget(True)
    with pytest.raises(do.SettingError):
        do.set_borrow_policy(1)
    with pytest.raises(ValueError):  # a SettingError is a ValueError too
        do.set_borrow_policy("sometimes")
    assert do.borrow_policy() == "order"


def test_indexing_past_the_end_is_an_index_error_so_iteration_stops(backend):
    t = do.from_numpy(np.arange(6, dtype=np.float32).reshape(3, 2)).sync()
    with pytest.raises(IndexError):
        t[3]
    with pytest.raises(do.TensorIndexError):
        t[-4]
    rows = list(t)  # iteration ends at the IndexError
    assert len(rows) == 3 and rows[2].numpy().tolist() == [4.0, 5.0]


@pytest.mark.parametrize("bad", ["1.0", b"1", [1], True])
def test_timeouts_must_be_numbers(backend, bad):
    async def main() -> None:
        await do.value(1).wait(timeout=bad)

    with pytest.raises(do.UsageError, match="timeout"):
        asyncio.run(main())


def test_scalars_beyond_the_dtype_are_refused_when_built(backend):
    x = do.zeros(256, do.float32).sync()
    y = do.empty(256, do.float32).sync()
    with pytest.raises(do.DTypeError, match="out of range"):
        K.scale(y.partition((128,)), x, 10**400)
    with pytest.raises(do.DTypeError, match="out of range"):
        K.scale(y.partition((128,)), x, 1e300)  # a float, beyond float32
    K.scale(y.partition((128,)), x, float("inf")).sync()  # inf itself is a float32 value


@pytest.mark.parametrize("shape", [2**62, (2**31, 2**31), (1 << 40, 1 << 10)])
def test_impossible_sizes_are_refused_when_built(shape):
    with pytest.raises(do.ShapeError, match="more than any device holds"):
        do.zeros(shape)
    with pytest.raises(do.ShapeError, match="more than any device holds"):
        do.empty(shape, do.float16)  # empty's own path for plain shapes checks the size too


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((16, 2048), do.float16),
        ([3, 4], "float32"),
        (np.int64(5), np.float32),
        (0, do.int32),
        ((1 << 47, 0, 1 << 47), do.float16),  # empty, whatever its other dimensions
    ],
)
def test_empty_takes_what_zeros_takes(backend, shape, dtype):
    a, z = do.empty(shape, dtype), do.zeros(shape, dtype)
    assert (a.shape, a.dtype) == (z.shape, z.dtype)
    t = a.sync()
    assert t.shape == z.shape and t.dtype is z.dtype


@pytest.mark.parametrize("bad", [(-1, 4), (2.0, 3), "abc", (True, 2)])
def test_empty_refuses_bad_shapes_when_built(bad):
    with pytest.raises(do.ShapeError):
        do.empty(bad, do.float16)


def test_an_interrupted_sync_keeps_its_work_registered_until_it_completes(host_backend, monkeypatch):
    # Ctrl-C while sync() waits: the work still runs, so the execution is handed to the stream's
    # watcher instead of being finished: host reads are refused and a later write on another
    # stream is ordered after it, until the work is really done
    from helpers import slow_fill

    s0, s1 = pool_of(2)[:2]
    x = do.zeros(4096, do.float32).sync()
    real = type(s0).synchronize
    calls = []

    def interrupted(self):
        if self is s0 and not calls:
            calls.append(1)
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(type(s0), "synchronize", interrupted)
    with pytest.raises(KeyboardInterrupt):
        slow_fill(x, 80.0, 0.3).sync_on(s0)
    monkeypatch.undo()
    with pytest.raises(do.BorrowError):
        x.numpy()
    K.fill(x.partition((128,)), 5.0).sync_on(s1)  # ordered after the slow fill
    assert np.all(x.numpy() == 5.0)


def test_tensor_fields_are_read_only_and_partitions_need_tensors(host_backend):
    t = do.zeros((4, 8), do.float32).sync()
    with pytest.raises(AttributeError):
        t.addr = 0  # the compiled paths trust these fields
    with pytest.raises(AttributeError):
        t.shape = (8, 4)
    with pytest.raises(do.ShapeError, match="deviceop Tensor"):
        do.Partition(np.zeros((4, 8), np.float32), (1, 8))
    p = t.partition((1, 8))
    assert (p.grid, p.tensor is t, t.span, t.T.span) == ((4, 1), True, (0, 128), (0, 128))
    assert t[1:3, ::2].span == (32, 32 + 4 * (8 + 6) + 4)
