import asyncio, cProfile, pstats, sys, time
sys.path.insert(0, "experiments")
import uvloop
import deviceop as do
from await_cost import spin_k
do.set_wait_policy(sys.argv[1])
s = do.streams()[0]
t = do.zeros(1024, do.float32).sync_on(s)
cyc = int(0.2 * 1.98e9)
async def main():
    for i in range(3):
        await spin_k(t, cyc, grid=(1,), block=(32,)).wait(stream=s)
    pr = cProfile.Profile(); pr.enable()
    c0 = time.process_time(); w0 = time.perf_counter()
    for i in range(3):
        await spin_k(t, cyc, grid=(1,), block=(32,)).wait(stream=s)
    pr.disable()
    print(sys.argv[1], "cpu", (time.process_time()-c0)/(time.perf_counter()-w0))
    pstats.Stats(pr).sort_stats("tottime").print_stats(8)
    c0 = time.process_time()
    for i in range(20):
        op = spin_k(t, 10, grid=(1,), block=(32,))
    print("build us", (time.process_time()-c0)/20*1e6)
uvloop.run(main())
