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
    result = vitviz.analyze(model, img, top_k=5)
    assert len(result.predictions) == 5
    probs = [p for _, p in result.predictions]
    assert probs == sorted(probs, reverse=True) and abs(result.probabilities.sum().item() - 1) < 1e-5
    assert result.attentions.shape == (12, 12, 50, 50) and result.attentions.device.type == "cpu"
    assert result.rollout.shape == (50, 50) and result.cls_map.shape == (7, 7)
    assert result.distances.shape == (12, 12)
    assert result.grid == (7, 7) and result.patch_size == 32 and result.image.size == (224, 224)
    # the same numbers torchvision gives on the same preprocessed input
    x, _ = vitviz.preprocess(img, model.spec)
    with torch.inference_mode():
        want = tv(x.unsqueeze(0)).softmax(-1)[0]
    torch.testing.assert_close(result.probabilities, want, atol=1e-5, rtol=0)
    label, p = result.predictions[0]
    assert label == model.spec.categories[int(want.argmax())] and p == pytest.approx(want.max().item(), abs=1e-5)
    torch.testing.assert_close(result.rollout, attention_rollout(result.attentions))
    torch.testing.assert_close(result.cls_map.flatten(), result.rollout[0, 1:])


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


def test_rollout_options_recompute_without_the_model(tv_and_ours):
    _, model = tv_and_ours
    result = vitviz.analyze(model, _photo(2))
    other = result.with_rollout(head_fusion="max", discard_ratio=0.9)
    torch.testing.assert_close(other.rollout, attention_rollout(result.attentions, head_fusion="max", discard_ratio=0.9))
    assert other.attentions is result.attentions
    direct = vitviz.analyze(model, _photo(2), head_fusion="max", discard_ratio=0.9)
    torch.testing.assert_close(direct.rollout, other.rollout)
