"""The launch path shared by user kernels and built-ins.

``KernelCall`` is the op a kernel call returns: its output is its arguments, same type in, same
type out. ``Launchable`` validates arguments, registers their accesses with the ledger and
enqueues the work: cuLaunchKernel with a prepacked parameter block on cuda, the numpy
implementation on the host backend.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Any, Sequence

import numpy as np

from .._errors import UsageError
from ..device import _fast, _ledger
from ..device._tensor import Partition, Tensor
from ..ops._base import DeviceOp

__all__ = ["KernelCall", "Packer", "CudaPlan", "launch_cuda", "launch_host", "weak", "same", "has_op"]

try:
    from cuda.bindings.driver import cuLaunchKernel as _cuLaunchKernel
except Exception:  # pragma: no cover
    _cuLaunchKernel = None

_NLAUNCH = _fast.LAUNCH  # [native launch or None]: set when the cuda backend loads the driver
_NHELD = _fast.LAUNCH_HELD  # [native check-held-and-launch or None]


class Packer:
    """A kernel's parameter block, laid out once; values are written in place per launch.

    Writes and the launch happen under the ledger lock, so one block per kernel suffices
    (cuLaunchKernel copies the values before it returns).
    """

    __slots__ = ("struct", "names", "addr", "_ptrs", "last_ptrs", "last_scalars", "handle")

    def __init__(self, ctypes_list: Sequence[Any], handle: int = 0) -> None:
        self.handle = handle  # the CUfunction as an integer, for the native launch
        fields = [(f"a{i}", c) for i, c in enumerate(ctypes_list)]
        S = type("KernelParams", (ctypes.Structure,), {"_fields_": fields})
        self.struct = S()
        base = ctypes.addressof(self.struct)
        n = len(fields)
        self._ptrs = (ctypes.c_void_p * max(n, 1))(*[base + getattr(S, f"a{i}").offset for i in range(n)])
        self.addr = ctypes.addressof(self._ptrs) if n else 0
        self.names = tuple(f"a{i}" for i in range(n))
        self.last_ptrs: Any = None
        self.last_scalars: Any = None


class KernelCall(DeviceOp[tuple]):
    """The op returned by calling a kernel; its output is the (resolved) argument tuple.

    Arguments that are ops (``lazy``) run first, in the same execution; plain arguments were
    validated when the call was made, before any GPU work.
    """

    __slots__ = ("_k", "_args", "_opts", "_lazy", "_plan")

    def __init__(self, kernel: Any, args: tuple[Any, ...], opts: Any, lazy: bool, plan: Any = None) -> None:
        self._used = None
        self._k = kernel
        self._args = args
        self._opts = opts
        self._lazy = lazy
        self._plan = plan
        if lazy:
            for i, a in enumerate(args):
                if isinstance(a, DeviceOp):
                    a._take(f"argument {i} of {kernel.name}()")

    def __repr__(self) -> str:
        return f"<{self._k.name}() call>"

    def _run(self, cx: Any) -> tuple:
        args = self._args
        if self._lazy:
            args = tuple(a._run(cx) if isinstance(a, DeviceOp) else a for a in args)
            self._k.check(args, self._opts)
        self._k.enqueue(cx, args, self._opts, self._plan)
        return args


def has_op(args: tuple[Any, ...]) -> bool:
    """True if any argument is an op (to be run before the launch)."""
    for a in args:
        if isinstance(a, DeviceOp):
            return True
    return False


def weak(args: Sequence[Any]) -> tuple[Any, ...]:
    """Weak references to ``args`` (tensors, partitions): caches must not keep memory alive."""
    return tuple(weakref.ref(a) for a in args)


def same(refs: tuple[Any, ...], args: tuple[Any, ...]) -> bool:
    """True if ``refs`` (from :func:`weak`) still point at exactly the leading ``args``."""
    if not refs:
        return False
    for i in range(len(refs)):
        if refs[i]() is not args[i]:
            return False
    return True


class CudaPlan:
    """Everything a cuda launch needs that is fixed once the kernel and its tensors are known.

    Built once per distinct set of tensor arguments (built-ins cache it by weak reference),
    so the per-launch path only registers accesses, rewrites changed scalars and launches.
    """

    __slots__ = ("fn", "packer", "geom", "grid", "block", "shmem", "writes", "ptrs", "tail", "fast")

    def __init__(
        self, fn: Any, packer: Packer, grid: tuple[int, int, int], block: tuple[int, int, int], shmem: int,
        writes: Sequence[bool], ptrs: tuple[int, ...], tail: tuple[Any, ...] = (),
    ) -> None:
        self.fn = fn
        self.packer = packer
        self.grid = grid
        self.block = block
        self.shmem = shmem
        # the native launch's first argument, packed once (an 8-tuple without the native module)
        g = (packer.handle, *grid, *block, shmem)
        self.geom = _fast.native.geometry(*g) if _fast.native is not None else g
        self.writes = tuple(writes)
        self.ptrs = ptrs
        self.tail = tail
        # what the native planned launch reads, in one attribute: tensor count, parameter block,
        # writes, geometry, the block's address, and the pointers' identity (packer.last_ptrs)
        self.fast = (len(ptrs), packer, self.writes, self.geom, packer.addr, ptrs)


def launch_cuda(cx: Any, k: Any, plan: CudaPlan, tensors: tuple[Tensor, ...], scalars: Sequence[Any]) -> None:
    """Register the tensors' accesses with the ledger and launch ``plan`` with ``scalars``.

    The parameter block is rewritten only when it last served other arguments.
    """
    packer = plan.packer
    with _ledger.LOCK:
        if packer.last_ptrs is not plan.ptrs or packer.last_scalars != scalars:
            _pack(packer, plan, scalars)
        if _NHELD[0] is not None and _ledger.ENABLED[0]:
            # the chained case, checked and launched in C: cx already holds every region
            err = _NHELD[0](cx, tensors, plan.writes, plan.geom, cx.stream.handle_int, packer.addr)
            if err != -1:
                if err:
                    _raise_launch_error(err, k)
                return
        _register(cx, k, tensors, plan.writes)
        nl = _NLAUNCH[0]
        if nl is not None:
            err = nl(plan.geom, cx.stream.handle_int, packer.addr)
        else:
            g, b = plan.grid, plan.block
            err = _cuLaunchKernel(plan.fn, g[0], g[1], g[2], b[0], b[1], b[2], plan.shmem, cx.stream.handle, packer.addr, 0)[0]
    if err:
        _raise_launch_error(err, k)


def _register(cx: Any, k: Any, tensors: Sequence[Tensor], writes: Sequence[bool]) -> None:
    """Register each tensor's access with the ledger (``touch`` skips regions cx already holds)."""
    touch = _ledger.touch
    for t, write in zip(tensors, writes):
        lo, hi = t._span
        touch(cx, t.buffer, lo, hi, write, k)


def _raise_launch_error(err: int, k: Any) -> None:
    from ..device._cuda import cuda_error

    raise cuda_error(err, f"cuLaunchKernel({k.name})")


def _pack(packer: Packer, plan: CudaPlan, scalars: Sequence[Any]) -> None:
    st = packer.struct
    names = packer.names
    for name, v in zip(names, plan.ptrs):
        setattr(st, name, v)
    i = len(plan.ptrs)
    for v in scalars:
        setattr(st, names[i], v)
        i += 1
    for v in plan.tail:
        setattr(st, names[i], v)
        i += 1
    packer.last_ptrs = plan.ptrs
    packer.last_scalars = scalars


def launch_host(
    cx: Any, k: Any, host_fn: Any, arrays: tuple[Any, ...], tensors: Sequence[Tensor], writes: Sequence[bool]
) -> None:
    """Register the tensors' accesses and enqueue ``host_fn(*arrays)`` on the host backend's stream."""
    if host_fn is None:
        raise UsageError(
            f"kernel {k.name!r} has no numpy implementation, so it cannot run on the host backend; "
            "pass host=fn to Kernel(...) or run on a CUDA device"
        )
    with _ledger.LOCK:
        _register(cx, k, tensors, writes)
        cx.backend.launch_host_kernel(host_fn, arrays, cx.stream)


def host_array(t: Tensor) -> np.ndarray:
    """The numpy view of a host-backend tensor."""
    b = t.buffer
    return b.backend.array(b, t.offset, t.shape, t.strides, t.dtype.np_dtype)


def tensor_of(x: Any) -> Tensor:
    return x.tensor if type(x) is Partition else x
