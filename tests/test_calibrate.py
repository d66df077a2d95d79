"""``fp4cache.calibrate_scale``: amax / (6 * M) in float32 (spec section 3), on both
backends (CuPy input: one reduction, a host float, under the ``gpu`` marker).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import DEVICES, DLPackProducer
from helpers import xp_of

import fp4cache
from fp4cache import formats

try:  # CuPy and its backend modules, for the GPU cases (which skip by their marker
    # where there is no GPU: collection needs no CuPy)
    import cupy as cp
except ImportError:
    cp = None


F32 = np.float32
BF16 = np.dtype(ml_dtypes.bfloat16)


def _expected(x, M):
    """fl(amax / fl(6*M)), computed here from the float32 widening of x."""
    amax = F32(np.max(np.abs(np.asarray(x).astype(np.float64))))  # exact: x is <= 32-bit
    return float(F32(amax / F32(F32(6) * F32(M))))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16])
@pytest.mark.parametrize("rule, M", [("static6", 448), ("4over6", 256)])
def test_value_is_amax_over_6M_in_float32(device, dtype, rule, M):
    rng = np.random.default_rng(1)
    for mag in (1e-3, 1.0, 37.5, 3e3):  # float16 holds 4-sigma values of 3e3
        x = (rng.standard_normal((33, 3, 64)) * mag).astype(dtype)
        xp = xp_of(device)
        got = fp4cache.calibrate_scale(xp.asarray(x), rule)
        assert type(got) is float
        assert got == _expected(x, M)
        assert got > 0 and F32(got) == got  # exactly a float32 value
    # a strided view (no unit stride) gives the same number as its contiguous copy
    big = xp.asarray((rng.standard_normal((8, 6, 128)) * 3).astype(dtype))
    view = big[:, ::2, ::2]
    assert fp4cache.calibrate_scale(view, rule) == fp4cache.calibrate_scale(
        xp.ascontiguousarray(view), rule)


def test_exact_values_and_default_rule():
    x = np.zeros((2, 16), F32)
    x[1, 7] = -2688.0
    assert fp4cache.calibrate_scale(x) == 1.0
    assert fp4cache.calibrate_scale(x, scale_rule="static6") == 1.0
    assert fp4cache.calibrate_scale(x, scale_rule="4over6") == 1.75
    # the negative extreme counts: |x|
    x[1, 7] = 2688.0 * 3
    assert fp4cache.calibrate_scale(x) == 3.0


def test_dlpack_producer():
    x = np.random.default_rng(2).standard_normal((5, 2, 32)).astype(F32)
    assert fp4cache.calibrate_scale(DLPackProducer(x)) == fp4cache.calibrate_scale(x)


@pytest.mark.parametrize("device", DEVICES)
def test_largest_block_scale_lands_on_e4m3_max(device):
    """static6: the group holding amax gets block scale 448 (byte 0x7E), none saturates
    beyond it; 4over6 with its own calibration never clips (both candidates <= 448)."""
    xp = xp_of(device)
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((64, 4, 128)) * 1e-3).astype(F32)
    xd = xp.asarray(x)
    _, sc = fp4cache.quantize(xd, scale=fp4cache.calibrate_scale(xd))
    sc = sc.get() if device != "cpu" else sc
    assert int(sc.max()) == 0x7E
    assert formats.e4m3_decode(sc).max() == 448.0
    s46 = fp4cache.calibrate_scale(xd, "4over6")
    _, sc46 = fp4cache.quantize(xd, scale=s46, scale_rule="4over6")
    sc46 = sc46.get() if device != "cpu" else sc46
    top = formats.e4m3_decode(sc46).max()
    assert 256.0 <= top <= 384.0  # the 4-candidate of the top group is 1.5 * 256


@pytest.mark.filterwarnings("ignore:PagedKVCache.store:UserWarning")  # badly scaled on purpose
@pytest.mark.parametrize("device", DEVICES)
def test_small_data_survives_only_with_a_calibrated_scale(device):
    """The trap: std 1e-4 with k_scale=1.0 stores only zeros."""
    xp = xp_of(device)
    rng = np.random.default_rng(4)
    k = (rng.standard_normal((64, 2, 64)) * 1e-4).astype(BF16)
    kd = xp.asarray(k)
    cache = fp4cache.PagedKVCache(4, 16, 2, 64, device=device)
    cache.store(xp.arange(64), kd, kd)
    got, _ = cache.gather_dequant(xp.arange(4))
    got = got.get() if device != "cpu" else got
    assert not np.asarray(got, F32).any()  # every block scale underflowed
    s = fp4cache.calibrate_scale(kd)
    cal = fp4cache.PagedKVCache(4, 16, 2, 64, k_scale=s, v_scale=s, device=device)
    cal.store(xp.arange(64), kd, kd)
    got, _ = cal.gather_dequant(xp.arange(4))
    got = np.asarray(got.get() if device != "cpu" else got, np.float64)
    ref = k.astype(np.float64)
    snr = 10 * np.log10(np.sum(ref**2) / np.sum((got - ref) ** 2))
    assert snr > 19.0  # ~20 dB, what unit-scale data gets with a unit scale


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad, match", [
    (np.nan, "NaN or an infinity"), (np.inf, "NaN or an infinity"),
    (-np.inf, "NaN or an infinity"),
])
def test_nonfinite_is_refused(device, bad, match):
    xp = xp_of(device)
    x = np.ones((4, 2, 32), F32)
    x[3, 1, 31] = bad
    with pytest.raises(ValueError, match=match):
        fp4cache.calibrate_scale(xp.asarray(x))
    with pytest.raises(ValueError, match=match):
        fp4cache.calibrate_scale(xp.asarray(x.astype(BF16)))


@pytest.mark.parametrize("device", DEVICES)
def test_zero_empty_tiny_and_wrong_inputs(device):
    xp = xp_of(device)
    with pytest.raises(ValueError, match="all zeros"):
        fp4cache.calibrate_scale(xp.zeros((4, 16), F32))
    with pytest.raises(ValueError, match="at least one value"):
        fp4cache.calibrate_scale(xp.zeros((0, 16), F32))
    with pytest.raises(ValueError, match="too small"):
        fp4cache.calibrate_scale(xp.asarray(np.full((1, 16), 1e-45, F32)))  # no GPU fill: ftz
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        fp4cache.calibrate_scale(xp.ones((4, 16), np.float64))
    with pytest.raises(ValueError, match="scale_rule"):
        fp4cache.calibrate_scale(xp.ones((4, 16), F32), "6over4")


_ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def test_one_scale_rule_in_the_docs():
    """The scale guidance is one rule: wherever the library's docstrings, the README or
    docs/ state ``amax / (6 * 448)``, the same passage gives 4over6's ``6 * 256`` (so no
    text tells a 4over6 user to use 448), and the PagedKVCache docstring sends the user to
    ``calibrate_scale(x, scale_rule)``."""
    import re

    files = [*sorted((_ROOT / "fp4cache").glob("*.py")), _ROOT / "README.md",
             *sorted((_ROOT / "docs").glob("*.md"))]
    pat = re.compile(r"6\s*[*·×]\s*448")
    bad = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        for m in pat.finditer(text):
            window = text[max(0, m.start() - 400):m.end() + 400]
            if not re.search(r"6\s*[*·×]\s*256", window):
                bad.append(f"{path.name}:{text.count(chr(10), 0, m.start()) + 1}")
    assert not bad, f"amax/(6*448) stated without the 4over6 rule at {bad}"
    doc = " ".join(fp4cache.PagedKVCache.__doc__.split())
    assert "calibrate_scale(x, scale_rule)" in doc
    assert "6 * 256" in doc


# -- on the GPU, against the CPU -----------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16])
def test_calibrate_scale_on_gpu_equals_cpu(dtype):
    rng = np.random.default_rng(23)
    x = (rng.standard_normal((1000, 3, 128)) * 0.07).astype(dtype)
    xd = cp.asarray(x)
    for rule in ("static6", "4over6"):
        got = fp4cache.calibrate_scale(xd, rule)
        assert type(got) is float
        assert got == fp4cache.calibrate_scale(x, rule)
        assert fp4cache.calibrate_scale(xd[:, ::-1, 1::2], rule) == \
            fp4cache.calibrate_scale(x[:, ::-1, 1::2], rule)  # strided: copied, then reduced
    x[500, 1, 7] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        fp4cache.calibrate_scale(cp.asarray(x))
