"""The service's model: a sentence-embedding encoder of BERT-base size (token and position
embeddings, then PyTorch's ``nn.TransformerEncoder``: 12 layers, 12 heads, 768 features, 3072 in
the feed-forward, then the mean over the tokens; random weights, seeded: no trained weights ship
with the example). A request is a sequence of ``rows`` token ids (int32, of a 30,522-word
vocabulary as BERT's); the answer is its embedding, ``width`` float16 values.

Run over one model object by each variant of ``server.py``:

- ``DeviceopModel.request(x)``: one op per request, the model run by ``do.interop.torch`` on
  the op's stream;
- ``DeviceopModel.batched(...)``: a ``Batcher`` whose batches, padded to ``max_batch``
  sequences, replay the model recorded into a CUDA graph (``do.interop.torch_graphs``,
  ``copies`` recordings, so that as many batches run at once);
- ``TorchModel.request(x)`` and ``TorchModel.work(x)``: the model in PyTorch, one request at a
  time, blocking or on the current stream;
- ``TorchModel.run_batch(...)`` and ``TorchModel.graphed(...)``: the same padded batches behind
  :class:`MicroBatcher`, the 40-line asyncio batcher a PyTorch service author writes (as Ray
  Serve's ``@serve.batch`` does), run blocking (in the loop or in a thread), or replaying
  PyTorch's own CUDA graph of the padded batch (``torch.cuda.graph``, ``copies`` captures).

Every batched variant pads to the one size ``max_batch``, so a request's output does not depend
on the batch it ran in. Without a GPU the model runs on the CPU in float32 (its outputs stay
float16).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

import deviceop as do
from deviceop.executors import Batcher

#: BERT's vocabulary size; token ids are below it
VOCAB = 30522


def encoder(width: int, layers: int, heads: int, rows: int, device: str, seed: int = 0) -> Any:
    """The embedding model as a PyTorch module of token ids ``(n, rows)`` to embeddings
    ``(n, width)``: token and learned position embeddings with a layer norm (as BERT's), the
    encoder (``nn.TransformerEncoder``, ``batch_first``, GELU, ``4 * width`` feed-forward), the
    mean over the tokens. In eval mode: on the GPU in float16, or on the CPU in float32."""
    import torch

    class Embedder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens = torch.nn.Embedding(VOCAB, width)
            self.positions = torch.nn.Parameter(torch.randn(rows, width) * 0.02)
            self.norm = torch.nn.LayerNorm(width)
            layer = torch.nn.TransformerEncoderLayer(
                width, heads, dim_feedforward=4 * width, dropout=0.0, activation="gelu", batch_first=True
            )
            self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

        def forward(self, ids: Any) -> Any:
            h = self.norm(self.tokens(ids) + self.positions)
            return self.encoder(h).mean(dim=1)

    torch.manual_seed(seed)
    enc = Embedder().eval()
    return enc.to("cuda", torch.float16) if device == "cuda" else enc


class Encoder:
    """The model as a function of a batch of token ids ``(n, rows)`` (or one sequence
    ``(rows,)``) to float16 embeddings ``(n, width)`` (or ``(width,)``), whatever device and
    dtype it runs in: ``device`` "cuda" or "cpu" (None: the GPU where PyTorch has one)."""

    def __init__(
        self, width: int, layers: int, heads: int, rows: int, seed: int = 0, device: str | None = None
    ) -> None:
        import torch

        self.torch = torch
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.module = encoder(width, layers, heads, rows, self.device, seed)

    def __call__(self, ids: Any) -> Any:
        torch = self.torch
        with torch.inference_mode():
            if ids.dim() == 1:
                return self(ids[None])[0]
            return self.module(ids).half()


def pad(xs: Sequence[np.ndarray], size: int) -> np.ndarray:
    """The requests stacked into a batch of ``size`` sequences (zeros after the last request)."""
    out = np.zeros((size, *xs[0].shape), xs[0].dtype)
    for i, x in enumerate(xs):
        out[i] = x
    return out


class DeviceopModel:
    """The encoder served through deviceop: ``do.interop.torch`` runs it on the op's stream."""

    def __init__(self, width: int, layers: int, heads: int, rows: int, seed: int = 0) -> None:
        # where deviceop runs: do.interop.torch gives the encoder CUDA tensors on the cuda
        # backend and CPU tensors on the host backend
        self.enc = Encoder(width, layers, heads, rows, seed, device="cuda" if do.backend_name() == "cuda" else "cpu")

    def request(self, x: np.ndarray) -> do.DeviceOp[np.ndarray]:
        """One request, unbatched: upload, the model, download."""
        return do.to_numpy(do.from_numpy(x).then(lambda t: do.interop.torch(self.enc, t)))

    def batched(self, max_batch: int, max_delay: float, copies: int) -> Batcher[np.ndarray, np.ndarray]:
        """A Batcher running up to ``max_batch`` requests as one replay of the recorded model."""
        # the model recorded into a CUDA graph for the padded batch (warmed up, captured and
        # replayed by do.interop.torch_graphs), ``copies`` recordings: as many batches at once
        cache = do.interop.torch_graphs(self.enc, buckets=[max_batch], copies=copies)

        def run(xs: list[np.ndarray]) -> do.DeviceOp[Sequence[np.ndarray]]:
            # the rows uploaded straight into the recording's static input (padded there),
            # the replay, the rows of its static output downloaded: no device copies around it
            return cache.run_numpy(np.stack(xs)).map(list)

        self.cache = cache
        return Batcher(run, max_batch=max_batch, max_delay=max_delay)


class MicroBatcher:
    """What a PyTorch service author writes to batch requests (as Ray Serve's ``@serve.batch``
    does): requests wait in a queue; one task takes up to ``max_batch`` of them, waiting at most
    ``max_delay`` seconds for more once it has one, and has ``fn`` run the list and answer each,
    with up to ``max_concurrent`` batches running at once."""

    def __init__(
        self,
        fn: Callable[[list[Any]], Awaitable[list[Any]]],
        max_batch: int,
        max_delay: float,
        max_concurrent: int = 1,
    ) -> None:
        self.fn, self.max_batch, self.max_delay = fn, max_batch, max_delay
        self.queue: asyncio.Queue[tuple[Any, asyncio.Future[Any]]] | None = None
        self.slots = asyncio.Semaphore(max_concurrent)
        self.batches = 0  # (since start-up, as the Batcher's counters)
        self.requests = 0
        self.task: asyncio.Task[None] | None = None
        self.running: set[asyncio.Task[None]] = set()  # (referenced while they run)

    async def __call__(self, x: Any) -> Any:
        if self.queue is None:
            self.queue = asyncio.Queue()
            self.task = asyncio.get_running_loop().create_task(self._gather())
        fut = asyncio.get_running_loop().create_future()
        self.queue.put_nowait((x, fut))
        return await fut

    async def _gather(self) -> None:
        assert self.queue is not None
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.queue.get()]
            deadline = loop.time() + self.max_delay
            while len(batch) < self.max_batch:
                if not self.queue.empty():
                    batch.append(self.queue.get_nowait())
                    continue
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self.queue.get(), left))
                except asyncio.TimeoutError:
                    break
            await self.slots.acquire()
            self.batches += 1
            self.requests += len(batch)
            t = loop.create_task(self._run(batch))
            self.running.add(t)
            t.add_done_callback(self.running.discard)

    async def _run(self, batch: list[tuple[Any, asyncio.Future[Any]]]) -> None:
        try:
            ys = await self.fn([x for x, _ in batch])
            if len(ys) != len(batch):
                raise RuntimeError(f"the batch function answered {len(ys)} of {len(batch)} requests")
        except BaseException as e:  # every request of the batch gets the error; the batcher goes on
            for _, f in batch:
                if not f.done():
                    f.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
            if not isinstance(e, Exception):
                raise
        else:
            for (_, f), y in zip(batch, ys):
                if not f.done():
                    f.set_result(y)
        finally:
            self.slots.release()


class TorchModel:
    """The encoder served by PyTorch alone."""

    def __init__(self, width: int, layers: int, heads: int, rows: int, seed: int = 0) -> None:
        self.enc = Encoder(width, layers, heads, rows, seed)
        self.torch = self.enc.torch
        self.device = self.enc.device

    def request(self, x: np.ndarray) -> np.ndarray:
        """One request, blocking until its result is on the host."""
        return self.enc(self.torch.from_numpy(x).to(self.device)).cpu().numpy()  # type: ignore[no-any-return]

    def work(self, x: np.ndarray) -> Any:
        """One request's work enqueued on the current stream; the device tensor."""
        return self.enc(self.torch.from_numpy(x).to(self.device, non_blocking=True))

    def run_batch(self, xs: list[np.ndarray], max_batch: int) -> list[np.ndarray]:
        """A padded batch through the encoder, blocking; each request's output."""
        y = self.enc(self.torch.from_numpy(pad(xs, max_batch)).to(self.device)).cpu().numpy()
        return list(y[: len(xs)])

    def graphed(
        self, rows: int, max_batch: int, poll: float, copies: int = 1
    ) -> Callable[[list[np.ndarray]], Awaitable[list[np.ndarray]]]:
        """The padded batch captured into PyTorch's own CUDA graph (``torch.cuda.graph``),
        ``copies`` times, so that up to ``copies`` batches run at once (behind a MicroBatcher
        with ``max_concurrent=copies``). Each copy has a stream of its own, which it is warmed up
        on (as PyTorch's documentation asks), captured on and replayed on, and its own memory
        pool and buffers: PyTorch keeps a cuBLAS workspace per stream, so copies captured on one
        stream would share one workspace and race when replayed at once. A call takes a free
        copy, pads the batch straight into its page-locked input, copies that into the captured
        input without blocking, replays, copies the output back into page-locked memory,
        records an event and polls it every ``poll`` seconds (the loop runs meanwhile)."""
        torch = self.torch

        def capture() -> tuple[Any, ...]:
            stream = torch.cuda.Stream()
            static_in = torch.zeros((max_batch, rows), dtype=torch.int32, device="cuda")
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    self.enc(static_in)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                static_out = self.enc(static_in)
            torch.cuda.synchronize()
            pin_in = torch.zeros(static_in.shape, dtype=static_in.dtype).pin_memory()
            pin_out = torch.empty(static_out.shape, dtype=static_out.dtype).pin_memory()
            return stream, g, static_in, static_out, pin_in, pin_out

        free = [capture() for _ in range(copies)]

        async def run(xs: list[np.ndarray]) -> list[np.ndarray]:
            copy = free.pop()
            stream, g, static_in, static_out, pin_in, pin_out = copy
            ev = None
            try:
                view_in = pin_in.numpy()
                view_in[: len(xs)] = np.stack(xs)
                view_in[len(xs) :] = 0
                with torch.cuda.stream(stream):
                    static_in.copy_(pin_in, non_blocking=True)
                    g.replay()
                    pin_out.copy_(static_out, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                while not ev.query():
                    await asyncio.sleep(poll)
                return list(pin_out.numpy()[: len(xs)].copy())
            finally:
                if ev is not None and not ev.query():  # cancelled (at shutdown): its copies still run
                    ev.synchronize()
                free.append(copy)

        return run
