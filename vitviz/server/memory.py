"""Handing freed heap back to the system in a long-running server."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

__all__ = ["KEEP_BYTES", "resident_bytes", "release_memory"]

# Resident memory let grow past what the last hand-back left before the freed heap is handed back
# again: the working set of a few ViT-B/16 analyses, kept for the next request to reuse; a request
# that frees more (ViT-L at 384 px frees GBs) goes past it and is handed back. (The server's is
# VITVIZ_HEAP_KEEP_MB, `vitviz.server.settings`.)
KEEP_BYTES = 256 * 2**20
# A call that kept the freed heap hands it back after this many seconds without another call: what a
# burst of requests kept goes back once the burst is over.
IDLE_SECONDS = 30.0


def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_TRIM = _malloc_trim()
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_LOCK = threading.Lock()
_after_last: int | None = None  # resident bytes just after the last hand-back
_calls = 0  # calls so far: an idle hand-back goes ahead only if none came after it was armed
_idle: threading.Timer | None = None


def resident_bytes() -> int | None:
    """This process's resident memory (Linux's /proc/self/statm); None where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def release_memory(*, keep: int | None = None) -> None:
    """Hands freed heap back to the system (glibc's malloc_trim; a no-op elsewhere) once resident
    memory has grown more than `keep` bytes (None: `KEEP_BYTES`; 0: at once) past what the last
    hand-back left, and otherwise `IDLE_SECONDS` later if no call has come by then.

    A long-running server that allocates and frees many mid-sized buffers (attention stacks, image
    rasters) otherwise keeps the freed pages: resident memory creeps up without any leak. Handing
    back, before and after every request, a working set the next forward allocates again costs that
    forward a fault for each page, each zeroed anew (more still on a virtual machine that returns
    free memory to its host: 30 ms of a 299 ms ViT-B/16 analysis on the 2-core test machine,
    docs/performance.md). So while requests come, resident memory may stay up to `keep` above what
    the last hand-back left (freed heap is reused by the next request, not lost), and it goes back to
    what is live once they stop.
    """
    global _after_last, _calls, _idle
    if _TRIM is None:
        return
    keep = KEEP_BYTES if keep is None else keep
    with _LOCK:
        _calls += 1
        if _idle is not None:
            _idle.cancel()
            _idle = None
        now = resident_bytes()
        if keep > 0 and now is not None and _after_last is not None and now - _after_last <= keep:
            _idle = threading.Timer(IDLE_SECONDS, _hand_back_if_idle, args=(_calls,))
            _idle.daemon = True
            _idle.start()
            return
        _hand_back()


def _hand_back() -> None:
    global _after_last
    _TRIM(0)
    _after_last = resident_bytes()


def _hand_back_if_idle(armed_at: int) -> None:
    global _idle
    with _LOCK:
        if _calls == armed_at:  # no call since: the freed heap goes back
            _idle = None
            _hand_back()
