"""Tensors -> pictures. No model, no Gradio, no pyplot.

Heatmaps over images are plain pixels (numpy + a colormap lookup table), which is faster than a
plot and adds nothing a person needs. Charts (attention distance, position similarity) are
`matplotlib.figure.Figure` objects built directly and rasterised with the Agg canvas, so a server
never keeps figures alive.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import matplotlib
import matplotlib.text
import matplotlib.ticker
import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image, ImageDraw, ImageFont

__all__ = [
    "CMAP",
    "heat_indices",
    "lut",
    "colorize",
    "overlay",
    "overlay_many",
    "with_colorbar",
    "named",
    "mark_patch",
    "patch_grid",
    "mosaic",
    "distance_figure",
    "DistanceChart",
    "axis_top",
    "position_similarity_figure",
    "filters_image",
    "features_image",
    "figure_to_image",
    "text_boxes",
    "clipped_text",
    "received_figure",
    "norms_figure",
    "faithfulness_figure",
    "curves_figure",
    "outline_cells",
    "layer_distance_figure",
    "bias_tables_image",
    "lens_figure",
    "HeadGrid",
    "head_grid_image",
]

CMAP = "inferno"
COLORBAR_PX = 76  # the width a colour bar adds to the right of a map
ALPHA_NUM, ALPHA_DEN = 3, 5  # a heat colour covers 3/5 of the image under it


def _font(size: int = 12):
    return ImageFont.load_default(size=size)


def heat_indices(values: np.ndarray, vmin: float, vmax: float) -> np.ndarray:
    """Values -> colormap indices 0..255 (uint8): floor((v - vmin) / (vmax - vmin) x 255 + 1/2), in float64.

    The one rule every heat map follows, here and in the browser's own drawing (`vitviz/server/
    explorer.js`), so that both give the same pixels for the same view. Equal vmin and vmax give 0."""
    v = np.asarray(values, dtype=np.float64)
    if not vmax > vmin:
        return np.zeros(v.shape, dtype=np.uint8)
    return np.clip(np.floor((v - vmin) / (vmax - vmin) * 255.0 + 0.5), 0, 255).astype(np.uint8)


def lut(cmap: str = CMAP) -> np.ndarray:
    """The colour map's 256 colours as matplotlib looks them up (`Colormap(i, bytes=True)`): uint8 RGB
    [256, 3], the table every map is drawn with (here, in the browser's explorers, in colour bars)."""
    return matplotlib.colormaps[cmap](np.arange(256), bytes=True)[:, :3]


def colorize(values: np.ndarray, *, cmap: str = CMAP, vmin: float | None = None, vmax: float | None = None) -> np.ndarray:
    """Float array [...] -> uint8 RGB [..., 3]; min-max scaled unless vmin/vmax are given (matplotlib's
    own lookup of the 256 colours, `Colormap(i, bytes=True)`)."""
    lo = float(np.min(values)) if vmin is None else vmin
    hi = float(np.max(values)) if vmax is None else vmax
    return matplotlib.colormaps[cmap](heat_indices(values, lo, hi), bytes=True)[..., :3]


def _scale_range(heat: np.ndarray, vmin: float | None, vmax: float | None) -> tuple[float, float]:
    return (float(heat.min()) if vmin is None else float(vmin)), (float(heat.max()) if vmax is None else float(vmax))


def overlay_many(
    image: Image.Image,
    heats: torch.Tensor,
    *,
    vmin: float | None = None,
    vmax: float | None = None,
    cmap: str = CMAP,
) -> list[Image.Image]:
    """Heat maps [K, gh, gw] over the image, one block of colour per patch: K RGB images.

    Each map is scaled to its own min..max unless vmin/vmax fix a shared scale. Pixel = (2 x image
    + 3 x colour + 2) // 5 (integers: the heat covers 3/5)."""
    w, h = image.size
    k, gh, gw = heats.shape
    if w % gw or h % gh:
        raise ValueError(f"a {w}x{h} image does not divide into {gh}x{gw} patches")
    base = np.asarray(image.convert("RGB"), dtype=np.int32)
    table = lut(cmap).astype(np.int32)
    values = heats.detach().cpu().double().numpy()
    out = []
    for heat in values:
        lo, hi = _scale_range(heat, vmin, vmax)
        colour = table[heat_indices(heat, lo, hi)]  # [gh, gw, 3]
        colour = colour.repeat(h // gh, axis=0).repeat(w // gw, axis=1)
        blended = ((ALPHA_DEN - ALPHA_NUM) * base + ALPHA_NUM * colour + ALPHA_DEN // 2) // ALPHA_DEN
        img = Image.fromarray(blended.astype(np.uint8))
        img.info["vitviz_range"] = (lo, hi)
        out.append(img)
    return out


def overlay(image: Image.Image, heat: torch.Tensor, *, vmin: float | None = None, vmax: float | None = None, cmap: str = CMAP) -> Image.Image:
    """One heat map [gh, gw] over the image (see `overlay_many`)."""
    return overlay_many(image, heat.unsqueeze(0), vmin=vmin, vmax=vmax, cmap=cmap)[0]


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    return [lo + (hi - lo) * i / (count - 1) for i in range(count)]


def _fmt(v: float) -> str:
    return f"{v:.3g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.1e}"


def with_colorbar(image: Image.Image, *, vmin: float, vmax: float, label: str = "", cmap: str = CMAP) -> Image.Image:
    """The image with a colour bar on its right: the scale of its heat map, ticks at five values."""
    w, h = image.size
    font = _font(11)
    lines = _wrap(label, font, COLORBAR_PX - 10) if label else []
    bar_w, pad, top, bottom = 12, 8, 12 + 12 * max(1, len(lines)), 8
    labels = [_fmt(v) for v in _ticks(vmin, vmax)]
    out = Image.new("RGB", (w + COLORBAR_PX, h), (255, 255, 255))  # a fixed width: views keep their size
    out.paste(image, (0, 0))
    bar_h = h - top - bottom
    ramp = np.linspace(255, 0, bar_h).round().astype(np.uint8)[:, None].repeat(bar_w, axis=1)
    out.paste(Image.fromarray(matplotlib.colormaps[cmap](ramp, bytes=True)[..., :3]), (w + pad, top))
    draw = ImageDraw.Draw(out)
    draw.rectangle((w + pad - 1, top - 1, w + pad + bar_w, top + bar_h), outline=(90, 90, 90))
    texts = list(text_boxes(image))
    for i, text in enumerate(labels):
        y = top + bar_h - 1 - round(i * (bar_h - 1) / (len(labels) - 1))
        draw.line((w + pad + bar_w, y, w + pad + bar_w + 3, y), fill=(90, 90, 90))
        texts.append(_draw_text(draw, (w + pad + bar_w + 5, y), text, font=font, anchor="lm", fill=(40, 40, 40)))
    for i, line in enumerate(lines):
        texts.append(_draw_text(draw, (w + pad, 2 + 12 * i), line, font=font, fill=(40, 40, 40)))
    out.info["vitviz_text"] = texts
    return named(out, image.info.get("vitviz_name"))


def _wrap(text: str, font, width: float) -> list[str]:
    """`text` in lines no wider than `width` px where its words allow."""
    lines: list[str] = []
    for word in text.split():
        if lines and font.getlength(lines[-1] + " " + word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines


def _draw_text(draw: ImageDraw.ImageDraw, xy: tuple[float, float], text: str, *, font, anchor: str = "la", fill=(30, 30, 30)) -> tuple:
    """Draws `text` and returns (text, its box (x0, y0, x1, y1) in pixels)."""
    draw.text(xy, text, fill=fill, font=font, anchor=anchor)
    return text, tuple(float(v) for v in draw.textbbox(xy, text, font=font, anchor=anchor))


def text_boxes(image: Image.Image) -> list[tuple[str, tuple[float, float, float, float]]]:
    """The text drawn on a picture of this module, each with its box (x0, y0, x1, y1) in pixels."""
    return list(image.info.get("vitviz_text", []))


def clipped_text(image: Image.Image) -> list[str]:
    """The texts of `text_boxes` that do not lie wholly inside the picture (a clipped label)."""
    w, h = image.size
    return [f"{t!r} at {tuple(round(v, 1) for v in box)} in {w}x{h}" for t, box in text_boxes(image)
            if box[0] < -0.5 or box[1] < -0.5 or box[2] > w + 0.5 or box[3] > h + 0.5]


def named(image: Image.Image, name: str | None) -> Image.Image:
    """Gives the picture a download name (the app writes it under that name)."""
    if name:
        image.info["vitviz_name"] = name
    return image


def mark_patch(image: Image.Image, *, patch: tuple[int, int], patch_size: int, color: str = "#00e5ff") -> Image.Image:
    """A copy of the image with patch (row, col) outlined."""
    out = image.copy()
    out.info.update(image.info)
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


def mosaic(images: list[Image.Image], *, cols: int | None = None, gap: int = 6, labels: list[str] | None = None) -> Image.Image:
    """Equal-size images in a grid with gaps, each label in a strip below its image (never over it)."""
    n = len(images)
    cols = cols or math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    w, h = images[0].size
    font = _font(12)
    strip = 16 if labels else 0
    out = Image.new("RGB", (cols * w + (cols - 1) * gap, rows * (h + strip) + (rows - 1) * gap), (255, 255, 255))
    draw = ImageDraw.Draw(out)
    texts = []
    for i, img in enumerate(images):
        x, y = (i % cols) * (w + gap), (i // cols) * (h + strip + gap)
        out.paste(img, (x, y))
        texts += [(t, (b[0] + x, b[1] + y, b[2] + x, b[3] + y)) for t, b in text_boxes(img)]
        if labels:
            texts.append(_draw_text(draw, (x + w // 2, y + h + strip // 2), labels[i], font=font, anchor="mm"))
    out.info["vitviz_text"] = texts
    return out


def figure_to_image(fig: Figure) -> Image.Image:
    """Rasterise a Figure with the Agg canvas (no pyplot, nothing kept alive)."""
    canvas = FigureCanvasAgg(fig)
    texts = _draw_with_texts(fig, canvas)
    img = Image.fromarray(np.asarray(canvas.buffer_rgba())[..., :3].copy())
    img.info["vitviz_text"] = texts
    return img


def _draw_with_texts(fig: Figure, canvas: FigureCanvasAgg) -> list[tuple[str, tuple[float, float, float, float]]]:
    """Draws the figure and returns every text the renderer drew, with its box in image pixels (y down)."""
    renderer = canvas.get_renderer()
    drawn: list[matplotlib.text.Text] = []
    draw_text = renderer.draw_text

    def recording(gc, x, y, s, prop, angle, ismath=False, mtext=None):
        if mtext is not None and s.strip():
            drawn.append(mtext)
        return draw_text(gc, x, y, s, prop, angle, ismath=ismath, mtext=mtext)

    renderer.draw_text = recording
    try:
        canvas.draw()
    finally:
        del renderer.draw_text
    height = fig.bbox.height
    out = []
    for t in dict.fromkeys(drawn):
        box = t.get_window_extent(renderer)
        out.append((t.get_text(), (float(box.x0), float(height - box.y1), float(box.x1), float(height - box.y0))))
    return out


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
    ax = ax if ax is not None else _chart_axes()  # a fixed layout: a third cheaper to draw than layout="constrained"
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
    if ax.get_legend_handles_labels()[1]:  # a single unnamed model without a reference has nothing to list
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
                texts = _draw_with_texts(fig, canvas)  # everything but the (animated) dots
                entry = (canvas, list(fig.axes[0].collections), canvas.copy_from_bbox(fig.bbox), texts)
                if len(self._backgrounds) >= self.max_keys:
                    self._backgrounds.pop(next(iter(self._backgrounds)))  # the least recently used
            self._backgrounds[key] = entry
            canvas, dots, background, texts = entry
            canvas.restore_region(background)
            for k, (artist, d) in enumerate(zip(dots, series.values())):
                artist.set_offsets(_distance_offsets(d, k, len(series)))
                artist.axes.draw_artist(artist)
            img = Image.fromarray(np.asarray(canvas.buffer_rgba())[..., :3].copy())
            img.info["vitviz_text"] = list(texts)
            return img


def position_similarity_figure(similarity: torch.Tensor, *, cmap: str = "viridis", title: str = "Position embedding similarity") -> Figure:
    """The paper's Figure 7 (centre): tile (a, b) shows S[a, b] over the gh x gw grid, the tiles laid
    out by input patch row and column, with a colour bar whose range is fitted to the data.

    Args:
        similarity: [gh, gw, gh, gw] cosine similarities.
    """
    s = similarity.detach().cpu().float().numpy()
    gh, gw = s.shape[:2]
    gap = 1
    canvas = np.full((gh * (gh + gap) - gap, gw * (gw + gap) - gap), np.nan)
    for a in range(gh):
        for b in range(gw):
            canvas[a * (gh + gap) : a * (gh + gap) + gh, b * (gw + gap) : b * (gw + gap) + gw] = s[a, b]
    fig = Figure(figsize=(5.6, 5.0), dpi=100)
    ax = fig.add_axes((0.1, 0.1, 0.72, 0.8))
    cax = fig.add_axes((0.85, 0.1, 0.03, 0.8))
    lo, hi = float(np.nanmin(s)), float(np.nanmax(s))
    im = ax.imshow(np.ma.masked_invalid(canvas), cmap=cmap, vmin=lo, vmax=hi, interpolation="nearest")
    step = max(1, gw // 7)
    ax.set_xticks([b * (gw + gap) + (gw - 1) / 2 for b in range(0, gw, step)], [str(b + 1) for b in range(0, gw, step)])
    ax.set_yticks([a * (gh + gap) + (gh - 1) / 2 for a in range(0, gh, step)], [str(a + 1) for a in range(0, gh, step)])
    ax.set_xlabel("Input patch column")
    ax.set_ylabel("Input patch row")
    ax.set_title(title, fontsize=10)
    ax.tick_params(length=0, labelsize=8)
    for spine in ax.spines.values():
        spine.set_visible(False)
    cb = fig.colorbar(im, cax=cax)
    cb.set_label("Cosine similarity", fontsize=9)
    cb.ax.tick_params(labelsize=8)
    return fig


def _rgb_tile(values: np.ndarray, size: int) -> Image.Image:
    """[P, P, 3] (or [gh, gw, 3]) floats, min-max scaled together, as an RGB tile of `size` px."""
    lo, hi = float(values.min()), float(values.max())
    scaled = (values - lo) / (hi - lo) if hi > lo else np.zeros_like(values)
    return Image.fromarray((scaled * 255).round().astype(np.uint8)).resize((size, size), Image.NEAREST)


def filters_image(components: torch.Tensor, explained: torch.Tensor | None = None, *, cols: int = 7, tile: int = 64) -> Image.Image:
    """The paper's Figure 7 (left): principal components [k, 3, P, P] of the patch-embedding filters as
    RGB tiles (each min-max scaled), with the share of variance each explains beneath it."""
    tiles = [_rgb_tile(c.permute(1, 2, 0).numpy(), tile) for c in components.detach().cpu().float()]
    labels = None
    if explained is not None:
        labels = [f"{i + 1}: {100 * float(e):.1f}%" for i, e in enumerate(explained)]
    return mosaic(tiles, cols=cols, gap=4, labels=labels)


def features_image(scores: torch.Tensor, grid: tuple[int, int], *, size: int) -> Image.Image:
    """The first three principal components of the patch features as the red, green and blue of
    each patch (each component min-max scaled on its own): [gh*gw, 3] -> a size x size image."""
    s = scores.detach().cpu().double().numpy()
    lo, hi = s.min(axis=0), s.max(axis=0)
    rgb = np.where(hi > lo, (s - lo) / np.where(hi > lo, hi - lo, 1), 0.0)
    gh, gw = grid
    return Image.fromarray((rgb.reshape(gh, gw, 3) * 255).round().astype(np.uint8)).resize((size, size), Image.NEAREST)


def received_figure(received: torch.Tensor | Sequence[torch.Tensor], *, prefix_names: tuple[str, ...], title: str = "Attention received", ax=None) -> Figure:
    """Where each layer's attention goes: one line per prefix token (cls, distillation, registers),
    and the median and largest share of a patch token, per layer.

    Args:
        received: [L, N] the share of attention each token receives (`attention_received`, heads
            averaged), or one [N_l] per layer where the layers' token counts differ.
        prefix_names: the names of the first p tokens.
    """
    ax = ax if ax is not None else _chart_axes(fitted=True)
    counts = _token_lines(ax, received, prefix_names)
    if (counts > len(prefix_names)).all():
        if (counts == counts[0]).all():
            ax.axhline(1.0 / counts[0], color="0.75", lw=0.8, label=f"uniform (1/{counts[0]})")
        else:  # each layer's own token count
            ax.step(np.arange(1, len(counts) + 1), 1.0 / counts, where="mid", color="0.75", lw=0.8, label="uniform (1/N of the layer)")
    ax.set_yscale("log")
    low, high = ax.get_ylim()
    if high / low < 10:  # no power of ten in range: label the 2..9 ticks plainly rather than as 4x10^-2
        plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:.2g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
    _finish_token_chart(ax, "Share of attention received", title)
    return ax.figure


def _chart_axes(*, fitted: bool = False):
    """The axes of a 520 x 360 px line chart: a fixed layout, or (`fitted`) one laid out to fit its
    labels (constrained layout: for tick labels whose width depends on the data)."""
    if fitted:
        return Figure(figsize=(5.2, 3.6), dpi=100, layout="constrained").add_subplot()
    fig = Figure(figsize=(5.2, 3.6), dpi=100)
    fig.subplots_adjust(left=0.12, right=0.97, top=0.92, bottom=0.14)
    return fig.add_subplot()


def _token_lines(ax, values: torch.Tensor | Sequence[torch.Tensor], prefix_names: tuple[str, ...]) -> np.ndarray:
    """One line per prefix token over the layers, and the patch tokens' median and largest; returns
    each layer's token count. `values` is [L, N], or one [N_l] per layer where the layers have
    different numbers of tokens (a model whose stages merge patches)."""
    rows = [r.detach().cpu().float() for r in values]
    counts = np.array([len(r) for r in rows])
    layers = np.arange(1, len(rows) + 1)
    p = len(prefix_names)
    for k, name in enumerate(prefix_names):
        ax.plot(layers, [float(r[k]) for r in rows], marker="o", ms=3, lw=1.5, label=name)
    if (counts > p).all():
        ax.plot(layers, [float(r[p:].median()) for r in rows], color="0.45", ls="--", lw=1, label="patch, median")
        ax.plot(layers, [float(r[p:].max()) for r in rows], color="0.2", ls=":", lw=1, label="patch, largest")
    return counts


def _finish_token_chart(ax, ylabel: str, title: str) -> None:
    ax.set_xlabel("Network depth (layer)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="best", ncol=2)
    ax.grid(alpha=0.3)


def norms_figure(norms: torch.Tensor | Sequence[torch.Tensor], *, prefix_names: tuple[str, ...], title: str = "Token norms") -> Figure:
    """The norm of each token after each block: one line per prefix token, and the patches' median
    and largest (high-norm "artefact" patches stand out; Darcet et al. 2024).

    Args:
        norms: [L, N], or one [N_l] per layer where the layers' token counts differ.
    """
    ax = _chart_axes(fitted=True)
    _token_lines(ax, norms, prefix_names)
    _finish_token_chart(ax, "Token norm (before the final norm)", title)
    return ax.figure


def faithfulness_figure(curves: dict, *, title: str = "") -> Figure:
    """Deletion and insertion curves side by side, each method's area under its curve in the legend.

    Args:
        curves: {method: `vitviz.faithfulness.Curves`} (the first sample of each is drawn).
    """
    series = {(name, mode): getattr(c, mode)[0].numpy() for name, c in curves.items() for mode in ("deletion", "insertion")}
    fractions = next(iter(curves.values())).fractions.numpy()
    return _curve_panels(series, fractions, ylabel="Probability of the class", title=title,
                         titles={"deletion": "Deletion: area under the curve, lower is better",
                                 "insertion": "Insertion: area under the curve, higher is better"})


def curves_figure(curves: dict, *, fractions: np.ndarray, title: str = "") -> Figure:
    """Mean deletion and insertion curves over a dataset, side by side, each line's area in its legend.

    Args:
        curves: {(method, "deletion" | "insertion"): mean probability of the class [steps + 1]}.
        fractions: [steps + 1] the share of patches removed (revealed) at each step — the x positions
            the areas are taken over (`vitviz.faithfulness`: round(i N / steps) / N of N patches).
    """
    return _curve_panels(curves, np.asarray(fractions, dtype=np.float64), ylabel="Mean probability of the class", title=title,
                         titles={"deletion": "Deletion (area under the curve)", "insertion": "Insertion (area under the curve)"})


def _curve_panels(series: dict, fractions: np.ndarray, *, ylabel: str, title: str, titles: dict[str, str]) -> Figure:
    """{(method, mode): values over `fractions`} as two panels, deletion and insertion, each line's
    area (trapezoidal rule) in the legend; "random" dashed grey."""
    fig = Figure(figsize=(8.4, 3.4), dpi=100)
    fig.subplots_adjust(left=0.08, right=0.98, top=0.86, bottom=0.16, wspace=0.22)
    axes = dict(zip(("deletion", "insertion"), fig.subplots(1, 2)))
    for (method, mode), values in series.items():
        area = float(np.trapezoid(values, fractions))
        style = dict(color="0.5", ls="--") if method == "random" else {}
        axes[mode].plot(fractions, values, lw=1.5, label=f"{method} ({area:.3f})", **style)
    for mode, ax in axes.items():
        ax.set_xlabel(f"Fraction of patches {'removed' if mode == 'deletion' else 'revealed'}")
        ax.set_ylabel(ylabel)
        ax.set_title(titles[mode], fontsize=9)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


# ------------------------------------------------------------------------------------------------
# Hierarchical models (Swin): regions of a grid outlined, ragged heads per layer, bias tables


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


def layer_distance_figure(distances: list[torch.Tensor] | dict[str, list[torch.Tensor]], *, stages: list[int] | None = None,
                          title: str = "Mean attention distance") -> Figure:
    """Mean attention distance with a head count of its own per layer (a hierarchical model's stages):
    one dot per head at each layer, stage boundaries as vertical lines, each stage labelled.

    Args:
        distances: per layer a [H_l] in pixels; or {name: that} for several models in one chart
            (each its own depth).
        stages: each layer's stage (of the first series), for the boundaries and labels.
    """
    ax = _chart_axes()
    series = distances if isinstance(distances, dict) else {"": distances}
    markers = "os^D"
    top = 0.0
    for k, (name, layers) in enumerate(series.items()):
        nudge = (k - (len(series) - 1) / 2) * 0.18
        x = np.concatenate([np.full(len(d), l + 1 + nudge, dtype=np.float64) for l, d in enumerate(layers)])
        y = np.concatenate([d.detach().cpu().double().numpy().reshape(-1) for d in layers])
        ax.scatter(x, y, s=14, alpha=0.75, marker=markers[k % 4], label=name or None, zorder=6)
        top = max(top, float(np.nanmax(y)) if y.size else 0.0)
    ax.set_ylim(0, axis_top(top))
    if stages is not None:
        bounds = [i for i in range(1, len(stages)) if stages[i] != stages[i - 1]]
        for b in bounds:
            ax.axvline(b + 0.5, color="0.55", lw=1, ls=":")
        starts = [0] + bounds
        ends = bounds + [len(stages)]
        for s, (a, b) in enumerate(zip(starts, ends)):
            ax.text((a + b + 1) / 2, 0.98, f"stage {stages[a] + 1}", transform=ax.get_xaxis_transform(), ha="center", va="top", fontsize=7,
                    color="0.3")
    ax.set_xlabel("Network depth (layer)")
    ax.set_ylabel("Mean attention distance (pixels)")
    ax.set_title(title, fontsize=10)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    if ax.get_legend_handles_labels()[1]:
        ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
    return ax.figure


def bias_tables_image(tables: torch.Tensor, *, tile: int = 128, cmap: str = "RdBu_r") -> Image.Image:
    """Relative position bias tables, one tile per head, on one symmetric colour scale with its bar.

    Args:
        tables: [H, 2wh - 1, 2ww - 1]: entry (r, c) is the bias a query adds to the logit of the key
            (r - wh + 1, c - ww + 1) cells away from it (the centre is the query itself, outlined).
    """
    t = tables.detach().cpu().double().numpy()
    heads, th, tw = t.shape
    bound = float(np.abs(t).max()) or 1.0
    cell = max(1, tile // max(th, tw))
    tiles = []
    for h in range(heads):
        rgb = colorize(t[h], cmap=cmap, vmin=-bound, vmax=bound).repeat(cell, 0).repeat(cell, 1)
        centre = np.zeros((th, tw), dtype=np.int64)
        centre[th // 2, tw // 2] = 1
        rgb = outline_cells(rgb, centre, cell_px=cell, width=max(1, cell // 6), color=(30, 30, 30), where=centre.astype(bool))
        tiles.append(Image.fromarray(rgb))
    img = mosaic(tiles, cols=math.ceil(math.sqrt(heads)), labels=[f"head {h + 1}" for h in range(heads)])
    return with_colorbar(img, vmin=-bound, vmax=bound, label="bias", cmap=cmap)


def lens_figure(lens: torch.Tensor, *, categories, classes: list[int], title: str = "Logit lens") -> Figure:
    """The logit lens [L+1, C] as lines: each of `classes`' probability against depth (0: the embedding)."""
    ax = _chart_axes(fitted=True)
    depth = np.arange(lens.shape[0])
    values = lens.detach().cpu().float()
    for c in classes:
        name = categories[c] if categories is not None else f"class {c}"
        ax.plot(depth, values[:, c].numpy(), marker="o", ms=3, lw=1.5, label=str(name)[:28])
    ax.set_xlabel("After block (0: the embedding)")
    ax.set_ylabel("Probability")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xticks(depth if len(depth) <= 13 else depth[:: math.ceil(len(depth) / 13)])
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    return ax.figure


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
                    cmap: str = "RdBu_r") -> tuple[Image.Image, HeadGrid]:
    """A value per (layer, head) [L, H] as coloured cells (a diverging map centred on 0, the same
    range both ways), the cells in `off` crossed out, with a colour bar; and its layout (for clicks)."""
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
        _draw_text(draw, (grid.LEFT - 4, y + c / 2), f"L{layer + 1}", font=font, anchor="rm")
        for h in range(heads):
            x = grid.LEFT + h * c
            draw.rectangle([x, y, x + c, y + c], fill=tuple(int(u) for u in colours[layer, h]), outline=(255, 255, 255))
            if (layer, h) in off:
                draw.line([x + 2, y + 2, x + c - 2, y + c - 2], fill=(20, 20, 20), width=2)
                draw.line([x + 2, y + c - 2, x + c - 2, y + 2], fill=(20, 20, 20), width=2)
    return with_colorbar(img, vmin=-top, vmax=top, label=label, cmap=cmap), grid
