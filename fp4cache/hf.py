"""fp4cache inside Hugging Face transformers: NVFP4 pages as a ``Cache``, attention read from them.

Importing this module registers the attention implementation ``"fp4cache"`` with
``transformers.AttentionInterface`` (and its mask function with
``transformers.masking_utils.AttentionMaskInterface``), the public extension points of
transformers.  A model loaded or switched to it stores each step's K/V into the pages of an
:class:`FP4Cache` and computes attention straight from them with
:meth:`fp4cache.PagedKVCache.attention` (prefill, chunked prefill and decode; GQA; bf16,
f16 or f32 queries), with no bf16 copy of the cache anywhere::

    import fp4cache.hf
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="fp4cache")
    cache = fp4cache.hf.FP4Cache(model.config, max_batch_size=8, max_cache_len=4096,
                                 device=model.device)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=128)

(transformers 5.24 and later name the argument ``cache=``; ``past_key_values=`` still works
there, with a deprecation warning.)  Give the cache per-layer scales from
:func:`calibrate_scales` on a sample of the model's own text: NVFP4's rounding depends on
them, and on a small model the default scale can change a greedy answer.

With any other attention implementation (``"sdpa"``, ``"eager"``, ...) the same cache
works as a dequantizing cache, as transformers' ``QuantizedCache`` does: ``update``
returns the whole cache dequantized to the model's dtype for that implementation to read.

PyTorch and transformers are imported here only (the ``hf`` extra); the rest of fp4cache
does not need them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

try:
    import torch
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as e:
    raise ImportError(f"fp4cache.hf needs PyTorch and transformers ({e}): pip install "
                      "'fp4cache[hf]' (in a checkout: pip install -e \".[hf]\")") from None

from . import _arrays, formats
from ._kernels import ATTN_HEAD_DIMS
from .cache import PagedKVCache
from .calibrate import calibrate_scale
from .layout import slot_mapping

__all__ = ["ATTN_IMPLEMENTATION", "DEFAULT_SCALE", "FP4Cache", "FP4CacheLayer",
           "calibrate_scales", "fp4cache_attention_forward", "fp4cache_mask"]

#: The name this module registers with ``transformers.AttentionInterface``.
ATTN_IMPLEMENTATION = "fp4cache"

#: Global scale of every layer's K and V when none is given: the scale
#: :func:`fp4cache.calibrate_scale` gives for data of ``amax = 64`` under ``"4over6"``
#: (``64 / (6 * 256)``).  It keeps the E4M3 block scales of post-RoPE keys and of values
#: of magnitude 0.1 to 100 in E4M3's normal range; calibrating with
#: :func:`calibrate_scales` on a sample of the model's own text is better.
DEFAULT_SCALE = 64.0 / (6 * formats.RULE_E4M3_MAX["4over6"])

_TAG = "_fp4cache_layer"  # attribute of the K tensor that ``update`` hands to the attention


# -- tensors -> the cache's arrays --------------------------------------------------------
def _array(t: torch.Tensor, name: str):
    """A NumPy (CPU) or CuPy (CUDA) view of ``t``'s memory through DLPack, without a copy
    (the library's own intake, :func:`fp4cache._arrays.to_backend`)."""
    return _arrays.to_backend(t.detach(), "cuda" if t.is_cuda else "cpu", name)


class _Step:
    """Where one forward step's new tokens go, shared by every layer of the step.

    ``slots`` holds -1 for the padding tokens (the store skips them); ``rows`` (None:
    every token is real) are the flat indices ``b * q + j`` of the real new tokens, the
    query rows the attention computes.  ``key`` is what the layers of one step share: the
    padding mask object, the positions before the step, the batch shape, the rows'
    lengths before the step (``lens``: those after it).
    """

    __slots__ = ("key", "rows", "slots", "qsl", "seq_lens", "max_q", "lens", "empty")

    def __init__(self, key, rows, slots, qsl, seq_lens, max_q, lens, empty):
        self.key, self.rows, self.slots, self.qsl = key, rows, slots, qsl
        self.seq_lens, self.max_q, self.lens, self.empty = seq_lens, max_q, lens, empty

    def serves(self, new_tokens, positions: int, b: int, q: int, lens: np.ndarray) -> bool:
        mask, p, bq, before = self.key
        return mask is new_tokens and (p, bq) == (positions, (b, q)) and \
            np.array_equal(before, lens)


class FP4CacheLayer(CacheLayerMixin):
    """One model layer's K/V in the NVFP4 pages of a :class:`fp4cache.PagedKVCache`.

    Created by :class:`FP4Cache`, which owns the row-to-page table shared by all layers.
    ``pages`` is the layer's pool (``None`` until allocated); ``positions`` counts the
    positions seen (padding included, what transformers calls the sequence length) and
    ``lens[b]`` the tokens of row ``b`` held in the pages.
    """

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, owner: FP4Cache, layer_idx: int, k_scale: float, v_scale: float):
        super().__init__()
        self._owner = owner
        self.layer_idx = layer_idx
        self.k_scale = float(k_scale)
        self.v_scale = float(v_scale)
        self.pages: PagedKVCache | None = None
        self.positions = 0
        self.lens = np.zeros(owner.max_batch_size, np.int64)
        self.mode: str | None = None  # "fused" or "dequantize" since the last reset

    def __repr__(self) -> str:
        return f"FP4CacheLayer({self.layer_idx}, positions={self.positions})"

    # -- CacheLayerMixin ------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._owner._allocate(key_states.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Hand this step's K/V on (fused attention) or store them and return the whole
        cache dequantized (any other attention implementation)."""
        if self.pages is None:
            self.lazy_initialization(key_states, value_states)
        owner = self._owner
        b, h, q, d = key_states.shape
        owner._check_shapes(b, h, q, d, self.positions)
        mode = "fused" if owner._fused() else "dequantize"
        if self.mode not in (None, mode):
            raise RuntimeError(
                f"FP4Cache layer {self.layer_idx} was filled with {self.mode!r} attention and is "
                f"now read with {mode!r} (the model's attn_implementation changed): call "
                "cache.reset() first")
        self.mode = mode
        if mode == "fused":
            setattr(key_states, _TAG, self)
            return key_states, value_states
        return self._update_dequantize(key_states, value_states)

    def get_mask_sizes(self, query_length: int, *args: Any) -> tuple[int, int]:
        return self.positions + int(query_length), 0

    def get_seq_length(self) -> int:
        return self.positions

    def get_max_length(self) -> int:
        return self._owner.max_cache_len

    def reset(self) -> None:
        self.positions = 0
        self.lens = np.zeros(self._owner.max_batch_size, np.int64)
        self.mode = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("FP4Cache reorders all layers at once: call "
                                  "FP4Cache.reorder_cache")

    def offload(self):
        raise NotImplementedError("FP4Cache does not offload layers to the CPU")

    def prefetch(self):
        raise NotImplementedError("FP4Cache does not offload layers to the CPU")

    # -- the two ways of reading ----------------------------------------------------------
    def _update_dequantize(self, key_states, value_states):
        """Store every new position (padding too: the model's own mask hides it) and
        return all positions so far, dequantized, as (B, H, positions, D)."""
        owner = self._owner
        b, h, q, d = key_states.shape
        p = self.positions
        n = p + q
        t = owner.block_size
        table = owner._table[:b]
        pos = np.broadcast_to(np.arange(p, n), (b, q))
        slots = slot_mapping(table, pos, block_size=t, validate=False).reshape(-1)
        k = key_states.transpose(1, 2).reshape(b * q, h, d)
        v = value_states.transpose(1, 2).reshape(b * q, h, d)
        nb = _arrays.ceil_div(n, t)
        kt, vt = (key_states.new_empty((b, nb * t, h, d)) for _ in range(2))
        after = self.lens.copy()
        after[:b] = n
        moves = owner._window_moves(b, self.lens, after)
        with owner._on_stream():
            if moves is not None:
                self.pages.map_window(*moves, validate=False)
            self.pages.store(owner._index(slots), _array(k, "key_states"),
                             _array(v, "value_states"))
            self.pages.gather_dequant(owner._index(table[:, :nb].reshape(-1)),
                                      out=(_array(kt.view(-1, h, d), "keys"),
                                           _array(vt.view(-1, h, d), "values")))
            if owner.window_pages:
                self._read_window(kt, vt, nb)
        self.positions = n
        self.lens = self.lens.copy()
        self.lens[:b] = n
        return kt[:, :n].transpose(1, 2), vt[:, :n].transpose(1, 2)

    def _read_window(self, kt: torch.Tensor, vt: torch.Tensor, nb: int) -> None:
        """The rows' newest ``window_pages`` pages of ``kt`` / ``vt`` (``(b, nb * T, H,
        D)``, dequantized) replaced by their exact values from the window slots (K back in
        the original basis): what the fused attention reads."""
        owner = self._owner
        b, t = kt.shape[0], owner.block_size
        p0 = max(0, nb - owner.window_pages)
        slots = owner._slot_of(owner._table[:b, p0:nb].reshape(-1))
        w = self.pages.window[owner._index(slots)]  # (b * pages, 2, T, H, D) bf16 bits
        vals = (w.astype(np.uint32) << 16).view(np.float32)
        k, v = vals[:, 0], vals[:, 1]
        if owner.rotation == "hadamard":
            k = formats.hadamard(k)
        shape = (b, (nb - p0) * t) + tuple(kt.shape[2:])
        kt[:, p0 * t:] = torch.from_dlpack(k).reshape(shape).to(kt.device, kt.dtype)
        vt[:, p0 * t:] = torch.from_dlpack(v).reshape(shape).to(vt.device, vt.dtype)

    def attend(self, query, key, value, new_tokens, scaling, sliding_window):
        """Store this step's real K/V tokens and attend from the pages: the output in
        transformers' layout (B, q, Hq, D)."""
        owner = self._owner
        b, hq, q, d = query.shape
        h = key.shape[1]
        if sliding_window is not None and self.positions + q > sliding_window:
            raise NotImplementedError(
                f"sliding-window attention (window {sliding_window}) over {self.positions + q} "
                "positions: fp4cache attends to every cached token")
        step = owner._step(self, b, q, new_tokens)
        if step.rows is None:  # every row is computed
            out = query.new_empty((b * q, hq, d))
        else:  # padding rows stay zero
            out = query.new_zeros((b * q, hq, d))
        if not step.empty:
            qf = query.detach().transpose(1, 2).reshape(b * q, hq, d)
            kf = key.transpose(1, 2).reshape(b * q, h, d)
            vf = value.transpose(1, 2).reshape(b * q, h, d)
            res = out
            if step.rows is not None:
                qf = qf[step.rows]
                res = torch.empty_like(qf)
            moves = owner._window_moves(b, self.lens, step.lens)
            with owner._on_stream():
                if moves is not None:
                    self.pages.map_window(*moves, validate=False)
                self.pages.store(step.slots, _array(kf, "key"), _array(vf, "value"))
                self.pages.attention(_array(qf.contiguous(), "query"), step.qsl,
                                     owner._table_dev(b), step.seq_lens,
                                     max_query_len=step.max_q, causal=True,
                                     sm_scale=float(scaling), out=_array(res, "out"))
            if step.rows is not None:
                out[step.rows] = res
        self.positions += q
        self.lens = step.lens
        return out.view(b, q, hq, d)


class FP4Cache(Cache):
    """A transformers ``Cache`` that keeps every layer's K/V in fp4cache's NVFP4 pages.

    Allocated up front like ``StaticCache``: each layer gets one
    :class:`fp4cache.PagedKVCache` of ``max_batch_size * ceil(max_cache_len /
    block_size)`` pages, row ``b`` of the batch owning pages ``b * P .. (b + 1) * P - 1``
    (``P`` pages per row).  One pool per layer, not one shared by all, because each
    layer has its own global scales (``k_scale`` / ``v_scale``): the keys of one layer
    may be ten times those of another.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        The model's config (``model.config``): layer count, KV heads, head_dim, and the
        attention implementation, which picks how the cache is read (below).  head_dim
        must be a multiple of 16 (e.g. 64, 96 for Phi-3, 128, 256); the fused attention
        on a GPU supports head_dim 64, 128 and 256, the CPU and the dequantizing path
        (any other attention implementation) every multiple of 16.  V scales are stored
        in vLLM's swizzled order where ``head_dim % 64 == 0`` and ``block_size % 4 ==
        0``, else in plain order (``PagedKVCache(swizzle_v_scales=False)``).
    max_batch_size : int
        Rows of the largest batch.
    max_cache_len : int
        Positions per row (prompt, padding included, plus new tokens).
    device : torch.device or str, optional
        Where the pages live (``"cpu"``: fp4cache's NumPy backend; ``"cuda:N"``: its CuPy
        kernels on that GPU).  Default: allocated at the first update, on its tensors'
        device.
    block_size : int, default 16
        Tokens per page.
    layout : {"HND", "NHD"}, default "HND"
        Page layout (vLLM's NVFP4 default is HND).
    scale_rule : {"static6", "4over6"}, default "4over6"
        Block-scale rule of :meth:`fp4cache.PagedKVCache.store`.
    k_scales, v_scales : float or sequence of float, optional
        Global scale of each layer's K and V (one value for all layers, or one per
        layer), e.g. from :func:`calibrate_scales` (recommended, with the same
        ``rotation``).  Default :data:`DEFAULT_SCALE`.
    rotation : {"hadamard", "none"}, optional
        K stored rotated by the normalized Hadamard transform (scores unchanged; NVFP4's
        error on K cut): ``PagedKVCache(rotation=...)``.  Default ``"hadamard"`` when
        head_dim is a power of two, else ``"none"``.
    window_pages : int, optional
        The newest pages of each row kept exact in bf16 as well and read from there by
        the fused attention (``PagedKVCache(window_pages=...)``, one ring of that many
        slots per row; ``docs/window.md``).  Default 3 (0 when ``block_size % 16``,
        which the window needs).  With ``rotation="hadamard"`` the default
        measured within 1 % of float32 K/V perplexity on SmolLM2 (``docs/quality.md``).
        ``0`` and ``rotation="none"``: the plain NVFP4 cache, byte-compatible with vLLM.

    Notes
    -----
    With ``attn_implementation="fp4cache"`` (fused) ``update`` only hands the step's K/V
    to the attention function, which stores the real tokens (never the padding the 2-D
    ``attention_mask`` marks) and attends from the pages; each row's pages hold its
    tokens only, so left-padded batches attend exactly as the prompts one by one.  With
    any other implementation (dequantizing) ``update`` stores every position and returns
    the cache dequantized to the model's dtype; the model's mask hides the padding.  A
    cache is filled and read one way until :meth:`reset`.

    A step whose ``attention_mask`` is given costs one host synchronization on the GPU
    (to find the padding), shared by all layers; without one, none.  Not supported
    (``NotImplementedError``, never a silent wrong result): sliding-window or chunked
    attention past the window, custom 4-D masks and mask functions, attention sinks,
    soft-capping, dropout, gradients, cropping and batch expansion after the prefill.  A
    config whose ``sliding_window`` is shorter than ``max_cache_len`` (sliding layers, or
    a Mistral-style window on every layer) is refused at construction.  Beam search's
    :meth:`reorder_cache` copies pages (``copy_blocks``).

    The exact window is read by the fused attention (decode steps read their newest
    ``window_pages`` pages exact; the rows of a longer step read the newest pages of the
    row after the step exact).  The dequantizing path returns the newest pages exact too,
    so both read the same values; with left padding they differ a little, because the
    dequantizing path's pages hold the padding as well and a padded row's newest pages
    then cover fewer of its tokens.
    """

    def __init__(self, config: Any, max_batch_size: int, max_cache_len: int, *,
                 device: Any = None, block_size: int = 16, layout: str = "HND",
                 scale_rule: str = "4over6", k_scales: float | Sequence[float] | None = None,
                 v_scales: float | Sequence[float] | None = None, rotation: str | None = None,
                 window_pages: int | None = None) -> None:
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") \
            else config
        for name, value in (("max_batch_size", max_batch_size),
                            ("max_cache_len", max_cache_len), ("block_size", block_size)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        layer_types = getattr(text, "layer_types", None) or []
        other = sorted(set(layer_types) - {"full_attention"})
        window = getattr(text, "sliding_window", None)
        if other and not (window is not None and window >= max_cache_len):
            raise NotImplementedError(f"FP4Cache holds full-attention layers only; config has "
                                      f"layer types {other}")
        if not layer_types and window is not None and window < max_cache_len:
            raise NotImplementedError(
                f"the config's attention has a sliding window (sliding_window={window}), "
                f"shorter than max_cache_len={max_cache_len}: FP4Cache attends to every "
                f"cached token, so it holds such a model's positions up to the window only; "
                f"pass max_cache_len <= {window}")
        self.config = config
        self._max_batch_size = int(max_batch_size)
        self._max_cache_len = int(max_cache_len)
        self.block_size = int(block_size)
        self.layout = layout
        self.scale_rule = scale_rule
        self.num_layers = int(text.num_hidden_layers)
        self.num_heads = int(getattr(text, "num_key_value_heads", None)
                             or text.num_attention_heads)
        self.num_query_heads = int(text.num_attention_heads)
        self.head_dim = int(getattr(text, "head_dim", None)
                            or text.hidden_size // text.num_attention_heads)
        if self.head_dim <= 0 or self.head_dim % 16:
            raise ValueError(f"FP4Cache needs a head_dim that is a positive multiple of 16 "
                             f"(NVFP4 scales blocks of 16 values); the config's head_dim is "
                             f"{self.head_dim}")
        ks = self._per_layer(k_scales, "k_scales")
        vs = self._per_layer(v_scales, "v_scales")
        self.pages_per_row = -(-self.max_cache_len // self.block_size)
        if rotation is None:
            d = self.head_dim
            rotation = "hadamard" if d & (d - 1) == 0 and 16 <= d <= 256 else "none"
        if rotation not in ("none", "hadamard"):
            raise ValueError(f"rotation must be 'hadamard' or 'none', got {rotation!r}")
        if window_pages is None:
            window_pages = 0 if self.block_size % 16 else 3
        if (not isinstance(window_pages, (int, np.integer)) or isinstance(window_pages, bool)
                or window_pages < 0):
            raise ValueError(f"window_pages must be a non-negative integer, got "
                             f"{window_pages!r}")
        self.rotation = rotation
        self.window_pages = min(int(window_pages), self.pages_per_row)
        # blocks mapped to their window slot (the same in every layer)
        self._mapped = np.zeros(self.max_batch_size * self.pages_per_row, bool)
        self._moves: tuple | None = None  # (key, blocks, slots) of the last window step
        self._table = np.arange(self.max_batch_size * self.pages_per_row,
                                dtype=np.int64).reshape(self.max_batch_size, -1)
        self.device: torch.device | None = None
        self._dev_tables: dict[int, Any] = {}
        self._streams: dict[int, Any] = {}
        self._last_step: _Step | None = None
        layers = [FP4CacheLayer(self, i, ks[i], vs[i]) for i in range(self.num_layers)]
        super().__init__(layers=layers)
        if device is not None:
            self._allocate(torch.device(device))

    def _per_layer(self, scales, name) -> list[float]:
        if scales is None:
            return [DEFAULT_SCALE] * self.num_layers
        if isinstance(scales, (int, float, np.floating, np.integer)):
            return [float(scales)] * self.num_layers
        scales = [float(s) for s in scales]
        if len(scales) != self.num_layers:
            raise ValueError(f"{name} must hold one scale per layer ({self.num_layers}), got "
                             f"{len(scales)}")
        return scales

    # -- allocation, devices, streams -----------------------------------------------------
    def _allocate(self, device: torch.device) -> None:
        if device.type == "cuda":
            if not torch.cuda.is_available():
                why = "was built without CUDA" if torch.version.cuda is None else "sees no GPU"
                raise RuntimeError(
                    f"FP4Cache on device {str(device)!r}: this PyTorch ({torch.__version__}) "
                    f"{why}; install a CUDA build of PyTorch (https://pytorch.org) and "
                    "fp4cache's CUDA extra (pip install 'fp4cache[cuda12]' or "
                    "'fp4cache[cuda13]'), or pass device='cpu'")
            index = device.index if device.index is not None else torch.cuda.current_device()
            device = torch.device("cuda", index)
            where: Any = f"cuda:{index}"
        elif device.type == "cpu":
            where = "cpu"
        else:
            raise NotImplementedError(f"FP4Cache runs on the CPU or a CUDA GPU, not {device}")
        if self.device is not None:
            if device != self.device:
                raise ValueError(f"FP4Cache lives on {self.device}; got tensors on {device}")
            return
        if device.type == "cuda" and self._fused() and self.head_dim not in ATTN_HEAD_DIMS:
            raise NotImplementedError(
                f"attn_implementation='fp4cache' on a GPU supports head_dim in "
                f"{ATTN_HEAD_DIMS}, the config's head_dim is {self.head_dim}: use "
                "device='cpu', or another attention implementation (e.g. 'sdpa', which "
                "reads this cache dequantized)")
        self.device = device
        for layer in self.layers:
            layer.pages = PagedKVCache(
                self.max_batch_size * self.pages_per_row, self.block_size, self.num_heads,
                self.head_dim, layout=self.layout, scale_rule=self.scale_rule,
                k_scale=layer.k_scale, v_scale=layer.v_scale, device=where,
                max_batch_size=self.max_batch_size, max_seq_len=self.max_cache_len,
                num_query_heads=self.num_query_heads, rotation=self.rotation,
                window_pages=self.window_pages,
                window_slots=self.max_batch_size * self.window_pages,
                swizzle_v_scales=self.head_dim % 64 == 0 and self.block_size % 4 == 0)

    # -- the exact window: a ring of window_pages slots per table row ---------------------
    def _slot_of(self, blocks: np.ndarray) -> np.ndarray:
        """The window slot of each block: a ring of ``window_pages`` slots per table row
        (the pages of a row never share a slot; a block keeps its slot when beam search
        moves table rows)."""
        return ((blocks // self.pages_per_row) * self.window_pages
                + (blocks % self.pages_per_row) % self.window_pages)

    def _window_moves(self, b: int, lens_before: np.ndarray, lens_after: np.ndarray):
        """``(blocks, slots)`` that keep each of the first ``b`` rows' newest
        ``window_pages`` pages mapped after a step from ``lens_before`` to ``lens_after``
        tokens (computed once per step, applied by every layer), or None."""
        if not self.window_pages:
            return None
        key = (b, lens_before[:b].tobytes(), lens_after[:b].tobytes())
        if self._moves is not None and self._moves[0] == key:
            return self._moves[1]
        t, P = self.block_size, self.window_pages
        rows = np.flatnonzero(lens_after[:b] > lens_before[:b])
        tab = self._table[rows]  # (rows, pages_per_row): the rows' blocks
        n = -(-lens_after[rows] // t)[:, None]  # pages in use after the step
        col = np.arange(tab.shape[1])
        want = (col >= n - P) & (col < n)  # the newest P pages of each row
        mapped = self._mapped[tab]
        drop, add = np.sort(tab[mapped & ~want]), np.sort(tab[want & ~mapped])
        moves = None
        if drop.size or add.size:
            blocks = np.concatenate([drop, add]).astype(np.int64)
            slots = np.concatenate([np.full(drop.size, -1, np.int64), self._slot_of(add)])
            moves = (self._index(blocks), self._index(slots))
            self._mapped[drop] = False
            self._mapped[add] = True
        self._moves = (key, moves)
        return moves

    def _unmap_all(self) -> None:
        """Unmap every mapped block in every layer (a reset)."""
        if self._mapped.any():
            blocks = np.flatnonzero(self._mapped).astype(np.int64)
            for layer in self.layers:
                if layer.pages is not None:
                    with self._on_stream():
                        layer.pages.map_window(self._index(blocks),
                                               self._index(np.full(blocks.size, -1)),
                                               validate=False)
        self._mapped[:] = False
        self._moves = None

    def _on_stream(self):
        """PyTorch's current stream as CuPy's (GPU), so the cache's kernels run in order
        with the model's; nothing on the CPU."""
        if self.device is None or self.device.type != "cuda":
            import contextlib

            return contextlib.nullcontext()
        import cupy

        ptr = torch.cuda.current_stream(self.device).cuda_stream
        s = self._streams.get(ptr)
        if s is None:
            s = self._streams[ptr] = cupy.cuda.ExternalStream(ptr, self.device.index)
        return s

    def _index(self, a: np.ndarray):
        """A host index array on the cache's device (CuPy on the GPU)."""
        if self.device is not None and self.device.type == "cuda":
            import cupy

            with cupy.cuda.Device(self.device.index), self._on_stream():
                return cupy.asarray(a)
        return a

    def _table_dev(self, b: int):
        t = self._dev_tables.get(b)
        if t is None:
            t = self._dev_tables[b] = self._index(np.ascontiguousarray(self._table[:b]))
        return t

    def _fused(self) -> bool:
        return getattr(self.config, "_attn_implementation", None) == ATTN_IMPLEMENTATION

    def _check_shapes(self, b, h, q, d, positions) -> None:
        if b > self.max_batch_size:
            raise ValueError(f"batch of {b} rows; this FP4Cache holds max_batch_size="
                             f"{self.max_batch_size}")
        if (h, d) != (self.num_heads, self.head_dim):
            raise ValueError(f"K/V of {h} heads x {d}; the cache holds {self.num_heads} x "
                             f"{self.head_dim}")
        if positions + q > self.max_cache_len:
            raise ValueError(f"{positions} + {q} positions exceed max_cache_len="
                             f"{self.max_cache_len}; nothing was stored")

    # -- one step's plan, shared by the layers --------------------------------------------
    def _step(self, layer: FP4CacheLayer, b: int, q: int, new_tokens) -> _Step:
        last = self._last_step
        if last is not None and last.serves(new_tokens, layer.positions, b, q, layer.lens):
            return last
        lens = layer.lens[:b]
        if new_tokens is not None:
            real = new_tokens.detach().to("cpu", torch.bool).numpy()  # the one sync
            if real.shape != (b, q):
                raise ValueError(f"attention_mask's last {q} columns have shape {real.shape}")
            if real.all():
                real = None
        else:
            real = None
        if real is None:
            rows = None
            counts = np.full(b, q, np.int64)
            pos = lens[:, None] + np.arange(q)
        else:  # a padding token gets position -1: slot -1, which the store skips
            counts = real.sum(axis=1).astype(np.int64)
            pos = np.where(real, lens[:, None] + np.cumsum(real, axis=1) - 1, -1)
            rows = torch.as_tensor(np.flatnonzero(real), device=self.device)
        slots = slot_mapping(self._table[:b], pos, block_size=self.block_size, validate=False)
        new_lens = layer.lens.copy()
        new_lens[:b] = lens + counts
        qsl = np.concatenate([[0], np.cumsum(counts)])
        step = _Step((new_tokens, layer.positions, (b, q), layer.lens), rows,
                     self._index(slots.reshape(-1)), self._index(qsl),
                     self._index(new_lens[:b].copy()), int(counts.max(initial=0)), new_lens,
                     int(counts.sum()) == 0)
        self._last_step = step
        return step

    # -- Cache ----------------------------------------------------------------------------
    @property
    def max_batch_size(self) -> int:
        """Rows of the largest batch the cache holds."""
        return self._max_batch_size

    @property
    def max_cache_len(self) -> int:
        """Positions per row."""
        return self._max_cache_len

    @property
    def block_tables(self) -> np.ndarray:
        """Row ``b``'s pages in order, ``(max_batch_size, pages_per_row)`` int64 (a copy):
        the ``block_tables`` of every layer's :class:`fp4cache.PagedKVCache` calls."""
        return self._table.copy()

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds on its device: the layers' pools (pages, tables,
        workspace) and the row-to-page tables of the batch sizes seen (at most
        ``max_batch_size`` of them)."""
        return (sum(layer.pages.nbytes for layer in self.layers if layer.pages is not None)
                + sum(int(t.nbytes) for t in self._dev_tables.values()))

    def reset(self) -> None:
        """Forget every row (the pages are overwritten by later stores)."""
        self._unmap_all()
        for layer in self.layers:
            layer.reset()
        self._last_step = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``b`` takes the tokens of row ``beam_idx[b]`` (beam search).

        A row picked once keeps its pages (its table row moves); a row picked again gets
        the pages of a row nobody picked, filled by ``copy_blocks``.
        """
        idx = np.asarray(torch.as_tensor(beam_idx).detach().cpu(), dtype=np.int64).reshape(-1)
        b = idx.size
        if b > self.max_batch_size or (idx < 0).any() or (idx >= b).any():
            raise ValueError(f"beam_idx must hold {b} row indices in [0, {b}), got {idx}")
        old = self._table[:b].copy()
        chosen = set(idx.tolist())
        free = [r for r in range(b) if r not in chosen]
        picked: set[int] = set()
        new = np.empty_like(old)
        copies = []  # (source row, free row whose pages receive the copy)
        for r, src in enumerate(idx.tolist()):
            if src not in picked:
                picked.add(src)
                new[r] = old[src]
            else:
                dst = free.pop()
                new[r] = old[dst]
                copies.append((src, dst))
        t = self.block_size
        for layer in self.layers:
            if copies and layer.pages is not None:
                n = [_arrays.ceil_div(int(layer.lens[s]), t) for s, _ in copies]
                src = np.concatenate([old[s, :k] for (s, _), k in zip(copies, n)])
                dst = np.concatenate([old[d, :k] for (_, d), k in zip(copies, n)])
                if src.size:
                    with self._on_stream():
                        layer.pages.copy_blocks(self._index(src), self._index(dst))
            lens = layer.lens.copy()
            lens[:b] = layer.lens[:b][idx]
            layer.lens = lens
        self._table[:b] = new
        self._dev_tables.clear()
        self._last_step = None

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("FP4Cache cannot crop (assisted generation)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("FP4Cache cannot expand its batch after the prefill")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("FP4Cache cannot select batch rows after the prefill")

    def __repr__(self) -> str:
        return (f"FP4Cache({self.num_layers} layers, {self.max_batch_size} x "
                f"{self.max_cache_len} positions, {self.scale_rule}, rotation={self.rotation!r}, "
                f"window_pages={self.window_pages}, device={self.device})")


# -- the attention and mask functions registered with transformers ------------------------
def fp4cache_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                  kv_offset: int = 0, mask_function: Any = None, attention_mask: Any = None,
                  **kwargs: Any):
    """The mask of ``attn_implementation="fp4cache"``: which new tokens are real.

    Returns the last ``q_length`` columns of the 2-D padding mask (``(B, q)`` bool), or
    ``None`` when there is none.  The pattern itself must be causal (every query sees
    the keys from position 0 to its own): a mask function that hides any of those keys
    or shows a later one (sliding windows past their width, chunked or bidirectional
    attention, packed sequences) is ``NotImplementedError``.
    """
    if mask_function is not None:
        _check_causal(mask_function, q_length, kv_length, q_offset, kv_offset)
    if attention_mask is None:
        return None
    if attention_mask.ndim != 2:
        raise NotImplementedError("fp4cache attention takes a 2-D padding mask, not a "
                                  f"{attention_mask.ndim}-D one")
    return attention_mask[:, -q_length:].to(torch.bool)


def _check_causal(mask_function, q_length, kv_length, q_offset, kv_offset) -> None:
    first = int(q_offset)  # FP4CacheLayer.get_seq_length: a host int
    pos = torch.arange(first, first + q_length)
    b = torch.zeros_like(pos)
    zero = torch.zeros_like(pos) + int(kv_offset)
    try:
        sees_first = mask_function(b, b, pos, zero)
        sees_self = mask_function(b, b, pos, pos)
        sees_next = mask_function(b, b, pos, pos + 1)
        ok = bool(torch.as_tensor(sees_first).all()) and bool(torch.as_tensor(sees_self).all()) \
            and not bool(torch.as_tensor(sees_next).any())
    except Exception as e:  # a mask function over device tensors or data
        raise NotImplementedError(f"fp4cache attention supports causal masks only; this "
                                  f"mask function could not be checked ({e})") from e
    if not ok:
        raise NotImplementedError(
            "fp4cache attention supports causal masks only (each query sees positions 0 to "
            "its own): this model's mask function differs (sliding window past its width, "
            "chunked, bidirectional or packed sequences)")


def fp4cache_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, attention_mask: Any, scaling: float | None
                               = None, dropout: float = 0.0, **kwargs: Any):
    """``attn_implementation="fp4cache"``: store the step's K/V in the pages of an
    :class:`FP4Cache` and attend from them.

    ``query`` is ``(B, Hq, q, D)``; ``key`` / ``value`` are the step's ``(B, H, q, D)``
    that :meth:`FP4CacheLayer.update` handed on.  Returns ``(out, None)`` with ``out`` of
    shape ``(B, q, Hq, D)`` (zeros at padding positions), as transformers' attention
    functions do.
    """
    layer = getattr(key, _TAG, None)
    if layer is None:
        raise TypeError("attn_implementation='fp4cache' reads K/V from an fp4cache.hf.FP4Cache:"
                        " pass past_key_values=FP4Cache(model.config, ...) to the model or to "
                        "generate")
    if dropout:
        raise NotImplementedError("fp4cache attention has no dropout (inference only)")
    if torch.is_grad_enabled() and query.requires_grad:
        raise NotImplementedError("fp4cache attention is inference only: run under "
                                  "torch.no_grad()")
    for name in ("s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise NotImplementedError("fp4cache attention has no attention sinks")
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("fp4cache attention has no logit soft-capping")
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                       or attention_mask.ndim != 2):
        raise NotImplementedError("fp4cache attention takes the 2-D padding mask its mask "
                                  "function returns, not a custom mask")
    if scaling is None:
        scaling = 1.0 / math.sqrt(query.shape[-1])
    out = layer.attend(query, key, value, attention_mask, scaling, kwargs.get("sliding_window"))
    return out, None


def calibrate_scales(model: Any, input_ids: torch.Tensor, scale_rule: str = "4over6", *,
                     attention_mask: torch.Tensor | None = None, rotation: str = "hadamard"
                     ) -> tuple[list[float], list[float]]:
    """Per-layer global scales for :class:`FP4Cache` from one forward pass over sample text.

    Runs ``model`` once over ``input_ids`` with a ``DynamicCache`` (attention by
    ``"sdpa"`` for that pass when the model uses ``"fp4cache"``) and applies
    :func:`fp4cache.calibrate_scale` to each layer's cached keys and values (after RoPE,
    what the cache stores; keys rotated first when ``rotation="hadamard"``, as
    :class:`FP4Cache` stores them by default).

    Returns
    -------
    k_scales, v_scales : list of float
        One per layer, for ``FP4Cache(..., k_scales=..., v_scales=...)``.
    """
    cache = DynamicCache()
    impl = getattr(model.config, "_attn_implementation", None)
    switch = impl == ATTN_IMPLEMENTATION
    if switch:
        model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache,
                  use_cache=True)
    finally:
        if switch:
            model.set_attn_implementation(impl)
    ks, vs = [], []
    for layer in cache.layers:
        k, v = layer.keys, layer.values
        if attention_mask is not None:  # padding is not data
            keep = attention_mask.to(torch.bool)[:, None, :, None].to(k.device)
            k, v = k * keep, v * keep
        k = k.float()
        if rotation == "hadamard":
            k = torch.from_numpy(formats.hadamard(k.cpu().numpy()))
        elif rotation != "none":
            raise ValueError(f"rotation must be 'hadamard' or 'none', got {rotation!r}")
        ks.append(calibrate_scale(k, scale_rule))
        vs.append(calibrate_scale(v.float(), scale_rule))
    return ks, vs


AttentionInterface.register(ATTN_IMPLEMENTATION, fp4cache_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, fp4cache_mask)
