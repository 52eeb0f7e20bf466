"""Combinators: then, map, inspect, first/last (methods of DeviceOp), zip and shared."""

from .._core._op import HOOKS
from ._chain import Chain, chain  # noqa: F401 - chain: the hook the core loads
from ._shared import Shared
from ._zip import Zip, zip_ops

HOOKS["shared"] = Shared

zip = zip_ops

__all__ = ["Chain", "Shared", "Zip", "zip"]
