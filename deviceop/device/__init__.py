"""The device layer: backends (cuda, host), tensors and partitions, DLPack."""

from .._core._base import Buffer
from .._core._ledger import borrow_policy, set_borrow_policy
from ._host import set_host_chaos
from ._select import DeviceOpWarning, backend_name, current, next_stream, use_backend
from ._tensor import Partition, Tensor

__all__ = [
    "Buffer", "Tensor", "Partition", "DeviceOpWarning", "backend_name", "current", "next_stream",
    "use_backend", "set_host_chaos", "set_borrow_policy", "borrow_policy",
]
