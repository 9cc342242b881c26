"""Charts: the cached distance chart draws exactly what the plain figure draws."""

import threading

import numpy as np
import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg

from vitviz import plots


@pytest.mark.parametrize(
    "value, top",
    [(116.5, 150.0), (90.0, 100.0), (9.2, 15.0), (136.0, 150.0), (137.0, 200.0), (0.3, 0.4), (700.0, 800.0)],
)
def test_axis_top_leaves_headroom_on_a_round_number(value, top):
    # 1.1 x value, rounded up to 1, 1.5, 2, 2.5, 3, 4, 5, 6 or 8 x 10^k: worked by hand
    assert plots.axis_top(value) == pytest.approx(top)


def _reference(d, uniform, title):
    return np.asarray(plots.figure_to_image(plots.distance_figure(d, uniform=uniform, title=title)))


def test_distance_chart_matches_the_full_figure_pixel_for_pixel():
    chart = plots.DistanceChart(uniform=116.5, title="vit_b_16: mean attention distance per head", max_keys=2)
    gen = torch.Generator().manual_seed(0)
    tops = set()
    for scale in (80, 150, 80, 300, 150, 500):  # several axis tops, reuse and eviction of cached backgrounds
        d = torch.rand(12, 12, generator=gen) * scale
        tops.add(plots.axis_top(max(d.max().item(), 116.5)))
        got = np.asarray(chart.render(d))
        np.testing.assert_array_equal(got, _reference(d, 116.5, chart.title))
    assert len(tops) >= 3 and len(chart._backgrounds) <= 2


def test_distance_chart_follows_the_shape_of_its_input_and_is_thread_safe():
    chart = plots.DistanceChart(uniform=None, title="t")
    small = torch.tensor([[10.0, 20.0], [30.0, 40.0]])
    np.testing.assert_array_equal(np.asarray(chart.render(small)), _reference(small, None, "t"))
    inputs = [torch.rand(6, 3, generator=torch.Generator().manual_seed(i)) * 40 for i in range(8)]
    expected = [_reference(d, None, "t") for d in inputs]
    results = [None] * len(inputs)

    def work(i):
        for _ in range(5):
            results[i] = np.asarray(chart.render(inputs[i]))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, want in zip(results, expected):
        np.testing.assert_array_equal(got, want)


def test_distance_chart_with_several_series_matches_the_full_figure():
    chart = plots.DistanceChart(uniform=None, title="compare")
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        series = {"vit_b_16": torch.rand(12, 12, generator=gen) * 120, "vit_b_32": torch.rand(12, 12, generator=gen) * 200}
        want = np.asarray(plots.figure_to_image(plots.distance_figure(series, title="compare")))
        np.testing.assert_array_equal(np.asarray(chart.render(series)), want)
    three = {"a": torch.rand(6, 3, generator=gen) * 50, "b": torch.rand(12, 12, generator=gen) * 50, "c": torch.rand(24, 16, generator=gen) * 50}
    want = np.asarray(plots.figure_to_image(plots.distance_figure(three, title="compare")))
    np.testing.assert_array_equal(np.asarray(chart.render(three)), want)


@pytest.mark.parametrize("spread", ["narrow", "decades"])
def test_token_charts_keep_every_label_inside_the_figure(spread):
    """Tick labels and axis titles of the Tokens charts are drawn inside the picture, also when the
    values span less than a power of ten (random weights: every token receives about 1/N)."""
    gen = torch.Generator().manual_seed(0)
    if spread == "narrow":
        received = torch.rand(6, 38, generator=gen).softmax(-1)
    else:
        received = torch.rand(6, 38, generator=gen) * 0.01
        received[:, 0] = 0.6
    for fig in (plots.received_figure(received, prefix_names=("cls", "dist")),
                plots.norms_figure(received * 40, prefix_names=("cls", "dist"))):
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
        renderer = canvas.get_renderer()
        width, height = canvas.get_width_height()
        ax = fig.axes[0]
        texts = [ax.yaxis.label, ax.xaxis.label, ax.title]
        low, high = ax.get_ylim()
        shown = [t for t in ax.yaxis.get_major_ticks() + ax.yaxis.get_minor_ticks() if low <= t.get_loc() <= high]
        ticks = [t.label1 for t in shown if t.label1.get_visible() and t.label1.get_text()]
        assert len(ticks) >= 2
        texts += ticks
        for t in texts:
            box = t.get_window_extent(renderer)
            assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= width and box.y1 <= height, (t.get_text(), box)
        if spread == "narrow" and ax.get_yscale() == "log":  # no 4x10^-2 on a narrow axis
            assert not any("times" in t.get_text() for t in ticks), [t.get_text() for t in ticks]
