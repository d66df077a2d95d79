"""fp4cache: an NVFP4 KV cache for LLM attention on any CuPy GPU, bit-exact on NumPy.

NVFP4 stores each value as a 4-bit E2M1 code, with one E4M3 scale per 16 values and a
float32 global scale: 72 bytes per (token, head) for ``head_dim=128`` instead of 256 in
bfloat16.  The byte layouts match vLLM's ``reshape_and_cache_nvfp4`` (paged cache) and
LongLive's ``dequantize_kv_cache_fp4`` (blocked cache).

Main entry points: :class:`PagedKVCache`, :class:`AttentionPlan` (the engine-facing
plan / run API), :func:`quantize`, :func:`dequantize`,
:func:`calibrate_scale` and the :mod:`fp4cache.longlive` module.
"""

from . import formats, layout, longlive
from ._arrays import gpu_available
from ._device import pinned_empty
from .cache import PagedKVCache
from .calibrate import calibrate_scale
from .codec import dequantize, quantize
from .engine import AttentionPlan, WindowRing
from .formats import hadamard
from .layout import PageGeometry, slot_mapping

__version__ = "0.1.0"

__all__ = [
    "PagedKVCache",
    "AttentionPlan",
    "WindowRing",
    "PageGeometry",
    "quantize",
    "dequantize",
    "calibrate_scale",
    "hadamard",
    "gpu_available",
    "slot_mapping",
    "pinned_empty",
    "formats",
    "layout",
    "longlive",
    "__version__",
]
