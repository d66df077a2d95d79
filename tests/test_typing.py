"""Public signatures are typed: return types everywhere, no ``Any`` for array arguments
(``fp4cache.typing.ArrayLike`` and friends instead), and every annotation resolves."""

from __future__ import annotations

import importlib
import inspect
import types

import numpy as np
import pytest
from conftest import resolve_qualname

import fp4cache
from fp4cache import typing as fp4_typing

PUBLIC = [
    "fp4cache.quantize", "fp4cache.dequantize", "fp4cache.calibrate_scale",
    "fp4cache.gpu_available",
    "fp4cache.PagedKVCache.__init__", "fp4cache.PagedKVCache.store",
    "fp4cache.PagedKVCache.gather_dequant", "fp4cache.PagedKVCache.decode_attention",
    "fp4cache.PagedKVCache.check", "fp4cache.PagedKVCache.reset_counters",
    "fp4cache.PagedKVCache.attention", "fp4cache.PagedKVCache.page_format",
    "fp4cache.PagedKVCache.copy_blocks", "fp4cache.PagedKVCache.read_blocks",
    "fp4cache.PagedKVCache.write_blocks", "fp4cache.PagedKVCache.save",
    "fp4cache.PagedKVCache.load", "fp4cache.PagedKVCache.load_pages",
    "fp4cache.attention.decode_attention", "fp4cache.attention.attention",
    "fp4cache.longlive.quantize_block", "fp4cache.longlive.dequantize",
    "fp4cache.longlive.dequantize_pool", "fp4cache.longlive.inverse_global_denominator",
    "fp4cache.longlive.LongLiveBlock.__new__",
    "fp4cache.layout.swizzle_scale_index", "fp4cache.layout.blocked_scale_offset",
    "fp4cache.layout.PageGeometry.data_offset", "fp4cache.layout.PageGeometry.scale_offset",
    "fp4cache._backend.backend",
]


@pytest.mark.parametrize("qualname", PUBLIC)
def test_public_function_is_typed(qualname):
    fn = resolve_qualname(qualname)
    ann = fn.__annotations__
    assert "return" in ann, f"{qualname} has no return annotation"
    untyped = [n for n in inspect.signature(fn).parameters if n not in ("self", "cls")
               and n not in ann]
    assert not untyped, f"{qualname}: parameters without annotation {untyped}"
    loose = [n for n, a in ann.items() if "Any" in str(a)]
    assert not loose, f"{qualname}: {loose} annotated Any (use fp4cache.typing's aliases)"
    # Every annotation evaluates (no typo, no missing import); CuPy is only named in
    # fp4cache.typing's forward references, so a stand-in module resolves it here, and
    # PagedKVCache is imported by attention.py for type checkers only.
    mod = importlib.import_module(fn.__module__)
    env = {**vars(mod), "cupy": types.SimpleNamespace(ndarray=type("ndarray", (), {})),
           "PagedKVCache": fp4cache.PagedKVCache}
    for a in ann.values():
        if isinstance(a, str):
            eval(a, env)  # our own annotation strings


def test_array_like_names_what_fp4cache_takes():
    assert isinstance(np.zeros(3), fp4_typing.SupportsDLPack)
    assert not isinstance([1, 2], fp4_typing.SupportsDLPack)
    assert np.ndarray in fp4_typing.ArrayLike.__args__
    assert fp4_typing.SupportsDLPack in fp4_typing.ArrayLike.__args__
    assert np.ndarray in fp4_typing.Array.__args__
    # the aliases are importable where a user would look for them
    assert fp4cache.typing is fp4_typing
