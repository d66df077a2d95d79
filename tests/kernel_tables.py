"""Test-only kernels (``tests/kernels/``) and their host side.

They include the shipped headers of ``kernels/`` and are built by the same loader
(``fp4cache._kernels``, a :class:`~fp4cache._kernels.Spec` whose ``folder`` is
:data:`FOLDER`), but no shipped module carries them.

- ``attn_dequant_table.cu``: the attention kernels' NVFP4 -> f16 decode
  (``kernels/attn_dequant.cuh``) of every E2M1 code x E4M3 scale byte x pair position,
  :func:`dequant_table`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fp4cache import _kernels as K

__all__ = ["FOLDER", "attn_dequant_table_spec", "dequant_table"]

#: The folder of the test-only kernel sources.
FOLDER = Path(__file__).resolve().parent / "kernels"


def attn_dequant_table_spec(decode_route: str = "auto") -> K.Spec:
    """The kernel that tabulates the attention's f16 decode on ``decode_route`` (one of
    ``_kernels.DECODE_ROUTES``; ``_bitmove`` in the name for the bit route)."""
    defines = K.route_defines(decode_route)
    return K.Spec("attn_dequant_table.cu", "FP4C_ATTN_DEQUANT_TABLE_KERNEL",
                  f"fp4cache_attn_dequant_table{'_bitmove' if defines else ''}", (), defines,
                  folder=str(FOLDER))


def dequant_table(decode_route: str = "auto") -> np.ndarray:
    """The kernel's E2M1 x E4M3 decode for every code, scale byte and pair position, as
    float32 ``[4 pairs, 2 halves, 16 codes, 256 bytes]``, on the current GPU.
    ``decode_route="bitmove"``: the bit-move route that GPUs before sm_89 use."""
    import cupy

    fn = K.get_kernel(attn_dequant_table_spec(decode_route))
    out = cupy.empty(8 * 4096, dtype=np.float32)
    fn((16,), (256,), (out,))
    return out.get().reshape(4, 2, 16, 256)
