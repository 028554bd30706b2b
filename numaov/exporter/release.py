"""Giving a finished stage's memory back to the system before the next stage of an export."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None on a C library without it."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> None:
    """Collect the garbage, then return the heaps' free pages to the system.

    A model freed after its stage of an export otherwise stays in the process's resident
    memory: glibc serves every allocation below its mmap threshold (which rises to 32 MiB once
    a large block is freed, i.e. after the first weight) from heaps it shrinks only from the
    top. Measured on a 4-block Wan 1.3B-width bf16 export: 743 MiB resident after the torch
    model was freed, 335 MiB after ``malloc_trim``.
    """
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
