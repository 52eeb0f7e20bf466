import cProfile, pstats, sys, time, io
sys.path.insert(0, "experiments")
import uvloop
import deviceop as do
from deviceop.executors import WorkQueue
from bimodal import Workload
w = Workload(2000, 8)
for batch in (8, 1):
    for S in (4,):
        q = WorkQueue(streams=S, capacity=4 * S, batch=batch); uvloop.run(q.run(w.items()))
        pr = cProfile.Profile()
        q = WorkQueue(streams=S, capacity=4 * S, batch=batch)
        pr.enable(); t0 = time.perf_counter(); c0 = time.process_time()
        uvloop.run(q.run(w.items()))
        t = time.perf_counter() - t0; c = time.process_time() - c0
        pr.disable()
        print(f"batch={batch} S={S}: {2000/t/1e3:.1f} WU/ms (profiled), cpu/WU {c/2000*1e6:.1f} us")
        out = io.StringIO(); pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(25); print(out.getvalue()[:6000])
