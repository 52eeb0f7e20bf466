"""Devices: selection (``use_backend``, ``device``, ``devices``), streams, tensors and partitions.

The face of what the core implements (``deviceop._core``: ``_select``, ``_tensor``) and of the
host backend's chaos setting.
"""

from .._backends._host import set_host_chaos
from .._core._base import Buffer
from .._core._ledger import borrow_policy, set_borrow_policy
from .._core._select import (
    DeviceOpWarning,
    Stream,
    backend_name,
    current,
    device,
    devices,
    next_stream,
    use_backend,
)
from .._core._tensor import Partition, Tensor

__all__ = [
    "Buffer",
    "DeviceOpWarning",
    "Partition",
    "Stream",
    "Tensor",
    "backend_name",
    "borrow_policy",
    "current",
    "device",
    "devices",
    "next_stream",
    "set_borrow_policy",
    "set_host_chaos",
    "use_backend",
]
