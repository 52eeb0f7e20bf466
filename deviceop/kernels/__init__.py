"""Kernels: NVRTC compilation with a disk cache, typed user kernels, and built-ins.

``Kernel(source, name, params=(Out(dt), In(dt), scalar_dtype...), host=numpy_fn)`` wraps a user
CUDA C++ kernel; ``fill``, ``scale`` and ``add`` are built in for float16, bfloat16, float32.
Every kernel call returns an op whose output is its arguments.
"""

from ._builtins import BUILTIN_SOURCE, add, builtin_names, compile_builtins, fill, scale
from ._kernel import Kernel
from ._nvrtc import cache_dir, cache_stats, compile_cubin
from ._params import In, InOut, Out

__all__ = [
    "Kernel", "In", "Out", "InOut", "fill", "scale", "add", "compile_builtins", "builtin_names",
    "BUILTIN_SOURCE", "compile_cubin", "cache_dir", "cache_stats",
]
