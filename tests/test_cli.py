"""The demo CLI, run as a user runs it: ``python -m fp4cache`` in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str, env_extra: dict | None = None, timeout: float = 240):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"]
                                     if env.get("PYTHONPATH") else "")
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "fp4cache", *args], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=ROOT)


def test_cpu_run_reports_tokens_per_second_progress_and_fits_100_columns():
    r = _cli("--device", "cpu", "--tokens", "64", "--heads", "2", "--reps", "1")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "Traceback" not in out + r.stderr
    assert "workload: 64 tokens x 2 heads" in out
    assert "tok/s" in out and "GB/s |" not in out  # no meaningless GB/s on the CPU
    progress = [ln for ln in out.splitlines() if ln.startswith("... ")]
    assert len(progress) >= 7  # generating, then per rule: first call, store, gather
    assert any("static6: timing store" in ln for ln in progress)
    assert any("4over6: timing gather" in ln for ln in progress)
    rows = [ln for ln in out.splitlines() if ln.startswith("| static6") or
            ln.startswith("| 4over6")]
    assert len(rows) == 2
    for ln in out.splitlines():
        assert len(ln) <= 100, ln


def test_single_rule_other_layout_and_no_swizzle():
    r = _cli("--device", "cpu", "--tokens", "40", "--heads", "1", "--head-dim", "48",
             "--block-size", "6", "--no-swizzle", "--layout", "NHD", "--rule", "4over6",
             "--reps", "1", "--seed", "3")
    assert r.returncode == 0, r.stderr
    assert "| 4over6 |" in r.stdout and "| static6 |" not in r.stdout


def test_device_cuda_without_a_gpu_is_one_line_and_exit_1():
    # CUDA_VISIBLE_DEVICES="" hides every GPU, so this also runs on a GPU machine
    r = _cli("--device", "cuda", "--tokens", "16", env_extra={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "error: device='cuda' needs CuPy and a CUDA GPU" in lines[0]


@pytest.mark.parametrize("args, message", [
    (("--tokens", "0"), "argument --tokens: must be a positive integer, got 0"),
    (("--tokens", "-5"), "argument --tokens: must be a positive integer, got -5"),
    (("--tokens", "many"), "argument --tokens: must be a positive integer, got 'many'"),
    (("--heads", "0"), "argument --heads: must be a positive integer"),
    (("--head-dim", "100"), "argument --head-dim: must be a multiple of 16, got 100"),
    (("--head-dim", "48"), "must be a multiple of 64 with swizzled V scales, got 48"),
    (("--head-dim", "100", "--no-swizzle"), "must be a multiple of 16, got 100"),
    (("--block-size", "6"), "argument --block-size: must be a multiple of 4 with swizzled"),
    (("--block-size", "0"), "argument --block-size: must be a positive integer"),
    (("--reps", "0"), "argument --reps: must be a positive integer"),
    (("--seed", "-1"), "argument --seed: must be an integer >= 0, got -1"),
    (("--layout", "XYZ"), "argument --layout: invalid choice"),
    (("--device", "tpu"), "argument --device: invalid choice"),
])
def test_bad_arguments_exit_2_with_usage(args, message):
    r = _cli(*args)
    assert r.returncode == 2, (args, r.stdout, r.stderr)
    assert r.stderr.startswith("usage: "), r.stderr
    assert message in r.stderr
    assert "Traceback" not in r.stderr
    assert r.stdout == ""  # nothing ran


def test_help_documents_every_option_without_rst_markup():
    r = _cli("--help")
    assert r.returncode == 0
    text = r.stdout
    assert "``" not in text and ":func:" not in text
    for opt in ("--tokens", "--heads", "--head-dim", "--block-size", "--layout", "--rule",
                "--device", "--reps", "--seed", "--no-swizzle"):
        assert opt in text, opt
    # every option has a help line (argparse prints nothing after a bare option)
    for phrase in ("row order in a page", "block-scale rule", "CuPy kernels",
                   "seed of the synthetic"):
        assert phrase in " ".join(text.split()), phrase
    for ln in text.splitlines():
        assert len(ln) <= 100, ln
