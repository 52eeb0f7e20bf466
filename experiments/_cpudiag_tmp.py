"""Per-thread CPU while awaiting a ~200 ms GPU op, under each wait policy (diagnostic)."""
import asyncio, os, sys, time, json
sys.path.insert(0, "experiments")
import numpy as np
import deviceop as do
from deviceop._core import _reactor
from await_cost import spin_k

def threads():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            name = open(f"/proc/self/task/{tid}/comm").read().strip()
            ns = int(open(f"/proc/self/task/{tid}/schedstat").read().split()[0])
        except OSError:
            continue
        out[tid] = (name, ns)
    return out

s = do.next_stream()
t = do.zeros(1024, do.float32).sync_on(s)
spin_k(t, 1000, grid=(1,), block=(32,)).sync_on(s)
res = {}
for pol in ("adaptive", "block", "spin"):
    do.set_wait_policy(pol)
    async def main():
        rows = []
        for i in range(6):
            a = threads(); w0 = time.perf_counter()
            await spin_k(t, int(0.2 * 1.98e9), grid=(1,), block=(32,)).wait(stream=s)
            w = time.perf_counter() - w0; b = threads()
            per = {}
            for tid, (name, ns) in b.items():
                d = ns - a.get(tid, (name, 0))[1]
                if d > 0:
                    per[f"{name}:{tid}"] = round(d / 1e9 / w * 100, 3)
            rows.append(per)
        return rows
    rows = asyncio.run(main())
    res[pol] = rows
    print(pol, rows[-1], "total", round(sum(rows[-1].values()), 2), "%")
# sync_on for comparison
a = threads(); w0 = time.perf_counter()
spin_k(t, int(0.2 * 1.98e9), grid=(1,), block=(32,)).sync_on(s)
w = time.perf_counter() - w0; b = threads()
print("sync_on", {f"{n}:{tid}": round((ns - a.get(tid, (n, 0))[1]) / 1e9 / w * 100, 3) for tid, (n, ns) in b.items() if ns - a.get(tid, (n, 0))[1] > 0})
print(_reactor.stats())
