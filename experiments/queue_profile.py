"""Where the one-thread GEMM queue's time goes: the gemm_queue example's jobs (fresh outputs)
drained by WorkQueue over 1, 2 and 4 streams, with and without batching and polling, then one
run under cProfile.

    python experiments/queue_profile.py --out queue_profile.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "gemm_queue"))

import run as gq  # the example, as a module

import deviceop as do


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=2000)
    ap.add_argument("--small", type=int, default=512)
    ap.add_argument("--large", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    args = gq.argparse.Namespace(
        items=a.items, small=a.small, large=a.large, large_every=5, streams=1, batch=8, poll=None, check=0
    )
    jobs = gq.Jobs(args)
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        import asyncio

        run = asyncio.run
    rows = []
    run(gq.drain(jobs, args, check=False))  # warm-up: plans, replays, pool
    plain = max(gq.one_at_a_time(jobs)["gemms_per_ms"] for _ in range(a.repeats))
    print(f"one at a time: {plain:.2f} GEMMs/ms")
    for streams in (1, 2, 4):
        for batch in (8, 1):
            for poll in (None, 0.0):
                args.streams, args.batch, args.poll = streams, batch, poll
                res = [run(gq.drain(jobs, args, check=False)) for _ in range(a.repeats)]
                best = max(res, key=lambda r: r["gemms_per_ms"])
                rows.append({"streams": streams, "batch": batch, "poll": poll, **best})
                print(
                    f"S={streams} batch={batch} poll={poll}: {best['gemms_per_ms']:.2f} GEMMs/ms "
                    f"({best['gemms_per_ms'] / plain:.2f}x)  CPU {best['cpu_us_per_gemm']:.1f} us/GEMM  "
                    f"busy {best['busy_fraction']}"
                )
    args.streams, args.batch, args.poll = 4, 8, None
    pr = cProfile.Profile()
    pr.enable()
    run(gq.drain(jobs, args, check=False))
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(45)
    print(buf.getvalue())
    if a.out:
        with open(a.out, "w") as f:
            json.dump(
                {"backend": do.backend_name(), "one_at_a_time": plain, "rows": rows, "profile": buf.getvalue()},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
