"""Where the one-thread async queue's host time goes, per item (cProfile, deterministic).

The bimodal GEMM queue of ``bimodal.py`` (2000 f16 GEMMs, 80 % 512^3 and 20 % 2048^3) drained
by ``WorkQueue`` from one uvloop thread over ``--streams`` streams, with ``batch=1`` (one await
per item) and with the default batching, beside deviceop serial (``sync_on`` per item). Per
mode: the throughput unprofiled (after a warm-up run, the collector frozen), then one profiled
run and the functions with the most own time per item (``--top``). The profiler slows Python
code more than compiled code: read the shares, not the absolute times. (``queue_profile.py``
profiles the gemm_queue example's drains whole; this one splits the bimodal queue's time per
item and mode.)

    python experiments/queue_item_profile.py --streams 8 --out queue_item_profile.json
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bimodal import Workload, run_async, run_serial


def top(pr: cProfile.Profile, items: int, n: int) -> list[dict]:
    """The ``n`` functions with the most own time: µs per item, own and cumulative, and calls."""
    st = pstats.Stats(pr).stats  # type: ignore[attr-defined]
    rows = sorted(((v[2], v[3], v[1], k) for k, v in st.items()), key=lambda r: r[0], reverse=True)[:n]
    return [
        {
            "function": f"{os.path.basename(k[0])}:{k[1]}({k[2]})",
            "own_us_per_item": 1e6 * own / items,
            "cum_us_per_item": 1e6 * cum / items,
            "calls_per_item": calls / items,
        }
        for own, cum, calls, k in rows
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=2000)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    w = Workload(a.items, a.streams)
    modes = {
        "serial": lambda: run_serial(w),
        "async_batch1": lambda: run_async(w, a.streams, batch=1),
        "async": lambda: run_async(w, a.streams),
    }
    for f in modes.values():  # warm-up: cuBLAS handles and plans, graph replays, uvloop
        f()
    gc.collect()
    gc.freeze()
    doc: dict = {"experiment": "queue_item_profile", "items": a.items, "streams": a.streams, "modes": {}}
    for name, f in modes.items():
        row = f()
        pr = cProfile.Profile()
        pr.enable()
        profiled = f()
        pr.disable()
        doc["modes"][name] = {"row": row, "profiled_row": profiled, "top": top(pr, a.items, a.top)}
        print(
            f"--- {name}: {row['wu_per_ms']:.1f} WU/ms, CPU {row['cpu_us_per_wu']:.2f} us per item "
            f"(profiled {profiled['wu_per_ms']:.1f} WU/ms, {profiled['cpu_us_per_wu']:.2f} us)"
        )
        for r in doc["modes"][name]["top"]:
            print(
                f"  {r['own_us_per_item']:7.2f} own {r['cum_us_per_item']:8.2f} cum {r['calls_per_item']:6.2f} calls  "
                f"{r['function']}"
            )
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(doc, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
