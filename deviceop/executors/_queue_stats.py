"""What a work queue reports: one ItemResult per item, and QueueStats for the whole run."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._core._lanes import new_result
from .._core._op import as_stream
from .._core._select import device_backend
from .._core._select import devices as all_devices
from .._errors import DeviceOpError, UsageError
from .._process import renew_at_fork

__all__ = ["ItemResult", "QueueCancelled", "QueueStats", "Recorder"]


class QueueCancelled(DeviceOpError):
    """The work queue was cancelled before this item completed."""


@dataclass(slots=True)
class ItemResult:
    """The outcome of one queue item, in the order items were put.

    ``value`` is the op's output, or ``error`` the exception it raised (``QueueCancelled`` for an
    item the queue's cancellation reached first). ``lane`` is the index of the stream it ran on;
    ``queued_s`` the time from ``put`` to its start, ``latency_s`` from its start to completion.
    """

    index: int
    value: Any = None
    error: BaseException | None = None
    lane: int = -1
    queued_s: float = 0.0
    latency_s: float = 0.0

    @property
    def ok(self) -> bool:
        """True if the item completed without an error."""
        return self.error is None

    def unwrap(self) -> Any:
        """The value, or raise the item's error."""
        if self.error is not None:
            raise self.error
        return self.value


@dataclass(frozen=True)
class QueueStats:
    """Throughput, latency percentiles (seconds, start to completion) and per-stream busy time."""

    items: int
    errors: int
    cancelled: int
    seconds: float
    throughput: float  # completed items per second
    latency_p50: float
    latency_p90: float
    latency_p99: float
    busy_s: tuple[float, ...]  # per lane: time with an item in flight
    cpu_s: float  # process CPU time (all threads) during the run
    host_threads: int  # threads the queue drove the streams from
    lane_devices: tuple[str, ...] = ()  # per lane: its stream's device
    lane_items: tuple[int, ...] = ()  # per lane: items it ran

    def per_device(self) -> dict[str, dict[str, float]]:
        """Per device: its lanes, the items they ran, their busy time (summed) and busy
        fraction (busy time over lanes times the run's wall time)."""
        out: dict[str, dict[str, float]] = {}
        for dev, busy, n in zip(self.lane_devices, self.busy_s, self.lane_items):
            d = out.setdefault(dev, {"lanes": 0, "items": 0, "busy_s": 0.0})
            d["lanes"] += 1
            d["items"] += n
            d["busy_s"] += busy
        for d in out.values():
            d["busy_fraction"] = d["busy_s"] / (d["lanes"] * self.seconds) if self.seconds else 0.0
        return out

    @property
    def busy_fraction(self) -> tuple[float, ...]:
        """Per lane: busy time over the run's wall time."""
        return tuple(b / self.seconds if self.seconds else 0.0 for b in self.busy_s)


class Recorder:
    """Collects results while a queue runs (one thread or the loop's thread writes each slot)."""

    def __init__(self, streams: list[Any], host_threads: int) -> None:
        self.results: list[ItemResult] = []
        self.busy = [0.0] * len(streams)
        self.devices = tuple(s.backend.device_label for s in streams)
        self.host_threads = host_threads
        self.t0 = self.t1 = 0.0
        self.cpu0 = self.cpu1 = 0.0

    def begin(self) -> None:
        self.t0 = time.perf_counter()
        self.cpu0 = time.process_time()

    def end(self) -> None:
        self.t1 = time.perf_counter()
        self.cpu1 = time.process_time()

    def add(self) -> ItemResult:
        """A new item's result (its put time in ``queued_s`` until it starts)."""
        return new_result(self.results, ItemResult)  # type: ignore[no-any-return]

    def cancel_unfinished(self) -> None:
        for r in self.results:
            if r.lane < 0 and r.error is None and r.value is None:
                r.error = QueueCancelled(f"item {r.index} was not run: the work queue was cancelled")

    def stats(self) -> QueueStats:
        done = [r for r in self.results if r.lane >= 0]
        lat = np.array([r.latency_s for r in done if r.error is None]) if done else np.zeros(0)

        def pct(q: float) -> float:
            return float(np.percentile(lat, q)) if lat.size else 0.0

        secs = max(self.t1 - self.t0, 0.0)
        ok = sum(1 for r in done if r.error is None)
        return QueueStats(
            items=len(self.results),
            errors=sum(1 for r in done if r.error is not None),
            cancelled=sum(1 for r in self.results if isinstance(r.error, QueueCancelled)),
            seconds=secs,
            throughput=ok / secs if secs else 0.0,
            latency_p50=pct(50),
            latency_p90=pct(90),
            latency_p99=pct(99),
            busy_s=tuple(self.busy),
            cpu_s=self.cpu1 - self.cpu0,
            host_threads=self.host_threads,
            lane_devices=self.devices,
            lane_items=tuple(sum(1 for r in done if r.lane == i) for i in range(len(self.busy))),
        )


def lanes_of(streams: int | Sequence[Any] | None, devices: Any = None) -> list[Any]:
    """The streams a queue drives: a count (the first n of the pool, made larger if needed) or a
    list; with ``devices`` (``"all"`` or a list of ordinals or labels), that count (default: the
    pool) on each device, interleaved (lane 0 on the first device, lane 1 on the second...)."""
    from .._core._select import current

    if devices is not None:
        if isinstance(devices, str) and devices == "all":
            specs: list[Any] = list(all_devices())
        elif isinstance(devices, (list, tuple)) and devices:
            specs = list(devices)
        else:
            raise UsageError(f"devices must be 'all' or a non-empty list of devices, got {devices!r}")
        bes = [device_backend(d) for d in specs]
        if len(set(map(id, bes))) != len(bes):
            raise UsageError(f"devices lists a device twice: {specs!r}")
        if streams is not None and (
            isinstance(streams, bool) or not isinstance(streams, int) or not 1 <= streams <= MAX_STREAMS
        ):
            raise UsageError(
                f"with devices=, streams is a number of streams per device (1 to {MAX_STREAMS}), got {streams!r}"
            )
        per = [list(be.streams) if streams is None else _first(be, streams) for be in bes]
        return [lane[i] for i in range(max(map(len, per))) for lane in per if i < len(lane)]
    if streams is None:
        return list(current().streams)
    if isinstance(streams, int) and not isinstance(streams, bool):
        if not 1 <= streams <= MAX_STREAMS:
            raise UsageError(
                f"a work queue needs at least one stream and takes at most {MAX_STREAMS} (per device), "
                f"got streams={streams}; a few per device keep a GPU busy"
            )
        return _first(current(), streams)
    if isinstance(streams, (bool, str, bytes)) or not isinstance(streams, Iterable):
        raise UsageError(f"streams must be a number of streams or a list of streams, got {streams!r}")
    out = [as_stream(s) for s in streams]
    if not out:
        raise UsageError("a work queue needs at least one stream; the list is empty")
    return out


def _first(be: Any, n: int) -> list[Any]:
    return [be.streams[i] if i < len(be.streams) else _extra(be, i) for i in range(n)]


_EXTRA: weakref.WeakKeyDictionary[Any, dict[int, Any]] = weakref.WeakKeyDictionary()
_extra_lock = threading.Lock()
renew_at_fork(globals(), _extra_lock=threading.Lock)  # a thread may hold it at fork()


def _extra(be: Any, i: int) -> Any:
    """Stream ``i`` beyond the pool, created once per backend and kept (streams are never freed)."""
    with _extra_lock:
        d = _EXTRA.setdefault(be, {})
        if i not in d:
            d[i] = be.new_stream(i)
        return d[i]


def check_capacity(capacity: Any, lanes: int, batch: int = 1) -> int:
    """The bound on queued plus in-flight items: given, or by default room for every lane to run
    a full batch while the next one waits (at least 4 items per lane)."""
    if capacity is None:
        return max(4, 2 * batch) * lanes
    if isinstance(capacity, bool) or not isinstance(capacity, int) or not 1 <= capacity <= MAX_ITEMS:
        raise UsageError(
            f"capacity (the bound on queued plus in-flight items) must be an int from 1 to {MAX_ITEMS}, got {capacity!r}"
        )
    return capacity


#: the most streams a queue drives per device, and the largest batch and capacity it takes (a
#: stream beyond the pool is made once and kept; a thread queue starts a thread per stream)
MAX_STREAMS = 256
MAX_ITEMS = 1 << 24


def check_batch(batch: Any) -> int:
    """``batch`` checked: an int from 1 to ``MAX_ITEMS``."""
    if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= MAX_ITEMS:
        raise UsageError(
            f"batch (items a stream's worker takes at once) must be an int from 1 to {MAX_ITEMS}, got {batch!r}"
        )
    return batch
