"""A streaming speech-recognition loop: audio in real time, a voice-activity detector on the host,
an acoustic model on the GPU per voiced chunk, partial results published, and barge-in: an
interrupt cancels the chunk work in flight.

The audio (``speech.wav`` here, synthesised with espeak-ng; ``--wav`` takes any 16-bit mono WAV)
is streamed in ``--chunk`` second chunks at the pace of real time (``--speed`` plays it faster).
Each chunk is split into 20 ms frames for WebRTC's voice-activity detector (webrtcvad); a chunk
with enough voiced frames is encoded: the last ``--context`` seconds of audio go through the
acoustic model (``--model``) to per-frame logits over 29 symbols, decoded greedily (CTC) on the
host. ``wav2vec2`` (the default): wav2vec 2.0 with a CTC head (transformers'
``Wav2Vec2ForCTC``, the base model's size on a GPU); ``residual``: log-mel features (a short-time
Fourier transform, a mel filterbank, a log) and ``--layers`` residual GELU layers of ``--width``
features, the model whose kernels the ``deviceop`` loop writes. The weights are random (seeded;
no model ships offline), so the text published is not English: the loop, its timing and its
cancellations are what is real. An interrupt (the user speaking over the system) arrives
``--interrupt-after`` seconds after every ``--interrupt-every``-th voiced chunk has arrived, so
while that chunk's GPU work runs; each cancels the chunk work in flight.

The same loop, six ways (five with wav2vec 2.0: the first needs ``--model residual``), one after
the other over the same audio:

  deviceop        (``--model residual``) one thread, one event loop (uvloop where installed):
                  the encoder in deviceop kernels over the PyTorch encoder's weights (the
                  log-mel features with the DFT as a GEMM, the layers and the head:
                  ``do.kernels.gemm`` and a few kernels of its own, ``KERNELS``); each voiced
                  chunk's op is awaited in a task while the next chunk is ingested, and its
                  enqueue gives the loop a turn between kernels once it has held the loop for
                  the enqueue slice (``do.set_enqueue_slice``); an interrupt cancels the
                  awaiting tasks, and the kernels not yet enqueued are dropped
  deviceop-torch  the same with the PyTorch model run through ``do.interop.torch``, in
                  steps (its front: the convolutions or the log-mel energies; the projection,
                  ``--steps`` groups of layers, the head): the loop gets a turn between steps
                  only, and each step boundary converts PyTorch's output into a deviceop tensor
  deviceop-graph  the PyTorch model recorded once into a CUDA graph (``do.graph.scope`` around
                  the ``do.interop.torch`` op); a chunk's op uploads its audio into the
                  recording's input and replays it
  torch-blocking  one thread: PyTorch called in the loop, blocking until each chunk's result is
                  on the host; an interrupt is seen when the call returns
  torch-graph     the same, with the model captured once by PyTorch (``torch.cuda.graph``) and
                  replayed per chunk (cuda only)
  torch-threaded  an ingest thread and a GPU thread joined by a queue; an interrupt drops the
                  queued chunks and is acknowledged when the GPU thread's call returns

Every chunk's context has one length (silence before the audio's start), so one recording
serves all chunks.

The loops run ``--rounds`` times over the audio (default 2), each round starting with the next
loop, and each loop's figures are over all its rounds. Reported for each: chunk latency (from
the moment a chunk's audio has arrived to its result published) p50 / p99, its stages (until
the model is called, the model's calls queueing
the GPU work, the wait for the result), interrupt reaction (from the interrupt to the work in
flight cancelled and the loop free again) p50 / p99, host CPU time per second of audio, and the
threads it used.

    python examples/asr_stream/run.py
    python examples/asr_stream/run.py --model residual                  # with the kernel loop
    python examples/asr_stream/run.py --speed 8 --width 64 --layers 1   # quick, small
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import os
import queue
import statistics
import sys
import threading
import time
import wave
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import deviceop as do

HERE = os.path.dirname(os.path.abspath(__file__))
SR = 16000
FRAME = SR // 50  # 20 ms, a frame size webrtcvad takes
N_FFT, HOP, N_MELS = 400, 160, 80
SYMBOLS = "_ abcdefghijklmnopqrstuvwxyz'"  # "_": the CTC blank


def read_wav(path: str) -> np.ndarray:
    """A 16-bit mono WAV as int16 samples at 16 kHz (resampled linearly if it is not)."""
    with wave.open(path) as w:
        if w.getsampwidth() != 2 or w.getnchannels() != 1:
            raise SystemExit(
                f"{path}: need a 16-bit mono WAV (got {w.getnchannels()} channels of {w.getsampwidth()} bytes)"
            )
        sr = w.getframerate()
        x = np.frombuffer(w.readframes(w.getnframes()), np.int16)
    if sr != SR:
        n = int(len(x) * SR / sr)
        x = np.round(np.interp(np.arange(n) * sr / SR, np.arange(len(x)), x.astype(np.float64))).astype(np.int16)
    return x


def mel_filterbank() -> np.ndarray:
    """(N_MELS, N_FFT // 2 + 1) triangular filters on the mel scale (HTK's formula)."""
    mel = lambda f: 2595 * np.log10(1 + f / 700)  # noqa: E731
    hz = lambda m: 700 * (10 ** (m / 2595) - 1)  # noqa: E731
    edges = hz(np.linspace(mel(0), mel(SR / 2), N_MELS + 2))
    bins = np.linspace(0, SR / 2, N_FFT // 2 + 1)
    fb = np.zeros((N_MELS, len(bins)), np.float32)
    for m in range(N_MELS):
        lo, c, hi = edges[m : m + 3]
        fb[m] = np.clip(np.minimum((bins - lo) / (c - lo), (hi - bins) / (hi - c)), 0, None)
    return fb


class Encoder:
    """Log-mel features and a residual GELU encoder in PyTorch, random weights (seeded)."""

    def __init__(self, device: str, width: int, layers: int, seed: int = 0) -> None:
        import torch

        self.torch = torch
        self.device = device
        dt = torch.float16 if device == "cuda" else torch.float32
        g = torch.Generator().manual_seed(seed)
        w = lambda *s: (torch.randn(*s, generator=g) / np.sqrt(s[0])).to(device, dt)  # noqa: E731
        self.window = torch.hann_window(N_FFT).to(device)
        self.mel = torch.from_numpy(mel_filterbank()).to(device)
        self.w_in, self.w_out = w(N_MELS, width), w(width, len(SYMBOLS))
        self.layers = [w(width, width) for _ in range(layers)]
        self.dtype = dt

    def __call__(self, audio: Any) -> Any:
        """float32 audio samples (on the encoder's device) -> (frames, symbols) float32 logits."""
        return self.head(self.block(self.features(audio), 0, len(self.layers)))

    def features(self, audio: Any) -> Any:
        """Log-mel features, normalised, projected to the encoder's width."""
        return self.project(self.log_mel(audio))

    def log_mel(self, audio: Any) -> Any:
        """(frames, mels) log-mel energies of the audio."""
        torch = self.torch
        spec = torch.stft(audio, N_FFT, HOP, window=self.window, return_complex=True).abs() ** 2
        return torch.log(self.mel @ spec + 1e-6).T.contiguous()

    def project(self, feats: Any) -> Any:
        """Log-mel energies normalised and projected to the encoder's width."""
        feats = (feats - feats.mean()) / (feats.std() + 1e-5)
        return feats.to(self.dtype) @ self.w_in

    def block(self, h: Any, lo: int, hi: int) -> Any:
        """Layers ``lo`` to ``hi - 1`` of the encoder."""
        import torch.nn.functional as F

        for w in self.layers[lo:hi]:
            h = h + F.gelu(h @ w, approximate="tanh")
        return h

    def head(self, h: Any) -> Any:
        """Per-frame logits over the symbols."""
        return (h @ self.w_out).float()

    def front(self, audio: Any) -> Any:
        """The first step of the encoder: the log-mel energies."""
        return self.log_mel(audio)

    def frames(self, samples: int) -> int:
        return samples // HOP + 1


class Wav2Vec2:
    """The acoustic model of wav2vec 2.0 with a CTC head (transformers' ``Wav2Vec2ForCTC``; at
    ``width`` 768 and 12 ``layers`` the base model: 7 convolutions over the waveform, then 12
    transformer layers of 768 features, 12 heads, 3,072 in the feed-forward), random weights
    (seeded: no trained weights ship offline), in float16 on the GPU, float32 on the CPU. Its
    steps, as :class:`Encoder`'s: the convolutions (``front``), the projection with the
    convolutional position embedding (``project``), groups of transformer layers (``block``) and
    the CTC head (``head``)."""

    def __init__(self, device: str, width: int, layers: int, seed: int = 0) -> None:
        import torch
        from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

        self.torch = torch
        self.device = device
        self.dtype = torch.float16 if device == "cuda" else torch.float32
        torch.manual_seed(seed)
        cfg = Wav2Vec2Config(
            vocab_size=len(SYMBOLS),
            hidden_size=width,
            num_hidden_layers=layers,
            num_attention_heads=max(1, width // 64),
            intermediate_size=4 * width,
            conv_dim=(min(512, width),) * 7,  # (512 in the base model)
            num_conv_pos_embeddings=128 if width >= 512 else 16,
            num_conv_pos_embedding_groups=16 if width % 16 == 0 else 1,
        )
        # inference only: no autograd bookkeeping in any step, and nothing it would allocate
        # while a CUDA graph records the model
        self.model = Wav2Vec2ForCTC(cfg).eval().requires_grad_(False).to(device, self.dtype)
        w2v = self.model.wav2vec2
        self.layers = list(w2v.encoder.layers)

    def __call__(self, audio: Any) -> Any:
        """float32 audio samples (on the model's device) -> (frames, symbols) float32 logits."""
        return self.head(self.block(self.project(self.front(audio)), 0, len(self.layers)))

    def front(self, audio: Any) -> Any:
        """The audio normalised (zero mean, unit variance, as wav2vec 2.0 takes it) through the
        convolutions: (1, frames, channels)."""
        x = (audio - audio.mean()) / (audio.std() + 1e-5)
        return self.model.wav2vec2.feature_extractor(x.to(self.dtype)[None]).transpose(1, 2)

    def project(self, feats: Any) -> Any:
        """The convolutions' features projected to the model's width, plus the convolutional
        position embedding, normalised: the first transformer layer's input."""
        w2v = self.model.wav2vec2
        h, _ = w2v.feature_projection(feats)
        return w2v.encoder.layer_norm(h + w2v.encoder.pos_conv_embed(h))

    def block(self, h: Any, lo: int, hi: int) -> Any:
        """Transformer layers ``lo`` to ``hi - 1``."""
        for layer in self.layers[lo:hi]:
            out = layer(h)
            h = out[0] if isinstance(out, tuple) else out  # (a tuple in older transformers)
        return h

    def head(self, h: Any) -> Any:
        """Per-frame logits over the symbols."""
        return self.model.lm_head(h)[0].float()

    def frames(self, samples: int) -> int:
        return int(self.model.wav2vec2._get_feat_extract_output_lengths(samples))


#: the acoustic models of ``--model``
MODELS = {"wav2vec2": Wav2Vec2, "residual": Encoder}
Model = Encoder | Wav2Vec2


def ctc_greedy(logits: np.ndarray) -> str:
    ids = logits.argmax(axis=1)
    out, prev = [], -1
    for i in ids:
        if i != prev and i != 0:
            out.append(SYMBOLS[i])
        prev = i
    return "".join(out)


@dataclass
class Chunk:
    index: int
    arrives: float  # seconds of audio from the start when the chunk is complete
    audio: np.ndarray  # the chunk's int16 samples
    context: np.ndarray  # float32 samples of the last --context seconds, this chunk included


@dataclass
class Report:
    name: str
    threads: int
    latencies: list[float] = field(default_factory=list)
    reactions: list[float] = field(default_factory=list)
    partials: list[str] = field(default_factory=list)
    voiced: int = 0
    cancelled: int = 0
    cpu_s: float = 0.0
    audio_s: float = 0.0
    #: an encoded chunk's time in each stage (seconds): "start" (from its arrival to the model
    #: called), "enqueue" (the model's PyTorch calls, until its GPU work is queued) and
    #: "complete" (from then to the result on the host)
    stages: dict[str, list[float]] = field(default_factory=dict)
    #: an interrupt's reaction in parts (seconds; the deviceop loops): "notice" (from the
    #: interrupt's moment to the loop running its handler) and "cancel" (from then to the work
    #: in flight cancelled and its tasks done)
    reaction_stages: dict[str, list[float]] = field(default_factory=dict)

    def stage(self, name: str, seconds: float) -> None:
        self.stages.setdefault(name, []).append(seconds)

    def reaction_stage(self, name: str, seconds: float) -> None:
        self.reaction_stages.setdefault(name, []).append(seconds)

    def merge(self, other: Report) -> Report:
        """This loop's report over two runs (rounds) of the audio."""
        out = Report(self.name, self.threads, self.latencies + other.latencies, self.reactions + other.reactions)
        out.partials = self.partials + other.partials
        out.voiced, out.cancelled = self.voiced + other.voiced, self.cancelled + other.cancelled
        out.cpu_s, out.audio_s = self.cpu_s + other.cpu_s, self.audio_s + other.audio_s
        for k in [*self.stages, *(k for k in other.stages if k not in self.stages)]:
            out.stages[k] = self.stages.get(k, []) + other.stages.get(k, [])
        rs, ors = self.reaction_stages, other.reaction_stages
        for k in [*rs, *(k for k in ors if k not in rs)]:
            out.reaction_stages[k] = rs.get(k, []) + ors.get(k, [])
        return out

    def summary(self) -> dict[str, Any]:
        def pct(v: list[float], q: float) -> float | None:
            if not v:
                return None
            s = sorted(v)
            return 1e3 * s[min(len(s) - 1, int(q * len(s)))]

        return {
            "loop": self.name,
            "host_threads": self.threads,
            "voiced_chunks": self.voiced,
            "published": len(self.latencies),
            "cancelled": self.cancelled,
            "interrupts": len(self.reactions),
            "chunk_latency_ms_p50": 1e3 * statistics.median(self.latencies) if self.latencies else None,
            "chunk_latency_ms_p99": pct(self.latencies, 0.99),
            "reaction_ms_p50": 1e3 * statistics.median(self.reactions) if self.reactions else None,
            "reaction_ms_p99": pct(self.reactions, 0.99),
            "cpu_s_per_audio_s": self.cpu_s / self.audio_s if self.audio_s else None,
            "stage_ms_p50": {k: 1e3 * statistics.median(v) for k, v in self.stages.items()},
            "reaction_stage_ms": {
                k: {"p50": 1e3 * statistics.median(v), "p99": pct(v, 0.99)} for k, v in self.reaction_stages.items()
            },
            "last_partial": self.partials[-1] if self.partials else "",
        }


class Stream:
    """The audio as chunks, their arrival times, the VAD's verdicts and the interrupt times."""

    def __init__(self, a: argparse.Namespace) -> None:
        import webrtcvad

        x = read_wav(a.wav)
        n = int(a.chunk * SR) // FRAME * FRAME
        ctx = int(a.context * SR)
        vad = webrtcvad.Vad(a.vad_mode)
        self.chunks: list[Chunk] = []
        self.voiced: list[bool] = []
        for k in range(len(x) // n):
            audio = x[k * n : (k + 1) * n]
            # the last ctx samples, silence before the audio's start: every chunk's context has
            # one shape (a recorded model serves them all)
            context = np.zeros(ctx, np.float32)
            seen = x[max(0, (k + 1) * n - ctx) : (k + 1) * n].astype(np.float32) / 32768
            context[ctx - len(seen) :] = seen
            self.chunks.append(Chunk(k, (k + 1) * n / SR, audio, context))
            frames = [vad.is_speech(audio[i : i + FRAME].tobytes(), SR) for i in range(0, n, FRAME)]
            self.voiced.append(sum(frames) >= a.voiced_fraction * len(frames))
        self.seconds = len(self.chunks) * n / SR
        voiced = [c for c, v in zip(self.chunks, self.voiced) if v]
        hit = voiced[:: a.interrupt_every] if a.interrupt_every else []
        self.interrupted = {c.index for c in hit}  # chunks during whose work an interrupt comes
        self.interrupt_after = a.interrupt_after
        self.interrupts = [c.arrives + a.interrupt_after for c in hit]
        self.speed = a.speed

    def at(self, t0: float, audio_t: float) -> float:
        """Wall-clock time (perf_counter) at which ``audio_t`` seconds of audio have arrived."""
        return t0 + audio_t / self.speed

    def is_voiced(self, c: Chunk) -> bool:
        # the detector already ran when the stream was read; here it runs again, as the loop
        # would on audio arriving, so its host time is part of the loop's
        return self.voiced[c.index]


def vad_again(vad: Any, c: Chunk) -> None:
    for i in range(0, len(c.audio), FRAME):
        vad.is_speech(c.audio[i : i + FRAME].tobytes(), SR)


# -- deviceop: one thread, one event loop -------------------------------------------------------
#: The encoder in CUDA C++ where deviceop has no built-in: the short-time Fourier transform's
#: framing (reflect padding and the Hann window, as ``torch.stft``'s defaults), the power of its
#: bins, the log-mel energies' mean and standard deviation, their normalisation, and each
#: layer's GELU with its residual add (rounded as PyTorch's separate calls round). The DFT, the
#: mel filterbank and the projections are ``do.kernels.gemm``.
KERNELS = r"""
#include <cuda_fp16.h>
#define N_FFT 400
#define HOP 160
#define BINS 201
__device__ __forceinline__ float gelu_tanh(float x) {
  return 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}
extern "C" __global__ void frames(float* out, const float* x, const float* w, int n) {
  const long long f = blockIdx.x;  // one block per frame: out is (frames, N_FFT)
  for (int j = threadIdx.x; j < N_FFT; j += blockDim.x) {
    int i = (int)f * HOP + j - N_FFT / 2;
    i = i < 0 ? -i : (i >= n ? 2 * (n - 1) - i : i);
    out[f * N_FFT + j] = x[i] * w[j];
  }
}
extern "C" __global__ void power(float* p, const float* z) {
  const long long f = blockIdx.x;  // p: (frames, BINS) from z: (frames, 2 * BINS), real parts first
  for (int k = threadIdx.x; k < BINS; k += blockDim.x) {
    const float re = z[f * 2 * BINS + k], im = z[f * 2 * BINS + BINS + k];
    p[f * BINS + k] = re * re + im * im;
  }
}
__device__ float block_sum(float v, float* red) {  // blockDim.x a power of two
  red[threadIdx.x] = v;
  __syncthreads();
  for (int k = blockDim.x / 2; k > 0; k >>= 1) {
    if (threadIdx.x < k) red[threadIdx.x] += red[threadIdx.x + k];
    __syncthreads();
  }
  const float s = red[0];
  __syncthreads();
  return s;
}
extern "C" __global__ void log_stats(float* stats, const float* m, int n) {
  // one block: (mean, unbiased standard deviation) of log(m + 1e-6) over its n elements
  __shared__ float red[1024];
  float s = 0.f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += logf(m[i] + 1e-6f);
  const float mean = block_sum(s, red) / n;
  float q = 0.f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float d = logf(m[i] + 1e-6f) - mean;
    q += d * d;
  }
  const float var = block_sum(q, red) / (n - 1);
  if (threadIdx.x == 0) { stats[0] = mean; stats[1] = sqrtf(var); }
}
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <typename T> __device__ void normalize(T* out, const float* m, const float* stats, int d) {
  const long long row = (long long)blockIdx.x * d;  // one block per frame
  const float mean = stats[0], inv = 1.f / (stats[1] + 1e-5f);
  for (int j = threadIdx.x; j < d; j += blockDim.x) out[row + j] = from_float<T>((logf(m[row + j] + 1e-6f) - mean) * inv);
}
extern "C" __global__ void normalize_f16(__half* o, const float* m, const float* s, int d) { normalize(o, m, s, d); }
extern "C" __global__ void normalize_f32(float* o, const float* m, const float* s, int d) { normalize(o, m, s, d); }
template <typename T> __device__ void residual_gelu(T* h, const T* t, int d) {
  const long long row = (long long)blockIdx.x * d;  // h += gelu(t), one block per row
  for (int j = threadIdx.x; j < d; j += blockDim.x) {
    const float g = to_float(from_float<T>(gelu_tanh(to_float(t[row + j]))));
    h[row + j] = from_float<T>(to_float(h[row + j]) + g);
  }
}
extern "C" __global__ void residual_gelu_f16(__half* h, const __half* t, int d) { residual_gelu(h, t, d); }
extern "C" __global__ void residual_gelu_f32(float* h, const float* t, int d) { residual_gelu(h, t, d); }
"""


# the same computations in numpy, for the host backend
def _frames_host(out: np.ndarray, x: np.ndarray, w: np.ndarray, n: int) -> None:
    i = np.arange(out.shape[0])[:, None] * HOP + np.arange(N_FFT)[None, :] - N_FFT // 2
    i = np.abs(i)
    i = np.where(i >= n, 2 * (n - 1) - i, i)
    out[:] = x[i] * w


def _power_host(p: np.ndarray, z: np.ndarray) -> None:
    b = p.shape[1]
    p[:] = z[:, :b] ** 2 + z[:, b:] ** 2


def _log_stats_host(stats: np.ndarray, m: np.ndarray, n: int) -> None:
    v = np.log(m.astype(np.float64) + 1e-6)
    stats[:] = (v.mean(), v.std(ddof=1))


def _normalize_host(out: np.ndarray, m: np.ndarray, stats: np.ndarray, d: int) -> None:
    out[:] = ((np.log(m + np.float32(1e-6)) - stats[0]) / (stats[1] + np.float32(1e-5))).astype(out.dtype)


def _residual_gelu_host(h: np.ndarray, t: np.ndarray, d: int) -> None:
    x = t.astype(np.float32)
    g = (0.5 * x * (1 + np.tanh(0.7978845608028654 * (x + 0.044715 * x**3)))).astype(h.dtype)
    np.add(h, g, out=h)


def _kernel_encoder(
    enc: Encoder, rep: Report, arrived: list[float], enqueued: list[float], stream: Any
) -> Callable[[Chunk], do.DeviceOp[np.ndarray]]:
    """The chunk's op with the whole encoder in deviceop kernels over the PyTorch encoder's
    weights, window and filterbank (uploaded once): the log-mel features as ``torch.stft`` and
    the filterbank compute them (the DFT as a GEMM against its basis), then per layer ``h +=
    gelu(h @ w)`` as a ``gemm`` and one kernel of :data:`KERNELS` for the GELU and the residual
    add (PyTorch's eager calls make two kernels of them), in PyTorch's precision (float16 on
    cuda). The chain is flat, one step per kernel, so the await gives the loop a turn between
    kernels once the enqueue has held it for the enqueue slice (a step's own chain would be
    enqueued whole)."""
    K = do.kernels
    f32, dt = do.float32, (do.float16 if enc.device == "cuda" else do.float32)
    sfx = "f16" if dt is do.float16 else "f32"
    f = K.Out(f32)

    def kernel(name: str, params: tuple[Any, ...], host: Callable[..., None], block: int = 256) -> K.Kernel:
        return K.Kernel(KERNELS, name, params=params, host=host, block=(block,))

    framing = kernel("frames", (f, K.In(f32), K.In(f32), do.int32), _frames_host, 128)
    power = kernel("power", (f, K.In(f32)), _power_host, 128)
    log_stats = kernel("log_stats", (f, K.In(f32), do.int32), _log_stats_host, 1024)
    normalize = kernel(f"normalize_{sfx}", (K.Out(dt), K.In(f32), K.In(f32), do.int32), _normalize_host, 128)
    residual_gelu = kernel(f"residual_gelu_{sfx}", (K.InOut(dt), K.In(dt), do.int32), _residual_gelu_host)
    k = np.arange(N_FFT // 2 + 1)
    angle = 2 * np.pi * np.outer(np.arange(N_FFT), k) / N_FFT
    bins = len(k)

    def upload(x: Any) -> do.Tensor:
        return do.from_numpy(np.ascontiguousarray(x)).sync_on(stream)

    basis = upload(np.concatenate([np.cos(angle), -np.sin(angle)], axis=1).astype(np.float32))  # (N_FFT, 2 * bins)
    window, mel_t = upload(enc.window.cpu().numpy()), upload(enc.mel.cpu().numpy().T)  # mel_t: (bins, N_MELS)
    w_in, w_out = upload(enc.w_in.cpu().numpy()), upload(enc.w_out.cpu().numpy())
    ws = [upload(w.cpu().numpy()) for w in enc.layers]
    width = w_in.shape[1]

    class Run:
        """One chunk's tensors, for its chain's steps (each step one kernel)."""

        def __init__(self, n: int) -> None:
            self.n, self.rows = n, enc.frames(n)

        def alloc(self, x: do.Tensor) -> do.DeviceOp[Any]:
            began[0] = time.perf_counter()
            rep.stage("start", began[0] - arrived[0])
            r = self.rows
            self.x = x
            shapes = ((r, N_FFT), (r, 2 * bins), (r, bins), (r, N_MELS), (2,))
            return do.zip(
                *(do.empty(s, f32) for s in shapes),
                do.empty((r, N_MELS), dt),
                *(do.empty((r, width), dt) for _ in range(2)),
                do.empty((r, len(SYMBOLS)), dt),
            ).inspect(self.keep)

        def keep(self, ts: tuple[do.Tensor, ...]) -> None:
            self.fr, self.z, self.p, self.m, self.st, self.feats, self.h, self.t, self.y = ts
            self.hp = self.h.partition((1, width))

        def framing(self, _: Any) -> Any:
            return framing(self.fr.partition((1, N_FFT)), self.x, window, self.n)

        def dft(self, _: Any) -> Any:
            return K.gemm(self.z, self.fr, basis)

        def power(self, _: Any) -> Any:
            return power(self.p.partition((1, bins)), self.z)

        def mel(self, _: Any) -> Any:
            return K.gemm(self.m, self.p, mel_t)

        def stats(self, _: Any) -> Any:
            return log_stats(self.st.partition((2,)), self.m, self.rows * N_MELS)

        def normalize(self, _: Any) -> Any:
            return normalize(self.feats.partition((1, N_MELS)), self.m, self.st, N_MELS)

        def project(self, _: Any) -> Any:
            return K.gemm(self.h, self.feats, w_in)

        def gemm(self, w: do.Tensor, _: Any) -> Any:
            return K.gemm(self.t, self.h, w)

        def residual(self, _: Any) -> Any:
            return residual_gelu(self.hp, self.t, width)

        def head(self, _: Any) -> Any:
            return K.gemm(self.y, self.h, w_out)

        def fetch(self, _: Any) -> do.DeviceOp[np.ndarray]:
            enqueued[0] = time.perf_counter()  # the encoder's work is queued
            rep.stage("enqueue", enqueued[0] - began[0])
            return do.to_numpy(self.y)

    began = [0.0]

    def chunk_op(c: Chunk) -> do.DeviceOp[np.ndarray]:
        run = Run(len(c.context))
        op = do.from_numpy(c.context).then(run.alloc)
        for step in (run.framing, run.dft, run.power, run.mel, run.stats, run.normalize, run.project):
            op = op.then(step)
        for w in ws:
            op = op.then(functools.partial(run.gemm, w)).then(run.residual)
        return op.then(run.head).then(run.fetch)

    return chunk_op


def run_deviceop(st: Stream, enc: Model, a: argparse.Namespace, mode: str = "kernels") -> Report:
    import webrtcvad

    rep = Report("deviceop" if mode == "kernels" else f"deviceop-{mode}", threads=1)
    vad = webrtcvad.Vad(a.vad_mode)

    enqueued = [0.0]
    arrived = [0.0]  # the arrival of the chunk whose op is starting

    began = [0.0]  # the start of the chunk's first model step

    def front(x: Any) -> Any:
        # the PyTorch model, run by do.interop.torch on the op's stream with the op's tensor
        # given as a PyTorch tensor (no copy); its output comes back as a deviceop tensor
        began[0] = time.perf_counter()
        rep.stage("start", began[0] - arrived[0])
        return enc.front(x)

    def head(h: Any) -> Any:
        y = enc.head(h)
        enqueued[0] = time.perf_counter()
        rep.stage("enqueue", enqueued[0] - began[0])
        return y

    n = len(enc.layers)
    group = max(1, -(-n // a.steps))  # layers per step (--steps of them)

    def eager_op(c: Chunk) -> do.DeviceOp[np.ndarray]:
        # the audio's upload is an argument of the first step: it runs first, on the same stream.
        # The model is enqueued in steps (its front, the projection, --steps
        # groups of layers, the head): the await gives the loop a turn between them once the
        # enqueue has held it for the enqueue slice (do.set_enqueue_slice), so an interrupt is
        # seen, and the steps not yet enqueued are dropped, while PyTorch's enqueue of the chunk
        # is still under way. A turn waits for the step under way: the longest step (the first,
        # with the upload and the first PyTorch calls of a chunk, which run cold) bounds it
        op = do.interop.torch(front, do.from_numpy(c.context)).then(lambda f: do.interop.torch(enc.project, f))
        for lo in range(0, n, group):
            op = op.then(lambda h, lo=lo: do.interop.torch(enc.block, h, lo, min(n, lo + group)))
        return op.then(lambda h: do.interop.torch(head, h)).then(do.to_numpy)

    # the chunks follow each other on one stream (PyTorch's caching allocator keeps blocks per
    # stream: one stream, one warm pool)
    stream = do.next_stream()
    chunk_op = eager_op
    if mode == "kernels":
        chunk_op = _kernel_encoder(enc, rep, arrived, enqueued, stream)
    elif mode == "graph":
        chunk_op = _recorded(enc, st, rep, arrived, enqueued, stream)

    async def until(t: float) -> None:
        # the simulated audio source delivers a chunk (or an interrupt) at its moment, as an audio
        # device's callback would; the loop's timers fire only to the millisecond (uvloop's), so
        # sleep to 2 ms before it and yield to the loop's other tasks until it
        # (a timer that fires early sleeps again: yielding all the way would spin the loop)
        while (left := t - time.perf_counter()) > 2e-3:
            await asyncio.sleep(left - 2e-3)
        while time.perf_counter() < t:
            await asyncio.sleep(0)

    async def main() -> None:
        inflight: set[asyncio.Task[None]] = set()
        pending: set[asyncio.Task[None]] = set()
        # warm-up, as the loop runs it (awaited): deviceop's pools, its wake-ups in this loop,
        # the export to PyTorch, PyTorch's allocator on this stream
        for c in st.chunks[:3]:
            await chunk_op(c).wait(stream=stream)
        rep.stages.clear()
        t0 = time.perf_counter()
        # CPU time counts from here, as in the other loops (whose warm-up precedes theirs): the
        # warm-up compiles deviceop's kernels when the kernel cache is cold (seconds of CPU)
        c0[0] = time.process_time()

        async def process(c: Chunk, ready: float) -> None:
            arrived[0] = ready
            logits = await chunk_op(c).wait(stream=stream)  # (float16 from the kernel encoder)
            rep.stage("complete", time.perf_counter() - enqueued[0])
            rep.partials.append(ctc_greedy(logits))
            rep.latencies.append(time.perf_counter() - ready)

        def finished(task: asyncio.Task[None]) -> None:
            # counted here, not in process(): a task cancelled before its first step never runs
            # its body
            inflight.discard(task)
            if task.cancelled():
                rep.cancelled += 1

        async def interrupt(due: float) -> None:
            seen = time.perf_counter()
            for t in list(inflight):
                t.cancel()
            await asyncio.gather(*inflight, return_exceptions=True)  # cancelled: the loop is free
            now = time.perf_counter()
            rep.reactions.append(now - due)
            rep.reaction_stage("notice", seen - due)
            rep.reaction_stage("cancel", now - seen)

        async def interrupt_at(due: float) -> None:
            await until(due)
            await interrupt(due)

        for c in st.chunks:
            ready = st.at(t0, c.arrives)
            await until(ready)
            vad_again(vad, c)
            if st.is_voiced(c):
                rep.voiced += 1
                task = asyncio.ensure_future(process(c, ready))
                inflight.add(task)
                task.add_done_callback(finished)
            if c.index in st.interrupted:
                pending.add(asyncio.ensure_future(interrupt_at(ready + st.interrupt_after / st.speed)))
        await asyncio.gather(*inflight, *pending, return_exceptions=True)
        await until(st.at(t0, st.seconds))

    run: Callable[[Any], Any] = asyncio.run
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        pass
    c0 = [time.process_time()]
    run(main())
    rep.cpu_s, rep.audio_s = time.process_time() - c0[0], st.seconds
    return rep


def _recorded(
    enc: Model, st: Stream, rep: Report, arrived: list[float], enqueued: list[float], stream: Any
) -> Callable[[Chunk], do.DeviceOp[np.ndarray]]:
    """The model recorded once into a CUDA graph (``do.graph.scope``); a chunk's op uploads its
    audio into the recording's input and replays the graph: one launch for the model's
    kernels instead of PyTorch's calls."""
    n = len(st.chunks[0].context)
    x_in = do.zeros((n,), do.float32).sync_on(stream)
    tile = next(t for t in (256, 128, 64, 32, 16, 8, 4, 2, 1) if n % t == 0)
    dst = x_in.partition((tile,))
    # the logits go into a deviceop tensor the chunk's op reads after the replay (on the host
    # backend a recording runs the PyTorch code at each replay, so it has no output of its own)
    y_out = do.zeros((enc.frames(n), len(SYMBOLS)), do.float32).sync_on(stream)
    with do.graph.scope() as sc:
        sc.record(do.interop.torch(lambda x, y: y.copy_(enc(x)), x_in, y_out, writes=(y_out,)))
    g = sc.graph
    began = [0.0]

    def replay(_: Any) -> Any:
        began[0] = time.perf_counter()
        rep.stage("start", began[0] - arrived[0])
        return g.launch()

    def fetch(_: Any) -> Any:
        enqueued[0] = time.perf_counter()
        rep.stage("enqueue", enqueued[0] - began[0])
        return do.to_numpy(y_out)

    def chunk_op(c: Chunk) -> do.DeviceOp[np.ndarray]:
        return do.from_numpy(c.context).then(lambda t: do.kernels.copy(dst, t)).then(replay).then(fetch)

    return chunk_op


# -- PyTorch, blocking, one thread ---------------------------------------------------------------
def _torch_chunk(
    enc: Model, c: Chunk, rep: Report | None = None, ready: float = 0.0, captured: tuple[Any, ...] | None = None
) -> np.ndarray:
    """One chunk through PyTorch, blocking; ``captured`` (input, graph, output): by a replay of
    the model's CUDA graph (:func:`_torch_graph_chunk`) instead of its calls."""
    torch = enc.torch
    t = time.perf_counter()
    if captured is None:
        y = enc(torch.from_numpy(c.context).to(enc.device, non_blocking=False))
    else:
        static_in, g, y = captured
        static_in.copy_(torch.from_numpy(c.context))
        g.replay()
    t1 = time.perf_counter()
    out = y.cpu().numpy()
    if rep is not None:
        rep.stage("start", t - ready)
        rep.stage("enqueue", t1 - t)
        rep.stage("complete", time.perf_counter() - t1)
    return out  # type: ignore[no-any-return]


def _torch_graph_chunk(enc: Model, st: Stream) -> Callable[..., np.ndarray]:
    """The model captured once into a CUDA graph by PyTorch (``torch.cuda.graph``); a chunk
    copies its audio into the captured input, replays, and copies the logits back."""
    torch = enc.torch
    static_in = torch.zeros(len(st.chunks[0].context), device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as PyTorch's graph docs ask
        for _ in range(3):
            enc(static_in)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = enc(static_in)
    return functools.partial(_torch_chunk, captured=(static_in, g, static_out))


def run_torch_blocking(st: Stream, enc: Model, a: argparse.Namespace, graph: bool = False) -> Report:
    import webrtcvad

    rep = Report("torch-graph" if graph else "torch-blocking", threads=1)
    call = _torch_graph_chunk(enc, st) if graph else _torch_chunk
    vad = webrtcvad.Vad(a.vad_mode)
    pending = list(st.interrupts)
    t0 = time.perf_counter()
    c0 = time.process_time()

    def notice_interrupts() -> None:
        # nothing is in flight between calls: an interrupt is handled when the loop sees it
        now = time.perf_counter()
        while pending and st.at(t0, pending[0]) <= now:
            rep.reactions.append(now - st.at(t0, pending.pop(0)))

    for c in st.chunks:
        ready = st.at(t0, c.arrives)
        while time.perf_counter() < ready:
            notice_interrupts()
            time.sleep(min(0.001, max(0.0, ready - time.perf_counter())))
        notice_interrupts()
        vad_again(vad, c)
        if st.is_voiced(c):
            rep.voiced += 1
            logits = call(enc, c, rep, ready)
            before = len(rep.reactions)
            notice_interrupts()
            if len(rep.reactions) > before:  # barge-in during the call: its result is dropped
                rep.cancelled += 1
                continue
            rep.partials.append(ctc_greedy(logits))
            rep.latencies.append(time.perf_counter() - ready)
    while time.perf_counter() < st.at(t0, st.seconds):
        notice_interrupts()
        time.sleep(0.001)
    notice_interrupts()
    rep.cpu_s, rep.audio_s = time.process_time() - c0, st.seconds
    return rep


# -- PyTorch, an ingest thread and a GPU thread --------------------------------------------------
def run_torch_threaded(st: Stream, enc: Model, a: argparse.Namespace) -> Report:
    import webrtcvad

    rep = Report("torch-threaded", threads=2)
    vad = webrtcvad.Vad(a.vad_mode)
    work: queue.Queue[tuple[Chunk, float] | None] = queue.Queue()
    lock = threading.Lock()
    generation = [0]  # bumped by an interrupt: work of an older generation is dropped
    busy = threading.Event()
    free = threading.Condition(lock)

    def gpu_thread() -> None:
        while True:
            item = work.get()
            if item is None:
                return
            c, ready = item
            with lock:
                gen = generation[0]
                busy.set()
            logits = _torch_chunk(enc, c, rep, ready)
            with lock:
                busy.clear()
                free.notify_all()
                if gen != generation[0]:
                    rep.cancelled += 1
                    continue
            rep.partials.append(ctc_greedy(logits))
            rep.latencies.append(time.perf_counter() - ready)

    worker = threading.Thread(target=gpu_thread, name="gpu")
    worker.start()
    t0 = time.perf_counter()
    c0 = time.process_time()
    pending = list(st.interrupts)

    def interrupt(due: float) -> None:
        with lock:
            generation[0] += 1
            while True:  # drop what is queued
                try:
                    work.get_nowait()
                except queue.Empty:
                    break
                rep.cancelled += 1
            while busy.is_set():  # the call in flight cannot be stopped: wait for it
                free.wait()
        rep.reactions.append(time.perf_counter() - due)

    for c in [*st.chunks, None]:
        ready = st.at(t0, c.arrives if c else st.seconds)
        while True:
            nxt = st.at(t0, pending[0]) if pending else float("inf")
            if nxt > ready:
                break
            time.sleep(max(0.0, nxt - time.perf_counter()))
            interrupt(st.at(t0, pending.pop(0)))
        time.sleep(max(0.0, ready - time.perf_counter()))
        if c is None:
            break
        vad_again(vad, c)
        if st.is_voiced(c):
            rep.voiced += 1
            work.put((c, ready))
    work.put(None)
    worker.join()
    rep.cpu_s, rep.audio_s = time.process_time() - c0, st.seconds
    return rep


LOOPS: dict[str, Callable[[Stream, Any, argparse.Namespace], Report]] = {
    "deviceop": run_deviceop,
    "deviceop-torch": lambda st, enc, a: run_deviceop(st, enc, a, mode="torch"),
    "deviceop-graph": lambda st, enc, a: run_deviceop(st, enc, a, mode="graph"),
    "torch-blocking": run_torch_blocking,
    "torch-graph": lambda st, enc, a: run_torch_blocking(st, enc, a, graph=True),
    "torch-threaded": run_torch_threaded,
}
#: loops that record the model into a CUDA graph by PyTorch itself (cuda only)
CUDA_ONLY = {"torch-graph"}


#: the loop that needs the residual encoder (its kernels compute that model)
KERNEL_LOOPS = {"deviceop"}
#: --width, --layers by model: on a GPU, and on the host backend (small, so that the command
#: finishes within a minute)
SIZES = {"wav2vec2": ((768, 12), (64, 2)), "residual": ((1024, 24), (256, 4))}


def _requirements(model: str) -> str | None:
    """What this example needs and is missing, said so that it can be installed (None: nothing)."""
    missing = []
    needs = [
        ("torch", "torch", "the acoustic model is a PyTorch module, in every loop"),
        ("webrtcvad", "webrtcvad-wheels", "the voice-activity detector"),
    ]
    if model == "wav2vec2":
        needs.append(("transformers", "transformers", "wav2vec 2.0 (Wav2Vec2ForCTC); or --model residual"))
    for mod, pip, why in needs:
        try:
            __import__(mod)
        except ImportError:
            missing.append(f"{mod} ({why}): pip install {pip}")
    if not missing:
        return None
    return "this example needs " + "; ".join(missing)


def main(argv: list[str] | None = None) -> int:
    gpu = do.backend_name() == "cuda"
    ap = argparse.ArgumentParser(description=" ".join((__doc__ or "").split("\n\n")[0].replace("``", "").split()))
    ap.add_argument("--wav", default=os.path.join(HERE, "speech.wav"))
    ap.add_argument(
        "--model",
        choices=MODELS,
        default="wav2vec2",
        help="the acoustic model: wav2vec 2.0 (transformers), or the residual encoder whose kernels the "
        "deviceop loop writes",
    )
    ap.add_argument(
        "--loops",
        default=None,
        help=f"comma-separated, of {', '.join(LOOPS)} (default: all that run the model: {', '.join(KERNEL_LOOPS)} "
        f"with --model residual only; on the host backend none of {', '.join(CUDA_ONLY)})",
    )
    ap.add_argument("--chunk", type=float, default=0.32, help="seconds of audio per chunk")
    ap.add_argument("--context", type=float, default=2.0, help="seconds of audio the model sees per chunk")
    # on the host backend (no GPU) a small model, the audio played 8x faster and one round, so
    # the command finishes within a minute
    ap.add_argument(
        "--width",
        type=int,
        default=None,
        help="the model's width (default: 768 for wav2vec2, 1024 for residual; on the host 64, 256)",
    )
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="the model's layers (default: 12 for wav2vec2, 24 for residual; on the host 2, 4)",
    )
    ap.add_argument(
        "--speed", type=float, default=1.0 if gpu else 8.0, help="audio seconds per wall second (1: real time)"
    )
    ap.add_argument("--interrupt-every", type=int, default=3, help="voiced chunks per interrupt (0: none)")
    ap.add_argument("--interrupt-after", type=float, default=0.001, help="seconds from the chunk's arrival")
    ap.add_argument("--vad-mode", type=int, default=2, choices=range(4))
    ap.add_argument("--voiced-fraction", type=float, default=0.3)
    ap.add_argument("--rounds", type=int, default=2 if gpu else 1, help="runs of the audio per loop, in rotated order")
    ap.add_argument(
        "--steps",
        type=int,
        default=4,
        help="deviceop-torch loop: groups of layers the model is enqueued in, one op step each",
    )
    ap.add_argument(
        "--enqueue-slice",
        type=float,
        default=2.5e-4,
        help="do.set_enqueue_slice(S): the host time an awaited chain's enqueue may hold the loop (deviceop loops)",
    )
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    size = SIZES[a.model][0 if gpu else 1]
    a.width = size[0] if a.width is None else a.width
    a.layers = size[1] if a.layers is None else a.layers
    if not os.path.isfile(a.wav):
        ap.error(f"--wav {a.wav}: no such file (a 16-bit mono WAV; the default is {os.path.join(HERE, 'speech.wav')})")
    cuda = gpu
    if not gpu:
        print(
            f"no GPU: the {do.backend_name()} backend (an emulated device) runs a small configuration "
            f"(--model {a.model} --width {a.width} --layers {a.layers} --speed {a.speed} --rounds {a.rounds}); "
            "its figures show "
            "that the loops work, not what a GPU does",
            flush=True,
        )
    kernels = a.model == "residual"
    loops = (
        [n for n in a.loops.split(",") if n]
        if a.loops
        else [n for n in LOOPS if (cuda or n not in CUDA_ONLY) and (kernels or n not in KERNEL_LOOPS)]
    )
    if not a.loops and not cuda and CUDA_ONLY:  # (say which the host leaves out, as loadtest.py does)
        print(f"left out without a GPU: {', '.join(sorted(CUDA_ONLY))} (PyTorch's CUDA graphs)", flush=True)
    bad = [n for n in loops if n not in LOOPS]
    if bad:
        ap.error(f"unknown --loops {bad}; choose from {', '.join(LOOPS)}")
    if not kernels and KERNEL_LOOPS & set(loops):
        ap.error(
            f"--loops {', '.join(sorted(KERNEL_LOOPS & set(loops)))}: its kernels compute the residual encoder; "
            "add --model residual"
        )
    if a.model == "wav2vec2" and (a.width % max(1, a.width // 64) or a.layers < 1):
        ap.error(
            "--model wav2vec2 needs --layers >= 1 and a --width that its heads (width // 64) divide, "
            "such as a multiple of 64"
        )
    if not cuda and CUDA_ONLY & set(loops):
        ap.error(
            f"--loops {', '.join(sorted(CUDA_ONLY & set(loops)))} need(s) the cuda backend (PyTorch's CUDA graphs)"
        )
    ok = a.chunk > 0 and a.context >= a.chunk and a.speed > 0 and a.width > 0 and a.layers >= 0 and a.steps >= 1
    if not (ok and a.rounds >= 1 and a.interrupt_every >= 0 and 0 <= a.interrupt_after < a.chunk):
        ap.error(
            "need --chunk > 0, --context >= --chunk, --speed > 0, --width > 0, --layers >= 0, --steps >= 1, "
            "--rounds >= 1, --interrupt-every >= 0 and 0 <= --interrupt-after < --chunk"
        )
    try:
        do.set_enqueue_slice(a.enqueue_slice)
    except do.SettingError as e:
        ap.error(str(e))
    need = _requirements(a.model)
    if need:  # (the arguments were fine: no usage text)
        raise SystemExit(f"{ap.prog}: {need}")

    import torch

    st = Stream(a)
    enc = MODELS[a.model]("cuda" if do.backend_name() == "cuda" else "cpu", a.width, a.layers)
    for c in st.chunks[:3]:  # warm-up: PyTorch's kernels and allocator, deviceop's pools
        _torch_chunk(enc, c)
    if enc.device == "cuda":
        torch.cuda.synchronize()
    # what exists now lives to the end: the garbage collector need not traverse it again (a full
    # collection with PyTorch imported stops the thread for tens of milliseconds, in any loop)
    gc.freeze()
    # the loops in turn, each round starting with the next one: whatever runs first in a
    # process (clocks ramping up, caches) is spread over all of them
    by: dict[str, Report] = {}
    for r in range(a.rounds):
        for n in loops[r % len(loops) :] + loops[: r % len(loops)]:
            print(
                f"round {r + 1} of {a.rounds}: the {n} loop over {st.seconds:.1f} s of audio "
                f"({st.seconds / a.speed:.1f} s at --speed {a.speed:g})...",
                flush=True,
            )
            rep = LOOPS[n](st, enc, a)
            by[n] = by[n].merge(rep) if n in by else rep
    reports = [by[n] for n in loops]
    doc = {
        "backend": do.backend_name(),
        "audio_s": st.seconds,
        "chunks": len(st.chunks),
        "voiced_chunks": sum(st.voiced),
        "config": vars(a),
        "loops": [r.summary() for r in reports],
    }
    print(f"{st.seconds:.1f} s of audio, {len(st.chunks)} chunks ({sum(st.voiced)} voiced), on {do.backend_name()}")
    for s in doc["loops"]:
        print(
            f"  {s['loop']:<15} chunk latency p50 {s['chunk_latency_ms_p50'] or 0:7.2f} ms p99 "
            f"{s['chunk_latency_ms_p99'] or 0:7.2f} ms  interrupt reaction p50 {s['reaction_ms_p50'] or 0:6.2f} ms "
            f"p99 {s['reaction_ms_p99'] or 0:6.2f} ms  CPU {s['cpu_s_per_audio_s']:.3f} s per audio s  "
            f"{s['host_threads']} thread(s)  published {s['published']}, cancelled {s['cancelled']}  "
            + "  ".join(f"{k} {v:.2f} ms" for k, v in s["stage_ms_p50"].items())
            + "".join(f"  reaction {k} {v['p50']:.2f} ms" for k, v in s["reaction_stage_ms"].items())
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
