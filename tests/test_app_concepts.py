"""The Concepts tab: shown for a model with a sparse autoencoder (one line for another), its map and
its top-5 with a feature switched off equal to the library's (`vitviz.concepts.concept_map`,
`vitviz.ablate(features=...)`), clicks that choose a patch and a feature without running the map
again (each run priced), a second SAE chosen from the dropdown, and junk from a client refused,
through the handlers and through raw HTTP."""

import os
import uuid

import gradio as gr
import pytest
import torch
from conftest import analyse_example, quiet
from test_concepts_browse import FEATURES, K, LAYER, concepts_folder

from vitviz.concepts.browse import concept_map, load_concepts
from vitviz.inside import ablate
from vitviz.preprocess import to_input


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Two SAEs for shapes_p16 (after blocks 4 and 2), listed in VITVIZ_CONCEPTS for the module."""
    root = tmp_path_factory.mktemp("concepts")
    first = concepts_folder(root / "first", classes=["star", "ring", "arrow", "cross", "heart", "moon", "square", "triangle"])
    second = concepts_folder(root / "second", layer=1, seed=1)
    from vitviz.concepts import browse

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VITVIZ_CONCEPTS", str(first))
        mp.setattr(browse, "assets_dir", lambda: root)  # shapes_p16's embedded SAE hidden: these tests' folders alone
        yield mp, first, second


@pytest.fixture(scope="module")
def app(folders):
    global page, runtime, tabs, SERVER
    from vitviz.server import app as app_module, page, runtime, tabs
    from vitviz.server.app import SERVER
    return app_module



@pytest.fixture(scope="module")
def analysed(app):
    return analyse_example()


def _values(**mine):
    """Every on-demand tab's draw inputs, in page order, with the Concepts tab's given."""
    values = []
    for tab in page.PAGE.on_demand:
        if tab.id == "concepts":
            values += [mine.get("sae"), mine.get("row", 1), mine.get("col", 1), mine.get("feature", 0), mine.get("held")]
        else:
            values += [getattr(c, "value", None) for c in tab.draw_inputs]
    return values


class _Click:
    def __init__(self, x, y):
        self.index = [x, y]


@pytest.fixture(scope="module")
def drawn(analysed):
    ref = analysed[0]
    return page.on_refresh_tab(ref, "concepts", *_values())


def test_only_a_model_with_an_sae_shows_the_tab(analysed):
    tab = tabs.concepts.TAB
    out = analysed[3]
    assert out[tab.gate.note]["visible"] is False and out[tab.gate.content]["visible"] is True
    other = page.on_analyze(runtime.EXAMPLES[0], "shapes_p8", "mean", 0.0, progress=quiet)
    line = other[tab.gate.note]["value"]
    assert line.startswith("No sparse autoencoder for shapes_p8: train one with python -m vitviz.concepts train DATA --model shapes_p8")
    assert other[tab.gate.note]["visible"] is True and other[tab.gate.content]["visible"] is False
    with pytest.raises(gr.Error, match="No sparse autoencoder for shapes_p8") as caught:
        tab.on_concepts(other[page.PAGE.state], None, 1, 1, 0, None)
    assert caught.value.message.endswith("in VITVIZ_CONCEPTS.") and line.endswith("in VITVIZ_CONCEPTS")  # one sentence, one stop
    assert page.on_refresh_tab(other[page.PAGE.state], "concepts", *_values()) == page._nothing()


def test_the_tab_draws_the_strongest_patch_and_feature_as_the_library_computes_them(analysed, drawn, folders):
    ref, exp, model, _ = analysed
    tab = tabs.concepts.TAB
    held = drawn[tab.held]
    kept = SERVER.store.get(held.key)
    concepts = load_concepts(folders[1])
    x = to_input(exp.analysis.image, model.spec.preprocessing)
    want = concept_map(model, x, concepts)
    assert (held.analysis, held.folder) == (ref.key, "first") and torch.equal(kept.map.z, want.z)
    (r, c), f = tab._strongest(kept)
    assert float(want.z[1 + r * 6 + c, f]) == float(want.values[1:].max())
    assert (drawn[tab.row], drawn[tab.col]) == (r + 1, c + 1) and drawn[tab.feature]["value"] == f
    top = want.top((r, c), 5)
    assert [row[0] for row in drawn[tab.table]] == [t[0] for t in top] and len(top) == K
    assert drawn[tab.table][0][1] == f"{top[0][1]:.3g}" and drawn[tab.table][0][3] == concepts.top_class(top[0][0])
    result = ablate(model, x, features=[f], concepts=concepts)
    assert drawn[tab.ablated]["value"] == {str(k): v for k, v in result.predictions(5)} and drawn[tab.ablated]["visible"]
    assert f"{result.target_before:.1%} → {result.target_after:.1%}" in drawn[tab.note] and f"**Feature {f}**" in drawn[tab.note]
    assert drawn[tab.image].size == exp.display_image.size and drawn[tab.map].size[0] > exp.display_image.size[0]
    assert drawn[tab.examples]["value"].size[1] == K * (48 + 4) - 4 and drawn[tab.feature_examples].size[1] == 48
    assert drawn[tab.sae]["visible"] is False and drawn[tab.sae]["value"] == "first"
    assert "after block 4, 64 features, 4 active per token, trained on its patch tokens; explained variance 0.500, mean L0 4.0, " \
        "3 dead, accuracy 90.0% → 80.0% with the layer replaced by its reconstruction." in drawn[tab.about]


def test_clicks_choose_a_patch_then_a_feature_and_the_map_runs_once(analysed, drawn, monkeypatch):
    ref, exp, model, _ = analysed
    tab = tabs.concepts.TAB
    held = drawn[tab.held]
    runs, jobs = [], []
    for name in ("map_on_device", "ablate_on_device"):
        real = getattr(tabs.concepts, name)
        monkeypatch.setattr(tabs.concepts, name, lambda *a, _real=real, _name=name: runs.append(_name) or _real(*a))
    job = SERVER.job
    monkeypatch.setattr(SERVER, "job", lambda kind, variant, request=None, **kw: jobs.append((kind, kw)) or job(kind, variant, request, **kw))
    px = exp.analysis.patch_size * exp.scale
    kept = SERVER.store.get(held.key)
    before = set(kept.ablations)  # the features switched off so far (the one drawn)
    out = tab.on_pick(ref, None, held, _Click(2.5 * px, 3.5 * px))  # row 4, column 3
    top = kept.map.top((3, 2), 5)
    assert (out[tab.row], out[tab.col]) == (4, 3) and [row[0] for row in out[tab.table]] == [t[0] for t in top]
    assert out[tab.feature]["value"] == top[0][0] and out[tab.held] == held
    second = tab.on_table(ref, None, 4, 3, held, _Click(1, 0))  # the table's second row
    assert second[tab.feature]["value"] == top[1][0]
    third = tab.on_examples(ref, None, 4, 3, held, _Click(120, 2 * 52 + 10))  # the examples' third row
    assert third[tab.feature]["value"] == top[2][0]
    assert tab.on_examples(ref, None, 4, 3, held, _Click(120, 10_000)) == gr.skip()  # below the rows
    again = tab.on_feature(ref, None, 4, 3, top[1][0], held)  # kept: no second run
    assert again[tab.ablated] == second[tab.ablated]
    new = {t[0] for t in top[:3]} - before
    assert "map_on_device" not in runs and runs == ["ablate_on_device"] * len(new) and new  # each new feature once
    assert jobs == [("concept_ablate", {"sae": (LAYER, FEATURES, K)})] * len(new)  # each priced


def test_a_second_sae_is_chosen_from_the_dropdown_and_mapped_at_its_layer(analysed, drawn, folders):
    ref = analysed[0]
    tab = tabs.concepts.TAB
    mp, first, second = folders
    mp.setenv("VITVIZ_CONCEPTS", f"{first}{os.pathsep}{second}")
    try:
        out = tab.on_concepts(ref, None, 1, 1, 0, drawn[tab.held])
        assert out[tab.sae]["visible"] is True and [v for _, v in out[tab.sae]["choices"]] == ["first", "second"]
        chosen = tab.on_concepts(ref, "second", 1, 1, 0, out[tab.held])
        held = chosen[tab.held]
        assert held.folder == "second" and SERVER.store.get(held.key).map.layer == 1
        assert "after block 2" in chosen[tab.about] and SERVER.store.get(out[tab.held].key) is None  # the first map dropped
    finally:
        mp.setenv("VITVIZ_CONCEPTS", str(first))


def test_a_folder_is_read_once_however_many_requests_want_it_at_once(analysed, monkeypatch):
    """An SAE read from disk is held beside the work budget: requests that find it missing at once wait
    for the one reading it and take its copy, instead of each reading (and holding) one."""
    import threading
    import time

    from vitviz.concepts.browse import concept_folders
    from vitviz.server.guards.sessions import SessionStore

    monkeypatch.setattr(SERVER, "store", SessionStore(budget_bytes=2**30, idle_seconds=600))  # nothing read yet
    real, reads = tabs.concepts.load_concepts, []

    def slow(path):
        reads.append(path)
        time.sleep(0.3)
        return real(path)

    monkeypatch.setattr(tabs.concepts, "load_concepts", slow)
    (folder,) = concept_folders("shapes_p16")
    got = []
    threads = [threading.Thread(target=lambda: got.append(tabs.concepts.concepts_of(SERVER.name, folder))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(reads) == 1 and len(got) == 4 and all(c is got[0] for c in got)


@pytest.mark.parametrize("sae, row, col, feature, match", [
    ("../../etc/passwd", 1, 1, 0, "Choose one of this model's sparse autoencoders"),
    (["first"], 1, 1, 0, "Choose one of this model's sparse autoencoders"),
    (None, 0, 1, 0, "row must be a whole number from 1 to 6"),
    (None, 1, 7, 0, "column must be a whole number from 1 to 6"),
    (None, "1; DROP", 1, 0, "row must be a whole number"),
    (None, 1, 1, -1, f"feature must be a whole number from 0 to {FEATURES - 1}"),
    (None, 1, 1, FEATURES, "feature must be a whole number"),
    (None, 1, 1, 1.5, "feature must be a whole number"),
    (None, 1, 1, float("nan"), "feature must be a whole number"),
    (None, 1, 1, {"x": 1}, "feature must be a whole number"),
])
def test_junk_is_refused_with_a_clear_message(analysed, drawn, sae, row, col, feature, match):
    ref = analysed[0]
    tab = tabs.concepts.TAB
    with pytest.raises(gr.Error, match=match):
        tab.on_feature(ref, sae, row, col, feature, drawn[tab.held])


@pytest.mark.parametrize("event, match", [
    (_Click("a", None), "A click must give the pixel"),
    (_Click(float("inf"), 3), "A click must give the pixel"),
    (type("E", (), {"index": None})(), "A click must give the pixel"),
])
def test_a_junk_click_is_refused(analysed, drawn, event, match):
    tab = tabs.concepts.TAB
    with pytest.raises(gr.Error, match=match):
        tab.on_pick(analysed[0], None, drawn[tab.held], event)
    with pytest.raises(gr.Error, match=match):
        tab.on_examples(analysed[0], None, 1, 1, drawn[tab.held], event)


@pytest.mark.parametrize("index, match", [(["0", 1], "must give its cell"), ([True, 0], "must give its cell"), (None, "must give its cell"),
                                          ([99, 0], "lists 4 features"), ([-1, 0], "lists 4 features")])
def test_a_junk_table_click_is_refused(analysed, drawn, index, match):
    tab = tabs.concepts.TAB
    event = type("E", (), {"index": index})()
    with pytest.raises(gr.Error, match=match):
        tab.on_table(analysed[0], None, 1, 1, drawn[tab.held], event)


@pytest.mark.slow
def test_a_private_event_over_raw_http_refuses_junk_and_the_server_goes_on(app, server, good):
    """`POST /gradio_api/queue/join` to the private feature event: junk in each field an error with its
    reason; then a good request in the same session draws the feature and its top-5."""
    from conftest import run, upload

    session = uuid.uuid4().hex
    ok, _ = run(server, "session_analyze", [upload(server, good), "shapes_p16", "mean", 0.0, None], session=session)
    assert ok
    for data, why in (([None, None, 1, 1, FEATURES, None], "feature must be a whole number"),
                      ([None, None, 9, 1, 0, None], "row must be a whole number"),
                      ([None, "/etc", 1, 1, 0, None], "not in the list of choices"),
                      ([None, None, "x", 1, 0, None], "could not be done")):
        ok, error = run(server, "on_feature", data, session=session)
        assert not ok and why in str(error) and "Traceback" not in str(error), (data, error)
    ok, out = run(server, "on_feature", [None, None, 4, 3, 5, None], session=session)
    assert ok, out
    label = next(v for v in out if isinstance(v, dict) and isinstance(v.get("value"), dict) and "confidences" in v["value"])
    assert len(label["value"]["confidences"]) == 5
