"""deviceop on Ray: an async actor per GPU awaiting deviceop ops on its event loop, and a driver
spreading a queue of requests over the actors.

Each ``Replica`` is a Ray actor with ``num_gpus=1`` (Ray gives it one GPU through
``CUDA_VISIBLE_DEVICES``, which deviceop then sees as ``cuda:0``). Its methods are ``async``, so
Ray runs them on the actor's own event loop; ``infer`` awaits a deviceop pipeline (upload, 8
blocks of gemm, gelu and gemm, download) and the loop serves the replica's other requests
meanwhile. That await replaces what Ray's documentation offers for waiting on GPU work,
``asyncio.to_thread``. The driver keeps ``--in-flight`` requests per replica outstanding,
round-robin, checks every answer against numpy, and reports throughput with 1 replica and
with all of them (``--replicas``), in one run.

    python examples/ray_replicas/run.py                       # 2 replicas, a GPU each
    python examples/ray_replicas/run.py --gpus-per-replica 0.5  # 2 replicas sharing one GPU
    python examples/ray_replicas/run.py --gpus-per-replica 0  # without GPUs (host backend)

Without Ray (``pip install ray``) the same replica code runs as one process per GPU:
``--no-ray`` (each process started with its own ``CUDA_VISIBLE_DEVICES``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import os
import queue
import sys
import threading
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def make_weights(width: int, steps: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float16) for _ in range(2 * steps)]


def reference(x: np.ndarray, ws: list[np.ndarray]) -> np.ndarray:
    """The model in numpy (float32), for checking the replicas' answers."""
    h = x.astype(np.float32)
    for i in range(0, len(ws), 2):
        g = h @ ws[i].astype(np.float32)
        g = 0.5 * g * (1 + np.tanh(0.7978845608 * (g + 0.044715 * g**3)))
        h = g.astype(np.float16).astype(np.float32) @ ws[i + 1].astype(np.float32)
        h = h.astype(np.float16).astype(np.float32)
    return h


class Replica:
    """One replica: the model's weights on its device, and an async ``infer``."""

    def __init__(self, width: int, steps: int) -> None:
        import deviceop as do

        self.do = do
        self.K = do.kernels
        # uploaded by the first request, awaited: an async actor's constructor runs on its event
        # loop, where deviceop refuses blocking calls such as sync()
        self._host_w = make_weights(width, steps)
        self.w: list[Any] = []
        self._loading: Any = None

    async def _weights(self) -> list[Any]:
        """The weights on this replica's device, uploaded once (concurrent first requests wait
        for the one upload)."""
        if not self.w:
            if self._loading is None:
                self._loading = asyncio.ensure_future(self._upload())
            await asyncio.shield(self._loading)
        return self.w

    async def _upload(self) -> None:
        self.w = list(await self.do.zip(*(self.do.from_numpy(w) for w in self._host_w)))

    def device(self) -> str:
        """Where this replica runs: backend, process, the devices it sees and which GPUs those are."""
        gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
        return f"{self.do.backend_name()} pid {os.getpid()} {self.do.devices()}" + (f" (GPU {gpus})" if gpus else "")

    def _request(self, x: np.ndarray) -> Any:
        do, K = self.do, self.K
        op = do.from_numpy(x)
        rows, d = x.shape
        for i in range(0, len(self.w), 2):
            w1, w2 = self.w[i], self.w[i + 1]
            op = (
                op.then(lambda t, w1=w1: do.empty((rows, d), do.float16).then(lambda h: K.gemm(h, t, w1)))
                .then(lambda r: do.empty((rows, d), do.float16).then(lambda g: K.gelu(g.partition((1, d)), r[0])))
                .then(lambda r, w2=w2: do.empty((rows, d), do.float16).then(lambda y: K.gemm(y, r[0].tensor, w2)))
                .map(lambda r: r[0])
            )
        return do.to_numpy(op)

    async def infer(self, x: np.ndarray) -> np.ndarray:
        """Await the pipeline on this actor's event loop."""
        await self._weights()
        return await self._request(x)  # type: ignore[no-any-return]


async def drive(call: Any, replicas: int, xs: list[np.ndarray], in_flight: int) -> tuple[float, list[np.ndarray]]:
    """Send ``xs`` to the replicas round-robin, ``in_flight`` outstanding per replica; returns
    (seconds, answers in order)."""
    out: list[Any] = [None] * len(xs)
    sem = asyncio.Semaphore(replicas * in_flight)

    async def one(i: int) -> None:
        async with sem:
            out[i] = await call(i % replicas, xs[i])

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(len(xs))))
    return time.perf_counter() - t0, out


def run_ray(a: argparse.Namespace, xs: list[np.ndarray]) -> dict[str, Any]:
    import ray

    env = {k: v for k, v in os.environ.items() if k.startswith("DEVICEOP_")}
    ray.init(
        num_cpus=max(2, a.replicas),
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": env, "working_dir": None, "py_modules": None} if env else None,
    )
    try:
        # the actor class is made here, so that importing this module needs no Ray
        actor = ray.remote(num_gpus=a.gpus_per_replica, num_cpus=1)(Replica)
        actors = [actor.remote(a.width, a.steps) for _ in range(a.replicas)]
        where = ray.get([r.device.remote() for r in actors])

        async def call(k: int, x: np.ndarray) -> np.ndarray:
            return await actors[k].infer.remote(x)  # type: ignore[no-any-return]

        return measure(a, xs, call, where)
    finally:
        ray.shutdown()


def _serve(conn: Any, gpu: int | None, width: int, steps: int) -> None:
    """A replica as a plain process (``--no-ray``): requests in, answers out, on one event loop."""
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    try:
        rep = Replica(width, steps)
    except Exception as e:  # told to the driver, which stops instead of waiting for this replica
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", rep.device()))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        pending: set[asyncio.Task[None]] = set()
        done = loop.create_future()

        async def answer(i: int, x: np.ndarray) -> None:
            conn.send((i, await rep.infer(x)))

        def start(msg: Any) -> None:
            if msg is None:
                done.set_result(None)
                return
            t = loop.create_task(answer(*msg))
            pending.add(t)
            t.add_done_callback(pending.discard)

        def reader() -> None:  # requests arrive on a thread of their own: the loop only awaits
            while True:
                msg = conn.recv()
                loop.call_soon_threadsafe(start, msg)
                if msg is None:
                    return

        threading.Thread(target=reader, daemon=True).start()
        await done
        await asyncio.gather(*pending)

    asyncio.run(main())


def run_processes(a: argparse.Namespace, xs: list[np.ndarray]) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    pipes, procs = [], []
    for k in range(a.replicas):
        mine, theirs = ctx.Pipe()
        gpu = int(k * a.gpus_per_replica) if a.gpus_per_replica else None  # replicas may share a GPU
        p = ctx.Process(target=_serve, args=(theirs, gpu, a.width, a.steps))
        p.start()
        theirs.close()  # the child's end: a child that dies ends this process's recv() (EOFError)
        pipes.append(mine)
        procs.append(p)
    where = []
    for k, c in enumerate(pipes):
        try:
            state, what = c.recv()
        except EOFError:
            procs[k].join(30)
            state, what = "failed", f"it exited with code {procs[k].exitcode}"
        if state != "ready":
            for c2, p in zip(pipes, procs):
                c2.close()
                p.terminate()
            raise SystemExit(f"replica {k} did not start: {what}")
        where.append(what)
    waiting: dict[int, asyncio.Future[np.ndarray]] = {}
    lock = threading.Lock()
    ids = itertools.count()

    def reader(c: Any) -> None:  # answers to the futures of whichever loop is waiting
        while True:
            try:
                i, y = c.recv()
            except (EOFError, OSError):
                return
            with lock:
                f = waiting.pop(i)
            f.get_loop().call_soon_threadsafe(f.set_result, y)

    def sender(c: Any, q: queue.SimpleQueue[Any]) -> None:  # a full pipe blocks this thread, not the loop
        while True:
            msg = q.get()
            c.send(msg)
            if msg is None:
                return

    outboxes: list[queue.SimpleQueue[Any]] = []
    for c in pipes:
        q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        outboxes.append(q)
        threading.Thread(target=reader, args=(c,), daemon=True).start()
        threading.Thread(target=sender, args=(c, q), daemon=True).start()

    async def call(k: int, x: np.ndarray) -> np.ndarray:
        fut: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        i = next(ids)
        with lock:
            waiting[i] = fut
        outboxes[k].put((i, x))
        return await fut

    try:
        return measure(a, xs, call, where)
    finally:
        for q in outboxes:
            q.put(None)
        for p in procs:
            p.join(timeout=60)


def measure(a: argparse.Namespace, xs: list[np.ndarray], call: Any, where: list[str]) -> dict[str, Any]:
    ws = make_weights(a.width, a.steps)
    want = [reference(x, ws) for x in xs[: a.check]]

    def run(n: int) -> tuple[float, list[np.ndarray]]:
        return asyncio.run(drive(call, n, xs, a.in_flight))

    run(a.replicas)  # warm-up: every replica's plans, pools and GEMM heuristics
    one = min(run(1)[0] for _ in range(a.repeats))
    best, answers = float("inf"), []
    for _ in range(a.repeats):
        secs, answers = run(a.replicas)
        best = min(best, secs)
    err = max(
        float(np.max(np.abs(got.astype(np.float32) - w)) / (np.max(np.abs(w)) + 1e-6)) for got, w in zip(answers, want)
    )
    return {
        "replicas": a.replicas,
        "where": where,
        "requests": len(xs),
        "req_s_one": len(xs) / one,
        "req_s_all": len(xs) / best,
        "speedup": one / best,
        "checked": len(want),
        "max_rel_err": err,
    }


def parse(doc: str, argv: list[str] | None, extra: Any = None, needs_ray: bool = True) -> argparse.Namespace:
    """The replicas' command line (shared with ``serve.py``), checked; ``extra(ap)`` adds options.

    Without a GPU (the host backend) the defaults are no GPU per replica and a small
    configuration, said once, so the command finishes within a minute."""
    import deviceop as do

    try:
        gpu = do.backend_name() == "cuda"
    except do.DeviceOpError:  # (no usable backend here: each replica reports its own error)
        gpu = False
    ap = argparse.ArgumentParser(description=" ".join(doc.split("\n\n")[0].replace("``", "").split()))
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument(
        "--gpus-per-replica",
        type=float,
        default=1.0 if gpu else 0.0,
        help="0: no GPU (the host backend); default 1 with a GPU, else 0",
    )
    ap.add_argument("--requests", type=int, default=2000 if gpu else 200)
    ap.add_argument("--in-flight", type=int, default=32, help="outstanding requests per replica")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--width", type=int, default=2048 if gpu else 128)
    ap.add_argument("--steps", type=int, default=8 if gpu else 2)
    ap.add_argument("--repeats", type=int, default=3 if gpu else 1)
    ap.add_argument("--check", type=int, default=16, help="answers checked against numpy")
    ap.add_argument("--out", default=None)
    if extra is not None:
        extra(ap)
    a = ap.parse_args(argv)
    if a.replicas < 1 or a.requests < a.replicas or a.in_flight < 1 or a.repeats < 1 or a.gpus_per_replica < 0:
        ap.error(
            "need --replicas >= 1, --requests >= --replicas, --in-flight >= 1, --repeats >= 1, --gpus-per-replica >= 0"
        )
    if needs_ray and not getattr(a, "no_ray", False):
        try:
            import ray  # noqa: F401
        except ImportError:
            raise SystemExit(  # (the arguments were fine: no usage text)
                f"{ap.prog}: Ray is not installed: python -m pip install --group ray in the repository's "
                "root (pip 25.1 or later: python -m pip install -U pip), or pip install 'ray[serve]'"
                + ("; or run the replicas as plain processes with --no-ray" if extra is not None else "")
            ) from None
    if a.gpus_per_replica and not gpu:
        ap.error(
            f"--gpus-per-replica {a.gpus_per_replica:g}: no GPU is visible (deviceop runs on the "
            "host backend); give --gpus-per-replica 0 to run the replicas there"
            + (", or --no-ray" if extra is not None else "")
        )
    if a.gpus_per_replica:
        have = len(do.devices())
        need = a.replicas * a.gpus_per_replica
        if need > have + 1e-9:  # Ray would wait for the missing GPUs for ever
            ap.error(
                f"{a.replicas} replicas of {a.gpus_per_replica:g} GPU need {need:g} GPUs, and "
                f"{have} {'is' if have == 1 else 'are'} visible: give fewer --replicas, or a fraction "
                f"such as --gpus-per-replica {have / a.replicas:g} to share {'it' if have == 1 else 'them'}"
            )
    if not gpu:
        print(
            f"no GPU: the replicas run on the {os.environ.get('DEVICEOP_BACKEND') or 'host'} backend (an emulated device) with a small "
            f"configuration (--requests {a.requests} --width {a.width} --steps {a.steps} --repeats {a.repeats}); "
            "its figures show that the program works, not what a GPU does",
            flush=True,
        )
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(
        __doc__,
        argv,
        lambda ap: ap.add_argument(
            "--no-ray", action="store_true", help="one plain process per replica instead of Ray actors"
        ),
    )
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((a.rows, a.width)).astype(np.float16) for _ in range(a.requests)]
    doc = run_processes(a, xs) if a.no_ray else run_ray(a, xs)
    doc["runtime"] = "processes" if a.no_ray else "ray"
    return report(a, doc)


def report(a: argparse.Namespace, doc: dict[str, Any], note: str = "") -> int:
    """Print the run's figures, write its JSON (``--out``); 0 if every checked answer agreed."""
    print(
        f"{doc['runtime']}: {a.replicas} replicas on {doc['where']}\n"
        f"  1 replica {doc['req_s_one']:.0f} req/s, {a.replicas} replicas {doc['req_s_all']:.0f} req/s: "
        f"{doc['speedup']:.2f}x; {doc['checked']} answers checked, max rel err {doc['max_rel_err']:.2e}{note}"
    )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0 if doc["max_rel_err"] < 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
