"""GPU decode paths added for speed, against the NumPy backend, byte for byte.

* the decode kernels' fast path (table lookup by PRMT, scale split as f*2^119 and
  s*2^12) and their plain path for s >= 2^116, on both sides of that threshold;
* ``longlive.dequantize_pool`` as one launch: int32 and int64 ids, ids out of range,
  ``out=``, CUDA-graph capture and replay with new ids;
* ``longlive.dequantize`` reusing its cached device pointer tables when the same
  blocks come again with new contents;
* a store whose launch plan (with its per-plan scale table) is first made while the
  stream is being captured into a CUDA graph.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from nvfp4_ref import assert_same_values

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

from fp4cache import PagedKVCache, codec, longlive  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)


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


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("scale", [1e-45, 3e-39, 1 / 448, 1.0, 2.0**115, 2.0**116, 1e37, 3e38])
def test_decode_every_code_and_scale_byte_at_extreme_scales(dtype, scale):
    """Every (code, scale byte) pair through the flat decoder, fast and plain paths."""
    # row r: scale byte r // 4 for all 8 groups; its 64 data bytes are (r % 4)*64 + 0..63,
    # so every (code byte, scale byte) pair occurs
    r = np.arange(1024)
    data = ((r[:, None] % 4) * 64 + np.arange(64)[None, :]).astype(np.uint8)
    scales = np.repeat((r // 4).astype(np.uint8)[:, None], 8, axis=1)
    ref = codec.dequantize(data, scales, scale, dtype=dtype)
    got = codec.dequantize(cp.asarray(data), cp.asarray(scales), scale, dtype=dtype)
    assert_same_values(got, ref)


@pytest.mark.parametrize("k_scale", [2.0**-130, 1.0, 2.0**117])
def test_gather_at_extreme_global_scales(k_scale):
    rng = np.random.default_rng(3)
    kw = dict(num_blocks=8, block_size=16, num_heads=2, head_dim=64, k_scale=k_scale,
              v_scale=k_scale)
    c_cpu = PagedKVCache(**kw, device="cpu")
    c_gpu = PagedKVCache(**kw, device="cuda")
    k = (rng.standard_normal((40, 2, 64)) * k_scale).astype(np.float32)
    v = (rng.standard_normal((40, 2, 64)) * k_scale).astype(np.float32)
    slots = rng.permutation(128)[:40]
    c_cpu.store(slots, k, v)
    c_gpu.store(cp.asarray(slots), cp.asarray(k), cp.asarray(v))
    blocks = np.array([3, 0, 7, 3])
    for dt in ("bfloat16", "float32"):
        rk, rv = c_cpu.gather_dequant(blocks, dtype=dt)
        gk, gv = c_gpu.gather_dequant(cp.asarray(blocks), dtype=dt)
        assert_same_values(gk, rk)
        assert_same_values(gv, rv)


def _pool(rng, n_pool, H, Tb, D):
    blocks = [longlive.quantize_block(rng.standard_normal((Tb, H, D)).astype(np.float32) * (i + 1),
                                      "4over6") for i in range(n_pool)]
    return [np.stack([b[j] for b in blocks]) for j in range(3)]


@pytest.mark.parametrize("dtype,D", [("bfloat16", 128), ("float16", 64), ("float32", 192)])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_dequantize_pool_one_launch_ids_out_and_graph(id_dtype, dtype, D):
    """16-bit outputs take the wide decode kernel, float32 outputs the other one."""
    rng = np.random.default_rng(5)
    H, Tb = 3, 40
    pool_c = _pool(rng, 5, H, Tb, D)
    pool_g = [cp.asarray(a) for a in pool_c]
    ids = np.array([4, 0, 4, 2, 1], id_dtype)
    ref = longlive.dequantize_pool(*pool_c, ids, H, Tb, dtype=dtype, scale_rule="4over6")
    ids_d = cp.asarray(ids)
    out = cp.full(ref.shape, np.nan, dtype=ref.dtype)
    got = longlive.dequantize_pool(*pool_g, ids_d, H, Tb, out=out, scale_rule="4over6")
    assert got is out
    assert_same_values(out, ref)
    # out of range on both sides: NaN rows for those blocks only
    bad = np.array([5, 1, -1, 2, 1 << 30], id_dtype)
    got = longlive.dequantize_pool(*pool_g, cp.asarray(bad), H, Tb, dtype=dtype,
                                   scale_rule="4over6")
    exp = longlive.dequantize_pool(*pool_c, np.where((bad < 0) | (bad >= 5), 0, bad), H, Tb,
                                   dtype=dtype, scale_rule="4over6")
    for j in (0, 2, 4):
        exp[0, j * Tb:(j + 1) * Tb] = np.nan
    assert_same_values(got, exp)
    # captured once, replayed with new ids in the same device array
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        out[...] = 0
        stream.begin_capture()
        longlive.dequantize_pool(*pool_g, ids_d, H, Tb, out=out, scale_rule="4over6")
        graph = stream.end_capture()
        new_ids = np.array([1, 1, 3, 0, 2], id_dtype)
        ids_d.set(new_ids, stream=stream)
        graph.launch(stream)
        stream.synchronize()
    assert_same_values(out, longlive.dequantize_pool(*pool_c, new_ids, H, Tb, dtype=dtype,
                                                     scale_rule="4over6"))


def test_wide_decode_many_blocks_and_a_misaligned_block():
    """Many small blocks (grid y), then one block at an odd address: the narrow kernel."""
    rng = np.random.default_rng(9)
    H, Tb, D = 2, 16, 64
    pool_c = _pool(rng, 70, H, Tb, D)
    ids = rng.integers(0, 70, 300)
    ref = longlive.dequantize_pool(*pool_c, ids, H, Tb, scale_rule="4over6")
    assert_same_values(
        longlive.dequantize_pool(*[cp.asarray(a) for a in pool_c], cp.asarray(ids), H, Tb,
                                 scale_rule="4over6"),
        ref)
    vals = [cp.asarray(pool_c[0][i]) for i in (3, 5)]
    raw = cp.zeros(vals[1].size + 1, cp.uint8)
    odd = raw[1:].reshape(vals[1].shape)
    odd[...] = vals[1]
    sfs = [cp.asarray(pool_c[1][i]) for i in (3, 5)]
    ams = [cp.asarray(pool_c[2][i]) for i in (3, 5)]
    exp = longlive.dequantize([pool_c[0][3], pool_c[0][5]], [pool_c[1][3], pool_c[1][5]],
                              [pool_c[2][3], pool_c[2][5]], H, Tb, scale_rule="4over6")
    assert_same_values(longlive.dequantize([vals[0], odd], sfs, ams, H, Tb,
                                           scale_rule="4over6"), exp)


def test_dequantize_list_reuses_pointer_tables_but_reads_new_contents():
    rng = np.random.default_rng(8)
    H, Tb, D = 2, 64, 64
    pool_c = _pool(rng, 3, H, Tb, D)
    vals = [cp.asarray(pool_c[0][i]) for i in range(3)]
    sfs = [cp.asarray(pool_c[1][i]) for i in range(3)]
    ams = [cp.asarray(pool_c[2][i]) for i in range(3)]
    ref = longlive.dequantize([a for a in pool_c[0]], [a for a in pool_c[1]],
                              [a for a in pool_c[2]], H, Tb, scale_rule="4over6")
    assert_same_values(longlive.dequantize(vals, sfs, ams, H, Tb, scale_rule="4over6"), ref)
    # same blocks (same pointers), new contents: the cached tables still point at them
    vals[1][...] = cp.asarray(pool_c[0][2])
    sfs[1][...] = cp.asarray(pool_c[1][2])
    ams[1][...] = cp.asarray(pool_c[2][2])
    exp = ref.copy()
    exp[0, Tb:2 * Tb] = ref[0, 2 * Tb:3 * Tb]
    assert_same_values(longlive.dequantize(vals, sfs, ams, H, Tb, scale_rule="4over6"), exp)
    # a different order is a different table
    assert_same_values(longlive.dequantize(vals[::-1], sfs[::-1], ams[::-1], H, Tb,
                                           scale_rule="4over6")[0, :Tb],
                       ref[0, 2 * Tb:])


def test_store_plan_made_during_graph_capture():
    """New scales -> new plan and os table, made inside the capture; replay is exact."""
    rng = np.random.default_rng(12)
    kw = dict(num_blocks=6, block_size=16, num_heads=2, head_dim=64, k_scale=0.0123,
              v_scale=3.5e-3)
    c_cpu = PagedKVCache(**kw, device="cpu")
    c_gpu = PagedKVCache(**kw, device="cuda")
    n = 24
    slots = cp.asarray(rng.permutation(96)[:n])
    k = cp.asarray(rng.standard_normal((n, 2, 64)).astype(np.float32))
    v = cp.asarray(rng.standard_normal((n, 2, 64)).astype(np.float32))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        c_gpu.store(slots, k, v)
        graph = stream.end_capture()
        for _ in range(2):  # replay with new contents in the same device arrays
            s_h = rng.permutation(96)[:n]
            k_h = rng.standard_normal((n, 2, 64)).astype(np.float32)
            v_h = rng.standard_normal((n, 2, 64)).astype(np.float32)
            slots.set(s_h, stream=stream)
            k.set(k_h, stream=stream)
            v.set(v_h, stream=stream)
            graph.launch(stream)
            stream.synchronize()
            c_cpu.store(s_h, k_h, v_h)
            assert np.array_equal(cp.asnumpy(c_gpu.buffer), c_cpu.buffer)


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16), np.dtype(np.float32)])
@pytest.mark.parametrize("rule", ["static6", "4over6"])
@pytest.mark.parametrize("D,layout,swz,H", [(64, "HND", True, 4), (128, "NHD", True, 6),
                                            (192, "HND", False, 2), (80, "NHD", False, 3),
                                            (128, "HND", True, 3)])
@pytest.mark.parametrize("n", [40, 300, 2000])
def test_store_one_or_two_heads_per_thread(dtype, rule, D, layout, swz, H, n):
    """Both store kernel shapes (the same group of heads h and h + H/2 per thread for
    16-bit static6 with an even H, else one group per thread) write the NumPy backend's
    bytes and counters, with padding (-1) and duplicate slots, through the scan (40) and
    the claim + clear (300, 2000) paths."""
    rng = np.random.default_rng(n + D + H)
    T, nb = 16, 160
    kw = dict(num_blocks=nb, block_size=T, num_heads=H, head_dim=D, layout=layout,
              scale_rule=rule, k_scale=0.02, v_scale=0.5, swizzle_v_scales=swz)
    c_cpu = PagedKVCache(**kw, device="cpu")
    c_gpu = PagedKVCache(**kw, device="cuda")
    slots = rng.permutation(nb * T)[:n]
    slots[::7] = -1
    slots[5::11] = slots[3]  # duplicates: the last occurrence wins
    k = (rng.standard_normal((n, H, D)) * rng.choice([0.01, 1, 30], (n, H, 1))).astype(dtype)
    v = (rng.standard_normal((n, H, D)) * 3).astype(dtype)
    c_cpu.store(slots, k, v, unique_slots=False)
    c_gpu.store(cp.asarray(slots), cp.asarray(k), cp.asarray(v), unique_slots=False)
    assert np.array_equal(cp.asnumpy(c_gpu.buffer), c_cpu.buffer)
    assert c_gpu.stats == c_cpu.stats
    assert not c_gpu._state.claim.any()  # the clear pass leaves the claim table zero


@pytest.mark.parametrize("rule", ["static6", "4over6"])
@pytest.mark.parametrize("n", [1, 40, 300, 2000])
@pytest.mark.parametrize("validate", [True, False])
def test_store_unique_slots_skips_the_duplicate_pass(rule, n, validate):
    """unique_slots=True (no scan, no claim pass) writes the same bytes as the default
    store for slot mappings without repeats, also through the prepared fast path."""
    rng = np.random.default_rng(n)
    H, D, T, nb = 8, 128, 16, 160
    kw = dict(num_blocks=nb, block_size=T, num_heads=H, head_dim=D, scale_rule=rule,
              k_scale=0.05, v_scale=0.3, validate=validate)
    c_cpu = PagedKVCache(**kw, device="cpu")
    c_gpu = PagedKVCache(**kw, device="cuda")
    for step in range(3):  # repeated calls: the fast path when not validating
        slots = rng.permutation(nb * T)[:n]
        slots[::9] = -1
        k = (rng.standard_normal((n, H, D)) * 2).astype(BF16)
        v = rng.standard_normal((n, H, D)).astype(BF16)
        c_cpu.store(slots, k, v)
        c_gpu.store(cp.asarray(slots), cp.asarray(k), cp.asarray(v), unique_slots=True)
        assert np.array_equal(cp.asnumpy(c_gpu.buffer), c_cpu.buffer), step


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)])
@pytest.mark.parametrize("H", [2, 3])  # two heads per thread (static6) or one
@pytest.mark.parametrize("rule", ["static6", "4over6"])
def test_store_group_max_special_values(dtype, H, rule):
    """The group max |x| (packed 16-bit maxima on sm_86+) with the largest magnitude, a
    NaN, +Inf or -Inf at every position of a group, negative maxima, -0, subnormal-only
    groups and the largest finite value: same bytes and counters (non-finite, saturated,
    underflow) as the NumPy backend."""
    finfo = ml_dtypes.finfo(dtype) if dtype == BF16 else np.finfo(dtype)
    tiny = np.float32(finfo.smallest_subnormal)
    rows = []
    for pos in range(16):
        base = np.linspace(-1, 1, 16, dtype=np.float32)
        for special in (np.float32(-7.5), np.nan, np.inf, -np.inf):
            g = base.copy()
            g[pos] = special
            rows.append(g)
        rows.append(np.where(np.arange(16) == pos, -tiny * 3, tiny).astype(np.float32))
    rows.append(np.full(16, np.float32(finfo.max)))
    rows.append(np.full(16, -np.float32(finfo.max)))
    rows.append(np.full(16, np.float32(-0.0)))
    D = 64
    x = np.array(rows, np.float32).reshape(-1)
    n = -(-x.size // (H * D))
    x = np.concatenate([x, np.ones(n * H * D - x.size, np.float32)]).reshape(n, H, D)
    k, v = x.astype(dtype), (-x[::-1]).astype(dtype)
    kw = dict(num_blocks=8, block_size=16, num_heads=H, head_dim=D, scale_rule=rule,
              k_scale=1 / 448, v_scale=0.02)
    for rep in (1, 15):  # scan path, then claim path (165 tokens, repeated slots)
        slots = np.arange(n).repeat(rep) % (8 * 16)
        kk, vv = np.repeat(k, rep, axis=0), np.repeat(v, rep, axis=0)
        c_cpu = PagedKVCache(**kw, device="cpu")
        c_gpu = PagedKVCache(**kw, device="cuda")
        c_cpu.store(slots, kk, vv, unique_slots=False)
        c_gpu.store(cp.asarray(slots), cp.asarray(kk), cp.asarray(vv), unique_slots=False)
        assert np.array_equal(cp.asnumpy(c_gpu.buffer), c_cpu.buffer)
        assert c_gpu.stats == c_cpu.stats


@pytest.mark.parametrize("rule", ["static6", "4over6"])
def test_large_stores_with_and_without_repeats_keep_pages_and_counters(rule):
    """Large stores (claim pass, store, clear pass; the store encodes every group before
    it looks at the claims): calls with and without repeated slots, with non-finite
    groups in winning and in losing tokens.  After every call the pages and every counter
    equal the NumPy backend's: a losing token's non-finite groups are not counted."""
    rng = np.random.default_rng(7)
    H, D, T, nb, n = 4, 64, 16, 64, 400
    kw = dict(num_blocks=nb, block_size=T, num_heads=H, head_dim=D, scale_rule=rule,
              k_scale=0.05, v_scale=0.5)
    c_cpu = PagedKVCache(**kw, device="cpu")
    c_gpu = PagedKVCache(**kw, device="cuda")
    for call, repeats in enumerate([True, False, False, True, True, False, True, False]):
        slots = rng.permutation(nb * T)[:n].astype(np.int64)
        slots[::13] = -1
        k = rng.standard_normal((n, H, D)).astype(BF16)
        v = (rng.standard_normal((n, H, D)) * 3).astype(BF16)
        k[rng.choice(n, 6, replace=False), 1, 16:32] = np.nan
        v[rng.choice(n, 4, replace=False), 2, :16] = np.inf
        if repeats:
            slots[7::17] = slots[3]  # token 3 and most of these lose to the last one
            k[3, 0, :16] = np.nan
            v[7, 3, 5] = -np.inf
        c_cpu.store(slots, k, v, unique_slots=False)
        c_gpu.store(cp.asarray(slots), cp.asarray(k), cp.asarray(v), unique_slots=False)
        assert np.array_equal(cp.asnumpy(c_gpu.buffer), c_cpu.buffer), f"call {call}"
        assert c_gpu.stats == c_cpu.stats, f"call {call}"
    assert c_cpu.nonfinite_groups[0] > 0 and c_cpu.nonfinite_groups[1] > 0


@pytest.mark.parametrize("n", [1, 2, 31, 64, 127, 128])
@pytest.mark.parametrize("pattern", ["all_same", "pairs", "random_repeats", "padding"])
@pytest.mark.parametrize("slot_dtype", [np.int32, np.int64])
def test_decode_step_scan_of_repeated_slots(n, pattern, slot_dtype):
    """Stores of up to 128 tokens find repeated slots in one launch (each CTA compares
    the slots in shared memory): the last occurrence wins for every pattern and length,
    also through the prepared decode-step launch (second call), against the NumPy
    backend."""
    rng = np.random.default_rng(n)
    H, D, T, nb = 8, 128, 16, 12
    if pattern == "all_same":
        slots = np.full(n, 37)
    elif pattern == "pairs":
        slots = np.arange(n) // 2 * 3
    elif pattern == "random_repeats":
        slots = rng.integers(0, 20, n)
    else:
        slots = rng.permutation(nb * T)[:n]
        slots[::3] = -1
        slots[1::5] = slots[-1]
    slots = slots.astype(slot_dtype)
    kw = dict(num_blocks=nb, block_size=T, num_heads=H, head_dim=D, k_scale=0.01,
              v_scale=0.02)
    c_cpu = PagedKVCache(**kw, device="cpu")
    c_gpu = PagedKVCache(**kw, device="cuda")
    for call in range(2):  # the second call takes the prepared launch
        k = rng.standard_normal((n, H, D)).astype(BF16)
        v = rng.standard_normal((n, H, D)).astype(BF16)
        c_cpu.store(slots, k, v, unique_slots=False)
        c_gpu.store(cp.asarray(slots), cp.asarray(k), cp.asarray(v), unique_slots=False)
        assert np.array_equal(cp.asnumpy(c_gpu.buffer), c_cpu.buffer), f"call {call}"
