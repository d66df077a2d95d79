"""The CuPy backend: the kernels of ``kernels/`` launched on CuPy's current stream.

It implements the protocol of :mod:`fp4cache._backend` (the front end has validated
shapes, dtypes and ranges, computed the float32 scalars, allocated the outputs and made
the arrays' device current): it makes a cache's pool
(:class:`~fp4cache._cuda.state.DevicePool`, :func:`new_pool`), and its runners prepare a
launch once per signature and keep it in the pool's plans.  One module per feature:

* :mod:`.state`: the pool, what a cache owns on the GPU;
* :mod:`.paged`: store, gather and the flat codec;
* :mod:`.decode`: the split plan, decode and few-row attention;
* :mod:`.varlen`: attention for any query length;
* :mod:`.pages`: page moves and host transfers;
* :mod:`.window`: the exact window's fill and copy;
* :mod:`.runners`: the prepared store, gather and attention of a pool;
* :mod:`.longlive`: LongLive's blocks;
* :mod:`.launch`: launch helpers.
"""

from __future__ import annotations

from .decode import decode_attention, decode_runner, workspace_bound
from .longlive import (
    abs_max,
    longlive_dequantize,
    longlive_list_launcher,
    longlive_pointer_tables,
    longlive_pool_launcher,
    longlive_quantize,
)
from .paged import dequantize, gather_dequant, gather_plan, quantize, store, store_plan
from .pages import copy_pages, read_pages, write_pages
from .runners import attention_runner, gather_runner, store_runner
from .state import PAGE_EXTRAS, DevicePool, allocation_bytes, memory_available, new_pool
from .varlen import attention, varlen_runner
from .window import copy_window, fill_window, map_window

__all__ = [
    "DevicePool", "PAGE_EXTRAS", "new_pool", "allocation_bytes", "memory_available", "store_plan",
    "gather_plan", "decode_runner", "varlen_runner",
    "workspace_bound", "store", "gather_dequant", "decode_attention", "attention",
    "quantize", "dequantize", "abs_max", "longlive_quantize", "longlive_dequantize",
    "longlive_pointer_tables", "longlive_pool_launcher", "longlive_list_launcher",
    "copy_pages", "read_pages", "write_pages", "map_window", "fill_window", "copy_window",
    "store_runner", "gather_runner", "attention_runner",
]
