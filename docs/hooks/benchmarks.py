"""mkdocs hook: the benchmarks page, generated from ``experiments/results`` at build time.

For every results folder named ``<machine>-<YYYY-MM-DD>`` (newest date first) it takes each
experiment's newest JSON (by the commit that last touched it, else the file's time), renders its
headline figures as tables and draws its plot with ``experiments/plots.py``. The page and the
plots are generated files: nothing is written into ``docs/``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "experiments" / "results"
FOLDER = re.compile(r"^(?P<machine>[a-z0-9]+(?:-[a-z0-9]+)*)-(?P<date>\d{4}-\d{2}-\d{2})$")
STEM = re.compile(r"^(?P<stem>[a-z_]+?)(?:_(?P<commit>[0-9a-f]{7}))?\.json$")


def _commit_times(folder: Path) -> dict[str, int]:
    """File name -> time of the newest commit that touched it (empty outside a git checkout)."""
    try:
        out = subprocess.run(
            ["git", "log", "--format=@%ct", "--name-only", "--", str(folder)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    times: dict[str, int] = {}
    t = 0
    for line in out.splitlines():
        if line.startswith("@"):
            t = int(line[1:])
        elif line.strip():
            times.setdefault(Path(line).name, t)
    return times


def latest(folder: Path) -> dict[str, tuple[Path, str | None]]:
    """Experiment stem -> (its newest JSON, the commit its name gives)."""
    times = _commit_times(folder)
    best: dict[str, tuple[float, Path, str | None]] = {}
    for p in folder.glob("*.json"):
        m = STEM.match(p.name)
        if not m:
            continue
        key = (times.get(p.name, 0), p.stat().st_mtime)
        t = key[0] * 1e10 + key[1]
        if m["stem"] not in best or t > best[m["stem"]][0]:
            best[m["stem"]] = (t, p, m["commit"])
    return {s: (p, c) for s, (_, p, c) in best.items()}


def _f(v: Any, nd: int = 2) -> str:
    return "–" if v is None else f"{v:,.{nd}f}"


def _signed(v: Any) -> str:
    """µs beside the reference, signed (an await may end before ``sync_on`` of the same op)."""
    return "–" if v is None else f"{v:+,.1f} µs"


def _pipeline(d: dict) -> str:
    rows = ["| steps | one at a time: deviceop / PyTorch host CPU | 64 in flight |", "| --- | --- | --- |"]
    for r in d["results"]:
        a, b = r["one_at_a_time"], r["in_flight"]
        rows.append(
            f"| {r['steps']} | {_f(a['cpu_ratio_median_of_rounds'])}× | {_f(b['cpu_ratio_median_of_rounds'])}× |"
        )
    return (
        "Host CPU per request of a request pipeline with fresh buffers, beside PyTorch (median of round ratios).\n\n"
        + "\n".join(rows)
    )


def _exec_modes(d: dict) -> str:
    rows = [
        "| N kernels | chained sync / raw cuda.bindings | graph replay / CUDA C++ (in process) |",
        "| --- | --- | --- |",
    ]
    graph = {r["n_ops"]: r for r in d.get("paired_graph", [])}
    for r in d.get("paired_chained", []):
        g = graph.get(r["n_ops"], {})
        rows.append(
            f"| {r['n_ops']} | {_f(r['deviceop_over_raw_median_of_ratios'], 3)}× | {_f(g.get('deviceop_over_cuda_cpp_in_process'), 3)}× |"
        )
    return "Paired runs (alternated rep by rep), medians of per-rep ratios.\n\n" + "\n".join(rows)


def _await_cost(d: dict) -> str:
    ops = list(dict.fromkeys(r["op"] for r in d["lengths"]))
    rows = ["| loop | " + " | ".join(ops) + " |", "| --- |" + " --- |" * len(ops)]
    for loop in dict.fromkeys(r["loop"] for r in d["lengths"]):
        cells = {r["op"]: r["await_minus_sync_us"] for r in d["lengths"] if r["loop"] == loop}
        rows.append(f"| {loop} | " + " | ".join(_signed(cells.get(o)) for o in ops) + " |")
    return "`await` minus `sync_on` of the same op, paired medians, by the op's GPU time.\n\n" + "\n".join(rows)


def _overlap(d: dict) -> str:
    how = "recorded once and replayed" if d.get("replayed_graph") else "chained"
    out = (
        f"Throughput of async over sync with host work equal to the GPU work: "
        f"**{_f(d['async_over_sync_at_w_eq_gpu'])}×** ({d['n_ops']} kernels per iteration, {how})."
    )
    if "bound_at_w_eq_gpu" in d:  # the host enqueues before its work starts: the launches bound it
        out += (
            f" Enqueuing them takes {_f(d['enqueue_ms'])} ms of host time against {_f(d['gpu_ms'])} ms on the GPU, "
            f"which bounds the ratio at {_f(d['bound_at_w_eq_gpu'])}×."
        )
    return out


def _bimodal(d: dict) -> str:
    ceil = d["ceiling_best_wu_per_ms"]
    bw = d["async_best"]["wu_per_ms"]
    b1w = d["async_batch1_best"]["wu_per_ms"]
    serw = d["serial"]["wu_per_ms"]
    out = (
        f"{d['items']} GEMMs ({d['mix']}) from one host thread. GPU ceiling (graphs replayed) {_f(ceil, 1)} WU/ms; "
        f"one-thread async queue best {_f(bw, 1)} WU/ms ({_f(100 * bw / ceil, 1)} % of it, the minimum of its runs "
        f"{_f(100 * d['async_best']['min_over_ceiling'], 1)} %); "
        f"`batch=1` {_f(b1w, 1)} WU/ms; serial {_f(serw, 1)} WU/ms."
    )
    probes = [p for r in d["rows"] for p in r["async"].get("host_probe_us") or [] if p]
    if probes:  # the queue is bound by the host thread, and a virtual machine's host speed moves
        out += (
            f" The host's speed before each async run (a fixed piece of Python) ranged over "
            f"{_f(min(probes), 0)} to {_f(max(probes), 0)} µs, and the queue's throughput follows it."
        )
    return out


def _kernels(d: dict) -> str:
    bw = d["bandwidth"]
    rows = ["| kernel | GB/s | of a device copy |", "| --- | --- | --- |"]
    for k, v in bw.items():
        if isinstance(v, dict) and "GBps" in v:
            rows.append(f"| {k} | {_f(v['GBps'], 0)} | {_f(100 * v.get('of_copy', 1.0), 1)} % |")
    g = d.get("gemm") or {}
    grows = [
        f"| {n}³ | {_f(100 * v['of_torch'], 1)} % |" for n, v in g.items() if isinstance(v, dict) and "of_torch" in v
    ]
    out = "\n".join(rows)
    if grows:
        out += "\n\n| GEMM f16 | of torch.matmul (GPU time) |\n| --- | --- |\n" + "\n".join(grows)
    return out


def _external(d: dict) -> str:
    s = d["steps"]
    rows = ["| served | in flight | req/s | host CPU µs/req |", "| --- | --- | --- | --- |"]
    for r in d["mlp"]["rows"]:
        rows.append(f"| {r['kind']} | {r['inflight']} | {_f(r['req_per_s'], 0)} | {_f(r['cpu_us_per_req'], 0)} |")
    return (
        f"An external step (`do.external` around `torch.add` of three tensors) costs +{_f(s['external_over_direct_us'], 1)} µs "
        f"of host CPU over calling PyTorch directly ({_f(s['direct_us'], 1)} µs); +{_f(s['adapter_over_direct_us'], 1)} µs "
        "through `do.interop.torch`. A PyTorch MLP served from one event loop:\n\n" + "\n".join(rows)
    )


def _soak(d: dict) -> str:
    c = d["counts"]
    ok = ", ".join(f"{k} {v:,}" for k, v in c.items())
    base = ", ".join(k for k, v in d["back_to_baseline"].items() if v)
    return (
        f"{d['seconds'] / 60:.0f} minutes on the {d['backend']} backend, one process: {ok}. "
        f"Errors {d['n_errors']}, hangs {len(d['hangs'])}; back to baseline: {base}; resident memory +{_f(d['rss_growth_mib'], 1)} MiB."
    )


def _service(d: dict) -> str:
    s = d["summary"]
    rows = [
        "| variant | req/s | p50 / p99 ms | loop lag p99 ms | CPU µs/req | at the open-loop rate: p50 / p99 ms, lag p99 ms |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for impl in d["impls"]:
        r = s[impl]
        o = r.get("at_rate", {})
        at = (
            f"{_f(o.get('latency_ms_p50'), 1)} / {_f(o.get('latency_ms_p99'), 1)}, {_f(o.get('lag_ms_p99'), 1)}"
            if o
            else "—"
        )
        rows.append(
            f"| {impl} | {_f(r['req_s'], 0)} | {_f(r['latency_ms_p50'], 1)} / {_f(r['latency_ms_p99'], 1)} | "
            f"{_f(r['lag_ms_p99'], 1)} | {_f(r['server_cpu_us_per_req'], 0)} | {at} |"
        )
    c = d["config"]
    best = s.get("deviceop-batch", {}).get("vs_best_torch")
    head = (
        f"`examples/service`: {c['clients']} HTTP clients from {c['procs']} processes, ({c['rows']}, {c['width']}) "
        f"float16 requests through {c['steps']} blocks of (gemm, gelu, gemm); medians over {c['rounds']} rounds; "
        f"open loop at {_f(d.get('rate'), 0)} req/s."
    )
    if best:
        head += f" deviceop-batch serves {_f(best['ratio'])}x the best PyTorch variant ({best['impl']})."
    return head + "\n\n" + "\n".join(rows)


def _gemm_queue(d: dict) -> str:
    q = max(d["queue"], key=lambda r: r["gemms_per_ms"])
    p = max(d["one_at_a_time"], key=lambda r: r["gemms_per_ms"])
    c = d["config"]
    return (
        f"`examples/gemm_queue`: {c['items']} GEMMs ({c['small']}³, every {c['large_every']}th {c['large']}³), fresh "
        f"outputs: the one-thread queue {_f(q['gemms_per_ms'])} GEMMs/ms ({_f(q['tflops'], 1)} TFLOP/s), one at a time "
        f"{_f(p['gemms_per_ms'])} GEMMs/ms: {_f(d['speedup'])}x."
    )


RENDER = {
    "pipeline_cost": ("Request pipeline", _pipeline),
    "exec_modes": ("Execution modes", _exec_modes),
    "await_cost": ("Await", _await_cost),
    "async_overlap": ("Overlap", _overlap),
    "async_overlap_graph": ("Overlap, the pipeline recorded and replayed", _overlap),
    "async_overlap_chain": ("Overlap, the pipeline built and enqueued each iteration", _overlap),
    "bimodal": ("One-thread GEMM queue", _bimodal),
    "kernels": ("Kernels and GEMM", _kernels),
    "external_cost": ("Other libraries' work", _external),
    "soak": ("Soak", _soak),
    "service": ("Inference service (example)", _service),
    "gemm_queue": ("GEMM queue (example)", _gemm_queue),
}


def render(out_dir: Path) -> tuple[str, list[Path]]:
    """The page's markdown, and the plots drawn into ``out_dir`` (paths relative to it are linked)."""
    sys.path.insert(0, str(ROOT / "experiments"))
    from plots import PLOTS

    folders = [p for p in RESULTS.iterdir() if p.is_dir() and FOLDER.match(p.name)]
    folders.sort(key=lambda p: (FOLDER.match(p.name)["date"], p.name), reverse=True)
    parts = [
        "# Benchmarks",
        "",
        "Generated from `experiments/results/` when the docs are built: for each machine and date, each "
        "experiment's newest result. Every figure is measured as a user's program runs, against a reference in "
        "the same process; the folders' README files give the commands and earlier runs. Where deviceop is "
        "behind its reference, the tables say so.",
        "",
    ]
    pngs: list[Path] = []
    for folder in folders:
        parts += [f"## {folder.name}", ""]
        for stem, (path, commit) in sorted(
            latest(folder).items(), key=lambda kv: list(RENDER).index(kv[0]) if kv[0] in RENDER else 99
        ):
            if stem not in RENDER:
                continue
            title, fn = RENDER[stem]
            try:
                doc = json.loads(path.read_text())
                body = fn(doc)
            except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
                body = f"(this result's format is not one this page reads: {type(e).__name__} {e})"
            src = f"`experiments/results/{folder.name}/{path.name}`" + (f", commit {commit}" if commit else "")
            parts += [f"### {title}", "", body, "", f"Source: {src}.", ""]
            if f"{stem}.json" in PLOTS:
                png = out_dir / folder.name / f"{stem}.png"
                png.parent.mkdir(parents=True, exist_ok=True)
                PLOTS[f"{stem}.json"](doc, str(png))
                pngs.append(png)
                parts += [f"![{title}]({folder.name}/{stem}.png)", ""]
    return "\n".join(parts), pngs


_TMP: tempfile.TemporaryDirectory | None = None


def on_files(files: Files, config: Any) -> Files:
    global _TMP
    import matplotlib

    matplotlib.use("Agg")
    _TMP = tempfile.TemporaryDirectory()
    out = Path(_TMP.name)
    md, pngs = render(out)
    files.append(File.generated(config, "benchmarks/index.md", content=md))
    for p in pngs:
        files.append(File.generated(config, f"benchmarks/{p.relative_to(out).as_posix()}", content=p.read_bytes()))
    return files


def on_post_build(config: Any) -> None:
    if _TMP is not None:
        _TMP.cleanup()


if __name__ == "__main__":  # print the page (no plots kept)
    with tempfile.TemporaryDirectory() as d:
        print(render(Path(d))[0])
    os.sys.exit(0)
