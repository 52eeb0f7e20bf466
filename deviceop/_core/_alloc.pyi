"""Type stub of the compiled module ``deviceop._core._alloc``: the allocation op.

Names not declared here are internal to the core and typed ``Any``.
"""

from typing import Any

from ._op import DeviceOp

class Alloc(DeviceOp[Any]):
    """An op allocating a tensor (zeros, ones, full, empty)."""

    def __init__(self, what: str, shape: Any, dtype: Any, fill: Any) -> None: ...

def empty_op(shape: Any, dtype: Any) -> Alloc: ...
def __getattr__(name: str) -> Any: ...

class FromNumpy(DeviceOp[Any]):
    """Allocate a tensor and copy a numpy array into it (the array is read when the op runs)."""

    dtype: Any
    def __init__(self, array: Any) -> None: ...
