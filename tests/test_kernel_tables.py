"""The test-only table kernels of ``tests/kernels/`` (``kernel_tables``): they compile from
their own folder against the shipped headers (no GPU needed), stay out of the shipped
kernels, and on the GPU tabulate the attention's NVFP4 -> f16 decode exactly."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from kernel_tables import FOLDER, attn_dequant_table_spec, dequant_table
from test_kernels_compile import needs_nvrtc

from fp4cache import _abi
from fp4cache import _kernels as K


def test_table_source_comes_from_the_test_folder():
    spec = attn_dequant_table_spec("bitmove")
    assert spec.name == "fp4cache_attn_dequant_table_bitmove"
    assert attn_dequant_table_spec().name == "fp4cache_attn_dequant_table"
    src = K.build_source(spec.file, [spec])
    # the test kernel from tests/kernels/, the headers it includes from the shipped folder
    assert '#line 1 "attn_dequant_table.cu"' in src and '#line 1 "attn_dequant.cuh"' in src
    assert "#define FP4C_ATTN_BITMOVE 1\n" in src and "#include" not in src
    assert (FOLDER / spec.file).is_file() and not (K.kernel_dir() / spec.file).exists()
    shipped = K.Spec(spec.file, spec.macro, spec.name, spec.args, spec.defines)
    with pytest.raises(ValueError, match="share their folder"):
        K.build_source(spec.file, [spec, shipped])
    with pytest.raises(FileNotFoundError, match="attn_dequant_table.cu"):
        K.build_source(spec.file, [shipped])


def test_shipped_kernels_hold_no_test_kernel():
    for f in K.kernel_dir().iterdir():
        text = f.read_text()
        assert "dequant_table" not in text and "FP4C_ATTN_DEQUANT_TABLE" not in text, f.name
    assert all(s.folder is None for s in K.all_specs())


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_table_kernel_compiles(arch):
    specs = [attn_dequant_table_spec(r) for r in K.DECODE_ROUTES]
    ptx = K.compile_all(arch, specs)
    assert list(ptx) == ["attn_dequant_table.cu"]
    text = ptx["attn_dequant_table.cu"]
    auto = text.split(".entry fp4cache_attn_dequant_table(")[1].split(".entry ")[0]
    bits = text.split(".entry fp4cache_attn_dequant_table_bitmove(")[1].split(".entry ")[0]
    # the bit route has no E4M3 conversion, on any architecture; "auto" takes it from sm_89
    assert "e4m3x2" not in bits
    assert ("e4m3x2" in auto) == (arch == "sm_90")


@pytest.mark.gpu
@pytest.mark.parametrize("route", K.DECODE_ROUTES)
def test_dequant_table_exhaustive(route):
    """Every E2M1 code x every E4M3 scale byte x every pair position, on both decode
    routes (sm_89+ E4M3 conversions; the bit moves of older GPUs, forced here with
    decode_route="bitmove"): the kernel's f16 decode (+ one f16x2 multiply, subnormals
    included) equals e2m1 * e4m3 * 2^-PAIR_SCALE_SHIFT exactly; 0x7F / 0xFF give NaN.  The
    kernel also poisons an entry with NaN where a code alone at the pair's nibble lands
    elsewhere."""
    tab = dequant_table(route)
    codes = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    sf = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    want = codes[:, None] * sf[None, :] * 2.0 ** -_abi.PAIR_SCALE_SHIFT
    for p in range(4):
        for half in range(2):
            got = tab[p, half].astype(np.float64)
            assert np.array_equal(np.isnan(got), np.isnan(want))
            ok = ~np.isnan(want)
            assert np.array_equal(got[ok], want[ok]), (p, half)
            # signed zeros too: the sign of -0 codes survives
            assert np.array_equal(np.signbit(got[ok]), np.signbit(want[ok])), (p, half)
