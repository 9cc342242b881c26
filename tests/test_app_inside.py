"""The Inside tab: the logit lens, direct logit attribution and ablation of the session's analysis,
each equal to the library's numbers (`vitviz.inside`), clicks on the heads x layers map switching
heads off, and junk from a client refused."""

import gradio as gr
import pytest
import torch

from conftest import analyse_example, quiet

import vitviz
from vitviz.inside import ablate, head_importance


@pytest.fixture(scope="module")
def app():
    global page, runtime, tabs, plots
    from vitviz import plots
    from vitviz.server import app as app_module, page, runtime, tabs
    return app_module


@pytest.fixture(scope="module")
def analysed(app):
    return analyse_example()[:3]


class _Click:
    def __init__(self, x, y):
        self.index = [x, y]


def _cell_centre(layer, head, layers=6, heads=3):
    grid = plots.HeadGrid(layers, heads)
    return grid.LEFT + (head + 0.5) * grid.cell, grid.TOP + (layer + 0.5) * grid.cell


def test_the_tab_draws_the_lens_and_the_attribution_of_the_analysis(analysed):
    ref, exp, model = analysed
    tab = tabs.inside.TAB
    a = exp.analysis
    out = page.on_refresh_tab(ref, "inside", *_values(target=None, off=[], mode="zero"))
    top = int(a.probabilities.argmax())
    assert out[tab.target]["value"] == a.categories[top] and len(out[tab.target]["choices"]) == 8
    parts = a.logit_attribution(top)
    rows = out[tab.parts]
    assert sum(float(v) for _, v in rows) == pytest.approx(float(parts.logit), abs=5e-3)
    assert f"logit {float(parts.logit):.2f}" in out[tab.note]
    assert out[tab.lens_img].size == (520, 360) and out[tab.heads_img].size[1] > 6 * 14
    assert out[tab.ablated] == {"value": None, "visible": False, "__type__": "update"} and "No head" in out[tab.ablation_note]
    assert len(out[tab.off]["choices"]) == 18 and out[tab.off]["value"] == []


def test_a_click_switches_a_head_off_and_the_top5_is_the_librarys_ablation(analysed):
    ref, exp, model = analysed
    tab = tabs.inside.TAB
    a = exp.analysis
    target = a.categories[int(a.probabilities.argmax())]
    out = tab.on_click(ref, target, ["L6 H1"], "mean", _Click(*_cell_centre(3, 2)))
    assert out[tab.off]["value"] == ["L6 H1", "L4 H3"]
    want = ablate(model, a.image, [(5, 0), (3, 2)], mode="mean", target=target)
    assert out[tab.ablated]["value"] == {str(k): v for k, v in want.predictions(5)} and out[tab.ablated]["visible"]
    assert f"{want.target_before:.1%} → {want.target_after:.1%}" in out[tab.ablation_note]
    again = tab.on_click(ref, target, out[tab.off]["value"], "mean", _Click(*_cell_centre(3, 2)))  # on again
    assert again[tab.off]["value"] == ["L6 H1"]
    assert tab.on_click(ref, target, [], "zero", _Click(1, 1)) == gr.skip()  # outside the cells


def test_ranking_the_heads_is_the_librarys_head_importance(analysed):
    ref, exp, model = analysed
    tab = tabs.inside.TAB
    a = exp.analysis
    out = tab.on_rank(ref, None, "zero")
    drop = head_importance(model, a.image, target=int(a.probabilities.argmax()), mode="zero")
    best = int(drop.flatten().argmax())
    assert f"1. L{best // 3 + 1} H{best % 3 + 1}: {float(drop.flatten()[best]):+.1%}" in out[tab.rank_note]
    assert out[tab.rank_img].size[0] > 100


@pytest.mark.parametrize("off, mode, target, match", [
    ("L1 H1", "zero", None, "list of at most"),
    (["L7 H1"], "zero", None, "L1 H1 to L6 H3"),
    (["L1 H4"], "zero", None, "L1 H1 to L6 H3"),
    ([{"x": 1}], "zero", None, "L1 H1 to L6 H3"),
    (["L1 H1"] * 65, "zero", None, "at most 64"),
    (["L1 H1"], "sideways", None, "zeros or their mean"),
    ([], "zero", "not a class", "Pick one of the model's classes"),
    ([], "zero", 3, "Pick one of the model's classes"),
])
def test_junk_is_refused_with_a_clear_message(analysed, off, mode, target, match):
    ref = analysed[0]
    with pytest.raises(gr.Error, match=match):
        tabs.inside.TAB.on_inside(ref, target, off, mode)


def test_an_image_text_model_gets_its_zero_shot_lens_and_a_windowed_one_the_reason(app):
    from vitviz.server.app import SERVER
    out = page.on_analyze(runtime.EXAMPLES[0], "shapes_clip", "mean", 0.0, progress=quiet)
    ref = out[page.PAGE.state]
    tab = tabs.inside.TAB
    drawn = tab.on_inside(ref, None, [], "zero")
    assert all(drawn[c]["visible"] is True for c in (tab.mode, tab.switches, tab.ranking))
    a = SERVER.store.get(ref.key).analysis
    assert drawn[tab.target]["choices"] == list(vitviz.shapes.CLASSES)
    torch.testing.assert_close(a.logit_lens()[-1], a.probabilities, atol=1e-5, rtol=1e-4)
    assert drawn[tab.lens_img] is not None


def _values(**mine):
    """Every on-demand tab's draw inputs, in page order, with the Inside tab's given."""
    values = []
    for tab in page.PAGE.on_demand:
        if tab.id == "inside":
            values += [mine["target"], mine["off"], mine["mode"]]
        else:
            values += [getattr(c, "value", None) for c in tab.draw_inputs]
    return values


@pytest.mark.parametrize("index", [(float("nan"), 3.0), (float("inf"), 1.0), ("x", 2), (1,), None, {"a": 1}, (1, 2, 3)])
def test_a_malformed_click_is_refused_in_one_sentence(analysed, index):
    """The event's pixel comes from the client: anything but two finite numbers is refused, not drawn or crashed on."""
    ref, exp, model = analysed
    tab = tabs.inside.TAB
    target = exp.analysis.categories[0]

    class Evt:
        pass

    evt = Evt()
    evt.index = index
    with pytest.raises(gr.Error, match="pixel"):
        tab.on_click(ref, target, [], "zero", evt)
