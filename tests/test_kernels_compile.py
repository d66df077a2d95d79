"""Every kernel specialization compiles with NVRTC for sm_80 and sm_90 (no GPU needed).

NVRTC comes from CuPy or, where CuPy is not installed (a CPU-only run), from
``cuda-bindings`` with the ``nvidia-cuda-nvrtc-cu12`` wheel (both in the ``test`` extra):
these tests run, not skip, without CuPy.  Also checks the loader's source assembly:
includes are inlined with ``#line`` directives (so compiler messages name the real files),
kernel names are the readable ``fp4cache_*`` ones, and the specialization list covers
every family.
"""

from __future__ import annotations

import re

import pytest

from fp4cache import _kernels as K

needs_nvrtc = pytest.mark.skipif(not K.nvrtc_available(),
                                 reason="no NVRTC: neither CuPy nor cuda-bindings with libnvrtc")


#: the attention kernels' split set (struct SplitSet: 3 pointers, 4 u32), passed by reference
#: to the merge, which is not inlined (attn_state.cuh, merge_splits): their only stack
SPLIT_SET_BYTES = 40


def local_depots(ptx: str) -> list[int]:
    """Sizes of the stack frames (``__local_depot``) of the functions in ``ptx``."""
    return [int(n) for n in re.findall(r"\.local \.align \d+ \.b8\s+__local_depot\d+\[(\d+)\]",
                                       ptx)] or [0]


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_all_specializations_compile(arch):
    ptx = K.compile_all(arch)
    # the wgmma kernel is compiled for sm_90a, with the sm_90 specializations
    assert set(ptx) == {"paged_kv.cu", "flat_codec.cu", "longlive.cu", "decode_attention.cu",
                        "page_copy.cu", "varlen_attention.cu", "window.cu"} | (
                            {"varlen_wgmma.cu"} if arch == "sm_90" else set())
    names = {s.name for s in K.all_specs() if s.arch is None or K.arch_family(s.arch) == arch}
    found = {n for n in names for text in ptx.values() if f".entry {n}(" in text}
    assert found == names
    assert "dequant_table" not in ptx["decode_attention.cu"]  # test kernels: tests only
    for file, text in ptx.items():
        # no local memory (stack) in any kernel: register arrays stay in registers; the one
        # exception is the attention kernels' split set (local_depots)
        if file in ("decode_attention.cu", "varlen_attention.cu", "varlen_wgmma.cu"):
            assert max(local_depots(text)) == SPLIT_SET_BYTES, file
        else:
            assert ".local" not in text, file
        # compiled with CuPy's -ftz=true, still no flush-to-zero instruction anywhere but
        # the attention's softmax exponent (weights below 2^-126 of the row maximum are 0)
        if file in ("decode_attention.cu", "varlen_attention.cu", "varlen_wgmma.cu"):
            assert "ex2.approx.ftz.f32" in text
            text = text.replace("ex2.approx.ftz.f32", "")
        assert ".ftz" not in text


@needs_nvrtc
def test_wgmma_kernel_assembles_for_every_head_dim_it_compiles_for():
    """The wgmma kernel for every head dim of ``_abi.VARLEN_WG_GEOMETRY`` (the host routes
    those of ``_abi.VARLEN_WG_HEAD_DIMS``), head_dim 256 included (steps of 32 keys, m64n32
    scores; each decode warp takes a quarter of a key block's columns; the P V of 256
    columns as two m64n128 MMAs): NVRTC's PTX has no stack but the split set, and ptxas
    assembles it for sm_90a (it refuses an instruction whose operands exceed the launch's
    128 registers per thread, as an m64n256 MMA's 128 accumulators would) without
    serializing the MMAs (C7512 / C7515, where NVRTC prints ptxas' report: 12.x)."""
    from fp4cache import _abi

    assert set(_abi.VARLEN_WG_HEAD_DIMS) <= set(_abi.VARLEN_WG_GEOMETRY)
    for d in _abi.VARLEN_WG_GEOMETRY:
        specs = [K.varlen_wgmma_spec(dt, d) for dt in K.VARLEN_WG_DTYPES]
        ptx = K.compile_all("sm_90", specs)["varlen_wgmma.cu"]
        assert all(f".entry {s.name}(" in ptx for s in specs), d
        assert max(local_depots(ptx)) == SPLIT_SET_BYTES, d
        log = K.compile_log(K.build_source("varlen_wgmma.cu", specs[:1]), "varlen_wgmma.cu",
                            "sm_90a", ("-Xptxas", "-v") + K.CUPY_IMPLICIT_OPTIONS)
        assert "error" not in log.lower() and "Potential Performance Loss" not in log, log


@needs_nvrtc
def test_page_copy_streams_through_l2_without_shared_staging():
    """copy_blocks' copy kernel reads the pool and the staging rows from L2 (other CTAs of
    the launch write them: never through the non-coherent read-only path) and holds no
    page bytes in shared memory (no limit on the pages of a call)."""
    import re

    specs = [K.page_mark_spec("i32"), K.page_copy_spec("i32", 16), K.page_copy_spec("i64", 1)]
    ptx = K.compile_all("sm_90", specs)["page_copy.cu"]
    for spec in specs[1:]:
        body = re.search(rf"\.entry {spec.name}\(.*?\n}}\n", ptx, re.S).group(0)
        assert ".extern .shared" not in body
        wide = "v4.u32" if spec.args[1] == "16" else "u8"
        assert f"ld.global.cg.{wide}" in body and f"ld.global.nc.{wide}" not in body
        assert "atom.global.add.u32" in body and "membar.gl" in body


@needs_nvrtc
def test_page_copy_fits_its_launch_bounds_without_spills():
    """The copy kernel streams pages with 4 CTAs of 512 threads per SM (COPY_MIN_CTAS): at
    most 32 registers and no spills (ptxas, sm_90).  Unbounded it took up to 98 registers,
    one CTA per SM."""
    import re

    from fp4cache import _abi

    specs = [K.page_copy_spec(ix, vw) for ix in K.INDEX_TYPES for vw in K.PAGE_VEC_BYTES]
    log = K.compile_log(K.build_source("page_copy.cu", specs), "page_copy.cu", "sm_90",
                        ("-Xptxas", "-v") + K.CUPY_IMPLICIT_OPTIONS)
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", log)]
    spills = [int(b) for b in re.findall(r"(\d+) bytes spill stores", log)]
    if not regs and _nvrtc_version(K.nvrtc_backends()[0])[0] >= 13:
        pytest.skip("NVRTC 13 prints no ptxas report for -Xptxas -v (NVRTC 12, the test "
                    "extra's, does)")
    assert len(regs) == len(specs) and len(spills) == len(specs), log
    assert max(regs) <= 65536 // (_abi.PAGE_MOVE_THREADS * _abi.COPY_MIN_CTAS), log
    assert not any(spills), log


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_bitmove_route_compiles(arch):
    """The variant only the GPU tests build: the sm_80 decode route forced on a newer GPU
    (decode_route="bitmove"; the test-only table kernels: test_kernel_tables.py)."""
    specs = [K.decode_attention_spec(dt, d, t, p, decode_route="bitmove")
             for dt in ("bf16", "f32") for d in K.ATTN_HEAD_DIMS for t in K.ATTN_ROW_TILES
             if 8 * t <= K.attn_max_rows(dt, d) for p in (True, False)]
    ptx = K.compile_all(arch, specs)["decode_attention.cu"]
    assert max(local_depots(ptx)) == SPLIT_SET_BYTES
    # the bit route has no E4M3 conversion, on any architecture
    assert "e4m3x2" not in ptx


@needs_nvrtc
@pytest.mark.parametrize("backend", K.NVRTC_BACKENDS)
def test_compile_error_names_the_real_file_and_line(backend):
    if backend not in K.nvrtc_backends():
        pytest.skip(f"NVRTC through {backend} is not installed here")
    src = K.build_source("flat_codec.cu", [K.dequantize_spec("bf16")])
    broken = src.replace("FP4C_DEVICE u32 fdiv(", "FP4C_DEVICE u32 fdiv(this is not C++ ", 1)
    with pytest.raises(RuntimeError) as exc:
        K.compile_source(broken, "flat_codec.cu", "sm_90", backend=backend)
    assert "fp4_common.cuh(" in str(exc.value)


def _nvrtc_version(backend: str) -> tuple[int, int]:
    if backend == "cupy":
        from cupy.cuda import nvrtc

        return tuple(nvrtc.getVersion())
    from cuda.bindings import nvrtc

    _, major, minor = nvrtc.nvrtcVersion()
    return (major, minor)


@needs_nvrtc
def test_nvrtc_front_ends_agree():
    """CuPy's NVRTC and cuda.bindings' give the same PTX and ptxas log (where both are
    installed and load the same libnvrtc): a CPU-only run checks what CuPy compiles."""
    have = K.nvrtc_backends()
    if len(have) < 2:
        pytest.skip(f"only {have} here")
    versions = {b: _nvrtc_version(b) for b in have}
    if len(set(versions.values())) > 1:
        pytest.skip(f"the front ends load different libnvrtc versions: {versions}")
    spec = K.varlen_attention_spec("bf16", 128, 1)
    src = K.build_source(spec.file, [spec])
    ptx = {b: K.compile_source(src, spec.file, "sm_90", K.CUPY_IMPLICIT_OPTIONS, b)
           for b in have}
    logs = {b: [ln for ln in K.compile_log(src, spec.file, "sm_90", ("-Xptxas", "-v"), b)
                .splitlines() if "Compile time" not in ln] for b in have}
    assert len(set(ptx.values())) == 1 and f".entry {spec.name}(" in ptx[have[0]]
    front = {b: [ln for ln in lines if not ln.startswith("ptxas")] for b, lines in logs.items()}
    assert front[have[0]] == front[have[1]]  # NVRTC's own diagnostics
    # ptxas' lines: the same where both front ends return them (NVRTC 13 on a GPU machine
    # was seen to return them to the first of two identical compiles only)
    ptxas = [[ln for ln in lines if ln.startswith("ptxas")] for lines in logs.values()]
    if all(ptxas):
        assert ptxas[0] == ptxas[1]
    if next(iter(versions.values()))[0] == 12:  # NVRTC 12 (the test extra's) runs ptxas -v
        assert any("Used" in ln and "registers" in ln for ln in logs[have[0]])
    with pytest.raises(ValueError, match="backend"):
        K.compile_source(src, spec.file, "sm_90", backend="nvcc")


def test_source_assembly():
    spec = K.store_spec("bf16", "4over6", "i64")
    assert spec.name == "fp4cache_store_bf16_4over6_i64"
    assert K.store_spec("f16", "static6", "i32", vec=False).name == \
        "fp4cache_store_f16_static6_i32_scalar"
    src = K.build_source(spec.file, [spec])
    assert '#line 1 "fp4_common.cuh"' in src and '#line 1 "paged_kv.cu"' in src
    assert "#include" not in src
    assert spec.instantiation in src
    with pytest.raises(ValueError):
        K.build_source("flat_codec.cu", [spec])
    families = {s.macro for s in K.all_specs()}
    assert len(families) == 21  # FP4C_VARLEN_WG_KERNEL: the sm_90a attention
    assert len({s.name for s in K.all_specs()}) == len(K.all_specs())


def test_kernel_dir_holds_sources():
    d = K.kernel_dir()
    assert (d / "fp4_common.cuh").is_file()
    for f in ("paged_kv.cu", "flat_codec.cu", "longlive.cu", "decode_attention.cu",
              "page_copy.cu", "varlen_attention.cu", "paged_layout.cuh", "attn_ptx.cuh",
              "attn_dequant.cuh", "attn_seq.cuh", "attn_state.cuh", "attn_epilogue.cuh",
              "window.cu", "hadamard.cuh"):
        assert (d / f).is_file()
