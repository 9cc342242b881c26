"""The Patch tab's pictures: the corrupted copy of a crop (one patch covered, or two patches swapped),
a crop shown with its patch grid and the chosen patches outlined, and the maps of restored logit
difference by (layer, token) and by (layer, head), with the layouts that turn a click into a cell.

Activation patching as TransformerLens's `patching` utilities define it (`vitviz.patching`): a score
per site, (LD_patched − LD_corrupted) / (LD_clean − LD_corrupted); it can be negative or above 1, so
the maps use a diverging colour map centred on 0, the same range both ways.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from vitviz import plots

__all__ = ["covered", "swapped", "shown", "patch_at", "TokenGrid", "token_map_image", "CMAP", "MARKS"]

CMAP = "RdBu_r"  # diverging: blue below 0, white at 0, red above (as the Inside tab's heads map)
MARKS = ("#00e5ff", "#ff4fd8")  # the first chosen patch, the second (a swap)


def _box(cell: tuple[int, int], patch_size: int) -> tuple[int, int, int, int]:
    r, c = cell
    return c * patch_size, r * patch_size, (c + 1) * patch_size, (r + 1) * patch_size


def _check_cell(crop: Image.Image, cell: tuple[int, int], patch_size: int) -> None:
    gh, gw = crop.height // patch_size, crop.width // patch_size
    if not (0 <= cell[0] < gh and 0 <= cell[1] < gw):
        raise ValueError(f"patch {cell} is outside the {gh}x{gw} grid of a {crop.width}x{crop.height} crop")


def covered(crop: Image.Image, cell: tuple[int, int], *, patch_size: int, colour: tuple[int, int, int]) -> Image.Image:
    """A copy of `crop` with patch (row, col) filled with `colour` (RGB 0..255)."""
    _check_cell(crop, cell, patch_size)
    out = crop.convert("RGB")  # (a copy)
    out.paste(colour, _box(cell, patch_size))
    return out


def swapped(crop: Image.Image, a: tuple[int, int], b: tuple[int, int], *, patch_size: int) -> Image.Image:
    """A copy of `crop` with the pixels of patches `a` and `b` (row, col) exchanged."""
    _check_cell(crop, a, patch_size)
    _check_cell(crop, b, patch_size)
    out = crop.convert("RGB")
    first, second = out.crop(_box(a, patch_size)), out.crop(_box(b, patch_size))
    out.paste(second, _box(a, patch_size)[:2])
    out.paste(first, _box(b, patch_size)[:2])
    return out


def shown(crop: Image.Image, *, patch_size: int, scale: int, cells: tuple[tuple[int, int], ...] = ()) -> Image.Image:
    """`crop` as the page shows it: `scale` times, its patch grid drawn, each of `cells` outlined in
    its colour of `MARKS`."""
    out = plots.patch_grid(crop.convert("RGB"), patch_size=patch_size, scale=scale)
    for cell, colour in zip(cells, MARKS):
        out = plots.mark_patch(out, patch=cell, patch_size=patch_size * scale, color=colour)
    return out


def patch_at(x: float, y: float, *, patch_size: int, scale: int, grid: tuple[int, int]) -> tuple[int, int] | None:
    """The patch (row, col) under pixel (x, y) of `shown`'s picture, or None outside it."""
    if not (math.isfinite(x) and math.isfinite(y)):
        return None
    side = patch_size * scale
    r, c = math.floor(y / side), math.floor(x / side)
    return (r, c) if 0 <= r < grid[0] and 0 <= c < grid[1] else None


class TokenGrid:
    """The layout of a layers x tokens picture (`token_map_image`): a row per layer, a column per
    token, the prefix tokens first (wide enough for their names), a gap, then the patches row by row;
    layer labels in a left margin, token labels in a top margin."""

    LEFT, TOP, RIGHT, GAP = 44, 22, 18, 3
    FONT = 10

    def __init__(self, layers: int, tokens: int, prefix_names: tuple[str, ...], grid: tuple[int, int]) -> None:
        if tokens != len(prefix_names) + grid[0] * grid[1]:
            raise ValueError(f"{tokens} tokens are not {len(prefix_names)} prefix tokens and a {grid[0]}x{grid[1]} grid")
        self.layers, self.tokens, self.prefix_names, self.grid = layers, tokens, tuple(prefix_names), tuple(grid)
        patches = grid[0] * grid[1]
        self.row = max(14, min(36, 432 // max(layers, 1)))  # a layer's height
        self.col = max(1, min(36, 720 // max(patches, 1)))  # a patch's width
        font = ImageFont.load_default(size=self.FONT)
        widest = max((font.getlength(n) for n in self.prefix_names), default=0)
        self.prefix = max(self.col, math.ceil(widest) + 6)  # a prefix token's width

    @property
    def patches_left(self) -> int:
        """Where the patches' columns start."""
        p = len(self.prefix_names)
        return self.LEFT + p * self.prefix + (self.GAP if p else 0)

    @property
    def size(self) -> tuple[int, int]:
        w = self.patches_left + self.grid[0] * self.grid[1] * self.col + self.RIGHT
        return w, self.TOP + self.layers * self.row + 1

    def column(self, token: int) -> tuple[int, int]:
        """The token's column: (left, right) in pixels."""
        p = len(self.prefix_names)
        if token < p:
            return self.LEFT + token * self.prefix, self.LEFT + (token + 1) * self.prefix
        left = self.patches_left + (token - p) * self.col
        return left, left + self.col

    def cell_at(self, x: float, y: float) -> tuple[int, int] | None:
        """The (layer, token) under pixel (x, y) of the picture, or None outside the cells."""
        if not (math.isfinite(x) and math.isfinite(y)):
            return None
        layer = math.floor((y - self.TOP) / self.row)
        if not 0 <= layer < self.layers:
            return None
        p = len(self.prefix_names)
        if self.LEFT <= x < self.LEFT + p * self.prefix:
            return layer, int((x - self.LEFT) // self.prefix)
        k = math.floor((x - self.patches_left) / self.col)
        return (layer, p + k) if 0 <= k < self.tokens - p else None


def token_map_image(values: torch.Tensor, *, prefix_names: tuple[str, ...], grid: tuple[int, int],
                    label: str = "") -> tuple[Image.Image, TokenGrid]:
    """A score per (layer, token) [L, N] as coloured cells (`CMAP`, centred on 0, the same range both
    ways), layers down ("L1" is the stream entering block 1), tokens across: the prefix tokens by name,
    then the patches row by row ("r1" where the first row of patches starts); with a colour bar. Returns
    the picture and its layout (for clicks)."""
    if values.ndim != 2:
        raise ValueError(f"expected scores [L, N], got {tuple(values.shape)}")
    v = values.detach().cpu().double().numpy()
    layers, tokens = v.shape
    layout = TokenGrid(layers, tokens, prefix_names, grid)
    finite = v[np.isfinite(v)]
    top = float(np.abs(finite).max()) if finite.size else 0.0
    top = top or 1.0
    colours = plots.colorize(np.nan_to_num(v, nan=0.0, posinf=top, neginf=-top), cmap=CMAP, vmin=-top, vmax=top)  # [L, N, 3]
    img = Image.new("RGB", layout.size, "white")
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=TokenGrid.FONT)
    texts = []

    def text(xy, s: str, anchor: str) -> None:
        draw.text(xy, s, fill=(30, 30, 30), font=font, anchor=anchor)
        texts.append((s, tuple(float(b) for b in draw.textbbox(xy, s, font=font, anchor=anchor))))

    outline = (255, 255, 255) if layout.col >= 6 else None
    for layer in range(layers):
        y = layout.TOP + layer * layout.row
        if layers <= 16 or layer % 2 == 0:
            text((layout.LEFT - 4, y + layout.row / 2), f"L{layer + 1}", "rm")
        for n in range(tokens):
            x0, x1 = layout.column(n)
            fill = tuple(int(u) for u in colours[layer, n])
            draw.rectangle([x0, y, x1 - 1 if outline is None else x1, y + layout.row], fill=fill, outline=outline or fill)
    for n, name in enumerate(layout.prefix_names):
        x0, x1 = layout.column(n)
        text(((x0 + x1) / 2, layout.TOP - 4), name, "ms")
    gh, gw = grid
    step = max(1, math.ceil(26 / max(gw * layout.col, 1)))  # rows of patches between two labels
    for r in range(0, gh, step):
        x = layout.patches_left + r * gw * layout.col
        draw.line([x, layout.TOP - 3, x, layout.TOP - 1], fill=(90, 90, 90))
        text((x, layout.TOP - 4), f"r{r + 1}", "ls")
    img.info["vitviz_text"] = texts
    return plots.with_colorbar(img, vmin=-top, vmax=top, label=label, cmap=CMAP), layout
