"""What the host code and the CUDA kernels share, defined once.

The constants (scale rules, layouts, counter indices) and the layouts of the structs that
kernels take by value live here as Python tables.  :func:`header` turns them into the C
text that the kernel loader inlines where a ``.cu`` file says ``#include "fp4c_abi.cuh"``
(there is no such file on disk), and :func:`struct_dtype` turns each struct into the numpy
structured dtype the host fills.  Every generated struct is followed by
``static_assert``\\ s of its size and of each field's offset, computed from the numpy
dtype: a field moved on either side fails the NVRTC compile (the CPU test suite compiles
every kernel) instead of garbling arguments on the GPU.
"""

from __future__ import annotations

from functools import cache

import numpy as np

__all__ = ["RULES", "LAYOUTS", "STAT_NAMES", "STAT", "STRUCTS", "struct_dtype", "header",
           "fastdiv", "DECODE_CHUNKS", "SCAN_MAX_TOKENS", "LL_WIDE_TILES", "ATTN_WARPS",
           "ATTN_MAX_SPLITS", "PAIR_SCALE_SHIFT", "ATTN_CHUNK_TILES", "COPY_UNROLL",
           "COPY_MIN_CTAS", "COPY_TABLES", "PAGE_MOVE_THREADS", "SCALE_SATURATES_ABOVE",
           "MMA_ROWS", "VARLEN_WARPS", "VARLEN_TILE_KEYS", "VARLEN_ROW_WARPS",
           "VARLEN_MAX_SPLITS", "VARLEN_MIN_SPLIT", "NEW_KV_KINDS", "VARLEN_SMEM_PAD",
           "varlen_smem_bytes",
           "VARLEN_WG_HEAD_DIMS", "VARLEN_WG_ROW_WARPS", "VARLEN_WG_DECODE_WARPS",
           "VARLEN_WG_GEOMETRY", "varlen_wg_smem_bytes",
           "varlen_warps"]

#: Scale rules: name -> value of the kernels' ``RULE`` template parameter.
RULES: dict[str, int] = {"static6": 0, "4over6": 1}
#: Page row orders: name -> value of the ``nhd`` kernel field.
LAYOUTS: dict[str, int] = {"HND": 0, "NHD": 1}

#: The counters of a cache's ``stats`` array (uint64, on the cache's device), in order.
STAT_NAMES: tuple[str, ...] = (
    "k_nonfinite_groups",   # groups of 16 stored with a NaN/Inf (they decode to NaN)
    "v_nonfinite_groups",
    "bad_slots",            # tokens whose slot was >= num_slots (not stored)
    "bad_block_ids",        # block ids outside [0, num_blocks) (read as NaN, or skipped)
    "k_saturated_groups",   # block scale clipped at E4M3's 448 (SCALE_SATURATES_ABOVE): the
                            # global scale is too small
    "v_saturated_groups",
    "k_underflow_groups",   # nonzero group whose block scale is zero or subnormal: too large
    "v_underflow_groups",
)
#: Counter name -> index.
STAT: dict[str, int] = {name: i for i, name in enumerate(STAT_NAMES)}

#: A group counts as saturated when the block scale its rule wants, ``fl(g * fl(m * c))``
#: for the chosen candidate, is above this: only then does the satfinite clip to 448
#: change the scale byte.  464 is the midpoint of 448 and 480 (the next E4M3 step, had the
#: format one), and round-to-nearest-even takes it and everything below to 448 anyway: the
#: calibrated maximum, ``fl(g * fl(amax * fl(1/6)))`` = 448.00003, is not saturated.
SCALE_SATURATES_ABOVE = 464.0

#: 16-byte output chunks per thread of the decode kernels (gather, flat dequantize,
#: LongLive decode); 1 and 4 were measured and dropped (docs/kernels.md).
DECODE_CHUNKS = 2
#: Stores of up to this many tokens find repeated slots by a scan in the kernel (one
#: launch, one thread per token of a 256-thread CTA); larger ones take a claim pass.
SCAN_MAX_TOKENS = 128
#: 1024-chunk tiles per CTA of the wide LongLive decode (all loads first; docs/kernels.md).
LL_WIDE_TILES = 2
#: Warps per CTA of the decode attention (2, 3 and 8 measured and dropped: docs/kernels.md).
ATTN_WARPS = 4
#: Largest GQA group (query heads per KV head) the attention kernels serve from one K/V
#: load (the group's heads are rows of one CTA's MMA tile).
MAX_GROUP = 16
#: Most KV splits per (sequence, KV head) of the decode attention (the merge's weights
#: live in shared memory).
ATTN_MAX_SPLITS = 128
#: The attention kernels decode an E2M1 code times its E4M3 scale as an exact f16 scaled
#: by 2^-PAIR_SCALE_SHIFT (``pair_scale`` in kernels/attn_dequant.cuh: the bit route's
#: multiplier is generated from it; the E4M3 route's pairs are 2^1 larger and the kernels
#: take that into the two scales, ``FP4C_ROUTE_UNSCALE``); the host folds
#: 2^PAIR_SCALE_SHIFT into the score scale and the output scale.
PAIR_SCALE_SHIFT = 7

#: Decode attention, groups of 1..8 with block_size % 16 == 0: 16-token tiles per chunk (a
#: warp's step of the chunk ring), by head_dim.  Measured on the H200 (docs/kernels.md):
#: D = 64 takes 4 (69.2 against 75.1 us with 2 at B=8 x 32768), D = 128 2 (4 would not fit
#: the 48 KB of static shared memory), D = 256 1 (registers).
ATTN_CHUNK_TILES: dict[int, int] = {64: 4, 128: 2, 256: 1}

#: copy_blocks (kernels/page_copy.cu): vectors each thread loads before it stores them
#: (loads in flight per thread while a CTA streams a page).
COPY_UNROLL = 4
#: copy_blocks: ``__launch_bounds__`` minimum CTAs per SM of the copy kernel: 4 x 512
#: threads fill an SM (32 registers; without the bound ptxas took 40 to 98, i.e. 1 to 3 CTAs).
COPY_MIN_CTAS = 4
#: copy_blocks: uint32 tables of ``num_blocks`` entries each (pending, dst_of), the
#: cache's workspace tickets, zero before and after every call.
COPY_TABLES = 2
#: Threads per CTA of the page-moving kernels (copy, read, write).
PAGE_MOVE_THREADS = 512
#: Rows of one mma.sync m16n8k16 tile (the A operand's m side).
MMA_ROWS = 16
#: Attention over any query length (kernels/varlen_attention.cu): warps per CTA (at least;
#: varlen_warps); keys of the tile one warp decodes per step (a CTA step is one tile per
#: warp); the kernels' row warps (a CTA holds MMA_ROWS * row_warps query rows, (token,
#: head) pairs; the varlen_warps / row_warps warps of a row block split the step's keys):
#: 1 for sequences of at most 16 rows (decode, speculative verification), 2 for at most
#: 32, 4 for at most 64, 8 (a CTA of 8 warps) for longer.
VARLEN_WARPS = 4
VARLEN_TILE_KEYS = 16
VARLEN_ROW_WARPS = (1, 2, 4, 8)
#: A sequence whose rows fit one CTA splits its keys over at most VARLEN_MAX_SPLITS CTAs of
#: at least VARLEN_MIN_SPLIT keys (partials of the CTA's rows in the workspace).
VARLEN_MAX_SPLITS = 32
VARLEN_MIN_SPLIT = 256
#: The exact new tokens' element types in the any-length kernel (``VarlenParams.new_kind``;
#: 0: the call has none).
NEW_KV_KINDS: dict[str, int] = {"bf16": 1, "f16": 2, "f32": 3}
#: f16 elements of padding per shared-memory row of decoded K / V / q (conflict-free ldmatrix).
VARLEN_SMEM_PAD = 8


def varlen_warps(row_warps: int) -> int:
    """Warps of a varlen kernel's CTA (FP4C_VL_WARPS): VARLEN_WARPS, or row_warps when more."""
    return max(VARLEN_WARPS, row_warps)


def varlen_smem_bytes(head_dim: int, row_warps: int, split_q: bool) -> int:
    """Dynamic shared memory of a varlen kernel (``VlDims::SMEM``, checked by the kernel):
    decoded K and V tiles of every warp, the scale-row staging, q (hi [+ lo]).  The 128-row
    kernel with q's fragments in registers (``VlDims::DBUF``: q's f16 values in at most 128
    columns) holds a second set of tiles in q's place instead."""
    ld = head_dim + VARLEN_SMEM_PAD
    w = varlen_warps(row_warps)
    kv = w * 2 * VARLEN_TILE_KEYS * ld * 2
    sc = w * 2 * VARLEN_TILE_KEYS * (head_dim // 16)
    if row_warps == 8 and head_dim * (2 if split_q else 1) <= 128:
        return 2 * kv + sc
    q = MMA_ROWS * row_warps * ld * 2 * (2 if split_q else 1)
    return kv + sc + q


#: The wgmma kernel (kernels/varlen_wgmma.cu, sm_90a): the head dims the host routes to it,
#: rows per CTA (two warpgroups of 64; the plan's row_warps is VARLEN_WG_ROW_WARPS), the
#: decode warps (two warpgroups beside them).
VARLEN_WG_HEAD_DIMS = (64, 128, 256)
VARLEN_WG_ROW_WARPS = 8
VARLEN_WG_DECODE_WARPS = 8
#: Per head dim the kernel compiles for: keys per step, shared stages of the decoded K and
#: of the decoded V (one step each).  Head_dim 256 takes steps of 32 keys: q is 64 KB, and
#: eight stages of 16 KB fit beside it in the SM's 227 KB; a decode lane holds a quarter
#: of a key's columns, and the row warps' scores take 16 registers.
VARLEN_WG_GEOMETRY = {64: (128, 2, 3), 128: (128, 2, 3), 256: (32, 3, 5)}


def varlen_wg_smem_bytes(head_dim: int) -> int:
    """Dynamic shared memory of the wgmma kernel (``WgDims::SMEM``, checked by the kernel):
    1024 bytes to align the swizzled regions, q, the K and V stages, the decode warps' scale
    staging."""
    step, k_stages, v_stages = VARLEN_WG_GEOMETRY[head_dim]
    rows = MMA_ROWS * VARLEN_WG_ROW_WARPS
    warps = VARLEN_WG_DECODE_WARPS
    return (1024 + rows * head_dim * 2 + (k_stages + v_stages) * step * head_dim * 2
            + warps * 2 * VARLEN_TILE_KEYS * (head_dim // 16))


#: The device ``FastDiv`` (``fdiv`` in kernels/fp4_common.cuh): ``n / d`` of a run-time
#: divisor ``d < 2**31`` as ``(umulhi(n, m) + n) >> s`` (Granlund-Montgomery, see
#: :func:`fastdiv`); a struct field of this type holds one divisor.
FASTDIV_FIELDS = (("d", "u32"), ("m", "u32"), ("s", "u32"))

_CTYPES = {"u32": np.uint32, "u64": np.uint64, "i64": np.int64, "float": np.float32,
           "FastDiv": np.dtype([(n, np.uint32) for n, _ in FASTDIV_FIELDS], align=True)}

#: Structs passed to kernels by value: name -> fields ``(name, C type[, count])``.
#: Pointers travel as ``u64``.
STRUCTS: dict[str, tuple[tuple, ...]] = {
    # kernels/paged_kv.cu, every non-pointer argument of the store
    "StoreParams": (
        ("buffer", "u64"), ("stats", "u64"), ("claim", "u64"), ("os_tab", "u64"),
        ("win", "u64"), ("win_map", "u64"),  # window slots (bf16), block -> slot (i32)
        ("k_tok_stride", "i64"), ("k_head_stride", "i64"),  # elements
        ("v_tok_stride", "i64"), ("v_head_stride", "i64"),
        ("num_slots", "i64"), ("side_bytes", "i64"), ("data_bytes", "i64"),
        ("k_pair_bytes", "i64"), ("v_pair_bytes", "i64"),  # NH = 2: offset of head h + H/2
        ("n_tokens", "u32"), ("total", "u32"),
        ("hg", "FastDiv"),  # (H/NH)*G
        ("g", "FastDiv"),  # G
        ("t", "FastDiv"),  # T
        ("H", "u32"), ("nhd", "u32"), ("swizzle", "u32"), ("dedup", "u32"), ("swz_m", "u32"),
        ("pair_rows", "u32"),  # NH = 2: pool rows from head h to head h + H/2
        ("k_s", "float"), ("k_g", "float"), ("v_s", "float"), ("v_g", "float"),
        ("pk", "u32", 8),  # code-packing multipliers (EncodeAux::pk)
        ("win_slots", "u32"),  # slots of the window (0: none)
        ("rot_scale", "float"),  # rotation: fl32(1 / sqrt(D))
        ("_pad", "u32"),
    ),
    # kernels/paged_kv.cu, every non-pointer argument of the gather
    "GatherParams": (
        ("buffer", "u64"), ("stats", "u64"),
        ("num_blocks", "i64"), ("side_bytes", "i64"), ("data_bytes", "i64"),
        ("c", "FastDiv"),  # output chunks per row (rotating kernel: groups per row, G)
        ("h", "FastDiv"),  # H
        ("t", "FastDiv"),  # T
        ("nhd", "u32"), ("swizzle", "u32"), ("swz_m", "u32"),
        ("k_s", "float"), ("v_s", "float"),
        ("rot_scale", "float"),  # rotation: fl32(1 / sqrt(D))
        ("_pad", "u32"),
    ),
    # kernels/decode_attention.cu, every non-pointer argument of the decode attention
    "AttnParams": (
        ("buffer", "u64"), ("ws_o", "u64"), ("ws_ml", "u64"),  # u8 pool, f32 partial O, (m, l)
        ("win", "u64"), ("win_map", "u64"),  # window slots (bf16), block -> slot (i32)
        ("counters", "u64"), ("stats", "u64"),  # u32 merge tickets [B*H], u64 counters
        ("num_blocks", "i64"), ("side_bytes", "i64"), ("data_bytes", "i64"),
        ("H", "u32"), ("group", "u32"),  # KV heads, query heads per KV head
        ("t", "FastDiv"),  # tokens per page
        ("max_blocks", "u32"), ("split_len", "u32"), ("nsplit", "u32"),
        ("row_h", "u32"), ("row_t", "u32"),  # row of (t, h) in a side: h*row_h + t*row_t
        ("swizzle", "u32"),  # V scales swizzled
        ("bt64", "u32"), ("sl64", "u32"),  # int64 block tables / sequence lengths
        ("ql64", "u32"), ("causal", "u32"),  # int64 query_start_loc; bottom-right mask
        ("rows_lo", "u32"), ("rows_hi", "u32"),  # with query_start_loc: sequences of
        ("max_q", "u32"),  # rows_lo < n*group <= rows_hi, at most max_q tokens computed
        ("num_tokens", "u32"),  # q's rows: query_start_loc is clamped to [0, num_tokens]
        ("rows_max", "u32"),  # rows per split partial in the workspace
        ("qk_scale", "float"),  # sm_scale * k_scale * 2^7 * log2(e)
        ("out_scale", "float"),  # v_scale * 2^7
        ("win_pages", "u32"), ("win_slots", "u32"),  # window: pages per sequence, slots
        ("rotate", "u32"),  # q rotated by the normalized Hadamard transform (rotation)
        ("win_k_mul", "float"), ("win_v_mul", "float"),  # window K/V -> decoded units
        ("_pad", "u32"),
    ),
    # kernels/varlen_attention.cu, every non-pointer argument of the varlen attention
    "VarlenParams": (
        ("buffer", "u64"), ("ws_o", "u64"), ("ws_ml", "u64"),  # u8 pool, f32 partials
        ("win", "u64"), ("win_map", "u64"),  # window slots (bf16), block -> slot (i32)
        ("counters", "u64"), ("stats", "u64"),  # u32 merge tickets [B*H], u64 counters
        ("num_blocks", "i64"), ("side_bytes", "i64"), ("data_bytes", "i64"),
        ("H", "u32"), ("group", "u32"),  # KV heads, query heads per KV head
        ("t", "FastDiv"),  # tokens per page
        ("max_blocks", "u32"),
        ("slots", "u32"),  # CTAs per (sequence, KV head): query tiles x splits
        ("max_splits", "u32"),  # splits per (sequence, KV head) of the workspace
        ("row_h", "u32"), ("row_t", "u32"),  # row of (t, h) in a side: h*row_h + t*row_t
        ("swizzle", "u32"), ("bt64", "u32"), ("sl64", "u32"), ("ql64", "u32"),
        ("causal", "u32"), ("smem", "u32"),  # bottom-right causal mask; dynamic smem bytes
        ("rows_lo", "u32"), ("rows_hi", "u32"),  # sequences of rows_lo < rows <= rows_hi
        ("items", "u32"),  # work items: B * H * slots
        ("num_tokens", "u32"),  # q's rows: query_start_loc is clamped to [0, num_tokens]
        ("qk_scale", "float"),  # sm_scale * k_scale * 2^7 * log2(e)
        ("out_scale", "float"),  # v_scale * 2^7
        ("win_pages", "u32"), ("win_slots", "u32"),  # window: pages per sequence, slots
        ("rotate", "u32"),  # q rotated by the normalized Hadamard transform (rotation)
        ("win_k_mul", "float"), ("win_v_mul", "float"),  # window / new K/V -> decoded units
        ("new_kind", "u32"),  # exact new tokens: NEW_KV_KINDS of new_k / new_v, 0: none
        ("new_k_ld", "u32"), ("new_v_ld", "u32"),  # their token strides (elements)
    ),
    # kernels/longlive.cu, where the blocks of a LongLive decode come from
    "LLSource": (
        ("value_ptrs", "u64"), ("sf_ptrs", "u64"), ("amax_ptrs", "u64"), ("ids", "u64"),
        ("vbase", "u64"), ("vstride", "u64"), ("sbase", "u64"), ("sstride", "u64"),
        ("abase", "u64"), ("astride", "u64"),
        ("n_pool", "i64"), ("ids64", "u32"), ("_pad", "u32"),
    ),
    # kernels/window.cu, every non-pointer argument of the window fill and copy
    "WindowParams": (
        ("buffer", "u64"), ("win", "u64"), ("win_map", "u64"),  # u8 pool, bf16 slots, i32 map
        ("staging", "u64"),  # copy: bf16 rows [n, 2*T*H*D] (workspace scratch)
        ("num_blocks", "i64"), ("side_bytes", "i64"), ("data_bytes", "i64"),
        ("total", "u32"),  # work items: pairs (entries) x groups per slot
        ("qg", "FastDiv"),  # groups per slot, 2*T*H*G
        ("g", "FastDiv"),  # G
        ("h", "FastDiv"),  # H
        ("t", "FastDiv"),  # T
        ("nhd", "u32"), ("swizzle", "u32"), ("swz_m", "u32"),
        ("win_slots", "u32"),  # S
        ("mode", "u32"),  # fill: 0 map_window (slots given, map written), 1 fill_window
        ("k_s", "float"), ("v_s", "float"),
    ),
    # kernels/page_copy.cu, every non-pointer argument of copy / read / write of whole pages
    "PageMoveParams": (
        ("buffer", "u64"), ("stats", "u64"),  # u8 pool, u64 counters
        ("tables", "u64"),  # copy: u32 pending, dst_of [num_blocks] each (zero at rest)
        ("staging", "u64"),  # copy: u8 rows [n, page_bytes] (workspace scratch)
        ("num_blocks", "i64"), ("page_bytes", "i64"), ("side_bytes", "i64"),
        ("data_bytes", "i64"),
        ("n", "u32"),  # pages moved
        ("_pad", "u32"),
    ),
}


def _field_bytes(f: tuple) -> tuple[int, int]:
    """(alignment, size) of field ``f``."""
    dt = np.dtype(_CTYPES[f[1]])
    return dt.alignment, dt.itemsize * (f[2] if len(f) == 3 else 1)


@cache
def fastdiv(d: int) -> tuple[np.uint32, np.uint32, np.uint32]:
    """``(d, m, s)`` of the device ``FastDiv`` (``kernels/fp4_common.cuh``: ``n / d`` as
    ``(umulhi(n, m) + n) >> s``) for the divisor ``1 <= d < 2**31``."""
    if not 1 <= d < 2**31:
        raise ValueError(f"divisor must be in [1, 2**31), got {d}")
    s = (d - 1).bit_length()
    m = ((1 << 32) * ((1 << s) - d)) // d + 1
    return np.uint32(d), np.uint32(m & 0xFFFFFFFF), np.uint32(s)


@cache
def struct_dtype(name: str) -> np.dtype:
    """The numpy dtype of struct ``name`` (C layout: natural alignment, ``align=True``).

    Raises ``AssertionError`` for a table that would need implicit padding."""
    fields, sizes = [], []
    for f in STRUCTS[name]:
        fields.append((f[0], _CTYPES[f[1]], (f[2],)) if len(f) == 3 else (f[0], _CTYPES[f[1]]))
        sizes.append(_field_bytes(f))
    dt = np.dtype(fields, align=True)
    assert all(a[0] >= b[0] for a, b in zip(sizes, sizes[1:])), f"{name}: order by alignment"
    assert dt.itemsize == sum(n for _, n in sizes), f"{name}: pad the tail explicitly"
    return dt


@cache
def header() -> str:
    """The C text of every constant and struct above, with layout checks."""
    out = ["// Generated by fp4cache/_abi.py: the one definition of these values."]
    out += [f"#define FP4C_RULE_{k.upper()} {v}" for k, v in RULES.items()]
    out += [f"#define FP4C_LAYOUT_{k} {v}" for k, v in LAYOUTS.items()]
    out += [f"#define FP4C_STAT_{k.upper()} {i}" for i, k in enumerate(STAT_NAMES)]
    out.append(f"#define FP4C_NUM_STATS {len(STAT_NAMES)}")
    sat_bits = int(np.float32(SCALE_SATURATES_ABOVE).view(np.uint32))
    out.append(f"#define FP4C_SCALE_SATURATES_ABOVE_BITS {sat_bits:#010x}u  "
               f"// float32 {SCALE_SATURATES_ABOVE:g}")
    out += [f"#define FP4C_DECODE_CHUNKS {DECODE_CHUNKS}",
            f"#define FP4C_SCAN_MAX_TOKENS {SCAN_MAX_TOKENS}",
            f"#define FP4C_LL_WIDE_TILES {LL_WIDE_TILES}",
            f"#define FP4C_ATTN_WARPS {ATTN_WARPS}",
            f"#define FP4C_ATTN_MAX_SPLITS {ATTN_MAX_SPLITS}",
            f"#define FP4C_PAIR_SCALE_SHIFT {PAIR_SCALE_SHIFT}"]
    # pair_scale's f16x2 multiplier of the bit route (codes e2m1 * 2^-14, scales |sf| *
    # 2^-8; the E4M3 route needs none: kernels/attn_dequant.cuh, FP4C_ROUTE_UNSCALE)
    for name, exp in (("BITS", 8 + 14),):
        bits = int(np.float16(2.0 ** (exp - PAIR_SCALE_SHIFT)).view(np.uint16)) * 0x10001
        out.append(f"#define FP4C_PAIR_SCALE_{name} {bits:#010x}u  "
                   f"// f16x2 2^{exp - PAIR_SCALE_SHIFT}")
    out += [f"#define FP4C_ATTN_CHUNK_TILES_D{d} {t}" for d, t in ATTN_CHUNK_TILES.items()]
    out.append(f"#define FP4C_COPY_UNROLL {COPY_UNROLL}")
    out.append(f"#define FP4C_COPY_MIN_CTAS {COPY_MIN_CTAS}")
    out.append(f"#define FP4C_COPY_TABLES {COPY_TABLES}")
    out.append(f"#define FP4C_PAGE_MOVE_THREADS {PAGE_MOVE_THREADS}")
    out += [f"#define FP4C_MMA_ROWS {MMA_ROWS}", f"#define FP4C_VARLEN_WARPS {VARLEN_WARPS}",
            f"#define FP4C_VARLEN_TILE_KEYS {VARLEN_TILE_KEYS}",
            f"#define FP4C_VARLEN_MAX_SPLITS {VARLEN_MAX_SPLITS}",
            f"#define FP4C_VARLEN_MIN_SPLIT {VARLEN_MIN_SPLIT}",
            *(f"#define FP4C_NEW_{k.upper()} {v}" for k, v in NEW_KV_KINDS.items()),
            f"#define FP4C_VARLEN_SMEM_PAD {VARLEN_SMEM_PAD}",
            f"#define FP4C_VARLEN_WG_ROW_WARPS {VARLEN_WG_ROW_WARPS}",
            f"#define FP4C_VARLEN_WG_DECODE_WARPS {VARLEN_WG_DECODE_WARPS}",
            "#define FP4C_VARLEN_WG_GEOMETRY(X) " + " ".join(
                f"X({d}, {step}, {ks}, {vs})"
                for d, (step, ks, vs) in VARLEN_WG_GEOMETRY.items())]
    fd = _CTYPES["FastDiv"]
    out.append("struct FastDiv {")
    out += [f"  {t} {n};" for n, t in FASTDIV_FIELDS]
    out.append("};")
    out.append(f'static_assert(sizeof(FastDiv) == {fd.itemsize}, "FastDiv: padding");')
    for name, fields in STRUCTS.items():
        dt = struct_dtype(name)
        out.append(f"struct {name} {{")
        for f in fields:
            out.append(f"  {f[1]} {f[0]}{f'[{f[2]}]' if len(f) == 3 else ''};")
        out.append("};")
        out.append(f'static_assert(sizeof({name}) == {dt.itemsize}, "{name}: padding");')
        for f in fields:
            out.append(f"static_assert(sizeof({name}::{f[0]}) == {_field_bytes(f)[1]}, "
                       f'"{name}.{f[0]}: size");')
    return "\n".join(out) + "\n"
