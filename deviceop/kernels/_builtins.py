"""The built-in kernel library: one CUDA source, one NVRTC compile (cached on disk), one module.

Elementwise (``_elementwise``): fill, copy, scale, add, mul, axpy, relu, gelu, silu. Row-wise
(``_rowwise``): sum, max, softmax, rms_norm, matvec. Each for float16, bfloat16 and float32,
each with a numpy implementation for the host backend.
"""

from __future__ import annotations

from collections.abc import Iterable

from .._core._select import current
from ._elementwise import DTYPES, ELEMENTWISE, PRELUDE, SFX, Elementwise
from ._kernel import Kernel
from ._library import FUNCS
from ._rowwise import ROW_PRELUDE, ROWWISE, RowWise

__all__ = ["BUILTINS", "BUILTIN_SOURCE", "FUNCS", "builtin_names", "compile_builtins", "warmup"]

BUILTINS: tuple[Elementwise | RowWise, ...] = (*ELEMENTWISE, *ROWWISE)
BUILTIN_SOURCE = PRELUDE + ROW_PRELUDE + "\n".join(k.source() for k in BUILTINS)
FUNCS.source = BUILTIN_SOURCE


def compile_builtins(arch: str = "sm_90") -> bytes:
    """Compile every built-in kernel for ``arch`` with NVRTC (no GPU needed); return the CUBIN."""
    from ._nvrtc import compile_cubin

    return compile_cubin(BUILTIN_SOURCE, "builtins", arch)


def builtin_names() -> list[str]:
    """The extern "C" names of every built-in kernel function."""
    return [f"{k.name}_{SFX[d.name]}" for k in BUILTINS for d in DTYPES]


def warmup(kernels: Iterable[Kernel] = (), builtins: bool = True) -> dict[str, int]:
    """Compile (through the disk cache) and, on cuda, load kernels ahead of their first call.

    ``kernels``: user :class:`Kernel` objects; ``builtins``: also the built-in library. Returns
    how many were prepared. On the host backend only compiling for ``sm_90`` is checked when an
    NVRTC is present; nothing needs loading.
    """
    be = current()
    ks = list(kernels)
    for k in ks:
        if not isinstance(k, Kernel):
            raise TypeError(f"warmup() takes deviceop Kernel objects, got {type(k).__name__}")
    done = {"builtins": 0, "kernels": 0}
    if be.driver is not None:  # a backend that loads kernels
        if builtins:
            for name in builtin_names():
                FUNCS.get(be, name)
            done["builtins"] = len(BUILTINS) * len(DTYPES)
        for k in ks:
            k.functions.get(be, k.name)
            done["kernels"] += 1
        return done
    if builtins:
        compile_builtins(be.arch)
        done["builtins"] = len(BUILTINS) * len(DTYPES)
    for k in ks:
        k.compile(be.arch)
        done["kernels"] += 1
    return done
