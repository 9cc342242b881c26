"""Charts as `matplotlib.figure.Figure` objects built directly (no pyplot), rasterised by
`images.figure_to_image`: attention distance, position similarity, tokens per layer, deletion and
insertion curves, the logit lens."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import matplotlib
import matplotlib.ticker
import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image

from vitviz.plots.images import _draw_with_texts


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


def lens_figure(lens: torch.Tensor, *, categories, classes: list[int], title: str = "Logit lens", first: int = 0,
                start: str = "the embedding") -> Figure:
    """The logit lens [L+1, C] as lines: each of `classes`' probability against depth, from `first`
    (the blocks before the first row; 0: the embedding, named `start`)."""
    ax = _chart_axes(fitted=True)
    depth = first + np.arange(lens.shape[0])
    values = lens.detach().cpu().float()
    for c in classes:
        name = categories[c] if categories is not None else f"class {c}"
        ax.plot(depth, values[:, c].numpy(), marker="o", ms=3, lw=1.5, label=str(name)[:28])
    ax.set_xlabel(f"After block ({first}: {start})")
    ax.set_ylabel("Probability")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xticks(depth if len(depth) <= 13 else depth[:: math.ceil(len(depth) / 13)])
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    return ax.figure
