"""The demo CLI, run as a user runs it: ``python -m fp4cache`` in a subprocess."""

from __future__ import annotations

import os
import re
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
    assert any("4over6: timing decode_attention" in ln for ln in progress)
    rows = [ln for ln in out.splitlines() if ln.startswith("| static6") or
            ln.startswith("| 4over6")]
    assert len(rows) == 4  # the store/gather table, then the decode_attention table
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
    for opt in ("--version", "--tokens", "--heads", "--head-dim", "--block-size", "--layout",
                "--rule", "--device", "--reps", "--seed", "--no-swizzle"):
        assert opt in text, opt
    # every option has a help line (argparse prints nothing after a bare option)
    for phrase in ("row order in a page", "block-scale rule", "CuPy kernels",
                   "seed of the synthetic"):
        assert phrase in " ".join(text.split()), phrase
    for ln in text.splitlines():
        assert len(ln) <= 100, ln


def test_version_prints_the_package_version():
    import fp4cache

    r = _cli("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"python -m fp4cache {fp4cache.__version__}"


def test_piped_into_head_ends_without_a_traceback():
    """``python -m fp4cache | head -3``: the reader goes away after a few lines; the demo
    must exit quietly (Python's documented BrokenPipeError handling), not print a
    traceback or "Exception ignored" on stderr."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"]
                                     if env.get("PYTHONPATH") else "")
    proc = subprocess.Popen(
        [sys.executable, "-m", "fp4cache", "--device", "cpu", "--tokens", "2048", "--reps", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    first = proc.stdout.readline()  # "... generating": the run has started
    proc.stdout.close()             # the reader is gone; the demo still has much to print
    _, err = proc.communicate(timeout=240)
    assert first.startswith(b"... generating"), first
    assert b"Traceback" not in err and b"BrokenPipeError" not in err, err.decode()
    assert err == b"", err.decode()
    assert proc.returncode == 1


def test_workload_too_large_is_refused_before_generating():
    r = _cli("--device", "cpu", "--tokens", "100000000")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stdout == ""  # not even "... generating"
    assert r.stderr.startswith("usage: "), r.stderr
    assert "Traceback" not in r.stderr
    msg = r.stderr.strip().splitlines()[-1]
    assert ("error: argument --tokens: 100000000 tokens x 8 heads x head_dim 128 need about "
            in msg), msg
    assert "GiB of host memory" in msg and "pass at most about" in msg, msg


def _table_rows(out: str, first_cell: str) -> list[list[str]]:
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in out.splitlines()
            if ln.startswith(f"| {first_cell} |")]


def test_demo_reports_decode_attention_time_and_error_against_float64():
    r = _cli("--device", "cpu", "--tokens", "256", "--heads", "2", "--reps", "1")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert ("decode_attention, one decode step: 8 sequences x 32 tokens, 8 bf16 query heads"
            in out), out
    head = [ln for ln in out.splitlines() if ln.startswith("| rule | ms |")]
    assert head == ["| rule | ms | tok/s | rRMSE vs fp64, same pages | rRMSE vs fp64, bf16 K/V |"]
    for rule in ("static6", "4over6"):
        rows = _table_rows(out, rule)
        assert len(rows) == 2, rows  # one in each table
        _, ms, tok_s, e_pages, e_orig = rows[1]
        assert float(ms) > 0 and float(tok_s) > 0
        # against float64 over the same pages: only the kernel's float32 arithmetic and
        # the bf16 rounding of the output (2^-9 relative): well under 1e-2
        assert 0 < float(e_pages) < 1e-2, rows[1]
        # against the unquantized K/V the NVFP4 error adds (rRMSE ~0.09 per K/V value)
        assert float(e_pages) < float(e_orig) < 0.5, rows[1]
    assert re.search(r"rRMSE of the outputs against float64 attention", out)
