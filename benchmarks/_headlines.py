"""Each benchmark's headline figures, read from the document its script writes.

A function per benchmark takes the script's JSON document and returns its :class:`Metric` list;
every figure is one the script measured against its reference in the same run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._harness import Metric


def _spread(mm: Any) -> dict[str, float]:
    return {"low": float(mm[0]), "high": float(mm[1])} if mm else {}


def exec_modes(d: dict[str, Any]) -> list[Metric]:
    out = []
    for r in d.get("paired_chained", []):
        out.append(
            Metric(
                f"chained sync, {r['n_ops']} kernels",
                r["deviceop_over_raw_median_of_ratios"],
                "x",
                "lower",
                "raw cuda.bindings launches",
            )
        )
    for r in d.get("paired_graph", []):
        v = r.get("deviceop_over_cuda_cpp_in_process")
        if v is not None:
            out.append(Metric(f"graph replay, {r['n_ops']} kernels", v, "x", "lower", "CUDA C++ replay"))
    return out


def await_cost(d: dict[str, Any]) -> list[Metric]:
    out = []
    for loop in dict.fromkeys(r["loop"] for r in d["lengths"]):
        rows = [r for r in d["lengths"] if r["loop"] == loop]
        short = [r["await_minus_sync_us"] for r in rows if r["op"] != "20ms"]
        if short:
            out.append(
                Metric(
                    f"await over sync_on, worst of 1 kernel to 2 ms, {loop}",
                    max(short),
                    "us",
                    "lower",
                    "sync_on of the same op",
                )
            )
    for r in d.get("cpu_200ms", []):
        out.append(
            Metric(
                f"CPU while awaiting a 200 ms op, {r['loop']}",
                100 * r["cpu_fraction_median"],
                "%",
                "lower",
                "one core",
                high=100 * r["cpu_fraction_max"],
            )
        )
    return out


def async_overlap(d: dict[str, Any]) -> list[Metric]:
    out = [
        Metric(
            "async over sync, host work = GPU time",
            d["async_over_sync_at_w_eq_gpu"],
            "x",
            "higher",
            "the same loop synchronously",
        )
    ]
    if "bound_at_w_eq_gpu" in d:
        out.append(Metric("its bound (the enqueue's share)", d["bound_at_w_eq_gpu"], "x", "higher", ""))
    return out


def bimodal(d: dict[str, Any]) -> list[Metric]:
    b, b1 = d["async_best"], d["async_batch1_best"]
    best = next(r for r in d["rows"] if r["streams"] == b["streams"])
    runs = [100 * v / d["ceiling_best_wu_per_ms"] for v in best["async"].get("runs") or [b["min_wu_per_ms"]]]
    out = [
        Metric(
            "one-thread queue, minimum of runs, of the ceiling (best S)",
            100 * b["min_over_ceiling"],
            "%",
            "higher",
            "graph replays of the same GEMMs",
            low=min(runs),
            high=max(runs),
        ),
        Metric("one-thread queue over serial", b["over_serial"], "x", "higher", "deviceop serial (sync per GEMM)"),
    ]
    if "over_serial_paired" in b1:
        out.append(
            Metric(
                "batch=1 over serial, paired runs (best S)",
                b1["over_serial_paired"],
                "x",
                "higher",
                "deviceop serial, run just before",
                **_spread(b1.get("over_serial_paired_min_max")),
            )
        )
    else:
        out.append(Metric("batch=1 over serial", b1["over_serial"], "x", "higher", "deviceop serial"))
    if "torch_threaded_best_wu_per_ms" in d:
        out.append(
            Metric(
                "one-thread queue over PyTorch thread per stream",
                b["wu_per_ms"] / d["torch_threaded_best_wu_per_ms"],
                "x",
                "higher",
                "PyTorch, a thread per stream, best S",
            )
        )
    return out


def bimodal_hostwork(d: dict[str, Any]) -> list[Metric]:
    v = sorted(r["async_over_threaded"] for r in d["rows"])
    return [
        Metric(
            "one-thread queue over threads with host work, worst over work sizes",
            v[0],
            "x",
            "higher",
            "ThreadedQueue (a thread per stream)",
        )
    ]


def kernels(d: dict[str, Any]) -> list[Metric]:
    out = []
    for k, v in d["bandwidth"].items():
        if isinstance(v, dict) and "of_copy" in v and not k.startswith("torch"):
            out.append(Metric(f"{k} bandwidth", 100 * v["of_copy"], "%", "higher", "a device copy"))
    for n, v in (d.get("gemm") or {}).items():
        if isinstance(v, dict) and "of_torch" in v:
            out.append(Metric(f"GEMM {n}^3 f16", 100 * v["of_torch"], "%", "higher", "torch.matmul (GPU time)"))
    return out


def pipeline_cost(d: dict[str, Any]) -> list[Metric]:
    out = []
    for r in d["results"]:
        s = r["steps"]
        if "awaited_cpu_over_torch_one_at_a_time" in r:
            out.append(
                Metric(
                    f"host CPU per request, awaited one at a time, {s} steps",
                    r["awaited_cpu_over_torch_one_at_a_time"],
                    "x",
                    "lower",
                    "PyTorch, one at a time",
                    **_spread(r.get("awaited_cpu_over_torch_one_at_a_time_min_max")),
                )
            )
        out.append(
            Metric(
                f"host CPU per request, 64 gathered, {s} steps",
                r["gathered_cpu_over_torch_in_flight"],
                "x",
                "lower",
                "PyTorch, 64 in flight",
                **_spread(r.get("gathered_cpu_over_torch_in_flight_min_max")),
            )
        )
        out.append(
            Metric(
                f"64 gathered over one at a time, {s} steps",
                r["gathered_cpu_over_deviceop_awaited_one_at_a_time"],
                "x",
                "lower",
                "deviceop awaited one at a time",
                **_spread(r.get("gathered_cpu_over_deviceop_awaited_one_at_a_time_min_max")),
            )
        )
        if "gathered_cpu_over_deviceop_tasks_one_at_a_time" in r:
            out.append(
                Metric(
                    f"64 gathered over one at a time as tasks, {s} steps",
                    r["gathered_cpu_over_deviceop_tasks_one_at_a_time"],
                    "x",
                    "lower",
                    "deviceop awaited one at a time, a task each",
                    **_spread(r.get("gathered_cpu_over_deviceop_tasks_one_at_a_time_min_max")),
                )
            )
        if "submitted_cpu_over_deviceop_awaited_one_at_a_time" in r:
            out.append(
                Metric(
                    f"64 submitted then awaited over one at a time, {s} steps",
                    r["submitted_cpu_over_deviceop_awaited_one_at_a_time"],
                    "x",
                    "lower",
                    "deviceop awaited one at a time",
                    **_spread(r.get("submitted_cpu_over_deviceop_awaited_one_at_a_time_min_max")),
                )
            )
    return out


def external_cost(d: dict[str, Any]) -> list[Metric]:
    s = d["steps"]
    out = [
        Metric(
            "do.external step, host CPU beyond the call",
            s["external_us"] - s["direct_us"],
            "us",
            "lower",
            "calling PyTorch directly",
        ),
        Metric(
            "do.interop.torch call, host CPU beyond the call",
            s["adapter_us"] - s["direct_us"],
            "us",
            "lower",
            "calling PyTorch directly",
        ),
    ]
    rows = (d.get("mlp") or {}).get("rows") or []
    best_torch = max((r["req_per_s"] for r in rows if str(r["kind"]).startswith("torch")), default=None)
    for r in rows:
        if best_torch and not str(r["kind"]).startswith("torch"):
            out.append(
                Metric(
                    f"PyTorch MLP served, {r['kind']}, {r['inflight']} in flight",
                    r["req_per_s"] / best_torch,
                    "x",
                    "higher",
                    "the best PyTorch variant",
                )
            )
    return out


def startup(d: dict[str, Any]) -> list[Metric]:
    first = d["first_all"]  # (bare driver start, import and first op) per run, ms
    return [
        Metric.of_runs("import deviceop", d["import_ms_all"], "ms", "lower"),
        Metric.of_runs(
            "import and first op on a started driver", [f[1] for f in first], "ms", "lower", "a bare driver start"
        ),
        Metric.of_runs("bare driver start", [f[0] for f in first], "ms", "lower"),
    ]


def ledger(d: dict[str, Any]) -> list[Metric]:
    return [
        Metric(
            "independent pipelines on two streams",
            d["independent_over_back_to_back"],
            "x",
            "lower",
            "the same back to back on one stream (0.5: full overlap)",
        ),
        Metric(
            "dependent pipelines on two streams",
            d["dependent_over_back_to_back"],
            "x",
            "higher",  # (1.0: ordered one after the other, as dependent work must be; below: overlapped)
            "back to back (1.0: ordered by the ledger)",
        ),
    ]


def multi_device(d: dict[str, Any]) -> list[Metric]:
    q = d["queue"]
    out = [Metric("GEMM queue over every GPU", q["ratio"], "x", "higher", "the same queue on one GPU")]
    for r in d.get("copy", []):
        if "ratio" in r:
            out.append(
                Metric(f"copy between GPUs, {r['mib']:g} MiB", r["ratio"], "x", "higher", "PyTorch's copy (GB/s)")
            )
    return out


def gemm_queue(d: dict[str, Any]) -> list[Metric]:
    return [Metric("one-thread queue over one GEMM at a time", d["speedup"], "x", "higher", "one at a time, best")]


def speech(d: dict[str, Any]) -> list[Metric]:
    loops = {s["loop"]: s for s in d["loops"]}
    torch_p50 = [
        s["chunk_latency_ms_p50"] for n, s in loops.items() if n.startswith("torch") and s["chunk_latency_ms_p50"]
    ]
    out = []
    for n, s in loops.items():
        if n.startswith("torch"):
            continue
        if torch_p50 and s["chunk_latency_ms_p50"]:
            out.append(
                Metric(
                    f"chunk latency p50, {n} loop",
                    s["chunk_latency_ms_p50"] / min(torch_p50),
                    "x",
                    "lower",
                    "the best PyTorch loop",
                )
            )
        blocking = loops.get("torch-blocking", {}).get("chunk_latency_ms_p50")
        if n == "deviceop-torch" and blocking and s["chunk_latency_ms_p50"]:
            # the eager path against PyTorch called the same way (eagerly, blocking)
            out.append(
                Metric(
                    f"chunk latency p50, {n} loop, over blocking",
                    s["chunk_latency_ms_p50"] / blocking,
                    "x",
                    "lower",
                    "the blocking PyTorch loop",
                )
            )
        if s.get("reaction_ms_p99") is not None:
            out.append(Metric(f"interrupt reaction p99, {n} loop", s["reaction_ms_p99"], "ms", "lower", ""))
    return out


def service(d: dict[str, Any]) -> list[Metric]:
    out = []
    for impl, s in d["summary"].items():
        v = s.get("vs_best_torch")
        if v:
            rounds = v.get("rounds") or []  # (the ratio within each round; older documents have none)
            out.append(
                Metric(
                    f"requests/s, {impl}",
                    v["ratio"],
                    "x",
                    "higher",
                    f"the best PyTorch variant ({v['impl']})",
                    **_spread([min(rounds), max(rounds)] if len(rounds) > 1 else None),
                )
            )
        if impl.startswith("deviceop") and s.get("lag_ms_p99") is not None:
            out.append(Metric(f"loop lag p99 at saturation, {impl}", s["lag_ms_p99"], "ms", "lower", ""))
        r = s.get("at_rate")
        # a server whose loop was blocked through every open-loop window ran no heartbeat: it
        # has no lag figure there (the load test leaves it out; older documents hold a 0)
        beat = any(x["server"].get("heartbeats", 1) > 0 for x in d.get("at_rate", []) if x["impl"] == impl)
        if impl.startswith("deviceop") and r and r.get("lag_ms_p99") is not None and beat:
            # (the name stays the same from run to run, so that --compare matches it; the rate,
            # 80 % of the best PyTorch variant's saturated throughput, is what it is against)
            rate = d.get("rate")
            out.append(
                Metric(
                    f"loop lag p99 at the open-loop rate, {impl}",
                    r["lag_ms_p99"],
                    "ms",
                    "lower",
                    f"{rate:.0f} requests/s offered" if rate else "",
                )
            )
    return out


HEADLINES: dict[str, Callable[[dict[str, Any]], list[Metric]]] = {
    "exec-modes": exec_modes,
    "await": await_cost,
    "overlap": async_overlap,
    "queue": bimodal,
    "queue-hostwork": bimodal_hostwork,
    "kernels": kernels,
    "pipeline": pipeline_cost,
    "external": external_cost,
    "startup": startup,
    "ledger": ledger,
    "gemm-queue": gemm_queue,
    "speech": speech,
    "service": service,
    "devices": multi_device,
}
