"""deviceop in a Ray Serve deployment: replicas whose async methods await deviceop ops.

The deployment wraps the same ``Replica`` as ``run.py`` (an MLP: upload, 8 blocks of
gemm, gelu and gemm, download). Each Serve replica is an actor with ``--gpus-per-replica`` GPUs
(Ray hands it its GPU through ``CUDA_VISIBLE_DEVICES``, so deviceop sees it as ``cuda:0``).
Its ``async def infer`` awaits the deviceop pipeline on the replica's event loop, so one
replica serves up to ``max_ongoing_requests`` requests at once without a thread per request;
``__call__`` answers HTTP requests the same way (a ``(rows, width)`` float16 array as raw bytes
in and out; the driver checks one such request). The driver sends ``--requests`` through a
deployment handle, ``--in-flight`` per
replica outstanding, checks answers against numpy, and reports throughput with one replica and
with ``--replicas``, in one run.

    python examples/ray_replicas/serve.py                          # 2 replicas, a GPU each
    python examples/ray_replicas/serve.py --gpus-per-replica 0.5   # 2 replicas sharing one GPU
    python examples/ray_replicas/serve.py --gpus-per-replica 0     # no GPU: the host backend

Needs ``pip install "ray[serve]"``.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
import urllib.request
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from run import Replica, make_weights, parse, reference, report  # noqa: E402  (the replica of run.py)


def make_deployment(gpus: float, max_ongoing: int) -> Any:
    """The Serve deployment class (made here, so that importing this module needs no Ray)."""
    from ray import serve

    @serve.deployment(ray_actor_options={"num_gpus": gpus, "num_cpus": 1}, max_ongoing_requests=max_ongoing)
    class Model:
        def __init__(self, width: int, steps: int) -> None:
            self.width = width
            self.replica = Replica(width, steps)

        def device(self) -> str:
            return self.replica.device()

        async def infer(self, x: np.ndarray) -> np.ndarray:
            """Await the pipeline on this replica's event loop."""
            return await self.replica.infer(x)

        async def __call__(self, request: Any) -> Any:
            from starlette.responses import Response

            body = await request.body()
            x = np.frombuffer(body, np.float16).reshape(-1, self.width)
            y = await self.replica.infer(x)
            return Response(y.tobytes(), media_type="application/octet-stream")

    return Model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def drive(handle: Any, xs: list[np.ndarray], in_flight: int) -> tuple[float, list[np.ndarray]]:
    """Send every request through the handle, ``in_flight`` outstanding; (seconds, answers)."""
    out: list[Any] = [None] * len(xs)
    sem = asyncio.Semaphore(in_flight)

    async def one(i: int) -> None:
        async with sem:
            out[i] = await handle.infer.remote(xs[i])

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(len(xs))))
    return time.perf_counter() - t0, out


def main(argv: list[str] | None = None) -> int:
    a = parse(__doc__, argv)
    import ray
    from ray import serve

    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((a.rows, a.width)).astype(np.float16) for _ in range(a.requests)]
    ws = make_weights(a.width, a.steps)
    want = [reference(x, ws) for x in xs[: a.check]]
    env = {k: v for k, v in os.environ.items() if k.startswith("DEVICEOP_")}
    ray.init(
        num_cpus=a.replicas + 2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": env} if env else None,
    )
    try:
        model = make_deployment(a.gpus_per_replica, a.in_flight)
        best: dict[int, float] = {}
        where: list[str] = []
        answers: list[Any] = []
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        http_err = None
        for n in (1, a.replicas) if a.replicas > 1 else (1,):
            app = model.options(num_replicas=n).bind(a.width, a.steps)
            handle = serve.run(app, name=f"deviceop-{n}", route_prefix=f"/deviceop-{n}")
            # one request over HTTP, answered by __call__, against numpy
            req = urllib.request.Request(f"http://127.0.0.1:{port}/deviceop-{n}", data=xs[0].tobytes(), method="POST")
            with urllib.request.urlopen(req, timeout=60) as resp:
                y = np.frombuffer(resp.read(), np.float16).reshape(xs[0].shape).astype(np.float32)
            http_err = max(http_err or 0.0, float(np.max(np.abs(y - want[0])) / (np.max(np.abs(want[0])) + 1e-6)))
            asyncio.run(drive(handle, xs[: 4 * n * a.in_flight], n * a.in_flight))  # warm-up: plans, pools
            for _ in range(a.repeats):
                secs, answers = asyncio.run(drive(handle, xs, n * a.in_flight))
                best[n] = min(best.get(n, float("inf")), secs)
            # the replicas that answer (Serve's router picks one per request): many at once
            seen: set[str] = set()
            for _ in range(20):
                seen.update(r.result() for r in [handle.device.remote() for _ in range(16 * n)])
                if len(seen) == n:
                    break
            where = sorted(seen)
            serve.delete(f"deviceop-{n}")
        err = max(
            float(np.max(np.abs(got.astype(np.float32) - w)) / (np.max(np.abs(w)) + 1e-6))
            for got, w in zip(answers, want)
        )
    finally:
        serve.shutdown()
        ray.shutdown()
    doc = {
        "runtime": "ray-serve",
        "replicas": a.replicas,
        "where": where,
        "requests": a.requests,
        "req_s_one": a.requests / best[1],
        "req_s_all": a.requests / best[a.replicas],
        "speedup": best[1] / best[a.replicas],
        "checked": len(want),
        "max_rel_err": err,
        "http_max_rel_err": http_err,
    }
    status = report(a, doc, f" (over HTTP {http_err:.2e})")
    return status if http_err is not None and http_err < 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
