"""Element types. Each DType knows its numpy dtype (bfloat16 from ml_dtypes), its C++ name
for kernels and its DLPack code."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from ._errors import DTypeError

__all__ = ["DType", "as_dtype", "bfloat16", "float16", "float32", "int32", "int64", "uint8"]


@dataclass(frozen=True, eq=False)
class DType:
    """A tensor element type. The six dtypes are singletons: compared and hashed by identity
    (launch plans are keyed by them on every call)."""

    name: str
    itemsize: int
    np_dtype: np.dtype
    ctype: str  # the C++ type name used in kernel sources
    dl_code: int  # DLPack type code: 0 int, 1 uint, 2 float, 4 bfloat
    is_float: bool

    def __repr__(self) -> str:
        return f"deviceop.{self.name}"


float16: DType = DType("float16", 2, np.dtype(np.float16), "__half", 2, True)
bfloat16: DType = DType("bfloat16", 2, np.dtype(ml_dtypes.bfloat16), "__nv_bfloat16", 4, True)
float32: DType = DType("float32", 4, np.dtype(np.float32), "float", 2, True)
int32: DType = DType("int32", 4, np.dtype(np.int32), "int", 0, False)
int64: DType = DType("int64", 8, np.dtype(np.int64), "long long", 0, False)
uint8: DType = DType("uint8", 1, np.dtype(np.uint8), "unsigned char", 1, False)

ALL = (float16, bfloat16, float32, int32, int64, uint8)
_BY_NP = {d.np_dtype: d for d in ALL}
_BY_NAME = {d.name: d for d in ALL}


def as_dtype(x: Any, what: str = "dtype") -> DType:
    """Accept a DType, a numpy dtype (or type) or a name; raise DTypeError otherwise."""
    if isinstance(x, DType):
        return x
    if isinstance(x, str) and x in _BY_NAME:
        return _BY_NAME[x]
    try:
        d = _BY_NP.get(np.dtype(x))
    except TypeError:
        d = None
    if d is None:
        names = ", ".join(d.name for d in ALL)
        raise DTypeError(f"{what} {x!r} is not supported; use one of deviceop.{{{names}}}")
    return d


def from_dl(code: int, bits: int) -> DType:
    """The DType for a DLPack (code, bits) pair."""
    for d in ALL:
        if d.dl_code == code and d.itemsize * 8 == bits:
            return d
    raise DTypeError(
        f"DLPack dtype (code={code}, bits={bits}) is not supported; convert the array to one of "
        + ", ".join(d.name for d in ALL)
        + " first"
    )
