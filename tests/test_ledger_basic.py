"""The access ledger: program order across streams, host-access borrow checks, memory reuse."""

from __future__ import annotations

import gc
import os
import time

import numpy as np
import pytest
from helpers import K, live, pool_of, slow_copy, slow_fill

import deviceop as do

N = 1024


def _two_streams():
    st = pool_of(2)
    return st[0], st[1]


def test_write_on_one_stream_read_on_another(backend):
    s0, s1 = _two_streams()
    t = do.zeros(N, do.float32).sync()
    fut = slow_fill(t, 3.0, 0.1).submit(s0)
    out = do.to_numpy(t).sync_on(s1)  # must wait for the write in flight on s0
    np.testing.assert_array_equal(out, np.full(N, 3.0, np.float32))
    fut.result(timeout=30)


def test_write_after_read_waits_for_the_reader(backend):
    s0, s1 = _two_streams()
    x = do.full(N, 1.0, do.float32).sync()
    y = do.full(N, np.nan, do.float32).sync()
    fut = slow_copy(y, x, 0.1).submit(s0)  # reads x slowly
    K.fill(x.partition((128,)), 2.0).sync_on(s1)  # must not overtake the read
    fut.result(timeout=30)
    np.testing.assert_array_equal(y.numpy(), np.full(N, 1.0, np.float32))
    np.testing.assert_array_equal(x.numpy(), np.full(N, 2.0, np.float32))


def test_writes_across_the_pool_land_in_issue_order(backend):
    streams = do.streams()
    t = do.zeros(N, do.float32).sync()
    futs = [K.fill(t.partition((128,)), float(i)).submit(streams[i % len(streams)]) for i in range(24)]
    for f in futs:
        f.result(timeout=30)
    np.testing.assert_array_equal(t.numpy(), np.full(N, 23.0, np.float32))


def test_read_modify_write_chain_across_streams(backend):
    streams = do.streams()
    t = do.zeros(N, do.float32).sync()
    one = do.ones(N, do.float32).sync()
    futs = [K.add(t.partition((256,)), t, one).submit(streams[i % len(streams)]) for i in range(20)]
    for f in futs:
        f.result(timeout=30)
    np.testing.assert_array_equal(t.numpy(), np.full(N, 20.0, np.float32))


def test_disjoint_halves_on_two_streams(backend):
    s0, s1 = _two_streams()
    t = do.zeros(N, do.float32).sync()
    f0 = K.fill(t[: N // 2].partition((128,)), 1.0).submit(s0)
    f1 = K.fill(t[N // 2 :].partition((128,)), 2.0).submit(s1)
    f0.result(timeout=30), f1.result(timeout=30)
    np.testing.assert_array_equal(t.numpy(), np.repeat(np.float32([1.0, 2.0]), N // 2))


def test_numpy_raises_borrow_error_while_in_flight(backend):
    t = do.zeros(N, do.float32).sync()
    fut = slow_fill(t, 4.0, 0.3).submit()
    with pytest.raises(do.BorrowError, match=r"sync\(\)|await|to_numpy"):
        t.numpy()
    # a view of the same memory is in flight too
    with pytest.raises(do.BorrowError):
        t[10:20].numpy()
    fut.result(timeout=30)
    np.testing.assert_array_equal(t.numpy(), np.full(N, 4.0, np.float32))


def test_numpy_of_untouched_memory_while_other_part_in_flight(backend):
    s0, s1 = _two_streams()  # the read must not queue behind the fill on its stream
    t = do.zeros(N, do.float32).sync()
    fut = slow_fill(t[: N // 2], 4.0, 0.3).submit(s1)
    t[N // 2 :].check_host_access()  # untouched memory: readable
    np.testing.assert_array_equal(do.to_numpy(t[N // 2 :]).sync_on(s0), np.zeros(N // 2, np.float32))
    if os.environ.get("DEVICEOP_SANITIZER") and fut.done():
        # compute-sanitizer serialises launches: the read on s0 waited for the fill on s1
        pytest.skip("under compute-sanitizer the fill completed before the host read")
    with pytest.raises(do.BorrowError):
        t.numpy()
    fut.result(timeout=30)


def _settle(baseline: int, timeout: float = 5.0) -> int:
    """used_bytes once frees have gone through (stream-ordered frees on cuda)."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        for s in do.streams():
            s.synchronize()
        used = do.used_bytes()
        if used <= baseline or time.monotonic() > deadline:
            return used
        time.sleep(0.01)


def _churn(rounds: int) -> None:
    for i in range(rounds):
        x = do.from_numpy(np.full(4096, i, np.float32))
        out = K.add(do.empty(4096, do.float32).map(lambda t: t.partition((512,))), x, do.ones(4096, do.float32))
        futs = [out.submit()]
        futs.append(do.zeros((64, 64), do.float16).then(lambda t: K.fill(t.partition((8, 64)), 1.0)).submit())
        for f in futs:
            f.result(timeout=30)
        del futs, f


def test_used_bytes_returns_to_baseline(backend):
    _churn(1)  # warm up: anything a first call keeps (compiled modules, pools) is kept from here on
    baseline = _settle(do.used_bytes())
    _churn(8)
    assert do.used_bytes() >= 0
    used = _settle(baseline)
    assert used == baseline, f"{used - baseline} bytes still held after the results were dropped"


def test_used_bytes_returns_to_baseline_after_a_large_builtin_call(backend):
    _churn(1)
    baseline = _settle(do.used_bytes())
    n = 1 << 20  # larger than anything else in the suite
    r = K.add(do.empty(n).map(lambda t: t.partition((1024,))), do.ones(n), do.ones(n)).sync()
    assert do.used_bytes() >= baseline + 3 * 4 * n - 3 * 4 * 4096  # the three tensors are live now
    del r
    used = _settle(baseline)
    assert used == baseline, f"{used - baseline} bytes still held after the results were dropped"


def test_used_bytes_returns_to_baseline_user_kernel(backend):
    k = K.Kernel(
        'extern "C" __global__ void ub(float* y) { y[blockIdx.x * blockDim.x + threadIdx.x] = 1.0f; }',
        "ub",
        params=(K.Out(do.float32),),
        host=lambda y: y.fill(1.0),
    )
    baseline = _settle(do.used_bytes())
    n = 1 << 20
    r = k(do.empty(n).map(lambda t: t.partition((128,)))).sync()
    assert do.used_bytes() >= baseline + 4 * n
    del r
    used = _settle(baseline)
    assert used == baseline, f"{used - baseline} bytes still held after the results were dropped"


def test_buffers_stay_alive_while_in_flight(backend):
    # dropping every Python reference while the work is in flight must not free it early
    fut = do.zeros(N, do.float32).then(lambda t: slow_fill(t, 8.0, 0.1)).first().map(lambda p: p.tensor.nbytes).submit()
    gc.collect()
    assert fut.result(timeout=30) == N * 4


def test_strict_mode_raises_on_cross_stream_conflict(backend):
    s0, s1 = _two_streams()
    t = do.zeros(N, do.float32).sync()
    do.set_borrow_policy("raise")
    try:
        assert do.borrow_policy() == "raise"
        fut = slow_fill(t, 1.0, 0.3).submit(s0)
        with pytest.raises(do.BorrowError, match="fill") as ei:
            K.fill(t.partition((128,)), 2.0).sync_on(s1)
        assert "slow_fill" in str(ei.value) or "submit" in str(ei.value)
        # reads of the same region conflict with the write too
        with pytest.raises(do.BorrowError):
            do.to_numpy(t).sync_on(s1)
        # the same stream is ordered by the stream: no conflict
        out = do.to_numpy(t).sync_on(s0)
        np.testing.assert_array_equal(out, np.full(N, 1.0, np.float32))
        fut.result(timeout=30)
        # once the writer finished, other streams may use it
        K.fill(t.partition((128,)), 2.0).sync_on(s1)
    finally:
        do.set_borrow_policy("order")
    assert do.borrow_policy() == "order"
    np.testing.assert_array_equal(t.numpy(), np.full(N, 2.0, np.float32))


def test_strict_mode_allows_disjoint_partitions_and_shared_reads(backend):
    s0, s1 = _two_streams()
    t = do.zeros(N, do.float32).sync()
    src = do.ones(N, do.float32).sync()
    do.set_borrow_policy("raise")
    try:
        f0 = slow_fill(t[: N // 2], 5.0, 0.1).submit(s0)
        K.fill(t[N // 2 :].partition((128,)), 6.0).sync_on(s1)  # disjoint: no conflict
        f1 = slow_copy(do.empty(N).sync(), src, 0.1).submit(s0)
        K.scale(do.empty(N).sync().partition((128,)), src, 2.0).sync_on(s1)  # read + read: fine
        f0.result(timeout=30), f1.result(timeout=30)
    finally:
        do.set_borrow_policy("order")
    np.testing.assert_array_equal(t.numpy(), np.repeat(np.float32([5.0, 6.0]), N // 2))


def test_bad_borrow_policy():
    with pytest.raises(ValueError, match="order"):
        do.set_borrow_policy("sometimes")
    assert do.borrow_policy() == "order"


def test_strict_mode_raises_on_write_after_read(backend):
    s0, s1 = _two_streams()
    src = do.ones(N, do.float32).sync()
    dst = do.zeros(N, do.float32).sync()
    do.set_borrow_policy("raise")
    try:
        fut = slow_copy(dst, src, 0.3).submit(s0)  # reads src for a while
        with pytest.raises(do.BorrowError, match="writes"):
            K.fill(src.partition((128,)), 9.0).sync_on(s1)  # a write while the read is in flight
        fut.result(timeout=30)
    finally:
        do.set_borrow_policy("order")
    np.testing.assert_array_equal(dst.numpy(), np.ones(N, np.float32))  # the read saw the old values


def test_dropped_future_frees_nothing_early(backend):
    baseline = _settle(do.used_bytes())
    n = 1 << 18
    src = do.full(n, 3.0, do.float32).sync()
    fut = do.empty(n).then(lambda t, src=src: slow_copy(t, src, 0.3)).first().map(lambda p: p.tensor).submit()
    del fut  # nobody waits any more; the slow copy is still in flight
    gc.collect()
    # the destination (4n bytes) is still held by the work in flight, on top of src
    assert do.used_bytes() >= baseline + 2 * 4 * n
    del src
    assert _settle(baseline, timeout=10) == baseline  # and everything returns once the work completes


def test_the_ledger_lock_excludes_other_threads():
    # the native Lock (where built) must behave as threading.Lock: exclusive, not re-entrant
    import threading
    import time

    from deviceop._core._base import LOCK

    order = []

    def other():
        with LOCK:
            order.append("other")

    with LOCK:
        th = threading.Thread(target=other)
        th.start()
        time.sleep(0.05)  # the other thread waits (without the GIL) while we hold the lock
        order.append("main")
    th.join(10)
    assert order == ["main", "other"] and not LOCK.locked()
    with pytest.raises(RuntimeError):
        LOCK.release()


def test_finished_entries_are_reused_and_dropped_by_the_next_registration(backend):
    # a finished execution's entries stop counting at once and go at the next registration on
    # the buffer (one reused in place, the others dropped); in-flight entries of another stay
    from deviceop._core._base import LOCK
    from deviceop._core._ledger import ExecutionContext, enqueue

    s0, s1, s2 = pool_of(3)[:3]
    b1 = do.zeros(16, do.float32).sync().buffer
    b2 = do.zeros(16, do.float32).sync().buffer
    mine, other = ExecutionContext(s0, "mine"), ExecutionContext(s1, "other")
    enqueue(mine, ((b1, 0, 32, True), (b2, 0, 16, False), (b1, 32, 64, False)), None, "test")
    enqueue(other, ((b1, 0, 32, False),), None, "test")  # ordered after mine's write (another stream)
    assert len(b1.accesses) == 3 and len(b2.accesses) == 1
    assert other._waited == (mine,)
    mine.finish()
    assert [a.execution for a in live(b1)] == [other] and live(b2) == []
    assert mine.buffers is None and mine.done and not LOCK.locked()
    third = ExecutionContext(s2, "third")
    enqueue(third, ((b1, 0, 64, True),), None, "test")  # after other's read: waits for it only
    assert third._waited == (other,)
    assert [a.execution for a in b1.accesses] == [other, third]  # mine's two entries: one reused, one dropped
    assert b1.accesses[-1].span == (0, 64) and b1.accesses[-1].writes
    other.finish()
    third.finish()
    assert live(b1) == [] and not LOCK.locked()
    fourth = ExecutionContext(s0, "fourth")
    enqueue(fourth, ((b2, 0, 16, True),), None, "test")
    assert [a.execution for a in b2.accesses] == [fourth] and fourth._waited == ()
    fourth.finish()


def test_readers_on_one_stream_keep_one_entry_and_a_writer_elsewhere_waits_for_all(backend):
    """Many unfinished executions reading one buffer on one stream (a model's weights under many
    requests in flight): each newer read supersedes the older one's entry, so the list holds one
    entry per stream and stays short; a write on another stream then waits for the newest
    reader, which on that stream runs after every older one. An entry of another stream, a
    wider older access, or an older write that a read cannot stand for, stays."""
    from deviceop._core._ledger import ExecutionContext, enqueue

    s0, s1, s2 = pool_of(3)[:3]
    w = do.zeros(64, do.float32).sync().buffer
    readers = [ExecutionContext(s0, f"reader {i}") for i in range(40)]
    for cx in readers:
        enqueue(cx, ((w, 0, 256, False),), None, "test")
    assert [a.execution for a in w.accesses] == [readers[-1]]
    assert all(w in cx.buffers for cx in readers)  # each still holds the buffer until it finishes
    elsewhere = ExecutionContext(s1, "reader elsewhere")
    enqueue(elsewhere, ((w, 0, 256, False),), None, "test")
    narrow = ExecutionContext(s0, "narrow reader")
    enqueue(narrow, ((w, 0, 128, False),), None, "test")  # covers less: the wider entry stays
    assert [a.execution for a in w.accesses] == [readers[-1], elsewhere, narrow]
    writer = ExecutionContext(s2, "writer")
    enqueue(writer, ((w, 0, 256, True),), None, "test")
    assert set(writer._waited) == {readers[-1], elsewhere, narrow}
    later_reader = ExecutionContext(s2, "reader after the write")
    enqueue(later_reader, ((w, 0, 256, False),), None, "test")
    assert writer in [a.execution for a in w.accesses]  # a read does not stand for a write
    for cx in (*readers, elsewhere, narrow, writer, later_reader):
        cx.finish()


class _Recording:
    """A stream stand-in for an execution: delegates to ``s``, recording the events it is made
    to wait for."""

    def __init__(self, s):
        self.s, self.backend, self.handle_int = s, s.backend, s.handle_int
        self.waits: list[object] = []

    def wait(self, ev):
        self.waits.append(ev)
        self.s.wait(ev)

    def record(self, ev):
        self.s.record(ev)


def test_a_writer_waits_again_for_an_execution_that_read_more_since(backend):
    """Steps of executions interleaved (sliced awaits, threads): W waited for B once; B then
    read a buffer after A on B's stream, and its entry stands for A's. W's write of that buffer
    waits for B again, on an event after that read (once was not enough: W's first wait came
    before A's read). B's work on memory W does not meet makes W wait for nothing more."""
    from deviceop._core._ledger import ExecutionContext, enqueue

    s0, s1 = pool_of(2)[:2]
    buf1, buf2, buf3, buf4 = (do.zeros(64, do.float32).sync().buffer for _ in range(4))
    ws = _Recording(s1)
    a, b, w = ExecutionContext(s0, "A"), ExecutionContext(s0, "B"), ExecutionContext(ws, "W")
    enqueue(b, ((buf1, 0, 256, False), (buf3, 0, 256, False)), None, "test")
    enqueue(w, ((buf1, 0, 256, True),), None, "test")
    assert len(ws.waits) == 1
    enqueue(b, ((buf4, 0, 256, True),), None, "test")  # B works elsewhere meanwhile
    enqueue(w, ((buf3, 0, 256, True),), None, "test")  # B's entry there is as it was: no new wait
    assert len(ws.waits) == 1
    enqueue(a, ((buf2, 0, 256, False),), None, "test")
    enqueue(b, ((buf2, 0, 256, False),), None, "test")
    assert [x.execution for x in buf2.accesses] == [b]
    enqueue(w, ((buf2, 0, 256, True),), None, "test")
    assert len(ws.waits) == 2 and ws.waits[1] is not ws.waits[0] and w._waited == (b,)
    for cx in (a, b, w):
        cx.finish()


def test_a_reader_waits_for_a_write_covered_by_the_writers_older_entry(backend):
    """B wrote a buffer, W read it on another stream, B wrote it again: B's older entry covers
    the second write, and it goes last, so that W's next read (its own entry no longer the
    newest) waits for that write as well."""
    from deviceop._core._ledger import ExecutionContext, enqueue

    s0, s1 = pool_of(2)[:2]
    buf = do.zeros(64, do.float32).sync().buffer
    ws = _Recording(s1)
    b, w = ExecutionContext(s0, "B"), ExecutionContext(ws, "W")
    enqueue(b, ((buf, 0, 256, True),), None, "test")
    enqueue(w, ((buf, 0, 256, False),), None, "test")
    assert len(ws.waits) == 1
    enqueue(b, ((buf, 0, 256, True),), None, "test")  # (B's stream waits for W's read)
    assert [x.execution for x in buf.accesses] == [w, b]
    enqueue(w, ((buf, 0, 256, False),), None, "test")
    assert len(ws.waits) == 2 and ws.waits[1] is not ws.waits[0]
    for cx in (b, w):
        cx.finish()


def test_a_reread_covered_by_an_older_entry_stays_in_place_beside_readers(backend):
    """Readers on two streams in turn: a read covered by the reader's older entry, with only
    reads after it, changes nothing (no move, no new epoch: a graph's kept entries stay valid);
    once another execution wrote there, the covered access moves its entry last."""
    from deviceop._core._ledger import ExecutionContext, enqueue

    s0, s1, s2 = pool_of(3)[:3]
    buf = do.zeros(64, do.float32).sync().buffer
    b, c = ExecutionContext(s0, "B"), ExecutionContext(s1, "C")
    enqueue(b, ((buf, 0, 256, False),), None, "test")
    enqueue(c, ((buf, 0, 256, False),), None, "test")
    before = list(buf.accesses)
    enqueue(b, ((buf, 0, 128, False),), None, "test")
    assert list(buf.accesses) == before
    w = ExecutionContext(s2, "W")
    enqueue(w, ((buf, 128, 256, True),), None, "test")  # (after both reads)
    enqueue(b, ((buf, 0, 256, False),), None, "test")  # (after W's write: B waits for it)
    assert [x.execution for x in buf.accesses][-1] is b and b._waited == (w,)
    for cx in (b, c, w):
        cx.finish()


def test_superseded_readers_still_order_a_later_write(backend):
    """What the entries stand for, run: requests read a buffer slowly on one stream while a write
    to it is issued on another; the write lands after every read (each copy saw the old values)."""
    s0, s1 = _two_streams()
    x = do.full(N, 1.0, do.float32).sync()
    ys = [do.full(N, np.nan, do.float32).sync() for _ in range(6)]
    futs = [slow_copy(y, x, 0.03).submit(s0) for y in ys]
    assert len(live(x.buffer)) == 1
    K.fill(x.partition((128,)), 2.0).sync_on(s1)
    for f in futs:
        f.result(timeout=30)
    for y in ys:
        np.testing.assert_array_equal(y.numpy(), np.full(N, 1.0, np.float32))
    np.testing.assert_array_equal(x.numpy(), np.full(N, 2.0, np.float32))


def test_a_finished_execution_holds_no_buffer(backend):
    # its entries stay in the buffers' lists until reused, but they keep nothing alive
    import weakref

    from deviceop._core._ledger import ExecutionContext, enqueue

    t = do.zeros(64, do.float32).sync()
    cx = ExecutionContext(pool_of(1)[0], "holder")
    enqueue(cx, ((t, True),), None, "test")
    r = weakref.ref(t.buffer)
    cx.finish()
    del t
    gc.collect()
    assert r() is None and cx.buffers is None


def test_a_callback_added_after_finish_runs_at_once(backend):
    # a buffer dropped while its execution finishes on another thread asks to be released "once
    # that execution is done": added after the finish, the callback must run, not wait for good
    from deviceop._core._ledger import ExecutionContext

    cx = ExecutionContext(pool_of(1)[0], "finished")
    ran: list[int] = []
    cx.on_done(lambda: ran.append(1))
    cx.finish()
    assert ran == [1]
    cx.on_done(lambda: ran.append(2))
    assert ran == [1, 2]


def test_views_named_in_turn_keep_the_access_list_short(backend):
    """One execution writing two halves of a buffer in turn: each half is registered once, and
    the buffer's in-flight list stays short (it grew with every step before)."""
    t = do.zeros(512, do.float32).sync()
    lo, hi = t[:256], t[256:]
    z = do.zeros(128, do.float32).sync()
    op = do.value(None)
    for i in range(40):
        op = op.then(lambda _, v=i: K.fill((lo if v % 2 else hi).partition((128,)), float(v)))
    fut = op.then(lambda _: slow_fill(z, 1.0, 0.2)).submit()
    assert len(t.buffer.accesses) <= 2, len(t.buffer.accesses)
    fut.result()
    np.testing.assert_array_equal(t.numpy()[:256], np.full(256, 39.0, np.float32))
    np.testing.assert_array_equal(t.numpy()[256:], np.full(256, 38.0, np.float32))
