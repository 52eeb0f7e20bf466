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


@needs_native
def test_native_lock_behaves_like_threading_lock():
    import threading

    Lock = _fast.native.Lock
    for lock in (Lock(), Lock.__new__(Lock)):  # usable without __init__ too
        assert lock.acquire() is True and lock.locked()
        lock.release()
        assert not lock.locked()
        with pytest.raises(RuntimeError, match="unlocked"):
            lock.release()
    lock, count = Lock(), [0]

    def bump() -> None:
        for _ in range(20000):
            with lock:
                n = count[0]
                count[0] = n + 1

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert count[0] == 80000 and not lock.locked()
    # as threading.Lock: another thread may give it back
    lock.acquire()
    t = threading.Thread(target=lock.release)
    t.start()
    t.join(10)
    assert not lock.locked() and lock.acquire()
    lock.release()


@needs_native
def test_graph_base_fields():
    import gc
    import weakref

    class G(_fast.native.GraphBase):
        pass

    g = G()
    assert g._fast is None and g.launches == 0
    g.launches += 2
    assert g.launches == 2
    regions = ((object(), 0, 8, True),)
    good = ("be", 7, object(), 0x1234, regions, "out", [None, None])
    g._fast = good
    assert g._fast is good
    bad = [
        ("be", 7, None, 0x1234, regions, "out"),  # six items
        ("be", "7", None, 0x1234, regions, "out", [None, None]),  # context not an int
        ("be", 7, None, 0x1234, regions, "out", (None, None)),  # park not a list
        ("be", 7, None, 0x1234, regions, "out", [None]),  # park of one
        ("be", 7, None, 0x1234, ((object(), 0, 8),), "out", [None, None]),  # a region of three
        ("be", 7, None, 0x1234, [regions[0]], "out", [None, None]),  # regions not a tuple
        ("be", 7, None, 1 << 80, regions, "out", [None, None]),  # not a pointer
        [1, 2, 3, 4, 5, 6, 7],
    ]
    for b in bad:
        with pytest.raises((TypeError, OverflowError)):
            g._fast = b
        assert g._fast is good  # unchanged
    g._fast = None
    assert g._fast is None
    g._fast = good
    del g._fast
    assert g._fast is None
    with pytest.raises(TypeError):
        g.launches = "many"
    # the collector sees through _fast: a graph in its own view is collected
    g._fast = (g, 7, None, 0, (), g, [g, None])
    r = weakref.ref(g)
    del g
    gc.collect()
    assert r() is None
