"""GPU paged attention for any query length (``fp4cache._cupy_varlen``) against a float64
reference computed from ``PagedKVCache.gather_dequant(..., dtype="float32")``.

Rows are (query token, query head) pairs of vLLM's flattened layout: sequence b owns
tokens ``qsl[b]:qsl[b+1]`` (n_b of them); causal token i sees keys ``0 .. len_b - n_b + i``
(bottom-right), else all ``len_b``; a row that sees no key gives zeros and lse = -inf.
The reference takes, for each row, only the keys that row sees.  Bad block ids make the
rows that see a key of the page NaN (output and lse); a K group stored as NaN makes the
rows that see it NaN; a V group stored as NaN makes the group's 16 columns NaN in the rows
that see it (the same rules as decode_attention, which sees every key).

Tolerances are decode_attention's (tests/test_gpu_attention.py, same reasons: the kernel's
K/V f16 values are exact, q is exact in f16 for bf16/f16 and hi + lo for float32, P is
rounded to f16, f32 accumulation, ex2.approx): relative 2-norm error per row <= 1e-2 for
bf16/f16 outputs and <= 3e-3 for float32, lse within 1e-3 * max(1, |lse|), NaN positions
exact.  Outputs are poisoned before every run.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

from nvfp4_ref import paged_attention_f64 as reference  # noqa: E402
from test_gpu_attention import BF16, DT, check, make_cache, poisoned, tables_for  # noqa: E402

from fp4cache import _abi  # noqa: E402
from fp4cache import _cupy_varlen as cv  # noqa: E402
from fp4cache._cupy_attention import new_scratch  # noqa: E402


# -- helpers ----------------------------------------------------------------------------
def make_q(rng, N, Hq, D, dtname):
    q = rng.standard_normal((N, Hq, D), dtype=np.float32) * 1.5
    return q.astype(DT[dtname])


def qsl_of(ns, dtype=np.int32):
    return np.concatenate([[0], np.cumsum(ns)]).astype(dtype)


def run(cache, q, qsl, tab, lens, *, max_query_len, causal, sm_scale=None, scratch=None,
        with_lse=True):
    geom = cache.geometry
    sm_scale = 1.0 / np.sqrt(geom.head_dim) if sm_scale is None else sm_scale
    out = poisoned(q.shape, q.dtype)
    lse = poisoned(q.shape[:2], np.float32) if with_lse else None
    scratch = new_scratch() if scratch is None else scratch
    cv.attention(cache.buffer, q, qsl, tab, lens, out, lse, max_query_len=max_query_len,
                 causal=causal, geom=geom, k_s=cache._k_s, v_s=cache._v_s, sm_scale=sm_scale,
                 stats=cache._stats, scratch=scratch)
    return out, lse, scratch


def case(rng, *, ns, lens, H, T, D, group, dtname="bfloat16", layout="HND", swizzle=True,
         causal=True, itype=np.int32, max_query_len=None, nan_k=(), nan_v=(), spare=2,
         tab_edit=None):
    max_blocks = max(-(-max(int(L), 1) // T) for L in lens) + 1
    num_blocks = sum(-(-max(int(L), 0) // T) for L in lens) + spare
    cache, kd, vd = make_cache(rng, H=H, T=T, D=D, layout=layout, swizzle=swizzle,
                               num_blocks=num_blocks, nan_k=nan_k, nan_v=nan_v)
    tab = tables_for(rng, lens, T, num_blocks, max_blocks, itype)
    if tab_edit is not None:
        tab_edit(tab, num_blocks)
    qsl = qsl_of(ns, itype)
    q = make_q(rng, int(qsl[-1]), H * group, D, dtname)
    mql = max(ns) if max_query_len is None else max_query_len
    cache.reset_counters()
    out, lse, scratch = run(cache, cp.asarray(q), cp.asarray(qsl), cp.asarray(tab),
                            cp.asarray(np.array(lens, dtype=itype)), max_query_len=mql,
                            causal=causal)
    ro, rl = reference(kd, vd, q, qsl, tab, lens, T, 1 / np.sqrt(D), num_blocks, causal)
    return cache, out, lse, ro, rl, scratch


# -- shapes ---------------------------------------------------------------------------------
RAGGED = [0, 1, 2, 5, 16, 100]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("D,group,dtname,layout", [
    (128, 4, "bfloat16", "HND"), (64, 1, "float16", "NHD"), (256, 8, "bfloat16", "HND"),
    (128, 16, "float32", "NHD"), (64, 3, "float32", "HND"), (256, 2, "float16", "NHD"),
    (256, 4, "float32", "HND")])
def test_ragged_matches_reference(D, group, dtname, layout, causal):
    rng = np.random.default_rng(zlib_seed(D, group, dtname, layout, causal))
    ns = RAGGED
    lens = [37, 1, 40, 5, 300, 161]  # cached + n_b, across page edges (T = 16)
    _, out, lse, ro, rl, _ = case(rng, ns=ns, lens=lens, H=2, T=16, D=D, group=group,
                                  dtname=dtname, layout=layout, causal=causal)
    check(out, lse, ro, rl, dtname, f"ragged D={D} g={group}")


def zlib_seed(*parts) -> int:
    import zlib

    return zlib.crc32(repr(parts).encode())


@pytest.mark.parametrize("T,swizzle,layout", [(16, True, "HND"), (5, False, "NHD"),
                                              (12, True, "NHD"), (32, False, "HND"),
                                              (4, True, "HND")])
def test_block_sizes_and_page_edges(T, swizzle, layout):
    rng = np.random.default_rng(T * 7 + swizzle)
    ns = [3, 1, 17, 4, 2]
    lens = [T, T + 1, 2 * T - 1 + 17, 3, 2]  # at, across and just before page edges
    _, out, lse, ro, rl, _ = case(rng, ns=ns, lens=lens, H=3, T=T, D=128, group=2,
                                  layout=layout, swizzle=swizzle, itype=np.int64)
    check(out, lse, ro, rl, "bfloat16", f"T={T}")


@pytest.mark.parametrize("n,group", [(1, 4), (2, 4), (4, 4), (8, 2), (2, 8), (1, 16),
                                     (8, 4), (5, 5), (3, 16)])
def test_speculative_split_kv(n, group):
    """n * group <= 16 rows: one launch of the few-row (decode) kernel, its two-n8-tile
    form above 8 rows; <= 32 (<= 64): the 32-row (64-row) varlen kernel.  One query tile
    per (sequence, KV head), keys split over CTAs and merged through the workspace (long
    sequences, different lengths)."""
    rng = np.random.default_rng(100 + n * group)
    lens = [9000, 4099, 300, n]
    _, out, lse, ro, rl, scratch = case(rng, ns=[n] * 4, lens=lens, H=2, T=16, D=128,
                                        group=group)
    check(out, lse, ro, rl, "bfloat16", f"spec n={n}")
    (call,) = scratch.plans.values()
    if n * group <= 16:
        (lp,) = call.launches
        (plan,) = lp.keep
        assert plan.spec.name.endswith("_wide_paged16" if n * group > 8 else "d128_paged16")
        assert plan.grid[0] > 1 and lp.grid == plan.grid[0] * 2 * 4  # splits x H x B
    else:
        assert len(call.launches) == 2
        ps = call.launches[-1].keep[-1]
        assert ps.row_warps == cv.row_warps_for(n * group) and ps.slots > 1


def test_more_sequences_than_a_grid_dimension():
    """65,540 sequences of 0-2 query tokens: more than a CUDA grid's y / z limit (65,535);
    the few-row kernel's grid is one-dimensional (splits x KV heads x sequences)."""
    rng = np.random.default_rng(23)
    B = 65540
    ns = rng.integers(0, 3, B)
    lens = (ns + rng.integers(0, 20, B)).tolist()
    _, out, lse, ro, rl, scratch = case(rng, ns=ns.tolist(), lens=lens, H=1, T=16, D=64,
                                        group=4)
    check(out, lse, ro, rl, "bfloat16", "65540 sequences")
    (call,) = scratch.plans.values()
    (lp,) = call.launches
    assert lp.grid >= B


def test_mixed_batch_one_launch():
    """Decode tokens, speculative tokens and a long chunk in one call: two launches (the
    few-row kernel splits the keys of the sequences of <= 16 rows, the 64-row kernel takes
    the others; its 24-row sequence fits one tile and splits too)."""
    rng = np.random.default_rng(11)
    ns = [1, 4, 300, 1, 0, 2, 6]
    lens = [5000, 3000, 1000, 77, 50, 2, 4000]
    _, out, lse, ro, rl, scratch = case(rng, ns=ns, lens=lens, H=2, T=16, D=128, group=4)
    check(out, lse, ro, rl, "bfloat16", "mixed")
    (call,) = scratch.plans.values()
    (small,), big = (lp.keep for lp in call.launches)
    assert small.spec.name.endswith("_wide_paged16") and small.grid[0] > 1
    assert big[-1].row_warps == 4


def test_one_cta_takes_every_work_item(monkeypatch):
    """A grid of one CTA for the varlen launch (GRID_WAVES = 0): it loops over every work
    item, splits of one sequence included (their ticket merge never waits)."""
    monkeypatch.setattr(cv, "GRID_WAVES", 0)
    rng = np.random.default_rng(19)
    ns = [1, 4, 70, 0, 3]
    lens = [3000, 700, 500, 9, 2000]
    _, out, lse, ro, rl, scratch = case(rng, ns=ns, lens=lens, H=2, T=16, D=64, group=4)
    check(out, lse, ro, rl, "bfloat16", "one CTA")
    (call,) = scratch.plans.values()
    assert call.launches[-1].grid == 1 and len(call.launches) == 2


def test_rows_without_keys_and_empty_sequences():
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


def test_bad_ids_nan_only_where_seen_and_counted():
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
    assert int(cp.asnumpy(cache._stats)[_abi.STAT["bad_block_ids"]]) == 2


def test_nan_groups():
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
    cache, kd, vd = make_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks, nan_k=nan_k,
                               nan_v=nan_v)
    qsl = qsl_of(ns)
    q = make_q(rng, int(qsl[-1]), H * group, D, "bfloat16")
    out, lse, _ = run(cache, cp.asarray(q), cp.asarray(qsl), cp.asarray(tab),
                      cp.asarray(np.array(lens, np.int32)), max_query_len=max(ns), causal=True)
    ro, rl = reference(kd, vd, q, qsl, tab, lens, T, 1 / np.sqrt(D), num_blocks, True)
    assert np.isnan(ro[6:20, group:, 64:80]).all() and not np.isnan(ro[:6]).any()
    assert not np.isnan(ro[6:16, group:, :64]).any()
    assert np.isnan(ro[16:20, :group]).all()
    assert np.isnan(ro[20:, :group, 0:16]).all() and not np.isnan(ro[20:, group:]).any()
    check(out, lse, ro, rl, "bfloat16", "nan groups")


def test_query_start_loc_clamped_to_q():
    """Unvalidated query_start_loc past q's rows (or decreasing): the kernel clamps it to
    [0, num_tokens], so nothing outside q and out is read or written."""
    rng = np.random.default_rng(20)
    H, T, D, group = 2, 16, 64, 2
    lens = [40, 30, 50, 20]
    num_blocks = 16
    cache, kd, vd = make_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks)
    tab = tables_for(rng, lens, T, num_blocks, 4)
    N = 9
    qsl = np.array([0, 3, 5, 1_000_000, 2], np.int64)
    q = make_q(rng, N, H * group, D, "bfloat16")
    guard = cp.zeros((N + 64, H * group, D), dtype=BF16)  # out plus rows that must stay 0
    out = guard[:N]
    cv.attention(cache.buffer, cp.asarray(q), cp.asarray(qsl), cp.asarray(tab),
                 cp.asarray(np.array(lens, np.int32)), out, None, max_query_len=16,
                 causal=True, geom=cache.geometry, k_s=cache._k_s, v_s=cache._v_s,
                 sm_scale=1 / np.sqrt(D), stats=cache._stats, scratch=new_scratch())
    ro, rl = reference(kd, vd, q, np.clip(qsl, 0, N), tab, lens, T, 1 / np.sqrt(D),
                       num_blocks, True)
    check(out, None, ro, rl, "bfloat16", "clamped query_start_loc")
    assert not cp.asnumpy(guard[N:]).astype(np.float32).any()


def test_lengths_clamped_and_int64():
    rng = np.random.default_rng(16)
    T, max_blocks, num_blocks = 16, 3, 16
    H, D, group = 2, 64, 2
    cache, kd, vd = make_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks)
    tab = rng.permutation(num_blocks)[:3 * max_blocks].reshape(3, max_blocks).astype(np.int64)
    lens = np.array([10_000, -5, 47], dtype=np.int64)
    ns = [4, 1, 20]
    qsl = qsl_of(ns, np.int64)
    q = make_q(rng, int(qsl[-1]), H * group, D, "float16")
    out, lse, _ = run(cache, cp.asarray(q), cp.asarray(qsl), cp.asarray(tab), cp.asarray(lens),
                      max_query_len=20, causal=True)
    ro, rl = reference(kd, vd, q, qsl, tab, lens, T, 1 / np.sqrt(D), num_blocks, True)
    check(out, lse, ro, rl, "float16", "clamped")


def test_cuda_graph_capture_and_replay():
    """Captured once with max_query_len, replayed with new q, query_start_loc, lengths and
    block tables (the split tickets reset themselves); no allocation when warm."""
    rng = np.random.default_rng(17)
    H, T, D, group = 4, 16, 128, 4
    B, max_blocks, N = 3, 320, 12
    num_blocks = 3 * max_blocks
    cache, kd, vd = make_cache(rng, H=H, T=T, D=D, num_blocks=num_blocks)
    qd = cp.empty((N, H * group, D), dtype=BF16)
    qsld = cp.empty((B + 1,), dtype=cp.int32)
    td = cp.empty((B, max_blocks), dtype=cp.int32)
    ld = cp.empty((B,), dtype=cp.int32)
    out = cp.empty((N, H * group, D), dtype=BF16)
    lse = cp.empty((N, H * group), dtype=cp.float32)
    scratch = new_scratch()
    stream = cp.cuda.Stream(non_blocking=True)
    kw = dict(max_query_len=4, causal=True, geom=cache.geometry, k_s=cache._k_s,
              v_s=cache._v_s, sm_scale=1 / np.sqrt(D), stats=cache._stats, scratch=scratch)
    with stream:
        qsld[...] = cp.asarray(qsl_of([4, 4, 4]))
        td[...] = cp.asarray(tables_for(rng, [5000, 100, 4], T, num_blocks, max_blocks))
        ld[...] = cp.asarray(np.array([5000, 100, 4], np.int32))
        qd[...] = cp.asarray(make_q(rng, N, H * group, D, "bfloat16"))
        cv.attention(cache.buffer, qd, qsld, td, ld, out, lse, **kw)  # warm
        stream.synchronize()
        pool = cp.get_default_memory_pool()
        used = pool.used_bytes()
        stream.begin_capture()
        cv.attention(cache.buffer, qd, qsld, td, ld, out, lse, **kw)
        graph = stream.end_capture()
        assert pool.used_bytes() == used
    (call,) = scratch.plans.values()
    assert len(call.launches) == 1 and call.launches[0].grid > B * H
    for rep, (ns, lens) in enumerate((([4, 4, 4], [5000, 100, 4]), ([1, 3, 4], [7, 5000, 4000]),
                                      ([0, 4, 2], [0, 4, 4096]), ([4, 0, 1], [2, 9, 1]))):
        qsl = qsl_of(ns)
        q = make_q(rng, N, H * group, D, "bfloat16")
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
        ro, rl = reference(kd, vd, q, qsl, tab, lens, T, 1 / np.sqrt(D), num_blocks, True)
        n = int(qsl[-1])  # rows past the last sequence are nobody's: not compared
        check(out[:n], lse[:n], ro[:n], rl[:n], "bfloat16", f"replay {rep}")


def test_long_prefill_chunk_tiles():
    """A 600-token causal chunk after 1,500 cached tokens, GQA 8 (75 query tiles of 64
    rows), with a decode sequence beside it."""
    rng = np.random.default_rng(18)
    ns = [600, 1]
    lens = [2100, 3000]
    _, out, lse, ro, rl, _ = case(rng, ns=ns, lens=lens, H=1, T=16, D=128, group=8)
    check(out, lse, ro, rl, "bfloat16", "prefill chunk")
