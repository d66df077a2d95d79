"""Shared fixtures and markers, and the one way a test says it needs a GPU.

The modules are grouped by feature (codec, store, gather, attention, pages, longlive,
errors, devices, ...): each holds its CPU cases and, under the ``gpu`` marker, the GPU
cases of the same feature, against the CPU backend or the float64 reference.  Cases one
layer down (a CuPy backend function against the NumPy backend's, a kernel against the
reference) sit in a class of the module (``TestCupyBackend``, ``TestKernel``).  Builders
and checks shared by several modules are in ``helpers.py``, the independent reference
(formats, codec, pages, LongLive, float64 attention) in ``nvfp4_ref.py``; no test module
imports another one.

GPU tests: the ``gpu`` marker, nothing else
-------------------------------------------
- one test or class: ``@pytest.mark.gpu``; a test that needs N GPUs: ``@pytest.mark.gpu(N)``;
- a whole module: ``pytestmark = pytest.mark.gpu``.  A module that imports CuPy at the top
  does so after that line as ``cp = pytest.importorskip("cupy")`` (collection must work
  where CuPy is not installed; the marker, not the import, decides the skip); a module of
  CPU and GPU cases imports CuPy (and fp4cache's CuPy modules) in ``try: ... except
  ImportError:`` with ``None`` in their place, so that its CPU cases run without CuPy;
- a parameter: ``@pytest.mark.parametrize("device", DEVICES)`` (its ``"cuda"`` carries the
  marker).

``pytest_collection_modifyitems`` below skips every marked test where
``fp4cache.gpu_available()`` is False (or fewer than N devices are visible); on the device
they run.  No ``skipif(not gpu_available())``, module-level ``pytest.skip`` or skip inside a
test body.  The one inverse case, a test of the no-GPU error, is
``@pytest.mark.skipif(gpu_available(), reason="checks the no-GPU error")``.
"""

from __future__ import annotations

import pytest

from fp4cache import gpu_available

__all__ = ["DEVICES", "DLPackProducer", "gpu_available", "resolve_qualname"]


class DLPackProducer:
    """A foreign array that offers only the DLPack protocol (what PyTorch or JAX hand
    over): the tests' stand-in for arrays of another library."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


#: Parametrize over backends: ``@pytest.mark.parametrize("device", DEVICES)``.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _gpu_count() -> int:
    if not gpu_available():
        return 0
    import cupy

    return cupy.cuda.runtime.getDeviceCount()


def pytest_collection_modifyitems(config, items):
    have = None
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        need = int(marker.args[0]) if marker.args else 1
        if have is None:
            have = _gpu_count()
        if have < need:
            item.add_marker(pytest.mark.skip(
                reason="needs a CUDA GPU with CuPy" if need == 1 else f"needs {need} CUDA GPUs"))


def resolve_qualname(qualname: str):
    """The object a dotted name like ``fp4cache.cache.PagedKVCache.store`` names: the
    longest importable module prefix, then attributes (decorators unwrapped)."""
    import importlib
    import inspect

    parts = qualname.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for p in parts[i:]:
            obj = getattr(obj, p)
        return inspect.unwrap(obj)
    raise AssertionError(f"{qualname} names nothing importable")
