"""``cuda.bindings.driver`` (compiled, no type information): every name is ``Any``."""

from typing import Any

def __getattr__(name: str) -> Any: ...
