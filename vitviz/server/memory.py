"""Handing freed heap back to the system in a long-running server."""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["release_memory"]


def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_TRIM = _malloc_trim()


def release_memory() -> None:
    """Hands freed heap back to the system (glibc's malloc_trim; a no-op elsewhere).

    A long-running server that allocates and frees many mid-sized buffers (attention stacks, image
    rasters) otherwise keeps the freed pages: resident memory creeps up without any leak.
    """
    if _TRIM is not None:
        _TRIM(0)
