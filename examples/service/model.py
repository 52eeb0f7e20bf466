"""The service's model, an MLP of ``steps`` blocks of (gemm, gelu, gemm) over ``width`` features,
written three ways over one set of weights:

- ``DeviceopModel.forward(x)``: a deviceop op per request, fresh buffers for every result;
- ``DeviceopModel.batched(max_batch)``: a ``Batcher`` whose batches are copied into a recorded
  CUDA graph (``GraphCache``, one bucket of ``max_batch * rows`` rows, several copies) and replayed;
- ``TorchModel``: the same model in PyTorch, for the PyTorch variants of the service.

Weights are random (seeded), in float16; the requests are ``(rows, width)`` float16 arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

import deviceop as do
from deviceop.executors import Batcher

K = do.kernels


def weights(width: int, steps: int, seed: int = 0) -> list[np.ndarray]:
    """The 2 * steps weight matrices, (width, width) float16, scaled to keep activations O(1)."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float16) for _ in range(2 * steps)]


class DeviceopModel:
    """The MLP on deviceop: weights uploaded once, on the first pool stream."""

    def __init__(self, width: int, steps: int, seed: int = 0) -> None:
        self.width = width
        self.steps = steps
        self.w = [do.from_numpy(w).sync() for w in weights(width, steps, seed)]

    def _block(self, x: do.Tensor, w1: do.Tensor, w2: do.Tensor) -> do.DeviceOp[do.Tensor]:
        rows, d = x.shape
        return (
            do.empty((rows, d), do.float16)
            .then(lambda h: K.gemm(h, x, w1))
            .then(lambda r: do.empty((rows, d), do.float16).then(lambda g: K.gelu(g.partition((1, d)), r[0])))
            .then(lambda r: do.empty((rows, d), do.float16).then(lambda y: K.gemm(y, r[0].tensor, w2)))
            .map(lambda r: r[0])
        )

    def forward(self, x: do.Tensor) -> do.DeviceOp[do.Tensor]:
        """The model on ``x``, every intermediate in a fresh buffer (as a request handler does)."""
        op: do.DeviceOp[do.Tensor] = do.value(x)
        for i in range(self.steps):
            op = op.then(lambda t, i=i: self._block(t, self.w[2 * i], self.w[2 * i + 1]))
        return op

    def forward_into(self, x: do.Tensor) -> do.DeviceOp[do.Tensor]:
        """The model on ``x`` into buffers allocated now: an op that allocates nothing, which a
        graph can record (``GraphCache`` calls this with its static input)."""
        rows, d = x.shape
        op: do.DeviceOp[Any] = do.value(x)
        for i in range(self.steps):
            h, g, y = (do.empty((rows, d), do.float16).sync() for _ in range(3))
            w1, w2 = self.w[2 * i], self.w[2 * i + 1]
            op = (
                op.then(lambda t, h=h, w1=w1: K.gemm(h, t, w1))
                .then(lambda r, g=g: K.gelu(g.partition((1, d)), r[0]))
                .then(lambda r, y=y, w2=w2: K.gemm(y, r[0].tensor, w2))
                .map(lambda r: r[0])
            )
        return op

    def request(self, x: np.ndarray) -> do.DeviceOp[np.ndarray]:
        """One request, unbatched: upload, the model, download."""
        return do.to_numpy(do.from_numpy(x).then(self.forward))

    def batched(self, rows: int, max_batch: int, max_delay: float, copies: int) -> Batcher[np.ndarray, np.ndarray]:
        """A Batcher running up to ``max_batch`` requests of ``rows`` rows as one replay.

        Every batch is padded to the one bucket of ``max_batch * rows`` rows, so every request
        runs the same GEMM shapes whatever its batch: identical inputs give identical outputs.
        """
        cache = do.graph.GraphCache(self.forward_into, buckets=[max_batch * rows], copies=copies)

        def run(xs: list[np.ndarray]) -> do.DeviceOp[Sequence[np.ndarray]]:
            x = np.concatenate(xs) if len(xs) > 1 else xs[0]
            n = len(xs)
            return do.to_numpy(do.from_numpy(x).then(cache)).map(lambda y: np.split(y, n))

        self.cache = cache
        return Batcher(run, max_batch=max_batch, max_delay=max_delay)


class TorchModel:
    """The same MLP in PyTorch (on the GPU if there is one, else on the CPU)."""

    def __init__(self, width: int, steps: int, seed: int = 0) -> None:
        import torch

        self.torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.w = [torch.from_numpy(w).to(self.device) for w in weights(width, steps, seed)]

    def work(self, x_np: np.ndarray) -> Any:
        """Enqueue one request's work on the current stream; returns the device tensor."""
        import torch.nn.functional as F

        x = self.torch.from_numpy(x_np).to(self.device, non_blocking=True)
        for i in range(len(self.w) // 2):
            h = x @ self.w[2 * i] if self.device == "cuda" else (x.float() @ self.w[2 * i].float()).half()
            g = F.gelu(h, approximate="tanh") if self.device == "cuda" else F.gelu(h.float(), approximate="tanh").half()
            x = g @ self.w[2 * i + 1] if self.device == "cuda" else (g.float() @ self.w[2 * i + 1].float()).half()
        return x

    def request(self, x_np: np.ndarray) -> np.ndarray:
        """One request, blocking until its result is on the host."""
        return self.work(x_np).cpu().numpy()  # type: ignore[no-any-return]
