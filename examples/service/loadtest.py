"""Load test of the inference service: every variant of ``server.py`` under the same HTTP load.

One command starts one server process per variant (``--impls``), checks that they agree (the
same token ids through each; PyTorch's embeddings are the reference within float16 tolerance) and
then, in alternating rounds, loads each one from ``--procs`` client processes holding
``--clients`` connections in all (aiohttp, keep-alive, loopback), each sending requests back
to back for ``--seconds`` (closed loop: the saturated throughput), then under one offered load
for all (open loop, ``--rate``: by default 80 % of the best PyTorch variant's saturated
throughput, a request on a fixed schedule whatever is in flight). Each round prints a line per
variant and load; at the end a table gives each variant's medians over the closed-loop rounds:
requests per second, latency p50 / p99, the server's event-loop lag p99, its CPU time per
request (all its threads), errors and responses that differ from that server's first answer to
the same input, its ratio to the best PyTorch variant (with the lowest and highest ratio within
a round: how far the machine moved it) and, with the ``cached`` variant among
them (the server answering each distinct input from a dict: its HTTP work alone), its share of
that ceiling. ``--out`` writes every figure (the open-loop medians too) as JSON.

    python examples/service/loadtest.py                       # every variant, the full-size model
    python examples/service/loadtest.py --impls deviceop-batch,torch-blocking --seconds 5
    python examples/service/loadtest.py --width 64 --layers 2 --heads 4 --rows 8 --seconds 2 --rounds 1  # small

Without a GPU (the host backend) the defaults are a small configuration (the small model,
short rounds, fewer clients), so the command finishes within a minute; its figures show that
the service works, not what a GPU does. The model is a PyTorch module, so every variant needs
PyTorch; the variants that need CUDA are left out without it, and it says so.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import json
import multiprocessing
import os
import platform
import queue
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from server import CUDA_ONLY, IMPLS  # noqa: E402

#: how long a server may take to build its model and listen (the full-size model on a CPU
#: takes tens of seconds)
START_S = 600.0

GRACE_S = 1.0  # open loop: how long after the window an answer still counts in the latencies
VOCAB = 30522  # token ids are below it (model.VOCAB, not imported here: the load generator keeps off the GPU)


def _post(url: str, data: bytes = b"", timeout: float = 60) -> bytes:
    req = urllib.request.Request(url, data=data, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()  # type: ignore[no-any-return]


def _get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def start_server(
    impl: str, model_args: list[str], env: dict[str, str], profile: str | None = None
) -> tuple[subprocess.Popen[str], str]:
    """Start ``server.py --impl impl`` on a free port; returns the process and its base URL."""
    extra = ["--profile", f"{profile}.{impl}.prof"] if profile else []
    p = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "server.py"), "--impl", impl, "--port", "0", *model_args, *extra],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert p.stdout is not None
    out = p.stdout
    said: list[str] = []  # what it printed while starting (the model it builds, a no-GPU note)
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:  # (a thread: readline() has no timeout, and a server may hang)
        for got in iter(out.readline, ""):
            lines.put(got)
            if got.startswith("listening on "):
                return
        lines.put("")

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + START_S
    line = None
    while line is None or (line and not line.startswith("listening on ")):
        if line:
            said.append(line.strip())
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            p.kill()
            raise SystemExit(
                f"server {impl} did not listen within {START_S:.0f} s (it printed {said[-3:]!r})"
            ) from None
    if not line:
        p.kill()
        printed = f": it printed {said[-3:]!r}" if said else ""
        raise SystemExit(f"server {impl} did not start (exit {p.wait()}){printed}; its error is above (its stderr)")
    print(f"  {impl}: listening", flush=True)
    return p, f"http://127.0.0.1:{int(line.split()[-1])}"


def _client(
    url: str, inputs: list[bytes], digests: list[str], conns: int, t_start: float, t_end: float, rate: float
) -> dict:
    """One client process. ``rate`` 0 (closed loop): ``conns`` connections, each sending requests
    back to back. ``rate`` > 0 (open loop): a request every 1/rate seconds on a fixed schedule,
    whatever is in flight; its latency counts from its scheduled time, so a server that falls
    behind is charged for the wait. Only requests due within [t_start, t_end] count: in closed
    loop those answered by ``t_end``; in open loop also those answered within a second after it
    (in the latencies, not in ``in_window``), the rest counted as ``unanswered``."""
    import aiohttp

    async def run() -> dict:
        lat: list[float] = []
        errors = 0
        mismatches = 0
        unanswered = 0
        in_window = 0
        cpu0 = time.process_time()
        # at most ``conns`` connections, kept alive, in both loops: in the open loop a request due
        # while all are busy waits for one (charged to its latency), as behind a client's pool
        conn = aiohttp.TCPConnector(limit=conns)
        async with aiohttp.ClientSession(connector=conn) as session:

            async def one(i: int, due: float) -> None:
                """Send input ``i``; count the answer if it was due in the window (latency from
                ``due``: the send time, or in open loop the scheduled time), and answered in it
                (closed loop) or before it is cancelled (open loop)."""
                nonlocal errors, mismatches, unanswered, in_window
                try:
                    async with session.post(url + "/infer", data=inputs[i]) as resp:
                        body = await resp.read()
                        status = resp.status
                except aiohttp.ClientError:
                    status, body = 0, b""
                except asyncio.CancelledError:  # (open loop) still unanswered when the window closed
                    if due >= t_start:
                        unanswered += 1
                    raise
                t1 = time.time()
                if due < t_start or (not rate and t1 > t_end):
                    return
                if status != 200:
                    errors += 1
                elif hashlib.sha1(body).hexdigest() != digests[i]:
                    mismatches += 1
                else:
                    lat.append(t1 - due)
                    in_window += t1 <= t_end

            async def loop(k: int) -> None:  # closed loop: one connection's requests back to back
                i = k
                while (t0 := time.time()) < t_end:
                    i = (i + conns) % len(inputs)
                    await one(i, t0)

            async def schedule() -> None:
                tasks = set()
                due = t_start - 0.5  # a half second of the same load before the window
                k = 0
                while due < t_end:
                    await asyncio.sleep(max(0.0, due - time.time()))
                    t = asyncio.ensure_future(one(k % len(inputs), due))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
                    k += 1
                    due += 1.0 / rate
                # an answer within a second after the window closes counts in the latencies (not
                # in the throughput); what is still unanswered then is counted as such and
                # dropped, so that the next load does not wait for this one's backlog (the server
                # still finishes the requests it has read: aiohttp does not cancel its handlers)
                await asyncio.sleep(max(0.0, t_end + GRACE_S - time.time()))
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

            await asyncio.sleep(max(0.0, t_start - 0.5 - time.time()))
            if rate:
                await schedule()
            else:
                await asyncio.gather(*(loop(k) for k in range(conns)))
        return {
            "latencies": lat,
            "errors": errors,
            "mismatches": mismatches,
            "unanswered": unanswered,
            "in_window": in_window,
            "cpu_s": time.process_time() - cpu0,
        }

    return asyncio.run(run())


_POOLS: dict[int, Any] = {}  # the client processes by their number, started once and kept for every load


def load(
    url: str, inputs: list[bytes], digests: list[str], clients: int, procs: int, seconds: float, rate: float = 0.0
) -> dict:
    """``clients`` connections from ``procs`` processes for ``seconds`` (closed loop), or
    ``rate`` requests per second in all (open loop); the server's counters are reset when the
    window opens and read when it closes."""
    per = [clients // procs + (1 if k < clients % procs else 0) for k in range(procs)]
    # the client processes start (the first time) and connect before the window opens
    lead = 0.5 if procs in _POOLS else 2.0
    t_start = time.time() + lead
    t_end = t_start + seconds
    if procs not in _POOLS:
        _POOLS[procs] = multiprocessing.get_context("spawn").Pool(procs)
    pool = _POOLS[procs]
    active = [n for n in per if n]
    jobs = [pool.apply_async(_client, (url, inputs, digests, n, t_start, t_end, rate / len(active))) for n in active]
    time.sleep(max(0.0, t_start - time.time()))
    _post(url + "/reset")
    time.sleep(max(0.0, t_end - time.time()))
    server = _get_json(url + "/stats")
    parts = [j.get(timeout=seconds + 120) for j in jobs]
    lat = sorted(v for p in parts for v in p["latencies"])
    n = len(lat)
    in_window = sum(p["in_window"] for p in parts)
    # the server's own window: a loop blocked for most of it (an overloaded unbatched variant)
    # runs the reset late and no heartbeat, and its lag and CPU figures would mean nothing
    valid = server["heartbeats"] > 0 and server["seconds"] >= 0.9 * seconds
    per_req = lambda k: 1e6 * server[k] / max(1, server["requests"]) if valid else None  # noqa: E731
    per_s = lambda k: server[k] / server["seconds"] if valid else None  # noqa: E731
    return {
        "req_s": in_window / seconds,
        "latency_ms_p50": 1e3 * statistics.median(lat) if lat else None,
        "latency_ms_p99": 1e3 * lat[min(n - 1, int(0.99 * n))] if lat else None,
        "ok": n,
        "late": n - in_window,
        "errors": sum(p["errors"] for p in parts) + server["errors"],
        "mismatches": sum(p["mismatches"] for p in parts),
        "unanswered": sum(p["unanswered"] for p in parts),
        "server_window": valid,
        "lag_ms_p50": server["lag_ms_p50"] if valid else None,
        "lag_ms_p99": server["lag_ms_p99"] if valid else None,
        "lag_ms_max": server["lag_ms_max"] if valid else None,
        "server_cpu_us_per_req": per_req("cpu_s"),
        "server_cpu_cores": per_s("cpu_s"),
        "loop_cpu_us_per_req": per_req("loop_cpu_s"),
        "loop_cpu_cores": per_s("loop_cpu_s"),
        "client_cpu_cores": sum(p["cpu_s"] for p in parts) / (seconds + lead + 0.5 + (GRACE_S if rate else 0.0)),
        "server": server,
    }


def _f(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def describe(res: dict[str, Any]) -> str:
    """One load's line: throughput, latency, the server's loop lag and CPU, the counts."""
    line = (
        f"{res['req_s']:8.1f} req/s  p50 {_f(res['latency_ms_p50'], '7.2f')} ms  "
        f"p99 {_f(res['latency_ms_p99'], '7.2f')} ms  lag p99 {_f(res['lag_ms_p99'], '7.2f')} ms  "
        f"CPU {_f(res['server_cpu_us_per_req'], '7.1f')} us/req (loop {_f(res['loop_cpu_us_per_req'], '6.1f')}, "
        f"{_f(res['loop_cpu_cores'], '.2f')} cores)  errors {res['errors']}  mismatches {res['mismatches']}"
    )
    if res["late"] or res["unanswered"]:
        line += f"  late {res['late']}  unanswered {res['unanswered']}"
    if not res["server_window"]:
        line += "  (the server's loop was blocked through the window: no lag or CPU figures)"
    return line


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True, text=True
        )
        info["gpu"] = out.stdout.strip() or None
    except OSError:
        info["gpu"] = None
    return info


def _backend() -> str:
    """The backend deviceop chooses here, asked of a short-lived process: the load generator
    itself keeps no device context on the GPU it measures."""
    r = subprocess.run(
        [sys.executable, "-c", "import deviceop as do; print(do.backend_name())"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    return r.stdout.strip().rsplit("\n", 1)[-1] if r.returncode == 0 else "host"


def print_table(summary: dict[str, Any]) -> None:
    """The variants' medians over the rounds, one line each (``--out`` writes every figure)."""

    def f(x: float | None, spec: str) -> str:
        return format("-", ">" + spec.split(".")[0]) if x is None else format(x, spec)

    def spread(vs: dict[str, Any]) -> str:
        rs = vs.get("rounds") or []
        return f" (rounds {min(rs):.2f}-{max(rs):.2f}x)" if len(rs) > 1 else ""

    print(
        f"\n{'variant':<20} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'lag p99':>7} {'CPU µs/req':>10}"
        f" {'errors':>6} {'of cached':>9}  vs the best PyTorch variant"
    )
    for impl, m in summary.items():
        vs = m.get("vs_best_torch")
        print(
            f"{impl:<20} {f(m.get('req_s'), '8.0f')} {f(m.get('latency_ms_p50'), '7.2f')}"
            f" {f(m.get('latency_ms_p99'), '7.2f')} {f(m.get('lag_ms_p99'), '7.2f')}"
            f" {f(m.get('server_cpu_us_per_req'), '10.0f')} {m['errors'] + m['mismatches']:>6}"
            f" {f(m.get('of_ceiling'), '9.2f')}" + (f"  {vs['ratio']:.2f}x {vs['impl']}{spread(vs)}" if vs else "")
        )
    print(
        "(closed loop, medians over the rounds; rounds: the ratio within each round, lowest to highest; "
        "lag: the server loop's timer lateness; errors: failed or differing answers; of cached: the share "
        "of the cached variant's requests/s; --out has the rest)"
    )


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    finally:
        for pool in _POOLS.values():
            pool.terminate()
        _POOLS.clear()


def _main(argv: list[str] | None = None) -> int:
    # on a GPU the measured configuration; on the host backend a small one that finishes within a
    # minute (the encoder of BERT-base size takes tens of milliseconds a request on a CPU)
    backend = _backend()
    gpu = backend == "cuda"
    ap = argparse.ArgumentParser(description=" ".join((__doc__ or "").split("\n\n")[0].replace("``", "").split()))
    ap.add_argument("--impls", default="all", help=f"comma-separated, of {', '.join(IMPLS)}; all: those that can run")
    ap.add_argument("--seconds", type=float, default=10.0 if gpu else 1.0)
    ap.add_argument("--warmup", type=float, default=3.0 if gpu else 0.5)
    ap.add_argument("--rounds", type=int, default=3 if gpu else 1)
    ap.add_argument("--clients", type=int, default=64 if gpu else 16)
    ap.add_argument("--procs", type=int, default=4 if gpu else 2)
    ap.add_argument("--inputs", type=int, default=64 if gpu else 16, help="distinct requests, sent in turn")
    ap.add_argument("--rows", type=int, default=32 if gpu else 8, help="token ids of one request")
    ap.add_argument("--width", type=int, default=768 if gpu else 64, help="the encoder's width")
    ap.add_argument("--layers", type=int, default=12 if gpu else 2, help="the encoder's layers")
    ap.add_argument("--heads", type=int, default=12 if gpu else 4, help="attention heads")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--max-delay", type=float, default=0.001)
    ap.add_argument("--copies", type=int, default=4, help="recordings of the batched graph variants (server.py)")
    ap.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="offered load (requests/s) of the open-loop rounds; 0: 80%% of the best PyTorch variant's "
        "saturated throughput (of the slowest variant's without PyTorch); -1: no open-loop rounds",
    )
    ap.add_argument(
        "--server-warmup",
        type=int,
        default=32 if gpu else 4,
        metavar="N",
        help="rounds each server warms itself up with (0: none)",
    )
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--profile", default=None, help="profile each server's event loop into PREFIX.IMPL.prof")
    ap.add_argument(
        "--trace-stalls",
        type=float,
        default=0.0,
        metavar="MS",
        help="diagnostic: each server samples what holds its loop for MS ms or more (see server.py)",
    )
    a = ap.parse_args(argv)
    if not gpu:
        print(
            f"no GPU: the servers run on the {backend} backend (an emulated device) with a small "
            f"configuration (--width {a.width} --layers {a.layers} --seconds {a.seconds} --rounds {a.rounds} "
            f"--clients {a.clients}); its figures show that the service works, not what a GPU does",
            flush=True,
        )
    try:
        import torch
    except ImportError:
        raise SystemExit("the service's model is a PyTorch module (every variant runs it): pip install torch") from None
    if a.impls == "all":
        impls = list(IMPLS)
        if not torch.cuda.is_available():
            impls = [i for i in impls if i not in CUDA_ONLY]
            print(f"{', '.join(CUDA_ONLY)} are left out: they need a CUDA device for PyTorch", flush=True)
    else:
        impls = [i for i in a.impls.split(",") if i]
        bad = [i for i in impls if i not in IMPLS]
        if bad:
            ap.error(f"unknown --impls {bad}; choose from {', '.join(IMPLS)}")
    model_args = ["--rows", str(a.rows), "--width", str(a.width), "--layers", str(a.layers), "--heads", str(a.heads)]
    model_args += ["--max-batch", str(a.max_batch), "--max-delay", str(a.max_delay), "--copies", str(a.copies)]
    model_args += ["--warmup", str(a.server_warmup)]
    if a.trace_stalls:
        model_args += ["--trace-stalls", str(a.trace_stalls)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    # cuBLAS gives bitwise the same results run after run only with a fixed workspace when several
    # streams are active (NVIDIA's reproducibility note): every server, so that the check of
    # answers against each server's first answer holds for all of them
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if not gpu:
        env["DEVICEOP_BACKEND"] = "host"  # (said above, once: not again by every server)

    rng = np.random.default_rng(1)
    xs = [rng.integers(0, VOCAB, a.rows, dtype=np.int32) for _ in range(a.inputs)]
    inputs = [x.tobytes() for x in xs]
    print(f"starting {len(impls)} servers ({', '.join(impls)})...", flush=True)
    if a.profile:
        os.makedirs(os.path.dirname(os.path.abspath(a.profile)), exist_ok=True)  # (the servers write there at exit)
    servers = {impl: start_server(impl, model_args, env, a.profile) for impl in impls}
    doc: dict[str, Any] = {"experiment": "service", "machine": machine(), "config": vars(a), "impls": impls}
    try:
        # every server answers every input once: its digests (for the identity check) and its
        # agreement with the reference (PyTorch's answer if it runs, else the first server's)
        print("checking that they agree on every input...", flush=True)
        answers = {i: [_post(u + "/infer", b) for b in inputs] for i, (_, u) in servers.items()}
        ref_impl = next((i for i in impls if i.startswith("torch")), impls[0])
        ref = [np.frombuffer(b, np.float16).astype(np.float32) for b in answers[ref_impl]]
        doc["check"] = {"reference": ref_impl}
        for impl, bs in answers.items():
            got = [np.frombuffer(b, np.float16).astype(np.float32) for b in bs]
            err = max(float(np.max(np.abs(g - r)) / (np.max(np.abs(r)) + 1e-6)) for g, r in zip(got, ref))
            doc["check"][impl] = err
            if not err < 2e-2:
                raise SystemExit(f"{impl} disagrees with {ref_impl}: relative max error {err:.3g}")
        digests = {i: [hashlib.sha1(b).hexdigest() for b in bs] for i, bs in answers.items()}
        print(f"warm-up under load, {a.warmup} s each...", flush=True)
        for impl, (_, u) in servers.items():  # warm-up under load: pools, plans, graphs, allocators
            load(u, inputs, digests[impl], a.clients, a.procs, a.warmup)
        rows = []
        for r in range(a.rounds):
            for impl, (_, u) in servers.items():
                res = load(u, inputs, digests[impl], a.clients, a.procs, a.seconds)
                res.update(impl=impl, round=r)
                rows.append(res)
                print(f"round {r} {impl:<15} {describe(res)}", flush=True)
        doc["rounds"] = rows
        # open loop: every variant under the same offered load, below saturation, where a
        # service runs: latency from the scheduled send time, and the event loop's lag
        rate = a.rate
        if rate == 0:
            sat = {i: statistics.median(x["req_s"] for x in rows if x["impl"] == i) for i in impls}
            torch_sat = [v for i, v in sat.items() if i.startswith("torch")]
            rate = 0.8 * (max(torch_sat) if torch_sat else min(sat.values()))
        at_rate = []
        if rate > 0:
            doc["rate"] = rate
            for r in range(a.rounds):
                for impl, (_, u) in servers.items():
                    res = load(u, inputs, digests[impl], a.clients, a.procs, a.seconds, rate=rate)
                    res.update(impl=impl, round=r)
                    at_rate.append(res)
                    print(f"at {rate:.0f} req/s, round {r} {impl:<15} {describe(res)}", flush=True)
                    sv, sched, mc = (
                        res["server"],
                        res["server"].get("loop_sched", {}),
                        res["server"].get("machine_cpu", {}),
                    )
                    print(  # why the loop ran late: waiting for a CPU, the collector, the machine's load
                        f"    loop waited for a CPU {1e3 * sched.get('runq_wait_s', 0.0):.1f} ms, "
                        f"{sched.get('nonvoluntary', 0):.0f} involuntary switches; "
                        f"{sv['gc_collections']} collections (longest {sv['gc_pause_ms_max']:.2f} ms, "
                        f"{sv['gc_collected']} objects freed); machine busy "
                        f"{mc.get('busy_s', 0.0) / max(sv['seconds'], 1e-9):.2f} cores, "
                        f"stolen {mc.get('steal_s', 0.0):.2f} s",
                        flush=True,
                    )
        doc["at_rate"] = at_rate
    finally:
        for p, _ in servers.values():
            p.terminate()
        for p, _ in servers.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()

    keys = (
        "req_s",
        "latency_ms_p50",
        "latency_ms_p99",
        "lag_ms_p50",
        "lag_ms_p99",
        "server_cpu_us_per_req",
        "loop_cpu_us_per_req",
    )

    def medians(loads: list[dict[str, Any]]) -> dict[str, float]:
        """Each figure's median over the loads that have it (a server window can have none)."""
        out = {}
        for k in keys:
            vals = [x[k] for x in loads if x[k] is not None]
            if vals:
                out[k] = statistics.median(vals)
        return out

    summary: dict[str, Any] = {}
    for impl in impls:
        mine = [x for x in rows if x["impl"] == impl]
        summary[impl] = medians(mine)
        opened = [x for x in at_rate if x["impl"] == impl]
        if opened:
            summary[impl]["at_rate"] = medians(opened)
        summary[impl]["errors"] = sum(x["errors"] for x in mine + opened)
        summary[impl]["mismatches"] = sum(x["mismatches"] for x in mine + opened)
        if opened:  # (answered after the window, or not at all within a second of it: overloaded)
            summary[impl]["at_rate"]["late"] = sum(x["late"] for x in opened)
            summary[impl]["at_rate"]["unanswered"] = sum(x["unanswered"] for x in opened)

    def ratio(a: float, b: float) -> float | None:
        # (a variant that answered nothing in its windows, its loop blocked through them on an
        # overloaded machine, has no ratio to stand against: None, shown as "-")
        return a / b if b else None

    torch_impls = [i for i in impls if i.startswith("torch")]
    for impl in impls:
        if impl.startswith("deviceop") and torch_impls:
            best = max(torch_impls, key=lambda i: summary[i]["req_s"])
            r = ratio(summary[impl]["req_s"], summary[best]["req_s"])
            if r is not None:
                # and round by round: the two windows of a round are next to each other in time,
                # and their spread over rounds shows how far the machine moved the ratio
                by_round = {x["round"]: x["req_s"] for x in rows if x["impl"] == best}
                paired = [
                    ratio(x["req_s"], by_round[x["round"]])
                    for x in rows
                    if x["impl"] == impl and x["round"] in by_round
                ]
                summary[impl]["vs_best_torch"] = {
                    "impl": best,
                    "ratio": r,
                    "rounds": [q for q in paired if q is not None],
                }
            if "torch-blocking" in summary:
                summary[impl]["vs_torch_blocking"] = ratio(summary[impl]["req_s"], summary["torch-blocking"]["req_s"])
    if "cached" in summary:  # (the most the server's loop answers: its HTTP work alone)
        for impl in impls:
            if impl != "cached":
                summary[impl]["of_ceiling"] = ratio(summary[impl]["req_s"], summary["cached"]["req_s"])
    doc["summary"] = summary
    print_table(summary)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    bad = sum(s["errors"] + s["mismatches"] for s in summary.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
