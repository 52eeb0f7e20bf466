"""An HTTP embedding service (aiohttp on uvloop) whose handler runs the embedding model of
``model.py`` (a transformer encoder).

``POST /infer`` takes a request's ``rows`` token ids (int32) as raw bytes and answers its
embedding (``width`` float16 values) the same way. ``--impl`` picks how the handler runs the GPU
work:

  deviceop-batch      ``await batcher(x)``: concurrent requests gathered into one op (Batcher),
                      padded to ``--max-batch`` and replayed from the model recorded into a
                      CUDA graph (``do.interop.torch_graphs``, ``--copies`` recordings, one
                      batch at a time each)
  deviceop            ``await model.request(x)``: one op per request (``do.interop.torch``)
  torch-batch         the same padded batches behind the example's MicroBatcher, the batch run
                      in the handler, ``.cpu()`` blocking the event loop
  torch-batch-thread  the same, each batch run in ``asyncio.to_thread``
  torch-batch-graphs  the same, each batch a replay of PyTorch's own CUDA graph of the padded
                      batch (``torch.cuda.graph``, ``--copies`` captures on their own streams,
                      one batch at a time each; CUDA only), its copies through page-locked
                      memory without blocking, the loop polling an event meanwhile
  torch-blocking      PyTorch per request in the handler, ``.cpu()`` blocking the event loop
  torch-thread        ``await asyncio.to_thread(...)`` of the blocking PyTorch request
  torch-streams       PyTorch per request on a pool of streams, the result copied to pinned
                      memory, an event recorded and polled (every ``--poll`` seconds)
  cached              no model per request: each distinct input's embedding computed once
                      (PyTorch, blocking) and answered from a dict afterwards, the most
                      requests this server's loop answers (its HTTP work and checks alone;
                      the handler never suspends), a ceiling for every variant

``GET /stats`` reports, since the last ``POST /reset``: requests, the process's CPU seconds (all
threads) and the event loop thread's alone, how long that thread waited runnable for a CPU and
its context switches, the machine's busy and stolen CPU time, deviceop's await counters, the
event loop's lag (a heartbeat timer every 5 ms; lag is how late it fires), the garbage
collector's pauses (by generation, with the objects they freed) and the batchers' counters (and, with ``--trace-stalls MS``, what the loop's thread
was running whenever the loop had not run for MS ms). After start-up the server warms itself up
(``--warmup`` rounds of concurrent requests) and calls ``gc.freeze()`` (``--no-gc-freeze``
leaves it out), as services do, for every variant. The server prints ``listening on PORT`` once
it accepts requests.

    python examples/service/server.py --impl deviceop-batch --port 8080

Without a GPU (the host backend) the model's defaults are a small configuration, and the server
says so.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import os
import signal
import socket
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from aiohttp import web

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

IMPLS = (
    "deviceop-batch",
    "deviceop",
    "torch-batch",
    "torch-batch-thread",
    "torch-batch-graphs",
    "torch-blocking",
    "torch-thread",
    "torch-streams",
    "cached",
)
#: the variants that need a CUDA device
CUDA_ONLY = ("torch-batch-graphs", "torch-streams")
HEARTBEAT_S = 0.005


def await_counts() -> dict[str, int]:
    """deviceop's await counters (awaits, parks, polls), where deviceop is loaded."""
    m = sys.modules.get("deviceop._core._completion")
    return m.stats() if m is not None else {}


def thread_sched() -> dict[str, float]:
    """The calling thread's scheduling so far, where Linux reports it (else empty): seconds it
    waited runnable for a CPU (``schedstat``), and its voluntary and involuntary switches."""
    out: dict[str, float] = {}
    try:
        with open("/proc/thread-self/schedstat") as f:
            out["runq_wait_s"] = int(f.read().split()[1]) / 1e9
        with open("/proc/thread-self/status") as f:
            for line in f:
                if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                    k, v = line.split(":")
                    out[k.split("_")[0]] = float(v)
    except (OSError, IndexError, ValueError):
        pass
    return out


def machine_cpu() -> dict[str, float]:
    """The machine's CPU time so far, all CPUs, seconds (``/proc/stat``; empty where unknown):
    busy (user, system, interrupts) and stolen (given by the hypervisor to others while this
    machine's CPUs wanted it)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) / os.sysconf("SC_CLK_TCK") for x in f.readline().split()[1:9]]
    except (OSError, IndexError, ValueError):
        return {}
    return {"busy_s": v[0] + v[1] + v[2] + v[5] + v[6], "steal_s": v[7]}


class Stats:
    """What /stats reports: requests, CPU time and the event loop's lag since the last reset."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.gc_pauses: list[float] = []
        self.gc_generations: list[int] = []
        self.gc_collected = 0
        self.requests = 0
        self.errors = 0
        self.cpu0 = time.process_time()
        self.loop_cpu0 = time.thread_time()  # (reset and report run on the loop's thread)
        self.sched0 = thread_sched()
        self.machine0 = machine_cpu()
        self.awaits0 = await_counts()
        self.t0 = time.perf_counter()
        self.lag: list[float] = []
        self.stalls: Counter[str] = Counter()
        self.tick = time.perf_counter()

    def report(self, extra: dict[str, Any]) -> dict[str, Any]:
        lag = sorted(self.lag) or [0.0]
        return {
            "requests": self.requests,
            "errors": self.errors,
            "seconds": time.perf_counter() - self.t0,
            "cpu_s": time.process_time() - self.cpu0,
            "loop_cpu_s": time.thread_time() - self.loop_cpu0,
            "loop_sched": {k: v - self.sched0.get(k, 0.0) for k, v in thread_sched().items()},
            "machine_cpu": {k: v - self.machine0.get(k, 0.0) for k, v in machine_cpu().items()},
            "lag_ms_p50": 1e3 * statistics.median(lag),
            "lag_ms_p99": 1e3 * lag[min(len(lag) - 1, int(0.99 * len(lag)))],
            "lag_ms_max": 1e3 * lag[-1],
            "heartbeats": len(self.lag),
            "awaits": {k: v - self.awaits0.get(k, 0) for k, v in await_counts().items()},
            "gc_collections": len(self.gc_pauses),
            "gc_pause_ms_max": 1e3 * max(self.gc_pauses, default=0.0),
            "gc_pause_ms_total": 1e3 * sum(self.gc_pauses),
            "gc_by_generation": dict(sorted(Counter(self.gc_generations).items())),
            "gc_collected": self.gc_collected,
            **({"stalls": dict(self.stalls.most_common(12))} if self.stalls else {}),
            **extra,
        }


async def heartbeat(stats: Stats) -> None:
    """How late a 5 ms timer fires: the delay any ready callback of this loop waits."""
    while True:
        t = time.perf_counter()
        await asyncio.sleep(HEARTBEAT_S)
        stats.lag.append(max(0.0, time.perf_counter() - t - HEARTBEAT_S))


async def ticker(stats: Stats) -> None:
    """Marks the loop as running about every millisecond (for the stall sampler)."""
    while True:
        stats.tick = time.perf_counter()
        await asyncio.sleep(0.0005)


def sample_stalls(stats: Stats, threshold: float) -> None:
    """A thread that, whenever the loop has not ticked for ``threshold`` seconds, counts what the
    loop's thread is running (its innermost Python frames): what holds the loop. Diagnostic
    only: the sampler takes the GIL every ``threshold / 2`` seconds."""
    main = threading.get_ident()

    def run() -> None:
        while True:
            time.sleep(threshold / 2)
            if time.perf_counter() - stats.tick < threshold:
                continue
            f = sys._current_frames().get(main)
            stack = []
            while f is not None and len(stack) < 8:
                stack.append(f"{os.path.basename(f.f_code.co_filename)}:{f.f_code.co_name}:{f.f_lineno}")
                f = f.f_back
            stats.stalls[" < ".join(stack)] += 1

    threading.Thread(target=run, name="stall-sampler", daemon=True).start()


def make_infer(a: argparse.Namespace) -> tuple[Callable[[np.ndarray], Awaitable[np.ndarray]], Callable[[], dict]]:
    """The handler's GPU step for ``--impl``, and a function giving its counters."""
    if a.impl.startswith("deviceop"):
        from model import DeviceopModel

        import deviceop as do

        m = DeviceopModel(a.width, a.layers, a.heads, a.rows)
        if a.impl == "deviceop":

            async def infer(x: np.ndarray) -> np.ndarray:
                return await m.request(x)

            return infer, lambda: {"backend": do.backend_name()}
        batcher = m.batched(a.max_batch, a.max_delay, a.copies)

        async def infer_batched(x: np.ndarray) -> np.ndarray:
            return await batcher(x)

        return infer_batched, lambda: {
            "backend": do.backend_name(),
            "batcher": batcher.stats(),
            "graph_cache": m.cache.stats(),
        }

    import torch
    from model import MicroBatcher, TorchModel

    tm = TorchModel(a.width, a.layers, a.heads, a.rows)
    if a.impl == "cached":
        answers: dict[bytes, np.ndarray] = {}

        async def infer_cached(x: np.ndarray) -> np.ndarray:
            k = x.tobytes()
            y = answers.get(k)
            if y is None:  # (the first time an input is seen: the model, blocking)
                y = answers[k] = tm.request(x.copy())
            return y

        return infer_cached, lambda: {"backend": "torch-" + tm.device, "cached": len(answers)}
    if a.impl in CUDA_ONLY and tm.device != "cuda":
        raise SystemExit(f"{a.impl} needs a CUDA device")
    if a.impl.startswith("torch-batch"):
        concurrent = 1
        if a.impl == "torch-batch-graphs":
            run = tm.graphed(a.rows, a.max_batch, a.poll, a.copies)
            concurrent = a.copies
        elif a.impl == "torch-batch-thread":
            concurrent = 2  # (a batch's host work beside the previous one's GPU work)

            async def run(xs: list[np.ndarray]) -> list[np.ndarray]:
                return await asyncio.to_thread(tm.run_batch, xs, a.max_batch)

        else:

            async def run(xs: list[np.ndarray]) -> list[np.ndarray]:
                return tm.run_batch(xs, a.max_batch)

        mb = MicroBatcher(run, a.max_batch, a.max_delay, concurrent)

        async def infer_micro(x: np.ndarray) -> np.ndarray:
            return await mb(x.copy())

        return infer_micro, lambda: {
            "backend": "torch-" + tm.device,
            "batches": mb.batches,
            "mean_batch": mb.requests / max(1, mb.batches),
        }
    info = lambda: {"backend": "torch-" + tm.device}  # noqa: E731
    if a.impl == "torch-blocking":

        async def infer_blocking(x: np.ndarray) -> np.ndarray:
            return tm.request(x.copy())

        return infer_blocking, info
    if a.impl == "torch-thread":

        async def infer_thread(x: np.ndarray) -> np.ndarray:
            return await asyncio.to_thread(tm.request, x.copy())

        return infer_thread, info
    streams = [torch.cuda.Stream() for _ in range(a.streams)]
    turn = itertools.count()

    async def infer_streams(x: np.ndarray) -> np.ndarray:
        s = streams[next(turn) % len(streams)]
        with torch.cuda.stream(s):
            y = tm.work(x.copy())
            out = torch.empty(y.shape, dtype=y.dtype, pin_memory=True)
            out.copy_(y, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(s)
        while not ev.query():
            await asyncio.sleep(a.poll)
        return out.numpy()

    return infer_streams, info


def watch_gc(stats: Stats) -> None:
    """Time every collection of the garbage collector (a pause of the event loop's thread)."""
    started = [0.0]

    def cb(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            stats.gc_pauses.append(time.perf_counter() - started[0])
            stats.gc_generations.append(info["generation"])
            stats.gc_collected += info["collected"]

    gc.callbacks.append(cb)


async def serve(
    a: argparse.Namespace,
    infer: Callable[[np.ndarray], Awaitable[np.ndarray]],
    counters: Callable[[], dict],
) -> None:
    if a.warmup:
        # before traffic, as services warm up: every graph copy recorded, pools and staging
        # blocks filled; what this makes then lives as long as the process (and is frozen below)
        x = np.zeros(a.rows, np.int32)
        for _ in range(a.warmup):
            await asyncio.gather(*(infer(x) for _ in range(a.max_batch)))
    stats = Stats()
    watch_gc(stats)
    if a.gc_freeze:
        # what the process holds after start-up and warm-up (modules, the model, recorded graphs)
        # is never collected again: the collector's full passes then walk only what requests made
        gc.collect()
        gc.freeze()
    from model import VOCAB

    nbytes = a.rows * 4

    async def handle_infer(request: web.Request) -> web.Response:
        body = await request.read()
        if len(body) != nbytes:
            stats.errors += 1
            return web.Response(status=400, text=f"expected {nbytes} bytes ({a.rows} int32 token ids)")
        x = np.frombuffer(body, np.int32)
        if x.min() < 0 or x.max() >= VOCAB:
            stats.errors += 1
            return web.Response(status=400, text=f"token ids are 0 to {VOCAB - 1}")
        try:
            y = await infer(x)
        except Exception as e:  # a failed request answers 500 and is counted; the service goes on
            stats.errors += 1
            return web.Response(status=500, text=f"{type(e).__name__}: {e}")
        stats.requests += 1
        return web.Response(body=y.tobytes(), content_type="application/octet-stream")

    async def handle_reset(request: web.Request) -> web.Response:
        stats.reset()
        if a.profile:
            restart_profile()
        return web.Response(text="ok")

    async def handle_stats(request: web.Request) -> web.Response:
        return web.json_response(stats.report({"impl": a.impl, **counters()}))

    async def handle_health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=max(1 << 20, 2 * nbytes))
    app.add_routes(
        [
            web.post("/infer", handle_infer),
            web.post("/reset", handle_reset),
            web.get("/stats", handle_stats),
            web.get("/health", handle_health),
        ]
    )
    hb = asyncio.ensure_future(heartbeat(stats))
    if a.trace_stalls:
        tick = asyncio.ensure_future(ticker(stats))
        sample_stalls(stats, a.trace_stalls / 1e3)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((a.host, a.port))
    await web.SockSite(runner, sock, backlog=1024).start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)  # terminate: a clean exit
    print(f"listening on {sock.getsockname()[1]}", flush=True)
    try:
        await stop.wait()
    finally:
        hb.cancel()
        if a.trace_stalls:
            tick.cancel()
        await runner.cleanup()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=" ".join((__doc__ or "").split("\n\n")[0].replace("``", "").split()))
    ap.add_argument("--impl", choices=IMPLS, default="deviceop-batch")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080, help="0: any free port (printed)")
    ap.add_argument("--rows", type=int, default=32, help="tokens of one request")
    ap.add_argument(
        "--width",
        type=int,
        default=None,
        help="the encoder's width (an embedding's values); default 768, 64 on the host",
    )
    ap.add_argument("--layers", type=int, default=None, help="the encoder's layers; default 12, 2 on the host")
    ap.add_argument(
        "--heads", type=int, default=None, help="attention heads (a divisor of --width); default 12, 4 on the host"
    )
    ap.add_argument("--max-batch", type=int, default=16, help="batched variants: requests per batch")
    ap.add_argument("--max-delay", type=float, default=0.001, help="batched variants: seconds a batch waits")
    ap.add_argument(
        "--copies", type=int, default=4, help="deviceop-batch, torch-batch-graphs: recordings, batches run at once"
    )
    ap.add_argument("--streams", type=int, default=8, help="torch-streams: streams in the pool")
    ap.add_argument(
        "--poll", type=float, default=0.0002, help="torch-streams, torch-batch-graphs: seconds between event polls"
    )
    ap.add_argument(
        "--no-gc-freeze", dest="gc_freeze", action="store_false", help="leave gc.freeze() out after start-up"
    )
    ap.add_argument(
        "--warmup",
        type=int,
        default=32,
        metavar="N",
        help="before serving, run N rounds of max-batch concurrent requests of zeros (0: none)",
    )
    ap.add_argument(
        "--profile", default=None, help="write the event loop thread's cProfile stats of the last window here on exit"
    )
    ap.add_argument(
        "--trace-stalls",
        type=float,
        default=0.0,
        metavar="MS",
        help="diagnostic: sample what the loop's thread runs whenever the loop has not run for MS ms "
        "(reported in /stats as 'stalls')",
    )
    a = ap.parse_args(argv)
    given = (a.width, a.layers, a.heads)
    if None in given:
        # on a GPU the encoder of BERT-base size; without one a small one (the large one takes
        # tens of milliseconds a request on a CPU and seconds to build). The device is the one
        # the model runs on: deviceop's backend for its variants, PyTorch's device for the others
        # (which leave deviceop's context unmade)
        if a.impl.startswith("deviceop"):
            import deviceop as do

            gpu, where = do.backend_name() == "cuda", f"the {do.backend_name()} backend (an emulated device)"
        else:
            try:
                import torch
            except ImportError:  # (main says what to install)
                gpu = False
            else:
                gpu = torch.cuda.is_available()
            where = "PyTorch on the CPU"
        size = (768, 12, 12) if gpu else (64, 2, 4)
        a.width, a.layers, a.heads = (size[i] if v is None else v for i, v in enumerate(given))
        if not gpu:
            print(
                f"no GPU: {where} serves a small model by default (--width {a.width} --layers {a.layers} "
                f"--heads {a.heads}); its figures show that the service works, not what a GPU does",
                flush=True,
            )
    if a.width % a.heads:
        ap.error(f"--heads {a.heads} must divide --width {a.width} (each head takes width / heads features)")
    if not 1 <= a.copies <= 64:
        ap.error(f"--copies is 1 to 64 (recordings of the batched model), got {a.copies}")
    if a.rows < 1 or a.max_batch < 1:
        ap.error(f"--rows and --max-batch are at least 1, got {a.rows} and {a.max_batch}")
    return a


PROFILE: list[Any] = []  # the loop thread's profiler (--profile), started again by every reset


def restart_profile() -> None:
    """Profile from now on: the stats dumped at exit cover the last window the load test measured."""
    import cProfile

    if PROFILE:
        PROFILE.pop().disable()
    PROFILE.append(cProfile.Profile())
    PROFILE[0].enable()


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    try:
        import torch  # noqa: F401
    except ImportError:
        raise SystemExit("the service's model is a PyTorch module (every variant runs it): pip install torch") from None
    if a.profile:
        restart_profile()
    # the model is made (its weights uploaded, blocking) before the event loop starts: blocking
    # calls are refused on a running loop's thread
    print(f"{a.impl}: building the model (width {a.width}, {a.layers} layers) and warming up...", flush=True)
    infer, counters = make_infer(a)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(a, infer, counters))
    else:
        uvloop.run(serve(a, infer, counters))
    if PROFILE:
        PROFILE[0].disable()
        PROFILE[0].dump_stats(a.profile)


if __name__ == "__main__":
    main()
