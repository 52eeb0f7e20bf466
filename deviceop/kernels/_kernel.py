"""Kernel: a user CUDA C++ kernel with typed parameters; compiled with NVRTC on first use."""

from __future__ import annotations

import math
import numbers
import threading
from typing import Any, Callable, Sequence

import numpy as np

from .._dtypes import DType
from .._errors import DTypeError, ShapeError, UsageError
from ..device._tensor import Partition, Tensor
from ._launch import CudaPlan, KernelCall, Packer, has_op, host_array, launch_cuda, launch_host, same, weak
from ._nvrtc import compile_cubin
from ._params import TensorParam, ctype_of

__all__ = ["Kernel", "CompiledFunctions", "check_scalar", "check_tensor"]

_INT_RANGE = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1), "uint8": (0, 255)}


class CompiledFunctions:
    """CUfunctions (and parameter packers) per backend, compiled and loaded on first use."""

    def __init__(self, source: str, module: str, options: Sequence[str] = ()) -> None:
        self.source = source
        self.module = module
        self.options = tuple(options)
        self._fns: dict[tuple[int, str], tuple[Any, Packer]] = {}
        self._lock = threading.Lock()

    def get(self, be: Any, name: str, ctypes_list: Sequence[Any]) -> tuple[Any, Packer]:
        key = (id(be), name)
        hit = self._fns.get(key)
        if hit is not None:
            return hit
        with self._lock:
            hit = self._fns.get(key)
            if hit is None:
                cubin = compile_cubin(self.source, self.module, be.arch, self.options)
                fn = be.load_function(cubin, name)
                hit = (fn, Packer(ctypes_list, int(fn)))
                self._fns[key] = hit
        return hit


def check_scalar(v: Any, dtype: DType, what: str) -> Any:
    """Validate a scalar argument against its declared dtype; return it as a Python number."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
        raise DTypeError(f"{what} must be a {dtype.name} scalar, got {type(v).__name__}")
    if dtype.is_float:
        return float(v)
    if isinstance(v, numbers.Integral) or float(v).is_integer():
        iv = int(v)
        lo, hi = _INT_RANGE[dtype.name]
        if not lo <= iv <= hi:
            raise DTypeError(f"{what} = {iv} is out of range for {dtype.name} [{lo}, {hi}]")
        return iv
    raise DTypeError(f"{what} must be an integer ({dtype.name}), got {v!r}")


def check_tensor(x: Any, dtype: DType, what: str, contiguous: bool = True) -> Tensor:
    """Validate a tensor argument's type, dtype and layout."""
    if type(x) is not Tensor:
        raise UsageError(f"{what} must be a Tensor, got {type(x).__name__}")
    if x.dtype is not dtype:
        raise DTypeError(f"{what} has dtype {x.dtype.name} but {dtype.name} is required; convert it first")
    if contiguous and not x.is_contiguous():
        raise ShapeError(
            f"{what} is a non-contiguous view (shape {x.shape}, strides {x.strides}); this kernel "
            "needs contiguous memory: copy it into a contiguous tensor first"
        )
    return x


class Kernel:
    """A CUDA C++ kernel with typed parameters.

    ``params``: one entry per kernel parameter: ``In(dtype)``, ``Out(dtype)``, ``InOut(dtype)``
    (tensors, passed as pointers) or a dtype (a scalar). ``host``: optional numpy
    implementation ``host(*arrays_and_scalars)`` used on the host backend (it writes Out arrays
    in place). Calling the kernel returns an op whose output is its arguments. The grid comes
    from the (single) Partition argument, or ``grid=`` is given; ``block`` defaults to 128.
    """

    def __init__(
        self, source: str, name: str, params: Sequence[Any], host: Callable[..., Any] | None = None,
        block: Sequence[int] = (128,), options: Sequence[str] = (),
    ) -> None:
        if not isinstance(source, str) or not isinstance(name, str) or not name.isidentifier():
            raise UsageError("Kernel(source, name, ...) needs the CUDA C++ source and the kernel's extern \"C\" name")
        from .._dtypes import as_dtype

        self.name = name
        self.params = tuple(p if isinstance(p, TensorParam) else as_dtype(p, f"parameter of {name}") for p in params)
        self.host = host
        self.block = _dim3(block, "block")
        self.functions = CompiledFunctions(source, name, options)
        self._ctypes = [ctype_of(p) for p in self.params]
        self._plans: dict[Any, tuple[Any, CudaPlan]] = {}

    @property
    def source(self) -> str:
        """The kernel's CUDA C++ source."""
        return self.functions.source

    def __repr__(self) -> str:
        return f"Kernel({self.name!r}, params={list(self.params)})"

    def __call__(self, *args: Any, grid: Any = None, block: Any = None, shared_mem: int = 0) -> KernelCall:
        if len(args) != len(self.params):
            raise UsageError(f"{self.name}() takes {len(self.params)} arguments ({list(self.params)}), got {len(args)}")
        if self.host is None:
            from ..device._select import current

            if current().name == "host":
                raise UsageError(
                    f"kernel {self.name!r} has no numpy implementation, so it cannot run on the host "
                    "backend; pass host=fn to Kernel(...) or run on a CUDA device"
                )
        opts = (None if grid is None else _dim3(grid, "grid"), self.block if block is None else _dim3(block, "block"), int(shared_mem))
        lazy = has_op(args)
        if not lazy:
            self.check(args, opts)  # bad input fails here, before any GPU work
        return KernelCall(self, args, opts, lazy)

    def compile(self, arch: str) -> bytes:
        """Compile for ``arch`` (e.g. ``"sm_90"``) through the cache; return the CUBIN."""
        return compile_cubin(self.source, self.name, arch, self.functions.options)

    # -- the launcher interface used by KernelCall -------------------------------------------
    def check(self, args: tuple[Any, ...], opts: Any) -> None:
        grid = opts[0]
        pgrid = None
        for i, (p, a) in enumerate(zip(self.params, args)):
            what = f"argument {i} of {self.name}() ({p!r})"
            if isinstance(p, TensorParam):
                if p.write and type(a) is Tensor and grid is None:
                    raise UsageError(f"{what} is written: pass a Partition (t.partition(tile)) or give grid=")
                if p.write and type(a) is Partition:
                    if pgrid is not None and a.grid != pgrid:
                        raise ShapeError(f"{what}: partition grid {a.grid} differs from an earlier one {pgrid}")
                    pgrid = a.grid
                    a = a.tensor
                elif not p.write and type(a) is Partition:
                    raise UsageError(f"{what} is read-only: pass the Tensor, not a Partition")
                check_tensor(a, p.dtype, what)
            else:
                check_scalar(a, p, what)
        if grid is None and pgrid is None:
            raise UsageError(f"{self.name}() has no Partition argument to take the grid from; give grid=")

    def enqueue(self, cx: Any, args: tuple[Any, ...], opts: Any, plan: Any = None) -> None:
        grid, block, shmem = opts
        tensors = []
        writes = []
        values = []
        pgrid = None
        for p, a in zip(self.params, args):
            if isinstance(p, TensorParam):
                if type(a) is Partition:
                    pgrid = a.grid
                    a = a.tensor
                if a.buffer.backend is not cx.backend:
                    raise UsageError(f"{a!r} lives on the {a.buffer.backend.name} backend, not {cx.backend.name}")
                tensors.append(a)
                writes.append(p.write)
                values.append(a.ptr)
            else:
                values.append(check_scalar(a, p, self.name))
        g = grid if grid is not None else pgrid + (1,) * (3 - len(pgrid))  # type: ignore[operator]
        if 0 in g:
            return  # an empty tensor: nothing to launch
        if cx.backend.name == "cuda":
            launch_cuda(cx, self, self._plan(cx.backend, g, opts, tuple(values), writes, tensors), tuple(tensors), ())
        else:
            arrays = tuple(
                host_array(a.tensor if type(a) is Partition else a) if isinstance(p, TensorParam) else p.np_dtype.type(a)
                for p, a in zip(self.params, args)
            )
            launch_host(cx, self, self.host, arrays, tensors, writes)


    def _plan(self, be: Any, grid: Any, opts: Any, values: tuple[Any, ...], writes: list[bool], tensors: list[Tensor]) -> CudaPlan:
        """The launch plan for these arguments, cached by their identity and values.

        A loop that launches a kernel on the same tensors reuses one plan, so the parameter
        block is not rewritten and nothing is rebuilt; weak references make sure a cached plan
        never outlives (or is mistaken for) tensors that were freed.
        """
        key = (id(be), grid, opts, values)
        hit = self._plans.get(key)
        if hit is not None and same(hit[0], tensors):
            return hit[1]  # type: ignore[no-any-return]
        fn, packer = self.functions.get(be, self.name, self._ctypes)
        plan = CudaPlan(fn, packer, grid, opts[1], opts[2], writes, values)
        if len(self._plans) >= 64:
            self._plans.clear()
        self._plans[key] = (weak(tensors), plan)
        return plan


def _dim3(x: Any, what: str) -> tuple[int, int, int]:
    if isinstance(x, (int, np.integer)):
        x = (int(x),)
    t = tuple(int(v) for v in x)
    if not 1 <= len(t) <= 3 or any(v < 0 for v in t):
        raise UsageError(f"{what} must be 1 to 3 non-negative ints, got {x!r}")
    t = t + (1,) * (3 - len(t))
    if what == "block" and (math.prod(t) > 1024 or 0 in t):
        raise UsageError(f"block {t} must have 1 to 1024 threads in all")
    return t  # type: ignore[return-value]
