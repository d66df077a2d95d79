"""The declared minimum versions of fp4cache's dependencies, as pip pins.

``python .ci/floors.py`` prints ``name==floor`` for every ``name>=floor`` of
``[project] dependencies`` in pyproject.toml, one a line (CI's minimum-versions step
installs them as constraints); ``--check`` instead checks that the installed versions are
exactly those floors.  Runs on Python 3.10 (no tomllib there: the list is read with a
regular expression).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def dependencies(text: str) -> list[str]:
    """The strings of ``[project] dependencies``."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        m = re.search(r"^dependencies\s*=\s*\[(.*?)\]", text, re.S | re.M)
        return re.findall(r'"([^"]+)"', m.group(1)) if m else []
    return list(tomllib.loads(text)["project"]["dependencies"])


def floors(text: str) -> dict[str, str]:
    """``{name: floor}`` of every dependency declared as ``name>=floor``."""
    out = {}
    for dep in dependencies(text):
        m = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)\s*", dep)
        if m is None:
            raise SystemExit(f"pyproject.toml: dependency {dep!r} has no plain '>=' floor")
        out[m.group(1)] = m.group(2)
    return out


def _release(v: str) -> tuple[int, ...]:
    parts = [int(p) for p in re.findall(r"\d+", v.split("+")[0])[:3]]
    return tuple(parts + [0] * (3 - len(parts)))


def main(argv: list[str]) -> int:
    want = floors(PYPROJECT.read_text(encoding="utf-8"))
    if "--check" not in argv:
        print("\n".join(f"{name}=={v}" for name, v in want.items()))
        return 0
    from importlib.metadata import version

    wrong = {name: version(name) for name, v in want.items()
             if _release(version(name)) != _release(v)}
    for name, v in want.items():
        print(f"{name}: declared floor {v}, installed {version(name)}")
    if wrong:
        print(f"installed versions are not the declared floors: {wrong}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
