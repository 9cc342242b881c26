"""The pictures of an analysis are chosen by its token layout (`vitviz.server.drawers`): each kind of
attention has one module that offers every function of the protocol, with the same bounds and
words the explorer checks against; a module that lacks one is refused when it registers."""

import types
from pathlib import Path

import numpy as np
import pytest

from vitviz.server import drawers, swin_views, views
from vitviz.server.models import ModelCache

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


def test_a_module_that_lacks_part_of_the_protocol_is_refused():
    partial = types.ModuleType("partial")
    for name in drawers.PROTOCOL[:-1]:
        setattr(partial, name, lambda *a, **k: None)
    with pytest.raises(TypeError, match="lacks scale_refusal"):
        drawers.register_drawer("toy", partial)
    with pytest.raises(ValueError, match="no drawer for 'toy'"):
        drawers.drawer(types.SimpleNamespace(analysis=types.SimpleNamespace(layout=types.SimpleNamespace(attention="toy"))))
