"""Tensors -> pixels: heat maps over images (numpy and a colormap lookup table: faster than a plot
and adding nothing a person needs), colour bars, outlines, mosaics, RGB tiles, and the one place a
matplotlib figure becomes pixels (`figure_to_image`, the Agg canvas, with every text's box kept)."""

from __future__ import annotations

import math

import matplotlib
import matplotlib.text
import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image, ImageDraw, ImageFont


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


def tick_values(lo: float, hi: float, count: int = 5) -> list[float]:
    return [lo + (hi - lo) * i / (count - 1) for i in range(count)]


def tick_label(v: float) -> str:
    return f"{v:.3g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.1e}"


def with_colorbar(image: Image.Image, *, vmin: float, vmax: float, label: str = "", cmap: str = CMAP) -> Image.Image:
    """The image with a colour bar on its right: the scale of its heat map, ticks at five values (an
    image too short for the bar, a very wide one, gets white beneath it)."""
    w, h = image.size
    font = _font(11)
    lines = _wrap(label, font, COLORBAR_PX - 10) if label else []
    bar_w, pad, top, bottom = 12, 8, 12 + 12 * max(1, len(lines)), 8
    labels = [tick_label(v) for v in tick_values(vmin, vmax)]
    h = max(h, top + bottom + 80)  # room for five ticks 20 px apart
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
    each patch (each component min-max scaled on its own): [gh*gw, 3] -> an image `size` px wide,
    of the grid's shape."""
    s = scores.detach().cpu().double().numpy()
    lo, hi = s.min(axis=0), s.max(axis=0)
    rgb = np.where(hi > lo, (s - lo) / np.where(hi > lo, hi - lo, 1), 0.0)
    gh, gw = grid
    return Image.fromarray((rgb.reshape(gh, gw, 3) * 255).round().astype(np.uint8)).resize((size, round(size * gh / gw)), Image.NEAREST)
