"""Kernels: NVRTC compilation with a disk cache, typed user kernels, and built-ins.

``Kernel(source, name, params=(Out(dt), In(dt), scalar_dtype...), host=numpy_fn)`` wraps a user
CUDA C++ kernel. Built in, for float16, bfloat16 and float32: elementwise ``fill``, ``copy``,
``scale``, ``add``, ``mul``, ``axpy``, ``relu``, ``gelu``, ``silu``; row-wise ``sum``, ``max``,
``softmax``, ``rms_norm``; ``matvec``; ``gemm`` through cuBLAS. Every kernel call returns an op whose output is its
arguments.
"""

from typing import TYPE_CHECKING

from ._builtins import BUILTIN_SOURCE, builtin_names, compile_builtins, warmup
from ._elementwise import add, axpy, copy, fill, gelu, mul, relu, scale, silu
from ._kernel import Kernel
from ._nvrtc import cache_dir, cache_stats, compile_cubin
from ._params import In, InOut, Out
from ._rowwise import matvec, rms_norm, softmax
from ._rowwise import row_max as max
from ._rowwise import row_sum as sum

if TYPE_CHECKING:
    from ._gemm import gemm

__all__ = [
    "BUILTIN_SOURCE",
    "In",
    "InOut",
    "Kernel",
    "Out",
    "add",
    "axpy",
    "builtin_names",
    "cache_dir",
    "cache_stats",
    "compile_builtins",
    "compile_cubin",
    "copy",
    "fill",
    "gelu",
    "gemm",
    "matvec",
    "max",
    "mul",
    "relu",
    "rms_norm",
    "scale",
    "silu",
    "softmax",
    "sum",
    "warmup",
]


def __getattr__(name: str) -> object:
    # gemm loads on first use (its module is start-up time for programs that never call it)
    if name == "gemm":
        from ._gemm import gemm

        globals()["gemm"] = gemm
        return gemm
    raise AttributeError(f"module 'deviceop.kernels' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({n for n in globals() if n.startswith("_")} | set(__all__))
