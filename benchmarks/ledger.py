"""Access-ledger figures: two independent GPU-bound pipelines on two streams overlap; two
dependent ones are ordered (and correct); the ledger's cost per op in a chained sync.

    python benchmarks/ledger.py --reps 20 --out ledger.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import deviceop as do

K = do.kernels
SRC = r"""
extern "C" __global__ void spin_fill(float* out, float v, long long n, long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) { }
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = v;
}
extern "C" __global__ void spin_add(float* out, const float* x, long long n, long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) { }
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = out[i] + x[i];
}
"""
spin_fill = K.Kernel(SRC, "spin_fill", params=(K.Out(do.float32), do.float32, do.int64, do.int64))
spin_add = K.Kernel(SRC, "spin_add", params=(K.InOut(do.float32), K.In(do.float32), do.int64, do.int64))
N = 256
STEPS = 20
CYCLES = 1_000_000  # ~0.5 ms per kernel at ~2 GHz: each pipeline is GPU-bound (~10 ms)


def pipeline(dst, v0, src=None):
    """STEPS dependent launches writing dst (and reading src, when given)."""
    p = dst.partition((N,))
    b = (N,)  # one block covers the whole tile
    op = spin_fill(p, v0, N, CYCLES, block=b)
    for _ in range(STEPS - 1):
        if src is None:
            op = op.then(lambda o: spin_fill(o[0], o[1] + 1.0, N, CYCLES, block=b))
        else:
            op = op.then(lambda o, src=src: spin_add(o[0], src, N, CYCLES, block=b))
    return op


def timed(fn, reps):
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    s0, s1 = do.streams()[:2]
    x = do.zeros(N, do.float32).sync()
    y = do.zeros(N, do.float32).sync()

    def alone():
        pipeline(x, 1.0).sync_on(s0)

    def back_to_back():
        pipeline(x, 1.0).sync_on(s0)
        pipeline(y, 1.0).sync_on(s1)

    def independent():
        f = pipeline(x, 1.0).submit(s0)
        g = pipeline(y, 1.0).submit(s1)
        f.result()
        g.result()

    def dependent():  # y += x, STEPS times, on s1 while x is being written on s0
        f = pipeline(x, 1.0).submit(s0)
        g = pipeline(y, 0.0, src=x).submit(s1)
        f.result()
        g.result()

    t_alone = timed(alone, a.reps)
    t_b2b = timed(back_to_back, a.reps)
    t_ind = timed(independent, a.reps)
    t_dep = timed(dependent, a.reps)
    # the dependent pipeline saw x's final value (STEPS) at each of its STEPS - 1 adds
    got = y.numpy()
    expect = float(STEPS * (STEPS - 1))
    ok = bool(np.all(got == expect))
    res = {
        "experiment": "ledger_overlap",
        "kernels_per_pipeline": STEPS,
        "spin_cycles": CYCLES,
        "reps": a.reps,
        "one_pipeline_s": t_alone,
        "back_to_back_s": t_b2b,
        "independent_two_streams_s": t_ind,
        "dependent_two_streams_s": t_dep,
        "independent_over_back_to_back": t_ind / t_b2b,
        "dependent_over_back_to_back": t_dep / t_b2b,
        "dependent_result_correct": ok,
        "device": do._current().device_name,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
