"""The exact new tokens (``new_kv``) on the CPU backend: a step's queries read the step's
own K/V as the model computed them and the earlier tokens through the pages (and the
exact window), in one softmax.

Tolerance: the oracle computes in float64 and rounds the result to the output dtype
(float32 here), so it agrees with the float64 reference below to float32 rounding
(about 6e-8 relative) plus float64 summation order; 1e-5 leaves room for that and is
far below what reading the new tokens through NVFP4 pages changes (about 1e-2).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from helpers import window_reference

import fp4cache
from fp4cache import PagedKVCache

RTOL = ATOL = 1e-5
BF16 = np.dtype(ml_dtypes.bfloat16)


def kv(rng, n, H, D, dtype=np.float32):
    k = rng.standard_normal((n, H, D), dtype=np.float32)
    k[:, :, ::8] *= 6  # outliers: NVFP4's error on K is visible
    v = rng.standard_normal((n, H, D), dtype=np.float32)
    return k.astype(dtype), v.astype(dtype)


def reference(c: PagedKVCache, q, qsl, tab, lens, new_kv, causal=True):
    """float64 attention: keys ``p >= L_b - n_b`` from ``new_kv``, the rest as the window
    reference reads them (:func:`helpers.window_reference`)."""
    return window_reference(c, q, qsl, tab, lens, causal=causal, new_kv=new_kv)[0]


def filled(rng, *, prior, new, rotation="none", window=0, T=16, H=2, D=64, dtype=np.float32):
    """A cache with sequences of ``prior[b]`` earlier tokens and ``new[b]`` new ones (all
    stored; the window ring, when on, mapped as a model runner does): ``(cache, table,
    lens, qsl, (k_new, v_new))``."""
    B = len(prior)
    lens = np.array([p + n for p, n in zip(prior, new)])
    width = int(max(-(-lens // T)))
    num_blocks = B * width + 2
    c = PagedKVCache(num_blocks, T, H, D, device="cpu", rotation=rotation,
                     window_pages=window, window_slots=window * B, k_scale=0.05, v_scale=0.02)
    tab = np.full((B, width), -1, np.int32)
    perm = rng.permutation(num_blocks)
    for b in range(B):
        npg = -(-int(lens[b]) // T)
        tab[b, :npg] = perm[b * width:b * width + npg]
        if window:
            for p in range(npg):
                blocks, slots = [int(tab[b, p])], [b * window + p % window]
                if p >= window:
                    blocks.append(int(tab[b, p - window]))
                    slots.append(-1)
                c.map_window(blocks, slots)
    slot = lambda b, pos: tab[b, pos // T].astype(np.int64) * T + pos % T  # noqa: E731
    for b in range(B):  # the earlier tokens, stored by earlier steps
        if prior[b]:
            k, v = kv(rng, prior[b], H, D, dtype)
            c.store(slot(b, np.arange(prior[b])), k, v)
    k_new, v_new = kv(rng, sum(new), H, D, dtype)
    slots = np.concatenate([slot(b, np.arange(prior[b], lens[b])) for b in range(B)])
    c.store(slots, k_new, v_new)  # this step's tokens, stored first
    qsl = np.concatenate([[0], np.cumsum(new)])
    return c, tab, lens, qsl, (k_new, v_new)


CASES = [
    dict(rotation="none", window=0),
    dict(rotation="hadamard", window=0),
    dict(rotation="none", window=2),
    dict(rotation="hadamard", window=2),
]


@pytest.mark.parametrize("opts", CASES, ids=lambda o: f"{o['rotation']}-win{o['window']}")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_attention_reads_new_tokens_exactly(opts, causal, dtype):
    rng = np.random.default_rng(1)
    # prior context, several n_b (0, 1, a chunk crossing pages, a prefill without context)
    c, tab, lens, qsl, new_kv = filled(rng, prior=[37, 20, 5, 0], new=[0, 1, 30, 21],
                                       dtype=dtype, **opts)
    q = rng.standard_normal((int(qsl[-1]), 4 * c.num_heads, c.head_dim), dtype=np.float32)
    out = c.attention(q, qsl, tab, lens, causal=causal, new_kv=new_kv)
    want = reference(c, q, qsl, tab, lens, new_kv, causal=causal)
    np.testing.assert_allclose(out, want, rtol=RTOL, atol=ATOL)
    # without new_kv the new tokens are read through the pages: the result moves
    old = c.attention(q, qsl, tab, lens, causal=causal)
    np.testing.assert_allclose(old, reference(c, q, qsl, tab, lens, None, causal=causal),
                               rtol=RTOL, atol=ATOL)
    assert np.abs(old - out).max() > 100 * ATOL


def test_decode_attention_reads_the_new_token_exactly():
    rng = np.random.default_rng(2)
    c, tab, lens, qsl, new_kv = filled(rng, prior=[40, 3, 16], new=[1, 1, 1],
                                       rotation="hadamard", window=2)
    q = rng.standard_normal((3, 4 * c.num_heads, c.head_dim), dtype=np.float32)
    out = c.decode_attention(q, tab, lens, new_kv=new_kv)
    np.testing.assert_allclose(out, reference(c, q, qsl, tab, lens, new_kv, causal=False),
                               rtol=RTOL, atol=ATOL)
    assert np.array_equal(out, c.attention(q, qsl, tab, lens, new_kv=new_kv))


def test_one_pass_prefill_is_float32_attention():
    """No earlier tokens: with new_kv every key is the model's own, so the result is
    attention over the float32 K/V; without it NVFP4's error shows."""
    rng = np.random.default_rng(3)
    c, tab, lens, qsl, (k, v) = filled(rng, prior=[0, 0], new=[48, 19], rotation="hadamard")
    q = rng.standard_normal((int(qsl[-1]), 8, c.head_dim), dtype=np.float32)
    scale = 1 / math.sqrt(c.head_dim)
    want = np.zeros(q.shape)
    for b in range(2):
        s0, s1 = qsl[b], qsl[b + 1]
        n = s1 - s0
        kk = np.repeat(k[s0:s1].astype(np.float64), 4, axis=1)  # GQA: head h reads h // 4
        vv = np.repeat(v[s0:s1].astype(np.float64), 4, axis=1)
        s = np.einsum("qhd,khd->hqk", q[s0:s1].astype(np.float64), kk) * scale
        s[:, np.triu(np.ones((n, n), bool), 1)] = -np.inf
        w = np.exp(s - s.max(axis=-1, keepdims=True))
        want[s0:s1] = np.einsum("hqk,khd->qhd", w / w.sum(axis=-1, keepdims=True), vv)
    exact = c.attention(q, qsl, tab, lens, new_kv=(k, v))
    np.testing.assert_allclose(exact, want, rtol=RTOL, atol=ATOL)
    paged = c.attention(q, qsl, tab, lens)
    assert np.abs(paged - want).max() > 100 * ATOL


def test_bad_page_id_spares_new_tokens():
    """A bad id on a page of new tokens only: counted, and those tokens still exact."""
    rng = np.random.default_rng(4)
    c, tab, lens, qsl, new_kv = filled(rng, prior=[16], new=[16])
    q = rng.standard_normal((16, 2, c.head_dim), dtype=np.float32)
    want = reference(c, q, qsl, tab, lens, new_kv)
    bad = tab.copy()
    bad[0, 1] = c.num_blocks + 5
    out = c.attention(q, qsl, bad, lens, new_kv=new_kv, validate=False)
    np.testing.assert_allclose(out, want, rtol=RTOL, atol=ATOL)
    assert c.stats["bad_block_ids"] == 1


@pytest.mark.parametrize("new_kv, exc, match", [
    ("kv", TypeError, r"new_kv must be a \(k, v\) pair"),
    ((np.zeros((5, 2, 64), np.float32),), TypeError, r"new_kv must be a \(k, v\) pair"),
    ((np.zeros((4, 2, 64), np.float32),) * 2, ValueError, r"new_kv\[0\] must have shape"),
    ((np.zeros((5, 2, 64), np.float32), np.zeros((5, 1, 64), np.float32)), ValueError,
     r"new_kv\[1\] must have shape"),
    ((np.zeros((5, 2, 64), np.float32), np.zeros((5, 2, 64), np.float16)), TypeError,
     r"new_kv's k and v must have the same dtype"),
    ((np.zeros((5, 2, 64), np.int32),) * 2, TypeError, r"new_kv\[0\] must have dtype"),
    ((np.zeros((5, 2, 64)).tolist(),) * 2, TypeError, r"new_kv\[0\] must be"),
])
def test_bad_new_kv_is_refused(new_kv, exc, match):
    c = PagedKVCache(4, 16, 2, 64, device="cpu")
    k, v = kv(np.random.default_rng(5), 20, 2, 64)
    c.store(np.arange(20), k, v)
    before = c.buffer.copy()
    q = np.zeros((5, 4, 64), np.float32)
    with pytest.raises(exc, match=match):
        c.attention(q, [0, 5], [[0, 1]], [20], max_query_len=5, new_kv=new_kv)
    with pytest.raises(exc, match=match):
        c.decode_attention(q, np.zeros((5, 2), np.int32), np.full(5, 20), new_kv=new_kv)
    assert np.array_equal(c.buffer, before)


def test_new_kv_needs_the_new_tokens_cached():
    c = PagedKVCache(4, 16, 2, 64, device="cpu")
    q = np.zeros((5, 4, 64), np.float32)
    k = np.zeros((5, 2, 64), np.float32)
    with pytest.raises(ValueError, match="with new_kv the query tokens are the last"):
        c.attention(q, [0, 5], [[0, 1]], [3], causal=False, new_kv=(k, k))


def planned_step(device: str, rng):
    """A planned step of three sequences (a decode after 20 tokens, a 3-token prompt, a
    1-token prompt) and two equal caches (K rotated, one window page) holding the 20
    earlier tokens: ``(plan, a, b, qsl, tab, lens, slots)``."""
    from helpers import xp_of

    xp = xp_of(device)
    H, D = 2, 64
    plan = fp4cache.AttentionPlan(max_batch_size=4, max_num_tokens=64, max_blocks_per_seq=4,
                                  device=device)
    lens = np.array([21, 3, 1])
    qsl = np.array([0, 1, 4, 5])
    tab = np.array([[0, 1, -1, -1], [2, -1, -1, -1], [3, -1, -1, -1]], np.int32)
    slots = np.array([20, 32, 33, 34, 48])
    a, b = (PagedKVCache(8, 16, H, D, device=device, rotation="hadamard", window_pages=1,
                         window_slots=3) for _ in range(2))
    k0, v0 = kv(rng, 20, H, D)
    for cache in (a, b):
        cache.map_window([1, 2, 3], [0, 1, 2])
        cache.store(xp.arange(20), xp.asarray(k0), xp.asarray(v0))
    plan.plan(query_start_loc=qsl, seq_lens=lens, block_tables=tab, slot_mapping=slots)
    return plan, a, b, qsl, tab, lens, slots


def test_plan_run_exact_new_is_store_then_attention():
    rng = np.random.default_rng(6)
    H, D = 2, 64
    plan, a, b, qsl, tab, lens, slots = planned_step("cpu", rng)
    q = rng.standard_normal((5, 4 * H, D), dtype=np.float32)
    k, v = kv(rng, 5, H, D, BF16)
    got = plan.run(a, q, k, v, exact_new=True)
    b.store(slots, k, v)
    want = b.attention(q, qsl, tab, lens, new_kv=(k, v))
    assert np.array_equal(got, want)
    assert np.array_equal(a.buffer, b.buffer)
    plain = plan.run(b, q, exact_new=False)  # another memo entry: through the pages
    assert not np.array_equal(plain, want)
    with pytest.raises(ValueError, match="exact_new"):
        plan.run(a, q, exact_new=True)


# -- transformers: FP4Cache(exact_prompt=True) ---------------------------------------------
def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    return transformers, transformers.LlamaConfig(
        vocab_size=96, hidden_size=256, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=512, pad_token_id=0)


def _model(transformers, cfg, impl):
    import copy

    import torch

    torch.manual_seed(0)  # the same weights for both models
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                          dtype=torch.float32)
    model = model.eval()
    model.set_attn_implementation(impl)
    return model


def test_hf_exact_prompt_one_pass_is_the_float32_forward():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import fp4cache.hf as fh

    transformers, cfg = _tiny_llama()
    fused, ref = _model(transformers, cfg, "fp4cache"), _model(transformers, cfg, "sdpa")
    ids = torch.randint(1, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(input_ids=ids, past_key_values=transformers.DynamicCache(),
                   use_cache=True).logits
        exact = fused(input_ids=ids, past_key_values=fh.FP4Cache(
            fused.config, 2, 64, device="cpu", exact_prompt=True), use_cache=True).logits
        paged = fused(input_ids=ids, past_key_values=fh.FP4Cache(
            fused.config, 2, 64, device="cpu", exact_prompt=False), use_cache=True).logits
    scale = float(want.abs().max())
    assert float((exact - want).abs().max()) <= 1e-4 * scale
    assert float((paged - want).abs().max()) > 1e-4 * scale  # the pages' error shows
    cache = fh.FP4Cache(fused.config, 2, 64, device="cpu", exact_prompt=True)
    out = fused.generate(ids, past_key_values=cache, max_new_tokens=5, do_sample=False,
                         attention_mask=torch.ones_like(ids))
    assert out.shape == (2, 45) and cache.get_seq_length() == 44


def test_hf_exact_prompt_is_on_by_default_for_passes_of_several_tokens(monkeypatch):
    """The default cache reads a prompt's own K/V exactly; a decode step (one token) reads
    its token from the window, as without exact_prompt."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import fp4cache.hf as fh

    seen = []
    run = fp4cache.AttentionPlan.run

    def spy(self, *args, exact_new=False, **kwargs):
        seen.append(exact_new)
        return run(self, *args, exact_new=exact_new, **kwargs)

    monkeypatch.setattr(fp4cache.AttentionPlan, "run", spy)
    transformers, cfg = _tiny_llama()
    model = _model(transformers, cfg, "fp4cache")
    ids = torch.randint(1, cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(3))
    cache = fh.FP4Cache(model.config, 1, 32, device="cpu")
    assert cache.exact_prompt is True
    with torch.no_grad():
        model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False,
                       attention_mask=torch.ones_like(ids))
    layers = cfg.num_hidden_layers
    assert seen == [True] * layers + [False] * (2 * layers)  # the prompt, two decode steps


def test_hf_exact_prompt_is_checked():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import fp4cache.hf as fh

    _, cfg = _tiny_llama()
    with pytest.raises(TypeError, match="exact_prompt must be True or False"):
        fh.FP4Cache(cfg, 1, 32, exact_prompt="yes")


@pytest.mark.gpu
def test_gpu_hf_exact_prompt_one_pass_is_the_forward_over_its_own_kv():
    """On the GPU a one-pass forward with exact_prompt is the model's attention over its
    own K/V up to the kernels' f16 inputs (about 1e-3 relative), well inside the error
    the pages alone give."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import fp4cache.hf as fh

    transformers, cfg = _tiny_llama()
    fused = _model(transformers, cfg, "fp4cache").cuda()
    ref = _model(transformers, cfg, "sdpa").cuda()
    ids = torch.randint(1, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    ids = ids.cuda()
    with torch.no_grad():
        want = ref(input_ids=ids, past_key_values=transformers.DynamicCache()).logits
        exact = fused(input_ids=ids, past_key_values=fh.FP4Cache(
            fused.config, 2, 64, exact_prompt=True)).logits
        paged = fused(input_ids=ids, past_key_values=fh.FP4Cache(
            fused.config, 2, 64, exact_prompt=False)).logits
        out = fused.generate(ids, past_key_values=fh.FP4Cache(fused.config, 2, 64,
                                                              exact_prompt=True),
                             max_new_tokens=5, do_sample=False,
                             attention_mask=torch.ones_like(ids))
    scale = float(want.abs().max())
    err, err_paged = float((exact - want).abs().max()), float((paged - want).abs().max())
    assert err <= 5e-3 * scale and err < err_paged / 2, (err, err_paged, scale)
    assert out.shape == (2, 45)


def test_hf_exact_prompt_dequantize_path_returns_the_pass_kv():
    """The dequantizing path (any other attention) with exact_prompt: a one-pass forward
    is the float32 forward as well, and the fused path agrees with it."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import fp4cache.hf as fh

    transformers, cfg = _tiny_llama()
    ref, fused = _model(transformers, cfg, "sdpa"), _model(transformers, cfg, "fp4cache")
    ids = torch.randint(1, cfg.vocab_size, (1, 33), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref(input_ids=ids, past_key_values=transformers.DynamicCache()).logits
        deq = ref(input_ids=ids, past_key_values=fh.FP4Cache(
            ref.config, 1, 48, device="cpu", exact_prompt=True)).logits
        fus = fused(input_ids=ids, past_key_values=fh.FP4Cache(
            fused.config, 1, 48, device="cpu", exact_prompt=True)).logits
    scale = float(want.abs().max())
    assert float((deq - want).abs().max()) <= 1e-4 * scale
    assert float((fus - deq).abs().max()) <= 1e-4 * scale


# -- the GPU: the any-length kernel reads the new rows (kernels/varlen_attention.cu) --------
#: Tolerance of the GPU against the float64 reference: helpers.check's bound (the kernels'
#: MMA inputs are f16; a new value times win_k_mul / win_v_mul, and the rotated K, are
#: rounded to f16 there, as the window's values), lse within 1e-2 (the window's bound,
#: test_attention_varlen.WIN_LSE_TOL).
GPU_LSE_TOL = 1e-2


def gpu_twin(c: PagedKVCache) -> PagedKVCache:
    """A CUDA cache holding ``c``'s pages, window slots and window map byte for byte."""
    import cupy as cp

    g = PagedKVCache(c.num_blocks, c.block_size, c.num_heads, c.head_dim, device="cuda",
                     rotation=c.rotation, window_pages=c.window_pages,
                     window_slots=c.window_slots, k_scale=c.k_scale, v_scale=c.v_scale,
                     layout=c.layout, scale_rule=c.scale_rule)
    g.buffer[...] = cp.asarray(c.buffer)
    if c.window_slots:
        g.window[...] = cp.asarray(c.window)
        g.window_map[...] = cp.asarray(c.window_map)
    return g


def on_gpu(*arrays):
    import cupy as cp

    return tuple(cp.asarray(a) for a in arrays)


@pytest.mark.gpu
@pytest.mark.parametrize("opts", CASES, ids=lambda o: f"{o['rotation']}-win{o['window']}")
@pytest.mark.parametrize("qdt, newdt, D, group, T", [
    ("bfloat16", BF16, 128, 4, 16), ("float32", np.float32, 64, 1, 32),
    ("float16", BF16, 256, 2, 16), ("bfloat16", np.float16, 64, 8, 64)])
def test_gpu_new_kv_within_the_bound_of_float64(opts, qdt, newdt, D, group, T):
    """Every tile kind: a chunk starting mid-page, one token after a long context (split
    keys), a prefill without context, a long chunk (several query tiles), a sequence
    without query tokens; either mask."""
    from helpers import DT, check

    rng = np.random.default_rng(7)
    c, tab, lens, qsl, (k, v) = filled(rng, prior=[37, 20, 5, 0, 2000, 300],
                                       new=[0, 1, 70, 21, 1, 200], T=T, D=D, dtype=newdt,
                                       **opts)
    g = gpu_twin(c)
    q = (rng.standard_normal((int(qsl[-1]), group * c.num_heads, D), dtype=np.float32)
         .astype(DT[qdt]))
    for causal in (True, False):
        out, lse = g.attention(*on_gpu(q, qsl, tab, lens), causal=causal,
                               new_kv=on_gpu(k, v), return_lse=True)
        ro, rl = window_reference(c, q, qsl, tab, lens, causal=causal, new_kv=(k, v))
        check(out, lse, ro, rl, qdt, f"causal={causal}", lse_tol=GPU_LSE_TOL)
    # the new tokens change what the pages alone give
    paged = g.attention(*on_gpu(q, qsl, tab, lens), causal=False)
    assert float(abs(paged - out).max()) > 0


@pytest.mark.gpu
def test_gpu_decode_attention_reads_the_new_token_exactly():
    from helpers import check

    rng = np.random.default_rng(8)
    c, tab, lens, qsl, (k, v) = filled(rng, prior=[40, 3, 16, 3000], new=[1, 1, 1, 1],
                                       rotation="hadamard", window=2, D=128)
    g = gpu_twin(c)
    q = rng.standard_normal((4, 4 * c.num_heads, c.head_dim), dtype=np.float32)
    out, lse = g.decode_attention(*on_gpu(q, tab, lens), new_kv=on_gpu(k, v),
                                  return_lse=True)
    ro, rl = window_reference(c, q, qsl, tab, lens, causal=False, new_kv=(k, v))
    check(out, lse, ro, rl, "float32", "decode", lse_tol=GPU_LSE_TOL)


@pytest.mark.gpu
def test_gpu_nan_new_values_reach_the_rows_that_see_them():
    """A new V group holding NaN makes the group's columns NaN for the rows that see its
    token (the pages' and the window's rule), a new K NaN those rows entirely."""
    from helpers import check

    rng = np.random.default_rng(9)
    c, tab, lens, qsl, (k, v) = filled(rng, prior=[20, 40], new=[30, 25], D=64,
                                       rotation="hadamard")
    v[5, 1, 16:32] = np.nan  # sequence 0, new token 5 (position 25), head 1, group 1
    k[30 + 10, 0, 3] = np.nan  # sequence 1, new token 10 (position 50), head 0
    g = gpu_twin(c)
    q = rng.standard_normal((int(qsl[-1]), 2 * c.num_heads, 64), dtype=np.float32)
    out, lse = g.attention(*on_gpu(q, qsl, tab, lens), new_kv=on_gpu(k, v),
                           return_lse=True)
    ro, rl = window_reference(c, q, qsl, tab, lens, new_kv=(k, v))
    assert np.isnan(ro).any()
    check(out, lse, ro, rl, "float32", "nan", lse_tol=GPU_LSE_TOL)


@pytest.mark.gpu
def test_gpu_bad_page_id_spares_new_tokens():
    from helpers import check

    rng = np.random.default_rng(4)
    c, tab, lens, qsl, (k, v) = filled(rng, prior=[16], new=[16])
    q = rng.standard_normal((16, 2, c.head_dim), dtype=np.float32)
    ro, rl = window_reference(c, q, qsl, tab, lens, new_kv=(k, v))
    bad = tab.copy()
    bad[0, 1] = c.num_blocks + 5
    g = gpu_twin(c)
    out, lse = g.attention(*on_gpu(q, qsl, bad, lens), new_kv=on_gpu(k, v), validate=False,
                           return_lse=True)
    check(out, lse, ro, rl, "float32", "bad page", lse_tol=GPU_LSE_TOL)
    assert int(g.stats["bad_block_ids"]) == 1


@pytest.mark.gpu
def test_gpu_plan_run_exact_new_is_store_then_attention():
    """``AttentionPlan.run(..., exact_new=True)`` with PyTorch's strided K/V views (one
    fused projection, as vLLM's) is the store, then ``attention(new_kv=...)``."""
    torch = pytest.importorskip("torch")
    import cupy as cp

    H, D = 2, 64
    plan, a, b, qsl, tab, lens, slots = planned_step("cuda", np.random.default_rng(6))
    q = torch.randn(5, 4 * H, D, device="cuda", dtype=torch.bfloat16)
    qkv = torch.randn(5, (4 + 2) * H * D, device="cuda", dtype=torch.bfloat16)
    k = qkv[:, 4 * H * D:5 * H * D].view(5, H, D)  # token stride (4 + 2) * H * D
    v = qkv[:, 5 * H * D:].view(5, H, D)
    got = plan.run(a, q, k, v, exact_new=True)
    b.store(cp.asarray(slots), cp.from_dlpack(k.contiguous()), cp.from_dlpack(v.contiguous()))
    want = b.attention(cp.from_dlpack(q), qsl, tab, lens,
                       new_kv=(cp.from_dlpack(k.contiguous()), cp.from_dlpack(v.contiguous())))
    torch.cuda.synchronize()
    assert bool((cp.from_dlpack(got) == want).all())
    assert bool((a.buffer == b.buffer).all())
