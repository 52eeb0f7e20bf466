"""Type stub of the compiled module ``deviceop._core._transfer``: copies between host and
device memory (the ops ``from_numpy`` and ``to_numpy``, and the staged copies behind them).

Names not declared here are internal to the core and typed ``Any``.
"""

from typing import Any

import numpy as np

from ._op import DeviceOp

class ToNumpy(DeviceOp[np.ndarray]):
    """Copy a tensor (or the tensor an op produces) into a new numpy array."""

    def __init__(self, src: Any) -> None: ...

def resolve_tensor(x: Any, what: str) -> Any:
    """A Tensor from a Tensor or a Partition; raise UsageError otherwise."""

def __getattr__(name: str) -> Any: ...
