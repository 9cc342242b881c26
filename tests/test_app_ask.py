"""The Ask tab: shapes_vlm's answer to a question about the analysed scene equals the library's
`vitviz.ask` on the same crop, each word's map is drawn, a model that is no VLM is told so, and junk
from a client is refused in one sentence, through the handlers and through raw HTTP."""

import uuid

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import quiet

QUESTION = "what colour is the {} ?"


@pytest.fixture(scope="module")
def app():
    global page, tabs
    from vitviz.server import app as app_module, page, tabs
    return app_module


@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    """A generated scene of coloured shapes (seed 4000, never trained on) as a PNG: (path, objects)."""
    from vitviz.shapes import render_scene

    image, objects, _ = render_scene(seed=4000, index=3)
    path = tmp_path_factory.mktemp("ask") / "scene.png"
    Image.fromarray(image).save(path)
    return str(path), objects


@pytest.fixture(scope="module")
def analysed(app, scene):
    from vitviz.server.app import SERVER

    out = page.on_analyze(scene[0], "shapes_vlm", "mean", 0.0, progress=quiet)
    ref = out[page.PAGE.state]
    return ref, SERVER.store.get(ref.key), SERVER.cache.get("shapes_vlm")[0], out


def _unique_shape(objects) -> tuple[str, str]:
    shapes = [s for _, s in objects]
    return next((c, s) for c, s in objects if shapes.count(s) == 1)


def test_the_tab_opens_for_a_vlm_and_says_why_not_for_another(analysed):
    tab = tabs.ask.TAB
    out = analysed[3]
    assert out[tab.gate.content]["visible"] is True and out[tab.gate.note]["visible"] is False
    other = page.on_analyze(analysed[1].analysis.image, "shapes_p16", "mean", 0.0, progress=quiet)
    assert other[tab.gate.content]["visible"] is False
    assert "is not a vision–language model" in other[tab.gate.note]["value"]


def test_the_answer_is_the_librarys_and_each_word_has_its_map(analysed, scene):
    from vitviz.server.app import SERVER
    from vitviz.vlm.ask import ask

    ref, exp, model, _ = analysed
    tab = tabs.ask.TAB
    colour, shape = _unique_shape(scene[1])
    question = QUESTION.format(shape)
    out = tab.on_ask(ref, question, 4, "relevance", None)
    kept = SERVER.store.get(out[tab.held].key)
    want = ask(model, exp.analysis.image, question, max_new_tokens=4)
    assert kept.ids == want.ids and kept.text == want.text == colour
    torch.testing.assert_close(kept.relevance, want.relevance)
    torch.testing.assert_close(kept.attention, want.attention)
    assert colour in out[tab.answer]
    choices = out[tab.word]["choices"]
    assert choices[0][1] == tabs.ask.WHOLE and choices[1] == (colour, "0-1") and out[tab.word]["value"] == "0-1"
    picture = out[tab.map]["value"]
    assert picture.width >= exp.display_image.width and "row" in out[tab.top]
    # another method and layer: drawn from the kept answer, nothing run
    shown = tab.on_view(ref, "0-1", "attention", 2, out[tab.held])
    assert shown[tab.layer]["visible"] is True and shown[tab.map]["value"].size == picture.size
    top = want.top_patches(0, k=1, method="attention", layer=1)[0]
    assert f"row {top['row'] + 1}, column {top['col'] + 1}" in shown[tab.top]


@pytest.mark.parametrize("question, tokens, method, why", [
    ("", 4, "relevance", "Type a question"),
    ("   ", 4, "relevance", "Type a question"),
    (None, 4, "relevance", "Type a question"),
    ("x" * 301, 4, "relevance", "at most 300"),
    ("what\x00 colour", 4, "relevance", "control characters"),
    ("how many shapes are there ?", 0, "relevance", "whole number from 1 to 32"),
    ("how many shapes are there ?", 33, "relevance", "whole number from 1 to 32"),
    ("how many shapes are there ?", "x", "relevance", "number"),
    ("how many shapes are there ?", 4, "gradcam", "relevance or the attention"),
])
def test_junk_is_refused_in_one_sentence(analysed, question, tokens, method, why):
    import gradio as gr

    tab = tabs.ask.TAB
    with pytest.raises(gr.Error) as caught:
        tab.on_ask(analysed[0], question, tokens, method, None)
    assert why in caught.value.message


def test_a_word_that_is_not_the_answers_is_refused(analysed):
    import gradio as gr

    ref = analysed[0]
    tab = tabs.ask.TAB
    out = tab.on_ask(ref, "how many shapes are there ?", 4, "relevance", None)
    for junk in ("9-10", "0-0", "a-b", "../0-1", {"x": 1}, 5):
        with pytest.raises(gr.Error, match="Pick one of the answer's words"):
            tab.on_view(ref, junk, "relevance", 0, out[tab.held])
    with pytest.raises(gr.Error, match="layer"):
        tab.on_view(ref, "0-1", "attention", 99, out[tab.held])
    with pytest.raises(gr.Error, match="Ask a question first"):
        tab.on_view(ref, "0-1", "relevance", 0, None)


def test_an_ask_over_the_servers_bound_is_refused_before_it_runs(analysed, monkeypatch):
    import gradio as gr

    from vitviz.server.app import SERVER
    from vitviz.server.tabs import ask as ask_tab

    ran = []
    monkeypatch.setattr(ask_tab, "ask", lambda *a, **k: ran.append(1))
    monkeypatch.setattr(SERVER.work, "budget_bytes", 2**20)
    with pytest.raises(gr.Error) as caught:
        tabs.ask.TAB.on_ask(analysed[0], "how many shapes are there ?", 4, "relevance", None)
    assert "VITVIZ_WORK_MB" in caught.value.message and not ran


def test_the_price_holds_what_an_ask_runs(analysed):
    """Within 1.5x of the multiply-adds torch counts (FlopCounterMode) for the whole ask."""
    from torch.utils.flop_counter import FlopCounterMode

    from vitviz.cost import price
    from vitviz.vlm.ask import ask, vlm_of

    ref, exp, model, _ = analysed
    question = "how many shapes are there ?"
    shape = vlm_of(model).ask_shape(question, 4)
    counter = FlopCounterMode(display=False)
    with counter:
        answer = ask(model, exp.analysis.image, question, max_new_tokens=4)
    assert len(answer.ids) == shape.new_tokens or answer.ends
    counted = counter.get_total_flops()
    full = price(model.spec, "ask", ask=shape.__class__(**{**shape.__dict__, "new_tokens": len(answer.ids)}))
    assert counted / 1.5 <= full.flops <= counted * 1.5, (full.flops, counted)
    assert full.kept_bytes >= answer.attention.numel() * 4


@pytest.mark.slow
def test_the_private_event_answers_hostile_data_and_the_server_goes_on(app, scene):
    """Over raw HTTP (`POST /gradio_api/queue/join`): an analysis by shapes_vlm in a session, then the
    private Ask event with junk in each field: each an error with its reason; a good question in the
    same session is answered, and the server still analyses."""
    from conftest import run, serving, upload

    with serving(app.demo, **app.LAUNCH_KWARGS) as server:
        session = uuid.uuid4().hex
        ok, _ = run(server, "session_analyze", [upload(server, scene[0]), "shapes_vlm", "mean", 0.0, None], session=session)
        assert ok
        for data, why in [(["", 4, "relevance"], "Type a question"), (["x" * 400, 4, "relevance"], "300"),
                          (["how many shapes are there ?", 1e9, "relevance"], ""),
                          (["how many shapes are there ?", 4, "<script>"], "")]:
            ok, error = run(server, "on_ask", [None, *data, None], session=session)
            assert not ok and why in error and error.strip() and "Traceback" not in error, (data, error)
        ok, out = run(server, "on_ask", [None, "how many shapes are there ?", 4, "relevance", None], session=session)
        assert ok, out
        ok, out = run(server, "analyze", [upload(server, scene[0]), "shapes_p16"])
        assert ok, out


def test_scenes_questions_have_one_answer():
    from vitviz.shapes import render_scene
    from vitviz.vlm.scenes import questions, where_words

    image, objects, masks = render_scene(seed=5, index=0)
    qas = questions(objects, masks)
    kinds = [q.kind for q in qas]
    assert kinds.count("where") == len(objects) and kinds.count("count") == 1
    for q in qas:
        if q.kind == "where":
            ys, xs = np.nonzero(masks[q.target])
            assert q.answer == where_words(masks[q.target])
            assert q.answer.startswith("top" if ys.mean() < 48 else "bottom")


def test_the_servers_bounds_count_the_whole_vlm():
    """The model cache's parameter bound and byte budget count a VLM's language model, not its tower
    alone (the tower is the embedded model's own: counted once)."""
    import vitviz
    from vitviz.server.models import ModelCache, count_params

    tower = vitviz.load_model("shapes_vlm", device="cpu")
    whole = tower.__dict__["vlm"]
    assert count_params(tower) == sum(p.numel() for p in whole.parameters()) > sum(p.numel() for p in tower.parameters())
    assert ModelCache._bytes(tower) == sum(p.numel() * p.element_size() for p in whole.parameters())
