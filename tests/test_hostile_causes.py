"""What a review of the Patch, Tokens and Concepts tabs as an attacker found, closed: a windowed model's
layer whose whole token-by-token matrix is over the server's bound is one sentence in the Tokens tab,
and nothing is gathered for it (shapes_swin@1824's first stage would be some 50 GB, outside the work
budget), while a layer within it is drawn."""

from dataclasses import replace

import pytest
from PIL import Image


@pytest.fixture(scope="module")
def app():
    global page, runtime, tabs, SERVER
    from vitviz.server import app as app_module, page, runtime, tabs
    from vitviz.server.app import SERVER
    return app_module


def _quiet(*args, **kwargs):
    pass


def test_a_windowed_layer_over_the_token_bound_is_one_sentence_and_nothing_is_gathered(app, monkeypatch):
    from vitviz.swin_analysis import SwinAnalysis

    out = page.on_analyze(runtime.EXAMPLES[0], "shapes_swin@192", "mean", 0.0, progress=_quiet)
    assert out[page.PAGE.notice] == ""
    ref = out[page.PAGE.state]
    a = SERVER.store.get(ref.key).analysis
    (gh0, gw0), (gh1, gw1) = a.stage_grids[:2]
    # the bound between the first stage's patches and the second's: what VITVIZ_MAX_TOKENS=144 makes of it
    monkeypatch.setattr(SERVER, "settings", replace(SERVER.settings, max_tokens=gh1 * gw1))
    gathered = []
    whole = SwinAnalysis.global_attention
    monkeypatch.setattr(SwinAnalysis, "global_attention", lambda self, layer: gathered.append(layer) or whole(self, layer))
    tab = tabs.tokens.TAB
    refused = tab.on_outlier_layer(ref, 1)
    text = refused[tab.outliers_text]
    assert refused[tab.outliers_img] is None and gathered == [], gathered
    assert text.startswith(f"**Not drawn.** After block 1, shapes\\_swin@192 has {gh0 * gw0:,} patch tokens") and "VITVIZ_MAX_TOKENS" in text
    later = a.stages.index(1) + 1  # the first block of the second stage: within the bound, drawn
    drawn = tab.on_outlier_layer(ref, later)
    assert isinstance(drawn[tab.outliers_img], Image.Image) and f"after block {later}" in drawn[tab.outliers_text] and gathered
    # the tab drawn again at block 1: the rest of it drawn, that picture one sentence
    tab.on_tokens(ref, 0.6)
    again = tab.on_tokens(ref, 0.6, 1)
    assert again[tab.outliers_img] is None and again[tab.outliers_text] == text and isinstance(again[tab.received_img], Image.Image)
