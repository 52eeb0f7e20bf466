"""Repeated GEMMs replayed as one-call graphs.

A ``cublasLtMatmul`` call costs several microseconds of host time even with a ready plan (its
argument checks and launch set-up run on every call); launching an executable graph that holds
the same call costs about a kernel launch. A GEMM queue runs the same few problems over and
over (same plan, pointers, scalars and stream), so once one exact call has been seen ``HOT``
times it is recorded into a graph on a private stream and replayed from then on.

The graph is a pure function of its key: plan (shapes, layouts, algorithm), the three device
pointers, alpha and beta, and the stream whose workspace it uses; replaying it on that stream is
the same call. Memory freed and reused at the same address is the same computation on the new
tensor. At most ``MAX`` graphs are kept; the oldest is dropped first (the driver frees a graph
that is still running once it ends).

Recording costs about as much as ``COST`` replays save. Calls that do not repeat (fresh
buffers per request, addresses that recur only now and then) must not pay it again and again,
so recordings draw on a credit that replays earn back: each recording spends ``COST``, each
replay earns 1, and while the credit is short no call is recorded (a hot call that goes
direct then earns ``1 / COST``, so recording resumes slowly if the pattern changes).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["COST", "HOT", "MAX", "Replays"]

#: calls of one exact problem before it is recorded (a problem seen once or twice is not worth it)
HOT = 3
MAX = 1024
#: replays a recording must be worth (a record + instantiate costs about this many replays' saving)
COST = 16.0


class Replays:
    """Graph executables by GEMM call key, recorded once a key is hot and the credit allows."""

    def __init__(self) -> None:
        self._seen: dict[Any, int] = {}
        self._execs: dict[Any, Any] = {}  # key -> _Exec, or None if recording it failed
        self._lock = threading.Lock()
        self.recorded = 0
        self.replays = 0
        self.credit = 4 * COST  # a few recordings up front: a queue's first problems pay back at once

    def __len__(self) -> int:
        return len(self._execs)

    def get(self, key: Any, backend: Any, stream: Any, call: Callable[[int], int]) -> int:
        """The graph handle (an int) to launch for ``key``, or 0 to make the call directly.

        ``call(stream_handle)`` enqueues the GEMM on a stream and returns its cuBLAS status;
        it is used once, to record. Call with the ledger lock held (one recording at a time).
        """
        ex = self._execs.get(key, 0)
        if ex:
            self.replays += 1
            if self.credit < 8 * COST:
                self.credit += 1.0
            return ex.handle_int  # type: ignore[no-any-return]
        if ex is None:
            return 0  # recording this one failed before: stay direct
        n = self._seen.get(key, 0) + 1
        if n < HOT or self.credit < COST:
            if n >= HOT:
                self.credit += 1.0 / COST  # hot, but recordings have not paid lately
            if len(self._seen) >= 4 * MAX:
                self._seen.clear()
            self._seen[key] = n
            return 0
        self._seen.pop(key, None)
        self.credit -= COST
        ex = _record(backend, stream, call)
        with self._lock:
            if len(self._execs) >= MAX:
                self._execs.pop(next(iter(self._execs)))
            self._execs[key] = ex
        if ex is None:
            return 0
        self.recorded += 1
        return ex.handle_int  # type: ignore[no-any-return]

    def clear(self) -> None:
        with self._lock:
            self._execs.clear()
            self._seen.clear()
            self.credit = 4 * COST


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
