"""What the app does, without Gradio: load models (bounded cache), analyse an image once, and
render every view from that analysis.

Data flows one way: image -> `explore` (the only step that runs a model) -> `Exploration`
(analysis tensors + per-variant facts) -> `render_*` functions -> pictures. Changing a layer,
head, query patch or rollout option calls a `render_*` function on the stored `Exploration`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import io
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from vitviz import plots
from vitviz.analysis import (
    embedding_filter_components,
    position_embedding_similarity,
    query_attention,
    uniform_attention_distance,
)
from vitviz.images import ImageSource
from vitviz.model import ViT
from vitviz.pipeline import Analysis, analyze, analyze_crop
from vitviz.summary import summary
from vitviz.zoo import VariantSpec, get_spec, list_variants, load_model, weights_status

__all__ = [
    "ModelFacts",
    "ModelCache",
    "Exploration",
    "explore",
    "explore_crop",
    "release_memory",
    "variant_choices",
    "head_choices",
    "patch_at",
    "render_predictions",
    "render_rollout",
    "render_query",
    "render_head_mosaic",
    "render_distance",
    "render_compare_distance",
    "render_architecture",
    "export_npz",
    "DISPLAY_PX",
]

DISPLAY_PX = 384  # images are shown at least this wide (nearest-neighbour upscaling keeps patch edges)


@dataclass(frozen=True)
class ModelFacts:
    """What a variant shows independently of the image, computed once per loaded model."""

    spec: VariantSpec
    similarity: torch.Tensor  # [gh, gw, gh, gw]
    components: torch.Tensor  # [28, 3, P, P]
    explained: torch.Tensor  # [28]
    summary_rows: list[list[str]]
    total_params: int
    uniform_distance: float
    distance_chart: plots.DistanceChart = field(repr=False, compare=False)

    @classmethod
    def of(cls, model: ViT) -> "ModelFacts":
        spec = model.spec
        with torch.no_grad():
            sim = position_embedding_similarity(model.pos_embed.cpu(), grid=spec.grid, num_prefix_tokens=model.num_prefix_tokens)
            comps, explained = embedding_filter_components(model.patch_embed.proj.weight.cpu(), k=28)
        s = summary(model)
        uniform = uniform_attention_distance(spec.grid, patch_size=spec.patch_size)
        return cls(
            spec=spec,
            similarity=sim,
            components=comps,
            explained=explained,
            summary_rows=s.table(),
            total_params=s.total_params,
            uniform_distance=uniform,
            distance_chart=plots.DistanceChart(uniform=uniform, title=f"{spec.name}: mean attention distance per head"),
        )


class ModelCache:
    """Loaded models, least recently used evicted first.

    At most `max_models` models and at most `max_bytes` of parameters are kept; the model just
    asked for always stays. Loads are serialised per variant, so two sessions asking for the same
    variant load it once.
    """

    def __init__(self, *, max_models: int = 3, max_bytes: int = 3 * 1024**3, device: str | torch.device | None = None) -> None:
        self.max_models = max_models
        self.max_bytes = max_bytes
        self.device = device
        self._models: OrderedDict[str, tuple[ViT, ModelFacts]] = OrderedDict()
        self._lock = threading.Lock()
        self._loading: dict[str, threading.Lock] = {}

    @staticmethod
    def _bytes(model: ViT) -> int:
        return sum(p.numel() * p.element_size() for p in model.parameters())

    def loaded(self) -> list[str]:
        with self._lock:
            return list(self._models)

    def get(self, name: str) -> tuple[ViT, ModelFacts]:
        """The model and its facts, loading (and maybe downloading) on first use."""
        with self._lock:
            if name in self._models:
                self._models.move_to_end(name)
                return self._models[name]
            load_lock = self._loading.setdefault(name, threading.Lock())
        with load_lock:
            with self._lock:
                if name in self._models:
                    self._models.move_to_end(name)
                    return self._models[name]
            model = load_model(name, device=self.device)
            entry = (model, ModelFacts.of(model))
            with self._lock:
                self._models[name] = entry
                self._evict(keep=name)
            return entry

    def _evict(self, *, keep: str) -> None:
        def total() -> int:
            return sum(self._bytes(m) for m, _ in self._models.values())

        while len(self._models) > 1 and (len(self._models) > self.max_models or total() > self.max_bytes):
            oldest = next(k for k in self._models if k != keep)
            del self._models[oldest]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


@dataclass(frozen=True)
class Exploration:
    """One image analysed by one variant: everything the views need."""

    analysis: Analysis
    facts: ModelFacts

    @property
    def scale(self) -> int:
        return max(1, math.ceil(DISPLAY_PX / self.analysis.image.size[0]))

    @property
    def display_image(self) -> Image.Image:
        img = self.analysis.image
        return img.resize((img.size[0] * self.scale, img.size[1] * self.scale), Image.NEAREST)


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


def explore(cache: ModelCache, image: ImageSource, variant: str, *, head_fusion: str = "mean", discard_ratio: float = 0.0) -> Exploration:
    """The one step that runs a model: analyse `image` with `variant`."""
    model, facts = cache.get(variant)
    return Exploration(analyze(model, image, head_fusion=head_fusion, discard_ratio=discard_ratio), facts)  # type: ignore[arg-type]


def explore_crop(cache: ModelCache, cropped: Image.Image, variant: str) -> Exploration:
    """`explore` for the crop of an earlier analysis (`Analysis.image`): the same numbers again."""
    model, facts = cache.get(variant)
    return Exploration(analyze_crop(model, cropped), facts)


# ---------------------------------------------------------------------------------------------
# Menus

_STATUS_WORDS = {"embedded": "embedded, offline", "cached": "ready", "download": "needs a download"}


def variant_choices() -> list[tuple[str, str]]:
    """(label, name) for a dropdown: each label says whether the variant is ready."""
    out = []
    for spec in list_variants():
        status = weights_status(spec.name)
        out.append((f"{spec.name} · {spec.image_size}px /{spec.patch_size} · {_STATUS_WORDS[status]}", spec.name))
    return out


def head_choices(heads: int) -> list[str]:
    return ["mean", "max"] + [f"head {h + 1}" for h in range(heads)]


def _head(choice: str) -> int | str:
    return int(choice.split()[1]) - 1 if choice.startswith("head ") else choice


def patch_at(exp: Exploration, x: float, y: float) -> int:
    """The token index of the patch under display pixel (x, y)."""
    a = exp.analysis
    px = a.patch_size * exp.scale
    gh, gw = a.grid
    r = min(gh - 1, max(0, int(y // px)))
    c = min(gw - 1, max(0, int(x // px)))
    return a.num_prefix_tokens + r * gw + c


def describe_query(exp: Exploration, query: int) -> str:
    a = exp.analysis
    if query < a.num_prefix_tokens:
        return "query: the cls token"
    r, c = divmod(query - a.num_prefix_tokens, a.grid[1])
    return f"query: patch row {r + 1}, column {c + 1}"


# ---------------------------------------------------------------------------------------------
# Views (no model calls below this line)

def render_predictions(exp: Exploration) -> dict[str, float]:
    return dict(exp.analysis.predictions)


def render_rollout(exp: Exploration, *, head_fusion: str = "mean", discard_ratio: float = 0.0) -> tuple[Image.Image, Exploration]:
    """The cls rollout over the image, recomputed from the stored attention when the options change."""
    a = exp.analysis.with_rollout(head_fusion=head_fusion, discard_ratio=discard_ratio)  # type: ignore[arg-type]
    exp = Exploration(a, exp.facts) if a is not exp.analysis else exp
    return plots.overlay(exp.display_image, a.cls_map), exp


def render_query(exp: Exploration, *, layer: int, head: str, query: int) -> Image.Image:
    """Layer `layer` (1-based) attention of token `query` over the patches, with the query marked."""
    a = exp.analysis
    heat = query_attention(a.attentions, layer=layer - 1, query=query, head=_head(head), grid=a.grid, num_prefix_tokens=a.num_prefix_tokens)
    img = plots.overlay(exp.display_image, heat)
    if query >= a.num_prefix_tokens:
        r, c = divmod(query - a.num_prefix_tokens, a.grid[1])
        img = plots.mark_patch(img, patch=(r, c), patch_size=a.patch_size * exp.scale)
    return img


def render_head_mosaic(exp: Exploration, *, layer: int, query: int, tile_px: int = 160) -> Image.Image:
    """Every head of one layer for the same query, as a mosaic."""
    a = exp.analysis
    p = a.num_prefix_tokens
    heats = a.attentions[layer - 1, :, query, p:].reshape(-1, *a.grid)  # [H, gh, gw]
    small = a.image.resize((tile_px, tile_px), Image.BILINEAR)
    tiles = plots.overlay_many(small, heats)
    return plots.mosaic(tiles, cols=min(6, len(tiles)), labels=[f"head {h + 1}" for h in range(len(tiles))])


def render_distance(exp: Exploration) -> Image.Image:
    """The distance chart: only the dots are drawn per image (`plots.DistanceChart`)."""
    return exp.facts.distance_chart.render(exp.analysis.distances)


_COMPARE_CHART = plots.DistanceChart(uniform=None, title="Mean attention distance per head (each variant's own pixels)")


def render_compare_distance(exps: list[Exploration]) -> Image.Image:
    return _COMPARE_CHART.render({e.facts.spec.name: e.analysis.distances for e in exps})


def render_position(exp: Exploration) -> tuple[Image.Image, Image.Image]:
    """(position-embedding similarity tiles, principal components of the patch filters)."""
    return plots.position_similarity_image(exp.facts.similarity), plots.filters_image(exp.facts.components)


def render_architecture(exp: Exploration) -> tuple[Image.Image, list[list[str]]]:
    return plots.patch_grid(exp.analysis.image, patch_size=exp.analysis.patch_size), exp.facts.summary_rows


def export_npz(exp: Exploration, path: str | Path, *, attentions: bool = True) -> Path:
    """The analysis as an .npz: attentions (optional: L x H x N x N floats, 22 MB for B/16), rollout,
    cls_map, distances, probabilities, the crop.

    Uncompressed: zlib on a float attention stack costs far more time than it saves bytes.
    """
    a = exp.analysis
    path = Path(path)
    buf = io.BytesIO()
    extra = {"attentions": a.attentions.numpy()} if attentions else {}
    np.savez(
        buf,
        **extra,
        rollout=a.rollout.numpy(),
        cls_map=a.cls_map.numpy(),
        distances=a.distances.numpy(),
        probabilities=a.probabilities.numpy(),
        categories=np.array(exp.facts.spec.categories),
        image=np.asarray(a.image),
        patch_size=a.patch_size,
        grid=np.array(a.grid),
        head_fusion=a.head_fusion,
        discard_ratio=a.discard_ratio,
        variant=a.variant,
    )
    path.write_bytes(buf.getvalue())
    return path


def spec_line(name: str) -> str:
    spec = get_spec(name)
    return f"{spec.description} — {spec.weights}"
