"""Host work overlapped with GPU work (paper Fig. 8a): sync vs async throughput.

Each iteration runs a pipeline of N=300 ``scale`` kernels (f16, ``--elems`` elements, so the GPU
time G is well above the time to enqueue it), recorded once into a CUDA graph and replayed, as
the paper's Fig. 8a does ("a fixed GPU pipeline (N = 300 captured graph)"), and W seconds of host
work (a busy Python loop). ``sync``: ``pipeline.sync_on(s)`` then the host work. ``async``
(uvloop): ``fut = pipeline.submit(s)``, the host work, ``await fut``, so the host work overlaps
the GPU. W sweeps 0..3 G; the figure is async/sync throughput at W close to G.

The host enqueues the pipeline before its host work can start: with G timed from the submit to
the completion (the enqueue E included), sync takes G + W and async at least E + W, so at W = G
async/sync is at most 2G / (E + G), whatever the await does. ``--chain`` builds and enqueues the
300 kernels anew each iteration (``then`` chained): E is then no longer small against G, and the
document's ``bound_at_w_eq_gpu`` says how far it bounds the ratio.

    python benchmarks/async_overlap.py --reps 10 --out async_overlap.json [--png async_overlap.png]
    python benchmarks/async_overlap.py --chain --reps 10 --factors 0,1 --out async_overlap_chain.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _harness import description
from exec_modes import machine_info

import deviceop as do

K = do.kernels
N_OPS = 300


def host_work(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--elems", type=int, default=1 << 26)
    ap.add_argument("--factors", default="0,0.25,0.5,0.75,1,1.25,1.5,2,3")
    ap.add_argument("--out", default=None)
    ap.add_argument("--png", default=None)
    ap.add_argument(
        "--chain",
        action="store_true",
        help="build and enqueue the kernels anew each iteration (default: record the pipeline once, replay it)",
    )
    a = ap.parse_args(argv)
    import uvloop

    s = do.next_stream()
    x = do.full(a.elems, 1.0, do.float16).sync_on(s)
    y = do.zeros(a.elems, do.float16).sync_on(s)
    yp = y.partition((4096,))

    def step(o: tuple) -> do.DeviceOp:
        return K.scale(*o)

    def chain() -> do.DeviceOp:
        op = K.scale(yp, x, 0.5)
        for _ in range(N_OPS - 1):
            op = op.then(step)
        return op

    pipeline = chain
    if not a.chain:
        g = chain().graph(stream=s)
        pipeline = g.launch

    for _ in range(3):
        pipeline().sync_on(s)
    clock = time.perf_counter
    g = []
    e = []
    for _ in range(max(a.reps, 5)):
        t0 = clock()
        op = pipeline()
        fut = op.submit(s)
        t1 = clock()
        fut.result()
        g.append(clock() - t0)
        e.append(t1 - t0)
    gpu_s, enqueue_s = float(np.median(g)), float(np.median(e))
    print(
        f"pipeline: {N_OPS} kernels over {a.elems} f16 elements, {'chained' if a.chain else 'recorded and replayed'}; "
        f"GPU (submit to done) {gpu_s * 1e3:.2f} ms, enqueue {enqueue_s * 1e3:.2f} ms, "
        f"bound at W = G {2 * gpu_s / (enqueue_s + gpu_s):.3f}x",
        file=sys.stderr,
    )

    rows = []
    for f in [float(v) for v in a.factors.split(",")]:
        w = f * gpu_s
        sync_t, async_t = [], []

        async def async_iter() -> None:
            fut = pipeline().submit(s)
            host_work(w)
            await fut

        async def async_reps() -> list[float]:
            out = []
            for _ in range(a.reps + 1):
                t0 = clock()
                await async_iter()
                out.append(clock() - t0)
            return out[1:]

        for _ in range(a.reps + 1):
            t0 = clock()
            pipeline().sync_on(s)
            host_work(w)
            sync_t.append(clock() - t0)
        sync_t = sync_t[1:]
        async_t = uvloop.run(async_reps())
        sm, am = float(np.median(sync_t)), float(np.median(async_t))
        rows.append(
            {
                "w_over_gpu": f,
                "w_ms": w * 1e3,
                "sync_iter_ms": sm * 1e3,
                "async_iter_ms": am * 1e3,
                "sync_it_per_s": 1 / sm,
                "async_it_per_s": 1 / am,
                "async_over_sync": sm / am,
            }
        )
        print(
            f"W = {f:4.2f} G ({w * 1e3:6.2f} ms): sync {sm * 1e3:7.2f} ms/it  async {am * 1e3:7.2f} ms/it  "
            f"-> {sm / am:.2f}x",
            file=sys.stderr,
        )
    near = min(rows, key=lambda r: abs(r["w_over_gpu"] - 1.0))
    doc = {
        "experiment": "async_overlap",
        "machine": machine_info(),
        "n_ops": N_OPS,
        "elements": a.elems,
        "replayed_graph": not a.chain,
        "gpu_ms": gpu_s * 1e3,
        "enqueue_ms": enqueue_s * 1e3,
        # (G + W) / (E + W) at W = G (G from the submit to the completion): what async can reach
        # over sync with this enqueue
        "bound_at_w_eq_gpu": 2 * gpu_s / (enqueue_s + gpu_s),
        "rows": rows,
        "async_over_sync_at_w_eq_gpu": near["async_over_sync"],
    }
    print(f"async/sync at W = G: {near['async_over_sync']:.2f}x")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(doc, fh, indent=1)
    if a.png:
        from plots import plot_overlap

        plot_overlap(doc, a.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
