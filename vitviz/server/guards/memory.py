"""Handing freed heap back to the system in a long-running server."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from typing import Callable, Protocol

__all__ = ["HANDS_BACK", "KEEP_BYTES", "HeapKeeper", "resident_bytes", "release_memory"]

# Resident memory let grow past what the last hand-back left before the freed heap is handed back
# again: the working set of a few ViT-B/16 analyses, kept for the next request to reuse; a request
# that frees more (ViT-L at 384 px frees GBs) goes past it and is handed back. (The server's is
# VITVIZ_HEAP_KEEP_MB, `vitviz.server.guards.settings`.)
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
HANDS_BACK = _TRIM is not None  # whether this system's malloc can hand freed heap back (glibc)
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int | None:
    """This process's resident memory (Linux's /proc/self/statm); None where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


class _Timer(Protocol):
    def start(self) -> None: ...
    def cancel(self) -> None: ...


class HeapKeeper:
    """The hand-back policy of `release_memory`, with what it calls given: `trim` (glibc's
    malloc_trim, None: a no-op), `resident` (bytes, or None where unknown), `idle_seconds`, and
    `timer(seconds, fn)`, an object with start() and cancel() that calls fn() once `seconds` have
    passed (`threading.Timer` by default: a test passes one it fires itself)."""

    def __init__(self, *, trim: Callable[[int], object] | None = _TRIM, resident: Callable[[], int | None] = resident_bytes,
                 idle_seconds: float | None = None, timer: Callable[[float, Callable[[], None]], _Timer] | None = None) -> None:
        self._trim, self._resident = trim, resident
        self._idle_seconds = idle_seconds
        self._timer = timer or _daemon_timer
        self._lock = threading.Lock()
        self._after_last: int | None = None  # resident bytes just after the last hand-back
        self._calls = 0  # calls so far: an idle hand-back goes ahead only if none came after it was armed
        self._idle: _Timer | None = None

    def release(self, *, keep: int | None = None) -> None:
        """`release_memory`'s rule (see there)."""
        if self._trim is None:
            return
        keep = KEEP_BYTES if keep is None else keep
        with self._lock:
            self._calls += 1
            if self._idle is not None:
                self._idle.cancel()
                self._idle = None
            now = self._resident()
            if keep > 0 and now is not None and self._after_last is not None and now - self._after_last <= keep:
                armed_at = self._calls
                seconds = IDLE_SECONDS if self._idle_seconds is None else self._idle_seconds
                self._idle = self._timer(seconds, lambda: self._hand_back_if_idle(armed_at))
                self._idle.start()
                return
            self._hand_back()

    def _hand_back(self) -> None:
        self._trim(0)
        self._after_last = self._resident()

    def _hand_back_if_idle(self, armed_at: int) -> None:
        with self._lock:
            if self._calls == armed_at:  # no call since: the freed heap goes back
                self._idle = None
                self._hand_back()


def _daemon_timer(seconds: float, fn: Callable[[], None]) -> threading.Timer:
    timer = threading.Timer(seconds, fn)
    timer.daemon = True
    return timer


_KEEPER = HeapKeeper()


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
    _KEEPER.release(keep=keep)
