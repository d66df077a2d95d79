"""PTX identity check of the shipped kernels (no GPU needed): a refactor must not change code.

``dump`` compiles every specialization of ``fp4cache._kernels.all_specs()`` (plus the
test-only variants of :func:`variant_specs`) - the specs of one file (and variant) in one
translation unit, CuPy's implicit options - for each architecture, and writes one
normalized ``<arch>/<kernel name>.ptx`` per kernel.
``compare`` reads two such folders and reports, per kernel, whether they are identical.
Normalization:

* only the kernel's own ``.entry`` and what it reaches (``.func``, ``.global``, ``.const``,
  ``.shared`` declarations, transitively) are kept: a test kernel that leaves the module
  does not count as a change of the shipped one;
* basic-block labels are numbered per function (``$L__BB<function>_<n>`` loses the
  function index, which changes when an entry before it leaves the module);
* the kernel's own name (with a mangled length prefix) becomes ``KERNEL``, so that
  ``compare --rename OLD=NEW`` (substring of the file names, applied in order) can map a
  deliberate entry-point rename.

Kernels only in "before" (deleted) or only in "after" (new) are listed separately.  The
exit status is 1 when a kernel present on both sides differs.

``cubin`` is the next check for a kernel whose PTX differs: it compiles the named kernels
of this tree and of an old tree (each alone, as the library does), assembles both with
``ptxas -v`` and says whether the cubins are byte-identical (then the SASS is the same),
with the register and spill lines of each.

From the repository root::

    git archive <old commit> | tar -x -C /tmp/old && cp bench/ptx_diff.py /tmp/old/bench/
    python /tmp/old/bench/ptx_diff.py dump /tmp/ptx_before   # the old tree (~2 min)
    python bench/ptx_diff.py dump /tmp/ptx_after             # this tree
    python bench/ptx_diff.py compare /tmp/ptx_before /tmp/ptx_after \
        --rename _g16_anyT=_wide --rename _g8_anyT= --rename _g16=_wide_paged16 \
        --rename _g8=_paged16    # the attention kernels' old names -> their current ones
    python bench/ptx_diff.py cubin /tmp/old --arch sm_90 --match varlen_attn_bf16_d128
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from fp4cache import _kernels as K  # noqa: E402


def variant_specs() -> list:
    """``(label, spec)`` of the specs that the library does not launch on an sm_90 device
    but the GPU tests do: the sm_80 E2M1 decode route of the attention, labelled
    ``<shipped kernel name>@bitmove``.  Older trees built them with
    ``Spec.with_tuning(FP4C_E4M3_CVT=0)``, newer ones with ``decode_route="bitmove"``."""
    attn = [s for s in K.all_specs() if s.file == "decode_attention.cu"]
    if hasattr(K, "decode_attention_args"):
        out = []
        for s in attn:
            a = K.decode_attention_args(s)
            out.append((s.name + "@bitmove", K.decode_attention_spec(
                # a[2]: the row form, `tiles` (or `wide` in older trees)
                a.dtype, a.head_dim, a[2], a.paged16, decode_route="bitmove")))
        return out
    return [(s.name + "@bitmove", s.with_tuning(FP4C_E4M3_CVT=0)) for s in attn]


def _variant_key(spec) -> tuple:
    return (spec.file, getattr(spec, "tuning", ()), getattr(spec, "defines", ()))


def _compile(job: tuple[str, list, list[str]]) -> tuple[str, list[tuple[str, str]]]:
    """Compile one translation unit (the specs of one file and variant) and return the
    normalized PTX of each kernel, by label."""
    arch, specs, labels = job
    src = K.build_source(specs[0].file, specs)
    own = getattr(specs[0], "arch", None)  # an arch-specific target (sm_90a) compiles as such
    ptx = K.compile_source(src, specs[0].file, own or arch, K.CUPY_IMPLICIT_OPTIONS)
    return arch, [(label, normalize(ptx, s.name)) for label, s in zip(labels, specs)]


def dump(folder: Path, archs: list[str], jobs: int) -> None:
    todo = [(s.name, s) for s in K.all_specs()] + variant_specs()
    units: dict[tuple, tuple[list, list]] = {}
    for label, spec in todo:
        specs, labels = units.setdefault(_variant_key(spec), ([], []))
        specs.append(spec)
        labels.append(label)
    work = [(arch, specs, labels) for arch in archs for specs, labels in units.values()
            if getattr(specs[0], "arch", None) is None or K.arch_family(specs[0].arch) == arch]
    n = 0
    with ProcessPoolExecutor(jobs) as ex:
        for arch, kernels in ex.map(_compile, work):
            d = folder / arch
            d.mkdir(parents=True, exist_ok=True)
            for label, text in kernels:
                (d / f"{label}.ptx").write_text(text)
                n += 1
    print(f"wrote {n} normalized kernels under {folder}")


_IDENT = re.compile(r"[A-Za-z_$%][A-Za-z0-9_$]*")


def _items(ptx: str) -> tuple[list[str], list[tuple[str, str]]]:
    """Header lines and top-level items ``(symbol, text)`` of a PTX module."""
    head: list[str] = []
    items: list[tuple[str, str]] = []
    lines = ptx.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        s = line.strip()
        if re.match(r"^(\.visible|\.weak|\.extern)?\s*\.(entry|func)\b", s):
            j = i
            depth = 0
            opened = False
            while j < len(lines):
                depth += lines[j].count("{") - lines[j].count("}")
                opened = opened or "{" in lines[j]
                if opened and depth == 0:
                    break
                if not opened and lines[j].rstrip().endswith(";"):  # a declaration only
                    break
                j += 1
            text = "\n".join(lines[i:j + 1])
            m = re.search(r"\.(?:entry|func)\s+(?:\([^)]*\)\s*)?([A-Za-z_$][\w$]*)", text)
            items.append((m.group(1) if m else text, text))
            i = j + 1
            continue
        if re.match(r"^(\.visible\s+|\.extern\s+|\.weak\s+)?\.(global|const|shared)\b", s):
            name = re.findall(r"([A-Za-z_$][\w$]*)\s*(?:\[[^\]]*\])*\s*(?:=|;)", s)
            items.append((name[0] if name else s, s))
        elif s and not s.startswith("//"):
            head.append(s)
        i += 1
    return head, items


def normalize(ptx: str, kernel: str) -> str:
    """The part of ``ptx`` that kernel ``kernel`` reaches, with label and name normalized."""
    head, items = _items(ptx)
    table: dict[str, str] = {}
    for sym, text in items:
        table[sym] = (table.get(sym, "") + "\n" + text).strip()
    if kernel not in table:
        raise KeyError(f"no .entry {kernel} in the PTX")
    keep, todo = [], [kernel]
    seen = {kernel}
    while todo:
        sym = todo.pop()
        keep.append(sym)
        for ident in set(_IDENT.findall(table[sym])):
            if ident in table and ident not in seen:
                seen.add(ident)
                todo.append(ident)
    order = [sym for sym, _ in items if sym in seen]
    body = "\n".join(head + [table[s] for s in dict.fromkeys(order)])
    body = re.sub(r"\$L__BB\d+_", "$L__BB_", body)
    body = re.sub(rf"\d*{re.escape(kernel)}", "KERNEL", body)
    return body + "\n"


def _mapped(name: str, renames: list[tuple[str, str]]) -> str:
    for old, new in renames:
        name = name.replace(old, new)
    return name


def compare(before: Path, after: Path, renames: list[tuple[str, str]], show: int) -> int:
    bad = 0
    for arch_dir in sorted(p for p in before.iterdir() if p.is_dir()):
        arch = arch_dir.name
        old = {p.stem: p for p in arch_dir.glob("*.ptx")}
        new = {p.stem: p for p in (after / arch).glob("*.ptx")}
        matched: set[str] = set()
        same, differ, gone = [], [], []
        for name, path in sorted(old.items()):
            target = _mapped(name, renames)
            if target not in new:
                gone.append(name)
                continue
            matched.add(target)
            a, b = path.read_text(), new[target].read_text()
            if a == b:
                same.append(name)
            else:
                differ.append(name)
                if show:
                    diff = list(difflib.unified_diff(a.splitlines(), b.splitlines(), name,
                                                     target, lineterm="", n=1))
                    print("\n".join(diff[:show]))
        added = sorted(set(new) - matched)
        print(f"{arch}: {len(same)} identical, {len(differ)} different, "
              f"{len(gone)} only before, {len(added)} only after")
        for label, names in (("DIFFERENT", differ), ("only before", gone), ("only after", added)):
            for n in names:
                print(f"  {label}: {n}")
        bad += len(differ)
    return 1 if bad else 0


_PTX_OF = """
import json, sys
sys.path.insert(0, sys.argv[1])
from fp4cache import _kernels as K
out = {}
for s in K.all_specs():
    if sys.argv[3] in s.name:
        src = K.build_source(s.file, [s])
        out[s.name] = K.compile_source(src, s.file, sys.argv[2], K.CUPY_IMPLICIT_OPTIONS)
print(json.dumps(out))
"""


def cubin(old_root: Path, arch: str, match: str, ptxas: str) -> int:
    """Assemble the kernels whose name contains ``match`` from both trees; 1 if a cubin
    differs (kernel names must be the same in both trees)."""
    import json
    import subprocess
    import tempfile

    def ptx_of(root: Path) -> dict[str, str]:
        return json.loads(subprocess.check_output(
            [sys.executable, "-c", _PTX_OF, str(root), arch, match]))

    old, new = ptx_of(old_root), ptx_of(_ROOT)
    bad = 0
    for name in sorted(set(old) & set(new)):
        res = []
        for ptx in (old[name], new[name]):
            with tempfile.TemporaryDirectory() as d:
                (Path(d) / "k.ptx").write_text(ptx)
                r = subprocess.run([ptxas, f"-arch={arch}", "-v", "-o", f"{d}/k.cubin",
                                    f"{d}/k.ptx"], capture_output=True, text=True, check=True)
                info = [ln.strip() for ln in r.stderr.splitlines() if "Used" in ln
                        or "spill" in ln]
                res.append(((Path(d) / "k.cubin").read_bytes(), info))
        same = res[0][0] == res[1][0]
        bad += not same
        print(f"{name}: cubin {'identical' if same else 'DIFFERENT'}")
        if not same:
            print(f"  before: {res[0][1]}\n  after:  {res[1][1]}")
    print(f"{len(set(old) & set(new))} kernels, {bad} different cubins; only before: "
          f"{sorted(set(old) - set(new))}, only after: {sorted(set(new) - set(old))}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump", help="compile every spec, write <folder>/<arch>/<kernel>.ptx")
    d.add_argument("folder", type=Path)
    d.add_argument("--arch", nargs="+", default=["sm_80", "sm_90"])
    d.add_argument("-j", "--jobs", type=int, default=2)
    c = sub.add_parser("compare", help="compare two dump folders kernel by kernel")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    c.add_argument("--rename", action="append", default=[], metavar="OLD=NEW",
                   help="substring rename of kernel names, before -> after (repeatable)")
    c.add_argument("--show", type=int, default=40, help="diff lines shown per kernel")
    b = sub.add_parser("cubin", help="ptxas both trees' kernels, compare the cubins")
    b.add_argument("old_root", type=Path, help="the old tree (e.g. a git archive export)")
    b.add_argument("--arch", default="sm_90")
    b.add_argument("--match", default="", help="substring of the kernel names")
    b.add_argument("--ptxas", default="ptxas")
    args = ap.parse_args(argv)
    if args.cmd == "cubin":
        return cubin(args.old_root, args.arch, args.match, args.ptxas)
    if args.cmd == "dump":
        dump(args.folder, args.arch, args.jobs)
        return 0
    renames = [tuple(r.split("=", 1)) for r in args.rename]
    return compare(args.before, args.after, renames, args.show)


if __name__ == "__main__":
    sys.exit(main())
