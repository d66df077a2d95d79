"""``PagedKVCache.attention`` (any number of query tokens per sequence, vLLM's flattened
layout) on the CPU against the float64 reference, and under the ``gpu`` marker on the GPU
against the CPU backend and, one layer down (``TestKernel``), the kernels of
``fp4cache._cuda.varlen`` against the float64 reference.

Rows are (query token, query head) pairs: sequence b owns tokens ``qsl[b]:qsl[b+1]`` (n_b
of them); causal token i sees keys ``0 .. len_b - n_b + i`` (bottom-right), else all
``len_b``; a row that sees no key gives zeros and lse = -inf.  The reference
(``nvfp4_ref.paged_attention_f64``; ``helpers.attention_reference`` feeds it a CPU
cache's pages) takes, for each row, only the keys that row sees, and a float64 softmax
per query head with KV head ``hq // (Hq // H)``.  Bad block ids make the rows that see a
key of the page NaN (output and lse); a K group stored as NaN makes the rows that see it
NaN; a V group stored as NaN makes the group's 16 columns NaN in the rows that see it (the
same rules as decode_attention, which sees every key).

CPU tolerances: those of ``tests/test_attention_decode.py`` (``helpers.assert_close``,
``helpers.assert_lse_close``), for the same reason: each element within ``2 u |ref| +
1e-9 max|ref row|`` (plus 2^-24 for float16's subnormals), ``lse`` within ``2^-23 |ref|
+ 1e-9``.  A row that sees one key too many or too few, a query row paired with the wrong
sequence or head, a wrong page or float32 accumulation over long rows all break these
bounds.

GPU tolerances: decode_attention's (same reasons): the relative 2-norm error per row <=
1e-2 for bf16/f16 outputs and <= 3e-3 for float32, lse within 1e-3 * max(1, |lse|), NaN
positions exact; outputs are poisoned before every call.  Against the CPU backend
(``cpu_reference``: float32 outputs, exact to ~2^-24, so the error measured is the GPU's)
a row that sees no key must also be exactly zeros (``helpers.check_rows``), and where the
contract leaves a row's NaN open (``PagedKVCache.attention``'s notes: rows of a sequence
with a bad page that do not see that page; rows that do not see a NaN V group of their
sequence's last ``n_b`` tokens) the row may be all NaN in the affected entries or must be
within tolerance.
"""

from __future__ import annotations

import math
import zlib

import ml_dtypes
import numpy as np
import pytest
from conftest import DEVICES, DLPackProducer
from helpers import (
    ATTENTION_CASES,
    RecordingRunner,
    assert_close,
    assert_lse_close,
    attention_reference,
    capture_stream,
    check,
    check_rows,
    make_cache,
    make_gpu_cache,
    make_q,
    make_tables,
    poisoned,
    rand_q,
    starts_of,
    tables_for,
    window_cpu_cache,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nvfp4_ref import paged_attention_f64

import fp4cache
from fp4cache import PagedKVCache, _abi
from fp4cache import _cpu as npb
from fp4cache import _kernels as K
from fp4cache import attention as front

try:  # CuPy and its backend modules, for the GPU cases (which skip by their marker
    # where there is no GPU: collection needs no CuPy)
    import cupy as cp

    from fp4cache._cuda import varlen as cv
    from fp4cache._cuda.decode import new_scratch
except ImportError:
    cp = cv = new_scratch = None


BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
DTYPES = {"bfloat16": BF16, "float16": F16, "float32": F32}


# -- helpers -------------------------------------------------------------------------------
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
    ref_out, ref_lse = attention_reference(cache, q, qsl, tables, lens, causal=causal,
                                           sm_scale=sm_scale)
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    assert_close(out, ref_out, q.dtype)
    assert_lse_close(lse, ref_lse)
    assert np.array_equal(cache.buffer, buf), "attention changed the cache buffer"
    return q, qsl, tables, lens, out, lse


#: Query counts n_b of a ragged batch (0 to 100) and its cache lengths, at and across
#: page edges of 16-token pages; every length >= its query count.
RAGGED_NQ = [0, 1, 2, 5, 16, 100, 1, 5]


RAGGED_LENS = [13, 1, 16, 17, 32, 130, 0 + 48, 5]


# -- the values ----------------------------------------------------------------------------
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
    ref_out, ref_lse = attention_reference(cache, q, qsl, tables, lens, sm_scale=0.3)
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
                  k_s=cache.pool.k_s, v_s=cache.pool.v_s, sm_scale=np.float32(1 / 8),
                  stats=cache.pool.stats, causal=True, max_query_len=5)
    ref_out, ref_lse = attention_reference(cache, q, qsl, tables, lens)
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


# -- bad ids and NaN -----------------------------------------------------------------------
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
    ref_out, ref_lse = attention_reference(cache, q, qsl, tables, lens)
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
    ref_out, _ = attention_reference(cache, q, qsl, tables, lens)
    assert np.array_equal(np.isnan(ref_out), nan)
    assert_close(np.where(nan, 0, out).astype(F32), np.where(nan, 0, ref_out), F32)


# -- out= and lse_out= ---------------------------------------------------------------------
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


# -- errors: each names its parameter and leaves the buffer and counters alone -------------
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
    ref_out, ref_lse = attention_reference(cache, g["q"], g["query_start_loc"], g["block_tables"],
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


# -- the public method on the GPU, against the CPU backend ---------------------------------
def cpu_reference(cache, q, qsl, tab, lens, *, causal=True, sm_scale=None):
    """The CPU backend on the GPU cache's page bytes: float32 (out, lse) and the number of
    bad block ids it counted."""
    D = cache.head_dim
    scale = np.float32(1 / np.sqrt(D) if sm_scale is None else sm_scale)
    out = np.empty(q.shape, np.float32)
    lse = np.empty(q.shape[:2], np.float32)
    stats = np.zeros_like(cp.asnumpy(cache.pool.stats))
    npb.attention(cp.asnumpy(cache.buffer), np.asarray(q), np.asarray(qsl), np.asarray(tab),
                  np.asarray(lens), out, lse, geom=cache.geometry, k_s=cache.pool.k_s,
                  v_s=cache.pool.v_s, sm_scale=scale, stats=stats, causal=causal)
    return out, lse, int(stats[fp4cache._abi.STAT["bad_block_ids"]])


def call(cache, q, qsl, tab, lens, **kw):
    """The public method with poisoned out / lse_out; returns (out, lse)."""
    out = poisoned(q.shape, q.dtype)
    lse = poisoned(q.shape[:2], np.float32)
    got = cache.attention(cp.asarray(q), cp.asarray(qsl), cp.asarray(tab), cp.asarray(lens),
                          out=out, lse_out=lse, return_lse=True, **kw)
    assert got[0] is out and got[1] is lse
    return out, lse


#: A ragged batch: query counts from 0 to 100, a whole prefill chunk from the start (24
#: of 24), and lengths at and across page edges (scaled by T below).
NQ = [0, 1, 2, 5, 16, 100, 1, 3, 24]


def ragged_lens(T):
    base = [5, 1, T, T + 1, 2 * T + 3, 130 + T, 3 * T, 7, 24]
    return [max(b, n) for b, n in zip(base, NQ)]


# (H, T, D, layout, swizzle, rule, group, dtype): the first 14 of the decode tests' shapes,
# plus four of its own
CASES = ATTENTION_CASES[:14] + [
    (2, 16, 128, "HND", True, "static6", 1, "bfloat16"),
    (2, 16, 64, "NHD", True, "static6", 2, "float16"),
    (3, 32, 64, "HND", False, "4over6", 7, "bfloat16"),
    (2, 16, 128, "HND", True, "static6", 8, "float32"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_ragged_batch_matches_cpu_backend(case):
    """Both masks, with max_query_len given and omitted (one synchronization), int32 and
    int64 index arrays."""
    H, T, D, layout, swizzle, rule, group, dtname = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    lens = ragged_lens(T)
    max_blocks = -(-max(lens) // T) + 2
    num_blocks = sum(-(-L // T) for L in lens) + 3
    cache = make_gpu_cache(rng, H=H, T=T, D=D, layout=layout, swizzle=swizzle, rule=rule,
                           num_blocks=num_blocks, decoded=False)
    itype = np.int64 if D == 64 else np.int32
    tab = tables_for(rng, lens, T, num_blocks, max_blocks, itype)
    qsl = starts_of(NQ, np.int32 if D == 64 else np.int64)
    lens_a = np.array(lens, dtype=np.int32 if D != 128 else np.int64)
    q = rand_q(rng, int(qsl[-1]), H * group, D, dtname)
    for causal in (True, False):
        ro, rl, _ = cpu_reference(cache, q, qsl, tab, lens_a, causal=causal)
        for bound in (max(NQ), None, 4 * max(NQ)):
            out, lse = call(cache, q, qsl, tab, lens_a, causal=causal, max_query_len=bound)
            check_rows(out, lse, ro, rl, dtname, f"{case} causal={causal} bound={bound}")
    assert cache.stats["bad_block_ids"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("nq", [2, 4, 8, 16])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_speculative_verification(nq, group):
    """n query tokens for every sequence (n x group from 2 to 128 rows per KV head),
    long cached sequences (split over the GPU), bf16."""
    rng = np.random.default_rng(100 * nq + group)
    H, T, D = 4, 16, 128
    lens = [3000, 777, 4099, nq]
    num_blocks = sum(-(-L // T) for L in lens) + 1
    cache = make_gpu_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks, decoded=False)
    tab = tables_for(rng, lens, T, num_blocks, -(-max(lens) // T))
    qsl = starts_of([nq] * len(lens))
    q = rand_q(rng, int(qsl[-1]), H * group, D, "bfloat16")
    ro, rl, _ = cpu_reference(cache, q, qsl, tab, lens)
    out, lse = call(cache, q, qsl, tab, np.array(lens, np.int32), max_query_len=nq)
    check_rows(out, lse, ro, rl, "bfloat16", f"spec n={nq} g={group}")


@pytest.mark.gpu
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
    cache = make_gpu_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks, decoded=False)
    tab = tables_for(rng, lens, T, num_blocks, -(-max(lens) // T) + 1)
    qsl = starts_of(nq)
    q = rand_q(rng, int(qsl[-1]), H * group, D, dtname)
    for causal in (True, False):
        ro, rl, _ = cpu_reference(cache, q, qsl, tab, lens, causal=causal)
        out, lse = call(cache, q, qsl, tab, np.array(lens), causal=causal, max_query_len=300)
        check_rows(out, lse, ro, rl, dtname, f"mixed D={D} causal={causal}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtname,group", [("bfloat16", 4), ("float32", 16), ("float16", 1)])
def test_all_n_b_one_matches_decode_attention(dtname, group):
    """decode_attention is the n_b = 1 case: both calls against the CPU backend."""
    rng = np.random.default_rng(11 + group)
    H, T, D = 2, 16, 128
    lens = [1, 15, 16, 17, 300, 4097, 2]
    num_blocks = sum(-(-L // T) for L in lens) + 1
    cache = make_gpu_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks, decoded=False)
    tab = tables_for(rng, lens, T, num_blocks, -(-max(lens) // T))
    q = rand_q(rng, len(lens), H * group, D, dtname)
    qsl = np.arange(len(lens) + 1, dtype=np.int32)
    ro, rl, _ = cpu_reference(cache, q, qsl, tab, lens)
    out, lse = call(cache, q, qsl, tab, np.array(lens, np.int32), max_query_len=1)
    check_rows(out, lse, ro, rl, dtname, "attention n_b = 1")
    dec, dec_lse = cache.decode_attention(cp.asarray(q), cp.asarray(tab),
                                          cp.asarray(np.array(lens, np.int32)),
                                          return_lse=True)
    check_rows(dec, dec_lse, ro, rl, dtname, "decode_attention")


@pytest.mark.gpu
def test_rows_that_see_no_key_without_validation():
    """n_b > seq_lens[b] is not checked on the GPU without validation: the rows that see
    no key give zeros and lse = -inf, the others the CPU backend's values; nothing else
    is touched (a sequence of length 0 with queries included)."""
    rng = np.random.default_rng(12)
    H, T, D, group = 2, 16, 128, 4
    nq = [5, 20, 3, 1]
    lens = [3, 40, 0, 9]  # sequence 0: rows 0, 1 see nothing; sequence 2: no row sees a key
    num_blocks = 8
    cache = make_gpu_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks, decoded=False)
    tab = tables_for(rng, lens, T, num_blocks, 3)
    qsl = starts_of(nq)
    q = rand_q(rng, int(qsl[-1]), H * group, D, "bfloat16")
    ro, rl, _ = cpu_reference(cache, q, qsl, tab, lens)
    empty = np.isneginf(rl).all(axis=1)
    assert empty[[0, 1, 25, 26, 27]].all() and empty.sum() == 5
    out, lse = call(cache, q, qsl, tab, np.array(lens, np.int32), max_query_len=20)
    check_rows(out, lse, ro, rl, "bfloat16", "no key")
    with pytest.raises(ValueError, match="sequence 0 has 5 query tokens"):
        call(cache, q, qsl, tab, np.array(lens, np.int32), validate=True)


@pytest.mark.gpu
def test_bad_block_ids_nan_and_counted():
    """Unvalidated bad ids: every row that sees a token of a bad page is NaN, rows of other
    sequences are exact, rows of that sequence that stop before the page may be NaN;
    each bad used entry of a sequence with queries is counted once; check() raises."""
    rng = np.random.default_rng(13)
    H, T, D, group = 2, 16, 128, 4
    nq = [4, 30, 3, 0, 200]
    lens = [100, 3000, 50, 40, 400]
    num_blocks = sum(-(-L // T) for L in lens) + 2
    cache = make_gpu_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks, decoded=False)
    tab = tables_for(rng, lens, T, num_blocks, -(-max(lens) // T) + 2)
    tab[0, 2] = num_blocks + 5      # used, seen by every row of sequence 0
    tab[1, 150] = -3                # used, long sequence: every row sees it
    tab[1, 186] = 2**31 - 1         # used: tokens 2976..2991, seen by rows 6.. of 30
    tab[2, 7] = num_blocks          # past the used pages (50 tokens = 4 pages): ignored
    tab[3, 0] = -1                  # used, but sequence 3 has no queries: never read
    tab[4, 20] = num_blocks + 1     # tokens 320..335: seen by rows 120.. of 200
    qsl = starts_of(nq)
    q = rand_q(rng, int(qsl[-1]), H * group, D, "bfloat16")
    ro, rl, count = cpu_reference(cache, q, qsl, tab, lens)
    assert count == 4
    seq = np.repeat(np.arange(len(nq)), nq)
    nan_rows = np.isnan(ro).all(axis=(1, 2))
    assert nan_rows[seq == 0].all() and nan_rows[seq == 1].all() and not nan_rows[seq == 2].any()
    assert nan_rows[seq == 4].sum() == 80  # rows 120..199
    maybe = np.broadcast_to((seq == 4)[:, None, None], ro.shape)  # rows 0..119 of seq 4
    cache.reset_counters()
    out, lse = call(cache, q, qsl, tab, np.array(lens), max_query_len=200)
    check_rows(out, lse, ro, rl, "bfloat16", "bad ids", maybe_nan=maybe)
    assert cache.stats["bad_block_ids"] == count
    with pytest.raises(IndexError, match="4 block id"):
        cache.check()


@pytest.mark.gpu
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
    cache = make_gpu_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks, nan_k=nan_k, nan_v=nan_v,
                           decoded=False)
    tab = np.arange(12, dtype=np.int32).reshape(3, 4)
    qsl = starts_of(nq)
    q = rand_q(rng, int(qsl[-1]), H * group, D, "bfloat16")
    ro, rl, _ = cpu_reference(cache, q, qsl, tab, lens)
    nan = np.isnan(ro)
    assert nan[0:3, group:].all() and not nan[0:3, :group].any()
    # sequence 1's rows see 57..64 keys: rows 4..7 (61..64 keys) see token 60
    assert nan[3 + 4:11, :group, 64:80].all() and not nan[3:3 + 4].any()
    assert nan[3 + 4:11].sum() == 4 * group * 16 and not nan[11:].any()
    maybe = np.zeros(ro.shape, bool)
    maybe[3:3 + 4, :group, 64:80] = True
    out, lse = call(cache, q, qsl, tab, np.array(lens), max_query_len=8)
    check_rows(out, lse, ro, rl, "bfloat16", "nan groups", maybe_nan=maybe)


@pytest.fixture
def recorded(monkeypatch):
    from fp4cache import _cuda

    rec = RecordingRunner()
    monkeypatch.setattr(_cuda, "attention_runner", rec)
    return rec


@pytest.mark.gpu
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


@pytest.mark.gpu
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
        assert c["seq_lens"] is sl and c["pool"] is cache.pool
    assert [c["max_query_len"] for c in recorded.calls] == [3, 3, 3, 7]
    assert recorded.calls[3]["causal"] is False and recorded.calls[3]["sm_scale"] == 0.5
    assert recorded.calls[0]["sm_scale"] == float(np.float32(1 / 8))
    assert recorded.calls[0]["out"] is out and recorded.calls[2]["lse"] is None
    with pytest.raises(TypeError, match="out must have dtype bfloat16"):  # changed signature
        cache.attention(q, qsl, bt, sl, max_query_len=3, out=out.astype(cp.float16))
    assert len(recorded.calls) == 4


@pytest.mark.gpu
def test_no_allocation_when_warm():
    rng = np.random.default_rng(15)
    H, T, D, group = 8, 16, 128, 4
    lens = [3000, 900, 17]
    nq = [4, 1, 17]
    num_blocks = sum(-(-L // T) for L in lens)
    cache = make_gpu_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks, decoded=False)
    tab = cp.asarray(tables_for(rng, lens, T, num_blocks, -(-max(lens) // T)))
    qsl = cp.asarray(starts_of(nq))
    ld = cp.asarray(np.array(lens, np.int32))
    q = cp.asarray(rand_q(rng, sum(nq), H * group, D, "bfloat16"))
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


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    """Captured once through the public method (out, lse_out and max_query_len given),
    replayed with new q, query_start_loc, lengths and block tables: decodes, a
    speculative batch, a chunk and a mixed batch of the same num_tokens."""
    rng = np.random.default_rng(16)
    H, T, D, group = 8, 16, 128, 4
    B, N, bound, max_blocks = 4, 64, 61, 300
    num_blocks = B * max_blocks
    cache = make_gpu_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks, decoded=False)
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
    stream = capture_stream()
    with stream:
        nq, lens = steps[0]
        qsld[...] = cp.asarray(starts_of(nq))
        td[...] = cp.asarray(tables_for(rng, lens, T, num_blocks, max_blocks))
        ld[...] = cp.asarray(np.array(lens, np.int32))
        qd[...] = cp.asarray(rand_q(rng, N, H * group, D, "bfloat16"))
        cache.attention(qd, qsld, td, ld, **kw)  # checked call and warm-up
        cache.attention(qd, qsld, td, ld, **kw)
        stream.synchronize()
        stream.begin_capture()
        cache.attention(qd, qsld, td, ld, **kw)
        graph = stream.end_capture()
    for rep, (nq, lens) in enumerate(steps + steps[:1]):
        q = rand_q(rng, N, H * group, D, "bfloat16")
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
        check_rows(out, lse, ro, rl, "bfloat16", f"replay {rep} nq={nq}")


# -- the kernels on the GPU, against the float64 reference ---------------------------------
#: The prefill route ``run`` passes (``_kernels.PREFILL_ROUTES``; TestKernel runs with each).
ROUTE = {"name": "auto"}


def run(cache, q, qsl, tab, lens, *, max_query_len, causal, sm_scale=None, scratch=None,
        with_lse=True, window=None, rotate=False):
    geom = cache.geometry
    sm_scale = 1.0 / np.sqrt(geom.head_dim) if sm_scale is None else sm_scale
    out = poisoned(q.shape, q.dtype)
    lse = poisoned(q.shape[:2], np.float32) if with_lse else None
    scratch = new_scratch() if scratch is None else scratch
    cv.attention(cache.buffer, q, qsl, tab, lens, out, lse, max_query_len=max_query_len,
                 causal=causal, geom=geom, k_s=cache.pool.k_s, v_s=cache.pool.v_s,
                 sm_scale=sm_scale, stats=cache.pool.stats, scratch=scratch, window=window,
                 rotate=rotate, route=ROUTE["name"])
    return out, lse, scratch


def case(rng, *, ns, lens, H, T, D, group, dtname="bfloat16", layout="HND", swizzle=True,
         causal=True, itype=np.int32, max_query_len=None, nan_k=(), nan_v=(), spare=2,
         tab_edit=None):
    max_blocks = max(-(-max(int(L), 1) // T) for L in lens) + 1
    num_blocks = sum(-(-max(int(L), 0) // T) for L in lens) + spare
    cache, kd, vd = make_gpu_cache(rng, H=H, T=T, D=D, layout=layout, swizzle=swizzle,
                                   num_blocks=num_blocks, nan_k=nan_k, nan_v=nan_v)
    tab = tables_for(rng, lens, T, num_blocks, max_blocks, itype)
    if tab_edit is not None:
        tab_edit(tab, num_blocks)
    qsl = starts_of(ns, itype)
    q = rand_q(rng, int(qsl[-1]), H * group, D, dtname)
    mql = max(ns) if max_query_len is None else max_query_len
    cache.reset_counters()
    out, lse, scratch = run(cache, cp.asarray(q), cp.asarray(qsl), cp.asarray(tab),
                            cp.asarray(np.array(lens, dtype=itype)), max_query_len=mql,
                            causal=causal)
    ro, rl = paged_attention_f64(kd, vd, q, qsl, tab, lens, T, 1 / np.sqrt(D), num_blocks, causal)
    return cache, out, lse, ro, rl, scratch


RAGGED = [0, 1, 2, 5, 16, 100]


def zlib_seed(*parts) -> int:
    import zlib

    return zlib.crc32(repr(parts).encode())


def wgmma_device() -> bool:
    return cp.cuda.Device().compute_capability == "90"


@pytest.mark.gpu
class TestKernel:
    """``fp4cache._cuda.varlen``'s kernels against the float64 reference, each test with
    both prefill routes (on an sm_90 device "auto" takes the wgmma kernel for the
    sequences of more than 64 rows, "mma" the 128-row mma.sync kernel)."""

    @pytest.fixture(autouse=True, params=K.PREFILL_ROUTES)
    def route(self, request, monkeypatch):
        monkeypatch.setitem(ROUTE, "name", request.param)
        return request.param

    @pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
    @pytest.mark.parametrize("D,group,dtname,layout", [
        (128, 1, "bfloat16", "HND"), (128, 2, "float16", "NHD"), (128, 4, "bfloat16", "NHD"),
        (128, 8, "float16", "HND"), (128, 16, "bfloat16", "HND"), (64, 1, "bfloat16", "NHD"),
        (64, 4, "float16", "HND"), (64, 16, "bfloat16", "HND"), (256, 4, "bfloat16", "HND")])
    def test_many_rows_every_geometry(self, D, group, dtname, layout, causal, route):
        """Sequences of more than 64 rows (the wgmma kernel on sm_90 with route "auto" for
        the head dims of ``_abi.VARLEN_WG_HEAD_DIMS``, else the mma.sync kernel; GQA 1-16,
        both layouts) beside a few-row one: chunks after cached keys, one that starts at key 0,
        a 100-token chunk that fits one 128-row tile with group 1 (split keys), the
        kernels' step edges (128 keys; 32 for the wgmma kernel at head_dim 256)."""
        rng = np.random.default_rng(zlib_seed("many", D, group, dtname, layout, causal))
        ns = [300, 100, 1, 129, 65]
        lens = [1000, 100, 700, 129 + 256, 3000]
        _, out, lse, ro, rl, scratch = case(rng, ns=ns, lens=lens, H=2, T=16, D=D,
                                            group=group, dtname=dtname, layout=layout,
                                            causal=causal)
        check(out, lse, ro, rl, dtname, f"many rows D={D} g={group} {route}")
        (call,) = [run.plan for run in scratch.plans.values()]
        wg = route == "auto" and wgmma_device() and D in _abi.VARLEN_WG_HEAD_DIMS
        assert ("_varlen_wgmma_" in call.launches[-1].name) == wg, call.launches[-1].name

    @pytest.mark.parametrize("T,H,itype", [(5, 3, np.int64), (5, 3, np.int32),
                                            (16, 2, np.int64)])
    def test_many_rows_unaligned_pages_and_int64_tables(self, T, H, itype, route):
        """Sequences of more than 64 rows over page sides that are not 16-byte multiples
        (T = 5, 3 heads: 120 scale bytes per side, so the codes come in 4-byte loads) and
        over int64 block tables, both prefill routes (on sm_90 "auto" is the wgmma kernel,
        whose decode warps pick the load width and the table type per item)."""
        rng = np.random.default_rng(zlib_seed("unaligned", T, H, itype().dtype.str))
        ns, lens = [300, 129], [1000, 129 + 2 * T + 300]
        cache, out, lse, ro, rl, scratch = case(rng, ns=ns, lens=lens, H=H, T=T, D=128,
                                                group=4, itype=itype, swizzle=T % 4 == 0)
        check(out, lse, ro, rl, "bfloat16", f"unaligned T={T} H={H} {itype.__name__}")
        geom = cache.geometry
        assert ((geom.side_bytes | geom.data_bytes) % 16 == 0) == (T == 16)
        (call,) = [run.plan for run in scratch.plans.values()]
        wg = route == "auto" and wgmma_device()
        assert ("_varlen_wgmma_" in call.launches[-1].name) == wg, call.launches[-1].name

    @pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
    @pytest.mark.parametrize("D,group,dtname,layout", [
        (128, 4, "bfloat16", "HND"), (64, 1, "float16", "NHD"), (256, 8, "bfloat16", "HND"),
        (128, 16, "float32", "NHD"), (64, 3, "float32", "HND"), (256, 2, "float16", "NHD"),
        (256, 4, "float32", "HND")])
    def test_ragged_matches_reference(self, D, group, dtname, layout, causal):
        rng = np.random.default_rng(zlib_seed(D, group, dtname, layout, causal))
        ns = RAGGED
        lens = [37, 1, 40, 5, 300, 161]  # cached + n_b, across page edges (T = 16)
        _, out, lse, ro, rl, _ = case(rng, ns=ns, lens=lens, H=2, T=16, D=D, group=group,
                                      dtname=dtname, layout=layout, causal=causal)
        check(out, lse, ro, rl, dtname, f"ragged D={D} g={group}")

    @pytest.mark.parametrize("T,swizzle,layout", [(16, True, "HND"), (5, False, "NHD"),
                                                  (12, True, "NHD"), (32, False, "HND"),
                                                  (4, True, "HND")])
    def test_block_sizes_and_page_edges(self, T, swizzle, layout):
        rng = np.random.default_rng(T * 7 + swizzle)
        ns = [3, 1, 17, 4, 2]
        lens = [T, T + 1, 2 * T - 1 + 17, 3, 2]  # at, across and just before page edges
        _, out, lse, ro, rl, _ = case(rng, ns=ns, lens=lens, H=3, T=T, D=128, group=2,
                                      layout=layout, swizzle=swizzle, itype=np.int64)
        check(out, lse, ro, rl, "bfloat16", f"T={T}")

    @pytest.mark.parametrize("n,group", [(1, 4), (2, 4), (4, 4), (8, 2), (2, 8), (1, 16),
                                         (8, 4), (5, 5), (3, 16)])
    def test_speculative_split_kv(self, n, group):
        """n * group <= 32 rows (bf16 q, head_dim 128): one launch of the few-row (decode)
        kernel, its two-n8-tile form above 8 rows, four tiles above 16; more: the 64-row
        varlen kernel.  One query tile per (sequence, KV head), keys split over CTAs and
        merged through the workspace (long sequences, different lengths)."""
        rng = np.random.default_rng(100 + n * group)
        lens = [9000, 4099, 300, n]
        _, out, lse, ro, rl, scratch = case(rng, ns=[n] * 4, lens=lens, H=2, T=16, D=128,
                                            group=group)
        check(out, lse, ro, rl, "bfloat16", f"spec n={n}")
        (call,) = [run.plan for run in scratch.plans.values()]
        if n * group <= 32:
            (lp,) = call.launches
            (plan,) = lp.keep
            form = "_wide4" if n * group > 16 else "_wide" if n * group > 8 else ""
            assert plan.spec.name.endswith(f"d128{form}_paged16")
            assert plan.grid[0] > 1 and lp.grid == plan.grid[0] * 2 * 4  # splits x H x B
        else:  # the few-row kernel's launches (two where one token fits 8 rows), then it
            assert len(call.launches) == (3 if group <= 8 else 2)
            ps = call.launches[-1].keep[-1]
            assert ps.row_warps == cv.row_warps_for(n * group) and ps.slots > 1

    @pytest.mark.parametrize("itype", [np.int32, np.int64], ids=["int32", "int64"])
    @pytest.mark.parametrize("n", [3, 6], ids=["two_tiles", "four_tiles"])
    def test_bad_ids_in_the_few_row_forms(self, n, itype):
        """The few-row kernel's two- and four-tile forms (n tokens x group 4: 12 / 24 rows),
        which keep block-table entries as loaded until their chunk is issued: bad entries of
        int32 and int64 tables (above the pool, negative, an int64 entry whose low word
        alone is a good page) make the rows that see them NaN and are counted once each; an
        entry past the used pages is ignored."""
        rng = np.random.default_rng(zlib_seed("few-row bad ids", n, np.dtype(itype).name))
        lens = [300, 5000, 4000, 60]

        def edit(tab, num_blocks):
            tab[0, 2] = num_blocks + 5  # tokens 32..47: every row sees them
            tab[1, 100] = -3            # long sequence (split-KV)
            tab[2, 200] = 2**31 - 1 if itype == np.int32 else 2**32 + 1  # low word 1
            tab[3, 5] = num_blocks      # past the used pages (60 tokens = 4 pages): ignored

        cache, out, lse, ro, rl, scratch = case(rng, ns=[n] * 4, lens=lens, H=2, T=16, D=128,
                                                group=4, itype=itype, tab_edit=edit)
        assert np.isnan(ro[:3 * n]).all() and not np.isnan(ro[3 * n:]).any()
        check(out, lse, ro, rl, "bfloat16", f"bad ids n={n}")
        assert int(cp.asnumpy(cache.pool.stats)[_abi.STAT["bad_block_ids"]]) == 3
        (call,) = [run.plan for run in scratch.plans.values()]
        (lp,) = call.launches
        (plan,) = lp.keep
        assert plan.spec.name.endswith("d128_wide4_paged16" if n == 6 else "d128_wide_paged16")

    @pytest.mark.parametrize("D,group,n,dtname,layout,T", [
        (128, 4, 8, "bfloat16", "HND", 16), (128, 2, 9, "float16", "NHD", 16),
        (64, 8, 4, "bfloat16", "NHD", 16), (64, 16, 2, "float16", "HND", 32),
        (128, 4, 5, "bfloat16", "HND", 12), (64, 3, 7, "bfloat16", "NHD", 6),
        (256, 4, 4, "bfloat16", "HND", 16), (256, 8, 2, "float16", "NHD", 12),
        (256, 3, 5, "float16", "HND", 32)])
    def test_shared_q_few_rows(self, D, group, n, dtname, layout, T):
        """The few-row forms whose q fragments live in shared memory, 16-bit q: 17 to 32
        rows per (sequence, KV head) at head_dim 64 / 128 (four n8 tiles), 9 to 16 at
        head_dim 256 (two tiles). One launch, over pages of 16-token multiples and of other
        sizes, causal and not, beside sequences of fewer tokens (one, none) and one with
        fewer keys than query tokens (rows without keys)."""
        form = "_wide" if D == 256 else "_wide4"
        rng = np.random.default_rng(zlib_seed("wide4", D, group, n, dtname, layout, T))
        ns = [n, 1, n, 0, n - 1, n]
        lens = [9000, 700, 300, 50, 4099, n - 1]
        for causal in (True, False):
            _, out, lse, ro, rl, scratch = case(rng, ns=ns, lens=lens, H=2, T=T, D=D,
                                                group=group, dtname=dtname, layout=layout,
                                                swizzle=T % 4 == 0, causal=causal)
            check(out, lse, ro, rl, dtname, f"wide4 D={D} g={group} n={n} causal={causal}")
            (call,) = [run.plan for run in scratch.plans.values()]
            (lp,) = call.launches
            (plan,) = lp.keep
            assert plan.spec.name.endswith(f"_d{D}{form}" + "_paged16" * (T % 16 == 0))
            assert plan.grid[0] > 1

    def test_more_sequences_than_a_grid_dimension(self):
        """65,540 sequences of 0-2 query tokens: more than a CUDA grid's y / z limit (65,535);
        the few-row kernel's grid is one-dimensional (splits x KV heads x sequences)."""
        rng = np.random.default_rng(23)
        B = 65540
        ns = rng.integers(0, 3, B)
        lens = (ns + rng.integers(0, 20, B)).tolist()
        _, out, lse, ro, rl, scratch = case(rng, ns=ns.tolist(), lens=lens, H=1, T=16, D=64,
                                            group=4)
        check(out, lse, ro, rl, "bfloat16", "65540 sequences")
        (call,) = [run.plan for run in scratch.plans.values()]
        (lp,) = call.launches
        assert lp.grid >= B

    def test_mixed_batch_one_launch(self):
        """Decode tokens, speculative tokens and a long chunk in one call: the few-row kernel
        splits the keys of the sequences of <= 16 rows in two launches (its one-n8-tile form
        for the decodes' 4 and the 8 rows of 2 tokens, two tiles for 16), the 128-row
        kernel takes the others (its 24-row sequence fits one tile and splits too)."""
        rng = np.random.default_rng(11)
        ns = [1, 4, 300, 1, 0, 2, 6]
        lens = [5000, 3000, 1000, 77, 50, 2, 4000]
        _, out, lse, ro, rl, scratch = case(rng, ns=ns, lens=lens, H=2, T=16, D=128, group=4)
        check(out, lse, ro, rl, "bfloat16", "mixed")
        (call,) = [run.plan for run in scratch.plans.values()]
        (narrow,), (wide,), big = (lp.keep for lp in call.launches)
        assert narrow.spec.name.endswith("_d128_paged16") and narrow.grid[0] > 1
        assert wide.spec.name.endswith("_wide_paged16") and wide.grid[0] > 1
        assert big[-1].row_warps == 8

    def test_one_cta_takes_every_work_item(self, monkeypatch):
        """A grid of one CTA for the varlen launch (GRID_WAVES = 0): it loops over every work
        item, splits of one sequence included (their ticket merge never waits)."""
        monkeypatch.setattr(cv, "GRID_WAVES", 0)
        rng = np.random.default_rng(19)
        ns = [1, 4, 70, 0, 3]
        lens = [3000, 700, 500, 9, 2000]
        _, out, lse, ro, rl, scratch = case(rng, ns=ns, lens=lens, H=2, T=16, D=64, group=4)
        check(out, lse, ro, rl, "bfloat16", "one CTA")
        (call,) = [run.plan for run in scratch.plans.values()]
        assert call.launches[-1].grid == 1 and len(call.launches) == 3

    def test_rows_without_keys_and_empty_sequences(self):
        """n_b > seq_len (no validation): the first rows see no key -> zeros, lse = -inf;
        seq_len 0; n_b = 0 rows are never written by anyone else."""
        rng = np.random.default_rng(12)
        ns = [6, 3, 0, 2]
        lens = [2, 0, 10, 40]
        _, out, lse, ro, rl, _ = case(rng, ns=ns, lens=lens, H=2, T=16, D=64, group=2)
        check(out, lse, ro, rl, "bfloat16", "no keys")
        o, lh = cp.asnumpy(out), cp.asnumpy(lse)
        assert not o[:4].astype(np.float32).any() and np.isneginf(lh[:4]).all()
        assert np.isneginf(lh[6:9]).all()

    def test_bad_ids_nan_only_where_seen_and_counted(self):
        rng = np.random.default_rng(13)
        T = 16
        ns = [50, 2, 3]
        lens = [200, 5000, 40]

        def edit(tab, num_blocks):
            tab[0, 12] = num_blocks + 5  # tokens 192..199: only the last 8 causal rows see it
            tab[1, 100] = -3             # long sequence (split-KV): both rows see it
            tab[2, 5] = num_blocks       # past the used pages (40 tokens = 3 pages): ignored

        cache, out, lse, ro, rl, _ = case(rng, ns=ns, lens=lens, H=2, T=T, D=128, group=4,
                                          tab_edit=edit)
        assert np.isnan(ro[42:50]).all() and not np.isnan(ro[:42]).any()
        assert np.isnan(ro[50:52]).all() and not np.isnan(ro[52:]).any()
        check(out, lse, ro, rl, "bfloat16", "bad ids")
        assert int(cp.asnumpy(cache.pool.stats)[_abi.STAT["bad_block_ids"]]) == 2

    def test_nan_groups(self):
        rng = np.random.default_rng(14)
        T = 16
        # tables_for gives sequence pages from a permutation: NaN at pool rows; find them after
        ns = [20, 3]
        lens = [64, 64]
        H, D, group = 2, 128, 2
        num_blocks = 8 + 2
        perm_rng = np.random.default_rng(15)
        tab = tables_for(perm_rng, lens, T, num_blocks, 5)
        # sequence 0 key 50 (seen by causal rows 6..19 only): V group 4 NaN; K NaN at key 60
        # (rows 16..19); sequence 1 key 10: V group 0 NaN (all rows)
        pool_row = lambda b, key: int(tab[b, key // T]) * T + key % T  # noqa: E731
        nan_v = [(pool_row(0, 50), 1, 70), (pool_row(1, 10), 0, 3)]
        nan_k = [(pool_row(0, 60), 0, 100)]
        cache, kd, vd = make_gpu_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks, nan_k=nan_k,
                                       nan_v=nan_v)
        qsl = starts_of(ns)
        q = rand_q(rng, int(qsl[-1]), H * group, D, "bfloat16")
        out, lse, _ = run(cache, cp.asarray(q), cp.asarray(qsl), cp.asarray(tab),
                          cp.asarray(np.array(lens, np.int32)), max_query_len=max(ns), causal=True)
        ro, rl = paged_attention_f64(kd, vd, q, qsl, tab, lens, T, 1 / np.sqrt(D),
                                     num_blocks, True)
        assert np.isnan(ro[6:20, group:, 64:80]).all() and not np.isnan(ro[:6]).any()
        assert not np.isnan(ro[6:16, group:, :64]).any()
        assert np.isnan(ro[16:20, :group]).all()
        assert np.isnan(ro[20:, :group, 0:16]).all() and not np.isnan(ro[20:, group:]).any()
        check(out, lse, ro, rl, "bfloat16", "nan groups")

    @pytest.mark.parametrize("D,layout,swizzle", [(128, "NHD", True), (256, "HND", True),
                                                  (256, "NHD", False)])
    def test_many_rows_nan_groups_and_bad_pages(self, D, layout, swizzle, route):
        """NaN groups and a bad page in sequences of many rows (the wgmma kernel on sm_90
        with route "auto" for the head dims of ``_abi.VARLEN_WG_HEAD_DIMS``; at head_dim
        256 a decode warp takes a quarter of a key block's columns): a V group and a K group
        stored as NaN (past the first quarter at head_dim 256) reach exactly the rows that
        see them, a bad page gives NaN to exactly the rows that see it and is counted once
        (not once per column slice), V scales swizzled or not."""
        rng = np.random.default_rng(zlib_seed("nan-many", D, layout, swizzle))
        H, T, group = 2, 16, 4
        ns = [40, 30, 3]
        lens = [300, 500, 3000]
        num_blocks = sum(-(-L // T) for L in lens) + 2
        tab = tables_for(np.random.default_rng(21), lens, T, num_blocks, -(-max(lens) // T))
        pool_row = lambda b, key: int(tab[b, key // T]) * T + key % T  # noqa: E731
        # sequence 0 (token i sees keys 0 .. 260 + i): key 270's V group at column D - 56
        # NaN in KV head 1 (rows 10..39), key 290's K group at column D / 2 + 12 in KV
        # head 0 (rows 30..39)
        v0 = (D - 56) // 16 * 16
        cache, kd, vd = make_gpu_cache(rng, H=H, T=T, D=D, layout=layout, swizzle=swizzle,
                                       num_blocks=num_blocks,
                                       nan_v=[(pool_row(0, 270), 1, D - 56)],
                                       nan_k=[(pool_row(0, 290), 0, D // 2 + 12)])
        tab[1, 30] = num_blocks + 3  # sequence 1 (keys 0 .. 470 + i): keys 480.. rows 10..29
        qsl = starts_of(ns)
        q = rand_q(rng, int(qsl[-1]), H * group, D, "bfloat16")
        cache.reset_counters()
        out, lse, scratch = run(cache, cp.asarray(q), cp.asarray(qsl), cp.asarray(tab),
                                cp.asarray(np.array(lens, np.int32)), max_query_len=max(ns),
                                causal=True)
        ro, rl = paged_attention_f64(kd, vd, q, qsl, tab, lens, T, 1 / np.sqrt(D), num_blocks,
                                     True)
        nan = np.isnan(ro)
        assert nan[10:40, group:, v0:v0 + 16].all() and not nan[:10].any()
        assert not nan[10:40, group:, :v0].any() and not nan[10:40, group:, v0 + 16:].any()
        assert nan[30:40, :group].all() and not nan[10:30, :group].any()
        assert nan[40 + 10:70].all() and not nan[40:40 + 10].any() and not nan[70:].any()
        check(out, lse, ro, rl, "bfloat16", f"D={D} {layout} {swizzle} {route}")
        assert int(cp.asnumpy(cache.pool.stats)[_abi.STAT["bad_block_ids"]]) == 1
        (call,) = [run.plan for run in scratch.plans.values()]
        wg = route == "auto" and wgmma_device() and D in _abi.VARLEN_WG_HEAD_DIMS
        assert ("_varlen_wgmma_" in call.launches[-1].name) == wg, call.launches[-1].name

    def test_query_start_loc_clamped_to_q(self):
        """Unvalidated query_start_loc past q's rows (or decreasing): the kernel clamps it to
        [0, num_tokens], so nothing outside q and out is read or written."""
        rng = np.random.default_rng(20)
        H, T, D, group = 2, 16, 64, 2
        lens = [40, 30, 50, 20]
        num_blocks = 16
        cache, kd, vd = make_gpu_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks)
        tab = tables_for(rng, lens, T, num_blocks, 4)
        N = 9
        qsl = np.array([0, 3, 5, 1_000_000, 2], np.int64)
        q = rand_q(rng, N, H * group, D, "bfloat16")
        guard = cp.zeros((N + 64, H * group, D), dtype=BF16)  # out plus rows that must stay 0
        out = guard[:N]
        cv.attention(cache.buffer, cp.asarray(q), cp.asarray(qsl), cp.asarray(tab),
                     cp.asarray(np.array(lens, np.int32)), out, None, max_query_len=16,
                     causal=True, geom=cache.geometry, k_s=cache.pool.k_s, v_s=cache.pool.v_s,
                     sm_scale=1 / np.sqrt(D), stats=cache.pool.stats, scratch=new_scratch())
        ro, rl = paged_attention_f64(kd, vd, q, np.clip(qsl, 0, N), tab, lens, T, 1 / np.sqrt(D),
                                     num_blocks, True)
        check(out, None, ro, rl, "bfloat16", "clamped query_start_loc")
        assert not cp.asnumpy(guard[N:]).astype(np.float32).any()

    def test_lengths_clamped_and_int64(self):
        rng = np.random.default_rng(16)
        T, max_blocks, num_blocks = 16, 3, 16
        H, D, group = 2, 64, 2
        cache, kd, vd = make_gpu_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks)
        tab = rng.permutation(num_blocks)[:3 * max_blocks].reshape(3, max_blocks).astype(np.int64)
        lens = np.array([10_000, -5, 47], dtype=np.int64)
        ns = [4, 1, 20]
        qsl = starts_of(ns, np.int64)
        q = rand_q(rng, int(qsl[-1]), H * group, D, "float16")
        out, lse, _ = run(cache, cp.asarray(q), cp.asarray(qsl), cp.asarray(tab), cp.asarray(lens),
                          max_query_len=20, causal=True)
        ro, rl = paged_attention_f64(kd, vd, q, qsl, tab, lens, T, 1 / np.sqrt(D),
                                     num_blocks, True)
        check(out, lse, ro, rl, "float16", "clamped")

    def test_cuda_graph_with_chunks(self, route):
        """A batch with a 200-token chunk (the wgmma kernel on sm_90 with route "auto"),
        captured once and replayed with new q, query_start_loc, lengths and block tables."""
        rng = np.random.default_rng(27)
        H, T, D, group = 2, 16, 128, 4
        B, max_blocks, N = 3, 200, 208
        num_blocks = 3 * max_blocks
        cache, kd, vd = make_gpu_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks)
        qd = cp.empty((N, H * group, D), dtype=BF16)
        qsld = cp.empty((B + 1,), dtype=cp.int32)
        td = cp.empty((B, max_blocks), dtype=cp.int32)
        ld = cp.empty((B,), dtype=cp.int32)
        out = cp.empty((N, H * group, D), dtype=BF16)
        lse = cp.empty((N, H * group), dtype=cp.float32)
        stream = capture_stream()
        kw = dict(max_query_len=200, causal=True, geom=cache.geometry, k_s=cache.pool.k_s,
                  v_s=cache.pool.v_s, sm_scale=1 / np.sqrt(D), stats=cache.pool.stats,
                  scratch=new_scratch(), route=route)
        cases = (([200, 4, 4], [3000, 100, 4]), ([1, 7, 200], [7, 500, 3100]),
                 ([100, 0, 108], [100, 0, 2000]))
        graph = None
        for rep, (ns, lens) in enumerate(cases):
            qsl = starts_of(ns)
            q = rand_q(rng, N, H * group, D, "bfloat16")
            tab = tables_for(rng, lens, T, num_blocks, max_blocks)
            with stream:
                qd[...] = cp.asarray(q)
                qsld[...] = cp.asarray(qsl)
                td[...] = cp.asarray(tab)
                ld[...] = cp.asarray(np.array(lens, np.int32))
                out.view(cp.uint16).fill(0x7E7E)
                lse.fill(12345.0)
                if graph is None:
                    cv.attention(cache.buffer, qd, qsld, td, ld, out, lse, **kw)  # warm
                    stream.begin_capture()
                    cv.attention(cache.buffer, qd, qsld, td, ld, out, lse, **kw)
                    graph = stream.end_capture()
                    out.view(cp.uint16).fill(0x7E7E)
                graph.launch(stream)
            stream.synchronize()
            ro, rl = paged_attention_f64(kd, vd, q, qsl, tab, lens, T, 1 / np.sqrt(D),
                                         num_blocks, True)
            n = int(qsl[-1])
            check(out[:n], lse[:n], ro[:n], rl[:n], "bfloat16", f"replay {rep} {route}")

    def test_cuda_graph_capture_and_replay(self):
        """Captured once with max_query_len, replayed with new q, query_start_loc, lengths and
        block tables (the split tickets reset themselves); no allocation when warm."""
        rng = np.random.default_rng(17)
        H, T, D, group = 4, 16, 128, 4
        B, max_blocks, N = 3, 320, 12
        num_blocks = 3 * max_blocks
        cache, kd, vd = make_gpu_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks)
        qd = cp.empty((N, H * group, D), dtype=BF16)
        qsld = cp.empty((B + 1,), dtype=cp.int32)
        td = cp.empty((B, max_blocks), dtype=cp.int32)
        ld = cp.empty((B,), dtype=cp.int32)
        out = cp.empty((N, H * group, D), dtype=BF16)
        lse = cp.empty((N, H * group), dtype=cp.float32)
        scratch = new_scratch()
        stream = capture_stream()
        kw = dict(max_query_len=4, causal=True, geom=cache.geometry, k_s=cache.pool.k_s,
                  v_s=cache.pool.v_s, sm_scale=1 / np.sqrt(D), stats=cache.pool.stats,
                  scratch=scratch)
        with stream:
            qsld[...] = cp.asarray(starts_of([4, 4, 4]))
            td[...] = cp.asarray(tables_for(rng, [5000, 100, 4], T, num_blocks, max_blocks))
            ld[...] = cp.asarray(np.array([5000, 100, 4], np.int32))
            qd[...] = cp.asarray(rand_q(rng, N, H * group, D, "bfloat16"))
            cv.attention(cache.buffer, qd, qsld, td, ld, out, lse, **kw)  # warm
            stream.synchronize()
            pool = cp.get_default_memory_pool()
            used = pool.used_bytes()
            stream.begin_capture()
            cv.attention(cache.buffer, qd, qsld, td, ld, out, lse, **kw)
            graph = stream.end_capture()
            assert pool.used_bytes() == used
        (call,) = [run.plan for run in scratch.plans.values()]
        assert len(call.launches) == 1 and call.launches[0].grid > B * H
        for rep, (ns, lens) in enumerate((([4, 4, 4], [5000, 100, 4]), ([1, 3, 4], [7, 5000, 4000]),
                                          ([0, 4, 2], [0, 4, 4096]), ([4, 0, 1], [2, 9, 1]))):
            qsl = starts_of(ns)
            q = rand_q(rng, N, H * group, D, "bfloat16")
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
            ro, rl = paged_attention_f64(kd, vd, q, qsl, tab, lens, T, 1 / np.sqrt(D),
                                         num_blocks, True)
            n = int(qsl[-1])  # rows past the last sequence are nobody's: not compared
            check(out[:n], lse[:n], ro[:n], rl[:n], "bfloat16", f"replay {rep}")

    def test_long_prefill_chunk_tiles(self):
        """A 600-token causal chunk after 1,500 cached tokens, GQA 8 (75 query tiles of 64
        rows), with a decode sequence beside it."""
        rng = np.random.default_rng(18)
        ns = [600, 1]
        lens = [2100, 3000]
        _, out, lse, ro, rl, _ = case(rng, ns=ns, lens=lens, H=1, T=16, D=128, group=8)
        check(out, lse, ro, rl, "bfloat16", "prefill chunk")


# -- the exact window and the q rotation (docs/window.md), kernels against float64 ---------
#: lse bound (times max(1, |lse|)) of a call with the window or the rotation: the kernels'
#: MMA inputs are f16, exact for a bf16 q and the decoded NVFP4 values, but the rotated q
#: (a float32 row) and a window value times win_k_mul are rounded (2^-11 relative): an lse
#: error of a few 1e-3 in the rows whose softmax a few outlier keys dominate (the outputs
#: keep their bound)
WIN_LSE_TOL = 1e-2


def lse_tol(extras: bool) -> float:
    return WIN_LSE_TOL if extras else 1e-3

def window_start_ref(row, L, T, P, win_map, S, num_blocks) -> int:
    """docs/window.md's ws of a sequence of (clamped) length L with block-table row `row`."""
    if L == 0:
        return 0
    n = -(-L // T)
    run_ = 0
    for i in range(min(P, n)):
        bid = int(row[n - 1 - i])
        if not (0 <= bid < num_blocks and 0 <= int(win_map[bid]) < S):
            break
        run_ += 1
    return L if run_ == 0 else (n - run_) * T


def window_slots(rng, S, T, H, D, nan_k=(), nan_v=()):
    """Random window slots: bf16 bits (S, 2, T, H, D), values unlike the pages' (a key read
    from the wrong source moves its row), and their float64 values; nan_k / nan_v: (slot,
    token, head, group) written as 16 x 0x7FC0, as the store writes a NaN group."""
    x = rng.standard_normal((S, 2, T, H, D), dtype=np.float32) * 2.0
    bits = fp4cache.formats.bf16_bits(x)
    for side, groups in ((0, nan_k), (1, nan_v)):
        for sl, t, h, g in groups:
            bits[sl, side, t, h, 16 * g:16 * g + 16] = 0x7FC0
    vals = (bits.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)
    return bits, vals


def map_last_pages(tab, lens, T, P, num_blocks):
    """window_map with the last P pages of every sequence in its own ring of P slots (S =
    P * B + 1: one slot never used)."""
    win_map = np.full(num_blocks, -1, np.int32)
    cap = tab.shape[1] * T
    for b, L in enumerate(lens):
        L = min(max(int(L), 0), cap)
        n = -(-L // T)
        for p in range(max(0, n - P), n):
            bid = int(tab[b, p])
            if 0 <= bid < num_blocks:
                win_map[bid] = P * b + p % P
    return win_map, P * len(lens) + 1


def window_reference(kd, vd, wvals, win_map, P, S, q, qsl, tab, lens, T, num_blocks, causal,
                     rotate):
    """float64 reference with the window: keys at or past ws of each sequence from its
    window slots (virtual pages appended to the decoded pool), q rotated by
    fp4cache.hadamard when K is stored rotated (K here is the stored, rotated basis)."""
    tab2 = tab.astype(np.int64).copy()
    tab2[(tab2 < 0) | (tab2 >= num_blocks)] = -1
    ks, vs = [kd], [vd]
    cap = tab.shape[1] * T
    nv = num_blocks
    for b, L in enumerate(lens):
        L = min(max(int(L), 0), cap)
        ws = window_start_ref(tab[b], L, T, P, win_map, S, num_blocks)
        for p in range(-(-ws // T), -(-L // T)):  # none when ws = L
            slot = int(win_map[int(tab[b, p])])
            ks.append(wvals[slot, 0])
            vs.append(wvals[slot, 1])
            tab2[b, p] = nv
            nv += 1
    qr = fp4cache.hadamard(np.asarray(q, np.float32)) if rotate else q
    D = q.shape[-1]
    return paged_attention_f64(np.concatenate(ks), np.concatenate(vs), qr, qsl, tab2, lens, T,
                               1 / np.sqrt(D), nv, causal)


def window_case(rng, *, ns, lens, H, T, D, group, P=3, dtname="bfloat16", layout="HND",
                swizzle=True, causal=True, rotate=True, window=True, itype=np.int32,
                nan_wk=(), nan_wv=(), tab_edit=None, map_edit=None, max_query_len=None,
                spare=2):
    """One call of the kernels with the window / rotation against window_reference."""
    max_blocks = max(-(-max(int(L), 1) // T) for L in lens) + 1
    num_blocks = sum(-(-max(int(L), 0) // T) for L in lens) + spare
    cache, kd, vd = make_gpu_cache(rng, H=H, T=T, D=D, layout=layout, swizzle=swizzle,
                                   num_blocks=num_blocks)
    tab = tables_for(rng, lens, T, num_blocks, max_blocks, itype)
    if tab_edit is not None:
        tab_edit(tab, num_blocks)
    win_map, S = map_last_pages(tab, lens, T, P, num_blocks)
    if map_edit is not None:
        map_edit(win_map, tab, S)
    bits, wvals = window_slots(rng, S, T, H, D, nan_wk, nan_wv)
    win = (cp.asarray(bits), cp.asarray(win_map), P) if window else None
    qsl = starts_of(ns, itype)
    q = rand_q(rng, int(qsl[-1]), H * group, D, dtname)
    mql = max(ns) if max_query_len is None else max_query_len
    cache.reset_counters()
    out, lse, scratch = run(cache, cp.asarray(q), cp.asarray(qsl), cp.asarray(tab),
                            cp.asarray(np.array(lens, dtype=itype)), max_query_len=mql,
                            causal=causal, window=win, rotate=rotate)
    if window:
        ro, rl = window_reference(kd, vd, wvals, win_map, P, S, q, qsl, tab, lens, T,
                                  num_blocks, causal, rotate)
    else:
        ro, rl = window_reference(kd, vd, wvals, np.full(num_blocks, -1, np.int32), P, S, q,
                                  qsl, tab, lens, T, num_blocks, causal, rotate)
    return cache, out, lse, ro, rl, scratch


def few_rows_window():
    """Whether the few-row (decode) kernel takes the window and the rotation yet (its
    part of the dispatch, fp4cache/_cuda/decode.py)."""
    import inspect

    from fp4cache._cuda import decode as cd
    return "window" in inspect.signature(cd.make_decode_plan).parameters


@pytest.mark.gpu
class TestWindow:
    """The exact window and the q rotation in ``fp4cache._cuda.varlen``'s kernels (the
    sequences of more than 32 rows, 16 for float32 q or head_dim 256: the varlen kernel; the
    few-row kernel's forms with q in shared memory in ``test_shared_q_few_rows``, its other
    forms in the mixed cases) against the float64 reference over the decoded pages and the window
    slots."""

    @pytest.mark.parametrize("window,rotate", [(True, False), (False, True), (True, True)],
                             ids=["window", "rotate", "both"])
    @pytest.mark.parametrize("D,group,dtname,layout", [
        (64, 1, "float16", "NHD"), (128, 4, "bfloat16", "HND"), (256, 8, "bfloat16", "HND"),
        (128, 16, "float32", "NHD"), (256, 2, "float32", "HND"), (64, 3, "bfloat16", "HND")])
    def test_window_and_rotation(self, D, group, dtname, layout, window, rotate):
        rng = np.random.default_rng(zlib_seed("win", D, group, dtname, layout, window, rotate))
        ns = [17, 40, 100, 64]
        lens = [17, 40 + 5 * 16 + 7, 300, 64 + 32]  # the first one shorter than the window
        for causal in (True, False):
            _, out, lse, ro, rl, _ = window_case(
                rng, ns=ns, lens=lens, H=2, T=16, D=D, group=group, dtname=dtname,
                layout=layout, causal=causal, window=window, rotate=rotate)
            check(out, lse, ro, rl, dtname, f"D={D} g={group} causal={causal}",
                  lse_tol=lse_tol(window or rotate))

    @pytest.mark.parametrize("T,swizzle,layout", [(16, True, "HND"), (32, False, "NHD"),
                                                  (64, True, "NHD"), (32, True, "HND"),
                                                  (64, False, "HND")])
    def test_block_sizes(self, T, swizzle, layout):
        rng = np.random.default_rng(zlib_seed("win-T", T, swizzle, layout))
        ns = [20, 33, 70]
        lens = [T + 20, 4 * T + 33, 2 * T + 70 - 1]
        for P in (1, 2, 5):
            _, out, lse, ro, rl, _ = window_case(rng, ns=ns, lens=lens, H=3, T=T, D=128,
                                                 group=2, P=P, layout=layout, swizzle=swizzle,
                                                 itype=np.int64)
            check(out, lse, ro, rl, "bfloat16", f"T={T} P={P}", lse_tol=WIN_LSE_TOL)

    @pytest.mark.parametrize("D,group,n,dtname", [(128, 4, 8, "bfloat16"),
                                                  (64, 2, 11, "float16"),
                                                  (256, 4, 4, "bfloat16")])
    def test_shared_q_few_rows(self, D, group, n, dtname):
        """The few-row forms with q's fragments in shared memory (17 to 32 rows per
        (sequence, KV head) at head_dim 64 / 128: four n8 tiles; 9 to 16 at head_dim 256:
        two), one launch, with the window and the rotation."""
        form = "_wide_" if D == 256 else "_wide4"
        rng = np.random.default_rng(zlib_seed("win-wide4", D, group, n))
        ns = [n, n, 1, n]
        lens = [n, 40 + 5 * 16 + 7, 300, 64 + 32]  # the first one shorter than the window
        for causal in (True, False):
            _, out, lse, ro, rl, scratch = window_case(rng, ns=ns, lens=lens, H=2, T=16, D=D,
                                                       group=group, dtname=dtname,
                                                       causal=causal)
            check(out, lse, ro, rl, dtname, f"wide4 window D={D} causal={causal}",
                  lse_tol=WIN_LSE_TOL)
            (call,) = [run.plan for run in scratch.plans.values()]
            (lp,) = call.launches
            assert f"_d{D}{form}" in lp.name, lp.name

    @pytest.mark.parametrize("group", [1, 2, 8])
    def test_chunk_rows_around_the_window_start(self, group):
        """Chunk rows whose causal limit ends before, at and past ws, query tiles whose
        last key is before ws and after it."""
        rng = np.random.default_rng(zlib_seed("win-chunk", group))
        ns = [96, 200, 64]
        lens = [500, 700, 64 + 3 * 16]
        for P in (3, 4):
            for causal in (True, False):
                _, out, lse, ro, rl, _ = window_case(rng, ns=ns, lens=lens, H=2, T=16, D=128,
                                                     group=group, P=P, causal=causal)
                check(out, lse, ro, rl, "bfloat16", f"chunk g={group} P={P} causal={causal}",
                      lse_tol=WIN_LSE_TOL)

    def test_unmapped_partially_mapped_and_bad_ids(self):
        """ws = L when the last page is not mapped (no slot, a slot outside [0, S), a bad
        id); a suffix cut by an unmapped page; a bad id before the window (NaN rows for the
        rows that see it)."""
        rng = np.random.default_rng(31)
        ns = [40] * 7  # more rows than the few-row kernel's (its bad-id rule: every row NaN)
        lens = [200, 200, 200, 200, 200, 200, 300]

        def tab_edit(tab, nb):
            tab[4, 12] = nb + 5  # last page of sequence 4: a bad id
            tab[5, 2] = -7  # a bad id long before sequence 5's window

        def map_edit(win_map, tab, S):
            win_map[tab[0, 12]] = -1  # unmapped last page
            win_map[tab[1, 11]] = -1  # mapped, unmapped, mapped: run of 1
            win_map[tab[2, 12]] = S  # slot outside [0, S): not mapped
            win_map[tab[3, 11]] = S + 100
            win_map[tab[6, 17]] = -3  # sequence 6 (19 pages): only its last page mapped
            win_map[tab[6, 16]] = -3

        cache, out, lse, ro, rl, _ = window_case(rng, ns=ns, lens=lens, H=2, T=16, D=128,
                                                 group=1, P=4, tab_edit=tab_edit,
                                                 map_edit=map_edit)
        check(out, lse, ro, rl, "bfloat16", "partial maps", lse_tol=WIN_LSE_TOL)
        assert np.isnan(ro[40 * 4:40 * 5]).any() and np.isnan(ro[40 * 5:40 * 6]).all()

    @pytest.mark.parametrize("n,group,P", [(9, 2, 3), (17, 1, 3), (8, 4, 40), (4, 16, 2),
                                           (6, 8, 33)])
    def test_splits(self, n, group, P):
        """17..64 rows per sequence (up to 32: the few-row kernel's four-tile form, more:
        the varlen kernel's one query tile), keys split over CTAs and merged; P up to 40
        pages (more than one ballot of the window start); a sequence shorter than its
        window."""
        rng = np.random.default_rng(zlib_seed("win-split", n, group, P))
        lens = [9000, 4099, 300, n]
        _, out, lse, ro, rl, scratch = window_case(rng, ns=[n] * 4, lens=lens, H=2, T=16,
                                                   D=128, group=group, P=P)
        check(out, lse, ro, rl, "bfloat16", f"splits n={n} g={group} P={P}",
              lse_tol=WIN_LSE_TOL)
        last = next(iter(scratch.plans.values())).plan.launches[-1]
        if n * group <= 32:
            (plan,) = last.keep
            assert "_wide4" in plan.spec.name and plan.grid[0] > 1  # splits
        else:
            assert last.keep[-1].slots > 1

    def test_nan_groups(self):
        """A window K group stored as NaN: NaN rows for the rows that see its key; a V
        group: NaN in its 16 columns for them."""
        rng = np.random.default_rng(33)
        ns = [40, 40, 40]
        lens = [300, 300, 300]
        # sequence b's ring is slots 3b .. 3b + 2; page p in slot 3b + p % 3
        # seq 0: K group 2 of token 300 - 25 = 275 (page 17, slot 2, token 3), head 1
        # seq 1: V group 5 of token 290 (page 18, slot 3 + 0, token 2), head 0
        _, out, lse, ro, rl, _ = window_case(rng, ns=ns, lens=lens, H=2, T=16, D=128,
                                             group=2, nan_wk=[(2, 3, 1, 2)],
                                             nan_wv=[(3, 2, 0, 5)])
        check(out, lse, ro, rl, "bfloat16", "window NaN groups", lse_tol=WIN_LSE_TOL)
        assert np.isnan(ro[:40]).any() and np.isnan(ro[40:80]).any()
        assert not np.isnan(ro[80:]).any()

    def test_mixed_batch_with_few_row_sequences(self):
        """Decodes, speculative and chunk sequences in one call: the few-row kernel and the
        varlen kernel in two launches, both with the window and the rotation."""
        if not few_rows_window():
            pytest.skip("the few-row (decode) kernel has no window yet")
        rng = np.random.default_rng(34)
        ns = [1, 300, 1, 4, 0, 1, 40]
        lens = [5000, 1300, 1, 1234, 60, 17, 40]
        for causal in (True, False):
            _, out, lse, ro, rl, _ = window_case(rng, ns=ns, lens=lens, H=2, T=16, D=128,
                                                 group=4, causal=causal)
            check(out, lse, ro, rl, "bfloat16", f"mixed causal={causal}",
                  lse_tol=WIN_LSE_TOL)

    def test_cuda_graph_capture_and_replay(self):
        """Captured once with the window; replayed after new q, lengths, tables, window
        map and slot contents (the map is read on the device)."""
        rng = np.random.default_rng(35)
        H, T, D, group, P = 2, 16, 128, 4, 3
        B, max_blocks, N = 3, 40, 60
        num_blocks = B * max_blocks
        cache, kd, vd = make_gpu_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks)
        S = P * B + 1
        qd = cp.empty((N, H * group, D), dtype=BF16)
        qsld = cp.empty((B + 1,), dtype=cp.int32)
        td = cp.empty((B, max_blocks), dtype=cp.int32)
        ld = cp.empty((B,), dtype=cp.int32)
        wd = cp.empty((S, 2, T, H, D), dtype=cp.uint16)
        md = cp.empty((num_blocks,), dtype=cp.int32)
        out = cp.empty((N, H * group, D), dtype=BF16)
        lse = cp.empty((N, H * group), dtype=cp.float32)
        scratch = new_scratch()
        stream = capture_stream()
        steps = [([20, 20, 20], [600, 20, 100]), ([5, 30, 25], [200, 31, 620]),
                 ([60, 0, 0], [640, 0, 0]), ([10, 10, 40], [17, 300, 40])]
        if not few_rows_window():
            steps = [s for s in steps if min(n for n in s[0] if n) * group > 16]

        def load(ns, lens):
            tab = tables_for(rng, lens, T, num_blocks, max_blocks)
            win_map, _ = map_last_pages(tab, lens, T, P, num_blocks)
            bits, wvals = window_slots(rng, S, T, H, D)
            q = rand_q(rng, N, H * group, D, "bfloat16")
            qsl = starts_of(ns)
            qd[...] = cp.asarray(q)
            qsld[...] = cp.asarray(qsl)
            td[...] = cp.asarray(tab)
            ld[...] = cp.asarray(np.array(lens, np.int32))
            wd[...] = cp.asarray(bits)
            md[...] = cp.asarray(win_map)
            return q, qsl, tab, win_map, wvals

        with stream:
            load(*steps[0])
            run_ = cv.varlen_runner(cache.buffer, qd, qsld, td, ld, max_query_len=60,
                                    causal=True, geom=cache.geometry, k_s=cache.pool.k_s,
                                    v_s=cache.pool.v_s, sm_scale=1 / np.sqrt(D),
                                    stats=cache.pool.stats, scratch=scratch,
                                    window=(wd, md, P), rotate=True)
            run_(qd, qsld, td, ld, out, lse)
            stream.synchronize()
            stream.begin_capture()
            run_(qd, qsld, td, ld, out, lse)
            graph = stream.end_capture()
        for rep, (ns, lens) in enumerate(steps + steps[:1]):
            with stream:
                q, qsl, tab, win_map, wvals = load(ns, lens)
                out.view(cp.uint16).fill(0x7E7E)
                lse.fill(12345.0)
                graph.launch(stream)
            stream.synchronize()
            ro, rl = window_reference(kd, vd, wvals, win_map, P, S, q, qsl, tab, lens, T,
                                      num_blocks, True, True)
            n = int(qsl[-1])
            check(out[:n], lse[:n], ro[:n], rl[:n], "bfloat16", f"replay {rep}",
                  lse_tol=WIN_LSE_TOL)

    def test_plan_key_and_kernel_variant(self):
        """The plain call takes the plain kernel, the window / rotation the _win variant;
        each its own plan."""
        rng = np.random.default_rng(36)
        cache, kd, vd = make_gpu_cache(rng, H=2, T=16, D=64, num_blocks=20)
        tab = cp.asarray(tables_for(rng, [100], 16, 20, 8))
        q = cp.asarray(rand_q(rng, 40, 2, 64, "bfloat16"))
        qsl = cp.asarray(starts_of([40]))
        lens = cp.asarray(np.array([100], np.int32))
        win = (cp.zeros((3, 2, 16, 2, 64), cp.uint16), cp.full(20, -1, cp.int32), 3)
        scratch = new_scratch()
        for w, r in ((None, False), (win, False), (None, True), (win, True)):
            run(cache, q, qsl, tab, lens, max_query_len=40, causal=True, scratch=scratch,
                window=w, rotate=r)
        plans = list(scratch.plans.values())
        assert len(plans) == 4
        fns = [p.plan.launches[-1].fn for p in plans]
        assert fns[1] is fns[2] is fns[3] and fns[0] is not fns[1]


# (D, group, T, layout, swizzle, rotation, window pages, dtype)
WINDOW_CPU_CASES = [
    (128, 4, 16, "HND", True, "hadamard", 3, "bfloat16"),
    (128, 4, 16, "NHD", False, "none", 3, "bfloat16"),
    (128, 2, 32, "NHD", True, "hadamard", 0, "float16"),
    (64, 1, 16, "HND", True, "hadamard", 2, "float16"),
    (64, 8, 64, "NHD", True, "none", 4, "float32"),
    (256, 16, 16, "HND", True, "hadamard", 3, "bfloat16"),
    (256, 2, 32, "NHD", False, "hadamard", 3, "float32"),
]


@pytest.mark.gpu
class TestWindowCPU:
    """The window and the rotation through ``fp4cache._cuda.varlen`` (the few-row and the
    varlen kernel in one call) against the CPU backend on the same pages, window slots and
    map (``helpers.window_cpu_cache``: mapped before the stores, so the slots
    hold the exact values; the CPU backend has its float64 checks in test_window.py)."""

    @pytest.mark.parametrize("case", WINDOW_CPU_CASES, ids=lambda c: "-".join(map(str, c)))
    def test_mixed_batch_matches_cpu(self, case):

        D, group, T, layout, swizzle, rotation, P, dtname = case
        rng = np.random.default_rng(zlib.crc32(repr(("vl",) + case).encode()))
        H = 2
        ns = [1, 4, 40, 100, 0, 17, 70]
        lens = [300, 5 * T + 3, 40, 7 * T + 100, 60, 17 + 2 * T, 4 * T + 70]
        unmapped = [(1, -(-lens[1] // T) - 1), (3, -(-lens[3] // T) - 2)] if P >= 2 else []
        cpu, tab, sl = window_cpu_cache(rng, H=H, T=T, D=D, lens=lens, P=P, rotation=rotation,
                                        layout=layout, swizzle=swizzle, unmapped=unmapped)
        q = rand_q(rng, sum(ns), H * group, D, dtname)
        qsl = starts_of(ns)
        buf = cp.asarray(cpu.buffer)
        win = None if cpu.window is None else (cp.asarray(cpu.window),
                                                cp.asarray(cpu.window_map), cpu.window_pages)
        stats = cp.zeros(cpu.pool.stats.shape, cp.uint64)
        for causal in (True, False):
            ro, rl = cpu.attention(q, qsl, tab, sl, causal=causal, return_lse=True)
            out = poisoned(q.shape, q.dtype)
            lse = poisoned(q.shape[:2], np.float32)
            cv.attention(buf, cp.asarray(q), cp.asarray(qsl), cp.asarray(tab), cp.asarray(sl),
                         out, lse, max_query_len=max(ns), causal=causal, geom=cpu.geometry,
                         k_s=cpu.pool.k_s, v_s=cpu.pool.v_s, sm_scale=1 / np.sqrt(D),
                         stats=stats, scratch=new_scratch(), window=win,
                         rotate=rotation == "hadamard")
            check_rows(out, lse, np.asarray(ro, np.float64), np.asarray(rl, np.float64), dtname,
                       f"{case} causal={causal}", lse_tol=lse_tol(P > 0 or rotation == "hadamard"))


@pytest.mark.gpu
@pytest.mark.parametrize("rotation,P", [("hadamard", 3), ("none", 2), ("hadamard", 0)])
def test_public_method_with_window_matches_cpu_cache(rotation, P):
    """End to end through ``PagedKVCache.attention``: a GPU and a CPU cache with the same
    options, the same map_window calls (the last P pages of each sequence, mapped before
    the stores) and stores; a mixed batch (few-row and chunk sequences) on both."""
    rng = np.random.default_rng(zlib_seed("public-window", rotation, P))
    H, T, D, group = 2, 16, 128, 4
    ns = [1, 4, 40, 100, 0, 17]
    lens = np.array([300, 5 * T + 3, 40, 7 * T + 100, 60, 17 + 2 * T], np.int32)
    npg = [-(-int(n) // T) for n in lens]
    nb = sum(npg) + 2
    opts = dict(rotation=rotation, k_scale=8.0 * 4.5 / (6 * 448), v_scale=4.5 / (6 * 448))
    if P:
        opts.update(window_pages=P, window_slots=P * len(lens))
    cpu = PagedKVCache(nb, T, H, D, device="cpu", **opts)
    gpu = PagedKVCache(nb, T, H, D, device="cuda", **opts)
    tab = np.full((len(lens), max(npg) + 1), -1, np.int32)
    perm = rng.permutation(nb)
    pos = 0
    for b, n in enumerate(npg):
        tab[b, :n] = perm[pos:pos + n]
        pos += n
    if P:
        blocks = np.array([tab[b, p] for b, n in enumerate(npg)
                           for p in range(max(0, n - P), n)], np.int32)
        slots = np.array([P * b + p % P for b, n in enumerate(npg)
                          for p in range(max(0, n - P), n)], np.int32)
        cpu.map_window(blocks, slots)
        gpu.map_window(cp.asarray(blocks), cp.asarray(slots))
    slot_ids = np.concatenate([tab[b, np.arange(n) // T] * T + np.arange(n) % T
                               for b, n in enumerate(lens) if n]).astype(np.int64)
    k = rng.standard_normal((slot_ids.size, H, D), dtype=np.float32).astype(BF16)
    v = rng.standard_normal((slot_ids.size, H, D), dtype=np.float32).astype(BF16)
    cpu.store(slot_ids, k, v)
    gpu.store(cp.asarray(slot_ids), cp.asarray(k), cp.asarray(v))
    q = rand_q(rng, sum(ns), H * group, D, "bfloat16")
    qsl = starts_of(ns)
    for causal in (True, False):
        ro, rl = cpu.attention(q.astype(np.float32), qsl, tab, lens, causal=causal,
                               return_lse=True)
        out, lse = call(gpu, q, qsl, tab, lens, causal=causal, max_query_len=max(ns))
        check_rows(out, lse, np.asarray(ro, np.float64), np.asarray(rl, np.float64),
                   "bfloat16", f"public {rotation} P={P} causal={causal}",
                   lse_tol=lse_tol(P > 0 or rotation == "hadamard"))
