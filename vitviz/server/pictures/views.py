"""The app's pictures, from one analysed image: no Gradio.

Data flows one way: image -> `explore` (the analysis: a model's forward) -> `Exploration` (the raw
`Analysis` + the variant's `ModelFacts`) -> `render_*` functions -> pictures. The render functions
run no model (the maps for a class and their curves are `vitviz.server.explaining`'s, a forward and
a backward) and never change the record: every view option (rollout fusion and discard ratio,
layer, head, query token, colour scale) is an argument of the function that draws it.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from vitviz import plots
from vitviz.analysis import POOL, Query, attention_received
from vitviz.architectures import attention_of
from vitviz.cost import export_plan
from vitviz.explainers import method as registered_method
from vitviz.images import ImageSource, load_image
from vitviz.offsets import attention_by_offset
from vitviz.pipeline import Analysis, analyze, analyze_crop, image_tower, spec_of
from vitviz.preprocess import crop
from vitviz.relevance import dino_head_maps, feature_components, feature_similarity, keep_mass
from vitviz.server.models import ModelCache, ModelFacts
from vitviz.server.pictures import explorer_data
from vitviz.sources import weights_dtype

__all__ = [
    "write_npz",
    "DISPLAY_PX",
    "Exploration",
    "display_scale",
    "display_of",
    "explore",
    "explore_crop",
    "patch_at",
    "describe_query",
    "explorer_bounds",
    "scale_refusal",
    "DISCARD_RATIO",
    "EXPLORER_WIDGET",
    "rollout_note",
    "maps_note",
    "explorer_mode",
    "write_explorer",
    "render_positions",
    "render_bias",
    "render_offsets",
    "render_stages",
    "parse_head",
    "render_predictions",
    "render_rollout",
    "render_received",
    "render_query",
    "render_head_mosaic",
    "render_distance",
    "render_compare_distance",
    "rollout_density",
    "render_compare_rollouts",
    "colour_bar_html",
    "compare_table_html",
    "render_position",
    "render_filters",
    "render_architecture",
    "render_method_maps",
    "render_dino_heads",
    "render_token_norms",
    "render_outliers",
    "outlined_heat",
    "outliers_caption",
    "render_features",
    "render_feature_similarity",
    "query_range",
    "mosaic_tile_px",
]

DISPLAY_PX = 384  # images are shown at least this wide (nearest-neighbour upscaling keeps patch edges)


@dataclass(frozen=True)
class Exploration:
    """One image analysed by one variant: everything the views need."""

    analysis: Analysis
    facts: ModelFacts
    key: str | None = None  # the session key chosen before the forward (`Server.run`): the explorer's files are named by it

    @property
    def scale(self) -> int:
        return display_scale(self.analysis.image)

    @property
    def display_image(self) -> Image.Image:
        return display_of(self.analysis.image)


def display_scale(crop: Image.Image) -> int:
    """How many display pixels a pixel of the crop the model sees takes (its longer side at least
    `DISPLAY_PX`)."""
    return max(1, math.ceil(DISPLAY_PX / max(crop.size)))


def display_of(crop: Image.Image) -> Image.Image:
    """The crop as the views show it: each pixel `display_scale` times, nearest-neighbour (patch edges stay sharp)."""
    k = display_scale(crop)
    return crop.resize((crop.size[0] * k, crop.size[1] * k), Image.NEAREST)


def explore(cache: ModelCache, image: ImageSource, variant: str, *, stream_to: str | Path | None = None,
            on_crop=None, on_file=None) -> Exploration:
    """The analysis: `variant` run once on `image`, its attention recorded. With `stream_to`, the
    explorer's "stack" file (`explorer_data`) is written there while the forward runs, each layer's
    block as soon as the layer is computed (`explorer_data.StackStream`; nothing for a Swin or a
    stack over the browser's budget); when the analysis fails, no file is left. With `stream_to`,
    `on_crop` is called with the crop the model sees (`Analysis.image`) before the forward runs, and
    `on_file` with the file's `vitviz.cost.ExplorerLayout` and path as soon as it is complete
    (as the forward's last attention is, for most models)."""
    model, facts = cache.get(variant)
    if stream_to is None or attention_of(model) != "global":  # (the stack file is of N x N attention)
        return Exploration(analyze(model, image), facts)
    tower = image_tower(model)
    stream = explorer_data.StackStream(stream_to, depth=tower.config.depth, num_prefix_tokens=tower.config.num_prefix_tokens,
                                       pooled_query=tower.config.pooled_query,
                                       pool_weighted=tower.config.pooled_query and tower.attn_pool is not None,
                                       on_complete=on_file)
    cropped = crop(load_image(image), spec_of(model).preprocessing)  # as `analyze` crops it
    if on_crop is not None:
        on_crop(cropped)
    try:
        a = analyze_crop(model, cropped, on_layer=stream.on_layer)
        stream.finish(a)
    except BaseException:
        stream.abort()
        raise
    return Exploration(a, facts)


def explore_crop(cache: ModelCache, cropped: Image.Image, variant: str) -> Exploration:
    """`explore` for the crop of an earlier analysis (`Analysis.image`): the same numbers again."""
    model, facts = cache.get(variant)
    return Exploration(analyze_crop(model, cropped), facts)


def parse_head(choice: str) -> int | str:
    """"head 3" -> 2 (0-based); "mean" and "max" as they are."""
    return int(choice.split()[1]) - 1 if choice.startswith("head ") else choice


def patch_at(exp: Exploration, x: float, y: float) -> int:
    """The query index (`Analysis.query_token`) of the patch under display pixel (x, y)."""
    a = exp.analysis
    px = a.patch_size * exp.scale
    gh, gw = a.grid
    r = min(gh - 1, max(0, int(y // px)))
    c = min(gw - 1, max(0, int(x // px)))
    return a.patch_query(r, c)


def describe_query(exp: Exploration, query: int, layer: int | None = None) -> str:
    """What query index `query` stands for, in words (the same token at every layer)."""
    a = exp.analysis
    if query < len(a.query_names):
        name = a.query_names[query]
        if name == POOL:
            return "query: the mean of the patch tokens (what the classifier reads)"
        return "query: the cls token" if name == "cls" else f"query: the {name} token"
    r, c = divmod(query - len(a.query_names), a.grid[1])
    return f"query: patch row {r + 1}, column {c + 1}"


def explorer_bounds(exp: Exploration, layer: int | None = None) -> tuple[int, int, int]:
    """(layers, heads, queries: the prefix tokens, a pooled query and the patches) of the explorer."""
    depth, heads = exp.analysis.attentions.shape[:2]
    return depth, heads, exp.analysis.num_queries


def scale_refusal(scale: str) -> str | None:
    """Why the explorer has no such colour scale: None, it has each."""
    return None


# ------------------------------------------------------------------------------------------------
# The rest of the drawer protocol (`vitviz.server.pictures.drawers.PROTOCOL`) for global attention

DISCARD_RATIO = True  # the rollout's discard ratio applies
EXPLORER_WIDGET = "global"  # the page's explorer widget that draws this layout (`explorer.js`)


def rollout_note(exp: Exploration) -> str | None:
    """What the page says beside the rollout of this layout (None: the caption says it all)."""
    return None


def maps_note(exp: Exploration, missing: list[str]) -> str:
    """What the Explain tab adds about the methods (`missing`, their titles) with no map for this
    model: here each lacks what the model does not have, which the tab's note says already."""
    return ""


def explorer_mode(exp: Exploration) -> str:
    """How the explorer reaches the browser (`explorer_data.layout_of`): "stack" (one file written
    during the forward), "layers" (a file per layer when shown) or "server" (drawn by the server)."""
    return explorer_data.layout_of(exp.analysis).mode


def write_explorer(exp: Exploration, *, key: str, folder) -> dict:
    """Writes the explorer's files for `exp` under names made from `key`; the widget's value."""
    return explorer_data.write_payload(exp, key=key, folder=folder)


def render_positions(exp: Exploration) -> tuple[Image.Image | None, Image.Image | None]:
    """(the learned positions' picture: the embeddings' similarity, or None; the patch filters, or
    None for a hybrid's)."""
    return render_position(exp)


def render_bias(exp: Exploration, *, layer: int) -> Image.Image:
    """A model's positions by offset at layer `layer` (1-based): BEiT's relative position bias per
    head (`TokenLayout.position_bias`); or, for a rotary model, per head the mean cosine of its pairs'
    rotary angles between a query and a key that far apart (`vitviz.offsets.rotary_offsets`; the
    same at every layer unless the frequencies are learned per layer)."""
    if exp.facts.bias is not None:  # BEiT's relative position bias over the grid, one table per head
        bias = exp.facts.bias
        if not 1 <= layer <= bias.shape[0]:
            raise ValueError(f"layer must be within 1..{bias.shape[0]}, got {layer}")
        return plots.named(plots.bias_tables_image(bias[layer - 1]), _name(exp, "position-bias", f"layer{layer}"))
    rotary = exp.facts.rotary
    if rotary is None:
        raise ValueError(f"{exp.analysis.variant} has learned position embeddings, not relative position bias tables")
    if not 1 <= layer <= rotary.shape[0]:
        raise ValueError(f"layer must be within 1..{rotary.shape[0]}, got {layer}")
    mixed = exp.analysis.layout.rotary == "mixed"
    tables = rotary[layer - 1] if mixed else rotary[layer - 1, :1]  # fixed frequencies: one table for every head
    titles = None if mixed else ["every head"]
    img = plots.bias_tables_image(tables, label="cos", titles=titles, tile=128 if mixed else 256)
    return plots.named(img, _name(exp, "rotary-positions", f"layer{layer}" if mixed else ""))


def render_offsets(exp: Exploration, *, layer: int) -> Image.Image:
    """The attention layer `layer` (1-based) gave each offset on this image, per head: a patch query's
    attention to the patch key that far away, averaged over the queries with a key there
    (`vitviz.offsets.attention_by_offset`)."""
    a = exp.analysis
    layers = a.attentions.shape[0]
    if not 1 <= layer <= layers:
        raise ValueError(f"layer must be within 1..{layers}, got {layer}")
    table = attention_by_offset(a.attentions[layer - 1], a.grid, num_prefix_tokens=a.num_prefix_tokens)
    img = plots.bias_tables_image(table, cmap="viridis", label="attention", symmetric=False)
    return plots.named(img, _name(exp, "attention-by-offset", f"layer{layer}"))


def render_stages(exp: Exploration) -> Image.Image | None:
    """The stages over the image: one stage of one global grid, drawn as the patch grid (None)."""
    return None


def render_predictions(exp: Exploration) -> dict[str, float]:
    return dict(exp.analysis.predictions(5))


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in text).strip("-")


def _name(exp: Exploration, *parts: object) -> str:
    """A download name: variant, view, and the view's options ("vit_b_16-query-l12-mean-q0.png")."""
    return "-".join(_slug(str(p)) for p in (exp.analysis.variant, *parts) if p != "") + ".png"


def _heat_view(exp: Exploration, heat: torch.Tensor, *, name: str, label: str, vmin: float | None = None,
               vmax: float | None = None, cmap: str = plots.CMAP, mark: int | None = None) -> Image.Image:
    """A map [gh, gw] over the displayed image, query `mark` outlined when it is a patch, with its
    colour bar (the range drawn: vmin..vmax, or the map's own) and its download name."""
    a = exp.analysis
    img = plots.overlay(exp.display_image, heat, vmin=vmin, vmax=vmax, cmap=cmap)
    lo, hi = img.info["vitviz_range"]
    if mark is not None and mark >= len(a.query_names):
        r, c = divmod(mark - len(a.query_names), a.grid[1])
        img = plots.mark_patch(img, patch=(r, c), patch_size=a.patch_size * exp.scale)
    return plots.with_colorbar(plots.named(img, name), vmin=lo, vmax=hi, label=label, cmap=cmap)


def render_rollout(exp: Exploration, *, head_fusion: str = "mean", discard_ratio: float = 0.0, token: Query | None = None) -> Image.Image:
    """A query's rollout over the image (the classifier's: the cls token's, or "pool" for a model
    that classifies from the mean of its patch tokens; token 1 is DeiT's distillation token),
    computed from the stored attention, with its colour bar."""
    a = exp.analysis
    token = a.default_query if token is None else token
    heat = a.cls_map(token=token, head_fusion=head_fusion, discard_ratio=discard_ratio)  # type: ignore[arg-type]
    name = _name(exp, "rollout", token if token == POOL else a.prefix_names[token], head_fusion, f"discard{discard_ratio:g}")
    return _heat_view(exp, heat, name=name, label="rollout")


def render_received(exp: Exploration) -> Image.Image:
    """Where each layer's attention goes: the prefix tokens (cls, distillation, registers) one by
    one, and the patches' median and largest share (heads averaged)."""
    a = exp.analysis
    received = attention_received(a.attentions).mean(dim=1)  # [L, H, N] -> [L, N]
    fig = plots.received_figure(received, prefix_names=a.prefix_names, title=f"{a.variant}: attention received per layer")
    return plots.named(plots.figure_to_image(fig), _name(exp, "attention-received"))


def query_range(exp: Exploration, *, query: int, scale: str, layer: int | None = None) -> tuple[float, float] | None:
    """The colour scale of a query's maps: "map", None (each map its own min..max); "layer", the
    min..max over every view of layer `layer` (1-based: its heads, mean and max), so that the map and
    the mosaic share one colour bar; "shared", 0 to the largest weight the query gives a patch in any
    layer and head."""
    if scale == "map":
        return None
    if scale == "shared":
        return 0.0, float(explorer_data.shared_max(exp.analysis)[query])
    if scale != "layer" or layer is None:
        raise ValueError(f"unknown colour scale {scale!r} (map, layer with a layer, or shared)")
    a = exp.analysis
    rows = [explorer_data.row_values(a, layer=layer - 1, head=h, query=query) for h in range(a.attentions.shape[1] + 2)]
    return float(min(r.min() for r in rows)), float(max(r.max() for r in rows))


def tick(value: float) -> str:
    """A scale value as the explorer writes it: three significant digits, tiny ones in e-notation."""
    if value == 0:
        return "0"
    if abs(value) < 1e-3:
        return f"{value:.1e}"
    return f"{float(f'{value:.3g}'):g}"


def head_index(head: str, heads: int) -> int:
    """A head choice as the explorer's view index: "head k" -> k - 1, "mean" -> H, "max" -> H + 1."""
    h = parse_head(head)
    return h if isinstance(h, int) else heads + ("mean", "max").index(h)


def _view_heat(exp: Exploration, *, layer: int, head: int, query: int) -> torch.Tensor:
    """The 8-bit values the browser draws too (`explorer_data`), as a [gh, gw] map."""
    a = exp.analysis
    return torch.from_numpy(explorer_data.row_values(a, layer=layer - 1, head=head, query=query).reshape(a.grid))


def render_query(exp: Exploration, *, layer: int, head: str, query: int, scale: str = "layer") -> Image.Image:
    """Layer `layer` (1-based) attention of token `query` over the patches, with the query marked and
    a colour bar; `scale` as `query_range` ("layer", "map" or "shared"). The values
    are the 8-bit rows the browser draws (`explorer_data`), so both give the same pixels."""
    a = exp.analysis
    heat = _view_heat(exp, layer=layer, head=head_index(head, a.attentions.shape[1]), query=query)
    lo, hi = query_range(exp, query=query, scale=scale, layer=layer) or (None, None)
    name = _name(exp, "query", f"layer{layer}", head.replace(" ", ""), f"token{query}", scale)
    return _heat_view(exp, heat, name=name, label="attention", vmin=lo, vmax=hi, mark=query)


mosaic_tile_px = explorer_data.mosaic_tile_px


def render_head_mosaic(exp: Exploration, *, layer: int, query: int, scale: str = "layer") -> Image.Image:
    """Every head of one layer for the same query, as a mosaic of tiles about 160 px (4 columns for
    12 and 16 heads), each head labelled beneath: on one colour bar (the map's) for "layer" and
    "shared", each on its own scale with its range in its label for "map"."""
    a = exp.analysis
    heads = a.attentions.shape[1]
    heats = torch.stack([_view_heat(exp, layer=layer, head=h, query=query) for h in range(heads)])  # [H, gh, gw]
    small = a.image.resize(explorer_data.mosaic_tile(a.grid), Image.BILINEAR)
    common = query_range(exp, query=query, scale=scale, layer=layer)
    tiles = plots.overlay_many(small, heats, vmin=common[0] if common else None, vmax=common[1] if common else None)
    if common:
        labels = [f"head {h + 1}" for h in range(heads)]
    else:
        labels = [f"head {h + 1}: {tick(float(m.min()))}–{tick(float(m.max()))}" for h, m in enumerate(heats)]
    img = plots.mosaic(tiles, cols=math.ceil(math.sqrt(len(tiles))), labels=labels)
    plots.named(img, _name(exp, "heads", f"layer{layer}", f"token{query}", scale))
    return plots.with_colorbar(img, vmin=common[0], vmax=common[1], label="attention") if common else img


def render_distance(exp: Exploration) -> Image.Image:
    """The distance chart: only the dots are drawn per image (`plots.DistanceChart`)."""
    return plots.named(exp.facts.distance_chart.render(exp.analysis.distances()), _name(exp, "attention-distance"))


_COMPARE_CHART = plots.DistanceChart(uniform=None, title="Mean attention distance per head (each variant's own pixels)")


def render_compare_distance(exps: list[Exploration]) -> Image.Image:
    """Several variants' mean attention distance in one chart, each in its own input pixels: one
    [layers, heads] table each, or, when a model's layers differ in heads (a list of rows, one per
    layer: heads by stage), each layer's heads its own."""
    tables = {e.facts.spec.name: e.analysis.distances() for e in exps}
    name = "compare-" + "-".join(_slug(e.facts.spec.name) for e in exps) + "-attention-distance.png"
    if all(isinstance(t, torch.Tensor) for t in tables.values()):
        return plots.named(_COMPARE_CHART.render(tables), name)
    fig = plots.layer_distance_figure({k: list(t) for k, t in tables.items()}, title=_COMPARE_CHART.title)
    return plots.named(plots.figure_to_image(fig), name)


def rollout_density(exp: Exploration) -> torch.Tensor:
    """The classifier query's rollout over the patches [gh, gw] (a Swin's: the pooled query's on its
    finest grid) as a density: each patch's weight times the number of patches, so 1 is the weight
    of a patch when the query spreads it evenly. Maps on different grids (B/16 and B/32) then share
    one scale; the raw weights of a grid with 4x the patches are 4x smaller."""
    heat = exp.analysis.cls_map()
    return heat * heat.numel()


COMPARE_LABEL = "rollout density (1 = spread evenly over the patches)"


def render_compare_rollouts(exps: list[Exploration], *, shared: bool = True) -> tuple[list[Image.Image], list[tuple[float, float]]]:
    """Each exploration's rollout density over its image, without a colour bar, and the range each
    is drawn on: 0 to the largest density of all of them when `shared` (one scale, so a colour means
    the same density in every map), else 0 to each map's own largest."""
    heats = [rollout_density(e) for e in exps]
    top = max(float(h.max()) for h in heats)
    ranges = [(0.0, top if shared else float(h.max())) for h in heats]
    pictures = [plots.named(plots.overlay(e.display_image, h, vmin=lo, vmax=hi), _name(e, "rollout-density", "shared" if shared else "own"))
                for e, h, (lo, hi) in zip(exps, heats, ranges)]
    return pictures, ranges


def colour_bar_html(lo: float, hi: float, *, label: str = COMPARE_LABEL, cmap: str = plots.CMAP) -> str:
    """A horizontal colour bar as page text (its numbers stay readable however narrow the figures):
    the colour map from `lo` to `hi`, five values under it."""
    table = plots.lut(cmap)
    stops = ", ".join(f"rgb({r},{g},{b}) {i * 10}%" for i, (r, g, b) in enumerate(table[np.linspace(0, 255, 11).round().astype(int)].tolist()))
    ticks = "".join(f"<span>{html.escape(plots.tick_label(v))}</span>" for v in plots.tick_values(lo, hi))
    return (f'<div class="vv-colourbar" role="img" aria-label="{html.escape(label)}: {plots.tick_label(lo)} to {plots.tick_label(hi)}">'
            f'<div class="vv-colourbar-ramp" style="background: linear-gradient(to right, {stops})"></div>'
            f'<div class="vv-colourbar-ticks">{ticks}</div><div class="vv-colourbar-label">{html.escape(label)}</div></div>')


def compare_table_html(exps: list[Exploration]) -> str:
    """The compared models in one small table: input, patch, grid, layers and heads (a Swin's per
    stage), parameters and the forward pass's time."""
    head = "".join(f"<th scope='col'>{h}</th>" for h in ("Variant", "Input", "Patch", "Grid", "Layers", "Heads", "Params", "Forward"))
    rows = []
    for e in exps:
        a = e.analysis
        heads = [int(layer.shape[-3]) for layer in a.attentions]  # each layer's [..., heads, N, N] (a Swin's: by stage)
        stages = list(dict.fromkeys(heads))
        p = a.patch_size
        cells = [f"{a.grid[1] * p}x{a.grid[0] * p}", f"{p} px", f"{a.grid[0]}x{a.grid[1]}", str(len(heads)),
                 "-".join(str(h) for h in stages), f"{e.facts.total_params / 1e6:.2f} M", f"{a.model_seconds * 1e3:.0f} ms"]
        name = "".join(f"{c}<wbr>" if c in "_.:/-@" else c for c in html.escape(a.variant))  # long names break at their joints
        rows.append(f"<tr><th scope='row'>{name}</th>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return (f"<div class='vv-scroll-x'><table class='vv-compare-table'><caption>The compared models</caption><thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table></div>")


def render_position(exp: Exploration) -> tuple[Image.Image | None, Image.Image | None]:
    """(position-embedding similarity as the paper's grid, principal components of the patch filters
    with the variance each explains): the model's own, drawn once per loaded model; None for the
    similarity of a model without a learned table, and for the filters of a hybrid."""
    f = exp.facts
    if f.similarity is None:  # no learned table (rotary positions alone)
        return None, render_filters(exp)
    if "position" not in f.drawn:
        sim = plots.figure_to_image(plots.position_similarity_figure(f.similarity, title=f"{f.spec.name}: position embedding similarity"))
        f.drawn["position"] = plots.named(sim, _name(exp, "position-similarity"))
    return f.drawn["position"], render_filters(exp)


def render_filters(exp: Exploration) -> Image.Image | None:
    """The patch-embedding filters' principal components with the variance each explains, whatever
    the token layout (drawn once per loaded model); None for a model without filters over pixels (a
    hybrid: `TokenLayout.patch_filters`)."""
    f = exp.facts
    if f.components is None:
        return None
    if "filters" not in f.drawn:
        f.drawn["filters"] = plots.named(plots.filters_image(f.components, f.explained), _name(exp, "filter-components"))
    return f.drawn["filters"]


def render_architecture(exp: Exploration) -> tuple[Image.Image, list[list[str]]]:
    grid = plots.named(plots.patch_grid(exp.analysis.image, patch_size=exp.analysis.patch_size), _name(exp, "patch-grid"))
    return grid, exp.facts.summary_rows


# ------------------------------------------------------------------------------------------------
# Explanations, DINO heads, tokens and features

def render_method_maps(exp: Exploration, maps: dict[str, torch.Tensor], *, label: str, scale: str = "map") -> dict[str, Image.Image]:
    """One overlay per method ({method: [gh, gw]}), each with its colour bar; "shared" puts every
    method on 0..the largest value of any (useful when the methods share a unit, as rollouts do)."""
    lo, hi = (0.0, max(float(m.max()) for m in maps.values())) if scale == "shared" else (None, None)
    return {name: _heat_view(exp, m, name=_name(exp, "explain", name, label), label=registered_method(name).unit, vmin=lo, vmax=hi)
            for name, m in maps.items()}


def render_phrase_maps(exp: Exploration, maps: torch.Tensor, phrases: list[str], *, method: str) -> list[Image.Image]:
    """One overlay per phrase (maps [T, gh, gw]), each on its own range with its colour bar, named by
    the variant, the method and the phrase."""
    unit = registered_method(method).unit
    return [_heat_view(exp, m, name=_name(exp, "find", method, phrase), label=unit) for m, phrase in zip(maps, phrases)]


def render_dino_heads(exp: Exploration, *, share: float = 0.6) -> Image.Image:
    """DINO's figure: the last block's cls attention per head (a pooled model's "pool" query's), the
    patches that hold `share` of each head's mass in colour and the rest dimmed (Caron et al. 2021);
    for a model that pools with attention, its probe's heads (the last attention its query has)."""
    a = exp.analysis
    if a.pool_attention is not None:
        rows = a.pool_attention[:, a.num_prefix_tokens :]  # [H, gh*gw]
        maps, masks = rows.reshape(-1, *a.grid), keep_mass(rows, share).reshape(-1, *a.grid)
    else:
        maps, masks = dino_head_maps(a.attentions, grid=a.grid, num_prefix_tokens=a.num_prefix_tokens, share=share, query=a.default_query)
    return kept_heads_mosaic(exp, maps, masks, share=share)


def kept_heads_mosaic(exp: Exploration, maps: torch.Tensor, masks: torch.Tensor, *, share: float,
                      labels: list[str] | None = None) -> Image.Image:
    """One tile per head: its map [H, gh, gw] over the image (a grid that divides it: the patch
    grid), the cells of `masks` [H, gh, gw] in colour and the rest dimmed, labelled with how many
    cells each head keeps, or with `labels` (DINO's figure)."""
    grid = tuple(maps.shape[1:])
    tw, th = explorer_data.mosaic_tile(grid)
    small = exp.analysis.image.resize((tw, th), Image.BILINEAR)
    tiles = []
    for heat, mask, img in zip(maps, masks, plots.overlay_many(small, maps)):
        keep = np.asarray(mask.numpy(), dtype=bool).repeat(th // grid[0], 0).repeat(tw // grid[1], 1)
        arr = np.asarray(img).copy()
        arr[~keep] = (np.asarray(small)[~keep] * 0.25).astype(np.uint8)
        tiles.append(Image.fromarray(arr))
    if labels is None:
        labels = [f"head {h + 1}: {int(m.sum())} patch{'' if int(m.sum()) == 1 else 'es'}" for h, m in enumerate(masks)]
    img = plots.mosaic(tiles, cols=math.ceil(math.sqrt(len(tiles))), labels=labels)
    return plots.named(img, _name(exp, "dino-heads", f"share{share:g}"))


def render_token_norms(exp: Exploration) -> tuple[Image.Image, Image.Image]:
    """(token norms per layer, prefix tokens one by one; the last block's patch norms over the image)."""
    a = exp.analysis
    chart = plots.figure_to_image(plots.norms_figure(a.token_norms, prefix_names=a.prefix_names, title=f"{a.variant}: token norms per layer"))
    last = a.token_norms[-1, a.num_prefix_tokens :].reshape(a.grid)
    img = _heat_view(exp, last, name=_name(exp, "token-norms-last-layer"), label="norm")
    return plots.named(chart, _name(exp, "token-norms")), img


OUTLIER_COLOR = (0, 229, 255)  # the outline of a high-norm token


def outlined_heat(exp: Exploration, heat: torch.Tensor, mask: torch.Tensor, *, cell_px: int, name: str, label: str) -> Image.Image:
    """A map [gh, gw] over the displayed image with the cells of `mask` [gh', gw'] outlined (each
    `cell_px` display pixels a side from the top left: a coarser grid's cells may run past the image,
    and are cut there), with its colour bar and its download name."""
    img = plots.overlay(exp.display_image, heat)
    lo, hi = img.info["vitviz_range"]
    pixels = np.asarray(img)
    gh, gw = mask.shape
    h, w = min(pixels.shape[0], gh * cell_px), min(pixels.shape[1], gw * cell_px)
    canvas = np.zeros((gh * cell_px, gw * cell_px, 3), dtype=np.uint8)  # whole cells, as `outline_cells` draws them
    canvas[:h, :w] = pixels[:h, :w]
    ids = np.arange(gh * gw).reshape(gh, gw)  # every cell its own region: each outlier outlined on its own
    canvas = plots.outline_cells(canvas, ids, cell_px=cell_px, width=max(2, cell_px // 10), color=OUTLIER_COLOR,
                                 where=mask.numpy().astype(bool))
    pixels = pixels.copy()
    pixels[:h, :w] = canvas[:h, :w]
    return plots.with_colorbar(plots.named(Image.fromarray(pixels), name), vmin=lo, vmax=hi, label=label)


def outliers_caption(o, index: int, *, layer: int, query: str, reader: str) -> str:
    """What the page says of the high-norm tokens of `o` (`vitviz.registers.Outliers`) at its layer
    `index`, shown as block `layer` (1-based): how many, the largest norm over the median, the rule,
    and the share of attention `query` (the classifier's query, in words) and the other patches give
    them in the block `reader` names ("In block 4, which reads them,")."""
    factor = "twice" if o.factor == 2 else f"{o.factor:g} times"
    rule = (f"A high-norm token: a patch token whose norm is above {factor} the layer's median patch norm "
            "(`vitviz.registers.OUTLIER_FACTOR`; Darcet et al. 2024).")
    ratio, count = float(o.ratio[index]), o.counts[index]
    if not count:
        return f"No high-norm token after block {layer} (largest norm {ratio:.1f} times the median). {rule}"
    patches = int(o.mask[index].numel())
    return (f"**{count} high-norm token{'' if count == 1 else 's'} after block {layer}** of {patches} patches; the largest norm "
            f"is {ratio:.1f} times the median. {reader} {query} gives them {100 * float(o.query_share[index]):.1f} % of its "
            f"attention, against {100 * float(o.fraction[index]):.1f} % spread evenly (their share of the patches); the other "
            f"patches give them {100 * float(o.patch_share[index]):.1f} % of theirs on average. {rule}")


def render_outliers(exp: Exploration, *, layer: int) -> tuple[Image.Image, str]:
    """The high-norm patch tokens after block `layer` (1-based; `Analysis.outliers`): every patch
    token's norm over the image, the outliers outlined, and what the page says of them (how many, the
    largest norm over the median, the attention the classifier's query and the other patches give
    them in the block that reads them)."""
    a = exp.analysis
    o = a.outliers()
    depth = o.norms.shape[0]
    if not 1 <= layer <= depth:
        raise ValueError(f"layer must be within 1..{depth}, got {layer}")
    index = layer - 1
    img = outlined_heat(exp, o.norms[index], o.mask[index], cell_px=a.patch_size * exp.scale,
                        name=_name(exp, "high-norm-tokens", f"layer{layer}"), label="token norm")
    query = "the pooled query (the mean of the patches' rows)" if a.default_query == POOL else f"the {a.prefix_names[0]} token"
    reader = f"In block {layer + 1}, which reads them," if layer < depth else "In the last block (no block reads them after it),"
    return img, outliers_caption(o, index, layer=layer, query=query, reader=reader)


def render_features(exp: Exploration) -> tuple[Image.Image, str]:
    """(the patch features' first three principal components as RGB, the variance they explain)."""
    a = exp.analysis
    scores, explained = feature_components(a.tokens[a.num_prefix_tokens :], k=3)  # the first three principal components
    img = plots.features_image(scores, exp.analysis.grid, size=exp.display_image.size[0])
    text = ", ".join(f"PC{i + 1} {100 * float(e):.1f} %" for i, e in enumerate(explained))
    return plots.named(img, _name(exp, "feature-pca")), f"Red, green, blue: {text} of the patch features' variance."


def render_feature_similarity(exp: Exploration, *, query: int) -> Image.Image:
    """Cosine similarity of one patch's last-layer feature to every patch's, over the image (`query`
    a query index, as `patch_at` gives)."""
    a = exp.analysis
    first = len(a.query_names)
    if query < first:
        raise ValueError("pick a patch, not a prefix token")
    sim = feature_similarity(a.tokens[a.num_prefix_tokens :], query - first).reshape(a.grid)
    return _heat_view(exp, sim, name=_name(exp, "feature-similarity", f"token{query}"), label="cosine", vmin=-1.0, vmax=1.0,
                      cmap="RdBu_r", mark=query)


# ---------------------------------------------------------------------------------------------
# The analysis as a download


def write_npz(exp: Exploration, path: str | Path, *, attentions: bool = True) -> Path:
    """The analysis as an .npz: attentions (optional: L x H x N x N; float32 up to 64 MB, float16
    beyond, relative error at most 2^-11), the cls rollout (mean fusion, no discard: all N rows up
    to 1,024 tokens, the prefix tokens' rows beyond) and its map, distances, probabilities, the crop.
    `vitviz.cost.export_plan` says what an export holds and weighs before it is written.

    Uncompressed: zlib on a float attention stack costs far more time than it saves bytes. The
    float16 copy is torch's (the same bits as numpy's `astype`): numpy's conversion slows down
    twelvefold where the values fall below float16's normal range (6.1e-5), as most of a model's
    attention does beside a sink that takes nearly all of it.
    """
    a = exp.analysis
    plan = export_plan(exp.facts.spec)
    path = Path(path)
    extra = {}
    if attentions:
        extra["attentions"] = a.attentions.to(weights_dtype(plan["attention_dtype"])).numpy()
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
