"""The compiled built-in library's functions (one NVRTC module holding every built-in).

Its source is assembled by ``_builtins`` from the kernel families, which import this module to
find their functions; the families never import ``_builtins`` (it imports them).
"""

from ._kernel import CompiledFunctions

__all__ = ["FUNCS"]

#: every built-in's CUfunction per backend; ``source`` is set when ``_builtins`` is imported
FUNCS = CompiledFunctions("", "builtins")
