"""Type stub of the compiled module ``deviceop._core._replay``: graph replays as ops."""

from typing import Any, Generic, TypeVar

from ._op import DeviceOp

T = TypeVar("T")

class GraphBase:
    """A recorded graph's replay state."""

    backend: Any
    launches: int
    def _set_replay(self, ex: Any, regions: Any, output: Any) -> None: ...
    def launch(self) -> DeviceOp[Any]:
        """An op replaying the graph."""

class GraphLaunch(DeviceOp[T], Generic[T]):
    """One replay of a recorded graph: an op whose output is the recorded op's output."""
