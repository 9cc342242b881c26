"""Downloads a server writes: the analysis as .npz, under names nobody can guess, cleaned up."""

from __future__ import annotations

import io
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from vitviz.server.views import Exploration

__all__ = ["export_npz", "Downloads"]


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


class Downloads:
    """A private folder of downloads with random names; files older than `max_age` seconds (long
    since served) are removed whenever a new one is written."""

    def __init__(self, *, max_age: float = 600) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="vitviz-"))
        self.max_age = max_age

    def npz(self, exp: Exploration, *, attentions: bool = True) -> str:
        now = time.time()
        for old in self.folder.glob("*.npz"):
            if now - old.stat().st_mtime > self.max_age:
                old.unlink(missing_ok=True)
        path = self.folder / f"vitviz-{exp.analysis.variant.replace(':', '-').replace('/', '-')}-{os.urandom(16).hex()}.npz"
        return str(export_npz(exp, path, attentions=attentions))
