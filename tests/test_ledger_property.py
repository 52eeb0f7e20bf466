"""Property test of the access ledger: random programs over up to 32 streams equal a sequential
numpy model. Programs mix full and partial writes (slices of one buffer), reads of other
buffers, zips and shared ops, each submitted to a random stream; reads are snapshots taken in
program order. Runs under chaos on the host backend. DEVICEOP_PROPERTY_EXAMPLES sets the count
(the GPU suite runs 1000 on cuda)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import STUB_DRIVER
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deviceop as do

K = do.kernels
TILE = 32
TILES = 8  # buffer length TILES * TILE float32
EXAMPLES = int(os.environ.get("DEVICEOP_PROPERTY_EXAMPLES", "60"))
VALUES = st.sampled_from([0.0, 1.0, 2.0, 3.0, -1.0, 5.0])
GAINS = st.sampled_from([1.0, 2.0, 0.5, -1.0])


@pytest.fixture
def pool32(backend_kind):
    """The test's backend with a 32-stream pool, chaos on the host."""
    be = do.use_backend(backend_kind, streams=32)
    do.set_host_chaos(0.0003 if backend_kind == "host" else 0)
    yield be
    do.set_host_chaos(0)
    do.set_borrow_policy("order")
    do.use_backend(backend_kind)


def _range(draw, n_tiles=None):
    n = n_tiles or draw(st.integers(1, TILES))
    lo = draw(st.integers(0, TILES - n))
    return lo, n


@st.composite
def kernel_step(draw, nbuf):
    kind = draw(st.sampled_from(["fill", "scale", "add"]))
    dst = draw(st.integers(0, nbuf - 1))
    dlo, n = _range(draw)
    if kind == "fill":
        return ("fill", dst, dlo, n, draw(VALUES))
    srcs = []
    for _ in range(1 if kind == "scale" else 2):
        b = draw(st.integers(0, nbuf - 1))
        lo = dlo if b == dst else _range(draw, n)[0]  # same buffer: same range (no shifted self-overlap)
        srcs.append((b, lo))
    if kind == "scale":
        return ("scale", dst, dlo, n, srcs[0], draw(GAINS))
    return ("add", dst, dlo, n, srcs[0], srcs[1])


@st.composite
def programs(draw):
    nbuf = draw(st.integers(1, 3))
    nstreams = draw(st.integers(1, 32))
    steps = []
    for _ in range(draw(st.integers(1, 14))):
        shape = draw(st.sampled_from(["kernel", "kernel", "kernel", "zip", "shared", "read"]))
        s = draw(st.integers(0, nstreams - 1))
        if shape == "kernel":
            steps.append(("one", draw(kernel_step(nbuf)), s))
        elif shape == "zip":
            steps.append(("zip", (draw(kernel_step(nbuf)), draw(kernel_step(nbuf))), s))
        elif shape == "shared":
            steps.append(("shared", draw(kernel_step(nbuf)), (s, draw(st.integers(0, nstreams - 1)))))
        else:
            steps.append(("read", draw(st.integers(0, nbuf - 1)), s))
    return nbuf, steps


def _model_apply(model, k):
    kind, dst, dlo, n = k[:4]
    d = slice(dlo * TILE, (dlo + n) * TILE)
    if kind == "fill":
        model[dst][d] = k[4]
    elif kind == "scale":
        (b, lo), g = k[4], k[5]
        model[dst][d] = model[b][lo * TILE : (lo + n) * TILE] * np.float32(g)
    else:
        (b1, lo1), (b2, lo2) = k[4], k[5]
        model[dst][d] = model[b1][lo1 * TILE : (lo1 + n) * TILE] + model[b2][lo2 * TILE : (lo2 + n) * TILE]


def _op(bufs, k):
    kind, dst, dlo, n = k[:4]
    out = bufs[dst][dlo * TILE : (dlo + n) * TILE].partition((TILE,))
    if kind == "fill":
        return K.fill(out, k[4])
    if kind == "scale":
        (b, lo), g = k[4], k[5]
        return K.scale(out, bufs[b][lo * TILE : (lo + n) * TILE], g)
    (b1, lo1), (b2, lo2) = k[4], k[5]
    return K.add(out, bufs[b1][lo1 * TILE : (lo1 + n) * TILE], bufs[b2][lo2 * TILE : (lo2 + n) * TILE])


def run_program(nbuf, steps, streams):
    rng = np.random.default_rng(len(steps))
    init = [rng.integers(-4, 5, TILES * TILE).astype(np.float32) for _ in range(nbuf)]
    bufs = [do.from_numpy(a).sync() for a in init]
    model = [a.copy() for a in init]
    futures, reads = [], []
    for kind, what, s in steps:
        if kind == "one":
            _model_apply(model, what)
            futures.append(_op(bufs, what).submit(streams[s]))
        elif kind == "zip":
            for k in what:
                _model_apply(model, k)
            futures.append(do.zip(_op(bufs, what[0]), _op(bufs, what[1])).submit(streams[s]))
        elif kind == "shared":
            _model_apply(model, what)  # executes once, however many consumers
            sh = _op(bufs, what).shared()
            futures.append(sh.submit(streams[s[0]]))
            futures.append(sh.map(lambda out: out).submit(streams[s[1]]))
        else:
            reads.append((model[what].copy(), do.to_numpy(bufs[what]).submit(streams[s])))
    for f in futures:
        f.result(timeout=60)
    for expect, f in reads:
        np.testing.assert_array_equal(f.result(timeout=60), expect)
    for b, expect in zip(bufs, model):
        np.testing.assert_array_equal(b.numpy(), expect)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(prog=programs())
def test_random_programs_equal_sequential_model(pool32, prog):
    nbuf, steps = prog
    run_program(nbuf, steps, pool32.streams)


def test_missing_dependency_is_caught_by_chaos(backend_kind):
    """With the ledger off, a cross-stream read-after-write race shows up under chaos (the host
    backend's, or the stub driver's streams with DEVICEOP_STUB_CHAOS_US)."""
    if backend_kind != "host" and not (STUB_DRIVER and os.environ.get("DEVICEOP_STUB_CHAOS_US")):
        pytest.skip("chaos delays exist on the host backend and the stub driver")
    do.use_backend(backend_kind, streams=2)
    do.set_host_chaos(0.002 if backend_kind == "host" else 0)
    s0, s1 = do.streams()
    wrong = 0
    try:
        do.set_borrow_policy("off")
        x = do.zeros(TILE * 4, do.float32).sync()
        y = do.zeros(TILE * 4, do.float32).sync()
        for i in range(1, 40):
            K.fill(x.partition((TILE,)), float(i)).submit(s0)
            got = (
                K.scale(y.partition((TILE,)), x, 1.0)
                .map(lambda o: None)
                .then(lambda _: do.to_numpy(y))
                .submit(s1)
                .result(10)
            )
            s0.synchronize()
            wrong += int(not (got == i).all())
            if wrong:
                break
    finally:
        do.set_borrow_policy("order")
        do.set_host_chaos(0)
        do.use_backend(backend_kind)
    assert wrong, "the chaos test did not notice a missing dependency with the ledger off"


def test_same_program_with_ledger_is_ordered(backend_kind):
    """The program above with the ledger on: always right."""
    be = do.use_backend(backend_kind, streams=2)
    do.set_host_chaos(0.002 if backend_kind == "host" else 0)
    s0, s1 = be.streams
    try:
        x = do.zeros(TILE * 4, do.float32).sync()
        y = do.zeros(TILE * 4, do.float32).sync()
        for i in range(1, 15):
            K.fill(x.partition((TILE,)), float(i)).submit(s0)
            got = (
                K.scale(y.partition((TILE,)), x, 1.0)
                .map(lambda o: None)
                .then(lambda _: do.to_numpy(y))
                .submit(s1)
                .result(10)
            )
            assert (got == i).all(), i
    finally:
        do.set_host_chaos(0)
        do.use_backend(backend_kind)
