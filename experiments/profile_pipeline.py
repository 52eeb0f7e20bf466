"""Where a request's host time goes: cProfile of experiments/pipeline_cost.py's deviceop request
(one at a time), the top entries by own time. A diagnostic for the pipeline figure.

    python experiments/profile_pipeline.py [--steps 8] [--requests 200] [--top 30]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pipeline_cost import B, D, build


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args(argv)
    request, _, _ = build(a.steps)
    x = np.ones((B, D), np.float16)
    for _ in range(20):
        request(x).sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.requests):
        request(x).sync()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(a.top)
    print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
