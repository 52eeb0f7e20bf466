"""The package's structure: layers import downward only (no import cycles among deviceop's
modules, imports inside functions included) and no module outside the backends branches on a
backend's name or imports the driver bindings. The project's structure tool
(../shared/tools/layers.py beside a checkout) checks the same and more; this test keeps the
import-cycle rule in the suite wherever the tool is not present."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "deviceop")


def _modules() -> dict[str, str]:
    out = {}
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith((".py", ".pyx")):
                path = os.path.join(d, f)
                rel = os.path.relpath(path, ROOT)[: -len(os.path.splitext(f)[1])].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = path
    return out


def _imports(name: str, path: str, mods: dict[str, str]) -> set[str]:
    src = Path(path).read_text(encoding="utf-8")
    pkg = name.split(".") if path.endswith("__init__.py") else name.split(".")[:-1]
    found: set[str] = set()
    if path.endswith(".py"):
        for n in ast.walk(ast.parse(src)):
            if isinstance(n, ast.Import):
                found.update(a.name for a in n.names)
            elif isinstance(n, ast.ImportFrom):
                base = pkg[: len(pkg) - n.level + 1] if n.level else []
                mod = ".".join(base + ([n.module] if n.module else []))
                found.add(mod)
                found.update(f"{mod}.{a.name}" for a in n.names)
    else:
        for m in re.finditer(r"^\s*from\s+(\.*)([\w.]*)\s+c?import\s+([\w, ]+)", src, re.M):
            level = len(m.group(1))
            base = pkg[: len(pkg) - level + 1] if level else []
            mod = ".".join(base + ([m.group(2)] if m.group(2) else []))
            found.add(mod)
            found.update(f"{mod}.{a.strip()}" for a in m.group(3).split(","))
    out = set()
    for m in found:
        while m and m not in mods:
            m = m.rpartition(".")[0]
        if m and m != name and not m.startswith(name + "."):
            out.add(m)
    return out


def test_no_import_cycles() -> None:
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    # depth-first search for a back edge
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycle = [*stack[stack.index(d) :], d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_no_backend_name_branches_or_driver_imports_outside_backends() -> None:
    branch = re.compile(r"""(name|backend_name\(\))\s*(==|!=|is|in)\s*\(?\s*["'](cuda|host)["']""")
    driver = re.compile(
        r"^\s*(from|import|cimport)\s+cuda\.(bindings|core)|from\s+cuda\s+import|cimport\s+cuda\.", re.M
    )
    backends = ("_cuda", "_host", "_select", "__main__")
    blas = ("_blas", "_blaslt", "_nvrtc")
    bad = []
    for m, path in _modules().items():
        base = m.rsplit(".", 1)[-1]
        src = Path(path).read_text(encoding="utf-8")
        if not base.startswith(backends) and branch.search(src):
            bad.append(f"{m}: branches on a backend's name")
        if not base.startswith(backends + blas) and driver.search(src):
            bad.append(f"{m}: imports the driver bindings")
    assert not bad, bad


def test_import_from_a_folder_holding_a_deviceop_folder(tmp_path) -> None:
    """Run from the checkout's parent (or any folder with a ``deviceop`` folder in it), ``import
    deviceop`` is the package, not an empty namespace package (the README's install puts the
    checkout on the path)."""
    import os
    import subprocess
    import sys

    (tmp_path / "deviceop").mkdir()
    code = "import deviceop, sys; sys.exit(0 if hasattr(deviceop, 'zeros') else 3)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (
        "import deviceop found an empty namespace package: install with "
        f"--config-settings editable_mode=compat (as the README says) {r.stderr[-500:]}"
    )
