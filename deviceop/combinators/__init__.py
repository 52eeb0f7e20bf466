"""Combinators: then, map, inspect, first/last (methods of DeviceOp), zip and shared."""

from .._core._op import HOOKS
from ._chain import Chain, chain
from ._shared import Shared
from ._zip import Zip, zip_ops

HOOKS["shared"] = Shared

zip = zip_ops  # noqa: A001 - the public name is do.zip

__all__ = ["Chain", "Shared", "Zip", "zip"]
