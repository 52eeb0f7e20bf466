"""Start-up: ``import deviceop`` after numpy, and the first op after a bare driver start.

Each figure is measured in fresh interpreter processes (median of --runs):
  import_ms       ``import deviceop`` in a process that already imported numpy
  bare_start_ms   cuInit + primary context retain + make current, through cuda.bindings
  first_op_ms     then, in the same process: ``import deviceop`` and the first op
                  (``do.zeros(1024).sync()``), i.e. what deviceop adds on top of a started driver
                  (built-in kernels come from the disk cache, as in any process after the first)

deviceop's modules are byte-compiled first, as ``pip install`` leaves an installed package: a
checkout run under ``PYTHONDONTWRITEBYTECODE=1`` would otherwise compile every module from
source in every process, which would dominate the figure.

    python benchmarks/startup.py --out startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from _harness import description

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

IMPORT = """
import time, numpy
t = time.perf_counter()
import deviceop
print((time.perf_counter() - t) * 1e3)
"""

FIRST = """
import time, numpy
from cuda.bindings import driver as d
t0 = time.perf_counter()
d.cuInit(0)
_, dev = d.cuDeviceGet(0)
_, ctx = d.cuDevicePrimaryCtxRetain(dev)
d.cuCtxSetCurrent(ctx)
t1 = time.perf_counter()
import deviceop as do
do.zeros(1024).sync()
t2 = time.perf_counter()
print((t1 - t0) * 1e3, (t2 - t1) * 1e3)
"""


def run(code: str) -> list[float]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return [float(v) for v in out.stdout.split()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    # byte-compile the package (compileall writes whatever PYTHONDONTWRITEBYTECODE says)
    subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(ROOT, "deviceop")], check=True)
    run(FIRST)  # fills the kernel cache and warms the page cache
    imp = [run(IMPORT)[0] for _ in range(a.runs)]
    first = [run(FIRST) for _ in range(a.runs)]
    doc = {
        "experiment": "startup",
        "runs": a.runs,
        "import_ms": statistics.median(imp),
        "import_ms_all": imp,
        "bare_start_ms": statistics.median(f[0] for f in first),
        "first_op_ms": statistics.median(f[1] for f in first),
        "first_all": first,
    }
    print(
        f"import deviceop after numpy: {doc['import_ms']:.1f} ms; bare driver start {doc['bare_start_ms']:.1f} ms, "
        f"then import + first op {doc['first_op_ms']:.1f} ms"
    )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
