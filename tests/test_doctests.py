"""The ``Examples`` sections of the public docstrings, run with :mod:`doctest`.

Every example builds its arrays with NumPy and, where it makes a cache, passes
``device="cpu"``, so they are deterministic and run the same with or without a GPU.
"""

from __future__ import annotations

import doctest
import importlib

import pytest
from conftest import resolve_qualname

MODULES = ["fp4cache.calibrate", "fp4cache.codec", "fp4cache.cache", "fp4cache.engine",
           "fp4cache.longlive",
           "fp4cache._plans", "fp4cache.layout", "fp4cache._device",
           "fp4cache.typing"]
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _tests(name: str):
    mod = importlib.import_module(name)
    return [t for t in doctest.DocTestFinder().find(mod) if t.examples]


@pytest.mark.parametrize("name", MODULES)
def test_module_examples(name):
    tests = _tests(name)
    assert tests, f"{name} has no doctest examples"
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    for t in tests:
        runner.run(t)
    res = runner.summarize(verbose=False)
    assert res.failed == 0, f"{res.failed} example(s) failed in {name} (see the output)"


@pytest.mark.parametrize("qualname", [
    "fp4cache.calibrate.calibrate_scale",
    "fp4cache.codec.quantize",
    "fp4cache.codec.dequantize",
    "fp4cache.cache.PagedKVCache",
    "fp4cache.cache.PagedKVCache.store",
    "fp4cache.cache.PagedKVCache.gather_dequant",
    "fp4cache.cache.PagedKVCache.check",
    "fp4cache.cache.PagedKVCache.reset_counters",
    "fp4cache.engine.AttentionPlan",
    "fp4cache.longlive.LongLiveBlock",
    "fp4cache.longlive.quantize_block",
    "fp4cache.longlive.dequantize",
    "fp4cache.longlive.dequantize_pool",
    "fp4cache.longlive.inverse_global_denominator",
])
def test_public_function_has_examples(qualname):
    """Each public function's docstring carries an ``Examples`` section with examples."""
    obj = resolve_qualname(qualname)
    doc = obj.__doc__ or ""
    assert "Examples\n" in doc and ">>> " in doc, f"{qualname} has no Examples section"
