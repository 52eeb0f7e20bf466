"""A direct ctypes binding of cuLaunchKernel for the launch hot path.

cuda.bindings' generic wrapper converts its eleven arguments through helper objects on every
call; measured on an H100 host that is most of a 3.8 µs raw launch loop. The launch path
already holds plain integers (function, stream, parameter block addresses), so it calls the
driver's entry point through ctypes with fixed argument types (which also releases the GIL).
``DEVICEOP_FAST_LAUNCH=0`` switches back to cuda.bindings.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Callable

__all__ = ["load"]


def load() -> "Callable[..., int] | None":
    """The driver's cuLaunchKernel with fixed argtypes, or None where it cannot be loaded."""
    if os.environ.get("DEVICEOP_FAST_LAUNCH", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn: Any = lib.cuLaunchKernel
    except (OSError, AttributeError):
        return None
    u = ctypes.c_uint
    fn.argtypes = [ctypes.c_void_p, u, u, u, u, u, u, u, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]
