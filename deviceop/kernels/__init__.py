"""Kernels: NVRTC compilation with a disk cache, typed user kernels, and built-ins.

``Kernel(source, name, params=(Out(dt), In(dt), scalar_dtype...), host=numpy_fn)`` wraps a user
CUDA C++ kernel. Built in, for float16, bfloat16 and float32: elementwise ``fill``, ``copy``,
``scale``, ``add``, ``mul``, ``axpy``, ``relu``, ``gelu``, ``silu``; row-wise ``sum``, ``max``,
``softmax``, ``rms_norm``; ``matvec``; ``gemm`` through cuBLAS. Every kernel call returns an op whose output is its
arguments.
"""

from ._builtins import BUILTIN_SOURCE, builtin_names, compile_builtins, warmup
from ._elementwise import add, axpy, copy, fill, gelu, mul, relu, scale, silu
from ._kernel import Kernel
from ._nvrtc import cache_dir, cache_stats, compile_cubin
from ._params import In, InOut, Out
from ._rowwise import matvec, rms_norm, softmax
from ._rowwise import row_max as max  # noqa: A004 - do.kernels.max, as in the DESIGN contract
from ._rowwise import row_sum as sum  # noqa: A004

__all__ = [
    "Kernel", "In", "Out", "InOut",
    "fill", "copy", "scale", "add", "mul", "axpy", "relu", "gelu", "silu",
    "sum", "max", "softmax", "rms_norm", "matvec", "gemm",
    "compile_builtins", "builtin_names", "warmup", "BUILTIN_SOURCE", "compile_cubin", "cache_dir", "cache_stats",
]


def __getattr__(name: str) -> object:
    # gemm loads on first use (its module is start-up time for programs that never call it)
    if name == "gemm":
        from ._gemm import gemm

        globals()["gemm"] = gemm
        return gemm
    raise AttributeError(f"module 'deviceop.kernels' has no attribute {name!r}")
