"""The device layer: backends (cuda, host), tensors and partitions, DLPack."""

from .._backends._host import set_host_chaos
from .._core._base import Buffer
from .._core._ledger import borrow_policy, set_borrow_policy
from .._core._select import DeviceOpWarning, backend_name, current, next_stream, use_backend
from .._core._tensor import Partition, Tensor

__all__ = [
    "Buffer",
    "DeviceOpWarning",
    "Partition",
    "Tensor",
    "backend_name",
    "borrow_policy",
    "current",
    "next_stream",
    "set_borrow_policy",
    "set_host_chaos",
    "use_backend",
]
