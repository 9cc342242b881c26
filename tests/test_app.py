"""The app's handlers called directly, and the /analyze endpoint through gradio_client."""

import dataclasses

import gradio as gr
import numpy as np
import pytest
import torch
from PIL import Image

import vitviz
from vitviz.model import ViT


@pytest.fixture(scope="module")
def app():
    # the page's modules, imported with the app (which builds the page) and bound here for every test
    global gradio_io, page, runtime, tabs, views
    from vitviz.server import app as app_module, page, runtime, tabs

    from vitviz.server.guards import gradio_io
    from vitviz.server.pictures import views
    return app_module


@pytest.fixture(scope="module")
def example(app):
    assert runtime.EXAMPLES, "assets/examples must hold example images"
    return runtime.EXAMPLES[0]


def _quiet(*args, **kwargs):
    pass


@pytest.fixture(scope="module")
def analysed(app, example):
    out = page.on_analyze(example, "shapes_p16", "mean", 0.0, progress=_quiet)
    return out[page.PAGE.state], out


class _Click:
    def __init__(self, x, y):
        self.index = [x, y]


def test_analyze_fills_every_section(app, analysed):
    ref, out = analysed
    assert set(out) == set(page.PAGE.analysis_outputs) - {page.PAGE.image, page.PAGE.variant}  # what the user chose stays
    preds, rollout = out[tabs.predict.TAB.predictions]["value"], out[tabs.predict.TAB.rollout_img]["value"]
    # the browser's explorer comes with the analysis
    assert out[tabs.explorer.TAB.live["global"]]["id"] == ref.key
    explorer, mosaic = out[tabs.explorer.TAB.explorer_img], out[tabs.explorer.TAB.mosaic]
    layer_upd, head_upd, query, query_text = out[tabs.explorer.TAB.layer], out[tabs.explorer.TAB.head], out[tabs.explorer.TAB.query], out[tabs.explorer.TAB.query_text]
    distance, similarity, filters, grid = out[tabs.distance.TAB.distance_img], out[tabs.positions.TAB.similarity_img], out[tabs.positions.TAB.filters_img], out[tabs.architecture.TAB.grid_img]
    table, npz, status = out[tabs.architecture.TAB.table], out[tabs.predict.TAB.npz], out[page.PAGE.status]
    assert out[page.PAGE.notice] == ""
    assert len(preds) == 5 and abs(sum(preds.values()) - 1) < 0.5
    assert out[tabs.positions.TAB.caption].startswith("Left: cosine similarity between the learned position embedding")
    # 384 px maps (the 96 px crop at 4x) with a colour bar beside them
    assert rollout.size[1] == 384 and 384 < rollout.size[0] < 480
    # the explorer is the browser's: its data written once, the server's own explorer hidden and not drawn
    live = out[tabs.explorer.TAB.live["global"]]
    assert live["mode"] == "stack" and live["id"] == ref.key and out[tabs.explorer.TAB.server_explorer]["visible"] is False
    assert explorer is None and mosaic is None
    from pathlib import Path

    assert Path(live["data"]).stat().st_size == 4 * 37 + 6 * 5 * 37 * (4 + 36)  # shared maxima, then per layer
    assert Path(live["base"]).is_file() and live["lut"][:3] == [0, 0, 3]  # inferno's first colour
    assert layer_upd["maximum"] == 6 and head_upd["choices"][:3] == ["mean", "max", "head 1"]
    assert query == 0 and "cls" in query_text
    assert distance.size[0] > 300
    assert similarity.size[0] > 300 and filters.size[0] > 100 and grid.size == (384, 384)
    assert table[0][0].startswith("Input image") and table[-2][0] == "Classification head"
    assert table[-1] == ["Total", "", "", "527,144"]
    assert npz is None  # written on demand
    data = np.load(tabs.predict.TAB.on_export(ref)[tabs.predict.TAB.npz])
    assert data["attentions"].shape == (6, 3, 37, 37) and data["cls_map"].shape == (6, 6)
    np.testing.assert_allclose(data["rollout"].sum(-1), 1, atol=1e-5)
    assert "shapes_p16" in status


def test_view_changes_never_call_the_model(app, analysed, monkeypatch):
    from vitviz.server.app import SERVER
    ref = analysed[0]
    exp = SERVER.store.get(ref.key)

    def forbidden(*args, **kwargs):
        raise AssertionError("the model was called for a view change")

    monkeypatch.setattr(ViT, "forward", forbidden)
    monkeypatch.setattr(ViT, "encode", forbidden)
    before = exp.analysis.attentions.clone()
    m1 = tabs.explorer.TAB.on_view(ref, 1, "head 2", 0)[tabs.explorer.TAB.explorer_img]
    m2 = tabs.explorer.TAB.on_view(ref, 6, "max", 0)[tabs.explorer.TAB.explorer_img]
    assert np.abs(np.asarray(m1, dtype=float) - np.asarray(m2, dtype=float)).sum() > 0
    r1 = tabs.predict.TAB.on_rollout_options(ref, "min", 0.5)[tabs.predict.TAB.rollout_img]
    r2 = tabs.predict.TAB.on_rollout_options(ref, "mean", 0.0)[tabs.predict.TAB.rollout_img]
    assert np.abs(np.asarray(r1, dtype=float) - np.asarray(r2, dtype=float)).sum() > 0
    assert SERVER.store.get(ref.key) is exp  # drawing leaves the stored analysis as it was
    out = tabs.explorer.TAB.on_click(ref, 6, "mean", tabs.explorer.SCALES[0], _Click(383, 0))  # top-right patch
    assert out[tabs.explorer.TAB.query] == 1 + 5 and "row 1, column 6" in out[tabs.explorer.TAB.query_text]
    assert set(out) == {tabs.explorer.TAB.query, tabs.explorer.TAB.query_text, tabs.explorer.TAB.prefix_query, tabs.explorer.TAB.explorer_img, tabs.explorer.TAB.mosaic}
    assert tabs.explorer.TAB.on_prefix_query(ref, 6, "mean", "cls")[tabs.explorer.TAB.query] == 0
    torch.testing.assert_close(exp.analysis.attentions, before)


def test_clicking_a_patch_changes_the_explorer_map(app, analysed):
    ref = analysed[0]
    a = tabs.explorer.TAB.on_click(ref, 3, "mean", tabs.explorer.SCALES[0], _Click(10, 10))[tabs.explorer.TAB.explorer_img]
    b = tabs.explorer.TAB.on_click(ref, 3, "mean", tabs.explorer.SCALES[0], _Click(300, 300))[tabs.explorer.TAB.explorer_img]
    assert np.abs(np.asarray(a, dtype=float) - np.asarray(b, dtype=float)).mean() > 1


def test_an_explorer_over_the_browsers_budget_comes_a_layer_at_a_time_or_from_the_server(app, analysed, example, monkeypatch):
    """shapes_p16 (37 tokens, 3 heads: 7,400 bytes a layer) under smaller budgets. With one layer
    within it, the explorer's value names no file; a layer's file, written when the page asks for it,
    is the stack file's shared maxima and that layer's block. With not even one, the server draws the
    explorer. `explorer_layer` refuses the two layouts that have no layer files, and writes nothing:
    its refusals are answers, {"error": why, "busy": False}, not errors."""
    from vitviz.server.app import SERVER
    from pathlib import Path

    from vitviz import cost
    from vitviz.server.pictures import explorer_data, views

    explorer = tabs.explorer.TAB
    ref, _ = analysed  # within the budget: one file, written with the analysis
    assert "no layer files" in _refused(tabs.explorer.explorer_layer([ref.key, 1]))
    layer, head = 5 * 37 * (4 + 36), 4 * 37
    monkeypatch.setattr(cost, "BROWSER_BYTES", head + layer)
    out = page.on_analyze(example, "shapes_p16", "mean", 0.0, progress=_quiet)
    near, live = out[page.PAGE.state], out[explorer.live["global"]]
    assert live["mode"] == "layers" and "data" not in live and out[explorer.server_explorer]["visible"] is False
    assert not list(SERVER.explorer_dir.glob(f"{near.key}-*.bin"))
    whole = explorer_data.stack_file(SERVER.store.get(near.key).analysis, range(6))
    for n in (6, 2):
        got = Path(tabs.explorer.explorer_layer([near.key, n])).read_bytes()
        assert got == whole[:head] + whole[head + (n - 1) * layer : head + n * layer]
    for bad in (0, 7, 2.5, float("nan"), None, [2]):
        assert "layer" in _refused(tabs.explorer.explorer_layer([near.key, bad]))
    for bad in (None, "junk", [near.key], [near.key, 1, 2], {"key": near.key}, ["x" * 22, 1], [7, 1]):
        assert _refused(tabs.explorer.explorer_layer(bad))

    # the analysis replaced on its page: its files go with it (its pictures, the layers written)
    assert len(list(SERVER.explorer_dir.glob(f"{near.key}-*"))) == 4
    other = next(e for e in runtime.EXAMPLES if e != example)
    out = page.on_analyze(other, "shapes_p16", "mean", 0.0, near, progress=_quiet)
    assert not list(SERVER.explorer_dir.glob(f"{near.key}-*")) and SERVER.store.get(near.key) is None
    near = out[page.PAGE.state]
    assert len(list(SERVER.explorer_dir.glob(f"{near.key}-*"))) == 2  # its pictures

    monkeypatch.setattr(cost, "BROWSER_BYTES", head + layer - 1)
    kept = sorted(SERVER.explorer_dir.glob("*"))  # the disk's cap reached: an explorer that writes nothing sweeps nothing
    monkeypatch.setattr(SERVER, "settings", dataclasses.replace(SERVER.settings, explorer_bytes=sum(f.stat().st_size for f in kept)))
    out = page.on_analyze(example, "shapes_p16", "mean", 0.0, progress=_quiet)
    assert sorted(SERVER.explorer_dir.glob("*")) == kept
    far, shown = out[page.PAGE.state], out  # the analysis brings the server's explorer, and its first views
    live = shown[explorer.live["global"]]
    assert live["mode"] == "server" and "too large" in live["note"] and "data" not in live and "base" not in live
    assert shown[explorer.server_explorer]["visible"] is True and shown[explorer.boxes["global"]]["visible"] is True
    exp = SERVER.store.get(far.key)
    assert np.array_equal(np.asarray(shown[explorer.explorer_img]), np.asarray(views.render_query(exp, layer=6, head="mean", query=0, scale="layer")))
    assert np.array_equal(np.asarray(shown[explorer.mosaic]), np.asarray(views.render_head_mosaic(exp, layer=6, query=0, scale="layer")))
    assert "no layer files" in _refused(tabs.explorer.explorer_layer([far.key, 1]))
    assert not list(SERVER.explorer_dir.glob(f"{far.key}-*"))  # not even the pictures


def test_the_explorer_reaches_the_page_with_the_analysis_and_by_no_other_event(app):
    """The explorer's widgets and the server's explorer are outputs of the analysis alone (and of
    the server's views, which draw on its pictures): no step after the analysis sends them."""
    explorer = tabs.explorer.TAB
    live = {id(c) for c in (*explorer.live.values(), *explorer.boxes.values(), explorer.server_explorer)}
    writers = {f.name for f in app.demo.fns.values() if live & {id(c) for c in f.outputs}}
    assert writers == {"on_analyze"}


def test_an_analysis_run_without_a_key_still_brings_its_explorer(app, example):
    """`Server.run` without an explorer key (as a bench or a client's own code may call it): the
    outputs drawn from it bring the explorer, its files named by the key the analysis is kept under."""
    from pathlib import Path

    from vitviz.server.app import SERVER
    from vitviz.server.pictures import explorer_data

    out = page.analysis_outputs(SERVER.run(example, "shapes_p16"), example, None)
    ref, live = out[page.PAGE.state], out[tabs.explorer.TAB.live["global"]]
    assert live["id"] == ref.key and live["mode"] == "stack" and Path(live["data"]).name == f"{ref.key}-stack.bin"
    exp = SERVER.recall(ref)
    assert Path(live["data"]).read_bytes() == explorer_data.stack_file(exp.analysis, range(exp.analysis.attentions.shape[0]))
    SERVER.forget(ref)
    assert not list(SERVER.explorer_dir.glob(f"{ref.key}-*"))  # dropped with the analysis


def test_a_model_the_explorer_cannot_draw_empties_its_widgets(app, example, monkeypatch):
    """An analysis the Explorer tab cannot draw: every widget emptied and the server's explorer hidden;
    its other outputs left as they were, and every other tab drawn."""
    explorer = tabs.explorer.TAB
    monkeypatch.setattr(explorer, "lacks", lambda exp: "no explorer for this model")
    out = page.on_analyze(example, "shapes_p16", "mean", 0.0, progress=_quiet)
    assert out[page.PAGE.notice] == ""
    assert all(out[widget] is None for widget in explorer.live.values()) and out[explorer.server_explorer]["visible"] is False
    assert all(out[c] == gr.skip() for c in (explorer.layer, explorer.head, explorer.query, explorer.explorer_img, explorer.mosaic))
    assert len(out[tabs.predict.TAB.predictions]["value"]) == 5


def _refused(answer) -> str:
    """The reason in `explorer_layer`'s answer to a call asking again would not help."""
    assert isinstance(answer, dict) and answer["busy"] is False and set(answer) == {"error", "busy"}, answer
    return answer["error"]


def test_compare_two_variants(app, example):
    """Two variants side by side: their rollouts as densities on one colour scale by default (a colour
    means the same density in both maps, the page's colour bar says which), each its own on asking;
    their grids and sizes in one table."""
    from vitviz.server.app import SERVER
    from vitviz import plots

    t = tabs.compare.TAB
    out = t.on_compare(example, ["shapes_p16", "shapes_p8"])
    (col1, md1, ro1, bar1), (col2, md2, ro2, bar2), (col3, _, _, _) = t.slots
    assert out[col1]["visible"] and out[col2]["visible"] and not out[col3]["visible"]
    assert "shapes_p16" in out[md1] and "shapes_p8" in out[md2]
    assert out[ro1].size[1] == 384 and out[ro2].size[1] == 384
    assert out[t.compare_notice] == "" and out[t.compare_distance].size[0] > 300
    exps = [SERVER.run(example, name) for name in ("shapes_p16", "shapes_p8")]
    for e in exps:  # a density: each patch's weight times the patch count, so its mean is the query's share on the patches
        a = e.analysis
        assert torch.allclose(views.rollout_density(e).mean(), a.rollout()[0, a.num_prefix_tokens:].sum(), atol=1e-6)
    dens = [views.rollout_density(e) for e in exps]
    top = max(float(d.max()) for d in dens)
    for picture, e, d in zip((out[ro1], out[ro2]), exps, dens):
        assert np.array_equal(np.asarray(picture), np.asarray(plots.overlay(e.display_image, d, vmin=0.0, vmax=top)))
    assert out[bar1] == out[bar2] == "" and f"<span>{plots.tick_label(top)}</span>" in out[t.compare_bar]  # one bar: the shared scale
    table = out[t.compare_table]
    assert "<td>6x6</td>" in table and "<td>12x12</td>" in table and "<td>16 px</td>" in table and "<td>8 px</td>" in table
    # each its own scale: a bar under each map, none shared
    own = t.on_compare(example, ["shapes_p16", "shapes_p8"], "own")
    assert own[t.compare_bar] == "" and f"<span>{plots.tick_label(float(dens[1].max()))}</span>" in own[bar2]
    assert np.array_equal(np.asarray(own[ro2]), np.asarray(plots.overlay(exps[1].display_image, dens[1], vmin=0.0, vmax=float(dens[1].max()))))
    # too few variants, or a scale not offered: only the notice changes, saying why
    out = t.on_compare(example, ["shapes_p16"])
    assert set(out) == {t.compare_notice} and "two or three" in out[t.compare_notice]
    out = t.on_compare(example, ["shapes_p16", "shapes_p8"], "../../etc")
    assert set(out) == {t.compare_notice} and "colour scale" in out[t.compare_notice]


def test_the_compare_picker_puts_what_runs_offline_first_and_names_each_family(app):
    labels = [label for label, _ in tabs.compare.TAB.compare_pick.choices]
    ready = [i for i, label in enumerate(labels) if "needs a download" not in label]
    assert ready == list(range(len(ready))) and len(ready) >= 4  # the embedded models, then the downloads
    assert all(label.split(" — ")[0] in {"Embedded", "torchvision", "timm", "Hugging Face", "OpenCLIP"} for label in labels)
    families = [label.split(" — ")[0] for label in labels[len(ready):]]
    blocks = [f for i, f in enumerate(families) if i == 0 or f != families[i - 1]]
    assert len(blocks) == len(set(blocks)) >= 3  # each family one block


def test_missing_inputs_and_bad_images_change_only_the_notice_and_the_preview(app, tmp_path):
    out = page.on_analyze(None, "shapes_p16", "mean", 0.0, progress=_quiet)
    assert set(out) == {page.PAGE.notice} and "Upload an image" in out[page.PAGE.notice]
    with pytest.raises(gr.Error, match="Analyse an image first"):
        tabs.explorer.TAB.on_view(None, 1, "mean", 0)
    bad = tmp_path / "notes.jpg"
    bad.write_text("this is not a picture")
    out = page.on_analyze(str(bad), "shapes_p16", "mean", 0.0, progress=_quiet)
    assert set(out) == {page.PAGE.notice, page.PAGE.image} and "not an image" in out[page.PAGE.notice] and out[page.PAGE.image] is None


def test_hostile_view_values_get_clear_errors(app, analysed):
    ref = analysed[0]
    for layer, head, query, words in [(0, "mean", 0, "layer"), (7, "mean", 0, "layer"), (float("nan"), "mean", 0, "layer"),
                                      (2.5, "mean", 0, "layer"), (1, "head 4", 0, "head"), (1, "<b>x</b>", 0, "head"),
                                      (1, "mean", -1, "query"), (1, "mean", 37, "query"), (1, "mean", "1e9", "query")]:
        with pytest.raises(gr.Error, match=words):
            tabs.explorer.TAB.on_view(ref, layer, head, query)
    for fusion, ratio in [("median", 0.0), ("mean", 0.99), ("mean", float("inf")), ("mean", "x")]:
        with pytest.raises(gr.Error, match="fusion|discard"):
            tabs.predict.TAB.on_rollout_options(ref, fusion, ratio)
    out = page.on_analyze(runtime.EXAMPLES[0], "vit_x", "mean", 0.0, progress=_quiet)
    assert set(out) == {page.PAGE.notice} and "There is no model called 'vit_x'; did you mean" in out[page.PAGE.notice]


def test_unavailable_weights_are_shown_as_text_and_other_variants_keep_working(app, example, tmp_path, monkeypatch):
    from vitviz.server.app import SERVER
    import urllib.error

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.delenv("VITVIZ_OFFLINE", raising=False)

    def unreachable(url, dst, *args, **kwargs):
        # a reason with angle brackets, which the page would take for an HTML tag
        raise urllib.error.URLError("<proxy> refused the tunnel: 403 <Forbidden>")

    monkeypatch.setattr(torch.hub, "download_url_to_file", unreachable)
    out = page.on_analyze(example, "vit_b_32", "mean", 0.0, progress=_quiet)
    shown = out[page.PAGE.notice]
    # the page reads the notice as HTML: every angle bracket of the message is escaped, and the
    # actionable part (which file, which folder) is all there, the folder named without the server's path
    assert set(out) == {page.PAGE.notice} and "vit_b_32-d86f8d99.pth" in shown and "$TORCH_HOME/hub/checkpoints" in shown
    assert str(tmp_path) not in shown
    text = shown.removeprefix('<div class="vv-error">').removesuffix("</div>")
    assert "<" not in text and ">" not in text
    out = page.on_analyze(example, "shapes_p8", "mean", 0.0, progress=_quiet)
    assert SERVER.store.get(out[page.PAGE.state].key).analysis.variant == "shapes_p8"


def test_variant_menu_says_which_are_ready(app, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    labels = dict((v, k) for k, v in vitviz.server.menus.variant_choices())
    assert "embedded" in labels["shapes_p16"] and "needs a download" in labels["vit_l_16"]


@pytest.fixture(scope="module")
def server(app):
    app.demo.launch(prevent_thread_lock=True, ssr_mode=False, server_name="127.0.0.1", quiet=True, **{
        k: v for k, v in app.LAUNCH_KWARGS.items() if k != "ssr_mode"})
    try:
        yield app.demo.local_url
    finally:
        app.demo.close()


def test_api_analyze_through_gradio_client(server, example):
    from gradio_client import Client, handle_file

    client = Client(server, verbose=False)
    preds, rollout, distance, npz = client.predict(handle_file(example), "shapes_p16", api_name="/analyze")
    assert preds["label"] and len(preds["confidences"]) == 5
    assert Image.open(rollout).size[1] == 384
    assert Image.open(distance).size[0] > 300
    data = np.load(npz)
    assert data["cls_map"].shape == (6, 6) and data["distances"].shape == (6, 3) and "attentions" not in data
    # the same answer as the Python API
    direct = vitviz.analyze(vitviz.load_model("shapes_p16", device="cpu"), example)
    assert preds["label"] == direct.predictions()[0][0]
    assert preds["confidences"][0]["confidence"] == pytest.approx(direct.predictions()[0][1], abs=1e-4)


def test_session_view_changes_through_gradio_client_never_call_the_model(server, example, monkeypatch):
    from gradio_client import Client, handle_file
    from gradio_client.exceptions import AppError

    client = Client(server, verbose=False)
    with pytest.raises(AppError, match="Analyse an image first"):
        client.predict(2, "mean", 0, "each map its own", api_name="/session_view")
    client.predict(handle_file(example), "shapes_p16", "mean", 0.0, api_name="/session_analyze")

    def forbidden(*args, **kwargs):
        raise AssertionError("the model was called for a view change")

    monkeypatch.setattr(ViT, "forward", forbidden)
    monkeypatch.setattr(ViT, "encode", forbidden)
    first, mosaic = client.predict(1, "head 2", 0, "each map its own", api_name="/session_view")
    second, _ = client.predict(1, "head 2", 7, "each map its own", api_name="/session_view")  # the query token counts
    assert not np.array_equal(np.asarray(Image.open(first)), np.asarray(Image.open(second)))
    second, _ = client.predict(6, "mean", 7, "each map its own", api_name="/session_view")
    assert Image.open(first).size[1] == 384 and Image.open(mosaic).format == "JPEG"
    assert np.abs(np.asarray(Image.open(first), dtype=float) - np.asarray(Image.open(second), dtype=float)).mean() > 1
    rollout, _ = client.predict("max", 0.5, api_name="/session_rollout")
    assert Image.open(rollout).size[1] == 384
    # another session has no analysis of its own
    with pytest.raises(AppError, match="Analyse an image first"):
        Client(server, verbose=False).predict(2, "mean", 0, "each map its own", api_name="/session_view")


def test_model_cache_is_bounded():
    from vitviz.server.models import ModelCache

    cache = ModelCache(max_models=2, device="cpu")
    for name in ["shapes_p16", "shapes_p8", "shapes_p16"]:
        cache.get(name)
    assert cache.loaded() == ["shapes_p8", "shapes_p16"]  # least recently used first
    cache.get("shapes_p16@192")  # a third model: the least recently used one goes
    assert cache.loaded() == ["shapes_p16", "shapes_p16@192"]
    cache = ModelCache(max_models=5, max_bytes=3 * 1024**2, device="cpu")  # room for one 2 MB model
    cache.get("shapes_p16")
    cache.get("shapes_p8")
    assert cache.loaded() == ["shapes_p8"]
    model, _ = cache.get("shapes_p8")
    assert cache.get("shapes_p8")[0] is model


def test_output_images_are_lossless_png(app, analysed, tmp_path, monkeypatch):
    rollout = analysed[1][tabs.predict.TAB.rollout_img]["value"]
    out = gradio_io.PngImage()
    monkeypatch.setattr(out, "GRADIO_CACHE", str(tmp_path))
    data = out.postprocess(rollout)
    assert data.path.startswith(str(tmp_path)) and data.path.endswith("shapes_p16-rollout-cls-mean-discard0.png")
    # stored under a keyed hash: not the plain SHA-256 of the bytes anybody could compute
    import hashlib

    assert hashlib.sha256(open(data.path, "rb").read()).hexdigest() not in data.path
    with Image.open(data.path) as back:
        assert back.format == "PNG"
        np.testing.assert_array_equal(np.asarray(back.convert("RGB")), np.asarray(rollout.convert("RGB")))
    assert out.postprocess(None) is None


def test_view_images_are_close_jpeg(app, analysed, tmp_path, monkeypatch):
    explorer = tabs.explorer.TAB.on_view(analysed[0], 3, "head 1", 9)[tabs.explorer.TAB.explorer_img]
    out = gradio_io.ViewImage()
    monkeypatch.setattr(out, "GRADIO_CACHE", str(tmp_path))
    data = out.postprocess(explorer)
    with Image.open(data.path) as back:
        assert back.format == "JPEG"
        diff = np.abs(np.asarray(back.convert("RGB"), dtype=np.int16) - np.asarray(explorer.convert("RGB"), dtype=np.int16))
    assert back.size == explorer.size and diff.mean() < 3 and np.percentile(diff, 99) < 40


@pytest.mark.slow
@pytest.mark.parametrize("name", ["vit_small_patch16_224.dino", "deit_tiny_distilled_patch16_224.fb_in1k",
                                  "vit_small_patch14_reg4_dinov2.lvd142m@224", "vit_small_patch16_dinov3.lvd1689m"])
def test_timm_models_through_the_app(app, example, offline_hub, name):
    """A timm model named in the other-model box, loaded from the hub cache offline: every section
    fills, a feature model says it has no classifier, DeiT shows its distillation map, and the
    registers are prefix tokens of their own."""
    from vitviz.server.app import SERVER
    timm_name = name.split("@")[0]
    out = page.on_other_model(f"timm:{name}", [])
    assert out[page.PAGE.notice] == "" and out[page.PAGE.variant]["value"] == f"timm:{name}"
    assert f"timm:{name}" in [v for _, v in out[tabs.compare.TAB.compare_pick]["choices"]]
    out = page.on_analyze(example, f"timm:{name}", "mean", 0.0, progress=_quiet)
    assert out[page.PAGE.notice] == "", out[page.PAGE.notice]
    exp = SERVER.store.get(out[page.PAGE.state].key)
    a = exp.analysis
    # the model the app ran is the cached one: the same features as timm's own forward
    model = offline_hub[timm_name]
    if "@" in name:  # another image size: the same weights in timm's dynamic-size model
        import timm

        dynamic = timm.create_model(timm_name, pretrained=False, dynamic_img_size=True).eval()
        dynamic.load_state_dict(model.state_dict())
        model = dynamic
    spec = vitviz.get_spec(f"timm:{name}")
    x, _ = vitviz.preprocess(vitviz.load_image(example), spec.preprocessing)
    with torch.inference_mode():
        want = model.forward_features(x.unsqueeze(0))[0]
    assert ((a.tokens - want).abs().max() / want.abs().max()).item() < 1e-4
    if "distilled" not in name:  # DINO and DINOv2: features only
        assert out[tabs.predict.TAB.predictions]["visible"] is False and "no classifier" in out[tabs.predict.TAB.predict_note]
    else:
        assert out[tabs.predict.TAB.predictions]["visible"] is True and len(out[tabs.predict.TAB.predictions]["value"]) == 5
    distilled = "distilled" in name
    assert out[tabs.predict.TAB.dist_rollout_img]["visible"] is distilled
    assert out[tabs.explorer.TAB.prefix_query]["choices"] == list(spec.prefix_names)
    assert out[tabs.explorer.TAB.live["global"]]["prefix"] == list(spec.prefix_names)
    tokens = tabs.tokens.TAB.on_tokens(out[page.PAGE.state], 0.6)
    assert tokens[tabs.tokens.TAB.received_img].size[0] > 300 and tokens[tabs.tokens.TAB.norms_img].size[0] > 300
    if "reg4" in name:
        assert a.prefix_names == ("cls", "reg1", "reg2", "reg3", "reg4") and a.grid == (16, 16)
        view = tabs.explorer.TAB.on_prefix_query(out[page.PAGE.state], 12, "mean", "reg2")
        assert view[tabs.explorer.TAB.query] == 2 and "reg2" in view[tabs.explorer.TAB.query_text]
    # the distance chart and the maps cover patches only
    assert a.distances().shape == (spec.depth, spec.heads)
    assert a.cls_map().shape == a.grid
    # positions: a learned table's similarity, or (DINOv3: none, rotary alone) one rotary table for every head; and for
    # every model the attention each offset received on this image, any layer
    positions = tabs.positions.TAB
    rotary = "dinov3" in name
    assert a.layout.rotary == ("dinov3" if rotary else None) and a.layout.position_embeddings is not rotary
    assert out[positions.similarity_box]["visible"] is not rotary and out[positions.bias_box]["visible"] is rotary
    if rotary:
        assert "rotary" in out[positions.bias_text] and out[positions.bias_layer]["visible"] is False
        assert isinstance(out[positions.bias_img]["value"], Image.Image) and "Every head" in out[positions.bias_text]
        assert a.prefix_names == ("cls", "reg1", "reg2", "reg3", "reg4") and a.grid == (16, 16)
    assert out[positions.offsets_box]["visible"] is True and out[positions.offsets_layer]["value"] == spec.depth
    first = positions.on_offsets_layer(out[page.PAGE.state], 1)[positions.offsets_img]
    assert isinstance(first, Image.Image) and np.asarray(first).std() > 0
    with pytest.raises(gr.Error, match="layer"):
        positions.on_offsets_layer(out[page.PAGE.state], spec.depth + 1)


@pytest.mark.slow
def test_analyze_endpoint_and_compare_with_a_timm_model(app, server, example, offline_hub):
    from gradio_client import Client, handle_file

    client = Client(server, verbose=False)
    preds, rollout, distance, npz = client.predict(handle_file(example), "timm:deit_tiny_distilled_patch16_224.fb_in1k", api_name="/analyze")
    assert len(preds["confidences"]) == 5 and Image.open(rollout).size[1] == 448
    data = np.load(npz)
    assert data["cls_map"].shape == (14, 14) and list(data["prefix_tokens"]) == ["cls", "dist"]
    preds, *_ = client.predict(handle_file(example), "timm:vit_small_patch16_224.dino", api_name="/analyze")
    assert not (preds or {}).get("confidences")  # no classifier, no classes
    # a supervised and a self-supervised model side by side, the same patch size
    out = tabs.compare.TAB.on_compare(example, ["timm:deit_tiny_distilled_patch16_224.fb_in1k", "timm:vit_small_patch16_224.dino"])
    assert out[tabs.compare.TAB.compare_notice] == "" and "no classifier" in out[tabs.compare.TAB.slots[1][1]]


def test_other_model_names_are_checked(app):
    for bad, words in [("", "Choose"), ("timm:no_such_model", "timm knows no model"), ("x" * 300, "200 characters"),
                       ("timm:vit_small_patch16_18x2_224", "blocks of type ParallelThingsBlock"),
                       ("timm:vit_giant_patch14_dinov2.lvd142m", "parameters"), ("timm:vit_giant_patch14_clip_224.laion2b", "parameters"),
                       ("resnet50", "There is no model called 'resnet50': choose one from the menu"),
                       ("/etc/passwd", "'/etc/passwd' is a path, and a model is named"), ("vit_b_99", "did you mean vit_b_32 or vit_b_16")]:
        out = page.on_other_model(bad, [])
        assert set(out) == {page.PAGE.notice} and words in out[page.PAGE.notice], (bad, out[page.PAGE.notice])
        assert "shapes_clip, shapes_swin" not in out[page.PAGE.notice]  # never the whole list


def test_explain_tab_maps_every_method_for_the_picked_class(app, analysed):
    ref, out = analysed
    top = out[tabs.predict.TAB.predictions]["value"]
    label = max(top, key=top.get)
    assert out[tabs.explain.TAB.target_class]["value"] == label and "circle" in out[tabs.explain.TAB.target_class]["choices"]
    got = tabs.explain.TAB.on_explain(ref, label)
    pictures = [got[tabs.explain.TAB.explain_imgs[m]]["value"] for m in vitviz.METHODS]
    assert all(got[tabs.explain.TAB.explain_imgs[m]]["visible"] for m in vitviz.METHODS)
    assert all(p.size[1] == 384 and p.size[0] > 384 for p in pictures)
    assert label in got[tabs.explain.TAB.explain_note]
    # a different class changes the gradient maps but not the class-blind ones
    other = tabs.explain.TAB.on_explain(ref, "circle")
    diff = lambda a, b: np.abs(np.asarray(a, dtype=float) - np.asarray(b, dtype=float)).mean()  # noqa: E731
    assert diff(other[tabs.explain.TAB.explain_imgs["gradient"]]["value"], got[tabs.explain.TAB.explain_imgs["gradient"]]["value"]) > 0.5
    assert diff(other[tabs.explain.TAB.explain_imgs["rollout"]]["value"], got[tabs.explain.TAB.explain_imgs["rollout"]]["value"]) == 0
    # the downloads are named by variant, view, method and class
    assert got[tabs.explain.TAB.explain_imgs["gradient"]]["value"].info["vitviz_name"] == f"shapes_p16-explain-gradient-{label}.png"
    with pytest.raises(gr.Error, match="classes"):
        tabs.explain.TAB.on_explain(ref, "<script>")

    class _Pick:
        value = "circle"

    picked = tabs.explain.TAB.on_pick_class(ref, tabs.explain.EXPLAIN_SCALES[0], _Pick())
    assert picked[tabs.explain.TAB.target_class] == "circle" and picked[page.PAGE.current_tab] == "explain"


def test_faithfulness_tab_measures_every_method_and_a_random_order(app, analysed):
    ref, _ = analysed
    out = tabs.explain.TAB.on_faithfulness(ref, "circle", progress=_quiet)
    rows = {r[0]: (float(r[1]), float(r[2])) for r in out[tabs.explain.TAB.faith_table]["value"]}
    assert set(rows) == {*vitviz.METHODS, "random"}
    assert all(0 <= d <= 1 and 0 <= i <= 1 for d, i in rows.values())
    assert out[tabs.explain.TAB.faith_img].size[0] > 600


def test_tokens_tab(app, analysed):
    ref, _ = analysed
    out = tabs.tokens.TAB.on_tokens(ref, 0.6)
    assert out[tabs.tokens.TAB.received_img].size[0] > 300 and out[tabs.tokens.TAB.norms_img].size[0] > 300
    assert out[tabs.tokens.TAB.dino_img].size[0] > 300 and "PC1" in out[tabs.tokens.TAB.features_text]
    assert out[tabs.tokens.TAB.features_img].size == (384, 384)

    class _Click:
        index = [200, 200]

    sim = tabs.tokens.TAB.on_feature_click(ref, _Click())[tabs.tokens.TAB.similarity_map_img]
    assert sim.size[1] == 384
    with pytest.raises(gr.Error, match="share"):
        tabs.tokens.TAB.on_tokens(ref, 7)
    assert tabs.tokens.TAB.on_dino_share(ref, 0.3)[tabs.tokens.TAB.dino_img].size == out[tabs.tokens.TAB.dino_img].size
    # drawn on demand: choosing the tab draws it, other tabs draw nothing
    class _Tab:
        value = "Tokens"

    assert page.on_tab(_Tab(), ref, "star", tabs.explain.EXPLAIN_SCALES[0], 0.6)[page.PAGE.current_tab] == "tokens"
    assert list(page.on_refresh_tab(ref, "distance", "star", tabs.explain.EXPLAIN_SCALES[0], 0.6)) == [tabs.explain.TAB.explain_note]  # nothing drawn


def test_shared_colour_scale_compares_layers(app, analysed):
    ref, _ = analysed
    a = tabs.explorer.TAB.on_view(ref, 1, "mean", 0, tabs.explorer.SCALES[2])[tabs.explorer.TAB.explorer_img]
    b = tabs.explorer.TAB.on_view(ref, 1, "mean", 0, tabs.explorer.SCALES[1])[tabs.explorer.TAB.explorer_img]
    assert a.info["vitviz_name"].endswith("shared.png") and b.info["vitviz_name"].endswith("map.png")
    assert np.abs(np.asarray(a, dtype=float) - np.asarray(b, dtype=float)).mean() > 1


def test_one_colour_scale_per_layer_serves_map_and_mosaic(app, analysed):
    """"one per layer": the range is the smallest and largest value of any view of that layer (every
    head, the mean and the max, as the browser reads them), worked out here from the attention."""
    from vitviz.server.app import SERVER
    from vitviz.server.pictures import explorer_data, views

    ref, _ = analysed
    exp = SERVER.store.get(ref.key)
    a = exp.analysis
    attn = a.attentions[2, :, 7, a.num_prefix_tokens :].float()  # layer 3, query token 7: [H, M]
    rows = torch.cat([attn, attn.mean(0, keepdim=True), attn.amax(0, keepdim=True)])
    q = torch.floor(rows / rows.amax(1, keepdim=True) * 255 + 0.5)
    vals = q.double() * rows.amax(1, keepdim=True).double() / 255
    lo, hi = views.query_range(exp, query=7, scale="layer", layer=3)
    assert lo == pytest.approx(float(vals.min()), rel=1e-6) and hi == pytest.approx(float(vals.max()), rel=1e-6)
    assert hi == pytest.approx(float(explorer_data.row_values(a, layer=2, head=a.attentions.shape[1] + 1, query=7).max()))
    out = tabs.explorer.TAB.on_view(ref, 3, "head 1", 7, tabs.explorer.SCALES[0])
    mosaic = out[tabs.explorer.TAB.mosaic]
    own = tabs.explorer.TAB.on_view(ref, 3, "head 1", 7, tabs.explorer.SCALES[1])[tabs.explorer.TAB.mosaic]
    # one colour bar to the right of the mosaic on a common scale; none (ranges in the labels) on its own
    assert mosaic.size[0] == own.size[0] + views.plots.COLORBAR_PX
    assert np.abs(np.asarray(mosaic, dtype=float)[:, : own.size[0]] - np.asarray(own, dtype=float)).mean() > 1
    with pytest.raises(gr.Error, match="colour scale"):
        tabs.explorer.TAB.on_view(ref, 1, "mean", 0, "log")


def test_results_say_which_image_and_variant_they_belong_to(app, example, tmp_path):
    from vitviz.server.app import SERVER
    from pathlib import Path

    out = page.on_analyze(example, "shapes_p16", "mean", 0.0, progress=_quiet)
    ref = out[page.PAGE.state]
    assert ref.image == Path(example).name and Path(example).stem in out[page.PAGE.status] and "**shapes_p16**" in out[page.PAGE.status]
    assert out[page.PAGE.results_box]["elem_classes"] == ["vv-results"]
    assert out[page.PAGE.result_thumb] is SERVER.store.get(ref.key).analysis.image  # the thumbnail is the crop this analysis saw
    # a variant that cannot be analysed: the menu goes back, the results are marked as those of their image and variant
    failed = page.on_analyze(example, "shapes_p16@4096", "mean", 0.0, ref, progress=_quiet)
    assert failed[page.PAGE.variant]["value"] == "shapes_p16" and "vv-stale" in failed[page.PAGE.results_box]["elem_classes"]
    assert f"still those of {ref.image} on shapes_p16" in failed[page.PAGE.notice] and "The menu is back on shapes_p16" in failed[page.PAGE.notice]
    # ... and going back to it shows those results again, unmarked, without running the model
    back = page.on_analyze(example, "shapes_p16", "mean", 0.0, ref, progress=_quiet)
    assert back == {page.PAGE.results_box: {"__type__": "update", "elem_classes": ["vv-results"]}}
    # a file that is no image: its broken preview is cleared and the message names it; the menu stays
    bad = tmp_path / "notes.png"
    bad.write_bytes(b"hello, not a picture\n" * 50)
    refused = page.on_analyze(str(bad), "shapes_p16", "mean", 0.0, ref, progress=_quiet)
    assert refused[page.PAGE.image] is None and page.PAGE.variant not in refused and "notes.png:" in refused[page.PAGE.notice]
    assert "vv-stale" in refused[page.PAGE.results_box]["elem_classes"]


def _pictures(outputs) -> list:
    """The PIL pictures among a handler's outputs (as values or as gr.update(value=...))."""
    found = []
    for value in outputs.values():
        if isinstance(value, dict):
            value = value.get("value")
        if isinstance(value, Image.Image):
            found.append(value)
    return found


def test_every_downloadable_figure_keeps_its_text_inside(app, analysed, example):
    """Each picture the page offers for download — every tab, every colour scale, the Compare tab —
    has each of its labels, tick values, titles and legends wholly inside its canvas."""
    from vitviz import plots

    ref, out = analysed
    pictures = _pictures(out)
    pictures += _pictures(tabs.explain.TAB.on_explain(ref, "star"))
    pictures += _pictures(tabs.explain.TAB.on_explain(ref, "star", tabs.explain.EXPLAIN_SCALES[1]))
    pictures += _pictures(tabs.explain.TAB.on_faithfulness(ref, "star", progress=_quiet))
    pictures += _pictures(page.on_refresh_tab(ref, "tokens", "star", tabs.explain.EXPLAIN_SCALES[0], 0.6))
    for scale in tabs.explorer.SCALES:
        pictures += _pictures(tabs.explorer.TAB.on_view(ref, 2, "head 1", 7, scale))
    pictures += _pictures(tabs.compare.TAB.on_compare(example, ["shapes_p16", "shapes_p8"]))
    names = {p.info.get("vitviz_name", "") for p in pictures}
    assert len(pictures) >= 20 and any("attention-received" in n for n in names) and any("faithfulness" in n for n in names)
    with_text = [p for p in pictures if plots.text_boxes(p)]
    assert len(with_text) >= 15  # charts, colour bars and mosaics carry the boxes of what they wrote
    clipped = {p.info.get("vitviz_name", "?"): plots.clipped_text(p) for p in pictures}
    assert not any(clipped.values()), {k: v for k, v in clipped.items() if v}


def test_a_clipped_label_is_found():
    """The check itself: a y label pushed off the left edge, and a tick value past a colour bar's edge."""
    from matplotlib.figure import Figure

    from vitviz import plots

    fig = Figure(figsize=(3, 2), dpi=100)
    fig.subplots_adjust(left=0.01)
    ax = fig.add_subplot()
    ax.plot([1, 2], [1e-3, 2e-3])
    ax.set_ylabel("Share of attention received")
    img = plots.figure_to_image(fig)
    assert any("Share of attention received" in c for c in plots.clipped_text(img))
    bar = plots.with_colorbar(Image.new("RGB", (40, 60)), vmin=0.0, vmax=1.0, label="gradient-weighted-rollout")
    assert plots.clipped_text(bar)
    fine = plots.with_colorbar(Image.new("RGB", (40, 60)), vmin=0.0, vmax=0.5, label="attention")
    assert plots.text_boxes(fine) and not plots.clipped_text(fine)


def test_a_class_picked_during_the_analysis_chain_stays(app, example):
    """The chain after an analysis draws the Explain tab for the class it read when the analysis began;
    a class picked for that analysis meanwhile is newer and stays on the page."""
    from vitviz.server.app import SERVER
    ref = page.on_analyze(example, "shapes_p16", "mean", 0.0, progress=_quiet)[page.PAGE.state]

    class _Pick:
        value = "circle"

    picked = tabs.explain.TAB.on_pick_class(ref, tabs.explain.EXPLAIN_SCALES[0], _Pick())
    assert "circle" in picked[tabs.explain.TAB.explain_note]
    assert list(page.on_refresh_tab(ref, "explain", "star", tabs.explain.EXPLAIN_SCALES[0], 0.6)) == [tabs.explain.TAB.explain_note]  # a skip
    fresh = page.on_analyze(example, "shapes_p16", "mean", 0.0, progress=_quiet)[page.PAGE.state]
    drawn = page.on_refresh_tab(fresh, "explain", "star", tabs.explain.EXPLAIN_SCALES[0], 0.6)  # a new analysis: drawn
    gh, gw = SERVER.store.get(fresh.key).analysis.grid
    for m in tabs.explain.METHODS:
        picture = drawn[tabs.explain.TAB.explain_imgs[m]]["value"]
        assert isinstance(picture, Image.Image) and picture.size[1] >= gh * 8, (m, picture)  # a map drawn, not a placeholder


@pytest.mark.parametrize("change, lacking", [
    (dict(position_embeddings=False), {"positions", "find", "ask"}),  # shapes_p16 has no text tower (Find) and no language model (Ask)
    (dict(classifier=False), {"find", "inside", "patch", "ask"}),  # no class and no phrase: nothing to attribute
])
def test_a_tab_whose_needs_the_model_lacks_says_why_in_place_of_its_content(app, example, monkeypatch, change, lacking):
    """A model without what a tab needs: the tab stays, its content hidden behind the one line
    `layout.lacks` gives; every other tab draws as ever."""
    from vitviz.server.app import SERVER
    import dataclasses

    explore = runtime.views.explore

    def without(*args, **kwargs):
        exp = explore(*args, **kwargs)
        layout = dataclasses.replace(exp.analysis.layout, **change)
        return dataclasses.replace(exp, analysis=dataclasses.replace(exp.analysis, layout=layout))

    monkeypatch.setattr(runtime.views, "explore", without)
    out = page.on_analyze(example, "shapes_p16", "mean", 0.0, progress=_quiet)
    assert out[page.PAGE.notice] == "", out[page.PAGE.notice]
    ref = out[page.PAGE.state]
    layout = SERVER.store.get(ref.key).analysis.layout
    assert [t.id for t in tabs.TABS][:9] == ["predict", "explain", "find", "explorer", "tokens", "distance", "positions", "architecture", "compare"]
    for tab in tabs.TABS:
        note, content = out[tab.gate.note], out[tab.gate.content]
        if tab.id in lacking:
            reason = layout.lacks(tab.needs, name="shapes_p16")
            assert reason and note == {"__type__": "update", "value": reason, "visible": True}, (tab.id, note)
            assert content["visible"] is False, tab.id
            assert all(out[c] == gr.skip() for c in tab.analysis_outputs()), tab.id  # nothing drawn behind it
        else:
            assert note["visible"] is False and content["visible"] is True, tab.id
    assert out[tabs.architecture.TAB.grid_img].size == (384, 384)
    assert len(out[tabs.predict.TAB.predictions]["value"]) == 5
    positions = (out[tabs.positions.TAB.similarity_img], out[tabs.positions.TAB.filters_img])
    assert all(isinstance(p, Image.Image) for p in positions) is ("positions" not in lacking)
    assert isinstance(out[tabs.distance.TAB.distance_img], Image.Image) is ("distance" not in lacking)
    # every layout has a rollout (its drawer's)
    rollout = out[tabs.predict.TAB.rollout_img]
    assert rollout["visible"] is True and isinstance(rollout["value"], Image.Image)
    # the tabs drawn on demand and the explorer's data: drawn only for a model that meets their needs
    tokens_drawn = page.on_refresh_tab(ref, "tokens", "star", tabs.explain.EXPLAIN_SCALES[0], 0.6)
    assert (tabs.tokens.TAB.received_img in tokens_drawn) is ("tokens" not in lacking)
    explained = page.on_refresh_tab(ref, "explain", "star", tabs.explain.EXPLAIN_SCALES[0], 0.6)
    assert (tabs.explain.TAB.explain_imgs["gradient"] in explained) is ("explain" not in lacking)
    if "explorer" in lacking:  # the analysis clears the explorer
        assert out[tabs.explorer.TAB.live["global"]] is None
    else:  # the analysis brought it
        assert out[tabs.explorer.TAB.live["global"]]["id"] == ref.key


def test_the_find_tab_maps_each_phrase_as_the_library_does(app, example):
    """shapes_clip: two phrases give two maps, each the library's own map for that phrase on the
    analysed crop (the same numbers drawn), titled by the phrase and its similarity; the other slots
    hidden. A plain ViT gets the reason instead, and the handler refuses it alike."""
    from vitviz.server.app import SERVER
    find = tabs.find.TAB
    out = page.on_analyze(example, "shapes_clip", "mean", 0.0, progress=_quiet)
    ref = out[page.PAGE.state]
    assert out[find.gate.note]["visible"] is False and out[find.gate.content]["visible"] is True
    got = find.on_find(ref, " a red star ,a blue circle, ", "gradient")
    model = SERVER.cache.get("shapes_clip")[0]
    crop = SERVER.store.get(ref.key).analysis.image
    want = vitviz.explain(model, crop, method="gradient", text=["a red star", "a blue circle"])
    for k, e in enumerate(want):
        slot = got[find.maps[k]]
        assert slot["visible"] and f"“{e.text}” — similarity {e.similarity:.2f}" == slot["label"]
        expected = np.asarray(views_heat(runtime, ref, e.map), dtype=float)  # the overlay, left of the colour bar
        heat = np.asarray(slot["value"], dtype=float)[: expected.shape[0], : expected.shape[1]]
        assert slot["value"].size[0] > expected.shape[1] and np.abs(heat - expected).max() == 0
    assert all(got[m]["visible"] is False for m in find.maps[2:])
    for bad, match in (("", "one or more phrases"), ("a, b, c, d, e", "At most 4"), ("x" * 81, "at most 80"), (None, "one or more")):
        with pytest.raises(gr.Error, match=match):
            find.on_find(ref, bad, "gradient")
    with pytest.raises(gr.Error, match="method must be one of"):
        find.on_find(ref, "a red star", "rollout")  # no phrase in it: not offered here
    plain = page.on_analyze(example, "shapes_p16", "mean", 0.0, progress=_quiet)
    assert "has no text tower" in plain[find.gate.note]["value"] and plain[find.gate.content]["visible"] is False
    with pytest.raises(gr.Error, match="has no text tower"):
        find.on_find(plain[page.PAGE.state], "a red star", "gradient")


def test_an_image_text_model_predicts_zero_shot_and_a_click_on_a_label_finds_it(app, example):
    """shapes_clip's Predict tab shows the zero-shot top-5 over the shapes classes (the library's
    numbers); a click on a label finds its prompt in the Find tab, and the Explain tab stays out of it.
    A classifier's click goes to the Explain tab as before, and the Find tab stays out of that."""
    from vitviz.server.app import SERVER
    find, explain, predict = tabs.find.TAB, tabs.explain.TAB, tabs.predict.TAB
    out = page.on_analyze(example, "shapes_clip", "mean", 0.0, progress=_quiet)
    ref = out[page.PAGE.state]
    model = SERVER.cache.get("shapes_clip")[0]
    want = vitviz.analyze(model, SERVER.store.get(ref.key).analysis.image).predictions(5)
    shown = out[predict.predictions]["value"]
    assert len(want) == 5 and shown == dict(want)
    assert "Zero-shot" in out[predict.predict_note] and "a photo of a {}" in out[predict.predict_note]
    label = want[1][0]
    click = gr.SelectData(None, {"value": {"label": label}, "index": 1, "selected": True})
    assert explain.on_pick_class(ref, tabs.explain.EXPLAIN_SCALES[0], click) == gr.skip()
    got = find.on_pick_label(ref, "gradient", click)
    assert got[find.phrases] == f"a photo of a {label}" and got[page.PAGE.current_tab] == "find"
    e = vitviz.explain(model, SERVER.store.get(ref.key).analysis.image, method="gradient", text=f"a photo of a {label}")
    assert got[find.maps[0]]["label"] == f"“a photo of a {label}” — similarity {e.similarity:.2f}"
    plain = page.on_analyze(example, "shapes_p16", "mean", 0.0, progress=_quiet)[page.PAGE.state]
    assert find.on_pick_label(plain, "gradient", click) == gr.skip()
    assert explain.on_pick_class(plain, tabs.explain.EXPLAIN_SCALES[0], click)[page.PAGE.current_tab] == "explain"


def views_heat(runtime, ref, heat):
    """The picture the views draw for a map of the session's analysis, on its own range."""
    from vitviz.server.app import SERVER
    from vitviz import plots

    exp = SERVER.store.get(ref.key)
    return plots.overlay(exp.display_image, heat)


def test_a_second_image_on_the_same_model_sends_what_changes_and_gradio_would_send_the_same(app, example, monkeypatch):
    """A new image on the model already shown leaves what the model decides (which tabs show, the
    menus' choices, the sliders' bounds) as it is; the page's outputs pass through `GuardedBlocks`,
    which does not rebuild a component left as it is, and gives Gradio's own answer for every output."""
    import asyncio
    import copy

    from gradio.state_holder import SessionState

    demo = app.demo
    fn = next(f for f in demo.fns.values() if f.name == "on_analyze")
    first = page.on_analyze(example, "shapes_p16", "mean", 0.0, progress=_quiet)
    second = page.on_analyze(runtime.EXAMPLES[1], "shapes_p16", "mean", 0.0, first[page.PAGE.state], progress=_quiet)
    other = page.on_analyze(runtime.EXAMPLES[1], "shapes_p8", "mean", 0.0, second[page.PAGE.state], progress=_quiet)
    skip = gr.skip()
    for g in page.PAGE.gates:
        assert second[g.note] == skip and second[g.content] == skip and other[g.content] != skip
    ex = tabs.explorer.TAB
    assert second[ex.layer] == 6 and second[ex.head] == "mean" and other[ex.layer]["__type__"] == "update"
    rebuilt = []
    original = SessionState._update_config
    monkeypatch.setattr(SessionState, "_update_config", lambda self, i: (rebuilt.append(i), original(self, i))[1])
    for out in (first, second, other):
        theirs = {k: copy.deepcopy(v) if isinstance(v, dict) else v for k, v in out.items()}
        updates = sum(1 for v in out.values() if isinstance(v, dict) and v.get("__type__") == "update" and v != skip)
        rebuilt.clear()
        mine = asyncio.run(demo.postprocess_data(fn, dict(out), SessionState(demo)))
        assert len(rebuilt) == updates  # only the components whose properties change are built again
        assert mine == asyncio.run(gr.Blocks.postprocess_data(demo, fn, theirs, SessionState(demo)))
    assert len([v for v in second.values() if v == skip]) > 20


def test_an_image_text_models_explain_tab_has_no_empty_frame_and_no_faithfulness(app, example):
    """shapes_clip has no classifier: its Explain tab draws the two maps that need no class and hides
    the other frames (the note says why) and the faithfulness controls; a classifier after it gets
    them all back."""
    explain = tabs.explain.TAB
    out = page.on_analyze(example, "shapes_clip", "mean", 0.0, progress=_quiet)
    for control in (explain.faith_button, explain.faith_stop, explain.faith_img, explain.faith_table):
        assert out[control]["visible"] is False
    got = explain.on_explain(out[page.PAGE.state], None)
    shown = {m for m in tabs.explain.METHODS if got[explain.explain_imgs[m]]["visible"]}
    assert shown == {"attention", "rollout"} and all(isinstance(got[explain.explain_imgs[m]]["value"], Image.Image) for m in shown)
    assert all(got[explain.explain_imgs[m]]["value"] is None for m in set(tabs.explain.METHODS) - shown)
    assert "has no classifier" in got[explain.explain_note]
    out = page.on_analyze(example, "shapes_p16", "mean", 0.0, progress=_quiet)
    assert all(out[c]["visible"] is True for c in (explain.faith_button, explain.faith_stop, explain.faith_img))
    assert out[explain.faith_table]["visible"] is False  # a table shows with its rows, once measured
    got = explain.on_explain(out[page.PAGE.state], "star")
    assert all(got[explain.explain_imgs[m]]["visible"] for m in tabs.explain.METHODS)


def test_a_copy_of_the_pages_config_keeps_the_one_server(app, analysed):
    """Gradio deep-copies the page's config for every /config request and each new session's
    stateful components, with what they hold (bound methods of the tabs and the server, such as the
    state's `delete_callback`): the copy shares the server, its models and the analyses kept, rather
    than copying them (16 clients at once each waited 9 s for /config that way)."""
    import copy

    from vitviz.server.app import SERVER

    assert len(SERVER.store) > 0  # an analysis kept: a copy of the store would copy it
    memo: dict = {}
    copy.deepcopy(app.demo.config, memo)
    assert id(SERVER.store) not in memo and id(SERVER.cache) not in memo
    callback = copy.deepcopy({"delete_callback": page.PAGE.state.delete_callback})["delete_callback"]
    assert callback.__self__ is SERVER
    assert copy.deepcopy(SERVER) is SERVER and copy.copy(SERVER) is SERVER


def test_the_explorer_tab_builds_every_registered_widget(app):
    """One column and widget for each registered explorer widget, with its element id and script;
    only a widget that calls the server has the server's functions."""
    from vitviz.server.pictures import drawers

    explorer = tabs.explorer.TAB
    assert list(explorer.live) == list(explorer.boxes) == [w.name for w in drawers.widgets()]
    for w in drawers.widgets():
        live = explorer.live[w.name]
        assert live.elem_id == w.elem_id and live.js_on_load == w.files["js"]
        assert sorted(f.__name__ for f in live.server_fns) == (["explorer_early", "explorer_layer"] if w.server_calls else [])


@pytest.mark.parametrize("height, width", [(150, 300), (16, 4000), (4000, 16)])
def test_an_image_of_any_aspect_ratio_is_drawn_in_its_shape(app, tmp_path, height, width):
    """shapes_p16 fed whole images ("@whole"): a 2:1 image and two of 1:250 (one row or one column of
    patches) analysed, every tab drawn, each map of the image's shape (a colour bar beside it, the
    bar's room kept beneath a very wide one)."""
    path = tmp_path / "any.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (height, width, 3), dtype=np.uint8)).save(path)
    out = page.on_analyze(str(path), "shapes_p16@whole", "mean", 0.0, progress=_quiet)
    ref = out[page.PAGE.state]
    assert out[page.PAGE.notice] == ""
    grid = {(150, 300): (4, 8), (16, 4000): (1, 36), (4000, 16): (36, 1)}[(height, width)]
    exp = page.PAGE.server.recall(ref)
    assert exp.analysis.grid == grid and exp.display_image.size[0] * grid[0] == exp.display_image.size[1] * grid[1]
    pictures = _pictures(out)
    for tab in ("tokens", "explain", "inside"):
        pictures += _pictures(page.on_refresh_tab(ref, tab, "star", tabs.explain.EXPLAIN_SCALES[0], 0.6))
    pictures += _pictures(tabs.explain.TAB.on_faithfulness(ref, "star", progress=_quiet))
    for scale in tabs.explorer.SCALES:
        pictures += _pictures(tabs.explorer.TAB.on_view(ref, 2, "head 1", 1, scale))
    assert len(pictures) >= 15
    rollout = out[tabs.predict.TAB.rollout_img]["value"]
    shown = exp.display_image.size
    from vitviz.plots import COLORBAR_PX

    assert rollout.size == (shown[0] + COLORBAR_PX, max(shown[1], 112))  # the map, its colour bar beside it (112 px at least)
    below = np.asarray(rollout)[shown[1] :, : shown[0]]
    assert below.size == 0 or (below == 255).all()  # white beneath a map too short for the bar


def test_an_analysis_whose_pictures_fail_leaves_the_previous_one_on_the_page(app, example, monkeypatch):
    """A tab that cannot draw the new analysis (a disk full while the explorer's files are written):
    the session's previous analysis stays kept, and the new one's files go."""
    from vitviz.server.app import SERVER

    first = page.on_analyze(example, "shapes_p16", "mean", 0.0, progress=_quiet)[page.PAGE.state]
    written: list[str] = []
    drawn = tabs.explorer.TAB.analysed

    def full(done):
        drawn(done)  # its files written, then the disk is full
        written.append(done.exp.key)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tabs.explorer.TAB, "analysed", full)
    with pytest.raises(OSError):
        page.on_analyze(runtime.EXAMPLES[1], "shapes_p16", "mean", 0.0, first, progress=_quiet)
    assert SERVER.store.get(first.key) is not None and SERVER.recall(first).analysis.variant == "shapes_p16"
    assert written and SERVER.store.get(written[0]) is None and not list(SERVER.explorer_dir.glob(f"{written[0]}-*"))
    assert list(SERVER.explorer_dir.glob(f"{first.key}-*"))


def test_a_float16_export_holds_the_bits_numpy_writes_below_the_normal_range(tmp_path):
    """An export whose attention is saved in float16 (over 64 MB in float32) holds the same bits as
    numpy's conversion gives, where a sink leaves most of the other weights below float16's normal
    range (the outlier model at 288 pixels: half of them subnormal or zero in float16)."""
    from vitviz.cost import export_plan
    from vitviz.server.models import ModelCache
    from vitviz.server.pictures import views

    exp = views.explore(ModelCache(), str(vitviz.sources.assets_dir() / "examples" / "star.png"), "shapes_p8_outliers@288")
    assert export_plan(exp.facts.spec)["attention_dtype"] == "float16"
    data = np.load(views.write_npz(exp, tmp_path / "a.npz"))
    numpy_bits = exp.analysis.attentions.numpy().astype(np.float16)
    assert data["attentions"].dtype == np.float16 and np.array_equal(data["attentions"].view(np.uint16), numpy_bits.view(np.uint16))
    assert (np.abs(numpy_bits) < np.finfo(np.float16).smallest_normal).mean() > 0.4
