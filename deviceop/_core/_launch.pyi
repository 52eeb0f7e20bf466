"""Type stub of the compiled module ``deviceop._core._launch``: launch plans and kernel calls.

Names not declared here are internal to the core and typed ``Any``.
"""

from typing import Any, TypeVar

from typing_extensions import Unpack

from ._op import DeviceOp
from ._tensor import Partition

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

P_KINDS: dict[str, int]

class UserPlan:
    """A user kernel's launch for one argument layout."""

    be: Any
    cuda: LaunchPlan | None
    empty: bool
    tensor_idx: tuple[int, ...]
    scalar_idx: tuple[int, ...]
    writes: tuple[bool, ...]
    def __init__(
        self,
        be: Any,
        cuda: LaunchPlan | None,
        empty: bool,
        tensor_idx: tuple[int, ...],
        scalar_idx: tuple[int, ...],
        writes: tuple[bool, ...],
        scalar_kinds: tuple[int, ...],
    ) -> None: ...

class UserFront:
    """The compiled call of a user Kernel for argument layouts that have a plan."""

    def __init__(self, kernel: Any, plans: PlanCache, kinds: tuple[int, ...], block: tuple[int, int, int]) -> None: ...
    def call(self, args: tuple[Any, ...], grid: Any, block: Any, shared_mem: Any) -> DeviceOp[Any] | None:
        """The op of the call, or None where the kernel's Python call must check and plan it."""

class LaunchPlan:
    """A kernel's launch for one argument layout: function, geometry and parameter layout."""

    def __init__(
        self, driver: Any, fn: Any, grid: Any, block: Any, shmem: int, layout: Any, writes: Any, what: Any
    ) -> None: ...

class PlanCache:
    """Launch plans by argument layout (bounded)."""

    def __init__(self, max_size: int = 256) -> None: ...
    def get(self, key: Any) -> Any: ...
    def put(self, key: Any, plan: T) -> T: ...
    def __len__(self) -> int: ...
    def clear(self) -> None: ...

def launch(cx: Any, p: LaunchPlan, tensors: tuple[Any, ...], scalars: tuple[Any, ...]) -> int: ...

class Planned(DeviceOp[Any]):
    """A planned kernel launch: an op whose output is its arguments."""

def planned(kernel: Any, args: tuple[Any, ...], plan: Any, nt: int, opts: Any = None) -> Planned: ...
def __getattr__(name: str) -> Any: ...
