"""Type stub of the compiled module ``deviceop._core._gemm``: GEMM's plan fields, its call as an
op, the cuBLASLt call and replays of repeated calls.

Names not declared here are internal to the core and typed ``Any``.
"""

from collections.abc import Callable
from typing import Any

from ._launch import PlanCache
from ._op import DeviceOp

HOT: int
MAX: int
COST: float
COST_MAX: float
KPARAMS_BYTES: int

class GemmPlan:
    """A GEMM problem's layout (no addresses): what its compiled call reads."""

    be: Any
    m: int
    n: int
    k: int
    swap: bool
    lt_call: tuple[int, ...] | None

class Replays:
    """Graph executables by GEMM call key, recorded once a key is hot and the credit allows."""

    recorded: int
    replays: int
    evicted: int
    limit: int  # at least 1 (UsageError otherwise)
    credit: float
    direct_s: float
    replay_s: float
    record_s: float

    def __init__(
        self, record: Callable[[Any, Any, Callable[[int], int]], Any], bank: Replays | None = None
    ) -> None: ...
    def __len__(self) -> int: ...
    @property
    def bank(self) -> Replays:
        """The table whose credit and price this one's recordings use (itself by default)."""
    @property
    def cost(self) -> float:
        """What one recording costs, in replays (``COST`` until measured, at most ``COST_MAX``)."""
    def observe(self, replayed: bool, seconds: float) -> None:
        """Count the host time of one call: a replay or a direct call."""
    def get(self, key: Any, backend: Any, stream: Any, call: Callable[[int], int]) -> int: ...
    def executables(self) -> list[Any]: ...
    def clear(self) -> None: ...

class GemmTemplate:
    """One cuBLASLt call recorded once and replayed on any buffers (its kernels' pointer
    arguments rewritten before a launch for other pointers than the last)."""

    ex: Any
    handle_int: int

    def __init__(self, ex: Any, raw: Any, nodes: list[tuple[Any, ...]], pointers: tuple[int, int, int]) -> None: ...
    @property
    def pointers(self) -> tuple[int, int, int]:
        """The pointers the executable holds now (0s: unknown)."""

class GemmLauncher:
    """The compiled half of the GEMM kernel."""

    plans: PlanCache
    blas: dict[int, tuple[int, int]]
    replays: Replays
    batch_replays: Replays | None
    mode: int
    ws_bytes: int
    status_error: Any

    def fast(self, c: Any, a: Any, b: Any, alpha: Any, beta: Any, tf32: Any) -> GemmCall | None: ...
    def run_lt(self, cx: Any, p: GemmPlan, c: Any, a: Any, b: Any, alpha: float, beta: float, ws: int) -> int: ...

class GemmCall(DeviceOp[Any]):
    """A planned GEMM; its output is its arguments ``(c, a, b)``."""

    kernel: GemmLauncher
    args: tuple[Any, ...]
    opts: tuple[float, float, bool]
    plan: GemmPlan

def gemm_call(kernel: GemmLauncher, args: tuple[Any, ...], opts: tuple[Any, ...], plan: GemmPlan) -> GemmCall: ...
def __getattr__(name: str) -> Any: ...
