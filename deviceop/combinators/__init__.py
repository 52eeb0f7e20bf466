"""Combinators: then, map, inspect, first/last (methods of DeviceOp), zip and shared."""

from .._core._op import Shared
from ._chain import Chain, chain  # noqa: F401 - chain: a combinator's function form
from ._zip import Zip, zip_ops

zip = zip_ops

__all__ = ["Chain", "Shared", "Zip", "zip"]
