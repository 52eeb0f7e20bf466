"""Built-in row-wise kernels: sum, max, softmax, rms_norm and matvec over 2-D tensors.

The output is partitioned by rows: ``softmax(y.partition((r, n)), x)`` (whole rows per tile) or
``sum(s.partition((r,)), x)`` for one value per row; block ``b`` handles rows
``[b * r, (b + 1) * r)``. Rows are read with 16-byte accesses when every row starts on a 16-byte
boundary (aligned base, row bytes a multiple of 16), else element by element. Reductions run in
float32 with warp shuffles; softmax uses the online (one-pass) max and sum, so a row is read
twice (the second time from cache) and written once.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from .._core._launch import BuiltinFront, KernelPlan, planned
from .._core._tensor import Partition
from .._errors import DTypeError, ShapeError, UsageError
from ._calls import Binary, RmsNorm, Unary
from ._elementwise import DTYPES, SFX
from ._kernel import check_scalar, check_tensor
from ._launch import (
    SRC_FIXED,
    SRC_SCALAR,
    SRC_TENSOR,
    T_F32,
    T_I32,
    T_I64,
    T_PTR,
    KernelCall,
    LaunchPlan,
    PlanCache,
    has_op,
    host_array,
    launch,
    launch_host,
    signature_from_doc,
)
from ._library import FUNCS

__all__ = ["ROWWISE", "ROW_PRELUDE", "RowWise", "matvec", "rms_norm", "row_max", "row_sum", "softmax"]

ROW_PRELUDE = r"""
#define INFINITY __int_as_float(0x7f800000)
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// every thread gets the block's reduction; sh holds 33 floats
template <bool MAX> __device__ __forceinline__ float block_reduce(float v, float* sh) {
  v = MAX ? warp_max(v) : warp_sum(v);
  int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = (blockDim.x + 31) >> 5;
  __syncthreads();  // the previous reduction's readers are done with sh
  if (l == 0) sh[w] = v;
  __syncthreads();
  if (w == 0) {
    v = l < nw ? sh[l] : (MAX ? -INFINITY : 0.f);
    v = MAX ? warp_max(v) : warp_sum(v);
    if (l == 0) sh[32] = v;
  }
  __syncthreads();
  return sh[32];
}
// f(j, x[j]) for this thread's share of a row of n elements
template <typename T, typename F> __device__ __forceinline__ void row_each(const T* p, long long n, int vec, F f) {
  constexpr int V = Vec<T>::N;
  if (vec) {
    for (long long j = threadIdx.x; j < n / V; j += blockDim.x) {
      float a[V]; ldv(p + j * V, a);
#pragma unroll
      for (int k = 0; k < V; ++k) f(j * V + k, a[k]);
    }
  } else {
    for (long long j = threadIdx.x; j < n; j += blockDim.x) f(j, tof(p[j]));
  }
}
// out[j] = f(x[j], w[j]) (w may be x when unused)
template <typename T, typename F> __device__ __forceinline__ void row_map(T* out, const T* p, const T* w, long long n, int vec, F f) {
  constexpr int V = Vec<T>::N;
  if (vec) {
    for (long long j = threadIdx.x; j < n / V; j += blockDim.x) {
      float a[V], b[V], r[V]; ldv(p + j * V, a); ldv(w + j * V, b);
#pragma unroll
      for (int k = 0; k < V; ++k) r[k] = f(a[k], b[k]);
      stv(out + j * V, r);
    }
  } else {
    for (long long j = threadIdx.x; j < n; j += blockDim.x) out[j] = fromf<T>(f(tof(p[j]), tof(w[j])));
  }
}
template <typename T> __device__ __forceinline__ void rowsum_t(T* out, const T* x, long long n, long long r, int vec) {
  __shared__ float sh[33];
  for (long long row = blockIdx.x * r, e = row + r; row < e; ++row) {
    float s = 0.f;
    row_each(x + row * n, n, vec, [&](long long, float v) { s += v; });
    s = block_reduce<false>(s, sh);
    if (threadIdx.x == 0) out[row] = fromf<T>(s);
  }
}
template <typename T> __device__ __forceinline__ void rowmax_t(T* out, const T* x, long long n, long long r, int vec) {
  __shared__ float sh[33];
  for (long long row = blockIdx.x * r, e = row + r; row < e; ++row) {
    float m = -INFINITY;
    row_each(x + row * n, n, vec, [&](long long, float v) { m = fmaxf(m, v); });
    m = block_reduce<true>(m, sh);
    if (threadIdx.x == 0) out[row] = fromf<T>(m);
  }
}
template <typename T> __device__ __forceinline__ void softmax_t(T* out, const T* x, long long n, long long r, int vec) {
  __shared__ float sh[33];
  for (long long row = blockIdx.x * r, e = row + r; row < e; ++row) {
    const T* xr = x + row * n;
    float m = -INFINITY, s = 0.f;
    row_each(xr, n, vec, [&](long long, float v) {
      if (v > m) { s = s * __expf(m - v) + 1.f; m = v; } else if (v > -INFINITY) { s += __expf(v - m); }
    });
    float M = block_reduce<true>(m, sh);
    s = m > -INFINITY ? s * __expf(m - M) : 0.f;
    float inv = 1.f / block_reduce<false>(s, sh);
    row_map(out + row * n, xr, xr, n, vec, [&](float v, float) { return __expf(v - M) * inv; });
  }
}
template <typename T> __device__ __forceinline__ void rms_norm_t(T* out, const T* x, const T* w, float eps, long long n, long long r, int vec) {
  __shared__ float sh[33];
  for (long long row = blockIdx.x * r, e = row + r; row < e; ++row) {
    const T* xr = x + row * n;
    float ss = 0.f;
    row_each(xr, n, vec, [&](long long, float v) { ss = fmaf(v, v, ss); });
    float k = rsqrtf(block_reduce<false>(ss, sh) / (float)n + eps);
    row_map(out + row * n, xr, w, n, vec, [&](float v, float g) { return v * k * g; });
  }
}
template <typename T> __device__ __forceinline__ void matvec_t(T* out, const T* a, const T* x, long long n, long long r, int vec) {
  __shared__ float sh[33];
  for (long long row = blockIdx.x * r, e = row + r; row < e; ++row) {
    const T* ar = a + row * n;
    float s = 0.f;
    if (vec) {
      constexpr int V = Vec<T>::N;
      for (long long j = threadIdx.x; j < n / V; j += blockDim.x) {
        float u[V], v[V]; ldv(ar + j * V, u); ldv(x + j * V, v);
#pragma unroll
        for (int k = 0; k < V; ++k) s = fmaf(u[k], v[k], s);
      }
    } else {
      for (long long j = threadIdx.x; j < n; j += blockDim.x) s = fmaf(tof(ar[j]), tof(x[j]), s);
    }
    s = block_reduce<false>(s, sh);
    if (threadIdx.x == 0) out[row] = fromf<T>(s);
  }
}
"""


class RowWise(BuiltinFront):
    """A built-in row-wise kernel family (see the module docstring)."""

    def __init__(self, name: str, kind: str, host: Callable[..., None], doc: str) -> None:
        self.name = name
        self.kind = kind  # "reduce" (one value per row), "map" (same shape), "rms", "matvec"
        self.host_impl = host
        self.__doc__ = doc
        self.__signature__: inspect.Signature = signature_from_doc(doc)
        n_ptr = {"reduce": 2, "map": 2, "rms": 3, "matvec": 3}[kind]
        self._n_t = n_ptr
        self.n_tensors: int = n_ptr
        self.n_args: int = n_ptr + (1 if kind == "rms" else 0)
        self.check_scalars: bool = kind == "rms"  # eps must be > 0
        self._writes = (True,) + (False,) * (n_ptr - 1)
        # parameter layout: out and inputs (pointers), eps (float32, rms_norm), then n, r, vec
        self._layout = tuple((SRC_TENSOR, i, T_PTR, 0) for i in range(n_ptr)) + (
            ((SRC_SCALAR, 0, T_F32, 0),) if kind == "rms" else ()
        )
        self.plans: PlanCache = PlanCache()

    def __repr__(self) -> str:
        return f"<built-in kernel {self.name}>"

    def source(self) -> str:
        out = []
        for d in DTYPES:
            t, sfx = d.ctype, SFX[d.name]
            if self.kind == "rms":
                sig, call = f"{t}* out, const {t}* x, const {t}* w, float eps", "out, x, w, eps"
            elif self.kind == "matvec":
                sig, call = f"{t}* out, const {t}* a, const {t}* x", "out, a, x"
            else:
                sig, call = f"{t}* out, const {t}* x", "out, x"
            fn = {"sum": "rowsum", "max": "rowmax"}.get(self.name, self.name)
            out.append(
                f'extern "C" __global__ void __launch_bounds__(256) {self.name}_{sfx}({sig}, long long n, long long r, int vec) '
                f"{{ {fn}_t({call}, n, r, vec); }}"
            )
        return "\n".join(out)

    def _call_slow(self, args: tuple[Any, ...]) -> Any:
        n = self.n_args
        if self.kind == "rms" and len(args) == 3:
            args = (*args, 1e-6)
        if len(args) != n:
            raise UsageError(
                f"do.kernels.{self.name}() takes {n} arguments, got {len(args)}; see help(do.kernels.{self.name})"
            )
        if has_op(args):
            return KernelCall(self, args, None, True)
        p = self.plan(args, None)
        if self.kind == "rms":
            args = (*args[:3], float(args[3]))
        return planned(self, args, p, self._n_t)

    def _check_scalars(self, args: tuple[Any, ...]) -> None:
        eps = check_scalar(args[3], DTYPES[2], f"eps of {self.name}()")
        if not eps > 0:
            raise UsageError(f"{self.name}(): eps must be > 0, got {eps}")

    def plan(self, args: tuple[Any, ...], opts: Any) -> KernelPlan:
        """Validate ``args`` and return their launch plan (made once per argument layout)."""
        try:
            key = (args[0]._key, *(a._key for a in args[1 : self._n_t]))
        except AttributeError:
            key = None
        p = self.plans.get(key) if key is not None else None
        if p is None:
            self.check(args, None)
            p = self.plans.put(key, self._make_plan(args))
        elif self.kind == "rms":
            self._check_scalars(args)
        return p

    def check(self, args: tuple[Any, ...], opts: Any) -> None:
        """Validate the arguments (before any GPU work)."""
        out = args[0]
        name = self.name
        if type(out) is not Partition:
            raise UsageError(
                f"the output of do.kernels.{name}() must be a Partition by rows (t.partition((rows_per_block, ...)))"
            )
        y = out.tensor
        if y.dtype not in DTYPES:
            raise DTypeError(f"do.kernels.{name}() supports float16, bfloat16 and float32, not {y.dtype.name}")
        check_tensor(y, y.dtype, f"the output of {name}()")
        src = args[1]
        if type(src) is Partition:
            raise UsageError(f"input 0 of {name}() is read-only: pass the Tensor, not a Partition")
        check_tensor(src, y.dtype, f"input 0 of {name}()")
        if src.ndim != 2:
            raise ShapeError(f"{name}() reads a 2-D tensor (rows, n), got shape {src.shape}")
        rows, n = src.shape
        if self.kind in ("map", "rms"):
            if y.shape != src.shape or out.tile[1] != n:
                raise ShapeError(
                    f"{name}(): the output must have the input's shape {src.shape} and tiles of whole rows, "
                    f"e.g. .partition((1, {n})); got shape {y.shape}, tile {out.tile}"
                )
        elif y.shape != (rows,):
            raise ShapeError(f"{name}(): the output must have shape ({rows},) (one value per row), got {y.shape}")
        if self.kind == "rms":
            w = args[2]
            check_tensor(w, y.dtype, f"the weight of {name}()")
            if w.shape != (n,):
                raise ShapeError(f"{name}(): the weight must have shape ({n},), got {w.shape}")
            eps = check_scalar(args[3], DTYPES[2], f"eps of {name}()")
            if not eps > 0:
                raise UsageError(f"{name}(): eps must be > 0, got {eps}")
        if self.kind == "matvec":
            x = args[2]
            check_tensor(x, y.dtype, f"the vector of {name}()")
            if x.shape != (n,):
                raise ShapeError(
                    f"{name}(): the vector must have shape ({n},) to match a {src.shape} matrix, got {x.shape}"
                )
        for t in args[1 : self._n_t]:
            if t.buffer.backend is not y.buffer.backend:
                raise UsageError(f"{name}(): {t!r} lives on {t.device}, the output on {y.device}; move it first")

    def _make_plan(self, args: tuple[Any, ...]) -> KernelPlan:
        out = args[0]
        y = out.tensor
        be = y.buffer.backend
        rows, n = args[1].shape
        cuda = None
        if be.driver is not None and rows:
            fn = FUNCS.get(be, f"{self.name}_{SFX[y.dtype.name]}")
            tensors = (y, *args[1 : self._n_t])
            it = y.dtype.itemsize
            vectored = tensors if self.kind in ("map", "rms") else tensors[1:]  # (reductions write scalars)
            vec = int(n * it % 16 == 0 and all(t.addr % 16 == 0 for t in vectored))
            r = out.tile[0]
            block = 256 if n >= 2048 else max(32, min(256, (((n + 7) // 8 if vec else n) + 31) // 32 * 32))
            layout = (*self._layout, (SRC_FIXED, 0, T_I64, n), (SRC_FIXED, 0, T_I64, r), (SRC_FIXED, 0, T_I32, vec))
            cuda = LaunchPlan(
                be.driver, int(fn), (math.prod(out.grid[:1]), 1, 1), (block, 1, 1), 0, layout, self._writes, self
            )
        return KernelPlan(be, cuda, rows == 0)

    def enqueue(self, cx: Any, args: tuple[Any, ...], opts: Any, p: KernelPlan) -> None:
        """Enqueue a call with arguments produced by ops (cuda), or on the host backend."""
        if p.empty:
            return
        if p.be is not cx.backend:
            raise UsageError(
                f"{self.name}(): its tensors live on {p.be.device_label}, not on {cx.backend.device_label}"
            )
        tensors = (args[0].tensor, *args[1 : self._n_t])
        if p.cuda is not None:
            launch(cx, p.cuda, tensors, (float(args[3]),) if self.kind == "rms" else ())
            return
        arrays = tuple(host_array(t) for t in tensors) + ((np.float32(args[3]),) if self.kind == "rms" else ())
        launch_host(cx, self, self.host_impl, arrays, tensors, self._writes)


def _f32(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32)


def _host_sum(out: np.ndarray, x: np.ndarray) -> None:
    out[...] = _f32(x).sum(axis=1).astype(out.dtype)


def _host_max(out: np.ndarray, x: np.ndarray) -> None:
    out[...] = _f32(x).max(axis=1).astype(out.dtype)


def _host_softmax(out: np.ndarray, x: np.ndarray) -> None:
    v = _f32(x)
    e = np.exp(v - v.max(axis=1, keepdims=True))
    out[...] = (e / e.sum(axis=1, keepdims=True)).astype(out.dtype)


def _host_rms_norm(out: np.ndarray, x: np.ndarray, w: np.ndarray, eps: np.float32) -> None:
    v = _f32(x)
    k = np.float32(1) / np.sqrt((v * v).mean(axis=1, keepdims=True) + eps)
    out[...] = (v * k * _f32(w)).astype(out.dtype)


def _host_matvec(out: np.ndarray, a: np.ndarray, x: np.ndarray) -> None:
    out[...] = (_f32(a) @ _f32(x)).astype(out.dtype)


# exported as do.kernels.sum / max (named apart here so this module's max() stays the builtin)
row_sum: Unary = cast(
    "Unary", RowWise("sum", "reduce", _host_sum, "sum(out.partition((r,)), x): out[i] = sum of row i of the 2-D x")
)
row_max: Unary = cast(
    "Unary", RowWise("max", "reduce", _host_max, "max(out.partition((r,)), x): out[i] = max of row i of the 2-D x")
)
softmax: Unary = cast(
    "Unary", RowWise("softmax", "map", _host_softmax, "softmax(y.partition((r, n)), x): softmax of each row of x")
)
rms_norm: RmsNorm = cast(
    "RmsNorm",
    RowWise(
        "rms_norm",
        "rms",
        _host_rms_norm,
        "rms_norm(y.partition((r, n)), x, w, eps=1e-6): y = x / sqrt(mean(x^2) + eps) * w, per row",
    ),
)
matvec: Binary = cast(
    "Binary", RowWise("matvec", "matvec", _host_matvec, "matvec(y.partition((r,)), a, x): y = a @ x for a 2-D a")
)

ROWWISE: tuple[RowWise, ...] = cast("tuple[RowWise, ...]", (row_sum, row_max, softmax, rms_norm, matvec))
