"""Imports inside fp4cache run one way: no module imports one above it (read with ``ast``).

The order (``fp4cache/_backend.py`` describes the layers), lowest first::

    constants   typing, _abi, formats
    helpers     _arrays, layout, _plans, _device, _kernels, _hotpath, _pool
    backends    _cpu, _cuda.launch, _cuda.state, _cuda.paged, _cuda.decode,
                _cuda.varlen, _cuda.pages, _cuda.window, _cuda.longlive, _cuda.runners,
                _cuda
    protocol    _backend
    front ends  codec, calibrate, attention, store, pages, longlive, cache, engine
    public      fp4cache (__init__), __main__, hf, vllm

Every import counts, also those inside functions or under ``TYPE_CHECKING``: a module may
import only modules listed before it, so the imports form no circle.  Also: no front end
reads a private attribute of ``PagedKVCache``, front ends reach a backend only
through :mod:`fp4cache._backend`, and the front ends over a pool never compare a device
kind (what differs between devices is a method of the pool or the backend).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "fp4cache"

ORDER = [
    "typing", "_abi", "formats",
    "_arrays", "layout", "_plans", "_device", "_kernels", "_hotpath", "_pool",
    "_cpu", "_cuda.launch", "_cuda.state", "_cuda.paged", "_cuda.decode", "_cuda.varlen",
    "_cuda.pages", "_cuda.window", "_cuda.longlive", "_cuda.runners", "_cuda",
    "_backend",
    "codec", "calibrate", "attention", "store", "pages", "longlive", "cache", "engine",
    "", "__main__", "hf", "vllm",
]
RANK = {name: i for i, name in enumerate(ORDER)}
BACKENDS = {"_cpu", "_cuda"}
FRONT_ENDS = {"codec", "calibrate", "attention", "store", "pages", "longlive", "cache",
              "engine", "hf", "vllm",
              "__main__", ""}


def module_name(path: Path) -> str:
    """``fp4cache/_cuda/paged.py`` -> ``"_cuda.paged"``; the package itself is ``""``."""
    parts = list(path.relative_to(PKG).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _resolve(name: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    """The fp4cache modules an ``from ... import ...`` names (relative or absolute)."""
    if node.level:
        base = name.split(".") if name else []
        if not is_package:
            base = base[:-1]
        base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
        mod = ".".join(base + ([node.module] if node.module else []))
    elif node.module and (node.module == "fp4cache" or node.module.startswith("fp4cache.")):
        mod = node.module[len("fp4cache."):] if node.module != "fp4cache" else ""
    else:
        return []
    known = modules()
    out = [mod]
    for alias in node.names:  # "from . import pages": the submodule itself
        sub = f"{mod}.{alias.name}" if mod else alias.name
        if sub in known:
            out.append(sub)
    return out


def imports_of(name: str, path: Path) -> set[str]:
    """Every fp4cache module ``name`` imports, at any depth of the file."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            out.update(_resolve(name, is_package, node))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "fp4cache" or alias.name.startswith("fp4cache."):
                    out.add(alias.name[len("fp4cache."):] if alias.name != "fp4cache" else "")
    # a submodule's import of its own package's parent modules: "from .. import _abi"
    # resolves to "" plus "_abi"; only the named submodule counts then
    if "" in out and name != "" and not _imports_package(tree):
        out.discard("")
    out.discard(name)
    return out


def _imports_package(tree: ast.AST) -> bool:
    """Whether the file imports ``fp4cache`` itself (``from . import PagedKVCache`` in
    ``__main__``, ``import fp4cache``), not only its submodules."""
    known = modules()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name == "fp4cache" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (
                (node.level == 1 and node.module is None) or node.module == "fp4cache"):
            if any(a.name not in known for a in node.names):
                return True
    return False


def test_every_module_has_a_place_in_the_order():
    assert set(modules()) == set(ORDER), "add the module to ORDER (and to _backend's doc)"


@pytest.mark.parametrize("name", ORDER)
def test_no_module_imports_one_above_it(name):
    path = modules()[name]
    above = sorted(m for m in imports_of(name, path) if m in RANK and RANK[m] > RANK[name])
    assert not above, f"fp4cache.{name or '__init__'} imports {above}, listed above it"


def test_the_order_has_no_circle():
    """The import graph is acyclic (follows from the test above; checked directly so that
    a failure names the circle)."""
    graph = {name: imports_of(name, path) & set(RANK) for name, path in modules().items()}
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack + [node, nxt]))
            if nxt not in state:
                visit(nxt, stack + [node])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [])


@pytest.mark.parametrize("name", sorted(FRONT_ENDS))
def test_front_ends_reach_backends_only_through_the_protocol(name):
    bad = sorted(m for m in imports_of(name, modules()[name])
                 if m.split(".")[0] in BACKENDS)
    assert not bad, f"fp4cache.{name or '__init__'} imports the backend module(s) {bad}"


def _private_cache_attributes() -> set[str]:
    """The private attributes ``PagedKVCache`` sets on itself (``self._x = ...``)."""
    tree = ast.parse((PKG / "cache.py").read_text())
    out = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "self" and node.attr.startswith("_")
                and not node.attr.startswith("__") and isinstance(node.ctx, ast.Store)):
            out.add(node.attr)
    return out


def test_private_attributes_of_the_cache_are_read_in_cache_py_only():
    private = _private_cache_attributes()
    assert "_pool" in private
    root = PKG.parent
    files = [p for p in sorted(PKG.rglob("*.py")) if p.name != "cache.py"]
    files += sorted((root / "tests").glob("*.py")) + sorted((root / "bench").glob("*.py"))
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in private:
                found.append(f"{path.relative_to(root)}:{node.lineno} .{node.attr}")
    assert not found, "\n".join(found)


#: The front ends over a cache's pool: what differs between devices is the pool's (its
#: methods) or the backend's, never a branch here.
POOL_FRONT_ENDS = ("cache", "attention", "store", "pages", "engine")


def _device_branches(tree: ast.AST) -> list[int]:
    """Lines comparing a device kind (``x.device``, ``kind``) with ``"cpu"`` / ``"cuda"``."""
    def names_device(node: ast.AST) -> bool:
        return any((isinstance(n, ast.Attribute) and n.attr == "device")
                   or (isinstance(n, ast.Name) and n.id == "kind") for n in ast.walk(node))

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Constant) and s.value in ("cpu", "cuda") for s in sides) \
                    and any(names_device(s) for s in sides):
                lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("name", POOL_FRONT_ENDS)
def test_front_ends_do_not_branch_on_the_device(name):
    path = modules()[name]
    tree = ast.parse(path.read_text(), str(path))
    assert not _device_branches(tree), (
        f"fp4cache/{name}.py compares a device kind at lines {_device_branches(tree)}: ask "
        "the pool (its methods, checks_are_free) or the backend instead")


def test_the_device_branch_check_finds_a_branch():
    tree = ast.parse('if pool.device == "cpu":\n    pass\nif kind != "cuda":\n    pass\n')
    assert _device_branches(tree) == [1, 3]
