"""fp4cache as a vLLM attention backend: vLLM serves from NVFP4 pages on sm_80 and later.

vLLM (0.25) sizes and allocates an ``nvfp4`` KV cache itself, one uint8 tensor per layer of
shape ``(num_blocks, 2, block_size, num_kv_heads, head_size // 2 + head_size // 16)``:
each page is ``[K data | K scales | V data | V scales]``, the bytes vLLM's own
``reshape_and_cache`` writes for ``kv_cache_dtype="nvfp4"`` (on SM100 only: vLLM 0.25 has
no SM90 or SM80 kernel to write or read them).  This backend stores into and
attends from that memory with fp4cache's kernels:

- :class:`FP4CacheMetadataBuilder` turns vLLM's ``CommonAttentionMetadata`` into one
  :class:`fp4cache.AttentionPlan` per step (its buffers persistent, the copies
  asynchronous on the current stream);
- :class:`FP4CacheImpl` wraps each layer's tensor as a :class:`fp4cache.PagedKVCache`
  over vLLM's memory (``buffer=``, no copy) and runs the plan on it: the step's K/V stored
  by ``slot_mapping``, attention over the pages for every kind of batch vLLM builds
  (decode, speculative verification, chunked prefill, mixed).

A step with more than one query token per sequence somewhere (a prompt, a chunk, a
verification) attends with the exact new tokens (``AttentionPlan.run(...,
exact_new=True)``): its queries read the K/V vLLM hands over for that step as computed and
only the earlier tokens through the pages, so a prompt's attention loses nothing to NVFP4.
``FP4CACHE_EXACT_PROMPT=0`` in the environment turns that off (every key through the
pages, the sm_90 wgmma kernel for long chunks); decode-only steps never use it.

The page bytes are vLLM's, so pages can move between this backend and vLLM's own: the K
and V data and scales in vLLM's order for the configured KV layout (``NHD`` or ``HND``,
``VLLM_KV_CACHE_LAYOUT``), V scales in the swizzled order vLLM's writer uses, the global
scales ``layer._k_scale`` / ``layer._v_scale`` as dequantization multipliers.

Use it with the ``vllm`` extra installed (its entry point registers the backend in every
vLLM process)::

    vllm serve MODEL --kv-cache-dtype nvfp4 --attention-backend CUSTOM
    LLM(MODEL, kv_cache_dtype="nvfp4", attention_config={"backend": "CUSTOM"})

What the kernels do not do is refused when vLLM builds the model, naming the feature:
sliding windows, attention sinks, logit soft-capping, ALiBi, shared KV layers, encoder and
cross attention, MLA, fused output quantization.  PyTorch and vLLM are imported here only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar

try:
    import torch
    from vllm.config import get_current_vllm_config
    from vllm.v1.attention.backend import (
        AttentionBackend,
        AttentionCGSupport,
        AttentionImpl,
        AttentionMetadataBuilder,
        AttentionType,
        CommonAttentionMetadata,
        MultipleOf,
    )
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.attention.backends.utils import get_kv_cache_layout
except ImportError as e:
    raise ImportError(f"fp4cache.vllm needs vLLM ({e}): pip install 'fp4cache[vllm]' (in a "
                      "checkout: pip install -e \".[vllm]\")") from None

from . import AttentionPlan, PagedKVCache, PageGeometry
from ._kernels import ATTN_HEAD_DIMS  # the head sizes the attention kernels are built for

__all__ = ["BACKEND_PATH", "FP4CacheBackend", "FP4CacheImpl", "FP4CacheMetadata",
           "FP4CacheMetadataBuilder", "LayerGroup", "register"]

#: What ``register`` hands vLLM's registry (an importable path: every process resolves it).
BACKEND_PATH = "fp4cache.vllm.FP4CacheBackend"
_NAME = "fp4cache's vLLM backend"


def register() -> None:
    """Register :class:`FP4CacheBackend` as vLLM's ``CUSTOM`` attention backend.

    The ``vllm.general_plugins`` entry point of the ``vllm`` extra calls it in every vLLM
    process (the API server, the engine core, each worker); calling it again is harmless.
    """
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)


class FP4CacheBackend(AttentionBackend):
    """fp4cache's NVFP4 pages as vLLM's ``CUSTOM`` attention backend (decoder attention,
    ``kv_cache_dtype="nvfp4"``)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["nvfp4"]
    # one call stores the step's K/V and attends (AttentionPlan.run)
    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # vLLM looks the name up in AttentionBackendEnum

    @staticmethod
    def get_impl_cls() -> type[FP4CacheImpl]:
        return FP4CacheImpl

    @staticmethod
    def get_builder_cls() -> type[FP4CacheMetadataBuilder]:
        return FP4CacheMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(ATTN_HEAD_DIMS)

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return capability is not None and (capability.major, capability.minor) >= (8, 0)

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]:
        if cache_dtype_str != "nvfp4":
            raise ValueError(f"{_NAME} keeps NVFP4 pages: start vLLM with "
                             f"kv_cache_dtype='nvfp4', got {cache_dtype_str!r}")
        # a (token, head) row of one side: D/2 bytes of E2M1 pairs and D/16 E4M3 scales
        row = PageGeometry(num_kv_heads, block_size, head_size).bytes_per_row
        return (num_blocks, 2, block_size, num_kv_heads, row)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False
                                  ) -> tuple[int, ...]:
        # the physical order of the logical (blocks, 2, block_size, heads, bytes) shape
        if include_num_layers_dimension:
            # each layer's pages must be one contiguous run of memory (no block stride);
            # vLLM then keeps the layers apart
            raise NotImplementedError(f"{_NAME} keeps each layer's pages contiguous")
        return (0, 1, 2, 3, 4) if get_kv_cache_layout() == "NHD" else (0, 1, 3, 2, 4)


class LayerGroup:
    """What the layers of one KV-cache group share besides the plan: the first layer's
    cache, whose attention workspace the others use (the layers run one after another on
    one stream, so one split-KV workspace serves them all, not one per layer)."""

    __slots__ = ("first",)

    def __init__(self) -> None:
        self.first: PagedKVCache | None = None


@dataclass
class FP4CacheMetadata:
    """One step's attention metadata: the planned step every layer runs."""

    plan: AttentionPlan
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    layers: LayerGroup | None = None


class FP4CacheMetadataBuilder(AttentionMetadataBuilder[FP4CacheMetadata]):
    """Plans each step once (``build``) into one :class:`fp4cache.AttentionPlan`, sized
    from vLLM's limits (``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``)
    and grown only if a step exceeds them."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = int(kv_cache_spec.block_size)
        sched = vllm_config.scheduler_config
        max_len = _max_model_len(vllm_config)
        self._limits = (int(sched.max_num_seqs), int(sched.max_num_batched_tokens),
                        1 if max_len is None else -(-max_len // self.block_size))
        self._device = _fp4cache_device(device)
        self.plan: AttentionPlan | None = None
        self.layers = LayerGroup()

    def _plan_for(self, batch: int, tokens: int, width: int) -> AttentionPlan:
        plan = self.plan
        if plan is None or batch > plan.max_batch_size or tokens > plan.max_num_tokens \
                or width > plan.max_blocks_per_seq:
            b, n, w = self._limits
            if plan is not None:
                if self._cudagraph_support != AttentionCGSupport.NEVER:
                    # a captured step reads the first plan's buffers: never swap them
                    raise RuntimeError(
                        f"{_NAME}: a step of {batch} sequences, {tokens} tokens and "
                        f"{width} block-table columns exceeds the plan made for "
                        f"max_batch_size={plan.max_batch_size}, max_num_tokens="
                        f"{plan.max_num_tokens}, max_blocks_per_seq="
                        f"{plan.max_blocks_per_seq}, which CUDA graphs may have captured")
                b, n, w = (max(b, plan.max_batch_size), max(n, plan.max_num_tokens),
                           max(w, plan.max_blocks_per_seq))
            plan = self.plan = AttentionPlan(max(b, batch), max(n, tokens, 1), max(w, width),
                                             device=self._device)
        return plan

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> FP4CacheMetadata:
        m = common_attn_metadata
        if m.causal is not True:  # a per-request tensor: encoder attention
            raise NotImplementedError(f"{_NAME} runs causal decoder attention only")
        B, n = int(m.num_reqs), int(m.num_actual_tokens)
        tables = m.block_table_tensor[:B]
        plan = self._plan_for(B, n, int(tables.shape[1]))
        plan.plan(m.query_start_loc[:B + 1], m.seq_lens[:B], tables, m.slot_mapping[:n],
                  max_query_len=int(m.max_query_len))
        return FP4CacheMetadata(plan, n, int(m.max_query_len), int(m.max_seq_len),
                                self.layers)


class FP4CacheImpl(AttentionImpl[FP4CacheMetadata]):
    """One attention layer: stores the step's K/V into the layer's NVFP4 pages and attends
    from them (vLLM's memory, wrapped once as a :class:`fp4cache.PagedKVCache`)."""

    def __init__(self, num_heads: int, head_size: int, scale: float,
                 num_kv_heads: int | None = None, alibi_slopes: list[float] | None = None,
                 sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None, **extra: Any) -> None:
        refused = {
            "alibi_slopes (ALiBi)": alibi_slopes is not None,
            "sliding_window": sliding_window is not None,
            "logits_soft_cap": bool(logits_soft_cap),
            "sinks (attention sinks)": sinks is not None,
            "kv_sharing_target_layer_name (shared KV layers)":
                kv_sharing_target_layer_name is not None,
            f"attn_type={attn_type!r} (decoder attention only)":
                attn_type != AttentionType.DECODER,
        }
        refused.update({f"{k}={v!r}": True for k, v in extra.items()
                        if v not in (None, False, -1)})
        bad = [name for name, on in refused.items() if on]
        if bad:
            raise NotImplementedError(f"{_NAME} does not support {', '.join(bad)}")
        if kv_cache_dtype != "nvfp4":
            raise ValueError(f"{_NAME} keeps NVFP4 pages: start vLLM with "
                             f"kv_cache_dtype='nvfp4', got {kv_cache_dtype!r}")
        if head_size not in ATTN_HEAD_DIMS:
            raise ValueError(f"{_NAME} supports head_size in {ATTN_HEAD_DIMS}, got {head_size}")
        self.num_heads = int(num_heads)
        self.head_size = int(head_size)
        self.scale = float(scale)
        self.num_kv_heads = int(num_kv_heads or num_heads)
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = None
        config = get_current_vllm_config()
        self._workspace_hints = {"max_batch_size": int(config.scheduler_config.max_num_seqs),
                                 "max_seq_len": _max_model_len(config),
                                 "num_query_heads": self.num_heads}
        self._layout = get_kv_cache_layout()
        self._pages: tuple[tuple, PagedKVCache] | None = None
        self.exact_prompt = _exact_prompt_setting()

    def pages(self, layer, kv_cache: torch.Tensor,
              layers: LayerGroup | None = None) -> PagedKVCache:
        """This layer's pages: vLLM's ``kv_cache`` tensor as a :class:`PagedKVCache`
        (made at the first call with vLLM's memory, and again only if that moves or the
        layer's global scales change: ``calculate_kv_scales`` sets them at the first step,
        and vLLM's own kernels read the current ones too).  Within ``layers`` the first
        cache reserves the attention workspace for vLLM's limits and the others share
        it."""
        key = (kv_cache.data_ptr(), layer._k_scale_float, layer._v_scale_float)
        if self._pages is None or self._pages[0] != key:
            if self._layout == "NHD":
                physical = kv_cache
            else:  # (blocks, 2, heads, block_size, bytes) in memory
                physical = kv_cache.permute(0, 1, 3, 2, 4)
            block_size = int(kv_cache.shape[2])
            first = None if layers is None else layers.first
            hints = self._workspace_hints if first is None else {}
            cache = PagedKVCache(
                None, block_size, self.num_kv_heads, self.head_size, layout=self._layout,
                swizzle_v_scales=True,  # vLLM's nvfp4 order: V scales swizzled, K linear
                k_scale=float(layer._k_scale_float), v_scale=float(layer._v_scale_float),
                device=_fp4cache_device(kv_cache.device), buffer=physical, **hints)
            if first is not None:
                cache.share_workspace(first)
            elif layers is not None:
                layers.first = cache
            self._pages = (key, cache)
        return self._pages[1]

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: FP4CacheMetadata | None,
                output: torch.Tensor | None = None, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Store the step's ``key`` / ``value`` at the planned slots and write attention of
        ``query`` over the layer's pages into ``output`` (``[num_tokens, num_heads,
        head_size]``; rows past ``num_actual_tokens`` are vLLM's padding, left as they
        are)."""
        if output is None:
            raise ValueError(f"{_NAME} writes into vLLM's output buffer: output is None")
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(f"{_NAME} does not fuse output quantization")
        if attn_metadata is None:  # vLLM's memory-profiling run: no pages, no plan
            return output.fill_(0)
        n = attn_metadata.num_actual_tokens
        pages = self.pages(layer, kv_cache, attn_metadata.layers)
        # q is read in place: a view of vLLM's fused projection is copied
        attn_metadata.plan.run(pages, query[:n].contiguous(), key[:n], value[:n],
                               out=output[:n], sm_scale=self.scale,
                               exact_new=self.exact_prompt and attn_metadata.max_query_len > 1)
        return output


def _exact_prompt_setting() -> bool:
    """``FP4CACHE_EXACT_PROMPT`` from the environment: "1" (the default) or "0"."""
    value = os.environ.get("FP4CACHE_EXACT_PROMPT", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"FP4CACHE_EXACT_PROMPT must be 0 or 1, got {value!r}")
    return value == "1"


def _max_model_len(vllm_config) -> int | None:
    """The model's context limit (None for a configuration without a model)."""
    model = getattr(vllm_config, "model_config", None)
    return None if model is None else int(model.max_model_len)


def _fp4cache_device(device) -> str:
    """A torch device as fp4cache names it: ``"cpu"`` or ``"cuda:N"``."""
    device = torch.device(device)
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        raise ValueError(f"{_NAME} runs on CUDA GPUs (or the CPU backend), got {device}")
    return f"cuda:{torch.cuda.current_device() if device.index is None else device.index}"
