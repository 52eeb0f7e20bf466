"""The benchmarks' one harness: a timer for wall and CPU time, summaries over repeats, the result
document's schema, and the comparison of two result documents.

Every benchmark is a script of this folder that writes one JSON document (``--out``); the runner
(``python -m benchmarks``) runs each in a fresh interpreter under :class:`Timer`, reads its
headline figures (:mod:`benchmarks._headlines`) and writes one document of this schema:

.. code-block:: text

    {"schema": "deviceop-benchmarks/1",
     "machine": {...}, "commit": "...", "dirty": false, "source": "sha256 of the measured sources",
     "environment": {...},
     "created": "...", "command": [...], "profile": "quick" | "full",
     "benchmarks": {name: {"status": "ok" | "failed" | "skipped", "why": "...",
                           "wall_s": ..., "cpu_s": ..., "command": [...],
                           "metrics": [Metric, ...], "raw": {the script's document}}}}

A metric: ``{"name", "value", "unit", "better": "higher" | "lower", "vs": what it is compared
with, "low", "high"}`` (``low``/``high``: the spread over the runs that made ``value``, where
the benchmark measured one).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = "deviceop-benchmarks/1"
ROOT = Path(__file__).resolve().parent.parent


class Timer:
    """Wall and CPU time of a block: this process's CPU (every thread), or with ``children``
    the CPU of the child processes that ended inside it (a benchmark run in its own interpreter).

    >>> with Timer() as t:
    ...     pass
    >>> t.wall_s >= 0 and t.cpu_s >= 0
    True
    """

    def __init__(self, children: bool = False) -> None:
        self.children = children
        self.wall_s = 0.0
        self.cpu_s = 0.0

    def _cpu(self) -> float:
        if self.children:
            r = resource.getrusage(resource.RUSAGE_CHILDREN)
            return r.ru_utime + r.ru_stime
        return time.process_time()

    def __enter__(self) -> Timer:
        self._w0, self._c0 = time.perf_counter(), self._cpu()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self._w0
        self.cpu_s = self._cpu() - self._c0


@dataclass
class Stats:
    """A summary of repeated measurements: median, spread (min, max, quartiles) and count."""

    median: float
    low: float
    high: float
    p25: float
    p75: float
    n: int

    @classmethod
    def of(cls, values: Iterable[float]) -> Stats:
        """The summary of ``values`` (at least one)."""
        v = sorted(float(x) for x in values)
        if not v:
            raise ValueError("no values to summarise")
        q = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else [v[0], v[0], v[0]]
        return cls(statistics.median(v), v[0], v[-1], q[0], q[2], len(v))


@dataclass
class Metric:
    """One headline figure of a benchmark."""

    name: str
    value: float
    unit: str
    better: str  # "higher" or "lower"
    vs: str = ""  # what it is compared with ("" where it stands alone)
    low: float | None = None
    high: float | None = None

    def __post_init__(self) -> None:
        if self.better not in ("higher", "lower"):
            raise ValueError(f"metric {self.name!r}: better must be 'higher' or 'lower', got {self.better!r}")

    @classmethod
    def of_runs(cls, name: str, runs: Iterable[float], unit: str, better: str, vs: str = "") -> Metric:
        """The median of ``runs``, with their spread."""
        st = Stats.of(runs)
        return cls(name, st.median, unit, better, vs, low=st.low, high=st.high)

    def as_dict(self) -> dict[str, Any]:
        """The metric as the result document holds it (spread left out where there is none)."""
        d = asdict(self)
        return {k: v for k, v in d.items() if v is not None}


@dataclass
class Benchmark:
    """A maintained benchmark: its script, arguments for the full and the quick profile, what it
    needs, and what it is measured against."""

    name: str
    script: str
    about: str
    vs: str
    full: Sequence[str] = ()
    quick: Sequence[str] = ()
    needs: Sequence[str] = ("cuda",)  # of "cuda", "torch", "gpus>=2"
    timeout_s: float = 900.0
    extra: Callable[[Path], list[str]] | None = field(default=None, repr=False)


#: what a run measures, by folder: the suffixes of the source files whose contents
#: :func:`source_digest` hashes (the library without its generated C, the benchmarks with their
#: references, the examples with their data, the build)
SOURCES = {
    "deviceop": (".py", ".pyx", ".pxd", ".pxi", ".pyi", ".cu", ".cuh", ".h"),
    "benchmarks": (".py", ".c", ".cpp", ".cu", ".h", ".sh"),
    "examples": (".py", ".wav"),
    ".": ("setup.py", "pyproject.toml"),
}


def source_digest(root: Path = ROOT) -> str:
    """A SHA-256 of the source files a run measures (:data:`SOURCES`: their paths and contents),
    read from the files themselves: it names the measured code where the commit cannot (a
    checkout with local changes, a copy whose git metadata is not the tree's). Compare it with
    ``python -m benchmarks --source`` at a commit."""
    import hashlib

    h = hashlib.sha256()
    for p in source_files(root):
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    return h.hexdigest()


def source_files(root: Path = ROOT) -> list[Path]:
    """The files :func:`source_digest` reads, in its order."""
    out: list[Path] = []
    for folder, suffixes in SOURCES.items():
        if folder == ".":
            out += [root / n for n in suffixes if (root / n).is_file()]
        else:
            out += sorted(
                p
                for p in (root / folder).rglob("*")
                if p.is_file() and p.name.endswith(suffixes) and "__pycache__" not in p.parts
            )
    return out


def description(doc: str | None) -> str:
    """A script's ``--help`` description: its docstring's first paragraph on one line, without
    reST's double backticks (its first line alone is cut mid-sentence)."""
    return " ".join((doc or "").split("\n\n")[0].replace("``", "").split())


def git(*args: str) -> str:
    """``git <args>`` in the repository ('' outside a checkout)."""
    try:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def environment() -> dict[str, Any]:
    """The software a result depends on: Python, the packages, deviceop's settings."""
    import importlib.metadata as md

    env: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform()}
    for pkg in ("deviceop", "numpy", "cuda-bindings", "torch", "cupy-cuda13x", "uvloop", "anyio", "trio"):
        try:
            env[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    env["settings"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("DEVICEOP_")}
    return env


def machine() -> dict[str, Any]:
    """The machine: CPU, cores, the GPU and its driver (from deviceop's backend, in a child
    process so that this one never initialises a device)."""
    info: dict[str, Any] = {"cpu": platform.processor() or "", "cores": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    probe = (
        "import json, deviceop as do; be = do._current(); "
        "print(json.dumps({'backend': do.backend_name(), 'device': getattr(be, 'device_name', ''), "
        "'driver': getattr(be, 'driver_version', ''), 'devices': be.device_count()}))"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-W", "ignore", "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT
        )
        info.update(json.loads(out.stdout.strip().splitlines()[-1]))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        info["backend"] = "unknown"
    return info


def kind_of(m: dict[str, Any]) -> str:
    """The machine kind a baseline file is named by: the GPU's name in lower case, dashed
    (``nvidia-h200``), with the count where there are several (``nvidia-h200-x2``)."""
    name = str(m.get("device") or m.get("backend") or "unknown").lower()
    slug = "".join(c if c.isalnum() else "-" for c in name).strip("-")
    while "--" in slug:
        slug = slug.replace("--", "-")
    n = m.get("devices") or 1
    return slug + (f"-x{n}" if n > 1 else "")


def new_document(command: Sequence[str], profile: str) -> dict[str, Any]:
    """An empty result document for a run of ``command``."""
    return {
        "schema": SCHEMA,
        "machine": machine(),
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "source": source_digest(),
        "environment": environment(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": list(command),
        "profile": profile,
        "benchmarks": {},
    }


def check_document(doc: dict[str, Any]) -> None:
    """Raise ValueError where ``doc`` is not a result document of this schema."""
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"not a {SCHEMA} document (schema {doc.get('schema')!r})")
    for key in ("machine", "commit", "environment", "benchmarks"):
        if key not in doc:
            raise ValueError(f"a result document needs {key!r}")
    for name, b in doc["benchmarks"].items():
        if b.get("status") not in ("ok", "failed", "skipped"):
            raise ValueError(f"benchmark {name!r}: status {b.get('status')!r}")
        for m in b.get("metrics", []):
            for k in ("name", "value", "unit", "better"):
                if k not in m:
                    raise ValueError(f"benchmark {name!r}: a metric without {k!r}: {m!r}")


def load(path: str | Path) -> dict[str, Any]:
    """A result document from ``path``, checked."""
    with open(path) as f:
        doc: dict[str, Any] = json.load(f)
    check_document(doc)
    return doc


def _fmt(v: float) -> str:
    a = abs(v)
    if a == 0 or 0.01 <= a < 1e5:
        return f"{v:.3g}" if a < 10 else f"{v:,.1f}"
    return f"{v:.3e}"


def compare(base: dict[str, Any], new: dict[str, Any]) -> list[dict[str, Any]]:
    """The change of every metric present in both documents: base and new value, the ratio, and
    a verdict: ``better`` or ``worse`` where the new value left the base's spread (or moved by
    more than 5 % where no spread was measured) in that direction, else ``same``."""
    rows = []
    for name, b in new["benchmarks"].items():
        old = base["benchmarks"].get(name)
        if not old:
            continue
        old_m = {m["name"]: m for m in old.get("metrics", [])}
        for m in b.get("metrics", []):
            o = old_m.get(m["name"])
            if o is None or o["unit"] != m["unit"]:
                continue
            v0, v1 = float(o["value"]), float(m["value"])
            ratio = v1 / v0 if v0 else math.inf if v1 else 1.0
            lo = o.get("low", v0 - 0.05 * abs(v0))
            hi = o.get("high", v0 + 0.05 * abs(v0))
            up = v1 > hi
            down = v1 < lo
            if not (up or down):
                verdict = "same"
            elif (up and m["better"] == "higher") or (down and m["better"] == "lower"):
                verdict = "better"
            else:
                verdict = "worse"
            rows.append(
                {
                    "benchmark": name,
                    "metric": m["name"],
                    "unit": m["unit"],
                    "base": v0,
                    "new": v1,
                    "ratio": ratio,
                    "verdict": verdict,
                }
            )
    return rows


def format_comparison(rows: list[dict[str, Any]], base: dict[str, Any], new: dict[str, Any]) -> str:
    """``compare``'s rows as a text table, headed by what was compared."""

    def who(d: dict[str, Any]) -> str:
        return f"{d['commit'][:9] or '?'}{'+dirty' if d.get('dirty') else ''} on {kind_of(d['machine'])}"

    out = [f"base {who(base)}  ->  new {who(new)}"]
    if kind_of(base["machine"]) != kind_of(new["machine"]):
        out.append("warning: the documents come from different kinds of machine")
    if base.get("profile") != new.get("profile"):
        out.append(
            f"warning: the base ran the {base.get('profile')} profile and the new one the {new.get('profile')} "
            "profile (other sizes and repeats)"
        )
    for n, b in new["benchmarks"].items():
        was = base["benchmarks"].get(n)
        if was is not None and was.get("command") and b.get("command") and was["command"][1:] != b["command"][1:]:
            # (the same profile can run another command: a benchmark's arguments changed since)
            out.append(
                f"warning: {n} ran another command in the base ({' '.join(was['command'][1:])}) than now "
                f"({' '.join(b['command'][1:])})"
            )
    seen = {(r["benchmark"], r["metric"]) for r in rows}

    def figures(d: dict[str, Any]) -> set[tuple[str, str]]:
        return {(n, m["name"]) for n, b in d["benchmarks"].items() for m in b.get("metrics", [])}

    for label, only in (("only in the base", figures(base) - seen), ("only in the new", figures(new) - seen)):
        for n, m in sorted(only):
            out.append(f"{label}: {n}: {m}")
    for n, b in new["benchmarks"].items():
        if b["status"] != "ok":
            out.append(f"new {n}: {b['status']}: {b.get('why', '')[:200]}")
    if not rows:
        return "\n".join([*out, "(no metric in common)"])
    w = max(len(f"{r['benchmark']}: {r['metric']}") for r in rows)
    for r in rows:
        label = f"{r['benchmark']}: {r['metric']}"
        out.append(
            f"{label:<{w}}  {_fmt(r['base']):>10} -> {_fmt(r['new']):>10} {r['unit']:<6} "
            f"{r['ratio']:6.3f}x  {r['verdict']}"
        )
    worse = sum(r["verdict"] == "worse" for r in rows)
    better = sum(r["verdict"] == "better" for r in rows)
    out.append(f"{len(rows)} metrics: {better} better, {worse} worse, {len(rows) - better - worse} within the spread")
    return "\n".join(out)
