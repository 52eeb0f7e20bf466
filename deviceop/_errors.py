"""The deviceop error tree. Every error raised by deviceop derives from DeviceOpError.

    DeviceOpError
    ├── BackendError        no usable backend / device, or a backend used after it failed
    ├── BorrowError         a buffer accessed while GPU work that uses it is in flight
    ├── CaptureError        work that cannot be recorded into a CUDA graph
    ├── CompileError        NVRTC rejected a kernel (carries the log)
    ├── CudaError           the driver reported an error (carries its name and explanation)
    ├── ShapeError          shapes, views or partitions that do not fit (also a ValueError)
    │   └── TensorIndexError    an index out of a tensor's range (also an IndexError)
    ├── DTypeError          an element type or scalar that is not accepted (also a TypeError)
    └── UsageError          an API used the wrong way (terminal twice, bad callback result...)
        └── SettingError    a setting's value that is not accepted (also a ValueError)

Messages say what happened and what to do instead.
"""

from __future__ import annotations

import os
import sys
import types
import warnings

__all__ = [
    "BackendError",
    "BorrowError",
    "CaptureError",
    "CompileError",
    "CudaError",
    "DTypeError",
    "DeviceOpError",
    "DeviceOpWarning",
    "NotATensorError",
    "SettingError",
    "ShapeError",
    "TensorIndexError",
    "UsageError",
    "warn_user",
]

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


class DeviceOpError(Exception):
    """Root of every error deviceop raises."""


class DeviceOpWarning(UserWarning):
    """Warnings from deviceop (e.g. falling back to the host backend)."""


class BackendError(DeviceOpError):
    """No usable backend or device, or an unknown backend name."""


class BorrowError(DeviceOpError):
    """A buffer was accessed while GPU work that uses it is still in flight."""


class CaptureError(DeviceOpError):
    """Work that cannot be recorded into a CUDA graph (allocation, nested sync...)."""


class CompileError(DeviceOpError):
    """NVRTC failed to compile a kernel; ``log`` holds the compiler's output."""

    def __init__(self, message: str, log: str = "") -> None:
        super().__init__(message)
        self.log = log


class CudaError(DeviceOpError):
    """The CUDA driver reported an error.

    ``name`` is the driver's error name (e.g. ``CUDA_ERROR_ILLEGAL_ADDRESS``) and ``code`` its
    numeric value; the message includes the driver's explanation.
    """

    def __init__(self, message: str, name: str = "", code: int = -1) -> None:
        super().__init__(message)
        self.name = name
        self.code = code


class ShapeError(DeviceOpError, ValueError):
    """Shapes, views or partitions that do not fit together."""


class DTypeError(DeviceOpError, TypeError):
    """An element type that is not accepted where it was given."""


class UsageError(DeviceOpError):
    """The API was used in a way it does not support."""


class TensorIndexError(ShapeError, IndexError):
    """An index outside a tensor's dimension (an IndexError, so iteration stops at the end)."""


class NotATensorError(UsageError, AttributeError):
    """A Tensor's attribute (``partition``, ``numpy``, ``shape``...) asked of an op that has not
    run yet; also an ``AttributeError``, so ``hasattr`` and ``getattr(op, name, default)`` work."""


class SettingError(UsageError, ValueError):
    """A setting (a ``set_*`` call or an environment variable) given a value it does not accept."""


def warn_user(message: str, category: type[Warning] = DeviceOpWarning) -> None:
    """Warn, attributed to the first caller outside deviceop (the user's line that set it off,
    not deviceop's source): ``warnings.warn``'s ``skip_file_prefixes`` on Python 3.12 and later,
    the same count by hand before."""
    if sys.version_info >= (3, 12):
        warnings.warn(message, category, stacklevel=2, skip_file_prefixes=(_PACKAGE,))
        return
    level = 2  # our caller's frame
    f: types.FrameType | None = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if "importlib" in name and "_bootstrap" in name:
            f = f.f_back  # (warnings skips import machinery's frames without counting them)
            continue
        if not name.startswith(_PACKAGE):
            break
        f = f.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
