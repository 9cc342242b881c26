"""The app's pictures of a Swin analysis (`vitviz.swin_analysis.SwinAnalysis`): no Gradio.

A Swin attends inside windows, each stage on its own grid (the finest first, halved at each merge),
and classifies from the mean of its final tokens: there is no cls token and no position embedding.
What applies, drawn here from the stored analysis (no model runs):

- the rollout of the pooled query through every layer and merge, on the finest grid (`cls_map`);
- a query token's attention at any layer on that layer's stage grid, its window outlined
  (`render_query`, the browser's windowed explorer draws the same pixels: `swin_explorer`);
- mean attention distance per layer and head in input pixels, heads by stage (`render_distance`);
- each layer's relative position bias tables per head (`render_bias`), in place of position
  embeddings;
- the stages: grids, windows, shifted windows and their masked regions (`render_stages`);
- the tokens: the share of attention each receives and its norm, layer by layer over its stage's
  tokens; the pooled query's heads at the last block and the final tokens' principal components, on
  the last stage's grid (`render_received`, `render_token_norms`, `render_dino_heads`,
  `render_features`, `render_feature_similarity`); the high-norm tokens of any layer among its
  stage's tokens (`render_outliers`).

The maps for a class are `vitviz.server.explaining`'s (one forward and one backward) drawn by
`views.render_method_maps`, as for a ViT.
"""

from __future__ import annotations

from dataclasses import replace

import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from vitviz import plots
from vitviz.cost import export_plan
from vitviz.registers import outliers
from vitviz.relevance import feature_components, feature_similarity, keep_mass
from vitviz.server.pictures import swin_explorer
from vitviz.server.pictures.views import (Exploration, _heat_view, _name, kept_heads_mosaic, mosaic_tile_px, outlined_heat, outliers_caption,
                                          render_filters, tick)
from vitviz.sources import weights_dtype
from vitviz.swin import relative_position_index
from vitviz.swin_analysis import SwinAnalysis

__all__ = ["finest", "DISCARD_RATIO", "EXPLORER_WIDGET", "rollout_note", "maps_note",
           "explorer_mode", "write_explorer", "render_positions", "render_rollout", "render_query", "render_head_mosaic", "explorer_bounds", "scale_refusal", "query_range", "distance_table",
           "render_distance", "bias_tables", "render_bias", "render_offsets", "render_stages", "describe_query", "head_view", "patch_at",
           "write_npz", "render_received", "render_token_norms", "render_outliers", "render_dino_heads", "render_features", "render_feature_similarity"]

WINDOW_COLOR = (0, 229, 255)  # the query's window (its visible tokens)
QUERY_COLOR = (255, 255, 255)  # the query token


DISCARD_RATIO = False  # most of each row lies outside the window: the rollout's discard ratio is not defined
EXPLORER_WIDGET = "windowed"  # the page's explorer widget that draws this layout (`swin_explorer.js`)
ROLLOUT_NOTE = (
    "**Rollout of the pooled query.** {variant} has no cls token: its classifier reads the mean of its final tokens, so "
    "the map is the mean of their rows of the rollout, carried through every window layer (the shift undone, masked pairs "
    "0) and every patch merge (each merged token drawing equally on its 2x2 children) onto the finest grid. The discard "
    "ratio is not defined for windowed attention."
)


def rollout_note(exp: Exploration) -> str | None:
    """What the rollout is for a model without a cls token, through windows and merges."""
    return ROLLOUT_NOTE.format(variant=exp.analysis.variant)


def maps_note(exp: Exploration, missing: list[str]) -> str:
    """Why the methods `missing` (their titles) have no map, and what the maps are."""
    if not missing:
        return ""
    return (f"Not for a Swin (windowed attention): {', '.join(missing)}. The maps are the pooled query's (the mean of the final "
            "tokens' rows), through every window layer and patch merge onto the finest grid.")


def explorer_mode(exp: Exploration) -> str:
    """The windowed explorer's data is one file, written after the forward within the analysis' job ("windows")."""
    return "windows"


def write_explorer(exp: Exploration, *, key: str, folder) -> dict:
    """Writes the windowed explorer's file for `exp` under names made from `key`; the widget's value
    ("stack", or "server" when too large for the browser)."""
    return swin_explorer.write_payload(exp, key=key, folder=folder, spec=exp.facts.spec)


def render_positions(exp: Exploration) -> tuple[Image.Image | None, Image.Image | None]:
    """(no position embeddings: None; the patch filters). Its learned positions are each layer's
    relative position bias (`render_bias`)."""
    return None, render_filters(exp)


def finest(values: torch.Tensor | np.ndarray, grid: tuple[int, int], stage: int) -> np.ndarray:
    """A stage's map [gh_s, gw_s] on the finest grid [gh0, gw0]: cell (r, c) shows (r >> s, c >> s)."""
    v = np.asarray(values)
    rows, cols = np.arange(grid[0]) >> stage, np.arange(grid[1]) >> stage
    return v[rows][:, cols]


def render_rollout(exp: Exploration, *, head_fusion: str = "mean", discard_ratio: float = 0.0, token=None) -> Image.Image:
    """The pooled query's rollout through every layer and merge (the mean of the final tokens' rows),
    over the image, with its colour bar (no other query, no discard ratio: `DISCARD_RATIO`)."""
    if discard_ratio:
        raise ValueError("The discard ratio is not defined for windowed attention (most of each row lies outside the window): "
                         "leave it at 0.")
    if token is not None:
        raise ValueError("A windowed model's rollout is its pooled query's: there is no other token to roll out.")
    heat = exp.analysis.cls_map(head_fusion=head_fusion)  # type: ignore[arg-type]
    return _heat_view(exp, heat, name=_name(exp, "rollout", "pool", head_fusion), label="rollout")


def head_view(head: str, heads: int) -> int:
    """A head choice ("head k", "mean", "max") as a view index of a layer with `heads` heads."""
    if head.startswith("head "):
        return int(head.split()[1]) - 1
    return heads + ("mean", "max").index(head)


def query_range(exp: Exploration, *, layer: int, query: int, scale: str, view: int) -> tuple[float, float]:
    """The colour scale of a query's view at layer `layer` (1-based): "map" the view's own min..max;
    "layer" the min..max over every view of the layer (its heads, mean and max) for that query."""
    a = exp.analysis
    views = range(a.heads(layer - 1) + 2) if scale == "layer" else [view] if scale == "map" else None
    if views is None:
        raise ValueError(f"unknown colour scale {scale!r} (layer or map)")
    rows = [swin_explorer.row_values(a, layer=layer - 1, view=v, query=query) for v in views]
    return float(min(r.min() for r in rows)), float(max(r.max() for r in rows))


def _outlined(exp: Exploration, img: Image.Image, *, layer: int, query: int) -> Image.Image:
    """The query's window (cyan) and the query token (white) outlined on a map of the display image."""
    a = exp.analysis
    seen = swin_explorer.visible(a, layer - 1, query)
    if seen is None:
        return img
    s, px = a.stages[layer - 1], a.patch_size * exp.scale
    width = swin_explorer.outline_width(px)
    cell = swin_explorer.query_cell(a, layer - 1, query)
    mine = np.zeros(seen.shape, dtype=bool)
    mine[cell] = True
    pixels = np.asarray(img.convert("RGB"))
    for mask, color in ((seen, WINDOW_COLOR), (mine, QUERY_COLOR)):
        big = finest(mask, a.grid, s)
        pixels = plots.outline_cells(pixels, big.astype(np.int64), cell_px=px, width=width, color=color, where=big)
    out = Image.fromarray(pixels)
    out.info.update(img.info)
    return out


def render_query(exp: Exploration, *, layer: int, head: str, query: int, scale: str = "layer") -> Image.Image:
    """Layer `layer` (1-based) attention of query `query` (`swin_explorer.POOL_QUERY`, or 1 + a
    finest patch: the stage's token over it) on the layer's stage grid, over the image, its window
    outlined, with a colour bar. The values are the 8-bit rows the browser draws, so both give the
    same pixels."""
    a = exp.analysis
    s = a.stages[layer - 1]
    view = head_view(head, a.heads(layer - 1))
    values = swin_explorer.row_values(a, layer=layer - 1, view=view, query=query).reshape(a.geometries[layer - 1].grid)
    lo, hi = query_range(exp, layer=layer, query=query, scale=scale, view=view)
    img = plots.overlay(exp.display_image, torch.from_numpy(finest(values, a.grid, s)), vmin=lo, vmax=hi)
    img = plots.named(_outlined(exp, img, layer=layer, query=query), _name(exp, "windows", f"layer{layer}", head.replace(" ", ""),
                                                                             f"token{query}", scale))
    return plots.with_colorbar(img, vmin=lo, vmax=hi, label="attention")


def render_head_mosaic(exp: Exploration, *, layer: int, query: int, scale: str = "layer") -> Image.Image:
    """Every head of one layer for the same query, tiles about 160 px, on the layer's colour bar
    ("layer") or each on its own range, written beneath it ("map")."""
    a = exp.analysis
    s, heads = a.stages[layer - 1], a.heads(layer - 1)
    grid = a.geometries[layer - 1].grid
    heats = torch.stack([torch.from_numpy(finest(swin_explorer.row_values(a, layer=layer - 1, view=h, query=query).reshape(grid), a.grid, s))
                         for h in range(heads)])
    tile = mosaic_tile_px(a.grid)
    small = a.image.resize((tile, tile), Image.BILINEAR)
    common = query_range(exp, layer=layer, query=query, scale="layer", view=0) if scale == "layer" else None
    tiles = plots.overlay_many(small, heats, vmin=common[0] if common else None, vmax=common[1] if common else None)
    labels = [f"head {h + 1}" if common else f"head {h + 1}: {tick(float(m.min()))}–{tick(float(m.max()))}" for h, m in enumerate(heats)]
    img = plots.named(plots.mosaic(tiles, cols=math.ceil(math.sqrt(heads)), labels=labels), _name(exp, "window-heads", f"layer{layer}",
                                                                                                 f"token{query}", scale))
    return plots.with_colorbar(img, vmin=common[0], vmax=common[1], label="attention") if common else img


def explorer_bounds(exp: Exploration, layer: int | None = None) -> tuple[int, int, int]:
    """(layers, heads at `layer` (1-based) or the most of any layer, queries: the pooled query and
    every finest patch)."""
    a = exp.analysis
    heads = a.heads(layer - 1) if layer is not None else max(a.heads(l) for l in range(a.num_layers))
    return a.num_layers, heads, 1 + a.grid[0] * a.grid[1]


def scale_refusal(scale: str) -> str | None:
    """Why the windowed explorer has no such colour scale, or None."""
    if scale == "shared":
        return "A Swin's layers lie on grids of their own: its colour scale is one per layer or each map its own."
    return None


def patch_at(exp: Exploration, x: float, y: float) -> int:
    """The query index (1 + r x gw0 + c) of the finest patch under display pixel (x, y)."""
    a = exp.analysis
    px = a.patch_size * exp.scale
    r = min(a.grid[0] - 1, max(0, int(y // px)))
    c = min(a.grid[1] - 1, max(0, int(x // px)))
    return 1 + r * a.grid[1] + c


def describe_query(exp: Exploration, query: int, layer: int | None = None) -> str:
    """What query index `query` stands for, in words (at `layer`, 1-based: its stage's token)."""
    a = exp.analysis
    if query == swin_explorer.POOL_QUERY:
        return "query: the mean of the final tokens (what the classifier reads)"
    r, c = divmod(query - 1, a.grid[1])
    text = f"query: patch row {r + 1}, column {c + 1}"
    if layer is not None and a.stages[layer - 1]:
        sr, sc = swin_explorer.query_cell(a, layer - 1, query)
        text += f" (stage {a.stages[layer - 1] + 1} token row {sr + 1}, column {sc + 1})"
    return text


def distance_table(a: SwinAnalysis) -> torch.Tensor:
    """Mean attention distance per layer and head [L, H_max] in input pixels, heads a layer lacks NaN."""
    rows = a.distances()
    out = torch.full((len(rows), max(len(r) for r in rows)), float("nan"))
    for l, r in enumerate(rows):
        out[l, : len(r)] = r
    return out


def render_distance(exp: Exploration) -> Image.Image:
    """Mean attention distance per layer and head, each layer on its own stage's grid in input
    pixels; stage boundaries marked (heads differ by stage)."""
    a = exp.analysis
    fig = plots.layer_distance_figure(a.distances(), stages=list(a.stages), title=f"{a.variant}: mean attention distance per head")
    return plots.named(plots.figure_to_image(fig), _name(exp, "attention-distance"))


def bias_tables(a: SwinAnalysis, layer: int) -> torch.Tensor:
    """Layer `layer`'s (0-based) relative position bias as tables [heads, 2wh - 1, 2ww - 1]: entry
    (r, c) is the bias a query adds to the logit of the key (r - wh + 1, c - ww + 1) cells away."""
    bias = a.relative_position_bias(layer)  # [heads, M², M²] (query place, key place)
    wh, ww = a.window_sizes[layer]
    index = relative_position_index((wh, ww))  # (query - key + M - 1) flattened
    dy, dx = index // (2 * ww - 1) - (wh - 1), index % (2 * ww - 1) - (ww - 1)  # query - key
    out = bias.new_zeros(bias.shape[0], 2 * wh - 1, 2 * ww - 1)
    out[:, (wh - 1) - dy, (ww - 1) - dx] = bias  # key - query, from the centre
    return out


def render_bias(exp: Exploration, *, layer: int) -> Image.Image:
    """Layer `layer`'s (1-based) relative position bias tables, one tile per head, on one colour bar."""
    img = plots.bias_tables_image(bias_tables(exp.analysis, layer - 1))
    return plots.named(img, _name(exp, "position-bias", f"layer{layer}"))


def render_offsets(exp: Exploration, *, layer: int) -> Image.Image:
    """Attention by offset over the whole grid: not for windowed attention (a window's tokens see
    only their window; its learned offsets are the bias tables, `render_bias`)."""
    raise ValueError(f"{exp.analysis.variant} attends within windows: its offsets are its relative position bias tables")


def render_stages(exp: Exploration) -> Image.Image:
    """Each stage over the image: its tokens (thin lines) and windows (cyan); a stage that shifts also
    its shifted windows, each of its mask's regions outlined (a token attends within its own)."""
    a = exp.analysis
    tile = mosaic_tile_px(a.grid, 200)
    px = tile // a.grid[1]
    small = np.asarray(a.image.resize((tile, tile), Image.BILINEAR).convert("RGB"))
    tiles, labels, seen = [], [], set()
    for layer, g in enumerate(a.geometries):
        s = a.stages[layer]
        if (s, g.shifted) in seen:
            continue  # one plain and one shifted tile per stage
        seen.add((s, g.shifted))
        window, _ = g.placement()
        groups = (window * 9 + g.token_regions()).reshape(g.grid).numpy()
        cells = np.arange(g.num_tokens).reshape(g.grid)
        pixels = plots.outline_cells(small, finest(cells, a.grid, s), cell_px=px, width=1, color=(235, 235, 235))
        tiles.append(Image.fromarray(plots.outline_cells(pixels, finest(groups, a.grid, s), cell_px=px, width=2, color=WINDOW_COLOR)))
        where = f"shifted {g.shift[0]}x{g.shift[1]}" if g.shifted else f"windows {g.window[0]}x{g.window[1]}"
        labels.append(f"stage {s + 1}: {g.grid[0]}x{g.grid[1]}, {where}")
    img = plots.mosaic(tiles, cols=min(len(tiles), 4), labels=labels)
    return plots.named(img, _name(exp, "stages"))


# ---------------------------------------------------------------------------------------------
# The tokens: attention received, token norms, the pooled query's heads, the final features


def _last_stage_view(exp: Exploration, heat: torch.Tensor, *, name: str, label: str, vmin: float | None = None,
                     vmax: float | None = None, cmap: str = plots.CMAP, cell: tuple[int, int] | None = None) -> Image.Image:
    """A map on the last stage's grid [gh, gw] over the displayed image, each token over the finest
    patches it covers (P 2^s pixels a side, the padding's share cut off at the bottom and right:
    `finest`), `cell` (row, column of that grid) outlined, with its colour bar and its download name."""
    a = exp.analysis
    stage = a.stages[-1]
    img = plots.overlay(exp.display_image, torch.from_numpy(finest(heat, a.grid, stage)), vmin=vmin, vmax=vmax, cmap=cmap)
    lo, hi = img.info["vitviz_range"]
    if cell is not None:
        img = plots.mark_patch(img, patch=cell, patch_size=a.stage_patch_size(a.num_layers - 1) * exp.scale)
    return plots.with_colorbar(plots.named(img, name), vmin=lo, vmax=hi, label=label, cmap=cmap)


def _last_grid_note(a: SwinAnalysis) -> str:
    gh, gw = a.stage_grids[-1]
    return f"the last stage's {gh} x {gw} grid, {a.stage_patch_size(a.num_layers - 1)} px a token"


def render_received(exp: Exploration) -> Image.Image:
    """Where each layer's attention goes: the patches' median and largest share of it (heads averaged),
    each layer over its own stage's tokens (`SwinAnalysis.attention_received`)."""
    a = exp.analysis
    fig = plots.received_figure(a.attention_received(), prefix_names=(), title=f"{a.variant}: attention received per layer")
    return plots.named(plots.figure_to_image(fig), _name(exp, "attention-received"))


def render_token_norms(exp: Exploration) -> tuple[Image.Image, Image.Image]:
    """(the patches' median and largest norm after each block, each layer over its stage's tokens; the
    last block's norms on the last stage's grid)."""
    a = exp.analysis
    chart = plots.figure_to_image(plots.norms_figure(a.token_norms, prefix_names=(), title=f"{a.variant}: token norms per layer"))
    last = a.token_norms[-1].reshape(a.stage_grids[-1])
    return plots.named(chart, _name(exp, "token-norms")), _last_stage_view(exp, last, name=_name(exp, "token-norms-last-layer"), label="norm")


def render_outliers(exp: Exploration, *, layer: int) -> tuple[Image.Image, str]:
    """The high-norm tokens after block `layer` (1-based) among its stage's tokens
    (`vitviz.registers.outliers` of that block's norms), over the image with the outliers outlined, and
    what the page says of them. The pooled query's share of attention is read in the next block when
    it is of the same stage; the last block of a stage is followed by a merge (its tokens are read
    four at a time), so its own attention is read there."""
    a = exp.analysis
    if not 1 <= layer <= a.num_layers:
        raise ValueError(f"layer must be within 1..{a.num_layers}, got {layer}")
    index, stage = layer - 1, a.stages[layer - 1]
    same_stage = layer < a.num_layers and a.stages[layer] == stage
    reading = index + 1 if same_stage else index
    o = outliers(a.token_norms[index][None], grid=a.geometries[index].grid, num_prefix_tokens=0, pooled_query=True)
    if o.mask[0].any():  # the shares, window by window (the stage's whole matrix is never gathered)
        mask = o.mask[0].flatten()
        share = a.attention_to(reading, mask).float().cpu()
        o = replace(o, query_share=share.mean()[None], patch_share=(share[~mask].mean() if (~mask).any() else share.new_zeros(()))[None])
    img = outlined_heat(exp, torch.from_numpy(finest(o.norms[0], a.grid, stage)), o.mask[0], cell_px=a.stage_patch_size(index) * exp.scale,
                        name=_name(exp, "high-norm-tokens", f"layer{layer}"), label="token norm")
    if same_stage:
        reader = f"In block {layer + 1}, which reads them,"
    elif layer < a.num_layers:
        reader = f"In block {layer} itself (a patch merge follows it),"
    else:
        reader = "In the last block (no block reads them after it),"
    return img, outliers_caption(o, 0, layer=layer, query="the pooled query (the mean of the tokens' rows)", reader=reader)


def render_dino_heads(exp: Exploration, *, share: float = 0.6) -> Image.Image:
    """DINO's figure for the pooled query: the last block's attention of the mean of the final tokens
    (the mean of their rows) per head on the last stage's grid, each token over the finest patches it
    covers, the tokens holding `share` of each head's mass in colour and the rest dimmed."""
    a = exp.analysis
    stage = a.stages[-1]
    rows = a.global_attention(a.num_layers - 1).mean(dim=1)  # [heads, N_last]
    maps, masks = rows.reshape(-1, *a.stage_grids[-1]), keep_mass(rows, share).reshape(-1, *a.stage_grids[-1])
    counts = [int(m.sum()) for m in masks]
    labels = [f"head {h + 1}: {n} token{'' if n == 1 else 's'}" for h, n in enumerate(counts)]
    on_finest = torch.from_numpy(np.stack([finest(m, a.grid, stage) for m in maps.numpy()]))
    kept = torch.from_numpy(np.stack([finest(m, a.grid, stage) for m in masks.numpy()]))
    return kept_heads_mosaic(exp, on_finest, kept, share=share, labels=labels)


def render_features(exp: Exploration) -> tuple[Image.Image, str]:
    """(the final tokens' first three principal components as RGB on the last stage's grid, each
    token over the finest patches it covers, the variance they explain)."""
    a = exp.analysis
    scores, explained = feature_components(a.tokens, k=3)
    on_finest = finest(scores.reshape(*a.stage_grids[-1], 3).numpy(), a.grid, a.stages[-1]).reshape(-1, 3)
    img = plots.features_image(torch.from_numpy(on_finest), a.grid, size=exp.display_image.size[0])
    text = ", ".join(f"PC{i + 1} {100 * float(e):.1f} %" for i, e in enumerate(explained))
    return plots.named(img, _name(exp, "feature-pca")), f"Red, green, blue: {text} of the final tokens' variance, on {_last_grid_note(a)}."


def render_feature_similarity(exp: Exploration, *, query: int) -> Image.Image:
    """Cosine similarity of the final token over patch `query` (as `patch_at` gives: a finest patch;
    its token on the last stage's grid) to every final token."""
    a = exp.analysis
    if query == swin_explorer.POOL_QUERY:
        raise ValueError("pick a patch, not the pooled query")
    gh, gw = a.stage_grids[-1]
    r, c = divmod(query - 1, a.grid[1])
    cell = (min(gh - 1, r >> a.stages[-1]), min(gw - 1, c >> a.stages[-1]))
    sim = feature_similarity(a.tokens, cell[0] * gw + cell[1]).reshape(gh, gw)
    return _last_stage_view(exp, sim, name=_name(exp, "feature-similarity", f"token{query}"), label="cosine", vmin=-1.0, vmax=1.0,
                            cmap="RdBu_r", cell=cell)


# ---------------------------------------------------------------------------------------------
# The analysis as a download


def write_npz(exp: Exploration, path: str | Path, *, attentions: bool = True) -> Path:
    """An analysis of windowed attention (a Swin's) as an .npz: each layer's window attention `attention_<l>` [windows, heads,
    M², M²] (optional; float32 up to 64 MB, float16 beyond) and relative position bias `bias_<l>`
    [heads, M², M²]; each layer's grid, window, shift and stage; the rollout [N_last, N_0] (mean
    fusion) and the pooled query's map on the finest grid; the distances [L, H_max] (NaN for heads a
    layer lacks); probabilities, the crop."""
    a = exp.analysis
    plan = export_plan(exp.facts.spec)
    per_layer = {f"bias_{l}": b.numpy() for l, b in enumerate(a.biases)}
    if attentions:
        per_layer.update({f"attention_{l}": t.to(weights_dtype(plan["attention_dtype"])).numpy() for l, t in enumerate(a.attentions)})
    if a.probabilities is not None:
        per_layer.update(probabilities=a.probabilities.numpy(), categories=np.array(a.categories))
    table = distance_table(a).numpy().astype(np.float32, copy=False)
    path = Path(path)
    with open(path, "wb") as f:
        np.savez(
            f, **per_layer, rollout=a.rollout().numpy(), cls_map=a.cls_map().numpy(), distances=table, image=np.asarray(a.image),
            patch_size=a.patch_size, grid=np.array(a.grid), grids=np.array([g.grid for g in a.geometries]),
            windows=np.array(a.window_sizes), shifts=np.array(a.shifts), stages=np.array(a.stages), head_fusion="mean", variant=a.variant,
        )
    return path
