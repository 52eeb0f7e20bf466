"""Scoped recording (``with do.graph.scope() as s: s.record(op)``, ``op.graph()``) and CudaGraph.

Compiled with the op itself (``deviceop._core._op``: ``op.graph()`` records through the scope, and
a graph's replay is an op); this module is their face in ``deviceop.graph``.
"""

from .._core._op import CudaGraph, GraphLaunch, GraphScope, Recording, capture, scope

__all__ = ["CudaGraph", "GraphLaunch", "GraphScope", "Recording", "capture", "scope"]
