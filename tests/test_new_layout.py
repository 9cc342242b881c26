"""A token layout no part of vitviz knows: a ViT over two frames of one image (`tests/vv_frames.py`, a
module outside the package that registers a model family, its `Architecture` and its drawer). The
library analyses and explains it through its architecture, every function of the drawer protocol
draws it, and the app analyses it with one click: each tab draws it or says in one line what it
lacks, the explorer is drawn by the server, Explain and Compare draw it beside a ViT, and the API's
endpoints answer for it, with no file of vitviz changed."""

import sys

import numpy as np
import pytest
import torch
from PIL import Image

import vitviz
from conftest import sources_kept

pytestmark = pytest.mark.slow

NAME = "frames:tiny"


def _quiet(*args, **kwargs):
    pass


@pytest.fixture(scope="module")
def frames():
    """The plugin imported (its family, architecture and drawer registered), and every registry as it
    was after the module's tests."""
    from vitviz import layout
    from vitviz.server.pictures import drawers

    architectures, drawn = dict(layout._ARCHITECTURES), dict(drawers._DRAWERS)
    try:
        with sources_kept():
            import vv_frames

            yield vv_frames
    finally:
        layout._ARCHITECTURES.clear()
        layout._ARCHITECTURES.update(architectures)
        drawers._DRAWERS.clear()
        drawers._DRAWERS.update(drawn)
        sys.modules.pop("vv_frames", None)


@pytest.fixture(scope="module")
def image():
    torch.manual_seed(5)
    return Image.fromarray((torch.rand(40, 48, 3) * 255).to(torch.uint8).numpy())


def test_the_library_analyses_and_explains_it_through_its_architecture(frames, image):
    from vitviz.architectures import architecture_of, attention_of

    model = vitviz.load_model(NAME, device="cpu")
    assert type(model) is frames.FramesViT and attention_of(model) == "frames" and architecture_of(model).methods == frames.METHODS
    a = vitviz.analyze(model, image)
    gh, gw = a.grid
    assert isinstance(a, frames.FramesAnalysis) and a.attentions.shape == (2, 2, 1 + 2 * gh * gw, 1 + 2 * gh * gw)
    assert a.layout.attention == "frames" and "global_attention" not in a.layout.provides
    assert "local windows" in a.layout.lacks({"global_attention"})
    # the rollout by hand: per layer (mean over heads + I) / 2, multiplied; the cls row over both frames, the mirror's mirrored back
    r = torch.eye(a.attentions.shape[-1])
    for layer in a.attentions:
        r = ((layer.mean(0) + torch.eye(layer.shape[-1])) / 2) @ r
    row = r[0, 1:].reshape(2, gh, gw)
    assert torch.allclose(a.cls_map(), row[0] + row[1].flip(-1), atol=1e-6)
    x = vitviz.preprocess(image, model.spec.preprocessing)[0][None]
    maps, _, probabilities = vitviz.relevance_maps(model, x, methods=["rollout", "attention"])
    assert torch.allclose(maps["rollout"][0], a.cls_map(), atol=1e-6) and torch.allclose(probabilities[0], a.probabilities, atol=1e-6)
    assert torch.allclose(maps["attention"][0].sum(), 1 - a.attentions[-1, :, 0, 0].mean(), atol=1e-5)  # the cls row's patch part
    # the mean attention distance of a query whose attention is all on one key is that key's distance
    one = frames.FramesAnalysis(**{**a.__dict__, "attentions": torch.zeros(1, 1, *a.attentions.shape[-2:])})
    one.attentions[0, 0, :, 1 + gh * gw] = 1  # every query on the mirror frame's first patch: the image's top-right
    places = one.places()
    assert torch.allclose(one.distances()[0, 0], (places - places[gh * gw]).norm(dim=1).mean())


def test_its_requests_are_priced_by_the_tokens_its_config_says_the_blocks_see(frames, image):
    """Every price is made from the record alone, before a model is built: the plugin's config says its
    blocks see each patch once a frame (`tokens_of`), so an analysis and an export are priced over
    both frames; the flops they run (counted by torch) are within their price and the price within
    1.5x of them. Priced as one frame, an analysis would be priced at about half its work."""
    from conftest import counted_flops
    from vitviz.cost import price

    spec = vitviz.sources.get_spec(NAME)
    gh, gw = spec.grid
    assert spec.num_tokens == 1 + 2 * gh * gw and spec.at(64).num_tokens == 1 + 2 * 8 * 8
    model = vitviz.load_model(NAME, device="cpu")
    analysed = vitviz.analyze(model, image)
    assert analysed.attentions.shape[-1] == spec.num_tokens
    for kind, run in {"analyse": lambda: vitviz.analyze(model, image).rollout(), "view": lambda: analysed.rollout()}.items():
        work, priced = counted_flops(run), price(spec, kind).flops
        assert work <= priced <= 1.5 * work, (kind, work, priced)


def test_every_function_of_the_drawer_protocol_draws_it(frames, image, tmp_path):
    from vitviz.server.pictures import drawers
    from vitviz.server.models import ModelCache
    from vitviz.server.pictures.views import explore

    exp = explore(ModelCache(), image, NAME)
    draw = drawers.drawer(exp)
    assert draw is frames and set(drawers.PROTOCOL) <= set(dir(draw))
    depth, heads, queries = draw.explorer_bounds(exp)
    gh, gw = exp.analysis.grid
    assert (depth, heads, queries) == (2, 2, 1 + 2 * gh * gw)
    px = exp.analysis.patch_size * exp.scale
    query = draw.patch_at(exp, gw * px + 1, 1)  # the top-left patch of the second frame
    assert query == 1 + gh * gw and draw.describe_query(exp, query) == "query: patch row 1, column 1 of frame 2"
    for picture in (draw.render_rollout(exp), draw.render_query(exp, layer=1, head="head 2", query=query),
                    draw.render_head_mosaic(exp, layer=2, query=0), draw.render_distance(exp), draw.render_positions(exp)[1]):
        assert np.asarray(picture).std() > 0
    norms_chart, norms_map = draw.render_token_norms(exp)
    for picture in (draw.render_received(exp), norms_chart, norms_map, draw.render_dino_heads(exp, share=0.5), draw.render_features(exp)[0],
                    draw.render_feature_similarity(exp, query=query)):
        assert np.asarray(picture).std() > 0
    assert draw.render_stages(exp) is None and draw.rollout_note(exp).startswith("**Two frames")
    from vitviz.server.guards.export import export_npz

    data = np.load(export_npz(exp, tmp_path / "frames.npz"))  # the download: its drawer's
    assert int(data["frames"]) == 2 and np.array_equal(data["cls_map"], exp.analysis.cls_map().numpy())
    assert exp.facts.summary_rows[0][0] == "Two frames" and exp.facts.similarity is None


def test_the_app_analyses_it_with_one_click_and_each_tab_draws_it_or_says_why_not(frames, image, tmp_path):
    from vitviz.server.app import SERVER
    import importlib

    importlib.import_module("vitviz.server.app")  # the page built
    from vitviz.server import page, runtime, tabs

    path = tmp_path / "photo.png"
    image.save(path)
    out = page.on_analyze(str(path), NAME, "mean", 0.0, progress=_quiet)
    assert out[page.PAGE.notice] == "", out[page.PAGE.notice]
    ref = out[page.PAGE.state]
    lacking = {"find": "has no text tower", "inside": "records no residual stream", "patch": "attends within local windows",
               "concepts": "attends within local windows", "ask": "is not a vision–language model"}
    for tab in tabs.TABS:
        note, content = out[tab.gate.note], out[tab.gate.content]
        if tab.id in lacking:
            assert lacking[tab.id] in note["value"] and content["visible"] is False, (tab.id, note)
        else:
            assert note["visible"] is False and content["visible"] is True, (tab.id, note)
    predict = tabs.predict.TAB
    assert isinstance(out[predict.rollout_img]["value"], Image.Image) and "Two frames" in out[predict.predict_note]
    assert len(out[predict.predictions]["value"]) == 3
    assert isinstance(out[tabs.distance.TAB.distance_img], Image.Image)
    assert out[tabs.positions.TAB.similarity_box]["visible"] is False and isinstance(out[tabs.positions.TAB.filters_img], Image.Image)
    assert out[tabs.architecture.TAB.stages_img]["visible"] is False
    # Tokens: its drawer's pictures (norms over both frames, the cls token's heads, both frames' features)
    tokens = page.on_refresh_tab(ref, "tokens", "red", tabs.explain.EXPLAIN_SCALES[0], 0.6)
    for shown in (tabs.tokens.TAB.received_img, tabs.tokens.TAB.norms_img, tabs.tokens.TAB.norms_map_img, tabs.tokens.TAB.dino_img,
                  tabs.tokens.TAB.features_img):
        assert isinstance(tokens[shown], Image.Image) and np.asarray(tokens[shown]).std() > 0, shown
    assert tokens[tabs.tokens.TAB.features_text].startswith("Both frames' patch features")
    # the explorer: no browser widget for this layout, so the server's, drawn with the analysis
    explorer = tabs.explorer.TAB
    follow = out
    assert follow[explorer.server_explorer]["visible"] is True and follow[explorer.live["global"]] is None
    assert isinstance(follow[explorer.explorer_img], Image.Image) and isinstance(follow[explorer.mosaic], Image.Image)
    shown = explorer.on_view(ref, 1, "head 1", 1 + 2 * 16 - 1, tabs.explorer.SCALES[0])  # the last patch of the second frame
    assert isinstance(shown[explorer.explorer_img], Image.Image)
    # Explain: the methods its architecture offers, the others said
    explained = page.on_refresh_tab(ref, "explain", "red", tabs.explain.EXPLAIN_SCALES[0], 0.6)
    imgs = tabs.explain.TAB.explain_imgs
    assert {m for m in imgs if explained[imgs[m]]["visible"]} == set(frames.METHODS)
    assert "Not for two frames" in explained[tabs.explain.TAB.explain_note]
    # Compare beside a ViT; the API's endpoints
    compared = tabs.compare.TAB._outputs([SERVER.run(str(path), NAME), SERVER.run(str(path), "shapes_p16")], shared=True)
    assert isinstance(compared[tabs.compare.TAB.compare_distance], Image.Image) and "frames:" in compared[tabs.compare.TAB.compare_table]
    assert isinstance(page.api_attention(str(path), NAME, 2, "mean", 0)[page.PAGE.api_map], Image.Image)
