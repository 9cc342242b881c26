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


@pytest.fixture(scope="module")
def analysed(app, example):
    return app.on_analyze(example, "shapes_p16", "mean", 0.0, progress=lambda *a, **k: None)


class _Click:
    def __init__(self, x, y):
        self.index = [x, y]


def test_analyze_fills_every_section(app, analysed):
    (exp, preds, rollout, layer_upd, head_upd, query, query_text, explorer, mosaic, distance,
     similarity, filters, grid, table, npz, status) = analysed
    assert len(preds) == 5 and abs(sum(preds.values()) - 1) < 0.5
    assert rollout.size == (384, 384) and explorer.size == (384, 384)
    assert layer_upd["maximum"] == 6 and head_upd["choices"][:3] == ["mean", "max", "head 1"]
    assert query == 0 and "cls" in query_text
    assert mosaic.size[0] > 160 and distance.size[0] > 300
    assert similarity.size[0] > 300 and filters.size[0] > 100 and grid.size == (384, 384)
    assert table[0][0].startswith("Input image") and table[-1][0] == "Classification head"
    assert npz is None  # written on demand
    data = np.load(app.on_export(exp))
    assert data["attentions"].shape == (6, 3, 37, 37) and data["cls_map"].shape == (6, 6)
    np.testing.assert_allclose(data["rollout"].sum(-1), 1, atol=1e-5)
    assert "shapes_p16" in status


def test_view_changes_never_call_the_model(app, analysed, monkeypatch):
    exp = analysed[0]

    def forbidden(*args, **kwargs):
        raise AssertionError("the model was called for a view change")

    monkeypatch.setattr(ViT, "forward", forbidden)
    monkeypatch.setattr(vitviz.pipeline, "analyze", forbidden)
    before = exp.analysis.attentions.clone()
    m1, _ = app.on_view(exp, 1, "head 2", 0)
    m2, _ = app.on_view(exp, 6, "max", 0)
    assert np.abs(np.asarray(m1, dtype=float) - np.asarray(m2, dtype=float)).sum() > 0
    rollout, new_exp = app.on_rollout_options(exp, "min", 0.5)
    assert new_exp.analysis.head_fusion == "min" and new_exp.analysis.attentions is exp.analysis.attentions
    q, text, clicked, _ = app.on_click(exp, 6, "mean", _Click(383, 0))  # top-right patch
    assert q == 1 + 5 and "row 1, column 6" in text
    q, text, _, _ = app.on_cls_query(exp, 6, "mean")
    assert q == 0
    torch.testing.assert_close(exp.analysis.attentions, before)


def test_clicking_a_patch_changes_the_explorer_map(app, analysed):
    exp = analysed[0]
    _, _, a, _ = app.on_click(exp, 3, "mean", _Click(10, 10))
    _, _, b, _ = app.on_click(exp, 3, "mean", _Click(300, 300))
    assert np.abs(np.asarray(a, dtype=float) - np.asarray(b, dtype=float)).mean() > 1


def test_compare_two_variants(app, example):
    out = app.on_compare(example, ["shapes_p16", "shapes_p8"])
    assert len(out) == 3 * 4 + 1
    assert out[0]["visible"] and out[4]["visible"] and not out[8]["visible"]
    assert "shapes_p16" in out[1] and "shapes_p8" in out[5]
    assert out[2].size == (384, 384) and out[6].size == (384, 384)
    with pytest.raises(gr.Error, match="two or three"):
        app.on_compare(example, ["shapes_p16"])


def test_missing_inputs_and_bad_images_are_clear_errors(app, tmp_path):
    with pytest.raises(gr.Error, match="Upload an image"):
        app.on_analyze(None, "shapes_p16", "mean", 0.0, progress=lambda *a, **k: None)
    with pytest.raises(gr.Error, match="Analyse an image first"):
        app.on_view(None, 1, "mean", 0)
    bad = tmp_path / "notes.jpg"
    bad.write_text("this is not a picture")
    with pytest.raises(gr.Error, match="not an image"):
        app.on_analyze(str(bad), "shapes_p16", "mean", 0.0, progress=lambda *a, **k: None)


def test_unavailable_weights_are_shown_and_other_variants_keep_working(app, example, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv("VITVIZ_OFFLINE", "1")
    with pytest.raises(gr.Error, match="vit_b_32-d86f8d99.pth"):
        app.on_analyze(example, "vit_b_32", "mean", 0.0, progress=lambda *a, **k: None)
    out = app.on_analyze(example, "shapes_p8", "mean", 0.0, progress=lambda *a, **k: None)
    assert out[0].analysis.variant == "shapes_p8"


def test_variant_menu_says_which_are_ready(app, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    labels = dict((v, k) for k, v in vitviz.explorer.variant_choices())
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
    assert preds["label"] == direct.predictions[0][0]
    assert preds["confidences"][0]["confidence"] == pytest.approx(direct.predictions[0][1], abs=1e-4)


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
    monkeypatch.setattr(vitviz.pipeline, "analyze", forbidden)
    first, mosaic = client.predict(1, "head 2", 0, api_name="/session_view")
    second, _ = client.predict(6, "mean", 7, api_name="/session_view")
    assert Image.open(first).size == (384, 384) and Image.open(mosaic).format == "JPEG"
    assert np.abs(np.asarray(Image.open(first), dtype=float) - np.asarray(Image.open(second), dtype=float)).mean() > 1
    rollout = client.predict("max", 0.5, api_name="/session_rollout")
    assert Image.open(rollout).size == (384, 384)
    # another session has no analysis of its own
    with pytest.raises(AppError, match="Analyse an image first"):
        Client(server, verbose=False).predict(2, "mean", 0, api_name="/session_view")


def test_model_cache_is_bounded():
    from vitviz.explorer import ModelCache

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
    rollout = analysed[2]
    out = app.PngImage()
    monkeypatch.setattr(out, "GRADIO_CACHE", str(tmp_path))
    data = out.postprocess(rollout)
    assert data.path.startswith(str(tmp_path)) and data.path.endswith(".png")
    with Image.open(data.path) as back:
        assert back.format == "PNG"
        np.testing.assert_array_equal(np.asarray(back.convert("RGB")), np.asarray(rollout.convert("RGB")))
    assert out.postprocess(None) is None


def test_view_images_are_close_jpeg(app, analysed, tmp_path, monkeypatch):
    explorer = analysed[7]
    out = app.ViewImage()
    monkeypatch.setattr(out, "GRADIO_CACHE", str(tmp_path))
    data = out.postprocess(explorer)
    with Image.open(data.path) as back:
        assert back.format == "JPEG"
        diff = np.abs(np.asarray(back.convert("RGB"), dtype=np.int16) - np.asarray(explorer.convert("RGB"), dtype=np.int16))
    assert back.size == explorer.size and diff.mean() < 3 and np.percentile(diff, 99) < 40
