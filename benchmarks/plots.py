"""PNG figures (matplotlib, no display) from the benchmarks' JSON documents.

python benchmarks/plots.py RESULTS_DIR     # every figure whose JSON is in the folder
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _plt().close(fig)


def plot_exec_modes(doc: dict, path: str) -> None:
    """Paper Fig. 6: µs per op against N for each mode and implementation (log-log)."""
    plt = _plt()
    modes = [m for m in ("sync_each", "chained", "await_each", "graph") if any(r["mode"] == m for r in doc["results"])]
    fig, axes = plt.subplots(1, len(modes), figsize=(4 * len(modes), 3.6), sharey=True)
    everyone = sorted({r["impl"] for r in doc["results"]})
    color = {impl: f"C{i}" for i, impl in enumerate(everyone)}
    for ax, mode in zip(axes if len(modes) > 1 else [axes], modes):
        impls = sorted({r["impl"] for r in doc["results"] if r["mode"] == mode})
        for impl in impls:
            rs = sorted(
                (r for r in doc["results"] if r["mode"] == mode and r["impl"] == impl), key=lambda r: r["n_ops"]
            )
            ax.plot(
                [r["n_ops"] for r in rs],
                [r["us_per_op_median"] for r in rs],
                "o-" if impl == "deviceop" else ".--",
                label=impl,
                color=color[impl],
                linewidth=2.2 if impl == "deviceop" else 1,
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(mode)
        ax.set_xlabel("ops per run (N)")
        ax.grid(alpha=0.3, which="both")
    (axes[0] if len(modes) > 1 else axes).set_ylabel("µs per op (median)")
    handles = [plt.Line2D([], [], color=color[i], marker="o" if i == "deviceop" else ".", label=i) for i in everyone]
    (axes[-1] if len(modes) > 1 else axes).legend(handles=handles, fontsize=8)
    fig.suptitle(f"Execution modes: scale over {doc.get('elements', '?')} f16, {doc['machine'].get('device', '')}")
    _save(fig, path)


def plot_overlap(doc: dict, path: str) -> None:
    """Paper Fig. 8a: iterations per second against host work W / GPU time."""
    plt = _plt()
    rows = doc["rows"]
    fx = [r["w_over_gpu"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(fx, [r["sync_it_per_s"] for r in rows], "o-", label="sync (then host work)")
    ax.plot(fx, [r["async_it_per_s"] for r in rows], "s-", label="async (overlapped)")
    ax.set_xlabel("host work W / GPU time G")
    ax.set_ylabel("iterations per second")
    ax.set_title(f"Overlap: {doc['n_ops']} chained kernels, G = {doc['gpu_ms']:.1f} ms")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path)


def plot_bimodal(doc: dict, path: str) -> None:
    """Paper Fig. 8b: WU/ms against streams S for serial, threaded and async, with PyTorch."""
    plt = _plt()
    rows = doc["rows"]
    S = [r["streams"] for r in rows]
    fig, ax = plt.subplots(figsize=(8.6, 4.2))
    ax.plot(S, [r["async"]["wu_per_ms"] for r in rows], "o-", linewidth=2.2, label="deviceop async (1 thread)")
    ax.plot(S, [r["threaded"]["wu_per_ms"] for r in rows], "s-", label="deviceop threaded (S threads)")
    if "async_batch1" in rows[0]:
        ax.plot(
            S,
            [r["async_batch1"]["wu_per_ms"] for r in rows],
            "o:",
            color="C0",
            alpha=0.6,
            label="deviceop async, batch=1",
        )
        ax.plot(
            S,
            [r["threaded_batch1"]["wu_per_ms"] for r in rows],
            "s:",
            color="C1",
            alpha=0.6,
            label="deviceop threaded, batch=1",
        )
    ax.axhline(doc["serial"]["wu_per_ms"], color="C2", linestyle=":", label="deviceop serial")
    if "torch_serial" in doc:
        ax.plot(S, [r["torch_threaded"]["wu_per_ms"] for r in rows], "^--", color="C3", label="PyTorch threaded")
        ax.axhline(doc["torch_serial"]["wu_per_ms"], color="C3", linestyle=":", label="PyTorch serial")
    ax.set_xscale("log", base=2)
    ax.set_xticks(S, [str(s) for s in S])
    ax.set_xlabel("streams S")
    ax.set_ylabel("work units (GEMMs) per ms")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Bimodal queue: {doc['items']} f16 GEMMs, 80% 512³ / 20% 2048³")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    _save(fig, path)


def plot_hostwork(doc: dict, path: str) -> None:
    """Paper Fig. 8c: WU/ms against host think-time W at S = 16."""
    plt = _plt()
    rows = doc["rows"]
    W = [r["w_ms"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for key, style, label in (
        ("async", "o-", "async (1 thread)"),
        ("threaded", "s-", "threaded (S threads)"),
        ("serial", "^:", "serial"),
    ):
        ax.plot(W, [r[key]["wu_per_ms"] for r in rows], style, label=label)
    ax.set_xlabel("host work per item W (ms)")
    ax.set_ylabel("work units (GEMMs) per ms")
    ax.set_yscale("log")
    ax.set_title(f"Bimodal queue with host work, S = {doc['streams']}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    _save(fig, path)


def _bars(names: list[str], vals: list[float], ours: list[bool], xlabel: str, title: str, path: str, **kw: Any) -> None:
    """Horizontal bars, deviceop's (``ours``) in blue and the others in red; ``log``: a log
    scale; ``line``: a vertical rule at that value."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 0.4 * len(names) + 1.2))
    ax.barh(names, vals, color=["C0" if o else "C3" for o in ours])
    if kw.get("log"):
        ax.set_xscale("log")
    if "line" in kw:
        ax.axvline(kw["line"], color="k", linewidth=0.8)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.invert_yaxis()
    _save(fig, path)


def plot_kernels(doc: dict, path: str) -> None:
    """Bandwidth of the built-ins (and PyTorch) as a fraction of the device-to-device copy."""
    bw = doc["bandwidth"]
    names = [k for k, v in bw.items() if isinstance(v, dict) and "of_copy" in v]
    _bars(
        names,
        [bw[k]["of_copy"] * 100 for k in names],
        [not n.startswith("torch") for n in names],
        f"% of copy bandwidth ({bw['copy']['GBps']:.0f} GB/s)",
        f"Built-in kernels, {bw['elements']} {bw['dtype']} elements",
        path,
        line=100,
    )


def plot_service(doc: dict, path: str) -> None:
    """The service example: saturated requests/s per variant (log scale), deviceop's in blue."""
    s, c = doc["summary"], doc["config"]
    names = sorted(s, key=lambda k: s[k]["req_s"], reverse=True)
    _bars(
        names,
        [s[k]["req_s"] for k in names],
        [k.startswith("deviceop") for k in names],
        "requests/s, closed loop (median of rounds)",
        f"HTTP embedding service, {c['layers']} layers x {c['width']}, {c['clients']} clients",
        path,
        log=True,
    )


def plot_speech(doc: dict, path: str) -> None:
    """The speech loop example: chunk latency p50 and p99, and interrupt reaction p99, per loop."""
    plt = _plt()
    loops = doc["loops"]
    names = [r["loop"] for r in loops]
    y = range(len(names))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 0.45 * len(names) + 1.4), sharey=True)
    for ax, keys, title in (
        (a1, ("chunk_latency_ms_p50", "chunk_latency_ms_p99"), "chunk latency (ms)"),
        (a2, ("reaction_ms_p50", "reaction_ms_p99"), "interrupt reaction (ms)"),
    ):
        for j, k in enumerate(keys):
            ax.barh(
                [i + 0.4 * j - 0.2 for i in y],
                [r.get(k) or 0.0 for r in loops],
                height=0.4,
                color=["C0" if n.startswith("deviceop") else "C3" for n in names],
                alpha=1.0 if j == 0 else 0.5,
                label=k.rsplit("_", 1)[1],
            )
        ax.set_xlabel(title)
        ax.legend(loc="lower right")
    a1.set_yticks(list(y), names)
    a1.invert_yaxis()
    fig.suptitle(f"Speech loop, --model {doc['config'].get('model', 'residual')}: p50 (solid), p99 (light)")
    _save(fig, path)


PLOTS = {
    "exec_modes.json": plot_exec_modes,
    "async_overlap.json": plot_overlap,
    "bimodal.json": plot_bimodal,
    "bimodal_hostwork.json": plot_hostwork,
    "kernels.json": plot_kernels,
    "service.json": plot_service,
    "speech.json": plot_speech,
}


def plot_folder(folder: str) -> list[str]:
    """Draw every figure whose JSON is in ``folder``; return the PNG paths."""
    out = []
    for name, fn in PLOTS.items():
        src = os.path.join(folder, name)
        if os.path.exists(src):
            with open(src) as f:
                doc = json.load(f)
            dst = src[: -len(".json")] + ".png"
            fn(doc, dst)
            out.append(dst)
    return out


if __name__ == "__main__":
    for p in plot_folder(sys.argv[1] if len(sys.argv) > 1 else "."):
        print(p)
