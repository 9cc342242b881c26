"""The Patch tab: the corrupted copy of the analysed crop (a patch covered, two swapped, a second
upload), both maps equal to the library's activation patching (`vitviz.patching.patch`) on the same
images, a click on a cell the library's one patched forward (`patched_logits`), a request over the
server's bound refused in one sentence, and junk from a client refused, through the handlers and
through raw HTTP."""

import uuid

import gradio as gr
import numpy as np
import pytest
import torch

from conftest import analyse_example
from vitviz.patching import patch, patched_logits
from vitviz.preprocess import to_input

COVERED = (4, 3)  # 1-based (row, column): covering it turns shapes_p16's arrow into another class
SWAPPED = ((4, 3), (1, 1))


@pytest.fixture(scope="module")
def app():
    global page, runtime, tabs, plots, patch_maps
    from vitviz import plots
    from vitviz.server import app as app_module, page, runtime, tabs
    from vitviz.server.pictures import patch_maps
    return app_module



@pytest.fixture(scope="module")
def analysed(app):
    return analyse_example()


@pytest.fixture(scope="module")
def patched(analysed):
    """The tab's patching of the arrow with one patch covered: (its outputs, the kept record)."""
    from vitviz.server.app import SERVER

    ref = analysed[0]
    tab = tabs.patch.TAB
    out = tab.on_patch(ref, "cover", *COVERED, 1, 1, None, tabs.patch.AUTO, None)
    return out, SERVER.store.get(out[tab.held].key)


class _Click:
    def __init__(self, x, y):
        self.index = [x, y]


def _differing_patches(a, b, patch_size: int) -> set[tuple[int, int]]:
    """The (row, col) of every patch where two equal-size pictures differ."""
    diff = np.any(np.asarray(a, dtype=np.int16) != np.asarray(b, dtype=np.int16), axis=-1)
    rows, cols = np.nonzero(diff)
    return {(int(r) // patch_size, int(c) // patch_size) for r, c in zip(rows, cols)}


def test_the_tab_shows_the_analysed_crop_and_a_covered_copy_after_an_analysis(analysed):
    ref, exp, model, out = analysed
    tab = tabs.patch.TAB
    a = exp.analysis
    assert out[tab.mode] == "cover" and out[tab.tokens_img]["visible"] is False and out[tab.top5]["visible"] is False
    assert out[tab.target]["choices"][0] == (tabs.patch.AUTO, tabs.patch.AUTO) and len(out[tab.target]["choices"]) == 1 + len(a.categories)
    clean, corrupt = out[tab.clean_img], out[tab.corrupt_img]["value"]
    assert clean.size == corrupt.size == exp.display_image.size
    side = a.patch_size * exp.scale
    first = (out[tab.row]["value"] - 1, out[tab.col]["value"] - 1)
    assert _differing_patches(clean, corrupt, side) == {first}


@pytest.mark.parametrize("mode, cells", [("cover", (COVERED,)), ("swap", SWAPPED)])
def test_cover_and_swap_change_only_those_patches(analysed, mode, cells):
    ref, exp, model, _ = analysed
    tab = tabs.patch.TAB
    a = exp.analysis
    second = cells[1] if len(cells) > 1 else (1, 1)
    shown = tab.on_patch_edit(ref, mode, *cells[0], *second)
    assert shown[tab.second_box]["visible"] is (mode == "swap") and shown[tab.upload]["visible"] is False
    want = {(r - 1, c - 1) for r, c in cells}
    assert _differing_patches(shown[tab.clean_img], shown[tab.corrupt_img]["value"], a.patch_size * exp.scale) == want
    # the crop the model is fed: the same patches changed, nothing else
    from vitviz.server.app import SERVER

    out = tab.on_patch(ref, mode, *cells[0], *second, None, tabs.patch.AUTO, None)
    corrupt = SERVER.store.get(out[tab.held].key).corrupt
    assert corrupt.size == a.image.size
    assert _differing_patches(a.image.convert("RGB"), corrupt, a.patch_size) == want
    if mode == "swap":
        (r1, c1), (r2, c2) = [(r - 1, c - 1) for r, c in cells]
        p = a.patch_size
        before, after = np.asarray(a.image.convert("RGB")), np.asarray(corrupt)
        assert (after[r1 * p:(r1 + 1) * p, c1 * p:(c1 + 1) * p] == before[r2 * p:(r2 + 1) * p, c2 * p:(c2 + 1) * p]).all()
    else:
        r, c = cells[0][0] - 1, cells[0][1] - 1
        block = np.asarray(corrupt)[r * 16:(r + 1) * 16, c * 16:(c + 1) * 16]
        assert (block == 128).all()  # shapes_p16's mean colour: what the model reads as zeros


def test_both_maps_are_the_librarys_patching_of_the_same_images(analysed, patched):
    ref, exp, model, _ = analysed
    out, kept = patched
    tab = tabs.patch.TAB
    a = exp.analysis
    pre = model.spec.preprocessing
    want = patch(model, to_input(a.image, pre), to_input(kept.corrupt, pre), where=("resid_pre", "head"))
    got = kept.result
    assert got.maps["resid_pre"].shape == (6, 37) and got.maps["head"].shape == (6, 3)
    for kind in ("resid_pre", "head"):
        torch.testing.assert_close(got.maps[kind], want.maps[kind], atol=1e-5, rtol=1e-4)
    assert (got.target, got.other) == (want.target, want.other) and got.label != got.other_label
    # the embedding at the covered patch is the whole difference (the rest of the images is the same); by
    # the last block's input the cls token carries nearly all of it
    n = 1 + (COVERED[0] - 1) * 6 + COVERED[1] - 1
    assert float(got.maps["resid_pre"][0, n]) == pytest.approx(1.0, abs=1e-4)
    assert float(got.maps["resid_pre"][-1, 0]) > 0.9
    tokens, heads = out[tab.tokens_img], out[tab.heads_img]
    assert tokens["visible"] and heads["visible"]
    grid = patch_maps.TokenGrid(6, 37, ("cls",), (6, 6))
    assert tokens["value"].size == (grid.size[0] + plots.COLORBAR_PX, grid.size[1])
    assert heads["value"].size[0] > plots.HeadGrid(6, 3).size[0]
    assert not plots.clipped_text(tokens["value"])
    note = out[tab.note]
    assert f"LD clean {want.clean_diff:.2f}, corrupted {want.corrupted_diff:.2f}" in note and f"{want.forwards} batched forwards" in note
    assert want.label in note and want.other_label in note


def _centre(grid, layer, token):
    x0, x1 = grid.column(token)
    return (x0 + x1) / 2, grid.TOP + (layer + 0.5) * grid.row


@pytest.mark.parametrize("kind, layer, index", [("resid_pre", 2, 1 + 3 * 6 + 2), ("resid_pre", 4, 0), ("head", 3, 1)])
def test_a_click_on_a_cell_is_the_librarys_one_patched_forward(analysed, patched, kind, layer, index):
    ref, exp, model, _ = analysed
    out, kept = patched
    tab = tabs.patch.TAB
    a = exp.analysis
    if kind == "resid_pre":
        shown = tab.on_patch_token(ref, out[tab.held], _Click(*_centre(patch_maps.TokenGrid(6, 37, ("cls",), (6, 6)), layer, index)))
    else:
        grid = plots.HeadGrid(6, 3)
        shown = tab.on_patch_head(ref, out[tab.held], _Click(grid.LEFT + (index + 0.5) * grid.cell, grid.TOP + (layer + 0.5) * grid.cell))
    pre = model.spec.preprocessing
    logits = patched_logits(model, to_input(a.image, pre), to_input(kept.corrupt, pre), [(kind, layer, index)])
    top = logits.double().softmax(-1).topk(5)
    want = {a.categories[i]: pytest.approx(float(p), abs=1e-6) for p, i in zip(top.values.tolist(), top.indices.tolist())}
    assert shown[tab.top5]["visible"] and shown[tab.top5]["value"] == want
    score = float(kept.result.maps[kind][layer, index])
    assert f"score {0.0 if abs(score) < 0.005 else score:.2f}" in shown[tab.site]  # the map's value, from this one forward
    assert tab.on_patch_token(ref, out[tab.held], _Click(2, 2)) == gr.skip()  # the margin: no cell


def test_a_click_on_the_clean_image_picks_its_patch(analysed):
    ref, exp, model, _ = analysed
    tab = tabs.patch.TAB
    side = exp.analysis.patch_size * exp.scale
    out = tab.on_patch_pick(ref, "cover", 1, 1, _Click(2.5 * side, 3.5 * side))
    assert (out[tab.row], out[tab.col]) == (4, 3)
    swap = tab.on_patch_pick(ref, "swap", 4, 3, _Click(0.5 * side, 0.5 * side))  # the patch chosen before becomes the second
    assert (swap[tab.row], swap[tab.col], swap[tab.row2], swap[tab.col2]) == (1, 1, 4, 3)
    assert _differing_patches(swap[tab.clean_img], swap[tab.corrupt_img]["value"], side) == {(0, 0), (3, 2)}


def test_a_second_upload_is_cut_as_the_model_cuts_it(analysed, tmp_path):
    from PIL import Image

    from vitviz.server.app import SERVER
    from vitviz.server.guards.gradio_io import upload_folder

    ref, exp, model, _ = analysed
    tab = tabs.patch.TAB
    folder = upload_folder() / f"vv-test-patch-{uuid.uuid4().hex}"
    folder.mkdir(parents=True)
    second = folder / "circle.png"
    Image.open(runtime.EXAMPLES[1]).resize((200, 150)).save(second)
    try:
        out = tab.on_patch(ref, "upload", 1, 1, 1, 1, str(second), tabs.patch.AUTO, None)
    finally:
        second.unlink()
        folder.rmdir()
    kept = SERVER.store.get(out[tab.held].key)
    assert kept.corrupt.size == exp.analysis.image.size and out[tab.corrupt_img]["visible"]
    assert runtime.md("the upload circle.png") in out[tab.note] and out[tab.cells_box]["visible"] is False and out[tab.upload]["visible"] is True


@pytest.mark.parametrize("mode, row, col, row2, col2, target, match", [
    ("cover", 0, 1, 1, 1, None, "row must be a whole number from 1 to 6"),
    ("cover", 1, 7, 1, 1, None, "column must be a whole number from 1 to 6"),
    ("cover", 2.5, 1, 1, 1, None, "whole number"),
    ("cover", "three", 1, 1, 1, None, "whole number"),
    ("cover", float("nan"), 1, 1, 1, None, "whole number"),
    ("cover", float("inf"), 1, 1, 1, None, "whole number"),
    ("swap", 1, 1, 99, 1, None, "second row"),
    ("swap", 2, 2, 2, 2, None, "two different patches"),
    ("sideways", 1, 1, 1, 1, None, "covers a patch"),
    (["cover"], 1, 1, 1, 1, None, "covers a patch"),
    ("cover", 1, 1, 1, 1, "not a class", "Pick one of the model's classes"),
    ("cover", 1, 1, 1, 1, 3, "Pick one of the model's classes"),
    ("upload", 1, 1, 1, 1, None, "Upload a second image first"),
])
def test_junk_is_refused_with_a_clear_message(analysed, mode, row, col, row2, col2, target, match):
    ref = analysed[0]
    with pytest.raises(gr.Error, match=match):
        tabs.patch.TAB.on_patch(ref, mode, row, col, row2, col2, None, target, None)


def test_an_upload_that_is_no_image_or_not_uploaded_is_refused(analysed, tmp_path):
    from vitviz.server.guards.gradio_io import UPLOAD_REFUSED, upload_folder

    ref = analysed[0]
    tab = tabs.patch.TAB
    folder = upload_folder() / f"vv-test-patch-{uuid.uuid4().hex}"
    folder.mkdir(parents=True)
    text = folder / "notes.png"
    text.write_text("not an image at all")
    try:
        with pytest.raises(gr.Error, match=r"notes\.png: .*(format|identif|image)"):
            tab.on_patch(ref, "upload", 1, 1, 1, 1, str(text), None, None)
    finally:
        text.unlink()
        folder.rmdir()
    outside = tmp_path / "secret.png"
    outside.write_bytes(b"\x89PNG")
    for path in (str(outside), "/etc/passwd", {"path": "/etc/passwd"}, 7):
        with pytest.raises(gr.Error) as caught:
            tab.on_patch(ref, "upload", 1, 1, 1, 1, path, None, None)
        assert caught.value.message == UPLOAD_REFUSED


def test_clicks_without_a_patching_or_with_junk_are_refused(analysed, patched):
    ref = analysed[0]
    out, _ = patched
    tab = tabs.patch.TAB
    for held in (None, "a key", tabs.patch.PatchRef("no-such-key", ref.key, "app"), tabs.patch.PatchRef(out[tab.held].key, "other", "app")):
        with pytest.raises(gr.Error, match="Run Patch first"):
            tab.on_patch_token(ref, held, _Click(60, 40))
    for index in (None, ["x", 2], [1], {"x": 1}):
        with pytest.raises(gr.Error, match="pixel"):
            tab.on_patch_head(ref, out[tab.held], type("Junk", (), {"index": index})())
    for x, y in ((float("nan"), 30), (30, float("-inf"))):
        with pytest.raises(gr.Error, match="pixel"):
            tab.on_patch_token(ref, out[tab.held], _Click(x, y))
        with pytest.raises(gr.Error, match="pixel"):
            tab.on_patch_pick(ref, "cover", 1, 1, _Click(x, y))
    for x, y in ((-5, -5), (1e9, 1e9), (1e308, 30)):  # outside every cell
        assert tab.on_patch_token(ref, out[tab.held], _Click(x, y)) == gr.skip()
        assert tab.on_patch_head(ref, out[tab.held], _Click(x, y)) == gr.skip()
        assert tab.on_patch_pick(ref, "cover", 1, 1, _Click(x, y)) == gr.skip()
    with pytest.raises(gr.Error, match="covers a patch"):
        tab.on_patch_pick(ref, "sideways", 1, 1, _Click(10, 10))
    with pytest.raises(gr.Error, match="covers a patch"):
        tab.on_patch_edit(ref, None, 1, 1, 1, 1)
    with pytest.raises(gr.Error, match="row must be a whole number"):
        tab.on_patch_edit(ref, "cover", 99, 1, 1, 1)
    with pytest.raises(gr.Error, match="Analyse an image first"):
        tab.on_patch(None, "cover", 1, 1, 1, 1, None, None, None)


def test_a_patching_over_the_servers_bound_is_refused_in_one_sentence(analysed, monkeypatch):
    from vitviz.server.app import SERVER
    from vitviz.server.guards.work import ModelWork

    ref = analysed[0]
    tab = tabs.patch.TAB
    monkeypatch.setattr(SERVER, "work", ModelWork(budget_bytes=8 * 2**20, lanes=1, seconds=60))
    with pytest.raises(gr.Error) as caught:
        tab.on_patch(ref, "cover", *COVERED, 1, 1, None, None, None)
    message = caught.value.message
    assert message.startswith("Patch of shapes_p16") and "VITVIZ_WORK_MB" in message and message.count(". ") == 0, message
    monkeypatch.undo()
    out = tab.on_patch(ref, "cover", *COVERED, 1, 1, None, None, None)  # the server goes on
    assert out[tab.tokens_img]["visible"]


@pytest.mark.slow
def test_the_private_events_answer_hostile_data_with_errors_and_the_server_goes_on(server, good):
    """Over raw HTTP (`POST /gradio_api/queue/join`): an analysis in a session, then the private
    Patch event with junk in each field and the map's click with junk event data: each an error
    with its reason; a good request in the same session still patches, a click on its map gives a
    top-5, and the server still analyses."""
    from conftest import join, results, run, upload

    session = uuid.uuid4().hex
    ok, _ = run(server, "session_analyze", [upload(server, good), "shapes_p16", "mean", 0.0, None], session=session)
    assert ok
    hostile = [
        (["sideways", 1, 1, 1, 1, None, None], "not in the list of choices"),
        (["cover", 0, 1, 1, 1, None, None], "less than minimum"),
        (["cover", "1; DROP TABLE", 1, 1, 1, None, None], "Patch could not be done"),
        (["cover", 1, 1, 1, 1, None, "not a class"], "not in the list of choices"),
        (["upload", 1, 1, 1, 1, {"path": "/etc/passwd", "meta": {"_type": "gradio.FileData"}}, None], "must be uploaded"),
        (["upload", 1, 1, 1, 1, {"url": "data:image/png;base64,AAAA"}, None], "must be uploaded"),
        (["upload", 1, 1, 1, 1, None, None], "Upload a second image first"),
        (["swap", 2, 2, 2, 2, None, None], "two different patches"),
    ]
    for data, why in hostile:
        ok, error = run(server, "on_patch", [None, *data, None, "resid_pre", "head"], session=session)
        assert not ok and why in error and "Traceback" not in error, (data, error)
    for kinds in (["head", "head"], ["resid_pre", {"x": 1}], ["resid_pre", None]):  # the maps' kinds: of the page's choices only
        ok, error = run(server, "on_patch", [None, "cover", *COVERED, 1, 1, None, None, None, *kinds], session=session)
        assert not ok and error.strip() and "Traceback" not in error, (kinds, error)

    def click(event_data) -> dict:
        assert join(server, "on_patch_token", [None, None], session, event_data=event_data).status_code == 200
        (msg,) = results(server, session, 1)
        return msg

    assert "Run Patch first" in click({"index": [300, 60], "value": None})["output"]["error"]
    ok, out = run(server, "on_patch", [None, "cover", *COVERED, 1, 1, None, None, None, "resid_pre", "head"], session=session)
    assert ok, out
    for junk in ({"index": ["a", None], "value": None}, {"index": None}, {"index": {"x": 1}, "value": None}, "junk", [1, 2]):
        msg = click(junk)
        assert not msg["success"] and msg["output"]["error"].strip(), (junk, msg)
    msg = click({"index": [300, 60], "value": None})
    assert msg["success"] and msg["output"]["data"][0]["value"]["label"] == "star", msg
    ok, out = run(server, "analyze", [upload(server, good), "shapes_p16"])
    assert ok and out[0]["label"] == "star", out


@pytest.mark.parametrize("token_kind, head_kind", [("mlp_out", "pattern"), ("attn_out", "head")])
def test_the_other_kinds_of_site_are_mapped_and_clicked_as_the_library_patches_them(analysed, token_kind, head_kind):
    """The two maps' kinds are the page's choice: an MLP's or attention's output per token, a head's
    pattern; each map is the library's, and a click patches that kind's site."""
    from vitviz.server.app import SERVER

    ref, exp, model, _ = analysed
    tab = tabs.patch.TAB
    out = tab.on_patch(ref, "cover", *COVERED, 1, 1, None, tabs.patch.AUTO, None, token_kind, head_kind)
    kept = SERVER.store.get(out[tab.held].key)
    a, pre = exp.analysis, model.spec.preprocessing
    clean, corrupt = to_input(a.image, pre), to_input(kept.corrupt, pre)
    want = patch(model, clean, corrupt, where=(token_kind, head_kind))
    assert kept.result.kinds == (token_kind, head_kind)
    for kind in (token_kind, head_kind):
        torch.testing.assert_close(kept.result.maps[kind], want.maps[kind], atol=1e-5, rtol=1e-4)
    layer, n = 2, 1 + 2 * 6 + 3
    shown = tab.on_patch_token(ref, out[tab.held], _Click(*_centre(patch_maps.TokenGrid(6, 37, ("cls",), (6, 6)), layer, n)))
    logits = patched_logits(model, clean, corrupt, [(token_kind, layer, n)])
    assert max(shown[tab.top5]["value"].values()) == pytest.approx(float(logits.double().softmax(-1).max()), abs=1e-6)
    assert f"block {layer + 1}" in shown[tab.site] and ("MLP" in shown[tab.site] or "attention output" in shown[tab.site])
    grid = plots.HeadGrid(6, 3)
    shown = tab.on_patch_head(ref, out[tab.held], _Click(grid.LEFT + 1.5 * grid.cell, grid.TOP + 4.5 * grid.cell))
    logits = patched_logits(model, clean, corrupt, [(head_kind, 4, 1)])
    assert max(shown[tab.top5]["value"].values()) == pytest.approx(float(logits.double().softmax(-1).max()), abs=1e-6)
    assert "head 2 of block 5" in shown[tab.site]


@pytest.mark.parametrize("token_kind, head_kind", [("head", "head"), ("resid_pre", "mlp_out"), (None, "head"), (["mlp_out"], "head"),
                                                   ("resid_pre", 3)])
def test_a_kind_of_site_that_is_not_offered_is_refused(analysed, token_kind, head_kind):
    with pytest.raises(gr.Error, match="By layer and token"):
        tabs.patch.TAB.on_patch(analysed[0], "cover", *COVERED, 1, 1, None, tabs.patch.AUTO, None, token_kind, head_kind)
