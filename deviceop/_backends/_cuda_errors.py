"""The cuda backend's error reporting: driver results as :class:`CudaError`."""

from __future__ import annotations

from typing import Any

from .._errors import CudaError

__all__ = ["_drv", "check", "cuda_error"]  # _drv: the driver bindings module, shared by the cuda backend

_drv: Any  # the bindings module (untyped), or None
try:
    from cuda.bindings import driver as _drv  # type: ignore[no-redef]
except Exception:  # pragma: no cover - cuda-python is a dependency; kept for broken installs
    _drv = None


def _error_text(err: Any) -> tuple[str, str]:
    try:
        if type(err) is int:  # from the compiled entry points
            err = _drv.CUresult(err)
        _, name = _drv.cuGetErrorName(err)
        _, text = _drv.cuGetErrorString(err)
        return name.decode(), text.decode()
    except Exception:
        return f"CUresult {int(err)}", "unknown error"


#: what to do after errors that a user can act on, by driver code
_ADVICE = {
    2: "free tensors you no longer need (and do.empty_cache()), or allocate less",  # OUT_OF_MEMORY
    700: "the context is lost: fix the failing kernel's memory access and start a new process",  # ILLEGAL_ADDRESS
    710: "the context is lost: a kernel's assert failed; fix it and start a new process",  # ASSERT
    719: "the context is lost: fix the failing kernel and start a new process",  # LAUNCH_FAILED
}


def cuda_error(err: Any, call: str) -> CudaError:
    """A CudaError carrying the driver's error name and explanation, and what to do where that
    is known."""
    name, text = _error_text(err)
    advice = _ADVICE.get(int(err))
    return CudaError(f"{call} failed with {name}: {text}" + (f"; {advice}" if advice else ""), name=name, code=int(err))


def check(result: Any, call: str) -> Any:
    """Unpack a cuda.bindings result tuple, raising CudaError on failure."""
    err = result[0]
    if err:
        raise cuda_error(err, call)
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]
