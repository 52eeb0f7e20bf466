"""Repeated GEMMs replayed as one-call graphs.

A ``cublasLtMatmul`` call costs several microseconds of host time even with a ready plan (its
argument checks and launch set-up run on every call); launching an executable graph that holds
the same call costs about a kernel launch. A GEMM queue runs the same few problems over and
over (same plan, pointers, scalars and stream), so once one exact call has been seen ``HOT``
times it is recorded into a graph on a private stream and replayed from then on.

The graph is a pure function of its key: plan (shapes, layouts, algorithm), the three device
pointers, alpha and beta, and the stream whose workspace it uses; replaying it on that stream is
the same call. Memory freed and reused at the same address is the same computation on the new
tensor. At most ``MAX`` graphs are kept (``Replays.limit``); the oldest is dropped first,
unless it was replayed since eviction last passed it (then it is kept once more, as a clock
cache does), so the graphs in use stay while those of addresses that did not come back go (the
driver frees a graph that is still running once it ends); drops are counted in
``Replays.evicted``.

A batch of GEMMs run as one execution (a work queue's batch: an ``Each`` of them) is looked up
in a second table (``GEMM.batch_replays``, at most ``BATCHES`` graphs) by every call's key in
order: once the same batch has come ``HOT`` times it is recorded as one graph of its calls and
replayed with one launch, where one per call would cost the host a launch each. Until then, and
for batches that do not repeat (a queue whose batches form by timing), its calls run one by one,
each looked up in the first table as a call on its own is. The second table's recordings draw
on the first table's credit and are priced as the calls' are (its ``bank``): priced by what a
batch's own replays save, a queue's batches would be recorded only as fast as the batches
already recorded earn it, while the calls' replays, which save a direct cuBLASLt call each,
fund them at once.

Recording costs what many replays save. Calls that do not repeat (fresh buffers per request,
addresses that recur only now and then) must not pay it again and again, so recordings draw on
a credit that replays earn back: each replay earns 1 (up to 8 recordings' worth: credit that
one pattern of calls earned, spent on recording another whose addresses do not settle, would
cost more than its replays save), each recording spends its cost in replays
(``Replays.cost``: the host time of a recording over what a replay saves against a direct
call, both measured as calls run; ``COST`` until they are, at most ``COST_MAX``), and while the
credit is short no call is recorded (a hot call that goes direct then earns ``1 / cost``, so
recording resumes slowly if the pattern changes; one seen ``2 * HOT`` times or more earns 1, as
a replay does, its recording having been due that often: a wide pattern that repeats, such as
the some 880 calls a round of 64 requests in flight on buffers of their own make, is then
recorded in about 30 rounds instead of 80). Where a replay saves next to nothing a
recording costs ``COST_MAX``: recordings become rare, but a pattern that starts to repeat is
still caught.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._core._gemm import COST, COST_MAX, HOT, MAX
from .._core._gemm import Replays as _Table

__all__ = ["BATCHES", "COST", "COST_MAX", "HOT", "MAX", "Replays"]

#: batches' graphs kept (``GEMM.batch_replays.limit``): a queue's streams times the few ways its
#: items fall into batches
BATCHES = 1024


class Replays(_Table):
    """Graph executables by GEMM call key, recorded (by :func:`_record`) once a key is hot and
    the credit allows; the table and its lookups are compiled (``deviceop._core._gemm``).
    ``bank``: the table whose credit and price this one's recordings use (itself if None)."""

    def __init__(self, bank: _Table | None = None) -> None:
        super().__init__(_record, bank)


def _record(backend: Any, stream: Any, call: Callable[[int], int]) -> Any:
    """Record ``call`` on a private stream into an executable graph uploaded to ``stream``; None on failure."""
    try:
        graphs = backend.graphs
        cs = graphs.acquire_stream()
    except Exception:
        return None
    try:
        graphs.begin(cs)
        status = -1
        try:
            status = call(cs.handle_int)
        finally:
            try:
                raw = graphs.end(cs)
            except Exception:
                raw = None
        if status != 0 or raw is None or graphs.nodes(raw) == 0:
            return None
        return graphs.instantiate(raw, stream)
    except Exception:
        return None  # the direct call still works; recording is only an optimization
    finally:
        graphs.release_stream(cs)
