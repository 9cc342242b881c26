"""Analyses kept for browser sessions, all of them together within one memory budget.

A session keeps only a small `SessionRef` itself (a key, the variant, the input crop). The heavy part
of its analysis, the attention stack (22 MB for ViT-B/16, 192 MB for B/16 at 384 px, 3.8 GB for H/14 at
518 px), lives in one `SessionStore` shared by every session. When the store is over its budget, or an
entry has not been used for `idle_seconds`, the least recently used entries are dropped; a session whose
entry was dropped computes it again from its crop (one model call) the next time it needs it.

Gradio's own state of a session (its copy of every component's configuration, the components its
events updated, the `gr.State` values such as the `SessionRef`, its unread results) is outside the
store; it is priced here (`SESSION_PRICE`, measured: docs/serving.md) so that the server keeps at
most as many sessions as fit beside the store in the state budget (`Settings.sessions`).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from PIL import Image

__all__ = ["SessionRef", "SessionStore", "SESSION_BYTES", "CROP_BYTES", "SESSION_PRICE", "crop_to_keep"]

# What Gradio holds for one session of this page besides the crop: its copy of the components'
# configurations (513 KiB traced for an empty one since the Patch and Concepts tabs; 386 KiB traced,
# 421 KiB resident before them), the components an analysis updated and its unread results (117-143 KiB
# traced more; 825 KiB resident in all with a 288 px crop before those tabs), with room.
SESSION_BYTES = 2**20
# The largest crop a session keeps (`SessionRef.crop`): the menu's largest model's (ViT-H/14, 518 px,
# RGB). A larger one (a model named by the client at a large size) is not kept: its analysis is
# computed again from the upload.
CROP_BYTES = 3 * 518**2
# What one session may hold, all told
SESSION_PRICE = SESSION_BYTES + CROP_BYTES

T = TypeVar("T")


@dataclass(frozen=True)
class SessionRef:
    """What a session holds itself: small, whatever the model.

    Attributes:
        key: the entry in the store (random, unguessable).
        variant: the model that analysed the image.
        crop: the S x S crop the model saw; the model's input is a pure function of it, so the
            analysis can be computed again exactly. None when it is over `CROP_BYTES` (the analysis
            is then computed again from `source`).
        image: the analysed image's file name; source: the uploaded file it came from.
    """

    key: str
    variant: str
    crop: Image.Image | None = field(repr=False, compare=False)
    image: str = ""  # the image's file name, as the page shows it
    source: str = field(default="", repr=False)  # the uploaded file the analysis came from


def crop_to_keep(crop: Image.Image) -> Image.Image | None:
    """`crop` if a session may keep it (at most `CROP_BYTES`), else None."""
    return crop if crop.width * crop.height * len(crop.getbands()) <= CROP_BYTES else None


class SessionStore(Generic[T]):
    """Values with a size, kept least-recently-used first within `budget_bytes` in all.

    The entry just stored always stays, even when it alone is over the budget (the bound is then the
    size of that one analysis); every other entry is dropped as needed, oldest use first. Entries
    not used for `idle_seconds` are dropped whenever the store is touched. Thread-safe.

    Args:
        budget_bytes: the most bytes kept for all entries together.
        idle_seconds: how long an unused entry is kept.
        clock: seconds, monotonic (tests pass their own).
        on_drop: called with the key of each entry dropped (by `drop`, idle or over the budget; not
            when a key is stored again), outside the store's lock; it must not raise.
    """

    def __init__(self, *, budget_bytes: int, idle_seconds: float, clock: Callable[[], float] = time.monotonic,
                 on_drop: Callable[[str], None] | None = None) -> None:
        self.budget_bytes = budget_bytes
        self.idle_seconds = idle_seconds
        self._clock = clock
        self._on_drop = on_drop
        self._entries: OrderedDict[str, tuple[T, int, float]] = OrderedDict()  # key -> (value, bytes, last use)
        self._lock = threading.Lock()
        self.evictions = 0

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(size for _, size, _ in self._entries.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def put(self, value: T, nbytes: int, *, key: str | None = None) -> str:
        """Stores `value` (of `nbytes`) under `key`, or a new random key; returns the key."""
        key = key or secrets.token_urlsafe(16)
        with self._lock:
            self._entries[key] = (value, nbytes, self._clock())
            self._entries.move_to_end(key)
            dropped = self._evict(keep=key)
        self._dropped(dropped)
        return key

    def get(self, key: str) -> T | None:
        """The value, or None when it was never stored or has been dropped; counts as a use."""
        with self._lock:
            dropped = self._evict(keep=key, budget=False)
            entry = self._entries.get(key)
            if entry is not None:
                value, size, _ = entry
                self._entries[key] = (value, size, self._clock())
                self._entries.move_to_end(key)
        self._dropped(dropped)
        return None if entry is None else entry[0]

    def drop(self, key: str | None) -> None:
        with self._lock:
            found = self._entries.pop(key, None) is not None  # type: ignore[arg-type]
        self._dropped([key] if found else [])

    def _dropped(self, keys: list[str]) -> None:
        if self._on_drop is not None:
            for key in keys:
                self._on_drop(key)

    def _evict(self, *, keep: str | None, budget: bool = True) -> list[str]:
        """Drops idle entries, then (with `budget`) the least recently used until within the budget;
        `keep` stays. Returns the keys dropped."""
        now = self._clock()
        dropped = [k for k, (_, _, used) in self._entries.items() if now - used > self.idle_seconds and k != keep]
        for k in dropped:
            del self._entries[k]
            self.evictions += 1
        if not budget:
            return dropped
        total = sum(size for _, size, _ in self._entries.values())
        for k in list(self._entries):
            if total <= self.budget_bytes:
                break
            if k == keep:
                continue
            total -= self._entries.pop(k)[1]
            dropped.append(k)
            self.evictions += 1
        return dropped
