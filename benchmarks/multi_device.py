"""Several devices in one process: the one-thread GEMM queue over 1 and over all devices, and
copies between two devices beside PyTorch's, in one run.

  queue  the bimodal mix (2000 float16 GEMMs, every fifth 2048^3, the rest 512^3; inputs on
         every device, outputs per lane) drained by one thread's ``WorkQueue`` over the first
         device's pool, then over every device's (``devices="all"``); GEMMs per ms, median of
         --reps after a warm-up, and the ratio
  copy   ``do.to_device(t, 1)`` of float16 tensors from device 0, against
         ``torch.Tensor.to("cuda:1")`` of the same sizes (PyTorch only on cuda): GB/s, median of
         --reps, each copy synced

On the host backend (``DEVICEOP_HOST_DEVICES=2``) it runs as a check of the program, with small
sizes; its figures say nothing about GPUs.

    python benchmarks/multi_device.py --out multi_device.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _harness import description

import deviceop as do
from deviceop.device import current
from deviceop.executors import WorkQueue

K = do.kernels


def queue(n_items: int, small: int, large: int, reps: int) -> dict:
    import uvloop

    labels = do.devices()
    rng = np.random.default_rng(0)
    host = {n: [(rng.standard_normal((n, n)) / 16).astype(np.float16) for _ in range(2)] for n in (small, large)}
    ins: dict[str, dict[int, tuple[do.Tensor, do.Tensor]]] = {}
    for lab in labels:
        with do.device(lab):
            ins[lab] = {n: (do.from_numpy(a).sync(), do.from_numpy(b).sync()) for n, (a, b) in host.items()}
    sizes = [large if i % 5 == 4 else small for i in range(n_items)]
    # per (device, lane): its outputs, made before the queue's loop runs (a factory runs on the
    # loop's thread, where blocking calls are refused); lanes are interleaved over the devices
    lanes = len(do.streams()) * len(labels)
    outs: dict[tuple[str, int], dict[int, do.Tensor]] = {}
    for lab in labels:
        with do.device(lab):
            for lane in range(lanes):
                outs[lab, lane] = {m: do.empty((m, m), do.float16).sync() for m in (small, large)}

    def items() -> list:
        def make(n: int):
            def f(lane: int) -> do.DeviceOp:
                lab = current().device_label  # the queue selects the lane's device here
                a, b = ins[lab][n]
                return K.gemm(outs[lab, lane][n], a, b)

            return f

        return [make(n) for n in sizes]

    def run(devices: list[str] | None) -> tuple[float, dict]:
        q = WorkQueue(devices=devices) if devices else WorkQueue()
        t0 = time.perf_counter()
        res = uvloop.run(q.run(items()))
        secs = time.perf_counter() - t0
        bad = [r for r in res if not r.ok]
        if bad:
            raise SystemExit(f"{len(bad)} queue items failed; first: {bad[0].error!r}")
        return n_items / secs / 1e3, q.stats().per_device()

    run(None), run(labels)  # warm-up: plans and cuBLAS heuristics on every device
    one = [run(None)[0] for _ in range(reps)]
    allr = [run(labels) for _ in range(reps)]
    return {
        "devices": labels,
        "items": n_items,
        "gemms_per_ms_one_device": statistics.median(one),
        "gemms_per_ms_all_devices": statistics.median(v for v, _ in allr),
        "ratio": statistics.median(v for v, _ in allr) / statistics.median(one),
        "per_device_last": allr[-1][1],
        "one_device_runs": one,
        "all_devices_runs": [v for v, _ in allr],
    }


def copies(sizes_mib: list[float], reps: int) -> list[dict]:
    rows = []
    torch = None
    if do.backend_name() == "cuda":
        import torch as _torch

        torch = _torch
    for mib in sizes_mib:
        n = int(mib * 2**20) // 2
        src = do.from_numpy(np.ones(n, np.float16)).sync()
        do.to_device(src, 1).sync()  # warm-up: device 1's pool and the peer mapping
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            y = do.to_device(src, 1).sync()
            ts.append(time.perf_counter() - t0)
        assert y.device.endswith(":1") and float(y.numpy()[-1]) == 1.0
        row = {"mib": mib, "deviceop_gb_s": n * 2 / statistics.median(ts) / 1e9}
        if torch is not None:
            t = torch.ones(n, dtype=torch.float16, device="cuda:0")
            t.to("cuda:1")
            torch.cuda.synchronize("cuda:0"), torch.cuda.synchronize("cuda:1")
            tt = []
            for _ in range(reps):
                t0 = time.perf_counter()
                t.to("cuda:1")
                torch.cuda.synchronize("cuda:1")
                tt.append(time.perf_counter() - t0)
            row["torch_gb_s"] = n * 2 / statistics.median(tt) / 1e9
            row["ratio"] = row["deviceop_gb_s"] / row["torch_gb_s"]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--items", type=int, default=2000)
    ap.add_argument("--small", type=int, default=512)
    ap.add_argument("--large", type=int, default=2048)
    ap.add_argument("--sizes-mib", default="1,16,256")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if len(do.devices()) < 2:
        raise SystemExit(f"needs two devices; this backend has {do.devices()} (host: DEVICEOP_HOST_DEVICES=2)")
    from exec_modes import machine_info

    doc = {
        "experiment": "multi_device",
        "machine": machine_info(),
        "queue": queue(a.items, a.small, a.large, a.reps),
        "copy": copies([float(v) for v in a.sizes_mib.split(",") if v], a.reps),
    }
    q = doc["queue"]
    print(
        f"queue over {len(q['devices'])} devices: {q['gemms_per_ms_all_devices']:.2f} GEMMs/ms against "
        f"{q['gemms_per_ms_one_device']:.2f} on one: {q['ratio']:.2f}x"
    )
    for r in doc["copy"]:
        ref = f"  torch {r['torch_gb_s']:.1f} GB/s, {r['ratio']:.2f}x" if "torch_gb_s" in r else ""
        print(f"copy {r['mib']:g} MiB: deviceop {r['deviceop_gb_s']:.1f} GB/s{ref}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
