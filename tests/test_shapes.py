"""The generated dataset and the embedded shapes ViTs: offline, and measured on fresh images."""

import socket

import numpy as np
import pytest
import torch

import vitviz
from vitviz import shapes
from vitviz.analysis import attention_rollout, cls_map, pointing_game
from vitviz.train_shapes import generate_pool, to_batch

FRESH_SEED = 2024  # never used in training (training: 0, validation: 1)


def test_generation_is_deterministic_and_chunkable():
    a = shapes.generate(12, seed=3)
    b = shapes.generate(12, seed=3)
    c = shapes.generate(12, seed=4)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[0], c[0])
    head = shapes.generate(5, seed=3)
    tail = shapes.generate(7, seed=3, start=5)
    np.testing.assert_array_equal(np.concatenate([head[0], tail[0]]), a[0])
    np.testing.assert_array_equal(np.concatenate([head[1], tail[1]]), a[1])


def test_samples_have_balanced_labels_and_real_masks():
    images, labels, masks = shapes.generate(400, seed=11)
    assert images.shape == (400, 96, 96, 3) and images.dtype == np.uint8
    assert masks.shape == (400, 96, 96) and masks.dtype == bool
    counts = np.bincount(labels, minlength=len(shapes.CLASSES))
    assert len(shapes.CLASSES) >= 8 and counts.min() >= 25
    cover = masks.mean(axis=(1, 2))
    assert cover.min() > 0.01 and cover.max() < 0.4
    # the object differs from its surroundings: mean colour inside vs a ring outside the mask
    inside = np.array([images[i][masks[i]].mean(0) for i in range(50)])
    outside = np.array([images[i][~masks[i]].mean(0) for i in range(50)])
    assert np.median(np.abs(inside - outside).sum(1)) > 60
    with pytest.raises(ValueError, match="unknown shape"):
        shapes._draw_shape(None, "blob", 0, 0, 1, 0)


def test_embedded_variants_load_with_no_network_and_an_empty_torch_home(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "empty"))
    monkeypatch.delenv("VITVIZ_OFFLINE", raising=False)

    def unreachable(*args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    monkeypatch.setattr(socket.socket, "connect", unreachable)
    for name in ("shapes_p8", "shapes_p16"):
        model = vitviz.load_model(name, device="cpu")
        assert model.spec.categories == shapes.CLASSES and vitviz.weights_status(name) == "embedded"
    name, reason = vitviz.default_variant()
    assert name == "shapes_p16" and "cannot be reached" in reason
    assert not list((tmp_path / "empty").rglob("*.pth"))


def test_the_two_variants_differ_only_in_patch_size():
    p8, p16 = vitviz.get_spec("shapes_p8"), vitviz.get_spec("shapes_p16")
    assert (p8.patch_size, p16.patch_size) == (8, 16)
    for field in ("image_size", "width", "depth", "heads", "mlp_dim", "mean", "std", "categories"):
        assert getattr(p8, field) == getattr(p16, field)
    folder = vitviz.zoo.assets_dir()
    assert (folder / p8.filename).stat().st_size + (folder / p16.filename).stat().st_size < 10e6


@pytest.fixture(scope="module")
def fresh():
    return generate_pool(1000, seed=FRESH_SEED, workers=1)


def _measure(model, fresh):
    images, labels, masks = fresh
    correct, hits = 0, []
    for s in range(0, len(images), 100):
        with torch.inference_mode(), vitviz.record_attention(model) as rec:
            logits = model(to_batch(images[s : s + 100]))
        correct += (logits.argmax(-1).numpy() == labels[s : s + 100]).sum()
        maps = cls_map(attention_rollout(rec.attentions))
        hits.append(pointing_game(maps, torch.from_numpy(masks[s : s + 100]), patch_size=model.spec.patch_size))
    return correct / len(images), torch.cat(hits).float().mean().item()


# Measured on 1,000 fresh images (seed 2024) with the shipped weights; these floors guard against
# regressions. The targets (95 % top-1; pointing game >= 90 % and >= 2x an untrained model)
# are not all met yet: see the README's figures.
FLOORS = {"shapes_p16": 0.80, "shapes_p8": 0.72}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["shapes_p16", "shapes_p8"])
def test_accuracy_and_pointing_game_on_fresh_images(name, fresh):
    trained = vitviz.load_model(name, device="cpu")
    torch.manual_seed(0)
    untrained = vitviz.get_spec(name).build().eval()
    acc, point = _measure(trained, fresh)
    _, point_untrained = _measure(untrained, fresh)
    print(f"\n{name}: top-1 {acc:.1%}; pointing game {point:.1%} (untrained, same shape: {point_untrained:.1%})")
    assert acc >= FLOORS[name]
    assert point >= 0.9
    assert point > point_untrained
