"""Patched copies of the kernel sources for the probes (``wgmma_decode_probe.py``,
``wgmma_timeline.py``): text replacements applied to files of ``kernels/`` and written to a
folder that a :class:`fp4cache._kernels.Spec` takes as its ``folder`` (its includes are
looked up there first, then in ``kernels/``).

A patch is ``(old, new)``: ``old`` is a text found exactly once, or ``(start, end)``: the
text between the end of ``start`` (found exactly once) and the first ``end`` after it, both
kept.  A patch that does not apply raises ``RuntimeError``, so a kernel change that breaks
a probe shows on the CPU (``tests/test_kernels_compile.py`` compiles every probe's copy).
"""

from __future__ import annotations

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
