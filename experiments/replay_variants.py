"""What a graph replay's cost over raw cuda.bindings is made of: variants interleaved rep by rep.

deviceop's replay (``g.launch().sync_on(s)``) beside raw cuda.bindings launching deviceop's own
executable graph on deviceop's stream, and the raw loop with host work added before the launch,
between launch and sync, or after the sync; deviceop with the ledger off; launches alone.
Medians over 2000 reps per round, after a 0.5 s warm-up; one JSON line per round.

    python experiments/replay_variants.py [ROUNDS]
"""

import json
import sys
import time

import numpy as np
from cuda.bindings import driver

import deviceop as do
from deviceop._core import _ledger

K = do.kernels
s = do.next_stream()
x = do.from_numpy(np.full(2048, 1.5, dtype=np.float16)).sync_on(s)
y = do.zeros(2048, do.float16).sync_on(s)
g = K.scale(y.partition((128,)), x, 0.5).graph()
ex, st = driver.CUgraphExec(g._exec.handle_int), driver.CUstream(s.handle_int)
gl, sy = driver.cuGraphLaunch, driver.cuStreamSynchronize
clock = time.perf_counter_ns


def raw():
    t = clock()
    gl(ex, st)
    sy(st)
    return clock() - t


def dev():
    t = clock()
    g.launch().sync_on(s)
    return clock() - t


def raw_alloc():
    t = clock()
    g.launch()
    gl(ex, st)
    sy(st)
    return clock() - t


def raw_after():  # python work after the sync (post-sync critical), as much as an alloc
    t = clock()
    gl(ex, st)
    sy(st)
    g.launch()
    return clock() - t


def raw_between():  # python work between launch and sync (hidden?)
    t = clock()
    gl(ex, st)
    g.launch()
    g.launch()
    g.launch()
    sy(st)
    return clock() - t


def dev_off():
    _ledger.set_borrow_policy("off")
    t = clock()
    g.launch().sync_on(s)
    r = clock() - t
    _ledger.set_borrow_policy("order")
    return r


def dev_submit():  # launch via deviceop's submit, wait through raw sync
    t = clock()
    f = g.launch().submit(s)
    sy(st)
    r = clock() - t
    f.result()
    return r


def launch_only():  # host time of deviceop's launch path without waiting (GPU then idles)
    sy(st)
    t = clock()
    g.launch().submit(s)
    r = clock() - t
    sy(st)
    return r


def raw_launch_only():
    sy(st)
    t = clock()
    gl(ex, st)
    r = clock() - t
    sy(st)
    return r


fns = [raw, dev, raw_alloc, raw_after, raw_between, dev_off, dev_submit, launch_only, raw_launch_only]


def main() -> None:
    for rnd in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
        t_end = time.perf_counter() + 0.5
        while time.perf_counter() < t_end:
            for f in fns:
                f()
        samp = {f.__name__: [] for f in fns}
        for _ in range(2000):
            for f in fns:
                samp[f.__name__].append(f())
        med = {k: round(float(np.median(v)) / 1e3, 3) for k, v in samp.items()}
        rel = {k: round(float(np.median([a / b for a, b in zip(v, samp["raw"])])), 4) for k, v in samp.items()}
        print(json.dumps({"round": rnd, "median_us": med, "over_raw_median_of_ratios": rel}))


if __name__ == "__main__":
    main()
