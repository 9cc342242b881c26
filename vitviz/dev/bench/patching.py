"""Activation patching at scale: every residual site of a model (`vitviz.patch`, where="resid_pre":
L layers x N tokens, each a forward of the corrupted image from its layer on, batched) against one
plain forward of the model, on the same random weights."""

from __future__ import annotations

import statistics

import torch

import vitviz
from vitviz.dev.bench.common import _sync_of, measure
from vitviz.sources import get_spec


def patching_table(arch: str, device: torch.device, *, rounds: int, patch_rounds: int = 1) -> list[tuple[str, float, float]]:
    """(path, median ms, ratio to one forward): a forward of one image, and `vitviz.patch` over every
    resid_pre site (`patch_rounds` runs of it; the patching also runs the clean and corrupted forwards)."""
    torch.manual_seed(0)
    spec = get_spec(arch)
    model = spec.build().eval().to(device)
    s = spec.image_size
    clean = torch.randn(3, s, s, device=device)
    corrupt = clean.clone()
    corrupt[:, : s // 4, : s // 4] = 0  # a covered corner
    x = clean[None]

    def forward():
        with torch.inference_mode():
            return model(x)

    times = measure({"forward": forward}, rounds=rounds, sync=_sync_of(device))
    base = statistics.median(times["forward"])
    result = {}

    def patching():
        result["r"] = vitviz.patch(model, clean, corrupt, target=(0, 1), where="resid_pre")

    patched = measure({"patch": patching}, rounds=patch_rounds, warmup=0, sync=_sync_of(device))
    r = result["r"]
    n = r.maps["resid_pre"].numel()
    ms = statistics.median(patched["patch"]) * 1e3
    return [(f"{arch}: one forward, batch 1", base * 1e3, 1.0),
            (f"{arch}: patch all {n} resid_pre sites", ms, ms / (base * 1e3)),
            (f"  ({r.forwards} batched forwards of {r.batch_size} sites)", ms / max(r.forwards, 1), ms / max(r.forwards, 1) / (base * 1e3))]
