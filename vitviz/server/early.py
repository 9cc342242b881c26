"""The explorer of an analysis still on its way, for the page that asked for it.

The page names each analysis it asks for with a ticket of its own (22 random URL-safe characters,
sent with the analysis' inputs) and, at the same moment, asks outside the queue for what that
ticket's analysis publishes (`ExplorerTab.explorer_early`), in two steps:

- "pictures": the explorer's two pictures (the image the model sees, and a mosaic tile's), written
  from the crop before the forward starts; the page fetches them while the forward runs;
- "explorer": the explorer's value, as soon as the forward has written the explorer's file (as
  its last attention is, while the rest of the forward runs; after the forward for a pooled query
  weighted by an attention probe), with what the first view needs inline (the shared maxima, the
  last layer's row maxima and its rows of token 0: `explorer_data.first_shown`); the page draws the
  explorer from it while the rest of the analysis runs and is drawn and sent, and fetches the rest
  of the file after. The value is the one the outputs bring (their drawer's `write_explorer`), made
  by the same function (`explorer_data.value_of`), so the page loads it once.

A ticket that is malformed or named a second time gets nothing early; neither does an analysis
whose explorer is not one file the forward writes (a Swin's, written after the forward; the
"layers" and "server" layouts, whose waits are answered as the crop is made), nor one that fails
before its file is complete: the wait answers None, and the page takes the explorer from the
outputs, as it does every explorer. One that fails after it
(in the last block's MLP or the head) has published its explorer; its files are removed, so the
page's explorer keeps only the last layer it was sent, while the other results stay those of the
previous analysis beside the error.
Waits are bounded in number (in all, and per network address) and time, end when their caller
leaves, and hold no thread (`wait` is a coroutine).

    tickets = Tickets()
    with tickets.opened(ticket_from_page) as name:   # None: nothing early for this analysis
        ...; tickets.publish(name, "pictures", paths); ...; tickets.publish(name, "explorer", value)
    # on leaving, what was not published: its wait answers None
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Tickets", "TICKET", "STEPS"]

TICKET = re.compile(r"[A-Za-z0-9_-]{22}")
STEPS = ("pictures", "explorer")
_NONE = object()  # settled without a value


class Tickets:
    """Tickets of analyses, the newest `size` kept for `seconds`; at most `waiters` waits at once, and
    `waiters_per_owner` of one owner (a network address: a page makes two waits per analysis, and an
    address has at most `VITVIZ_ADDRESS_JOBS` analyses waiting or running); each at most
    `wait_seconds` (an analysis waiting longer in the queue gets its explorer with its outputs), and
    none past its caller's leaving (`wait`'s `gone`, asked every `poll_seconds`)."""

    def __init__(self, *, size: int = 1024, seconds: float = 600.0, waiters: int = 64, waiters_per_owner: int = 16,
                 wait_seconds: float = 60.0, poll_seconds: float = 1.0) -> None:
        self.size, self.seconds, self.max_waiters, self.wait_seconds = size, seconds, waiters, wait_seconds
        self.per_owner, self.poll_seconds = waiters_per_owner, poll_seconds
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[float, dict]] = OrderedDict()  # ticket -> (time opened, {step: value or _NONE})
        self._waiting: dict[tuple[str, str], list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = {}
        self._count = 0
        self._owners: dict[str, int] = {}  # owner -> its waits now

    def open(self, ticket: object) -> str | None:
        """`ticket` registered for an analysis starting now; None when it is no ticket or was named before."""
        if not _valid(ticket):
            return None
        with self._lock:
            self._expire()
            if ticket in self._entries:
                return None
            self._entries[ticket] = (time.monotonic(), {})
            while len(self._entries) > self.size:
                old, _ = self._entries.popitem(last=False)
                self._answer_all(old)
        return ticket

    @contextmanager
    def opened(self, ticket: object) -> Iterator[str | None]:
        """`open`, and `close` when the analysis ends, however it ends."""
        name = self.open(ticket)
        try:
            yield name
        finally:
            self.close(name)

    def publish(self, ticket: str | None, step: str, value: dict) -> None:
        """What `step` of `ticket`'s analysis (one opened here) has: every wait for it answered."""
        if ticket is not None:
            with self._lock:
                self._settle(ticket, step, value)

    def close(self, ticket: str | None) -> None:
        """`ticket`'s analysis ended: a wait for a step it never published answers None."""
        if ticket is not None:
            with self._lock:
                for step in STEPS:
                    self._settle(ticket, step, _NONE)

    async def wait(self, ticket: object, step: object, *, owner: str | None = None, gone=None) -> dict | None:
        """What `step` of `ticket`'s analysis publishes, once it does; None when there is nothing (no
        such analysis or an expired one, it ended without it, too many waits are open, or too many of
        `owner`'s, `wait_seconds` passed, or the caller left: `gone`, an async callable, said so)."""
        if not _valid(ticket) or step not in STEPS:
            return None
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        key = (ticket, step)
        with self._lock:
            self._expire()
            entry = self._entries.get(ticket)
            if entry is not None and step in entry[1]:
                value = entry[1][step]
                return None if value is _NONE else value
            if self._count >= self.max_waiters or (owner is not None and self._owners.get(owner, 0) >= self.per_owner):
                return None
            self._waiting.setdefault(key, []).append((loop, future))
            self._count += 1
            if owner is not None:
                self._owners[owner] = self._owners.get(owner, 0) + 1
        try:
            end = loop.time() + self.wait_seconds
            while True:
                left = end - loop.time()
                if future.done() or left <= 0:
                    return future.result() if future.done() else None
                try:  # (the future shielded: a poll's timeout leaves it waiting)
                    return await asyncio.wait_for(asyncio.shield(future), timeout=min(left, self.poll_seconds) if gone else left)
                except asyncio.TimeoutError:
                    if gone is not None and await _gone(gone):
                        return None
        finally:
            with self._lock:
                mine = self._waiting.get(key, [])
                if (loop, future) in mine:
                    mine.remove((loop, future))
                    if not mine:
                        del self._waiting[key]
                self._count -= 1
                if owner is not None:
                    self._owners[owner] -= 1
                    if not self._owners[owner]:
                        del self._owners[owner]

    def _settle(self, ticket: str, step: str, value) -> None:
        entry = self._entries.get(ticket)
        if entry is None or step in entry[1]:  # dropped, or settled already (published, then closed)
            return
        entry[1][step] = value
        for loop, future in self._waiting.pop((ticket, step), []):
            loop.call_soon_threadsafe(_resolve, future, None if value is _NONE else value)

    def _answer_all(self, ticket: str) -> None:
        """Every wait for a dropped ticket answered None (the lock held)."""
        for step in STEPS:
            for loop, future in self._waiting.pop((ticket, step), []):
                loop.call_soon_threadsafe(_resolve, future, None)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._entries:
            ticket, (opened, _) = next(iter(self._entries.items()))
            if now - opened < self.seconds:
                break
            self._entries.popitem(last=False)
            self._answer_all(ticket)


def _valid(ticket: object) -> bool:
    return isinstance(ticket, str) and TICKET.fullmatch(ticket) is not None


async def _gone(gone) -> bool:
    """Whether the caller has left; a check that fails counts as gone."""
    try:
        return bool(await gone())
    except Exception:
        return True


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)
