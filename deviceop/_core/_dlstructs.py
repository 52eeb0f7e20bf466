"""DLPack's structs (dlpack.h, unversioned ``dltensor`` capsules) and reading a producer's capsule."""

from __future__ import annotations

import ctypes
from typing import Any

from .._errors import UsageError

__all__ = ["describe_dlpack"]


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.PYFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]

_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_SetName.restype = ctypes.c_int
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]

_USED = b"used_dltensor"  # the capsule keeps this pointer: it must live as long as the module


class _Imported:
    """Owner of imported DLPack memory: calls the producer's deleter when dropped."""

    def __init__(self, addr: int, keep: Any) -> None:
        self.addr = addr
        self.keep = keep

    def __del__(self) -> None:
        mt = _DLManagedTensor.from_address(self.addr)
        if mt.deleter:
            mt.deleter(ctypes.pointer(mt))


def describe_dlpack(obj: Any, be: Any, what: str) -> tuple[int, tuple[int, ...], tuple[int, ...] | None, int, str]:
    """(address, shape, byte strides, itemsize, 'cuda'|'cpu') of an array that speaks DLPack
    (the memory stays the producer object's: the capsule is released at once)."""
    cap = obj.__dlpack__()
    if not _api.PyCapsule_IsValid(cap, b"dltensor"):
        raise UsageError(f"{what}: {type(obj).__name__}.__dlpack__() did not return an unconsumed 'dltensor' capsule")
    addr = _api.PyCapsule_GetPointer(cap, b"dltensor")
    mt = _DLManagedTensor.from_address(addr)
    dl = mt.dl_tensor
    dev = (
        "cuda"
        if dl.device.device_type == 2
        else "cpu"
        if dl.device.device_type in (1, 3)
        else str(dl.device.device_type)
    )
    want = "cuda" if be.cuda_memory else "cpu"
    if dev != want:
        raise UsageError(
            f"{what}: this {type(obj).__name__} lives on {dev!r} memory, but the {be.name} backend's work "
            f"touches {want!r} memory; move it there first"
        )
    it = max(dl.dtype.bits // 8, 1) * dl.dtype.lanes
    shape = tuple(dl.shape[i] for i in range(dl.ndim))
    strides = tuple(dl.strides[i] * it for i in range(dl.ndim)) if dl.strides else None
    ptr = int(dl.data or 0) + int(dl.byte_offset)
    _api.PyCapsule_SetName(cap, _USED)
    del mt, dl
    _Imported(addr, cap)  # dropped at once: the producer's deleter runs; obj keeps the memory
    return ptr, shape, strides, it, dev
