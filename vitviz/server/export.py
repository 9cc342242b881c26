"""Downloads a server writes: the analysis as .npz, under names nobody can guess, cleaned up."""

from __future__ import annotations

import io
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from vitviz.server.views import Exploration

__all__ = ["export_npz", "Downloads", "sweep"]


def export_npz(exp: Exploration, path: str | Path, *, attentions: bool = True) -> Path:
    """The analysis as an .npz: attentions (optional: L x H x N x N floats, 22 MB for B/16), the cls
    rollout (mean fusion, no discard) and its map, distances, probabilities, the crop.

    Uncompressed: zlib on a float attention stack costs far more time than it saves bytes.
    """
    a = exp.analysis
    path = Path(path)
    buf = io.BytesIO()
    extra = {"attentions": a.attentions.numpy()} if attentions else {}
    if a.probabilities is not None:
        extra.update(probabilities=a.probabilities.numpy(), categories=np.array(a.categories))
    rollout = a.rollout()
    np.savez(
        buf,
        **extra,
        rollout=rollout.numpy(),
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
    path.write_bytes(buf.getvalue())
    return path


def sweep(folder: str | Path, *, max_age: float, max_bytes: int | None = None, pattern: str = "*") -> None:
    """Removes files in `folder` older than `max_age` seconds, then the oldest until the rest take
    at most `max_bytes`."""
    now = time.time()
    files = []
    for path in Path(folder).glob(pattern):
        try:
            st = path.stat()
        except OSError:
            continue
        if not path.is_file():
            continue
        if now - st.st_mtime > max_age:
            path.unlink(missing_ok=True)
        else:
            files.append((st.st_mtime, st.st_size, path))
    if max_bytes is not None:
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files, key=lambda f: f[0]):
            if total <= max_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size


class Downloads:
    """A private folder of downloads with random names; files older than `max_age` seconds (long
    since served) are removed whenever a new one is written."""

    def __init__(self, *, max_age: float = 600) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="vitviz-"))
        self.max_age = max_age

    def npz(self, exp: Exploration, *, attentions: bool = True) -> str:
        sweep(self.folder, max_age=self.max_age, pattern="*.npz")
        path = self.folder / f"vitviz-{exp.analysis.variant.replace(':', '-').replace('/', '-')}-{os.urandom(16).hex()}.npz"
        return str(export_npz(exp, path, attentions=attentions))
