"""Built-in elementwise kernels (fill, scale, add) for float16, bfloat16 and float32.

One CUDA source holds every built-in for every dtype, so one NVRTC compile (cached on disk)
and one module load serve them all. Each has a numpy implementation for the host backend that
computes in float32 and rounds to nearest even, like the device code.

ABI: ``<op>_<sfx>(T* out, const T* in..., float scalar..., long long tile)``; block ``b`` of the
grid owns the contiguous elements ``[b * tile, (b + 1) * tile)`` of the output.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any, Callable

import numpy as np

from .._dtypes import bfloat16, float16, float32
from .._errors import DTypeError, ShapeError, UsageError
from ..device._select import _state as _SELECTED
from ..device._select import current
from ..device._tensor import Partition, Tensor
from ..ops._base import DeviceOp
from ._kernel import CompiledFunctions, check_scalar, check_tensor
from ._launch import CudaPlan, KernelCall, host_array, launch_cuda, launch_host, same, weak

__all__ = ["fill", "scale", "add", "BUILTINS", "BUILTIN_SOURCE", "compile_builtins"]

_SFX = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}
_DTYPES = (float16, bfloat16, float32)

_PRELUDE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
__device__ __forceinline__ float ld(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float ld(const __half* p, long long i) { return __half2float(p[i]); }
__device__ __forceinline__ float ld(const __nv_bfloat16* p, long long i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void st(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void st(__half* p, long long i, float v) { p[i] = __float2half_rn(v); }
__device__ __forceinline__ void st(__nv_bfloat16* p, long long i, float v) { p[i] = __float2bfloat16_rn(v); }
#define TILE_LOOP for (long long i = base + threadIdx.x, e = base + tile; i < e; i += blockDim.x)
"""


class Elementwise:
    """A built-in elementwise kernel family: ``op(out_partition, *inputs, *scalars)``."""

    def __init__(self, name: str, n_in: int, n_scalar: int, body: str, host: Callable[..., Any], doc: str) -> None:
        self.name = name
        self.n_in = n_in
        self.n_scalar = n_scalar
        self.body = body
        self.host_impl = host
        self.__doc__ = doc
        self._ctypes = [ctypes.c_uint64] * (1 + n_in) + [ctypes.c_float] * n_scalar + [ctypes.c_int64]
        # the last validated and planned arguments (held by weak reference)
        self._plan: _Plan | None = None
        self._writes = (True,) + (False,) * n_in
        self._n = 1 + n_in + n_scalar
        self._n_t = 1 + n_in

    def __repr__(self) -> str:
        return f"<built-in kernel {self.name}>"

    def source(self) -> str:
        params_in = "".join(f", const T* x{i}" for i in range(self.n_in))
        params_s = "".join(f", float s{i}" for i in range(self.n_scalar))
        args = "".join(f", x{i}" for i in range(self.n_in)) + "".join(f", s{i}" for i in range(self.n_scalar))
        out = [
            f"template <typename T> __device__ __forceinline__ void {self.name}_t(T* out{params_in}{params_s}, long long tile) {{",
            "  long long base = (long long)blockIdx.x * tile;",
            f"  TILE_LOOP {{ {self.body} }}",
            "}",
        ]
        for d in _DTYPES:
            sfx = _SFX[d.name]
            sig = params_in.replace("T*", f"{d.ctype}*") + params_s
            out.append(
                f'extern "C" __global__ void {self.name}_{sfx}({d.ctype}* out{sig}, long long tile) '
                f"{{ {self.name}_t(out{args}, tile); }}"
            )
        return "\n".join(out)

    def __call__(self, *args: Any) -> KernelCall:
        p = self._plan
        if p is not None and len(args) == self._n and p.be is _SELECTED["backend"]:
            # the launch path: the same tensors as last time (validated then), plain float scalars
            i = 0
            for r in p.refs:
                if r() is not args[i]:
                    break
                i += 1
            else:
                for v in args[i:]:
                    if type(v) is not float:
                        break
                else:
                    return _PlannedCall(self, args, p)
        return self._call_slow(args)

    def _call_slow(self, args: tuple[Any, ...]) -> KernelCall:
        n = self._n
        if len(args) != n:
            raise UsageError(
                f"do.kernels.{self.name}() takes {n} arguments (out partition, {self.n_in} input tensor(s), "
                f"{self.n_scalar} scalar(s)), got {len(args)}"
            )
        for a in args:
            if isinstance(a, DeviceOp):
                return KernelCall(self, args, None, True)
        # validate (bad input fails here, before any GPU work) and plan the launch, once per
        # distinct set of tensor arguments
        p = self._plan
        be = current()
        if p is None or p.be is not be or not same(p.refs, args):
            self._check_tensors(args)
            p = self._plan = self._make_plan(be, args)
        for i in range(1 + self.n_in, n):
            if type(args[i]) is not float:
                check_scalar(args[i], float32, f"scalar {i - 1 - self.n_in} of {self.name}()")
        return KernelCall(self, args, None, False, p)

    def check(self, args: tuple[Any, ...], opts: Any) -> None:
        """Validate arguments produced by ops (at run time, before the launch)."""
        self._check_tensors(args)
        for i in range(1 + self.n_in, len(args)):
            check_scalar(args[i], float32, f"scalar {i - 1 - self.n_in} of {self.name}()")

    def _check_tensors(self, args: tuple[Any, ...]) -> None:
        out = args[0]
        if type(out) is not Partition:
            hint = " (call .partition((128,)) on it)" if type(out) is Tensor else ""
            raise UsageError(
                f"the output of do.kernels.{self.name}() must be a Partition of a tensor{hint}, got {type(out).__name__}"
            )
        t = out.tensor
        if t.dtype not in _DTYPES:
            raise DTypeError(f"do.kernels.{self.name}() supports float16, bfloat16 and float32, not {t.dtype.name}")
        check_tensor(t, t.dtype, f"the output of {self.name}()")
        if out.tile[1:] != t.shape[1:]:
            raise ShapeError(
                f"{self.name}(): tile {out.tile} of shape {t.shape} is not contiguous in memory; elementwise "
                f"built-ins need tiles spanning the trailing dimensions, e.g. tile {(out.tile[0],) + t.shape[1:]}"
            )
        for i in range(self.n_in):
            x = args[1 + i]
            if type(x) is Partition:
                raise UsageError(f"input {i} of {self.name}() is read-only: pass the Tensor, not a Partition")
            check_tensor(x, t.dtype, f"input {i} of {self.name}()")
            if x.shape != t.shape:
                raise ShapeError(f"input {i} of {self.name}() has shape {x.shape} but the output has shape {t.shape}")

    def _make_plan(self, be: Any, args: tuple[Any, ...]) -> "_Plan":
        """What a launch needs that depends only on the tensor arguments and the backend.

        Holds the arguments by weak reference only, so a cached plan never keeps memory alive.
        """
        out = args[0]
        t = out.tensor
        tensors = [t, *args[1 : 1 + self.n_in]]
        for x in tensors:
            if x.buffer.backend is not be:
                raise UsageError(f"{self.name}(): {x!r} lives on the {x.buffer.backend.name} backend, not {be.name}")
        tile = math.prod(out.tile)
        cuda = None
        if be.name == "cuda" and t.size:
            fn, packer = _FUNCS.get(be, f"{self.name}_{_SFX[t.dtype.name]}", self._ctypes)
            block = min(256, (tile + 31) // 32 * 32)
            grid = (math.prod(out.grid), 1, 1)
            cuda = CudaPlan(fn, packer, grid, (block, 1, 1), 0, self._writes, tuple(x.ptr for x in tensors), tile)
        return _Plan(weak(args[: 1 + self.n_in]), be, cuda, t.size == 0)

    def enqueue(self, cx: Any, args: tuple[Any, ...], opts: Any, p: Any = None) -> None:
        if p is None or p.be is not cx.backend:  # args produced by ops, or the backend changed since the call
            p = self._make_plan(cx.backend, args)
        if p.empty:
            return  # empty tensor: nothing to do
        n = self._n_t
        tensors = (args[0].tensor, *args[1:n])
        if p.cuda is not None:
            launch_cuda(cx, self, p.cuda, tensors, args[n:])
        else:
            launch_host(cx, self, self.host_impl, _host_args(args, self.n_in), tensors, self._writes)


class _PlannedCall(KernelCall):
    """A built-in call whose plain arguments match the kernel's cached plan: the launch path."""

    __slots__ = ()

    def __init__(self, k: Elementwise, args: tuple[Any, ...], plan: "_Plan") -> None:
        self._used = None
        self._k = k
        self._args = args
        self._plan = plan

    def _run(self, cx: Any) -> tuple:
        p = self._plan
        c = p.cuda
        if c is None or p.be is not cx.backend:
            self._k.enqueue(cx, self._args, None, p)
            return self._args
        args = self._args
        k = self._k
        n = k._n_t
        if n == 2:  # scale: the common case, without building a tuple by unpacking
            launch_cuda(cx, k, c, (args[0].tensor, args[1]), args[2:])
        else:
            launch_cuda(cx, k, c, (args[0].tensor, *args[1:n]), args[n:])
        return args


class _Plan:
    __slots__ = ("refs", "be", "cuda", "empty")

    def __init__(self, refs: tuple[Any, ...], be: Any, cuda: "CudaPlan | None", empty: bool) -> None:
        self.refs = refs
        self.be = be
        self.cuda = cuda
        self.empty = empty


def _host_args(args: tuple[Any, ...], n_in: int) -> tuple[Any, ...]:
    arrays = [host_array(args[0].tensor)] + [host_array(x) for x in args[1 : 1 + n_in]]
    return (*arrays, *(np.float32(s) for s in args[1 + n_in :]))


def _f32(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32)


def _host_fill(out: np.ndarray, v: np.float32) -> None:
    out[...] = np.float32(v).astype(out.dtype)


def _host_scale(out: np.ndarray, x: np.ndarray, g: np.float32) -> None:
    out[...] = (_f32(x) * g).astype(out.dtype)


def _host_add(out: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
    out[...] = (_f32(x) + _f32(y)).astype(out.dtype)


fill = Elementwise("fill", 0, 1, "st(out, i, s0);", _host_fill, "fill(out_partition, value): out[:] = value")
scale = Elementwise("scale", 1, 1, "st(out, i, ld(x0, i) * s0);", _host_scale, "scale(out_partition, x, g): out = x * g")
add = Elementwise("add", 2, 0, "st(out, i, ld(x0, i) + ld(x1, i));", _host_add, "add(out_partition, x, y): out = x + y")

BUILTINS = (fill, scale, add)
BUILTIN_SOURCE = _PRELUDE + "\n".join(k.source() for k in BUILTINS)
_FUNCS = CompiledFunctions(BUILTIN_SOURCE, "builtins")


def compile_builtins(arch: str = "sm_90") -> bytes:
    """Compile every built-in kernel for ``arch`` with NVRTC (no GPU needed); return the CUBIN."""
    from ._nvrtc import compile_cubin

    return compile_cubin(BUILTIN_SOURCE, "builtins", arch)


def builtin_names() -> list[str]:
    """The extern "C" names of every built-in kernel function."""
    return [f"{k.name}_{_SFX[d.name]}" for k in BUILTINS for d in _DTYPES]


