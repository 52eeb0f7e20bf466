"""``python experiments/bench.py [exec-modes|overlap|bimodal|kernels|all] [--out FOLDER]``.

Runs the experiments of this folder, each in a fresh interpreter
(so one's start-up or failure cannot skew another), with a progress bar; writes their JSON,
logs and PNG figures to a new folder and prints it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["BENCHES", "run_bench"]

# bench name -> (script, extra arguments) steps
BENCHES: dict[str, list[tuple[str, list[str]]]] = {
    "exec-modes": [("exec_modes.py", ["--reps", "100"])],
    "overlap": [("async_overlap.py", ["--reps", "10"])],
    "bimodal": [("bimodal.py", []), ("bimodal_hostwork.py", [])],
    "kernels": [("kernels.py", [])],
}


def run_bench(which: str, out: str | None = None) -> int:
    """Run bench ``which`` (or ``all``); return a process exit code."""
    names = list(BENCHES) if which == "all" else [which]
    exp = Path(__file__).resolve().parent
    try:
        import matplotlib  # noqa: F401
        from tqdm import tqdm
    except ImportError as e:
        print(f"the benchmarks need matplotlib and tqdm ({e}); pip install -e '.[bench]'", file=sys.stderr)
        return 2
    import deviceop as do

    if do.backend_name() != "cuda":
        print(
            "the benchmarks measure GPU work against CUDA references and needs a CUDA device; "
            f"this process has the {do.backend_name()} backend",
            file=sys.stderr,
        )
        return 2
    folder = Path(out or f"deviceop-bench-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    folder.mkdir(parents=True, exist_ok=True)
    print(f"bench {which}: results go to {folder}")
    steps = [(n, script, args) for n in names for script, args in BENCHES[n]]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(exp.parent), os.environ.get("PYTHONPATH", "")]))
    failed = []
    with tqdm(steps, unit="experiment", file=sys.stderr) as bar:
        for _name, script, args in bar:
            bar.set_description(script)
            stem = script[: -len(".py")]
            cmd = [sys.executable, str(exp / script), "--out", str(folder / f"{stem}.json"), *args]
            if script == "exec_modes.py":
                chain, lib = _build_chain(exp, folder)
                if chain:
                    cmd += ["--chain-bin", chain]
                if lib:
                    cmd += ["--graph-lib", lib]
            with open(folder / f"{stem}.log", "w") as log:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
            if rc:
                failed.append(f"{script} (exit {rc}; see {folder / (stem + '.log')})")
    sys.path.insert(0, str(exp))
    from plots import plot_folder  # the experiments' own plotting module

    pngs = plot_folder(str(folder))
    for p in pngs:
        print(f"  figure: {p}")
    for f in failed:
        print(f"  FAILED: {f}", file=sys.stderr)
    print(f"results: {folder}")
    return 1 if failed else 0


def _build_chain(exp: Path, folder: Path) -> tuple[str | None, str | None]:
    """The CUDA C++ references for exec-modes (program, in-process graph library), built with nvcc when there is one."""
    if shutil.which("nvcc") is None:
        return None, None
    exe, lib = folder / "chain", folder / "libgraphref.so"
    r = subprocess.run(
        ["nvcc", "-O3", "-arch=native", "-o", str(exe), str(exp / "ref" / "chain.cu")], capture_output=True
    )
    r2 = subprocess.run(
        [
            "nvcc",
            "-O3",
            "-arch=native",
            "-shared",
            "-Xcompiler",
            "-fPIC",
            "-o",
            str(lib),
            str(exp / "ref" / "graph_ref.cu"),
        ],
        capture_output=True,
    )
    return (str(exe) if r.returncode == 0 else None), (str(lib) if r2.returncode == 0 else None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python experiments/bench.py",
        description="run the experiments (GPU): JSON, logs and PNG figures into a folder",
    )
    ap.add_argument("which", nargs="?", default="all", choices=[*BENCHES, "all"])
    ap.add_argument("--out", default=None, help="folder for the results (default: a new dated folder here)")
    a = ap.parse_args(argv)
    return run_bench(a.which, a.out)


if __name__ == "__main__":
    sys.exit(main())
