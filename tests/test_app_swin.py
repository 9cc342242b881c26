"""A Swin through the app: every tab that applies shows the library's numbers (`vitviz.swin`), the
ones that need a cls token or a text tower say so, junk to its endpoints is refused, and in a real
browser the window outline follows the hovered query.

The Swin is `shapes_swin`'s architecture with random weights (its relative position biases drawn
large, so that heads differ), from a weights source registered for these tests ("swintest:")."""

import json
import os
import shutil
import uuid

import gradio as gr
import numpy as np
import pytest
import torch
from PIL import Image

import vitviz
from vitviz import Preprocessing, VariantSpec, WeightsSource
from conftest import sources_kept
from vitviz.sources.base import split_size
from vitviz.sources.embedded import shapes_swin_config
from vitviz.swin import Swin

NAME = "swintest:shapes"
SHIFTED = 2  # layer 2 (1-based): stage 1's second block, its 6x6 windows shifted by 3x3 on the 12x12 grid


class _SwinTestSource(WeightsSource):
    """Random Swins of `shapes_swin`'s architecture, named "swintest:<anything>[@<px>]"."""

    name = "swintest"
    prefix = "swintest:"

    def specs(self):
        return []  # not in the menus

    def resolve(self, name, *, weights_path=None):
        base, size = split_size(name)
        spec = VariantSpec(name=base, config=shapes_swin_config(8), preprocessing=Preprocessing(image_size=96, resize_size=96, mean=(0.5,) * 3,
                           std=(0.5,) * 3), categories=vitviz.shapes.CLASSES, source=self.name, weights="random", description="a random Swin")
        return spec.at(size) if size else spec

    def status(self, spec):
        return "embedded"

    def load(self, spec, *, weights_path=None, progress=True):
        torch.manual_seed(0)
        model = Swin(spec.config)
        with torch.no_grad():
            for block in model.blocks:
                block.attn.relative_position_bias_table.normal_(std=1.0)
        model.spec = spec
        return model


@pytest.fixture(scope="module")
def app():
    """The app with the test family registered (removed afterwards: sources are per process)."""
    global page, runtime, tabs, swin_views, swin_explorer
    with sources_kept():
        vitviz.register_source(_SwinTestSource())
        from vitviz.server import app as app_module, page, runtime, tabs

        from vitviz.server.pictures import swin_explorer, swin_views
        yield app_module


def _quiet(*args, **kwargs):
    pass


@pytest.fixture(scope="module")
def analysed(app):
    from vitviz.server.app import SERVER
    out = page.on_analyze(runtime.EXAMPLES[-2], NAME, "mean", 0.0, progress=_quiet)  # star.png
    assert out[page.PAGE.notice] == "", out[page.PAGE.notice]
    ref = out[page.PAGE.state]
    exp = SERVER.store.get(ref.key)
    model = SERVER.cache.get(NAME)[0]
    fresh = vitviz.analyze(model, exp.analysis.image)  # the library's own analysis of the same crop
    return ref, out, exp, model, fresh


def _left(picture: Image.Image, like: Image.Image) -> np.ndarray:
    """The map part of a picture with a colour bar beside it."""
    assert picture.size[1] == like.size[1] and picture.size[0] > like.size[0]
    return np.asarray(picture.convert("RGB"))[:, : like.size[0]]


def _map_equals(picture: Image.Image, exp, heat: torch.Tensor) -> None:
    from vitviz import plots

    want = plots.overlay(exp.display_image, heat)
    assert np.array_equal(_left(picture, want), np.asarray(want))


def test_every_tab_that_applies_shows_the_librarys_numbers(analysed):
    from vitviz.server.app import SERVER
    ref, out, exp, model, fresh = analysed
    a = exp.analysis
    predict = tabs.predict.TAB
    assert out[predict.predictions]["value"] == dict(fresh.predictions(5)) and len(fresh.predictions(5)) == 5
    _map_equals(out[predict.rollout_img]["value"], exp, fresh.cls_map())  # the pooled query's rollout, mean fusion
    assert "mean of its final tokens" in out[predict.predict_note] and out[predict.discard]["interactive"] is False
    reasons = {t.id: out[t.gate.note]["value"] for t in tabs.TABS if out[t.gate.note]["visible"]}
    assert reasons.get("find") == f"{NAME} has no text tower: there is no phrase to look for"
    for shown in ("predict", "explain", "explorer", "distance", "positions", "architecture", "tokens", "inside"):
        assert shown not in reasons and out[tabs.TABS.by_id(shown).gate.content]["visible"] is True
    # distances: the library's, per layer, heads by stage, NaN where a layer has fewer heads
    table = swin_views.distance_table(a)
    for l, d in enumerate(fresh.distances()):
        assert torch.allclose(table[l, : len(d)], d) and torch.isnan(table[l, len(d) :]).all()
    assert out[tabs.distance.TAB.distance_img].size[0] > 300
    # the stored analysis is priced as it is held
    spec = vitviz.get_spec(NAME)
    assert a.nbytes == vitviz.cost.price(spec, "analyse").kept_bytes
    assert SERVER.store._entries[ref.key][1] == a.nbytes


def test_the_inside_tab_reads_the_last_stage_through_the_pooled_mean(analysed):
    """The lens and the direct logit attribution of a Swin: the library's numbers, from the last
    stage's first block (the stream is as wide as the head's input there only), the blocks named as
    the model's; no ablation offered, and a click or a ranking refused in one line."""
    import gradio as gr

    ref, out, exp, model, fresh = analysed
    tab = tabs.inside.TAB
    drawn = tab.on_inside(ref, None, [], "zero")
    parts, first = fresh.logit_attribution(), fresh.inside.first_layer
    assert first == len(model.blocks) - len(model.stages[-1].blocks) > 0
    assert drawn[tab.target]["value"] == fresh.categories[parts.target]
    assert f"logit {float(parts.logit):.2f}" in drawn[tab.note] and f"start at block {first + 1}" in drawn[tab.note]
    rows = dict(drawn[tab.parts])
    assert rows[f"the stream entering block {first + 1} (every block before it, merged)"] == f"{float(parts.embedding):.3f}"
    assert rows["all heads"] == f"{float(parts.heads.sum()):.3f}" and f"MLP {len(model.blocks)}" in rows and "MLP 1" not in rows
    heads = np.asarray(drawn[tab.heads_img])
    assert heads.shape[0] > 40 and heads.std() > 0
    assert isinstance(drawn[tab.lens_img], Image.Image)
    assert drawn[tab.off]["choices"] == [] and drawn[tab.off]["interactive"] is False
    assert all(drawn[c]["visible"] is False for c in (tab.mode, tab.switches, tab.ranking))  # no control that cannot act
    assert drawn[tab.ablation_note].startswith("No ablation here") and drawn[tab.ablated]["visible"] is False
    with pytest.raises(gr.Error, match="No ablation here"):
        tab.on_rank(ref, None, "zero")

    class Click:
        index = (60, 30)

    assert tab.on_click(ref, None, [], "zero", Click()) == gr.skip()  # (nothing to switch off)


def test_rollout_options_and_the_discard_ratio(analysed):
    ref, _, exp, _, fresh = analysed
    predict = tabs.predict.TAB
    _map_equals(predict.on_rollout_options(ref, "max", 0.0)[predict.rollout_img], exp, fresh.cls_map(head_fusion="max"))
    with pytest.raises(gr.Error, match="not defined for windowed attention"):
        predict.on_rollout_options(ref, "mean", 0.3)


def test_positions_show_each_layers_relative_position_bias_tables(analysed):
    ref, out, exp, model, _ = analysed
    positions = tabs.positions.TAB
    assert out[positions.similarity_box]["visible"] is False and out[positions.bias_box]["visible"] is True
    assert out[positions.bias_layer]["maximum"] == 6 and isinstance(out[positions.bias_img]["value"], Image.Image)
    assert "relative position bias" in out[positions.bias_text] and out[positions.bias_img]["label"] == "Relative position bias per head"
    assert out[positions.offsets_box]["visible"] is False  # windows: its offsets are the tables above
    assert isinstance(out[positions.filters_img], Image.Image)
    assert "position embedding" not in out[positions.caption] and "principal components" in out[positions.caption]  # (none to show)
    for l, block in enumerate(model.blocks):
        wh, ww = block.attn.window
        table = block.attn.relative_position_bias_table.detach()  # [(2wh-1)(2ww-1), heads], row (dy + wh-1)(2ww-1) + dx + ww-1, dy = query - key
        # shown as where the key lies from the query: the table read backwards along both axes
        want = table.reshape(2 * wh - 1, 2 * ww - 1, -1).permute(2, 0, 1).flip(1, 2)
        assert torch.equal(swin_views.bias_tables(exp.analysis, l), want)
    one, three = positions.on_bias_layer(ref, 1)[positions.bias_img], positions.on_bias_layer(ref, 3)[positions.bias_img]
    assert one.info["vitviz_name"].endswith("position-bias-layer1.png") and one.size != three.size  # 2 heads, then 4
    for junk in (0, 7, 2.5, "x", None):
        with pytest.raises(gr.Error, match="layer"):
            positions.on_bias_layer(ref, junk)


def test_architecture_shows_the_stages(analysed):
    _, out, exp, model, _ = analysed
    arch = tabs.architecture.TAB
    assert out[arch.stages_img]["visible"] is True and out[arch.stages_img]["value"].size[0] > 300
    rows = out[arch.table]
    names = [r[0].strip() for r in rows]
    assert names.count("Stage 2: patch merging") == 1 and "Stage 3: patch merging" in names
    assert any("shifted by 3x3" in r[1] for r in rows) and rows[-1] == ["Total", "", "", f"{sum(p.numel() for p in model.parameters()):,}"]
    assert exp.facts.similarity is None and model.config.num_params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name, grid", [(NAME, 12), (f"{NAME}@80", 10)])  # at 80 px: grids 10 and 5 padded to whole windows
def test_the_explorer_data_is_the_layers_window_attention(analysed, name, grid):
    """The browser's file, read by its documented layout: each query's row over its window is the
    layer's global attention row (to 8 bits), zero outside the window; each token's window and
    region give exactly the library's `window_of`; the pooled row is the mean of the rows."""
    from vitviz.server.app import SERVER
    live = analysed[1] if name == NAME else page.on_analyze(runtime.EXAMPLES[-2], name, "mean", 0.0, progress=_quiet)
    ref = live[page.PAGE.state]  # the explorer's value comes with the analysis' outputs
    exp = SERVER.store.get(ref.key)
    a = exp.analysis
    value = live[tabs.explorer.TAB.live["windowed"]]
    assert live[tabs.explorer.TAB.live["global"]] is None and live[tabs.explorer.TAB.boxes["windowed"]]["visible"] is True
    assert value["mode"] == "stack" and value["grid"] == [grid, grid] and value["outline"] == value["patch_px"] // 8
    data = open(value["data"], "rb").read()
    spec = vitviz.get_spec(name)
    assert len(data) == vitviz.cost.explorer_bytes(spec) == vitviz.cost.price(spec, "explorer").kept_bytes
    for l, info in enumerate(value["layers"]):
        n, m, w, v = info["grid"][0] * info["grid"][1], info["area"], info["windows"], info["heads"] + 2
        at = info["offset"]

        def take(dtype, count):
            nonlocal at
            out = np.frombuffer(data, dtype=dtype, count=count, offset=at)
            at += count * np.dtype(dtype).itemsize
            return out

        tokens, window, region = take("<i4", w * m).reshape(w, m), take("<i4", n), take("<i4", n)
        top, q = take("<f4", v * n).reshape(v, n), take("u1", v * n * m).reshape(v, n, m)
        pool_top, pool = take("<f4", v), take("u1", v * n).reshape(v, n)
        g = a.global_attention(l).double()  # [heads, N, N], the library's
        rows = torch.cat([g, g.mean(0, keepdim=True), g.amax(0, keepdim=True)])  # every view
        got = torch.zeros(v, n, n, dtype=torch.float64)
        for t in range(n):
            keys = tokens[window[t]]
            got[:, t, torch.from_numpy(keys[keys >= 0]).long()] = torch.from_numpy(q[:, t, keys >= 0] * top[:, t : t + 1].astype(np.float64) / 255)
            seen = torch.from_numpy((window == window[t]) & (region == region[t]))
            assert torch.equal(seen.reshape(info["grid"]), a.window_of(l, t // info["grid"][1], t % info["grid"][1])), (l, t)
        assert (got - rows).abs().max() <= rows.amax(-1, keepdim=True).max() / 255 / 2 + 1e-6, l
        pooled = torch.from_numpy(pool * pool_top[:, None].astype(np.float64) / 255)
        mean_row = g.mean(1)  # each head's pooled row [heads, N], then the views over heads, as for any query
        want = torch.cat([mean_row, mean_row.mean(0, keepdim=True), mean_row.amax(0, keepdim=True)])
        assert (pooled - want).abs().max() <= want.max() / 255 / 2 + 1e-6, l
    assert at == len(data)
    if name != NAME:
        assert any((g.padded != g.grid) and g.shifted for g in a.geometries)  # padding and a shift in one layer
    # too large for the browser: a note, and the server draws the explorer
    far = swin_explorer.write_payload(exp, key="x", folder=SERVER.explorer_dir, spec=spec, budget=len(data) - 1)
    assert far["mode"] == "server" and "too large" in far["note"] and "data" not in far


def _cyan(picture: Image.Image, x: int, y: int) -> bool:
    return tuple(np.asarray(picture.convert("RGB"))[y, x]) == swin_views.WINDOW_COLOR


def test_the_servers_windowed_view_outlines_the_querys_window(analysed):
    ref, _, exp, _, _ = analysed
    a, explorer = exp.analysis, tabs.explorer.TAB
    px = 32  # a finest patch on the display
    seen = {}
    for r, c in ((0, 0), (4, 4), (11, 11)):  # in the shifted layer: three windows (the corner one cut by the mask)
        query = 1 + r * 12 + c
        shown = explorer.on_view(ref, SHIFTED, "mean", query, tabs.explorer.SCALES[0])[explorer.explorer_img]
        box = a.window_of(SHIFTED - 1, r, c)
        rows, cols = box.any(1).nonzero().flatten(), box.any(0).nonzero().flatten()
        r0, r1, c0, c1 = int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1
        assert int(box.sum()) == (r1 - r0) * (c1 - c0)  # a rectangle
        seen[(r, c)] = (r0, c0, r1, c1)
        assert _cyan(shown, c0 * px + 1, (r0 + r1) * px // 2) and _cyan(shown, c1 * px - 2, (r0 + r1) * px // 2)
        assert not _cyan(shown, (c0 + c1) * px // 2, (r0 + r1) * px // 2 + 5 if r1 - r0 > 1 else r0 * px + 10)  # inside: the heat
    assert len(set(seen.values())) == 3
    # the values drawn are the library's global attention row, quantised to 8 bits
    values = swin_explorer.row_values(a, layer=SHIFTED - 1, view=2, query=1 + 4 * 12 + 4)  # mean of 2 heads
    row = a.global_attention(SHIFTED - 1).mean(0)[4 * 12 + 4].double().numpy()
    assert np.abs(values - row).max() <= row.max() / 255 / 2 + 1e-9 and (values[row == 0] == 0).all()
    # the pooled query: no outline; a stage-2 layer: the stage's token under the patch
    assert "mean of the final tokens" in explorer.on_prefix_query(ref, 6, "mean", "pool")[explorer.query_text]
    clicked = explorer.on_click(ref, 4, "head 3", tabs.explorer.SCALES[1], _Click(5 * px + 3, 9 * px + 3))
    assert clicked[explorer.query] == 1 + 9 * 12 + 5 and "stage 2 token row 5, column 3" in clicked[explorer.query_text]


class _Click:
    def __init__(self, x, y):
        self.index = [x, y]


def test_hostile_values_get_clear_errors(analysed):
    ref, _, _, _, _ = analysed
    explorer = tabs.explorer.TAB
    for layer, head, query, scale, words in [(0, "mean", 0, 0, "layer"), (7, "mean", 0, 0, "layer"), (1, "head 3", 0, 0, "head"),
                                             (3, "head 5", 0, 0, "head"), (1, "mean", 145, 0, "query"), (1, "mean", -1, 0, "query"),
                                             (1, "mean", 0, 2, "grids of their own"), (float("nan"), "mean", 0, 0, "layer")]:
        with pytest.raises(gr.Error, match=words):
            explorer.on_view(ref, layer, head, query, tabs.explorer.SCALES[scale])
    assert "no layer files" in tabs.explorer.explorer_layer([ref.key, 1])["error"]
    with pytest.raises(gr.Error, match="share"):
        tabs.tokens.TAB.on_tokens(ref, float("nan"))
    with pytest.raises(gr.Error, match="no text tower"):
        tabs.find.TAB.on_find(ref, "a red star", "gradient")


@pytest.mark.parametrize("name", [NAME, f"{NAME}@80"])  # at 80 px the grids are 10, 5 and 3: the last stage's padded
def test_the_tokens_tab_draws_the_librarys_norms_shares_heads_and_features(app, name):
    from vitviz.server.app import SERVER
    from vitviz import plots
    from vitviz.relevance import feature_components, feature_similarity, keep_mass

    analysed = page.on_analyze(runtime.EXAMPLES[-2], name, "mean", 0.0, progress=_quiet)
    ref = analysed[page.PAGE.state]
    exp = SERVER.store.get(ref.key)
    fresh = vitviz.analyze(SERVER.cache.get(name)[0], exp.analysis.image)
    a, tab = exp.analysis, tabs.tokens.TAB
    out = tab.on_tokens(ref, 0.6)
    last_grid, s = fresh.stage_grids[-1], fresh.stages[-1]
    rows, cols = np.arange(a.grid[0]) // 2**s, np.arange(a.grid[1]) // 2**s  # each finest patch's token of the last stage

    def on_finest(values: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(np.asarray(values)[rows][:, cols])

    for l, (got, want) in enumerate(zip(a.token_norms, fresh.token_norms)):
        torch.testing.assert_close(got, want)
    _map_equals(out[tab.norms_map_img], exp, on_finest(fresh.token_norms[-1].reshape(last_grid)))
    for chart in (out[tab.received_img], out[tab.norms_img]):
        assert np.asarray(chart).std() > 0
    # DINO's heads: the pooled query's row of the last block (the mean of its rows), per head
    heads = fresh.global_attention(fresh.num_layers - 1).mean(dim=1)
    kept = keep_mass(heads, 0.6)
    assert kept.sum(dim=1).min() >= 1
    maps = torch.stack([on_finest(m) for m in heads.reshape(-1, *last_grid)])
    masks = torch.stack([on_finest(m) for m in kept.reshape(-1, *last_grid)])
    labels = [f"head {h + 1}: {int(k.sum())} token{'' if int(k.sum()) == 1 else 's'}" for h, k in enumerate(kept)]
    want = swin_views.kept_heads_mosaic(exp, maps, masks, share=0.6, labels=labels)
    assert np.array_equal(np.asarray(out[tab.dino_img]), np.asarray(want))
    # the features: the final tokens' principal components, and a click's similarity on the last grid
    scores, explained = feature_components(fresh.tokens, k=3)
    want = plots.features_image(on_finest(scores.reshape(*last_grid, 3)).reshape(-1, 3), a.grid, size=exp.display_image.size[0])
    assert np.array_equal(np.asarray(out[tab.features_img]), np.asarray(want))
    assert f"PC1 {100 * float(explained[0]):.1f} %" in out[tab.features_text] and f"{last_grid[0]} x {last_grid[1]} grid" in out[tab.features_text]
    w, h = exp.display_image.size
    clicked = tab.on_feature_click(ref, _Click(w - 1, h - 1))[tab.similarity_map_img]  # the bottom-right patch: the last token
    similarity = feature_similarity(fresh.tokens, last_grid[0] * last_grid[1] - 1).reshape(last_grid)
    want = plots.overlay(exp.display_image, on_finest(similarity), vmin=-1.0, vmax=1.0, cmap="RdBu_r")
    got, want = _left(clicked, want).astype(int), np.asarray(want).astype(int)
    cell = fresh.stage_patch_size(fresh.num_layers - 1) * exp.scale  # the clicked token's cell, outlined from its top left
    top, left = (last_grid[0] - 1) * cell, (last_grid[1] - 1) * cell
    outside = np.ones(got.shape[:2], dtype=bool)
    outside[max(0, top - 3) : top + cell + 3, max(0, left - 3) : left + cell + 3] = False
    assert np.array_equal(got[outside], want[outside]) and not np.array_equal(got[~outside], want[~outside])


def test_the_explain_tab_maps_the_methods_that_apply(analysed):
    ref, _, exp, model, _ = analysed
    got = tabs.explain.TAB.on_explain(ref, "circle")
    for m in vitviz.swin_analysis.SWIN_METHODS:
        want = vitviz.explain(model, exp.analysis.image, method=m, target="circle").map
        _map_equals(got[tabs.explain.TAB.explain_imgs[m]]["value"], exp, want)
    absent = [m for m in tabs.explain.METHODS if m not in vitviz.swin_analysis.SWIN_METHODS]
    assert all(got[tabs.explain.TAB.explain_imgs[m]] == gr.update(value=None, visible=False) for m in absent)  # no empty frame
    note = got[tabs.explain.TAB.explain_note]
    assert note.startswith("Explaining **circle**") and "Not for a Swin (windowed attention)" in note


def test_faithfulness_curves_for_a_swin(analysed):
    ref = analysed[0]
    out = tabs.explain.TAB.on_faithfulness(ref, "circle", progress=_quiet)
    rows = {r[0]: (float(r[1]), float(r[2])) for r in out[tabs.explain.TAB.faith_table]["value"]}
    assert set(rows) == {*vitviz.swin_analysis.SWIN_METHODS, "random"} and all(0 <= d <= 1 and 0 <= i <= 1 for d, i in rows.values())


def test_the_npz_and_the_api_endpoints(analysed):
    ref, _, exp, _, fresh = analysed
    path = tabs.predict.TAB.on_export(ref)[tabs.predict.TAB.npz]
    data = np.load(path)
    spec = vitviz.get_spec(NAME)
    assert os.path.getsize(path) <= vitviz.cost.price(spec, "export").kept_bytes
    for l, attn in enumerate(fresh.attentions):
        assert np.array_equal(data[f"attention_{l}"], attn.numpy()) and np.array_equal(data[f"bias_{l}"], fresh.biases[l].numpy())
    np.testing.assert_allclose(data["rollout"], fresh.rollout().numpy(), atol=1e-6)
    assert data["distances"].shape == (6, 8) and np.isnan(data["distances"][0, 2:]).all()
    assert data["shifts"].tolist() == [[0, 0], [3, 3], [0, 0], [1, 1], [0, 0], [0, 0]]  # stage 3: one window, the whole grid
    image = runtime.EXAMPLES[-2]
    api = page.api_analyze(image, NAME)
    assert api[page.PAGE.api_pred] == dict(fresh.predictions(5)) and "attentions" not in np.load(api[page.PAGE.api_npz])
    _map_equals(api[page.PAGE.api_rollout], exp, fresh.cls_map())
    view = page.api_attention(image, NAME, SHIFTED, "mean", 1 + 4 * 12 + 4)[page.PAGE.api_map]
    assert np.array_equal(np.asarray(view), np.asarray(swin_views.render_query(exp, layer=SHIFTED, head="mean", query=1 + 4 * 12 + 4)))
    with pytest.raises(gr.Error, match="cannot run on"):
        page.api_explain(image, NAME, "", "legrad")
    from vitviz import plots

    compared = tabs.compare.TAB.on_compare(image, [NAME, "shapes_p16"], "own")  # a Swin beside a ViT, each on its own scale
    density = fresh.cls_map() * fresh.cls_map().numel()
    want = plots.overlay(exp.display_image, density, vmin=0.0, vmax=float(density.max()))
    assert np.array_equal(np.asarray(compared[tabs.compare.TAB.slots[0][2]]), np.asarray(want))
    assert compared[tabs.compare.TAB.compare_notice] == "" and compared[tabs.compare.TAB.compare_distance].size[0] > 300


def test_a_windowed_model_is_bounded_by_the_attention_it_holds(app):
    from vitviz.server.guards import inputs

    spec = vitviz.get_spec(f"{NAME}@960")  # 120x120 patches: 14,400 tokens, windows of 6x6 hold 14,400 x 36 per head
    held = max(g.num_windows * g.area**2 for g in spec.config.geometries(spec.grid))
    assert held == 14_400 * 36
    assert inputs.variant(f"{NAME}@960", max_tokens=720) == f"{NAME}@960"  # 720² = 518,400: as much as 720 tokens attending globally
    with pytest.raises(inputs.InputError, match="518,400 attention weights per head"):
        inputs.variant(f"{NAME}@960", max_tokens=719)
    assert vitviz.cost.price(spec, "analyse").kept_bytes < vitviz.cost.price(vitviz.get_spec("shapes_p8@480"), "analyse").kept_bytes


@pytest.mark.slow
def test_raw_http_junk_to_the_swin_endpoints_is_refused(app):
    """Through the running app: a Swin session's view, bias, rollout and explorer-layer calls with
    junk values are refused with a message, never a bare "Error"."""
    from vitviz.server.app import SERVER
    import httpx

    from conftest import fn_index, results, upload
    from conftest import run

    app.demo.launch(prevent_thread_lock=True, ssr_mode=False, server_name="127.0.0.1", quiet=True,
                    **{k: v for k, v in app.LAUNCH_KWARGS.items() if k != "ssr_mode"})
    try:
        base = app.demo.local_url.rstrip("/")
        session = uuid.uuid4().hex
        ok, _ = run(base, "session_analyze", [upload(base, runtime.EXAMPLES[-2]), NAME, "mean", 0.0, None], session=session)
        assert ok
        # each event's first input is the session's state (the server fills it in: the client sends null)
        cases = [("session_bias", [0]), ("session_bias", ["x"]), ("session_bias", [1e30]), ("session_view", [2, "head 9", 1, "each map its own"]),
                 ("session_view", [2, "mean", 1, "all layers and heads"]), ("session_view", [2, "mean", 1e9, "each map its own"]),
                 ("session_rollout", ["mean", 0.5])]
        for name, data in cases:
            body = {"data": [None, *data], "fn_index": fn_index(base, name), "session_hash": session, "event_data": None, "trigger_id": None}
            r = httpx.post(f"{base}/gradio_api/queue/join", content=json.dumps(body), headers={"content-type": "application/json"}, timeout=30)
            if r.status_code != 200:
                assert r.text and r.text.strip() != "Error", r.text
                continue
            (msg,) = results(base, session, 1)
            error = msg["output"].get("error")
            assert not msg["success"] and error and error.strip() != "Error" and len(error) > 20, (name, msg)
            assert "input values" not in error, (name, error)  # refused by vitviz's checks, not by the request's shape
        ok, out = run(base, "session_bias", [None, 3], session=session)  # a sound value still works
        assert ok, out
        (key,) = [k for k, (e, _, _) in SERVER.store._entries.items() if getattr(getattr(e, "analysis", None), "variant", None) == NAME][-1:]
        config = httpx.get(f"{base}/config").json()
        component = next(c["id"] for c in config["components"] if c.get("props", {}).get("elem_id") == "vv-explorer-live")
        body = {"session_hash": session, "component_id": component, "fn_name": "explorer_layer", "data": [key, 1]}
        answer = httpx.post(f"{base}/gradio_api/component_server", json=body, timeout=60)
        # refused, with its reason, and nothing written
        assert answer.status_code == 200 and "no layer files" in answer.json()["error"], answer.text
        assert answer.json()["busy"] is False and not list(SERVER.explorer_dir.glob(f"{key}-layer*"))
    finally:
        app.demo.close()


CHROMIUM = os.environ.get("VITVIZ_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.slow
@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed")
def test_hovering_moves_the_window_outline_in_the_browser(app):
    """A Swin named in the page, its Explorer tab: at the shifted layer, hovering two patches in
    different windows moves the outline (read from the map's data and its pixels), and each drawing
    is the server's picture of that view, pixel for pixel."""
    from playwright.sync_api import sync_playwright

    from test_browser import FLAGS, _analysed, _canvas

    app.demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True, **app.LAUNCH_KWARGS)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
            try:
                page_ = browser.new_page(viewport={"width": 1280, "height": 1000})
                page_.set_default_timeout(60_000)
                _hover_two_windows(page_, app.demo.local_url, _analysed, _canvas)
            finally:
                browser.close()
    finally:
        app.demo.close()


def _hover_two_windows(page_, url, _analysed, _canvas):
    from vitviz.server.app import SERVER
    page_.goto(url)
    page_.locator("#vv-image input[type=file]").set_input_files(runtime.EXAMPLES[-2])
    _analysed(page_, "shapes_p16")
    page_.locator("#vv-other textarea, #vv-other input").first.fill(NAME)
    page_.locator("#vv-other-use").click()
    _analysed(page_, NAME)
    page_.get_by_role("tab", name="Explorer").click()
    page_.wait_for_function("document.querySelector('#vv-swin-explorer .vvw') && document.querySelector('#vv-swin-explorer .vvw').dataset.analysis")
    key = page_.locator("#vv-swin-explorer .vvw").get_attribute("data-analysis")
    exp = SERVER.store.get(key)
    a = exp.analysis
    layer = page_.locator("#vv-swin-explorer .vvw-layer")
    layer.focus()
    page_.keyboard.press("Home")
    page_.keyboard.press("ArrowRight")  # layer 2: shifted windows
    canvas = page_.locator("#vv-swin-explorer canvas.vvw-map")
    page_.wait_for_function("document.querySelector('#vv-swin-explorer canvas.vvw-map').dataset.layer === '2'")
    box = canvas.bounding_box()
    side = exp.display_image.size[0]
    windows = []
    for r, c in ((1, 1), (7, 8)):  # two patches in different windows of the shifted layer
        page_.mouse.move(box["x"] + (c + 0.5) / 12 * box["width"], box["y"] + (r + 0.5) / 12 * box["height"])
        query = 1 + r * 12 + c
        page_.wait_for_function(f"document.querySelector('#vv-swin-explorer canvas.vvw-map').dataset.query === '{query}'")
        shown = page_.locator("#vv-swin-explorer canvas.vvw-map").get_attribute("data-window")
        seen = a.window_of(SHIFTED - 1, r, c)
        rows, cols = seen.any(1).nonzero().flatten(), seen.any(0).nonzero().flatten()
        assert shown == f"{int(rows[0])},{int(cols[0])},{int(rows[-1]) + 1},{int(cols[-1]) + 1}", (r, c, shown)
        got = _canvas(page_, "#vv-swin-explorer canvas.vvw-map")
        want = np.asarray(swin_views.render_query(exp, layer=SHIFTED, head="mean", query=query, scale="layer"))[:, :side]
        assert got.shape == want.shape and np.array_equal(got, want), (r, c, np.abs(got.astype(int) - want).max())
        windows.append((shown, got))
    assert windows[0][0] != windows[1][0]  # the outline moved with the query
    cyan = [np.all(g == swin_views.WINDOW_COLOR, axis=-1) for _, g in windows]
    assert cyan[0].sum() > 100 and cyan[1].sum() > 100 and (cyan[0] != cyan[1]).any()
    # by keyboard, one token of the layer's stage at a time; the last layer's heads in the menu; the pooled query has no window
    canvas.focus()
    page_.keyboard.press("ArrowDown")
    page_.wait_for_function(f"document.querySelector('#vv-swin-explorer canvas.vvw-map').dataset.query === '{1 + 8 * 12 + 8}'")
    layer.focus()
    page_.keyboard.press("End")
    page_.wait_for_function("document.querySelector('#vv-swin-explorer canvas.vvw-map').dataset.layer === '6'")
    assert page_.locator("#vv-swin-explorer .vvw-head option").count() == 8 + 2
    assert "stage 3 token row 3, column 3" in page_.locator("#vv-swin-explorer .vvw-query-text").inner_text()
    page_.locator("#vv-swin-explorer .vvw-pool").click()
    page_.wait_for_function("document.querySelector('#vv-swin-explorer canvas.vvw-map').dataset.query === '0'")
    assert page_.locator("#vv-swin-explorer canvas.vvw-map").get_attribute("data-window") == ""
    got = _canvas(page_, "#vv-swin-explorer canvas.vvw-map")
    assert np.array_equal(got, np.asarray(swin_views.render_query(exp, layer=6, head="mean", query=0, scale="layer"))[:, :side])


@pytest.mark.skipif(not (vitviz.sources.assets_dir() / "shapes_swin.pt").is_file(), reason="assets/shapes_swin.pt is not trained yet")
def test_the_embedded_shapes_swin_through_the_app(app):
    """The embedded Swin from the menu: it analyses, predicts the example's shape, and every tab that
    applies draws (its explorer data written, its maps for the top class)."""
    out = page.on_analyze(runtime.EXAMPLES[-2], "shapes_swin", "mean", 0.0, progress=_quiet)
    assert out[page.PAGE.notice] == "", out[page.PAGE.notice]
    ref = out[page.PAGE.state]
    preds = out[tabs.predict.TAB.predictions]["value"]
    assert max(preds, key=preds.get) == "star"
    assert out[tabs.explorer.TAB.live["windowed"]]["mode"] == "stack"
    got = tabs.explain.TAB.on_explain(ref, "star")
    assert all(isinstance(got[tabs.explain.TAB.explain_imgs[m]]["value"], Image.Image) for m in vitviz.swin_analysis.SWIN_METHODS)
