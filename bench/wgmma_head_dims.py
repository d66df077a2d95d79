"""A pytest plugin for the device checks: every head dim the wgmma kernel compiles for
(``fp4cache._abi.VARLEN_WG_GEOMETRY``) routed to it, ahead of the library, which routes
only ``_abi.VARLEN_WG_HEAD_DIMS`` (a head dim joins those once it has run on a GPU).

From the repository root (pytest-xdist's workers load it too)::

    PYTHONPATH=.:bench python3 -m pytest -p wgmma_head_dims tests/test_attention_varlen.py -k 256
"""

from __future__ import annotations

from fp4cache import _abi


def route_all() -> None:
    """Route every head dim of ``_abi.VARLEN_WG_GEOMETRY`` to the wgmma kernel."""
    _abi.VARLEN_WG_HEAD_DIMS = tuple(_abi.VARLEN_WG_GEOMETRY)


def pytest_configure(config) -> None:
    route_all()
    print(f"wgmma head dims: {_abi.VARLEN_WG_HEAD_DIMS}", flush=True)
