"""A user kernel's launch from Python: deviceop's ``Kernel`` beside cuda.bindings, CuPy and cuda.core.

The kernel is ``_refs.py``'s ``y[i] = x[i] * g`` over 2048 f16 elements (16 blocks of 128
threads), declared as a user kernel (``do.kernels.Kernel``, parameters ``Out(float16),
In(float16), float32, int64``) and called as a user writes it:

* ``sync_each``: N times ``k(y.partition((128,)), x, g, n).sync_on(s)`` (a partition made per
  call, as a fresh output would need);
* ``chained``: one op of N calls, ``op.then(lambda o: k(*o))``, then ``sync_on(s)``.

The references run the same kernel in the same process (``_refs.py``: cuda.bindings with its
parameters packed once, CuPy's ``RawKernel``, cuda.core's ``launch``). Medians over reps of the
time per launch, µs; the ratio is deviceop's over each reference.

    python experiments/user_kernel_cost.py --sizes 1,100,1000 --reps 100 --out user_kernel_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _refs
from exec_modes import machine_info

import deviceop as do

K = do.kernels


def measure_deviceop(n_ops: int, reps: int, warmup: int) -> list[dict]:
    n = _refs.N_ELEMS
    k = K.Kernel(
        _refs.KERNEL_SRC,
        _refs.KERNEL_NAME,
        params=(K.Out(do.float16), K.In(do.float16), do.float32, do.int64),
        host=lambda y, x, g, m: np.multiply(x[:m], np.float16(g), out=y[:m]),
    )
    s = do.next_stream()
    x = do.full(n, _refs.X_FILL, do.float16).sync_on(s)
    y = do.zeros(n, do.float16).sync_on(s)
    g = _refs.G

    def sync_each() -> None:
        for _ in range(n_ops):
            k(y.partition((_refs.THREADS,)), x, g, n).sync_on(s)

    def step(o: tuple) -> do.DeviceOp:
        return k(*o)

    def chained() -> None:
        op = k(y.partition((_refs.THREADS,)), x, g, n)
        for _ in range(n_ops - 1):
            op = op.then(step)
        op.sync_on(s)

    out = []
    for mode, fn in (("sync_each", sync_each), ("chained", chained)):
        K.fill(y.partition((_refs.THREADS,)), 0.0).sync_on(s)
        samples = _refs._time_reps(fn, reps, warmup)
        got = y.numpy().astype(np.float32)
        if not np.all(got == _refs.EXPECTED):
            raise RuntimeError(f"deviceop {mode} N={n_ops}: wrong output {got[:4]}")
        out.append(_refs._summary("deviceop", mode, n_ops, samples, reps))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--sizes", default="1,100,1000")
    ap.add_argument("--impls", default="raw_bindings,cupy,cuda_core")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    sizes = [int(v) for v in a.sizes.split(",") if v]
    rows: list[dict] = []
    for n_ops in sizes:
        rows += measure_deviceop(n_ops, a.reps, a.warmup)
        for name in [v for v in a.impls.split(",") if v]:
            try:
                rows += _refs.IMPLS[name](n_ops, a.reps, a.warmup)
            except ImportError as e:
                print(f"[{name}] skipped: {e}", file=sys.stderr)
    rows = [r for r in rows if r["mode"] in ("sync_each", "chained")]
    mine = {(r["mode"], r["n_ops"]): r["us_per_op_median"] for r in rows if r["impl"] == "deviceop"}
    for r in rows:
        r["deviceop_over_this"] = mine[(r["mode"], r["n_ops"])] / r["us_per_op_median"]
        print(
            f"{r['impl']:13s} {r['mode']:10s} N={r['n_ops']:5d} {r['us_per_op_median']:8.2f} us/launch"
            f"  deviceop/this {r['deviceop_over_this']:.2f}x"
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"experiment": "user_kernel_cost", "machine": machine_info(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
