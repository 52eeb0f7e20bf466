"""Build deviceop's compiled core (Cython); metadata lives in pyproject.toml.

The core is required: a source build needs a C compiler, Cython and cuda-bindings (whose
``cydriver`` declarations the cuda backend's driver module is compiled against).
"""

import glob
import importlib.util
import os
import re

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

#: translations and compilations at once: pip's builds (editable, wheel) pass no -j (the CPUs
#: this process may use: a container's share, not the host's count)
_JOBS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class _BuildExt(build_ext):
    """``build_ext`` compiling the modules in parallel, one job per CPU, unless ``-j`` says how
    many."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if not self.parallel:
            self.parallel = _JOBS


def _driver_headers() -> set[str]:
    """The headers cuda-bindings' cydriver declarations include (they vary by its version)."""
    spec = importlib.util.find_spec("cuda.bindings")
    pxd = os.path.join(os.path.dirname(spec.origin), "cydriver.pxd") if spec and spec.origin else ""
    if not os.path.exists(pxd):
        raise SystemExit("deviceop's build needs cuda-bindings (its cydriver.pxd): pip install cuda-bindings")
    return set(re.findall(r"cdef extern from ['\"]([\w./]+\.h)['\"]", open(pxd).read())) or {"cuda.h"}


def _cuda_include() -> list[str]:
    """A folder with those headers: $CUDA_HOME, the nvidia-cuda-runtime wheel, /usr/local/cuda."""
    need = _driver_headers()
    dirs = [os.path.join(os.environ[v], "include") for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        dirs += sorted(glob.glob(os.path.join(root, "*", "include")))
    dirs.append("/usr/local/cuda/include")
    for d in dirs:
        if all(os.path.exists(os.path.join(d, h)) for h in need):
            return [d]
    raise SystemExit(
        f"deviceop's build needs the CUDA driver headers {sorted(need)}: install nvidia-cuda-runtime (pip) "
        "or a CUDA toolkit (set CUDA_HOME)"
    )


_FLAGS = ["-O2", "-Wno-unused-function", "-Wno-unreachable-code"]

extensions = [
    Extension(f"deviceop._core.{m}", [f"deviceop/_core/{m}.pyx"], extra_compile_args=_FLAGS, libraries=["pthread"])
    for m in (
        "_base",
        "_ledger",
        "_op",
        "_alloc",
        "_launch",
        "_gemm",
        "_reactor",
        "_dlpack",
        "_external",
        "_transfer",
        "_lanes",
        "_watch",
        "_guards",
    )
] + [
    Extension(
        "deviceop._backends._cuda_driver",
        ["deviceop/_backends/_cuda_driver.pyx"],
        extra_compile_args=_FLAGS,
        include_dirs=_cuda_include(),
        language="c++",
    ),
]

# Python modules on the path of foreign work (do.external, do.interop.torch), compiled from their
# source as it is (the .py stays the one implementation: a checkout without the build runs it as
# it is). Annotations are read as Python's, not as C types. The await path's modules stay
# interpreted: compiled so, long awaits resumed measurably later (the compiled coroutines resume
# through a slower path of the event loop).
compiled_py = [
    Extension(f"deviceop.{m.replace('/', '.')}", [f"deviceop/{m}.py"], extra_compile_args=_FLAGS)
    for m in ("interop/_external", "_core/_regions", "interop/_torch")
]

setup(
    cmdclass={"build_ext": _BuildExt},
    ext_modules=cythonize(
        extensions,
        compiler_directives={"language_level": 3, "embedsignature": True, "binding": True},
        quiet=True,
        nthreads=_JOBS,
    )
    + cythonize(
        compiled_py,
        compiler_directives={"language_level": 3, "binding": True, "annotation_typing": False},
        quiet=True,
        nthreads=_JOBS,
    ),
)
