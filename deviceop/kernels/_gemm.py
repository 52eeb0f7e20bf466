"""GEMM: ``c = alpha * a @ b + beta * c`` through cuBLAS (cublasGemmEx), numpy on the host backend.

Tensors are row-major; a transposed view (``x.T``) is read as the transpose without a copy, and
row strides larger than the width (sub-matrices) are leading dimensions. cuBLAS is column-major,
so the row-major product runs as ``c^T = b^T a^T``, which needs no data movement.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np

from .._core._capture import CAPTURE
from .._core._gemm import GemmLauncher, GemmPlan, gemm_call
from .._core._launch import PlanCache
from .._core._ledger import check_backend, enqueue
from .._core._op import DeviceOp
from .._core._tensor import Partition, Tensor
from .._dtypes import DType, bfloat16, float16, float32
from .._errors import DTypeError, ShapeError, UsageError
from ._blas import WORKSPACE_BYTES, call, cublas, handle_for, recording_workspace, workspace_of
from ._blaslt import _lt, lt_handle, lt_plan, matmul_address, status_error
from ._gemm_replay import BATCHES, Replays
from ._kernel import check_scalar
from ._launch import KernelCall, has_op, host_array, launch_host

__all__ = ["gemm"]

_CUDA_TYPE = {"float16": 2, "bfloat16": 14, "float32": 0}  # cudaDataType_t: R_16F, R_16BF, R_32F
_COMPUTE_32F, _COMPUTE_TF32 = 68, 77  # cublasComputeType_t: COMPUTE_32F, COMPUTE_32F_FAST_TF32
# DEVICEOP_GEMM: "auto" (default) cuBLASLt with a plan made once per problem, and a call repeated
# exactly (same pointers, scalars, stream) replayed as a recorded graph; "lt" cuBLASLt calls only;
# "ex" cublasGemmEx on every call. The last two only to compare.
# (GEMM.mode holds the index of the one in use)
_MODES = ("auto", "lt", "ex")
if os.environ.get("DEVICEOP_GEMM", "auto") not in _MODES:
    raise UsageError(f"DEVICEOP_GEMM={os.environ['DEVICEOP_GEMM']!r} is not known; use auto (the default), lt or ex")
_FLOATS = (float16, bfloat16, float32)


def gemm(
    c: Any, a: Any, b: Any, alpha: float = 1.0, beta: float = 0.0, *, tf32: bool = False
) -> DeviceOp[tuple[Tensor | Partition, Tensor, Tensor]]:
    """``c = alpha * a @ b + beta * c`` for 2-D float16, bfloat16 or float32 tensors.

    ``c`` is the output: a Tensor or a Partition of one (the tiling does not matter to cuBLAS);
    ``a`` is (m, k), ``b`` (k, n), ``c`` (m, n), all of one dtype. Pass ``a.T`` / ``b.T`` for
    transposes. Accumulation is in float32; ``tf32=True`` lets float32 GEMMs use TF32 tensor
    cores (faster, about 10 mantissa bits). With ``beta=0``, ``c`` is not read (it may hold
    NaN). Arguments may be ops producing them. Returns an op whose output is ``(c, a, b)``.
    On cuda each stream has its own cuBLAS handle and workspace, so GEMMs can be recorded into
    graphs; a cuBLASLt plan (descriptors and algorithm) is made once per problem layout and
    reused, for fresh tensors too. The host backend computes with numpy in float32.
    """
    op = GEMM.fast(c, a, b, alpha, beta, tf32)  # a known layout: its op at once (compiled)
    if op is not None:
        return op
    alpha = check_scalar(alpha, float32, "alpha of gemm()")
    beta = check_scalar(beta, float32, "beta of gemm()")
    if tf32 is not False and tf32 is not True:
        raise UsageError(f"tf32 of gemm() must be True or False, got {tf32!r}")
    args = (c, a, b)
    opts = (alpha, beta, tf32)
    if has_op(args):
        return KernelCall(GEMM, args, opts, True)
    return gemm_call(GEMM, args, opts, GEMM.plan(args, opts))  # bad input fails here


class _Gemm(GemmLauncher):
    """The launcher behind :func:`gemm`: validation and plans here, the per-call path compiled
    (``GemmLauncher``); KernelCall drives ``plan`` and ``enqueue`` for calls given ops."""

    name = "gemm"

    def __init__(self) -> None:
        #: problem layouts (shapes, strides, dtype, alignment, device) -> _Geometry
        self.plans = PlanCache(1024)
        #: per stream handle: its cuBLAS handle and workspace
        self.blas = {}
        #: graphs of repeated GEMM calls, and of repeated batches of calls, which draw on the
        #: calls' credit (see _gemm_replay)
        self.replays = Replays()
        self.batch_replays = Replays(bank=self.replays)
        self.batch_replays.limit = BATCHES
        self.mode = _MODES.index(os.environ.get("DEVICEOP_GEMM", "auto"))
        self.ws_bytes = WORKSPACE_BYTES
        self.status_error = status_error

    def plan(self, args: tuple[Any, ...], opts: Any) -> _Geometry:
        """Validate ``(c, a, b)`` and return their problem's geometry (made once per layout)."""
        c, a, b = args
        ct = c.tensor if type(c) is Partition else c
        try:  # the layout, and the addresses' alignment up to 256 bytes (cuBLASLt's heuristic uses it)
            key = (opts[2], ct._key, a._key, b._key, ct.addr & 255, a.addr & 255, b.addr & 255)
        except AttributeError:
            key = None
        g = self.plans.get(key) if key is not None else None
        if g is None:
            g = _geometry(args, opts)
            if key is not None:
                self.plans.put(key, g)
        elif a.buffer is ct.buffer or b.buffer is ct.buffer:
            _refuse_overlap(ct, a, b)
        return g

    def enqueue(self, cx: Any, args: tuple[Any, ...], opts: Any, g: _Geometry) -> None:
        alpha, beta, tf32 = opts
        if g.m == 0 or g.n == 0:
            return
        c, a, b = args
        if type(c) is Partition:
            c = c.tensor
        check_backend(cx, g.be, "gemm()")
        if cx.backend.driver is None:
            arrays = (host_array(c), host_array(a), host_array(b), alpha, beta)
            launch_host(cx, self, _host_gemm, arrays, (c, a, b), _WRITES)
            return
        stream = cx.stream
        sh = stream.handle_int
        mode = _MODES[self.mode]
        lt = g.lt_call if mode != "ex" else None
        if lt is None and mode != "ex" and not g.lt_tried:
            lt = _lt_call(g, c.dtype, tf32)
        blas = self.blas.get(sh)
        if blas is None:
            blas = self.blas[sh] = (handle_for(stream), workspace_of(stream))
        ws = blas[1]
        if cx.capturing:  # (the recording's own: its replays may run on any stream, at once)
            ws = recording_workspace(CAPTURE.scope, stream)
        if lt is not None and lt[0]:  # a plain cuBLASLt call: the compiled path
            self.run_lt(cx, g, c, a, b, alpha, beta, ws)
            return
        # column-major view of the row-major product: c^T (n x m) = op(b') op(a'); a column-major c
        # swaps a and b (see _geometry)
        pa, pb, pc = (b.addr, a.addr, c.addr) if g.swap else (a.addr, b.addr, c.addr)
        accesses = ((c, True), a, b)
        if lt is None:
            h = blas[0]
            dt = _CUDA_TYPE[c.dtype.name]
            compute = _COMPUTE_TF32 if tf32 else _COMPUTE_32F

            def work() -> None:
                al, be_ = ctypes.c_float(alpha), ctypes.c_float(beta)
                if ws != blas[1]:  # recording: the handle works in the recording's workspace
                    call(cublas().set_workspace, h, ws, WORKSPACE_BYTES)
                try:
                    _gemm_ex(al, be_)
                finally:
                    if ws != blas[1]:
                        call(cublas().set_workspace, h, blas[1], WORKSPACE_BYTES)

            def _gemm_ex(al: ctypes.c_float, be_: ctypes.c_float) -> None:
                call(
                    cublas().gemm_ex,
                    h,
                    g.op_b,
                    g.op_a,
                    g.n,
                    g.m,
                    g.k,
                    ctypes.addressof(al),
                    pb,
                    dt,
                    g.ld_b,
                    pa,
                    dt,
                    g.ld_a,
                    ctypes.addressof(be_),
                    pc,
                    dt,
                    g.ld_c,
                    compute,
                    -1,  # CUBLAS_GEMM_DEFAULT
                )

            enqueue(cx, accesses, work, self)
            return
        _, handle, desc, la, lb, lc, algo = lt

        def work() -> None:  # type: ignore[no-redef]  # cublasLtMatmul's address is unknown: nvmath's binding calls it
            al, be_ = ctypes.c_float(alpha), ctypes.c_float(beta)
            call(
                _lt().matmul,
                handle,
                desc,
                ctypes.addressof(al),
                pb,
                la,
                pa,
                lb,
                ctypes.addressof(be_),
                pc,
                lc,
                pc,
                lc,
                algo,
                ws,
                WORKSPACE_BYTES,
                sh,
            )

        enqueue(cx, accesses, work, self)


def _lt_call(g: _Geometry, dtype: DType, tf32: bool) -> tuple[int, ...] | None:
    """The fixed arguments of g's cublasLtMatmul call (its plan made once), or None (no algorithm)."""
    g.lt_tried = True
    lp = lt_plan(g, _CUDA_TYPE[dtype.name], _COMPUTE_TF32 if tf32 else _COMPUTE_32F)
    if lp is None:
        return None
    g.lt = lp
    g.lt_call = (matmul_address(), lt_handle(g.be), lp.desc, lp.layout_a, lp.layout_b, lp.layout_c, lp.algo)
    call: tuple[int, ...] | None = g.lt_call
    return call


def _align(ptr: int) -> int:
    """The alignment cuBLASLt may assume for an address (at most 256 bytes)."""
    return min(256, ptr & -ptr) if ptr else 256


_WRITES = (True, False, False)


GEMM = _Gemm()


class _Geometry(GemmPlan):
    """A GEMM problem's layout for cuBLAS (no addresses): sizes, transposes, leading dimensions
    (the sizes, ``swap``, ``be`` and ``lt_call`` are the compiled plan's fields)."""

    __slots__ = ("al_a", "al_b", "al_c", "ld_a", "ld_b", "ld_c", "lt", "lt_tried", "op_a", "op_b")
    ld_a: int
    ld_b: int
    ld_c: int
    al_a: int
    al_b: int
    al_c: int
    op_a: int
    op_b: int
    lt: Any
    lt_tried: bool


def _refuse_overlap(ct: Tensor, a: Tensor, b: Tensor) -> None:
    for what, x in (("a", a), ("b", b)):
        if x.buffer is ct.buffer and x.size and ct.size and x._span[0] < ct._span[1] and ct._span[0] < x._span[1]:
            raise UsageError(
                f"gemm(): c overlaps {what}; cuBLAS reads {what} while it writes c, so write into another tensor"
            )


def _geometry(args: tuple[Any, ...], opts: Any) -> _Geometry:
    """Validate (c, a, b) and work out the column-major cuBLAS call."""
    c, a, b = args
    ct = c.tensor if type(c) is Partition else c
    for what, x in (("c (the output)", ct), ("a", a), ("b", b)):
        if type(x) is not Tensor:
            raise UsageError(f"{what} of gemm() must be a Tensor, got {type(x).__name__}")
        if x.ndim != 2:
            raise ShapeError(f"{what} of gemm() must be 2-D, got shape {x.shape}; use .view((rows, cols))")
    dt: DType = ct.dtype
    if dt not in _FLOATS:
        raise DTypeError(f"gemm() supports float16, bfloat16 and float32, got {dt.name}")
    for what, x in (("a", a), ("b", b)):
        if x.dtype is not dt:
            raise DTypeError(f"gemm(): {what} is {x.dtype.name} but c is {dt.name}; all three must have one dtype")
        if x.buffer.backend is not ct.buffer.backend:
            raise UsageError(f"gemm(): {what} lives on {x.device} and c on {ct.device}; move it first")
    if opts[2] and dt is not float32:
        raise UsageError(f"gemm(tf32=True) applies to float32 only; these tensors are {dt.name}")
    (m, k), (k2, n) = a.shape, b.shape
    if k2 != k or ct.shape != (m, n):
        raise ShapeError(
            f"gemm(): a {a.shape} @ b {b.shape} does not give c {ct.shape}; need a (m, k), b (k, n), c (m, n)"
        )
    _refuse_overlap(ct, a, b)
    g = _Geometry()
    g.be = ct.buffer.backend
    g.lt, g.lt_tried, g.lt_call = None, False, None
    g.swap = _layout(ct, "c")[0]
    if g.swap:
        # c is column-major (a transposed view): compute c^T = b^T a^T, whose output is row-major
        ct, a, b = ct.T, b.T, a.T
        m, n = n, m
    g.m, g.n, g.k = m, n, k
    _, g.ld_c = _layout(ct, "c")
    ta, g.ld_a = _layout(a, "a")
    tb, g.ld_b = _layout(b, "b")
    # a row-major matrix is its transpose in column-major terms: no transpose flag needed
    g.op_a, g.op_b = int(ta), int(tb)  # cublasOperation_t: 0 = N, 1 = T
    g.al_a, g.al_b, g.al_c = _align(a.addr), _align(b.addr), _align(ct.addr)
    return g


def _layout(x: Tensor, what: str) -> tuple[bool, int]:
    """(column_major, leading dimension) of a 2-D view; raises if neither dimension is unit-stride."""
    r, c = x.shape
    s0, s1 = x.strides
    if (s1 == 1 or c <= 1) and (r <= 1 or s0 >= c):
        return False, max(s0 if r > 1 else c, c, 1)
    if (s0 == 1 or r <= 1) and (c <= 1 or s1 >= r):
        return True, max(s1 if c > 1 else r, r, 1)
    raise ShapeError(
        f"gemm(): {what} has shape {x.shape} and strides {x.strides}; cuBLAS needs unit stride along "
        "one dimension (a row-major tensor, a slice of rows/columns of one, or its .T); copy it first"
    )


def _host_gemm(c: np.ndarray, a: np.ndarray, b: np.ndarray, alpha: float, beta: float) -> None:
    """numpy twin: float64 products and accumulation, one rounding to c's dtype.

    float64, not cuBLAS's float32: BLAS's float32 sums of a row change with the row's place in
    the matrix (its blocking), and rounding a float64 sum to c's dtype hides that, so a row's
    result does not depend on the other rows (a batched request gets the bits it gets alone)."""
    acc = alpha * (a.astype(np.float64) @ b.astype(np.float64))
    if beta != 0.0:
        acc += beta * c.astype(np.float64)
    c[...] = acc.astype(c.dtype)
