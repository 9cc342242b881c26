"""Tensors -> pictures. No model, no Gradio, no pyplot.

Heatmaps over images are plain pixels (numpy + a colormap lookup table), which is faster than a
plot and adds nothing a person needs. Charts (attention distance, position similarity) are
`matplotlib.figure.Figure` objects built directly and rasterised with the Agg canvas, so a server
never keeps figures alive.
"""

from __future__ import annotations

import math
import threading

import matplotlib
import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image, ImageDraw

__all__ = [
    "colorize",
    "overlay",
    "overlay_many",
    "mark_patch",
    "patch_grid",
    "mosaic",
    "distance_figure",
    "DistanceChart",
    "axis_top",
    "position_similarity_image",
    "filters_image",
    "figure_to_image",
]


def colorize(values: np.ndarray, *, cmap: str = "inferno", vmin: float | None = None, vmax: float | None = None) -> np.ndarray:
    """Float array [...] -> uint8 RGB [..., 3]; min-max scaled unless vmin/vmax are given.

    Values are scaled to [0, 1] and quantised to the colormap's 256 entries (matplotlib's own
    lookup, `Colormap(x, bytes=True)`)."""
    lo = float(values.min()) if vmin is None else vmin
    hi = float(values.max()) if vmax is None else vmax
    scaled = (values - lo) / (hi - lo) if hi > lo else np.zeros_like(values, dtype=np.float64)
    idx = np.clip(np.rint(scaled * 255), 0, 255).astype(np.uint8)
    return matplotlib.colormaps[cmap](idx, bytes=True)[..., :3]


def overlay_many(image: Image.Image, heats: torch.Tensor, *, alpha: float = 0.6, cmap: str = "inferno") -> list[Image.Image]:
    """Heatmaps [K, gh, gw] upsampled (bilinear) onto the image, each min-max scaled: K RGB images."""
    w, h = image.size
    up = F.interpolate(heats.float().unsqueeze(1), size=(h, w), mode="bilinear", align_corners=False)[:, 0].numpy()
    base = np.asarray(image.convert("RGB"), dtype=np.float32)
    out = []
    for heat in up:
        colored = colorize(heat, cmap=cmap).astype(np.float32)
        out.append(Image.fromarray(np.clip(base * (1 - alpha) + colored * alpha, 0, 255).astype(np.uint8)))
    return out


def overlay(image: Image.Image, heat: torch.Tensor, *, alpha: float = 0.6, cmap: str = "inferno") -> Image.Image:
    """One heatmap [gh, gw] over the image."""
    return overlay_many(image, heat.unsqueeze(0), alpha=alpha, cmap=cmap)[0]


def mark_patch(image: Image.Image, *, patch: tuple[int, int], patch_size: int, color: str = "#00e5ff") -> Image.Image:
    """A copy of the image with patch (row, col) outlined."""
    out = image.copy()
    r, c = patch
    ImageDraw.Draw(out).rectangle(
        (c * patch_size, r * patch_size, (c + 1) * patch_size - 1, (r + 1) * patch_size - 1), outline=color, width=max(1, patch_size // 8)
    )
    return out


def patch_grid(image: Image.Image, *, patch_size: int, scale: int | None = None) -> Image.Image:
    """The image cut into its patch grid: lines between patches, shown at least 384 px wide."""
    w, h = image.size
    scale = scale or max(1, math.ceil(384 / w))
    big = image.resize((w * scale, h * scale), Image.NEAREST)
    draw = ImageDraw.Draw(big)
    for x in range(0, w + 1, patch_size):
        draw.line([(x * scale, 0), (x * scale, h * scale)], fill=(255, 255, 255), width=1)
    for y in range(0, h + 1, patch_size):
        draw.line([(0, y * scale), (w * scale, y * scale)], fill=(255, 255, 255), width=1)
    return big


def mosaic(images: list[Image.Image], *, cols: int | None = None, gap: int = 4, labels: list[str] | None = None) -> Image.Image:
    """Equal-size images in a grid with gaps, optionally labelled in their top-left corner."""
    n = len(images)
    cols = cols or math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    w, h = images[0].size
    out = Image.new("RGB", (cols * w + (cols - 1) * gap, rows * h + (rows - 1) * gap), (255, 255, 255))
    draw = ImageDraw.Draw(out)
    for i, img in enumerate(images):
        x, y = (i % cols) * (w + gap), (i // cols) * (h + gap)
        out.paste(img, (x, y))
        if labels:
            draw.rectangle((x, y, x + 8 * len(labels[i]) + 6, y + 14), fill=(0, 0, 0))
            draw.text((x + 3, y + 2), labels[i], fill=(255, 255, 255))
    return out


def figure_to_image(fig: Figure) -> Image.Image:
    """Rasterise a Figure with the Agg canvas (no pyplot, nothing kept alive)."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return Image.fromarray(np.asarray(canvas.buffer_rgba())[..., :3].copy())


def axis_top(value: float) -> float:
    """A y-axis top for data reaching `value`: 10 % headroom, rounded up to 1, 1.5, 2, 2.5, 3, 4, 5, 6 or 8 x 10^k."""
    want = max(1.1 * float(value), 1e-6)
    base = 10.0 ** math.floor(math.log10(want))
    for step in (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0):
        if step * base >= want * (1 - 1e-9):
            return step * base
    return 10.0 * base  # pragma: no cover - the loop always returns


def _as_series(distances: torch.Tensor | dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{name: float CPU [L, H]}; a lone tensor is one unnamed series."""
    return {k: v.detach().cpu().float() for k, v in (distances if isinstance(distances, dict) else {"": distances}).items()}


def _distance_offsets(d: torch.Tensor, k: int, count: int) -> np.ndarray:
    """Scatter positions [L * H, 2] of series `k` of `count`: x = layer (nudged apart per series), y = distance."""
    depth, heads = d.shape
    x = np.repeat(np.arange(1, depth + 1, dtype=np.float64), heads) + (k - (count - 1) / 2) * 0.18
    return np.column_stack([x, d.reshape(-1).numpy().astype(np.float64)])


def distance_figure(
    distances: torch.Tensor | dict[str, torch.Tensor],
    *,
    uniform: float | None = None,
    title: str = "Mean attention distance",
    ax=None,
    _animated: bool = False,
) -> Figure:
    """The paper's Figure 7 (right): one dot per head at each depth, distance in pixels.

    Args:
        distances: [L, H] for one model, or {name: [L, H]} for several in one chart.
        uniform: the uniform-attention reference (dashed line), in pixels.
    """
    if ax is None:  # a fixed layout: a third cheaper to draw than layout="constrained"
        fig = Figure(figsize=(5.2, 3.6), dpi=100)
        fig.subplots_adjust(left=0.12, right=0.97, top=0.92, bottom=0.14)
        ax = fig.add_subplot()
    fig = ax.figure
    series = _as_series(distances)
    markers = "os^D"
    for k, (name, d) in enumerate(series.items()):
        xy = _distance_offsets(d, k, len(series))
        # dots above the grid, the reference line and the legend, so that DistanceChart's
        # blitted dots (drawn last) give exactly these pixels
        ax.scatter(xy[:, 0], xy[:, 1], s=14, alpha=0.75, marker=markers[k % 4], label=name or None, zorder=6, animated=_animated)
    if uniform is not None:
        ax.axhline(uniform, color="0.4", ls="--", lw=1, label=f"uniform attention ({uniform:.0f} px)")
    ax.set_xlabel("Network depth (layer)")
    ax.set_ylabel("Mean attention distance (pixels)")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(0, axis_top(max(max(float(d.max()) for d in series.values()), uniform or 0.0)))
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
    return fig


class DistanceChart:
    """`distance_figure` with a fixed title and reference line, redrawn for new distances in a few milliseconds.

    Axes, ticks, labels, legend and reference line depend only on the axis top (`axis_top`, a
    handful of values per model) and on the series' names and shapes; they are drawn once per
    such key and kept as pixels, and each call restores them and draws only the dots. The result
    equals `figure_to_image(distance_figure(distances, uniform=..., title=...))` pixel for pixel.
    Thread-safe; memory: about 0.75 MB per key kept (at most `max_keys`).
    """

    def __init__(self, *, uniform: float | None, title: str, max_keys: int = 8) -> None:
        self.uniform = uniform
        self.title = title
        self.max_keys = max_keys
        self._backgrounds: dict[tuple, tuple] = {}
        self._lock = threading.Lock()

    def render(self, distances: torch.Tensor | dict[str, torch.Tensor]) -> Image.Image:
        """distances: [L, H], or {name: [L, H]} for several series (as `distance_figure`)."""
        series = _as_series(distances)
        top = axis_top(max(max(float(d.max()) for d in series.values()), self.uniform or 0.0))
        key = (top, tuple((name, tuple(d.shape)) for name, d in series.items()))
        with self._lock:
            entry = self._backgrounds.pop(key, None)
            if entry is None:
                fig = distance_figure(distances, uniform=self.uniform, title=self.title, _animated=True)
                canvas = FigureCanvasAgg(fig)
                canvas.draw()  # everything but the (animated) dots
                entry = (canvas, list(fig.axes[0].collections), canvas.copy_from_bbox(fig.bbox))
                if len(self._backgrounds) >= self.max_keys:
                    self._backgrounds.pop(next(iter(self._backgrounds)))  # the least recently used
            self._backgrounds[key] = entry
            canvas, dots, background = entry
            canvas.restore_region(background)
            for k, (artist, d) in enumerate(zip(dots, series.values())):
                artist.set_offsets(_distance_offsets(d, k, len(series)))
                artist.axes.draw_artist(artist)
            return Image.fromarray(np.asarray(canvas.buffer_rgba())[..., :3].copy())


def position_similarity_image(similarity: torch.Tensor, *, tile_px: int | None = None, cmap: str = "viridis") -> Image.Image:
    """The paper's Figure 7 (centre) as pixels: tile (a, b) shows S[a, b] as a gh x gw image.

    Args:
        similarity: [gh, gw, gh, gw] cosine similarities, drawn on the fixed range [-1, 1].
    """
    gh, gw = similarity.shape[:2]
    tile_px = tile_px or max(2, 560 // (gw * gw))
    gap = 1
    colored = colorize(similarity.detach().cpu().float().numpy(), cmap=cmap, vmin=-1.0, vmax=1.0)  # [gh, gw, gh, gw, 3]
    tile = np.repeat(np.repeat(colored, tile_px, axis=2), tile_px, axis=3)  # [gh, gw, gh*t, gw*t, 3]
    th, tw = tile.shape[2], tile.shape[3]
    out = np.full((gh * (th + gap) - gap, gw * (tw + gap) - gap, 3), 255, dtype=np.uint8)
    for a in range(gh):
        for b in range(gw):
            out[a * (th + gap) : a * (th + gap) + th, b * (tw + gap) : b * (tw + gap) + tw] = tile[a, b]
    return Image.fromarray(out)


def filters_image(components: torch.Tensor, *, cols: int = 7, scale: int | None = None) -> Image.Image:
    """The paper's Figure 7 (left): principal components [k, 3, P, P] as RGB tiles, each min-max scaled."""
    k, _, p, _ = components.shape
    scale = scale or max(1, 64 // p)
    tiles = []
    for comp in components.detach().cpu().float():
        c = comp.permute(1, 2, 0).numpy()
        c = (c - c.min()) / (c.max() - c.min() + 1e-12)
        img = Image.fromarray((c * 255).astype(np.uint8)).resize((p * scale, p * scale), Image.NEAREST)
        tiles.append(img)
    return mosaic(tiles, cols=cols, gap=3)
