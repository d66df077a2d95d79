"""The Markdown files render as their authors meant: tables are tables.

A GitHub-flavoured Markdown table must start after a blank line with a header row and a
delimiter row (``|---|``); a ``|`` row right under a paragraph line is read as more text of
that paragraph, and a row with another number of cells than the header is cut or padded.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKDOWN = sorted([*ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md"),
                   *(ROOT / "bench").glob("*.md")])
DELIMITER = re.compile(r"^\|(\s*:?-{3,}:?\s*\|)+\s*$")
#: A clock time (hours:minutes, alone, with "UTC" or as a range): documents give dates,
#: not times.
TIME_OF_DAY = re.compile(r"\b[0-2]?\d:[0-5]\d(:[0-5]\d)?\s*(UTC|GMT|Z\b|-\s*[0-2]?\d:[0-5]\d)"
                         r"|\bUTC\b")


def _cells(row: str) -> int:
    """Cells of a table row: ``|`` outside code spans, not escaped, minus the two ends."""
    row = re.sub(r"`[^`]*`", "code", row.strip())
    return len(re.split(r"(?<!\\)\|", row)) - 2


def table_problems(text: str) -> list[str]:
    problems = []
    lines = text.splitlines()
    fence = None
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.lstrip()
        if stripped.startswith(("```", "~~~")):
            mark = stripped[:3]
            fence = None if fence == mark else (fence or mark)
            i += 1
            continue
        if fence or not line.startswith("|"):
            i += 1
            continue
        prev = lines[i - 1] if i else ""
        if prev.strip():
            problems.append(f"line {i + 1}: a table row right under a paragraph line (it "
                            f"renders as text): {line[:60]!r}")
        block = []
        while i < len(lines) and lines[i].startswith("|"):
            block.append((i + 1, lines[i]))
            i += 1
        if len(block) < 2 or not DELIMITER.match(block[1][1]):
            problems.append(f"line {block[0][0]}: a table without a delimiter row (|---|) "
                            "under its header")
            continue
        want = _cells(block[0][1])
        for n, row in block:
            if _cells(row) != want:
                problems.append(f"line {n}: {_cells(row)} cells, the header has {want}")
    return problems


def test_checker_finds_a_row_under_a_paragraph():
    text = "| a | b |\n|---|---|\n| 1 | 2 |\n\nsome text\n| 3 | 4 |\n"
    assert [p.split(":")[0] for p in table_problems(text)] == ["line 6", "line 6"]
    assert table_problems("| a | b |\n|---|---|\n| `x|y` | 2 |\n") == []
    assert table_problems("text\n\n```\n| not | a table |\n```\n") == []


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_markdown_tables_render(path):
    problems = table_problems(path.read_text(encoding="utf-8"))
    assert not problems, f"{path.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_scale_rule_page_cites_measured_numbers():
    """docs/scale_rules.md: both rules, vLLM's names for them, the calibration rule, and
    every time it quotes is one of BENCHMARKS.md's measurements (with GPU and date: a day,
    no time of day)."""
    page = (ROOT / "docs" / "scale_rules.md").read_text(encoding="utf-8")
    bench = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    for phrase in ("`nvfp4`", "`nvfp4_4over6`", "6·448", "6·256", "H200",
                   "calibrate_scale", "## Which one to use"):
        assert phrase in page, phrase
    assert re.search(r"\b20\d\d-[01]\d-[0-3]\d\b", page), "the speed table gives no date"
    assert not TIME_OF_DAY.search(page), TIME_OF_DAY.search(page).group()
    times = re.findall(r"(\d+\.\d) µs", page)
    assert len(times) >= 5, times
    for t in times:
        assert t in bench, f"docs/scale_rules.md quotes {t} us, which BENCHMARKS.md lacks"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for doc in ("docs/scale_rules.md", "docs/interop.md"):
        assert doc in readme, f"README.md does not point at {doc}"


#: What a development diary says (spelled so that this file does not match itself): the
#: project's history is git's, documents and code describe the product.
DIARY = re.compile(r"\bsess" r"ions?\b|\bissue\s+#?\d" r"|\bKERNEL_" r"NOTES\b", re.IGNORECASE)
SOURCES = sorted({*MARKDOWN, *(ROOT / "fp4cache").glob("*.py"), *(ROOT / "tests").glob("*.py"),
                  *(ROOT / "bench").glob("*.py"), *(ROOT / "kernels").glob("*.cu"),
                  *(ROOT / "kernels").glob("*.cuh"), *(ROOT / "notebooks").glob("*.py")})


def test_checker_finds_diary_words():
    assert DIARY.search("measured in the sixth sess" + "ion")
    assert DIARY.search("see Iss" + "ue 24")
    clock = "{}:{}".format  # the examples are built, so this file holds no clock time
    assert TIME_OF_DAY.search(f"run at {clock(17, 33)} UTC")
    assert TIME_OF_DAY.search(f"{clock('08', 54)}-{clock('09', 10)}")
    assert not DIARY.search("issue slots 61 % busy; the sess" + "ionless API")
    assert not TIME_OF_DAY.search("k[5, 1, 16:32] and ro[16:20, :g]")


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_development_diary(path):
    """No document, comment or test speaks of its own making (work periods, tracker
    numbers, times of day, a removed notes file): BENCHMARKS.md holds the current numbers,
    docs/ the design, CHANGELOG.md the changes by version, git the history."""
    text = path.read_text(encoding="utf-8")
    hits = [m.group() for m in DIARY.finditer(text)]
    if path.suffix == ".md":
        hits += [m.group() for m in TIME_OF_DAY.finditer(text)]
    assert not hits, f"{path.relative_to(ROOT)}: {hits[:5]}"
