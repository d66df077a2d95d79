"""Side-by-side timing of two source trees: did a change keep every benchmark row's speed?

Run each benchmark alternately from both trees in one run on the GPU (A, B, A, B, ...:
drift of clocks and temperature hits both alike), each run writing its JSON, then compare
the rows::

    # on the GPU machine, old tree unpacked in /tmp/old (git archive <commit> | tar -x)
    for i in 1 2; do for t in /tmp/old .; do
        (cd $t && PYTHONPATH=. python3 bench/attention_bench.py \
             --out $OUT/$(basename $t)-attn-$i.json)
    done; done
    python3 bench/tree_compare.py --before $OUT/old-attn-*.json --after $OUT/.-attn-*.json

For each row (matched by its ``case``, or ``section / case / impl``) and each time field
of fp4cache's own (``time_us`` / ``us`` of an ``impl`` starting with ``fp4cache``, and the
``*_us`` fields that name no peer: ``fused_us``, ``varlen_us``, ``decode_us``, ...) it
prints the median over the runs of each side and the ratio after / before, and marks the
ratios outside ``--tol`` (default 2 %).  The exit status is 1 when a row is outside.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

#: time fields of the peers measured beside fp4cache (not what a change of fp4cache moves)
PEER_WORDS = ("sdpa", "torch", "flashinfer", "cupy", "copy", "empty", "memcpy", "numpy",
              "compile", "fi_", "dynamic", "static")


def _rows(doc) -> list[dict]:
    if isinstance(doc, dict):
        for key in ("rows", "results"):
            if isinstance(doc.get(key), list):
                return [r for r in doc[key] if isinstance(r, dict)]
        return [r for v in doc.values() if isinstance(v, list) for r in v if isinstance(r, dict)]
    return [r for r in doc if isinstance(r, dict)]


def _key(r: dict) -> str:
    if "impl" in r:
        head = f"{r['section']} / " if "section" in r else ""
        return f"{head}{r.get('case')} / {r['impl']}"
    return str(r.get("case", r.get("name", "?")))


def _times(r: dict) -> dict[str, float]:
    out = {}
    for k, v in r.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v is None:
            continue
        if k in ("time_us", "us"):
            if str(r.get("impl", "fp4cache")).startswith("fp4cache"):
                out[k] = float(v)
        elif k.endswith("_us") and not any(w in k for w in PEER_WORDS):
            out[k] = float(v)
    return out


def collect(paths: list[str]) -> dict[tuple[str, str], list[float]]:
    got: dict[tuple[str, str], list[float]] = {}
    for p in paths:
        for r in _rows(json.loads(Path(p).read_text())):
            for field, t in _times(r).items():
                got.setdefault((_key(r), field), []).append(t)
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", nargs="+", required=True, help="JSONs of the old tree")
    ap.add_argument("--after", nargs="+", required=True, help="JSONs of the new tree")
    ap.add_argument("--tol", type=float, default=0.02, help="allowed |after/before - 1|")
    args = ap.parse_args(argv)
    b, a = collect(args.before), collect(args.after)
    bad = 0
    print("| row | field | before us | after us | after / before |\n|---|---|---|---|---|")
    for key in sorted(set(b) & set(a)):
        tb, ta = statistics.median(b[key]), statistics.median(a[key])
        ratio = ta / tb if tb else float("nan")
        flag = "" if abs(ratio - 1) <= args.tol else " **outside**"
        bad += bool(flag)
        print(f"| {key[0]} | {key[1]} | {tb:.2f} | {ta:.2f} | {ratio:.3f}{flag} |")
    for key in sorted(set(b) ^ set(a)):
        print(f"| {key[0]} | {key[1]} | only {'before' if key in b else 'after'} | | |")
    n = len(set(b) & set(a))
    print(f"\n{n} rows compared, {bad} outside +-{args.tol:.0%}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
