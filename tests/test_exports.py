"""The public surface is exactly what ``__all__`` says (trio's test_exports is the model).

Public modules: ``deviceop``, ``deviceop.kernels``, ``deviceop.executors``, ``deviceop.graph`` and
``deviceop.interop``. Every name of their ``__all__`` resolves (lazy ones included), is documented,
and ``dir()`` lists no other public name, so what ``from deviceop import *``, an IDE and the API
reference show is one list.
"""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
import types

import pytest

PUBLIC = ["deviceop", "deviceop.kernels", "deviceop.executors", "deviceop.graph", "deviceop.interop"]


@pytest.mark.parametrize("name", PUBLIC)
def test_dir_is_all(name):
    m = importlib.import_module(name)
    public = {n for n in dir(m) if not n.startswith("_")}
    assert sorted(m.__all__) == sorted(set(m.__all__)), "no duplicates"
    assert public == set(m.__all__), f"not in __all__: {public - set(m.__all__)}; missing: {set(m.__all__) - public}"


@pytest.mark.parametrize("name", PUBLIC)
def test_every_exported_name_resolves_and_is_documented(name):
    m = importlib.import_module(name)
    assert (m.__doc__ or "").strip(), f"{name} has no docstring"
    for n in m.__all__:
        v = getattr(m, n)
        if isinstance(v, (type, types.ModuleType)) or callable(v):  # (dtypes and constants are values)
            assert (inspect.getdoc(v) or "").strip(), f"{name}.{n} has no docstring"


def test_star_import_gives_all_and_nothing_private():
    ns: dict = {}
    exec("from deviceop import *", ns)
    import deviceop

    assert set(ns) - {"__builtins__"} == set(deviceop.__all__)


def test_unknown_names_raise_attribute_error():
    import deviceop

    for m in (deviceop, deviceop.kernels, deviceop.executors):
        with pytest.raises(AttributeError, match="no attribute"):
            m.no_such_name


def test_lazy_names_load_in_a_fresh_process():
    # the lazy public names (executors, graph, kernels.gemm, WorkQueue...) resolve on first use
    code = (
        "import deviceop as do\n"
        "assert do.executors.WorkQueue.__name__ == 'WorkQueue'\n"
        "assert callable(do.kernels.gemm) and do.graph.GraphCache and do.zip and do.external\n"
        "print('ok')\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "DEVICEOP_BACKEND": "host"},
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


# compiled classes users do not construct (ops are made by functions, contexts and replays by
# deviceop): their constructors are not part of the surface
_NOT_CONSTRUCTED = {"DeviceOp", "ExecutionContext", "External", "GraphLaunch"}


@pytest.mark.parametrize("name", PUBLIC)
def test_signatures_are_visible(name):
    m = importlib.import_module(name)
    for n in m.__all__:
        v = getattr(m, n)
        if n in _NOT_CONSTRUCTED or isinstance(v, types.ModuleType) or not callable(v):
            continue
        if isinstance(v, type) and issubclass(v, BaseException):
            continue  # exceptions take any arguments
        inspect.signature(v)  # raises ValueError / TypeError where none is visible


def test_builtin_kernel_signatures_name_their_arguments():
    import deviceop as do

    assert list(inspect.signature(do.kernels.add).parameters) == ["out_partition", "x", "y"]
    p = inspect.signature(do.kernels.rms_norm).parameters
    assert list(p) == ["out", "x", "w", "eps"] and p["eps"].default == 1e-6
    assert list(inspect.signature(do.Tensor).parameters)[:3] == ["buffer", "shape", "dtype"]
