"""Built-in row-wise kernels: sum, max, softmax, rms_norm and matvec over 2-D tensors.

The output is partitioned by rows: ``softmax(y.partition((r, n)), x)`` (whole rows per tile) or
``sum(s.partition((r,)), x)`` for one value per row; block ``b`` handles rows
``[b * r, (b + 1) * r)``. Rows are read with 16-byte accesses when every row starts on a 16-byte
boundary (aligned base, row bytes a multiple of 16), else element by element. Reductions run in
float32 with warp shuffles; softmax uses the online (one-pass) max and sum, so a row is read
twice (the second time from cache) and written once.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any, Callable

import numpy as np

from .._errors import DTypeError, ShapeError, UsageError
from ..device._tensor import Partition
from ..ops._base import DeviceOp
from ._elementwise import DTYPES, SFX
from ._kernel import check_scalar, check_tensor
from ._launch import CudaPlan, KernelCall, host_array, launch_cuda, launch_host

__all__ = ["RowWise", "ROWWISE", "ROW_PRELUDE", "row_sum", "row_max", "softmax", "rms_norm", "matvec"]

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


class RowWise:
    """A built-in row-wise kernel family (see the module docstring)."""

    def __init__(self, name: str, kind: str, host: Callable[..., None], doc: str) -> None:
        self.name = name
        self.kind = kind  # "reduce" (one value per row), "map" (same shape), "rms", "matvec"
        self.host_impl = host
        self.__doc__ = doc
        n_ptr = {"reduce": 2, "map": 2, "rms": 3, "matvec": 3}[kind]
        self._n_t = n_ptr
        self._ctypes = [ctypes.c_uint64] * n_ptr + ([ctypes.c_float] if kind == "rms" else []) + [
            ctypes.c_int64, ctypes.c_int64, ctypes.c_int32]
        self._writes = (True,) + (False,) * (n_ptr - 1)

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

    def __call__(self, *args: Any) -> KernelCall:
        n = self._n_t + (1 if self.kind == "rms" else 0)
        if self.kind == "rms" and len(args) == 3:
            args = (*args, 1e-6)
        if len(args) != n:
            raise UsageError(f"do.kernels.{self.name}() takes {n} arguments, got {len(args)}; see help(do.kernels.{self.name})")
        for a in args:
            if isinstance(a, DeviceOp):
                return KernelCall(self, args, None, True)
        self.check(args, None)
        return KernelCall(self, args, None, False)

    def check(self, args: tuple[Any, ...], opts: Any) -> None:
        """Validate the arguments (before any GPU work)."""
        out = args[0]
        name = self.name
        if type(out) is not Partition:
            raise UsageError(f"the output of do.kernels.{name}() must be a Partition by rows (t.partition((rows_per_block, ...)))")
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
                raise ShapeError(f"{name}(): the vector must have shape ({n},) to match a {src.shape} matrix, got {x.shape}")

    def enqueue(self, cx: Any, args: tuple[Any, ...], opts: Any, plan: Any = None) -> None:
        out = args[0]
        y = out.tensor
        tensors = (y, *args[1 : self._n_t])
        for t in tensors:
            if t.buffer.backend is not cx.backend:
                raise UsageError(f"{self.name}(): {t!r} lives on the {t.buffer.backend.name} backend, not {cx.backend.name}")
        rows, n = args[1].shape
        if rows == 0:
            return
        if cx.backend.name != "cuda":
            arrays = tuple(host_array(t) for t in tensors) + ((np.float32(args[3]),) if self.kind == "rms" else ())
            launch_host(cx, self, self.host_impl, arrays, tensors, self._writes)
            return
        from ._builtins import FUNCS

        fn, packer = FUNCS.get(cx.backend, f"{self.name}_{SFX[y.dtype.name]}", self._ctypes)
        it = y.dtype.itemsize
        vectored = tensors if self.kind in ("map", "rms") else tensors[1:]  # (reductions write scalars)
        vec = int(n * it % 16 == 0 and all(t.ptr % 16 == 0 for t in vectored))
        r = out.tile[0]
        block = 256 if n >= 2048 else max(32, min(256, (((n + 7) // 8 if vec else n) + 31) // 32 * 32))
        scalars = (float(args[3]),) if self.kind == "rms" else ()
        p = CudaPlan(fn, packer, (math.prod(out.grid[:1]), 1, 1), (block, 1, 1), 0, self._writes,
                     tuple(t.ptr for t in tensors), (n, r, vec))
        launch_cuda(cx, self, p, tensors, scalars)


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
row_sum = RowWise("sum", "reduce", _host_sum, "sum(out.partition((r,)), x): out[i] = sum of row i of the 2-D x")
row_max = RowWise("max", "reduce", _host_max, "max(out.partition((r,)), x): out[i] = max of row i of the 2-D x")
softmax = RowWise("softmax", "map", _host_softmax, "softmax(y.partition((r, n)), x): softmax of each row of x")
rms_norm = RowWise(
    "rms_norm", "rms", _host_rms_norm,
    "rms_norm(y.partition((r, n)), x, w, eps=1e-6): y = x / sqrt(mean(x^2) + eps) * w, per row",
)
matvec = RowWise("matvec", "matvec", _host_matvec, "matvec(y.partition((r,)), a, x): y = a @ x for a 2-D a")

ROWWISE = (row_sum, row_max, softmax, rms_norm, matvec)
