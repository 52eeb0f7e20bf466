"""Interop with other array and GPU libraries.

DLPack both ways (:func:`from_dlpack`, ``Tensor.__dlpack__``), another library's GPU work as an
op (:func:`external`, and :func:`torch` for PyTorch code, :func:`torch_graphs` for it recorded per
size bucket), and other libraries' streams
(:class:`~deviceop.Stream`, ``from_handle``; terminals take any ``__cuda_stream__``).
"""

from ._dlpack import from_dlpack
from ._external import External, external
from ._torch import torch, torch_graphs

__all__ = ["External", "external", "from_dlpack", "torch", "torch_graphs"]
