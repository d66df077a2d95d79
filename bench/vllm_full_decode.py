"""The experiment ``vllm_bench.py --full-decode-graphs``: fp4cache's vLLM backend with a
builder that declares full CUDA graphs for uniform single-token decode steps (vLLM
resolves a backend by its module path, so the classes live at a module's top level)."""

from __future__ import annotations

from vllm.v1.attention.backend import AttentionCGSupport

import fp4cache.vllm as fv


class FullDecodeBuilder(fv.FP4CacheMetadataBuilder):
    _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE


class FullDecodeBackend(fv.FP4CacheBackend):
    @staticmethod
    def get_builder_cls() -> type[FullDecodeBuilder]:
        return FullDecodeBuilder
