"""The app's handlers called directly, and the /analyze endpoint through gradio_client."""


import gradio as gr
import numpy as np
import pytest
import torch
from PIL import Image

import vitviz
from vitviz.model import ViT


@pytest.fixture(scope="module")
def app():
    import app as app_module

    return app_module


@pytest.fixture(scope="module")
def example(app):
    assert app.EXAMPLES, "assets/examples must hold example images"
    return app.EXAMPLES[0]


def _quiet(*args, **kwargs):
    pass


@pytest.fixture(scope="module")
def analysed(app, example):
    out = app.on_analyze(example, "shapes_p16", "mean", 0.0, progress=_quiet)
    return out[app.state], out


class _Click:
    def __init__(self, x, y):
        self.index = [x, y]


def test_analyze_fills_every_section(app, analysed):
    ref, out = analysed
    assert set(out) == set(app.analysis_outputs)
    preds, rollout, explorer, mosaic = out[app.predictions], out[app.rollout_img], out[app.explorer_img], out[app.mosaic]
    layer_upd, head_upd, query, query_text = out[app.layer], out[app.head], out[app.query], out[app.query_text]
    distance, similarity, filters, grid = out[app.distance_img], out[app.similarity_img], out[app.filters_img], out[app.grid_img]
    table, npz, status = out[app.table], out[app.npz], out[app.status]
    assert out[app.notice] == ""
    assert len(preds) == 5 and abs(sum(preds.values()) - 1) < 0.5
    assert rollout.size == (384, 384) and explorer.size == (384, 384)
    assert layer_upd["maximum"] == 6 and head_upd["choices"][:3] == ["mean", "max", "head 1"]
    assert query == 0 and "cls" in query_text
    assert mosaic.size[0] > 160 and distance.size[0] > 300
    assert similarity.size[0] > 300 and filters.size[0] > 100 and grid.size == (384, 384)
    assert table[0][0].startswith("Input image") and table[-1][0] == "Classification head"
    assert npz is None  # written on demand
    data = np.load(app.on_export(ref)[app.npz])
    assert data["attentions"].shape == (6, 3, 37, 37) and data["cls_map"].shape == (6, 6)
    np.testing.assert_allclose(data["rollout"].sum(-1), 1, atol=1e-5)
    assert "shapes_p16" in status


def test_view_changes_never_call_the_model(app, analysed, monkeypatch):
    ref = analysed[0]
    exp = app.STORE.get(ref.key)

    def forbidden(*args, **kwargs):
        raise AssertionError("the model was called for a view change")

    monkeypatch.setattr(ViT, "forward", forbidden)
    monkeypatch.setattr(ViT, "encode", forbidden)
    before = exp.analysis.attentions.clone()
    m1 = app.on_view(ref, 1, "head 2", 0)[app.explorer_img]
    m2 = app.on_view(ref, 6, "max", 0)[app.explorer_img]
    assert np.abs(np.asarray(m1, dtype=float) - np.asarray(m2, dtype=float)).sum() > 0
    r1 = app.on_rollout_options(ref, "min", 0.5)[app.rollout_img]
    r2 = app.on_rollout_options(ref, "mean", 0.0)[app.rollout_img]
    assert np.abs(np.asarray(r1, dtype=float) - np.asarray(r2, dtype=float)).sum() > 0
    assert app.STORE.get(ref.key) is exp  # nothing derived is stored
    out = app.on_click(ref, 6, "mean", _Click(383, 0))  # top-right patch
    assert out[app.query] == 1 + 5 and "row 1, column 6" in out[app.query_text]
    assert set(out) == {app.query, app.query_text, app.explorer_img, app.mosaic}
    assert app.on_cls_query(ref, 6, "mean")[app.query] == 0
    torch.testing.assert_close(exp.analysis.attentions, before)


def test_clicking_a_patch_changes_the_explorer_map(app, analysed):
    ref = analysed[0]
    a = app.on_click(ref, 3, "mean", _Click(10, 10))[app.explorer_img]
    b = app.on_click(ref, 3, "mean", _Click(300, 300))[app.explorer_img]
    assert np.abs(np.asarray(a, dtype=float) - np.asarray(b, dtype=float)).mean() > 1


def test_compare_two_variants(app, example):
    out = app.on_compare(example, ["shapes_p16", "shapes_p8"])
    (col1, md1, ro1, _), (col2, md2, ro2, _), (col3, _, _, _) = app.slots
    assert out[col1]["visible"] and out[col2]["visible"] and not out[col3]["visible"]
    assert "shapes_p16" in out[md1] and "shapes_p8" in out[md2]
    assert out[ro1].size == (384, 384) and out[ro2].size == (384, 384)
    assert out[app.compare_notice] == "" and out[app.compare_distance].size[0] > 300
    # too few variants: only the notice changes, saying why
    out = app.on_compare(example, ["shapes_p16"])
    assert set(out) == {app.compare_notice} and "two or three" in out[app.compare_notice]


def test_missing_inputs_and_bad_images_change_only_the_notice(app, tmp_path):
    out = app.on_analyze(None, "shapes_p16", "mean", 0.0, progress=_quiet)
    assert set(out) == {app.notice} and "Upload an image" in out[app.notice]
    with pytest.raises(gr.Error, match="Analyse an image first"):
        app.on_view(None, 1, "mean", 0)
    bad = tmp_path / "notes.jpg"
    bad.write_text("this is not a picture")
    out = app.on_analyze(str(bad), "shapes_p16", "mean", 0.0, progress=_quiet)
    assert set(out) == {app.notice} and "not an image" in out[app.notice]


def test_hostile_view_values_get_clear_errors(app, analysed):
    ref = analysed[0]
    for layer, head, query, words in [(0, "mean", 0, "layer"), (7, "mean", 0, "layer"), (float("nan"), "mean", 0, "layer"),
                                      (2.5, "mean", 0, "layer"), (1, "head 4", 0, "head"), (1, "<b>x</b>", 0, "head"),
                                      (1, "mean", -1, "query"), (1, "mean", 37, "query"), (1, "mean", "1e9", "query")]:
        with pytest.raises(gr.Error, match=words):
            app.on_view(ref, layer, head, query)
    for fusion, ratio in [("median", 0.0), ("mean", 0.99), ("mean", float("inf")), ("mean", "x")]:
        with pytest.raises(gr.Error, match="fusion|discard"):
            app.on_rollout_options(ref, fusion, ratio)
    out = app.on_analyze(app.EXAMPLES[0], "vit_x", "mean", 0.0, progress=_quiet)
    assert set(out) == {app.notice} and "unknown variant" in out[app.notice]


def test_unavailable_weights_are_shown_as_text_and_other_variants_keep_working(app, example, tmp_path, monkeypatch):
    import urllib.error

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.delenv("VITVIZ_OFFLINE", raising=False)

    def unreachable(url, dst, *args, **kwargs):
        # a reason with angle brackets, which the page would take for an HTML tag
        raise urllib.error.URLError("<proxy> refused the tunnel: 403 <Forbidden>")

    monkeypatch.setattr(torch.hub, "download_url_to_file", unreachable)
    out = app.on_analyze(example, "vit_b_32", "mean", 0.0, progress=_quiet)
    shown = out[app.notice]
    # the page reads the notice as HTML: every angle bracket of the message is escaped, and the
    # actionable part (which file, which folder) is all there
    assert set(out) == {app.notice} and "vit_b_32-d86f8d99.pth" in shown and str(tmp_path / "torch") in shown
    text = shown.removeprefix('<div class="vv-error">').removesuffix("</div>")
    assert "<" not in text and ">" not in text
    out = app.on_analyze(example, "shapes_p8", "mean", 0.0, progress=_quiet)
    assert app.STORE.get(out[app.state].key).analysis.variant == "shapes_p8"


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
    assert Image.open(rollout).size == (384, 384)
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
        client.predict(2, "mean", 0, api_name="/session_view")
    client.predict(handle_file(example), "shapes_p16", "mean", 0.0, api_name="/session_analyze")

    def forbidden(*args, **kwargs):
        raise AssertionError("the model was called for a view change")

    monkeypatch.setattr(ViT, "forward", forbidden)
    monkeypatch.setattr(ViT, "encode", forbidden)
    first, mosaic = client.predict(1, "head 2", 0, api_name="/session_view")
    second, _ = client.predict(1, "head 2", 7, api_name="/session_view")  # the query token counts
    assert not np.array_equal(np.asarray(Image.open(first)), np.asarray(Image.open(second)))
    second, _ = client.predict(6, "mean", 7, api_name="/session_view")
    assert Image.open(first).size == (384, 384) and Image.open(mosaic).format == "JPEG"
    assert np.abs(np.asarray(Image.open(first), dtype=float) - np.asarray(Image.open(second), dtype=float)).mean() > 1
    rollout = client.predict("max", 0.5, api_name="/session_rollout")
    assert Image.open(rollout).size == (384, 384)
    # another session has no analysis of its own
    with pytest.raises(AppError, match="Analyse an image first"):
        Client(server, verbose=False).predict(2, "mean", 0, api_name="/session_view")


def test_model_cache_is_bounded():
    from vitviz.server.models import ModelCache

    cache = ModelCache(max_models=2, device="cpu")
    for name in ["shapes_p16", "shapes_p8", "shapes_p16", "shapes_p8"]:
        cache.get(name)
    assert cache.loaded() == ["shapes_p16", "shapes_p8"]
    cache = ModelCache(max_models=5, max_bytes=3 * 1024**2, device="cpu")  # room for one 2 MB model
    cache.get("shapes_p16")
    cache.get("shapes_p8")
    assert cache.loaded() == ["shapes_p8"]
    model, _ = cache.get("shapes_p8")
    assert cache.get("shapes_p8")[0] is model


def test_output_images_are_lossless_png(app, analysed, tmp_path, monkeypatch):
    rollout = analysed[1][app.rollout_img]
    out = app.PngImage()
    monkeypatch.setattr(out, "GRADIO_CACHE", str(tmp_path))
    data = out.postprocess(rollout)
    assert data.path.startswith(str(tmp_path)) and data.path.endswith(".png")
    # stored under a keyed hash: not the plain SHA-256 of the bytes anybody could compute
    import hashlib

    assert hashlib.sha256(open(data.path, "rb").read()).hexdigest() not in data.path
    with Image.open(data.path) as back:
        assert back.format == "PNG"
        np.testing.assert_array_equal(np.asarray(back.convert("RGB")), np.asarray(rollout.convert("RGB")))
    assert out.postprocess(None) is None


def test_view_images_are_close_jpeg(app, analysed, tmp_path, monkeypatch):
    explorer = analysed[1][app.explorer_img]
    out = app.ViewImage()
    monkeypatch.setattr(out, "GRADIO_CACHE", str(tmp_path))
    data = out.postprocess(explorer)
    with Image.open(data.path) as back:
        assert back.format == "JPEG"
        diff = np.abs(np.asarray(back.convert("RGB"), dtype=np.int16) - np.asarray(explorer.convert("RGB"), dtype=np.int16))
    assert back.size == explorer.size and diff.mean() < 3 and np.percentile(diff, 99) < 40
