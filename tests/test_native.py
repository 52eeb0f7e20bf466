"""The native module's object factories and kernel front, against the Python they replace."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import deviceop as do
from deviceop.device import _fast
from deviceop.executors._context import ExecutionContext, context_maker
from deviceop.kernels import _elementwise

K = do.kernels

needs_native = pytest.mark.skipif(not _fast.available(), reason="the native module is not built (or DEVICEOP_NATIVE=0)")


def _slots(cls: type) -> list[str]:
    return [n for c in cls.__mro__ for n in getattr(c, "__slots__", ()) if n != "__weakref__"]


def _state(obj: object, cls: type) -> dict:
    return {n: getattr(obj, n) for n in _slots(cls) if hasattr(obj, n)}


@needs_native
def test_context_maker_builds_what_init_builds():
    stream = SimpleNamespace(backend="be", handle_int=42)
    op = object()
    ref = ExecutionContext(stream, "sync_on()", op)
    make = context_maker()
    a, b = make(stream, 42, "be", op, "sync_on()"), make(stream, 42, "be", op, "sync_on()")
    assert type(a) is ExecutionContext
    assert _state(a, ExecutionContext) == _state(ref, ExecutionContext)
    assert set(_state(a, ExecutionContext)) == set(_slots(ExecutionContext))  # every slot set
    assert a.buffers is not b.buffers  # a fresh list per object
    a.buffers.append(1)
    assert b.buffers == [] and make(stream, 42, "be", op, "x").buffers == []
    assert "sync_on()" in repr(a)


@needs_native
def test_planned_call_maker_builds_what_init_builds():
    k, args, plan = K.scale, (1, 2, 3.0), object()
    ref = _elementwise._PlannedCall(k, args, plan)
    made = _elementwise._MAKE_CALL(None, k, args, plan)
    assert type(made) is _elementwise._PlannedCall
    assert _state(made, _elementwise._PlannedCall) == _state(ref, _elementwise._PlannedCall)


@needs_native
def test_maker_bad_input():
    Maker = _fast.native.Maker

    class P:
        __slots__ = ("a", "b")

    class D:  # no slots: nothing to set directly
        pass

    with pytest.raises(TypeError, match="not a writable __slots__ member"):
        Maker(P, ("a", "zz"), ())
    with pytest.raises(TypeError, match="not a writable __slots__ member"):
        Maker(D, ("a",), ())
    with pytest.raises(TypeError, match="mutable"):
        Maker(P, ("a",), (("b", [1]),))
    with pytest.raises(TypeError, match="mutable"):
        Maker(P, ("a",), (("b", {}),))
    with pytest.raises(TypeError, match="pairs"):
        Maker(P, ("a",), ("b",))
    with pytest.raises(TypeError, match="fixed-size"):
        Maker(tuple, (), ())
    m = Maker(P, ("a",), (("b", 7),))
    with pytest.raises(TypeError, match="takes 1 arguments, got 2"):
        m(1, 2)
    with pytest.raises(TypeError, match="positional"):
        m(a=1)
    p = m("x")
    assert (p.a, p.b) == ("x", 7)
    assert not hasattr(Maker(P, ("a",), ())(1), "b")  # a slot not named stays unset, as with __init__


@pytest.fixture(params=["native", "python"])
def front(request, monkeypatch):
    """The built-in kernels' call with the native front, and again with its Python twin."""
    if request.param == "native":
        if not _fast.available():
            pytest.skip("the native module is not built (or DEVICEOP_NATIVE=0)")
        return K.scale
    twin = _elementwise.Elementwise("scale", 1, 1, "x0 * s0", _elementwise.scale.host_impl, "scale")
    monkeypatch.setattr(type(twin), "__call__", _elementwise._PyFront.__call__)
    return twin


def test_kernel_fronts_agree(backend, front):
    x = do.full(256, 2.0, do.float32).sync()
    y = do.zeros(256, do.float32).sync()
    yp = y.partition((128,))
    assert type(front(yp, x, 3.0)) is _elementwise.KernelCall  # first call: validated and planned
    op = front(yp, x, 3.0)
    assert type(op) is _elementwise._PlannedCall and op._args == (yp, x, 3.0) and op._k is front
    op.sync()
    assert (y.numpy() == 6).all()
    assert type(front(yp, x, 3)) is _elementwise.KernelCall  # an int scalar: checked again
    assert type(front(y.partition((128,)), x, 3.0)) is _elementwise.KernelCall  # another partition
    assert type(front(y.partition((128,)), x, 3.0)) is _elementwise.KernelCall  # (each a new object)
    with pytest.raises(do.UsageError, match="takes 3 arguments"):
        front(yp, x)
    with pytest.raises(do.DTypeError, match="scalar 0"):
        front(yp, x, "3")
    with pytest.raises(TypeError):
        front(yp, x, g=3.0)
    del x
    # the plan holds its tensors weakly: a new tensor at maybe the same address is validated again
    x2 = do.full(256, 1.0, do.float32).sync()
    assert type(front(yp, x2, 1.0)) is _elementwise.KernelCall
