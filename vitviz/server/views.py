"""The app's pictures, from one analysed image: no Gradio, no model calls after `explore`.

Data flows one way: image -> `explore` (the only step that runs a model) -> `Exploration`
(the raw `Analysis` + the variant's `ModelFacts`) -> `render_*` functions -> pictures. Every view
option (rollout fusion and discard ratio, layer, head, query token) is an argument of the function
that draws it; nothing derived is stored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from PIL import Image

from vitviz import plots
from vitviz.analysis import query_attention
from vitviz.images import ImageSource
from vitviz.pipeline import Analysis, analyze, analyze_crop
from vitviz.server.models import ModelCache, ModelFacts

__all__ = [
    "DISPLAY_PX",
    "Exploration",
    "explore",
    "explore_crop",
    "patch_at",
    "describe_query",
    "parse_head",
    "render_predictions",
    "render_rollout",
    "render_query",
    "render_head_mosaic",
    "render_distance",
    "render_compare_distance",
    "render_position",
    "render_architecture",
]

DISPLAY_PX = 384  # images are shown at least this wide (nearest-neighbour upscaling keeps patch edges)


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


def explore(cache: ModelCache, image: ImageSource, variant: str) -> Exploration:
    """The one step that runs a model: analyse `image` with `variant`."""
    model, facts = cache.get(variant)
    return Exploration(analyze(model, image), facts)


def explore_crop(cache: ModelCache, cropped: Image.Image, variant: str) -> Exploration:
    """`explore` for the crop of an earlier analysis (`Analysis.image`): the same numbers again."""
    model, facts = cache.get(variant)
    return Exploration(analyze_crop(model, cropped), facts)


def parse_head(choice: str) -> int | str:
    """"head 3" -> 2 (0-based); "mean" and "max" as they are."""
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
        name = a.prefix_names[query]
        return "query: the cls token" if name == "cls" else f"query: the {name} token"
    r, c = divmod(query - a.num_prefix_tokens, a.grid[1])
    return f"query: patch row {r + 1}, column {c + 1}"


def render_predictions(exp: Exploration) -> dict[str, float]:
    return dict(exp.analysis.predictions(5))


def render_rollout(exp: Exploration, *, head_fusion: str = "mean", discard_ratio: float = 0.0) -> Image.Image:
    """The cls token's rollout over the image, computed from the stored attention."""
    heat = exp.analysis.cls_map(head_fusion=head_fusion, discard_ratio=discard_ratio)  # type: ignore[arg-type]
    return plots.overlay(exp.display_image, heat)


def render_query(exp: Exploration, *, layer: int, head: str, query: int) -> Image.Image:
    """Layer `layer` (1-based) attention of token `query` over the patches, with the query marked."""
    a = exp.analysis
    heat = query_attention(a.attentions, layer=layer - 1, query=query, head=parse_head(head), grid=a.grid, num_prefix_tokens=a.num_prefix_tokens)
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
    return exp.facts.distance_chart.render(exp.analysis.distances())


_COMPARE_CHART = plots.DistanceChart(uniform=None, title="Mean attention distance per head (each variant's own pixels)")


def render_compare_distance(exps: list[Exploration]) -> Image.Image:
    return _COMPARE_CHART.render({e.facts.spec.name: e.analysis.distances() for e in exps})


def render_position(exp: Exploration) -> tuple[Image.Image, Image.Image]:
    """(position-embedding similarity tiles, principal components of the patch filters)."""
    return plots.position_similarity_image(exp.facts.similarity), plots.filters_image(exp.facts.components)


def render_architecture(exp: Exploration) -> tuple[Image.Image, list[list[str]]]:
    return plots.patch_grid(exp.analysis.image, patch_size=exp.analysis.patch_size), exp.facts.summary_rows
