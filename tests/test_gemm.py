"""do.kernels.gemm on every backend: shapes (odd, non-multiples of 8, empty), transposes, strided
sub-matrices, alpha/beta, every float dtype against a float64 reference; bad input; graphs."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import needs_gpu
from helpers import FLOAT_DTYPES, pool_of

import deviceop as do


@pytest.fixture(autouse=True)
def _cublas(request):
    """GEMM runs through cuBLAS, which the stub driver does not emulate."""
    if "backend" in request.fixturenames:
        needs_gpu(request.getfixturevalue("backend"), "cuBLAS")


K = do.kernels

# float32 accumulation over k terms; the inputs round to their dtype first (the reference uses
# the rounded inputs), so only the products' accumulation and the output rounding differ
TOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2e-5}


def _rand(rng: np.random.Generator, shape: tuple[int, ...], dt: do.DType) -> np.ndarray:
    return rng.standard_normal(shape).astype(dt.np_dtype)


def _check(got: np.ndarray, want: np.ndarray, dt: do.DType, k: int) -> None:
    g = got.astype(np.float64)
    assert not np.isnan(g).any(), "an output element was not written"
    tol = TOL[dt.name]
    np.testing.assert_allclose(g, want, rtol=tol, atol=tol * max(1.0, np.sqrt(k)) * 2)


def _ref(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a.astype(np.float64) @ b.astype(np.float64)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (5, 7, 3), (33, 17, 9), (64, 128, 96), (127, 61, 255), (256, 256, 256)])
def test_gemm_matches_float64_reference(backend, dtype, m, k, n):
    rng = np.random.default_rng(m * 1000 + k * 10 + n)
    a, b = _rand(rng, (m, k), dtype), _rand(rng, (k, n), dtype)
    c = do.full((m, n), float("nan"), dtype).sync()  # beta = 0: c is never read
    out, ta, tb = K.gemm(c, do.from_numpy(a).sync(), do.from_numpy(b).sync()).sync()
    assert out is c and ta.shape == (m, k) and tb.shape == (k, n)
    _check(c.numpy(), _ref(a, b), dtype, k)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("ta,tb", [(False, True), (True, False), (True, True)])
def test_gemm_transposed_views(backend, dtype, ta, tb):
    m, k, n = 37, 29, 19
    rng = np.random.default_rng(7)
    a, b = _rand(rng, (m, k), dtype), _rand(rng, (k, n), dtype)
    # store the transposes contiguously and pass .T views: nothing is copied
    da = do.from_numpy(np.ascontiguousarray(a.T)).sync().T if ta else do.from_numpy(a).sync()
    db = do.from_numpy(np.ascontiguousarray(b.T)).sync().T if tb else do.from_numpy(b).sync()
    assert da.shape == (m, k) and db.shape == (k, n)
    c = do.full((m, n), float("nan"), dtype).sync()
    K.gemm(c, da, db).sync()
    _check(c.numpy(), _ref(a, b), dtype, k)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.name)
def test_gemm_column_major_output_and_submatrices(backend, dtype):
    rng = np.random.default_rng(3)
    big_a, big_b = _rand(rng, (40, 50), dtype), _rand(rng, (60, 30), dtype)
    a_np, b_np = big_a[3:24, 5:46], big_b[7:48, 2:13]  # strided rows: leading dims 50 and 30
    da = do.from_numpy(big_a).sync()[3:24, 5:46]
    db = do.from_numpy(big_b).sync()[7:48, 2:13]
    # c as the transpose of a (n, m) buffer, inside a larger poisoned one
    backing = do.full((15, 30), float("nan"), dtype).sync()
    c = backing[2:13, 4:25].T
    assert c.shape == (21, 11) and c.strides[0] == 1
    K.gemm(c, da, db).sync()
    _check(c.numpy(), _ref(a_np, b_np), dtype, 41)
    rest = backing.numpy().astype(np.float64)
    rest[2:13, 4:25] = 0
    assert np.isnan(rest).sum() == 15 * 30 - 11 * 21, "gemm wrote outside c"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.name)
def test_gemm_alpha_beta_and_partition_output(backend, dtype):
    m, k, n = 24, 40, 16
    rng = np.random.default_rng(11)
    a, b, c0 = _rand(rng, (m, k), dtype), _rand(rng, (k, n), dtype), _rand(rng, (m, n), dtype)
    c = do.from_numpy(c0).sync()
    p = c.partition((8, 8))
    out, _, _ = K.gemm(p, do.from_numpy(a).sync(), do.from_numpy(b).sync(), alpha=0.5, beta=-2.0).sync()
    assert out is p  # same type in, same type out
    _check(c.numpy(), 0.5 * _ref(a, b) - 2.0 * c0.astype(np.float64), dtype, k)


def test_gemm_k_zero_scales_c(backend):
    c0 = np.arange(6, dtype=np.float32).reshape(2, 3)
    c = do.from_numpy(c0).sync()
    K.gemm(c, do.zeros((2, 0), do.float32).sync(), do.zeros((0, 3), do.float32).sync(), beta=3.0).sync()
    np.testing.assert_array_equal(c.numpy(), 3 * c0)


def test_gemm_empty_output_is_a_no_op(backend):
    out = K.gemm(
        do.zeros((0, 4), do.float16).sync(), do.zeros((0, 3), do.float16).sync(), do.zeros((3, 4), do.float16).sync()
    ).sync()
    assert out[0].shape == (0, 4)


def test_gemm_tf32_opt_in(backend):
    rng = np.random.default_rng(5)
    a, b = _rand(rng, (64, 64), do.float32), _rand(rng, (64, 64), do.float32)
    c = do.zeros((64, 64), do.float32).sync()
    K.gemm(c, do.from_numpy(a).sync(), do.from_numpy(b).sync(), tf32=True).sync()
    # TF32 keeps 10 mantissa bits of each input
    np.testing.assert_allclose(c.numpy(), _ref(a, b), rtol=5e-3, atol=5e-2)


def test_gemm_arguments_may_be_ops(backend):
    a = np.ones((4, 6), np.float32)
    b = np.full((6, 5), 2.0, np.float32)
    out, _, _ = K.gemm(do.zeros((4, 5), do.float32), do.from_numpy(a), do.from_numpy(b)).sync()
    np.testing.assert_array_equal(out.numpy(), np.full((4, 5), 12.0, np.float32))


def test_gemm_chains_and_awaits(backend):
    import asyncio

    x = do.from_numpy(np.eye(8, dtype=np.float32) * 2).sync()
    y = do.zeros((8, 8), do.float32).sync()
    z = do.zeros((8, 8), do.float32).sync()
    op = K.gemm(y, x, x).then(lambda r: K.gemm(z, r[0], x))  # z = (2I)(2I)(2I)
    asyncio.run(_await(op))
    np.testing.assert_array_equal(z.numpy(), np.eye(8, dtype=np.float32) * 8)


async def _await(op):
    return await op


def test_gemm_in_a_graph(backend):
    rng = np.random.default_rng(2)
    a, b = _rand(rng, (48, 32), do.float16), _rand(rng, (32, 40), do.float16)
    da, db = do.from_numpy(a).sync(), do.from_numpy(b).sync()
    c = do.full((48, 40), float("nan"), do.float16).sync()
    g = K.gemm(c, da, db).graph()
    assert np.isnan(c.numpy().astype(np.float64)).all(), "recording must not run the GEMM"
    for _ in range(3):
        g.launch().sync()
    _check(c.numpy(), _ref(a, b), do.float16, 32)


def test_gemms_recorded_in_scopes_work_in_workspaces_of_their_own(backend):
    """Scopes record one after another on the same capture streams, and their graphs replay on
    any stream at once: each recording's GEMMs get a cuBLAS workspace of the recording's (never
    a stream's, nor another live recording's), kept while its graph lives, then served to a
    later recording."""
    if backend == "host":
        pytest.skip("the host backend has no cuBLAS workspaces")
    import gc

    from deviceop.kernels import _blas

    rng = np.random.default_rng(3)
    a, b = _rand(rng, (256, 512), do.float32), _rand(rng, (512, 384), do.float32)
    da, db = do.from_numpy(a).sync(), do.from_numpy(b).sync()
    s0, s1 = pool_of(2)[:2]
    cs = [do.zeros((256, 384), do.float32).sync() for _ in range(3)]
    graphs = []
    for c, scope_kw in ((cs[0], {}), (cs[1], {}), (cs[2], {"stream": s0})):
        with do.graph.scope(**scope_kw) as sc:
            sc.record(K.gemm(c, da, db))
        graphs.append(sc.graph)
    ws = [[k.ptr for k in g._rec.keep if isinstance(k, _blas._Workspace)] for g in graphs]
    assert all(len(w) == 1 for w in ws) and len({w[0] for w in ws}) == 3
    assert not {w[0] for w in ws} & set(_blas._workspaces.values())
    for _ in range(3):  # replayed at once on two streams, and beside s0's own GEMMs
        f = [graphs[0].launch().submit(s0), graphs[1].launch().submit(s1), graphs[2].launch().submit(s1)]
        K.gemm(do.zeros((256, 384), do.float32).sync(), da, db).sync_on(s0)
        for x in f:
            x.result(timeout=30)
    for c in cs:
        _check(c.numpy(), _ref(a, b), do.float32, 512)
    del graphs, sc, f
    gc.collect()
    with do.graph.scope() as sc:
        sc.record(K.gemm(cs[0], da, db))
    again = [k.ptr for k in sc.graph._rec.keep if isinstance(k, _blas._Workspace)]
    assert len(again) == 1 and again[0] in {w[0] for w in ws}  # (given back, served again)


def test_gemm_streams_are_ordered_by_the_ledger(backend):
    # a GEMM reading y on one stream after a fill writing y on another stream
    x = do.from_numpy(np.eye(16, dtype=np.float32)).sync()
    y = do.zeros((16, 16), do.float32).sync()
    z = do.zeros((16, 16), do.float32).sync()
    s = do.streams()
    futs = []
    for v in (1.0, 2.0, 3.0):
        futs.append(K.fill(y.view(-1).partition((256,)), v).submit(s[0]))
        futs.append(K.gemm(z, x, y).submit(s[1 % len(s)]))
    for f in futs:
        f.result(30)
    assert (z.numpy() == 3.0).all()


# -- bad input: every error before any GPU work ----------------------------------------------
def test_gemm_bad_input(backend):
    f16, f32 = do.float16, do.float32
    a, b, c = do.zeros((4, 3), f16).sync(), do.zeros((3, 5), f16).sync(), do.zeros((4, 5), f16).sync()
    with pytest.raises(do.ShapeError, match="does not give c"):
        K.gemm(do.zeros((5, 4), f16).sync(), a, b)
    with pytest.raises(do.ShapeError, match="does not give c"):
        K.gemm(c, a, do.zeros((4, 5), f16).sync())
    with pytest.raises(do.DTypeError, match="one dtype"):
        K.gemm(c, a, do.zeros((3, 5), f32).sync())
    with pytest.raises(do.DTypeError, match="float16, bfloat16 and float32"):
        K.gemm(do.zeros((4, 5), do.int32).sync(), a, b)
    with pytest.raises(do.ShapeError, match="2-D"):
        K.gemm(c, do.zeros(12, f16).sync(), b)
    with pytest.raises(do.UsageError, match="must be a Tensor"):
        K.gemm(c, np.zeros((4, 3), np.float16), b)
    with pytest.raises(do.UsageError, match="float32 only"):
        K.gemm(c, a, b, tf32=True)
    with pytest.raises(do.DTypeError, match="alpha"):
        K.gemm(c, a, b, alpha="2")
    with pytest.raises(do.UsageError, match="overlaps"):
        sq = do.zeros((4, 4), f16).sync()
        K.gemm(sq, sq, do.zeros((4, 4), f16).sync())
    with pytest.raises(do.ShapeError, match="unit stride"):
        big = do.zeros((8, 6), f16).sync()
        K.gemm(c, big[::2, ::2], b)
    # a planned layout's calls are made by the compiled path: the same refusals hold there
    K.gemm(c, a, b)
    with pytest.raises(do.DTypeError, match="out of range for float32"):
        K.gemm(c, a, b, alpha=1e39)
    with pytest.raises(do.DTypeError, match="beta"):
        K.gemm(c, a, b, beta=-1e300)
    with pytest.raises(do.UsageError, match="tf32"):
        K.gemm(c, a, b, tf32=1)
    K.gemm(*(do.zeros((4, 4), f16).sync() for _ in range(3)))  # sq's layout, planned
    with pytest.raises(do.UsageError, match="overlaps"):
        K.gemm(sq, sq, do.zeros((4, 4), f16).sync())
    assert K.gemm(c, a, b, alpha=2.0, beta=0.5).sync()[0] is c


def test_gemm_bad_input_from_an_op_fails_at_run_time(backend):
    op = K.gemm(do.zeros((4, 5), do.float32), do.zeros((4, 4), do.float32), do.zeros((3, 5), do.float32))
    with pytest.raises(do.ShapeError):
        op.sync()


def test_repeated_gemms_replay_correctly(backend):
    # the same call many times (recorded into a graph on cuda after a few), then with other
    # scalars, pointers and streams: every result must match the reference
    from deviceop.kernels import _gemm

    rng = np.random.default_rng(5)
    s0, s1 = pool_of(2)[:2]
    a_np, b_np = _rand(rng, (64, 48), do.float16), _rand(rng, (48, 32), do.float16)
    a, b = do.from_numpy(a_np).sync(), do.from_numpy(b_np).sync()
    cs = [do.zeros((64, 32), do.float16).sync() for _ in range(2)]
    _gemm.GEMM.replays.clear()  # recordings draw on a credit that earlier tests may have spent
    # and a credit that replays' measured savings refill: under a sanitizer, which slows every
    # call alike, a replay saves next to nothing and the table rightly stops recording. What is
    # tested here is one recording per distinct call, so the credit is not what limits them
    _gemm.GEMM.replays.credit = 1e6
    before = _gemm.GEMM.replays.recorded
    try:
        for _ in range(8):
            K.gemm(cs[0], a, b).sync_on(s0)
            _check(cs[0].numpy(), _ref(a_np, b_np), do.float16, 48)
        for alpha, c, s in ((0.5, cs[0], s0), (0.5, cs[1], s1), (2.0, cs[1], s1)):
            for _ in range(4):
                K.gemm(c, a, b, alpha=alpha).sync_on(s)
                _check(c.numpy(), alpha * _ref(a_np, b_np), do.float16, 48)
        if backend == "cuda" and _gemm.GEMM.mode == 0:  # DEVICEOP_GEMM=auto
            assert _gemm.GEMM.replays.recorded >= before + 4  # one per distinct (scalars, pointers, stream)
    finally:
        _gemm.GEMM.replays.clear()  # (the credit as it starts, for the tests after this one)


def test_repeated_gemm_inside_a_recording_is_recorded_not_replayed(backend):
    a, b = do.ones((32, 32), do.float32).sync(), do.ones((32, 32), do.float32).sync()
    c = do.zeros((32, 32), do.float32).sync()
    for _ in range(4):
        K.gemm(c, a, b).sync()
    g = K.gemm(c, a, b, alpha=3.0).graph()  # the replay cache never serves a recording
    g.launch().sync()
    np.testing.assert_array_equal(c.numpy(), np.full((32, 32), 96.0, np.float32))


def test_a_repeated_batch_of_gemms_is_replayed_as_one_graph(backend):
    # a work queue's batch (an Each of GEMMs), the same calls again and again, is recorded into
    # one graph on cuda and replayed: every result must match the reference with the inputs
    # changed between runs, a call reading what an earlier call of the batch wrote included
    from deviceop._core._op import Each
    from deviceop.kernels import _gemm
    from deviceop.kernels._gemm_replay import HOT

    rng = np.random.default_rng(11)
    s = pool_of(1)[0]
    dt = do.float32
    a, b, d = (do.zeros(shape, dt).sync() for shape in ((64, 32), (32, 64), (64, 32)))
    c1, c2, c3 = (do.zeros(shape, dt).sync() for shape in ((64, 64), (64, 32), (64, 64)))
    table = _gemm.GEMM.batch_replays
    bank = table.bank  # (the calls' table, whose credit the batches' recordings spend)
    saved = bank.credit
    table.clear()
    bank.credit = 1e6  # (see test_repeated_gemms_replay_correctly)
    recorded, replays = table.recorded, table.replays
    try:
        for _ in range(HOT + 3):
            av, bv, dv = (_rand(rng, t.shape, dt) for t in (a, b, d))
            for t, v in ((a, av), (b, bv), (d, dv)):
                K.copy(t.view(-1).partition((256,)), do.from_numpy(v.ravel()).sync_on(s)).sync_on(s)
            ops = [K.gemm(c1, a, b), K.gemm(c2, c1, d), K.gemm(c3, a, b, alpha=0.5)]
            for o in ops:
                o._take("a test")  # (as a work queue takes its items' ops)
            out = Each(ops).sync_on(s)
            assert [(ok, o[0]) for ok, o in out] == [(True, c1), (True, c2), (True, c3)]
            _check(c1.numpy(), _ref(av, bv), dt, 32)
            _check(c2.numpy(), _ref(c1.numpy(), dv), dt, 64)
            _check(c3.numpy(), 0.5 * _ref(av, bv), dt, 32)
        if backend == "cuda" and _gemm.GEMM.mode == 0:  # DEVICEOP_GEMM=auto
            # one recording, of the batch; replayed from the run after it (the first run plans
            # the calls one by one where no earlier test planned their layouts)
            assert table.recorded - recorded == 1 and table.replays - replays >= 2
    finally:
        table.clear()
        bank.credit = saved


class _Ex:
    def __init__(self, n: int) -> None:
        self.handle_int = 1000 + n


class _Graphs:  # a stand-in for the cuda backend's graph operations
    def __init__(self) -> None:
        self.made = 0

    def acquire_stream(self):
        return type("S", (), {"handle_int": 7})()

    def release_stream(self, s) -> None:
        pass

    def begin(self, s) -> None:
        pass

    def end(self, s):
        return "raw"

    def nodes(self, raw) -> int:
        return 1

    def instantiate(self, raw, stream):
        self.made += 1
        return _Ex(self.made)


def _stand_in_backend():
    return type("Be", (), {"graphs": _Graphs()})()


def test_gemm_replays_record_when_hot_remember_failures_and_are_bounded():
    from deviceop.kernels._gemm_replay import HOT, MAX, Replays

    be = _stand_in_backend()
    r = Replays()
    calls = []
    got = [r.get("k", be, None, lambda s: calls.append(s) or 0) for _ in range(HOT + 2)]
    assert got[: HOT - 1] == [0] * (HOT - 1)  # direct calls until the key is hot
    assert got[HOT - 1] == got[HOT] == got[HOT + 1] == 1001 and calls == [7] and r.recorded == 1
    assert [x.handle_int for x in r.executables()] == [1001]
    # a failed recording (status != 0) is remembered: no retry on every later call
    fails = []
    for _ in range(HOT + 3):
        assert r.get("bad", be, None, lambda s: fails.append(s) or 13) == 0
    assert len(fails) == 1
    # bounded: the oldest graphs go first, but one replayed since eviction last passed it is
    # kept once more ("k" was replayed, "bad" and the fills were not: "k" is spared now, and
    # again after its next replay, and dropped the time after, not replayed in between)
    r.credit = float("inf")  # (recordings that pay back: see the credit test below)
    for i in range(MAX + 5):
        for _ in range(HOT):
            r.get(("fill", i), be, None, lambda s: 0)
    # (MAX + 7 keys recorded or failed: "k", "bad" and the fills; "bad" and the 6 oldest fills went)
    assert len(r) == MAX and r.limit == MAX and r.evicted == 7
    assert r.get(("fill", 6), be, None, lambda s: 0) and not r.get(("fill", 5), be, None, lambda s: 0)
    assert r.get("k", be, None, lambda s: 0) == 1001  # spared, and replayed again: spared again
    for i in range(MAX):
        for _ in range(HOT):
            r.get(("again", i), be, None, lambda s: 0)
    assert r.get("k", be, None, lambda s: 0) == 1001
    for i in range(2 * MAX):
        for _ in range(HOT):
            r.get(("third", i), be, None, lambda s: 0)
    assert not r.get("k", be, None, lambda s: 0)  # not replayed since it was spared: dropped
    assert r.evicted == 7 + MAX + 2 * MAX  # every recording into a full table drops one entry
    before = r.evicted
    r.limit = 8  # a smaller table: the oldest go at the next recording
    for _ in range(HOT):
        r.get(("more", 0), be, None, lambda s: 0)
    assert len(r) == 8 and r.evicted == before + MAX - 7
    for bad in (0, -1, 2.5, "8"):
        with pytest.raises(do.UsageError, match="limit"):
            r.limit = bad
    assert r.limit == 8


def test_gemm_replays_stop_recording_calls_that_do_not_repeat():
    # calls that become hot but are never replayed (addresses that recur now and then) spend the
    # credit: after a few recordings no more are made, however many such calls come; replays of
    # a recorded call earn the credit back
    from deviceop.kernels._gemm_replay import COST, HOT, Replays

    be = _stand_in_backend()
    r = Replays()
    for i in range(2000):
        for _ in range(HOT):
            r.get(("once", i), be, None, lambda s: 0)
    # the first few on credit, then one per COST**2 hot calls that went direct (slow recovery)
    assert r.recorded <= 4 + 2000 // int(COST * COST) + 1 and be.graphs.made == r.recorded
    hot = ("queue", 1)
    r.credit = COST
    for _ in range(HOT):
        r.get(hot, be, None, lambda s: 0)
    assert r.recorded > 0 and r.get(hot, be, None, lambda s: 0)  # recorded, then replayed
    before = r.credit
    for _ in range(100):
        assert r.get(hot, be, None, lambda s: 0)
    assert r.credit >= before + 99 and r.replays >= 101


@pytest.mark.parametrize("m,k,n", [(64, 64, 64), (256, 2048, 2048)])
def test_gemm_row_results_do_not_depend_on_the_other_rows(backend, m, k, n):
    # batch invariance, which a batching service needs (identical requests, identical answers):
    # the same 16 rows at every place of an (m, k) input, among other rows, give the same bits
    rng = np.random.default_rng(11)
    block = (rng.standard_normal((16, k)) / np.sqrt(k)).astype(np.float16)
    b = do.from_numpy((rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float16)).sync()
    outs = []
    for place in range(0, m, 16):
        a = (rng.standard_normal((m, k)) / np.sqrt(k)).astype(np.float16)
        a[place : place + 16] = block
        c = do.empty((m, n), do.float16).sync()
        K.gemm(c, do.from_numpy(a).sync(), b).sync()
        outs.append(c.numpy()[place : place + 16])
    for place, o in zip(range(0, m, 16), outs):
        assert np.array_equal(o, outs[0]), f"rows at {place} differ from rows at 0"


def test_gemm_replays_price_recordings_by_measured_host_times():
    # the cost of a recording, in replays, is measured: its host time over what a replay saves;
    # where replays save nothing recordings are priced at the most, and the credit stays bounded
    from deviceop.kernels._gemm_replay import COST, COST_MAX, HOT, Replays

    be = _stand_in_backend()
    r = Replays()
    assert r.cost == COST  # nothing measured yet
    r.get("warm", be, None, lambda s: 0)  # (a recording measures its own time)
    for _ in range(HOT):
        r.get("first", be, None, lambda s: 0)
    assert r.recorded == 1 and r.record_s > 0
    r.observe(False, 10e-6)
    r.observe(True, 2e-6)
    assert r.cost == pytest.approx(r.record_s / 8e-6)
    for _ in range(100):
        r.observe(True, 10e-6)  # replays come to cost what a direct call does
    assert r.cost == COST_MAX
    r.credit = COST_MAX - 1  # short of one recording: a hot call goes direct, earning 1/COST_MAX
    for _ in range(HOT + 2):
        assert r.get("second", be, None, lambda s: 0) == 0
    assert r.recorded == 1 and r.credit > COST_MAX - 1
    for _ in range(10000):
        r.get("first", be, None, lambda s: 0)  # replays earn credit, up to 8 recordings' worth
    assert r.credit <= 8 * COST_MAX + 1
    r.clear()
    assert r.cost == COST and r.direct_s == r.replay_s == r.record_s == 0.0


def test_gemm_replays_record_a_wide_repeating_pattern_within_tens_of_rounds():
    # 64 requests in flight, each on buffers of its own, make some 880 distinct calls a round,
    # each once; a call seen 2 * HOT times and still direct for want of credit earns as a replay
    # does, so the table records them all in about 30 rounds (80 when only replays earned), and
    # calls that stop recurring right after cost no more than that credit
    import time

    from deviceop._core._gemm import HOT
    from deviceop._core._gemm import Replays as Table

    class Executable:
        handle_int = 1

    def record(backend: object, stream: object, call: object) -> Executable:
        t = time.perf_counter() + 170e-6  # a recording's host time: about 21 replays' saving
        while time.perf_counter() < t:
            pass
        return Executable()

    def table() -> Table:
        t = Table(record)
        t.observe(False, 10e-6)  # a direct call
        t.observe(True, 2e-6)  # a replay
        return t

    t = table()
    keys = [("call", i) for i in range(880)]
    rounds = 0
    while rounds < 200:
        rounds += 1
        before = t.recorded
        direct = sum(1 for k in keys if not t.get(k, None, None, lambda s: 0))
        if direct == 0 and t.recorded == before:
            break
    assert t.recorded == len(keys) and rounds <= 40, (rounds, t.recorded)
    # calls that recur 2 * HOT + 1 times, then never again: the credit they earn (1 for each
    # miss from the 2 * HOT-th, 1 / cost before it) pays for at most that many replays' worth
    # of recordings, at their price: about 2.2 replays' saving a call
    t = table()
    low = t.cost  # (the price moves with each recording's measured time: a loaded host's
    for i in range(2000):  # preemption raises it; the recordings were paid at the prices of then)
        for _ in range(2 * HOT + 1):
            t.get(("once", i), None, None, lambda s: 0)
        low = min(low, t.cost)
    assert t.recorded <= 2.5 * 2000 / low + 8, (t.recorded, low, t.cost)


def test_gemm_batch_table_draws_on_the_calls_credit_and_leaves_their_price_alone():
    # a table made with a bank (the batches' table, banked on the calls') spends the bank's
    # credit on its recordings at the bank's price and earns into it with its replays; its own
    # recordings' time does not price the bank's
    from deviceop.kernels._gemm_replay import HOT, Replays

    be = _stand_in_backend()
    calls = Replays()
    batches = Replays(bank=calls)
    assert batches.bank is calls and calls.bank is calls
    with pytest.raises(do.UsageError, match="another replay table"):
        Replays(bank=object())  # type: ignore[arg-type]
    calls.observe(False, 10e-6)
    calls.observe(True, 2e-6)
    calls.record_s = 16e-6  # a call's recording: 2 replays' saving
    assert calls.cost == batches.cost == pytest.approx(2.0)
    credit, own = calls.credit, batches.credit
    for _ in range(HOT):
        batches.get("batch", be, None, lambda s: 0)
    assert batches.recorded == 1 and calls.credit == pytest.approx(credit - 2.0)
    assert calls.record_s == 16e-6 and batches.record_s > 0  # (its own, apart)
    calls.credit = 3.0  # (under the cap, 8 recordings' worth)
    for _ in range(5):
        assert batches.get("batch", be, None, lambda s: 0) != 0
    assert calls.credit == pytest.approx(8.0) and batches.credit == own
    calls.credit = 1.0  # short of a recording at the bank's price: none is made
    for _ in range(HOT + 1):
        assert batches.get("other", be, None, lambda s: 0) == 0
    assert batches.recorded == 1
    batches.clear()
    assert batches.cost == calls.cost  # (clearing a banked table leaves the bank's price)


@pytest.fixture
def stub_gemm(backend_kind):
    """On the stub driver, with cuBLASLt stood in for by the stub's ``stub_ltmatmul`` (one empty
    kernel on the call's stream): ``(a, b, cs, stream, emulate)`` for GEMMs ``cs[i] = a @ b`` of
    a problem no other test makes, whose plan's cuBLASLt call is the stand-in meanwhile; both
    replay tables cleared, with credit to record freely (what is tested is the path, not the
    credit), and restored after. (What the GEMM computes is tested on a GPU; this is its path,
    in CI.)"""
    import ctypes

    from conftest import STUB_DRIVER

    from deviceop.kernels._gemm import GEMM

    if not STUB_DRIVER or backend_kind != "cuda":
        pytest.skip("the stub driver's cuBLASLt stand-in")
    if GEMM.mode != 0:
        pytest.skip("DEVICEOP_GEMM is not auto: no replays")
    from stub_driver import emulate

    do.use_backend("cuda")  # (not the backend fixture: this file's other cuda tests need cuBLAS)
    fake = int(ctypes.cast(ctypes.CDLL("libcuda.so.1").stub_ltmatmul, ctypes.c_void_p).value or 0)
    s = do.streams()[0]
    a = do.zeros((24, 40), do.float32).sync_on(s)
    b = do.zeros((40, 64), do.float32).sync_on(s)
    cs = [do.empty((24, 64), do.float32).sync_on(s) for _ in range(3)]
    g = GEMM.plan((cs[0], a, b), (1.0, 0.0, False))
    tables = (GEMM.replays, GEMM.batch_replays)
    saved = (g.lt_call, g.lt_tried, GEMM.blas.get(s.handle_int), [t.credit for t in tables])
    try:
        for t in tables:
            t.clear()
            t.credit = 1e6
        GEMM.blas[s.handle_int] = (0, 0)
        g.lt_call, g.lt_tried = (fake, 0, 0, 0, 0, 0, 0), True
        yield a, b, cs, s, emulate
    finally:
        g.lt_call, g.lt_tried = saved[0], saved[1]
        if saved[2] is None:
            GEMM.blas.pop(s.handle_int, None)
        else:
            GEMM.blas[s.handle_int] = saved[2]
        for t, credit in zip(tables, saved[3]):
            t.clear()
            t.credit = credit


def _batch(a, b, cs):
    """A work queue's batch of GEMMs: an Each of ``cs[i] = (1 + i) * a @ b``, its ops taken."""
    from deviceop._core._op import Each

    ops = [K.gemm(c, a, b, alpha=1.0 + i) for i, c in enumerate(cs)]
    for o in ops:
        o._take("a test")  # (as a work queue takes its items' ops)
    return Each(ops)


def _counts(table) -> tuple[int, int]:
    return table.recorded, table.replays


def test_gemm_compiled_path_records_and_replays_on_the_stub_driver(stub_gemm):
    """The compiled GEMM path enqueues each call, records the exact call once it is hot into a
    graph, and launches that graph for the calls after, one kernel each."""
    from deviceop.kernels._gemm import GEMM
    from deviceop.kernels._gemm_replay import HOT

    a, b, cs, s, emulate = stub_gemm
    before, launched = _counts(GEMM.replays), emulate.launches()
    n = HOT + 3
    for _ in range(n):
        assert K.gemm(cs[0], a, b).sync_on(s)[0] is cs[0]
    recorded, replays = (x - y for x, y in zip(_counts(GEMM.replays), before))
    assert (recorded, replays) == (1, n - HOT)  # recorded at the HOT-th call, replayed after it
    assert emulate.launches() - launched == n  # every call ran its kernel once, replayed or not
    assert [type(x.handle_int) for x in GEMM.replays.executables()] == [int]


@pytest.mark.parametrize("by_params", [False, True], ids=["one_buffer", "by_parameter"])
def test_gemm_template_replays_one_recording_on_every_buffer(stub_gemm, by_params):
    """Calls of one plan, scalars and stream on other buffers each time are recorded once, as a
    template, and replayed from then on with their own pointers written into the recorded
    kernel's arguments: every launch, direct or replayed, ran on its call's pointers (read from
    the stand-in kernel's argument block as it ran, under the stub's chaos), also where calls
    are enqueued back to back, each replay's update made while the last may still wait to run.
    The kernel takes its arguments as one buffer (as cuBLAS's nvjet kernels do) or as one
    parameter each (as its float32 kernels do, read where the driver counts them)."""
    from deviceop.kernels._gemm import GEMM
    from deviceop.kernels._gemm_replay import HOT

    a, b, cs, s, emulate = stub_gemm
    emulate.gemm_by_params(by_params)
    try:
        a2 = do.zeros(a.shape, a.dtype).sync_on(s)  # (the same layouts: the same plan)
        b2 = do.zeros(b.shape, b.dtype).sync_on(s)
        before, launched = _counts(GEMM.replays), emulate.launches()
        emulate.gemm_log()
        want = []
        n = 0
        for r in range(HOT + 3):
            futs = []
            for i, c in enumerate(cs):
                x, y = (a, b2) if (r + i) % 2 else (a2, b)
                op = K.gemm(c, x, y)
                if r < HOT:
                    assert op.sync_on(s)[0] is c
                else:
                    futs.append(op.submit(s))
                want.append((y.addr, x.addr, c.addr, c.addr))
                n += 1
            assert [f.result()[0] for f in futs] == ([] if r < HOT else cs)
        recorded, replays = (x - y for x, y in zip(_counts(GEMM.replays), before))
        assert (recorded, replays) == (1, n - HOT)  # one recording for every buffer, replayed after it
        assert emulate.launches() - launched == n
        assert emulate.gemm_log() == want
    finally:
        emulate.gemm_by_params(False)


def test_gemm_template_whose_update_fails_gives_way_to_exact_calls(stub_gemm):
    """A template whose update the driver refuses runs that call directly, on its pointers, and
    is retired: its key's calls are recorded as exact calls from then on."""
    from deviceop.kernels._gemm import GEMM
    from deviceop.kernels._gemm_replay import HOT

    a, b, cs, s, emulate = stub_gemm
    for _ in range(HOT + 1):  # the template recorded, then replayed on cs[1]
        K.gemm(cs[0], a, b).sync_on(s)
    K.gemm(cs[1], a, b).sync_on(s)
    emulate.gemm_log()
    recorded = GEMM.replays.recorded
    emulate.fail_next_node_update(1)
    assert K.gemm(cs[0], a, b).sync_on(s)[0] is cs[0]  # (its pointers moved: an update, refused)
    for _ in range(HOT + 1):
        K.gemm(cs[2], a, b).sync_on(s)
    assert emulate.gemm_log() == [(b.addr, a.addr, c.addr, c.addr) for c in [cs[0]] + [cs[2]] * (HOT + 1)]
    assert GEMM.replays.recorded - recorded == 1  # cs[2]'s exact call, once hot


def test_gemm_without_a_template_replays_exact_calls(stub_gemm, monkeypatch):
    """Where the recorded call cannot be made a template (here: the driver cannot list its
    kernels' arguments), each exact call (its pointers too) is recorded once it is hot, and the
    template is not tried again."""
    from deviceop.kernels._gemm import GEMM
    from deviceop.kernels._gemm_replay import HOT

    a, b, cs, s, emulate = stub_gemm
    monkeypatch.setattr(type(s.backend.graphs), "kernel_nodes", lambda self, raw: None)
    before = _counts(GEMM.replays)
    emulate.gemm_log()
    want = []
    for _ in range(2 * HOT + 1):
        for c in cs:
            K.gemm(c, a, b).sync_on(s)
            want.append((b.addr, a.addr, c.addr, c.addr))
    recorded, replays = (x - y for x, y in zip(_counts(GEMM.replays), before))
    # the template is tried at the HOT-th call (the first round's last) and fails; that call is
    # then its exact call's first, the others' come a round later: HOT calls of the last buffer
    # before its recording is replayed, HOT + 1 of each other
    assert recorded == 3 and replays == 3 * (2 * HOT + 1) - (HOT + 2 * (HOT + 1))
    assert emulate.gemm_log() == want


def test_gemm_template_shifts_find_what_they_claim():
    """The recordings' pointer moves keep alignment to 256 bytes, move both halves of a pointer,
    and none of them (in either recording) is a sum or difference of two of them."""
    from deviceop.kernels._gemm_replay import _SHIFTS

    m = (1 << 64) - 1
    for shifts in _SHIFTS:
        assert len(set(shifts)) == 3
        for d in shifts:
            assert d % 256 == 0 and d & 0xFFFFFFFF and d >> 32
        combos = {(x + y) & m for x in shifts for y in shifts} | {(x - y) & m for x in shifts for y in shifts if x != y}
        assert not combos & set(shifts)


def test_gemm_template_spec_finds_the_pointer_words_or_refuses():
    """A template's patches from three recordings: the words that move with a pointer (plus a
    constant), checked against the third; anything else moving refuses."""
    from deviceop.kernels._gemm_replay import _SHIFTS, template_spec

    base = (0x7F0000000000, 0x7F0000100000, 0x7F0000200000)

    def block_of(ptrs, junk=0):
        words = [0x1234, ptrs[1], ptrs[0] + 64, 7, ptrs[2], ptrs[2] + 128, junk]
        return b"".join(w.to_bytes(8, "little") for w in words) + b"\x01\x02\x03"

    def rec(shift, junk=0, memset=(0xAB00, 0, 0, 1, 4, 1)):
        ptrs = tuple(p + d for p, d in zip(base, shift))
        kernel = (0xF00, 0, (2, 3, 1), (128, 1, 1), 1024, True, block_of(ptrs, junk), None)
        return [(2, 0x10, memset), (0, 0x20, kernel)]

    recs = [rec((0, 0, 0)), rec(_SHIFTS[0]), rec(_SHIFTS[1])]
    spec = template_spec(base, recs)
    assert spec is not None and len(spec) == 1
    node, func, kern, grid, block, shmem, by_buffer, data, layout, patches = spec[0]
    assert (node, func, kern, grid, block) == (0x20, 0xF00, 0, (2, 3, 1), (128, 1, 1))
    assert (shmem, by_buffer, layout, data) == (1024, True, None, block_of(base))
    assert patches == [(8, 1, 0), (16, 0, 64), (32, 2, 0), (40, 2, 128)]
    assert template_spec(base, [rec((0, 0, 0)), rec(_SHIFTS[0], junk=1), rec(_SHIFTS[1], junk=1)]) is None
    assert template_spec(base, [recs[0], recs[1], rec(_SHIFTS[1], junk=5)]) is None  # the third disagrees
    moved = rec(_SHIFTS[0], memset=(0xAC00, 0, 0, 1, 4, 1))
    assert template_spec(base, [recs[0], moved, recs[2]]) is None  # a memset of the call's memory
    assert template_spec(base, [recs[0], recs[1][1:], recs[2]]) is None  # another graph

    def halves(ptrs):  # a pointer's high half beside a flag, its low half on its own
        pa = ptrs[0]
        words = [(pa >> 32 << 32) | 0x55, pa & 0xFFFFFFFF, ptrs[1], ptrs[2]]
        return b"".join(w.to_bytes(8, "little") for w in words)

    def rec2(shift):
        ptrs = tuple(p + d for p, d in zip(base, shift))
        return [(0, 0x20, (0xF00, 0, (1, 1, 1), (32, 1, 1), 0, True, halves(ptrs), None))]

    assert template_spec(base, [rec2((0, 0, 0)), rec2(_SHIFTS[0]), rec2(_SHIFTS[1])]) is None


def test_gemm_batch_runs_call_by_call_until_it_repeats_then_as_one_graph(stub_gemm):
    """A work queue's batch of GEMMs whose batch has not repeated runs call by call, each call
    replayed once it is hot on its own (batches that form by timing keep their calls' replays);
    once the same batch has come HOT times it is recorded as one graph and replayed with one
    launch."""
    from deviceop.kernels._gemm import GEMM
    from deviceop.kernels._gemm_replay import HOT

    a, b, cs, s, emulate = stub_gemm
    recorded = GEMM.replays.recorded
    for _ in range(HOT):  # each call hot and recorded on its own
        for i, c in enumerate(cs):
            K.gemm(c, a, b, alpha=1.0 + i).sync_on(s)
    assert GEMM.replays.recorded - recorded == 3
    calls, batches, launched = _counts(GEMM.replays), _counts(GEMM.batch_replays), emulate.launches()
    for r in range(HOT + 2):
        out = _batch(a, b, cs).sync_on(s)
        assert [(ok, o[0]) for ok, o in out] == [(True, c) for c in cs]
        if r < HOT - 1:  # not yet a repeated batch: each call its own replay
            assert GEMM.replays.replays - calls[1] == 3 * (r + 1)
    assert GEMM.replays.recorded == calls[0]
    recorded, replays = (x - y for x, y in zip(_counts(GEMM.batch_replays), batches))
    assert (recorded, replays) == (1, 2)  # the batch recorded at its HOT-th run, replayed after
    assert emulate.launches() - launched == 3 * (HOT + 2)  # every call ran its kernel once


def test_gemm_batch_keeps_each_calls_outcome_on_the_stub_driver(stub_gemm):
    """A call of a batch that cannot be ordered (its output written on another stream meanwhile,
    under the raise policy) gets its own error; the batch's other calls run, as in ``Each``."""
    from helpers import slow_fill

    a, b, cs, s, emulate = stub_gemm
    other = next(x for x in do.streams() if x is not s)
    launched, policy = emulate.launches(), do.borrow_policy()
    do.set_borrow_policy("raise")
    try:
        fut = slow_fill(cs[1].view(-1), 1.0, 0.3).submit(other)
        out = _batch(a, b, cs).sync_on(s)
        fut.result(timeout=30)
    finally:
        do.set_borrow_policy(policy)
    assert [ok for ok, _ in out] == [True, False, True] and isinstance(out[1][1], do.BorrowError)
    assert emulate.launches() - launched == 1 + 2  # the fill, and the two GEMMs that could run
