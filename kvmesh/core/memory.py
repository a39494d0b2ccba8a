"""Giving freed memory back to the operating system.

glibc's malloc keeps the memory a process frees in its heap and arenas for later allocations:
after a burst (KV block bodies on their way to the host tier or Redis, a large step's
activations) a process's resident set stays at the burst's high-water mark although the memory
is free. ``malloc_trim(0)`` hands every whole free page back (``MADV_DONTNEED``), in every arena
(how much the soak's processes held: docs/engine.md, "Resident memory while serving"). The
engine process calls :func:`release_free_memory` once it has been idle a moment after serving
(and has its stages do the same): a few milliseconds, never while a request runs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys


@functools.cache
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim                 # glibc only (not musl)
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_memory() -> bool:
    """Return the memory this process has freed to the operating system (glibc's
    ``malloc_trim(0)``); False where there is no such call (not glibc)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
