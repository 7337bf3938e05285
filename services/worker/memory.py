"""Freed memory goes back to the OS: glibc keeps what the forward frees inside its heap, so a worker's RSS
crept up under load (docs/benchmarks.md, the soak); a periodic malloc_trim returns it."""

from __future__ import annotations

import ctypes
import ctypes.util

TRIM_INTERVAL_S = 10.0  # one trim (a few ms, outside the GIL) per this many seconds


def _libc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


_MALLOC_TRIM = _libc_trim()


def trim() -> bool:
    """Return the heap's free pages to the OS; False where the C library has no malloc_trim."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True
