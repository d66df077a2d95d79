"""The built wheel installs into a fresh venv and ships the CUDA sources as package data;
the sdist is complete, and the benchmarks it ships run."""

from __future__ import annotations

import hashlib
import json
import os
import re
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

PROBE = r"""
import hashlib, importlib, importlib.resources, json, sys
import fp4cache
kdir = importlib.resources.files("fp4cache") / "kernels"
files = {}
if kdir.is_dir():
    for p in kdir.iterdir():
        if p.name.endswith((".cu", ".cuh")):
            files[p.name] = hashlib.sha256(p.read_bytes()).hexdigest()
info = {"file": fp4cache.__file__, "version": fp4cache.__version__, "kernels": files,
        "kernel_dir": str(kdir)}
try:
    loader = importlib.import_module("fp4cache._kernels")
except ImportError:
    loader = None
if loader is not None:
    info["loader_dir"] = str(loader.kernel_dir())
# the package works from the install: a tiny CPU round trip
import numpy as np
d, s = fp4cache.quantize(np.full((1, 16), 6.0, np.float32))
info["round_trip"] = fp4cache.dequantize(d, s, dtype="float32").tolist()
print(json.dumps(info))
"""


def repo_kernel_sources() -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((REPO / "kernels").glob("*")) if p.suffix in (".cu", ".cuh")}


@pytest.mark.slow
def test_wheel_installs_and_ships_kernels(tmp_path):
    # The build backend comes with the `test` extra (CI installs it); a machine without
    # it and without network (the GPU image) cannot build the wheel at all.
    pytest.importorskip("hatchling", reason="hatchling (the build backend) is not installed")
    wheel_dir = tmp_path / "wheels"
    want = repo_kernel_sources()  # before the build: the wheel must hold these bytes
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheel_dir), str(REPO)],
        check=True, cwd=tmp_path, capture_output=True, text=True,
    )
    wheels = list(wheel_dir.glob("fp4cache-*.whl"))
    assert len(wheels) == 1, wheels
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True, capture_output=True)
    py = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    # The test's own environment (numpy, ml_dtypes) may itself be a venv, which
    # --system-site-packages does not see: append its site-packages (after the new venv's).
    probe_site = "import sysconfig; print(sysconfig.get_path('purelib'))"
    vsite = subprocess.run([str(py), "-c", probe_site], check=True, capture_output=True,
                           text=True).stdout.strip()
    parents = [p for p in [*site.getsitepackages(), sysconfig.get_path("purelib")]
               if Path(p).is_dir()]
    (Path(vsite) / "_parent_env.pth").write_text("\n".join(dict.fromkeys(parents)) + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                    str(wheels[0])], check=True, capture_output=True, text=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    run = subprocess.run([str(py), "-c", PROBE], cwd=tmp_path, env=env, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr
    info = json.loads(run.stdout.strip().splitlines()[-1])
    installed = Path(info["file"]).resolve()
    assert installed.is_relative_to(venv.resolve()), installed
    assert not installed.is_relative_to(REPO), installed
    assert info["version"] == __import__("fp4cache").__version__
    assert info["round_trip"] == [[6.0] * 16]
    if repo_kernel_sources() != want:
        pytest.skip("kernels/ was edited while this test ran; run it again")
    if not want:
        pytest.skip("kernels/ holds no .cu/.cuh file yet")
    assert info["kernels"] == want  # every source, identical bytes, nothing missing
    assert Path(info["kernel_dir"]).resolve().is_relative_to(venv.resolve())
    if (REPO / "fp4cache" / "_kernels.py").exists():
        assert Path(info["loader_dir"]).resolve() == Path(info["kernel_dir"]).resolve()


def test_public_api_and_version():
    import fp4cache

    for name in ("quantize", "dequantize", "calibrate_scale", "PagedKVCache", "PageGeometry",
                 "longlive", "formats", "layout", "gpu_available", "__version__"):
        assert hasattr(fp4cache, name), name
        assert name in fp4cache.__all__, name
    assert callable(fp4cache.longlive.quantize_block)
    assert callable(fp4cache.longlive.dequantize)
    import numpy as np

    block = fp4cache.longlive.quantize_block(np.ones((1, 1, 64), np.float32))
    assert type(block) is fp4cache.longlive.LongLiveBlock
    try:
        import tomllib
    except ImportError:  # Python 3.10
        pytest.skip("tomllib needs Python 3.11")
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert fp4cache.__version__ == meta["project"]["version"]


#: sha256 of the official Apache License 2.0 text (apache.org/licenses/LICENSE-2.0.txt).
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"


def test_license_is_the_official_apache_2_text():
    text = (REPO / "LICENSE").read_bytes()
    assert hashlib.sha256(text).hexdigest() == APACHE_2_SHA256
    try:
        import tomllib
    except ImportError:  # Python 3.10
        pytest.skip("tomllib needs Python 3.11")
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"


def test_metadata_classifiers_and_keywords():
    """What an index page shows: valid trove classifiers that agree with the package
    (Python versions within requires-python, typed since it ships py.typed), keywords,
    and no license classifier next to the SPDX license expression (PEP 639)."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    classifiers = meta["classifiers"]
    assert classifiers == sorted(set(classifiers), key=classifiers.index)  # no repeats
    try:
        from trove_classifiers import classifiers as known
    except ImportError:  # comes with hatchling (the test extra)
        known = None
    if known is not None:
        unknown = [c for c in classifiers if c not in known]
        assert not unknown, f"not trove classifiers: {unknown}"
    assert "Typing :: Typed" in classifiers and (REPO / "fp4cache" / "py.typed").is_file()
    assert not any(c.startswith("License ::") for c in classifiers)
    low = tuple(int(x) for x in meta["requires-python"].lstrip(">=").split("."))
    versions = [tuple(int(x) for x in c.rsplit(" ", 1)[1].split("."))
                for c in classifiers if c.startswith("Programming Language :: Python :: 3.")]
    assert versions and min(versions) == low, (versions, meta["requires-python"])
    assert {"nvfp4", "kv-cache", "vllm"} <= set(meta["keywords"])
    for extra in meta["optional-dependencies"]:  # cuda12, cuda13: a classifier each
        if re.fullmatch(r"cuda\d+", extra):
            assert f"Environment :: GPU :: NVIDIA CUDA :: {extra[4:]}" in classifiers, extra


def _floors() -> dict[str, tuple[int, ...]]:
    """``{name: floor}`` of pyproject.toml's ``name>=floor`` dependencies."""
    text = (REPO / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies\s*=\s*\[(.*?)\]", text, re.S | re.M).group(1)
    return {m.group(1): tuple(int(x) for x in m.group(2).split("."))
            for m in re.finditer(r'"([A-Za-z0-9_.-]+)>=([0-9.]+)"', deps)}


def test_dependency_floors_are_versions_that_work():
    """ml_dtypes 0.4 imports but has no float4_e2m1fn (the E2M1 type every store and
    gather uses): the floor is 0.5.0, the first release with it; numpy 1.24 is the oldest
    NumPy that CI's minimum-versions step (.ci/run, .ci/floors.py) installs and tests."""
    import ml_dtypes

    floors = _floors()
    assert set(floors) == {"numpy", "ml_dtypes"}, floors
    assert floors["ml_dtypes"] >= (0, 5), floors
    assert floors["numpy"] >= (1, 24), floors
    assert hasattr(ml_dtypes, "float4_e2m1fn")


CI = REPO / ".ci" / "run"
needs_ci = pytest.mark.skipif(not CI.is_file(), reason="a checkout's CI script (.ci/ is not "
                                                       "in the sdist)")


def _readme_installs() -> list[str]:
    """The extras of the README's ``pip install -e ...`` lines that run the tests."""
    lines = (REPO / "README.md").read_text().split("```")[1].splitlines()
    out = []
    for ln in lines:
        m = re.search(r'pip install -e "?\.(?:\[([^\]]*)\])?"?\s*&&\s*python -m pytest -q', ln)
        if m:
            out.append(m.group(1) or "")
    return out


@needs_ci
def test_ci_runs_the_suite_in_every_install_the_readme_gives():
    """CI installs each of the README's test lines in its own venv (with CuPy and
    without: the CPU-only one must not see CuPy) and runs the suite there, plus the
    minimum-versions venv; every suite function is in the list that runs."""
    text = CI.read_text()
    installs = _readme_installs()
    assert "test,notebooks,cuda12" in installs and "test,notebooks" in installs, installs
    venvs = dict(re.findall(r'^\s+new_venv (\w+) "([^"]*)"', text, re.M))
    for extras in installs:
        assert extras in venvs.values(), (extras, venvs)
    cpu = next(n for n, e in venvs.items() if e == "test,notebooks")
    assert f"in_venv {cpu} no_cupy" in text
    suites = re.search(r'^SUITES="([^"]*)"', text, re.M).group(1).split()
    defined = re.findall(r"^suite_(\w+)\(\)", text, re.M)
    assert sorted(suites) == sorted(defined) and set(venvs) <= set(suites), (suites, defined)
    for name, extras in venvs.items():
        if extras:  # the README's lines with an extra run the tests
            assert re.search(rf"^\s*pytest_in {name}\b", text, re.M), name
    base = next(n for n, e in venvs.items() if e == "")  # pip install -e . && python -m fp4cache
    assert re.search(rf"^\s*in_venv {base} python -m fp4cache\b", text, re.M)
    assert "pip install -e . && python -m fp4cache" in (REPO / "README.md").read_text()
    assert '"$rc" -eq 5' in text  # pytest's "no tests collected" is a failure


@needs_ci
def test_ci_minimum_versions_step_pins_the_declared_floors():
    r = subprocess.run([sys.executable, str(REPO / ".ci" / "floors.py")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    pins = dict(ln.split("==") for ln in r.stdout.split())
    assert {k: tuple(int(x) for x in v.split(".")) for k, v in pins.items()} == _floors()
    text = CI.read_text()
    assert "python3 .ci/floors.py" in text and 'new_venv min "test" -c' in text
    assert "floors.py --check" in text


def test_changelog_has_unreleased_and_the_current_version_with_numbers():
    import fp4cache

    text = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")
    heads = [ln for ln in text.splitlines() if ln.startswith("## ")]
    assert heads[0] == "## [Unreleased]", heads  # Keep a Changelog
    assert re.fullmatch(rf"## \[{re.escape(fp4cache.__version__)}\] - \d{{4}}-\d{{2}}-\d{{2}}",
                        heads[1]), heads
    for section in text.split("\n## ")[1:]:
        subs = [ln for ln in section.splitlines() if ln.startswith("### ")]
        assert subs and set(subs) <= {"### Added", "### Changed", "### Deprecated",
                                      "### Removed", "### Fixed", "### Security"}, subs
    current = text.split(heads[1], 1)[1]
    assert len(re.findall(r"\d µs", current)) >= 8, "the version's section quotes few timings"
    assert "% of copy" in current


def _repo_files(folder: str) -> set[str]:
    return {str(p.relative_to(REPO)) for p in (REPO / folder).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
            and ".ipynb_checkpoints" not in p.parts}


def test_sdist_is_complete(tmp_path):
    """The sdist holds what its tests need (notebooks, docs), the LICENSE, and no CI or
    build debris; the notebook and doc tests can run from an unpacked sdist."""
    pytest.importorskip("hatchling", reason="hatchling (the build backend) is not installed")
    import tarfile

    out = subprocess.run([sys.executable, "-m", "hatchling", "build", "-t", "sdist", "-d",
                          str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    (sdist,) = tmp_path.glob("fp4cache-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        lic = tar.extractfile(next(m for m in tar.getmembers()
                                   if m.name.endswith("/LICENSE"))).read()
    assert hashlib.sha256(lic).hexdigest() == APACHE_2_SHA256
    for f in ("LICENSE", "README.md", "CHANGELOG.md", "BENCHMARKS.md", "pyproject.toml",
              "PKG-INFO"):
        assert f in names, f
    for folder in ("fp4cache", "kernels", "tests", "notebooks", "docs"):
        want = _repo_files(folder)
        assert want, folder
        missing = want - names
        assert not missing, f"sdist lacks {sorted(missing)}"
    for n in ("notebooks/01_quickstart.ipynb", "docs/format.md", "tests/test_notebooks.py"):
        assert n in names, n
    assert not any(n.startswith((".ci/", ".git/", ".venv")) or "__pycache__" in n
                   for n in names), sorted(names)


def test_notebook_tests_skip_without_their_extra():
    """With only the ``test`` extra, the notebook tests skip (with a reason), not fail."""
    code = (
        "import sys\n"
        "for m in ('nbclient', 'nbformat', 'ipykernel', 'matplotlib'): sys.modules[m] = None\n"
        "import pytest\n"
        "sys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', "
        "'tests/test_notebooks.py', '-k', 'stored_clean or executes']))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(REPO)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "failed" not in r.stdout and "skipped" in r.stdout, r.stdout
    assert "the notebook tests need nbclient, nbformat, ipykernel, matplotlib" in r.stdout


def test_bench_scripts_run_on_the_cpu(tmp_path):
    """The shipped benchmarks (``bench/``) import and run: ``bench.py --cpu --quick`` runs
    every section but torch on the NumPy backend at tiny sizes (its numbers mean nothing
    there; this checks the script) and the GPU-only scripts answer ``--help``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(REPO)
    for script in ("attention_bench.py", "attn_kernel.py", "seed_longlive.py", "bench.py",
                   "pages_bench.py", "soak_bench.py", "sweep_bench.py", "vllm_bench.py"):
        r = subprocess.run([sys.executable, f"bench/{script}", "--help"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout.startswith("usage: "), (script, r.stderr)
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "bench/bench.py", "--cpu", "--quick", "--no-torch",
                        "--watchdog-s", "0", "--out", str(out)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["errors"] == [] and doc["skipped"] == [], (doc["errors"], doc["skipped"])
    sections = {row["section"] for row in doc["rows"]}
    assert sections == {"copy", "store", "gather", "longlive", "decode", "host"}, sections
    assert all(row["time_s"] > 0 for row in doc["rows"]), doc["rows"]
    sanity = [c for c in doc["checks"] if c["check"].startswith("fp4cache cpu vs NumPy")]
    assert len(sanity) == 2 and all(c["page_bytes_identical"] == 1.0
                                    and c["gather_bits_identical"] == 1.0 for c in sanity)
    assert "| case | impl | time (us) |" in r.stdout  # the markdown table comes last


def test_sweep_bench_runs_on_the_cpu(tmp_path):
    """``bench/sweep_bench.py --cpu --quick`` (the decode-attention sweep on the NumPy
    backend at tiny shapes): every (B, L) cell is measured, checked against the float32
    reference, and printed in the B x L markdown table; the JSON and the plot are written."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(REPO)
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    r = subprocess.run([sys.executable, "bench/sweep_bench.py", "--cpu", "--quick", "--out",
                        str(out), "--plot", str(png)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    Bs, Ls = doc["Bs"], doc["Ls"]
    assert len(Bs) >= 2 and len(Ls) >= 2, (Bs, Ls)
    assert doc["errors"] == [] and doc["skipped"] == [], (doc["errors"], doc["skipped"])
    cells = {(row["B"], row["L"]): row for row in doc["rows"]}
    assert sorted(cells) == sorted((B, L) for B in Bs for L in Ls), sorted(cells)
    for (B, L), row in cells.items():
        assert row["fused_us"] > 0 and row["gbps"] > 0 and row["frac_copy"] > 0, row
        assert row["check"] == "ok" and row["max_row_rel_err"] <= 1e-2, row
        assert row["page_bytes"] == B * L * 2 * 8 * (128 // 2 + 128 // 16), row
        assert 1 <= row["checked_seqs"] <= B and row["sets"] >= 1, row
        assert row["target"] == (1.5 if B * L >= 65536 else 1.0), row
        if "ratio" in row:  # torch importable: SDPA (math backend on the CPU) beside it
            assert row["met"] == (row["ratio"] >= row["target"]), row
    # the first table: rows B, columns L, each cell "fused us / ratio met?"
    lines = r.stdout.splitlines()
    head = lines.index("| B \\ L | " + " | ".join(map(str, Ls)) + " |")
    cell = re.compile(r"^\d+\.\d / (-|\d+\.\d\dx) (met|MISSED|\?)$")
    for i, B in enumerate(Bs):
        parts = [x.strip() for x in lines[head + 2 + i].strip("|").split("|")]
        assert parts[0] == str(B) and len(parts) == 1 + len(Ls), parts
        assert all(cell.match(x) for x in parts[1:]), parts
        want = [f"{cells[(B, L)]['fused_us']:.1f} / " for L in Ls]
        assert [x[:len(w)] for x, w in zip(parts[1:], want)] == want, (parts, want)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib not importable" in r.stdout
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_bench_targets_and_tiles():
    """The per-cell target (ratio >= 1.5 from B * L = 65536 tokens, >= 1.0 below)
    and the disjoint tiles a cell rotates through."""
    code = (
        "import json, sys\n"
        "sys.path.insert(0, 'bench')\n"
        "import sweep_bench as s\n"
        "print(json.dumps(dict(\n"
        "    targets=[s.target_ratio(B, L) for B, L in [(1, 65536), (1, 16384), (4, 16384),\n"
        "                                               (64, 512), (64, 1024), (2, 32752)]],\n"
        "    tiles=[s.tiles(4, 8, 2, 2, w) for w in (100, 3, 0)],\n"
        "    one=s.tiles(64, 4096, 64, 4096, 5))))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(REPO)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["targets"] == [1.5, 1.0, 1.5, 1.0, 1.5, 1.0]
    full, three, none = got["tiles"]
    assert len(full) == 8 and len(three) == 3 and len(none) == 1 and got["one"] == [[0, 0]]
    cover = [(r0 + i, c0 + j) for r0, c0 in full for i in range(2) for j in range(2)]
    assert sorted(cover) == [(i, j) for i in range(4) for j in range(8)]  # disjoint, in range


def _run_bench_without_cupy(args, tmp_path):
    """``bench/bench.py args`` in a subprocess where ``import cupy`` fails, as in the
    CPU-only install (``.[test,notebooks]``), whether or not CuPy is installed here."""
    code = ("import runpy, sys\n"
            "sys.modules['cupy'] = None\n"
            f"sys.argv = ['bench/bench.py'] + {list(args)!r}\n"
            "runpy.run_path('bench/bench.py', run_name='__main__')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_bench_longlive_list_runs_on_the_cpu_without_cupy(tmp_path):
    """The LongLive list-API section imports the CuPy backend only for its GPU rows, so
    ``--cpu`` works where CuPy is not installed."""
    out = tmp_path / "bench.json"
    r = _run_bench_without_cupy(["--cpu", "--quick", "--no-torch", "--only", "longlive-list",
                                 "--watchdog-s", "0", "--out", str(out)], tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["errors"] == [], doc["errors"]
    assert {row["section"] for row in doc["rows"]} == {"longlive"}, doc["rows"]


def test_bench_exits_nonzero_when_it_recorded_an_error(tmp_path, monkeypatch, capsys):
    """A section that fails is recorded, the rest still runs, and the exit status is 1."""
    import importlib.util

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location("fp4cache_bench_main",
                                                  REPO / "bench" / "bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def broken():
        raise RuntimeError("a section that fails")

    def run(self):
        self.section("broken section", broken)
        self.write_json()

    monkeypatch.setattr(mod.Bench, "run", run)
    out = tmp_path / "bench.json"
    args = ["--cpu", "--quick", "--no-torch", "--watchdog-s", "0", "--out", str(out)]
    assert mod.main(args) == 1
    doc = json.loads(out.read_text())
    assert [e["error"] for e in doc["errors"]] == ["RuntimeError: a section that fails"]
    text = capsys.readouterr()
    assert "1 error(s)" in text.out and "exit status 1" in text.err

    monkeypatch.setattr(mod.Bench, "run", lambda self: self.write_json())
    assert mod.main(args) == 0
