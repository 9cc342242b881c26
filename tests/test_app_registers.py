"""The Tokens tab's high-norm tokens and test-time register, on `shapes_p8_outliers` (high-norm tokens
planted in flat patches at block 2): the outlier picture and its words are `Analysis.outliers()`'s;
the register finds the planted neurons and takes the outliers off the patches; an image without any,
and a model that cannot take one, are told so; junk from a client is refused, also over raw HTTP."""

import json
import math
import uuid
from pathlib import Path

import gradio as gr
import httpx
import numpy as np
import pytest
from PIL import Image

from conftest import quiet

import vitviz
from vitviz.registers import register_neurons

ASSETS = Path(__file__).resolve().parents[1] / "assets"
NAME = "shapes_p8_outliers"


@pytest.fixture(scope="module")
def app():
    global page, runtime, tabs, views, SERVER
    from vitviz.server import app as app_module, page, runtime, tabs
    from vitviz.server.app import SERVER
    from vitviz.server.pictures import views
    return app_module



@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Two generated images as PNG files: the first whose analysis has high-norm tokens after the last
    two blocks (where the register's neurons are found, and where the ratio is read), and one with
    none after any block."""
    model = vitviz.load_model(NAME)
    folder = tmp_path_factory.mktemp("registers")
    found = {}
    for i, pixels in enumerate(vitviz.shapes.generate(64, seed=2025)[0]):
        counts = vitviz.analyze(model, Image.fromarray(pixels)).outliers().counts
        kind = "outliers" if counts[-1] and counts[-2] else "none" if not any(counts) else None
        if kind and kind not in found:
            found[kind] = folder / f"{kind}-{i}.png"
            Image.fromarray(pixels).save(found[kind])
        if len(found) == 2:
            return found
    raise AssertionError(f"the 64 images lack one kind: {sorted(found)}")


def _analysed(path, variant=NAME):
    out = page.on_analyze(str(path), variant, "mean", 0.0, progress=quiet)
    assert out[page.PAGE.notice] == "", out[page.PAGE.notice]
    ref = out[page.PAGE.state]
    return ref, SERVER.store.get(ref.key)


@pytest.fixture(scope="module")
def analysed(app, images):
    return _analysed(images["outliers"])


def _outlined(picture: Image.Image, cell: tuple[int, int], px: int) -> bool:
    """Whether the top-left corner pixel of a patch is the outline's colour."""
    return tuple(np.asarray(picture.convert("RGB"))[cell[0] * px + 1, cell[1] * px + 1]) == views.OUTLIER_COLOR


def test_the_outlier_picture_and_caption_are_the_analysis_outliers(analysed):
    ref, exp = analysed
    tab, a = tabs.tokens.TAB, exp.analysis
    o = a.outliers()
    depth = len(o.counts)
    out = tab.on_tokens(ref, 0.6)
    assert out[tab.outlier_layer] == {"maximum": depth, "value": depth, "__type__": "update"}  # the last layer first
    px = a.patch_size * exp.scale
    for layer in range(1, depth + 1):
        drawn = tab.on_outlier_layer(ref, layer) if layer < depth else out
        caption, picture = drawn[tab.outliers_text], drawn[tab.outliers_img]
        i = layer - 1
        if o.counts[i]:
            assert f"**{o.counts[i]} high-norm token{'s' if o.counts[i] > 1 else ''} after block {layer}** of {a.grid[0] * a.grid[1]}" in caption
            shares = (f"gives them {100 * float(o.query_share[i]):.1f} % of its attention, against {100 * float(o.fraction[i]):.1f} % "
                      f"spread evenly")
            assert shares in caption and f"give them {100 * float(o.patch_share[i]):.1f} % of theirs" in caption, caption
            assert f"largest norm is {float(o.ratio[i]):.1f} times the median" in caption
            assert all(_outlined(picture, cell, px) for cell in o.patches(i))
        else:
            assert caption.startswith(f"No high-norm token after block {layer} (largest norm {float(o.ratio[i]):.1f} times the median)")
        assert "above twice the layer's median patch norm" in caption and "OUTLIER_FACTOR" in caption
        unflagged = [(r, c) for r in range(a.grid[0]) for c in range(a.grid[1]) if not o.mask[i, r, c]]
        assert not any(_outlined(picture, cell, px) for cell in unflagged[:20])
    assert o.counts[-1] > 0 and "the cls token gives them" in out[tab.outliers_text]
    assert o.counts[0] == 0  # planted at block 2 (0-based): none before


def test_the_register_finds_the_planted_neurons_and_takes_the_outliers_off_the_patches(analysed):
    ref, exp = analysed
    tab, a = tabs.tokens.TAB, exp.analysis
    card = json.loads((ASSETS / f"{NAME}.json").read_text())
    planted = {(card["layer"], j) for j in card["neurons"]}
    out = tab.on_register(ref, 8, 6)
    held = out[tab.held]
    kept = SERVER.store.get(held.key)
    assert planted <= set(kept.found.neurons) and len(kept.found.neurons) == 8
    model = SERVER.cache.get(NAME)[0]
    assert kept.found.neurons == register_neurons(model, [a.image], top_k=8).neurons  # the library's, on the analysed crop
    note = out[tab.register_note]
    assert all(f"({layer}, {neuron}) " in note for layer, neuron in planted), note
    before, after = float(a.outliers().ratio[-1]), float(kept.after.analysis.outliers().ratio[-1])
    assert before > 4 and after < 2
    assert f"{before:.1f} times the median before, {after:.1f} after" in note
    assert kept.after.analysis.prefix_names == ("cls", "ttr")
    top, top_after = a.predictions(1)[0], kept.after.analysis.predictions(1)[0]
    assert f"{top[0]} {top[1]:.1%} before, {top_after[0]} {top_after[1]:.1%} after" in note
    for shown in (tab.rollout_before, tab.rollout_after, tab.outliers_after, tab.norms_after):
        assert out[shown]["visible"] is True and isinstance(out[shown]["value"], Image.Image), shown
    both = [np.asarray(out[c]["value"]) for c in (tab.rollout_before, tab.rollout_after)]
    assert both[0].shape == both[1].shape and not np.array_equal(*both)
    # the cls rollout leaves the outliers: its largest share on them falls
    cls_before, cls_after = a.cls_map(), kept.after.analysis.cls_map()
    mask = a.outliers().mask[-1]
    assert float(cls_after[mask].sum()) < 0.5 * float(cls_before[mask].sum())
    # the layer slider draws both sides again from what is kept (the same picture as from the kept analysis)
    moved = tab.on_outlier_layer(ref, 3, held)
    want = views.render_outliers(kept.after, layer=3)[0]
    assert np.array_equal(np.asarray(moved[tab.outliers_after]), np.asarray(want))
    assert SERVER.store.get(held.key) is kept
    # the tab shown again keeps the register; a register of another analysis goes
    again = tab.on_tokens(ref, 0.6, 3, held)
    assert again[tab.rollout_after] == gr.skip() and again[tab.outlier_layer]["value"] == 3
    other, _ = _analysed(runtime.EXAMPLES[0])
    cleared = tab.on_tokens(other, 0.6, 3, held)
    assert cleared[tab.rollout_after] == {"value": None, "visible": False, "__type__": "update"} and cleared[tab.held] is None
    assert SERVER.store.get(held.key) is None


def test_an_image_without_outliers_and_a_model_without_room_are_told_so(app, images):
    tab = tabs.tokens.TAB
    ref, exp = _analysed(images["none"])
    drawn = tab.on_tokens(ref, 0.6)
    ratio = float(exp.analysis.outliers().ratio[-1])
    assert drawn[tab.outliers_text].startswith(f"No high-norm token after block 6 (largest norm {ratio:.1f} times the median)")
    out = tab.on_register(ref, 8, 6)
    assert "No high-norm token to trace" in out[tab.register_note] and out[tab.held] is None
    assert out[tab.rollout_after] == {"value": None, "visible": False, "__type__": "update"}
    swin, exp = _analysed(images["outliers"], "shapes_swin")
    out = tab.on_register(swin, 8, 1)
    assert out[tab.register_note].startswith("shapes_swin cannot take a test-time register") and out[tab.held] is None
    drawn = tab.on_tokens(swin, 0.6)  # its high-norm tokens, each layer among its own stage's tokens
    assert drawn[tab.outlier_layer]["maximum"] == exp.analysis.num_layers
    assert "after block 6" in drawn[tab.outliers_text] and isinstance(drawn[tab.outliers_img], Image.Image)
    assert "after block 2" in tab.on_outlier_layer(swin, 2)[tab.outliers_text]


def test_the_register_kept_for_a_session_holds_the_ranks_it_shows_only(analysed):
    """The store counts a register by its tensors: the neurons' ranks, Python tuples (about 120 bytes
    each, 4.4 MiB for vit_b_16's 36,864 neurons), are kept for those moved only, the ones the caption lists."""
    ref, exp = analysed
    tab = tabs.tokens.TAB
    out = tab.on_register(ref, 3, 6)
    kept = SERVER.store.get(out[tab.held].key)
    assert [(layer, neuron) for layer, neuron, _ in kept.found.ranked] == list(kept.found.neurons) and kept.moved == 3
    assert all(f"({layer}, {neuron}) {score:.2f}" in out[tab.register_note] for layer, neuron, score in kept.found.ranked)


@pytest.mark.parametrize("value", ["three", None, 0, 7, math.nan, math.inf, 2.5, [1], {"layer": 2}, "1e999"])
def test_a_hostile_layer_is_refused_with_a_clear_message(analysed, value):
    ref = analysed[0]
    tab = tabs.tokens.TAB
    with pytest.raises(gr.Error, match="The layer must be a whole number from 1 to 6"):
        tab.on_outlier_layer(ref, value)
    with pytest.raises(gr.Error, match="The layer must be a whole number from 1 to 6"):
        tab.on_register(ref, 8, value)
    if value is not None:  # (the tab drawn again without a layer: the last one)
        tab.on_tokens(ref, 0.6)
        with pytest.raises(gr.Error, match="The layer must be a whole number from 1 to 6"):
            tab.on_tokens(ref, 0.6, value)


@pytest.mark.parametrize("value", ["eight", None, 0, 65, -1, math.nan, 1.5, [8], "8; drop"])
def test_a_hostile_neuron_count_is_refused_with_a_clear_message(analysed, value):
    with pytest.raises(gr.Error, match="The number of neurons moved must be a whole number from 1 to 64"):
        tabs.tokens.TAB.on_register(analysed[0], value, 6)


def test_a_forged_register_state_or_no_analysis_is_refused(analysed):
    ref = analysed[0]
    tab = tabs.tokens.TAB
    forged = tab.on_outlier_layer(ref, 3, {"key": "x" * 32, "analysis": ref.key})  # not the server's own reference: nothing kept
    assert forged[tab.outliers_after] == gr.skip()
    with pytest.raises(gr.Error, match="Analyse an image first"):
        tab.on_register(None, 8, 6)
    with pytest.raises(gr.Error, match="Analyse an image first"):
        tab.on_outlier_layer("a forged reference", 3)


def _results(base: str, session: str) -> dict:
    with httpx.stream("GET", f"{base}/gradio_api/queue/data", params={"session_hash": session}, timeout=300) as stream:
        for line in stream.iter_lines():
            if line.startswith("data:") and json.loads(line[5:]).get("msg") == "process_completed":
                return json.loads(line[5:])
    raise AssertionError("no completion")


def _event(base: str, session: str, fn: int, data: list) -> dict:
    body = {"data": data, "fn_index": fn, "session_hash": session, "event_data": None, "trigger_id": None}
    r = httpx.post(f"{base}/gradio_api/queue/join", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return _results(base, session)


def test_the_private_event_refuses_hostile_data_over_raw_http_and_the_server_keeps_answering(server, images):
    from conftest import fn_index, upload

    config = httpx.get(f"{server}/config", timeout=30).json()
    button = tabs.tokens.TAB.register_run._id
    (fn,) = [d["id"] for d in config["dependencies"] if [button, "click"] in d["targets"]]
    session = uuid.uuid4().hex
    analysed = _event(server, session, fn_index(server, "session_analyze"), [upload(server, images["outliers"]), NAME, "mean", 0.0, None])
    assert analysed["success"], analysed
    # what Gradio's sliders let through reaches the handler's checks; what they do not is refused before it
    for data, said in (([None, 2.5, 6, None], "The number of neurons moved must be a whole number from 1 to 64"),
                       ([None, 8, 9, "forged"], "The layer must be a whole number from 1 to 6"),
                       ([None, "NaN", 6, None], "The page's own controls send valid values"),
                       ([None, 8, {"__proto__": 1}, None], "The page's own controls send valid values"),
                       ([None, 1e308, 6, None], "")):
        refused = _event(server, session, fn, data)
        assert not refused["success"] and said in refused["output"]["error"], (data, refused)
    done = _event(server, session, fn, [None, 8, 6, None])  # the same session, asked properly
    assert done["success"], done
    assert "neurons moved into a test-time register" in json.dumps(done["output"]["data"])
