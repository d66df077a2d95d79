"""Run-time compilation of the CUDA kernels in ``kernels/`` (NVRTC).

The ``.cu`` files define each kernel family as a template plus an
``FP4C_*_KERNEL(NAME, ...)`` macro that stamps out one ``extern "C"`` kernel.  A
:class:`Spec` names one specialization (value type, rule, index type, vectorized
or scalar memory access); the loader builds a translation unit from

* a ``#define FP4C_INSTANTIATIONS`` preamble listing the wanted specializations,
* the ``.cu`` text with every ``#include "x.cuh"`` of the kernel folder inlined
  (CuPy's on-disk cache keys on the source text only, so headers must be part of
  it), framed by ``#line`` directives so that NVRTC messages name the real files,

and compiles it with ``cupy.RawModule``, memoized per device and specialization.  A
``#include "fp4c_abi.cuh"`` is answered with :func:`fp4cache._abi.header` (constants and
by-value structs shared with the host, with layout checks).  The kernels have no tuning
macros: the values that were measured are constants of the code, those the host needs too
in :mod:`fp4cache._abi`.  A variant that must stay testable (the attention's sm_80 decode
route on a newer GPU) is a named argument of its spec builder and part of the
:class:`Spec` (``defines``): a kernel's identity includes it.
:func:`compile_all` compiles every specialization with the low-level NVRTC API for
a given architecture; it needs no GPU and no CuPy (used by the CPU test suite): NVRTC
through CuPy where it is installed, else through ``cuda.bindings`` (:data:`NVRTC_BACKENDS`).
A test-only kernel (``tests/kernels/``) is a :class:`Spec` with its own ``folder``.

Kernel names read like FlashInfer's: ``fp4cache_store_bf16_4over6_i64``,
``fp4cache_gather_f16_i32``, with a ``_scalar`` suffix for the variant that makes
no alignment assumption.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import NamedTuple

import ml_dtypes
import numpy as np

from . import _abi

__all__ = [
    "NVRTC_OPTIONS",
    "Spec",
    "value_type",
    "kernel_dir",
    "build_source",
    "all_specs",
    "get_kernel",
    "compile_all",
    "compile_source",
    "compile_log",
    "nvrtc_available",
    "nvrtc_backends",
    "NVRTC_BACKENDS",
    "store_spec",
    "claim_spec",
    "clear_spec",
    "gather_spec",
    "window_fill_spec",
    "window_stage_spec",
    "window_write_spec",
    "quantize_spec",
    "dequantize_spec",
    "ll_amax_spec",
    "ll_quantize_spec",
    "ll_decode_spec",
    "ll_decode_wide_spec",
    "decode_attention_spec",
    "ATTN_ROW_TILES",
    "attn_row_tiles",
    "attn_max_rows",
    "DecodeAttnArgs",
    "decode_attention_args",
    "attention_head_dim",
    "page_mark_spec",
    "route_defines",
    "page_copy_spec",
    "page_read_spec",
    "page_write_spec",
    "varlen_attention_spec",
    "varlen_wgmma_spec",
    "arch_family",
]

#: Options of every compile: C++17, no FMA contraction (bit-exact float32 arithmetic).
NVRTC_OPTIONS: tuple[str, ...] = ("--std=c++17", "--fmad=false")
#: What CuPy appends to every NVRTC compile.  The kernels do their float32 arithmetic
#: in PTX without ``.ftz`` so that this flag cannot flush subnormals; :func:`compile_all`
#: compiles with it too, to check that no ``.ftz`` instruction is left.
CUPY_IMPLICIT_OPTIONS: tuple[str, ...] = ("-ftz=true",)
#: Most specializations :func:`compile_all` puts in one NVRTC call (its calls run in
#: threads: smaller modules spread the largest files over the CPUs).
COMPILE_ALL_CHUNK = 12

#: Kernel value types: short name -> C++ tag type.
VALUE_TYPES = {"bf16": "bf16_t", "f16": "f16_t", "f32": "f32_t"}
#: numpy dtype -> short name of its kernel value type.
DTYPE_NAMES = {np.dtype(ml_dtypes.bfloat16): "bf16", np.dtype(np.float16): "f16",
               np.dtype(np.float32): "f32"}


def value_type(dtype, what: str) -> str:
    """Short name of the kernel value type of ``dtype`` (the dtype of argument ``what``);
    ``ValueError`` naming the dtype for any other."""
    name = DTYPE_NAMES.get(np.dtype(dtype))
    if name is None:
        raise ValueError(f"{what} must be bfloat16, float16 or float32, got {np.dtype(dtype)}")
    return name


#: Index types of slot_mapping / block ids: short name -> C++ type.
INDEX_TYPES = {"i32": "int", "i64": "i64"}
#: Scale rules: name -> the macro holding the RULE template parameter's value.
RULES = {name: f"FP4C_RULE_{name.upper()}" for name in _abi.RULES}
#: The virtual header that carries :func:`fp4cache._abi.header`.
ABI_HEADER = "fp4c_abi.cuh"

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


def kernel_dir() -> Path:
    """Folder holding the ``.cu`` / ``.cuh`` files.

    An installed wheel carries them in ``fp4cache/kernels``; a source checkout has
    them in the top-level ``kernels/`` folder.
    """
    here = Path(__file__).resolve().parent
    for cand in (here / "kernels", here.parent / "kernels"):
        if (cand / "fp4_common.cuh").is_file():
            return cand
    raise FileNotFoundError(
        f"fp4cache kernel sources not found in {here / 'kernels'} or {here.parent / 'kernels'}"
    )


@dataclass(frozen=True)
class Spec:
    """One kernel specialization: file, stamping macro, kernel name, macro arguments, the
    macros its translation unit defines (a variant's switch, e.g. ``FP4C_ATTN_BITMOVE``),
    where the host reads them back the builder's arguments by name (``params``), the
    folder of ``file`` (``None``: the shipped :func:`kernel_dir`; a test kernel's folder
    otherwise, whose includes are looked up there first, then in :func:`kernel_dir`) and
    the one architecture it is compiled for (``"sm_90a"``: it uses features of that
    architecture only; ``None``: the device's)."""

    file: str
    macro: str
    name: str
    args: tuple[str, ...]
    defines: tuple[tuple[str, int], ...] = ()
    params: tuple | None = None
    folder: str | None = None
    arch: str | None = None

    @property
    def instantiation(self) -> str:
        """The macro call that defines this kernel."""
        return f"{self.macro}({', '.join((self.name,) + self.args)})"


def _vec(vec: bool) -> tuple[str, str]:
    return ("1" if vec else "0"), ("" if vec else "_scalar")


def store_spec(dtype: str, rule: str, slot: str, vec: bool = True, pair: bool = False,
               rot: bool = False, win: bool = False) -> Spec:
    """Paged store of K and V (``dtype`` in bf16/f16/f32, ``slot`` in i32/i64); ``pair``:
    each thread encodes one group of two heads, h and h + H/2, of a token (needs H even);
    ``rot``: K rotated by the Hadamard transform first (``_rot``; head_dim a power of two);
    ``win``: the values of mapped pages also go to the exact window (``_win``)."""
    v, sfx = _vec(vec)
    name = (f"fp4cache_store_{dtype}_{rule}_{slot}{'_pair' if pair else ''}"
            f"{'_rot' if rot else ''}{'_win' if win else ''}{sfx}")
    return Spec("paged_kv.cu", "FP4C_STORE_KERNEL", name,
                (VALUE_TYPES[dtype], RULES[rule], INDEX_TYPES[slot], v, "2" if pair else "1",
                 "true" if rot else "false", "true" if win else "false"))


def claim_spec(slot: str) -> Spec:
    """Duplicate-slot claim pre-pass of the store ("last occurrence wins")."""
    return Spec("paged_kv.cu", "FP4C_CLAIM_KERNEL", f"fp4cache_claim_{slot}",
                (INDEX_TYPES[slot],))


def clear_spec(slot: str) -> Spec:
    """The pass after such a store that zeroes the claim entries again."""
    return Spec("paged_kv.cu", "FP4C_CLEAR_KERNEL", f"fp4cache_claim_clear_{slot}",
                (INDEX_TYPES[slot],))


#: (value type, rule) pairs whose store gives each thread the same group of two heads
#: (h and h + H/2) of one token when H is even (``kernels/paged_kv.cu``, NH = 2): 16-bit
#: inputs with static6, measured faster on the H200 (docs/kernels.md); 4over6
#: and float32 inputs would need too many registers.
STORE_PAIR = frozenset({("bf16", "static6"), ("f16", "static6")})


def gather_spec(dtype: str, block: str, vec: bool = True, rot: bool = False) -> Spec:
    """Paged gather + dequantize of K and V into ``dtype`` rows; ``rot``: K rotated back by
    the Hadamard transform (``_rot``, one thread per group)."""
    v, sfx = _vec(vec)
    if rot:
        return Spec("paged_kv.cu", "FP4C_GATHER_ROT_KERNEL",
                    f"fp4cache_gather_{dtype}_{block}_rot{sfx}",
                    (VALUE_TYPES[dtype], INDEX_TYPES[block], v))
    return Spec("paged_kv.cu", "FP4C_GATHER_KERNEL", f"fp4cache_gather_{dtype}_{block}{sfx}",
                (VALUE_TYPES[dtype], INDEX_TYPES[block], v))


def window_fill_spec(ids: str, aligned: bool = True) -> Spec:
    """map_window / fill_window: window slots filled from their pages (``ids`` the id type;
    ``aligned``: 8-byte code loads, else ``_scalar``)."""
    v, sfx = _vec(aligned)
    return Spec("window.cu", "FP4C_WINDOW_FILL_KERNEL", f"fp4cache_window_fill_{ids}{sfx}",
                (INDEX_TYPES[ids], v))


def window_stage_spec(ids: str) -> Spec:
    """copy_window, launch 1: the source slots of the pairs into staging rows."""
    return Spec("window.cu", "FP4C_WINDOW_STAGE_KERNEL", f"fp4cache_window_stage_{ids}",
                (INDEX_TYPES[ids],))


def window_write_spec(ids: str, aligned: bool = True) -> Spec:
    """copy_window, launch 2: the destination slots, from staging or from their pages."""
    v, sfx = _vec(aligned)
    return Spec("window.cu", "FP4C_WINDOW_WRITE_KERNEL", f"fp4cache_window_write_{ids}{sfx}",
                (INDEX_TYPES[ids], v))


def quantize_spec(dtype: str, rule: str, vec: bool = True) -> Spec:
    """Flat ``[N, D]`` quantize."""
    v, sfx = _vec(vec)
    return Spec("flat_codec.cu", "FP4C_QUANTIZE_KERNEL", f"fp4cache_quantize_{dtype}_{rule}{sfx}",
                (VALUE_TYPES[dtype], RULES[rule], v))


def dequantize_spec(dtype: str, vec: bool = True) -> Spec:
    """Flat ``[N, D]`` dequantize into ``dtype``."""
    v, sfx = _vec(vec)
    return Spec("flat_codec.cu", "FP4C_DEQUANTIZE_KERNEL", f"fp4cache_dequantize_{dtype}{sfx}",
                (VALUE_TYPES[dtype], v))


def ll_amax_spec(dtype: str, vec: bool = True) -> Spec:
    """LongLive block amax reduction."""
    v, sfx = _vec(vec)
    return Spec("longlive.cu", "FP4C_AMAX_KERNEL", f"fp4cache_longlive_amax_{dtype}{sfx}",
                (VALUE_TYPES[dtype], v))


def ll_quantize_spec(dtype: str, rule: str, vec: bool = True) -> Spec:
    """LongLive per-block quantize into the blocked layout."""
    v, sfx = _vec(vec)
    return Spec("longlive.cu", "FP4C_LL_QUANTIZE_KERNEL",
                f"fp4cache_longlive_quantize_{dtype}_{rule}{sfx}",
                (VALUE_TYPES[dtype], RULES[rule], v))


def ll_decode_spec(dtype: str, vec: bool = True) -> Spec:
    """LongLive pool decode through device pointer tables."""
    v, sfx = _vec(vec)
    return Spec("longlive.cu", "FP4C_LL_DECODE_KERNEL", f"fp4cache_longlive_decode_{dtype}{sfx}",
                (VALUE_TYPES[dtype], v))


def ll_decode_wide_spec(dtype: str) -> Spec:
    """LongLive decode, 16-byte code loads (bf16/f16 out, 16-byte aligned blocks)."""
    return Spec("longlive.cu", "FP4C_LL_DECODE_WIDE_KERNEL",
                f"fp4cache_longlive_decode_wide_{dtype}", (VALUE_TYPES[dtype],))


#: head_dim values of the decode-attention kernels (register tiles are sized at compile time).
ATTN_HEAD_DIMS = (64, 128, 256)


#: How the attention kernels turn E2M1 codes and E4M3 scales into f16 pairs
#: (``kernels/attn_dequant.cuh``): "auto" takes the E4M3 conversion instructions on sm_89+
#: and bit moves below; "bitmove" takes the bit moves on every GPU (so that a newer GPU
#: can test the sm_80 route).
DECODE_ROUTES = ("auto", "bitmove")
#: Which kernel ``PagedKVCache.attention`` takes for sequences of more than 64 rows
#: (``fp4cache._cuda.varlen``): "auto" the wgmma kernel (``kernels/varlen_wgmma.cu``) where
#: it applies (an sm_90 device, bf16 / f16 q, head_dim in ``_abi.VARLEN_WG_HEAD_DIMS``, no
#: window or rotation), else the 128-row mma.sync kernel; "mma" the mma.sync kernel on every
#: GPU (so that an sm_90 device can test and time the sm_80 route).
PREFILL_ROUTES = ("auto", "mma")
#: q/out value types of the wgmma kernel (16-bit: q converts to f16 exactly).
VARLEN_WG_DTYPES = ("bf16", "f16")


class DecodeAttnArgs(NamedTuple):
    """The arguments of a :func:`decode_attention_spec` specialization."""

    dtype: str
    head_dim: int
    tiles: int
    paged16: bool
    decode_route: str


def route_defines(decode_route: str) -> tuple[tuple[str, int], ...]:
    """The macros of a :data:`DECODE_ROUTES` entry (the ``defines`` of a :class:`Spec`)."""
    if decode_route not in DECODE_ROUTES:
        raise ValueError(f"decode_route must be one of {DECODE_ROUTES}, got {decode_route!r}")
    return (("FP4C_ATTN_BITMOVE", 1),) if decode_route == "bitmove" else ()


#: n8 MMA tiles of query rows of the few-row attention kernel (``decode_attention.cu``):
#: up to 8, 16 or 32 rows per (sequence, KV head); kernel name suffix of each.
ATTN_ROW_TILES: dict[int, str] = {1: "", 2: "_wide", 4: "_wide4"}
#: q / out value types and head dims of the four-tile form (q's fragments in shared
#: memory: 16-bit q; its O accumulators, 128 registers at head_dim 128: not 256).
ATTN_WIDE4_DTYPES = ("bf16", "f16")
ATTN_WIDE4_HEAD_DIMS = (64, 128)


def attn_max_rows(dtype: str, head_dim: int) -> int:
    """Most query rows per (sequence, KV head) of the few-row attention kernel for ``dtype``
    q and ``head_dim``: 32 where its four-tile form applies, else 16."""
    wide4 = dtype in ATTN_WIDE4_DTYPES and head_dim in ATTN_WIDE4_HEAD_DIMS
    return 8 * (4 if wide4 else 2)


def attn_row_tiles(rows: int) -> int:
    """The fewest n8 tiles of :data:`ATTN_ROW_TILES` that hold ``rows`` query rows."""
    for tiles in ATTN_ROW_TILES:
        if rows <= 8 * tiles:
            return tiles
    raise ValueError(f"rows must be at most {8 * max(ATTN_ROW_TILES)}, got {rows}")


def decode_attention_spec(dtype: str, head_dim: int, tiles: int, paged16: bool = True,
                          decode_route: str = "auto") -> Spec:
    """Fused paged decode attention over NVFP4 pages, ``dtype`` q/out (bf16/f16/f32).

    ``tiles``: n8 MMA tiles of query rows per (sequence, KV head), a key of
    :data:`ATTN_ROW_TILES`: 1 (1..8 rows), 2 (9..16, ``_wide`` in the kernel name) or 4
    (17..32, ``_wide4``; bf16 / f16 q, head_dim 64 / 128: :func:`attn_max_rows`); rows are
    query heads of the group for decode and (query token, head) pairs for
    ``PagedKVCache.attention`` with few tokens per sequence; ``paged16``: the block size
    is a multiple of 16,
    so every 16-token tile lies in one page (``_paged16``, ``PAGED16``; else the kernel
    finds each token's page);
    ``decode_route``: one of :data:`DECODE_ROUTES` (``_bitmove`` in the kernel name)."""
    if head_dim not in ATTN_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {ATTN_HEAD_DIMS}, got {head_dim}")
    if tiles not in ATTN_ROW_TILES or isinstance(tiles, bool):
        raise ValueError(f"tiles must be one of {tuple(ATTN_ROW_TILES)}, got {tiles!r}")
    if 8 * tiles > attn_max_rows(dtype, head_dim):
        raise ValueError(f"tiles {tiles} needs q of {ATTN_WIDE4_DTYPES} and head_dim in "
                         f"{ATTN_WIDE4_HEAD_DIMS}, got {dtype}, {head_dim}")
    defines = route_defines(decode_route)
    name = (f"fp4cache_decode_attn_{dtype}_d{head_dim}{ATTN_ROW_TILES[tiles]}"
            f"{'_paged16' if paged16 else ''}{'_bitmove' if defines else ''}")
    return Spec("decode_attention.cu", "FP4C_ATTN_KERNEL", name,
                (VALUE_TYPES[dtype], str(head_dim), str(tiles),
                 "true" if paged16 else "false"), defines,
                DecodeAttnArgs(dtype, head_dim, tiles, paged16, decode_route))


def decode_attention_args(spec: Spec) -> DecodeAttnArgs:
    """The named arguments of a :func:`decode_attention_spec` specialization."""
    if not isinstance(spec.params, DecodeAttnArgs):
        raise ValueError(f"{spec.name} is not a decode_attention_spec specialization")
    return spec.params


def varlen_attention_spec(dtype: str, head_dim: int, row_warps: int,
                          window: bool = False) -> Spec:
    """Paged attention over NVFP4 pages for any query length (``kernels/varlen_attention.cu``),
    ``dtype`` q/out; ``row_warps`` in ``_abi.VARLEN_ROW_WARPS``: query rows per CTA are
    ``_abi.MMA_ROWS * row_warps``; ``window``: the variant with the exact window and the q
    rotation compiled in (``docs/window.md``, name suffix ``_win``), for a cache with either
    option (the plain kernel has neither's code)."""
    if head_dim not in ATTN_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {ATTN_HEAD_DIMS}, got {head_dim}")
    if row_warps not in _abi.VARLEN_ROW_WARPS:
        raise ValueError(f"row_warps must be one of {_abi.VARLEN_ROW_WARPS}, got {row_warps}")
    name = (f"fp4cache_varlen_attn_{dtype}_d{head_dim}_r{_abi.MMA_ROWS * row_warps}"
            f"{'_win' if window else ''}")
    return Spec("varlen_attention.cu", "FP4C_VARLEN_KERNEL", name,
                (VALUE_TYPES[dtype], str(head_dim), str(row_warps), "1" if window else "0"))


def varlen_wgmma_spec(dtype: str, head_dim: int) -> Spec:
    """The wgmma attention kernel (``kernels/varlen_wgmma.cu``, sm_90a only): the 128-row
    varlen kernel's work for ``dtype`` (bf16 / f16) q/out, ``head_dim`` a key of
    ``_abi.VARLEN_WG_GEOMETRY`` (the host routes those of ``_abi.VARLEN_WG_HEAD_DIMS``),
    without the window and the rotation."""
    if dtype not in VARLEN_WG_DTYPES:
        raise ValueError(f"dtype must be one of {VARLEN_WG_DTYPES}, got {dtype!r}")
    if head_dim not in _abi.VARLEN_WG_GEOMETRY:
        raise ValueError(f"head_dim must be one of {tuple(_abi.VARLEN_WG_GEOMETRY)}, "
                         f"got {head_dim}")
    return Spec("varlen_wgmma.cu", "FP4C_VARLEN_WG_KERNEL",
                f"fp4cache_varlen_wgmma_{dtype}_d{head_dim}",
                (VALUE_TYPES[dtype], str(head_dim)), arch="sm_90a")


def attention_head_dim(spec: Spec) -> int:
    """head_dim of a :func:`decode_attention_spec` specialization."""
    return decode_attention_args(spec).head_dim


#: Bytes per memory access of the page-moving kernels (a width divides the page size and
#: the alignment of the rows they read or write).
PAGE_VEC_BYTES = (16, 8, 4, 2, 1)


def _page_spec(macro: str, kind: str, ids: str, vw: int) -> Spec:
    if vw not in PAGE_VEC_BYTES:
        raise ValueError(f"vector width must be one of {PAGE_VEC_BYTES}, got {vw}")
    return Spec("page_copy.cu", macro, f"fp4cache_pages_{kind}_{ids}_v{vw}",
                (INDEX_TYPES[ids], str(vw)))


def page_mark_spec(ids: str) -> Spec:
    """copy_blocks, launch 1: count each page's readers, note each page's writer (``ids``
    the id type)."""
    return Spec("page_copy.cu", "FP4C_PAGE_MARK_KERNEL", f"fp4cache_pages_mark_{ids}",
                (INDEX_TYPES[ids],))


def page_copy_spec(ids: str, vw: int) -> Spec:
    """copy_blocks, launch 2: page dst[i] <- page src[i], directly or through a staging
    row, every read of a page before any write of it (``ids`` the id type, ``vw`` the
    bytes per access)."""
    return _page_spec("FP4C_PAGE_COPY_KERNEL", "copy", ids, vw)


def page_read_spec(ids: str, vw: int) -> Spec:
    """read_blocks: rows ``out[i]`` <- pages ``blocks[i]`` (raw bytes)."""
    return _page_spec("FP4C_PAGE_READ_KERNEL", "read", ids, vw)


def page_write_spec(ids: str, vw: int) -> Spec:
    """write_blocks: pages ``blocks[i]`` <- rows ``data[i]`` (raw bytes)."""
    return _page_spec("FP4C_PAGE_WRITE_KERNEL", "write", ids, vw)


def all_specs() -> list[Spec]:
    """Every specialization the backend can launch (and no other)."""
    specs: list[Spec] = []
    bools = (True, False)
    for dt in VALUE_TYPES:
        for vec in bools:
            for rule in RULES:
                for ix in INDEX_TYPES:
                    for rot in bools:
                        for win in bools:
                            specs.append(store_spec(dt, rule, ix, vec, rot=rot, win=win))
                            if (dt, rule) in STORE_PAIR:
                                specs.append(store_spec(dt, rule, ix, vec, True, rot, win))
                specs.append(quantize_spec(dt, rule, vec))
                specs.append(ll_quantize_spec(dt, rule, vec))
            specs += [gather_spec(dt, ix, vec, rot) for ix in INDEX_TYPES for rot in bools]
            specs.append(dequantize_spec(dt, vec))
            specs.append(ll_decode_spec(dt, vec))
            specs.append(ll_amax_spec(dt, vec))
    specs += [claim_spec(ix) for ix in INDEX_TYPES]
    specs += [clear_spec(ix) for ix in INDEX_TYPES]
    specs += [ll_decode_wide_spec(dt) for dt in ("bf16", "f16")]
    specs += [decode_attention_spec(dt, d, t, p) for dt in VALUE_TYPES for d in ATTN_HEAD_DIMS
              for t in ATTN_ROW_TILES if 8 * t <= attn_max_rows(dt, d) for p in (True, False)]
    specs += [page_mark_spec(ix) for ix in INDEX_TYPES]
    specs += [f(ix, a) for f in (window_fill_spec, window_write_spec) for ix in INDEX_TYPES
              for a in bools]
    specs += [window_stage_spec(ix) for ix in INDEX_TYPES]
    specs += [f(ix, vw) for f in (page_copy_spec, page_read_spec, page_write_spec)
              for ix in INDEX_TYPES for vw in PAGE_VEC_BYTES]
    specs += [varlen_attention_spec(dt, d, mw, win) for dt in VALUE_TYPES
              for d in ATTN_HEAD_DIMS for mw in _abi.VARLEN_ROW_WARPS for win in bools]
    specs += [varlen_wgmma_spec(dt, d) for dt in VARLEN_WG_DTYPES
              for d in _abi.VARLEN_WG_HEAD_DIMS]
    return specs


@cache
def _read_inlined(file: str, folder: str | None = None) -> str:
    """``file`` (in ``folder``, default :func:`kernel_dir`) with its local includes inlined
    once each, with ``#line`` framing; an include is looked up in ``folder``, then in
    :func:`kernel_dir`."""
    roots = list(dict.fromkeys([Path(folder) if folder else kernel_dir(), kernel_dir()]))
    seen: set[str] = set()

    def find(name: str) -> Path | None:
        return next((r / name for r in roots if (r / name).is_file()), None)

    def expand(name: str) -> list[str]:
        out = [f'#line 1 "{name}"']
        path = find(name)
        if path is None:
            raise FileNotFoundError(f"kernel source {name!r} not in {roots[0]}")
        lines = path.read_text().splitlines()
        for lineno, line in enumerate(lines, start=1):
            m = _INCLUDE.match(line)
            if m and m.group(1) == ABI_HEADER:
                out += [f'#line 1 "{ABI_HEADER}"', *_abi.header().splitlines(),
                        f'#line {lineno + 1} "{name}"']
            elif m:
                inc = m.group(1)
                if find(inc) is None:
                    where = " or ".join(str(r) for r in roots)
                    raise FileNotFoundError(f"{name}:{lineno}: include {inc!r} not in {where}")
                if inc not in seen:
                    seen.add(inc)
                    out += expand(inc)
                out.append(f'#line {lineno + 1} "{name}"')
            elif line.strip() == "#pragma once":
                out.append("")
            else:
                out.append(line)
        return out

    return "\n".join(expand(file)) + "\n"


def build_source(file: str, specs: list[Spec] | tuple[Spec, ...]) -> str:
    """Translation unit of ``file`` defining the kernels in ``specs`` (one variant, one
    folder)."""
    for s in specs:
        if s.file != file:
            raise ValueError(f"spec {s.name} belongs to {s.file}, not {file}")
    variants = {s.defines for s in specs}
    if len(variants) > 1:
        raise ValueError("specs of one translation unit must share their defines")
    if len({s.arch for s in specs}) > 1:
        raise ValueError("specs of one translation unit must share their architecture")
    folders = {s.folder for s in specs}
    if len(folders) > 1:
        raise ValueError("specs of one translation unit must share their folder")
    folder = folders.pop() if specs else None
    defines = "".join(f"#define {k} {v}\n" for k, v in sorted(variants.pop() if specs else ()))
    body = " \\\n    ".join(s.instantiation for s in specs)
    preamble = (f"// fp4cache specializations\n{defines}"
                f"#define FP4C_INSTANTIATIONS \\\n    {body}\n")
    return preamble + _read_inlined(file, folder)


def common_source() -> str:
    """``fp4_common.cuh``, inlined: a prefix for test kernels that call the shared device
    functions directly."""
    return _read_inlined("fp4_common.cuh")


# Compiled kernels per (device, spec), like ``cupy.memoize(for_each_device=True)``: the
# one memo of the library (launch plans live with their owners).
_FUNCS: dict[tuple[int, Spec], object] = {}


def get_kernel(spec: Spec):
    """Compiled ``cupy.RawKernel`` of ``spec`` on the current device (memoized)."""
    import cupy

    key = (cupy.cuda.runtime.getDevice(), spec)
    fn = _FUNCS.get(key)
    if fn is None:
        opts = NVRTC_OPTIONS + ((f"--gpu-architecture={spec.arch}",) if spec.arch else ())
        mod = cupy.RawModule(code=build_source(spec.file, [spec]), options=opts)
        fn = _FUNCS.setdefault(key, mod.get_function(spec.name))
    return fn


#: The NVRTC front ends :func:`compile_source` can use, in the order it tries them: CuPy's
#: (the compiler :func:`get_kernel` runs) and NVIDIA's ``cuda.bindings.nvrtc`` (package
#: ``cuda-bindings``, the library from the ``nvidia-cuda-nvrtc-cu12`` wheel, found by
#: ``cuda.pathfinder``): the kernels compile and their ABI checks run where CuPy is not
#: installed (a CPU-only test run).
NVRTC_BACKENDS: tuple[str, ...] = ("cupy", "cuda-bindings")


class _NvrtcFailed(Exception):
    """A compile that NVRTC rejected; the argument is its log."""


def _text(b) -> str:
    return (b.decode() if isinstance(b, bytes) else b).rstrip("\0")


def _compile_cupy(source: str, name: str, options: tuple[str, ...],
                  want_ptx: bool) -> tuple[str | None, str]:
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(source, name, (), ())
    try:
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as exc:
            raise _NvrtcFailed(_text(nvrtc.getProgramLog(prog))) from exc
        log = _text(nvrtc.getProgramLog(prog))
        return (_text(nvrtc.getPTX(prog)) if want_ptx else None), log
    finally:
        nvrtc.destroyProgram(prog)


def _compile_bindings(source: str, name: str, options: tuple[str, ...],
                      want_ptx: bool) -> tuple[str | None, str]:
    from cuda.bindings import nvrtc

    ok = nvrtc.nvrtcResult.NVRTC_SUCCESS

    def check(res):
        if res[0] != ok:
            raise RuntimeError(f"NVRTC (cuda.bindings): {res[0]!r} on {name}")
        return res[1] if len(res) > 1 else None

    def read(size_fn, get_fn) -> str:
        buf = b" " * check(size_fn(prog))
        check(get_fn(prog, buf))
        return _text(buf)

    prog = check(nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []))
    try:
        opts = [o.encode() for o in options]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        log = read(nvrtc.nvrtcGetProgramLogSize, nvrtc.nvrtcGetProgramLog)
        if err != ok:
            raise _NvrtcFailed(log)
        return (read(nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX) if want_ptx else None), log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


_COMPILERS = {"cupy": _compile_cupy, "cuda-bindings": _compile_bindings}


def _usable(backend: str) -> bool:
    try:
        if backend == "cupy":
            from cupy.cuda import nvrtc

            nvrtc.getVersion()
        else:
            from cuda.bindings import nvrtc

            if nvrtc.nvrtcVersion()[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
                return False
        return True
    except Exception:  # noqa: BLE001 - ImportError, a missing libnvrtc, ...
        return False


@cache
def nvrtc_backends() -> tuple[str, ...]:
    """The entries of :data:`NVRTC_BACKENDS` that work here (importable, libnvrtc found)."""
    return tuple(b for b in NVRTC_BACKENDS if _usable(b))


def nvrtc_available() -> bool:
    """Whether :func:`compile_source` can compile here (no GPU needed)."""
    return bool(nvrtc_backends())


def _compile(source: str, name: str, options: tuple[str, ...], want_ptx: bool,
             backend: str | None, what: str) -> tuple[str | None, str]:
    if backend is None:
        have = nvrtc_backends()
        if not have:
            raise RuntimeError("no NVRTC here: install cupy-cuda12x, or cuda-bindings and "
                               "nvidia-cuda-nvrtc-cu12 (fp4cache[test])")
        backend = have[0]
    elif backend not in _COMPILERS:
        raise ValueError(f"backend must be one of {NVRTC_BACKENDS}, got {backend!r}")
    try:
        return _COMPILERS[backend](source, name, options, want_ptx)
    except _NvrtcFailed as exc:
        raise RuntimeError(f"NVRTC failed on {name} for {what}:\n{exc.args[0]}") from None


def compile_source(source: str, name: str, arch: str, extra: tuple[str, ...] = (),
                   backend: str | None = None) -> str:
    """Compile ``source`` with NVRTC for ``arch`` (e.g. ``"sm_90"``); return the PTX.

    ``backend``: one of :data:`NVRTC_BACKENDS` (default: the first that works here).
    Raises ``RuntimeError`` with the compiler log when the compile fails.
    """
    opts = NVRTC_OPTIONS + (f"--gpu-architecture={arch.replace('sm_', 'compute_')}",) + extra
    return _compile(source, name, opts, True, backend, arch)[0]


def compile_log(source: str, name: str, arch: str, extra: tuple[str, ...] = (),
                backend: str | None = None) -> str:
    """Compile ``source`` to machine code of ``arch`` (e.g. ``"sm_90"``, through ptxas);
    return NVRTC's log (with ``extra=("-Xptxas", "-v")`` ptxas' register and spill lines).

    Raises ``RuntimeError`` with the compiler log when the compile fails.
    """
    opts = NVRTC_OPTIONS + (f"--gpu-architecture={arch}",) + extra
    return _compile(source, name, opts, False, backend, arch)[1]


def arch_family(arch: str) -> str:
    """The architecture an arch-specific target belongs to: ``"sm_90a"`` -> ``"sm_90"``."""
    return arch[:-1] if arch.endswith("a") else arch


def compile_all(arch: str = "sm_90", specs: list[Spec] | None = None,
                backend: str | None = None) -> dict[str, str]:
    """Compile every specialization for ``arch`` without a GPU (NVRTC calls of at most
    :data:`COMPILE_ALL_CHUNK` specializations of one file and variant, in threads, one per
    CPU: NVRTC releases the GIL; ``backend`` as for :func:`compile_source`); a spec of an
    arch-specific target (``Spec.arch``, e.g. ``"sm_90a"``) is compiled for that target
    with the architecture it belongs to (:func:`arch_family`) and left out for the others.

    Returns ``{file: ptx}`` (a file's modules in a fixed order).  Raises ``RuntimeError``
    with the compiler log on failure and ``RuntimeError`` if a kernel is missing from the
    PTX.
    """
    specs = [s for s in (all_specs() if specs is None else specs)
             if s.arch is None or arch_family(s.arch) == arch]
    by_file: dict[tuple[str, str, tuple, str], list[Spec]] = {}
    for s in specs:
        by_file.setdefault((s.file, s.folder or "", s.defines, s.arch or ""), []).append(s)
    jobs = [(file, own or arch, group[i:i + COMPILE_ALL_CHUNK])
            for (file, _, _, own), group in sorted(by_file.items())
            for i in range(0, len(group), COMPILE_ALL_CHUNK)]

    def one(job: tuple[str, str, list[Spec]]) -> str:
        file, target, chunk = job
        ptx = compile_source(build_source(file, chunk), file, target, CUPY_IMPLICIT_OPTIONS,
                             backend)
        for s in chunk:
            if f".entry {s.name}(" not in ptx:
                raise RuntimeError(f"kernel {s.name} missing from the PTX of {file}")
        return ptx

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        ptxs = list(pool.map(one, jobs))
    out: dict[str, str] = {}
    for (file, _, _), ptx in zip(jobs, ptxs):
        out[file] = out.get(file, "") + ptx
    return out
