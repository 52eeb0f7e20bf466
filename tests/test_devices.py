"""Several devices in one process: listing and selecting them (per thread, per task), copies
between them, the ledger's ordering across them, and refusals. On the host backend two devices
are emulated (``DEVICEOP_HOST_DEVICES=2``); on cuda the tests that need two GPUs skip on one."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

import deviceop as do
from deviceop.device import current as current_backend

K = do.kernels


@pytest.fixture
def two(backend, monkeypatch):
    """The backend with two devices (emulated on host); skips on a machine with one GPU."""
    monkeypatch.setenv("DEVICEOP_HOST_DEVICES", "2")
    if len(do.devices()) < 2:
        pytest.skip("needs two devices")
    return backend


def test_devices_are_listed_by_label(backend, monkeypatch) -> None:
    monkeypatch.setenv("DEVICEOP_HOST_DEVICES", "3")
    labels = do.devices()
    assert labels[0] == f"{backend}:0" and all(lab == f"{backend}:{i}" for i, lab in enumerate(labels))
    if backend == "host":
        assert len(labels) == 3
    assert do.zeros(2).sync().device == f"{backend}:0"


def test_device_selects_allocation_streams_and_terminals(two) -> None:
    with do.device(1) as label:
        assert label == f"{two}:1"
        t = do.full(8, 2.0).sync()
        assert t.device == label and do.next_stream().backend.device_label == label
        assert all(s.backend.device_label == label for s in do.streams())
        with do.device(0):  # scopes nest
            assert do.zeros(1).sync().device == f"{two}:0"
        assert do.zeros(1).sync().device == label
        np.testing.assert_array_equal(do.to_numpy(t).sync(), np.full(8, 2.0, np.float32))
    assert do.zeros(1).sync().device == f"{two}:0"
    with do.device(f"{two}:1"):  # by label
        assert do.zeros(1).sync().device == f"{two}:1"


def test_device_is_per_thread(two) -> None:
    seen = {}

    def other() -> None:
        seen["other"] = do.zeros(1).sync().device  # a thread starts on the default device

    with do.device(1):
        th = threading.Thread(target=other)
        th.start()
        th.join()
        seen["here"] = do.zeros(1).sync().device
    assert seen == {"other": f"{two}:0", "here": f"{two}:1"}


def test_device_is_per_task_and_inherited(two) -> None:
    async def on(i: int) -> list[str]:
        with do.device(i):
            await asyncio.sleep(0.01)  # the other task runs meanwhile, on its own device
            t = await do.full(4, float(i))
            inner = await asyncio.create_task(label_of_new())  # a task started inside inherits it
            return [t.device, inner, (await do.to_numpy(t)).tolist()[0]]

    async def label_of_new() -> str:
        return (await do.zeros(1)).device

    async def main() -> list[list[str]]:
        return await asyncio.gather(on(0), on(1))

    a, b = asyncio.run(main())
    assert a == [f"{two}:0", f"{two}:0", 0.0] and b == [f"{two}:1", f"{two}:1", 1.0]


def test_to_device_copies_both_ways(two) -> None:
    x = np.arange(1000, dtype=np.float32)
    t = do.from_numpy(x).sync()
    y = do.to_device(t, 1).sync()
    assert y.device == f"{two}:1" and y.shape == t.shape and y.dtype == t.dtype
    np.testing.assert_array_equal(y.numpy(), x)  # numpy() reads on the tensor's own device
    z = do.to_device(y, f"{two}:0").sync()
    np.testing.assert_array_equal(z.numpy(), x)
    assert do.to_device(z, 0).sync() is z  # already there: no copy
    # from an op, and run from a stream of either device
    w = do.to_device(do.full(16, 3.0), 1).sync()
    assert w.device == f"{two}:1" and (w.numpy() == 3).all()
    with do.device(1):
        v = do.to_device(do.full(16, 5.0), 1).sync()  # made on device 1: already there
        u = do.to_device(z, 1).sync()
    assert v.device == u.device == f"{two}:1" and (v.numpy() == 5).all()
    np.testing.assert_array_equal(u.numpy(), x)


def test_ledger_orders_work_across_devices(two) -> None:
    # under the host backend's chaos every queued item is delayed at random: a copy that did
    # not wait for the source's writer, or a later write that did not wait for the copy, shows
    # up as a wrong value
    rng = np.random.default_rng(5)
    for trial in range(20):
        n = 4096
        src = do.zeros(n).sync()
        s0 = do.streams()[trial % len(do.streams())]
        p = src.partition((256,))
        for _ in range(5):  # a chain of writes in flight on device 0
            K.add(p, src, do.full(n, 1.0).sync()).submit(stream=s0)
        y = do.to_device(src, 1).submit()  # another stream: the ledger orders it after the adds
        K.fill(p, float(rng.integers(100, 200))).submit(stream=s0)  # write after the copy's read
        got = y.result(timeout=30).numpy()
        assert (got == 5.0).all(), f"trial {trial}: the copy saw {np.unique(got)}"


def test_work_on_the_other_device_orders_against_this_one(two) -> None:
    x = do.full(2048, 1.0).sync()
    with do.device(1):
        y = do.to_device(x, 1).sync()
        p = y.partition((256,))
        for _ in range(4):
            K.add(p, y, y).submit()  # 16.0 in the end, in flight on device 1
    back = do.to_device(y, 0).sync()  # from device 0's stream: waits for device 1's work
    assert (back.numpy() == 16.0).all()


def test_work_for_another_device_leaves_this_threads_context(two) -> None:
    # what one device's execution makes for another (the copy's join event, a foreign address
    # lookup, a stream) is made in that device's context, and the thread's context is this
    # device's again after: the stub driver refuses another context's events and functions
    if two != "cuda":
        pytest.skip("contexts exist on the cuda backend")
    from cuda.bindings import driver as drv

    def ctx() -> int:
        err, c = drv.cuCtxGetCurrent()
        assert not err
        return int(c)

    be0 = current_backend()
    with do.device(1):
        be1 = current_backend()
    x = do.full(64, 3.0).sync()
    assert ctx() == int(be0.context)
    with be1.current():
        assert ctx() == int(be1.context)
    assert ctx() == int(be0.context)
    be1.new_event(), be1.allocation_range(0), be1.new_stream(-1)
    assert ctx() == int(be0.context)
    y = do.to_device(x, 1).sync()
    assert ctx() == int(be0.context)
    K.add(x.partition((64,)), x, x).sync()  # device 0's kernel, launched after the copy
    assert (x.numpy() == 6.0).all() and (y.numpy() == 3.0).all()


def test_a_context_switched_behind_deviceops_back_is_switched_back(two) -> None:
    # another library may make another device's context current on this thread (PyTorch's
    # torch.cuda.set_device, a cudaSetDevice), also inside do.external's fn: deviceop asks the
    # driver what is current instead of trusting what it last set (the stub driver refuses a
    # launch on a stream whose context is not current)
    if two != "cuda":
        pytest.skip("contexts exist on the cuda backend")
    from cuda.bindings import driver as drv

    x = do.full(64, 1.0).sync()
    with do.device(1):
        be1 = current_backend()
    (err,) = drv.cuCtxSetCurrent(be1.context)
    assert not err
    K.add(x.partition((64,)), x, x).sync()  # device 0's kernel, with device 1's context current before
    assert (x.numpy() == 2.0).all()

    def switch(stream, *_):  # fn leaves the thread on device 1, as set_device would
        drv.cuCtxSetCurrent(be1.context)

    y = do.full(64, 1.0).sync()
    op = do.external(switch, reads=(x,)).then(lambda _: K.add(y.partition((64,)), y, x))
    op.sync()  # the kernel after fn runs in device 0's context again
    assert (y.numpy() == 3.0).all()


def test_mixed_device_kernel_is_refused(two) -> None:
    a = do.zeros(8).sync()
    with do.device(1):
        b = do.zeros(8).sync()
    with pytest.raises(do.UsageError, match=f"lives on {two}:1"):
        K.add(do.zeros(8).sync().partition((8,)), a, b).sync()
    with pytest.raises(do.UsageError, match="another device"):
        do.to_numpy(b).sync()  # the terminal runs on device 0: say where the tensor is


@pytest.mark.parametrize("spec", [5, -1, "host:9", "cuda:7", 1.0, None, True, "gpu", "host:x"])
def test_bad_devices_are_refused_before_any_work(backend, monkeypatch, spec) -> None:
    monkeypatch.setenv("DEVICEOP_HOST_DEVICES", "2")
    if backend == "cuda" and spec == 1 and len(do.devices()) > 1:
        pytest.skip("a real second device")
    with pytest.raises(do.UsageError):
        do.device(spec)
    with pytest.raises(do.UsageError):
        do.to_device(do.zeros(2), spec)


def test_to_device_bad_input(two) -> None:
    with pytest.raises(do.UsageError, match="needs a Tensor"):
        do.to_device(np.ones(3), 1)  # type: ignore[arg-type]
    t = do.zeros((4, 4)).sync()
    with pytest.raises(do.ShapeError, match="contiguous"):
        do.to_device(t[:, 1:3], 1).sync()
    with pytest.raises(do.CaptureError), do.graph.scope() as s:
        s.record(do.to_device(t, 1))


def test_a_device_scope_is_entered_once(two) -> None:
    d = do.device(1)
    with d, pytest.raises(do.UsageError, match="already entered"):
        with d:
            pass
    assert "device" in repr(d)


def test_bad_host_device_counts_are_refused(monkeypatch) -> None:
    from deviceop._backends._host import HostBackend

    for bad in ("0", "17", "two", "-1"):
        monkeypatch.setenv("DEVICEOP_HOST_DEVICES", bad)
        with pytest.raises(do.BackendError, match="DEVICEOP_HOST_DEVICES"):
            HostBackend.device_count()


def test_use_backend_host_with_a_default_device(host_backend, monkeypatch) -> None:
    monkeypatch.setenv("DEVICEOP_HOST_DEVICES", "2")
    old1 = do.device(1)._be
    be = do.use_backend("host", device=1)
    try:
        assert be.device_label == "host:1" and do.zeros(1).sync().device == "host:1"
        with pytest.raises(do.BackendError):  # the devices it replaced are closed
            do.zeros(1).sync_on(old1.streams[0])
        with pytest.raises(do.BackendError, match="DEVICEOP_HOST_DEVICES"):
            do.use_backend("host", device=2)
        with pytest.raises(do.BackendError, match="device ordinal"):
            do.use_backend("host", device=-1)
    finally:
        do.use_backend("host")
    assert current_backend().device_label == "host:0"


def _item(i: int):
    def make(lane: int) -> do.DeviceOp:
        # made by the op the factory returns (a factory runs on the queue's loop: it must not
        # block it), on the lane's device
        ins = do.zip(do.full(256, float(i)), do.empty(256))
        return ins.then(lambda ts: K.scale(ts[1].partition((128,)), ts[0], 2.0)).map(
            lambda r: (r[0].tensor, r[1].device)
        )

    return make


@pytest.mark.parametrize("kind", ["WorkQueue", "ThreadedQueue"])
def test_queues_spread_lanes_over_devices(two, kind) -> None:
    from deviceop.executors import ThreadedQueue, WorkQueue

    if kind == "WorkQueue":
        q = WorkQueue(devices="all", streams=2, batch=1)
        res = asyncio.run(q.run([_item(i) for i in range(60)]))
    else:
        q = ThreadedQueue(devices=[0, f"{two}:1"], streams=2, batch=1)
        res = q.run([_item(i) for i in range(60)])
    assert [s.backend.device_label for s in q.streams] == [f"{two}:{d}" for d in (0, 1, 0, 1)]
    for r in res:
        out, made_on = r.unwrap()
        lane_dev = q.streams[r.lane].backend.device_label
        assert out.device == made_on == lane_dev  # the factory ran with its lane's device selected
        assert (out.numpy() == 2.0 * r.index).all()
    per = q.stats().per_device()
    assert set(per) == {f"{two}:0", f"{two}:1"}
    assert sum(d["items"] for d in per.values()) == 60 and all(d["lanes"] == 2 for d in per.values())
    assert all(0.0 <= d["busy_fraction"] <= 1.0 for d in per.values())


@pytest.mark.parametrize("devices", ["some", [], [0, 0], 3.0, [9]])
def test_queue_devices_bad_input(two, devices) -> None:
    from deviceop.executors import WorkQueue

    with pytest.raises(do.UsageError):
        WorkQueue(devices=devices)
    with pytest.raises(do.UsageError, match="per device"):
        WorkQueue(devices="all", streams=[do.streams()[0]])


def test_info_lists_the_devices() -> None:
    import os
    import subprocess
    import sys

    env = {
        **os.environ,
        "DEVICEOP_BACKEND": "host",
        "DEVICEOP_HOST_DEVICES": "2",
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    r = subprocess.run([sys.executable, "-m", "deviceop", "info"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "devices:            host:0, host:1 (default host:0)" in r.stdout


def test_demo_says_as_a_note_why_it_runs_on_the_host_backend() -> None:
    # the README's first command: its checks pass; where it falls back to the host backend (no
    # GPU), the reason is a note on stderr, not a warning attributed to the interpreter's
    # start-up code (the first caller outside deviceop when deviceop is the program)
    import os
    import re
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "DEVICEOP_BACKEND"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    if env.pop("DEVICEOP_STUB_DRIVER", None) == "1":
        env.pop("LD_LIBRARY_PATH", None)  # (the stub driver computes only under the tests' harness)
    r = subprocess.run([sys.executable, "-m", "deviceop", "demo"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert len(re.findall(r":\s+ok\s", r.stdout)) == 2 and "WRONG" not in r.stdout, r.stdout
    assert "runpy" not in r.stderr and "DeviceOpWarning" not in r.stderr, r.stderr
    if "on the host backend" in r.stdout:
        assert r.stderr.startswith("note: deviceop: ") and "using the host backend" in r.stderr, r.stderr


def test_info_says_what_to_do_when_the_chosen_backend_is_unusable() -> None:
    # DEVICEOP_BACKEND=cuda where there is no driver: one line saying so and what to set, not a
    # traceback (where a driver is found, info describes it)
    import os
    import subprocess
    import sys

    env = dict(os.environ, DEVICEOP_BACKEND="cuda", PYTHONPATH=os.pathsep.join(sys.path))
    if env.pop("DEVICEOP_STUB_DRIVER", None) == "1":
        env.pop("LD_LIBRARY_PATH", None)  # (no stub: no driver, unless the machine has one)
    r = subprocess.run([sys.executable, "-m", "deviceop", "info"], capture_output=True, text=True, env=env, timeout=120)
    if r.returncode == 0:
        assert "backend:            cuda" in r.stdout, r.stdout
        return
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("python -m deviceop: ") and "unset DEVICEOP_BACKEND" in r.stderr, r.stderr
    # a setting's own error is said without advice about the backend
    env["DEVICEOP_STREAMS"] = "x"
    r = subprocess.run([sys.executable, "-m", "deviceop", "info"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1 and "DEVICEOP_STREAMS must be" in r.stderr and "DEVICEOP_BACKEND" not in r.stderr


def test_multi_device_experiment_runs_on_two_emulated_devices(tmp_path) -> None:
    import json
    import os
    import subprocess
    import sys

    from conftest import ROOT

    out = tmp_path / "md.json"
    env = {
        **os.environ,
        "DEVICEOP_BACKEND": "host",
        "DEVICEOP_HOST_DEVICES": "2",
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    args = ["--items", "60", "--small", "16", "--large", "32", "--sizes-mib", "0.1", "--reps", "1", "--out", str(out)]
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "multi_device.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(out.read_text())
    q = doc["queue"]
    assert q["devices"] == ["host:0", "host:1"] and q["ratio"] > 0
    assert set(q["per_device_last"]) == {"host:0", "host:1"}
    assert sum(d["items"] for d in q["per_device_last"].values()) == 60
    assert doc["copy"][0]["deviceop_gb_s"] > 0
