"""Patched copies of the kernel sources for the probes (``wgmma_decode_probe.py``,
``wgmma_timeline.py``, ``few_rows_probe.py``, ``mma_route_probe.py``): text replacements
applied to files of ``kernels/`` and written to a folder that a
:class:`fp4cache._kernels.Spec` takes as its ``folder`` (its includes are looked up there
first, then in ``kernels/``); and the probes' shared timing of one call per variant.

A patch is ``(old, new)``: ``old`` is a text found exactly once, or ``(start, end)``: the
text between the end of ``start`` (found exactly once) and the first ``end`` after it, both
kept.  A patch that does not apply raises ``RuntimeError``, so a kernel change that breaks
a probe shows on the CPU (``tests/test_kernels_compile.py`` compiles every probe's copy).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from fp4cache import _kernels as K

Patch = tuple[str | tuple[str, str], str]


def patch_text(src: str, patches: list[Patch], what: str) -> str:
    """``src`` with ``patches`` applied in order; ``what`` names them in errors."""
    for old, new in patches:
        if isinstance(old, tuple):
            start, end = old
            if src.count(start) != 1:
                raise RuntimeError(f"{what}: {start[:60]!r} found {src.count(start)} times")
            a = src.index(start) + len(start)
            b = src.find(end, a)
            if b < 0:
                raise RuntimeError(f"{what}: {end[:60]!r} not found after {start[:40]!r}")
            src = src[:a] + new + src[b:]
        else:
            if src.count(old) != 1:
                raise RuntimeError(f"{what}: {old[:60]!r} found {src.count(old)} times")
            src = src.replace(old, new)
    return src


def write_folder(folder: Path, files: dict[str, list[Patch]]) -> str:
    """Write each file of ``kernels/`` named in ``files`` with its patches into ``folder``
    (created); return the folder as a :class:`fp4cache._kernels.Spec` takes it."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, patches in files.items():
        src = (K.kernel_dir() / name).read_text()
        (folder / name).write_text(patch_text(src, patches, f"{folder.name}/{name}"))
    return str(folder)


def add_baseline_argument(ap) -> None:
    """A probe's ``--baseline DIR`` (an ``argparse`` parser's): older kernel files timed as
    the variant ``"baseline"`` (:func:`variant_folders`)."""
    ap.add_argument("--baseline", type=Path, default=None,
                    help="a folder of older kernel files: timed as the variant 'baseline'")


def variant_folders(root: Path, names: list[str], folders: dict[str, dict[str, list[Patch]]],
                    baseline: Path | None, kernel_file: str) -> dict[str, str | None]:
    """Each variant of ``names`` -> its folder under ``root`` (written from ``folders``;
    None: the shipped sources), with the variant ``"baseline"`` first when ``baseline``
    names a folder of older kernel files (it must hold ``kernel_file``)."""
    out: dict[str, str | None] = {
        name: write_folder(root / name, folders[name]) if name in folders else None
        for name in names}
    if baseline is not None:
        if not (baseline / kernel_file).is_file():
            raise SystemExit(f"--baseline: {baseline} holds no {kernel_file}")
        out = {"baseline": str(baseline.resolve()), **out}
    return out


def compare_bytes(first: tuple[str, np.ndarray] | None, name: str,
                  got: np.ndarray) -> tuple[tuple[str, np.ndarray], str]:
    """The first variant's (name, output bytes) and a note on how variant ``name``'s bytes
    ``got`` compare with them (empty for the first variant itself)."""
    if first is None:
        return (name, got), ""
    same = "equal to" if np.array_equal(got, first[1]) else "unlike"
    return first, f"  bytes {same} {first[0]}'s"


def spec_in_folder(shipped: Callable[..., K.Spec], folder: str | None) -> Callable[..., K.Spec]:
    """``shipped`` (a spec function of :mod:`fp4cache._kernels`), or for a variant's
    ``folder`` one that builds the same :class:`~fp4cache._kernels.Spec` from it."""
    if folder is None:
        return shipped

    def spec(*a, **kw):
        return dataclasses.replace(shipped(*a, **kw), folder=folder)
    return spec


def time_variant(vb, call, out, scratch, first: tuple[str, np.ndarray] | None, name: str,
                 batch: int) -> tuple[tuple[str, np.ndarray], str]:
    """Run ``call`` (an ``attention`` call of bench ``vb`` writing ``out``, planned in
    ``scratch``) once, compare its output bytes with the first variant's
    (:func:`compare_bytes`), time it in batches of ``batch``; return the first variant's
    bytes and the variant's line (time, launches, bytes)."""
    cp = vb.cp
    call()
    cp.cuda.Device().synchronize()
    names = [lp.name for lp in next(iter(scratch.plans.values())).plan.launches]
    first, same = compare_bytes(first, name, out.view(cp.uint16).get())
    t = vb.time([call], batch=batch)
    return first, f"   {name:9s} {t * 1e6:9.1f} us  {' + '.join(names)}{same}"


#: the prefill probes' rows (``wgmma_decode_probe.py``, ``mma_route_probe.py``): name ->
#: (label, sequences, query tokens, cached tokens)
PREFILL_ROWS = {"chunk": ("chunk 2,048 after 30,720", 1, 2048, 30720),
                "prefill": ("prefill 8,192", 1, 8192, 0),
                "batch": ("prefill 4 x 4,096", 4, 4096, 0)}


def time_prefill_variants(reps: int, rows: list[str], head_dim: int,
                          folders: dict[str, str | None], spec_attr: str,
                          route: str = "auto") -> None:
    """For each row of :data:`PREFILL_ROWS` named in ``rows`` (Hq 32, H 8, ``head_dim``,
    block 16, bf16 q; one cache and q for every variant), each variant of ``folders``
    (:func:`variant_folders`): ``attention`` with prefill ``route`` through the kernel that
    ``fp4cache._kernels.<spec_attr>`` builds from the variant's folder; its time and output
    bytes against the first variant's, logged."""
    from attention_bench import log
    from timing import BF16
    from varlen_bench import VarlenBench

    from fp4cache._cuda.decode import new_scratch

    vb = VarlenBench.plain(reps)
    cp = vb.cp
    shipped = getattr(K, spec_attr)
    sm_scale = 1.0 / np.sqrt(head_dim)
    try:
        for case, B, n, cached in (PREFILL_ROWS[r] for r in rows):
            cache, tab, lens, _ = vb.cache_for(B, [cached + n] * B, 8, head_dim, 16, 5)
            q = vb.env.randn_bf16((B * n, 32, head_dim), 6)
            qsl = cp.arange(B + 1, dtype=cp.int32) * n
            out = cp.empty((B * n, 32, head_dim), dtype=BF16)
            log(f"== {case}, head_dim {head_dim}, route {route}")
            first = None  # the first variant's output bytes
            for name, folder in folders.items():
                setattr(K, spec_attr, spec_in_folder(shipped, folder))
                scratch = new_scratch()
                call = vb.varlen(cache, q, qsl, tab, lens, out, scratch, sm_scale, n,
                                 route=route)
                first, line = time_variant(vb, call, out, scratch, first, name, 3)
                log(line)
            setattr(K, spec_attr, shipped)
            del cache
            vb.release()
    finally:
        setattr(K, spec_attr, shipped)


def prefill_probe_main(argv: Sequence[str] | None, description: str,
                       folders: dict[str, dict[str, list[Patch]]], variants: list[str],
                       kernel_file: str, spec_attr: str, head_dims: Sequence[int], *,
                       reps: int, rows: list[str], route: str = "auto") -> int:
    """The prefill probes' command line and run: ``--reps``, ``--variants`` (of
    ``variants``, their patched files in ``folders``), ``--head-dim`` (of ``head_dims``),
    ``--rows`` (of :data:`PREFILL_ROWS`), ``--baseline``; each variant's folder written to a
    temporary folder, then :func:`time_prefill_variants` with ``spec_attr`` and ``route``."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--variants", nargs="*", default=list(variants), choices=list(variants))
    ap.add_argument("--head-dim", type=int, default=128, choices=list(head_dims))
    ap.add_argument("--rows", nargs="*", default=list(rows), choices=list(PREFILL_ROWS))
    add_baseline_argument(ap)
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp())
    try:
        chosen = variant_folders(root, args.variants, folders, args.baseline, kernel_file)
        time_prefill_variants(args.reps, args.rows, args.head_dim, chosen, spec_attr,
                              route=route)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0
