"""Type aliases of fp4cache's public signatures.

fp4cache takes arrays from several libraries and depends on none but NumPy, so its
signatures name what an argument must *support*, not a class:

* :data:`ArrayLike`: an array argument: a ``numpy.ndarray``, a ``cupy.ndarray``, or any
  DLPack producer (a PyTorch tensor, a JAX array, ...), which is imported without a copy.
* :data:`IndexLike`: an index argument (``slot_mapping``, ``blocks``, ``block_tables``,
  ``seq_lens``, LongLive ``block_ids``): an :data:`ArrayLike` or a Python sequence of ints.
* :data:`DTypeLike`: a dtype given by name (``"bfloat16"``), as a NumPy dtype or a type.
* :data:`IntArrayLike` / :data:`IntArray`: the integer positions the offset formulas of
  :mod:`fp4cache.layout` take (Python ints or NumPy integer arrays; they broadcast) and
  return (NumPy integers or integer arrays).
* :data:`Array`: what fp4cache returns: a ``numpy.ndarray`` on the CPU backend, a
  ``cupy.ndarray`` on the GPU (CuPy is imported only by type checkers here).
* :data:`DeviceLike`: a ``device=`` argument: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, a GPU
  index or a ``cupy.cuda.Device``.
* :data:`PageFormat`: what ``PagedKVCache.page_format()`` returns (a JSON-able dict).
* :data:`PathLike`: a file name (``str`` or ``os.PathLike``).

Examples
--------
>>> import numpy as np
>>> from fp4cache.typing import SupportsDLPack
>>> isinstance(np.zeros(3), SupportsDLPack)       # NumPy arrays are DLPack producers
True
>>> isinstance([0, 1, 2], SupportsDLPack)
False
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, Union, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    import cupy

__all__ = ["Array", "ArrayLike", "DTypeLike", "DeviceLike", "IndexLike", "IntArray",
           "IntArrayLike", "PageFormat", "PathLike", "SupportsDLPack"]


@runtime_checkable
class SupportsDLPack(Protocol):
    """An object that exports itself through DLPack (``__dlpack__`` and
    ``__dlpack_device__``): NumPy and CuPy arrays, PyTorch tensors, JAX arrays, ..."""

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any: ...

    def __dlpack_device__(self) -> tuple[int, int]: ...


#: What fp4cache returns: NumPy arrays on the CPU backend, CuPy arrays on the GPU.
# (Union, not |: a string forward reference cannot take part in | at run time.)
Array = Union[np.ndarray, "cupy.ndarray"]  # noqa: UP007

#: An array argument: NumPy, CuPy, or any DLPack producer (PyTorch, JAX, ...).
ArrayLike = Union[np.ndarray, "cupy.ndarray", SupportsDLPack]  # noqa: UP007

#: An index argument: an array or a Python sequence of ints (converted).
IndexLike = ArrayLike | Sequence[int] | Sequence[Sequence[int]] | range

#: A dtype: ``"bfloat16"``, ``"float16"``, ``"float32"``, a NumPy dtype or a scalar type.
DTypeLike = str | np.dtype | type

#: Integer positions for the offset formulas of :mod:`fp4cache.layout` (they broadcast).
IntArrayLike = int | np.integer | np.ndarray | Sequence[int]

#: What the offset formulas return: a NumPy integer or integer array.
IntArray = np.integer | np.ndarray

#: A ``device=`` argument: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, a GPU index, a
#: ``cupy.cuda.Device``.
DeviceLike = Union[str, int, "cupy.cuda.Device"]  # noqa: UP007

#: ``PagedKVCache.page_format()``: field name -> a str, int, float or bool value.
PageFormat = dict[str, str | int | float | bool]

#: A file name.
PathLike = str | os.PathLike
