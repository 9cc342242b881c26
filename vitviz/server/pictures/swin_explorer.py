"""The windowed explorer's data (a Swin analysis, `vitviz.swin_analysis.SwinAnalysis`), as the browser holds
it, and the one rule both sides draw it by.

At layer l (stage s, its grid gh_s x gw_s of N_s tokens), a query token attends only inside its
window, less what the shifted layer's mask separates (`WindowGeometry.visible_from`): its row is
kept over the M² places of its window, every place outside that support set to 0 (padding and
masked places), for each view (the layer's heads, then their mean and max). The pooled query (the
classifier's: the mean of the tokens' rows) is a row over the whole grid. Each row is kept as 8 bits
relative to its own maximum, as the global explorer's are (`explorer_data.quantise_rows`).

A view is drawn on the finest grid: cell (r, c) of the finest grid shows the value of the stage's
token (r >> s, c >> s); the heat is coloured and blended by the rule of `vitviz.plots.overlay`; then
the query's window (its visible tokens) is outlined in cyan and the query token in white, by
`vitviz.plots.outline_cells`, each outline max(1, floor(P' / 8)) px wide (P' the finest patch in
display pixels). The server's pictures (`vitviz.server.pictures.swin_views`) and the browser's
(`swin_explorer.js`) do exactly this, so both give the same pixels.

What the browser gets, per analysis, in one binary file (little-endian), layer after layer:

    int32   window_tokens[W, M²]   the token (raster index on the stage's grid) at each place of each window, -1 for padding
    int32   token_window[N]        each token's window
    int32   token_region[N]        each token's region of the shifted layer's mask (0 when not shifted)
    float32 row_max[V, N]          each query's row maximum, per view (V = heads + 2)
    uint8   rows[V, N, M²]         each query's row over its window's places
    float32 pool_max[V]            the pooled query's row maxima
    uint8   pool[V, N]             the pooled query's row over the grid

(`vitviz.cost.explorer_bytes` is its size.) All layers in one file when it fits the browser's budget;
otherwise the server draws the views.
"""

from __future__ import annotations

import io
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from vitviz import cost
from vitviz.cost import explorer_bytes
from vitviz.plots import CMAP, lut
from vitviz.server.pictures.explorer_data import dequantise, quantise_rows
from vitviz.swin_analysis import SwinAnalysis

__all__ = ["POOL_QUERY", "view_rows", "window_rows", "pool_rows", "row_values", "visible", "query_cell", "outline_width",
           "layer_block", "stack_file", "write_payload", "widget_files"]

POOL_QUERY = 0  # query index 0 is the pooled query; 1 + r * gw0 + c the finest grid's patch (r, c)


def view_rows(rows: torch.Tensor) -> torch.Tensor:
    """Rows of every head [H, ...] -> every view: the heads, then their mean and max [H + 2, ...] float32."""
    rows = rows.float()
    return torch.cat([rows, rows.mean(dim=0, keepdim=True), rows.amax(dim=0, keepdim=True)])


def window_rows(a: SwinAnalysis, layer: int) -> torch.Tensor:
    """Each token's row over its window's places, every view, places outside its support 0:
    [V, N_s, M²] (layer 0-based, tokens in raster order of the stage's grid)."""
    g, attn = a.geometries[layer], a.attentions[layer]  # attn [W, H, M², M²]
    kept = attn * g.support(attn.device).to(attn.dtype)[:, None]
    window, place = g.placement(attn.device)
    return view_rows(kept[window, :, place, :].permute(1, 0, 2))  # [N, H, M²] -> [H, N, M²] -> [V, N, M²]


def pool_rows(a: SwinAnalysis, layer: int) -> torch.Tensor:
    """The pooled query's row over the stage's grid, every view: [V, N_s]; the mean over the real
    queries of the layer's global attention rows (without the N x N matrix)."""
    g, attn = a.geometries[layer], a.attentions[layer]
    tokens = g.window_tokens(attn.device)  # [W, M²]
    kept = attn * g.support(attn.device).to(attn.dtype)[:, None]
    columns = kept.sum(dim=2)  # [W, H, M²]: what the window's queries give each key place (padding queries give nothing: no support)
    real = tokens >= 0
    out = attn.new_zeros(attn.shape[1], g.num_tokens)
    out.index_add_(1, tokens[real], columns.permute(1, 0, 2)[:, real])
    return view_rows(out / g.num_tokens)


def query_cell(a: SwinAnalysis, layer: int, query: int) -> tuple[int, int] | None:
    """The stage grid's cell (row, column) of query index `query` at layer `layer` (0-based): the
    stage's token over the finest patch; None for the pooled query."""
    if query == POOL_QUERY:
        return None
    r, c = divmod(query - 1, a.grid[1])
    s = a.stages[layer]
    return r >> s, c >> s


def row_values(a: SwinAnalysis, *, layer: int, view: int, query: int) -> np.ndarray:
    """The values a view of layer `layer` (0-based), view `view` (0..H-1 a head, H their mean, H + 1
    their max) and query `query` (`POOL_QUERY` or 1 + a finest patch) shows over the stage's grid:
    float64 [N_s], exactly as the browser reads them (zero outside the query's window)."""
    g = a.geometries[layer]
    cell = query_cell(a, layer, query)
    if cell is None:
        q, top = quantise_rows(pool_rows(a, layer)[view])
        return dequantise(q, np.asarray(top))
    token = cell[0] * g.grid[1] + cell[1]
    window, place = g.placement()
    row = window_rows(a, layer)[view, token]  # [M²]
    q, top = quantise_rows(row)
    values = dequantise(q, np.asarray(top))
    out = np.zeros(g.num_tokens)
    tokens = g.window_tokens()[int(window[token])].numpy()
    out[tokens[tokens >= 0]] = values[tokens >= 0]
    return out


def visible(a: SwinAnalysis, layer: int, query: int) -> np.ndarray | None:
    """bool [gh_s, gw_s]: the cells the query token sees at that layer (its window, less what the
    mask separates); None for the pooled query."""
    cell = query_cell(a, layer, query)
    return None if cell is None else a.window_of(layer, *cell).numpy()


def outline_width(finest_px: int) -> int:
    """The outlines' width for a finest patch of `finest_px` display pixels."""
    return max(1, finest_px // 8)


def layer_block(a: SwinAnalysis, layer: int) -> bytes:
    """One layer as the browser reads it (the module's layout)."""
    g = a.geometries[layer]
    window, _ = g.placement()
    parts = [g.window_tokens().numpy().astype("<i4"), window.numpy().astype("<i4"), g.token_regions().numpy().astype("<i4")]
    q, top = quantise_rows(window_rows(a, layer))
    pq, ptop = quantise_rows(pool_rows(a, layer))
    return b"".join(p.tobytes() for p in parts) + top.astype("<f4").tobytes() + q.tobytes() + ptop.astype("<f4").tobytes() + pq.tobytes()


def stack_file(a: SwinAnalysis) -> bytes:
    buf = io.BytesIO()
    for layer in range(a.num_layers):
        buf.write(layer_block(a, layer))
    return buf.getvalue()


def _layers_meta(a: SwinAnalysis) -> list[dict]:
    out, offset = [], 0
    for l, g in enumerate(a.geometries):
        heads, n, area = a.heads(l), g.num_tokens, g.area
        out.append(dict(stage=a.stages[l], grid=list(g.grid), window=list(g.window), shift=list(g.shift), heads=heads,
                        windows=g.num_windows, area=area, offset=offset))
        offset += g.num_windows * area * 4 + 8 * n + (heads + 2) * (n * (4 + area) + 4 + n)
    return out


def write_payload(exp, *, key: str, folder, spec, budget: int | None = None) -> dict:
    """Writes what the browser needs for `exp` (an `Exploration` of a Swin) into `folder`, under names
    made from `key` (the session's secret), and returns the widget's value: "stack" (the file, the
    layers' layout, the picture under the maps, the colour map) or "server" (too large for `budget`
    bytes, None: `vitviz.cost.BROWSER_BYTES`: a note)."""
    budget = cost.BROWSER_BYTES if budget is None else budget
    a = exp.analysis
    size = explorer_bytes(spec)
    finest_px = a.patch_size * exp.scale
    value = dict(id=key, grid=list(a.grid), depth=a.num_layers, patch_size=a.patch_size, patch_px=finest_px, outline=outline_width(finest_px),
                 layers=_layers_meta(a), lut=lut(CMAP).reshape(-1).tolist())
    if size > budget:
        value.update(mode="server", note=f"{a.variant}'s windowed attention is too large to hold in the browser ({size / 2**20:.0f} MB); "
                                         "the views below are drawn by the server.")
        return value
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    base = folder / f"{key}-swin-base.png"
    if not base.exists():
        exp.display_image.save(base, format="PNG", compress_level=1)
    data = folder / f"{key}-swin.bin"
    if not data.exists():  # one analysis, one key: written once
        data.write_bytes(stack_file(a))
    value.update(mode="stack", base=str(base), data=str(data))
    return value


# what the page says under the widget
CAPTION = (
    "A Swin attends inside windows: at each layer a token's row is nonzero only over its window (cyan), on that "
    "layer's stage grid (each merge halves the grid: a token there covers 2x2 of the stage before). Every second "
    "layer shifts the windows by half a window; a window that wraps round the border is cut by the mask into "
    "regions, and a token attends within its own. **pool** is the classifier's query: the mean of the tokens' rows."
)


def widget_files() -> dict[str, str]:
    """The browser side: {"js": ..., "html": ..., "css": ...} (swin_explorer.js after explorer_common.js,
    which the global explorer loads too; swin_explorer.html, .css of this package)."""
    folder = resources.files("vitviz.server")
    files = {kind: (folder / f"swin_explorer.{kind}").read_text() for kind in ("js", "html", "css")}
    files["js"] = (folder / "explorer_common.js").read_text() + "\n" + files["js"]
    return files
