import asyncio, sys, time
sys.path.insert(0, "experiments")
import deviceop as do
from deviceop._core import _reactor
from deviceop.executors import _await
from await_cost import spin_k
s = do.next_stream()
t = do.zeros(1024, do.float32).sync_on(s)
spin_k(t, 1000, grid=(1,), block=(32,)).sync_on(s)
cyc = int(0.2 * 1.98e9)
tt = time.thread_time
rec = []
orig_poll, orig_sow, orig_pw = _await._poll, _await._sleep_or_wake, _reactor.prewoken
async def poll(lib, done, budget, deadline):
    c = tt(); w = time.perf_counter(); r = await orig_poll(lib, done, budget, deadline)
    rec.append(("poll", round(budget * 1e6), r, round((tt() - c) * 1e6), round((time.perf_counter() - w) * 1e6)))
    return r
async def sow(lib, waker, limit):
    c = tt(); w = time.perf_counter(); r = await orig_sow(lib, waker, limit)
    rec.append(("sleep", round(limit * 1e6), r, round((tt() - c) * 1e6), round((time.perf_counter() - w) * 1e6)))
    return r
def pw(h):
    r = orig_pw(h); rec.append(("prewoken", r, _reactor.stats()["loop_lateness_s"])); return r
_await._poll, _await._sleep_or_wake = poll, sow
_reactor.prewoken = pw
async def main():
    for rep in range(5):
        rec.clear()
        c = tt(); w = time.perf_counter(); await spin_k(t, cyc, grid=(1,), block=(32,)).wait(stream=s); full = tt() - c
        print(f"full await cpu {full*1e6:.0f} us wall {(time.perf_counter()-w)*1e3:.2f} ms est {_reactor._estimates().get(s.handle_int)}")
        for r in rec: print("   ", r)
asyncio.run(main())
print(_reactor.stats())
