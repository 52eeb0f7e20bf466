"""mkdocs hook: the benchmarks page, generated at build time from the curated baselines
(``benchmarks/baselines/<machine kind>.json``, each written by ``python -m benchmarks``).

The page opens with a summary table of every benchmark's headline figures per machine kind, then
each benchmark's details (its own tables, drawn from the script's document the baseline keeps
whole) and its plot. The page and the plots are generated files: nothing is written into
``docs/``. Older results are in git's history of the baseline files.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
BASELINES = ROOT / "benchmarks" / "baselines"


def _f(v: Any, nd: int = 2) -> str:
    return "–" if v is None else f"{v:,.{nd}f}"


def _signed(v: Any) -> str:
    """µs beside the reference, signed (an await may end before ``sync_on`` of the same op)."""
    return "–" if v is None else f"{v:+,.1f} µs"


def _pipeline(d: dict) -> str:
    names = [
        ("deviceop_sync_one_at_a_time", "sync, one at a time"),
        ("deviceop_awaited_one_at_a_time", "awaited, one at a time"),
        ("deviceop_tasks_one_at_a_time", "awaited, one at a time, a task each"),
        ("deviceop_gathered", f"{d.get('in_flight', 64)} gathered"),
        ("deviceop_submitted", f"{d.get('in_flight', 64)} submitted, then awaited"),
        ("torch_one_at_a_time", "PyTorch, one at a time"),
        ("torch_in_flight", f"PyTorch, {d.get('in_flight', 64)} in flight"),
    ]
    names = [(k, n) for k, n in names if any(k in r for r in d["results"])]  # (as the run measured)
    rows = ["| steps | " + " | ".join(n for _, n in names) + " |", "| --- |" + " --- |" * len(names)]
    for r in d["results"]:
        rows.append(f"| {r['steps']} | " + " | ".join(_f(r.get(k, {}).get("cpu_us"), 0) for k, _ in names) + " |")
    replayed = [
        f"{r['steps']} steps: "
        + ", ".join(
            f"{n} {_f(r[k]['gemm_replayed_per_request'], 1)}"
            for k, n in names
            if "gemm_replayed_per_request" in r.get(k, {})
        )
        + f" (of {2 * r['steps']})"
        for r in d["results"]
        if any("gemm_replayed_per_request" in r.get(k, {}) for k, _ in names)
    ]
    return (
        "Host CPU per request (µs, every thread of the process) of a request pipeline with fresh buffers, "
        "medians over rounds that run every variant in turn.\n\n"
        + "\n".join(rows)
        + (
            "\n\nGEMMs a request replays from recorded graphs (the others are direct cuBLASLt calls): "
            + "; ".join(replayed)
            + "."
            if replayed
            else ""
        )
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
    for r in (d.get("mlp") or {}).get("rows", []):
        rows.append(f"| {r['kind']} | {r['inflight']} | {_f(r['req_per_s'], 0)} | {_f(r['cpu_us_per_req'], 0)} |")
    return (
        f"An external step (`do.external` around `torch.add` of three tensors) costs +{_f(s['external_over_direct_us'], 1)} µs "
        f"of host CPU over calling PyTorch directly ({_f(s['direct_us'], 1)} µs); +{_f(s['adapter_over_direct_us'], 1)} µs "
        "through `do.interop.torch`."
        + (" A PyTorch MLP served from one event loop:\n\n" + "\n".join(rows) if len(rows) > 2 else "")
    )


def _service(d: dict) -> str:
    s = d["summary"]
    rows = [
        "| variant | req/s | p50 / p99 ms | loop lag p99 ms | CPU µs/req | at the open-loop rate: p50 / p99 ms, "
        "lag p99 ms, late / unanswered |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for impl in d["impls"]:
        r = s[impl]
        o = r.get("at_rate", {})
        at = (
            f"{_f(o.get('latency_ms_p50'), 1)} / {_f(o.get('latency_ms_p99'), 1)}, {_f(o.get('lag_ms_p99'), 1)}, "
            f"{o.get('late', '—')} / {o.get('unanswered', '—')}"
            if o
            else "—"
        )
        rows.append(
            f"| {impl} | {_f(r['req_s'], 0)} | {_f(r.get('latency_ms_p50'), 1)} / {_f(r.get('latency_ms_p99'), 1)} | "
            f"{_f(r.get('lag_ms_p99'), 1)} | {_f(r.get('server_cpu_us_per_req'), 0)} | {at} |"
        )
    c = d["config"]
    best = s.get("deviceop-batch", {}).get("vs_best_torch")
    head = (
        f"`examples/service`: {c['clients']} HTTP clients from {c['procs']} processes, requests of {c['rows']} "
        f"token ids answered by their embedding from a transformer encoder of {c['layers']} layers, width "
        f"{c['width']} (BERT-base: 12, 768); medians over {c['rounds']} round(s); "
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
    "bimodal": ("One-thread GEMM queue", _bimodal),
    "kernels": ("Kernels and GEMM", _kernels),
    "external_cost": ("Other libraries' work", _external),
    "service": ("Inference service (example)", _service),
    "gemm_queue": ("GEMM queue (example)", _gemm_queue),
}


def _summary(name: str, e: dict[str, Any]) -> list[str]:
    rows = []
    for m in e.get("metrics", []):
        unit = "×" if m["unit"] == "x" else " µs" if m["unit"] == "us" else f" {m['unit']}"
        spread = f" ({m['low']:.3g} to {m['high']:.3g})" if "low" in m and "high" in m else ""
        good = "higher is better" if m["better"] == "higher" else "lower is better"
        rows.append(f"| {name} | {m['name']} | {m['value']:.3g}{unit}{spread} | {m.get('vs') or '–'} | {good} |")
    return rows


def render(out_dir: Path) -> tuple[str, list[Path]]:
    """The page's markdown, and the plots drawn into ``out_dir`` (paths relative to it are linked)."""
    sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]
    try:
        from plots import PLOTS

        from benchmarks._suite import BENCHMARKS
    finally:
        del sys.path[:2]

    parts = [
        "# Benchmarks",
        "",
        "Generated from the curated baselines in `benchmarks/baselines/` when the docs are built. Each "
        "baseline is one run of `python -m benchmarks` on one kind of machine; every figure is measured as a "
        "user's program runs, against what a user would write instead, in the same run (medians; the spread "
        "over runs in brackets where the benchmark measured one). `python -m benchmarks --compare "
        "benchmarks/baselines/<kind>.json` compares a new run with it; `benchmarks/README.md` says how each "
        "is measured. Where deviceop is behind its reference, the table says so: a ratio above 1 where lower "
        "is better, or below 1 where higher is.",
        "",
    ]
    pngs: list[Path] = []
    for path in sorted(BASELINES.glob("*.json")):
        doc = json.loads(path.read_text())
        kind = path.stem
        m, env = doc["machine"], doc["environment"]
        parts += [
            f"## {kind}",
            "",
            f"{m.get('device', '?')} (driver {m.get('driver', '?')}), {m.get('cpu', '?')}, {m.get('cores', '?')} "
            f"cores; Python {env.get('python', '?')}, PyTorch {env.get('torch', '–')}; commit "
            f"`{doc['commit'][:9]}`{' (with local changes)' if doc.get('dirty') else ''}"
            + (f", sources `{doc['source'][:12]}`" if doc.get("source") else "")
            + f", {doc['created'][:10]}, "
            f"`{' '.join(doc['command'])}` ({doc['profile']} profile).",
            "",
            "| benchmark | figure | deviceop | against | |",
            "| --- | --- | --- | --- | --- |",
        ]
        for name, e in doc["benchmarks"].items():
            parts += _summary(name, e)
        left = [
            f"{n} ({e['status']}: {e.get('why', '')[:120]})"
            for n, e in doc["benchmarks"].items()
            if e["status"] != "ok"
        ]
        if left:
            parts += ["", "Not in this baseline: " + "; ".join(left) + "."]
        parts.append("")
        for name, e in doc["benchmarks"].items():
            if e["status"] != "ok" or "raw" not in e:
                continue
            stem = Path(BENCHMARKS[name].script).stem if name in BENCHMARKS else name
            stem = {"run": name.replace("-", "_"), "loadtest": "service"}.get(stem, stem)
            parts += [
                f"### {name}: {e.get('about', '')}",
                "",
                f"Against: {e.get('vs', '')}. Command: `{' '.join(e['command'])}`.",
                "",
            ]
            if stem in RENDER:
                try:
                    parts += [RENDER[stem][1](e["raw"]), ""]
                except (KeyError, TypeError, ValueError, ZeroDivisionError) as err:
                    parts += [f"(details not readable: {type(err).__name__} {err})", ""]
            if f"{stem}.json" in PLOTS:
                png = out_dir / kind / f"{stem}.png"
                png.parent.mkdir(parents=True, exist_ok=True)
                PLOTS[f"{stem}.json"](e["raw"], str(png))
                pngs.append(png)
                parts += [f"![{name}]({kind}/{stem}.png)", ""]
    if not pngs and not any(BASELINES.glob("*.json")):
        parts += ["No baseline yet: run `python -m benchmarks --out benchmarks/baselines/<kind>.json` on a GPU.", ""]
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
