"""The built wheel installs into a fresh venv and ships the CUDA sources as package data."""

from __future__ import annotations

import hashlib
import json
import os
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

    for name in ("quantize", "dequantize", "PagedKVCache", "PageGeometry", "longlive",
                 "formats", "layout", "gpu_available", "__version__"):
        assert hasattr(fp4cache, name), name
        assert name in fp4cache.__all__, name
    assert callable(fp4cache.longlive.quantize_block)
    assert callable(fp4cache.longlive.dequantize)
    try:
        import tomllib
    except ImportError:  # Python 3.10
        pytest.skip("tomllib needs Python 3.11")
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert fp4cache.__version__ == meta["project"]["version"]
