"""Downloads a server writes: the analysis as .npz, under names nobody can guess, cleaned up (also
what servers before this one left)."""

from __future__ import annotations

import os
import re
import stat
import tempfile
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: folders of earlier servers are judged by age
    fcntl = None

import numpy as np

from vitviz.cost import export_plan
from vitviz.server.gradio_io import file_stem
from vitviz.server.views import Exploration
from vitviz.swin import SwinAnalysis

__all__ = ["export_npz", "export_swin_npz", "Downloads", "sweep", "sweep_old_downloads"]


def export_npz(exp: Exploration, path: str | Path, *, attentions: bool = True) -> Path:
    """The analysis as an .npz: attentions (optional: L x H x N x N; float32 up to 64 MB, float16
    beyond, relative error at most 2^-11), the cls rollout (mean fusion, no discard: all N rows up
    to 1,024 tokens, the prefix tokens' rows beyond) and its map, distances, probabilities, the crop.
    `vitviz.cost.export_plan` says what an export holds and weighs before it is written.

    Uncompressed: zlib on a float attention stack costs far more time than it saves bytes. A Swin's
    analysis is `export_swin_npz`'s.
    """
    a = exp.analysis
    if isinstance(a, SwinAnalysis):
        return export_swin_npz(exp, path, attentions=attentions)
    plan = export_plan(exp.facts.spec)
    path = Path(path)
    extra = {}
    if attentions:
        extra["attentions"] = a.attentions.numpy().astype(plan["attention_dtype"], copy=False)
    if a.probabilities is not None:
        extra.update(probabilities=a.probabilities.numpy(), categories=np.array(a.categories))
    rollout = a.rollout()
    with open(path, "wb") as f:
        np.savez(
            f,
            **extra,
            rollout=rollout[: plan["rollout_rows"]].numpy(),
            cls_map=a.cls_map().numpy(),
            distances=a.distances().numpy(),
            image=np.asarray(a.image),
            patch_size=a.patch_size,
            grid=np.array(a.grid),
            prefix_tokens=np.array(a.prefix_names),
            head_fusion="mean",
            discard_ratio=0.0,
            variant=a.variant,
        )
    return path


def export_swin_npz(exp: Exploration, path: str | Path, *, attentions: bool = True) -> Path:
    """A Swin's analysis as an .npz: each layer's window attention `attention_<l>` [windows, heads,
    M², M²] (optional; float32 up to 64 MB, float16 beyond) and relative position bias `bias_<l>`
    [heads, M², M²]; each layer's grid, window, shift and stage; the rollout [N_last, N_0] (mean
    fusion) and the pooled query's map on the finest grid; the distances [L, H_max] (NaN for heads a
    layer lacks); probabilities, the crop."""
    a = exp.analysis
    plan = export_plan(exp.facts.spec)
    per_layer = {f"bias_{l}": b.numpy() for l, b in enumerate(a.biases)}
    if attentions:
        per_layer.update({f"attention_{l}": t.numpy().astype(plan["attention_dtype"], copy=False) for l, t in enumerate(a.attentions)})
    if a.probabilities is not None:
        per_layer.update(probabilities=a.probabilities.numpy(), categories=np.array(a.categories))
    distances = [d.numpy() for d in a.distances()]
    table = np.full((len(distances), max(len(d) for d in distances)), np.nan, dtype=np.float32)
    for l, d in enumerate(distances):
        table[l, : len(d)] = d
    path = Path(path)
    with open(path, "wb") as f:
        np.savez(
            f, **per_layer, rollout=a.rollout().numpy(), cls_map=a.cls_map().numpy(), distances=table, image=np.asarray(a.image),
            patch_size=a.patch_size, grid=np.array(a.grid), grids=np.array([g.grid for g in a.geometries]),
            windows=np.array(a.window_sizes), shifts=np.array(a.shifts), stages=np.array(a.stages), head_fusion="mean", variant=a.variant,
        )
    return path


def sweep(folder: str | Path, *, max_age: float, max_bytes: int | None = None, pattern: str = "*", room: int = 0,
          recursive: bool = False, skip: tuple[Path, ...] = (), keep=None) -> int:
    """Removes files in `folder` older than `max_age` seconds, then the oldest until the rest take at
    most `max_bytes - room` (room for a file about to be written); returns the bytes the rest take.

    Args:
        recursive: also files in folders below (emptied folders are removed).
        skip: folders below `folder` left alone.
        keep: a predicate on a path: files it accepts are never removed, nor counted.
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
    if max_bytes is not None:
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
    """A private folder of downloads with random names, within `max_bytes` on disk: before a file is
    written, files older than `max_age` seconds (long since served) go, then the oldest until the new
    one fits. At start, the folders that earlier servers left in `root` (default: the system's
    temporary folder) are removed (`sweep_old_downloads`); this one is locked as this server's while
    it runs."""

    def __init__(self, *, max_age: float = 600, max_bytes: int = 1024 * 2**20, root: str | Path | None = None) -> None:
        root = Path(root) if root is not None else Path(tempfile.gettempdir())
        self.swept = sweep_old_downloads(root, max_age=max_age)
        self.folder = Path(tempfile.mkdtemp(prefix=DOWNLOADS_PREFIX, dir=root))
        self._owner = _hold(self.folder / OWNER)
        self.max_age = max_age
        self.max_bytes = max_bytes

    def npz(self, exp: Exploration, *, attentions: bool = True, size: int | None = None) -> str:
        """Writes the .npz of `exp`; `size`: its expected bytes (`export_plan`), to make room first.

        Raises:
            ValueError: `size` is more than the folder may hold.
        """
        if size is not None and size > self.max_bytes:
            raise ValueError(
                f"This analysis as .npz takes {size / 2**20:,.0f} MB, more than this server keeps for downloads "
                f"({self.max_bytes / 2**20:,.0f} MB, VITVIZ_DOWNLOADS_MB)."
            )
        sweep(self.folder, max_age=self.max_age, max_bytes=self.max_bytes, pattern="*.npz", room=size or 0)
        path = self.folder / f"vitviz-{file_stem(exp.analysis.variant, max_bytes=180)}-{os.urandom(16).hex()}.npz"
        return str(export_npz(exp, path, attentions=attentions))
