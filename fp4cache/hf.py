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

import contextlib
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
from ._device import external_stream
from ._kernels import ATTN_HEAD_DIMS
from .cache import PagedKVCache
from .calibrate import calibrate_scale
from .engine import AttentionPlan, WindowRing
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

#: The attention keyword argument (else attribute of the K tensor) that hands the layer to
#: the attention function.
_KWARG = "fp4cache_layer"


# -- tensors -> the cache's arrays --------------------------------------------------------
def _array(t: torch.Tensor, name: str):
    """A NumPy (CPU) or CuPy (CUDA) view of ``t``'s memory through DLPack, without a copy
    (the library's own intake, :func:`fp4cache._arrays.to_backend`)."""
    return _arrays.to_backend(t.detach(), "cuda" if t.is_cuda else "cpu", name)


class _Step:
    """One forward step of the batch, shared by every layer of the step: which new tokens
    are real (``rows``: their flat indices ``b * q + j``, None when all are), the rows'
    lengths after the step (``lens``), the window moves (device ids or None), and whether
    any token is real.  ``key`` is what the layers of one step share: the padding mask
    object, the positions before the step, the batch shape and the lengths before it."""

    __slots__ = ("key", "rows", "lens", "moves", "empty")

    def __init__(self, key, rows, lens, moves, empty):
        self.key, self.rows, self.lens, self.moves, self.empty = key, rows, lens, moves, empty

    def serves(self, new_tokens, positions: int, b: int, q: int, lens: np.ndarray) -> bool:
        mask, p, bq, before = self.key
        return mask is new_tokens and (p, bq) == (positions, (b, q)) and \
            np.array_equal(before, lens)


class _Rows:
    """What the layers of one :class:`FP4Cache` share, and all they see of it: the rows'
    pages (row ``b`` owns pages ``b * P .. (b + 1) * P - 1`` in every layer's pool, a
    table beam search permutes), the exact window's ring over them
    (:class:`fp4cache.WindowRing`), the step's :class:`fp4cache.AttentionPlan`, the
    device and PyTorch's stream there."""

    def __init__(self, max_batch_size: int, pages_per_row: int, block_size: int,
                 window_pages: int) -> None:
        self.max_batch_size = max_batch_size
        self.pages_per_row = pages_per_row
        self.block_size = block_size
        self.window_pages = window_pages
        self.table = np.arange(max_batch_size * pages_per_row,
                               dtype=np.int64).reshape(max_batch_size, -1)
        self.ring = WindowRing(window_pages, max_batch_size * pages_per_row)
        self.device: torch.device | None = None
        self.plan: AttentionPlan | None = None
        self.last: _Step | None = None
        self._moves: tuple | None = None  # (key, moves) of the last window step
        self._streams: dict[int, Any] = {}

    @property
    def cuda(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    def allocate(self, device: torch.device, max_cache_len: int) -> None:
        self.device = device
        self.plan = AttentionPlan(self.max_batch_size, self.max_batch_size * max_cache_len,
                                  self.pages_per_row,
                                  device=f"cuda:{device.index}" if self.cuda else "cpu")

    def on_stream(self):
        """PyTorch's current stream as CuPy's (GPU), so the cache's own calls (window maps,
        the dequantizing path) run in order with the model's; nothing on the CPU."""
        if not self.cuda:
            return contextlib.nullcontext()

        ptr = torch.cuda.current_stream(self.device).cuda_stream
        s = self._streams.get(ptr)
        if s is None:
            s = self._streams[ptr] = external_stream(ptr, self.device.index)
        return s

    def index(self, a: np.ndarray):
        """A host index array on the cache's device (CuPy on the GPU)."""
        if self.cuda:
            import cupy

            with cupy.cuda.Device(self.device.index), self.on_stream():
                return cupy.asarray(a)
        return a

    def window_moves(self, b: int, lens_before: np.ndarray, lens_after: np.ndarray):
        """The ring's ``(blocks, slots)`` on the device after a step of the first ``b``
        rows from ``lens_before`` to ``lens_after`` tokens (the same for every layer:
        computed once per step), or None."""
        if not self.window_pages:
            return None
        key = (b, lens_before[:b].tobytes(), lens_after[:b].tobytes())
        if self._moves is not None and self._moves[0] == key:
            return self._moves[1]
        # a row's ring is that of the row whose pages it holds (beam search moves whole
        # table rows), so a block keeps its slot when its row moves
        rings = self.table[:b, 0] // self.pages_per_row
        moves = self.ring.step(self.table[:b], rings, lens_before[:b], lens_after[:b],
                               self.block_size)
        if moves is not None:
            moves = (self.index(moves[0]), self.index(moves[1]))
        self._moves = (key, moves)
        return moves

    def forget(self) -> None:
        """Drop the step and the window moves kept for the next layers (a reset)."""
        self.last = None
        self._moves = None

    def slot_of(self, blocks: np.ndarray) -> np.ndarray:
        """The window slot of each block: the ring of the row that owns it."""
        P = self.pages_per_row
        return self.ring.slots(blocks // P, blocks % P)

    def step(self, layer: FP4CacheLayer, b: int, q: int, new_tokens) -> _Step:
        """The step of these new tokens (planned once, shared by the layers)."""
        last = self.last
        if last is not None and last.serves(new_tokens, layer.positions, b, q, layer.lens):
            return last
        lens = layer.lens[:b]
        real = None
        if new_tokens is not None:
            real = new_tokens.detach().to("cpu", torch.bool).numpy()  # the one sync
            if real.shape != (b, q):
                raise ValueError(f"attention_mask's last {q} columns have shape {real.shape}")
            if real.all():
                real = None
        if real is None:
            rows = None
            counts = np.full(b, q, np.int64)
            pos = lens[:, None] + np.arange(q)
        else:  # a padding token gets position -1: slot -1, which the store skips
            counts = real.sum(axis=1).astype(np.int64)
            pos = np.where(real, lens[:, None] + np.cumsum(real, axis=1) - 1, -1)
            rows = torch.as_tensor(np.flatnonzero(real), device=self.device)
        slots = slot_mapping(self.table[:b], pos, block_size=self.block_size, validate=False)
        new_lens = layer.lens.copy()
        new_lens[:b] = lens + counts
        # the plan takes the real tokens only, sequence after sequence
        real_slots = slots.reshape(-1) if rows is None else slots.reshape(-1)[real.reshape(-1)]
        qsl = np.concatenate([[0], np.cumsum(counts)])
        empty = int(counts.sum()) == 0
        if not empty:  # on the model's stream: the last step's launches read the old plan
            with self.on_stream():
                self.plan.plan(qsl, new_lens[:b], self.table[:b], real_slots,
                               max_query_len=int(counts.max(initial=0)))
        step = _Step((new_tokens, layer.positions, (b, q), layer.lens), rows, new_lens,
                     self.window_moves(b, layer.lens, new_lens), empty)
        self.last = step
        return step


class FP4CacheLayer(CacheLayerMixin):
    """One model layer's K/V in the NVFP4 pages of a :class:`fp4cache.PagedKVCache`.

    Created by :class:`FP4Cache`, which owns what the layers share (the rows' page table,
    the exact window's ring, the step's plan).  ``pages`` is the layer's pool (``None``
    until allocated); ``positions`` counts the positions seen (padding included, what
    transformers calls the sequence length) and ``lens[b]`` the tokens of row ``b`` held
    in the pages.
    """

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, owner: FP4Cache, rows: _Rows, layer_idx: int, k_scale: float,
                 v_scale: float):
        super().__init__()
        self._owner = owner  # the Cache: allocation, shape checks, how it is read
        self._rows = rows
        self.layer_idx = layer_idx
        self.k_scale = float(k_scale)
        self.v_scale = float(v_scale)
        self.pages: PagedKVCache | None = None
        self.positions = 0
        self.lens = np.zeros(rows.max_batch_size, np.int64)
        self.mode: str | None = None  # "fused" or "dequantize" since the last reset

    def __repr__(self) -> str:
        return f"FP4CacheLayer({self.layer_idx}, positions={self.positions})"

    # -- CacheLayerMixin ------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._owner.allocate(key_states.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Hand this step's K/V on (fused attention) or store them and return the whole
        cache dequantized (any other attention implementation).

        The fused attention finds this layer in the attention keyword arguments that
        transformers passes to ``Cache.update`` as ``kwargs`` and then to the attention
        function (a tensor attribute where a transformers passes none)."""
        if self.pages is None:
            self.lazy_initialization(key_states, value_states)
        owner = self._owner
        b, h, q, d = key_states.shape
        owner.check_step(b, h, q, d, self.positions)
        mode = "fused" if owner.fused else "dequantize"
        if self.mode not in (None, mode):
            raise RuntimeError(
                f"FP4Cache layer {self.layer_idx} was filled with {self.mode!r} attention and is "
                f"now read with {mode!r} (the model's attn_implementation changed): call "
                "cache.reset() first")
        self.mode = mode
        if mode == "fused":
            attn_kwargs = kwargs.get("kwargs")
            if isinstance(attn_kwargs, dict):
                attn_kwargs[_KWARG] = self
            else:
                setattr(key_states, _KWARG, self)
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
        self.lens = np.zeros(self._rows.max_batch_size, np.int64)
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
        rows = self._rows
        b, h, q, d = key_states.shape
        p = self.positions
        n = p + q
        t = rows.block_size
        table = rows.table[:b]
        pos = np.broadcast_to(np.arange(p, n), (b, q))
        slots = slot_mapping(table, pos, block_size=t, validate=False).reshape(-1)
        k = key_states.transpose(1, 2).reshape(b * q, h, d)
        v = value_states.transpose(1, 2).reshape(b * q, h, d)
        nb = _arrays.ceil_div(n, t)
        kt, vt = (key_states.new_empty((b, nb * t, h, d)) for _ in range(2))
        after = self.lens.copy()
        after[:b] = n
        moves = rows.window_moves(b, self.lens, after)
        with rows.on_stream():
            if moves is not None:
                self.pages.map_window(*moves, validate=False)
            self.pages.store(rows.index(slots), _array(k, "key_states"),
                             _array(v, "value_states"))
            self.pages.gather_dequant(rows.index(table[:, :nb].reshape(-1)),
                                      out=(_array(kt.view(-1, h, d), "keys"),
                                           _array(vt.view(-1, h, d), "values")))
            if rows.window_pages:
                self._read_window(kt, vt, nb)
        if self._owner.reads_own_kv(q):  # the pass's own positions as computed
            kt[:, p:n] = key_states.transpose(1, 2)
            vt[:, p:n] = value_states.transpose(1, 2)
        self.positions = n
        self.lens = self.lens.copy()
        self.lens[:b] = n
        return kt[:, :n].transpose(1, 2), vt[:, :n].transpose(1, 2)

    def _read_window(self, kt: torch.Tensor, vt: torch.Tensor, nb: int) -> None:
        """The rows' newest ``window_pages`` pages of ``kt`` / ``vt`` (``(b, nb * T, H,
        D)``, dequantized) replaced by their exact values from the window slots (K back in
        the original basis): what the fused attention reads."""
        rows = self._rows
        b, t = kt.shape[0], rows.block_size
        p0 = max(0, nb - rows.window_pages)
        slots = rows.slot_of(rows.table[:b, p0:nb].reshape(-1))
        w = self.pages.window[rows.index(slots)]  # (b * pages, 2, T, H, D) bf16 bits
        vals = (w.astype(np.uint32) << 16).view(np.float32)
        k, v = vals[:, 0], vals[:, 1]
        if self.pages.rotation == "hadamard":
            k = formats.hadamard(k)
        shape = (b, (nb - p0) * t) + tuple(kt.shape[2:])
        kt[:, p0 * t:] = torch.from_dlpack(k).reshape(shape).to(kt.device, kt.dtype)
        vt[:, p0 * t:] = torch.from_dlpack(v).reshape(shape).to(vt.device, vt.dtype)

    def attend(self, query, key, value, new_tokens, scaling, sliding_window):
        """Store this step's real K/V tokens and attend from the pages: the output in
        transformers' layout (B, q, Hq, D)."""
        rows = self._rows
        b, hq, q, d = query.shape
        h = key.shape[1]
        if sliding_window is not None and self.positions + q > sliding_window:
            raise NotImplementedError(
                f"sliding-window attention (window {sliding_window}) over {self.positions + q} "
                "positions: fp4cache attends to every cached token")
        step = rows.step(self, b, q, new_tokens)
        if step.rows is None:  # every row is computed
            out = query.new_empty((b * q, hq, d))
        else:  # padding rows stay zero
            out = query.new_zeros((b * q, hq, d))
        if not step.empty:
            qf = query.detach().transpose(1, 2).reshape(b * q, hq, d)
            kf = key.detach().transpose(1, 2).reshape(b * q, h, d)
            vf = value.detach().transpose(1, 2).reshape(b * q, h, d)
            res = out
            if step.rows is not None:
                qf, kf, vf = qf[step.rows], kf[step.rows], vf[step.rows]
                res = torch.empty_like(qf)
            if step.moves is not None:
                with rows.on_stream():
                    self.pages.map_window(*step.moves, validate=False)
            rows.plan.run(self.pages, qf.contiguous(), kf, vf, out=res,
                          sm_scale=float(scaling), exact_new=self._owner.reads_own_kv(q))
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
        which the window needs).  ``0`` and ``rotation="none"``: the plain NVFP4 cache,
        byte-compatible with vLLM.
    exact_prompt : bool, default True
        The queries of a forward pass of more than one token (a prompt, a chunk) read
        that pass's own K/V exactly (the tensors the model just computed, in its dtype)
        and the earlier tokens through the NVFP4 pages (and the exact window); the pages
        are written as always, so later steps read those tokens from there
        (:meth:`fp4cache.PagedKVCache.attention`'s ``new_kv``).  A one-pass forward of a
        prompt is then the model's attention over its own K/V; a decode step (one token)
        reads its token from the window.  The fused attention reads them so, and the
        dequantizing path returns them in place of the pass's positions.  On the GPU
        such a pass runs in the mma.sync any-length kernel (not sm_90's wgmma one).
        ``False``: every key through the pages.  The defaults measured on SmolLM2:
        ``docs/quality.md``.

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
                 window_pages: int | None = None, exact_prompt: bool = True) -> None:
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
            rotation = "hadamard" if formats.rotation_supported(d) else "none"
        if rotation not in ("none", "hadamard"):
            raise ValueError(f"rotation must be 'hadamard' or 'none', got {rotation!r}")
        if window_pages is None:
            window_pages = 0 if self.block_size % 16 else 3
        if (not isinstance(window_pages, (int, np.integer)) or isinstance(window_pages, bool)
                or window_pages < 0):
            raise ValueError(f"window_pages must be a non-negative integer, got "
                             f"{window_pages!r}")
        self.exact_prompt = _arrays.check_bool(exact_prompt, "exact_prompt")
        self.rotation = rotation
        self.window_pages = min(int(window_pages), self.pages_per_row)
        self._rows = _Rows(self.max_batch_size, self.pages_per_row, self.block_size,
                           self.window_pages)
        layers = [FP4CacheLayer(self, self._rows, i, ks[i], vs[i])
                  for i in range(self.num_layers)]
        super().__init__(layers=layers)
        if device is not None:
            self.allocate(torch.device(device))

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

    # -- allocation, devices, what the layers ask ----------------------------------------
    @property
    def device(self) -> torch.device | None:
        """Where the pages live (None until allocated)."""
        return self._rows.device

    def allocate(self, device: torch.device) -> None:
        """Allocate every layer's pages on ``device`` (done by the first update; once)."""
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
        if device.type == "cuda" and self.fused and self.head_dim not in ATTN_HEAD_DIMS:
            raise NotImplementedError(
                f"attn_implementation='fp4cache' on a GPU supports head_dim in "
                f"{ATTN_HEAD_DIMS}, the config's head_dim is {self.head_dim}: use "
                "device='cpu', or another attention implementation (e.g. 'sdpa', which "
                "reads this cache dequantized)")
        self._rows.allocate(device, self.max_cache_len)
        # the layers attend one after another on one stream: the first layer's attention
        # workspace, reserved for the cache's limits, serves them all
        hints = {"max_batch_size": self.max_batch_size, "max_seq_len": self.max_cache_len,
                 "num_query_heads": self.num_query_heads}
        first = None
        for layer in self.layers:
            layer.pages = PagedKVCache(
                self.max_batch_size * self.pages_per_row, self.block_size, self.num_heads,
                self.head_dim, layout=self.layout, scale_rule=self.scale_rule,
                k_scale=layer.k_scale, v_scale=layer.v_scale, device=where,
                rotation=self.rotation, window_pages=self.window_pages,
                window_slots=self.max_batch_size * self.window_pages,
                swizzle_v_scales=self.head_dim % 64 == 0 and self.block_size % 4 == 0,
                **(hints if first is None else {}))
            if first is None:
                first = layer.pages
            else:
                layer.pages.share_workspace(first)

    def reads_own_kv(self, q: int) -> bool:
        """Whether a pass of ``q`` tokens reads its own K/V exactly (``exact_prompt``: a
        pass of more than one token)."""
        return self.exact_prompt and q > 1

    @property
    def fused(self) -> bool:
        """Whether the model attends with ``attn_implementation="fp4cache"`` (read from
        the pages), else the cache is read dequantized."""
        impl = getattr(self.config, "_attn_implementation", None)
        return impl == ATTN_IMPLEMENTATION

    def check_step(self, b: int, h: int, q: int, d: int, positions: int) -> None:
        """Refuse a step of ``b`` rows of ``q`` tokens of ``h`` heads x ``d`` after
        ``positions`` positions that this cache cannot hold; nothing is stored."""
        if b > self.max_batch_size:
            raise ValueError(f"batch of {b} rows; this FP4Cache holds max_batch_size="
                             f"{self.max_batch_size}")
        if (h, d) != (self.num_heads, self.head_dim):
            raise ValueError(f"K/V of {h} heads x {d}; the cache holds {self.num_heads} x "
                             f"{self.head_dim}")
        if positions + q > self.max_cache_len:
            raise ValueError(f"{positions} + {q} positions exceed max_cache_len="
                             f"{self.max_cache_len}; nothing was stored")

    def window_moves(self, b: int, lens_before: np.ndarray, lens_after: np.ndarray):
        """The exact window's ``(blocks, slots)`` (arrays on the cache's device; slot -1
        unmaps) that keep each of the first ``b`` rows' newest ``window_pages`` pages
        mapped after a step from ``lens_before`` to ``lens_after`` tokens, or None: what
        every layer's :meth:`fp4cache.PagedKVCache.map_window` applies before its store
        (the ring remembers them as mapped)."""
        return self._rows.window_moves(b, np.asarray(lens_before, np.int64),
                                       np.asarray(lens_after, np.int64))

    def _unmap_all(self) -> None:
        """Unmap every mapped block in every layer (a reset)."""
        rows = self._rows
        blocks = rows.ring.unmap_all()
        if blocks.size:
            for layer in self.layers:
                if layer.pages is not None:
                    with rows.on_stream():
                        layer.pages.map_window(rows.index(blocks),
                                               rows.index(np.full(blocks.size, -1)),
                                               validate=False)
        rows.forget()

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
        return self._rows.table.copy()

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds on its device: the layers' pools (pages, tables,
        workspace) and the step plan's metadata buffers."""
        plan = self._rows.plan
        return (sum(layer.pages.nbytes for layer in self.layers if layer.pages is not None)
                + (0 if plan is None else plan.nbytes))

    def reset(self) -> None:
        """Forget every row (the pages are overwritten by later stores)."""
        self._unmap_all()
        for layer in self.layers:
            layer.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``b`` takes the tokens of row ``beam_idx[b]`` (beam search).

        A row picked once keeps its pages (its table row moves); a row picked again gets
        the pages of a row nobody picked, filled by ``copy_blocks``.
        """
        idx = np.asarray(torch.as_tensor(beam_idx).detach().cpu(), dtype=np.int64).reshape(-1)
        b = idx.size
        if b > self.max_batch_size or (idx < 0).any() or (idx >= b).any():
            raise ValueError(f"beam_idx must hold {b} row indices in [0, {b}), got {idx}")
        rows = self._rows
        old = rows.table[:b].copy()
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
                    with rows.on_stream():
                        layer.pages.copy_blocks(rows.index(src), rows.index(dst))
            lens = layer.lens.copy()
            lens[:b] = layer.lens[:b][idx]
            layer.lens = lens
        rows.table[:b] = new
        rows.forget()

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
    layer = kwargs.pop(_KWARG, None) or getattr(key, _KWARG, None)
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
