"""vitviz.analyze: one call from an image to predictions and analyses."""

import numpy as np
import pytest
import torch
from conftest import random_torchvision
from PIL import Image

import vitviz
from vitviz.analysis import attention_rollout


@pytest.fixture(scope="module")
def tv_and_ours():
    torch.manual_seed(3)
    tv = random_torchvision("vit_b_32")
    return tv, vitviz.ViT.from_torchvision(tv)


def _photo(seed=0, size=(320, 240)):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def test_analyze_returns_consistent_cpu_tensors(tv_and_ours):
    tv, model = tv_and_ours
    img = _photo()
    result = vitviz.analyze(model, img)
    assert len(result.predictions()) == 5 and len(result.predictions(3)) == 3
    probs = [p for _, p in result.predictions()]
    assert probs == sorted(probs, reverse=True) and abs(result.probabilities.sum().item() - 1) < 1e-5
    assert result.attentions.shape == (12, 12, 50, 50) and result.attentions.device.type == "cpu"
    assert result.rollout().shape == (50, 50) and result.cls_map().shape == (7, 7)
    assert result.distances().shape == (12, 12) and result.tokens.shape == (50, 768)
    assert result.grid == (7, 7) and result.patch_size == 32 and result.image.size == (224, 224)
    assert result.prefix_names == ("cls",) and result.nbytes > result.attentions.numel() * 4
    # the same numbers torchvision gives on the same preprocessed input
    x, _ = vitviz.preprocess(img, model.spec.preprocessing)
    with torch.inference_mode():
        want = tv(x.unsqueeze(0)).softmax(-1)[0]
    torch.testing.assert_close(result.probabilities, want, atol=1e-5, rtol=0)
    label, p = result.predictions()[0]
    assert label == model.spec.categories[int(want.argmax())] and p == pytest.approx(want.max().item(), abs=1e-5)
    torch.testing.assert_close(result.rollout(), attention_rollout(result.attentions))
    torch.testing.assert_close(result.cls_map().flatten(), result.rollout()[0, 1:])
    # the final tokens are torchvision's encoder output
    with torch.inference_mode():
        cls = tv.class_token.expand(1, -1, -1)
        encoded = tv.encoder(torch.cat([cls, tv._process_input(x.unsqueeze(0))], dim=1))[0]
    torch.testing.assert_close(result.tokens, encoded, atol=1e-4, rtol=0)


def test_paths_bytes_and_arrays_give_the_same_result(tv_and_ours, tmp_path):
    _, model = tv_and_ours
    img = _photo(1)
    path = tmp_path / "x.png"
    img.save(path)
    a = vitviz.analyze(model, img)
    b = vitviz.analyze(model, path)
    c = vitviz.analyze(model, path.read_bytes())
    d = vitviz.analyze(model, np.asarray(img))
    for other in (b, c, d):
        torch.testing.assert_close(other.probabilities, a.probabilities)


def test_derived_views_are_computed_from_the_stored_attention(tv_and_ours, monkeypatch):
    _, model = tv_and_ours
    result = vitviz.analyze(model, _photo(2))

    def forbidden(*args, **kwargs):
        raise AssertionError("the model ran")

    monkeypatch.setattr(vitviz.ViT, "forward", forbidden)
    monkeypatch.setattr(vitviz.ViT, "encode", forbidden)
    got = result.rollout(head_fusion="max", discard_ratio=0.9)
    torch.testing.assert_close(got, attention_rollout(result.attentions, head_fusion="max", discard_ratio=0.9))
    torch.testing.assert_close(result.cls_map(head_fusion="max", discard_ratio=0.9).flatten(), got[0, 1:])
    torch.testing.assert_close(result.distances(renormalize=False), vitviz.mean_attention_distance(result.attentions, patch_size=32, renormalize=False))


def test_analysing_the_crop_again_gives_the_same_numbers(tv_and_ours):
    from vitviz.pipeline import analyze_crop

    _, model = tv_and_ours
    first = vitviz.analyze(model, _photo(4, size=(500, 333)))
    again = analyze_crop(model, first.image)
    torch.testing.assert_close(again.attentions, first.attentions, atol=0, rtol=0)
    torch.testing.assert_close(again.probabilities, first.probabilities, atol=0, rtol=0)
