"""The stub driver's kernels: built-in launches computed on the host by their numpy twins.

``install()`` registers the hooks with the stub libcuda.so.1 loaded into this process (see
stub_cuda.c). A launch arrives as the function's name, the grid and the parameter block; the
parameters are decoded by the built-in's ABI (see deviceop.kernels._elementwise and
_rowwise) and the family's host implementation computes the result in place. So the cuda
backend's packing of parameters is checked by the results, as on a GPU.

User kernels run their ``host=`` function: the harness remembers each Kernel by name and each
tensor's layout by address (it wraps ``Kernel.__init__`` and ``Tensor.__init__``, and is told
of each tensor an allocation makes), so a pointer parameter becomes the array the host backend
would pass. cuBLAS is not emulated: GEMM tests skip under the stub (but one, which runs the
compiled GEMM path with the stub's ``stub_ltmatmul``, an empty kernel, standing in for
cuBLASLt's call), as do tests that need a GPU's own behaviour (its faults, its timing). Each
stream's work runs on a worker thread of the stub's (as it is enqueued with
``DEVICEOP_STUB_INLINE=1``, which tests never set).
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

_LAUNCH = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_char_p,
    ctypes.POINTER(ctypes.c_uint),
    ctypes.POINTER(ctypes.c_uint),
    ctypes.POINTER(ctypes.c_void_p),
)
_NPARAMS = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p)
_state: dict[str, Any] = {}


#: the kernels the stub's cuBLASLt stand-in (stub_ltmatmul) launches: no work; their arguments one
#: buffer, or (``gemm_by_params(True)``) eight parameters, which the stub itself declares
STAND_IN_GEMMS = (b"stub_gemm", b"stub_gemm_p")


def _families() -> dict[str, Any]:
    from deviceop.kernels._builtins import BUILTINS
    from deviceop.kernels._elementwise import DTYPES, SFX

    out = {}
    for k in BUILTINS:
        for d in DTYPES:
            out[f"{k.name}_{SFX[d.name]}"] = (k, d)
    return out


def _nparams(k: Any) -> int:
    if hasattr(k, "n_in"):  # elementwise: out, inputs, scalars, tile, vec
        return 1 + k.n_in + k.n_scalar + 2
    return k.n_tensors + (1 if k.kind == "rms" else 0) + 3  # row-wise: pointers, eps, n, r, vec


def _array(addr: int, n: int, dtype: Any) -> np.ndarray:
    if n == 0:
        return np.empty(0, dtype.np_dtype)
    raw = (ctypes.c_uint8 * (n * dtype.itemsize)).from_address(addr)
    return np.frombuffer(raw, dtype=dtype.np_dtype)


def _value(params: Any, i: int, ctype: Any) -> Any:
    return ctype.from_address(params[i]).value


_SCALAR_CTYPES = {
    "float32": ctypes.c_float,
    "int32": ctypes.c_int32,
    "int64": ctypes.c_int64,
    "uint8": ctypes.c_uint8,
    "float16": ctypes.c_uint16,
    "bfloat16": ctypes.c_uint16,
}


def _tensor_array(addr: int, what: str) -> np.ndarray:
    lay = _state["layouts"].get(addr)
    if lay is None:
        raise LookupError(f"no tensor is known at 0x{addr:x} ({what})")
    shape, strides, dtype = lay
    if not shape or 0 in shape:
        return np.empty(shape, dtype.np_dtype)
    span = (sum((n - 1) * st for n, st in zip(shape, strides)) + 1) * dtype.itemsize
    raw = np.frombuffer((ctypes.c_uint8 * span).from_address(addr), dtype=np.uint8).view(dtype.np_dtype)
    it = dtype.itemsize
    return np.lib.stride_tricks.as_strided(raw, shape=shape, strides=tuple(st * it for st in strides))


def _launch_user(k: Any, params: Any) -> int:
    from deviceop.kernels._params import TensorParam

    args = []
    for i, p in enumerate(k.params):
        if isinstance(p, TensorParam):
            args.append(_tensor_array(_value(params, i, ctypes.c_uint64), f"argument {i} of {k.name}"))
        else:
            v = _value(params, i, _SCALAR_CTYPES[p.name])
            if p.itemsize == 2 and p.is_float:
                v = np.array(v, np.uint16).view(p.np_dtype)[()]
            args.append(p.np_dtype.type(v))
    k.host(*args)
    return 0


def _launch(name: bytes, grid: Any, block: Any, params: Any) -> int:
    if name in STAND_IN_GEMMS:
        return 0  # (the stub's cuBLASLt stand-in: an empty kernel; what a test times or counts is the path)
    try:
        user = _state["kernels"].get(name.decode())
        if user is not None:
            return _launch_user(user, params)
        k, d = _state["families"][name.decode()]
        g = grid[0] * grid[1] * grid[2]
        ptr = lambda i: _value(params, i, ctypes.c_uint64)  # noqa: E731
        if hasattr(k, "n_in"):
            n_ptr = 1 + k.n_in
            tile = _value(params, n_ptr + k.n_scalar, ctypes.c_int64)
            n = g * tile
            arrays = [_array(ptr(i), n, d) for i in range(n_ptr)]
            scalars = [np.float32(_value(params, n_ptr + j, ctypes.c_float)) for j in range(k.n_scalar)]
            k.host_impl(*arrays, *scalars)
            return 0
        n_ptr = k.n_tensors
        extra = 1 if k.kind == "rms" else 0
        n = _value(params, n_ptr + extra, ctypes.c_int64)
        r = _value(params, n_ptr + extra + 1, ctypes.c_int64)
        rows = g * r
        x = _array(ptr(1), rows * n, d).reshape(rows, n)  # (matvec: the matrix)
        if k.kind in ("map", "rms"):
            out = _array(ptr(0), rows * n, d).reshape(rows, n)
        else:
            out = _array(ptr(0), rows, d)
        rest: list[Any] = []
        if k.kind == "rms":
            rest = [_array(ptr(2), n, d), np.float32(_value(params, n_ptr, ctypes.c_float))]
        elif k.kind == "matvec":
            rest = [_array(ptr(2), n, d)]
        k.host_impl(out, x, *rest)
        return 0
    except Exception as e:  # a fault, as a kernel's would be: CUDA_ERROR_LAUNCH_FAILED
        print(f"deviceop stub driver: launch of {name!r} failed: {e!r}", file=sys.stderr)
        return 719


def _count(name: bytes) -> int:
    if name in STAND_IN_GEMMS:
        return 0
    user = _state["kernels"].get(name.decode())
    if user is not None:
        return len(user.params) if user.host is not None else -1
    hit = _state["families"].get(name.decode())
    return _nparams(hit[0]) if hit else -1


def _remember_layouts() -> None:
    from deviceop._core._base import set_fresh_tensor_hook
    from deviceop._core._tensor import Tensor
    from deviceop.kernels._kernel import Kernel

    layouts: dict[int, Any] = {}
    kernels: dict[str, Any] = {}
    t_init, k_init = Tensor.__init__, Kernel.__init__

    def tensor_init(self: Any, *a: Any, **kw: Any) -> None:
        t_init(self, *a, **kw)
        if len(layouts) > 200_000:
            layouts.clear()
        layouts[self.addr] = (self.shape, self.strides, self.dtype)

    def fresh(t: Any) -> None:
        if len(layouts) > 200_000:
            layouts.clear()
        layouts[t.addr] = (t.shape, t.strides, t.dtype)

    def kernel_init(self: Any, *a: Any, **kw: Any) -> None:
        k_init(self, *a, **kw)
        kernels[self.name] = self

    Tensor.__init__ = tensor_init  # type: ignore[method-assign]
    set_fresh_tensor_hook(fresh)  # allocations make their tensors without __init__
    Kernel.__init__ = kernel_init  # type: ignore[method-assign]
    _state["layouts"], _state["kernels"] = layouts, kernels


def install() -> None:
    """Register the emulated kernels with the stub driver loaded in this process."""
    if "lib" in _state:
        return
    lib = ctypes.CDLL("libcuda.so.1")
    if not hasattr(lib, "stub_set_hooks"):
        raise RuntimeError("libcuda.so.1 here is not deviceop's stub driver (check LD_LIBRARY_PATH)")
    _state["families"] = _families()
    _remember_layouts()
    _state["hooks"] = (_LAUNCH(_launch), _NPARAMS(_count))  # kept alive: the driver calls them
    lib.stub_set_hooks(*_state["hooks"])
    lib.stub_launches.restype = ctypes.c_long
    lib.stub_last_async_alloc_stream.restype = ctypes.c_void_p
    _state["lib"] = lib


def last_async_alloc_stream() -> int:
    """The stream handle the last ``cuMemAllocAsync`` was given (0: none or the legacy stream)."""
    return int(_state["lib"].stub_last_async_alloc_stream() or 0)


def set_dtoh_call_delay(seconds: float) -> None:
    """Make each cuMemcpyDtoHAsync call take ``seconds`` on the calling thread (0: none), to
    widen the window between an access's registration and its copy's enqueue in tests."""
    _state["lib"].stub_set_dtoh_call_delay(ctypes.c_uint(int(seconds * 1e6)))


def dtoh_calls_waiting() -> int:
    """cuMemcpyDtoHAsync calls waiting out the delay of :func:`set_dtoh_call_delay` now."""
    fn = _state["lib"].stub_dtoh_calls_waiting
    fn.restype = ctypes.c_long
    return int(fn())


def launches() -> int:
    """Kernel launches the stub has executed (graph replays included)."""
    return int(_state["lib"].stub_launches())


def gemm_log() -> list[tuple[int, int, int, int]]:
    """The cuBLASLt stand-in's launches executed since the last call, in order (all streams):
    each ``(A, B, C, D)`` as its kernel's argument block held them when it ran (replayed or
    not) (cuBLAS's operands: ``A`` is the row-major product's ``b``, ``B`` its ``a``, ``C`` and
    ``D`` its output); the log is then cleared. Raises if launches were dropped (more than
    4,096 since the last call)."""
    lib = _state["lib"]
    out = (ctypes.c_uint64 * (4 * 4096))()
    dropped = ctypes.c_long(0)
    lib.stub_gemm_log.restype = ctypes.c_long
    n = lib.stub_gemm_log(out, ctypes.c_long(4096), ctypes.byref(dropped))
    if dropped.value:
        raise AssertionError(f"the stub's GEMM log dropped {dropped.value} launches: read it more often")
    return [(out[4 * i], out[4 * i + 1], out[4 * i + 2], out[4 * i + 3]) for i in range(n)]


def gemm_by_params(on: bool) -> None:
    """Make the cuBLASLt stand-in pass its kernel's arguments as eight parameters (True), as
    cuBLAS's float32 kernels do, or as one buffer (False, the default)."""
    _state["lib"].stub_gemm_by_params(ctypes.c_int(int(on)))


def fail_next_node_update(code: int) -> None:
    """Make the next cuGraphExecKernelNodeSetParams (a GEMM template's update) fail with
    ``code`` once."""
    _state["lib"].stub_fail_next_node_update(ctypes.c_int(code))


def set_pool_cap(nbytes: int) -> None:
    """Make an allocation that would take the device memory in use past ``nbytes`` fail with
    CUDA_ERROR_OUT_OF_MEMORY, as a full device's pool does (0: no cap)."""
    _state["lib"].stub_set_pool_cap(ctypes.c_longlong(nbytes))


def pool_used() -> int:
    """Bytes of the device's pool in use (live and cached blocks), less those being freed."""
    fn = _state["lib"].stub_pool_used
    fn.restype = ctypes.c_longlong
    return int(fn())


def fail_next_write(code: int) -> None:
    """Make the next cuStreamWriteValue32 (a completion flag's arming) fail with ``code`` once,
    enqueuing nothing: an error of that one call (the fault switch of the lifetime tests)."""
    _state["lib"].stub_fail_next_write(ctypes.c_int(code))
