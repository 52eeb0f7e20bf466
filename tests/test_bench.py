"""experiments/bench.py's guard rails and the experiments' figures (drawn from small documents)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))


def test_bench_refuses_without_a_gpu(tmp_path):
    env = dict(os.environ, DEVICEOP_BACKEND="host", PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "experiments", "bench.py"), "kernels", "--out", str(tmp_path / "b")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 2
    assert "needs a CUDA device" in r.stderr or "pip install" in r.stderr
    assert not (tmp_path / "b").exists(), "nothing is written when the bench cannot run"


def test_bench_rejects_unknown_names():
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "experiments", "bench.py"), "nope"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
        timeout=120,
    )
    assert r.returncode == 2 and "invalid choice" in r.stderr


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
