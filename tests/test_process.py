"""Processes and lifetimes of devices: fork(), and host devices replaced by use_backend("host").

A child made by fork() has only the forking thread: deviceop starts afresh there (a new host
device, renewed locks, its own watcher and wake-up threads), refuses CUDA with a message that
says to use 'spawn', and refuses the parent's tensors and streams instead of hanging on
threads that do not exist in the child.
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
import pickle
import signal
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import deviceop as do
from deviceop._core._base import LOCK

K = do.kernels

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")


def in_child(fn: Callable[[], Any], timeout: float = 20.0) -> Any:
    """Run ``fn`` in a forked child; return what it returned, or re-raise what it raised there.

    The child is killed after ``timeout`` seconds: a hang is reported as a failure, not waited on.
    """
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "this process is multi-threaded"
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        signal.alarm(int(timeout) + 1)
        try:
            out = ("ok", fn())
        except BaseException as e:
            out = ("raised", f"{type(e).__name__}: {e}")
        try:
            data = pickle.dumps(out)
        except Exception as e:
            data = pickle.dumps(("raised", f"unpicklable result: {e!r}"))
        with os.fdopen(w, "wb") as f:
            f.write(data)
        os._exit(0)
    os.close(w)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            pytest.fail(f"the forked child hung for {timeout} s")
        time.sleep(0.01)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    assert data, f"the forked child died (status {status})"
    kind, value = pickle.loads(data)
    if kind == "raised":
        raise AssertionError(f"in the child: {value}")
    return value


def _work() -> list[float]:
    """Sync, submit and await on the child's own device."""
    t = do.from_numpy(np.arange(8, dtype=np.float32)).sync()
    out = do.zeros(8, do.float32).sync()
    K.scale(out.partition((8,)), t, 2.0).sync()
    fut = do.to_numpy(out).submit()

    async def main() -> Any:
        return await do.to_numpy(out)

    a = asyncio.run(main())
    assert np.array_equal(fut.result(10), a)
    return a.tolist()


def test_child_runs_on_a_fresh_host_device(host_backend: str) -> None:
    _work()  # the parent has streams, watchers and a wake-up channel in use
    assert in_child(_work) == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0]
    assert _work()[1] == 2.0  # the parent is unaffected


def test_child_refuses_parent_futures_and_in_flight_tensors_at_once(host_backend: str) -> None:
    # the parent's work never completes in the child: waiting for it would hang, and the advice
    # to await it could not be followed
    from helpers import slow_fill

    t = do.zeros(4096, do.float32).sync()
    fut = slow_fill(t, 1.0, 2.0).submit()

    def child() -> list[str]:
        got = []
        for f in (lambda: fut.result(), lambda: fut.result(timeout=30), lambda: asyncio.run(_awaited(fut)), t.numpy):
            t0 = time.monotonic()
            try:
                f()
            except do.BackendError as e:
                got.append(str(e))
            assert time.monotonic() - t0 < 1.0, "waited for the parent's work"
        return got

    msgs = in_child(child)
    assert len(msgs) == 4 and all("parent" in m for m in msgs)
    assert fut.result(timeout=30) is not None  # the parent's own future completes


async def _awaited(fut: Any) -> Any:
    return await fut


def test_child_refuses_parent_tensors_instead_of_hanging(host_backend: str) -> None:
    t = do.zeros(4, do.float32).sync()
    s = do.next_stream()

    def child() -> str:
        try:
            do.to_numpy(t).sync()
        except do.BackendError as e:
            msg = str(e)
        else:
            raise AssertionError("a parent's tensor was used in the child")
        with pytest.raises(do.BackendError, match="parent process"):
            do.zeros(4, do.float32).sync_on(s)
        assert do.zeros(2, do.float32).sync().numpy().tolist() == [0.0, 0.0]  # its own device works
        return msg

    assert "parent process" in in_child(child)


def _locks() -> dict[str, Any]:
    from deviceop._core import _select, _wake, _watch

    return {"ledger": LOCK, "backend selection": _select._lock, "watchers": _watch._wlock, "wake-ups": _wake._lock}


@pytest.mark.parametrize("which", ["ledger", "backend selection", "watchers", "wake-ups"])
def test_child_works_while_a_parent_thread_holds_a_lock(host_backend: str, which: str) -> None:
    taken, release = threading.Event(), threading.Event()
    _work()  # the watchers and wake-ups exist
    lock = _locks()[which]

    def holder() -> None:
        with lock:
            taken.set()
            release.wait(30)

    th = threading.Thread(target=holder)
    th.start()
    try:
        assert taken.wait(10)
        assert in_child(_work)[:2] == [0.0, 2.0]
    finally:
        release.set()
        th.join()


def _pool_item(i: int) -> float:
    return float(do.from_numpy(np.full(4, float(i), np.float32)).sync().numpy().sum())


def test_multiprocessing_fork_pool(host_backend: str) -> None:
    _work()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with multiprocessing.get_context("fork").Pool(2) as pool:
            assert pool.map(_pool_item, range(6), chunksize=1) == [4.0 * i for i in range(6)]


def test_cuda_child_is_refused_with_advice(backend: str) -> None:
    if backend != "cuda":
        pytest.skip("the cuda backend's fork rule")
    do.zeros(4, do.float32).sync()

    def child() -> str:
        os.environ["DEVICEOP_BACKEND"] = "cuda"
        with pytest.raises(do.BackendError, match="spawn"):
            do.zeros(4, do.float32).sync()
        with pytest.raises(do.BackendError, match="spawn"):
            do.use_backend("cuda")
        do.use_backend("host")
        return do.backend_name() + ":" + str(do.zeros(2, do.float32).sync().numpy().tolist())

    assert in_child(child) == "host:[0.0, 0.0]"


def _host_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith(("deviceop-host", "deviceop-watch")))


def test_use_backend_host_closes_the_device_it_replaces(host_backend: str) -> None:
    def fresh_device() -> None:
        do.use_backend("host")
        t = do.zeros(16, do.float32).sync()
        do.to_numpy(t).submit().result(10)  # a watcher thread too

    fresh_device()
    before = _host_threads()
    for _ in range(8):
        fresh_device()
    gc.collect()
    deadline = time.monotonic() + 10
    while _host_threads() > before and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.02)
    # the current device's threads, and nothing left of the seven it replaced
    assert _host_threads() <= before


def test_closed_host_device_finishes_queued_work_then_refuses(host_backend: str) -> None:
    do.set_host_chaos(0.01)
    s = do.next_stream()
    t = do.zeros(1 << 12, do.float32).sync_on(s)
    fut = K.fill(t.partition((1 << 12,)), 3.0).submit(s)
    do.use_backend("host")  # closes the device while its fill is queued
    assert fut.result(10)  # queued work completed
    with pytest.raises(do.BackendError, match=r"replaced by do\.use_backend"):
        do.to_numpy(t).sync()
    with pytest.raises(do.BackendError, match="replaced"):
        K.fill(t.partition((1 << 12,)), 1.0).sync_on(s)


def test_process_state_is_renewed_after_fork_in_one_place() -> None:
    # one after_in_child handler (deviceop._process) renews every module's state, the core's
    # locks first, then its services, then the layers above; no module registers its own
    import pathlib
    import re

    import deviceop.executors
    import deviceop.kernels  # (their renewals register at import)
    from deviceop._process import renewals

    root = pathlib.Path(do.__file__).parent
    own = [
        str(p.relative_to(root))
        for p in sorted(root.rglob("*"))
        if p.suffix in (".py", ".pyx", ".pxi")
        and re.search(r"register_at_fork|pthread_atfork", p.read_text())
        and p.name != "_process.py"
    ]
    assert own == [], f"modules that renew state after fork outside deviceop._process: {own}"
    got = renewals()
    stages = [r.split(":")[0] for r in got]
    assert stages == sorted(stages, key=("CORE", "SERVICES", "LIBRARIES").index), got
    for name in ("_core._base", "_core._reactor", "_core._select", "_core._watch", "_core._wake", "kernels._nvrtc"):
        assert sum(name in r for r in got) == 1, (name, got)
    assert deviceop.executors is not None
