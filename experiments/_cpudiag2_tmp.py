import asyncio, sys, time
sys.path.insert(0, "experiments")
import deviceop as do
from deviceop._core import _reactor
from deviceop._core._op import start
from deviceop.executors._wake import dispatcher
from await_cost import spin_k
s = do.next_stream()
t = do.zeros(1024, do.float32).sync_on(s)
spin_k(t, 1000, grid=(1,), block=(32,)).sync_on(s)
cyc = int(0.2 * 1.98e9)
tt = time.thread_time
async def main():
    for rep in range(3):
        c = tt(); await asyncio.sleep(0.2); a = tt() - c
        c = tt(); op = spin_k(t, cyc, grid=(1,), block=(32,)); b = tt() - c
        c = tt(); cx, out = start(op, s, "await"); ev = cx.seal(); st = tt() - c
        d = dispatcher("asyncio"); tok = d.register(None)
        c = tt(); h = _reactor.arm(s, d.channel, tok); ar = tt() - c
        c = tt(); await asyncio.sleep(0.19); sl = tt() - c
        c = tt()
        while not _reactor.done(h):
            await asyncio.sleep(0)
        po = tt() - c
        c = tt(); _reactor.retire(h); cx.finish(); fi = tt() - c
        c = tt(); await spin_k(t, cyc, grid=(1,), block=(32,)).wait(stream=s); full = tt() - c
        c = tt(); w0 = time.perf_counter(); await asyncio.sleep(0.2); x = tt() - c
        print(f"sleep0.2 {a*1e6:.0f}us build {b*1e6:.0f} start+seal {st*1e6:.0f} arm {ar*1e6:.0f} sleep0.19 {sl*1e6:.0f} poll {po*1e6:.0f} finish {fi*1e6:.0f} | full await {full*1e6:.0f} us | sleep again {x*1e6:.0f}")
asyncio.run(main())
import uvloop
uvloop.run(main())
