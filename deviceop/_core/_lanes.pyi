"""Type stub of the compiled module ``deviceop._core._lanes``: a work queue's lanes."""

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

DEPTH: int
#: what ``Lanes.feed`` returns once its iterator is exhausted
END: object

def resolve(item: Any, lane: int) -> Any:
    """An item is an op, or a callable ``f(lane) -> op``."""

def new_result(results: list[Any], cls: Callable[[int], Any]) -> Any:
    """An item's result, ``cls(index)``, appended to ``results``."""

def take_batch(first: Any, more: Callable[[], Any], limit: int) -> list[Any]:
    """``first`` plus up to ``limit - 1`` more from ``more()``."""

def start_batch(
    batch: list[Any], lane: int, t0: float, who: str, stream: Any, selected: bool = ...
) -> tuple[list[Any], Any]:
    """Mark a batch's items started on ``lane``; return (their (result, op) pairs, the op to run)."""

def settle(ops: list[Any], out: Any) -> None:
    """Give each item its output (or its own error) from what the batch's op returned."""

class Run:
    """One execution of a lane."""

    lane: int
    stream: Any
    batch: list[Any]
    ops: list[Any]
    t0: float

class Lanes:
    """The one-thread queue's executions, per lane, and what finishing them updates."""

    held: list[int]
    slicing: int
    pending: int
    stopped: bool
    lat: float
    def __init__(
        self,
        streams: list[Any],
        items: deque[Any],
        results: list[Any],
        result_cls: Callable[[int], Any],
        busy: list[float],
        space: list[Any],
        refill: int,
        batch: int,
        counts: dict[str, int],
        after: Callable[[int, list[Any]], None] | None,
        cancelled: type[BaseException],
    ) -> None: ...
    def add(self, item: Any) -> None:
        """Queue ``item``: its result joins ``results``; it is pending from now."""
    def feed(self, item: Any, it: Iterator[Any], capacity: int) -> Any:
        """Queue ``item``, then items of ``it``, while fewer than ``capacity`` are pending, each is
        an op or a callable and the queue is not ``stopped``; the first not queued, or ``END``."""
    def bind(self, ch: Any, tok: Any, selected: bool) -> None:
        """The driver's reactor channel and token, and whether every lane's device is selected."""
    def release(self, lane: int) -> None:
        """An execution's on_done hooks returned: its place on ``lane`` is free."""
    @property
    def in_flight(self) -> bool:
        """True while any lane has an execution in flight."""
    def any_held(self) -> bool:
        """True while any execution's on_done hooks run."""
    def collect(self, seen: bool) -> bool:
        """Finish every execution whose completion is flagged; True if any did."""
    def issue(self, slice_s: float) -> bool:
        """Enqueue new work, each lane up to two executions; True if anything moved."""
    def ready(self) -> bool:
        """True if a pass would move something (a completion flagged, a chain under way, an item with room)."""
    def watch_all(self) -> bool:
        """Have the reactor wake the loop at each execution's completion; True at the first complete."""
    def check_all(self) -> bool:
        """The parked re-check: an execution whose context failed is finished with its error; True if any was."""
    def abandon_all(self) -> None:
        """The queue is cancelled: the streams' watchers finish the work in flight."""
