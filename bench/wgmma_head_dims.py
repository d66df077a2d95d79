"""A pytest plugin for the device checks: every head dim the wgmma kernel compiles for
(``fp4cache._abi.VARLEN_WG_GEOMETRY``) routed to it, ahead of the library, which routes
only ``_abi.VARLEN_WG_HEAD_DIMS`` (a head dim joins those once it has run on a GPU).

From the repository root (pytest-xdist's workers load it too)::

    PYTHONPATH=.:bench python3 -m pytest -p wgmma_head_dims tests/test_attention_varlen.py -k 256
"""

from __future__ import annotations

from fp4cache import _abi


def route(head_dims=None) -> None:
    """Route ``head_dims`` (default: every head dim of ``_abi.VARLEN_WG_GEOMETRY``) to the
    wgmma kernel; ``ValueError`` for one it does not compile for."""
    dims = tuple(_abi.VARLEN_WG_GEOMETRY) if head_dims is None else tuple(head_dims)
    bad = sorted(set(dims) - set(_abi.VARLEN_WG_GEOMETRY))
    if bad:
        raise ValueError(f"the wgmma kernel compiles for head dims "
                         f"{tuple(_abi.VARLEN_WG_GEOMETRY)}, not {bad}")
    _abi.VARLEN_WG_HEAD_DIMS = dims


def pytest_configure(config) -> None:
    route()
    print(f"wgmma head dims: {_abi.VARLEN_WG_HEAD_DIMS}", flush=True)
