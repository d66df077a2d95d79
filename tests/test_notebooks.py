"""Execute every ``notebooks/*.ipynb`` top to bottom and run the examples in ``docs/*.md``.

The notebooks run in a fresh ``python3`` kernel of *this* interpreter (ipykernel's own
kernel spec, built from ``sys.executable``; any user-installed ``python3`` spec that
points at another Python is ignored), with ``notebooks/`` as working directory and the
repository root on ``PYTHONPATH``, so a plain checkout works as well as an installed one.
A cell that raises fails the test.  Needs ``nbclient``, ``nbformat``, ``ipykernel`` and
``matplotlib`` (the ``notebooks`` extra, which CI installs): without them the notebook
tests are skipped with a reason naming the missing package (``pip install -e
".[test,notebooks]"`` brings them), so that ``.[test]`` alone still gives a green run.

The Markdown docs hold doctest examples (``>>>`` lines); they are run with
:mod:`doctest`, so the docs cannot drift from the code.
"""

from __future__ import annotations

import doctest
import importlib
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
DOCS_DIR = ROOT / "docs"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
DOCS = sorted(DOCS_DIR.glob("*.md"))
CELL_TIMEOUT_S = 300


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
                 "06_any_query_attention.ipynb"):
        assert want in names, f"notebooks/{want} is missing (found {names})"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_stored_clean(path):
    """Stored without outputs; opens with Markdown; ends with a Markdown + code summary."""
    nb = _read(path)
    cells = nb.cells
    assert cells[0].cell_type == "markdown", f"{path.name} must open with a Markdown cell"
    assert [c.cell_type for c in cells[-2:]] == ["markdown", "code"], (
        f"{path.name} must end with a Markdown cell and a code cell (the summary)"
    )
    assert "what we learned" in cells[-2].source.lower()
    for i, cell in enumerate(cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name} cell {i} has stored outputs"
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"


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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, kernel_manager):
    nbclient = _require("nbclient")
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


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_doc_examples(path, monkeypatch):
    """Run the ``>>>`` examples of a Markdown doc (a doc without any is fine)."""
    monkeypatch.syspath_prepend(str(ROOT))
    importlib.import_module("fp4cache")  # the package itself must import: never a skip
    result = doctest.testfile(
        str(path),
        module_relative=False,
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
        raise_on_error=False,
        verbose=False,
    )
    assert result.failed == 0, f"{result.failed} doctest example(s) failed in docs/{path.name}"
