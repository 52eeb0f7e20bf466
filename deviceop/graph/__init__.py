"""Scoped CUDA graphs: record ops, replay the graph as an op, update it, cache one per size bucket.

with do.graph.scope() as s:
    s.record(op)                 # recorded, not run; allocating ops raise CaptureError
g = s.graph                      # CudaGraph
g.launch().sync()                # a replay is a DeviceOp: sync, await, submit, then
g.update(other_op)               # "updated" in place, or "reinstantiated"
"""

from ._cache import GraphCache, power_of_two_buckets
from ._graph import CudaGraph, GraphLaunch, GraphScope, capture, scope

__all__ = ["CudaGraph", "GraphCache", "GraphLaunch", "GraphScope", "capture", "power_of_two_buckets", "scope"]
