"""cuBLASLt plans for GEMM: descriptors and a chosen algorithm, made once per problem.

cublasGemmEx runs cuBLAS's heuristics on every call, several microseconds of host time; in a
queue of small GEMMs that host time is the throughput. A plan (matmul descriptor, the three
layouts and the heuristic's first algorithm) is made once per (dtype, shape, transposes,
leading dimensions, pointer alignment) and reused, so a call is one ``cublasLtMatmul``.
Plans are host objects; they are kept for the process's lifetime (a bounded number).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np

from .._process import renew_at_fork
from ._blas import WORKSPACE_BYTES, call, relaxed_capture

__all__ = ["LtPlan", "lt_handle", "lt_plan", "matmul_address", "status_error"]

_lock = threading.RLock()  # plan creation takes it, then may create the handle
renew_at_fork(globals(), _lock=threading.RLock)  # a thread may hold it at fork()
_plans: dict[tuple[Any, ...], LtPlan | None] = {}
_MAX_PLANS = 4096
_state: dict[str, Any] = {}
_handles: dict[Any, int] = {}  # backend (a device) -> its cublasLtHandle_t


def _lt() -> Any:
    m = _state.get("mod")
    if m is None:
        from nvmath.bindings import cublasLt as m  # type: ignore[no-redef]

        _state["mod"] = m
    return m


def lt_handle(backend: Any) -> int:
    """``backend``'s cuBLASLt handle (streams are given per call): a handle belongs to the
    device current when it is made, so each device has its own."""
    h = _handles.get(backend)
    if h is None:
        with _lock:
            h = _handles.get(backend)
            if h is None:
                with relaxed_capture(), backend.current():
                    h = _handles[backend] = call(_lt().create)
    return h


def matmul_address() -> int:
    """The address of the ``cublasLtMatmul`` that nvmath's bindings call (0 if it cannot be had).

    The compiled launch calls it directly: the same library instance as the handle and plans.
    """
    a = _state.get("addr")
    if a is None:
        try:
            from nvmath.bindings._internal import cublasLt as internal

            a = int(internal._inspect_function_pointer("__cublasLtMatmul"))
        except Exception:  # another nvmath layout: the bindings' own call serves
            a = 0
        _state["addr"] = a
    return a


def status_error(status: int, what: str) -> Exception:
    """A CudaError naming a non-zero cublasStatus_t."""
    from .._errors import CudaError

    try:
        name = _lt().Status(status).name
    except Exception:
        name = f"cublasStatus {status}"
    return CudaError(
        f"cuBLASLt {what} failed with {name}. Check the GEMM's shapes and strides; a launch failure here "
        "can also be an earlier kernel's error (run with CUDA_LAUNCH_BLOCKING=1)",
        name,
        status,
    )


class LtPlan:
    """What one cublasLtMatmul call needs besides the pointers and the stream."""

    __slots__ = ("_result", "algo", "desc", "layout_a", "layout_b", "layout_c")

    def __init__(self, desc: int, la: int, lb: int, lc: int, result: Any) -> None:
        self.desc, self.layout_a, self.layout_b, self.layout_c = desc, la, lb, lc
        self._result = result  # owns the algorithm's memory
        self.algo = result.ptr  # cublasLtMatmulHeuristicResult_t starts with its algo


def lt_plan(g: Any, cuda_type: int, compute: int) -> LtPlan | None:
    """The plan for geometry ``g`` (see _gemm) on its device, or None if cuBLASLt offers no algorithm."""
    be = g.be
    shape = (g.m, g.n, g.k, g.op_a, g.op_b, g.ld_a, g.ld_b, g.ld_c, g.al_a, g.al_b, g.al_c)
    key = (be.device_label, cuda_type, compute, *shape)
    if key in _plans:
        return _plans[key]
    lt_handle(be)  # before the plan lock
    with _lock:
        if key not in _plans:
            with relaxed_capture(), be.current():
                plan = _make(key, lt_handle(be))
            if len(_plans) < _MAX_PLANS:
                _plans[key] = plan
            return plan
    return _plans[key]


def _set(fn: Any, obj: int, attr: Any, ctype: Any, value: int) -> None:
    v = ctype(value)
    call(fn, obj, int(attr), ctypes.addressof(v), ctypes.sizeof(v))


def _make(key: tuple[Any, ...], h: int) -> LtPlan | None:
    lt = _lt()
    _, dt, compute, m, n, k, op_a, op_b, ld_a, ld_b, ld_c, al_a, al_b, al_c = key
    # the row-major product as column-major: c^T (n x m) = op(b') (n x k) op(a') (k x m)
    desc = call(lt.matmul_desc_create, compute, 0)  # scale type: CUDA_R_32F
    A = lt.MatmulDescAttribute
    _set(lt.matmul_desc_set_attribute, desc, A.TRANSA, ctypes.c_int32, op_b)
    _set(lt.matmul_desc_set_attribute, desc, A.TRANSB, ctypes.c_int32, op_a)
    la = call(lt.matrix_layout_create, dt, *((k, n) if op_b else (n, k)), ld_b)
    lb = call(lt.matrix_layout_create, dt, *((m, k) if op_a else (k, m)), ld_a)
    lc = call(lt.matrix_layout_create, dt, n, m, ld_c)
    pref = call(lt.matmul_preference_create)
    P = lt.MatmulPreferenceAttribute
    try:
        _set(lt.matmul_preference_set_attribute, pref, P.MAX_WORKSPACE_BYTES, ctypes.c_uint64, WORKSPACE_BYTES)
        _set(lt.matmul_preference_set_attribute, pref, P.MIN_ALIGNMENT_A_BYTES, ctypes.c_uint32, al_b)
        _set(lt.matmul_preference_set_attribute, pref, P.MIN_ALIGNMENT_B_BYTES, ctypes.c_uint32, al_a)
        _set(lt.matmul_preference_set_attribute, pref, P.MIN_ALIGNMENT_C_BYTES, ctypes.c_uint32, al_c)
        _set(lt.matmul_preference_set_attribute, pref, P.MIN_ALIGNMENT_D_BYTES, ctypes.c_uint32, al_c)
        result = lt.MatmulHeuristicResult(1)
        count = np.zeros(1, np.int32)
        try:
            call(lt.matmul_algo_get_heuristic, h, desc, la, lb, lc, lc, pref, 1, result.ptr, count.ctypes.data)
        except Exception:
            count[0] = 0  # no algorithm for this problem: the caller uses cublasGemmEx
    finally:
        lt.matmul_preference_destroy(pref)
    if count[0] == 0:
        for lay in (la, lb, lc):
            lt.matrix_layout_destroy(lay)
        lt.matmul_desc_destroy(desc)
        return None
    return LtPlan(desc, la, lb, lc, result)
