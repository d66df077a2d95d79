"""``fp4cache.hf``: the transformers Cache over NVFP4 pages and the ``"fp4cache"`` attention.

Tiny random-weight models built from configs (no download): Llama, Qwen2 and Mistral-style,
GQA 1, 3 and 4, head_dim 64 and 128.  The fused path (``attn_implementation="fp4cache"``,
attention read from the pages) is compared with transformers' sdpa over the same cache's
dequantized K/V (the values the fused attention reads): the tokens must agree exactly and
the logits within float32 attention tolerance (the two differ only in the order of the
float32 sums, amplified through the layers: 2e-3 relative to the largest logit).
The GPU cases run the same comparisons on CUDA tensors against the CPU backend.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="fp4cache.hf needs the 'hf' extra (torch)")
transformers = pytest.importorskip("transformers",
                                   reason="fp4cache.hf needs the 'hf' extra (transformers)")

import fp4cache.hf as fh  # noqa: E402
from fp4cache import formats, gpu_available  # noqa: E402

LOGIT_RTOL = 2e-3  # of the largest |logit|: float32 attention sums in another order


def _config(kind: str, *, heads=8, kv_heads=2, head_dim=64, layers=2, vocab=96):
    common = dict(vocab_size=vocab, hidden_size=heads * head_dim // 2, intermediate_size=128,
                  num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, head_dim=head_dim,
                  max_position_embeddings=512, pad_token_id=0)
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common, use_sliding_window=False)
    if kind == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None)
    raise ValueError(kind)


def _model(cfg, impl: str, device="cpu", dtype=torch.float32):
    torch.manual_seed(0)  # the same weights for every model of one config
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), dtype=dtype)
    model = model.to(device).eval()
    model.set_attn_implementation(impl)
    return model


def _greedy(model, cache, ids, steps, mask=None, forced=None):
    """Prefill, then ``steps`` greedy decode steps by hand: (tokens, logits per step).
    ``forced`` (B, steps): feed these tokens instead of the argmax (teacher forcing: two
    models compared on the same inputs, whatever a near tie picks)."""
    logits, tokens = [], []
    pos = None if mask is None else (mask.cumsum(1) - 1).clamp(min=0)  # as generate does
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                    use_cache=True)
        for i in range(steps):
            last = out.logits[:, -1].float()
            logits.append(last)
            nxt = last.argmax(-1, keepdim=True) if forced is None else forced[:, i:i + 1]
            tokens.append(nxt)
            if mask is not None:
                mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
                pos = pos[:, -1:] + 1
            out = model(input_ids=nxt, attention_mask=mask, position_ids=pos,
                        past_key_values=cache, use_cache=True)
    return torch.cat(tokens, 1), torch.stack(logits, 1)


def _close(a, b, rtol=LOGIT_RTOL):
    scale = float(b.abs().max())
    err = float((a - b).abs().max())
    assert err <= rtol * scale, f"max |logit diff| {err:.3g} > {rtol} x {scale:.3g}"


#: The plain NVFP4 cache (no rotation, no exact window): vLLM's pages.
PLAIN = {"rotation": "none", "window_pages": 0, "exact_prompt": False}

CASES = [("llama", 8, 2, 64), ("qwen2", 6, 2, 128), ("mistral", 4, 4, 64),
         ("llama", 12, 4, 128)]  # GQA 4, 3, 1, 3; head_dim 64 and 128


@pytest.mark.parametrize("kind,heads,kv_heads,head_dim", CASES)
def test_fused_equals_sdpa_over_the_dequantized_cache(kind, heads, kv_heads, head_dim):
    cfg = _config(kind, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    fused, ref = _model(cfg, "fp4cache"), _model(cfg, "sdpa")
    ids = torch.randint(1, cfg.vocab_size, (2, 19), generator=torch.Generator().manual_seed(1))
    c_f = fh.FP4Cache(fused.config, 2, 64, device="cpu")
    c_r = fh.FP4Cache(ref.config, 2, 64, device="cpu")
    t_f, l_f = _greedy(fused, c_f, ids, 20)
    t_r, l_r = _greedy(ref, c_r, ids, 20)
    assert torch.equal(t_f, t_r)
    _close(l_f, l_r)
    # Layer 0's K/V depend on the embeddings only: both caches hold the same bytes there.
    p_f, p_r = c_f.layers[0].pages, c_r.layers[0].pages
    used = np.arange(2)[:, None] * c_f.pages_per_row + np.arange(-(-39 // 16))
    assert np.array_equal(p_f.buffer[used.ravel()], p_r.buffer[used.ravel()])
    assert c_f.get_seq_length() == c_r.get_seq_length() == 19 + 20
    assert c_f.layers[0].mode == "fused" and c_r.layers[0].mode == "dequantize"


def test_head_dim_96_phi3_runs_and_other_head_dims_are_refused():
    """head_dim 96 (Phi-3) has no swizzled V scales (head_dim % 64): the cache stores them
    in plain order, and the fused attention equals sdpa over the dequantized cache."""
    cfg = transformers.Phi3Config(vocab_size=96, hidden_size=192, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=2,
                                  num_key_value_heads=1, max_position_embeddings=512,
                                  pad_token_id=0, eos_token_id=1, bos_token_id=1)
    fused, ref = _model(cfg, "fp4cache"), _model(cfg, "sdpa")
    ids = torch.randint(1, 96, (1, 11), generator=torch.Generator().manual_seed(3))
    c_f = fh.FP4Cache(fused.config, 1, 32, device="cpu")
    c_r = fh.FP4Cache(ref.config, 1, 32, device="cpu")
    assert c_f.head_dim == 96 and not c_f.layers[0].pages.geometry.swizzle_v_scales
    t_f, l_f = _greedy(fused, c_f, ids, 6)
    t_r, l_r = _greedy(ref, c_r, ids, 6)
    assert torch.equal(t_f, t_r)
    _close(l_f, l_r)
    assert fh.FP4Cache(_config("llama"), 1, 32, device="cpu").layers[0].pages.geometry \
        .swizzle_v_scales
    with pytest.raises(ValueError, match="head_dim .*multiple of 16.* 40"):
        fh.FP4Cache(_config("llama", head_dim=40), 1, 32)


@pytest.mark.gpu
def test_gpu_fused_attention_refuses_head_dim_96_at_construction():
    cfg = _config("llama", heads=4, kv_heads=2, head_dim=96)
    cfg._attn_implementation = "fp4cache"
    with pytest.raises(NotImplementedError, match=r"head_dim in \(64, 128, 256\).* 96"):
        fh.FP4Cache(cfg, 1, 32, device="cuda")
    cfg._attn_implementation = "sdpa"  # the dequantizing path takes any multiple of 16
    cache = fh.FP4Cache(cfg, 1, 32, device="cuda")
    k = torch.randn(1, 2, 5, 96, device="cuda")
    kk, _ = cache.update(k, k, 0)
    assert kk.shape == (1, 2, 5, 96)


def test_dequantize_mode_returns_the_exact_window():
    cfg = _config("llama")
    model = _model(cfg, "eager")
    # rotation and window (default), every key read through the pages and the window
    cache = fh.FP4Cache(model.config, 1, 64, device="cpu", exact_prompt=False)
    assert (cache.rotation, cache.window_pages) == ("hadamard", 3)
    k = torch.randn(1, 2, 40, 64)
    v = torch.randn(1, 2, 40, 64)
    kk, vv = cache.update(k, v, 0)
    # the 3 newest pages (all 40 tokens) come from the window: bf16 of the values
    # (K through the rotation and back: float32 rounding on top)
    torch.testing.assert_close(vv, v.to(torch.bfloat16).float(), rtol=0, atol=0)
    exact_k = formats.hadamard(formats.hadamard(k.numpy()).astype(ml_dtypes.bfloat16)
                               .astype(np.float32))
    assert torch.equal(kk, torch.from_numpy(exact_k))
    k2 = torch.randn(1, 2, 20, 64)
    kk, vv = cache.update(k2, k2, 0)  # 60 tokens: page 0 has left the window
    ref_k, ref_v = cache.layers[0].pages.gather_dequant(np.array([0]), dtype="float32")
    assert torch.equal(vv[0, :, :16].transpose(0, 1), torch.from_numpy(ref_v))
    assert torch.equal(kk[0, :, :16].transpose(0, 1), torch.from_numpy(ref_k))
    torch.testing.assert_close(vv[:, :, 16:40], v[:, :, 16:].to(torch.bfloat16).float(),
                               rtol=0, atol=0)
    assert cache.layers[0].pages.window_map[:4].tolist() == [-1, 1, 2, 0]  # page p: p % 3


def test_dequantize_mode_returns_the_cache_contents():
    cfg = _config("llama")
    model = _model(cfg, "eager")
    cache = fh.FP4Cache(model.config, 1, 32, device="cpu", **PLAIN)
    k = torch.randn(1, 2, 5, 64)
    v = torch.randn(1, 2, 5, 64)
    kk, vv = cache.update(k, v, 0)
    assert kk.shape == (1, 2, 5, 64) and kk.dtype == torch.float32
    ref_k, ref_v = cache.layers[0].pages.gather_dequant(np.array([0]), dtype="float32")
    assert torch.equal(kk[0].transpose(0, 1), torch.from_numpy(ref_k[:5]))
    assert torch.equal(vv[0].transpose(0, 1), torch.from_numpy(ref_v[:5]))
    assert float((kk - k).abs().max()) < 0.5 * float(k.abs().max())  # NVFP4, not garbage


def test_left_padded_batch_equals_the_prompts_one_by_one():
    cfg = _config("llama", heads=6, kv_heads=2)
    model = _model(cfg, "fp4cache")
    g = torch.Generator().manual_seed(2)
    a = torch.randint(1, cfg.vocab_size, (1, 21), generator=g)
    b = torch.randint(1, cfg.vocab_size, (1, 13), generator=g)
    ids = torch.zeros(2, 21, dtype=torch.long)
    mask = torch.zeros(2, 21, dtype=torch.long)
    ids[0], mask[0] = a[0], 1
    ids[1, 8:], mask[1, 8:] = b[0], 1
    cache = fh.FP4Cache(model.config, 2, 48, device="cpu")
    t, logits = _greedy(model, cache, ids, 12, mask)
    # the pages of row 1 hold its 13 + 12 real tokens only, from its first page on
    assert cache.layers[1].lens[:2].tolist() == [21 + 12, 13 + 12]
    for row, prompt in ((0, a), (1, b)):
        alone = fh.FP4Cache(model.config, 1, 48, device="cpu")
        t1, l1 = _greedy(model, alone, prompt, 12)
        assert torch.equal(t[row], t1[0])
        _close(logits[row], l1[0])


def test_generate_greedy_sampling_reset_and_reuse():
    cfg = _config("qwen2", heads=4, kv_heads=2)
    model = _model(cfg, "fp4cache")
    ids = torch.randint(1, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    cache = fh.FP4Cache(model.config, 2, 40, device="cpu")
    kw = dict(attention_mask=mask, past_key_values=cache, max_new_tokens=8, pad_token_id=0)
    first = model.generate(ids, do_sample=False, **kw)
    assert first.shape == (2, 17)
    cache.reset()
    assert cache.get_seq_length() == 0 and not cache.layers[0].lens.any()
    again = model.generate(ids, do_sample=False, **kw)
    assert torch.equal(first, again)
    cache.reset()
    torch.manual_seed(5)
    sampled = model.generate(ids, do_sample=True, top_k=5, **kw)
    cache.reset()
    torch.manual_seed(5)
    assert torch.equal(sampled, model.generate(ids, do_sample=True, top_k=5, **kw))


def test_one_plan_per_step_for_all_layers(monkeypatch):
    cfg = _config("llama", layers=4)
    model = _model(cfg, "fp4cache")
    cache = fh.FP4Cache(model.config, 2, 32, device="cpu")
    made = []
    real = fh._Step.__init__

    def counting(self, *a):
        made.append(1)
        real(self, *a)

    monkeypatch.setattr(fh._Step, "__init__", counting)
    ids = torch.randint(1, cfg.vocab_size, (2, 5))
    _greedy(model, cache, ids, 3, torch.ones_like(ids))
    assert len(made) == 4  # prefill + 3 steps, not 4 layers x 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models(dtype):
    cfg = _config("llama")
    fused, ref = _model(cfg, "fp4cache", dtype=dtype), _model(cfg, "sdpa", dtype=dtype)
    ids = torch.randint(1, cfg.vocab_size, (1, 11), generator=torch.Generator().manual_seed(4))
    t_f, l_f = _greedy(fused, fh.FP4Cache(fused.config, 1, 32, device="cpu"), ids, 6)
    t_r, l_r = _greedy(ref, fh.FP4Cache(ref.config, 1, 32, device="cpu"), ids, 6)
    _close(l_f, l_r, rtol=2e-2)  # the model itself runs in 16 bits


def test_reorder_cache_copies_pages_of_repeated_rows():
    cfg = _config("llama", layers=2)
    cache = fh.FP4Cache(cfg, 3, 40, device="cpu")
    rows = [torch.randn(1, 2, 20, 64) for _ in range(3)]
    k = torch.cat(rows)
    for layer in range(2):
        cache.update(k, -k, layer)
    before = [cache.update(k[:, :, :0], k[:, :, :0], 0)[0][r].clone() for r in range(3)]
    buf1 = cache.layers[1].pages.buffer.copy()
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    after = cache.update(k[:, :, :0], k[:, :, :0], 0)[0]
    for r, src in enumerate([2, 2, 0]):
        assert torch.equal(after[r], before[src])
    # the pages of rows 0 and 2 (picked) did not move; row 1's free pages took the copy
    p = cache.pages_per_row
    keep = np.r_[0:2, 2 * p:2 * p + 2]
    assert np.array_equal(cache.layers[1].pages.buffer[keep], buf1[keep])
    assert cache.block_tables[:3, 0].tolist() == [2 * p, p, 0]


def test_calibrate_scales_per_layer():
    cfg = _config("llama", layers=3)
    model = _model(cfg, "fp4cache")
    ids = torch.randint(1, cfg.vocab_size, (1, 24))
    ks, vs = fh.calibrate_scales(model, ids, "4over6")
    plain_ks, plain_vs = fh.calibrate_scales(model, ids, "4over6", rotation="none")
    assert len(ks) == len(vs) == 3 and all(s > 0 for s in ks + vs)
    assert model.config._attn_implementation == "fp4cache"  # restored
    cache = transformers.DynamicCache()
    sdpa = _model(cfg, "sdpa")
    with torch.no_grad():
        sdpa(input_ids=ids, past_key_values=cache)
    k1 = cache.layers[1].keys.float()
    assert plain_ks[1] == pytest.approx(k1.abs().max().item() / (6 * 256), rel=1e-6)
    rotated = formats.hadamard(k1.numpy())  # the keys as FP4Cache stores them by default
    assert ks[1] == pytest.approx(float(np.abs(rotated).max()) / (6 * 256), rel=1e-6)
    assert vs == plain_vs
    c = fh.FP4Cache(model.config, 1, 32, k_scales=ks, v_scales=vs, device="cpu")
    assert [layer.pages.k_scale for layer in c.layers] == pytest.approx(ks, rel=1e-7)


def test_nbytes_and_compression():
    cfg = _config("llama", heads=8, kv_heads=2, head_dim=128, layers=4)
    cache = fh.FP4Cache(cfg, 4, 256, device="cpu", **PLAIN)
    bf16 = 4 * 256 * 2 * 128 * 2 * 2 * 4  # B x L x H x D x (K, V) x 2 bytes x layers
    pages = sum(layer.pages.nbytes for layer in cache.layers)
    # the step plan: query starts, lengths, the rows' page table (int32), a slot per position
    plan = (4 + 1) * 4 + 4 * 4 + 4 * 16 * 4 + 4 * 256 * 8
    assert cache.nbytes == pages + plan
    assert bf16 / pages == pytest.approx(256 / 72, rel=1e-3)
    win = fh.FP4Cache(cfg, 4, 256, device="cpu")  # plus 3 bf16 pages per row and a map
    window = 4 * (4 * 3 * 16 * 2 * 128 * 2 * 2 + 4 * 16 * 4)  # layers x (slots + map)
    assert win.nbytes == cache.nbytes + window


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
#: One layer's fused attention against float32 sdpa over the cache's dequantized K/V: the
#: output's own rounding (bf16: 2^-8 of the largest value) on top of the backend's float32
#: (CPU) or f16-MMA (GPU, ~2e-4) attention.
LAYER_RTOL = {torch.bfloat16: 5e-3, torch.float32: 1e-3}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b,q,past", [(2, 37, 0), (2, 1, 37), (1, 5, 20)])
def test_one_layer_against_float32_attention(device, dtype, b, q, past):
    cfg = _config("llama", layers=1)
    cfg._attn_implementation = "fp4cache"
    cache = fh.FP4Cache(cfg, b, 80, device=device, **PLAIN)
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(8)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    if past:
        kk, vv = layer.update(rnd(b, 2, past, 64), rnd(b, 2, past, 64), 0)
        fh.fp4cache_attention_forward(None, rnd(b, 8, past, 64), kk, vv, None, 0.125)
    query = rnd(b, 8, q, 64)
    kk, vv = layer.update(rnd(b, 2, q, 64), rnd(b, 2, q, 64), 0)
    out, weights = fh.fp4cache_attention_forward(None, query, kk, vv, None, 0.125)
    assert weights is None and out.shape == (b, q, 8, 64) and out.dtype == dtype
    n = past + q
    blocks = (np.arange(b)[:, None] * cache.pages_per_row + np.arange(-(-n // 16))).ravel()
    if cache.device.type == "cuda":
        import cupy

        blocks = cupy.asarray(blocks)
    k_hat, v_hat = layer.pages.gather_dequant(blocks, dtype="float32")

    def heads(a):
        t = torch.from_dlpack(a).to(device)
        return t.view(b, -1, 2, 64)[:, :n].transpose(1, 2).repeat_interleave(4, 1)

    mask = torch.ones(q, n, dtype=torch.bool, device=device).tril(n - q)
    ref = torch.nn.functional.scaled_dot_product_attention(
        query.float(), heads(k_hat), heads(v_hat), attn_mask=mask, scale=0.125).transpose(1, 2)
    err = float((out.float() - ref).abs().max() / ref.abs().max())
    assert err < LAYER_RTOL[dtype]


# -- errors: clear, and nothing in the cache changes ----------------------------------------
def test_fp4cache_attention_without_an_fp4cache():
    model = _model(_config("llama"), "fp4cache")
    with pytest.raises(TypeError, match="FP4Cache"), torch.no_grad():
        model(input_ids=torch.ones(1, 4, dtype=torch.long))


@pytest.mark.parametrize("missing", ["torch", "transformers"])
def test_import_without_the_hf_extra_says_what_to_install(missing):
    code = (f"import sys; sys.modules[{missing!r}] = None\n"
            "try:\n    import fp4cache.hf\n"
            "except ImportError as e:\n    print(type(e).__name__, e)")
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("ImportError fp4cache.hf needs PyTorch and transformers")
    assert missing in res.stdout and "pip install 'fp4cache[hf]'" in res.stdout


@pytest.mark.skipif(gpu_available() or torch.cuda.is_available(),
                    reason="checks the error of a PyTorch without CUDA")
def test_cuda_device_with_a_cpu_only_torch_says_what_to_install():
    cfg = _config("llama")
    for device in ("cuda", "cuda:0", torch.device("cuda")):
        with pytest.raises(RuntimeError, match="FP4Cache on device 'cuda.*CUDA build of PyTorch"):
            fh.FP4Cache(cfg, 1, 512, device=device)


def test_overflow_and_batch_errors_leave_the_pages():
    model = _model(_config("llama"), "fp4cache")
    cache = fh.FP4Cache(model.config, 1, 16, device="cpu")
    with torch.no_grad():
        model(input_ids=torch.ones(1, 10, dtype=torch.long), past_key_values=cache)
        before = cache.layers[0].pages.buffer.copy()
        with pytest.raises(ValueError, match="max_cache_len=16"):
            model(input_ids=torch.ones(1, 7, dtype=torch.long), past_key_values=cache)
        with pytest.raises(ValueError, match="max_batch_size=1"):
            model(input_ids=torch.ones(2, 1, dtype=torch.long), past_key_values=cache)
    assert np.array_equal(cache.layers[0].pages.buffer, before)
    assert cache.get_seq_length() == 10


def test_sliding_window_shorter_than_the_cache_is_refused_at_construction():
    cfg = _config("mistral")
    cfg.sliding_window = 8
    model = _model(cfg, "fp4cache")
    with pytest.raises(NotImplementedError, match=r"sliding_window=8.*max_cache_len=32.*"
                                                  r"max_cache_len <= 8"):
        fh.FP4Cache(model.config, 1, 32, device="cpu")
    cache = fh.FP4Cache(model.config, 1, 8, device="cpu")  # the window covers the cache
    with torch.no_grad():
        model(input_ids=torch.ones(1, 8, dtype=torch.long), past_key_values=cache)
    assert cache.get_seq_length() == 8
    default = transformers.MistralConfig(num_hidden_layers=1)  # sliding_window 4096
    fh.FP4Cache(default, 1, 4096)
    with pytest.raises(NotImplementedError, match="sliding_window=4096"):
        fh.FP4Cache(default, 1, 4097)
    qwen2 = transformers.Qwen2Config(num_hidden_layers=2, use_sliding_window=True,
                                     sliding_window=8, max_window_layers=1)
    with pytest.raises(NotImplementedError, match="sliding_attention"):
        fh.FP4Cache(qwen2, 1, 32)


def test_unsupported_features_raise():
    cfg = _config("mistral")
    cfg.sliding_window = 8
    model = _model(cfg, "fp4cache")
    cache = fh.FP4Cache(model.config, 1, 8, device="cpu")
    model.config.sliding_window = 4  # changed after construction: refused at the call
    with pytest.raises(NotImplementedError, match="causal|sliding"), torch.no_grad():
        model(input_ids=torch.ones(1, 6, dtype=torch.long), past_key_values=cache)
    llama = _model(_config("llama"), "fp4cache")
    cache = fh.FP4Cache(llama.config, 1, 32, device="cpu")
    mask4d = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    with pytest.raises(NotImplementedError, match="mask"), torch.no_grad():
        llama(input_ids=torch.ones(1, 4, dtype=torch.long), attention_mask=mask4d,
              past_key_values=cache)
    with pytest.raises(NotImplementedError):
        cache.crop(2)
    with pytest.raises(ValueError, match="max_cache_len"):
        fh.FP4Cache(llama.config, 1, 0)
    with pytest.raises(ValueError, match="k_scales"):
        fh.FP4Cache(llama.config, 1, 8, k_scales=[1.0])


def test_switching_attention_needs_a_reset():
    model = _model(_config("llama"), "fp4cache")
    cache = fh.FP4Cache(model.config, 1, 32, device="cpu")
    ids = torch.ones(1, 4, dtype=torch.long)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
        model.set_attn_implementation("sdpa")
        with pytest.raises(RuntimeError, match="reset"):
            model(input_ids=ids, past_key_values=cache)
        cache.reset()
        model(input_ids=ids, past_key_values=cache)


# -- GPU: CUDA tensors, the CuPy kernels, checked against the CPU backend -------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kind,heads,kv_heads,head_dim", CASES[:2])
def test_gpu_fused_equals_sdpa_over_the_dequantized_cache(kind, heads, kv_heads, head_dim,
                                                          dtype=torch.float32):
    cfg = _config(kind, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    fused = _model(cfg, "fp4cache", device="cuda", dtype=dtype)
    ref = _model(cfg, "sdpa", device="cuda", dtype=dtype)
    ids = torch.randint(1, cfg.vocab_size, (2, 37), generator=torch.Generator().manual_seed(6))
    c_f = fh.FP4Cache(fused.config, 2, 80, device="cuda")
    c_r = fh.FP4Cache(ref.config, 2, 80, device="cuda")
    t_f, l_f = _greedy(fused, c_f, ids.cuda(), 16)
    _, l_r = _greedy(ref, c_r, ids.cuda(), 16, forced=t_f)
    # The GPU kernels multiply in f16 MMAs (each attention row within ~2e-3 of float32,
    # tests/test_attention_*.py), amplified through the layers.
    _close(l_f.cpu(), l_r.cpu(), rtol=1e-2)
    assert c_f.layers[0].pages.device == "cuda" and c_f.layers[0].mode == "fused"
    # the layers attend with the first layer's workspace (reserved for the cache's
    # limits), and nbytes counts it once over the layers (each a share, rounded up)
    ws = [layer.pages.workspace_nbytes for layer in c_f.layers]
    assert ws[0] > 0 and ws == [ws[0]] * len(ws)
    own = fh.FP4Cache(fused.config, 2, 80, device="cuda").layers[0].pages
    pages = len(ws) * (own.nbytes - own.workspace_nbytes) + c_f._rows.plan.nbytes
    assert 0 <= c_f.nbytes - pages - ws[0] < len(ws)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,heads,kv_heads,head_dim", CASES[:2])
def test_gpu_fused_with_padding_equals_the_cpu_backend(kind, heads, kv_heads, head_dim):
    """A left-padded batch through the fused path on the GPU and on the CPU backend, fed the
    same tokens.  (Against the dequantizing path only without padding: there the padding is
    stored, so a padded row's exact window holds other tokens, docs/window.md.)"""
    cfg = _config(kind, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    gpu = _model(cfg, "fp4cache", device="cuda")
    cpu = _model(cfg, "fp4cache")
    ids = torch.randint(1, cfg.vocab_size, (2, 37), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    t_g, l_g = _greedy(gpu, fh.FP4Cache(gpu.config, 2, 80, device="cuda"), ids.cuda(), 16,
                       mask.cuda())
    _, l_c = _greedy(cpu, fh.FP4Cache(cpu.config, 2, 80, device="cpu"), ids, 16, mask,
                     forced=t_g.cpu())
    _close(l_g.cpu(), l_c, rtol=1e-2)  # the same pages; the kernels' f16 MMAs, as above


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_pages_equal_the_cpu_backends(dtype):
    """The same CUDA K/V stored through FP4Cache on the GPU and on the CPU: the same bytes,
    and the same dequantized K/V back."""
    cfg = _config("llama", heads=8, kv_heads=2, head_dim=128)
    g = torch.Generator().manual_seed(7)
    k = torch.randn(3, 2, 40, 128, generator=g).to(dtype) * 3
    v = torch.randn(3, 2, 40, 128, generator=g).to(dtype)
    gpu = fh.FP4Cache(cfg, 3, 64, device="cuda")
    cpu = fh.FP4Cache(cfg, 3, 64, device="cpu")
    kg, vg = gpu.update(k.cuda(), v.cuda(), 1)
    kc, vc = cpu.update(k, v, 1)
    assert np.array_equal(gpu.layers[1].pages.buffer.get(), cpu.layers[1].pages.buffer)
    assert torch.equal(kg.cpu(), kc) and torch.equal(vg.cpu(), vc)


@pytest.mark.gpu
def test_gpu_generate_and_no_sync_without_a_mask():
    cfg = _config("llama", heads=8, kv_heads=2, head_dim=128)
    model = _model(cfg, "fp4cache", device="cuda", dtype=torch.bfloat16)
    cache = fh.FP4Cache(model.config, 4, 96, device="cuda")
    ids = torch.randint(1, cfg.vocab_size, (4, 30), device="cuda")
    out = model.generate(ids, past_key_values=cache, max_new_tokens=16, do_sample=False,
                         pad_token_id=0)
    assert out.shape == (4, 46)
    ref = _model(cfg, "sdpa", device="cuda", dtype=torch.bfloat16)
    out_ref = ref.generate(ids, past_key_values=fh.FP4Cache(ref.config, 4, 96), max_new_tokens=16,
                           do_sample=False, pad_token_id=0)
    assert (out == out_ref).float().mean() > 0.9  # bf16 models: ties may break either way
    # a decode step without a padding mask launches without a host synchronization
    step = torch.ones(4, 1, dtype=torch.long, device="cuda")
    with torch.no_grad():
        model(input_ids=step, past_key_values=cache)  # warm the launches
        torch.cuda.set_sync_debug_mode("error")
        try:
            model(input_ids=step, past_key_values=cache)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_gpu_cache_lives_on_the_model_device():
    cfg = _config("llama")
    cache = fh.FP4Cache(cfg, 1, 32, device="cuda:0")
    assert cache.device == torch.device("cuda", 0)
    assert all(layer.pages.device_id == 0 for layer in cache.layers)
    assert gpu_available()


@pytest.mark.gpu
def test_gpu_random_shapes_keep_memory_flat():
    """Steps of random batch sizes, query lengths and padding: after a warm-up that sees
    every shape, neither the cache's bytes nor CuPy's pool grow."""
    import cupy

    cfg = _config("llama", heads=8, kv_heads=2, head_dim=64)
    cfg._attn_implementation = "fp4cache"
    cache = fh.FP4Cache(cfg, 4, 96, device="cuda")
    layer = cache.layers[0]
    rng = np.random.default_rng(9)
    pool = cupy.get_default_memory_pool()

    def steps(n):
        for _ in range(n):
            b, q = int(rng.integers(1, 5)), int(rng.choice([1, 3, 17]))
            if layer.positions + q > cache.max_cache_len:
                cache.reset()
            mask = torch.from_numpy(rng.random((b, q)) < 0.8).cuda() if rng.random() < 0.5 \
                else None
            k = torch.randn(b, 2, q, 64, device="cuda", dtype=torch.bfloat16)
            kk, vv = layer.update(k, k, 0)
            fh.fp4cache_attention_forward(None, torch.randn(b, 8, q, 64, device="cuda",
                                                            dtype=torch.bfloat16),
                                          kk, vv, mask, 0.125)
            if rng.random() < 0.05:
                cache.reset()
        torch.cuda.synchronize()

    steps(300)
    before = (cache.nbytes, pool.total_bytes())
    steps(300)
    assert (cache.nbytes, pool.total_bytes()) == before
