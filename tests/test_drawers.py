"""The pictures of an analysis are chosen by its token layout (`vitviz.server.pictures.drawers`): each kind of
attention has one module that offers every function of the protocol, with the same bounds and
words the explorer checks against; a module that lacks one is refused when it registers."""

import types
from pathlib import Path

import numpy as np
import pytest

from vitviz.server.models import ModelCache, ModelFacts
from vitviz.server.pictures import drawers, swin_views, views

IMAGE = str(Path(__file__).resolve().parent.parent / "assets" / "examples" / "star.png")


@pytest.fixture(scope="module")
def explorations():
    cache = ModelCache()
    return {name: views.explore(cache, IMAGE, name) for name in ("shapes_p16", "shapes_swin")}


def test_each_layout_is_drawn_by_its_module_through_the_same_protocol(explorations):
    vit, swin = explorations["shapes_p16"], explorations["shapes_swin"]
    assert drawers.drawer(vit) is views and drawers.drawer(swin) is swin_views
    for exp in (vit, swin):
        draw = drawers.drawer(exp)
        a = exp.analysis
        depth, most, queries = draw.explorer_bounds(exp)
        assert depth == (a.num_layers if draw is swin_views else a.attentions.shape[0])
        for layer in (1, depth):
            _, heads, queries_here = draw.explorer_bounds(exp, layer)
            assert heads <= most and queries_here == queries
            query = draw.patch_at(exp, 0, 0)  # the top-left patch
            assert 0 < query < queries
            assert draw.describe_query(exp, query, layer=layer).startswith("query: patch row 1, column 1")
            picture = draw.render_query(exp, layer=layer, head="mean", query=query, scale="layer")
            assert np.asarray(picture).std() > 0
            assert draw.render_head_mosaic(exp, layer=layer, query=query, scale="layer").size[0] > 0
        assert np.asarray(draw.render_rollout(exp)).std() > 0
        assert draw.render_distance(exp).size[0] > 0
    # a Swin's heads differ by stage, and its query indices are the pooled query and the finest patches
    assert drawers.drawer(swin).explorer_bounds(swin, 1)[1] < drawers.drawer(swin).explorer_bounds(swin)[1]
    assert swin.analysis.grid[0] * swin.analysis.grid[1] + 1 == drawers.drawer(swin).explorer_bounds(swin)[2]
    assert views.scale_refusal("shared") is None and "grids of their own" in swin_views.scale_refusal("shared")


def test_what_differs_by_layout_beyond_the_explorer_comes_from_the_drawer_too(explorations, tmp_path):
    """The drawer a model's attention names, the rollout's note and options, the explorer's file and widget, the learned
    positions, the stages and the Explain tab's note: each from the layout's module."""
    from vitviz.architectures import attention_of

    vit, swin = explorations["shapes_p16"], explorations["shapes_swin"]
    cache = ModelCache()
    for exp in (vit, swin):
        draw = drawers.drawer(exp)
        model, facts = cache.get(exp.analysis.variant)
        assert drawers.drawer_for(attention_of(model)) is draw and exp.analysis.layout.attention == attention_of(model)
        assert ModelFacts.of(model).summary_rows == facts.summary_rows == exp.facts.summary_rows
        live = draw.write_explorer(exp, key="k" * 22, folder=tmp_path)
        assert live["mode"] != "server" and list(tmp_path.glob("k" * 22 + "*"))  # written, small enough for the browser
        similarity, filters = draw.render_positions(exp)
        assert filters.size[0] > 0
    # a ViT: position embeddings, a discard ratio, no stages, its explorer sent with the analysis
    assert views.rollout_note(vit) is None and views.DISCARD_RATIO and views.render_stages(vit) is None
    assert views.render_positions(vit)[0] is not None and not vit.analysis.layout.position_bias
    assert views.explorer_mode(vit) in ("stack", "layers") and views.EXPLORER_WIDGET == "global"
    with pytest.raises(ValueError, match="not relative position bias"):
        views.render_bias(vit, layer=1)
    assert np.asarray(views.render_offsets(vit, layer=1)).std() > 0  # this image's attention by offset
    with pytest.raises(ValueError, match="within 1..6"):  # shapes_p16: 6 blocks
        views.render_offsets(vit, layer=7)
    with pytest.raises(ValueError, match="within windows"):
        swin_views.render_offsets(swin, layer=1)
    # a Swin: the pooled query's rollout explained, no discard ratio, a relative position bias per layer, its stages
    assert "pooled query" in swin_views.rollout_note(swin) and not swin_views.DISCARD_RATIO
    with pytest.raises(ValueError, match="discard ratio"):
        swin_views.render_rollout(swin, discard_ratio=0.5)
    assert swin_views.render_positions(swin)[0] is None and swin.analysis.layout.position_bias
    assert np.asarray(swin_views.render_bias(swin, layer=2)).std() > 0
    assert swin_views.render_stages(swin).size[0] > 0 and swin_views.EXPLORER_WIDGET == "windowed"
    assert swin_views.explorer_mode(swin) not in ("stack", "layers")  # written after the analysis
    assert swin_views.maps_note(swin, []) == "" and "Chefer" in swin_views.maps_note(swin, ["Chefer"])


def test_a_module_that_lacks_part_of_the_protocol_is_refused():
    partial = types.ModuleType("partial")
    for name in drawers.PROTOCOL[:-1]:
        setattr(partial, name, lambda *a, **k: None)
    with pytest.raises(TypeError, match=f"lacks {drawers.PROTOCOL[-1]}, DISCARD_RATIO, EXPLORER_WIDGET$"):
        drawers.register_drawer("toy", partial)
    with pytest.raises(ValueError, match="no drawer for 'toy'"):
        drawers.drawer(types.SimpleNamespace(analysis=types.SimpleNamespace(layout=types.SimpleNamespace(attention="toy"))))


def test_explorer_widgets_are_registered_and_a_drawer_names_one_of_them(monkeypatch):
    """The widgets the Explorer tab builds: the global one (which calls the server for layers and the
    early explorer) and the windowed one; a drawer naming no registered widget, or a widget without
    its files, is refused; a new one is built beside them."""
    names = [w.name for w in drawers.widgets()]
    assert names[:2] == ["global", "windowed"]
    by_name = {w.name: w for w in drawers.widgets()}
    assert by_name["global"].server_calls and not by_name["windowed"].server_calls
    common = by_name["global"].files["js"].split("\n", 1)[0]
    assert by_name["windowed"].files["js"].startswith(common) and "Swin" in by_name["windowed"].caption
    with pytest.raises(TypeError, match="lacks its css, html"):
        drawers.register_widget(drawers.Widget("toy", {"js": ""}, elem_id="vv-toy"))
    with pytest.raises(ValueError, match="another explorer widget's"):
        drawers.register_widget(drawers.Widget("toy", {"js": "", "html": "", "css": ""}, elem_id="vv-swin-explorer"))
    complete = types.ModuleType("complete")
    for name in drawers.PROTOCOL:
        setattr(complete, name, lambda *a, **k: None)
    complete.DISCARD_RATIO, complete.EXPLORER_WIDGET = False, "frames"
    with pytest.raises(ValueError, match="names the explorer widget 'frames', which is not registered"):
        drawers.register_drawer("toy", complete)
    monkeypatch.setattr(drawers, "_WIDGETS", dict(drawers._WIDGETS))
    monkeypatch.setattr(drawers, "_DRAWERS", dict(drawers._DRAWERS))
    drawers.register_widget(drawers.Widget("frames", {"js": "", "html": "", "css": ""}, elem_id="vv-frames"))
    drawers.register_drawer("toy", complete)
    assert [w.name for w in drawers.widgets()][-1] == "frames" and drawers.drawer_for("toy") is complete
