"""fp4cache benchmark: bandwidth of the NVFP4 KV-cache kernels against the copy ceiling
and against the same work written in PyTorch (eager and ``torch.compile``).

Run on a GPU (from the repository root)::

    PYTHONPATH=. python3 bench/bench.py --out bench.json

or on the CPU, NumPy backend, tiny sizes (same code paths, for testing the script)::

    python3 bench/bench.py --cpu --quick

See ``bench/README.md`` for what is measured and how bytes are counted.  Every section
is wrapped: a failure prints its error and the rest still runs.  The JSON file is
rewritten after every section, and a markdown table is the last thing printed.  Exit
status: 0 when no section recorded an error, 1 when one did (the table lists them), 2
without a GPU (and no ``--cpu``), 3 when the watchdog stopped the run.

This file runs the sections (``--only``); each one's method is in its own module:
``timing.py`` (timing, copy ceiling, rows, JSON and table), ``suite.py`` (sizes, targets,
device info, copy, inputs and page pools), ``store_gather.py`` (sanity, large store and
gather, decode-step sizes), ``longlive_bench.py`` (LongLive), ``host_time.py`` (host time
per call) and ``torch_baselines.py`` (PyTorch eager / ``torch.compile``,
``--verify-reference``).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
for _p in (str(_ROOT), str(_ROOT / "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from host_time import HostTime  # noqa: E402
from longlive_bench import LongLiveBench  # noqa: E402
from store_gather import StoreGather  # noqa: E402
from suite import Suite  # noqa: E402
from torch_baselines import TorchBaselines, verify_reference  # noqa: E402


class Bench(Suite, StoreGather, LongLiveBench, HostTime, TorchBaselines):
    """The whole run: ``Suite``'s state and setup plus every section's methods."""

    def run(self) -> None:
        a = self.args
        only = set(a.only.split(",")) if a.only else None
        unknown = (only or set()) - set(SECTIONS)
        if unknown:
            raise SystemExit(f"--only: unknown section(s) {sorted(unknown)}; choose from "
                             f"{', '.join(SECTIONS)}")

        def want(key: str) -> bool:
            return only is None or key in only

        # where each section's method is: copy, setup -> suite.py; sanity, large, decode ->
        # store_gather.py; longlive, longlive-list -> longlive_bench.py; host -> host_time.py;
        # torch -> torch_baselines.py
        self.section("device and versions", self.sec_info)
        for key, title, fn in (
                ("copy", "copy bandwidth (ceiling)", self.sec_copy),
                ("setup", "setup: inputs and page pools", self.sec_setup),
                ("sanity", "sanity: bit-exact vs NumPy backend", self.sec_sanity),
                ("large", "fp4cache store / gather, large", self.sec_fp4_large),
                ("longlive", "fp4cache LongLive decode", self.sec_longlive),
                ("longlive-list", "LongLive list API by block count", self.sec_longlive_list),
                ("decode", "decode-step sizes", self.sec_decode),
                ("host", "host time per call", self.sec_host)):
            if want(key):
                self.section(title, fn)
        if not a.no_torch and want("torch"):
            self.section("torch eager", lambda: self.sec_torch("eager"), need_s=20)
            if not a.no_compile:
                self.section("torch.compile", lambda: self.sec_torch("compile"),
                             need_s=a.compile_need_s)
        self.write_json()


#: Section keys for ``--only`` (the device/version section always runs).
SECTIONS = ("copy", "setup", "sanity", "large", "longlive", "longlive-list", "decode", "host",
            "torch")


def _watchdog(bench: Bench) -> None:
    """Past the hard limit (a hung kernel, a slow compile): report what we have and exit."""
    try:
        bench.errors.append({"where": "watchdog", "traceback": "",
                             "error": f"still running after {bench.args.watchdog_s:.0f} s: "
                                      "stopped; the sections after the last one printed "
                                      "did not finish"})
        bench.write_json()
        print(f"\n!! watchdog: {bench.args.watchdog_s:.0f} s elapsed, stopping", flush=True)
        print(bench.table(), flush=True)
    finally:
        os._exit(3)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true",
                   help="NumPy backend at tiny sizes, perf_counter timing (tests the script)")
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer repetitions")
    p.add_argument("--out", help="write all numbers to this JSON file (rewritten per section)")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison")
    p.add_argument("--only", metavar="KEYS",
                   help="comma-separated sections to run: " + ", ".join(SECTIONS)
                   + " (setup is needed by sanity, large, decode, host and torch)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="wall-clock budget: later sections are skipped past it (default 420)")
    p.add_argument("--compile-need-s", type=float, default=90.0,
                   help="time left needed before starting a torch.compile (default 90)")
    p.add_argument("--watchdog-s", type=float, default=470.0,
                   help="hard stop: print the table so far and exit 3 (default 470; 0: off)")
    p.add_argument("--verify-reference", action="store_true",
                   help="only check bench/torch_reference.py against the NumPy backend on "
                        "the CPU (all layouts and rules) and exit")
    args = p.parse_args(argv)
    if args.verify_reference:
        return verify_reference(compile_too=not args.no_compile)
    if not args.cpu:
        import fp4cache

        if not fp4cache.gpu_available():
            print("error: no usable CUDA GPU through CuPy; run with --cpu to test the script "
                  "on the NumPy backend", file=sys.stderr)
            return 2
    bench = Bench(args)
    watchdog = threading.Timer(args.watchdog_s, _watchdog, (bench,))
    watchdog.daemon = True
    if args.watchdog_s > 0:
        watchdog.start()
    try:
        bench.run()
    except KeyboardInterrupt:
        bench.errors.append({"where": "run", "error": "KeyboardInterrupt", "traceback": ""})
    finally:
        watchdog.cancel()
        bench.write_json()
        if args.out:
            print(f"\nJSON: {args.out}")
        print(bench.table(), flush=True)
    if bench.errors:  # the table above lists them; a run that recorded one has failed
        print(f"bench.py: {len(bench.errors)} error(s) recorded, exit status 1",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
