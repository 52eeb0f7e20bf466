"""The example programs of ``examples/`` run as a user runs them, each briefly, on the backend."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest
from conftest import ROOT, STUB_DRIVER, needs_gpu

import deviceop as do

EXAMPLES = os.path.join(ROOT, "examples")


def _run(backend: str, args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEVICEOP_BACKEND": backend, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_service_load_test(backend, tmp_path) -> None:
    pytest.importorskip("aiohttp")
    pytest.importorskip("torch")  # (the model is a PyTorch module in every variant)
    needs_gpu(backend, "the service's encoder runs PyTorch's kernels on deviceop's stream")
    impls = ["deviceop-batch", "deviceop", "torch-batch", "torch-blocking", "cached"]
    if backend == "cuda":
        impls.append("torch-batch-graphs")
    out = tmp_path / "service.json"
    r = _run(
        backend,
        [
            os.path.join(EXAMPLES, "service", "loadtest.py"),
            "--impls",
            ",".join(impls),
            "--width",
            "64",
            "--layers",
            "2",
            "--heads",
            "4",
            "--rows",
            "4",
            "--inputs",
            "8",
            "--seconds",
            "1",
            "--warmup",
            "0.5",
            "--rounds",
            "1",
            "--clients",
            "16",
            "--procs",
            "2",
            "--copies",
            "2",
            "--out",
            str(out),
        ],
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["impls"] == impls
    for impl in impls:
        s = doc["summary"][impl]
        assert s["errors"] == 0 and s["mismatches"] == 0, (impl, s)
        assert s["req_s"] > 0 and s["latency_ms_p99"] >= s["latency_ms_p50"] > 0
        assert doc["check"][impl] < 2e-2
        assert s["at_rate"]["late"] >= 0 and s["at_rate"]["unanswered"] >= 0  # (the open-loop rounds ran)
    (batched,) = [x for x in doc["rounds"] if x["impl"] == "deviceop-batch"]
    assert batched["server"]["backend"] == backend and batched["server_window"]
    assert batched["server"]["batcher"]["mean_batch"] > 1  # (requests were gathered)
    assert batched["server"]["graph_cache"]["misses"] >= 1
    (ceiling,) = [x for x in doc["rounds"] if x["impl"] == "cached"]
    assert ceiling["server"]["cached"] in (8, 9)  # the 8 inputs (and the warm-up's zeros, unless among them)
    assert all(doc["summary"][i]["of_ceiling"] > 0 for i in impls if i != "cached")
    (micro,) = [x for x in doc["rounds"] if x["impl"] == "torch-batch"]
    assert micro["server"]["mean_batch"] > 1
    sv = batched["server"]
    assert sv["gc_collected"] >= 0 and sv["machine_cpu"]["busy_s"] > 0
    if sys.platform == "linux":
        assert sv["loop_sched"]["runq_wait_s"] >= 0 and sv["loop_sched"]["voluntary"] >= 0


def _service_module(name: str):
    sys.path.insert(0, os.path.join(EXAMPLES, "service"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


@pytest.mark.parametrize("delay", [0.2, 2.5])
def test_load_test_open_loop_counts_late_and_unanswered_requests(delay: float) -> None:
    """A server answering every request after ``delay``: in open loop, an answer after the window
    (within its grace second) counts in the latencies and as late, not in the throughput; one
    not there by then counts as unanswered."""
    pytest.importorskip("aiohttp")
    import asyncio
    import hashlib
    import threading

    from aiohttp import web

    loadtest = _service_module("loadtest")
    started = threading.Event()
    box: dict = {}

    def serve() -> None:
        async def handle(request: web.Request) -> web.Response:
            await request.read()
            await asyncio.sleep(delay)
            return web.Response(body=b"answer")

        async def main() -> None:
            app = web.Application()
            app.add_routes([web.post("/infer", handle)])
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            box["port"] = runner.addresses[0][1]
            box["stop"] = asyncio.Event()
            started.set()
            await box["stop"].wait()
            await runner.cleanup()

        box["loop"] = asyncio.new_event_loop()
        box["loop"].run_until_complete(main())

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    assert started.wait(30)
    try:
        t0 = time.time() + 0.6
        window, rate = 0.8, 40.0
        got = loadtest._client(
            f"http://127.0.0.1:{box['port']}",
            [b"request"],
            [hashlib.sha1(b"answer").hexdigest()],
            64,
            t0,
            t0 + window,
            rate,
        )
    finally:
        box["loop"].call_soon_threadsafe(box["stop"].set)
        t.join(30)
    due = int(window * rate)  # requests due in the window (give or take one)
    assert got["errors"] == 0 and got["mismatches"] == 0
    lat = got["latencies"]
    if delay < loadtest.GRACE_S:
        assert got["unanswered"] == 0 and abs(len(lat) - due) <= 1
        late = len(lat) - got["in_window"]  # due in the window's last ``delay`` seconds
        assert abs(late - delay * rate) <= 2 and got["in_window"] > 0
        assert min(lat) >= delay * 0.9
    else:
        assert not lat and got["in_window"] == 0 and abs(got["unanswered"] - due) <= 1


def test_service_refuses_bad_requests_and_settings() -> None:
    pytest.importorskip("aiohttp")
    pytest.importorskip("torch")
    import urllib.error

    loadtest = _service_module("loadtest")
    model = _service_module("model")
    assert loadtest.VOCAB == model.VOCAB
    small = ["--rows", "4", "--width", "32", "--layers", "1", "--heads", "2", "--warmup", "0"]
    env = {**os.environ, "DEVICEOP_BACKEND": "host", "PYTHONPATH": os.pathsep.join(sys.path)}
    p, url = loadtest.start_server("torch-blocking", small, env)
    try:
        import numpy as np

        ok = loadtest._post(url + "/infer", np.arange(4, dtype=np.int32).tobytes())
        assert len(ok) == 32 * 2  # an embedding: width float16 values
        for body in (np.arange(3, dtype=np.int32).tobytes(), np.array([0, 1, 2, model.VOCAB], np.int32).tobytes()):
            with pytest.raises(urllib.error.HTTPError) as e:
                loadtest._post(url + "/infer", body)
            assert e.value.code == 400
    finally:
        p.terminate()
        p.wait(30)
    for bad in (["--copies", "0"], ["--rows", "0"], ["--width", "30", "--heads", "4"]):
        r = subprocess.run(
            [sys.executable, os.path.join(EXAMPLES, "service", "server.py"), *small, *bad],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert r.returncode == 2 and bad[0] in r.stderr, r.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="schedstat and /proc/stat are Linux's")
def test_service_reads_the_loop_threads_scheduling_and_the_machines_cpu() -> None:
    pytest.importorskip("aiohttp")
    sys.path.insert(0, os.path.join(EXAMPLES, "service"))
    try:
        import server
    finally:
        sys.path.pop(0)
    m0, s0 = server.machine_cpu(), server.thread_sched()
    t = time.thread_time() + 0.05
    while time.thread_time() < t:  # busy on this thread
        pass
    m1, s1 = server.machine_cpu(), server.thread_sched()
    assert m1["busy_s"] - m0["busy_s"] >= 0.02 and m1["steal_s"] >= m0["steal_s"] >= 0
    assert s1["voluntary"] >= s0["voluntary"] and s1["nonvoluntary"] >= s0["nonvoluntary"]
    assert s1["runq_wait_s"] >= s0["runq_wait_s"] >= 0


def test_gemm_queue(backend, tmp_path) -> None:
    needs_gpu(backend, "cuBLAS GEMMs")
    out = tmp_path / "queue.json"
    args = ["--items", "100", "--small", "32", "--large", "96", "--repeats", "1", "--check", "10"]  # the whole pool
    r = _run(backend, [os.path.join(EXAMPLES, "gemm_queue", "run.py"), *args, "--out", str(out)], timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["backend"] == backend
    (q,) = doc["queue"]
    assert doc["checked"] == 10 and doc["max_rel_err"] < 2e-2
    assert len(q["busy_fraction"]) == doc["config"]["streams"] >= 1 and q["gemms_per_ms"] > 0
    assert "GEMMs/ms" in r.stdout


def test_gemm_queue_refuses_bad_arguments(tmp_path) -> None:
    r = _run("host", [os.path.join(EXAMPLES, "gemm_queue", "run.py"), "--items", "0"], timeout=120)
    assert r.returncode == 2 and "--items must be at least 1" in r.stderr


STAGES = ["start", "enqueue", "complete"]


@pytest.mark.parametrize("model", ["wav2vec2", "residual"])
def test_asr_stream(backend, tmp_path, model) -> None:
    pytest.importorskip("webrtcvad")
    pytest.importorskip("torch")
    if model == "wav2vec2":
        pytest.importorskip("transformers")
    needs_gpu(backend, "PyTorch on deviceop's stream")
    out = tmp_path / "asr.json"
    args = ["--model", model, "--speed", "16", "--width", "64", "--layers", "1", "--interrupt-every", "3"]
    args += ["--rounds", "2"]
    r = _run(backend, [os.path.join(EXAMPLES, "asr_stream", "run.py"), *args, "--out", str(out)], timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["backend"] == backend and doc["chunks"] == 50 and 0 < doc["voiced_chunks"] < 50
    loops = {s["loop"]: s for s in doc["loops"]}
    # the kernel loop writes the residual encoder's kernels: it runs with that model only
    ours = (
        ("deviceop", "deviceop-torch", "deviceop-graph")
        if model == "residual"
        else ("deviceop-torch", "deviceop-graph")
    )
    expected = {*ours, "torch-blocking", "torch-threaded"}
    assert set(loops) == (expected | {"torch-graph"} if backend == "cuda" else expected)
    for s in loops.values():  # two rounds over the audio each
        assert s["voiced_chunks"] == 2 * doc["voiced_chunks"]
        assert s["published"] + s["cancelled"] == s["voiced_chunks"]  # each chunk published or cancelled
        assert s["interrupts"] == 2 * -(-doc["voiced_chunks"] // 3)
        assert s["published"] > 0 and s["chunk_latency_ms_p50"] > 0 and list(s["stage_ms_p50"]) == STAGES
    assert {loops[n]["host_threads"] for n in ours} == {1}
    for name in ours:  # an interrupt's reaction, in its two parts
        parts = loops[name]["reaction_stage_ms"]
        assert list(parts) == ["notice", "cancel"] and all(0 <= p["p50"] <= p["p99"] for p in parts.values())
        assert parts["notice"]["p50"] <= loops[name]["reaction_ms_p99"]


def _asr_module():
    spec = importlib.util.spec_from_file_location("asr_stream_run", os.path.join(EXAMPLES, "asr_stream", "run.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (its dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


def test_asr_kernel_encoder_computes_what_pytorch_does(backend) -> None:
    """The speech loop's deviceop encoder (the whole encoder in deviceop kernels: the log-mel
    features, the layers, the head) gives the PyTorch encoder's logits on the same weights and
    audio, for every chunk of a stream of them."""
    torch = pytest.importorskip("torch")
    np = pytest.importorskip("numpy")
    needs_gpu(backend, "cuBLAS GEMMs and NVRTC-compiled kernels")
    asr = _asr_module()
    dev = "cuda" if backend == "cuda" else "cpu"
    enc = asr.Encoder(dev, 64, 3, seed=1)
    rep = asr.Report("check", 1)
    stream = do.next_stream()
    chunk_op = asr._kernel_encoder(enc, rep, [0.0], [0.0], stream)
    rng = np.random.default_rng(0)
    for i in range(3):
        x = (0.1 * rng.standard_normal(4000)).astype(np.float32)
        got = chunk_op(asr.Chunk(i, 0.0, np.zeros(0, np.int16), x)).sync_on(stream).astype(np.float32)
        want = enc(torch.from_numpy(x).to(dev)).cpu().numpy()
        assert got.shape == want.shape == (enc.frames(len(x)), len(asr.SYMBOLS))
        # float32 on the host; on cuda both round every op to float16, in different kernels
        tol = 1e-3 if dev == "cpu" else 3e-2
        assert np.allclose(got, want, rtol=tol, atol=tol * float(np.abs(want).max())), float(np.abs(got - want).max())
    assert len(rep.stages["start"]) == len(rep.stages["enqueue"]) == 3


def test_asr_wav2vec2_steps_compute_the_whole_model(host_backend) -> None:
    """The speech loop's wav2vec 2.0 in its steps (front, projection, layers, head) gives the
    logits of transformers' own forward pass over the normalised audio; and its frame count."""
    torch = pytest.importorskip("torch")
    np = pytest.importorskip("numpy")
    pytest.importorskip("transformers")
    asr = _asr_module()
    m = asr.Wav2Vec2("cpu", 64, 2, seed=3)
    x = torch.from_numpy((0.1 * np.random.default_rng(0).standard_normal(8000)).astype(np.float32))
    with torch.inference_mode():
        got = m(x)
        want = m.model((x - x.mean())[None] / (x.std() + 1e-5)).logits[0].float()
        steps = m.head(m.block(m.block(m.project(m.front(x)), 0, 1), 1, 2))
    assert got.shape == (m.frames(len(x)), len(asr.SYMBOLS))
    assert torch.allclose(got, want, atol=1e-5) and torch.equal(got, steps)


def test_asr_kernel_loop_needs_the_residual_model() -> None:
    pytest.importorskip("webrtcvad")
    pytest.importorskip("torch")
    r = _run("host", [os.path.join(EXAMPLES, "asr_stream", "run.py"), "--loops", "deviceop"], timeout=120)
    assert r.returncode == 2 and "--model residual" in r.stderr, r.stderr[-2000:]


def test_asr_stream_says_a_missing_wav_is_missing(tmp_path) -> None:
    # a one-line usage error, before anything is loaded (not a traceback from inside wave.open)
    missing = tmp_path / "talk.wav"
    r = _run("host", [os.path.join(EXAMPLES, "asr_stream", "run.py"), "--wav", str(missing)], timeout=120)
    assert r.returncode == 2 and f"--wav {missing}: no such file" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def _replicas(backend: str, tmp_path, script: str, *extra: str) -> dict:
    """Run a Ray example with two small replicas (sharing the GPU where there is one); its JSON,
    checked for what both examples report."""
    out = tmp_path / "replicas.json"
    args = ["--requests", "48", "--width", "64", "--steps", "2", "--rows", "4", "--repeats", "1", "--check", "8"]
    if backend == "host":
        args += ["--gpus-per-replica", "0"]
    elif len(do.devices()) < 2:  # two replicas sharing the one GPU
        args += ["--gpus-per-replica", "0.5"]
    r = _run(backend, [os.path.join(EXAMPLES, "ray_replicas", script), *args, *extra, "--out", str(out)], timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc: dict = json.loads(out.read_text())
    assert doc["replicas"] == 2 and doc["checked"] == 8
    assert doc["max_rel_err"] < 2e-2 and doc["req_s_one"] > 0 and doc["req_s_all"] > 0
    assert len({w.split(" pid ")[1] for w in doc["where"]}) == 2  # two replica processes answered
    assert all(w.startswith(backend) for w in doc["where"])
    return doc


@pytest.mark.parametrize("runtime", ["ray", "processes"])
def test_ray_replicas(backend, tmp_path, runtime) -> None:
    if runtime == "ray":
        pytest.importorskip("ray")
    needs_gpu(backend, "cuBLAS GEMMs in the replicas")
    doc = _replicas(backend, tmp_path, "run.py", *(["--no-ray"] if runtime == "processes" else []))
    assert doc["runtime"] == runtime


def test_ray_serve_deployment(backend, tmp_path) -> None:
    pytest.importorskip("ray.serve")
    needs_gpu(backend, "cuBLAS GEMMs in the replicas")
    doc = _replicas(backend, tmp_path, "serve.py")
    assert doc["runtime"] == "ray-serve" and doc["http_max_rel_err"] < 2e-2


def test_ray_replicas_refuses_more_gpus_than_there_are(backend) -> None:
    n = len(do.devices())
    args = [os.path.join(EXAMPLES, "ray_replicas", "run.py"), "--no-ray", "--replicas", str(n + 1)]
    r = _run(backend, [*args, "--gpus-per-replica", "1"], 120)
    assert r.returncode == 2, r.stderr[-2000:]
    if backend == "cuda":
        assert f"{n} {'is' if n == 1 else 'are'} visible" in r.stderr, r.stderr[-2000:]
    else:  # no GPU at all: the advice is to run without one
        assert "no GPU is visible" in r.stderr and "--gpus-per-replica 0" in r.stderr, r.stderr[-2000:]


def test_ray_replicas_stops_when_a_replica_cannot_start(backend) -> None:
    # a replica process that fails at start is reported, not waited for
    env_backend = "no-such-backend"
    args = [os.path.join(EXAMPLES, "ray_replicas", "run.py"), "--no-ray", "--gpus-per-replica", "0"]
    args += ["--requests", "8", "--width", "64", "--steps", "1", "--rows", "4"]
    r = _run(env_backend, args, 120)
    assert r.returncode == 1 and "replica 0 did not start" in r.stderr, r.stdout[-2000:] + r.stderr[-2000:]


def _small_commands() -> list[str]:
    """The commands of examples/README.md marked ``# small``: what a user runs first, on any machine."""
    import re

    with open(os.path.join(EXAMPLES, "README.md")) as f:
        text = f.read()
    return [m.group(1).strip() for m in re.finditer(r"^(python examples/\S+.*?)\s+# small\b", text, re.M)]


def test_the_readme_marks_a_small_command_for_every_example() -> None:
    got = {c.split()[1].split("/")[1] for c in _small_commands()}
    have = {
        d for d in os.listdir(EXAMPLES) if os.path.isdir(os.path.join(EXAMPLES, d)) and not d.startswith((".", "_"))
    }
    assert got == have, f"examples without a '# small' command in examples/README.md: {sorted(have - got)}"


@pytest.mark.parametrize("command", _small_commands())
def test_documented_small_command_finishes_on_the_host_within_a_minute(command: str) -> None:
    import shlex

    if STUB_DRIVER:
        pytest.skip("a host-backend command: the host run of the suite runs it")
    args = shlex.split(command)[1:]
    script = args[0]
    if "ray_replicas" in script:
        pytest.importorskip("ray")
    if "asr_stream" in script or "torch-blocking" in command:
        pytest.importorskip("torch")
    if "service" in script:
        pytest.importorskip("aiohttp")
    if "asr_stream" in script:
        pytest.importorskip("webrtcvad")
        if "--model residual" not in command:
            pytest.importorskip("transformers")  # (wav2vec 2.0)
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=ROOT,
        env={**os.environ, "DEVICEOP_BACKEND": "host", "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    took = time.monotonic() - t0
    assert r.returncode == 0, f"{command}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    assert took < 60, f"{command} took {took:.0f} s on the host"
    assert "not what a GPU does" in r.stdout, r.stdout[-2000:]  # host figures are said to be host figures
