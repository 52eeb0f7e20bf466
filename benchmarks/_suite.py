"""The maintained benchmarks: what each runs, with which arguments, against what; and the
README's figures table made from a result document."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

from ._harness import Benchmark

HERE = Path(__file__).resolve().parent
BASELINES = HERE / "baselines"


def _cuda_refs(work: Path) -> list[str]:
    """The CUDA C++ references of exec-modes (a program and an in-process graph library), built
    with nvcc where there is one; without them the C++ rows are left out."""
    if shutil.which("nvcc") is None:
        return []
    exe, lib = work / "chain", work / "libgraphref.so"
    ref = HERE / "ref"
    args: list[str] = []
    if (
        subprocess.run(
            ["nvcc", "-O3", "-arch=native", "-o", str(exe), str(ref / "chain.cu")], capture_output=True
        ).returncode
        == 0
    ):
        args += ["--chain-bin", str(exe)]
    r = subprocess.run(
        ["nvcc", "-O3", "-arch=native", "-shared", "-Xcompiler", "-fPIC", "-o", str(lib), str(ref / "graph_ref.cu")],
        capture_output=True,
    )
    if r.returncode == 0:
        args += ["--graph-lib", str(lib)]
    return args


#: the maintained benchmarks, in the order they run
BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in [
        Benchmark(
            "startup",
            "startup.py",
            "import deviceop, and the first op after a bare driver start",
            "a bare cuda.bindings start",
            full=("--runs", "7"),
            quick=("--runs", "3"),
            timeout_s=300,
        ),
        Benchmark(
            "exec-modes",
            "exec_modes.py",
            "one kernel to 1000: sync each, chained, awaited, graph replays",
            "raw cuda.bindings, CuPy, PyTorch, cuda.core, CUDA C++",
            full=("--reps", "100"),
            quick=("--reps", "30", "--sizes", "1,100,1000"),
            extra=_cuda_refs,
        ),
        Benchmark(
            "await",
            "await_cost.py",
            "await at every length under uvloop, asyncio and trio; CPU while awaiting",
            "sync_on of the same op",
            full=("--reps", "300"),
            quick=("--reps", "100"),
        ),
        Benchmark(
            "overlap",
            "async_overlap.py",
            "host work beside a 300-kernel pipeline replayed (paper Fig. 8a)",
            "the same loop synchronously",
            full=("--reps", "10"),
            quick=("--reps", "5", "--factors", "0,1,2"),
        ),
        Benchmark(
            "queue",
            "bimodal.py",
            "2000 mixed-size GEMMs from one thread (paper Fig. 8b)",
            "graph replays of the same GEMMs (the ceiling), serial, PyTorch thread per stream",
            full=("--reps", "3", "--gc", "--loop", "asyncio"),
            quick=("--reps", "3", "--gc", "--loop", "asyncio", "--streams", "1,4,16", "--no-torch"),
            needs=("cuda", "torch"),
        ),
        Benchmark(
            "queue-hostwork",
            "bimodal_hostwork.py",
            "the GEMM queue with host work per item",
            "ThreadedQueue (a thread per stream)",
            full=(),
            quick=("--reps", "1"),
        ),
        Benchmark(
            "kernels",
            "kernels.py",
            "built-in kernels' bandwidth and GEMM",
            "a device copy, torch.matmul",
            full=(),
            quick=("--elements", str(1 << 26), "--trials", "3"),
            needs=("cuda", "torch"),
        ),
        Benchmark(
            "pipeline",
            "pipeline_cost.py",
            "a request pipeline's host CPU, one at a time and 64 gathered",
            "PyTorch one at a time and 64 in flight",
            full=("--steps", "1,8,32"),
            quick=("--steps", "1,8"),
            needs=("cuda", "torch"),
        ),
        Benchmark(
            "external",
            "external_cost.py",
            "PyTorch work inside a pipeline (do.external, do.interop.torch)",
            "calling PyTorch directly",
            full=(),
            quick=("--steps-only", "--reps", "100"),
            needs=("cuda", "torch"),
        ),
        Benchmark(
            "ledger",
            "ledger.py",
            "the access ledger orders dependent work and overlaps independent work",
            "the same pipelines back to back",
            full=(),
            quick=("--reps", "10"),
        ),
        Benchmark(
            "gemm-queue",
            "../examples/gemm_queue/run.py",
            "the GEMM queue example as its README runs it",
            "the same GEMMs one at a time",
            full=(),
            quick=(),
        ),
        Benchmark(
            "speech",
            "../examples/asr_stream/run.py",
            "the speech loop example: chunk latency, interrupt reaction",
            "PyTorch loops: blocking, threaded, its own CUDA graph",
            full=("--rounds", "4"),
            # rounds interleave the loops (each round starts with the next one): the eager loops'
            # host-bound latency drifts with the machine's clocks over a loop's run. At twice real
            # time three rounds take what one took (a chunk's work is far shorter than its audio)
            quick=("--rounds", "3", "--speed", "2"),
            needs=("cuda", "torch"),
            timeout_s=1200,
        ),
        Benchmark(
            "service",
            "../examples/service/loadtest.py",
            "the HTTP service example under load from other processes",
            "PyTorch behind the same server: a micro-batcher (blocking, a thread, its own CUDA graphs), "
            "or unbatched (blocking, a thread, streams)",
            full=(),
            quick=("--seconds", "3", "--warmup", "1", "--rounds", "1"),
            needs=("cuda", "torch"),
            timeout_s=1800,
        ),
        Benchmark(
            "devices",
            "multi_device.py",
            "the GEMM queue over every GPU; copies between GPUs",
            "one GPU; PyTorch's copies",
            full=(),
            quick=("--reps", "1"),
            needs=("cuda", "gpus>=2"),
        ),
    ]
}


#: the figures the README shows (benchmark, the start of a metric's name), in this order; the
#: docs' benchmarks page shows every one
README_FIGURES = [
    ("exec-modes", "graph replay, 1000 kernels"),
    ("exec-modes", "chained sync, 1000 kernels"),
    ("await", "await over sync_on, worst of 1 kernel to 2 ms, uvloop"),
    ("await", "CPU while awaiting a 200 ms op, uvloop"),
    ("overlap", "async over sync"),
    ("queue", "one-thread queue, minimum of runs"),
    ("queue", "batch=1 over serial"),
    ("kernels", "GEMM 8192"),
    ("pipeline", "host CPU per request, awaited one at a time, 8 steps"),
    ("pipeline", "host CPU per request, 64 gathered, 8 steps"),
    ("external", "do.external step"),
    ("service", "requests/s, deviceop"),
    ("speech", "chunk latency p50, deviceop-graph"),
]


def readme_table(doc: dict[str, Any]) -> str:
    """The README's figures table from a result document: the figures of ``README_FIGURES``
    that it holds."""
    lines = ["| benchmark | figure | deviceop | against |", "| --- | --- | --- | --- |"]
    for bench, start in README_FIGURES:
        e = doc["benchmarks"].get(bench)
        if not e or e["status"] != "ok":
            continue
        for m in e["metrics"]:
            if not m["name"].startswith(start):
                continue
            spread = f" ({m['low']:.3g}–{m['high']:.3g})" if "low" in m and "high" in m else ""
            unit = "×" if m["unit"] == "x" else " µs" if m["unit"] == "us" else f" {m['unit']}"
            lines.append(f"| {bench} | {m['name']} | {m['value']:.3g}{unit}{spread} | {m.get('vs', '')} |")
            break
    return "\n".join(lines)
