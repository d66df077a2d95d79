"""The ctypes mirror of the driver's launch structures (``fp4cache/_pdl.py``) must match
cuda.h byte for byte: a wrong offset would launch with garbage.  Runs without a GPU."""

from __future__ import annotations

import ctypes

import pytest

_pdl = pytest.importorskip("fp4cache._pdl", reason="needs CuPy installed")


def test_launch_config_layout_matches_cuda_h():
    cfg, attr = _pdl._Config, _pdl._Attr
    # CUlaunchConfig: seven unsigned ints, then CUstream, CUlaunchAttribute*, numAttrs
    assert [getattr(cfg, f).offset for f in ("gridDimX", "gridDimY", "gridDimZ",
                                             "blockDimX", "blockDimY", "blockDimZ",
                                             "sharedMemBytes")] == list(range(0, 28, 4))
    assert (cfg.hStream.offset, cfg.attrs.offset, cfg.numAttrs.offset) == (32, 40, 48)
    assert ctypes.sizeof(cfg) == 56
    # CUlaunchAttribute: id, pad to 8, then a 64-byte value union whose int comes first
    assert (attr.id.offset, attr.value.offset, ctypes.sizeof(attr)) == (0, 8, 72)
    assert _pdl._ATTR_PROGRAMMATIC_STREAM_SERIALIZATION == 6


def test_error_text_names_the_code_or_falls_back_to_the_number():
    text = _pdl._error_text(1)  # CUDA_ERROR_INVALID_VALUE where a driver is loaded
    assert "1" in text and ("CUDA_ERROR_INVALID_VALUE" in text or text == "CUresult 1")
