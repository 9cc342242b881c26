"""What a review of the Patch, Tokens and Concepts tabs as an attacker found, closed: a windowed model's
high-norm tokens are drawn with the attention they receive summed window by window, never from the
stage's whole token-by-token matrix (shapes_swin@1824's first stage would be some 50 GB, outside the
work budget)."""

import pytest
from PIL import Image

from conftest import quiet


@pytest.fixture(scope="module")
def app():
    global page, runtime, tabs, SERVER
    from vitviz.server import app as app_module, page, runtime, tabs
    from vitviz.server.app import SERVER
    return app_module



def test_a_windowed_models_outlier_shares_are_summed_window_by_window():
    """`SwinAnalysis.attention_to`: each token's share of attention on a set of keys, from the windows,
    equals the rows of the stage's whole matrix (`global_attention`) summed over those keys."""
    import torch
    import vitviz

    from vitviz.server.runtime import EXAMPLES

    a = vitviz.analyze(vitviz.load_model("shapes_swin"), EXAMPLES[0])
    g = torch.Generator().manual_seed(0)
    for layer in range(a.num_layers):
        n = a.geometries[layer].grid[0] * a.geometries[layer].grid[1]
        keys = torch.rand(n, generator=g) < 0.2
        want = a.global_attention(layer).float().mean(dim=0)[:, keys].sum(dim=1)
        torch.testing.assert_close(a.attention_to(layer, keys).float(), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="keys must be"):
        a.attention_to(0, torch.zeros(3, dtype=torch.bool))


def test_a_windowed_layer_of_a_large_size_is_drawn_without_its_whole_matrix(app, monkeypatch):
    """shapes_swin@1824's first stage (51,984 patches) would be some 50 GB as one matrix: the Tokens tab
    draws its high-norm tokens from the windows alone."""
    from vitviz.swin_analysis import SwinAnalysis

    out = page.on_analyze(runtime.EXAMPLES[0], "shapes_swin@384", "mean", 0.0, progress=quiet)
    assert out[page.PAGE.notice] == ""
    ref = out[page.PAGE.state]
    gathered = []
    whole = SwinAnalysis.global_attention
    monkeypatch.setattr(SwinAnalysis, "global_attention", lambda self, layer: gathered.append(layer) or whole(self, layer))
    tab = tabs.tokens.TAB
    for layer in (1, 2, 3):
        drawn = tab.on_outlier_layer(ref, layer)
        assert isinstance(drawn[tab.outliers_img], Image.Image) and f"after block {layer}" in drawn[tab.outliers_text]
    assert gathered == []
