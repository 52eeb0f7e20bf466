"""Kernel: a user CUDA C++ kernel with typed parameters; compiled with NVRTC on first use."""

from __future__ import annotations

import math
import numbers
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._core._launch import P_KINDS, UserFront, UserPlan, planned
from .._core._ledger import check_backend
from .._core._op import DeviceOp
from .._core._tensor import Partition, Tensor
from .._dtypes import DType, as_dtype
from .._errors import DTypeError, ShapeError, UsageError
from ._launch import (
    SRC_SCALAR,
    SRC_TENSOR,
    T_F32,
    T_I32,
    T_I64,
    T_PTR,
    T_U8,
    T_U16,
    KernelCall,
    LaunchPlan,
    PlanCache,
    has_op,
    host_array,
    launch,
    launch_host,
    tensor_of,
)
from ._nvrtc import compile_cubin
from ._params import TensorParam

__all__ = ["CompiledFunctions", "Kernel", "check_scalar", "check_tensor"]

_FLOAT_MAX = {"float32": 3.4028234663852886e38, "float16": 65504.0, "bfloat16": 3.3895313892515355e38}
_INT_RANGE = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1), "uint8": (0, 255)}


class CompiledFunctions:
    """CUfunction handles per backend, compiled (through the disk cache) and loaded on first use."""

    def __init__(self, source: str, module: str, options: Sequence[str] = ()) -> None:
        self.source = source
        self.module = module
        self.options: tuple[str, ...] = tuple(options)
        self._fns: dict[tuple[int, str], Any] = {}
        self._lock = threading.Lock()

    def get(self, be: Any, name: str) -> Any:
        """The CUfunction ``name`` on backend ``be``."""
        key = (id(be), name)
        hit = self._fns.get(key)
        if hit is not None:
            return hit
        with self._lock:
            hit = self._fns.get(key)
            if hit is None:
                cubin = compile_cubin(self.source, self.module, be.arch, self.options)
                hit = self._fns[key] = be.load_function(cubin, name)
        return hit


def check_scalar(v: Any, dtype: DType, what: str) -> Any:
    """Validate a scalar argument against its declared dtype; return it as a Python number."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
        raise DTypeError(f"{what} must be a {dtype.name} scalar, got {type(v).__name__}")
    if dtype.is_float:
        try:
            f = float(v)
        except OverflowError:
            raise DTypeError(f"{what} = {v!r} is out of range for {dtype.name}") from None
        if math.isfinite(f) and abs(f) > _FLOAT_MAX[dtype.name]:
            raise DTypeError(f"{what} = {v!r} is out of range for {dtype.name} (it would become inf)")
        return f
    if isinstance(v, numbers.Integral) or float(v).is_integer():
        iv = int(v)  # type: ignore[call-overload]  # numbers.Real has no __int__ in typeshed; every Real here has one
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
        host = "ml_dtypes.bfloat16" if dtype.name == "bfloat16" else f"np.{dtype.name}"
        raise DTypeError(
            f"{what} has dtype {x.dtype.name} but {dtype.name} is required. Make it {dtype.name} "
            f"where it is made (do.zeros(..., do.{dtype.name}); on the host before upload: "
            f"do.from_numpy(a.astype({host}))), or convert it inside the pipeline with "
            f"a kernel of your own (do.kernels.Kernel) or PyTorch (do.interop.torch(lambda t: "
            f"t.to(torch.{dtype.name}), x))"
        )
    if contiguous and not x.is_contiguous():
        raise ShapeError(
            f"{what} is a non-contiguous view (shape {x.shape}, strides {x.strides}); this kernel "
            "needs contiguous memory: copy it into a contiguous tensor first"
        )
    return x


_SCALAR_CT = {"float32": T_F32, "int32": T_I32, "int64": T_I64, "uint8": T_U8, "float16": T_U16, "bfloat16": T_U16}


class Kernel:
    """A CUDA C++ kernel with typed parameters.

    ``params``: one entry per kernel parameter: ``In(dtype)``, ``Out(dtype)``, ``InOut(dtype)``
    (tensors, passed as pointers) or a dtype (a scalar). ``host``: optional numpy
    implementation ``host(*arrays_and_scalars)`` used on the host backend (it writes Out arrays
    in place). Calling the kernel returns an op whose output is its arguments. The grid comes
    from the (single) Partition argument, or ``grid=`` is given; ``block`` defaults to 128.
    Launch plans are kept per argument layout, so calls on fresh tensors of a known shape
    reuse one.
    """

    def __init__(
        self,
        source: str,
        name: str,
        params: Sequence[Any],
        host: Callable[..., Any] | None = None,
        block: Sequence[int] = (128,),
        options: Sequence[str] = (),
    ) -> None:
        if not isinstance(source, str) or not isinstance(name, str) or not name.isidentifier():
            raise UsageError('Kernel(source, name, ...) needs the CUDA C++ source and the kernel\'s extern "C" name')
        self.name: str = name
        self.params: tuple[Any, ...] = tuple(
            p if isinstance(p, TensorParam) else as_dtype(p, f"parameter of {name}") for p in params
        )
        self.host = host
        self._block: tuple[int, int, int] = _dim3(block, "block")
        self.functions: CompiledFunctions = CompiledFunctions(source, name, options)
        self.plans: PlanCache = PlanCache()
        other = P_KINDS["other"]
        # each parameter's kind as the compiled core checks it; the slow path's plans reuse it
        self._kinds: tuple[int, ...] = tuple(
            P_KINDS["tensor"] if isinstance(p, TensorParam) else P_KINDS.get(p.name, other) for p in self.params
        )
        # the call of a known argument layout, checked and planned in the compiled core
        self._front = UserFront(self, self.plans, self._kinds, self._block)

    @property
    def block(self) -> tuple[int, int, int]:
        """The default block of every launch (read-only: the compiled call front holds it too;
        pass ``block=`` to a call to launch with another)."""
        return self._block

    @property
    def source(self) -> str:
        """The kernel's CUDA C++ source."""
        return self.functions.source

    def __repr__(self) -> str:
        return f"Kernel({self.name!r}, params={list(self.params)})"

    def __call__(
        self, *args: Any, grid: Any = None, block: Any = None, shared_mem: int = 0
    ) -> DeviceOp[tuple[Any, ...]]:
        """Build the launch: an op whose output is ``args`` (ops among them replaced by their outputs)."""
        op = self._front.call(args, grid, block, shared_mem)
        if op is not None:
            return op
        if len(args) != len(self.params):
            raise UsageError(f"{self.name}() takes {len(self.params)} arguments ({list(self.params)}), got {len(args)}")
        if isinstance(shared_mem, bool) or not isinstance(shared_mem, (int, np.integer)) or not 0 <= shared_mem < 2**31:
            raise UsageError(f"shared_mem of {self.name}() must be an int of bytes >= 0, got {shared_mem!r}")
        opts = (
            None if grid is None else _dim3(grid, "grid"),
            self._block if block is None else _dim3(block, "block"),
            int(shared_mem),
        )
        if has_op(args):
            return KernelCall(self, args, opts, True)
        return planned(self, args, self.plan(args, opts), 0, opts)  # bad input fails here

    def compile(self, arch: str) -> bytes:
        """Compile for ``arch`` (e.g. ``"sm_90"``) through the cache; return the CUBIN."""
        return compile_cubin(self.source, self.name, arch, self.functions.options)

    # -- the launcher interface used by KernelCall -------------------------------------------
    def plan(self, args: tuple[Any, ...], opts: Any) -> UserPlan:
        """Validate ``args`` and return their launch plan (made once per argument layout)."""
        key: list[Any] = [opts]
        for p, a in zip(self.params, args):
            if isinstance(p, TensorParam):
                key.append(getattr(a, "_key", a))
            else:
                check_scalar(a, p, f"argument of {self.name}()")
        k = tuple(key)
        try:
            hit = self.plans.get(k)
        except TypeError:  # an unhashable argument: the checks below say what is wrong
            hit = None
        if hit is not None:
            return hit  # type: ignore[no-any-return]
        self.check(args, opts)
        return self.plans.put(k, self._make_plan(args, opts))

    def check(self, args: tuple[Any, ...], opts: Any) -> None:
        """Validate every argument against the declared parameters (before any GPU work)."""
        grid = opts[0]
        pgrid = None
        be = None
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
                if be is None:
                    be = a.buffer.backend
                elif a.buffer.backend is not be:
                    raise UsageError(
                        f"{what} lives on {a.device}, the other tensors on {be.device_label}; move it first"
                    )
            else:
                check_scalar(a, p, what)
        if grid is None and pgrid is None:
            raise UsageError(f"{self.name}() has no Partition argument to take the grid from; give grid=")
        if be is None:
            from .._core._select import current

            be = current()
        if self.host is None and be.driver is None:
            raise UsageError(
                f"kernel {self.name!r} has no numpy implementation, so it cannot run on the {be.name} backend; "
                "pass host=fn to Kernel(...) or run on a CUDA device"
            )

    def _make_plan(self, args: tuple[Any, ...], opts: Any) -> UserPlan:
        grid, block, shmem = opts
        layout: list[tuple[int, int, int, int]] = []
        tensor_idx: list[int] = []
        scalar_idx: list[int] = []
        scalar_kinds: list[int] = []
        writes: list[bool] = []
        pgrid = None
        be = None
        for i, (p, a) in enumerate(zip(self.params, args)):
            if isinstance(p, TensorParam):
                if type(a) is Partition:
                    pgrid = a.grid
                    a = a.tensor
                be = a.buffer.backend
                layout.append((SRC_TENSOR, len(tensor_idx), T_PTR, 0))
                tensor_idx.append(i)
                writes.append(p.write)
            else:
                layout.append((SRC_SCALAR, len(scalar_idx), _SCALAR_CT[p.name], 0))
                scalar_idx.append(i)
                scalar_kinds.append(self._kinds[i])
        if be is None:
            from .._core._select import current

            be = current()
        if grid is not None:
            g = grid
        else:
            assert pgrid is not None  # check() refused a call with neither grid= nor a Partition
            g = pgrid + (1,) * (3 - len(pgrid))
        empty = 0 in g
        cuda = None
        if be.driver is not None and not empty:
            fn = self.functions.get(be, self.name)
            cuda = LaunchPlan(be.driver, int(fn), g, block, shmem, tuple(layout), tuple(writes), self)
        return UserPlan(be, cuda, empty, tuple(tensor_idx), tuple(scalar_idx), tuple(writes), tuple(scalar_kinds))

    def enqueue(self, cx: Any, args: tuple[Any, ...], opts: Any, plan: UserPlan) -> None:
        if plan.empty:
            return  # an empty grid: nothing to launch
        check_backend(cx, plan.be, f"{self.name}()")
        params = self.params
        tensors = tuple(tensor_of(args[i]) for i in plan.tensor_idx)
        if plan.cuda is not None:
            scalars = tuple(_scalar_bits(args[i], params[i], self.name) for i in plan.scalar_idx)
            launch(cx, plan.cuda, tensors, scalars)
            return
        arrays = tuple(
            host_array(tensor_of(a)) if isinstance(p, TensorParam) else p.np_dtype.type(a) for p, a in zip(params, args)
        )
        launch_host(cx, self, self.host, arrays, tensors, plan.writes)


def _scalar_bits(v: Any, dt: DType, what: str) -> Any:
    """A scalar as the launch packs it: a number, or a 16-bit float's raw bits."""
    v = check_scalar(v, dt, what)
    if dt.itemsize == 2 and dt.is_float:
        return int(np.array(v, dtype=dt.np_dtype).view(np.uint16))
    return v


# CUDA's limits: grid x < 2^31, y and z < 2^16; block x, y <= 1024, z <= 64, 1024 threads in all
_GRID_MAX = (2**31 - 1, 65535, 65535)
_BLOCK_MAX = (1024, 1024, 64)


def _dim3(x: Any, what: str) -> tuple[int, int, int]:
    """A grid or block as 3 ints within CUDA's limits; anything else raises UsageError."""
    if isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)):
        x = (x,)
    try:
        items = tuple(x)  # pyright: ignore[reportArgumentType] (a bool fails here as intended)
    except TypeError:
        raise UsageError(f"{what} must be an int or 1 to 3 ints, got {x!r}") from None
    if not 1 <= len(items) <= 3 or any(
        isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) for v in items
    ):
        raise UsageError(f"{what} must be an int or 1 to 3 ints, got {x!r}")
    t = tuple(int(v) for v in items) + (1,) * (3 - len(items))
    limit = _GRID_MAX if what == "grid" else _BLOCK_MAX
    for d, (v, m) in enumerate(zip(t, limit)):
        if not 0 <= v <= m:
            raise UsageError(f"{what} {t}: dimension {d} must be in [0, {m}] (CUDA's limit), got {v}")
    if what == "block" and (math.prod(t) > 1024 or 0 in t):
        raise UsageError(f"block {t} must have 1 to 1024 threads in all")
    return t  # type: ignore[return-value]
