"""Composition semantics of DeviceOp: value/then/map/inspect/zip/first/last/shared, terminals."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from helpers import K, pool_of, slow_fill

import deviceop as do
from deviceop._core._base import set_lend_cap

N = 1024


def test_value_sync_returns_the_object(backend):
    x = object()
    assert do.value(x).sync() is x


def test_ops_are_lazy_until_a_terminal(backend):
    calls = []
    before = do.used_bytes()
    op = do.zeros((1 << 16,), do.float32).inspect(lambda t: calls.append(t)).map(lambda t: t.shape)
    assert calls == [] and do.used_bytes() == before  # building did nothing
    assert op.sync() == (1 << 16,)
    assert len(calls) == 1 and isinstance(calls[0], do.Tensor)


def test_map_transforms_on_the_host(backend):
    assert do.value(20).map(lambda x: x + 1).map(lambda x: x * 2).sync() == 42


def test_inspect_passes_output_on(backend):
    seen = []
    out = do.value((3, 4)).inspect(seen.append).sync()
    assert out == (3, 4) and seen == [(3, 4)]


def test_then_runs_after_and_sees_prior_writes(backend):
    # then runs on the same stream: the fill must see the zeros, the read must see the fill
    out = (
        do.zeros(N, do.float32)
        .then(lambda t: K.fill(t.partition((128,)), 2.5))
        .first()
        .then(lambda p: K.scale(do.empty(N, do.float32).map(lambda u: u.partition((256,))), do.value(p.tensor), 3.0))
        .first()
        .then(lambda p: do.to_numpy(p.tensor))
        .sync()
    )
    np.testing.assert_array_equal(out, np.full(N, 7.5, np.float32))


def test_then_gets_the_output_of_the_previous_op(backend):
    got = []

    def step(x):
        got.append(x)
        return do.value(x * 10)

    assert do.value(7).then(step).then(step).sync() == 700
    assert got == [7, 70]


def test_zip_first_last(backend):
    a, b, c = do.zip(do.value(1), do.value("two"), do.value(3.0)).sync()
    assert (a, b, c) == (1, "two", 3.0)
    assert do.zip(do.value(1), do.value(2), do.value(3)).first().sync() == 1
    assert do.zip(do.value(1), do.value(2), do.value(3)).last().sync() == 3


def test_zip_of_tensor_ops(backend):
    x = np.arange(N, dtype=np.float32)
    t1, t2 = do.zip(do.from_numpy(x), do.full(N, 4.0, do.float32)).sync()
    np.testing.assert_array_equal(t1.numpy(), x)
    np.testing.assert_array_equal(t2.numpy(), np.full(N, 4.0, np.float32))


def test_zip_then_kernel_on_both_outputs(backend):
    rng = np.random.default_rng()
    x = rng.standard_normal(N).astype(np.float32)
    y = rng.standard_normal(N).astype(np.float32)
    out = (
        do.zip(do.from_numpy(x), do.from_numpy(y))
        .then(lambda xy: K.add(do.full(N, np.nan, do.float32).map(lambda t: t.partition((128,))), *xy))
        .first()
        .then(lambda p: do.to_numpy(p.tensor))
        .sync()
    )
    np.testing.assert_allclose(out, x + y, rtol=1e-6)


def test_first_on_a_non_tuple_is_a_usage_error(backend):
    with pytest.raises(do.UsageError, match="tuple"):
        do.value(5).first().sync()


def test_shared_executes_once(backend):
    calls = []
    s = do.value(41).inspect(lambda x: calls.append(x)).map(lambda x: x + 1).shared()
    assert s.sync() == 42
    assert s.map(lambda x: x * 2).sync() == 84
    assert do.zip(s.map(str), s.map(float)).sync() == ("42", 42.0)
    assert calls == [41]


def test_shared_tensor_is_the_same_object_for_every_consumer(backend):
    calls = []
    s = do.zeros(N, do.float32).inspect(lambda t: calls.append(1)).shared()
    t1 = s.sync()
    t2, t3 = do.zip(s.map(lambda t: t), s.map(lambda t: t)).sync()
    assert t1 is t2 is t3
    assert len(calls) == 1


def test_shared_consumed_from_two_submits_on_different_streams(backend):
    s0, s1 = pool_of(2)[:2]
    calls = []
    # the shared source is slow: the consumer on the other stream must wait for it on the device
    src = (
        do.full(N, -1.0, do.float32)
        .then(lambda t: slow_fill(t, 6.0, 0.1))
        .first()
        .map(lambda p: p.tensor)
        .inspect(lambda t: calls.append(1))
        .shared()
    )
    f0 = src.then(do.to_numpy).submit(s0)
    f1 = src.then(do.to_numpy).submit(s1)
    a0, a1 = f0.result(timeout=30), f1.result(timeout=30)
    expect = np.full(N, 6.0, np.float32)
    np.testing.assert_array_equal(a0, expect)
    np.testing.assert_array_equal(a1, expect)
    assert calls == [1]


@pytest.mark.parametrize("how", ["strided", "staged"])
@pytest.mark.parametrize("other_stream", [True, False])
def test_a_shared_host_result_is_filled_before_any_consumer_returns_it(backend, how, other_stream):
    # do.to_numpy fills its array when its execution finishes (a strided view is gathered then;
    # on cuda, past the lending cap, the bytes are copied out of a staging block then). Shared,
    # the first consumer's execution has later work and is not finished when a second consumer
    # returns: that consumer's finish runs the fill, once, before it returns the array
    if how == "staged" and backend == "host":
        pytest.skip("the host backend copies without staging blocks")
    x = do.from_numpy(np.arange(64, dtype=np.float32).reshape(8, 8)).sync()
    src, expect = (x.T, np.arange(64, dtype=np.float32).reshape(8, 8).T) if how == "strided" else (x, x.numpy())
    t = do.zeros(N, do.float32).sync()
    s0, s1 = pool_of(2)[:2]
    prev = set_lend_cap(0)
    try:
        sh = do.to_numpy(src).shared()
        first = sh.then(lambda a: slow_fill(t, 1.0, 0.3).map(lambda _: a)).submit(s0)
        out = sh.sync_on(s1 if other_stream else s0)
        np.testing.assert_array_equal(out, expect)
        if other_stream:
            assert not first.done()  # (its later work still runs: it has not run the fill)
        assert first.result(timeout=30) is out
        np.testing.assert_array_equal(out, expect)  # (filled once: the first's finish adds nothing)
    finally:
        set_lend_cap(prev)


def test_a_shared_host_result_reaches_every_consumer_filled_when_the_first_finishes_first(backend):
    x = do.from_numpy(np.arange(64, dtype=np.float32).reshape(8, 8)).sync()
    sh = do.to_numpy(x.T).shared()
    a = sh.sync()
    b = sh.map(lambda v: v.copy()).sync()  # (its finish finds the fill run already)
    expect = np.arange(64, dtype=np.float32).reshape(8, 8).T
    np.testing.assert_array_equal(a, expect)
    np.testing.assert_array_equal(b, expect)


def test_a_shared_fill_interrupted_fails_the_later_consumers(backend):
    """An interrupt raised while the first consumer's finish fills a shared output reaches that
    thread; a later consumer gets an error saying the output was not filled, not the array."""
    from deviceop._core._op import DeviceOp

    class Source(DeviceOp):
        def _run(self, cx):
            out = np.zeros(4)

            def fill():
                raise KeyboardInterrupt("during the fill")

            cx.on_done(fill)
            return out

    sh = Source().shared()
    with pytest.raises(KeyboardInterrupt, match="during the fill"):
        sh.sync()
    with pytest.raises(do.UsageError, match=r"output was not filled.*interrupted"):
        sh.sync()


def test_shared_first_run_from_threads_runs_once(backend):
    calls = []
    lock = threading.Lock()

    def count(_):
        with lock:
            calls.append(1)

    s = do.zeros(N, do.float32).inspect(count).shared()
    results = []

    def worker():
        results.append(s.map(lambda t: t).sync())

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert len(results) == 4 and all(r is results[0] for r in results)
    assert calls == [1]


def test_long_then_chain_does_not_recurse(backend):
    op = do.value(0)
    for _ in range(2000):
        op = op.then(lambda x: do.value(x + 1))
    assert op.sync() == 2000


def test_long_mixed_chain_with_nested_thens(backend):
    op = do.value(0)
    for i in range(2000):
        if i % 2:
            op = op.map(lambda x: x + 1)
        else:
            # the op returned by the closure is itself a chain
            op = op.then(lambda x: do.value(x).map(lambda y: y + 1))
    assert op.sync() == 2000


def test_long_chain_of_kernels(backend):
    # 2000 dependent kernel launches on one stream: each must see the previous one's write
    t = do.zeros(256, do.float32).sync()
    op = do.value(t)
    for i in range(2000):
        op = op.then(lambda u, i=i: K.fill(u.partition((256,)), float(i))).first().map(lambda p: p.tensor)
    out = op.then(do.to_numpy).sync()
    np.testing.assert_array_equal(out, np.full(256, 1999.0, np.float32))


def test_sync_on_a_given_stream(backend):
    st = do.streams()[-1]
    out = do.full(64, 3, do.int32).then(do.to_numpy).sync_on(st)
    np.testing.assert_array_equal(out, np.full(64, 3, np.int32))


def test_sync_on_runs_on_that_stream_host(host_backend):
    # on the host backend each stream is a worker thread: the kernel runs on the chosen one
    names = []

    def where(out):
        names.append(threading.current_thread().name)
        out[...] = 1

    k = K.Kernel("", "where", params=(K.Out(do.float32),), host=where)
    st = pool_of(3)[2]
    do.zeros(128, do.float32).then(lambda t: k(t.partition((128,)))).sync_on(st)
    assert names == ["deviceop-host-stream-2"]


def test_sync_on_rejects_a_non_stream(backend):
    with pytest.raises(do.UsageError, match="stream"):
        do.value(1).sync_on("stream 0")


def test_submit_result_and_done(backend):
    t = do.zeros(N, do.float32).sync()
    fut = slow_fill(t, 9.0, 0.3).submit()
    assert not fut.done()
    with pytest.raises(TimeoutError):
        fut.result(timeout=0.01)
    out = fut.result(timeout=30)
    assert fut.done()
    assert type(out) is tuple and out[0].tensor is t
    np.testing.assert_array_equal(t.numpy(), np.full(N, 9.0, np.float32))


def test_submit_value_future(backend):
    fut = do.value(5).map(lambda x: x + 1).submit(do.next_stream())
    assert fut.result(timeout=30) == 6
    assert fut.done()
    assert fut.exception(timeout=30) is None


def test_many_submits_complete_in_any_order(backend):
    xs = [np.full(256, i, np.float32) for i in range(16)]
    futs = [do.from_numpy(x).then(do.to_numpy).submit() for x in xs]
    for x, f in zip(xs, futs):
        np.testing.assert_array_equal(f.result(timeout=30), x)


def test_done_callback(backend):
    got = []
    ev = threading.Event()
    fut = do.value(3).submit()
    fut.add_done_callback(lambda f: (got.append(f.result()), ev.set()))
    assert ev.wait(30)
    assert got == [3]


def test_futures_complete_without_their_watcher_thread(backend, monkeypatch):
    # whoever sees the work done completes it: result() waits in the driver itself, done() looks
    # itself, and a later submit() on the stream completes the earlier ones; no watcher runs here
    from deviceop._core import _watch

    monkeypatch.setattr(_watch.Watcher, "_run", lambda self: None)
    monkeypatch.setattr(_watch, "_watchers", {})
    s = do.next_stream()
    t = do.zeros(N, do.float32).sync()
    first = slow_fill(t, 1.0, 0.05).submit(s)
    assert first.result() is not None and first.done()  # no timeout: waited for in the driver
    early = [do.value(i).submit(s) for i in range(20)]
    time.sleep(0.05)
    do.value(99).submit(s)  # completes what is done before it is watched
    assert all(f.done() for f in early)
    assert [f.result(timeout=0) for f in early] == list(range(20))
    late = do.value(7).submit(s)
    deadline = time.monotonic() + 30
    while not late.done():  # done() looks for itself
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert late.result(timeout=0) == 7
    np.testing.assert_array_equal(t.numpy(), np.full(N, 1.0, np.float32))


def test_the_watcher_leaves_an_entry_in_its_grace_to_others_until_hurried():
    """Its thread neither waits for nor finishes an entry in its grace (a future submitted on a
    loop's thread), even behind one it finishes; a hurry, or a later entry without a grace,
    ends the grace; another thread's reap finishes it at any time."""
    from deviceop._core._watch import Watcher

    class Ev:  # an event (and, done, the stream): complete once set
        backend = None
        index = "test"

        def __init__(self, done: bool = False) -> None:
            self.flag = threading.Event()
            if done:
                self.flag.set()

        def query(self) -> bool:
            return self.flag.is_set()

        def synchronize(self) -> None:
            self.flag.wait()

    w = Watcher(Ev(True))
    got: dict[str, int] = {}

    def then(name):  # type: ignore[no-untyped-def]
        return lambda err: got.setdefault(name, threading.get_ident())

    def until(name: str) -> None:
        deadline = time.monotonic() + 10
        while name not in got and time.monotonic() < deadline:
            time.sleep(0.001)
        assert name in got, (name, got)

    me = threading.get_ident()
    try:
        first, second = Ev(), Ev()
        w.give(first, None, then("plain"))
        lazy = w.give(second, None, then("lazy"), 30.0)
        first.flag.set()
        second.flag.set()
        until("plain")
        time.sleep(0.1)
        assert "lazy" not in got  # (its work is done: the thread left it alone)
        w.hurry(lazy)
        until("lazy")
        assert got["plain"] != me and got["lazy"] != me  # the watcher's thread finished both

        first, second = Ev(), Ev()
        w.give(first, None, then("lazy 2"), 30.0)
        w.give(second, None, then("plain 2"))  # watching it means finishing those before it
        first.flag.set()
        second.flag.set()
        until("plain 2")
        until("lazy 2")
        assert got["lazy 2"] != me

        w.give(Ev(True), None, then("lazy 3"), 30.0)
        time.sleep(0.05)
        w.reap()  # another thread that looks finishes it, grace or not
        assert got["lazy 3"] == me
    finally:
        w.stop()


class _Waitable:
    """What a watcher waits on, in its unit tests: complete once ``done`` is set."""

    backend = None
    index = "test"

    def __init__(self, done: bool = False) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        pass


def test_a_reclaim_finishes_completed_executions_and_leaves_their_callbacks():
    """A reclaim (an allocation that found the device full) finishes the executions of the
    entries whose work completed, in grace or not, stopping at the first one still running, and
    calls none of their callbacks; whoever finishes such an entry meanwhile waits until its
    execution's finishing has ended, and its callback sees what that finishing raised."""
    from deviceop._core._watch import Watcher

    log: list[str] = []
    finishing = threading.Event()

    class Cx:
        def __init__(self, name: str, slow: float = 0.0, fail: bool = False) -> None:
            self.name, self.slow, self.fail = name, slow, fail

        def finish(self, ok: bool) -> None:
            finishing.set()
            time.sleep(self.slow)
            log.append(f"finish {self.name}")
            if self.fail:
                raise RuntimeError(self.name)

    thens: list[int] = []

    def then(name):  # type: ignore[no-untyped-def]
        return lambda err: (thens.append(threading.get_ident()), log.append(f"then {name} {err!r}"))

    evs = [_Waitable() for _ in range(4)]
    w = Watcher(_Waitable(True))
    try:
        # (given while running: a give finishes what has completed before it)
        w.give(evs[0], Cx("a", slow=0.3), then("a"), 30.0)
        w.give(evs[1], Cx("b", fail=True), then("b"), 30.0)
        w.give(evs[2], Cx("c"), then("c"), 30.0)
        w.give(evs[3], Cx("d"), then("d"), 30.0)
        evs[0].done = evs[1].done = evs[3].done = True  # (d: complete, after one that is not)
        # another thread reaps while a's execution is being finished
        reaper = threading.Thread(target=lambda: (finishing.wait(10), w.reap()))
        reaper.start()
        assert w.reclaim() == 2
        reaper.join(10)
        assert sorted(log) == ["finish a", "finish b", "then a None", "then b RuntimeError('b')"]
        assert log.index("finish a") < log.index("then a None")  # (the reaper waited for it)
        assert log.index("finish b") < log.index("then b RuntimeError('b')")
        assert set(thens) == {reaper.ident}  # (the reclaiming thread called none)
        assert w.reclaim() == 0  # (finished already, or still running)
        evs[2].done = True
        w.reap()
        assert log[4:] == ["finish c", "then c None", "finish d", "then d None"]
    finally:
        w.stop()


def test_a_reclaimed_entry_is_settled_only_once_its_execution_has_finished():
    """A finaliser run by the reclaim's finishing that gives the stream work (a reap on the same
    thread) leaves that entry for later; an entry marked but not finished (the reclaiming
    thread was interrupted) is finished by whoever settles it."""
    from deviceop._core import _watch

    log: list[str] = []
    w = _watch.Watcher(_Waitable())

    class Cx:
        def __init__(self, name: str, nested: bool = False) -> None:
            self.name, self.nested = name, nested

        def finish(self, ok: bool) -> None:
            if self.nested:
                w.reap()  # (as give() does first)
            log.append(f"finish {self.name}")

    try:
        ev = _Waitable()
        w.give(ev, Cx("a", nested=True), lambda err: log.append("then a"), 30.0)
        ev.done = True
        assert w.reclaim() == 1
        assert log == ["finish a"]  # (the nested reap did not settle the entry being finished)
        w.reap()
        assert log == ["finish a", "then a"]

        ev = _Waitable()
        w.give(ev, Cx("b"), lambda err: log.append("then b"), 30.0)
        ev.done = True
        real = _watch._Early.run
        calls: list[int] = []

        def interrupted(self):  # type: ignore[no-untyped-def]
            if not calls:  # (the reclaim's run: as if an interrupt came before it)
                calls.append(1)
                raise KeyboardInterrupt
            return real(self)

        _watch._Early.run = interrupted
        try:
            with pytest.raises(KeyboardInterrupt):
                w.reclaim()
        finally:
            _watch._Early.run = real
        w.reap()
        assert log[2:] == ["finish b", "then b"]
    finally:
        w.stop()


def test_each_future_completes_once_whoever_looks(backend):
    # the submitting thread, threads asking the futures and the watcher race to complete them
    s = do.next_stream()
    calls: dict[int, int] = {}
    lock = threading.Lock()
    futs: list = []
    stop = threading.Event()

    def count(f) -> None:
        with lock:
            calls[id(f)] = calls.get(id(f), 0) + 1

    def ask() -> None:
        while not stop.is_set():
            for f in list(futs):
                f.done()

    askers = [threading.Thread(target=ask) for _ in range(3)]
    for a in askers:
        a.start()
    try:
        for i in range(300):
            f = do.value(i).submit(s)
            f.add_done_callback(count)
            futs.append(f)
        assert [f.result(timeout=30) for f in futs] == list(range(300))
    finally:
        stop.set()
        for a in askers:
            a.join()
    assert len(calls) == 300 and set(calls.values()) == {1}


def test_step_loop_runs_then_map_inspect(backend):
    seen = []
    t = do.zeros(256, do.float32).sync()
    op = do.value(t)
    for i in range(50):
        op = (
            op.then(lambda u, i=i: K.fill(u.partition((128,)), float(i)))
            .inspect(seen.append)
            .map(lambda p: p[0].tensor)
        )
        op = op.then(
            lambda u: K.scale(do.empty(256, do.float32).map(lambda v: v.partition((128,))), do.value(u), 2.0)
        ).map(lambda p: p[1])  # an op argument: the generic launch path inside the loop
    out = op.then(do.to_numpy).sync()
    np.testing.assert_array_equal(out, np.full(256, 49.0, np.float32))
    assert len(seen) == 50 and all(isinstance(p, tuple) for p in seen)


def test_step_loop_raises_usage_errors(backend):
    with pytest.raises(do.UsageError, match=r"returned int, not a DeviceOp"):
        do.value(1).then(lambda x: x + 1).sync()
    used = do.value(5)
    used.sync()
    with pytest.raises(do.UsageError, match="already consumed"):
        do.value(1).then(lambda x: used).sync()
    with pytest.raises(ZeroDivisionError):
        do.value(0).map(lambda x: 1 / x).then(do.value).sync()


@pytest.mark.parametrize("combinator", ["then", "map", "inspect"])
def test_a_step_that_is_not_callable_is_refused_before_the_op_is_consumed(backend, combinator):
    op = do.value(1).map(lambda x: x + 1)
    with pytest.raises(do.UsageError, match=rf"\.{combinator}\(f\) needs a function, got int"):
        getattr(op, combinator)(3)
    assert op.sync() == 2  # not consumed by the refused step


def test_an_extended_chain_hands_its_steps_over(backend):
    op = do.value(1).map(lambda x: x + 1)
    assert "+ 1 steps" in repr(op)
    longer = op.then(lambda x: do.value(x * 10)).map(lambda x: x + 3)
    assert "+ 3 steps" in repr(longer)
    assert "+ 0 steps" in repr(op)  # consumed: the longer chain took its steps
    with pytest.raises(do.UsageError, match="already consumed"):
        op.sync()
    assert longer.sync() == 23
    from deviceop.combinators import chain

    with pytest.raises(do.UsageError, match="a chain step is then, map or inspect"):
        chain(do.value(1), "zip", len)
    assert chain(do.value(4), "map", lambda x: x + 1).sync() == 5


def test_chained_kernels_with_changing_scalars_and_tensors(backend):
    # the planned fast path must fall back when the scalar or the tensors differ from the last launch
    a, b = do.full(512, 1.0, do.float32).sync(), do.full(512, 1.0, do.float32).sync()
    pa, pb = a.partition((128,)), b.partition((128,))
    op = K.scale(pa, a, 2.0)
    for g in (2.0, 3.0, 3.0, 0.5):
        op = op.then(lambda o, g=g: K.scale(pa, a, g))
    op = op.then(lambda o: K.scale(pb, a, 1.0)).then(lambda o: K.add(pa, a, b))
    op.sync()
    # a: 1 -> 2 -> 4 -> 12 -> 36 -> 18; b = a; a = a + b
    np.testing.assert_array_equal(b.numpy(), np.full(512, 18.0, np.float32))
    np.testing.assert_array_equal(a.numpy(), np.full(512, 36.0, np.float32))
