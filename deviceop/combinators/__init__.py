"""Combinators: then, map, inspect, first/last (methods of DeviceOp), zip and shared."""

from ..ops import _base
from ._chain import Chain, chain
from ._shared import Shared
from ._zip import Zip, zip_ops

_base._combinators["chain"] = chain
_base._combinators["shared"] = Shared

zip = zip_ops  # noqa: A001 - the public name is do.zip

__all__ = ["Chain", "Shared", "Zip", "zip"]
