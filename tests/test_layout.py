"""Byte layouts (spec sections 4 and 5) against independent formulas and reshape forms.

Under the ``gpu`` marker: the kernels' division by a run-time constant (``fdiv`` with
``_abi.fastdiv``'s multiplier and shift) against the hardware division.
"""

from __future__ import annotations

import itertools

import numpy as np
import nvfp4_ref as ref
import pytest

from fp4cache.layout import (
    GROUP,
    PageGeometry,
    blocked_scale_offset,
    longlive_padded_rows,
    swizzle_scale_index,
)

try:  # CuPy and its backend modules, for the GPU cases (which skip by their marker
    # where there is no GPU: collection needs no CuPy)
    import cupy as cp
except ImportError:
    cp = None


GEOMS = [  # (H, T, D, layout, swizzle)
    (h, t, d, lay, sw)
    for (h, t, d) in [(1, 4, 64), (2, 8, 128), (3, 16, 256), (4, 12, 64), (8, 16, 128)]
    for lay in ("HND", "NHD")
    for sw in (True, False)
] + [(2, 6, 48, "HND", False), (3, 5, 16, "NHD", False), (1, 1, 32, "HND", False)]


def geom_id(g):
    return "H{}-T{}-D{}-{}-{}".format(*g[:4], "swz" if g[4] else "lin")


def grid(*sizes):
    return np.meshgrid(*[np.arange(n) for n in sizes], indexing="ij")


@pytest.mark.parametrize("g", GEOMS, ids=geom_id)
def test_sizes(g):
    H, T, D, layout, sw = g
    geom = PageGeometry(H, T, D, layout, sw)
    geom.check()
    assert geom.row_data_bytes == D // 2
    assert geom.scales_per_row == D // 16
    assert geom.bytes_per_row == D // 2 + D // 16
    assert geom.data_bytes == H * T * D // 2
    assert geom.scale_bytes == H * T * D // 16
    assert geom.side_bytes == H * T * (D // 2 + D // 16)
    assert geom.page_bytes == 2 * H * T * (D // 2 + D // 16)
    assert geom.bytes_per_token == 2 * H * (D // 2 + D // 16)
    assert GROUP == 16


@pytest.mark.parametrize("g", GEOMS, ids=geom_id)
def test_data_offsets_direct_formula(g):
    H, T, D, layout, sw = g
    geom = PageGeometry(H, T, D, layout, sw)
    t, h, j = grid(T, H, D // 2)
    got = geom.data_offset(t, h, j)
    if layout == "HND":
        want = h * T * (D // 2) + t * (D // 2) + j
    else:
        want = t * H * (D // 2) + h * (D // 2) + j
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("g", GEOMS, ids=geom_id)
def test_scale_offsets_direct_formula(g):
    H, T, D, layout, sw = g
    geom = PageGeometry(H, T, D, layout, sw)
    S = D // 16
    t, h, s = grid(T, H, S)
    base = H * T * D // 2
    lin = base + (h * T * S + t * S + s if layout == "HND" else t * H * S + h * S + s)
    np.testing.assert_array_equal(geom.scale_offset(t, h, s, side=0), lin)
    if not sw:
        np.testing.assert_array_equal(geom.scale_offset(t, h, s, side=1), lin)
        return
    tq = (t // 4) * 4 + s // (S // 4)
    sq = (s % (S // 4)) * 4 + t % 4
    swz = base + (h * T * S + tq * S + sq if layout == "HND" else tq * H * S + h * S + sq)
    np.testing.assert_array_equal(geom.scale_offset(t, h, s, side=1), swz)


@pytest.mark.parametrize("g", [g for g in GEOMS if g[4]], ids=geom_id)
def test_v_swizzle_matches_reshape_permute_form(g):
    """Place a unique id per logical (t, h, s) with the reshape/permute form, then check
    that the library's V offset of every (t, h, s) points at its own id."""
    H, T, D, layout, _ = g
    geom = PageGeometry(H, T, D, layout, True)
    S = D // 16
    ids = np.arange(T * H * S, dtype=np.int64).reshape(T, H, S)
    data = np.zeros((T, H, D // 2), dtype=np.int64)
    side = ref.build_page_side(data, ids, layout, swizzle=True)
    t, h, s = grid(T, H, S)
    np.testing.assert_array_equal(side[geom.scale_offset(t, h, s, side=1)], ids)
    # and the K side (never swizzled) against the linear form
    side_k = ref.build_page_side(data, ids, layout, swizzle=False)
    np.testing.assert_array_equal(side_k[geom.scale_offset(t, h, s, side=0)], ids)


@pytest.mark.parametrize("g", GEOMS, ids=geom_id)
def test_every_offset_of_a_side_hit_exactly_once(g):
    H, T, D, layout, sw = g
    geom = PageGeometry(H, T, D, layout, sw)
    for side in (0, 1):
        t, h, j = grid(T, H, D // 2)
        d_off = np.ravel(geom.data_offset(t, h, j))
        t, h, s = grid(T, H, D // 16)
        s_off = np.ravel(geom.scale_offset(t, h, s, side=side))
        counts = np.bincount(np.concatenate([d_off, s_off]), minlength=geom.side_bytes)
        assert counts.shape == (geom.side_bytes,)
        assert np.all(counts == 1)
        assert d_off.max() < geom.data_bytes <= s_off.min()


@pytest.mark.parametrize("T, S", [(4, 4), (8, 8), (16, 16), (12, 4), (32, 8)])
def test_swizzle_scale_index(T, S):
    t, s = grid(T, S)
    tq, sq = swizzle_scale_index(t, s, S)
    np.testing.assert_array_equal(tq, (t // 4) * 4 + s // (S // 4))
    np.testing.assert_array_equal(sq, (s % (S // 4)) * 4 + t % 4)
    # a permutation of the tile, equal to the reshape/permute form
    ids = np.arange(T * S).reshape(T, S)
    stored = np.full((T, S), -1)
    stored[tq, sq] = ids
    np.testing.assert_array_equal(stored, ref.swizzle_tile(ids))
    # rows of 4 tokens stay inside their group of 4
    assert np.all(tq // 4 == t // 4)


def test_swizzle_known_values():
    # D = 128 -> S = 8, S/4 = 2: (t=1, s=3) -> t' = 0 + 1 = 1, s' = 1*4 + 1 = 5
    assert tuple(int(v) for v in swizzle_scale_index(1, 3, 8)) == (1, 5)
    assert tuple(int(v) for v in swizzle_scale_index(6, 7, 8)) == (7, 6)
    assert tuple(int(v) for v in swizzle_scale_index(0, 0, 8)) == (0, 0)


@pytest.mark.parametrize("R, S", [(128, 4), (128, 8), (256, 16), (384, 8), (100, 8), (130, 4)])
def test_blocked_scale_offset_vs_to_blocked(R, S):
    ids = np.arange(R * S, dtype=np.int64).reshape(R, S) + 1  # 0 marks padding
    flat = ref.to_blocked(ids)
    Rp = -(-R // 128) * 128
    assert flat.shape == (Rp * S,)
    r, s = grid(R, S)
    off = blocked_scale_offset(r, s, S)
    np.testing.assert_array_equal(flat[off], ids)
    # the padded matrix covers every offset exactly once
    r, s = grid(Rp, S)
    off = np.ravel(blocked_scale_offset(r, s, S))
    assert np.all(np.bincount(off, minlength=Rp * S) == 1)
    # direct spec formula
    want = ((r // 128) * (S // 4) + s // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + s % 4
    np.testing.assert_array_equal(blocked_scale_offset(r, s, S), want)


@pytest.mark.parametrize("Tb, H, want", [(1, 1, 128), (16, 8, 128), (16, 9, 256), (64, 2, 128),
                                         (128, 3, 384), (33, 4, 256)])
def test_longlive_padded_rows(Tb, H, want):
    assert longlive_padded_rows(Tb, H) == want


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(num_heads=0, block_size=16, head_dim=128), "num_heads"),
    (dict(num_heads=-1, block_size=16, head_dim=128), "num_heads"),
    (dict(num_heads=True, block_size=16, head_dim=128), "num_heads"),
    (dict(num_heads=2.0, block_size=16, head_dim=128), "num_heads"),
    (dict(num_heads=2, block_size=0, head_dim=128), "block_size"),
    (dict(num_heads=2, block_size=16, head_dim=0), "head_dim"),
    (dict(num_heads=2, block_size=16, head_dim=40, swizzle_v_scales=False), "head_dim"),
    (dict(num_heads=2, block_size=16, head_dim=48), "head_dim"),
    (dict(num_heads=2, block_size=6, head_dim=128), "block_size"),
    (dict(num_heads=2, block_size=16, head_dim=128, layout="NDH"), "layout"),
])
def test_check_rejects(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        PageGeometry(**kwargs).check()


@pytest.mark.parametrize("H, T, D, sw", list(itertools.product([1, 3], [1, 6], [16, 48], [False]))
                         + [(2, 4, 64, True), (1, 8, 256, True)])
def test_check_accepts(H, T, D, sw):
    PageGeometry(H, T, D, "NHD", sw).check()


# -- on the GPU -----------------------------------------------------------------------------
_FDIV_CHECK = r"""
extern "C" __global__ void fdiv_check(u32 d, u32 m, u32 s, u32 n0, u32 count,
                                      unsigned long long* bad, unsigned int* first) {
  const FastDiv f{d, m, s};
  const u32 stride = gridDim.x * blockDim.x;
  for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
    const u32 n = n0 + i;
    if (fdiv(n, f) != n / f.d) {
      atomicAdd(bad, 1ull);
      atomicMin(first, n);
    }
  }
}
"""


@pytest.mark.gpu
def test_fastdiv_matches_division():
    """The kernels' division by a run-time constant (``fdiv`` with ``_abi.fastdiv``'s
    multiplier and shift) against the hardware division: every 32-bit numerator for a
    few divisors (block sizes among them), and the top 2^24 numerators for many more."""
    from fp4cache import _abi, _kernels

    mod = cp.RawModule(code=_kernels.common_source() + _FDIV_CHECK,
                       options=_kernels.NVRTC_OPTIONS)
    fn = mod.get_function("fdiv_check")
    bad = cp.zeros(1, cp.uint64)
    first = cp.full(1, 0xFFFFFFFF, cp.uint32)
    every = [1, 3, 7, 16, 48, 1000, 2**31 - 1]
    some = [2, 5, 12, 17, 31, 32, 64, 96, 100, 128, 255, 256, 4097, 65535, 2**20 + 3,
            2**30, 2**30 + 1]
    for d in every + some:
        f = _abi.fastdiv(d)  # (d, m, s) as np.uint32
        spans = [(0, 2**32)] if d in every else [(0, 2**24), (2**32 - 2**24, 2**24)]
        for n0, count in spans:
            for start in range(n0, n0 + count, 2**31):  # count fits the u32 argument
                fn((132 * 8,), (256,), (*f, np.uint32(start),
                                        np.uint32(min(2**31, n0 + count - start)), bad,
                                        first))
        assert int(bad[0]) == 0, f"d={d}: {int(bad[0])} wrong, first n={int(first[0])}"
