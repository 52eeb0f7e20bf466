"""Type stub of the compiled module ``deviceop._core._dlpack``: DLPack export.

Names not declared here are internal to the core and typed ``Any``.
"""

from typing import Any

def __getattr__(name: str) -> Any: ...
