"""Returning the C heap's free memory to the operating system between optimizer steps.

Every step allocates host tensors of new sizes (rows are packed to the data, batches vary), and
glibc's malloc raises its mmap threshold each time a large mapped block is freed, so later blocks of
that size are carved from the heap instead. Freed heap pages stay resident until ``malloc_trim``
hands them back: without it the trainer's resident memory climbs in steps over a long run while the
live data stays the same (``tests/integration/test_soak.py`` measures it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


def release_free_heap() -> bool:
    """Give the free pages of the C heap back to the OS; False where the C library cannot (not glibc)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
