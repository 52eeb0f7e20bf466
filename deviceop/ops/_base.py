"""DeviceOp: lazy, typed GPU work. Building an op does nothing; a terminal drives it.

The class, its run protocol and the synchronous terminals are compiled (``deviceop._core._op``);
this module is their public face.
"""

from .._core._op import DeviceOp, is_op

__all__ = ["DeviceOp", "is_op"]
