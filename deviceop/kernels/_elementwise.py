"""Built-in elementwise kernels for float16, bfloat16 and float32, with 16-byte accesses.

Each has a numpy implementation for the host backend that computes in float32 and rounds to
nearest even, like the device code.

ABI: ``<op>_<sfx>(T* out, const T* in..., float scalar..., long long tile, int vec)``; block
``b`` owns the contiguous elements ``[b * tile, (b + 1) * tile)`` of the output. With ``vec``
(tiles over 256 elements and every pointer at the same address modulo 16, checked on the
host) a block peels the head up
to a 16-byte boundary, moves the middle as 16-byte vectors and finishes the tail element by
element; otherwise (views of different alignment) every access is one element.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from .._core._launch import BuiltinFront, KernelPlan, planned
from .._core._ledger import check_backend
from .._core._tensor import Partition, Tensor
from .._dtypes import bfloat16, float16, float32
from .._errors import DTypeError, ShapeError, UsageError
from ._calls import Axpy, Binary, Fill, Scale, Unary
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

__all__ = ["DTYPES", "ELEMENTWISE", "PRELUDE", "SFX", "Elementwise", "host_fn"]

SFX = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}
_SMALL_TILE = 256  # elements: tiles up to this size take the element-per-thread path
DTYPES = (float16, bfloat16, float32)

PRELUDE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
__device__ __forceinline__ float tof(float v) { return v; }
__device__ __forceinline__ float tof(__half v) { return __half2float(v); }
__device__ __forceinline__ float tof(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T fromf(float v);
template <> __device__ __forceinline__ float fromf<float>(float v) { return v; }
template <> __device__ __forceinline__ __half fromf<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 fromf<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <typename T> __device__ __forceinline__ float ld(const T* p, long long i) { return tof(p[i]); }
template <typename T> __device__ __forceinline__ void st(T* p, long long i, float v) { p[i] = fromf<T>(v); }
// 16 bytes at once: V = 16 / sizeof(T) elements, converted to float
template <typename T> struct Vec { static constexpr int N = 16 / sizeof(T); };
template <typename T> __device__ __forceinline__ void ldv(const T* p, float* f) {
  uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
  const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
  for (int k = 0; k < Vec<T>::N; ++k) f[k] = tof(e[k]);
}
template <typename T> __device__ __forceinline__ void stv(T* p, const float* f) {
  uint4 u;
  T* e = reinterpret_cast<T*>(&u);
#pragma unroll
  for (int k = 0; k < Vec<T>::N; ++k) e[k] = fromf<T>(f[k]);
  *reinterpret_cast<uint4*>(p) = u;
}
__device__ __forceinline__ float gelu_tanh(float x) {
  return 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}
__device__ __forceinline__ float silu(float x) { return x / (1.f + __expf(-x)); }
"""


class Elementwise(BuiltinFront):
    """A built-in elementwise kernel family: ``op(out_partition, *inputs, *scalars)``.

    Calling it checks the arguments and returns the kernel call op. Launch plans are kept per
    argument layout (tile, shapes, strides, dtype, alignment, device): a call on fresh tensors
    of a known shape reuses the plan and only the addresses change (the call itself is
    compiled: ``deviceop._core._launch.BuiltinFront``).
    """

    def __init__(self, name: str, n_in: int, n_scalar: int, body: str, host: Callable[..., Any], doc: str) -> None:
        self.name = name
        self.n_in = n_in
        self.n_scalar = n_scalar
        self.body = body
        self.host_impl = host
        self.__doc__ = doc
        self.__signature__: inspect.Signature = signature_from_doc(doc)
        self.plans: PlanCache = PlanCache()
        self.n_args: int = 1 + n_in + n_scalar
        self.n_tensors: int = 1 + n_in
        self._writes = (True,) + (False,) * n_in
        # parameter layout: out and inputs (pointers), scalars (float32), tile (int64), vec (int32)
        self._layout = tuple((SRC_TENSOR, i, T_PTR, 0) for i in range(1 + n_in)) + tuple(
            (SRC_SCALAR, i, T_F32, 0) for i in range(n_scalar)
        )

    def __repr__(self) -> str:
        return f"<built-in kernel {self.name}>"

    def source(self) -> str:
        """The CUDA C++ of this op for every dtype (see the module docstring for the ABI)."""
        xs = [f"x{i}" for i in range(self.n_in)]
        ss = [f"s{i}" for i in range(self.n_scalar)]
        params_in = "".join(f", const T* __restrict__ {x}" for x in xs)
        params_s = "".join(f", float {v}" for v in ss)
        fargs = ", ".join([f"float {x}" for x in xs] + [f"float {v}" for v in ss]) or "void"
        call_v = ", ".join([f"a{i}[k]" for i in range(self.n_in)] + ss)
        call_s = ", ".join([f"ld({x}, e)" for x in xs] + ss)
        loads = " ".join(f"float a{i}[V]; ldv({x} + e, a{i});" for i, x in enumerate(xs))
        args = "".join(f", {x}" for x in xs) + "".join(f", {v}" for v in ss)
        out = [
            f"__device__ __forceinline__ float {self.name}_f({fargs}) {{ return {self.body}; }}",
            f"template <typename T> __device__ __forceinline__ void {self.name}_t(T* __restrict__ out{params_in}{params_s}, long long tile, int vec) {{",
            "  constexpr int V = Vec<T>::N;",
            "  long long base = (long long)blockIdx.x * tile, end = base + tile, i = base;",
            "  if (vec) {",
            "    int mis = (int)(reinterpret_cast<size_t>(out + base) & 15);",
            "    long long head = mis ? (long long)((16 - mis) / sizeof(T)) : 0;",
            "    if (head > tile) head = tile;",
            "    long long nv = (tile - head) / V;",
            "    long long vb = base + head;",
            "#pragma unroll 4",
            "    for (long long j = threadIdx.x; j < nv; j += blockDim.x) {",
            f"      long long e = vb + j * V; {loads} float r[V];",
            "#pragma unroll",
            f"      for (int k = 0; k < V; ++k) r[k] = {self.name}_f({call_v});",
            "      stv(out + e, r);",
            "    }",
            f"    for (long long e = base + threadIdx.x; e < vb; e += blockDim.x) st(out, e, {self.name}_f({call_s}));",
            "    i = vb + nv * V;",
            "  }",
            f"  for (long long e = i + threadIdx.x; e < end; e += blockDim.x) st(out, e, {self.name}_f({call_s}));",
            "}",
        ]
        for d in DTYPES:
            sfx = SFX[d.name]
            sig = params_in.replace("T*", f"{d.ctype}*") + params_s
            out.append(
                f'extern "C" __global__ void __launch_bounds__(256) {self.name}_{sfx}({d.ctype}* __restrict__ out{sig}, long long tile, int vec) '
                f"{{ {self.name}_t(out{args}, tile, vec); }}"
            )
        return "\n".join(out)

    def _call_slow(self, args: tuple[Any, ...]) -> Any:
        n = self.n_args
        if len(args) != n:
            raise UsageError(
                f"do.kernels.{self.name}() takes {n} arguments (out partition, {self.n_in} input tensor(s), "
                f"{self.n_scalar} scalar(s)), got {len(args)}"
            )
        if has_op(args):
            return KernelCall(self, args, None, True)
        nt = self.n_tensors
        scalars = tuple(check_scalar(args[i], float32, f"scalar {i - nt} of {self.name}()") for i in range(nt, n))
        args = args[:nt] + scalars
        return planned(self, args, self.plan(args, None), nt)

    def plan(self, args: tuple[Any, ...], opts: Any) -> KernelPlan:
        """Validate ``args`` and return their launch plan (made once per argument layout)."""
        self._check_tensors(args)
        for i in range(self.n_tensors, len(args)):
            check_scalar(args[i], float32, f"scalar {i - self.n_tensors} of {self.name}()")
        nt = self.n_tensors
        key = args[0]._key if nt == 1 else (args[0]._key, *(a._key for a in args[1:nt]))
        p = self.plans.get(key)
        if p is None:
            p = self.plans.put(key, self._make_plan(args))
        return p

    def _check_tensors(self, args: tuple[Any, ...]) -> None:
        out = args[0]
        if type(out) is not Partition:
            hint = " (call .partition((128,)) on it)" if type(out) is Tensor else ""
            raise UsageError(
                f"the output of do.kernels.{self.name}() must be a Partition of a tensor{hint}, got {type(out).__name__}"
            )
        t = out.tensor
        if t.dtype not in DTYPES:
            raise DTypeError(f"do.kernels.{self.name}() supports float16, bfloat16 and float32, not {t.dtype.name}")
        check_tensor(t, t.dtype, f"the output of {self.name}()")
        if out.tile[1:] != t.shape[1:]:
            raise ShapeError(
                f"{self.name}(): tile {out.tile} of shape {t.shape} is not contiguous in memory; elementwise "
                f"built-ins need tiles spanning the trailing dimensions, e.g. tile {(out.tile[0], *t.shape[1:])}"
            )
        be = t.buffer.backend
        for i in range(self.n_in):
            x = args[1 + i]
            # named by position after the output (argument 0): the call's argument i + 1
            what = f"input {i} of {self.name}() (argument {i + 1}, after the output)"
            if type(x) is Partition:
                raise UsageError(f"{what} is read-only: pass the Tensor, not a Partition")
            check_tensor(x, t.dtype, what)
            if x.shape != t.shape:
                raise ShapeError(f"{what} has shape {x.shape} but the output has shape {t.shape}")
            if x.buffer.backend is not be:
                raise UsageError(f"{what} lives on {x.device}, the output on {t.device}; move it first")

    def _make_plan(self, args: tuple[Any, ...]) -> KernelPlan:
        """What a launch needs that depends only on the arguments' layout and device."""
        out = args[0]
        t = out.tensor
        be = t.buffer.backend
        tile = math.prod(out.tile)
        cuda = None
        if be.driver is not None and t.size:
            fn = FUNCS.get(be, f"{self.name}_{SFX[t.dtype.name]}")
            # 16-byte accesses need every array at the same offset within 16 bytes, and pay only
            # on tiles larger than one element per thread of a block: small tiles are latency-,
            # not bandwidth-bound, and there one element per thread finishes sooner
            aligns = {t.addr % 16, *(a.addr % 16 for a in args[1 : self.n_tensors])}
            vec = int(tile > _SMALL_TILE and len(aligns) == 1)
            per = (tile + 7) // 8 if vec else tile
            block = min(256, max(32, (per + 31) // 32 * 32))
            grid = (math.prod(out.grid), 1, 1)
            layout = (*self._layout, (SRC_FIXED, 0, T_I64, tile), (SRC_FIXED, 0, T_I32, vec))
            cuda = LaunchPlan(be.driver, int(fn), grid, (block, 1, 1), 0, layout, self._writes, self)
        return KernelPlan(be, cuda, t.size == 0)

    def enqueue(self, cx: Any, args: tuple[Any, ...], opts: Any, p: KernelPlan) -> None:
        """Enqueue a call with arguments produced by ops (cuda), or on the host backend."""
        if p.empty:
            return  # empty tensor: nothing to do
        check_backend(cx, p.be, f"{self.name}()")
        n = self.n_tensors
        if p.cuda is not None:
            launch(cx, p.cuda, (args[0].tensor, *args[1:n]), args[n:])
        else:
            tensors = (args[0].tensor, *args[1:n])
            launch_host(cx, self, self.host_impl, _host_args(args, self.n_in), tensors, self._writes)


def _host_args(args: tuple[Any, ...], n_in: int) -> tuple[Any, ...]:
    arrays = [host_array(args[0].tensor)] + [host_array(x) for x in args[1 : 1 + n_in]]
    return (*arrays, *(np.float32(s) for s in args[1 + n_in :]))


def host_fn(fn: Callable[..., np.ndarray]) -> Callable[..., None]:
    """A numpy implementation: inputs to float32, ``fn`` in float32, one rounding to the output."""

    def run(out: np.ndarray, *rest: Any) -> None:
        vals = [r.astype(np.float32) if isinstance(r, np.ndarray) else np.float32(r) for r in rest]
        with np.errstate(over="ignore", invalid="ignore"):
            res = np.asarray(fn(*vals), dtype=np.float32)
        out[...] = np.broadcast_to(res, out.shape).astype(out.dtype)

    return run


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    c = np.float32(0.7978845608028654)
    y: np.ndarray = np.float32(0.5) * x * (np.float32(1) + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))
    return y


def _silu(x: np.ndarray) -> np.ndarray:
    y: np.ndarray = x / (np.float32(1) + np.exp(-x))
    return y


def _op(name: str, n_in: int, n_s: int, body: str, fn: Callable[..., np.ndarray], doc: str) -> Elementwise:
    return Elementwise(name, n_in, n_s, body, host_fn(fn), doc)


fill: Fill = cast("Fill", _op("fill", 0, 1, "s0", lambda v: v, "fill(out_partition, value): out[:] = value"))
copy: Unary = cast("Unary", _op("copy", 1, 0, "x0", lambda x: x, "copy(out_partition, x): out = x"))
scale: Scale = cast(
    "Scale", _op("scale", 1, 1, "x0 * s0", lambda x, g: x * g, "scale(out_partition, x, g): out = x * g")
)
add: Binary = cast("Binary", _op("add", 2, 0, "x0 + x1", lambda x, y: x + y, "add(out_partition, x, y): out = x + y"))
mul: Binary = cast("Binary", _op("mul", 2, 0, "x0 * x1", lambda x, y: x * y, "mul(out_partition, x, y): out = x * y"))
axpy: Axpy = cast(
    "Axpy",
    _op("axpy", 2, 1, "fmaf(s0, x0, x1)", lambda x, y, a: a * x + y, "axpy(out_partition, x, y, a): out = a * x + y"),
)
relu: Unary = cast(
    "Unary",
    _op(
        "relu",
        1,
        0,
        "fmaxf(x0, 0.f)",
        lambda x: np.maximum(x, np.float32(0)),
        "relu(out_partition, x): out = max(x, 0)",
    ),
)
gelu: Unary = cast(
    "Unary",
    _op(
        "gelu",
        1,
        0,
        "gelu_tanh(x0)",
        _gelu_tanh,
        "gelu(out_partition, x): GELU, tanh approximation (as torch's approximate='tanh')",
    ),
)
silu: Unary = cast("Unary", _op("silu", 1, 0, "silu(x0)", _silu, "silu(out_partition, x): out = x * sigmoid(x)"))

ELEMENTWISE: tuple[Elementwise, ...] = cast(
    "tuple[Elementwise, ...]", (fill, copy, scale, add, mul, axpy, relu, gelu, silu)
)
