"""Element formats (spec section 1): E2M1, E4M3, nibble packing, float32 clamps.

Under the ``gpu`` marker: the scale byte of the E4M3 conversion instruction the kernels use
on sm_89+ equals the software encoder's on every non-negative float32.
"""

from __future__ import annotations

import struct

import ml_dtypes
import numpy as np
import nvfp4_ref as ref
import pytest

from fp4cache import formats

try:  # CuPy and its backend modules, for the GPU cases (which skip by their marker
    # where there is no GPU: collection needs no CuPy)
    import cupy as cp
except ImportError:
    cp = None


F32 = np.float32


def f32_from_bits(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(F32)


def bits_of(x) -> np.ndarray:
    return np.asarray(x, dtype=F32).view(np.uint32)


def stratified_f32(seed: int, per_exponent: int = 48, include_nonfinite: bool = False):
    """Float32 bit patterns: every exponent 0..254 (255 optional), both signs, mantissas
    0, 1, max, half, and ``per_exponent`` random ones."""
    rng = np.random.default_rng(seed)
    fixed = np.array([0, 1, 2, 0x7FFFFF, 0x7FFFFE, 0x400000, 0x3FFFFF, 0x400001], np.uint32)
    exps = np.arange(256 if include_nonfinite else 255, dtype=np.uint32)
    mant = np.concatenate(
        [np.broadcast_to(fixed, (len(exps), len(fixed))),
         rng.integers(0, 1 << 23, size=(len(exps), per_exponent), dtype=np.uint32)], axis=1)
    bits = (exps[:, None] << 23) | mant
    bits = np.concatenate([bits.ravel(), bits.ravel() | np.uint32(0x80000000)])
    return f32_from_bits(bits)


def neighbours(values) -> np.ndarray:
    """Each value, both signs, and its float32 neighbours on either side."""
    v = np.asarray(values, dtype=F32)
    v = np.concatenate([v, -v])
    inf = F32(np.inf)
    return np.concatenate([v, np.nextafter(v, inf), np.nextafter(v, -inf)])


# -- constants -----------------------------------------------------------------------------
def test_constants_bit_patterns():
    assert bits_of(formats.C6) == 0x3E2AAAAB
    assert formats.C6 == F32(1) / F32(6)
    assert bits_of(formats.C4) == bits_of(F32(0.25))
    assert bits_of(formats.FLT_MAX) == 0x7F7FFFFF
    assert formats.E4M3_NAN == 0x7F
    assert formats.E4M3_MAX == 448.0
    assert formats.SCALE_RULES == ("static6", "4over6")
    np.testing.assert_array_equal(
        bits_of(formats.E2M1_VALUES),
        bits_of([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]))


# -- E2M1 ----------------------------------------------------------------------------------
def test_e2m1_encode_stratified_vs_ml_dtypes_and_bruteforce():
    x = stratified_f32(seed=1)
    got = formats.e2m1_encode(x)
    assert got.dtype == np.uint8
    want = x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    np.testing.assert_array_equal(got, want)
    # and an encoder written from the spec's rule (no ml_dtypes), on a subsample
    sub = x[:: 7]
    brute = np.array([ref.e2m1_encode_scalar(v) for v in sub], dtype=np.uint8)
    np.testing.assert_array_equal(formats.e2m1_encode(sub), brute)


def test_e2m1_encode_all_codes_round_trip():
    codes = np.arange(16, dtype=np.uint8)
    np.testing.assert_array_equal(formats.e2m1_encode(formats.e2m1_decode(codes)), codes)


@pytest.mark.parametrize(
    "x, below, at, above",
    [  # tie value: code just below, at the tie (even code), just above
        (0.25, 0, 0, 1), (0.75, 1, 2, 2), (1.25, 2, 2, 3), (1.75, 3, 4, 4),
        (2.5, 4, 4, 5), (3.5, 5, 6, 6), (5.0, 6, 6, 7),
    ],
)
def test_e2m1_ties_and_neighbours(x, below, at, above):
    for sign in (1.0, -1.0):
        v = F32(sign * x)
        lo = np.nextafter(v, F32(0))
        hi = np.nextafter(v, F32(sign * np.inf))
        sb = 8 if sign < 0 else 0
        got = formats.e2m1_encode(np.array([lo, v, hi], dtype=F32))
        np.testing.assert_array_equal(got, np.array([below, at, above], np.uint8) | sb)
        np.testing.assert_array_equal(
            got, [ref.e2m1_encode_scalar(u) for u in (lo, v, hi)])


def test_e2m1_boundary_neighbours_vs_ml_dtypes():
    x = neighbours([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, .5, 1, 1.5, 2, 3, 4, 6])
    np.testing.assert_array_equal(
        formats.e2m1_encode(x), x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF)


def test_e2m1_zero_subnormal_saturation_inf():
    tiny = f32_from_bits([1, 0x007FFFFF])  # smallest and largest float32 subnormal
    cases = [
        (0.0, 0), (-0.0, 8), (tiny[0], 0), (-tiny[0], 8), (tiny[1], 0), (-tiny[1], 8),
        (6.0, 7), (6.5, 7), (1e30, 7), (-1e30, 15), (formats.FLT_MAX, 7),
        (-formats.FLT_MAX, 15), (np.inf, 7), (-np.inf, 15),
    ]
    x = np.array([c[0] for c in cases], dtype=F32)
    np.testing.assert_array_equal(formats.e2m1_encode(x), [c[1] for c in cases])
    assert formats.e2m1_encode(np.array([-0.0], F32))[0] == 8
    assert formats.e2m1_encode(np.array([0.0], F32))[0] == 0


def test_e2m1_decode_exhaustive():
    vals = formats.e2m1_decode(np.arange(16, dtype=np.uint8))
    assert vals.dtype == np.float32
    np.testing.assert_array_equal(bits_of(vals), bits_of(ref.E2M1_TABLE))
    assert np.signbit(vals[8]) and not np.signbit(vals[0])
    # only the low nibble is read
    np.testing.assert_array_equal(
        bits_of(formats.e2m1_decode(np.arange(256, dtype=np.uint8))),
        bits_of(np.tile(ref.E2M1_TABLE, 16)))


# -- E4M3 ----------------------------------------------------------------------------------
def test_e4m3_encode_stratified_all_exponents():
    x = stratified_f32(seed=2, include_nonfinite=False)
    got = formats.e4m3_encode(x)
    assert got.dtype == np.uint8
    want = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, ref.e4m3_encode_bruteforce(x))


def test_e4m3_ties_and_subnormals():
    pos = ref.E4M3_POS  # float64 values of codes 0..126
    mids = (pos[:-1] + pos[1:]) / 2  # every tie, incl. the subnormal range and 2^-10
    assert np.all(mids.astype(F32) == mids)  # representable exactly in float32
    x = neighbours(np.concatenate([mids, pos]))
    got = formats.e4m3_encode(x)
    np.testing.assert_array_equal(got, ref.e4m3_encode_bruteforce(x))
    # explicit ties: 2^-10 is halfway between 0 and the smallest subnormal -> 0 (even)
    assert formats.e4m3_encode(np.array([2.0**-10], F32))[0] == 0x00
    assert formats.e4m3_encode(np.array([3 * 2.0**-10], F32))[0] == 0x02
    assert formats.e4m3_encode(np.array([-(2.0**-10)], F32))[0] == 0x80
    assert formats.e4m3_encode(np.array([2.0**-9], F32))[0] == 0x01
    # 1.0625 sits between 1.0 (0x38) and 1.125 (0x39): ties to even -> 0x38
    assert formats.e4m3_encode(np.array([1.0625], F32))[0] == 0x38
    assert formats.e4m3_encode(np.array([1.1875], F32))[0] == 0x3A


def test_e4m3_saturates_to_448():
    x = np.array([448, 449, 464, 465, 480, 1e6, 3e38, np.inf], dtype=F32)
    np.testing.assert_array_equal(formats.e4m3_encode(x), [0x7E] * len(x))
    np.testing.assert_array_equal(formats.e4m3_encode(-x), [0xFE] * len(x))
    assert formats.e4m3_encode(np.array([-0.0], F32))[0] == 0x80


def test_e4m3_nan_encodes_to_nan():
    b = formats.e4m3_encode(np.array([np.nan], F32))
    assert np.isnan(formats.e4m3_decode(b))[0]


def test_e4m3_decode_exhaustive():
    codes = np.arange(256, dtype=np.uint8)
    got = formats.e4m3_decode(codes)
    assert got.dtype == np.float32
    want = np.concatenate([ref.E4M3_POS, [np.nan], -ref.E4M3_POS, [np.nan]]).astype(F32)
    np.testing.assert_array_equal(got, want)  # NaNs compare equal here
    assert np.isnan(got[0x7F]) and np.isnan(got[0xFF])
    assert np.signbit(got[0x80])
    assert got[0x7E] == 448 and got[0x01] == 2.0**-9
    # decode then encode is the identity on every non-NaN code
    ok = ~np.isnan(got)
    np.testing.assert_array_equal(formats.e4m3_encode(got[ok]), codes[ok])


# -- nibble packing ------------------------------------------------------------------------
def test_pack_nibble_order():
    np.testing.assert_array_equal(formats.pack_nibbles(np.array([1, 2, 15, 8], np.uint8)),
                                  [0x21, 0x8F])
    np.testing.assert_array_equal(formats.unpack_nibbles(np.array([0x21, 0x8F], np.uint8)),
                                  [1, 2, 15, 8])


def test_pack_unpack_round_trip_shapes():
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 16, size=(3, 5, 32), dtype=np.uint8)
    packed = formats.pack_nibbles(codes)
    assert packed.shape == (3, 5, 16) and packed.dtype == np.uint8
    np.testing.assert_array_equal(packed, ref.pack(codes))
    np.testing.assert_array_equal(formats.unpack_nibbles(packed), codes)
    data = rng.integers(0, 256, size=(4, 8), dtype=np.uint8)
    np.testing.assert_array_equal(formats.unpack_nibbles(data), ref.unpack(data))


# -- float32 clamps and dtype helpers ------------------------------------------------------
def test_reciprocal_clamped():
    tiny = f32_from_bits([1, 2, 0x00200000, 0x00400000])  # 1/x overflows for the first three
    got = np.array([formats.reciprocal_clamped(v) for v in tiny], dtype=F32)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got[:3], [formats.FLT_MAX] * 3)
    assert got[3] == F32(2.0**127)
    assert formats.reciprocal_clamped(F32(0.0)) == formats.FLT_MAX
    assert formats.reciprocal_clamped(F32(3.0)) == F32(1) / F32(3)
    assert bits_of(formats.reciprocal_clamped(F32(6.0))) == 0x3E2AAAAB
    assert np.isfinite(formats.reciprocal_clamped(F32(1e-45)))


def test_reciprocal_clamped_matches_reference_on_all_exponents():
    x = np.abs(stratified_f32(seed=4, per_exponent=4))
    x = x[x > 0]
    got = np.array([formats.reciprocal_clamped(v) for v in x], dtype=F32)
    want = np.array([ref.encode_multiplier(v) for v in x], dtype=F32)
    np.testing.assert_array_equal(bits_of(got), bits_of(want))
    assert np.all(np.isfinite(got))


def test_float32_to_rounds_to_nearest_even():
    # bf16: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 -> 1 (even mantissa)
    x = f32_from_bits([0x3F808000, 0x3F818000, 0x3F808001, 0x7FC00000])
    bf = formats.float32_to(x, formats.resolve_dtype("bfloat16"))
    assert bf.dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(bf.view(np.uint16)[:3], [0x3F80, 0x3F82, 0x3F81])
    assert np.isnan(bf[3].astype(F32))
    # fp16: 2049 halfway between 2048 and 2050 -> 2048; 2051 -> 2052
    h = formats.float32_to(np.array([2049, 2051, 65520, np.nan], F32), np.float16)
    np.testing.assert_array_equal(h[:2], [2048, 2052])
    assert np.isinf(h[2]) and np.isnan(h[3])


@pytest.mark.parametrize("spec, want", [
    ("bfloat16", ml_dtypes.bfloat16), ("float16", np.float16), ("float32", np.float32),
    (ml_dtypes.bfloat16, ml_dtypes.bfloat16), (np.float16, np.float16),
    (np.dtype(np.float32), np.float32), ("bf16", ml_dtypes.bfloat16), ("fp16", np.float16),
])
def test_resolve_dtype_accepts(spec, want):
    assert formats.resolve_dtype(spec) == np.dtype(want)


@pytest.mark.parametrize("spec", ["int8", np.int32, np.float64, "float8", "nonsense", None])
def test_resolve_dtype_rejects(spec):
    with pytest.raises(TypeError, match="out_dtype"):
        formats.resolve_dtype(spec, name="out_dtype")


def test_f32_helper_is_float32():
    assert struct.pack("<f", float(ref.C6)) == struct.pack("<I", 0x3E2AAAAB)


# -- on the GPU, against the CPU -----------------------------------------------------------
_E4M3_CHECK = r"""
extern "C" __global__ void e4m3_check(unsigned long long* bad, unsigned int* first) {
  // every float32 bit pattern from +0 to +inf
  const u32 stride = gridDim.x * blockDim.x;
  for (u32 u = blockIdx.x * blockDim.x + threadIdx.x; u <= 0x7F800000u; u += stride) {
    const float v = __uint_as_float(u);
    if (e4m3_encode_nonneg(v) != e4m3_encode_nonneg_sw(v)) {
      atomicAdd(bad, 1ull);
      atomicMin(first, u);
    }
  }
}
"""


@pytest.mark.gpu
def test_e4m3_conversion_instruction_matches_software_on_every_input():
    """The scale byte from sm_89's cvt.rn.satfinite.e4m3x2.f32 (what the kernels use
    there) equals the software encoder's, which the NumPy backend matches, on every
    non-negative float32 up to +inf.  On older devices both are the software one."""
    from fp4cache import _kernels

    mod = cp.RawModule(code=_kernels.common_source() + _E4M3_CHECK,
                       options=_kernels.NVRTC_OPTIONS)
    bad = cp.zeros(1, cp.uint64)
    first = cp.full(1, 0xFFFFFFFF, cp.uint32)
    mod.get_function("e4m3_check")((132 * 8,), (256,), (bad, first))
    assert int(bad[0]) == 0, f"{int(bad[0])} mismatches, first at bits {int(first[0]):#010x}"
