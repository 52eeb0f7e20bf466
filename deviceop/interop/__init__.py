"""Interop with other array and GPU libraries: DLPack both ways."""

from ._dlpack import from_dlpack

__all__ = ["from_dlpack"]
