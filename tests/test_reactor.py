"""The completion reactor behind ``await``: flags written in stream order, one scanner thread.

On the host backend the stream's worker writes the flag; on cuda (the stub driver in CI) the
stream writes it with ``cuStreamWriteValue32`` and nobody wakes the scanner, so its polling,
learning and back-off are what these tests exercise there. Host functions are the fallback
(no stream memory operations, the ``block`` policy), and the stream's own notification is the
fallback when every slot is armed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import textwrap
import threading
import time

import anyio
import pytest
from conftest import STUB_DRIVER
from helpers import idle_cores, pool_of, slow_fill

import deviceop as do
from deviceop._core import _reactor

K = do.kernels
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def policy():
    """Restore the default policy after a test that changes it."""
    yield
    do.set_wait_policy("adaptive")


def _run(script: str, env: dict[str, str] | None = None, timeout: float = 60.0) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.update(env or {})
    e["PYTHONPATH"] = os.pathsep.join(sys.path)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], env=e, capture_output=True, text=True, timeout=timeout
    )


def _backend_env(backend: str) -> dict[str, str]:
    return {"DEVICEOP_BACKEND": backend}


_PRELUDE = f"""
import asyncio, os, sys, time
import numpy as np
sys.path.insert(0, os.path.join({ROOT!r}, "tests"))
import deviceop as do
if os.environ.get("DEVICEOP_STUB_DRIVER") == "1":
    from stub_driver import emulate
    emulate.install()
from deviceop._core import _reactor
from helpers import pool_of, slow_fill
K = do.kernels
"""


async def _many(n: int, seconds: float = 0.0) -> list[float]:
    """``n`` concurrent awaits over the pool's streams, each filling its own tensor; their values."""
    streams = do.streams()
    ts = [await do.zeros(256, do.float32).wait(stream=streams[i % len(streams)]) for i in range(n)]

    async def one(i: int) -> None:
        s = streams[i % len(streams)]
        if seconds:
            await slow_fill(ts[i], float(i), seconds).wait(stream=s)
        else:
            await K.fill(ts[i].partition((128,)), float(i)).wait(stream=s)

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
    return [float((await do.to_numpy(t))[-1]) for t in ts]


# -- behaviour -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["adaptive", "spin", "block"])
def test_every_policy_completes_concurrent_awaits(backend, name, policy) -> None:
    do.set_wait_policy(name)
    assert do.wait_policy() == name
    before = _reactor.stats()
    libs = ["asyncio", "trio"]
    try:
        import trio  # noqa: F401
    except ImportError:
        libs = ["asyncio", "asyncio"]
    for lib in libs:
        assert anyio.run(_many, 40, backend=lib) == [float(i) for i in range(40)]
    deadline = time.monotonic() + 5  # an await that saw its event before the flag leaves the slot to the scanner
    while _reactor.stats()["pending"] and time.monotonic() < deadline:
        time.sleep(0.01)
    after = _reactor.stats()
    assert after["armed"] - before["armed"] >= 80
    assert after["pending"] == 0
    if backend == "cuda" and name == "block":
        assert after["host_function"] - before["host_function"] >= 80  # block: a host function wakes it
    if backend == "cuda" and name != "block":
        assert after["memop"] - before["memop"] >= 80  # the stream writes the flag itself
    if backend == "host":
        assert after["host_stream"] - before["host_stream"] >= 80


def test_slots_come_back(backend) -> None:
    free = _reactor.stats()["free"]
    asyncio.run(_many(64))
    deadline = time.monotonic() + 10
    while _reactor.stats()["free"] != free and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _reactor.stats()["free"] == free


def test_done_stays_true_once_the_slot_is_armed_again(backend) -> None:
    # the scanner retires a slot once its flag is written and the next arm takes it again (the
    # free list is a stack); a task polling its own handle may look only after that second
    # write: it must still see its work done (it saw "not done" and polled until its budget)
    from deviceop._core._base import Channel

    s, ch = do.streams()[0], Channel()

    def retired(free: int) -> None:
        deadline = time.monotonic() + 10
        while _reactor.stats()["free"] != free and time.monotonic() < deadline:
            time.sleep(0.001)
        assert _reactor.stats()["free"] == free, "the scanner did not retire the slot"

    free = _reactor.stats()["free"]
    first = _reactor.arm(s, ch, 1)
    s.synchronize()
    retired(free)
    second = _reactor.arm(s, ch, 2)
    assert second >> 32 == first >> 32 and second != first  # the same slot, the next number
    s.synchronize()
    retired(free)
    assert _reactor.done(second) and _reactor.done(first)
    assert _reactor.retire(first)  # seen done: nothing left to retire, and no error


def test_a_slot_armed_unwatched_wakes_no_parked_scanner_until_its_task_parks(backend) -> None:
    """An await arms its slot unwatched and polls first: a parked scanner stays parked when the
    task sees the flag itself (no thread wake-up per short await); once the task parks
    (``watch``), or lets the slot go (``disown``), the scanner looks after the slot."""
    from deviceop._core._base import Channel

    s, ch = do.streams()[0], Channel()

    def parked() -> int:
        """The scanner's pass count once it is parked (nothing armed, the count standing still)."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            before = _reactor.stats()
            time.sleep(0.05)
            after = _reactor.stats()
            if before["pending"] == after["pending"] == 0 and after["passes"] == before["passes"]:
                return int(after["passes"])
        raise AssertionError(f"the scanner did not park: {_reactor.stats()}")

    def retired_by_the_scanner() -> None:
        deadline = time.monotonic() + 10
        while _reactor.stats()["pending"] and time.monotonic() < deadline:
            time.sleep(0.001)
        assert _reactor.stats()["pending"] == 0, "the scanner did not retire the slot"

    def tokens() -> set[int]:
        """The tokens pushed so far: the scanner retires a slot under its lock and pushes the
        token after releasing it, so a retired slot's token may land a moment later."""
        got: set[int] = set()
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            got.update(ch.drain())
            if not got:
                time.sleep(0.001)
        time.sleep(0.01)  # (a second push of the same slot, a pre-wake then the flag)
        got.update(ch.drain())
        return got

    _reactor.arm(s, ch, 9)  # (the scanner thread starts with the first slot armed)
    s.synchronize()
    retired_by_the_scanner()
    # (a stream whose durations are learned may get its token twice: a pre-wake, then the flag)
    assert tokens() == {9}

    p0 = parked()
    h = _reactor.arm(s, ch, 1, False)
    s.synchronize()
    time.sleep(0.05)  # (a woken scanner would have looked by now)
    assert _reactor.done(h) and _reactor.stats()["pending"] == 1
    assert _reactor.stats()["passes"] == p0, "an unwatched slot woke the parked scanner"
    assert _reactor.retire(h, True)  # the task saw its flag: the slot is free again
    assert _reactor.stats()["pending"] == 0

    p0 = parked()
    h = _reactor.arm(s, ch, 2, False)
    _reactor.watch(h)  # the task parks
    s.synchronize()
    retired_by_the_scanner()
    assert _reactor.stats()["passes"] > p0
    assert tokens() == {2}  # the parked task's wake-up

    p0 = parked()
    h = _reactor.arm(s, ch, 3, False)
    _reactor.disown(h)  # cancelled while polling: the slot must still be retired once written
    s.synchronize()
    retired_by_the_scanner()
    time.sleep(0.05)  # (a push after the retirement would have landed by now)
    assert ch.drain() == []  # nobody waits for it


def test_durations_are_learned_and_long_waits_sleep(backend) -> None:
    """Awaits of ~30 ms ops on one stream: the estimate converges, the scanner sleeps (it does
    not spin for the whole wait), and the process spends a small share of a core."""
    s = do.streams()[0]

    async def main() -> float:
        t = await do.zeros(128, do.float32).wait(stream=s)
        for _ in range(3):
            await slow_fill(t, 1.0, 0.03).wait(stream=s)
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(5):
            await slow_fill(t, 2.0, 0.03).wait(stream=s)
        return (time.process_time() - c0) / (time.perf_counter() - w0)

    sleeps = _reactor.stats()["sleeps"]
    cpu = asyncio.run(main())
    est = _reactor._estimates().get(s.handle_int)
    assert est is not None and 0.015 < est < 0.1, est
    assert _reactor.stats()["sleeps"] > sleeps
    assert cpu < 0.25, f"{cpu:.0%} of a core while awaiting 30 ms ops"


def test_spin_policy_burns_what_adaptive_saves(backend, policy) -> None:
    """The CPU figure above can fail: the spin policy keeps the scanner busy for the whole wait."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs two cores: the spinning scanner and the loop")
    idle = idle_cores()
    if idle < 1.8:  # (the scanner's share is the figure: another process's load lowers it)
        pytest.skip(f"needs two idle cores (the spinning scanner, and the work on the host backend): {idle:.1f} idle")
    s = do.streams()[0]

    async def main() -> float:
        t = await do.zeros(128, do.float32).wait(stream=s)
        c0, w0 = time.process_time(), time.perf_counter()
        await slow_fill(t, 1.0, 0.15).wait(stream=s)
        return (time.process_time() - c0) / (time.perf_counter() - w0)

    do.set_wait_policy("spin")
    spin = asyncio.run(main())
    do.set_wait_policy("adaptive")
    adaptive = asyncio.run(main())
    assert spin > 0.5 and adaptive < 0.25, (spin, adaptive)


def test_the_spin_policy_pre_wakes_a_long_await_too(backend, policy) -> None:
    """Under "spin" the scanner sees a flag at once, but a loop parked on a long await wakes
    only when its token comes, tens to hundreds of µs later on a server: the spin policy
    pre-wakes the awaiting task before the predicted completion, as "adaptive" does (without
    it, its long awaits were slower than adaptive's: the loop's own wake-up came late)."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs two cores: the spinning scanner and the loop")
    s = pool_of(4)[1]
    t = asyncio.run(_learned(s))
    do.set_wait_policy("spin")  # (the policy fixture restores the default)
    pre = _reactor.stats()["prewakes"]

    async def main() -> None:
        # until the first pre-wake, at most six awaits: on a loaded machine a learning await
        # can run long, and an estimate above the work's time puts the pre-wake after the
        # completion (the estimate comes down with each await that follows)
        for _ in range(6):
            await slow_fill(t, 3.0, 0.1).wait(stream=s)
            if _reactor.stats()["prewakes"] > pre:
                break

    asyncio.run(main())
    assert _reactor.stats()["prewakes"] - pre >= 1
    assert float(t.numpy()[0]) == 3.0


def test_awaits_from_several_loops_in_threads(backend) -> None:
    """One reactor serves every loop: four threads, each with its own loop, share it."""
    pool = pool_of(4)
    out: dict[int, list[float]] = {}
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        async def main() -> list[float]:
            t = await do.zeros(256, do.float32).wait(stream=pool[k])
            vals = []
            for i in range(30):
                await K.fill(t.partition((128,)), float(k * 100 + i)).wait(stream=pool[k])
                vals.append(float((await do.to_numpy(t))[0]))
            return vals

        try:
            out[k] = asyncio.run(main())
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert all(out[k] == [float(k * 100 + i) for i in range(30)] for k in range(4))


def test_cancelled_await_gives_its_slot_back_once_done(backend) -> None:
    s = pool_of(4)[1]  # (DEVICEOP_STREAMS=1: a pool of four is selected)

    async def main() -> None:
        t = await do.zeros(128, do.float32).wait(stream=s)
        with anyio.move_on_after(0.02):
            await slow_fill(t, 5.0, 0.2).wait(stream=s)
        assert _reactor.stats()["pending"] >= 1  # still armed: the GPU has not written it
        await do.value(t).then(lambda x: K.scale(x.partition((128,)), x, 2.0)).wait(stream=s)
        assert float((await do.to_numpy(t))[0]) == 10.0  # ordered after the cancelled fill

    # slots are process-wide: start once no earlier test's work holds one, then every slot
    # this test armed, the cancelled await's included, must come back
    deadline = time.monotonic() + 10
    while _reactor.stats()["pending"] and time.monotonic() < deadline:
        time.sleep(0.01)
    free = _reactor.stats()["free"]
    asyncio.run(main())
    deadline = time.monotonic() + 10
    while _reactor.stats()["free"] < free and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _reactor.stats()["free"] >= free, _reactor.stats()


def test_timeout_then_await_again(backend) -> None:
    async def main() -> float:
        t = await do.zeros(128, do.float32)
        fut = slow_fill(t, 7.0, 0.1).submit()
        with pytest.raises(TimeoutError):
            await fut.wait(timeout=0.01)
        await fut
        return float((await do.to_numpy(t))[0])

    assert asyncio.run(main()) == 7.0


# -- fallbacks -------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend_name", ["host", "cuda"])
def test_slot_exhaustion_falls_back_to_host_functions(backend_name) -> None:
    if backend_name == "cuda" and not STUB_DRIVER:
        pytest.skip("runs the cuda backend on the stub driver (CI); on a GPU the cuda suite covers it")
    r = _run(
        _PRELUDE
        + """
async def main():
    streams = do.streams()
    ts = [await do.zeros(128, do.float32) for _ in range(24)]
    async def one(i):
        await slow_fill(ts[i], float(i), 0.02).wait(stream=streams[i % len(streams)])
    await asyncio.gather(*(one(i) for i in range(24)))
    return [float((await do.to_numpy(t))[0]) for t in ts]
assert asyncio.run(main()) == [float(i) for i in range(24)]
st = _reactor.stats()
assert st["slots"] == 2 and st["exhausted"] > 0, st
print("ok")
""",
        {"DEVICEOP_REACTOR_SLOTS": "2", **_backend_env(backend_name)},
    )
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_no_stream_memory_operations_falls_back_to_host_functions() -> None:
    if not STUB_DRIVER:
        pytest.skip("needs the stub driver's switch that refuses stream memory operations")
    r = _run(
        _PRELUDE
        + """
async def main():
    t = await do.zeros(128, do.float32)
    for i in range(20):
        await K.fill(t.partition((128,)), float(i))
    return float((await do.to_numpy(t))[0])
assert asyncio.run(main()) == 19.0
st = _reactor.stats()
assert not st["memops"] and st["memop"] == 0 and st["host_function"] >= 20, st
print("ok")
""",
        {"DEVICEOP_STUB_NO_MEMOPS": "1", "DEVICEOP_BACKEND": "cuda"},
    )
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


# -- faults, shutdown, fork -----------------------------------------------------------------------
@pytest.mark.parametrize("backend_name", ["host", "cuda"])
def test_context_fault_fails_every_pending_await(backend_name) -> None:
    """Eight awaits parked on slow work, then a fault: every one raises CudaError promptly and
    no slot stays armed (a failed device never writes its flags)."""
    if backend_name == "cuda" and not STUB_DRIVER:
        pytest.skip("a real fault is tested on the GPU by test_await; here the stub driver's")
    r = _run(
        _PRELUDE
        + """
def boom(out, *rest):
    raise FloatingPointError("planted fault")
bad = K.Kernel('extern "C" __global__ void boom(float* out) { }', "boom", params=(K.Out(do.float32),), host=boom)
async def main():
    streams = pool_of(4)
    ts = [await do.zeros(128, do.float32) for _ in range(9)]
    async def parked(i):
        try:
            await slow_fill(ts[i], 1.0, 0.3).wait(stream=streams[i % 3])
        except do.CudaError:
            return "CudaError"
        return "ok"
    async def fault():
        await asyncio.sleep(0.05)
        try:
            await bad(ts[8].partition((128,))).wait(stream=streams[3])
        except do.CudaError:
            return "CudaError"
        return "ok"
    t0 = time.perf_counter()
    res = await asyncio.gather(*(parked(i) for i in range(8)), fault())
    return res, time.perf_counter() - t0
res, secs = asyncio.run(main())
assert res[-1] == "CudaError", res
assert res.count("CudaError") >= 6, res   # those still running when the fault struck
assert secs < 5, secs
deadline = time.monotonic() + 5
while _reactor.stats()["pending"] and time.monotonic() < deadline:
    time.sleep(0.01)
assert _reactor.stats()["pending"] == 0, _reactor.stats()
print("ok")
""",
        _backend_env(backend_name),
    )
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("backend_name", ["host", "cuda"])
def test_interpreter_exits_with_armed_slots(backend_name) -> None:
    """Work still armed at exit (its await timed out): the process ends at once, no hang."""
    if backend_name == "cuda" and not STUB_DRIVER:
        pytest.skip("the stub driver's cuda backend (CI); the GPU suite runs the host case")
    r = _run(
        _PRELUDE
        + """
async def main():
    t = await do.zeros(128, do.float32)
    try:
        await slow_fill(t, 1.0, 2.0).wait(timeout=0.05)
    except TimeoutError:
        pass
asyncio.run(main())
assert _reactor.stats()["pending"] == 1
print("ok")
""",
        _backend_env(backend_name),
        timeout=30,
    )
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_fork_after_the_scanner_started() -> None:
    """The child has no scanner thread (fork copies one thread): it starts its own."""
    r = _run(
        _PRELUDE
        + """
async def main():
    t = await do.zeros(128, do.float32)
    await K.fill(t.partition((128,)), 3.0)
    return float((await do.to_numpy(t))[0])
assert asyncio.run(main()) == 3.0
assert _reactor.stats()["scanner"]
pid = os.fork()
if pid == 0:
    import signal
    signal.alarm(20)
    try:
        ok = asyncio.run(main()) == 3.0 and _reactor.stats()["pending"] == 0
    except BaseException as e:
        print("child:", repr(e), file=sys.stderr)
        ok = False
    os._exit(0 if ok else 1)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
print("ok")
""",
        {"DEVICEOP_BACKEND": "host"},
    )
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


# -- settings --------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["fast", "", 3, None, "Adaptive"])
def test_bad_policy_is_refused(bad) -> None:
    with pytest.raises(do.SettingError, match="adaptive"):
        do.set_wait_policy(bad)  # type: ignore[arg-type]
    assert do.wait_policy() == "adaptive"


@pytest.mark.parametrize(
    "env", [{"DEVICEOP_REACTOR_SLOTS": "0"}, {"DEVICEOP_REACTOR_SLOTS": "many"}, {"DEVICEOP_WAIT_POLICY": "turbo"}]
)
def test_bad_environment_settings_are_refused(env) -> None:
    r = _run(
        _PRELUDE
        + """
async def main():
    await do.zeros(4, do.float32)
asyncio.run(main())
""",
        {"DEVICEOP_BACKEND": "host", **env},
    )
    assert r.returncode != 0 and "SettingError" in r.stderr and next(iter(env)) in r.stderr, r.stderr


def test_policy_from_the_environment() -> None:
    r = _run("import deviceop as do; print(do.wait_policy())", {"DEVICEOP_WAIT_POLICY": "spin"})
    assert r.returncode == 0 and r.stdout.strip() == "spin", r.stderr


def test_long_waits_are_pre_woken(backend) -> None:
    """Once a stream's durations are known, the reactor wakes the loop shortly before the
    predicted completion (a pre-wake), and the await still returns only once the work is done."""
    s = pool_of(4)[2]  # (DEVICEOP_STREAMS=1: a pool of four is selected)

    async def main() -> list[float]:
        t = await do.zeros(128, do.float32).wait(stream=s)
        vals = []
        for i in range(8):
            await slow_fill(t, float(i), 0.03).wait(stream=s)
            vals.append(float((await do.to_numpy(t))[0]))
        return vals

    before = _reactor.stats()["prewakes"]
    assert asyncio.run(main()) == [float(i) for i in range(8)]
    st = _reactor.stats()
    assert st["prewakes"] > before, st
    assert 0 < st["wake_lateness_s"] < 0.01, st


def test_cancelled_await_with_a_pre_wake_pending_leaves_the_scanner_idle(backend) -> None:
    """A cancelled await whose pre-wake was still ahead: the scanner has nobody to wake and
    sleeps (it must not spin on the pre-wake it cannot deliver)."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs two cores: a spinning scanner would share one with this thread")
    s = pool_of(4)[3]  # (DEVICEOP_STREAMS=1: a pool of four is selected)

    async def main() -> None:
        t = await do.zeros(128, do.float32).wait(stream=s)
        for _ in range(3):
            await slow_fill(t, 1.0, 0.1).wait(stream=s)
        with anyio.move_on_after(0.01):
            await slow_fill(t, 2.0, 0.3).wait(stream=s)

    asyncio.run(main())
    p0 = _reactor.stats()["passes"]
    c0, w0 = time.process_time(), time.perf_counter()
    time.sleep(0.25)  # the cancelled fill runs; its pre-wake would have been due meanwhile
    cpu = (time.process_time() - c0) / (time.perf_counter() - w0)
    passes = _reactor.stats()["passes"] - p0
    assert cpu < 0.3, f"{cpu:.0%} of a core while nothing is awaited"
    # a scanner spinning on the undeliverable pre-wake makes a pass every few microseconds
    # (tens of thousands here); backing off, it makes about a hundred. A count, not the
    # learned lateness of its sleeps, which another process's load on the cores raises.
    assert passes < 2000, (passes, _reactor.stats())


@contextlib.contextmanager
def _armed(s, ch):  # type: ignore[no-untyped-def]
    """A slot armed on ``s`` with token 7 on ``ch``; retired (or disowned) after ``s`` drains."""
    h = _reactor.arm(s, ch, 7)
    assert h >= 0
    try:
        yield h
    finally:
        s.synchronize()
        if not _reactor.retire(h):
            _reactor.disown(h)


async def _learned(s) -> do.Tensor:  # type: ignore[no-untyped-def]
    """A tensor, and ``s``'s executions learned as about 100 ms long (three awaited fills)."""
    t = await do.zeros(128, do.float32).wait(stream=s)
    for _ in range(3):
        await slow_fill(t, 1.0, 0.1).wait(stream=s)
    return t


def test_a_wake_near_the_predicted_completion_polls_and_one_far_from_it_parks(backend) -> None:
    """A parked task woken before its work completed asks the reactor how long to poll: far
    from the predicted completion (its re-check timer fired early) it parks again; near or past
    it (the timer fired with, or instead of, the pre-wake) it polls, and the pre-wake still
    ahead is dropped (the task would only be woken again)."""
    s = pool_of(4)[1]  # (DEVICEOP_STREAMS=1: a pool of four is selected)

    t = asyncio.run(_learned(s))
    from deviceop._core._base import Channel

    ch = Channel()
    slow_fill(t, 2.0, 0.4).submit(stream=s)  # runs four times as long as the stream's estimate
    with _armed(s, ch) as h:
        assert _reactor.prewoken(h) is None  # about 100 ms ahead of the prediction: park again
        time.sleep(0.15)  # past the prediction, the work still running
        assert not _reactor.done(h)
        span = _reactor.prewoken(h)
        assert span is not None and 0 < span < 0.01, span  # poll until shortly past the prediction


def test_work_still_running_past_its_poll_raises_the_estimate_at_once(backend) -> None:
    """A task whose poll after a pre-wake ran out tells the reactor (``overdue``): the stream's
    work takes at least as long as this one has run, and the estimate rises to that at once
    (observations raise it by an eighth per await, so a low estimate took many awaits to
    recover, each parked past its completion)."""
    from deviceop._core._base import Channel

    s = pool_of(4)[1]

    t = asyncio.run(_learned(s))
    est0 = _reactor._estimates()[s.handle_int]
    assert 0.05 < est0 < 0.2, est0
    ch = Channel()
    slow_fill(t, 2.0, 0.5).submit(stream=s)  # five times the estimate
    with _armed(s, ch) as h:
        time.sleep(0.25)
        assert not _reactor.done(h)
        _reactor.overdue(h)
        assert _reactor._estimates()[s.handle_int] >= 0.24  # not about 0.1 + 0.15 / 8
        _reactor.overdue(h)  # only ever raises it
        assert _reactor._estimates()[s.handle_int] >= 0.24


def test_a_pre_woken_task_polls_whenever_the_pre_wake_comes(backend) -> None:
    """A pre-wake comes early by up to its lead (the scanner's sleep may end on time, and the
    loop resume at once): the task woken by it polls from then on (it used to park again with
    no pre-wake left to come, and waited for a backing-off look, up to a millisecond later than
    the work's completion)."""
    import select

    from deviceop._core._base import Channel

    s = pool_of(4)[1]

    t = asyncio.run(_learned(s))
    ch = Channel()
    pre0 = _reactor.stats()["prewakes"]
    slow_fill(t, 2.0, 0.2).submit(stream=s)  # twice the estimate: the pre-wake comes about 100 ms early
    with _armed(s, ch) as h:
        ready, _, _ = select.select([ch], [], [], 1.0)
        assert ready and 7 in ch.drain(), "no pre-wake within a second of a 100 ms prediction"
        assert _reactor.stats()["prewakes"] > pre0
        assert not _reactor.done(h)
        span = _reactor.prewoken(h)
        assert span is not None and 0 < span < 0.01, span  # poll until shortly past the prediction


def test_a_pre_wake_answered_only_after_the_completion_teaches_the_loops_lateness(backend) -> None:
    """A loop that resumes a pre-woken task only after the work completed (its thread slept
    deeply) never answers the pre-wake with ``prewoken``: the task reports it when it finds the
    work done (``resumed``), and the reactor's loop lateness grows by it, so that later pre-wakes
    come that much earlier. Only answered pre-wakes were learned before: the lead followed the
    quick resumes and kept missing the slow ones."""
    import select

    from deviceop._core._base import Channel

    s = pool_of(4)[1]

    t = asyncio.run(_learned(s))
    ch = Channel()
    st0 = _reactor.stats()
    late0 = st0["late_resumes"]
    slow_fill(t, 2.0, 0.2).submit(stream=s)  # twice the estimate: the pre-wake comes about 100 ms early
    with _armed(s, ch) as h:
        ready, _, _ = select.select([ch], [], [], 1.0)
        assert ready and 7 in ch.drain(), "no pre-wake within a second of a 100 ms prediction"
        assert _reactor.stats()["prewakes"] > st0["prewakes"] and not _reactor.done(h)
        s.synchronize()
        time.sleep(0.002)  # the loop resumes the task 2 ms after the completion
        assert _reactor.done(h)
        _reactor.resumed(h)
        st = _reactor.stats()
        assert st["late_resumes"] == late0 + 1
        assert st["loop_lateness_s"] >= 0.9e-3  # at least 2 ms late, learned up to its 1 ms cap
        _reactor.resumed(h)  # once per pre-wake
        assert _reactor.stats()["late_resumes"] == late0 + 1


def test_the_poll_after_a_pre_wake_lasts_past_the_prediction_whatever_the_budget(backend, monkeypatch) -> None:
    """The poll budget bounds the poll of work whose duration is not learned; a pre-woken task
    polls until shortly past the predicted completion (a poll cut short by the budget parked
    again with no pre-wake left to come, and the completion was seen only by a backing-off
    look, up to milliseconds late)."""
    from deviceop._core import _completion as _await

    s = pool_of(4)[1]
    polls: list[tuple[float, bool]] = []
    real = _await._poll

    async def poll(lib, done, budget, deadline, *spin):  # type: ignore[no-untyped-def]
        r = await real(lib, done, budget, deadline, *spin)
        polls.append((budget, r))
        return r

    async def main() -> None:
        t = await _learned(s)
        monkeypatch.setattr(_await, "_poll", poll)
        do.set_poll_budget(1e-6)
        try:
            for _ in range(8):  # work that ends before its pre-wake (a loaded host) polls nothing
                await slow_fill(t, 2.0, 0.1).wait(stream=s)
                if polls:
                    break
        finally:
            do.set_poll_budget(1e-3)

    asyncio.run(main())
    assert polls, "the await was not pre-woken to poll"
    assert all(budget > 20e-6 for budget, _ in polls), polls  # to past the prediction, not 1 µs


def test_a_spin_looks_without_yielding_and_a_poll_yields_before_every_look() -> None:
    from deviceop._core._completion import _poll, _spin

    async def main(spin: float, ready_at: int) -> tuple[bool, int]:
        ticks = 0
        calls = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        def done() -> bool:
            nonlocal calls
            calls += 1
            return calls >= ready_at

        t = asyncio.ensure_future(ticker())
        await asyncio.sleep(0)  # the ticker runs once
        before = ticks
        ok = _spin(done, spin, None) or await _poll("asyncio", done, 0.05, None)
        yielded = ticks - before
        t.cancel()
        return ok, yielded

    assert asyncio.run(main(1.0, 3)) == (True, 0)  # done within the spin: the loop never ran

    async def past_deadline() -> float:
        t0 = time.perf_counter()
        assert not _spin(lambda: False, 5.0, t0 - 1.0)
        assert not await _poll("asyncio", lambda: False, 5.0, t0 - 1.0)
        return time.perf_counter() - t0

    assert asyncio.run(past_deadline()) < 1.0  # neither spins nor polls past the deadline
    ok, yielded = asyncio.run(main(0.0, 3))
    assert ok and yielded >= 2  # no spin: a yield before every look


def test_an_await_spins_only_for_work_due_within_microseconds_with_nothing_else_pending(backend, monkeypatch) -> None:
    from deviceop._core import _completion as _await

    s = pool_of(4)[1]
    seen: list[float] = []
    real = _await._spin

    def spin(done, spin, deadline):  # type: ignore[no-untyped-def]
        seen.append(spin)
        return real(done, spin, deadline)

    async def main(answer: tuple[float, bool]) -> None:
        t = await do.zeros(1 << 16, do.float32).wait(stream=s)
        monkeypatch.setattr(_await, "_spin", spin)
        monkeypatch.setattr(_reactor, "expected", lambda h: answer)
        await slow_fill(t, 1.0, 0.005).wait(stream=s)  # long enough to be pending when asked
        monkeypatch.undo()

    for answer, want in (((4e-6, True), [9e-6]), ((4e-6, False), []), ((200e-6, True), [])):
        seen.clear()
        asyncio.run(main(answer))
        assert seen == pytest.approx(want), (answer, seen)


def test_work_much_shorter_than_predicted_is_seen_early(backend) -> None:
    """A stream that learned 150 ms executions, then a short one: the scanner looks on its
    backing-off schedule from the start, so the await does not sleep until the prediction."""
    s = do.streams()[0]

    async def main() -> float:
        t = await do.zeros(128, do.float32).wait(stream=s)
        await K.fill(t.partition((128,)), 0.0).wait(stream=s)  # compiled and loaded
        for _ in range(3):
            await slow_fill(t, 1.0, 0.15).wait(stream=s)
        t0 = time.perf_counter()
        await K.fill(t.partition((128,)), 2.0).wait(stream=s)
        return time.perf_counter() - t0

    assert asyncio.run(main()) < 0.01  # the parked re-check alone would take 20 ms


def test_a_stream_whose_work_got_shorter_is_learned_within_three_awaits(backend) -> None:
    """150 ms executions, then 15 ms ones: each shorter observation moves the estimate most of the
    way down (halving it would leave about 32 ms after three), so later awaits are pre-woken near
    their completion instead of found late by the scanner's looks."""
    s = do.streams()[0]

    async def main() -> float:
        t = await do.zeros(128, do.float32).wait(stream=s)
        for _ in range(2):
            await slow_fill(t, 1.0, 0.15).wait(stream=s)
        for _ in range(3):
            await slow_fill(t, 2.0, 0.015).wait(stream=s)
        return _reactor._estimates()[s.handle_int]

    est = asyncio.run(main())
    assert 0.012 < est < 0.03, est


def test_work_that_grew_tenfold_is_relearned_by_one_await(backend) -> None:
    """A stream learned at 20 ms, then a 200 ms execution: its polls run out one after another
    (each raises the estimate to the time run so far), yet the completion still counts as work
    that changed (against the estimate it was armed with), so the next await is predicted right
    instead of creeping up by an eighth per await with a poll running out each time."""
    s = do.streams()[0]

    async def main() -> float:
        t = await do.zeros(128, do.float32).wait(stream=s)
        for _ in range(3):
            await slow_fill(t, 1.0, 0.02).wait(stream=s)
        await slow_fill(t, 2.0, 0.2).wait(stream=s)
        return _reactor._estimates()[s.handle_int]

    est = asyncio.run(main())
    assert 0.19 < est < 0.3, est
