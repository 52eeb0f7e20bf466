"""Execution-mode overhead (paper Fig. 6, sync columns): per-op µs for N chained `scale` launches.

deviceop's `sync_on` per op and a `then`-chain with one sync (the chain is built inside the
timed region: building is part of the cost a user pays), beside raw cuda.bindings, CuPy,
PyTorch, cuda.core and a CUDA C++ program doing the same, all in one run. The ledger-off
variant measures the access ledger's cost per op. Writes JSON with the machine, versions and date.

    python benchmarks/exec_modes.py --reps 200 --out results.json [--chain-bin chain] [--graph-lib libgraphref.so]
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _refs
from _harness import description

import deviceop as do

N_ELEMS = 2048
G = 0.5


def measure_deviceop(n_ops: int, reps: int, warmup: int) -> list[dict]:
    K = do.kernels
    s = do.next_stream()
    x0 = np.full(N_ELEMS, 1.5, dtype=np.float16)
    x = do.from_numpy(x0).sync_on(s)
    y = do.zeros(N_ELEMS, do.float16).sync_on(s)
    yp = y.partition((128,))

    def step(o: tuple) -> do.DeviceOp:
        return K.scale(*o)

    def sync_each() -> None:
        for _ in range(n_ops):
            K.scale(yp, x, G).sync_on(s)

    def chained() -> None:
        op = K.scale(yp, x, G)
        for _ in range(n_ops - 1):
            op = op.then(step)
        op.sync_on(s)

    def chain_op() -> do.DeviceOp:
        op = K.scale(yp, x, G)
        for _ in range(n_ops - 1):
            op = op.then(step)
        return op

    g = chain_op().graph()  # recorded once, outside the timed region (as every graph column is)

    def graph() -> None:
        g.launch().sync_on(s)

    out = []
    for mode, fn in (("sync_each", sync_each), ("chained", chained), ("graph", graph)):
        samples = _refs._time_reps(fn, reps, warmup)
        out.append(_refs._summary("deviceop", mode, n_ops, samples, reps))
    out.extend(measure_await(n_ops, reps, warmup, yp, x, s))
    do.set_borrow_policy("off")
    try:
        samples = _refs._time_reps(chained, reps, warmup)
        out.append(_refs._summary("deviceop", "chained_ledger_off", n_ops, samples, reps))
    finally:
        do.set_borrow_policy("order")
    got = y.numpy()
    if not np.array_equal(got, (x0.astype(np.float32) * G).astype(np.float16)):
        raise AssertionError("deviceop scale produced wrong values")
    return out


def measure_await(n_ops: int, reps: int, warmup: int, yp: do.Partition, x: do.Tensor, s: object) -> list[dict]:
    """The async column (uvloop): ``await`` per op, and a ``then``-chain awaited once."""
    import uvloop

    K = do.kernels

    def step(o: tuple) -> do.DeviceOp:
        return K.scale(*o)

    async def await_each() -> None:
        for _ in range(n_ops):
            await K.scale(yp, x, G).wait(stream=s)

    async def chained_await() -> None:
        op = K.scale(yp, x, G)
        for _ in range(n_ops - 1):
            op = op.then(step)
        await op.wait(stream=s)

    async def run() -> list[dict]:
        res = []
        clock = time.perf_counter_ns
        for mode, fn in (("await_each", await_each), ("chained_await", chained_await)):
            for _ in range(warmup):
                await fn()
            samples = []
            for _ in range(reps):
                t = clock()
                await fn()
                samples.append(clock() - t)
            res.append(_refs._summary("deviceop", mode, n_ops, samples, reps))
        return res

    return uvloop.run(run())


def paired_chain(n_ops: int, reps: int, warmup: int) -> dict:
    """Raw cuda.bindings, deviceop and deviceop with the ledger off, interleaved rep by rep.

    The host's speed drifts over seconds on a shared machine; alternating the three in one loop
    gives each the same conditions, so the per-rep ratio is the robust figure.
    """
    from cuda.bindings import driver

    K = do.kernels
    st = _refs._raw_state()
    launch, sync = driver.cuLaunchKernel, driver.cuStreamSynchronize
    func, rstream, params = st.func, st.stream, st.params_ptr
    s = do.next_stream()
    x = do.from_numpy(np.full(N_ELEMS, 1.5, dtype=np.float16)).sync_on(s)
    y = do.zeros(N_ELEMS, do.float16).sync_on(s)
    yp = y.partition((128,))

    def raw() -> None:
        for _ in range(n_ops):
            launch(func, _refs.BLOCKS, 1, 1, _refs.THREADS, 1, 1, 0, rstream, params, 0)
        sync(rstream)

    def step(o: tuple) -> do.DeviceOp:
        return K.scale(*o)

    def dev() -> None:
        op = K.scale(yp, x, G)
        for _ in range(n_ops - 1):
            op = op.then(step)
        op.sync_on(s)

    def dev_off() -> None:
        do.set_borrow_policy("off")
        try:
            dev()
        finally:
            do.set_borrow_policy("order")

    fns = {"raw_bindings": raw, "deviceop": dev, "deviceop_ledger_off": dev_off}
    samples: dict[str, list[float]] = {k: [] for k in fns}
    clock = time.perf_counter_ns
    for r in range(warmup + reps):
        for name, fn in fns.items():
            t = clock()
            fn()
            dt = (clock() - t) / 1e3 / n_ops
            if r >= warmup:
                samples[name].append(dt)
    med = {k: float(np.median(v)) for k, v in samples.items()}
    ratio = [d / r for d, r in zip(samples["deviceop"], samples["raw_bindings"])]
    ledger = [a - b for a, b in zip(samples["deviceop"], samples["deviceop_ledger_off"])]
    return {
        "n_ops": n_ops,
        "reps": reps,
        "us_per_op_median": med,
        "deviceop_over_raw_median_of_ratios": float(np.median(ratio)),
        "deviceop_over_raw_ratio_of_medians": med["deviceop"] / med["raw_bindings"],
        "ledger_cost_us_per_op_median": float(np.median(ledger)),
    }


def paired_graph(
    n_ops: int, reps: int, warmup_s: float = 0.5, graph_lib: str | None = None, order: str = "shuffle"
) -> dict:
    """deviceop ``g.launch().sync_on(s)`` against raw cuda.bindings cuGraphLaunch + sync of the same
    N-kernel graph and, with ``graph_lib``, the CUDA C++ graph replay (benchmarks/ref/graph_ref.cu
    built as a shared library), interleaved rep by rep after a time-based warm-up.

    A graph of N small kernels runs at the GPU's node rate, which follows its clock state; the
    state changes over seconds (the same graph replays 18 % slower or faster), so only replays
    interleaved in one process compare like with like.

    ``order``: ``"shuffle"`` (the default) runs the columns of each rep in a random order (a
    fixed seed), so each column follows each other column about equally often; ``"fixed"`` runs
    them in one order every rep (raw, deviceop, raw on deviceop's graph, C++), as this
    experiment did before. A replay's time depends on what ran just before it: in one fixed
    order, a column that always follows the same other column carries that neighbour's effect.
    The result gives each column's median by the column that ran just before it
    (``us_per_op_median_after``) to show that effect.
    """
    from cuda.bindings import driver

    K = do.kernels
    st = _refs._raw_state()
    gexec = st.graph_exec(n_ops)
    glaunch, sync, rstream = driver.cuGraphLaunch, driver.cuStreamSynchronize, st.stream
    s = do.next_stream()
    x = do.from_numpy(np.full(N_ELEMS, 1.5, dtype=np.float16)).sync_on(s)
    y = do.zeros(N_ELEMS, do.float16).sync_on(s)
    op = K.scale(y.partition((128,)), x, G)
    for _ in range(n_ops - 1):
        op = op.then(lambda o: K.scale(*o))
    g = op.graph()
    clock = time.perf_counter_ns

    def raw() -> float:
        t = clock()
        glaunch(gexec, rstream)
        sync(rstream)
        return (clock() - t) / 1e3

    def dev() -> float:
        t = clock()
        g.launch().sync_on(s)
        return (clock() - t) / 1e3

    # deviceop's own executable graph launched through raw cuda.bindings on deviceop's stream:
    # separates deviceop's host cost per replay (deviceop over this) from what its recorded
    # graph and its kernels cost on the GPU (this over raw_bindings)
    own_exec, own_stream = driver.CUgraphExec(g._exec.handle_int), driver.CUstream(s.handle_int)

    def raw_own() -> float:
        t = clock()
        glaunch(own_exec, own_stream)
        sync(own_stream)
        return (clock() - t) / 1e3

    fns = {"raw_bindings": raw, "deviceop": dev, "raw_bindings_deviceop_graph": raw_own}
    check_cpp = None
    if graph_lib:
        fns["cuda_cpp"], check_cpp = cpp_graph_replay(graph_lib, n_ops)
    warm_up(fns, warmup_s)
    # the Python columns are timed around the call from Python, so each includes one read of
    # the clock from Python (the C++ column reads steady_clock inside C++): that read's own
    # cost, measured here, is taken off the Python columns
    timer_us = clock_read_us()
    samples, after = interleave(fns, reps, order, {"cuda_cpp": 0.0}, timer_us, n_ops)
    names = list(fns)
    if not np.array_equal(y.numpy(), np.full(N_ELEMS, 0.75, np.float16)):
        raise AssertionError("deviceop graph replay produced wrong values")
    if check_cpp is not None and not check_cpp():
        raise AssertionError("the C++ graph replay produced wrong values")
    med = {k: float(np.median(v)) for k, v in samples.items()}
    out = {
        "n_ops": n_ops,
        "reps": reps,
        "order": order,
        "python_timer_us": timer_us,
        "us_per_op_median": med,
        "us_per_op_median_after": {
            k: {j: round(float(np.median(v)), 4) for j, v in after[k].items() if v} for k in names
        },
        "deviceop_over_raw_median_of_ratios": _ratio(samples, "raw_bindings"),
    }
    out["deviceop_over_raw_own_graph"] = _ratio(samples, "raw_bindings_deviceop_graph")
    out["raw_own_graph_over_raw"] = float(
        np.median([o / r for o, r in zip(samples["raw_bindings_deviceop_graph"], samples["raw_bindings"])])
    )
    if check_cpp is not None:
        out["deviceop_over_cuda_cpp_in_process"] = _ratio(samples, "cuda_cpp")
        out["raw_over_cuda_cpp_in_process"] = float(
            np.median([r / c for r, c in zip(samples["raw_bindings"], samples["cuda_cpp"])])
        )
    return out


def cpp_graph_replay(graph_lib: str, n_ops: int) -> tuple[Callable[[], float], Callable[[], bool]]:
    """The in-process CUDA C++ replay of an ``n_ops``-kernel graph (benchmarks/ref/graph_ref.cu
    built as ``graph_lib``): ``(replay, check)``. ``replay()`` launches it once and synchronizes,
    timed inside C++ (steady_clock, as chain.cu times itself), in µs; ``check()`` says whether
    its output is right (proof that the replays ran)."""
    lib = ctypes.CDLL(graph_lib)
    lib.ref_replay_us.restype = ctypes.c_double
    if lib.ref_setup(n_ops) != 0:
        raise RuntimeError(f"{graph_lib}: ref_setup({n_ops}) failed")
    replay_us = lib.ref_replay_us

    def replay() -> float:
        us = replay_us(n_ops)
        if us < 0:
            raise RuntimeError(f"{graph_lib}: replay failed ({us})")
        return float(us)

    return replay, lambda: bool(lib.ref_check() == 1)


def warm_up(fns: dict, seconds: float) -> None:
    """Run every function of ``fns`` in turn for about ``seconds``."""
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        for fn in fns.values():
            fn()


def clock_read_us() -> float:
    """The median cost of one ``time.perf_counter_ns()`` read from Python, in µs."""
    reads = []
    for _ in range(2000):
        t0 = time.perf_counter_ns()
        reads.append(time.perf_counter_ns() - t0)
    return float(np.median(reads)) / 1e3


def interleave(
    fns: dict, reps: int, order: str, offsets: dict[str, float], default_offset: float, per: int
) -> tuple[dict[str, list[float]], dict[str, dict[str, list[float]]]]:
    """Run every function of ``fns`` once per rep, ``reps`` times; each returns µs. A sample is
    ``(fn() - offset) / per`` (``offsets`` by name, else ``default_offset``). ``order``:
    ``"shuffle"``, a random order each rep (seeded by ``per``), or ``"fixed"``, the dict's order.
    Returns the samples by name, and by name the samples by the function that ran just before."""
    if order not in ("shuffle", "fixed"):
        raise ValueError(f"order must be 'shuffle' or 'fixed', not {order!r}")
    names = list(fns)
    rng = random.Random(per)
    samples: dict[str, list[float]] = {k: [] for k in names}
    after: dict[str, dict[str, list[float]]] = {k: {j: [] for j in names if j != k} for k in names}
    prev = names[-1]
    for _ in range(reps):
        for name in rng.sample(names, len(names)) if order == "shuffle" else names:
            us = (fns[name]() - offsets.get(name, default_offset)) / per
            samples[name].append(us)
            if prev != name:
                after[name][prev].append(us)
            prev = name
    return samples, after


def _ratio(samples: dict[str, list[float]], ref: str) -> float:
    """Median over reps of deviceop's time over ``ref``'s in the same rep."""
    return float(np.median([d / r for d, r in zip(samples["deviceop"], samples[ref])]))


def graph_update_cost(n_ops: int, reps: int) -> dict:
    """Re-pointing an N-kernel graph at other buffers: update in place vs record + instantiate.

    Both include building the op chain and recording it (what a user pays either way).
    """
    K = do.kernels
    s = do.next_stream()
    xs = [do.from_numpy(np.full(N_ELEMS, 1.5, dtype=np.float16)).sync_on(s) for _ in range(2)]
    ys = [do.zeros(N_ELEMS, do.float16).sync_on(s) for _ in range(2)]

    def chain_op(i: int) -> do.DeviceOp:
        op = K.scale(ys[i].partition((128,)), xs[i], G)
        for _ in range(n_ops - 1):
            op = op.then(lambda o: K.scale(*o))
        return op

    g = chain_op(0).graph()
    clock = time.perf_counter_ns
    upd, new, rec = [], [], []
    for r in range(reps + 2):
        t = clock()
        how = g.update(chain_op(r % 2))
        t1 = clock()
        g2 = chain_op(r % 2).graph()
        t2 = clock()
        with do.graph.scope(update=g2) as sc:  # recording alone: the update's lower bound
            sc.record(chain_op(r % 2))
            t3 = clock()
        if how != "updated":
            raise AssertionError(f"same-structure update was {how}")
        if r >= 2:
            upd.append((t1 - t) / 1e3)
            new.append((t2 - t1) / 1e3)
            rec.append((t3 - t2) / 1e3)
        g.launch().sync_on(s)
        g2.launch().sync_on(s)
    med = {
        "update_us": float(np.median(upd)),
        "record_and_instantiate_us": float(np.median(new)),
        "record_only_us": float(np.median(rec)),
    }
    return {
        "n_ops": n_ops,
        "reps": reps,
        **med,
        "update_over_instantiate": med["update_us"] / med["record_and_instantiate_us"],
    }


def host_probe() -> float:
    """The time of a fixed piece of Python (10,000 calls of a small function, best of 7), µs:
    the host's speed now. On a virtual machine it moves (``cpu_speed.py`` shows by how much), and
    host-bound figures (the one-thread queues) move with it."""

    def f(x: int) -> int:
        return x + 1

    best = float("inf")
    for _ in range(7):
        t = time.perf_counter()
        for i in range(10000):
            f(i)
        best = min(best, time.perf_counter() - t)
    return best * 1e6


def host_cpu() -> tuple[str, float]:
    """The host CPU's model name, and :func:`host_probe`."""
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return model, host_probe()


def machine_info() -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "backend": do.backend_name(),
        "deviceop": do.__version__,
    }
    info["cpu"], info["host_probe_us"] = host_cpu()
    be = do._current()
    info["device"] = be.device_name
    info["driver"] = be.driver_version
    try:
        import importlib.metadata as md

        for pkg in ("cuda-bindings", "cupy-cuda13x", "torch", "numpy"):
            try:
                info[pkg] = md.version(pkg)
            except md.PackageNotFoundError:
                pass
    except Exception:
        pass
    return info


def ratios(results: list[dict]) -> list[dict]:
    """deviceop / reference per-op medians, same mode and N."""
    idx = {(r["impl"], r["mode"], r["n_ops"]): r["us_per_op_median"] for r in results}
    out = []
    for (impl, mode, n), v in sorted(idx.items()):
        if impl != "deviceop":
            continue
        base_mode = "chained" if mode.startswith("chained") else "sync_each" if mode == "await_each" else mode
        for ref in ("raw_bindings", "cuda_cpp", "cupy", "torch"):
            b = idx.get((ref, base_mode, n))
            if b:
                out.append({"mode": mode, "n_ops": n, "vs": ref, "ratio": v / b})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--sizes", default="1,10,100,1000")
    ap.add_argument("--impls", default="raw_bindings,cupy,torch,cuda_core")
    ap.add_argument("--chain-bin", default=None)
    ap.add_argument(
        "--graph-lib",
        default=None,
        help="libgraphref.so (benchmarks/ref/graph_ref.cu) for the in-process C++ graph column",
    )
    ap.add_argument(
        "--graphs-only",
        action="store_true",
        help="only the paired graph replays (deviceop, raw cuda.bindings, the in-process C++ library)",
    )
    ap.add_argument(
        "--graph-order",
        choices=("shuffle", "fixed"),
        default="shuffle",
        help="the paired graph replays' order in each rep: random (seeded; the default) or fixed",
    )
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    sizes = [int(v) for v in a.sizes.split(",")]
    if a.graphs_only:
        graphs = [paired_graph(n, max(a.reps, 300), graph_lib=a.graph_lib, order=a.graph_order) for n in sizes]
        for p in graphs:
            print(json.dumps(p))
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"experiment": "exec_modes", "machine": machine_info(), "paired_graph": graphs}, f, indent=1)
        return 0
    results: list[dict] = []
    failed = []
    for n in sizes:  # deviceop and references interleaved per N, in one process
        t0 = time.perf_counter()
        results.extend(measure_deviceop(n, a.reps, a.warmup))
        for name in [v for v in a.impls.split(",") if v]:
            try:
                results.extend(_refs.IMPLS[name](n, a.reps, a.warmup))
            except ImportError as e:
                print(f"[{name}] skipped: {e}", file=sys.stderr)
            except Exception as e:
                print(f"[{name}] FAILED: {e!r}", file=sys.stderr)
                failed.append(name)
        print(f"N={n} done in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    paired = []
    for n in sizes:
        paired.append(paired_chain(n, a.reps, a.warmup))
        print(json.dumps(paired[-1]), file=sys.stderr)
    graphs = []
    for n in sizes:
        # at least 300 reps: a graph pair is cheap, and its median moves with the GPU clock state
        graphs.append(paired_graph(n, max(a.reps, 300), graph_lib=a.graph_lib, order=a.graph_order))
        print(json.dumps(graphs[-1]), file=sys.stderr)
    if a.chain_bin:
        results.extend(r for r in _refs.run_chain_bin(a.chain_bin, a.reps) if r["n_ops"] in sizes)
        cpp = {r["n_ops"]: r["us_per_op_median"] for r in results if r["impl"] == "cuda_cpp" and r["mode"] == "graph"}
        for p in graphs:
            if p["n_ops"] in cpp:
                p["cuda_cpp_us_per_op_median"] = cpp[p["n_ops"]]
                p["deviceop_over_cuda_cpp"] = p["us_per_op_median"]["deviceop"] / cpp[p["n_ops"]]
    update = graph_update_cost(max(sizes), max(10, min(a.reps, 50)))
    doc = {
        "experiment": "exec_modes",
        "elements": N_ELEMS,
        "machine": machine_info(),
        "results": results,
        "ratios": ratios(results),
        "paired_chained": paired,
        "paired_graph": graphs,
        "graph_update": update,
    }
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    _refs._print_table(results, sizes)
    for r in doc["ratios"]:
        if r["vs"] == "raw_bindings" or (r["mode"] == "graph" and r["vs"] == "cuda_cpp"):
            print(f"deviceop {r['mode']:<20} N={r['n_ops']:<5} {r['ratio']:.3f}x {r['vs']}")
    print("paired graph replays (interleaved with raw cuda.bindings and the in-process C++ library after a warm-up):")
    for p in graphs:
        m = p["us_per_op_median"]
        cpp_s = (
            f"  C++ binary {p['cuda_cpp_us_per_op_median']:.3f} -> {p['deviceop_over_cuda_cpp']:.3f}x"
            if "deviceop_over_cuda_cpp" in p
            else ""
        )
        if "cuda_cpp" in m:
            cpp_s += f"  C++ in-process {m['cuda_cpp']:.3f} -> {p['deviceop_over_cuda_cpp_in_process']:.3f}x C++"
        print(
            f"  N={p['n_ops']:<5} raw {m['raw_bindings']:.3f}  deviceop {m['deviceop']:.3f} us/op -> "
            f"{p['deviceop_over_raw_median_of_ratios']:.3f}x raw{cpp_s}"
        )
        print(
            f"         deviceop's graph through raw cuda.bindings {m['raw_bindings_deviceop_graph']:.3f} us/op: "
            f"deviceop {p['deviceop_over_raw_own_graph']:.3f}x it (host cost), it {p['raw_own_graph_over_raw']:.3f}x raw (graph)"
        )
    print(
        f"graph update, N={update['n_ops']}: update in place {update['update_us']:.0f} us, record + instantiate "
        f"{update['record_and_instantiate_us']:.0f} us, record alone {update['record_only_us']:.0f} us "
        f"({update['update_over_instantiate']:.2f}x)"
    )
    print("paired (interleaved rep by rep), chained:")
    for p in paired:
        m = p["us_per_op_median"]
        print(
            f"  N={p['n_ops']:<5} raw {m['raw_bindings']:.2f}  deviceop {m['deviceop']:.2f}  ledger-off {m['deviceop_ledger_off']:.2f} us/op"
            f"  -> {p['deviceop_over_raw_median_of_ratios']:.3f}x raw; ledger {p['ledger_cost_us_per_op_median']:+.2f} us/op"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
