"""Type stub of the compiled module ``deviceop._core._launch``: launch plans, the built-ins' call and graph replays.

Names not declared here are internal to the core and typed ``Any``.
"""

from typing import Any, Generic, TypeVar

from typing_extensions import Unpack

from ..device._tensor import Partition
from ._op import DeviceOp

T = TypeVar("T")

class BuiltinFront:
    """The call of a built-in kernel family ``k(out_partition, *tensors, *float_scalars)``."""

    plans: Any
    n_args: int
    n_tensors: int
    check_scalars: bool
    def __call__(self, *args: Any) -> DeviceOp[tuple[Partition, Unpack[tuple[Any, ...]]]]:
        """An op running the kernel; its output is its arguments (ops among them replaced by their
        outputs): the output Partition, then the input tensors and scalars."""

class GraphBase:
    """A recorded graph's replay state."""

    backend: Any
    launches: int
    def _set_replay(self, ex: Any, regions: Any, output: Any) -> None: ...
    def launch(self) -> DeviceOp[Any]:
        """An op replaying the graph."""

class GraphLaunch(DeviceOp[T], Generic[T]):
    """One replay of a recorded graph: an op whose output is the recorded op's output."""

class Planned(DeviceOp[Any]):
    """A planned kernel launch: an op whose output is its arguments."""

def planned(kernel: Any, args: tuple[Any, ...], plan: Any, nt: int, opts: Any = None) -> Planned: ...
def __getattr__(name: str) -> Any: ...
