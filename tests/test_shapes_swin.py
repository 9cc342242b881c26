"""The embedded Swin Transformer `shapes_swin`: its architecture, its loading offline, and that it
classifies and points at the object on fresh images. Nothing here trains."""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch

import vitviz
from vitviz import shapes
from vitviz.analysis import pointing_game
from vitviz.dev.train_shapes import generate_pool, to_batch
from vitviz.hooks import record_attention
from vitviz.sources.embedded import assets_dir, shapes_swin_config
from vitviz.swin import Swin, SwinConfig
from vitviz.swin_analysis import merge_map, swin_relevance_maps, window_to_global

SEED = 4545  # never trained on (training: seed 0, held-out checks: 1, the published figures: 2024)


@pytest.fixture(scope="module")
def model():
    return vitviz.load_model("shapes_swin", device="cpu")


@pytest.fixture(scope="module")
def fresh():
    return generate_pool(200, seed=SEED, workers=1)


def test_the_architecture_has_whole_windows_and_a_shifted_layer_where_a_stage_has_room():
    spec = vitviz.get_spec("shapes_swin")
    c = spec.config
    assert isinstance(c, SwinConfig) and c == shapes_swin_config() and spec.source == "embedded"
    assert (spec.image_size, spec.patch_size, spec.grid, spec.categories) == (96, 8, (12, 12), shapes.CLASSES)
    assert spec.mean == spec.std == (0.5, 0.5, 0.5)
    assert c.stage_grids() == ((12, 12), (6, 6), (3, 3))
    for (gh, gw), m in zip(c.stage_grids(), c.window_size):
        assert gh % m == 0 and gw % m == 0  # no padding anywhere
    # stages 0 and 1: 2 x 2 windows, the second block shifted by M / 2; stage 2: one window, the whole grid
    assert c.stage_windows() == (((6, 6), (3, 3)), ((3, 3), (1, 1)), ((3, 3), (0, 0)))
    geometries = Swin(c).geometries(96, 96)
    assert [g.shift for g in geometries] == [(0, 0), (3, 3), (0, 0), (1, 1), (0, 0), (0, 0)]


def test_it_loads_offline_as_a_swin_with_its_spec_and_the_file_is_at_most_5_mb(model, tmp_path, monkeypatch):
    def unreachable(*args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "empty"))
    monkeypatch.setattr(socket, "create_connection", unreachable)
    monkeypatch.setattr(socket.socket, "connect", unreachable)
    loaded = vitviz.load_model("shapes_swin", device="cpu")
    assert isinstance(loaded, Swin) and not loaded.training
    assert loaded.spec == vitviz.get_spec("shapes_swin") and loaded.config == loaded.spec.config
    assert vitviz.weights_status("shapes_swin") == "embedded"
    assert (assets_dir() / "shapes_swin.pt").stat().st_size <= 5e6
    assert sum(p.numel() for p in loaded.parameters()) * 4 <= 5e6


def test_a_missing_or_wrong_file_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("VITVIZ_ASSETS", str(tmp_path))
    with pytest.raises(vitviz.WeightsUnavailableError) as info:
        vitviz.load_model("shapes_swin", device="cpu")
    msg = str(info.value)
    assert "shapes_swin" in msg and str(tmp_path / "shapes_swin.pt") in msg and "python -m vitviz.dev.train_shapes_swin" in msg
    other = Swin(SwinConfig(image_size=96, patch_size=8, embed_dim=24, depths=(1,), num_heads=(1,), window_size=6, num_classes=8))
    torch.save(other.state_dict(), tmp_path / "shapes_swin.pt")
    with pytest.raises(ValueError, match="does not fit shapes_swin"):
        vitviz.load_model("shapes_swin", device="cpu")


def test_top1_on_200_fresh_images(model, fresh):
    images, labels, _ = fresh
    with torch.inference_mode():
        predicted = torch.cat([model(to_batch(images[s : s + 100])).argmax(-1) for s in range(0, 200, 100)])
    assert (predicted == torch.from_numpy(labels)).float().mean().item() >= 0.90


def _dense_rollout_map(model: Swin, x: torch.Tensor) -> torch.Tensor:
    """The pooled query's rollout from dense matrices: per layer rownorm(mean_h(A) + I) of the global
    attention, the merge maps between stages, the product, the mean of its rows: [B, 12, 12]."""
    with torch.inference_mode(), record_attention(model) as rec:
        model(x)
    geometries, stages = model.geometries(96, 96), model.layer_stages
    r = None
    for layer, (a, g) in enumerate(zip(rec.calls[-1], geometries)):
        if layer and stages[layer] != stages[layer - 1]:
            r = merge_map(geometries[layer - 1].grid, dtype=torch.float64) @ r
        step = window_to_global(a.double(), g).mean(dim=1) + torch.eye(g.num_tokens, dtype=torch.float64)
        step = step / step.sum(dim=-1, keepdim=True)
        r = step if r is None else step @ r
    return r.mean(dim=1).reshape(-1, 12, 12)


def _hit(score: torch.Tensor, mask: np.ndarray) -> bool:
    """Is the peak patch's centre pixel within 8 px (one patch, a square) of the object?"""
    peak = int(score.flatten().argmax())
    r, c = (peak // 12) * 8 + 4, (peak % 12) * 8 + 4
    return bool(mask[max(0, r - 8) : r + 9, max(0, c - 8) : c + 9].any())


def test_rollout_points_at_the_object_on_100_fresh_images(model, fresh):
    images, labels, masks = (a[:100] for a in fresh)
    x = to_batch(images)
    maps, chosen, _ = swin_relevance_maps(model, x, methods=["rollout", "gradient"], targets=labels.tolist())
    assert maps["rollout"].shape == maps["gradient"].shape == (100, 12, 12) and chosen.tolist() == labels.tolist()
    dense = _dense_rollout_map(model, x[:8])
    torch.testing.assert_close(maps["rollout"][:8].double(), dense, rtol=1e-4, atol=1e-7)
    hits = {m: torch.tensor([_hit(a, k) for a, k in zip(maps[m], masks)]) for m in maps}
    for m, h in hits.items():  # the library's pointing game (a dilation by max pooling) agrees with the hand-made one
        assert torch.equal(pointing_game(maps[m], torch.from_numpy(masks), patch_size=8), h)
    rollout, gradient = (hits[m].float().mean().item() for m in ("rollout", "gradient"))
    assert rollout >= 0.85, f"rollout pointing {rollout:.0%}"
    assert gradient >= 0.85, f"gradient pointing {gradient:.0%}"


def test_analyze_and_explain_take_it(model, fresh):
    image = fresh[0][0]
    analysis = vitviz.analyze(model, image)
    assert analysis.stage_grids == ((12, 12), (6, 6), (3, 3)) and analysis.num_layers == 6
    explanation = vitviz.explain(model, image, method="gradient")
    assert explanation.map.shape == (12, 12) and explanation.label == analysis.predictions(1)[0][0]
