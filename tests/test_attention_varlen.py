"""``PagedKVCache.attention`` (any number of query tokens per sequence) on the CPU backend,
against an independent float64 reference.

The reference (``reference`` below) is written plainly, one query row at a time: the
float32 K/V values that ``gather_dequant`` returns for the sequence's pages, cut to the
keys the row sees (``seq_lens[b] - n_b + i + 1`` with ``causal``, else ``seq_lens[b]``),
and a float64 softmax per query head with KV head ``hq // (Hq // H)``.

Tolerances: those of ``tests/test_attention.py`` (``assert_close``, ``assert_lse_close``),
for the same reason.  The backend reads the same float32 values and accumulates in
float64, so it differs from the reference only by float64 rounding order (~1e-15 of a
row's magnitude) before both are rounded to q's dtype: each element must be within
``2 u |ref| + 1e-9 max|ref row|`` (``u`` the unit roundoff of q's dtype; doubled for the
float64 -> float32 -> dtype double rounding; plus 2^-24 for float16's subnormals), and
``lse`` (float32) within ``2^-23 |ref| + 1e-9``.  A row that sees one key too many or
too few, a query row paired with the wrong sequence or head, a wrong page or float32
accumulation over long rows all break these bounds.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import DEVICES, DLPackProducer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_attention import (
    BF16,
    DTYPES,
    F16,
    F32,
    assert_close,
    assert_lse_close,
    make_cache,
    make_q,
    make_tables,
)

import fp4cache
from fp4cache import PagedKVCache
from fp4cache import _numpy_backend as npb


# -- helpers ----------------------------------------------------------------------------------
def starts_of(nq) -> np.ndarray:
    """``query_start_loc`` of per-sequence query counts."""
    return np.concatenate([[0], np.cumsum(nq, dtype=np.int64)]).astype(np.int32)


def reference(cache, q, qsl, tables, lens, *, causal=True, sm_scale=None):
    """float64 attention of each query row over the keys it sees (module docstring);
    rows that see no key give zeros and lse -inf; a bad page in a row's keys gives NaN."""
    N, Hq, D = q.shape
    H, T = cache.num_heads, cache.block_size
    group = Hq // H
    scale = float(np.float32(1.0 / math.sqrt(D) if sm_scale is None else sm_scale))
    out = np.zeros((N, Hq, D))
    lse = np.full((N, Hq), -np.inf)
    kv_head = np.arange(Hq) // group
    for b in range(len(qsl) - 1):
        n_b, L = int(qsl[b + 1] - qsl[b]), int(lens[b])
        if n_b == 0 or L == 0:
            continue
        pages = np.asarray(tables[b, : -(-L // T)])
        bad = (pages < 0) | (pages >= cache.num_blocks)
        k, v = cache.gather_dequant(np.where(bad, 0, pages), dtype="float32")
        k, v = k.astype(np.float64), v.astype(np.float64)
        k[np.repeat(bad, T)] = np.nan  # a page outside the pool reads as NaN
        v[np.repeat(bad, T)] = np.nan
        for i in range(n_b):
            row = int(qsl[b]) + i
            see = L - n_b + i + 1 if causal else L
            if see <= 0:
                continue
            kk = k[:see][:, kv_head]  # [see, Hq, D]
            vv = v[:see][:, kv_head]
            with np.errstate(invalid="ignore"):
                s = scale * np.einsum("thd,hd->ht", kk, q[row].astype(np.float64))
                top = s.max(axis=1, keepdims=True)
                w = np.exp(s - top)
                out[row] = np.einsum("ht,thd->hd", w, vv) / w.sum(axis=1)[:, None]
                lse[row] = top[:, 0] + np.log(w.sum(axis=1))
    return out, lse


def run_and_compare(cache, nq, lens, *, Hq=4, dtype=F32, causal=True, sm_scale=None,
                    max_blocks=None, seed=2, **kw):
    """Random tables and q for query counts ``nq`` and lengths ``lens``; the call on the
    cache against the reference; the buffer is left unchanged."""
    tables, lens = make_tables(cache, lens, max_blocks=max_blocks, seed=seed)
    qsl = starts_of(nq)
    q = make_q(int(qsl[-1]), Hq, cache.head_dim, dtype, seed=seed + 1)
    buf = cache.buffer.copy()
    out, lse = cache.attention(q, qsl, tables, lens, causal=causal, sm_scale=sm_scale,
                               return_lse=True, **kw)
    ref_out, ref_lse = reference(cache, q, qsl, tables, lens, causal=causal,
                                 sm_scale=sm_scale)
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    assert_close(out, ref_out, q.dtype)
    assert_lse_close(lse, ref_lse)
    assert np.array_equal(cache.buffer, buf), "attention changed the cache buffer"
    return q, qsl, tables, lens, out, lse


#: Query counts (each of the issue's n_b) and cache lengths of a ragged batch, lengths
#: at and across page edges of 16-token pages; every length >= its query count.
RAGGED_NQ = [0, 1, 2, 5, 16, 100, 1, 5]
RAGGED_LENS = [13, 1, 16, 17, 32, 130, 0 + 48, 5]


# -- the values ---------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("rule", ["static6", "4over6"])
def test_ragged_batch(causal, layout, rule):
    cache = make_cache(layout=layout, scale_rule=rule, k_scale=0.02, v_scale=0.5)
    run_and_compare(cache, RAGGED_NQ, RAGGED_LENS, Hq=8, causal=causal)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("causal", [True, False])
def test_group_sizes(group, causal):
    cache = make_cache(num_heads=3)
    run_and_compare(cache, [2, 16, 0, 5], [37, 16, 9, 130], Hq=3 * group, causal=causal)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_head_dims(head_dim, layout):
    cache = make_cache(num_blocks=12, block_size=8, num_heads=2, head_dim=head_dim,
                       layout=layout)
    run_and_compare(cache, [5, 1, 16, 2], [8, 41, 16, 80], Hq=4)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_q_dtypes(dtype):
    cache = make_cache()
    *_, out, _ = run_and_compare(cache, [3, 1, 16], [50, 1, 16], dtype=DTYPES[dtype])
    assert out.dtype == DTYPES[dtype]


@pytest.mark.parametrize("block_size,swizzle", [(1, False), (5, False), (8, True),
                                                (16, True), (32, True)])
def test_causal_windows_across_page_edges(block_size, swizzle):
    """Query counts that put each row's last key just before, on and after page edges:
    with n_b = T + 1 after one page, the rows' windows end on every slot of two pages."""
    T = block_size
    cache = make_cache(num_blocks=max(8, 96 // T), block_size=T, swizzle_v_scales=swizzle)
    nq = [T + 1, T, 1, 2, T + 2]
    lens = [2 * T + 1, T, T + 1, 2 * T, 3 * T]
    run_and_compare(cache, nq, lens, causal=True)


def test_whole_prefill_row_zero_sees_only_the_first_token():
    """n_b = seq_len (a prefill chunk from the start): row 0's softmax has one key, so its
    output is that token's V exactly and its lse is that one score."""
    cache = make_cache()
    q, qsl, tables, lens, out, lse = run_and_compare(cache, [40], [40], Hq=4)
    k, v = cache.gather_dequant(tables[0, :1], dtype="float32")
    for hq in range(4):
        assert np.array_equal(out[0, hq], v[0, hq // 2])
        score = np.float32(1 / 8) * (k[0, hq // 2].astype(np.float64) @ q[0, hq])
        assert lse[0, hq] == pytest.approx(score, rel=1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_all_n_b_one_equals_decode_attention(causal):
    """decode_attention is the n_b = 1 case: the same bits (both are one backend).  A
    length of 0 with a query is decode's empty sequence, but with causal=True it breaks
    n_b <= seq_lens[b] (refused): it is only in the non-causal batch."""
    cache = make_cache()
    tables, lens = make_tables(cache, [1, 15, 16, 17, 1 if causal else 0, 100])
    q = make_q(6, 8, 64, BF16)
    dec, dec_lse = cache.decode_attention(q, tables, lens, return_lse=True)
    got, got_lse = cache.attention(q, np.arange(7), tables, lens, causal=causal,
                                   max_query_len=1, return_lse=True)
    assert np.array_equal(got.view(np.uint16), dec.view(np.uint16))
    assert np.array_equal(got_lse, dec_lse)


def test_causal_last_row_equals_non_causal():
    """The last query of a sequence sees every key with or without the causal mask."""
    cache = make_cache()
    nq, lens = [5, 16, 2], [40, 16, 90]
    tables, lens = make_tables(cache, lens)
    qsl = starts_of(nq)
    q = make_q(int(qsl[-1]), 4, 64)
    a = cache.attention(q, qsl, tables, lens, causal=True)
    b = cache.attention(q, qsl, tables, lens, causal=False)
    last = qsl[1:] - 1
    np.testing.assert_allclose(a[last], b[last], rtol=1e-6, atol=1e-7)
    assert not np.allclose(a[qsl[0]], b[qsl[0]])  # the first rows differ


def test_small_items_and_chunks(monkeypatch):
    """The backend cuts sequences into items of query rows and merges chunks of pages:
    force 3-row items and one page per chunk."""
    monkeypatch.setattr(npb, "_ATTN_ITEM_ROWS", 3)
    monkeypatch.setattr(npb, "_ATTN_CHUNK_VALUES", 1)
    cache = make_cache(num_blocks=30, block_size=4)
    for causal in (True, False):
        run_and_compare(cache, [7, 0, 1, 3, 16], [45, 4, 1, 13, 16], dtype=BF16,
                        causal=causal)


def test_long_chunked_prefill_and_sm_scale():
    """A 300-token chunk after 2,000 cached tokens with a peaky softmax, next to decodes."""
    cache = make_cache(num_blocks=160, block_size=16)
    q_scale = 3.0
    tables, lens = make_tables(cache, [2300, 70, 1])
    qsl = starts_of([300, 1, 1])
    q = make_q(302, 4, 64) * q_scale
    out, lse = cache.attention(q, qsl, tables, lens, sm_scale=0.3, return_lse=True)
    ref_out, ref_lse = reference(cache, q, qsl, tables, lens, sm_scale=0.3)
    assert_close(out, ref_out, F32)
    assert_lse_close(lse, ref_lse)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_configurations(data):
    """Layout, swizzle, rule, head_dim, block size, heads, group, dtype, causal, query
    counts and lengths drawn together."""
    swizzle = data.draw(st.booleans(), "swizzle")
    head_dim = data.draw(st.sampled_from([64, 128] if swizzle else [16, 48, 64]), "D")
    block_size = data.draw(st.sampled_from([4, 8, 12] if swizzle else [1, 3, 8]), "T")
    heads = data.draw(st.integers(1, 3), "H")
    group = data.draw(st.sampled_from([1, 2, 3, 4, 8, 16]), "group")
    cache = make_cache(num_blocks=12, block_size=block_size, num_heads=heads,
                       head_dim=head_dim, swizzle_v_scales=swizzle,
                       layout=data.draw(st.sampled_from(["HND", "NHD"]), "layout"),
                       scale_rule=data.draw(st.sampled_from(["static6", "4over6"]), "rule"),
                       seed=data.draw(st.integers(0, 2**16), "seed"))
    causal = data.draw(st.booleans(), "causal")
    lens = data.draw(st.lists(st.integers(0, 12 * block_size), min_size=1, max_size=4), "lens")
    nq = [data.draw(st.integers(0, min(n, 20) if causal else 20), "n_b") for n in lens]
    dtype = DTYPES[data.draw(st.sampled_from(list(DTYPES)), "dtype")]
    run_and_compare(cache, nq, lens, Hq=heads * group, dtype=dtype, causal=causal,
                    sm_scale=data.draw(st.sampled_from([None, 0.05, 1.0]), "sm_scale"),
                    seed=data.draw(st.integers(0, 2**16), "tables"))


def test_no_queries():
    """n_b = 0 for every sequence (num_tokens 0), and no sequence at all."""
    cache = make_cache()
    tables, lens = make_tables(cache, [20, 0, 7])
    q = np.zeros((0, 4, 64), np.float32)
    out, lse = cache.attention(q, np.zeros(4, np.int64), tables, lens, return_lse=True)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)
    out = cache.attention(q, np.zeros(1, np.int32), np.zeros((0, 2), np.int32),
                          np.zeros(0, np.int32))
    assert out.shape == (0, 4, 64)
    assert cache.stats["bad_block_ids"] == 0


def test_length_zero_without_causal_gives_zeros_and_minus_inf():
    cache = make_cache()
    tables = np.array([[-1, -1], [3, 4]], np.int32)
    qsl = starts_of([3, 2])
    out, lse = cache.attention(make_q(5, 4, 64), qsl, tables, np.array([0, 20]),
                               causal=False, return_lse=True)
    assert not out[:3].any() and np.isneginf(lse[:3]).all()
    assert np.isfinite(out[3:]).all() and np.isfinite(lse[3:]).all()


def test_backend_rows_that_see_no_key():
    """n_b > seq_lens[b] (refused by the front end; the GPU's unvalidated behaviour): the
    backend gives zeros and lse = -inf for the rows that see no key, and the reference's
    values for the others."""
    cache = make_cache()
    tables, lens = make_tables(cache, [3, 20, 0])
    nq = [5, 2, 2]  # rows 0, 1 of sequence 0 and both rows of sequence 2 see nothing
    qsl = starts_of(nq)
    q = make_q(9, 4, 64)
    out = np.full(q.shape, 7, np.float32)
    lse = np.full(q.shape[:2], 7, np.float32)
    npb.attention(cache.buffer, q, qsl, tables, lens, out, lse, geom=cache.geometry,
                  k_s=cache._k_s, v_s=cache._v_s, sm_scale=np.float32(1 / 8),
                  stats=cache._stats, causal=True, max_query_len=5)
    ref_out, ref_lse = reference(cache, q, qsl, tables, lens)
    none = [0, 1, 7, 8]
    assert not out[none].any() and np.isneginf(lse[none]).all()
    assert np.isneginf(ref_lse[none]).all()
    assert_close(out, ref_out, F32)
    assert_lse_close(lse, ref_lse)


def test_sequences_sharing_pages():
    """Two sequences on the same pages (a shared prefix) with the same queries: rows
    that see the same keys give the same bits."""
    cache = make_cache(block_size=8)
    tables = np.array([[3, 7, 1, -1], [3, 7, 1, 2]], np.int64)
    q1 = make_q(4, 4, 64)
    q = np.concatenate([q1, q1])
    out = cache.attention(q, starts_of([4, 4]), tables, np.array([24, 24]))
    assert np.array_equal(out[:4], out[4:])


def test_default_sm_scale_and_max_query_len_bounds():
    cache = make_cache(head_dim=128)
    tables, lens = make_tables(cache, [70, 9])
    qsl = starts_of([4, 1])
    q = make_q(5, 2, 128)
    default = cache.attention(q, qsl, tables, lens)
    assert np.array_equal(default, cache.attention(q, qsl, tables, lens,
                                                   sm_scale=1 / math.sqrt(128)))
    assert not np.allclose(default, cache.attention(q, qsl, tables, lens, sm_scale=0.5))
    for bound in (4, 5, 1000, np.int64(4)):  # any bound >= the longest n_b
        assert np.array_equal(default, cache.attention(q, qsl, tables, lens,
                                                       max_query_len=bound))


def test_dlpack_lists_and_non_contiguous_inputs():
    cache = make_cache()
    tables, lens = make_tables(cache, [33, 2, 64])
    qsl = starts_of([3, 2, 5])
    q = make_q(10, 4, 64)
    want = cache.attention(q, qsl, tables, lens)
    got = cache.attention(DLPackProducer(q), DLPackProducer(qsl), DLPackProducer(tables),
                          DLPackProducer(lens))
    assert np.array_equal(got, want)
    assert np.array_equal(cache.attention(q, qsl.tolist(), tables, lens.tolist()), want)
    wide = np.zeros((10, 8, 64), np.float32)
    wide[:, ::2] = q
    wide_qsl = np.zeros(8, np.int64)
    wide_qsl[::2] = qsl
    got = cache.attention(wide[:, ::2], wide_qsl[::2], tables, lens)
    assert np.array_equal(got, want)


# -- bad ids and NaN --------------------------------------------------------------------------
def test_bad_block_ids_refused_by_default_and_deferred_with_validate_false():
    """Validating (the CPU default): IndexError, nothing computed, buffer and counters
    unchanged.  validate=False does what the GPU does: the rows that see a token of a bad
    page are NaN, other rows exact, each bad used entry of a sequence with queries counted
    once, and check() raises."""
    T = 8
    cache = make_cache(num_blocks=10, block_size=T)
    tables = np.array([[1, 2, 99], [4, -3, -1], [5, 6, 7], [8, 0, -7]], np.int32)
    lens = np.array([20, 12, 24, 3])
    # seq 0: 4 causal rows see 17..20 keys, all reach page 99 (tokens 16..19)
    # seq 1: bad entry at column 1 (tokens 8..11): the rows seeing 7 and 8 keys are exact
    # seq 2: no bad page; seq 3: no queries (its bad entry is past ceil(3 / 8) anyway)
    nq = [4, 6, 3, 0]
    qsl = starts_of(nq)
    q = make_q(13, 4, 64)
    buf, stats = cache.buffer.copy(), cache.stats
    with pytest.raises(IndexError, match=r"block_tables\[0, 2\] = 99"):
        cache.attention(q, qsl, tables, lens)
    assert np.array_equal(cache.buffer, buf) and cache.stats == stats
    out, lse = cache.attention(q, qsl, tables, lens, return_lse=True, validate=False)
    ref_out, ref_lse = reference(cache, q, qsl, tables, lens)
    sees = [True] * 4 + [lens[1] - 6 + i + 1 > T for i in range(6)] + [False] * 3
    assert sees[4:10] == [False, False, True, True, True, True]  # 7..12 keys
    assert np.array_equal(np.isnan(out).all(axis=(1, 2)), np.array(sees))
    assert np.array_equal(np.isnan(lse).all(axis=1), np.array(sees))
    good = ~np.array(sees)
    assert_close(out[good], ref_out[good], F32)
    assert_lse_close(lse[good], ref_lse[good])
    assert np.isnan(ref_out[~good]).all()
    assert cache.stats["bad_block_ids"] == 2
    with pytest.raises(IndexError, match="2 block id"):
        cache.check()
    assert np.array_equal(cache.buffer, buf)


def test_bad_ids_in_a_sequence_without_queries_are_neither_validated_nor_counted():
    """Validation checks the ids the call reads, as the unvalidated path counts them: a
    sequence without query tokens reads none of its row."""
    cache = make_cache()
    tables = np.array([[0, 1], [50, -1]], np.int32)
    q = make_q(2, 4, 64)
    checked = cache.attention(q, starts_of([2, 0]), tables, np.array([20, 3]))
    unchecked = cache.attention(q, starts_of([2, 0]), tables, np.array([20, 3]),
                                validate=False)
    assert np.array_equal(checked, unchecked)
    assert cache.stats["bad_block_ids"] == 0  # never read: not counted
    with pytest.raises(IndexError, match=r"block_tables\[1, 0\] = 50"):  # read: refused
        cache.attention(q, starts_of([1, 1]), tables, np.array([20, 3]))


def test_nan_groups_reach_the_rows_that_see_them():
    """A K group stored as NaN: every output of the query heads of its KV head is NaN in
    the rows that see that token (and only those: a causal row that stops before it is
    exact); a V group: those 16 channels."""
    H, group, T = 2, 2, 8
    cache = make_cache(num_blocks=6, block_size=T, num_heads=H)
    k = np.ones((2, H, 64), np.float32)
    v = np.ones((2, H, 64), np.float32)
    k[0, 1, 3] = np.nan   # slot 13: page 1, token 5 -> K of head 1, group 0
    v[1, 0, 40] = np.inf  # slot 34: page 4, token 2 -> V of head 0, group 2
    cache.store(np.array([13, 34]), k, v)
    tables = np.array([[1, 2], [4, 5]])
    lens = np.array([8, 12])
    nq = [4, 11]  # seq 0 rows see 5..8 keys; seq 1 rows see 2..12 keys
    qsl = starts_of(nq)
    q = make_q(15, H * group, 64)
    out, lse = cache.attention(q, qsl, tables, lens, return_lse=True)
    nan = np.isnan(out)
    # seq 0: token 5 is seen by rows 1..3 (6..8 keys): query heads 2, 3 all NaN there
    assert not nan[0].any() and np.isfinite(lse[0]).all()
    assert nan[1:4, 2:].all() and not nan[1:4, :2].any() and np.isnan(lse[1:4, 2:]).all()
    # seq 1: token 2 is seen by rows with >= 3 keys (rows 1..10): heads 0, 1, ch 32..47
    want = np.zeros((11, H * group, 64), bool)
    want[1:, :2, 32:48] = True
    assert np.array_equal(nan[4:], want) and np.isfinite(lse[4:]).all()
    ref_out, _ = reference(cache, q, qsl, tables, lens)
    assert np.array_equal(np.isnan(ref_out), nan)
    assert_close(np.where(nan, 0, out).astype(F32), np.where(nan, 0, ref_out), F32)


# -- out= and lse_out= ------------------------------------------------------------------------
def test_out_and_lse_out_are_written_and_returned():
    cache = make_cache()
    tables, lens = make_tables(cache, [40, 0, 5])
    qsl = starts_of([3, 0, 2])
    q = make_q(5, 4, 64, BF16)
    want_out, want_lse = cache.attention(q, qsl, tables, lens, return_lse=True)
    out = np.full((5, 4, 64), 7, BF16)
    lse = np.full((5, 4), 7, np.float32)
    got = cache.attention(q, qsl, tables, lens, out=out, lse_out=lse, return_lse=True)
    assert got[0] is out and got[1] is lse
    assert np.array_equal(out.view(np.uint16), want_out.view(np.uint16))
    assert np.array_equal(lse, want_lse)
    out2 = np.empty((5, 4, 64), BF16)
    assert cache.attention(q, qsl, tables, lens, out=out2) is out2


OUT_ERRORS = [
    (dict(out=np.empty((5, 4, 32), BF16)), ValueError, r"out must have shape \(5, 4, 64\)"),
    (dict(out=np.empty((5, 4, 64), np.float32)), TypeError, "out must have dtype bfloat16"),
    (dict(out=np.empty((5, 4, 128), BF16)[..., ::2]), ValueError, "out must be C-contiguous"),
    (dict(lse_out=np.empty((5, 4), np.float32)), ValueError, "lse_out .*return_lse"),
    (dict(lse_out=np.empty((5, 4), np.float64), return_lse=True), TypeError,
     "lse_out must have dtype float32"),
    (dict(lse_out=np.empty((4, 5), np.float32), return_lse=True), ValueError,
     r"lse_out must have shape \(5, 4\)"),
]


@pytest.mark.parametrize("kwargs,exc,pattern", OUT_ERRORS)
def test_out_checks(kwargs, exc, pattern):
    cache = make_cache()
    tables, lens = make_tables(cache, [40, 3])
    buf = cache.buffer.copy()
    with pytest.raises(exc, match=pattern):
        cache.attention(make_q(5, 4, 64, BF16), starts_of([3, 2]), tables, lens, **kwargs)
    assert np.array_equal(cache.buffer, buf)


def test_out_overlapping_q_is_refused():
    cache = make_cache()
    tables, lens = make_tables(cache, [40, 3])
    qsl = starts_of([3, 2])
    q = make_q(5, 4, 64)
    with pytest.raises(ValueError, match="out must not overlap q"):
        cache.attention(q, qsl, tables, lens, out=q)
    with pytest.raises(ValueError, match="lse_out must not overlap"):
        cache.attention(q, qsl, tables, lens, out=q.copy(),
                        lse_out=q.reshape(-1)[:20].reshape(5, 4), return_lse=True)


# -- errors: each names its parameter and leaves the buffer and counters alone ---------------
def _good():
    return dict(q=make_q(5, 4, 64), query_start_loc=np.array([0, 3, 5], np.int32),
                block_tables=np.array([[0, 1, 2], [3, -1, -1]], np.int32),
                seq_lens=np.array([40, 16], np.int32))


ERRORS = [
    # the checks shared with decode_attention
    ("q int32", dict(q=np.zeros((5, 4, 64), np.int32)), TypeError,
     "q must have dtype bfloat16, float16 or float32, got int32"),
    ("q 2-D", dict(q=np.zeros((5, 64), np.float32)), ValueError,
     r"q must be 3-D \(num_tokens, Hq, head_dim\)"),
    ("q head_dim", dict(q=np.zeros((5, 4, 128), np.float32)), ValueError,
     r"q.shape\[2\] must equal the cache's head_dim \(64\), got 128"),
    ("group 32", dict(q=np.zeros((5, 64, 64), np.float32)), ValueError,
     r"Hq = 64.*num_heads \(2\).*between 1 and 16"),
    ("block_tables float", dict(block_tables=np.zeros((2, 3))), TypeError,
     "block_tables must have dtype int32 or int64, got float64"),
    ("block_tables rows", dict(block_tables=np.zeros((3, 3), np.int32)), ValueError,
     r"block_tables must have one row per sequence \(B = 2, from query_start_loc\), got 3"),
    ("seq_lens length", dict(seq_lens=np.zeros(3, np.int32)), ValueError,
     r"seq_lens must have one entry per sequence \(B = 2, from query_start_loc\)"),
    ("seq_lens past capacity", dict(seq_lens=np.array([49, 16])), ValueError,
     r"seq_lens\[0\] = 49 .*\[0, 48\]"),
    ("seq_lens negative", dict(seq_lens=np.array([40, -1])), ValueError,
     r"seq_lens\[1\] = -1 is out of range"),
    ("bad block id", dict(block_tables=np.array([[0, 24, 2], [3, -1, -1]])), IndexError,
     r"block_tables\[0, 1\] = 24 is out of range.*\[0, 24\)"),
    ("sm_scale zero", dict(sm_scale=0.0), ValueError, "sm_scale must be a positive finite"),
    ("sm_scale text", dict(sm_scale="big"), TypeError, "sm_scale"),
    # query_start_loc
    ("qsl float", dict(query_start_loc=np.array([0.0, 3, 5])), TypeError,
     "query_start_loc must have dtype int32 or int64, got float64"),
    ("qsl 2-D", dict(query_start_loc=np.array([[0, 3, 5]])), ValueError,
     r"query_start_loc must be 1-D \(B \+ 1,\)"),
    ("qsl empty", dict(query_start_loc=np.zeros(0, np.int32)), ValueError,
     r"query_start_loc must be 1-D \(B \+ 1,\) with at least one entry"),
    ("qsl not from 0", dict(query_start_loc=np.array([1, 3, 5])), ValueError,
     r"query_start_loc\[0\] must be 0, got 1"),
    ("qsl decreasing", dict(query_start_loc=np.array([0, 6, 5])), ValueError,
     r"non-decreasing: query_start_loc\[2\] = 5 < query_start_loc\[1\] = 6"),
    ("qsl short of num_tokens", dict(query_start_loc=np.array([0, 3, 4])), ValueError,
     r"query_start_loc\[-1\] must equal the number of query tokens \(q.shape\[0\] = 5\), "
     "got 4"),
    ("qsl past num_tokens", dict(query_start_loc=np.array([0, 3, 6])), ValueError,
     r"query_start_loc\[-1\] must equal"),
    ("n_b > seq_len", dict(seq_lens=np.array([2, 16])), ValueError,
     r"sequence 0 has 3 query tokens but seq_lens\[0\] = 2.*causal=True.*n_b <= seq_lens"),
    ("max_query_len too small", dict(max_query_len=2), ValueError,
     r"max_query_len = 2 is smaller than the 3 query tokens of sequence 0"),
    ("max_query_len negative", dict(max_query_len=-1), ValueError, "max_query_len must be >= 0"),
    ("max_query_len float", dict(max_query_len=3.0), TypeError,
     "max_query_len must be a Python or NumPy int"),
    ("max_query_len bool", dict(max_query_len=True), TypeError, "max_query_len"),
    ("causal int", dict(causal=1), TypeError, "causal must be True or False, got 1"),
    ("causal None", dict(causal=None), TypeError, "causal must be True or False"),
]


@pytest.mark.parametrize("case,override,exc,pattern", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors(case, override, exc, pattern):
    cache = make_cache()
    buf = cache.buffer.copy()
    stats = cache.stats
    args = {**_good(), **override}
    with pytest.raises(exc, match=pattern):
        cache.attention(args.pop("q"), args.pop("query_start_loc"), args.pop("block_tables"),
                        args.pop("seq_lens"), **args)
    assert np.array_equal(cache.buffer, buf)
    assert cache.stats == stats


def test_value_checks_on_the_cpu_even_without_validation():
    """The CPU checks lengths, query_start_loc and n_b <= seq_lens always (it has no
    synchronization to save); validate=False defers only the block ids."""
    cache = make_cache()
    g = _good()
    for kw, pattern in ((dict(seq_lens=np.array([100, 1])), r"seq_lens\[0\] = 100"),
                        (dict(seq_lens=np.array([2, 16])), "sequence 0 has 3 query tokens"),
                        (dict(query_start_loc=np.array([0, 3, 4])), "query_start_loc"),
                        (dict(max_query_len=1), "max_query_len = 1")):
        args = {**g, **kw}
        with pytest.raises(ValueError, match=pattern):
            cache.attention(args.pop("q"), args.pop("query_start_loc"),
                            args.pop("block_tables"), args.pop("seq_lens"), validate=False,
                            **args)


def test_n_b_above_seq_len_is_allowed_without_causal():
    """causal=False: every query sees all seq_lens[b] keys, however many queries."""
    cache = make_cache()
    g = _good()
    lens = np.array([2, 1])
    out, lse = cache.attention(g["q"], g["query_start_loc"], g["block_tables"], lens,
                               causal=False, return_lse=True)
    ref_out, ref_lse = reference(cache, g["q"], g["query_start_loc"], g["block_tables"],
                                 lens, causal=False)
    assert_close(out, ref_out, F32)
    assert_lse_close(lse, ref_lse)


def test_good_arguments_pass_and_method_exported():
    cache = make_cache()
    g = _good()
    out = cache.attention(g["q"], g["query_start_loc"], g["block_tables"], g["seq_lens"])
    assert np.isfinite(out).all()
    assert callable(fp4cache.PagedKVCache.attention)
    assert "attention" in fp4cache.attention.__all__


def test_float16_output_dtype_and_bf16_q():
    """Outputs come in q's dtype, also for the rows of a ragged causal batch."""
    cache = make_cache()
    for dt in (F16, BF16):
        *_, out, lse = run_and_compare(cache, [5, 2], [9, 30], dtype=dt)
        assert out.dtype == dt and lse.dtype == np.float32


@pytest.mark.parametrize("device", DEVICES)
def test_a_sequence_without_query_tokens_reads_no_block_id(device):
    """One rule, validated or not, on both backends: a call checks and counts only the
    block ids it reads, and a sequence with n_b = 0 reads none (docs/errors.md)."""
    xp = np if device == "cpu" else pytest.importorskip("cupy")
    c = PagedKVCache(16, 16, 2, 64, device=device)
    ones = xp.ones((256, 2, 64), xp.float32)
    c.store(xp.arange(256), ones, ones)
    q = xp.ones((3, 8, 64), xp.float32)
    tables = np.array([[0, 1, 2], [999, 1, 2]])
    lens = np.array([30, 20])
    before = c.buffer.copy()
    outs = [c.attention(q, np.array([0, 3, 3]), tables, lens, validate=v) for v in (True, False)]
    assert c.stats["bad_block_ids"] == 0
    c.check()  # quiet
    assert xp.array_equal(outs[0], outs[1]) and bool(xp.isfinite(outs[0]).all())
    assert xp.array_equal(before, c.buffer)
    # the same bad id in a sequence that has query tokens is read: refused, or counted
    with pytest.raises(IndexError, match=r"block_tables\[1, 0\] = 999 is out of range.* of a "
                                         "sequence with query tokens"):
        c.attention(q, np.array([0, 2, 3]), tables, lens, validate=True)
    out = c.attention(q, np.array([0, 2, 3]), tables, lens, validate=False)
    assert c.stats["bad_block_ids"] == 1 and bool(xp.isnan(out[2]).all())
    with pytest.raises(IndexError, match="1 block id"):
        c.check()
