"""One source for what host and kernels share (``fp4cache/_abi.py``): the constants, the
counter indices and the by-value structs, and tuning as part of a kernel's identity."""

from __future__ import annotations

import re

import numpy as np
import pytest
from test_kernels_compile import needs_nvrtc

from fp4cache import _abi
from fp4cache import _kernels as K


@pytest.mark.parametrize("name", sorted(_abi.STRUCTS))
def test_struct_tables_have_no_hidden_padding(name):
    dt = _abi.struct_dtype(name)
    sizes = [np.dtype(_abi._CTYPES[f[1]]).itemsize * (f[2] if len(f) == 3 else 1)
             for f in _abi.STRUCTS[name]]
    assert dt.itemsize == sum(sizes)
    offsets = np.cumsum([0] + sizes[:-1])
    assert [dt.fields[f[0]][1] for f in _abi.STRUCTS[name]] == offsets.tolist()
    text = _abi.header()
    assert f"static_assert(sizeof({name}) == {dt.itemsize}" in text
    for f in _abi.STRUCTS[name]:
        assert f"sizeof({name}::{f[0]})" in text


def test_constants_come_from_the_tables():
    text = _abi.header()
    for i, stat in enumerate(_abi.STAT_NAMES):
        assert f"#define FP4C_STAT_{stat.upper()} {i}\n" in text
    for rule, v in _abi.RULES.items():
        assert f"#define FP4C_RULE_{rule.upper()} {v}\n" in text
    assert f"#define FP4C_NUM_STATS {len(_abi.STAT_NAMES)}\n" in text
    from fp4cache import PagedKVCache

    assert list(PagedKVCache(2, 16, 1, 64, device="cpu").stats) == list(_abi.STAT_NAMES)


@needs_nvrtc
def test_a_struct_field_changed_on_one_side_fails_to_compile(monkeypatch):
    """The C struct is generated, so a field can only change in the table; if the
    generated text and the numpy layout ever disagreed, the size checks stop the compile
    (here: the claim pointer declared 4 bytes wide in the C text only)."""
    good = _abi.header()
    bad = good.replace("  u64 claim;\n", "  u32 claim;\n", 1)
    assert bad != good
    monkeypatch.setattr(_abi, "header", lambda: bad)
    K._read_inlined.cache_clear()
    try:
        spec = K.store_spec("bf16", "static6", "i32")
        with pytest.raises(RuntimeError, match="StoreParams"):
            K.compile_source(K.build_source(spec.file, [spec]), spec.file, "sm_90")
    finally:
        monkeypatch.undo()
        K._read_inlined.cache_clear()


def test_variant_is_part_of_the_spec():
    spec = K.decode_attention_spec("bf16", 128, 1)
    other = K.decode_attention_spec("bf16", 128, 1, decode_route="bitmove")
    assert other != spec and hash(other) != hash(spec)
    assert other.name == spec.name + "_bitmove"
    assert "#define FP4C_ATTN_BITMOVE 1\n" in K.build_source(other.file, [other])
    assert "FP4C_ATTN_BITMOVE 1" not in K.build_source(spec.file, [spec])
    assert K.decode_attention_args(other) == ("bf16", 128, 1, True, "bitmove")
    assert K.attention_head_dim(other) == 128
    with pytest.raises(ValueError, match="decode_route"):
        K.decode_attention_spec("bf16", 128, 1, decode_route="fast")
    with pytest.raises(ValueError, match="share their defines"):
        K.build_source(spec.file, [spec, other])
    with pytest.raises(ValueError, match="not a decode_attention_spec"):
        K.decode_attention_args(K.claim_spec("i32"))


def test_few_row_kernel_forms():
    """The few-row attention kernel's n8 tiles of rows: 1, 2 or 4 (up to 8, 16, 32 rows);
    four only for 16-bit q at head_dim 64 / 128 (q's fragments in shared memory, O's
    accumulators in registers), so other q and head dims stop at 16 rows."""
    assert [K.attn_row_tiles(r) for r in (1, 8, 9, 16, 17, 32)] == [1, 1, 2, 2, 4, 4]
    with pytest.raises(ValueError, match="rows must be at most 32"):
        K.attn_row_tiles(33)
    for dt in K.VALUE_TYPES:
        for d in K.ATTN_HEAD_DIMS:
            four = dt in ("bf16", "f16") and d in (64, 128)
            assert K.attn_max_rows(dt, d) == (32 if four else 16), (dt, d)
    names = [K.decode_attention_spec("f16", 64, t).name for t in K.ATTN_ROW_TILES]
    assert names == ["fp4cache_decode_attn_f16_d64_paged16",
                     "fp4cache_decode_attn_f16_d64_wide_paged16",
                     "fp4cache_decode_attn_f16_d64_wide4_paged16"]
    assert K.decode_attention_spec("bf16", 128, 4, False).args[2] == "4"
    for dt, d in (("f32", 128), ("bf16", 256)):
        with pytest.raises(ValueError, match="tiles 4 needs"):
            K.decode_attention_spec(dt, d, 4)
    for bad in (3, True, 0):
        with pytest.raises(ValueError, match="tiles must be one of"):
            K.decode_attention_spec("bf16", 128, bad)
    spec_names = {s.name for s in K.all_specs()}
    assert "fp4cache_decode_attn_bf16_d128_wide4" in spec_names
    assert not any("wide4" in n and ("_f32_" in n or "_d256" in n) for n in spec_names)


def test_shared_sizes_come_from_abi():
    """The values both languages use are generated from _abi (the kernels define none)."""
    head = _abi.header()
    for name, value in (("DECODE_CHUNKS", _abi.DECODE_CHUNKS),
                        ("SCAN_MAX_TOKENS", _abi.SCAN_MAX_TOKENS),
                        ("LL_WIDE_TILES", _abi.LL_WIDE_TILES),
                        ("ATTN_WARPS", _abi.ATTN_WARPS),
                        ("ATTN_MAX_SPLITS", _abi.ATTN_MAX_SPLITS),
                        ("PAIR_SCALE_SHIFT", _abi.PAIR_SCALE_SHIFT)):
        assert f"#define FP4C_{name} {value}\n" in head
        for f in K.kernel_dir().iterdir():
            assert f"#define FP4C_{name} " not in f.read_text(), f.name
    # pair_scale's multiplier of the bit route: f16x2 of 2^(22 - S); the E4M3 route has none
    # (its pairs are 2^(S - 6) larger: FP4C_ROUTE_UNSCALE in attn_dequant.cuh)
    S = _abi.PAIR_SCALE_SHIFT
    m = re.search(r"#define FP4C_PAIR_SCALE_BITS (0x[0-9a-f]+)u", head)
    word = int(m.group(1), 16)
    halves = np.array([word & 0xFFFF, word >> 16], dtype=np.uint16).view(np.float16)
    assert (halves.astype(np.float64) == 2.0 ** (22 - S)).all()
    assert "FP4C_PAIR_SCALE_E4M3" not in head
    common = (K.kernel_dir() / "attn_dequant.cuh").read_text()
    assert f"#define FP4C_ROUTE_UNSCALE {2.0 ** (6 - S)}f" in common


def test_every_shipped_store_shape_is_compiled_in_ci():
    """The two-heads-per-thread store kernels the backend launches for 16-bit static6
    inputs are in the list the CPU NVRTC test compiles."""
    names = {s.name for s in K.all_specs()}
    for dt, rule in K.STORE_PAIR:
        for ix in K.INDEX_TYPES:
            for vec in (True, False):
                assert K.store_spec(dt, rule, ix, vec, pair=True).name in names
    assert K.clear_spec("i64").name in names and K.claim_spec("i32").name in names


def test_names_have_one_source():
    """The Python-side name tuples are the _abi tables' keys (the kernels' values)."""
    import typing

    from fp4cache import formats, layout

    assert layout.LAYOUTS == tuple(_abi.LAYOUTS)
    assert typing.get_args(layout.Layout) == layout.LAYOUTS
    assert formats.SCALE_RULES == tuple(_abi.RULES)


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.uint8])
def test_value_type_names_the_dtype(dtype):
    with pytest.raises(ValueError, match=f"q.dtype must be bfloat16, float16 or float32, got "
                                         f"{np.dtype(dtype)}"):
        K.value_type(dtype, "q.dtype")
    assert [K.value_type(d, "x") for d in (np.float32, np.float16)] == ["f32", "f16"]


def test_fastdiv_fields_are_one_struct():
    """A divisor travels as one FastDiv field (d, m, s), the layout of the device struct."""
    fd = _abi.struct_dtype("StoreParams")["t"]
    assert fd.names == ("d", "m", "s") and fd.itemsize == 12
    assert "struct FastDiv {\n  u32 d;\n  u32 m;\n  u32 s;\n};" in _abi.header()
    p = np.zeros((), dtype=_abi.struct_dtype("AttnParams"))
    p["t"] = _abi.fastdiv(12)
    d, m, s = (int(p["t"][k]) for k in ("d", "m", "s"))
    n = np.arange(1 << 16, dtype=np.uint64)
    assert ((((n * m) >> 32) + n) >> s == n // d).all()


@needs_nvrtc
def test_shared_memory_sizes_match_the_kernels_layouts():
    """The host sizes the varlen kernels' dynamic shared memory by ``_abi.varlen_smem_bytes``
    and ``_abi.varlen_wg_smem_bytes``; the kernels' own layouts (``VlDims::SMEM``,
    ``WgDims::SMEM``) must agree for every head dim, row-warp count and q type (the kernels
    trap on a mismatch at run time; here it fails the compile)."""
    spec = K.varlen_attention_spec("bf16", 128, 8)
    checks = [f"static_assert(VlDims<{d}, {mw}, {'true' if split else 'false'}>::SMEM == "
              f"{_abi.varlen_smem_bytes(d, mw, split)}, \"varlen_smem_bytes({d}, {mw}, "
              f"{split})\");"
              for d in K.ATTN_HEAD_DIMS for mw in _abi.VARLEN_ROW_WARPS
              for split in (False, True)]
    source = K.build_source(spec.file, [spec]) + "\n" + "\n".join(checks) + "\n"
    K.compile_source(source, spec.file, "sm_90", K.CUPY_IMPLICIT_OPTIONS)
    bad = source.replace(f"== {_abi.varlen_smem_bytes(128, 8, False)},",
                         f"== {_abi.varlen_smem_bytes(128, 8, False) + 16},", 1)
    with pytest.raises(RuntimeError, match="varlen_smem_bytes"):
        K.compile_source(bad, spec.file, "sm_90", K.CUPY_IMPLICIT_OPTIONS)
    wg = K.varlen_wgmma_spec("bf16", 128)
    checks = [f"static_assert(WgDims<{d}>::SMEM == {_abi.varlen_wg_smem_bytes(d)}, "
              f"\"varlen_wg_smem_bytes({d})\");" for d in _abi.VARLEN_WG_GEOMETRY]
    K.compile_source(K.build_source(wg.file, [wg]) + "\n" + "\n".join(checks) + "\n",
                     wg.file, "sm_90a", K.CUPY_IMPLICIT_OPTIONS)
