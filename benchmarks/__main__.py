"""``python -m benchmarks``: run deviceop's maintained benchmarks, each against what a user would
write instead, in the same run; write one result document; compare it with another.

    python -m benchmarks --list
    python -m benchmarks                      # every benchmark this machine can run (full profile)
    python -m benchmarks await queue --quick  # a subset, fewer repeats
    python -m benchmarks --out run.json --compare benchmarks/baselines/nvidia-h200.json
    python -m benchmarks --compare A.json B.json   # compare two documents, run nothing
    python -m benchmarks --readme benchmarks/baselines/nvidia-h200.json  # README's figures table

Each benchmark runs in a fresh interpreter (one's start-up or failure cannot skew another), under
one timer for wall and CPU time; its script's document is kept whole in the result (``raw``)
beside the headline figures read from it. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ._harness import (
    ROOT,
    Benchmark,
    Timer,
    check_document,
    compare,
    description,
    format_comparison,
    kind_of,
    load,
    new_document,
    source_digest,
)
from ._headlines import HEADLINES
from ._suite import BENCHMARKS, HERE, readme_table


def _missing(b: Benchmark, machine: dict[str, Any]) -> str | None:
    """Why ``b`` cannot run on this machine, or None."""
    for need in b.needs:
        if need == "cuda" and machine.get("backend") != "cuda":
            return f"needs a CUDA device (this machine's backend: {machine.get('backend')})"
        if need == "gpus>=2" and (machine.get("devices") or 0) < 2:
            return "needs two GPUs or more"
        if need == "torch" and importlib.util.find_spec("torch") is None:
            return "needs PyTorch (its reference)"
    return None


def headlines(name: str, raw: dict[str, Any]) -> list[dict[str, Any]]:
    """Benchmark ``name``'s headline figures from its script's document (ValueError where it
    has none this runner reads)."""
    try:
        metrics = [m.as_dict() for m in HEADLINES[name](raw)]
    except (KeyError, TypeError, ValueError, ZeroDivisionError, IndexError, StopIteration) as e:
        raise ValueError(f"its document has no headline figure this runner reads: {e!r}") from None
    if not metrics:
        raise ValueError("its document gave no headline figure")
    return metrics


def run_one(b: Benchmark, quick: bool, work: Path, log: Path) -> dict[str, Any]:
    """Run benchmark ``b`` in a fresh interpreter (a process group of its own, so that a time-out
    ends whatever it started too); its entry of the result document. Its output goes to ``log``."""
    out = work / f"{b.name}.json"
    cmd = [sys.executable, str(HERE / b.script), "--out", str(out), *(b.quick if quick else b.full)]
    if b.extra is not None:
        cmd += b.extra(work)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    # the command as a reader would type it: the repository's paths relative, the scratch output left out
    shown = [Path(cmd[0]).name, *(os.path.relpath(c, ROOT) if c.startswith(str(ROOT)) else c for c in cmd[1:])]
    del shown[2:4]  # ("--out", the scratch file)
    entry: dict[str, Any] = {"about": b.about, "vs": b.vs, "command": shown}
    timed_out = False
    with Timer(children=True) as t, open(log, "w") as lf:
        p = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        try:
            rc = p.wait(timeout=b.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(p.pid, signal.SIGKILL)
            rc = p.wait()
        except BaseException:  # (an interrupt of the runner ends the benchmark's processes too)
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise
    entry["wall_s"], entry["cpu_s"] = round(t.wall_s, 3), round(t.cpu_s, 3)
    if timed_out or rc != 0 or not out.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-12:]
        why = f"timed out after {b.timeout_s:g} s" if timed_out else f"exit {rc}"
        return {**entry, "status": "failed", "why": f"{why}: " + " | ".join(tail)[-1500:]}
    try:
        raw = json.loads(out.read_text())
        return {**entry, "status": "ok", "metrics": headlines(b.name, raw), "raw": raw}
    except ValueError as e:  # (json's errors are ValueErrors too)
        return {**entry, "status": "failed", "why": str(e)}


def print_metrics(name: str, entry: dict[str, Any], file: Any = sys.stdout) -> None:
    """One benchmark's headline figures, a line each."""
    if entry["status"] != "ok":
        print(f"{name}: {entry['status']}: {entry.get('why', '')}", file=file)
        return
    for m in entry["metrics"]:
        spread = f" ({m['low']:.3g} to {m['high']:.3g})" if "low" in m and "high" in m else ""
        vs = f"  vs {m['vs']}" if m.get("vs") else ""
        print(f"{name}: {m['name']}: {m['value']:.3g} {m['unit']}{spread}{vs}", file=file)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=description(__doc__))
    ap.add_argument("names", nargs="*", help=f"benchmarks to run (default: all): {', '.join(BENCHMARKS)}")
    ap.add_argument("--quick", action="store_true", help="fewer repeats and sizes (minutes instead of tens)")
    ap.add_argument("--out", default=None, help="the result document (default: benchmarks-<machine>.json here)")
    ap.add_argument(
        "--compare",
        nargs="+",
        metavar="BASE.json",
        help="compare the run with BASE.json; with two files, compare them and run nothing",
    )
    ap.add_argument("--list", action="store_true", help="list the benchmarks and what each is measured against")
    ap.add_argument(
        "--source",
        action="store_true",
        help="print the digest of this tree's measured sources (a result document's 'source'), and nothing else",
    )
    ap.add_argument("--readme", metavar="RESULT.json", help="print the README's figures table from a result document")
    ap.add_argument(
        "--reheadline",
        metavar="RESULT.json",
        help="read the headline figures again from the scripts' documents kept in RESULT.json (after "
        "a change of how they are read; nothing runs) and rewrite it",
    )
    a = ap.parse_args(argv)

    def load_or_exit(path: str) -> dict[str, Any]:
        try:
            return load(path)
        except (OSError, ValueError) as e:
            ap.error(f"{path}: {e}; give a result document written by python -m benchmarks")

    if a.source:
        print(source_digest())
        return 0
    if a.list:
        for b in BENCHMARKS.values():
            print(f"{b.name:<15} {b.about}\n{'':<15} against: {b.vs}")
        return 0
    if a.readme:
        print(readme_table(load_or_exit(a.readme)))
        return 0
    if a.reheadline:
        doc = load_or_exit(a.reheadline)
        for name, e in doc["benchmarks"].items():
            if e["status"] == "ok":
                e["metrics"] = headlines(name, e["raw"])
        check_document(doc)
        Path(a.reheadline).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"headline figures read again from the documents kept in {a.reheadline}")
        return 0
    if a.compare and len(a.compare) == 2:
        base, new = load_or_exit(a.compare[0]), load_or_exit(a.compare[1])
        print(format_comparison(compare(base, new), base, new))
        return 0
    if a.compare and len(a.compare) > 2:
        ap.error("--compare takes one base document, or two documents to compare")
    unknown = [n for n in a.names if n not in BENCHMARKS]
    if unknown:
        ap.error(f"unknown benchmark(s) {', '.join(unknown)}; --list shows them")
    base = load_or_exit(a.compare[0]) if a.compare else None
    names = a.names or list(BENCHMARKS)
    profile = "quick" if a.quick else "full"
    doc = new_document(["python", "-m", "benchmarks", *(argv if argv is not None else sys.argv[1:])], profile)
    m = doc["machine"]
    out = Path(a.out or f"benchmarks-{kind_of(m)}.json")
    if m.get("backend") != "cuda":
        print(
            f"this machine runs deviceop's {m.get('backend')} backend: the benchmarks measure GPU work against "
            "GPU references, so they need a CUDA device (nothing was run or written)",
            file=sys.stderr,
        )
        return 2
    try:
        from tqdm import tqdm
    except ImportError:
        print("the benchmarks show their progress with tqdm: python -m pip install --group bench", file=sys.stderr)
        return 2

    logs = out.with_name(out.stem + "-logs")  # each benchmark's output, kept beside the document
    logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="deviceop-bench-") as tmp:
        work = Path(tmp)
        bar = tqdm(names, unit="benchmark", file=sys.stderr, dynamic_ncols=True)
        for name in bar:
            b = BENCHMARKS[name]
            bar.set_description(name)
            why = _missing(b, m)
            if why:
                doc["benchmarks"][name] = {"about": b.about, "vs": b.vs, "status": "skipped", "why": why}
                continue
            entry = run_one(b, a.quick, work, logs / f"{name}.log")
            doc["benchmarks"][name] = entry
            tqdm.write(f"{name}: {entry['status']} in {entry['wall_s']:.0f} s", file=sys.stderr)
            out.write_text(json.dumps(doc, indent=1) + "\n")  # (what ran so far survives an interrupted run)
    check_document(doc)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    for name, e in doc["benchmarks"].items():
        print_metrics(name, e)
    print(f"results: {out} (each benchmark's output: {logs}/)")
    if base is not None:
        print(format_comparison(compare(base, doc), base, doc))
    failed = [n for n, e in doc["benchmarks"].items() if e["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
