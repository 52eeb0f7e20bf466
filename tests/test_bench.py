"""The benchmark suite's harness (``python -m benchmarks``): its refusals, its timer and
summaries, its result schema, the comparison, the README's figures drawn from the curated
baseline, and the benchmarks' figures (drawn from small documents)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import _cuda_skip_reason

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.join(ROOT, "benchmarks"))  # (plots.py; appended: its script names shadow nothing)
sys.path.insert(0, ROOT)

from benchmarks._harness import SCHEMA, Metric, Stats, Timer, check_document, compare, kind_of  # noqa: E402
from benchmarks._suite import BASELINES, BENCHMARKS, readme_table  # noqa: E402


def _bench(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, **(env or {})),
        timeout=timeout,
    )


def test_benchmarks_refuse_without_a_gpu(tmp_path):
    r = _bench("startup", "--out", str(tmp_path / "b.json"), env={"DEVICEOP_BACKEND": "host"})
    assert r.returncode == 2, r.stderr
    assert "need a CUDA device" in r.stderr
    assert not (tmp_path / "b.json").exists(), "nothing is written when the benchmarks cannot run"


def test_benchmarks_reject_unknown_names():
    r = _bench("nope")
    assert r.returncode == 2 and "unknown benchmark(s) nope" in r.stderr


def test_every_benchmark_has_a_script_and_a_headline():
    from benchmarks._headlines import HEADLINES

    assert set(HEADLINES) == set(BENCHMARKS)
    assert len(BENCHMARKS) <= 15
    for b in BENCHMARKS.values():
        assert (Path(ROOT) / "benchmarks" / b.script).resolve().is_file(), b.script
        assert b.vs, f"{b.name} names what it is measured against"


def test_timer_counts_wall_and_cpu_time():
    with Timer() as t:
        end = time.perf_counter() + 0.05
        while time.perf_counter() < end:
            pass
    assert 0.05 <= t.wall_s < 5
    assert 0.02 <= t.cpu_s <= t.wall_s + 0.05


def test_stats_summarise_repeats():
    s = Stats.of([3.0, 1.0, 2.0, 10.0])
    assert (s.median, s.low, s.high, s.n) == (2.5, 1.0, 10.0, 4)
    with pytest.raises(ValueError):
        Stats.of([])
    with pytest.raises(ValueError, match="better"):
        Metric("x", 1.0, "x", "bigger")


def _doc(metrics: list[dict]) -> dict:
    return {
        "schema": SCHEMA,
        "machine": {"device": "NVIDIA H200", "devices": 1, "backend": "cuda"},
        "commit": "0" * 40,
        "environment": {},
        "benchmarks": {"queue": {"status": "ok", "metrics": metrics}},
    }


def test_compare_judges_changes_by_the_base_spread_and_direction():
    base = _doc(
        [
            {"name": "throughput", "value": 100.0, "unit": "x", "better": "higher", "low": 95.0, "high": 105.0},
            {"name": "cost", "value": 10.0, "unit": "us", "better": "lower"},
            {"name": "lag", "value": 1.0, "unit": "ms", "better": "lower"},
        ]
    )
    new = _doc(
        [
            {"name": "throughput", "value": 104.0, "unit": "x", "better": "higher"},  # within the spread
            {"name": "cost", "value": 12.0, "unit": "us", "better": "lower"},  # > 5 %, the wrong way
            {"name": "lag", "value": 0.5, "unit": "ms", "better": "lower"},  # better
        ]
    )
    check_document(base)
    verdicts = {r["metric"]: r["verdict"] for r in compare(base, new)}
    assert verdicts == {"throughput": "same", "cost": "worse", "lag": "better"}
    with pytest.raises(ValueError, match="schema"):
        check_document({**base, "schema": "other/1"})
    assert kind_of(base["machine"]) == "nvidia-h200"
    assert kind_of({"device": "NVIDIA H200", "devices": 2}) == "nvidia-h200-x2"


def test_compare_two_documents_from_the_command_line(tmp_path):
    a = tmp_path / "a.json"
    a.write_text(json.dumps(_doc([{"name": "cost", "value": 10.0, "unit": "us", "better": "lower"}])))
    r = _bench("--compare", str(a), str(a))
    assert r.returncode == 0, r.stderr
    assert "queue: cost" in r.stdout and "1 metrics: 0 better, 0 worse, 1 within the spread" in r.stdout


def test_readme_figures_come_from_the_curated_baseline():
    # the README's figures table is the one `python -m benchmarks --readme` makes from the baseline
    baselines = sorted(BASELINES.glob("*.json"))
    assert baselines, "a curated baseline exists for at least one machine kind"
    readme = (Path(ROOT) / "README.md").read_text()
    begin, end = "<!-- figures: begin", "<!-- figures: end -->"
    assert begin in readme and end in readme
    section = readme[readme.index(begin) : readme.index(end)]
    name = re.match(r"<!-- figures: begin \(python -m benchmarks --readme (\S+)\) -->", section)[1]  # type: ignore[index]
    doc = json.loads((Path(ROOT) / name).read_text())
    check_document(doc)
    assert readme_table(doc) in section


def test_compare_says_what_it_could_not_compare():
    base = _doc([{"name": "cost", "value": 0.0, "unit": "us", "better": "lower"}])
    base["profile"] = "full"
    new = _doc([{"name": "other", "value": 1.0, "unit": "us", "better": "lower"}])
    new["profile"] = "quick"
    new["machine"] = {"device": "NVIDIA H100 80GB HBM3", "devices": 1}
    new["benchmarks"]["kernels"] = {"status": "failed", "why": "exit 1: boom"}
    from benchmarks._harness import format_comparison

    text = format_comparison(compare(base, new), base, new)
    assert "different kinds of machine" in text and "full profile" in text
    assert "only in the base: queue: cost" in text and "only in the new: queue: other" in text
    assert "new kernels: failed: exit 1: boom" in text
    assert "another command" not in text  # (neither document says what its queue ran)
    base["benchmarks"]["queue"]["command"] = ["python3", "benchmarks/bimodal.py", "--reps", "3"]
    new["benchmarks"]["queue"]["command"] = ["/usr/bin/python3", "benchmarks/bimodal.py", "--reps", "5"]
    text = format_comparison(compare(base, new), base, new)
    assert "warning: queue ran another command in the base (benchmarks/bimodal.py --reps 3)" in text
    # the same arguments by another interpreter: the same command
    new["benchmarks"]["queue"]["command"] = ["python", "benchmarks/bimodal.py", "--reps", "3"]
    assert "another command" not in format_comparison(compare(base, new), base, new)
    # a zero base is compared without dividing by it
    same = compare(base, _doc([{"name": "cost", "value": 0.0, "unit": "us", "better": "lower"}]))
    assert same[0]["ratio"] == 1.0 and same[0]["verdict"] == "same"


def test_every_headline_reads_the_baseline_it_made():
    from benchmarks.__main__ import headlines

    for path in sorted(BASELINES.glob("*.json")):
        doc = json.loads(path.read_text())
        check_document(doc)
        assert kind_of(doc["machine"]) == path.stem, "a baseline is named by the kind of machine it ran on"
        for name, e in doc["benchmarks"].items():
            assert name in BENCHMARKS
            if e["status"] != "ok":
                assert e.get("why"), f"{path.name}: {name} says why it did not run"
                continue
            assert [m["name"] for m in headlines(name, e["raw"])] == [m["name"] for m in e["metrics"]]


def test_the_service_headline_gives_the_spread_of_its_rounds():
    from benchmarks.__main__ import headlines

    summary = {
        "deviceop-batch": {"vs_best_torch": {"impl": "torch-batch-graphs", "ratio": 1.2, "rounds": [1.3, 0.9, 1.1]}},
        "deviceop": {"vs_best_torch": {"impl": "torch-batch-graphs", "ratio": 0.5}},  # (an older document)
    }
    got = {m["name"]: m for m in headlines("service", {"summary": summary})}
    batch = got["requests/s, deviceop-batch"]
    assert (batch["value"], batch["low"], batch["high"]) == (1.2, 0.9, 1.3)
    assert "low" not in got["requests/s, deviceop"] and "high" not in got["requests/s, deviceop"]


def _fake(tmp_path: Path, body: str, timeout_s: float = 60):
    from benchmarks._harness import Benchmark

    script = tmp_path / "fake.py"
    script.write_text(
        "import argparse, json, sys, time\n"
        "ap = argparse.ArgumentParser(); ap.add_argument('--out'); a = ap.parse_args()\n" + body
    )
    return Benchmark("startup", str(script), "a fake", "nothing", timeout_s=timeout_s)


def test_a_failing_or_hanging_benchmark_is_reported_and_ended(tmp_path):
    from benchmarks.__main__ import run_one

    e = run_one(_fake(tmp_path, "print('about to fail'); sys.exit(3)\n"), False, tmp_path, tmp_path / "a.log")
    assert e["status"] == "failed" and e["why"].startswith("exit 3") and "about to fail" in e["why"]
    e = run_one(
        _fake(tmp_path, "json.dump({'experiment': 'x'}, open(a.out, 'w'))\n"), False, tmp_path, tmp_path / "b.log"
    )
    assert e["status"] == "failed" and "no headline figure" in e["why"]
    t0 = time.monotonic()
    e = run_one(
        _fake(
            tmp_path,
            "import subprocess; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)\n",
            1.0,
        ),
        False,
        tmp_path,
        tmp_path / "c.log",
    )
    assert e["status"] == "failed" and e["why"].startswith("timed out after 1 s")
    assert time.monotonic() - t0 < 30
    e = run_one(
        _fake(
            tmp_path,
            "json.dump({'import_ms': 1.0, 'import_ms_all': [1.0], 'bare_start_ms': 2.0, 'first_op_ms': 3.0, 'first_all': [[2.0, 3.0]]}, open(a.out, 'w'))\n",
        ),
        False,
        tmp_path,
        tmp_path / "d.log",
    )
    assert e["status"] == "ok" and e["metrics"][0] == {
        "name": "import deviceop",
        "value": 1.0,
        "unit": "ms",
        "better": "lower",
        "vs": "",
        "low": 1.0,
        "high": 1.0,
    }
    script = str(tmp_path / "fake.py")
    root = str(Path(__file__).resolve().parents[1])  # (a record shows a path in the checkout from there)
    assert e["command"][1:] == [os.path.relpath(script, root) if script.startswith(root) else script]


def test_a_benchmark_runs_end_to_end(tmp_path):
    # (in its own process: the cuda backend on the stub driver in CI, on the GPU there)
    reason = _cuda_skip_reason()
    if reason:
        pytest.skip(f"runs a benchmark, which needs the cuda backend: {reason}")
    out = tmp_path / "b.json"
    r = _bench("startup", "--quick", "--out", str(out), env={"DEVICEOP_BACKEND": "cuda"}, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    check_document(doc)
    e = doc["benchmarks"]["startup"]
    assert e["status"] == "ok" and e["wall_s"] > 0 and e["raw"]["experiment"] == "startup"
    assert {m["name"] for m in e["metrics"]} >= {"import deviceop", "bare driver start"}
    assert "startup: import deviceop:" in r.stdout


def _bimodal_row(v: float) -> dict:
    return {"wu_per_ms": v, "seconds": 1.0, "cpu_us_per_wu": 10.0, "host_threads": 1}


DOCS = {
    "exec_modes.json": {
        "elements": 2048,
        "machine": {"device": "test"},
        "results": [
            {"impl": i, "mode": m, "n_ops": n, "us_per_op_median": 10.0 / n + 1}
            for i in ("deviceop", "raw_bindings")
            for m in ("sync_each", "chained", "graph")
            for n in (1, 10, 100)
        ],
    },
    "async_overlap.json": {
        "n_ops": 300,
        "gpu_ms": 1.0,
        "rows": [
            {"w_over_gpu": f, "sync_it_per_s": 100 / (1 + f), "async_it_per_s": 100 / max(1, f)} for f in (0, 1, 2)
        ],
    },
    "bimodal.json": {
        "items": 2000,
        "serial": _bimodal_row(30),
        "torch_serial": _bimodal_row(33),
        "rows": [
            {
                "streams": s,
                "threaded": _bimodal_row(30 + s),
                "async": _bimodal_row(29 + s),
                "torch_threaded": _bimodal_row(35),
            }
            for s in (1, 2, 4)
        ],
    },
    "bimodal_hostwork.json": {
        "streams": 16,
        "rows": [
            {
                "w_ms": w,
                "serial": _bimodal_row(5 / (1 + w)),
                "threaded": _bimodal_row(9 / (1 + w)),
                "async": _bimodal_row(9 / (1 + w)),
            }
            for w in (0, 1, 3)
        ],
    },
    "kernels.json": {
        "bandwidth": {
            "elements": 1 << 20,
            "dtype": "float16",
            "copy": {"GBps": 3000.0},
            "add": {"of_copy": 0.99},
            "torch_add": {"of_copy": 0.9},
        }
    },
    "service.json": {
        "config": {"layers": 2, "width": 64, "clients": 8},
        "summary": {
            "deviceop-batch": {"req_s": 900.0},
            "torch-batch": {"req_s": 700.0},
            "torch-blocking": {"req_s": 90},
        },
    },
    "speech.json": {
        "config": {"model": "wav2vec2"},
        "loops": [
            {
                "loop": n,
                "chunk_latency_ms_p50": 3.0 + i,
                "chunk_latency_ms_p99": 4.0 + i,
                "reaction_ms_p50": 0.5,
                "reaction_ms_p99": None,
            }
            for i, n in enumerate(("deviceop-graph", "torch-blocking"))
        ],
    },
}


def test_every_figure_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    from plots import PLOTS, plot_folder

    assert set(PLOTS) == set(DOCS)
    for name, doc in DOCS.items():
        (tmp_path / name).write_text(json.dumps(doc))
    pngs = plot_folder(str(tmp_path))
    assert len(pngs) == len(DOCS)
    for p in pngs:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_version_option():
    import deviceop

    r = subprocess.run(
        [sys.executable, "-m", "deviceop", "--version"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.strip() == f"deviceop {deviceop.__version__}"


def test_source_digest_names_the_measured_sources(tmp_path):
    """The digest follows the library's, the benchmarks' and the examples' sources and the build
    files, and nothing generated beside them."""
    from benchmarks._harness import source_digest

    for rel, text in (
        ("deviceop/_core/a.pyx", "x = 1\n"),
        ("benchmarks/b.py", "y = 2\n"),
        ("examples/e/run.py", "z = 3\n"),
        ("setup.py", "s = 4\n"),
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    d0 = source_digest(tmp_path)
    assert d0 == source_digest(tmp_path) and len(d0) == 64
    for generated in ("deviceop/_core/a.c", "deviceop/__pycache__/a.cpython-312.pyc", "benchmarks/out.json"):
        (tmp_path / generated).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / generated).write_text("generated")
    assert source_digest(tmp_path) == d0
    (tmp_path / "examples/e/run.py").write_text("z = 4\n")
    d1 = source_digest(tmp_path)
    assert d1 != d0
    (tmp_path / "examples/e/run.py").rename(tmp_path / "examples/e/main.py")  # a path is part of it
    assert source_digest(tmp_path) not in (d0, d1)


def test_the_source_option_prints_this_trees_digest():
    from benchmarks._harness import source_digest

    r = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--source"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.strip() == source_digest(), r.stderr


def test_the_source_digest_reads_every_tracked_source_and_nothing_generated():
    """Against git's list of this checkout's files: each tracked file of the measured folders is
    read unless it is documentation or data that no run executes, and no file read is one git
    ignores (the generated C++ of the compiled core, build outputs)."""
    from benchmarks._harness import ROOT as HROOT
    from benchmarks._harness import SOURCES, source_files

    where = [f for f in SOURCES if f != "."] + list(SOURCES["."])
    r = subprocess.run(["git", "ls-files", *where], cwd=HROOT, capture_output=True, text=True)
    if r.returncode != 0 or not r.stdout:
        pytest.skip("not a git checkout")
    tracked = set(r.stdout.split())
    read = {p.relative_to(HROOT).as_posix() for p in source_files()}
    assert {p for p in tracked if not p.endswith((".md", ".json", ".typed"))} - read == set()
    extra = sorted(read - tracked)
    if extra:
        ignored = subprocess.run(["git", "check-ignore", *extra], cwd=HROOT, capture_output=True, text=True)
        assert not ignored.stdout.split(), ignored.stdout


def test_the_queue_benchmark_counts_full_collections_and_their_pauses():
    # a run slower than its neighbours says whether the collector stopped its thread: the
    # pauses of every collection, and how many were full ones
    import gc

    from benchmarks.bimodal import GcPauses

    with GcPauses() as young:
        gc.collect(0)
        gc.collect(1)
    assert young.full == 0 and young.ms > 0
    with GcPauses() as full:
        gc.collect()
    assert full.full == 1 and full.ms > 0
    gc.collect()  # (after the context: no longer counted)
    assert full.full == 1 and GcPauses not in map(type, gc.callbacks)


def test_the_pipeline_benchmark_warms_up_until_each_variant_stops_recording():
    # 64 gathered requests' calls are many more keys than one request's: the warm-up waits for
    # the variant still recording, even while the others' replays dwarf its recordings, and
    # while it records less than 1% of its own replays (as a variant the credit paces does)
    from benchmarks.pipeline_cost import measure

    table = {"recorded": 0, "replays": 0}
    passes = {"gathered": 0}

    def one_at_a_time() -> None:
        table["replays"] += 10_000

    def gathered() -> None:
        passes["gathered"] += 1
        table["replays"] += 1000
        table["recorded"] += 5 if passes["gathered"] <= 5 else 0  # settles in its sixth pass

    fns = {"deviceop_awaited_one_at_a_time": one_at_a_time, "deviceop_gathered": gathered}
    for k in (
        "deviceop_tasks_one_at_a_time",
        "deviceop_sync_one_at_a_time",
        "torch_one_at_a_time",
        "torch_in_flight",
    ):
        fns[k] = one_at_a_time
    out = measure(fns, 3, 1, lambda: (table["recorded"], table["replays"]), warmup_s=60.0)
    assert out["warmup"]["passes"] == 6 and out["warmup"]["settled"] is True
    assert out["deviceop_gathered"]["gemm_recorded_per_round"] == 0
    # past warmup_s, the warm-up ends after that pass, and says it did not settle
    passes["gathered"] = -100
    out = measure(fns, 3, 1, lambda: (table["recorded"], table["replays"]), warmup_s=0.0)
    assert out["warmup"]["passes"] == 1 and out["warmup"]["settled"] is False
