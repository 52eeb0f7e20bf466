"""The launch path shared by user kernels and built-ins.

``KernelCall`` is the op a kernel call returns: its output is its arguments, same type in, same
type out. Launch plans (:class:`~deviceop._core._launch.LaunchPlan`) are keyed by value, the
arguments' layout (shape, strides, dtype, alignment, device) and not their identity, so fresh
tensors of a known shape reuse one; :class:`PlanCache` holds them. On cuda a planned call is
one compiled ``launch`` (ledger and ``cuLaunchKernel`` under the ledger lock); on the host
backend the numpy implementation is enqueued through the ledger's entry point.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._core._launch import LaunchPlan, PlanCache, launch
from .._core._ledger import enqueue
from .._core._tensor import Partition, Tensor
from .._errors import UsageError
from ..ops._base import DeviceOp

__all__ = [
    "SRC_FIXED",
    "SRC_SCALAR",
    "SRC_TENSOR",
    "T_F32",
    "T_I32",
    "T_I64",
    "T_PTR",
    "T_U8",
    "T_U16",
    "KernelCall",
    "LaunchPlan",
    "PlanCache",
    "has_op",
    "host_array",
    "launch",
    "launch_host",
    "tensor_of",
]

# a launch plan's parameter layout: (source, index, C type, fixed raw bits) per parameter
SRC_TENSOR, SRC_SCALAR, SRC_FIXED = 0, 1, 2
T_PTR, T_F32, T_I32, T_I64, T_U8, T_U16 = 0, 1, 2, 3, 4, 5


class KernelCall(DeviceOp[tuple[Any, ...]]):
    """The op returned by calling a kernel; its output is the (resolved) argument tuple.

    Arguments that are ops (``lazy``) run first, in the same execution; plain arguments were
    validated when the call was made, before any GPU work.
    """

    __slots__ = ("_args", "_k", "_lazy", "_opts", "_plan")

    def __init__(self, kernel: Any, args: tuple[Any, ...], opts: Any, lazy: bool, plan: Any = None) -> None:
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

    def _run(self, cx: Any) -> tuple[Any, ...]:
        args = self._args
        plan = self._plan
        if self._lazy:
            args = tuple(a._run(cx) if isinstance(a, DeviceOp) else a for a in args)
            plan = self._k.plan(args, self._opts)  # validates the produced arguments first
        self._k.enqueue(cx, args, self._opts, plan)
        return args


def has_op(args: tuple[Any, ...]) -> bool:
    """True if any argument is an op (to be run before the launch)."""
    return any(isinstance(a, DeviceOp) for a in args)


def launch_host(
    cx: Any, k: Any, host_fn: Any, arrays: tuple[Any, ...], tensors: Sequence[Tensor], writes: Sequence[bool]
) -> None:
    """Enqueue ``host_fn(*arrays)`` on the host backend's stream through the ledger's entry point."""
    if host_fn is None:
        raise UsageError(
            f"kernel {k.name!r} has no numpy implementation, so it cannot run on the host backend; "
            "pass host=fn to Kernel(...) or run on a CUDA device"
        )
    be = cx.backend
    enqueue(cx, tuple(zip(tensors, writes)), lambda: be.launch_host_kernel(host_fn, arrays, cx.stream), k)


def host_array(t: Tensor) -> np.ndarray:
    """The numpy view of a host-backend tensor."""
    b = t.buffer
    return b.backend.array(b, t.offset, t.shape, t.strides, t.dtype.np_dtype)  # type: ignore[no-any-return]


def tensor_of(x: Any) -> Tensor:
    """The tensor of a Partition, or ``x`` itself."""
    return x.tensor if type(x) is Partition else x  # type: ignore[no-any-return]


def signature_from_doc(doc: str) -> inspect.Signature:
    """The call signature a built-in's one-line doc gives (``"add(out_partition, x, y): ..."``), so
    ``inspect.signature`` and IDEs show it: parameters are positional; an output written as
    ``y.partition(...)`` is named ``out``; ``eps=1e-6`` keeps its default."""
    head = doc.split(":", 1)[0]
    inner = head[head.index("(") + 1 : head.rindex(")")]
    parts: list[str] = []
    depth, cur = 0, ""
    for ch in inner:
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
            continue
        depth += ch == "("
        depth -= ch == ")"
        cur += ch
    if cur.strip():
        parts.append(cur.strip())
    params: list[inspect.Parameter] = []
    for i, p in enumerate(parts):
        name, _, default = p.partition("=")
        name = name.strip()
        if not name.isidentifier():
            name = "out" if i == 0 else f"arg{i}"
        if default:
            params.append(inspect.Parameter(name, inspect.Parameter.POSITIONAL_ONLY, default=float(default)))
        else:
            params.append(inspect.Parameter(name, inspect.Parameter.POSITIONAL_ONLY))
    return inspect.Signature(params)
