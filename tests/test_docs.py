"""The README and every docs page run as written: each page's Python blocks, in order, as one
program on the host backend (a fresh process each, so pages cannot lean on one another)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "hooks" not in p.parts)]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_pages_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "docs/tutorial.md", "docs/concepts/ops.md", "docs/concepts/await.md"} <= names


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 150


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_code_blocks_run(page, tmp_path):
    blocks = BLOCK.findall(page.read_text(encoding="utf-8"))
    if not blocks:
        pytest.skip("no Python blocks on this page")
    script = tmp_path / "page.py"
    script.write_text("\n".join(blocks), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVICEOP_STUB")}
    env.update(DEVICEOP_BACKEND="host", PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, f"{page.name} failed:\n{r.stderr[-3000:]}"


def test_benchmarks_page_reads_every_baseline(tmp_path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("mkdocs")
    sys.path.insert(0, str(ROOT / "docs" / "hooks"))
    try:
        import benchmark_page
    finally:
        sys.path.pop(0)
    md, pngs = benchmark_page.render(tmp_path)
    baselines = sorted((ROOT / "benchmarks" / "baselines").glob("*.json"))
    assert baselines
    for b in baselines:
        assert f"## {b.stem}" in md
    assert "| benchmark | figure | deviceop | against |" in md
    assert "details not readable" not in md
    assert pngs and all(p.exists() and p.stat().st_size > 1000 for p in pngs)
