"""fp4cache.vllm against vLLM's own classes, on the CPU backend: vLLM's attention layer
builds the backend's impl, vLLM's allocation code shapes the pages, vLLM's
``CommonAttentionMetadata`` describes the steps.

The translation (metadata -> plan, vLLM's page tensor -> pool) and the results are
checked against :class:`fp4cache.PagedKVCache` doing the same steps by hand on the CPU
backend, exactly; the ``cuda`` cases run the same on the GPU (vLLM's GPU machine kit on
the path).  vLLM's engine end to end is ``bench/vllm_bench.py``.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import DEVICES
from helpers import TOL

for _name, _value in (("VLLM_USE_FLASHINFER_SAMPLER", "0"),
                      ("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1"), ("VLLM_NO_USAGE_STATS", "1")):
    os.environ.setdefault(_name, _value)
torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="the vLLM backend tests need vLLM (the 'vllm' extra)")

from vllm.config import CacheConfig, DeviceConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.layers.attention import Attention  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.utils.torch_utils import nvfp4_kv_cache_split_views  # noqa: E402
from vllm.v1.attention.backend import (  # noqa: E402
    AttentionCGSupport,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.worker.gpu.attn_utils import _reshape_attention_kv_cache  # noqa: E402

import fp4cache.vllm as fv  # noqa: E402
from fp4cache import PagedKVCache, _arrays  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BS, HQ, H, D = 16, 8, 2, 128


def _config():
    return VllmConfig(device_config=DeviceConfig(device="cpu"),
                      cache_config=CacheConfig(cache_dtype="nvfp4", block_size=BS))


@pytest.fixture
def layout(request, monkeypatch):
    """vLLM's KV cache layout (``VLLM_KV_CACHE_LAYOUT``), both tried."""
    import vllm.v1.attention.backends.utils as vutils

    value = getattr(request, "param", "NHD")
    monkeypatch.setattr(vutils, "get_kv_cache_layout", lambda: value)
    monkeypatch.setattr(fv, "get_kv_cache_layout", lambda: value)
    return value


def _layer(config, index=0, **kw):
    with set_current_vllm_config(config):
        return Attention(HQ, D, D ** -0.5, num_kv_heads=H, cache_config=config.cache_config,
                         prefix=f"model.layers.{index}.self_attn.attn",
                         attn_backend=fv.FP4CacheBackend, **kw)


def _kv_cache(layer, config, num_blocks, device="cpu"):
    """A layer's page tensor exactly as vLLM's model runner makes it: one int8 buffer,
    viewed through the backend's shape and stride order."""
    spec = layer.get_kv_cache_spec(config)
    shape = fv.FP4CacheBackend.get_kv_cache_shape(num_blocks, BS, H, D, "nvfp4")
    raw = torch.zeros(num_blocks * spec.page_size_bytes, dtype=torch.int8, device=device)
    return _reshape_attention_kv_cache(raw, spec, shape,
                                       fv.FP4CacheBackend.get_kv_cache_stride_order(),
                                       num_blocks, None)


def _metadata(qsl, lens, tables, slots, device="cpu"):
    """vLLM's step metadata, its tensors on ``device`` as vLLM's runner keeps them."""
    qsl_cpu = torch.tensor(qsl, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl_cpu.to(device), query_start_loc_cpu=qsl_cpu,
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        num_reqs=len(lens), num_actual_tokens=int(qsl[-1]),
        max_query_len=int((qsl_cpu[1:] - qsl_cpu[:-1]).max()), max_seq_len=max(lens),
        block_table_tensor=torch.tensor(tables, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device))


def _steps(rng, num_blocks):
    """vLLM-like steps: two prompts prefilled (one chunked), then decodes, a
    speculative verification of 3 tokens and a new prompt mixed in.  Each step:
    (query_start_loc, seq_lens, block tables, slot_mapping)."""
    free = list(rng.permutation(num_blocks))
    tables: dict[int, list[int]] = {}
    lens: dict[int, int] = {}
    plan = [{0: 37, 1: 20}, {1: 25}, {0: 1, 1: 1}, {0: 3, 1: 1, 2: 18}, {0: 1, 1: 1, 2: 1}]
    out = []
    for step in plan:
        qsl, sl, bt, slots = [0], [], [], []
        for r, n in step.items():
            start = lens.get(r, 0)
            lens[r] = start + n
            need = -(-lens[r] // BS)
            tables.setdefault(r, [])
            while len(tables[r]) < need:
                tables[r].append(int(free.pop()))
            qsl.append(qsl[-1] + n)
            sl.append(lens[r])
            slots += [tables[r][p // BS] * BS + p % BS for p in range(start, lens[r])]
        width = max(len(tables[r]) for r in step)
        bt = [tables[r] + [0] * (width - len(tables[r])) for r in step]
        out.append((qsl, sl, bt, slots))
    return out


def _host(t):
    """A torch tensor's values as NumPy (bf16 as ml_dtypes.bfloat16), as fp4cache takes
    them in."""
    return _arrays.to_backend(t.detach().cpu().contiguous(), "cpu", "t")


def _assert_output(got, want, dtype: str, device: str) -> None:
    """The backend's output against ``PagedKVCache.attention`` on the CPU: bit for bit on
    the CPU backend; on the GPU within the GPU attention tests' bound (other kernels over
    the same page bytes, so the contract's attention tolerance applies)."""
    if device == "cpu":
        assert np.array_equal(got.view(np.int16), want.view(np.int16))
        return
    g, w = got.astype(np.float64), want.astype(np.float64)
    err = np.linalg.norm(g - w, axis=-1) / np.maximum(np.linalg.norm(w, axis=-1), 1e-30)
    assert err.max() <= TOL[dtype], err.max()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("layout", ["NHD", "HND"], indirect=True)
def test_steps_through_vllm_classes_equal_the_cache_by_hand(layout, dtype, device):
    """Two layers, five steps (prefill, chunked prefill, decode, mixed with a verification
    and a new prompt), through vLLM's layer, allocation and metadata: the pages hold
    exactly the bytes ``PagedKVCache.store`` writes on the CPU (the store is bit-exact on
    both backends), rows past ``num_actual_tokens`` are left alone, and the outputs equal
    ``PagedKVCache.attention`` on the CPU: bit for bit on the CPU backend, within the GPU
    attention tests' bound on the GPU (other kernels, same pages)."""
    config = _config()
    rng = np.random.default_rng(0)
    nb = 24
    layers = [_layer(config, i) for i in range(2)]
    caches = [_kv_cache(la, config, nb, device) for la in layers]
    refs = [PagedKVCache(nb, BS, H, D, layout=layout, device="cpu") for _ in layers]
    spec = layers[0].get_kv_cache_spec(config)
    builder = fv.FP4CacheBackend.get_builder_cls()(spec, ["l0", "l1"], config,
                                                    torch.device(device))
    for qsl, sl, bt, slots in _steps(rng, nb):
        md = builder.build(0, _metadata(qsl, sl, bt, slots, device))
        n = qsl[-1]
        for layer, kv, ref in zip(layers, caches, refs, strict=True):
            # views of one fused qkv projection, as vLLM's Llama hands them over (strided
            # along tokens), with 3 padding rows
            qkv = torch.randn(n + 3, (HQ + 2 * H) * D, dtype=getattr(torch, dtype)).to(device)
            q, k, v = (t.view(n + 3, -1, D) for t in qkv.split([HQ * D, H * D, H * D], -1))
            out = torch.full((n + 3, HQ, D), 7.0, dtype=q.dtype, device=device)
            layer.impl.forward(layer, q, k, v, kv, md, output=out)
            assert bool((out[n:] == 7.0).all())
            ref.store(np.array(slots), _host(k[:n]), _host(v[:n]))
            # a step with a prompt or chunk reads its own K/V exactly (exact prompt)
            prompt = max(np.diff(qsl)) > 1
            want = ref.attention(_host(q[:n]), np.array(qsl), np.array(bt), np.array(sl),
                                 new_kv=(_host(k[:n]), _host(v[:n])) if prompt else None)
            _assert_output(_host(out[:n]), want, dtype, device)
            physical = kv if layout == "NHD" else kv.permute(0, 1, 3, 2, 4)
            assert np.array_equal(physical.contiguous().cpu().numpy().reshape(nb, -1),
                                  ref.buffer.reshape(nb, -1))
    # the layers of the group: the first one's cache holds the workspace the others share
    first, second = (la.impl.pages(la, kv) for la, kv in zip(layers, caches, strict=True))
    assert builder.layers.first is first and second is not first
    assert second.workspace_nbytes == first.workspace_nbytes


def test_attention_layer_forward_as_vllms_model_runs_it(layout):
    """The model's call: ``Attention.forward`` with 2-D q/k/v, the step's metadata and
    slot mapping in vLLM's forward context, the page tensor bound to the layer; its
    reshapes and output buffer reach the backend, which stores and attends as
    ``PagedKVCache`` does by hand.  On the device vLLM's platform registers its attention
    op for (the GPU where vLLM sees one)."""
    from vllm.platforms import current_platform

    device = "cuda" if current_platform.is_cuda() else "cpu"
    config = _config()
    layer = _layer(config)
    layer.kv_cache = _kv_cache(layer, config, 8, device)
    spec = layer.get_kv_cache_spec(config)
    builder = fv.FP4CacheBackend.get_builder_cls()(spec, [layer.layer_name], config,
                                                    torch.device(device))
    slots = [3 * BS + i for i in range(16)] + [5 * BS + i for i in range(4)]
    md = builder.build(0, _metadata([0, 20], [20], [[3, 5]], slots, device))
    q, k, v = (torch.randn(20, h * D, dtype=torch.bfloat16).to(device) for h in (HQ, H, H))
    with set_current_vllm_config(config), set_forward_context(
            {layer.layer_name: md}, config,
            slot_mapping={layer.layer_name: torch.tensor(slots, device=device)}):
        out = layer(q, k, v)
    assert out.shape == (20, HQ * D) and out.dtype == torch.bfloat16
    ref = PagedKVCache(8, BS, H, D, layout=layout, device="cpu")
    ref.store(np.array(slots), _host(k.view(20, H, D)), _host(v.view(20, H, D)))
    want = ref.attention(_host(q.view(20, HQ, D)), np.array([0, 20]), np.array([[3, 5]]),
                         np.array([20]), new_kv=(_host(k.view(20, H, D)),
                                                 _host(v.view(20, H, D))))
    _assert_output(_host(out.view(20, HQ, D)), want, "bfloat16", device)
    assert np.array_equal(layer.kv_cache.cpu().numpy().reshape(8, -1), ref.buffer.reshape(8, -1))


def test_the_plan_grows_to_a_step_beyond_vllms_limits():
    """A step wider than the limits the builder read from vLLM's configuration (more
    sequences, tokens or block-table columns) gets a larger plan, not an error; steps
    within them keep the same plan (its buffers are what a captured step reads)."""
    config = _config()
    layer = _layer(config)
    spec = layer.get_kv_cache_spec(config)
    builder = fv.FP4CacheBackend.get_builder_cls()(spec, ["l0"], config, torch.device("cpu"))
    first = builder.build(0, _metadata([0, 1], [5], [[0]], [4])).plan
    assert builder.build(0, _metadata([0, 1, 2], [5, 3], [[0], [1]], [4, 18])).plan is first
    wide = config.scheduler_config.max_num_batched_tokens + 1
    grown = builder.build(0, _metadata([0, wide], [wide], [list(range(-(-wide // BS)))],
                                       list(range(wide)))).plan
    assert grown is not first and grown.max_num_tokens >= wide
    assert grown.max_batch_size >= first.max_batch_size

    class Captured(fv.FP4CacheMetadataBuilder):  # a builder whose steps graphs may capture
        _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    captured = Captured(spec, ["l0"], config, torch.device("cpu"))
    captured.build(0, _metadata([0, 1], [5], [[0]], [4]))
    with pytest.raises(RuntimeError, match="CUDA graphs may have captured"):
        captured.build(0, _metadata([0, wide], [wide], [list(range(-(-wide // BS)))],
                                    list(range(wide))))


@pytest.mark.parametrize("layout", ["NHD", "HND"], indirect=True)
def test_pages_read_through_vllms_own_views(layout):
    """vLLM's ``nvfp4_kv_cache_split_views`` over the backend's pages: K decodes (E2M1
    pairs, element 2i in the low nibble, times the E4M3 scale and ``k_scale``) to what
    ``PagedKVCache.gather_dequant`` returns, and V's data bytes are where vLLM reads them."""
    config = _config()
    layer = _layer(config)
    nb = 4
    kv = _kv_cache(layer, config, nb)
    spec = layer.get_kv_cache_spec(config)
    builder = fv.FP4CacheBackend.get_builder_cls()(spec, ["l0"], config, torch.device("cpu"))
    n = nb * BS
    slots = list(range(n))
    md = builder.build(0, _metadata([0, n], [n], [list(range(nb))], slots))
    rng = np.random.default_rng(1)
    k = torch.from_numpy(rng.standard_normal((n, H, D)).astype(np.float32)).bfloat16()
    v = torch.from_numpy(rng.standard_normal((n, H, D)).astype(np.float32)).bfloat16()
    q = torch.zeros(n, HQ, D, dtype=torch.bfloat16)
    layer.impl.forward(layer, q, k, v, kv, md, output=torch.empty_like(q))
    # vLLM's views index (block, token, head, byte) whatever the layout in memory
    (kd, vd), (ks, _) = nvfp4_kv_cache_split_views(kv)
    e2m1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    codes = kd.numpy()
    vals = np.stack([e2m1[codes & 15], e2m1[codes >> 4]], -1).reshape(nb, BS, H, D)
    scales = ks.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    k_vllm = vals * np.repeat(scales, 16, -1) * layer._k_scale_float
    k_ours, _ = layer.impl.pages(layer, kv).gather_dequant(np.arange(nb), dtype=np.float32)
    assert np.array_equal(k_vllm.reshape(n, H, D), k_ours.reshape(n, H, D))
    # V's data: the first block_size * H * D / 2 bytes of each page's V side
    page = (kv if layout == "NHD" else kv.permute(0, 1, 3, 2, 4)).contiguous().numpy()
    v_data = page.reshape(nb, 2, -1)[:, 1, :BS * H * D // 2]
    v_data = v_data.reshape(nb, BS, H, D // 2) if layout == "NHD" else \
        v_data.reshape(nb, H, BS, D // 2).transpose(0, 2, 1, 3)
    assert np.array_equal(vd.numpy(), v_data)


def test_backend_is_registered_and_validated_as_vllm_selects_it():
    fv.register()
    fv.register()  # every vLLM process calls it; twice is harmless
    assert AttentionBackendEnum.CUSTOM.get_class() is fv.FP4CacheBackend
    assert AttentionBackendEnum[fv.FP4CacheBackend.get_name()] is AttentionBackendEnum.CUSTOM
    kw = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="nvfp4", block_size=16,
              use_mla=False, has_sink=False, use_sparse=False, use_mm_prefix=False,
              use_per_head_quant_scales=False, attn_type=AttentionType.DECODER)
    validate = fv.FP4CacheBackend.validate_configuration
    assert validate(device_capability=DeviceCapability(9, 0), **kw) == []
    assert validate(device_capability=DeviceCapability(8, 0), **kw) == []
    assert validate(device_capability=DeviceCapability(7, 5), **kw) != []
    for change in ({"kv_cache_dtype": "auto"}, {"kv_cache_dtype": "fp8"}, {"head_size": 96},
                   {"block_size": 8}, {"has_sink": True}, {"use_mla": True},
                   {"attn_type": AttentionType.ENCODER_DECODER}):
        assert validate(device_capability=DeviceCapability(9, 0), **{**kw, **change}) != [], \
            change


def test_page_bytes_are_vllms_nvfp4_sizing():
    config = _config()
    layer = _layer(config)
    spec = layer.get_kv_cache_spec(config)
    shape = fv.FP4CacheBackend.get_kv_cache_shape(10, BS, H, D, "nvfp4")
    assert math.prod(shape) == 10 * spec.page_size_bytes
    assert spec.page_size_bytes == PagedKVCache(1, BS, H, D, device="cpu").buffer.nbytes
    with pytest.raises(ValueError, match="kv_cache_dtype='nvfp4'"):
        fv.FP4CacheBackend.get_kv_cache_shape(10, BS, H, D, "auto")
    with pytest.raises(NotImplementedError, match="contiguous"):
        fv.FP4CacheBackend.get_kv_cache_stride_order(include_num_layers_dimension=True)


@pytest.mark.parametrize("kw, match", [
    ({"sliding_window": 4096}, "sliding_window"),
    ({"logits_soft_cap": 30.0}, "logits_soft_cap"),
    ({"alibi_slopes": [1.0] * HQ}, "ALiBi"),
    ({"attn_type": AttentionType.ENCODER_DECODER}, "decoder attention only"),
])
def test_unsupported_features_are_refused_when_the_model_is_built(kw, match):
    impl_cls = fv.FP4CacheBackend.get_impl_cls()
    with set_current_vllm_config(_config()), pytest.raises(NotImplementedError, match=match):
        impl_cls(HQ, D, D ** -0.5, H, kv_cache_dtype="nvfp4",
                 **{"alibi_slopes": None, "sliding_window": None, **kw})
    with set_current_vllm_config(_config()), pytest.raises(ValueError, match="nvfp4"):
        impl_cls(HQ, D, D ** -0.5, H, None, None, "auto")
    with set_current_vllm_config(_config()), pytest.raises(ValueError, match="head_size"):
        impl_cls(HQ, 96, 96 ** -0.5, H, None, None, "nvfp4")


def test_pages_follow_the_layers_global_scales():
    """The layer's ``_k_scale_float`` / ``_v_scale_float`` are the cache's global scales
    (dequantization multipliers); when vLLM sets new ones (``calculate_kv_scales``, at the
    first step) the next step stores and reads with them, over the same memory."""
    config = _config()
    layer = _layer(config)
    kv = _kv_cache(layer, config, 2)
    first = layer.impl.pages(layer, kv)
    assert (first.k_scale, first.v_scale) == (1.0, 1.0)
    assert layer.impl.pages(layer, kv) is first
    layer._k_scale_float, layer._v_scale_float = 0.25, 0.5
    again = layer.impl.pages(layer, kv)
    assert (again.k_scale, again.v_scale) == (0.25, 0.5)
    assert again.buffer.__array_interface__["data"][0] == kv.data_ptr()


def test_profiling_run_without_metadata_writes_zeros():
    config = _config()
    layer = _layer(config)
    out = torch.ones(5, HQ, D, dtype=torch.bfloat16)
    q = torch.zeros(5, HQ, D, dtype=torch.bfloat16)
    k = torch.zeros(5, H, D, dtype=torch.bfloat16)
    layer.impl.forward(layer, q, k, k, torch.tensor([]), None, output=out)
    assert not out.any()


def test_vllm_loads_the_installed_plugin(monkeypatch):
    """What each vLLM process does at start: its plugin loader finds the installed
    package's entry point (``pip install -e .`` writes it) and the call registers the
    backend as ``CUSTOM``."""
    from importlib.metadata import entry_points

    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group
    from vllm.v1.attention.backends import registry

    if not any(ep.value == "fp4cache.vllm:register"
               for ep in entry_points(group=DEFAULT_PLUGINS_GROUP)):
        pytest.skip("fp4cache's entry points are not installed (pip install -e . again "
                    "after a change to pyproject.toml)")
    monkeypatch.setattr(registry, "_ATTN_OVERRIDES", {})
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    plugins = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
    assert plugins["fp4cache"] is fv.register
    plugins["fp4cache"]()
    assert AttentionBackendEnum.CUSTOM.get_class() is fv.FP4CacheBackend


def test_entry_point_registers_in_every_vllm_process():
    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["entry-points"]["vllm.general_plugins"] == {"fp4cache": "fp4cache.vllm:register"}
    assert any(d.startswith("vllm") for d in meta["optional-dependencies"]["vllm"])
    assert "fp4cache.vllm" in sys.modules


@pytest.mark.parametrize("value, exact", [("0", False), ("1", True), (None, True)])
def test_exact_prompt_follows_the_environment(monkeypatch, value, exact):
    """``FP4CACHE_EXACT_PROMPT``: a prompt step reads its own K/V exactly unless it is 0;
    another value is refused when the layer is built."""
    if value is None:
        monkeypatch.delenv("FP4CACHE_EXACT_PROMPT", raising=False)
    else:
        monkeypatch.setenv("FP4CACHE_EXACT_PROMPT", value)
    assert _layer(_config()).impl.exact_prompt is exact
    monkeypatch.setenv("FP4CACHE_EXACT_PROMPT", "yes")
    with pytest.raises(ValueError, match="FP4CACHE_EXACT_PROMPT must be 0 or 1"):
        _layer(_config())
