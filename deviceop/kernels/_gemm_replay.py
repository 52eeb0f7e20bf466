"""Repeated GEMMs replayed as one-call graphs.

A ``cublasLtMatmul`` call costs several microseconds of host time even with a ready plan (its
argument checks and launch set-up run on every call); launching an executable graph that holds
the same call costs about a kernel launch. Services and queues run the same few problems over
and over, so once calls of one plan, alpha and beta on one stream have been seen ``HOT`` times,
the call is recorded as a template (:class:`GemmTemplate`) and replayed from then on for every
call of that key, whatever its buffers: before a launch on other pointers than the last, the
words of the recorded kernels' arguments that hold the pointers are rewritten
(``cuGraphExecKernelNodeSetParams``: the launches already enqueued keep theirs). Those words are
found by recording the call three times, on its own pointers and moved by two sets of offsets
(``_SHIFTS``; captured, never run): a word that moves by exactly a pointer's offset in the
second recording holds that pointer plus a constant, and the third recording must then be
predicted byte for byte (:func:`template_spec`). cuBLASLt's kernels on the H200 (nvjet's and
xmma's) hold their pointers plainly in their argument block. A kernel given its parameters one
by one (xmma's, for float32) is read only where the driver counts its parameters
(``cuFuncGetParamCount``; asking past the last one is an error compute-sanitizer reports); where
a recording differs in any other way (another kernel, a node other than a kernel, an empty node
or a memset the same in all three, a word that moves otherwise), the template fails, is
remembered as failed, and the key's calls are recorded exactly instead.

The exact graph is a pure function of its key: plan (shapes, layouts, algorithm), the three
device pointers, alpha and beta, and the stream whose workspace it uses; replaying it on that
stream is the same call. Memory freed and reused at the same address is the same computation on
the new tensor. Templates and exact graphs share one table. At most ``MAX`` graphs are kept
(``Replays.limit``); the oldest is dropped first, unless it was replayed since eviction last
passed it (then it is kept once more, as a clock cache does), so the graphs in use stay while
those of addresses that did not come back go (the driver frees a graph that is still running
once it ends); drops are counted in ``Replays.evicted``.

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
addresses that recur only now and then) must not pay it again and again, so recordings draw on a
credit that replays earn back: each replay earns 1 (up to 8 recordings' worth: credit that one
pattern of calls earned, spent on recording another whose addresses do not settle, would cost
more than its replays save), each recording spends its cost in replays (``Replays.cost``: the
host time of a recording over what a replay saves against a direct call, both measured as calls
run; ``COST`` until they are, at most ``COST_MAX``), and while the credit is short no call is
recorded (a hot call that goes direct then earns ``1 / cost``, so recording resumes slowly if
the pattern changes; one seen ``2 * HOT`` times or more earns 1, as a replay does, its recording
having been due that often: a wide pattern of exact calls that repeats, such as the some 880
calls a round of 64 requests in flight on buffers of their own make where templates fail, is
then recorded in about 30 rounds instead of 80). Where a replay saves next to nothing a
recording costs ``COST_MAX``: recordings become rare, but a pattern that starts to repeat is
still caught.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._core._gemm import COST, COST_MAX, HOT, KPARAMS_BYTES, MAX, GemmTemplate
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


def _record(backend: Any, stream: Any, call: Any) -> Any:
    """Record ``call`` on a private stream into an executable graph uploaded to ``stream`` (a
    :class:`GemmTemplate` where ``call.template`` asks for one); None on failure."""
    try:
        graphs = backend.graphs
        if getattr(call, "template", False):
            return _record_template(graphs, stream, call)
        raw = _capture(graphs, call)
        return None if raw is None else graphs.instantiate(raw, stream)
    except Exception:
        return None  # the direct call still works; recording is only an optimization


def _capture(graphs: Any, call: Callable[[int], int]) -> Any:
    """``call`` captured on a private stream: the raw graph, or None (it failed, or recorded nothing)."""
    cs = graphs.acquire_stream()
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
        return raw
    finally:
        graphs.release_stream(cs)


#: how far the second and third recordings of a template move each pointer (the key's pa, pb and
#: pc): multiples of 256 bytes (cuBLASLt's choices depend on alignment up to that), with bits both
#: above and below 2**32 (so a field holding only a pointer's low or high half moves too, and is
#: refused, not left stale), and no one of them a sum or difference of two others, so a word that
#: moves by one of them holds that pointer (plus a constant), and the third recording checks what
#: the second found (tests/test_gemm.py checks these properties)
_SHIFTS = (
    ((1 << 40) + (0x1357 << 8), (3 << 40) + (0x2AC1 << 8), (9 << 40) + (0x0F93 << 8)),
    ((5 << 40) + (0x3E25 << 8), (17 << 40) + (0x0B7D << 8), (7 << 40) + (0x19E9 << 8)),
)
_M64 = (1 << 64) - 1
_KERNEL, _MEMSET, _EMPTY = 0, 2, 5  # CUgraphNodeType


def _record_template(graphs: Any, stream: Any, call: Any) -> Any:
    """A :class:`GemmTemplate` of ``call`` (one cuBLASLt call): recorded on its own pointers and
    twice on moved ones (captured, never run), the argument words that move with a pointer
    found by comparing them; None where the recordings differ otherwise (another launch shape, a
    node other than a kernel, an empty one or a memset the same in all three, a word that moves
    by anything else)."""
    nodes_of = getattr(graphs, "kernel_nodes", None)
    if nodes_of is None or getattr(graphs, "kernel_node_params_bytes", None) != KPARAMS_BYTES:
        return None  # (a backend without the queries, or whose node parameters the core does not lay out)
    base = call.pointers
    caps = []
    for shift in ((0, 0, 0), *_SHIFTS):
        raw = _capture(graphs, call.shifted(*shift) if any(shift) else call)
        nodes = None if raw is None else nodes_of(raw)
        if not nodes:
            return None
        caps.append((raw, nodes))
    spec = template_spec(base, [n for _, n in caps])
    if spec is None:
        return None
    ex = graphs.instantiate(caps[0][0], stream)
    return GemmTemplate(ex, caps[0][0], spec, base)


def template_spec(base: tuple[int, int, int], recordings: list[list[Any]]) -> list[tuple[Any, ...]] | None:
    """What a :class:`GemmTemplate` patches, from three recordings of one call: on ``base``'s
    pointers, then moved by each of ``_SHIFTS``. Per kernel node of the first, ``(node,
    function, kernel, grid, block, shared memory, by_buffer, arguments, layout, patches)``, with
    ``patches`` the ``(offset, which, rel)`` of each 8-byte word holding pointer ``which`` plus
    ``rel`` (a node whose words hold none is left out: it needs no update); None where the
    recordings cannot be explained that way, or none of them hold a pointer."""
    first, second, third = recordings
    if not len(first) == len(second) == len(third):
        return None
    out = []
    for n0, n1, n2 in zip(first, second, third):
        t, node, p0 = n0
        if n1[0] != t or n2[0] != t:
            return None
        if t == _EMPTY:
            continue
        if t == _MEMSET:  # (cuBLASLt clears its workspace's counters: the same memory in all three)
            if not p0 == n1[2] == n2[2]:
                return None
            continue
        if t != _KERNEL:
            return None
        p1, p2 = n1[2], n2[2]
        if p0[:6] != p1[:6] or p0[:6] != p2[:6] or p0[7] != p1[7] or p0[7] != p2[7]:
            return None  # another kernel, launch shape or parameter layout
        d0, d1, d2 = p0[6], p1[6], p2[6]
        if d0 is None or d1 is None or d2 is None or not len(d0) == len(d1) == len(d2):
            return None
        patches = []
        for w in sorted({i & ~7 for i in range(len(d0)) if d0[i] != d1[i]}):
            if w + 8 > len(d0):
                return None
            v0 = int.from_bytes(d0[w : w + 8], "little")
            moved = (int.from_bytes(d1[w : w + 8], "little") - v0) & _M64
            if moved not in _SHIFTS[0]:
                return None
            which = _SHIFTS[0].index(moved)
            patches.append((w, which, (v0 - base[which]) & _M64))
        # the third recording, predicted from the first and the words found
        want = bytearray(d0)
        for w, which, rel in patches:
            want[w : w + 8] = ((base[which] + _SHIFTS[1][which] + rel) & _M64).to_bytes(8, "little")
        if bytes(want) != bytes(d2):
            return None
        if patches:
            func, kern, grid, block, shmem, by_buffer, data, layout = p0
            out.append((node, func, kern, grid, block, shmem, by_buffer, data, layout, patches))
    return out if out else None
