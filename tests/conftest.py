"""Shared test helpers: GPU detection and the ``requires_gpu`` skip.

Tests marked ``@pytest.mark.gpu`` are skipped cleanly when no CUDA device is usable
(CuPy missing, no driver, no device).  ``requires_gpu`` is the same skip as a
reusable marker, and ``DEVICES`` parametrizes a test over ``"cpu"`` and ``"cuda"``.
"""

from __future__ import annotations

import functools

import pytest


@functools.lru_cache(maxsize=1)
def gpu_available() -> bool:
    """True when CuPy imports and at least one CUDA device answers."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - any failure means "no usable GPU"
        return False


requires_gpu = pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU with CuPy")

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
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_gpu])]


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
