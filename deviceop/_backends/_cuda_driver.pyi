"""Type stub of the compiled module ``deviceop._backends._cuda_driver``: the driver calls the cuda backend
makes through ``cuda.bindings.cydriver``, typed ``Any``.
"""

from typing import Any

def __getattr__(name: str) -> Any: ...
