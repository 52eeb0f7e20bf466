"""What host work costs after a wait, by how the thread waited (a diagnostic of the await's excess).

After a wait of each length, one op is built (``scale`` over 2048 f16, not launched) and a
pure-Python workload runs; both are timed. The wait is, in turn: ``sync_on`` of a spin kernel
(the driver spins), ``time.sleep`` (the thread sleeps and its core may idle), a Python busy loop
(the core stays busy on other Python work), and a sleep while ``/dev/cpu_dma_latency`` holds the
cores out of deep idle states (only where that file is writable). Medians in µs.

    python experiments/cold_host.py --reps 60 --out cold_host.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import struct
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from await_cost import spin_k
from exec_modes import machine_info

import deviceop as do

K = do.kernels
LENGTHS = [0.0, 100e-6, 2e-3, 20e-3]


def _py_work() -> int:
    d = {}
    for i in range(200):
        d[i] = str(i)
    return sum(len(v) for v in d.values())


def _idle_states() -> list[str]:
    out = []
    for p in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cpuidle/state*/name")):
        try:
            with open(p) as f:
                name = f.read().strip()
            with open(p.replace("/name", "/latency")) as f:
                out.append(f"{name} ({f.read().strip()} us)")
        except OSError:
            pass
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--out", default="cold_host.json")
    a = ap.parse_args(argv)
    s = do.next_stream()
    x = do.from_numpy(np.full(2048, 1.5, dtype=np.float16)).sync_on(s)
    yp = do.zeros(2048, do.float16).sync_on(s).partition((128,))
    out_t = do.zeros(1024, do.float32).sync_on(s)
    clock = time.perf_counter_ns
    K.scale(yp, x, 0.5).sync_on(s)
    spin_k(out_t, 1000, grid=(1,), block=(32,)).sync_on(s)

    def wait_gpu(secs: float) -> None:
        spin_k(out_t, int(secs * 1e9), grid=(1,), block=(32,)).sync_on(s)

    def wait_sleep(secs: float) -> None:
        if secs:
            time.sleep(secs)

    def wait_busy(secs: float) -> None:
        t = time.perf_counter() + secs
        while time.perf_counter() < t:
            pass

    waits = {"gpu_sync_on": wait_gpu, "sleep": wait_sleep, "busy": wait_busy}
    res: dict = {"machine": machine_info(), "idle_states": _idle_states(), "rows": []}

    def measure(kind: str, fn) -> None:  # type: ignore[no-untyped-def]
        for secs in LENGTHS:
            build, py = [], []
            for r in range(a.reps + 5):
                fn(secs)
                t0 = clock()
                op = K.scale(yp, x, 0.5)
                t1 = clock()
                _py_work()
                t2 = clock()
                op.sync_on(s)
                if r >= 5:
                    build.append((t1 - t0) / 1e3)
                    py.append((t2 - t1) / 1e3)
            row = {
                "wait": kind,
                "secs": secs,
                "build_us": float(np.median(build)),
                "py_work_us": float(np.median(py)),
                "build_p90_us": float(np.percentile(build, 90)),
            }
            res["rows"].append(row)
            print(json.dumps(row), flush=True)

    for kind, fn in waits.items():
        measure(kind, fn)
    try:
        fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
    except OSError as e:
        res["dma_latency"] = f"not writable: {e}"
    else:
        os.write(fd, struct.pack("i", 0))
        try:
            measure("sleep_no_deep_idle", wait_sleep)
            measure("gpu_sync_on_no_deep_idle", wait_gpu)
        finally:
            os.close(fd)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
