"""Ops: the DeviceOp base class and the leaf ops (value, allocation, transfers)."""

from ._base import DeviceOp, is_op
from ._leaf import empty, full, ones, value, zeros
from ._transfer import from_numpy, to_device, to_numpy

__all__ = ["DeviceOp", "empty", "from_numpy", "full", "is_op", "ones", "to_device", "to_numpy", "value", "zeros"]
