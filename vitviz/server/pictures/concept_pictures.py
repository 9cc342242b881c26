"""The Concepts tab's pictures: the analysed crop with its patch grid and the chosen patch outlined,
a sparse autoencoder's feature over the image (the house's overlay, with its colour bar), and the
strongest examples of some features, a row each (the atlas' rows, `Concepts.atlas_row`), with the
layout that turns a click on them into a row.
"""

from __future__ import annotations

import math

from PIL import Image, ImageDraw, ImageFont

from vitviz import plots
from vitviz.concepts.browse import Concepts
from vitviz.server.pictures import views

__all__ = ["shown", "feature_image", "ExampleRows", "examples_image"]


def shown(exp: views.Exploration, cell: tuple[int, int]) -> Image.Image:
    """The crop as the views show it (`Exploration.scale` times: `drawers.patch_at` reads a click on it),
    its patch grid drawn and patch `cell` (row, col) outlined."""
    a = exp.analysis
    out = plots.patch_grid(a.image.convert("RGB"), patch_size=a.patch_size, scale=exp.scale)
    return plots.mark_patch(out, patch=cell, patch_size=a.patch_size * exp.scale)


def feature_image(exp: views.Exploration, heat, *, feature: int, cell: tuple[int, int], name: str) -> Image.Image:
    """Feature `feature`'s activation [gh, gw] over the image, patch `cell` outlined, with its colour bar."""
    a = exp.analysis
    return views._heat_view(exp, heat, name=views._name(exp, "concept", name, f"feature{feature}"), label=f"feature {feature}",
                            mark=a.patch_query(*cell))


class ExampleRows:
    """The layout of `examples_image`: a row per feature, its label in a left margin, then its
    examples as square tiles."""

    LEFT, GAP, FONT = 92, 4, 12

    def __init__(self, rows: int, columns: int, thumb: int) -> None:
        self.rows, self.columns = rows, columns
        self.tile = max(thumb, 48)  # small thumbnails drawn larger, nearest-neighbour
        self.tile = self.tile * max(1, math.ceil(48 / self.tile))

    @property
    def size(self) -> tuple[int, int]:
        return self.LEFT + self.columns * (self.tile + self.GAP), self.rows * (self.tile + self.GAP) - self.GAP

    def row_at(self, x: float, y: float) -> int | None:
        """The row under pixel (x, y), or None outside the rows (or in a gap)."""
        if not (math.isfinite(x) and math.isfinite(y)) or not 0 <= x < self.size[0]:
            return None
        r, at = divmod(y, self.tile + self.GAP)
        return int(r) if 0 <= r < self.rows and at < self.tile else None


def examples_image(concepts: Concepts, features: list[int], *, labels: list[str] | None = None) -> Image.Image:
    """The strongest examples of each of `features` (the atlas' rows), a row each, labelled ("#f" by default)."""
    layout = ExampleRows(len(features), concepts.top_n, concepts.thumb)
    t = layout.tile
    out = Image.new("RGB", layout.size, (255, 255, 255))
    draw = ImageDraw.Draw(out)
    font = ImageFont.load_default(size=layout.FONT)
    texts = []
    for i, f in enumerate(features):
        y = i * (t + layout.GAP)
        row = concepts.atlas_row(f).resize((concepts.top_n * t, t), Image.NEAREST)
        for j, image in enumerate(concepts.index["top_images"][f].tolist()):
            if image >= 0:  # (a feature that fired on fewer tokens has fewer examples)
                out.paste(row.crop((j * t, 0, (j + 1) * t, t)), (layout.LEFT + j * (t + layout.GAP), y))
        label = labels[i] if labels is not None else f"#{f}"
        draw.text((4, y + t // 2), label, fill=(30, 30, 30), font=font, anchor="lm")
        texts.append((label, tuple(float(v) for v in draw.textbbox((4, y + t // 2), label, font=font, anchor="lm"))))
    out.info["vitviz_text"] = texts
    return out
