"""GPU ``PagedKVCache.attention`` (any number of query tokens per sequence) against the CPU
backend (``fp4cache._numpy_backend.attention``) on the same page bytes.

The CPU backend reads the float32 values ``gather_dequant`` returns and accumulates in
float64 (``tests/test_attention_varlen.py`` checks it against a plain float64
reference); here it writes float32 outputs, so it is exact to ~2^-24 and the error
measured is the GPU's.  Tolerances are ``decode_attention``'s (``tests/test_gpu_attention.py``
explains them: f16 P for the P.V MMA, f32 accumulation, ex2.approx, the output
rounding): per output row (token, query head), the relative 2-norm error over the row
is <= 1e-2 for bf16/f16 outputs and <= 3e-3 for float32 outputs; NaN positions must
match; ``lse`` within ``1e-3 * max(1, |lse|)``; a row that sees no key must be exactly
zeros with ``lse = -inf``.  Outputs are poisoned before every call, so an unwritten row
cannot pass.  Where the contract leaves a row's NaN open (``PagedKVCache.attention``'s
notes: rows of a sequence with a bad page that do not see that page; rows that do not
see a NaN V group of their sequence's last ``n_b`` tokens) the row may be all NaN in
the affected entries or must be within tolerance.

Run on the device: ``PYTHONPATH=. python -m pytest -q tests/test_gpu_attention_varlen.py``.
"""

from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest

import fp4cache
from fp4cache import _numpy_backend as npb
from fp4cache import attention as front

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

from test_gpu_attention import CASES as _decode_cases  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
DT = {"bfloat16": BF16, "float16": np.dtype(np.float16), "float32": np.dtype(np.float32)}
TOL = {"bfloat16": 1e-2, "float16": 1e-2, "float32": 3e-3}


# -- helpers ----------------------------------------------------------------------------------
def make_cache(rng, *, H, T, D, layout="HND", swizzle=True, rule="static6", num_blocks,
               nan_k=(), nan_v=()):
    """A GPU cache whose every slot holds unit-normal K/V with a few outlier channels;
    optional NaN entries (slot, head, d) make their groups NaN."""
    cache = fp4cache.PagedKVCache(num_blocks, T, H, D, layout=layout, scale_rule=rule,
                                  k_scale=8.0 * 4.5 / (6 * 448), v_scale=4.5 / (6 * 448),
                                  swizzle_v_scales=swizzle, device="cuda")
    n = num_blocks * T
    k = rng.standard_normal((n, H, D), dtype=np.float32)
    v = rng.standard_normal((n, H, D), dtype=np.float32)
    ch = rng.choice(D, size=max(1, D // 32), replace=False)
    k[:, :, ch] *= 8.0
    v[:, :, ch[:1]] *= 4.0
    for t, h, d in nan_k:
        k[t, h, d] = np.nan
    for t, h, d in nan_v:
        v[t, h, d] = np.nan
    cache.store(cp.arange(n, dtype=cp.int64), cp.asarray(k), cp.asarray(v))
    return cache


def tables_for(rng, lens, T, num_blocks, max_blocks, itype=np.int32):
    """Distinct random pages per sequence while the pool lasts, -1 past each one's pages."""
    tab = np.full((len(lens), max_blocks), -1, dtype=itype)
    perm = rng.permutation(num_blocks)
    pos = 0
    for b, L in enumerate(lens):
        need = -(-int(L) // T)
        if pos + need <= num_blocks:
            tab[b, :need] = perm[pos:pos + need]
            pos += need
        else:
            tab[b, :need] = rng.integers(0, num_blocks, need)
    return tab


def starts_of(nq, itype=np.int32):
    return np.concatenate([[0], np.cumsum(nq)]).astype(itype)


def cpu_reference(cache, q, qsl, tab, lens, *, causal=True, sm_scale=None):
    """The CPU backend on the GPU cache's page bytes: float32 (out, lse) and the number of
    bad block ids it counted."""
    D = cache.head_dim
    scale = np.float32(1 / np.sqrt(D) if sm_scale is None else sm_scale)
    out = np.empty(q.shape, np.float32)
    lse = np.empty(q.shape[:2], np.float32)
    stats = np.zeros_like(cp.asnumpy(cache._stats))
    npb.attention(cp.asnumpy(cache.buffer), np.asarray(q), np.asarray(qsl), np.asarray(tab),
                  np.asarray(lens), out, lse, geom=cache.geometry, k_s=cache._k_s,
                  v_s=cache._v_s, sm_scale=scale, stats=stats, causal=causal)
    return out, lse, int(stats[fp4cache._abi.STAT["bad_block_ids"]])


def poisoned(shape, dtype):
    a = cp.empty(shape, dtype=dtype)
    a.view(cp.uint8).fill(0x7E)
    return a


def check(out, lse, ref_out, ref_lse, dtname, what="", maybe_nan=None):
    """The module docstring's bounds; ``maybe_nan`` (bool, ``out``'s shape): entries that
    may be NaN on the GPU although the CPU computed them (then the whole (token, head)
    row is compared on its other entries)."""
    got = cp.asnumpy(out).astype(np.float64)
    ref = ref_out.astype(np.float64)
    gn, rn = np.isnan(got), np.isnan(ref)
    allowed = rn if maybe_nan is None else rn | (maybe_nan & gn)
    assert np.array_equal(gn, allowed), (
        f"{what}: NaN positions differ: gpu {gn.sum()} ref {rn.sum()}, first "
        f"{np.argwhere(gn != allowed)[:4].tolist()}")
    skip = gn | rn
    g = np.where(skip, 0.0, got)
    r = np.where(skip, 0.0, ref)
    num = np.sqrt(((g - r) ** 2).sum(-1))
    den = np.sqrt((r ** 2).sum(-1))
    rel = np.where(den > 0, num / np.maximum(den, 1e-300), num)
    worst = np.unravel_index(int(np.argmax(rel)), rel.shape)
    assert rel.max() <= TOL[dtname], f"{what}: row {worst} relative error {rel.max():.3g}"
    empty = np.isneginf(ref_lse)
    assert not got[empty].any(), f"{what}: a row that sees no key is not zeros"
    if lse is not None:
        gl = cp.asnumpy(lse).astype(np.float64)
        lnan = np.isnan(gl)
        want_nan = np.isnan(ref_lse)
        if maybe_nan is not None:
            want_nan = want_nan | (maybe_nan.any(-1) & lnan)
        assert np.array_equal(lnan, want_nan), f"{what}: lse NaN positions differ"
        assert np.array_equal(np.isneginf(gl), empty), f"{what}: lse -inf positions differ"
        fin = np.isfinite(ref_lse) & ~lnan
        err = np.abs(gl[fin] - ref_lse[fin])
        assert (err <= 1e-3 * np.maximum(1.0, np.abs(ref_lse[fin]))).all(), \
            f"{what}: lse error {err.max():.3g}"
    return float(rel.max())


def call(cache, q, qsl, tab, lens, **kw):
    """The public method with poisoned out / lse_out; returns (out, lse)."""
    out = poisoned(q.shape, q.dtype)
    lse = poisoned(q.shape[:2], np.float32)
    got = cache.attention(cp.asarray(q), cp.asarray(qsl), cp.asarray(tab), cp.asarray(lens),
                          out=out, lse_out=lse, return_lse=True, **kw)
    assert got[0] is out and got[1] is lse
    return out, lse


def make_q(rng, N, Hq, D, dtname):
    return (rng.standard_normal((N, Hq, D), dtype=np.float32) * 1.5).astype(DT[dtname])


#: A ragged batch: the issue's query counts, a whole prefill chunk from the start (24 of
#: 24), and lengths at and across page edges (scaled by T below).
NQ = [0, 1, 2, 5, 16, 100, 1, 3, 24]


def ragged_lens(T):
    base = [5, 1, T, T + 1, 2 * T + 3, 130 + T, 3 * T, 7, 24]
    return [max(b, n) for b, n in zip(base, NQ)]


# (H, T, D, layout, swizzle, rule, group, dtype): the first 14 of the decode tests' shapes,
# plus four of its own
CASES = _decode_cases[:14] + [
    (2, 16, 128, "HND", True, "static6", 1, "bfloat16"),
    (2, 16, 64, "NHD", True, "static6", 2, "float16"),
    (3, 32, 64, "HND", False, "4over6", 7, "bfloat16"),
    (2, 16, 128, "HND", True, "static6", 8, "float32"),
]


# -- the values ---------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_ragged_batch_matches_cpu_backend(case):
    """Both masks, with max_query_len given and omitted (one synchronization), int32 and
    int64 index arrays."""
    H, T, D, layout, swizzle, rule, group, dtname = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    lens = ragged_lens(T)
    max_blocks = -(-max(lens) // T) + 2
    num_blocks = sum(-(-L // T) for L in lens) + 3
    cache = make_cache(rng, H=H, T=T, D=D, layout=layout, swizzle=swizzle, rule=rule,
                       num_blocks=num_blocks)
    itype = np.int64 if D == 64 else np.int32
    tab = tables_for(rng, lens, T, num_blocks, max_blocks, itype)
    qsl = starts_of(NQ, np.int32 if D == 64 else np.int64)
    lens_a = np.array(lens, dtype=np.int32 if D != 128 else np.int64)
    q = make_q(rng, int(qsl[-1]), H * group, D, dtname)
    for causal in (True, False):
        ro, rl, _ = cpu_reference(cache, q, qsl, tab, lens_a, causal=causal)
        for bound in (max(NQ), None, 4 * max(NQ)):
            out, lse = call(cache, q, qsl, tab, lens_a, causal=causal, max_query_len=bound)
            check(out, lse, ro, rl, dtname, f"{case} causal={causal} bound={bound}")
    assert cache.stats["bad_block_ids"] == 0


@pytest.mark.parametrize("nq", [2, 4, 8, 16])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_speculative_verification(nq, group):
    """n query tokens for every sequence (n x group from 2 to 128 rows per KV head),
    long cached sequences (split over the GPU), bf16."""
    rng = np.random.default_rng(100 * nq + group)
    H, T, D = 4, 16, 128
    lens = [3000, 777, 4099, nq]
    num_blocks = sum(-(-L // T) for L in lens) + 1
    cache = make_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks)
    tab = tables_for(rng, lens, T, num_blocks, -(-max(lens) // T))
    qsl = starts_of([nq] * len(lens))
    q = make_q(rng, int(qsl[-1]), H * group, D, "bfloat16")
    ro, rl, _ = cpu_reference(cache, q, qsl, tab, lens)
    out, lse = call(cache, q, qsl, tab, np.array(lens, np.int32), max_query_len=nq)
    check(out, lse, ro, rl, "bfloat16", f"spec n={nq} g={group}")


@pytest.mark.parametrize("D,dtname,group", [(128, "bfloat16", 4), (64, "float16", 1),
                                             (256, "float32", 8), (128, "float16", 16)])
def test_chunked_prefill_in_a_mixed_batch(D, dtname, group):
    """A 300-token causal chunk after 1,000 cached tokens next to decodes and a short
    verification: the shapes of vLLM's mixed batches (bench/ measures the large ones)."""
    rng = np.random.default_rng(D + group)
    H, T = 2, 16
    nq = [1, 300, 1, 4, 0, 1]
    lens = [5000, 1300, 1, 1234, 60, 17]
    num_blocks = sum(-(-L // T) for L in lens) + 1
    cache = make_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks)
    tab = tables_for(rng, lens, T, num_blocks, -(-max(lens) // T) + 1)
    qsl = starts_of(nq)
    q = make_q(rng, int(qsl[-1]), H * group, D, dtname)
    for causal in (True, False):
        ro, rl, _ = cpu_reference(cache, q, qsl, tab, lens, causal=causal)
        out, lse = call(cache, q, qsl, tab, np.array(lens), causal=causal, max_query_len=300)
        check(out, lse, ro, rl, dtname, f"mixed D={D} causal={causal}")


@pytest.mark.parametrize("dtname,group", [("bfloat16", 4), ("float32", 16), ("float16", 1)])
def test_all_n_b_one_matches_decode_attention(dtname, group):
    """decode_attention is the n_b = 1 case: both calls against the CPU backend."""
    rng = np.random.default_rng(11 + group)
    H, T, D = 2, 16, 128
    lens = [1, 15, 16, 17, 300, 4097, 2]
    num_blocks = sum(-(-L // T) for L in lens) + 1
    cache = make_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks)
    tab = tables_for(rng, lens, T, num_blocks, -(-max(lens) // T))
    q = make_q(rng, len(lens), H * group, D, dtname)
    qsl = np.arange(len(lens) + 1, dtype=np.int32)
    ro, rl, _ = cpu_reference(cache, q, qsl, tab, lens)
    out, lse = call(cache, q, qsl, tab, np.array(lens, np.int32), max_query_len=1)
    check(out, lse, ro, rl, dtname, "attention n_b = 1")
    dec, dec_lse = cache.decode_attention(cp.asarray(q), cp.asarray(tab),
                                          cp.asarray(np.array(lens, np.int32)),
                                          return_lse=True)
    check(dec, dec_lse, ro, rl, dtname, "decode_attention")


def test_rows_that_see_no_key_without_validation():
    """n_b > seq_lens[b] is not checked on the GPU without validation: the rows that see
    no key give zeros and lse = -inf, the others the CPU backend's values; nothing else
    is touched (a sequence of length 0 with queries included)."""
    rng = np.random.default_rng(12)
    H, T, D, group = 2, 16, 128, 4
    nq = [5, 20, 3, 1]
    lens = [3, 40, 0, 9]  # sequence 0: rows 0, 1 see nothing; sequence 2: no row sees a key
    num_blocks = 8
    cache = make_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks)
    tab = tables_for(rng, lens, T, num_blocks, 3)
    qsl = starts_of(nq)
    q = make_q(rng, int(qsl[-1]), H * group, D, "bfloat16")
    ro, rl, _ = cpu_reference(cache, q, qsl, tab, lens)
    empty = np.isneginf(rl).all(axis=1)
    assert empty[[0, 1, 25, 26, 27]].all() and empty.sum() == 5
    out, lse = call(cache, q, qsl, tab, np.array(lens, np.int32), max_query_len=20)
    check(out, lse, ro, rl, "bfloat16", "no key")
    with pytest.raises(ValueError, match="sequence 0 has 5 query tokens"):
        call(cache, q, qsl, tab, np.array(lens, np.int32), validate=True)


def test_bad_block_ids_nan_and_counted():
    """Unvalidated bad ids: every row that sees a token of a bad page is NaN, rows of other
    sequences are exact, rows of that sequence that stop before the page may be NaN;
    each bad used entry of a sequence with queries is counted once; check() raises."""
    rng = np.random.default_rng(13)
    H, T, D, group = 2, 16, 128, 4
    nq = [4, 30, 3, 0, 200]
    lens = [100, 3000, 50, 40, 400]
    num_blocks = sum(-(-L // T) for L in lens) + 2
    cache = make_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks)
    tab = tables_for(rng, lens, T, num_blocks, -(-max(lens) // T) + 2)
    tab[0, 2] = num_blocks + 5      # used, seen by every row of sequence 0
    tab[1, 150] = -3                # used, long sequence: every row sees it
    tab[1, 186] = 2**31 - 1         # used: tokens 2976..2991, seen by rows 6.. of 30
    tab[2, 7] = num_blocks          # past the used pages (50 tokens = 4 pages): ignored
    tab[3, 0] = -1                  # used, but sequence 3 has no queries: never read
    tab[4, 20] = num_blocks + 1     # tokens 320..335: seen by rows 120.. of 200
    qsl = starts_of(nq)
    q = make_q(rng, int(qsl[-1]), H * group, D, "bfloat16")
    ro, rl, count = cpu_reference(cache, q, qsl, tab, lens)
    assert count == 4
    seq = np.repeat(np.arange(len(nq)), nq)
    nan_rows = np.isnan(ro).all(axis=(1, 2))
    assert nan_rows[seq == 0].all() and nan_rows[seq == 1].all() and not nan_rows[seq == 2].any()
    assert nan_rows[seq == 4].sum() == 80  # rows 120..199
    maybe = np.broadcast_to((seq == 4)[:, None, None], ro.shape)  # rows 0..119 of seq 4
    cache.reset_counters()
    out, lse = call(cache, q, qsl, tab, np.array(lens), max_query_len=200)
    check(out, lse, ro, rl, "bfloat16", "bad ids", maybe_nan=maybe)
    assert cache.stats["bad_block_ids"] == count
    with pytest.raises(IndexError, match="4 block id"):
        cache.check()


def test_nan_groups_propagate():
    """A K group stored as NaN in a token every row of its sequence sees: the outputs of
    that KV head's query heads are NaN in every row; a V group in the last n_b tokens:
    those 16 channels in the rows that see it (rows of that sequence that do not see it
    may be NaN there too: the contract leaves them open)."""
    rng = np.random.default_rng(14)
    H, T, D, group = 2, 16, 128, 4
    nq = [3, 8, 2]
    lens = [64, 64, 64]
    num_blocks = 12
    # tables below map sequence b to pages 4b .. 4b + 3 in order: slot = 64 b + token
    nan_k = [(5, 1, 3)]             # sequence 0, token 5, head 1: K group 0
    nan_v = [(64 + 60, 0, 70)]      # sequence 1, token 60, head 0: V group 4
    cache = make_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks, nan_k=nan_k, nan_v=nan_v)
    tab = np.arange(12, dtype=np.int32).reshape(3, 4)
    qsl = starts_of(nq)
    q = make_q(rng, int(qsl[-1]), H * group, D, "bfloat16")
    ro, rl, _ = cpu_reference(cache, q, qsl, tab, lens)
    nan = np.isnan(ro)
    assert nan[0:3, group:].all() and not nan[0:3, :group].any()
    # sequence 1's rows see 57..64 keys: rows 4..7 (61..64 keys) see token 60
    assert nan[3 + 4:11, :group, 64:80].all() and not nan[3:3 + 4].any()
    assert nan[3 + 4:11].sum() == 4 * group * 16 and not nan[11:].any()
    maybe = np.zeros(ro.shape, bool)
    maybe[3:3 + 4, :group, 64:80] = True
    out, lse = call(cache, q, qsl, tab, np.array(lens), max_query_len=8)
    check(out, lse, ro, rl, "bfloat16", "nan groups", maybe_nan=maybe)


# -- the front end on the GPU -----------------------------------------------------------------
class _Recorder:
    """Stands in for ``fp4cache._cupy_varlen.attention_runner``: records what the front end
    hands to the backend, once per launch (the prepared launch's arguments with the
    arrays of the call)."""

    def __init__(self):
        self.calls = []

    def __call__(self, buffer, q, query_start_loc, block_tables, seq_lens, **kw):
        def run(q, query_start_loc, block_tables, seq_lens, out, lse):
            self.calls.append(dict(q=q, query_start_loc=query_start_loc,
                                   block_tables=block_tables, seq_lens=seq_lens, out=out,
                                   lse=lse, **kw))

        return run


@pytest.fixture
def recorded(monkeypatch):
    from fp4cache import _cupy_varlen

    rec = _Recorder()
    monkeypatch.setattr(_cupy_varlen, "attention_runner", rec)
    return rec


def test_validate_true_refuses_before_the_backend(recorded):
    cache = fp4cache.PagedKVCache(8, 16, 2, 64, device="cuda")
    q = cp.zeros((5, 4, 64), dtype=cp.float32)
    qsl = cp.asarray(np.array([0, 3, 5], np.int32))
    bt = cp.asarray(np.array([[0, 1], [8, -1]], np.int32))
    buf = cache.buffer.copy()
    with pytest.raises(IndexError, match=r"block_tables\[1, 0\] = 8"):
        cache.attention(q, qsl, bt, cp.asarray([20, 3]), validate=True)
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 33"):
        cache.attention(q, qsl, bt, cp.asarray([33, 0]), validate=True)
    for bad_qsl, pattern in (([1, 3, 5], "must be 0"), ([0, 6, 5], "non-decreasing"),
                             ([0, 3, 4], r"query_start_loc\[-1\]")):
        with pytest.raises(ValueError, match=pattern):
            cache.attention(q, cp.asarray(bad_qsl), bt, cp.asarray([20, 0]), validate=True)
    with pytest.raises(ValueError, match="sequence 1 has 2 query tokens"):
        cache.attention(q, qsl, bt, cp.asarray([20, 0]), validate=True)
    good_bt = np.array([[0, 1], [2, -1]], np.int32)
    with pytest.raises(ValueError, match="max_query_len = 2"):
        cache.attention(q, qsl, good_bt, [20, 16], max_query_len=2, validate=True)
    with pytest.raises(TypeError, match="q must be a CuPy"):
        cache.attention(q.get(), qsl, bt, cp.asarray([20, 16]))
    assert recorded.calls == []
    assert bool((cache.buffer == buf).all())
    bt[1, 0] = 2
    cache.attention(q, qsl, bt, cp.asarray([20, 16]), validate=True)
    cache.attention(q, qsl.get(), bt.get(), [20, 16], causal=False)  # host arrays converted
    assert [c["max_query_len"] for c in recorded.calls] == [3, 3]
    assert recorded.calls[1]["causal"] is False and recorded.calls[0]["causal"] is True


def test_front_end_hands_over_the_arguments_and_takes_the_hot_path(recorded, monkeypatch):
    cache = fp4cache.PagedKVCache(8, 16, 2, 64, device="cuda")
    q = cp.zeros((5, 4, 64), dtype=BF16)
    qsl = cp.asarray(np.array([0, 3, 5], np.int64))
    bt = cp.zeros((2, 2), dtype=cp.int32)
    sl = cp.asarray(np.array([20, 16], np.int32))
    out = cp.empty((5, 4, 64), dtype=BF16)
    lse = cp.empty((5, 4), dtype=cp.float32)
    first = cache.attention(q, qsl, bt, sl, max_query_len=3, out=out, lse_out=lse,
                            return_lse=True)
    assert first[0] is out and first[1] is lse
    checks = []
    real = front._check_q
    monkeypatch.setattr(front, "_check_q", lambda *a: checks.append(1) or real(*a))
    again = cache.attention(q, qsl, bt, sl, max_query_len=3, out=out, lse_out=lse,
                            return_lse=True)
    assert checks == [] and again[0] is out and again[1] is lse
    auto = cache.attention(q, qsl, bt, sl)  # no bound: checked, one sync computes it
    assert checks == [1] and auto.shape == (5, 4, 64) and auto.dtype == BF16
    cache.attention(q, qsl, bt, sl, max_query_len=7, causal=False, sm_scale=0.5)
    assert len(recorded.calls) == 4
    for c in recorded.calls:
        assert c["q"] is q and c["query_start_loc"] is qsl and c["block_tables"] is bt
        assert c["seq_lens"] is sl and c["stats"] is cache._stats
        assert c["scratch"] is cache._state and c["geom"] == cache.geometry
    assert [c["max_query_len"] for c in recorded.calls] == [3, 3, 3, 7]
    assert recorded.calls[3]["causal"] is False and recorded.calls[3]["sm_scale"] == 0.5
    assert recorded.calls[0]["sm_scale"] == float(np.float32(1 / 8))
    assert recorded.calls[0]["out"] is out and recorded.calls[2]["lse"] is None
    with pytest.raises(TypeError, match="out must have dtype bfloat16"):  # changed signature
        cache.attention(q, qsl, bt, sl, max_query_len=3, out=out.astype(cp.float16))
    assert len(recorded.calls) == 4


def test_no_allocation_when_warm():
    rng = np.random.default_rng(15)
    H, T, D, group = 8, 16, 128, 4
    lens = [3000, 900, 17]
    nq = [4, 1, 17]
    num_blocks = sum(-(-L // T) for L in lens)
    cache = make_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks)
    tab = cp.asarray(tables_for(rng, lens, T, num_blocks, -(-max(lens) // T)))
    qsl = cp.asarray(starts_of(nq))
    ld = cp.asarray(np.array(lens, np.int32))
    q = cp.asarray(make_q(rng, sum(nq), H * group, D, "bfloat16"))
    out = cp.empty(q.shape, dtype=BF16)
    lse = cp.empty(q.shape[:2], dtype=cp.float32)
    kw = dict(max_query_len=17, out=out, lse_out=lse, return_lse=True)
    cache.attention(q, qsl, tab, ld, **kw)
    cache.attention(q, qsl, tab, ld, **kw)
    pool = cp.get_default_memory_pool()
    cp.cuda.get_current_stream().synchronize()
    used, nbytes = pool.used_bytes(), cache.nbytes
    cache.attention(q, qsl, tab, ld, **kw)
    cp.cuda.get_current_stream().synchronize()
    assert pool.used_bytes() == used and cache.nbytes == nbytes


def test_cuda_graph_capture_and_replay():
    """Captured once through the public method (out, lse_out and max_query_len given),
    replayed with new q, query_start_loc, lengths and block tables: decodes, a
    speculative batch, a chunk and a mixed batch of the same num_tokens."""
    rng = np.random.default_rng(16)
    H, T, D, group = 8, 16, 128, 4
    B, N, bound, max_blocks = 4, 64, 61, 300
    num_blocks = B * max_blocks
    cache = make_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks)
    qd = cp.empty((N, H * group, D), dtype=BF16)
    qsld = cp.empty((B + 1,), dtype=cp.int32)
    td = cp.empty((B, max_blocks), dtype=cp.int32)
    ld = cp.empty((B,), dtype=cp.int32)
    out = cp.empty((N, H * group, D), dtype=BF16)
    lse = cp.empty((N, H * group), dtype=cp.float32)
    kw = dict(max_query_len=bound, out=out, lse_out=lse, return_lse=True)
    steps = [  # (query counts summing to N, lengths >= them)
        ([16, 16, 16, 16], [4000, 16, 300, 4799]),
        ([1, 1, 1, 61], [4800, 2, 999, 61]),
        ([61, 0, 2, 1], [3000, 7, 2, 1]),
        ([4, 4, 4, 52], [17, 4096, 4, 1000]),
    ]
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        nq, lens = steps[0]
        qsld[...] = cp.asarray(starts_of(nq))
        td[...] = cp.asarray(tables_for(rng, lens, T, num_blocks, max_blocks))
        ld[...] = cp.asarray(np.array(lens, np.int32))
        qd[...] = cp.asarray(make_q(rng, N, H * group, D, "bfloat16"))
        cache.attention(qd, qsld, td, ld, **kw)  # checked call and warm-up
        cache.attention(qd, qsld, td, ld, **kw)
        stream.synchronize()
        stream.begin_capture()
        cache.attention(qd, qsld, td, ld, **kw)
        graph = stream.end_capture()
    for rep, (nq, lens) in enumerate(steps + steps[:1]):
        q = make_q(rng, N, H * group, D, "bfloat16")
        qsl = starts_of(nq)
        tab = tables_for(rng, lens, T, num_blocks, max_blocks)
        with stream:
            qd[...] = cp.asarray(q)
            qsld[...] = cp.asarray(qsl)
            td[...] = cp.asarray(tab)
            ld[...] = cp.asarray(np.array(lens, np.int32))
            out.view(cp.uint16).fill(0x7E7E)
            lse.fill(12345.0)
            graph.launch(stream)
        stream.synchronize()
        ro, rl, _ = cpu_reference(cache, q, qsl, tab, lens)
        check(out, lse, ro, rl, "bfloat16", f"replay {rep} nq={nq}")
