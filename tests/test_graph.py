"""Scoped graphs on every backend: record, replay as an op, refusals, lifetimes, update, the cache."""

from __future__ import annotations

import gc
import threading
import time

import anyio
import numpy as np
import pytest
from helpers import live, pool_of, slow_copy, slow_fill

import deviceop as do
from deviceop._core._capture import CAPTURE

K = do.kernels


def _data(n: int = 1024, seed: int = 0) -> tuple[np.ndarray, do.Tensor, do.Tensor]:
    x0 = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    return x0, do.from_numpy(x0).sync(), do.zeros(n, do.float32).sync()


def _chain(y: do.Tensor, x: do.Tensor, steps: int) -> do.DeviceOp:
    """y = x * 2, then y = y + x, ``steps`` times (each step reads the previous one's output)."""
    op = K.scale(y.partition((128,)), x, 2.0)
    for _ in range(steps):
        op = op.then(lambda a: K.add(a[0], a[0].tensor, x))
    return op


def _chain_ref(x0: np.ndarray, steps: int) -> np.ndarray:
    y = x0 * np.float32(2)
    for _ in range(steps):
        y = y + x0
    return y


# -- record and replay ---------------------------------------------------------------------------
def test_recording_runs_nothing_and_replay_equals_eager(backend) -> None:
    x0, x, y = _data()
    g = _chain(y, x, 5).graph()
    assert g.nodes == 6 and g.launches == 0
    assert np.all(y.numpy() == 0), "recording must not run the work"
    out = g.launch().sync()
    assert out[0].tensor.buffer is y.buffer and out[2] is x  # the recorded op's output
    _, x2, y2 = _data()
    _chain(y2, x2, 5).sync()
    np.testing.assert_array_equal(y.numpy(), y2.numpy())
    np.testing.assert_allclose(y.numpy(), _chain_ref(x0, 5), rtol=1e-6)


def test_many_replays_and_scope_records(backend) -> None:
    x0, x, y = _data(512)
    yp = y.partition((128,))
    with do.graph.scope() as s:
        a = s.record(K.scale(yp, x, 0.5))
        b = s.record(K.add(a[0], y, x))  # a later record uses an earlier output
    g = s.graph
    assert g.nodes == 2 and g.output == (a, b)
    for _ in range(50):
        g.launch().sync()
    np.testing.assert_allclose(y.numpy(), x0 * np.float32(0.5) + x0, rtol=1e-6)
    assert g.launches == 50


def test_replay_accumulates_in_order(backend) -> None:
    x0, x, y = _data(256)
    g = K.add(y.partition((128,)), y, x).graph()  # y += x per replay
    futs = [g.launch().submit(do.streams()[i % len(do.streams())]) for i in range(20)]
    for f in futs:
        f.result(timeout=30)
    np.testing.assert_allclose(y.numpy(), x0 * 20, rtol=1e-5)


def test_replay_then_and_zip(backend) -> None:
    x0, x, y = _data(256)
    g = K.scale(y.partition((128,)), x, 3.0).graph()
    arr = g.launch().then(lambda out: do.to_numpy(out[0].tensor)).sync()
    np.testing.assert_allclose(arr, x0 * 3, rtol=1e-6)
    _, x2, y2 = _data(256, seed=1)
    g2 = K.scale(y2.partition((128,)), x2, 1.0).graph()
    a, b = do.zip(g.launch(), g2.launch()).sync()
    assert a[0].tensor.buffer is y.buffer and b[0].tensor.buffer is y2.buffer


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    if request.param == "trio":
        pytest.importorskip("trio")
    return request.param


@pytest.mark.anyio
async def test_replay_awaited(backend, anyio_backend) -> None:
    x0 = np.random.default_rng(0).standard_normal(256).astype(np.float32)
    x, y = await do.zip(do.from_numpy(x0), do.zeros(256, do.float32))
    g = K.scale(y.partition((128,)), x, 4.0).graph()
    out = await g.launch()
    assert out[0].tensor.buffer is y.buffer
    await g.launch().wait(timeout=30)
    fut = g.launch().submit()
    await fut
    np.testing.assert_allclose((await do.to_numpy(y)), x0 * 4, rtol=1e-6)


def test_empty_scope_replays_nothing(backend) -> None:
    with do.graph.scope() as s:
        pass
    g = s.graph
    assert g.nodes == 0 and g.output == ()
    assert g.launch().sync() == ()


def test_record_on_a_given_pool_stream(backend) -> None:
    s0, st = pool_of(2)[:2]
    x0, x, y = _data(256)
    g = K.scale(y.partition((128,)), x, 2.0).graph(stream=st)
    g.launch().sync_on(s0)
    np.testing.assert_allclose(y.numpy(), x0 * 2, rtol=1e-6)


def test_other_threads_keep_working_while_recording(backend) -> None:
    x0, x, y = _data(256)
    errors: list[BaseException] = []
    stop = threading.Event()

    def other() -> None:
        try:
            while not stop.is_set():
                v = do.full(64, 3.0, do.float32).sync().numpy()
                assert np.all(v == 3)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=other)
    t.start()
    try:
        for _ in range(20):
            g = _chain(y, x, 3).graph()
            g.launch().sync()
    finally:
        stop.set()
        t.join(30)
    assert not errors, errors
    np.testing.assert_allclose(y.numpy(), _chain_ref(x0, 3), rtol=1e-6)


def test_objects_dying_while_recording_do_not_break_it(backend) -> None:
    x0, x, y = _data(256)
    doomed = [K.scale(y.partition((128,)), x, 1.0).graph() for _ in range(3)]
    tmp = [do.zeros(1024).sync() for _ in range(3)]
    futs = [do.value(1).submit() for _ in range(3)]
    for f in futs:
        f.result(timeout=10)
    with do.graph.scope() as s:
        del doomed, tmp, futs  # graphs, buffers and events released during the recording
        gc.collect()
        s.record(K.scale(y.partition((128,)), x, 2.0))
    s.graph.launch().sync()
    np.testing.assert_allclose(y.numpy(), x0 * 2, rtol=1e-6)


# -- refusals --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        lambda: do.zeros(16),
        lambda: do.empty((4, 4), do.float16),
        lambda: do.from_numpy(np.ones(4, np.float32)),
    ],
    ids=["zeros", "empty", "from_numpy"],
)
def test_allocating_op_is_refused_with_its_name(backend, make) -> None:
    op = make()
    with pytest.raises(do.CaptureError, match=r"allocates device memory.*Allocate before the scope") as ei:
        with do.graph.scope() as s:
            s.record(op)
    assert repr(op) in str(ei.value)
    with pytest.raises(do.CaptureError, match="recording failed"):
        s.graph


def test_allocation_inside_a_chain_is_refused(backend) -> None:
    _, x, y = _data(256)
    op = K.scale(y.partition((128,)), x, 2.0).then(lambda a: do.zeros(8))
    with pytest.raises(do.CaptureError, match="allocates"):
        op.graph()


@pytest.mark.parametrize("nested", ["sync", "submit", "await", "numpy", "to_numpy", "graph", "future"])
def test_nested_waits_are_refused(backend, nested) -> None:
    _, x, y = _data(256)
    fut = do.value(1).submit() if nested == "future" else None
    if fut is not None:
        fut.result(timeout=10)
        fut = slow_fill(do.zeros(128).sync(), 1.0, 0.05).submit()

    def inner(a):
        if nested == "sync":
            do.value(1).sync()
        elif nested == "submit":
            do.value(1).submit()
        elif nested == "await":
            do.value(1).wait()
        elif nested == "numpy":
            x.numpy()
        elif nested == "to_numpy":
            return do.to_numpy(x)
        elif nested == "graph":
            K.scale(y.partition((128,)), x, 1.0).graph()
        elif nested == "future":
            fut.result()
        return do.value(a)

    op = K.scale(y.partition((128,)), x, 2.0).then(inner)
    with pytest.raises(do.CaptureError, match=r"inside a graph recording|do not nest"):
        op.graph()
    assert CAPTURE.scope is None  # the recording ended
    if fut is not None:
        fut.result(timeout=30)
    # the thread records and runs normally afterwards
    K.scale(y.partition((128,)), x, 1.0).graph().launch().sync()


def test_scope_misuse(backend) -> None:
    _, x, y = _data(256)
    s = do.graph.scope()
    with pytest.raises(do.UsageError, match="inside the with-block"):
        s.record(do.value(1))
    with pytest.raises(do.UsageError, match="after the with-block"):
        s.graph
    with s:
        with pytest.raises(do.UsageError, match="takes a DeviceOp"):
            s.record(42)  # type: ignore[arg-type]
        with pytest.raises(do.CaptureError, match="do not nest"):
            with do.graph.scope():
                pass
        s.record(K.scale(y.partition((128,)), x, 1.0))
    with pytest.raises(do.UsageError, match="used once"):
        with s:
            pass
    with pytest.raises(do.UsageError, match="not a deviceop stream"):
        do.graph.scope(stream=7)
    with pytest.raises(do.UsageError, match="CudaGraph to update"):
        do.graph.scope(update="g")  # type: ignore[arg-type]
    op = do.value(1)
    op.sync()
    with pytest.raises(do.UsageError, match="already consumed"):
        op.graph()


def test_exception_in_the_block_ends_the_recording(backend) -> None:
    _, x, y = _data(256)
    with pytest.raises(KeyError):
        with do.graph.scope() as s:
            s.record(K.scale(y.partition((128,)), x, 2.0))
            raise KeyError("boom")
    assert CAPTURE.scope is None
    with pytest.raises(do.CaptureError, match="no graph"):
        s.graph
    # every pool stream and the thread still work; a new recording succeeds
    for st in do.streams():
        K.scale(y.partition((128,)), x, 1.0).sync_on(st)
    K.scale(y.partition((128,)), x, 1.0).graph().launch().sync()


def test_graph_launch_cannot_be_recorded(backend) -> None:
    _, x, y = _data(256)
    g = K.scale(y.partition((128,)), x, 2.0).graph()
    with pytest.raises(do.CaptureError, match="graphs do not nest"):
        g.launch().graph()


def test_launch_is_single_use_like_any_op(backend) -> None:
    _, x, y = _data(256)
    g = K.scale(y.partition((128,)), x, 2.0).graph()
    op = g.launch()
    op.sync()
    with pytest.raises(do.UsageError, match="already consumed"):
        op.sync()


def test_shared_inside_and_outside_a_recording(backend) -> None:
    x0, x, y = _data(256)
    before = do.value(x).shared()
    before.sync()  # ran outside: consumers inside the recording just use it
    g = before.then(lambda t: K.scale(y.partition((128,)), t, 2.0)).graph()
    g.launch().sync()
    np.testing.assert_allclose(y.numpy(), x0 * 2, rtol=1e-6)
    inside = K.scale(y.partition((128,)), x, 3.0).shared()
    g2 = do.zip(inside, inside).graph()
    assert g2.nodes == 1
    with pytest.raises(do.CaptureError, match="first ran inside a graph recording"):
        inside.sync()


# -- lifetimes and the ledger --------------------------------------------------------------------
def test_graph_keeps_its_buffers_alive(backend) -> None:
    def make() -> do.CudaGraph:  # every tensor name dies with this frame
        x = do.from_numpy(np.arange(4096, dtype=np.float32)).sync()
        y = do.zeros(4096, do.float32).sync()
        return _chain(y, x, 2).graph()

    g = make()
    gc.collect()
    for _ in range(3):
        garbage = [do.full(4096, 9.0, do.float32).sync() for _ in range(4)]  # reuse freed memory
        del garbage
        gc.collect()
    out = g.launch().sync()
    np.testing.assert_allclose(out[0].tensor.numpy(), _chain_ref(np.arange(4096, dtype=np.float32), 2), rtol=1e-6)


def test_memory_goes_with_the_graph(backend) -> None:
    gc.collect()
    base = do.used_bytes()
    x = do.zeros(1 << 16, do.float32).sync()
    y = do.zeros(1 << 16, do.float32).sync()
    g = K.scale(y.partition((1024,)), x, 2.0).graph()
    del x, y
    gc.collect()
    assert do.used_bytes() >= base + 2 * (4 << 16)  # held by the graph
    g.launch().sync()
    del g
    gc.collect()
    assert do.used_bytes() == base


def test_host_read_during_a_replay_raises(backend) -> None:
    x = do.full(256, 5.0, do.float32).sync()
    y = do.zeros(256, do.float32).sync()
    g = slow_copy(y, x, 0.3).graph()
    fut = g.launch().submit()
    with pytest.raises(do.BorrowError):
        y.numpy()
    fut.result(timeout=30)
    assert np.all(y.numpy() == 5)


def test_replay_orders_writers_on_other_streams(backend) -> None:
    a, b = do.streams()[0], do.streams()[1 % len(do.streams())]
    x = do.full(4096, 7.0, do.float32).sync()
    y = do.zeros(4096, do.float32).sync()
    g = slow_copy(y, x, 0.2).graph()
    fut = g.launch().submit(a)
    # a reader on another stream waits for the replay's write; a writer waits for it too
    z = do.zeros(4096, do.float32).sync()
    K.scale(z.partition((128,)), y, 1.0).sync_on(b)
    assert np.all(z.numpy() == 7)
    fut.result(timeout=30)
    # and a replay waits for an earlier writer on another stream
    fut2 = slow_fill(x, 2.0, 0.2).submit(b)
    g.launch().sync_on(a)
    assert np.all(y.numpy() == 2)
    fut2.result(timeout=30)


def _accumulating(z: do.Tensor, x: do.Tensor, seconds: float) -> do.CudaGraph:
    """A graph that waits about ``seconds`` on the device, then adds x into z (z += x)."""
    tmp = do.zeros(x.size, do.float32).sync()
    return slow_copy(tmp, x, seconds).then(lambda _: K.add(z.partition((128,)), z, x)).graph()


def test_back_to_back_replays_on_one_stream_hand_their_entries_on(backend) -> None:
    a, b = pool_of(2)[:2]
    x = do.full(4096, 1.0, do.float32).sync()
    z = do.zeros(4096, do.float32).sync()
    g = _accumulating(z, x, 0.15)
    futs = [g.launch().submit(a) for _ in range(3)]
    # nothing else registered between them: each replay took over the one before's entries
    # (one per buffer, though all three are in flight), so the ledger names the last
    assert [e.execution for e in z.buffer.accesses] == [futs[-1]._cx]
    # a reader on another stream waits for the last replay, not only for the first
    out = do.zeros(4096, do.float32).sync()
    K.scale(out.partition((128,)), z, 1.0).sync_on(b)
    assert np.all(out.numpy() == 3)
    for f in futs:
        f.result(timeout=30)


def test_a_replay_on_another_stream_or_after_other_work_scans_again(backend) -> None:
    a, b = pool_of(2)[:2]
    x = do.full(4096, 1.0, do.float32).sync()
    z = do.zeros(4096, do.float32).sync()
    g = _accumulating(z, x, 0.15)
    busy = do.zeros(4096, do.float32).sync()
    first = slow_fill(busy, 1.0, 0.3).submit(a)  # the replay on a starts only after this
    fut = g.launch().submit(a)
    g.launch().sync_on(b)  # waits for the replay queued on a (both write z)
    assert np.all(z.numpy() == 2)
    fut.result(timeout=30)
    first.result(timeout=30)
    g.launch().submit(a)
    K.add(z.partition((128,)), z, x).submit(b)  # another execution's write between two replays
    fut = g.launch().submit(a)  # ordered after it
    fut.result(timeout=30)
    assert np.all(z.numpy() == 5) and live(z.buffer) == []


def test_sync_replays_release_the_ledger(backend) -> None:
    x0, x, y = _data(1024)
    g = _chain(y, x, 3).graph()
    s = do.streams()[-1]
    outs = [g.launch().sync_on(s) for _ in range(3)] + [g.launch().sync()]
    assert all(o is g.output for o in outs) and g.launches == 4
    np.testing.assert_allclose(y.numpy(), _chain_ref(x0, 3), rtol=1e-6)
    assert live(x.buffer) == [] and live(y.buffer) == []  # finished once each replay returned
    assert len(x.buffer.accesses) == 1 and len(y.buffer.accesses) == 1  # each replay reused one entry
    empty = do.graph.scope()
    with empty as sc:
        pass
    assert sc.graph.launch().sync() == ()


def test_sync_replay_refusals(backend) -> None:
    _, x, y = _data(256)
    g = K.scale(y.partition((128,)), x, 2.0).graph()
    op = g.launch()
    op.sync_on(do.streams()[0])
    with pytest.raises(do.UsageError, match="already consumed"):
        op.sync_on(do.streams()[0])
    with pytest.raises(do.UsageError, match="already consumed"):
        op.sync()
    with pytest.raises(do.UsageError, match="not a deviceop stream"):
        g.launch().sync_on(object())
    with do.graph.scope():
        with pytest.raises(do.CaptureError, match="graph recording"):
            g.launch().sync()
        with pytest.raises(do.CaptureError, match="graph recording"):
            g.launch().sync_on(do.streams()[0])
    assert g.launches == 1


def test_sync_replay_in_strict_mode_raises_and_releases(backend) -> None:
    a, b = pool_of(2)[:2]
    x = do.full(4096, 1.0, do.float32).sync()
    y = do.zeros(4096, do.float32).sync()
    g = K.scale(y.partition((128,)), x, 2.0).graph()
    do.set_borrow_policy("raise")
    try:
        fut = slow_fill(x, 3.0, 0.2).submit(b)
        with pytest.raises(do.BorrowError, match="still writes"):
            g.launch().sync_on(a)
        fut.result(timeout=30)
    finally:
        do.set_borrow_policy("order")
    assert g.launches == 0 and live(x.buffer) == [] and live(y.buffer) == []
    g.launch().sync_on(a)
    assert np.all(y.numpy() == 6)


def test_host_read_during_a_sync_replay_raises(backend) -> None:
    x = do.full(256, 5.0, do.float32).sync()
    y = do.zeros(256, do.float32).sync()
    g = slow_copy(y, x, 0.5).graph()
    seen = []

    def reader() -> None:  # runs while the main thread waits for the replay (without the GIL)
        time.sleep(0.15)
        try:
            y.numpy()
            seen.append("read")
        except do.BorrowError:
            seen.append("borrow")

    th = threading.Thread(target=reader)
    th.start()
    g.launch().sync_on(do.streams()[0])
    th.join(30)
    assert seen == ["borrow"] and np.all(y.numpy() == 5)


def test_a_replayed_graph_is_freed_with_its_last_name(backend) -> None:
    import gc
    import weakref

    s = do.streams()[0]
    x, y = do.full(1024, 2.0, do.float32).sync(), do.zeros(1024, do.float32).sync()
    g = K.scale(y.partition((128,)), x, 3.0).graph()
    op = g.launch()
    assert op.sync_on(s) is g.output and np.all(y.numpy() == 6)
    with pytest.raises(do.UsageError, match="already consumed by sync_on"):
        op.sync_on(s)
    assert op.source is g and repr(op).startswith("<launch of <CudaGraph")
    r = weakref.ref(g)
    del g
    assert r() is not None  # the consumed op still names it
    del op
    gc.collect()
    assert r() is None and live(x.buffer) == [] and live(y.buffer) == []


# -- update ------------------------------------------------------------------------------------------
def test_update_in_place_with_other_buffers(backend) -> None:
    x0, x, y = _data(1024)
    g = _chain(y, x, 3).graph()
    g.launch().sync()
    x1, x2, y2 = _data(1024, seed=5)
    assert g.update(_chain(y2, x2, 3)) == "updated"
    assert g.last_update == "updated" and g.updates["updated"] == 1
    out = g.launch().sync()
    assert out[0].tensor.buffer is y2.buffer
    np.testing.assert_allclose(y2.numpy(), _chain_ref(x1, 3), rtol=1e-6)
    np.testing.assert_allclose(y.numpy(), _chain_ref(x0, 3), rtol=1e-6)  # untouched by the new replay


def test_update_with_another_structure_reinstantiates(backend) -> None:
    x0, x, y = _data(1024)
    g = _chain(y, x, 3).graph()
    assert g.update(_chain(y, x, 1)) == "reinstantiated"
    assert g.nodes == 2
    g.launch().sync()
    np.testing.assert_allclose(y.numpy(), _chain_ref(x0, 1), rtol=1e-6)
    with do.graph.scope(update=g) as s:
        s.record(K.scale(y.partition((128,)), x, 5.0))
        s.record(K.scale(y.partition((128,)), x, 6.0))
    assert s.graph is g and s.update_result == "updated"
    g.launch().sync()
    np.testing.assert_allclose(y.numpy(), x0 * 6, rtol=1e-6)


def test_update_while_a_replay_is_in_flight(backend) -> None:
    x = do.full(256, 1.0, do.float32).sync()
    y = do.zeros(256, do.float32).sync()
    y2 = do.zeros(256, do.float32).sync()
    g = slow_copy(y, x, 0.2).graph()
    fut = g.launch().submit()
    assert g.update(slow_copy(y2, x, 0.0)) == "updated"
    fut.result(timeout=30)
    assert np.all(y.numpy() == 1) and np.all(y2.numpy() == 0)  # the queued replay ran the old work
    g.launch().sync()
    assert np.all(y2.numpy() == 1)


def test_a_replay_in_flight_keeps_what_its_recording_keeps_after_an_update(backend) -> None:
    """What a recording keeps (scope.keep: another library's memory pool, a cuBLAS workspace)
    lives while a replay of it runs, though an update dropped the recording meanwhile."""
    import weakref

    class Pool:
        pass

    x = do.full(256, 1.0, do.float32).sync()
    y, y2 = do.zeros(256, do.float32).sync(), do.zeros(256, do.float32).sync()
    pool = Pool()
    ref = weakref.ref(pool)
    with do.graph.scope() as sc:
        sc.keep(pool)
        sc.record(slow_copy(y, x, 0.3))
    g = sc.graph
    del pool, sc
    fut = g.launch().submit()
    assert g.update(slow_copy(y2, x, 0.0)) in ("updated", "reinstantiated")
    gc.collect()
    assert ref() is not None  # (the replay in flight holds it)
    fut.result(timeout=30)
    gc.collect()
    assert ref() is None
    assert np.all(y.numpy() == 1)


def test_failed_update_keeps_the_old_graph(backend) -> None:
    x0, x, y = _data(256)
    g = K.scale(y.partition((128,)), x, 2.0).graph()
    with pytest.raises(do.CaptureError):
        g.update(do.zeros(4))
    g.launch().sync()
    np.testing.assert_allclose(y.numpy(), x0 * 2, rtol=1e-6)


# -- the bucketed cache --------------------------------------------------------------------------------
def _double_rows(inp: do.Tensor) -> do.DeviceOp:
    out = do.empty(inp.shape, inp.dtype).sync()  # allocated outside the recording
    return K.scale(out.partition((1, *inp.shape[1:])), inp, 2.0).map(lambda a: a[0].tensor)


def test_power_of_two_buckets() -> None:
    assert do.graph.power_of_two_buckets(8) == [1, 2, 4, 8]
    assert do.graph.power_of_two_buckets(12) == [1, 2, 4, 8, 12]
    assert do.graph.power_of_two_buckets(1) == [1]
    with pytest.raises(do.UsageError):
        do.graph.power_of_two_buckets(0)


def test_cache_buckets_padding_and_counters(backend) -> None:
    c = do.graph.GraphCache(_double_rows, max_size=16)
    assert c.buckets == [1, 2, 4, 8, 16]
    rng = np.random.default_rng(3)
    sizes = [3, 4, 3, 1, 16, 9, 20, 5]
    for n in sizes:
        a = rng.standard_normal((n, 33)).astype(np.float16)
        out = c(do.from_numpy(a).sync()).sync()
        assert out.shape == (n, 33)
        np.testing.assert_array_equal(out.numpy(), (a.astype(np.float32) * 2).astype(np.float16))
    s = c.stats()
    # buckets: 3->4 miss, 4 hit, 3 hit, 1 miss, 16 miss, 9->16 hit, 20 eager, 5->8 miss
    assert (s["calls"], s["hits"], s["misses"], s["eager"]) == (8, 3, 4, 1)
    assert s["rows"] == 3 + 4 + 3 + 1 + 16 + 9 + 5
    assert s["padded_rows"] == 1 + 0 + 1 + 0 + 0 + 7 + 3
    assert s["hit_rate"] == pytest.approx(3 / 8)
    assert s["padding_waste"] == pytest.approx(12 / (41 + 12))
    c.clear()
    assert c.stats()["calls"] == 0


def test_cache_outputs_are_fresh_unless_asked(backend) -> None:
    c = do.graph.GraphCache(_double_rows, buckets=[4])
    a = c(do.full((3, 8), 1.0, do.float32).sync()).sync()
    b = c(do.full((2, 8), 5.0, do.float32).sync()).sync()
    assert np.all(a.numpy() == 2) and np.all(b.numpy() == 10)
    v = do.graph.GraphCache(_double_rows, buckets=[4], copy_out=False)
    a = v(do.full((3, 8), 1.0, do.float32).sync()).sync()
    v(do.full((3, 8), 5.0, do.float32).sync()).sync()
    assert np.all(a.numpy() == 10)  # a view of the bucket's static output


def test_cache_padding_rows_are_zero(backend) -> None:
    seen = {}

    def build(inp: do.Tensor) -> do.DeviceOp:
        seen["inp"] = inp
        return _double_rows(inp)

    c = do.graph.GraphCache(build, buckets=[8])
    c(do.full((8, 4), 3.0, do.float32).sync()).sync()
    c(do.full((2, 4), 1.0, do.float32).sync()).sync()
    got = seen["inp"].numpy()
    assert np.all(got[:2] == 1) and np.all(got[2:] == 0)


def test_cache_awaited(backend) -> None:
    c = do.graph.GraphCache(_double_rows, max_size=8)

    async def main() -> list[np.ndarray]:
        outs = []
        for n in (5, 7, 2):
            t = await do.full((n, 16), float(n), do.float32)
            outs.append(await do.to_numpy(await c(t)))
        return outs

    for n, o in zip((5, 7, 2), anyio.run(main)):
        assert o.shape == (n, 16) and np.all(o == 2 * n)


def test_cache_bad_input(backend) -> None:
    with pytest.raises(do.UsageError, match=r"buckets=.*max_size"):
        do.graph.GraphCache(_double_rows)
    for bad in ([0, 4], [1, "a"], 5, [[1]], [], [2.0], "12"):  # (a few were raw TypeErrors)
        with pytest.raises(do.UsageError, match="positive ints"):
            do.graph.GraphCache(_double_rows, buckets=bad)  # type: ignore[arg-type]
    for ok, want in (({4, 1, 2}, [1, 2, 4]), (range(1, 5, 2), [1, 3]), (iter([2, 1]), [1, 2])):  # any iterable
        assert do.graph.GraphCache(_double_rows, buckets=ok).buckets == want  # type: ignore[arg-type]
    with pytest.raises(do.UsageError, match="callable"):
        do.graph.GraphCache(3)  # type: ignore[arg-type]
    c = do.graph.GraphCache(_double_rows, max_size=4)
    with pytest.raises(do.UsageError, match="takes a Tensor"):
        c(np.ones(3))  # type: ignore[arg-type]
    with pytest.raises(do.ShapeError, match="at least one row"):
        c(do.zeros((0, 3)).sync())
    t = do.zeros((4, 4)).sync()
    with pytest.raises(do.ShapeError, match="contiguous"):
        c(t[:, 1:3])
    bad = do.graph.GraphCache(
        lambda inp: K.scale(do.zeros(inp.shape).sync().partition((1, inp.shape[1])), inp, 1.0), max_size=4
    )
    with pytest.raises(do.UsageError, match="output is a contiguous Tensor"):
        bad(do.zeros((2, 4)).sync()).sync()
    alloc = do.graph.GraphCache(lambda inp: do.zeros(inp.shape), max_size=4)
    with pytest.raises(do.CaptureError, match="allocates"):
        alloc(do.zeros((2, 4)).sync()).sync()


def test_cache_copies_are_recorded_once_each_and_used_in_turn(backend) -> None:
    inputs = []

    def build(inp: do.Tensor) -> do.DeviceOp:
        inputs.append(inp)
        return _double_rows(inp)

    c = do.graph.GraphCache(build, buckets=[4], copies=3)
    streams = do.streams()
    for i in range(7):
        x = do.full((2 + i % 3, 8), float(i), do.float32).sync()
        y = c(x).sync_on(streams[i % len(streams)])
        assert y.shape == (2 + i % 3, 8) and np.all(y.numpy() == 2 * i)
    s = c.stats()
    assert (s["calls"], s["misses"], s["hits"]) == (7, 3, 4)
    assert len(inputs) == 3 and len({id(t.buffer) for t in inputs}) == 3  # three recordings
    assert "copies=3 graphs=3" in repr(c)
    # calls in flight at once on several streams: each gets its own result
    outs = [c(do.full((3, 8), float(k), do.float32).sync()).submit(stream=streams[k % len(streams)]) for k in range(9)]
    for k, f in enumerate(outs):
        assert np.all(f.result(timeout=30).numpy() == 2 * k)
    c.clear()
    assert "graphs=0" in repr(c)


def test_cache_run_numpy_uploads_into_the_static_input_and_downloads_its_rows(backend) -> None:
    seen = []

    def build(inp: do.Tensor) -> do.DeviceOp:
        seen.append(inp)
        return _double_rows(inp)

    c = do.graph.GraphCache(build, buckets=[4, 8], copies=2)
    rng = np.random.default_rng(5)
    for n in (3, 8, 1, 4, 8, 2, 11):  # 11: larger than every bucket, run eagerly
        a = rng.standard_normal((n, 6)).astype(np.float32)
        y = c.run_numpy(a).sync()
        assert isinstance(y, np.ndarray) and y.shape == (n, 6) and y.dtype == np.float32
        np.testing.assert_array_equal(y, a * 2)
    # the padding rows of a call are zeros, not an earlier call's rows: the first recording of
    # bucket 4 (calls of 3 and 4 rows) now takes 1 row
    c.run_numpy(np.full((1, 6), 7.0, np.float32)).sync()
    got = seen[0].numpy()
    assert got.shape == (4, 6) and np.all(got[0] == 7) and np.all(got[1:] == 0)
    s = c.stats()
    assert (s["calls"], s["eager"], s["misses"]) == (8, 1, 4)  # two copies of two buckets
    assert s["rows"] == 3 + 8 + 1 + 4 + 8 + 2 + 1 and s["padded_rows"] == 1 + 0 + 3 + 0 + 0 + 2 + 3
    # a snapshot: the array may change as soon as the call is enqueued
    a = np.ones((2, 6), np.float32)
    fut = c.run_numpy(a).submit()
    a[:] = 5
    np.testing.assert_array_equal(fut.result(timeout=30), np.full((2, 6), 2.0, np.float32))
    # a strided array is taken as its C-ordered copy
    b = np.arange(48, dtype=np.float32).reshape(8, 6)[::2]
    np.testing.assert_array_equal(c.run_numpy(b).sync(), b * 2)


def test_cache_run_numpy_calls_in_flight_at_once_each_get_their_own_rows(backend) -> None:
    c = do.graph.GraphCache(_double_rows, buckets=[4], copies=2)
    streams = do.streams()

    out: list[np.ndarray | None] = [None] * 24

    async def one(k: int) -> None:
        a = np.full((1 + k % 4, 16), float(k), np.float32)
        out[k] = await c.run_numpy(a).wait(stream=streams[k % len(streams)])

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for k in range(24):
                tg.start_soon(one, k)

    anyio.run(main)
    for k, y in enumerate(out):
        assert y is not None
        assert y.shape == (1 + k % 4, 16) and np.all(y == 2 * k)


def test_cache_run_numpy_refuses_what_it_cannot_take(backend) -> None:
    c = do.graph.GraphCache(_double_rows, buckets=[4])
    with pytest.raises(do.UsageError, match=r"takes a numpy\.ndarray"):
        c.run_numpy(do.zeros((2, 4)).sync())  # type: ignore[arg-type]
    with pytest.raises(do.ShapeError, match="at least one row"):
        c.run_numpy(np.zeros((0, 4), np.float32))
    with pytest.raises(do.ShapeError, match="at least one row"):
        c.run_numpy(np.array(3.0, np.float32))
    with pytest.raises(do.DTypeError, match=r"convert it first: x\.astype"):
        c.run_numpy(np.zeros((2, 4), np.complex64))
    with pytest.raises(do.UsageError, match=r"numpy\.stack\(rows\)"):
        c.run_numpy([np.zeros(4, np.float32)])  # type: ignore[arg-type]
    eager = do.graph.GraphCache(lambda inp: 3, buckets=[1])  # type: ignore[arg-type,return-value]
    with pytest.raises(do.UsageError, match="must return a DeviceOp"):
        eager.run_numpy(np.zeros((2, 4), np.float32)).sync()  # (larger than every bucket: build runs eagerly)
    with do.graph.scope() as sc:
        with pytest.raises(do.CaptureError, match="graphs do not nest"):
            sc.record(c.run_numpy(np.zeros((2, 4), np.float32)))


@pytest.mark.parametrize("copies", [0, -1, 65, 1.0, True, None])
def test_cache_copies_out_of_range_are_refused(copies) -> None:
    with pytest.raises(do.UsageError, match="copies must be an int from 1 to 64"):
        do.graph.GraphCache(_double_rows, buckets=[4], copies=copies)


@pytest.mark.parametrize("copies", [1, 3])
def test_graph_cache_from_several_threads_gives_each_call_its_own_result(backend, monkeypatch, copies) -> None:
    # a call is three enqueues on the bucket's shared buffers (copy in, replay, copy out);
    # another thread's call must never slip between them (it used to: its replay then fed this
    # call's copy out). The window is widened: the copy out's allocation waits 1 ms.
    import time as _time

    from helpers import run_threads

    from deviceop.graph import _cache

    real_new_tensor = _cache.new_tensor

    def slow_new_tensor(*a, **kw):
        _time.sleep(0.001)
        return real_new_tensor(*a, **kw)

    monkeypatch.setattr(_cache, "new_tensor", slow_new_tensor)

    def build(inp):
        out = do.empty(inp.shape, inp.dtype).sync()
        return K.scale(out.partition((1, inp.shape[1])), inp, 2.0).map(lambda a: a[0].tensor)

    cache = do.graph.GraphCache(build, max_size=8, copies=copies)
    wrong = []

    def worker(k: int) -> None:
        s = do.streams()[k % len(do.streams())]
        for i in range(100):
            n = 3 if i % 4 else 1 + (i + k) % 8  # mostly one bucket: the calls share its buffers
            v = float(1000 * k + i)
            x = do.full((n, 64), v, do.float32).sync_on(s)
            y = cache(x).sync_on(s)
            got = y.numpy()
            if got.shape != (n, 64) or not np.all(got == 2 * v):
                wrong.append((k, i, float(got.flat[0])))

    errors = run_threads(worker, 4)
    assert not errors, errors[:3]
    assert not wrong, f"{len(wrong)} of 400 calls got another call's result, e.g. {wrong[:3]}"
