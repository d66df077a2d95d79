"""``PagedKVCache.decode_attention`` (one query token per sequence) against the float64
reference ``nvfp4_ref.paged_attention_f64``, on the CPU and, under the ``gpu`` marker, on
the GPU.

The reference is written plainly: for each sequence and query head, a float64 softmax
over the float32 K/V values that ``gather_dequant`` returns for the sequence's pages, with
KV head ``hq // (Hq // H)`` (``helpers.decode_reference`` feeds it a CPU cache's pages).

CPU tolerances.  The NumPy backend reads the same float32 K/V values and accumulates
scores, softmax and the weighted sum in float64; it differs from the reference only by
float64 rounding order (relative error ~1e-15 of the row's magnitude), then both are
rounded to q's dtype.  So each output element must be within ``2 * u * |ref| + 1e-9 *
max|ref row|`` of the float64 reference, where ``u`` is the unit roundoff of q's dtype
(2^-8 bf16, 2^-11 f16, 2^-24 f32): one rounding to the output dtype (at most ``u |ref|``,
doubled for the float64 -> float32 -> dtype double rounding and the float64 noise at a
rounding boundary), plus an absolute term far above the float64 noise and far below any
real error.  For float16 the absolute term also covers its subnormal spacing (2^-24).
``lse`` is float32: within ``2^-23 * |ref| + 1e-9``.  A wrong head mapping, a wrong page,
a missed token or float32 accumulation over long rows all break these bounds
(``helpers.assert_close``, ``helpers.assert_lse_close``).

GPU tolerances (``TestKernel``: the fused kernels of ``fp4cache._cuda.decode``; the
public method on the GPU).  The reference and the kernel see the same decoded K/V values
(the kernel's f16 K/V are exact: an E2M1 value times an E4M3 scale has at most 6
significant bits); they differ by the kernel's rounding of q to f16 (exact for bf16/f16 q;
hi + lo parts, ~2^-22, for float32 q), of the softmax weights P to f16 for the P.V MMA
(2^-11 relative), the f32 accumulation order, ex2.approx, and the rounding of the output
to its dtype (2^-9 for bf16).  Tolerances, per output row (b, query head), on the relative
2-norm error over the row's finite entries: <= 1e-2 for bf16/f16 outputs, <= 3e-3 for
float32 outputs (the expected errors are ~2e-3 and ~5e-4).  NaN positions must match
exactly.  lse: |error| <= 1e-3 * max(1, |lse|) (the denominator is summed in f32 from f32
weights; only the scores' f32 accumulation differs).  Outputs are poisoned before every
run so that an unwritten entry cannot pass (``helpers.check``).
"""

from __future__ import annotations

import math
import zlib

import ml_dtypes
import numpy as np
import pytest
from conftest import DLPackProducer
from helpers import (
    ATTENTION_CASES,
    DT,
    TOL,
    RecordingRunner,
    assert_close,
    assert_lse_close,
    capture_stream,
    check,
    decode_f64,
    decode_reference,
    kv_values,
    make_cache,
    make_gpu_cache,
    make_q,
    make_tables,
    poisoned,
    rand_q,
    tables_for,
    window_cpu_cache,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fp4cache
from fp4cache import PagedKVCache, formats
from fp4cache import _cpu as npb
from fp4cache import _kernels as K

try:  # CuPy and its backend modules, for the GPU cases (which skip by their marker
    # where there is no GPU: collection needs no CuPy)
    import cupy as cp

    from fp4cache._cuda import decode as ca
except ImportError:
    ca = cp = None


BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
DTYPES = {"bfloat16": BF16, "float16": F16, "float32": F32}


# -- helpers -------------------------------------------------------------------------------
def run_and_compare(cache, q, tables, lens, **kw):
    buf = cache.buffer.copy()
    out, lse = cache.decode_attention(q, tables, lens, return_lse=True, **kw)
    ref_out, ref_lse = decode_reference(cache, q, tables, lens, kw.get("sm_scale"))
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    assert_close(out, ref_out, q.dtype)
    assert_lse_close(lse, ref_lse)
    assert np.array_equal(cache.buffer, buf), "decode_attention changed the cache buffer"
    return out, lse


# -- the values ----------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("swizzle", [True, False])
@pytest.mark.parametrize("rule", ["static6", "4over6"])
def test_layouts_swizzle_rules(layout, swizzle, rule):
    cache = make_cache(layout=layout, swizzle_v_scales=swizzle, scale_rule=rule,
                       k_scale=0.02, v_scale=0.5)
    lens = [1, 15, 16, 17, 100, 0, 64]
    tables, lens = make_tables(cache, lens)
    run_and_compare(cache, make_q(len(lens), 8, 64), tables, lens)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_head_dims(head_dim, layout):
    cache = make_cache(num_blocks=10, block_size=8, num_heads=2, head_dim=head_dim,
                       layout=layout)
    tables, lens = make_tables(cache, [3, 8, 41, 80])
    run_and_compare(cache, make_q(4, 4, head_dim), tables, lens)


@pytest.mark.parametrize("block_size,swizzle", [(1, False), (3, False), (4, True), (5, False),
                                                (8, True), (32, True), (64, True)])
def test_block_sizes(block_size, swizzle):
    cache = make_cache(num_blocks=max(4, 256 // block_size), block_size=block_size,
                       swizzle_v_scales=swizzle)
    lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 2, 200]
    lens = [n for n in lens if n > 0]
    tables, lens = make_tables(cache, lens)
    run_and_compare(cache, make_q(len(lens), 4, 64), tables, lens)


@pytest.mark.parametrize("group", [1, 2, 4, 8, 16])
def test_group_sizes(group):
    cache = make_cache(num_heads=3)
    tables, lens = make_tables(cache, [37, 5, 130])
    run_and_compare(cache, make_q(3, 3 * group, 64), tables, lens)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_q_dtypes(dtype):
    cache = make_cache()
    tables, lens = make_tables(cache, [50, 1, 16])
    q = make_q(3, 4, 64, DTYPES[dtype])
    out, _ = run_and_compare(cache, q, tables, lens)
    assert out.dtype == DTYPES[dtype]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_configurations(data):
    """Layout, swizzle, rule, head_dim, block size, heads, group, dtype and lengths drawn
    together (the parametrized tests above vary one or two at a time)."""
    swizzle = data.draw(st.booleans(), "swizzle")
    head_dim = data.draw(st.sampled_from([64, 128] if swizzle else [16, 48, 64, 128]), "D")
    block_size = data.draw(st.sampled_from([4, 8, 12] if swizzle else [1, 2, 5, 8]), "T")
    heads = data.draw(st.integers(1, 3), "H")
    group = data.draw(st.sampled_from([1, 2, 3, 4, 8, 16]), "group")
    cache = make_cache(num_blocks=12, block_size=block_size, num_heads=heads,
                       head_dim=head_dim, swizzle_v_scales=swizzle,
                       layout=data.draw(st.sampled_from(["HND", "NHD"]), "layout"),
                       scale_rule=data.draw(st.sampled_from(["static6", "4over6"]), "rule"),
                       seed=data.draw(st.integers(0, 2**16), "seed"))
    lens = data.draw(st.lists(st.integers(0, 12 * block_size), min_size=1, max_size=4), "lens")
    tables, lens = make_tables(cache, lens, seed=data.draw(st.integers(0, 2**16)))
    dtype = DTYPES[data.draw(st.sampled_from(list(DTYPES)), "dtype")]
    run_and_compare(cache, make_q(len(lens), heads * group, head_dim, dtype), tables, lens,
                    sm_scale=data.draw(st.sampled_from([None, 0.05, 1.0]), "sm_scale"))


def test_long_sequence_and_sm_scale():
    """8,192 tokens: float32 accumulation of the sums over the row would miss the bound."""
    cache = make_cache(num_blocks=520, block_size=16, num_heads=2, head_dim=64)
    tables, lens = make_tables(cache, [8192, 8000, 3])
    q = make_q(3, 4, 64) * 3  # peaky softmax: a few tokens dominate
    run_and_compare(cache, q, tables, lens, sm_scale=0.3)


def test_many_chunks_of_pages(monkeypatch):
    """The backend's online softmax merges chunks of pages: force one page per chunk."""
    monkeypatch.setattr(npb, "_ATTN_CHUNK_VALUES", 1)
    cache = make_cache(num_blocks=12, block_size=4)
    tables, lens = make_tables(cache, [45, 4, 0, 13, 1])
    run_and_compare(cache, make_q(5, 4, 64, BF16), tables, lens)


def test_working_memory_does_not_grow_with_the_batch(monkeypatch):
    """The backend attends to the sequences in groups of about ``_ATTN_CHUNK_VALUES``
    working values: under a small budget 1,000 sequences peak at a fraction of their
    memory in one group, with the same bits (one page per sequence: the same chunks of
    pages either way)."""
    import tracemalloc

    cache = make_cache(num_blocks=24)
    tables, lens = make_tables(cache, np.random.default_rng(3).integers(0, 17, 1000))
    q = make_q(1000, 4, 64)
    peaks, outs = [], []
    for budget in (1 << 40, 1 << 13):  # one group; groups of 3 sequences
        monkeypatch.setattr(npb, "_ATTN_CHUNK_VALUES", budget)
        tracemalloc.start()
        try:
            outs.append(cache.decode_attention(q, tables, lens, return_lse=True))
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    assert np.array_equal(outs[0][0], outs[1][0]) and np.array_equal(outs[0][1], outs[1][1])
    assert peaks[1] < peaks[0] / 4, peaks


def test_default_sm_scale_is_rsqrt_head_dim():
    cache = make_cache(head_dim=128)
    tables, lens = make_tables(cache, [70, 9])
    q = make_q(2, 2, 128)
    default = cache.decode_attention(q, tables, lens)
    explicit = cache.decode_attention(q, tables, lens, sm_scale=1 / math.sqrt(128))
    other = cache.decode_attention(q, tables, lens, sm_scale=0.5)
    assert np.array_equal(default, explicit)
    assert not np.allclose(default, other)


def test_length_zero_gives_zeros_and_minus_inf():
    cache = make_cache()
    tables = np.full((3, 2), -1, np.int32)
    tables[1, 0] = 4
    lens = np.array([0, 7, 0])
    out, lse = cache.decode_attention(make_q(3, 2, 64), tables, lens, return_lse=True)
    assert np.all(out[[0, 2]] == 0) and np.all(np.isneginf(lse[[0, 2]]))
    assert np.all(np.isfinite(out[1])) and np.all(np.isfinite(lse[1]))
    empty = cache.decode_attention(np.zeros((0, 2, 64), np.float32), np.zeros((0, 3), np.int32),
                                   np.zeros(0, np.int32), return_lse=True)
    assert empty[0].shape == (0, 2, 64) and empty[1].shape == (0, 2)


def test_length_one_is_that_tokens_value():
    """One token: the softmax weight is 1, so out is that token's V (rounded to q's dtype)."""
    cache = make_cache()
    q = make_q(1, 4, 64)
    out, lse = cache.decode_attention(q, np.array([[5]]), np.array([1]), return_lse=True)
    k, v = cache.gather_dequant(np.array([5]), dtype="float32")
    G = 2
    for hq in range(4):
        assert np.array_equal(out[0, hq], v[0, hq // G])
        score = np.float32(1 / 8) * (k[0, hq // G].astype(np.float64) @ q[0, hq])
        assert lse[0, hq] == pytest.approx(score, rel=1e-6)


def test_gqa_maps_query_head_to_h_div_group():
    """V of KV head h is the constant h+1, so out[hq] names the KV head it read.  With
    h % H instead of h // group, query heads 1, 2, 3, 5... would read another KV head."""
    H, group, T = 3, 4, 16
    cache = make_cache(num_blocks=4, block_size=T, num_heads=H, fill=False)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((4 * T, H, 64), dtype=np.float32)
    v = np.broadcast_to(np.arange(1, H + 1, dtype=np.float32)[None, :, None], k.shape).copy()
    cache.store(np.arange(4 * T), k, v)
    _, v_hat = cache.gather_dequant(np.arange(4), dtype="float32")
    per_head = v_hat[0, :, 0]
    assert np.all(v_hat == per_head[None, :, None]), "V did not decode to one value per head"
    assert len(set(per_head.tolist())) == H
    out = cache.decode_attention(make_q(2, H * group, 64), np.array([[0, 1, 2], [3, 2, -1]]),
                                 np.array([40, 20]))
    for hq in range(H * group):
        np.testing.assert_allclose(out[:, hq], per_head[hq // group], rtol=1e-6)
        if hq // group != hq % H:
            assert not np.allclose(out[:, hq], per_head[hq % H])


def test_decoded_pages_are_gather_dequant_values():
    """The backend's page decoder returns exactly gather_dequant's float32 values."""
    for layout, swizzle in (("HND", True), ("NHD", True), ("HND", False), ("NHD", False)):
        cache = make_cache(num_blocks=5, block_size=8, num_heads=3, head_dim=128,
                           layout=layout, swizzle_v_scales=swizzle, scale_rule="4over6")
        ids = np.array([3, 0, 4, 4])
        k, v = cache.gather_dequant(ids, dtype="float32")
        pages = cache.buffer[ids]
        g = cache.geometry
        # decode_pages is head-major [n, H, T, D]; gather_dequant token-major [n*T, H, D]
        dk = npb.decode_pages(pages[:, 0], g, 0, cache.pool.k_s).swapaxes(1, 2).reshape(k.shape)
        dv = npb.decode_pages(pages[:, 1], g, 1, cache.pool.v_s).swapaxes(1, 2).reshape(v.shape)
        assert np.array_equal(dk, k) and np.array_equal(dv, v)


def test_ignored_entries_shared_pages_and_validate_true():
    """Entries past ceil(len / T) are never read (-1 or huge); pages may repeat across
    rows (a shared prompt prefix); validate=True gives the same result."""
    cache = make_cache(block_size=8)
    tables = np.array([[3, 7, 1, -1, -1], [3, 7, 2, 10**6, -5], [3, 7, 1, 9, 9]],
                      dtype=np.int64)
    lens = np.array([20, 17, 24])
    out, _ = run_and_compare(cache, make_q(3, 4, 64), tables, lens)
    again = cache.decode_attention(make_q(3, 4, 64), tables, lens, validate=True)
    assert np.array_equal(out, again)
    # Rows 0 and 2 share their first 20 tokens: the row of length 20 sees exactly those.
    same = cache.decode_attention(make_q(3, 4, 64)[[0, 0]], tables[[0, 2]], np.array([20, 20]))
    assert np.array_equal(same[0], same[1])


def test_tokens_past_seq_len_in_the_last_page_are_not_read():
    """A NaN stored in slot 5 of the last page does not reach a sequence of length 5."""
    cache = make_cache(num_blocks=4, block_size=8)
    kv = np.full((1, 2, 64), np.nan, np.float32)
    cache.store(np.array([2 * 8 + 5]), kv, kv)
    out = cache.decode_attention(make_q(2, 2, 64), np.array([[1, 2], [1, 2]]),
                                 np.array([13, 14]))
    assert np.all(np.isfinite(out[0])) and np.all(np.isnan(out[1]))


def test_nan_groups_propagate():
    """A K group stored as NaN: every output of the query heads of its KV head is NaN in
    the sequences that attend to that token; a V group: those 16 channels only."""
    H, group, T = 2, 2, 8
    cache = make_cache(num_blocks=6, block_size=T, num_heads=H)
    k = np.ones((2, H, 64), np.float32)
    v = np.ones((2, H, 64), np.float32)
    k[0, 1, 3] = np.nan  # token in slot 9 (page 1): K of head 1, group 0
    v[1, 0, 40] = np.inf  # token in slot 34 (page 4): V of head 0, group 2
    cache.store(np.array([9, 34]), k, v)
    assert cache.nonfinite_groups == (1, 1)
    tables = np.array([[1, 2], [4, 5], [2, 3]])
    out, lse = cache.decode_attention(make_q(3, H * group, 64), tables, np.array([16, 16, 16]),
                                      return_lse=True)
    nan = np.isnan(out)
    # sequence 0 reads page 1: query heads 2, 3 (KV head 1) all NaN, heads 0, 1 finite
    assert nan[0, 2:].all() and not nan[0, :2].any() and np.isnan(lse[0, 2:]).all()
    # sequence 1 reads page 4: query heads 0, 1, channels 32..47 NaN, nothing else
    want = np.zeros((H * group, 64), bool)
    want[:2, 32:48] = True
    assert np.array_equal(nan[1], want) and np.isfinite(lse[1]).all()
    assert not nan[2].any()


def test_bad_block_ids_deferred_like_the_gpu():
    """validate=False on the CPU does what the kernels do: the sequence with a bad page
    gives NaN everywhere, the others are exact, the ids are counted and check() raises."""
    cache = make_cache(num_blocks=8, block_size=8)
    tables = np.array([[1, 2, 3], [4, 99, -1], [5, -3, 6], [7, 0, -1]], np.int32)
    lens = np.array([24, 12, 20, 3])  # row 3 never reaches its entry -1 at column 2
    q = make_q(4, 4, 64)
    buf = cache.buffer.copy()
    out, lse = cache.decode_attention(q, tables, lens, return_lse=True, validate=False)
    assert np.isnan(out[1]).all() and np.isnan(out[2]).all() and np.isnan(lse[1:3]).all()
    good = [0, 3]
    ref_out, ref_lse = decode_reference(cache, q[good], tables[good], lens[good])
    assert_close(out[good], ref_out, F32)
    assert_lse_close(lse[good], ref_lse)
    assert cache.stats["bad_block_ids"] == 2
    with pytest.raises(IndexError, match="2 block id"):
        cache.check()
    cache.check()  # the counter was reset
    assert np.array_equal(cache.buffer, buf)


def test_dlpack_and_non_contiguous_inputs():
    cache = make_cache()
    tables, lens = make_tables(cache, [33, 2, 64])
    q = make_q(3, 4, 64)
    want = cache.decode_attention(q, tables, lens)
    got = cache.decode_attention(DLPackProducer(q), DLPackProducer(tables), DLPackProducer(lens))
    assert np.array_equal(got, want)
    wide = np.zeros((3, 8, 64), np.float32)
    wide[:, ::2] = q
    wide_tables = np.zeros((3, 2 * tables.shape[1]), np.int32)
    wide_tables[:, ::2] = tables
    got = cache.decode_attention(wide[:, ::2], wide_tables[:, ::2], [33, 2, 64])
    assert np.array_equal(got, want)


# -- out= ----------------------------------------------------------------------------------
def test_out_and_lse_out_are_written_and_returned():
    cache = make_cache()
    tables, lens = make_tables(cache, [40, 0])
    q = make_q(2, 4, 64, BF16)
    want_out, want_lse = cache.decode_attention(q, tables, lens, return_lse=True)
    out = np.full((2, 4, 64), 7, BF16)
    lse = np.full((2, 4), 7, np.float32)
    got = cache.decode_attention(q, tables, lens, out=out, lse_out=lse, return_lse=True)
    assert got[0] is out and got[1] is lse
    assert np.array_equal(out.view(np.uint16), want_out.view(np.uint16))
    assert np.array_equal(lse, want_lse)
    out2 = np.empty((2, 4, 64), BF16)
    assert cache.decode_attention(q, tables, lens, out=out2) is out2


@pytest.mark.parametrize("kwargs,exc,pattern", [
    (dict(out=np.empty((2, 4, 32), BF16)), ValueError, r"out must have shape \(2, 4, 64\)"),
    (dict(out=np.empty((2, 4, 64), np.float32)), TypeError, "out must have dtype bfloat16"),
    (dict(out=np.empty((2, 4, 128), BF16)[..., ::2]), ValueError, "out must be C-contiguous"),
    (dict(out=[[0.0]]), TypeError, "out must be an array .*got a Python list"),
    (dict(lse_out=np.empty((2, 4), np.float32)), ValueError, "lse_out .*return_lse"),
    (dict(lse_out=np.empty((2, 4), np.float64), return_lse=True), TypeError,
     "lse_out must have dtype float32"),
    (dict(lse_out=np.empty((4, 2), np.float32), return_lse=True), ValueError,
     r"lse_out must have shape \(2, 4\)"),
])
def test_out_checks(kwargs, exc, pattern):
    cache = make_cache()
    tables, lens = make_tables(cache, [40, 3])
    buf = cache.buffer.copy()
    with pytest.raises(exc, match=pattern):
        cache.decode_attention(make_q(2, 4, 64, BF16), tables, lens, **kwargs)
    assert np.array_equal(cache.buffer, buf)


def test_out_overlapping_q_is_refused():
    cache = make_cache()
    tables, lens = make_tables(cache, [40, 3])
    q = make_q(2, 4, 64)
    with pytest.raises(ValueError, match="out must not overlap q"):
        cache.decode_attention(q, tables, lens, out=q)
    lse = np.empty(8, np.float32)
    with pytest.raises(ValueError, match="lse_out must not overlap"):
        cache.decode_attention(q, tables, lens, out=q.copy(), lse_out=q.reshape(-1)[:8]
                               .reshape(2, 4), return_lse=True)
    cache.decode_attention(q, tables, lens, lse_out=lse.reshape(2, 4), return_lse=True)


# -- errors: each names its parameter and leaves the buffer alone --------------------------
class _GpuProducer:
    """Claims to live on a CUDA device (DLPack device type 2): a CPU cache refuses it."""

    def __dlpack__(self, **kwargs):
        raise AssertionError("a refused array must not be read")

    def __dlpack_device__(self):
        return (2, 0)


def _good():
    return dict(q=make_q(2, 4, 64), block_tables=np.array([[0, 1, 2], [3, -1, -1]], np.int32),
                seq_lens=np.array([40, 16], np.int32))


ERRORS = [
    ("q int32", dict(q=np.zeros((2, 4, 64), np.int32)), TypeError,
     "q must have dtype bfloat16, float16 or float32, got int32"),
    ("q float64", dict(q=np.zeros((2, 4, 64))), TypeError, "q must have dtype .* float64"),
    ("q 2-D", dict(q=np.zeros((2, 64), np.float32)), ValueError, r"q must be 3-D"),
    ("q head_dim", dict(q=np.zeros((2, 4, 128), np.float32)), ValueError,
     r"q.shape\[2\] must equal the cache's head_dim \(64\), got 128"),
    ("Hq not a multiple", dict(q=np.zeros((2, 3, 64), np.float32)), ValueError,
     r"Hq = 3.*num_heads \(2\)"),
    ("group 32", dict(q=np.zeros((2, 64, 64), np.float32)), ValueError,
     r"Hq = 64.*num_heads \(2\).*between 1 and 16"),
    ("block_tables float", dict(block_tables=np.zeros((2, 3))), TypeError,
     "block_tables must have dtype int32 or int64, got float64"),
    ("block_tables 1-D", dict(block_tables=np.zeros(3, np.int32)), ValueError,
     "block_tables must be 2-D"),
    ("block_tables rows", dict(block_tables=np.zeros((3, 3), np.int32)), ValueError,
     r"block_tables must have one row per sequence \(B = 2"),
    ("seq_lens float", dict(seq_lens=np.array([1.0, 2.0])), TypeError,
     "seq_lens must have dtype int32 or int64"),
    ("seq_lens 2-D", dict(seq_lens=np.zeros((2, 1), np.int32)), ValueError,
     "seq_lens must be 1-D"),
    ("seq_lens length", dict(seq_lens=np.zeros(3, np.int32)), ValueError,
     r"seq_lens must have one entry per sequence \(B = 2"),
    ("seq_lens negative", dict(seq_lens=np.array([40, -1])), ValueError,
     r"seq_lens\[1\] = -1 is out of range: it must be in \[0, 48\]"),
    ("seq_lens past capacity", dict(seq_lens=np.array([49, 16])), ValueError,
     r"seq_lens\[0\] = 49 .*\[0, 48\].*max_blocks 3 \* block_size 16"),
    ("bad block id", dict(block_tables=np.array([[0, 24, 2], [3, -1, -1]])), IndexError,
     r"block_tables\[0, 1\] = 24 is out of range.*\[0, 24\)"),
    ("negative block id", dict(seq_lens=np.array([40, 17])), IndexError,
     r"block_tables\[1, 1\] = -1 is out of range"),
    ("q on a GPU", dict(q=_GpuProducer()), TypeError, "q must be a NumPy"),
    ("out on a GPU", dict(out=_GpuProducer()), TypeError, "out must be a NumPy"),
    ("lse_out on a GPU", dict(lse_out=_GpuProducer(), return_lse=True), TypeError,
     "lse_out must be a NumPy"),
    ("sm_scale zero", dict(sm_scale=0.0), ValueError, "sm_scale must be a positive finite"),
    ("sm_scale nan", dict(sm_scale=float("nan")), ValueError, "sm_scale"),
    ("sm_scale inf", dict(sm_scale=float("inf")), ValueError, "sm_scale"),
    ("sm_scale negative", dict(sm_scale=-0.1), ValueError, "sm_scale"),
    ("sm_scale text", dict(sm_scale="big"), TypeError, "sm_scale"),
    ("sm_scale bool", dict(sm_scale=True), TypeError, "sm_scale"),
]


@pytest.mark.parametrize("case,override,exc,pattern", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors(case, override, exc, pattern):
    cache = make_cache()
    buf = cache.buffer.copy()
    stats = cache.stats
    args = {**_good(), **override}
    with pytest.raises(exc, match=pattern):
        cache.decode_attention(args.pop("q"), args.pop("block_tables"), args.pop("seq_lens"),
                               **args)
    assert np.array_equal(cache.buffer, buf)
    assert cache.stats == stats


def test_seq_lens_are_checked_on_the_cpu_even_without_validation():
    cache = make_cache()
    g = _good()
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 100"):
        cache.decode_attention(g["q"], g["block_tables"], np.array([100, 1]), validate=False)


def test_good_arguments_pass():
    """The baseline of the error table is a valid call."""
    cache = make_cache()
    g = _good()
    out = cache.decode_attention(g["q"], g["block_tables"], g["seq_lens"])
    assert np.isfinite(out).all()


def test_max_group_is_the_limit_the_front_end_enforces():
    """``fp4cache._abi.MAX_GROUP`` query heads per KV head run; one more is refused
    with a message naming the limit, and the cache is left as it was."""
    from fp4cache._abi import MAX_GROUP

    cache = make_cache(num_heads=1)
    tables, lens = np.array([[0, 1]], np.int32), np.array([20], np.int32)
    out = cache.decode_attention(make_q(1, MAX_GROUP, 64), tables, lens)
    assert out.shape == (1, MAX_GROUP, 64) and np.isfinite(out).all()
    before = cache.buffer.copy()
    with pytest.raises(ValueError, match=rf"Hq = {MAX_GROUP + 1}\b.*between 1 and {MAX_GROUP}"):
        cache.decode_attention(make_q(1, MAX_GROUP + 1, 64), tables, lens)
    np.testing.assert_array_equal(cache.buffer, before)


# -- the GPU front end (any backend: a recording stand-in takes the kernels' place) --------
class _RecordingBackend:
    """A backend whose ``attention_runner`` records the front end's calls
    (:class:`helpers.RecordingRunner`)."""

    def __init__(self):
        self.attention_runner = RecordingRunner()
        self.calls = self.attention_runner.calls


@pytest.fixture
def gpu_cache(monkeypatch):
    cache = PagedKVCache(8, 16, 2, 64, device="cuda")
    backend = _RecordingBackend()
    monkeypatch.setattr(cache.pool, "backend", backend)
    return cache, backend


@pytest.mark.gpu
def test_gpu_hot_path_skips_checks_for_a_known_signature(gpu_cache, monkeypatch):
    import cupy

    from fp4cache import attention

    cache, backend = gpu_cache
    q = cupy.zeros((3, 4, 64), dtype=np.float32)
    bt = cupy.zeros((3, 2), dtype=cupy.int32)
    sl = cupy.full(3, 5, dtype=cupy.int32)
    out = cupy.empty((3, 4, 64), dtype=np.float32)
    lse = cupy.empty((3, 4), dtype=np.float32)
    first = cache.decode_attention(q, bt, sl, out=out, lse_out=lse, return_lse=True)
    assert first[0] is out and first[1] is lse
    checks = []
    real = attention._check_args
    monkeypatch.setattr(attention, "_check_args",
                        lambda *a, **k: checks.append(1) or real(*a, **k))
    again = cache.decode_attention(q, bt, sl, out=out, lse_out=lse, return_lse=True)
    assert checks == [] and again[0] is out and again[1] is lse
    auto = cache.decode_attention(q, bt, sl)  # a new signature (no out=): checked once
    assert checks == [1] and auto.dtype == np.float32 and auto.shape == (3, 4, 64)
    cache.decode_attention(q, bt, sl)
    assert checks == [1]
    assert len(backend.calls) == 4
    for call in backend.calls:
        assert call["q"] is q and call["block_tables"] is bt and call["seq_lens"] is sl
        assert call["sm_scale"] == float(np.float32(1 / 8))
        assert call["pool"] is cache.pool and call["query_start_loc"] is None
    assert backend.calls[0]["out"] is out and backend.calls[0]["lse"] is lse
    assert backend.calls[2]["lse"] is None
    # A changed signature takes the checked path and is refused there.
    with pytest.raises(TypeError, match="out must have dtype float32"):
        cache.decode_attention(q, bt, sl, out=out.astype(np.float16))
    with pytest.raises(ValueError, match="sm_scale"):
        cache.decode_attention(q, bt, sl, out=out, sm_scale=-1.0)
    assert len(backend.calls) == 4


@pytest.mark.gpu
def test_gpu_validate_true_refuses_before_the_backend(gpu_cache):
    import cupy

    cache, backend = gpu_cache
    q = cupy.zeros((2, 2, 64), dtype=np.float32)
    bt = cupy.asarray(np.array([[0, 1], [8, -1]], np.int32))
    buf = cache.buffer.copy()
    with pytest.raises(IndexError, match=r"block_tables\[1, 0\] = 8"):
        cache.decode_attention(q, bt, cupy.asarray([20, 3]), validate=True)
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 33"):
        cache.decode_attention(q, bt, cupy.asarray([33, 3]), validate=True)
    with pytest.raises(TypeError, match="q must be a CuPy"):
        cache.decode_attention(np.zeros((2, 2, 64), np.float32), bt, cupy.asarray([1, 1]))
    assert backend.calls == []
    assert bool((cache.buffer == buf).all())
    cache.decode_attention(q, bt, cupy.asarray([20, 0]), validate=True)  # row 1 unused
    cache.decode_attention(q, bt.get(), [20, 3])  # index arrays from the host are converted
    assert len(backend.calls) == 2


@pytest.mark.parametrize("dtype", [BF16, F16, F32])
@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("pages", [3, 70])  # one chunk; many (the CPU works in chunks)
def test_nan_q_warns_nothing_and_stays_in_its_head(dtype, return_lse, pages):
    """A NaN q on the CPU must not leak a NumPy RuntimeWarning (such as "All-NaN slice
    encountered"); run with warnings as errors.  NaN stays where it
    belongs: the NaN query heads give NaN, every other head and a length-0 row are
    exact as without the NaN."""
    import warnings

    T, H, D = 16, 2, 64
    c = PagedKVCache(2 * pages + 1, T, H, D, device="cpu")
    rng = np.random.default_rng(pages)
    n = c.num_slots
    c.store(np.arange(n), rng.standard_normal((n, H, D)).astype(F32),
            rng.standard_normal((n, H, D)).astype(F32))
    q = rng.standard_normal((4, 4 * H, D)).astype(F32)
    clean = q.astype(dtype)
    q[0, 3] = np.nan          # one query head of row 0
    q[1] = np.nan             # every head of row 1
    q[2, :, 5] = np.nan       # one channel of every head of row 2
    q[3] = np.nan             # row 3 has length 0
    q = q.astype(dtype)
    tables = np.arange(4 * pages).reshape(4, pages) % c.num_blocks
    lens = np.array([pages * T, pages * T - 5, 17, 0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with np.errstate(all="raise"):  # NumPy's floating-point warnings raise too
            got = c.decode_attention(q, tables, lens, return_lse=return_lse)
    want = c.decode_attention(clean, tables, lens, return_lse=return_lse)
    out, lse = got if return_lse else (got, None)
    ref_out, ref_lse = want if return_lse else (want, None)
    out, ref_out = out.astype(F32), ref_out.astype(F32)
    assert np.isnan(out[0, 3]).all() and np.isnan(out[1]).all() and np.isnan(out[2]).all()
    keep = np.ones(4 * H, bool)
    keep[3] = False
    assert np.array_equal(out[0, keep], ref_out[0, keep])
    assert not out[3].any()
    if return_lse:
        assert np.isnan(lse[0, 3]) and np.isnan(lse[1]).all() and np.isnan(lse[2]).all()
        assert np.array_equal(lse[0, keep], ref_lse[0, keep])
        assert np.isneginf(lse[3]).all()


# -- the kernels on the GPU, against the float64 reference ---------------------------------
def run(cache, q, tab, lens, *, sm_scale=None, scratch=None, with_lse=True,
        decode_route="auto"):
    geom = cache.geometry
    D = geom.head_dim
    sm_scale = 1.0 / np.sqrt(D) if sm_scale is None else sm_scale
    out = poisoned(q.shape, q.dtype)
    lse = poisoned(q.shape[:2], np.float32) if with_lse else None
    scratch = ca.new_scratch() if scratch is None else scratch
    ca.decode_attention(cache.buffer, q, tab, lens, out, lse, geom=geom, k_s=cache.pool.k_s,
                        v_s=cache.pool.v_s, sm_scale=sm_scale, stats=cache.pool.stats,
                        scratch=scratch, decode_route=decode_route)
    return out, lse, scratch


# the cases that take each kernel family: chunk ring (groups <= 8, paged16), not paged16,
# wide
BITS_CASES = [ATTENTION_CASES[i] for i in (0, 3, 7, 9, 12, 6)]


@pytest.mark.gpu
class TestKernel:
    """``fp4cache._cuda.decode``'s decode against the float64 reference."""

    @pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: "-".join(map(str, c)))
    def test_small_matches_reference(self, case):
        H, T, D, layout, swizzle, rule, group, dtname = case
        rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
        lens = [0, 1, 37, 3 * T + 1, 200, 17]
        max_blocks = -(-200 // T) + 2
        num_blocks = sum(-(-L // T) for L in lens) + 3
        cache, kd, vd = make_gpu_cache(rng, H=H, T=T, D=D, layout=layout, swizzle=swizzle,
                                       rule=rule, num_blocks=num_blocks)
        itype = np.int64 if D == 64 else np.int32
        tab = tables_for(rng, lens, T, num_blocks, max_blocks, itype)
        q = rand_q(rng, len(lens), H * group, D, dtname)
        lens_a = np.array(lens, dtype=np.int32 if D != 128 else np.int64)
        out, lse, _ = run(cache, cp.asarray(q), cp.asarray(tab), cp.asarray(lens_a))
        ro, rl = decode_f64(kd, vd, q, tab, lens_a, T, 1 / np.sqrt(D), num_blocks)
        check(out, lse, ro, rl, dtname, str(case))
        assert not cp.asnumpy(out[0]).astype(np.float32).any()  # length 0 -> zeros

    @pytest.mark.parametrize("case", BITS_CASES, ids=lambda c: "-".join(map(str, c)))
    def test_bit_route_matches_reference(self, case):
        """GPUs before sm_89 decode E2M1 codes and E4M3 scales by bit moves, with another
        pairing of the codes (q's permutation and the V byte interleave follow it); on this
        GPU the same kernels built with decode_route="bitmove" take that route."""
        H, T, D, layout, swizzle, rule, group, dtname = case
        rng = np.random.default_rng(zlib.crc32(repr(case).encode()) + 1)
        lens = [1, 37, 3 * T + 1, 200]
        max_blocks = -(-200 // T) + 1
        num_blocks = sum(-(-L // T) for L in lens) + 2
        cache, kd, vd = make_gpu_cache(rng, H=H, T=T, D=D, layout=layout, swizzle=swizzle,
                                       rule=rule, num_blocks=num_blocks)
        tab = tables_for(rng, lens, T, num_blocks, max_blocks)
        q = rand_q(rng, len(lens), H * group, D, dtname)
        lens_a = np.array(lens, dtype=np.int32)
        out, lse, scratch = run(cache, cp.asarray(q), cp.asarray(tab), cp.asarray(lens_a),
                                decode_route="bitmove")
        specs = [p.spec for p in ca.attention_plans(scratch)]
        assert specs and all(K.decode_attention_args(s).decode_route == "bitmove"
                             for s in specs), specs
        ro, rl = decode_f64(kd, vd, q, tab, lens_a, T, 1 / np.sqrt(D), num_blocks)
        check(out, lse, ro, rl, dtname, f"bits {case}")

    @pytest.mark.parametrize("D,dtname,group", [(128, "bfloat16", 4), (64, "float32", 8),
                                                 (256, "float16", 16)])
    def test_long_split_kv(self, D, dtname, group):
        """20k tokens: several splits per (sequence, KV head), merged by the last CTA."""
        rng = np.random.default_rng(D + group)
        H, T = 2, 16
        lens = [20000, 13, 4099]
        max_blocks = 20000 // T + 1
        num_blocks = sum(-(-L // T) for L in lens) + 1
        cache, kd, vd = make_gpu_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks)
        tab = tables_for(rng, lens, T, num_blocks, max_blocks)
        q = rand_q(rng, len(lens), H * group, D, dtname)
        out, lse, scratch = run(cache, cp.asarray(q), cp.asarray(tab),
                                cp.asarray(np.array(lens, np.int32)))
        (plan,) = ca.attention_plans(scratch)
        assert plan.grid[0] > 1  # split-KV in use
        ro, rl = decode_f64(kd, vd, q, tab, lens, T, 1 / np.sqrt(D), num_blocks)
        check(out, lse, ro, rl, dtname, f"long D={D}")

    @pytest.mark.parametrize("itype", [np.int32, np.int64])
    def test_bad_ids_nan_and_counted(self, itype):
        """Bad entries of int32 and int64 block tables: out of range above, negative, and an
        int64 entry whose low word alone is a good page."""
        rng = np.random.default_rng(5)
        H, T, D, group = 2, 16, 128, 4
        lens = [100, 3000, 50, 40]
        max_blocks = 3000 // T + 2
        num_blocks = sum(-(-L // T) for L in lens) + 2
        cache, kd, vd = make_gpu_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks)
        tab = tables_for(rng, lens, T, num_blocks, max_blocks, itype)
        tab[0, 2] = num_blocks + 5      # used: NaN
        tab[1, 150] = -3                # used, long sequence (split-KV): NaN
        tab[1, 160] = 2**31 - 1 if itype == np.int32 else 2**32 + 1  # used (low word 1)
        tab[2, 7] = num_blocks          # past the used pages (50 tokens = 4 pages): ignored
        q = rand_q(rng, len(lens), H * group, D, "bfloat16")
        cache.reset_counters()
        out, lse, _ = run(cache, cp.asarray(q), cp.asarray(tab), cp.asarray(np.array(lens)))
        ro, rl = decode_f64(kd, vd, q, tab, lens, T, 1 / np.sqrt(D), num_blocks)
        assert np.isnan(ro[0]).all() and np.isnan(ro[1]).all() and not np.isnan(ro[2:]).any()
        check(out, lse, ro, rl, "bfloat16", "bad ids")
        assert int(cp.asnumpy(cache.pool.stats)[3]) == 3  # once per bad used entry

    def test_nan_groups_propagate(self):
        rng = np.random.default_rng(6)
        H, T, D, group = 2, 16, 128, 4
        lens = [64, 64, 64]
        num_blocks = 12
        # page layout: tables below map sequence b to pages 4b..4b+3 in order
        nan_k = [(5, 1, 3)]            # sequence 0, token 5, head 1: K group 0 NaN
        nan_v = [(4 * T + 9, 0, 70)]   # sequence 1, token 9, head 0: V group 4 NaN
        cache, kd, vd = make_gpu_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks, nan_k=nan_k,
                                       nan_v=nan_v)
        tab = np.arange(12, dtype=np.int32).reshape(3, 4)
        q = rand_q(rng, 3, H * group, D, "bfloat16")
        out, lse, _ = run(cache, cp.asarray(q), cp.asarray(tab), cp.asarray(np.array(lens)))
        ro, rl = decode_f64(kd, vd, q, tab, lens, T, 1 / np.sqrt(D), num_blocks)
        assert np.isnan(ro[0, group:2 * group]).all() and not np.isnan(ro[0, :group]).any()
        assert np.isnan(ro[1, :group, 64:80]).all() and not np.isnan(ro[1, :group, :64]).any()
        check(out, lse, ro, rl, "bfloat16", "nan groups")

    def test_lengths_clamped_to_capacity(self):
        rng = np.random.default_rng(7)
        H, T, D, group = 2, 16, 64, 2
        max_blocks = 3
        lens = np.array([10_000, -5, 48, 47], dtype=np.int64)
        num_blocks = 16
        cache, kd, vd = make_gpu_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks)
        tab = rng.permutation(num_blocks)[:4 * max_blocks].reshape(4, max_blocks).astype(np.int32)
        q = rand_q(rng, 4, H * group, D, "float16")
        out, lse, _ = run(cache, cp.asarray(q), cp.asarray(tab), cp.asarray(lens))
        ro, rl = decode_f64(kd, vd, q, tab, lens, T, 1 / np.sqrt(D), num_blocks)
        check(out, lse, ro, rl, "float16", "clamped")  # the reference clamps to 48 tokens
        assert np.isneginf(cp.asnumpy(lse[1])).all() and not cp.asnumpy(out[1]).any()

    def test_sm_scale_without_lse_and_no_allocation_when_warm(self):
        rng = np.random.default_rng(8)
        H, T, D, group = 2, 16, 128, 4
        lens = [300, 900]
        num_blocks = 80
        cache, kd, vd = make_gpu_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks)
        tab = tables_for(rng, lens, T, num_blocks, 60)
        q = rand_q(rng, 2, H * group, D, "bfloat16")
        qd, td, ld = cp.asarray(q), cp.asarray(tab), cp.asarray(np.array(lens, np.int32))
        scratch = ca.new_scratch()
        out, _, _ = run(cache, qd, td, ld, sm_scale=0.3, scratch=scratch, with_lse=False)
        ro, rl = decode_f64(kd, vd, q, tab, lens, T, 0.3, num_blocks)
        check(out, None, ro, rl, "bfloat16", "sm_scale")
        pool = cp.get_default_memory_pool()
        out2 = cp.empty_like(out)
        cp.cuda.get_current_stream().synchronize()
        used = pool.used_bytes()
        ca.decode_attention(cache.buffer, qd, td, ld, out2, None, geom=cache.geometry,
                            k_s=cache.pool.k_s, v_s=cache.pool.v_s, sm_scale=0.3,
                            stats=cache.pool.stats, scratch=scratch)
        assert pool.used_bytes() == used and len(ca.attention_plans(scratch)) == 1
        # deterministic: the same bits twice
        assert cp.array_equal(out.view(cp.uint16), out2.view(cp.uint16))

    def test_cuda_graph_capture_and_replay(self):
        """Captured once, replayed with new q, lengths and block tables (split-KV tickets
        are reset by the kernel, so every replay merges correctly)."""
        rng = np.random.default_rng(9)
        H, T, D, group = 8, 16, 128, 4
        B, max_blocks = 2, 512
        num_blocks = 2 * max_blocks
        cache, kd, vd = make_gpu_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks)
        qd = cp.empty((B, H * group, D), dtype=BF16)
        td = cp.empty((B, max_blocks), dtype=cp.int32)
        ld = cp.empty((B,), dtype=cp.int32)
        out = cp.empty((B, H * group, D), dtype=BF16)
        lse = cp.empty((B, H * group), dtype=cp.float32)
        scratch = ca.new_scratch()
        stream = capture_stream()
        kw = dict(geom=cache.geometry, k_s=cache.pool.k_s, v_s=cache.pool.v_s,
                  sm_scale=1 / np.sqrt(D), stats=cache.pool.stats, scratch=scratch)
        with stream:
            td[...] = cp.asarray(tables_for(rng, [8192, 100], T, num_blocks, max_blocks))
            ld[...] = cp.asarray(np.array([8192, 100], np.int32))
            qd[...] = cp.asarray(rand_q(rng, B, H * group, D, "bfloat16"))
            ca.decode_attention(cache.buffer, qd, td, ld, out, lse, **kw)  # warm
            stream.synchronize()
            stream.begin_capture()
            ca.decode_attention(cache.buffer, qd, td, ld, out, lse, **kw)
            graph = stream.end_capture()
        (plan,) = ca.attention_plans(scratch)
        assert plan.grid[0] > 1
        for rep, lens in enumerate(([8192, 100], [1, 5000], [0, 8191], [7777, 7777])):
            q = rand_q(rng, B, H * group, D, "bfloat16")
            tab = tables_for(rng, lens, T, num_blocks, max_blocks)
            with stream:
                qd[...] = cp.asarray(q)
                td[...] = cp.asarray(tab)
                ld[...] = cp.asarray(np.array(lens, np.int32))
                out.view(cp.uint16).fill(0x7E7E)
                lse.fill(12345.0)
                graph.launch(stream)
            stream.synchronize()
            ro, rl = decode_f64(kd, vd, q, tab, lens, T, 1 / np.sqrt(D), num_blocks)
            check(out, lse, ro, rl, "bfloat16", f"replay {rep}")

    def test_split_plan_shapes(self):
        # fills one wave, never more splits than FP4C_ATTN_MAX_SPLITS, covers the capacity
        for B, H, cap, R in [(8, 8, 32768, 396), (1, 8, 131072, 396), (64, 8, 4096, 396),
                             (1, 8, 1024, 396), (32, 8, 512, 396), (3, 1, 0, 396),
                             (2, 2, 17, 100)]:
            n, L = ca.split_plan(B, H, cap, R)
            assert 1 <= n <= 128 and L % 128 == 0 and n * L >= cap and (n - 1) * L < max(cap, 1)
            assert L <= ca.SPLIT_TOKENS and (n == 1 or L >= ca.MIN_SPLIT_TOKENS)
        # whole waves: 64 (sequence, KV head) pairs on 528 resident CTAs take 8 splits of 4096
        # (one wave), not 9 (a second, nearly empty wave) nor 16 (two waves and more merging)
        assert ca.split_plan(8, 8, 32768, 528) == (8, 4096)
        assert ca.split_plan(64, 8, 4096, 528) == (1, 4096)
        assert ca.split_plan(1, 8, 131072, 528) == (64, 2048)
        # a kernel of two CTAs per SM (two n8 tiles of rows) takes splits up to 8192 tokens:
        # 4 splits (one wave of 256 CTAs on 264) instead of 8 (two waves; 157.9 against 184.6 us
        # on the H200)
        assert ca.split_plan(8, 8, 32768, 264, per_sm=2) == (4, 8192)
        assert ca.split_plan(8, 8, 32768, 396, per_sm=3) == ca.split_plan(8, 8, 32768, 396)
        # head_dim 64 takes 4-tile chunks: split lengths are whole 64-token chunks per warp
        from fp4cache import _kernels as K

        spec = K.decode_attention_spec("bf16", 64, 1)
        for B, H, cap in [(8, 8, 32768), (1, 8, 1000), (32, 8, 640), (3, 2, 17)]:
            n, L = ca.split_plan(B, H, cap, 528, spec)
            assert L % 256 == 0 and n * L >= cap and (n - 1) * L < max(cap, 1), (B, H, cap)


# -- the public method on the GPU ----------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtname", ["bfloat16", "float32"])
@pytest.mark.parametrize("group", [4, 16])
def test_unaligned_q_and_out_same_bits(dtname, group):
    """q and out at views one element off 16 bytes (the kernel's scalar q loads and output
    stores) give the same bits as aligned ones (16-byte q loads, 8/16-byte stores), also
    through the public method; the outputs around the view are left untouched."""
    rng = np.random.default_rng(12)
    H, T, D = 2, 16, 128
    lens = [70, 600, 0]
    num_blocks = 60
    cache, kd, vd = make_gpu_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks)
    tab = tables_for(rng, lens, T, num_blocks, 40)
    B, Hq = len(lens), H * group
    q = rand_q(rng, B, Hq, D, dtname)
    td, ld = cp.asarray(tab), cp.asarray(np.array(lens, np.int32))
    n = B * Hq * D
    dt = DT[dtname]
    flat_q = cp.zeros(n + 1, dtype=dt)
    flat_o = cp.full(n + 2, np.nan, dtype=dt)
    results = []
    for off in (0, 1):
        qv = flat_q[off:off + n].reshape(B, Hq, D)
        qv[...] = cp.asarray(q)
        flat_o.fill(np.nan)
        ov = flat_o[off:off + n].reshape(B, Hq, D)
        assert (qv.data.ptr % 16 == 0) == (off == 0)
        got = cache.decode_attention(qv, td, ld, out=ov)
        assert got is ov
        results.append(cp.asnumpy(ov).view(np.uint8).copy())
        if off == 1:
            assert np.isnan(float(flat_o[0])) and np.isnan(float(flat_o[n + 1]))
    assert np.array_equal(results[0], results[1])
    ro, rl = decode_f64(kd, vd, q, tab, lens, T, 1.0 / np.sqrt(D), num_blocks)
    check(cp.asarray(results[0].view(dt).reshape(B, Hq, D)), None, ro, rl, dtname, "aligned")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("group", [1, 4, 16])
def test_method_on_gpu_equals_cpu_backend(dtype, group):
    """PagedKVCache.decode_attention through the front end (checked call, then the hot
    path, also with out=/lse_out=) on the GPU against the CPU backend on the same pages
    (same tolerance as above: the CPU accumulates the same float32 values in float64)."""
    rng = np.random.default_rng(group)
    H, T, D, nb = 2, 16, 128, 64
    kw = dict(num_blocks=nb, block_size=T, num_heads=H, head_dim=D, k_scale=0.02,
              v_scale=0.03)
    gpu = fp4cache.PagedKVCache(**kw, device="cuda")
    cpu = fp4cache.PagedKVCache(**kw, device="cpu")
    k, v = kv_values(rng, nb * T, H, D)
    slots = rng.permutation(nb * T)
    cpu.store(slots, k, v)
    gpu.store(cp.asarray(slots), cp.asarray(k), cp.asarray(v))
    B = 3
    tables = rng.permutation(nb)[:B * 20].reshape(B, 20).astype(np.int32)
    lens = np.array([0, 37, 20 * T], np.int64)
    q = rng.standard_normal((B, H * group, D)).astype(DT[dtype])
    ref, ref_lse = cpu.decode_attention(q, tables, lens, return_lse=True)
    qd, td, ld = cp.asarray(q), cp.asarray(tables), cp.asarray(lens)
    out = cp.full(q.shape, np.nan, DT[dtype])
    lse = cp.full((B, H * group), np.nan, np.float32)
    for _ in range(3):  # checked call, then the hot path
        got = gpu.decode_attention(qd, td, ld)
        got2, lse2 = gpu.decode_attention(qd, td, ld, out=out, lse_out=lse, return_lse=True)
        assert got2 is out and lse2 is lse
        for g in (got, got2):
            a = g.get().astype(np.float64)
            r = ref.astype(np.float64)
            err = np.linalg.norm(a - r, axis=-1) / np.maximum(np.linalg.norm(r, axis=-1),
                                                               1e-30)
            assert (err[1:] <= TOL[dtype]).all(), err
            assert not a[0].any()  # length 0: zeros
        ll = lse2.get()
        assert np.isneginf(ll[0]).all()
        assert np.allclose(ll[1:], ref_lse[1:], rtol=1e-3, atol=1e-3)
    assert gpu.stats["bad_block_ids"] == 0


# -- the exact window and the rotation (docs/window.md) in the few-row kernel ---------------
def window_gpu_run(cpu, q, tab, lens, *, qsl=None, causal=False, max_q=1, window=True,
                   decode_route="auto", scratch=None):
    """The GPU kernel on copies of the CPU cache's pages, window slots and map (launched
    through ``decode``'s plan: decode, or the few-row launch of ``attention`` with
    ``qsl``); returns (out, lse, stats)."""
    geom = cpu.geometry
    D = geom.head_dim
    buf = cp.asarray(cpu.buffer)
    win = None
    if window and cpu.window is not None:
        win = (cp.asarray(cpu.window), cp.asarray(cpu.window_map), cpu.window_pages)
    rotate = cpu.rotation == "hadamard"
    stats = cp.zeros(cpu.pool.stats.shape, cp.uint64)
    qg, tg, lg = cp.asarray(q), cp.asarray(tab), cp.asarray(lens)
    out = poisoned(q.shape, q.dtype)
    lse = poisoned(q.shape[:2], np.float32)
    scratch = ca.new_scratch() if scratch is None else scratch
    kw = dict(geom=geom, k_s=cpu.pool.k_s, v_s=cpu.pool.v_s, sm_scale=1 / np.sqrt(D),
              stats=stats)
    if qsl is None:
        ca.decode_attention(buf, qg, tg, lg, out, lse, scratch=scratch, window=win,
                            rotate=rotate, decode_route=decode_route, **kw)
    else:
        rows = ca.RowsSpec(len(qsl) - 1, True, False, causal, 0, 0xFFFFFFFF, max_q)
        plan = ca.make_decode_plan(buf, qg, tg, lg, geom, kw["k_s"], kw["v_s"], kw["sm_scale"],
                                   stats, scratch.workspace, decode_route, rows=rows,
                                   window=win, rotate=rotate)
        nsplit, H, B = plan.grid
        plan.fn((nsplit * H * B,), plan.block,
                (qg, cp.asarray(np.asarray(qsl, np.int32)), tg, lg, out, lse, plan.params))
    return out, lse, cp.asnumpy(stats)


def check_window(out, lse, ref_out, ref_lse, dtname, what, rotate):
    """``helpers.check``; with the rotation lse within ``4e-3 * max(1, |lse|)``: the kernel
    rounds the rotated q (no longer bf16 values) to f16, 2^-11 relative per value, which
    moves scores by up to ~2e-3 (measured ~1.3e-3 against the float64 oracle, a NumPy
    model of that rounding gives the same)."""
    check(out, None if rotate else lse, ref_out, ref_lse, dtname, what)
    if rotate:
        gl = cp.asnumpy(lse).astype(np.float64)
        assert np.array_equal(np.isnan(gl), np.isnan(ref_lse)), f"{what}: lse NaN"
        assert np.array_equal(np.isneginf(gl), np.isneginf(ref_lse)), f"{what}: lse -inf"
        fin = np.isfinite(ref_lse)
        err = np.abs(gl[fin] - ref_lse[fin])
        assert (err <= 4e-3 * np.maximum(1.0, np.abs(ref_lse[fin]))).all(), \
            f"{what}: lse error {err.max():.3g}"


def window_ref(cpu, q, tab, lens, *, qsl=None, causal=False):
    if qsl is None:  # (validate=False: bad ids give NaN as on the GPU)
        return cpu.decode_attention(q, tab, lens, return_lse=True, validate=False)
    return cpu.attention(q, np.asarray(qsl, np.int32), tab, lens, causal=causal,
                         return_lse=True, validate=False)


# (D, group, T, layout, swizzle, rotation, window pages, dtype)
WINDOW_CASES = [
    (128, 4, 16, "HND", True, "none", 3, "bfloat16"),
    (128, 4, 16, "HND", True, "hadamard", 3, "bfloat16"),
    (128, 4, 16, "NHD", True, "hadamard", 0, "bfloat16"),
    (64, 1, 32, "NHD", False, "hadamard", 2, "float16"),
    (64, 16, 16, "HND", True, "hadamard", 3, "bfloat16"),
    (64, 8, 64, "NHD", True, "none", 4, "float32"),
    (256, 16, 64, "HND", True, "hadamard", 3, "bfloat16"),
    (256, 2, 16, "NHD", False, "none", 3, "float32"),
    (128, 16, 32, "HND", False, "hadamard", 5, "float16"),
    (128, 1, 64, "NHD", True, "hadamard", 1, "float32"),
    (128, 4, 8, "HND", True, "hadamard", 0, "bfloat16"),  # not paged16: rotation only
    (256, 8, 32, "HND", True, "hadamard", 0, "float16"),
]


@pytest.mark.gpu
class TestWindow:
    """The exact window and the rotation in the few-row kernel against the CPU backend
    (same pages, window slots and map; the CPU backend is checked against a float64
    reference of its own in test_window.py)."""

    @pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: "-".join(map(str, c)))
    def test_decode_matches_cpu(self, case):
        D, group, T, layout, swizzle, rotation, P, dtname = case
        rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
        H = 2
        lens = [0, 1, 15, 16, 17, 3 * T + 5, 7 * T, 300, 6 * T + 1]
        unmapped = []
        if P >= 2:  # the last page unmapped; a page inside the window unmapped
            unmapped = [(6, 6), (7, -(-300 // T) - 2)]
        cpu, tab, sl = window_cpu_cache(rng, H=H, T=T, D=D, lens=lens, P=P, rotation=rotation,
                                        layout=layout, swizzle=swizzle, unmapped=unmapped,
                                        extra_mapped=[(8, 1)] if P else ())
        q = rand_q(rng, len(lens), H * group, D, dtname)
        ro, rl = window_ref(cpu, q, tab, sl)
        out, lse, _ = window_gpu_run(cpu, q, tab, sl)
        check_window(out, lse, ro, rl, dtname, f"window {case}", rotation == "hadamard")
        assert not cp.asnumpy(out[0]).astype(np.float32).any()  # length 0 -> zeros
        if P:  # the window is read: without it the result is another one
            plain, _, _ = window_gpu_run(cpu, q, tab, sl, window=False)
            assert not np.array_equal(cp.asnumpy(plain), cp.asnumpy(out))

    @pytest.mark.parametrize("rotation", ["none", "hadamard"])
    def test_bit_route(self, rotation):
        """The sm_80 decode route (another power of two in the window's multipliers)."""
        rng = np.random.default_rng(11)
        lens = [5, 40, 100, 33]
        cpu, tab, sl = window_cpu_cache(rng, H=2, T=16, D=128, lens=lens, P=3,
                                        rotation=rotation)
        q = rand_q(rng, len(lens), 8, 128, "bfloat16")
        ro, rl = window_ref(cpu, q, tab, sl)
        out, lse, _ = window_gpu_run(cpu, q, tab, sl, decode_route="bitmove")
        check_window(out, lse, ro, rl, "bfloat16", "window bitmove", rotation == "hadamard")

    @pytest.mark.parametrize("D,group,dtname", [(128, 4, "bfloat16"), (64, 8, "float32"),
                                                 (256, 16, "float16")])
    def test_long_split_kv(self, D, group, dtname):
        """Several splits per (sequence, KV head): only the last splits read the window."""
        rng = np.random.default_rng(D + group + 1)
        lens = [20000, 13, 4099]
        cpu, tab, sl = window_cpu_cache(rng, H=2, T=16, D=D, lens=lens, P=3,
                                        rotation="hadamard", unmapped=[(2, 255)])
        q = rand_q(rng, len(lens), 2 * group, D, dtname)
        ro, rl = window_ref(cpu, q, tab, sl)
        scratch = ca.new_scratch()
        out, lse, _ = window_gpu_run(cpu, q, tab, sl, scratch=scratch)
        (plan,) = ca.attention_plans(scratch)
        assert plan.grid[0] > 1  # split-KV in use
        check_window(out, lse, ro, rl, dtname, f"window long D={D}", True)

    @pytest.mark.parametrize("rotation", ["none", "hadamard"])
    @pytest.mark.parametrize("T,group", [(16, 4), (32, 2), (64, 1)])
    def test_speculative_rows(self, rotation, T, group):
        """query_start_loc rows (the few-row launch of attention): causal limits inside the
        window, NaN K and V groups in window pages that only some rows see."""
        rng = np.random.default_rng(T * 10 + group)
        D, H = 128, 2
        lens = [40, 3 * T + 3, 7, 5 * T, 2 * T + 9]
        nq = [4, 3, 2, 1, 4 if group <= 4 else 2]
        nan_k = [(1, 3 * T + 1, 0, 5)]      # seen by rows 1, 2 of sequence 1 (limits L-1, L)
        nan_v = [(4, 2 * T + 7, 1, 40)]     # group 2 of head 1: rows 2, 3 of sequence 4
        cpu, tab, sl = window_cpu_cache(rng, H=H, T=T, D=D, lens=lens, P=3, rotation=rotation,
                                        nan_k=nan_k, nan_v=nan_v)
        qsl = np.concatenate([[0], np.cumsum(nq)])
        q = rand_q(rng, int(qsl[-1]), H * group, D, "bfloat16")
        max_q = max(nq)
        for causal in (True, False):
            ro, rl = window_ref(cpu, q, tab, sl, qsl=qsl, causal=causal)
            out, lse, _ = window_gpu_run(cpu, q, tab, sl, qsl=qsl, causal=causal, max_q=max_q)
            if causal:
                r1 = np.isnan(ro[int(qsl[1]):int(qsl[2])]).reshape(nq[1], -1).any(1)
                assert r1.tolist() == [False, True, True]
                r4 = np.isnan(ro[int(qsl[4]):int(qsl[5])])
                assert not r4[:2].any() and r4[2:, group:, 32:48].all()
            check_window(out, lse, ro, rl, "bfloat16", f"spec causal={causal}",
                         rotation == "hadamard")

    def test_bad_ids_and_nan_groups(self):
        rng = np.random.default_rng(12)
        T, D, group = 16, 128, 4
        lens = [100, 3000, 50, 40, 64]
        cpu, tab, sl = window_cpu_cache(rng, H=2, T=T, D=D, lens=lens, P=3, rotation="none",
                                        nan_k=[(3, 36, 1, 0)], nan_v=[(4, 60, 0, 70)])
        tab[0, 2] = cpu.num_blocks + 5   # NVFP4 part: NaN, counted
        tab[1, 187] = -3                 # the last page (not in the window any more): NaN
        tab[2, 7] = cpu.num_blocks       # past the used pages: ignored
        q = rand_q(rng, len(lens), 2 * group, D, "bfloat16")
        stats0 = cpu.pool.stats.copy()
        ro, rl = window_ref(cpu, q, tab, sl)
        out, lse, stats = window_gpu_run(cpu, q, tab, sl)
        assert np.isnan(ro[0]).all() and np.isnan(ro[1]).all() and not np.isnan(ro[2]).any()
        assert np.isnan(ro[3, group:]).all() and np.isnan(ro[4, :group, 64:80]).all()
        check(out, lse, ro, rl, "bfloat16", "window bad ids / nan")
        assert int(stats[3]) == int(cpu.pool.stats[3] - stats0[3]) == 2

    def test_cuda_graph_replay(self):
        """decode with a window and rotation captured once, replayed on new q, window
        contents and lengths (the plan holds pointers, the kernel reads the map)."""
        rng = np.random.default_rng(13)
        lens = [70, 33, 120]
        cpu, tab, sl = window_cpu_cache(rng, H=2, T=16, D=128, lens=lens, P=3,
                                        rotation="hadamard", spare=8)
        geom = cpu.geometry
        buf, win = cp.asarray(cpu.buffer), cp.asarray(cpu.window)
        wmap = cp.asarray(cpu.window_map)
        stats = cp.zeros(8, cp.uint64)
        qg = cp.asarray(rand_q(rng, 3, 8, 128, "bfloat16"))
        tg, lg = cp.asarray(tab), cp.asarray(sl)
        out, lse = cp.empty_like(qg), cp.empty(qg.shape[:2], cp.float32)
        scratch = ca.new_scratch()
        runner = ca.decode_runner(buf, qg, tg, lg, geom=geom, k_s=cpu.pool.k_s,
                                  v_s=cpu.pool.v_s, sm_scale=1 / np.sqrt(128), stats=stats,
                                  scratch=scratch, window=(win, wmap, 3), rotate=True)
        runner(qg, tg, lg, out, lse)  # warm: plan and workspace exist
        cp.cuda.get_current_stream().synchronize()
        stream = capture_stream()
        with stream:
            stream.begin_capture()
            runner(qg, tg, lg, out, lse)
            graph = stream.end_capture()
        for step in range(2):
            q = rand_q(rng, 3, 8, 128, "bfloat16")
            sl2 = (sl - step * 3).astype(np.int32)  # shorter: the window start moves
            # new token values in the window slots (the oracle's own rows)
            cpu.window[...] = formats.bf16_bits(
                rng.standard_normal(cpu.window.shape).astype(np.float32))
            with stream:  # (the updates ordered before the replay)
                qg[...] = cp.asarray(q)
                lg[...] = cp.asarray(sl2)
                win[...] = cp.asarray(cpu.window)
                out.view(cp.uint16).fill(0x7E7E)
                lse.fill(12345.0)
                graph.launch(stream)
            stream.synchronize()
            ro, rl = window_ref(cpu, q, tab, sl2)
            check_window(out, lse, ro, rl, "bfloat16", f"graph replay {step}", True)
