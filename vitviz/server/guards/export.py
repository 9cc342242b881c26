"""Downloads a server writes: the analysis as .npz, under names nobody can guess, cleaned up (also
what servers before this one left); and the sweeps of the folders a server writes, where each caller
(a session, an MCP caller: `gradio_io.caller_of`) makes room only among its own files or those of
callers holding more than their share (`sweep(owners=...)`, `FileOwners`, `Downloads`)."""

from __future__ import annotations

import os
import re
import stat
import tempfile
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: folders of earlier servers are judged by age
    fcntl = None

from vitviz.server.guards.gradio_io import current_caller, file_stem, secret_name
from vitviz.server.pictures.drawers import drawer
from vitviz.server.pictures.views import Exploration

__all__ = ["export_npz", "Downloads", "FileOwners", "NoRoom", "sweep", "sweep_old_downloads"]


def export_npz(exp: Exploration, path: str | Path, *, attentions: bool = True) -> Path:
    """The analysis as an .npz, written by its layout's drawer (`drawers.PROTOCOL`'s `write_npz`: a
    ViT's `views.write_npz`, a Swin's `swin_views.write_npz`). `vitviz.cost.export_plan` says what
    an export holds and weighs before it is written."""
    return drawer(exp).write_npz(exp, Path(path), attentions=attentions)


def sweep(folder: str | Path, *, max_age: float, max_bytes: int | None = None, pattern: str = "*", room: int = 0,
          recursive: bool = False, skip: tuple[Path, ...] = (), keep=None,
          owners: Callable[[Path], Iterable[str]] | None = None, writer: str | None = None) -> int:
    """Removes files in `folder` older than `max_age` seconds, then the oldest until the rest take at
    most `max_bytes - room` (room for a file about to be written); returns the bytes the rest take.

    Args:
        recursive: also files in folders below (emptied folders are removed).
        skip: folders below `folder` left alone.
        keep: a predicate on a path: files it accepts are never removed, nor counted.
        owners: the callers each file belongs to. Then a file is removed to make room only if it
            belongs to nobody (those go first), or only to `writer` (who is about to write `room`)
            and to callers holding more than their share: `max_bytes` divided among the callers
            holding files, `writer` one of them. A file of a caller within its share stays, so the
            rest may take more than `max_bytes - room`: the writer is refused then.
    """
    now = time.time()
    files = []
    root = Path(folder)
    found = root.rglob(pattern) if recursive else root.glob(pattern)
    skip = tuple(Path(p) for p in skip)
    for path in found:
        if skip and any(path == s or s in path.parents for s in skip):
            continue
        try:
            st = path.lstat()
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        kept = keep is not None and keep(path)
        if now - st.st_mtime > max_age and not kept:
            path.unlink(missing_ok=True)
        else:
            files.append((st.st_mtime, st.st_size, path, kept))
    total = sum(f[1] for f in files if not f[3])
    if max_bytes is not None and owners is not None:
        total = _make_room(sorted((f for f in files if not f[3]), key=lambda f: f[0]), total, owners=owners, writer=writer,
                           max_bytes=max_bytes, room=room)
    elif max_bytes is not None:
        for _, size, path, kept in sorted(files, key=lambda f: f[0]):
            if total + room <= max_bytes:
                break
            if kept:
                continue
            path.unlink(missing_ok=True)
            total -= size
    if recursive:
        for sub in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            if not any(sub == s or s in sub.parents for s in skip):
                try:
                    if now - sub.stat().st_mtime < 60:  # a folder just made may be about to get its file
                        continue
                    sub.rmdir()  # only when empty
                except OSError:
                    pass
    return total


def _make_room(files: list, total: int, *, owners, writer: str | None, max_bytes: int, room: int) -> int:
    """`sweep`'s room made fairly: `files` (mtime, size, path, kept) oldest first, `total` their bytes.
    Returns the bytes left."""
    if total + room <= max_bytes:
        return total
    held = {path: frozenset(owners(path)) for _, _, path, _ in files}
    holding: Counter[str] = Counter()
    for _, size, path, _ in files:
        for who in held[path]:
            holding[who] += size
    if writer is not None:
        holding[writer] += room
    share = max_bytes / max(1, len(holding))  # (a file of several callers counts for each: within their shares, the rest fits)
    gone = set()
    for nobodys in (True, False):
        for _, size, path, _ in files:
            if total + room <= max_bytes:
                return total
            who = held[path]
            if path in gone or bool(who) == nobodys or not all(w == writer or holding[w] > share for w in who):
                continue
            path.unlink(missing_ok=True)
            gone.add(path)
            total -= size
            for w in who:
                holding[w] -= size
    return total


class FileOwners:
    """Who each file in `folder` belongs to: the callers (`gradio_io.caller_of`, or "address ..." for
    an upload no event has used yet) that uploaded, used or were sent it, at most `max_owners` a file
    (the latest). At most `max_files` files are remembered, the least recently claimed forgotten first
    (their files then belong to nobody, and go first when room is made: `sweep(owners=...)`). Files
    in `skip` folders are not followed.
    """

    def __init__(self, folder: str | Path, *, skip: tuple[Path, ...] = (), max_files: int = 32_768, max_owners: int = 8) -> None:
        self.root = os.path.realpath(folder)
        self.skip = tuple(os.path.realpath(p) for p in skip)
        self.max_files, self.max_owners = max_files, max_owners
        self._owners: OrderedDict[str, OrderedDict[str, None]] = OrderedDict()
        self._lock = threading.Lock()

    def _key(self, path) -> str | None:
        try:
            real = os.path.realpath(path)
        except (TypeError, ValueError, OSError):
            return None
        if os.path.commonpath([self.root, real]) != self.root or real == self.root:
            return None
        if any(os.path.commonpath([s, real]) == s for s in self.skip):
            return None
        return real

    def claim(self, owner: str | None, paths: Iterable, *, used: bool = False) -> None:
        """`paths` belong to `owner` (also); `used`: they were read now (their age starts again, so
        that a file a session goes on using is not swept for its age)."""
        if not owner:
            return
        for path in paths:
            key = self._key(path)
            if key is None:
                continue
            if used:
                try:
                    os.utime(key)
                except OSError:
                    continue
            with self._lock:
                mine = self._owners.setdefault(key, OrderedDict())
                self._owners.move_to_end(key)
                mine[owner] = None
                mine.move_to_end(owner)
                while len(mine) > self.max_owners:
                    mine.popitem(last=False)
                while len(self._owners) > self.max_files:
                    self._owners.popitem(last=False)

    def owners(self, path) -> frozenset[str]:
        key = self._key(path)
        with self._lock:
            return frozenset(self._owners.get(key, ())) if key else frozenset()

    def forget_gone(self) -> None:
        """Forgets the files no longer there."""
        with self._lock:
            keys = list(self._owners)
        gone = [k for k in keys if not os.path.lexists(k)]
        with self._lock:
            for key in gone:
                self._owners.pop(key, None)


class NoRoom(ValueError):
    """A download that does not fit: larger than the folder, or the room is held by other callers'
    recent downloads, each within its share."""


DOWNLOADS_PREFIX = "vitviz-downloads-"
OWNER = ".owner"  # in a downloads folder: locked (flock) by the server that writes there, as long as it runs
_FOLDER = re.compile(r"vitviz-downloads-[a-z0-9_]{8}")  # `tempfile.mkdtemp`'s 8 characters
_EARLIER_FOLDER = re.compile(r"vitviz-[a-z0-9_]{8}")  # the folders of versions before the owner's lock
_EXPORT = re.compile(r"vitviz-.+-[0-9a-f]{32}\.npz")


def _hold(path: Path) -> int:
    """An open, locked `path` (created): the lock lasts as long as this process keeps it open."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def _owner_gone(folder: Path) -> bool:
    """Whether the server that wrote into `folder` has ended: its owner file's lock is free (taken
    here for a moment). A folder without one (being made now) is not judged."""
    try:
        fd = os.open(folder / OWNER, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _exports(folder: Path, *, older_than: float | None = None) -> list[Path] | None:
    """The files of a downloads folder (exports, and its owner file), or None when it holds anything
    else or, with `older_than`, an export written since then."""
    found = []
    for path in folder.iterdir():
        st = path.lstat()
        if not stat.S_ISREG(st.st_mode) or not (path.name == OWNER or _EXPORT.fullmatch(path.name)):
            return None
        if older_than is not None and st.st_mtime > older_than:
            return None
        found.append(path)
    return found


def sweep_old_downloads(root: str | Path, *, max_age: float = 600) -> int:
    """Removes the downloads folders that servers before this one left in `root`: vitviz's by their
    name and what they hold (exports only), and either no longer locked by their server or, for the
    folders of earlier versions (and where there is no `fcntl`), holding only exports older than
    `max_age` seconds (long since served). Nothing else is
    touched: another name, another kind of file, a live server's folder. Returns the folders removed."""
    removed = 0
    for folder in Path(root).iterdir():
        try:
            if not stat.S_ISDIR(folder.lstat().st_mode):
                continue
            if _FOLDER.fullmatch(folder.name) and fcntl is not None:
                files = _exports(folder) if _owner_gone(folder) else None
            elif _FOLDER.fullmatch(folder.name) or _EARLIER_FOLDER.fullmatch(folder.name):
                files = _exports(folder, older_than=time.time() - max_age) or None  # (an empty one may be anybody's)
            else:
                continue
            if files is None:
                continue
            for path in files:
                path.unlink(missing_ok=True)
            folder.rmdir()
            removed += 1
        except OSError:  # (gone meanwhile, or not ours to remove: left as it is)
            continue
    return removed


class Downloads:
    """A private folder of downloads with random names, within `max_bytes` on disk, each caller
    (session, MCP caller) with its share: before a file is written, files older than `max_age`
    seconds (long since served) go, then, oldest first, the writer's own and those of callers
    holding more than their share (`max_bytes` divided among the callers holding downloads), until
    the new one fits; a caller within its share keeps its files, and when they leave no room the
    download is refused (`NoRoom`). A file's name carries its caller (a keyed hash). At start, the
    folders that earlier servers left in `root` (default: the system's temporary folder) are removed
    (`sweep_old_downloads`); this one is locked as this server's while it runs."""

    def __init__(self, *, max_age: float = 600, max_bytes: int = 1024 * 2**20, root: str | Path | None = None) -> None:
        root = Path(root) if root is not None else Path(tempfile.gettempdir())
        self.swept = sweep_old_downloads(root, max_age=max_age)
        self.folder = Path(tempfile.mkdtemp(prefix=DOWNLOADS_PREFIX, dir=root))
        self._owner = _hold(self.folder / OWNER)
        self.max_age = max_age
        self.max_bytes = max_bytes

    def npz(self, exp: Exploration, *, attentions: bool = True, size: int | None = None, owner: str | None = None) -> str:
        """Writes the .npz of `exp`; `size`: its expected bytes (`export_plan`), to make room first;
        `owner`: whose share it takes (default: the caller of the event running, `current_caller`).

        Raises:
            NoRoom: `size` is more than the folder may hold, or other callers' downloads, each within
                its share, leave no room for it now.
        """
        if size is not None and size > self.max_bytes:
            raise NoRoom(
                f"This analysis as .npz takes {size / 2**20:,.0f} MB, more than this server keeps for downloads "
                f"({self.max_bytes / 2**20:,.0f} MB, VITVIZ_DOWNLOADS_MB)."
            )
        tag = _owner_tag(owner or current_caller())
        left = sweep(self.folder, max_age=self.max_age, max_bytes=self.max_bytes, pattern="*.npz", room=size or 0,
                     owners=_tagged_owner, writer=tag)
        if left + (size or 0) > self.max_bytes:
            raise NoRoom(
                f"There is no room for this {(size or 0) / 2**20:,.1f} MB download now: this server keeps "
                f"{self.max_bytes / 2**20:,.0f} MB of downloads (VITVIZ_DOWNLOADS_MB), shared among the sessions "
                f"that hold some, and the others' recent downloads fill it within their shares. Try again in a few "
                f"minutes (a download is kept {self.max_age / 60:,.0f} minutes)."
            )
        path = self.folder / f"vitviz-{file_stem(exp.analysis.variant, max_bytes=180)}-{tag}-{os.urandom(16).hex()}.npz"
        return str(export_npz(exp, path, attentions=attentions))


def _owner_tag(owner: str | None) -> str:
    """The caller a download's name carries: 16 hex digits of a keyed hash (nobody's: of "")."""
    return secret_name(f"download owner\0{owner or ''}".encode())[:16]


def _tagged_owner(path: Path) -> tuple[str, ...]:
    """The caller tag in a download's name (`vitviz-<variant>-<tag>-<random>.npz`)."""
    parts = path.name.removesuffix(".npz").rsplit("-", 2)
    return (parts[1],) if len(parts) == 3 and re.fullmatch(r"[0-9a-f]{16}", parts[1]) else ()
