"""Grids drawn as pixels: regions of a token grid outlined (windows, masked regions), relative
position bias tables per head, and the heads x layers map of the Inside tab (`HeadGrid`)."""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image, ImageDraw

from vitviz.plots.images import _draw_text, _font, colorize, mosaic, with_colorbar


def outline_cells(pixels: np.ndarray, ids: np.ndarray, *, cell_px: int, width: int, color: tuple[int, int, int],
                  where: np.ndarray | None = None) -> np.ndarray:
    """Outlines regions of a grid drawn over a picture: uint8 [gh x cell_px, gw x cell_px, 3] -> a copy.

    A pixel of cell (r, c) takes `color` when the cell is in `where` (default: every cell) and the
    pixel lies within `width` px of a side of the cell whose neighbour has another id (or is off the
    grid). The one rule the server and the browser's windowed explorer (`vitviz/server/
    swin_explorer.js`) both draw by.

    Args:
        ids: [gh, gw] region ids; where: bool [gh, gw].
    """
    ids = np.asarray(ids)
    gh, gw = ids.shape
    if pixels.shape[0] != gh * cell_px or pixels.shape[1] != gw * cell_px:
        raise ValueError(f"a {pixels.shape[1]}x{pixels.shape[0]} picture is not {gh}x{gw} cells of {cell_px} px")
    pad = np.pad(ids.astype(np.int64), 1, constant_values=np.iinfo(np.int64).min)  # off the grid: another id
    sides = [pad[1:-1, 1:-1] != pad[1:-1, :-2], pad[1:-1, 1:-1] != pad[1:-1, 2:], pad[1:-1, 1:-1] != pad[:-2, 1:-1],
             pad[1:-1, 1:-1] != pad[2:, 1:-1]]  # left, right, top, bottom: [gh, gw] each
    inside = np.arange(cell_px)
    near = [inside < width, cell_px - 1 - inside < width]  # [cell_px]: near the first side, near the second
    left, right, top, bottom = (s.repeat(cell_px, 0).repeat(cell_px, 1) for s in sides)
    col_first, col_last = np.tile(near[0], gw)[None, :], np.tile(near[1], gw)[None, :]
    row_first, row_last = np.tile(near[0], gh)[:, None], np.tile(near[1], gh)[:, None]
    edge = (left & col_first) | (right & col_last) | (top & row_first) | (bottom & row_last)
    if where is not None:
        edge &= np.asarray(where, dtype=bool).repeat(cell_px, 0).repeat(cell_px, 1)
    out = pixels.copy()
    out[edge] = color
    return out


def bias_tables_image(tables: torch.Tensor, *, tile: int = 128, cmap: str = "RdBu_r", label: str = "bias",
                      symmetric: bool = True, titles: list[str] | None = None) -> Image.Image:
    """Tables over offsets (a relative position bias, a rotary product, attention by offset), one
    tile per head, on one colour scale with its bar: symmetric about 0, or from 0 to the largest.

    Args:
        tables: [H, 2wh - 1, 2ww - 1]: entry (r, c) is the value for the key (r - wh + 1, c - ww + 1)
            cells away from the query (the centre is the query itself, outlined).
        titles: each tile's label (default "head h").
    """
    t = tables.detach().cpu().double().numpy()
    heads, th, tw = t.shape
    bound = float(np.abs(t).max()) or 1.0
    low = -bound if symmetric else 0.0
    cell = max(1, tile // max(th, tw))
    tiles = []
    for h in range(heads):
        rgb = colorize(t[h], cmap=cmap, vmin=low, vmax=bound).repeat(cell, 0).repeat(cell, 1)
        centre = np.zeros((th, tw), dtype=np.int64)
        centre[th // 2, tw // 2] = 1
        rgb = outline_cells(rgb, centre, cell_px=cell, width=max(1, cell // 6), color=(30, 30, 30), where=centre.astype(bool))
        tiles.append(Image.fromarray(rgb))
    img = mosaic(tiles, cols=math.ceil(math.sqrt(heads)), labels=titles or [f"head {h + 1}" for h in range(heads)])
    return with_colorbar(img, vmin=low, vmax=bound, label=label, cmap=cmap)


class HeadGrid:
    """The layout of a heads x layers picture (`head_grid_image`): a cell per (layer, head), layers
    down, heads across, after a left margin of layer labels and a top margin of head labels."""

    LEFT, TOP = 44, 22

    def __init__(self, layers: int, heads: int, *, cell: int | None = None) -> None:
        self.layers, self.heads = layers, heads
        self.cell = cell or max(14, min(36, 432 // max(heads, 1), 432 // max(layers, 1)))

    @property
    def size(self) -> tuple[int, int]:
        return self.LEFT + self.heads * self.cell + 1, self.TOP + self.layers * self.cell + 1

    def cell_at(self, x: float, y: float) -> tuple[int, int] | None:
        """The (layer, head) under pixel (x, y) of the picture, or None outside the cells."""
        col, row = math.floor((x - self.LEFT) / self.cell), math.floor((y - self.TOP) / self.cell)
        return (row, col) if 0 <= row < self.layers and 0 <= col < self.heads else None


def head_grid_image(values: torch.Tensor, *, off: set[tuple[int, int]] = frozenset(), label: str = "",
                    cmap: str = "RdBu_r", first_layer: int = 0) -> tuple[Image.Image, HeadGrid]:
    """A value per (layer, head) [L, H] as coloured cells (a diverging map centred on 0, the same
    range both ways), the cells in `off` crossed out, with a colour bar; and its layout (for clicks).
    Rows are labelled from layer `first_layer` + 1 (the model's blocks, 1-based)."""
    v = values.detach().cpu().double().numpy()
    layers, heads = v.shape
    grid = HeadGrid(layers, heads)
    top = float(np.abs(v).max()) or 1.0
    colours = colorize(v, cmap=cmap, vmin=-top, vmax=top)  # [L, H, 3]
    img = Image.new("RGB", grid.size, "white")
    draw = ImageDraw.Draw(img)
    font, c = _font(10), grid.cell
    for h in range(heads):
        if heads <= 16 or h % 2 == 0:
            _draw_text(draw, (grid.LEFT + h * c + c / 2, grid.TOP - 4), f"H{h + 1}", font=font, anchor="ms")
    for layer in range(layers):
        y = grid.TOP + layer * c
        _draw_text(draw, (grid.LEFT - 4, y + c / 2), f"L{first_layer + layer + 1}", font=font, anchor="rm")
        for h in range(heads):
            x = grid.LEFT + h * c
            draw.rectangle([x, y, x + c, y + c], fill=tuple(int(u) for u in colours[layer, h]), outline=(255, 255, 255))
            if (layer, h) in off:
                draw.line([x + 2, y + 2, x + c - 2, y + c - 2], fill=(20, 20, 20), width=2)
                draw.line([x + 2, y + c - 2, x + c - 2, y + 2], fill=(20, 20, 20), width=2)
    return with_colorbar(img, vmin=-top, vmax=top, label=label, cmap=cmap), grid
