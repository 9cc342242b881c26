"""Rollout, mean attention distance, position similarity and filter PCA on hand-worked cases."""

import math

import numpy as np
import pytest
import torch

import vitviz
from vitviz.analysis import cls_map, fuse_heads, patch_distances, pointing_game, query_attention


def _random_attention(*shape):
    return torch.softmax(torch.randn(*shape) * 3, dim=-1)


# ----------------------------------------------------------------------------- rollout

def test_rollout_hand_case_one_layer_mean_fusion():
    a = torch.tensor([[[0.2, 0.8], [0.6, 0.4]], [[0.4, 0.6], [0.0, 1.0]]])  # [H=2, N, N]
    # mean over heads: [[0.3, 0.7], [0.3, 0.7]]; + I -> [[1.3, 0.7], [0.3, 1.7]]; rows sum to 2
    want = torch.tensor([[0.65, 0.35], [0.15, 0.85]])
    got = vitviz.attention_rollout(a.unsqueeze(0))
    torch.testing.assert_close(got, want)


def test_rollout_multiplies_from_first_layer_up():
    a1 = torch.tensor([[[1.0, 0.0], [1.0, 0.0]]])
    a2 = torch.tensor([[[0.0, 1.0], [0.0, 1.0]]])
    h1 = torch.tensor([[1.0, 0.0], [0.5, 0.5]])  # rownorm(a1 + I)
    h2 = torch.tensor([[0.5, 0.5], [0.0, 1.0]])
    got = vitviz.attention_rollout(torch.stack([a1, a2]))
    torch.testing.assert_close(got, h2 @ h1)
    assert not torch.allclose(got, h1 @ h2)


def test_rollout_max_min_fusion_and_discard_hand_case():
    # one layer, two heads, N = 4 with one prefix token
    h0 = torch.tensor([[0.1, 0.2, 0.3, 0.4]] * 4)
    h1 = torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 4)
    a = torch.stack([h0, h1]).unsqueeze(0)  # [1, 2, 4, 4]
    eye = torch.eye(4)
    rn = lambda m: m / m.sum(-1, keepdim=True)  # noqa: E731
    torch.testing.assert_close(vitviz.attention_rollout(a, head_fusion="max"), rn(torch.maximum(h0, h1) + eye))
    torch.testing.assert_close(vitviz.attention_rollout(a, head_fusion="min"), rn(torch.minimum(h0, h1) + eye))
    # discard_ratio 0.5 -> floor(0.5 * 3) = 1 smallest patch column zeroed in each row
    a2 = torch.stack([torch.tensor([[0.4, 0.1, 0.2, 0.3]] * 4)] * 2).unsqueeze(0)
    want = rn(torch.tensor([[0.4, 0.0, 0.2, 0.3]] * 4) + eye)
    torch.testing.assert_close(vitviz.attention_rollout(a2, discard_ratio=0.5), want)
    # the prefix column is never discarded, even when it is the smallest
    a3 = torch.stack([torch.tensor([[0.05, 0.25, 0.3, 0.4]] * 4)] * 2).unsqueeze(0)
    want3 = rn(torch.tensor([[0.05, 0.0, 0.3, 0.4]] * 4) + eye)
    torch.testing.assert_close(vitviz.attention_rollout(a3, discard_ratio=0.5), want3)


def test_rollout_invariants():
    attn = _random_attention(6, 3, 4, 17, 17)
    r = vitviz.attention_rollout(attn)
    assert r.shape == (3, 17, 17)
    torch.testing.assert_close(r.sum(-1), torch.ones(3, 17))
    assert (r >= 0).all()
    for fusion in ("max", "min"):
        for ratio in (0.0, 0.5, 0.9):
            rr = vitviz.attention_rollout(attn, head_fusion=fusion, discard_ratio=ratio)
            torch.testing.assert_close(rr.sum(-1), torch.ones(3, 17))
    # batched equals unbatched
    for b in range(3):
        torch.testing.assert_close(vitviz.attention_rollout(attn[:, b]), r[b])
    # identity attention gives identity rollout
    eye = torch.eye(17).expand(6, 2, 4, 17, 17)
    torch.testing.assert_close(vitviz.attention_rollout(eye), torch.eye(17).expand(2, 17, 17))


def test_rollout_against_explicit_loop():
    attn = _random_attention(4, 2, 3, 10, 10).double()
    got = vitviz.attention_rollout(attn, discard_ratio=0.3)
    k = math.floor(0.3 * 9)
    for b in range(2):
        r = np.eye(10)
        for layer in range(4):
            m = attn[layer, b].mean(0).numpy().copy()
            for i in range(10):
                cols = np.argsort(m[i, 1:])[:k] + 1
                m[i, cols] = 0
            m = m + np.eye(10)
            m = m / m.sum(1, keepdims=True)
            r = m @ r
        np.testing.assert_allclose(got[b].numpy(), r, atol=1e-12)


def test_cls_map_shape_and_values():
    r = torch.arange(17 * 17, dtype=torch.float32).reshape(17, 17)
    m = cls_map(r)
    assert m.shape == (4, 4)
    torch.testing.assert_close(m.flatten(), r[0, 1:])
    with pytest.raises(ValueError, match="square"):
        cls_map(torch.zeros(7, 7))


def test_bad_inputs_are_refused_with_the_shape():
    with pytest.raises(ValueError, match=r"\[3, 5\]"):
        vitviz.attention_rollout(torch.zeros(3, 5))
    with pytest.raises(ValueError, match="head_fusion"):
        vitviz.attention_rollout(_random_attention(1, 1, 5, 5), head_fusion="median")
    with pytest.raises(ValueError, match="discard_ratio"):
        vitviz.attention_rollout(_random_attention(1, 1, 5, 5), discard_ratio=1.0)


# ----------------------------------------------------------------------------- distance

def test_uniform_attention_on_14x14_at_16px_is_about_116_5():
    n = 1 + 14 * 14
    attn = torch.full((1, 1, n, n), 1.0 / n, dtype=torch.float64)
    mad = vitviz.mean_attention_distance(attn, patch_size=16)
    assert mad.shape == (1, 1)
    assert mad.item() == pytest.approx(116.5, abs=0.1)
    assert vitviz.uniform_attention_distance((14, 14), patch_size=16) == pytest.approx(mad.item())
    # without renormalisation the prefix column's mass is lost: (196/197) of it
    raw = vitviz.mean_attention_distance(attn, patch_size=16, renormalize=False)
    assert raw.item() == pytest.approx(mad.item() * 196 / 197)


def test_attention_on_self_gives_distance_zero():
    attn = torch.eye(1 + 49).expand(3, 2, 4, 50, 50)
    assert torch.all(vitviz.mean_attention_distance(attn, patch_size=32) == 0)


def test_distance_hand_case_2x2_grid():
    # patches 0..3 at (0,0), (0,1), (1,0), (1,1); every patch attends half to itself and half to
    # the diagonally opposite patch -> distance 0.5 * sqrt(2) * P for every query
    n = 5
    a = torch.zeros(1, 1, n, n)
    opposite = {1: 4, 2: 3, 3: 2, 4: 1}
    for q, o in opposite.items():
        a[0, 0, q, q] = 0.4
        a[0, 0, q, o] = 0.4
        a[0, 0, q, 0] = 0.2  # prefix mass: dropped and renormalised away
    a[0, 0, 0, 0] = 1.0
    mad = vitviz.mean_attention_distance(a, patch_size=10)
    assert mad.item() == pytest.approx(0.5 * math.sqrt(2) * 10)
    raw = vitviz.mean_attention_distance(a, patch_size=10, renormalize=False)
    assert raw.item() == pytest.approx(0.4 * math.sqrt(2) * 10)


def test_distance_shapes_batched_and_rectangular_grid():
    attn = _random_attention(3, 2, 4, 1 + 2 * 3, 1 + 2 * 3)
    mad = vitviz.mean_attention_distance(attn, patch_size=8, grid=(2, 3))
    assert mad.shape == (3, 2, 4)
    torch.testing.assert_close(vitviz.mean_attention_distance(attn[:, 1], patch_size=8, grid=(2, 3)), mad[:, 1])
    d = patch_distances((2, 3), patch_size=8)
    assert d[0, 5].item() == pytest.approx(8 * math.sqrt(1 + 4))
    with pytest.raises(ValueError, match="square"):
        vitviz.mean_attention_distance(attn, patch_size=8)


# ----------------------------------------------------------------------------- position embeddings

def test_position_similarity_hand_case_and_diagonal():
    e = torch.tensor([[9.0, 9.0], [1.0, 0.0], [0.0, 2.0], [1.0, 1.0], [-3.0, 0.0]])  # prefix + 2x2
    s = vitviz.position_embedding_similarity(e.unsqueeze(0), grid=(2, 2))
    assert s.shape == (2, 2, 2, 2)
    assert s[0, 0, 0, 1].item() == pytest.approx(0.0, abs=1e-7)
    assert s[0, 0, 1, 0].item() == pytest.approx(1 / math.sqrt(2))
    assert s[0, 0, 1, 1].item() == pytest.approx(-1.0)
    pos = torch.randn(1, 1 + 49, 32)
    s = vitviz.position_embedding_similarity(pos)
    torch.testing.assert_close(torch.einsum("abab->ab", s), torch.ones(7, 7))
    torch.testing.assert_close(s, s.permute(2, 3, 0, 1))


# ----------------------------------------------------------------------------- filters

def test_filter_components_match_numpy_pca():
    w = torch.randn(64, 3, 4, 4)
    w[:, 0] += torch.randn(64, 1, 1) * 5  # one dominant direction
    comps, explained = vitviz.embedding_filter_components(w, k=28)
    assert comps.shape == (28, 3, 4, 4) and explained.shape == (28,)
    x = w.reshape(64, -1).double().numpy()
    x = x - x.mean(0)
    evals, evecs = np.linalg.eigh(np.cov(x, rowvar=False))
    order = np.argsort(evals)[::-1][:28]
    for i, j in enumerate(order[:5]):
        cos = abs(float(np.dot(comps[i].flatten().double().numpy(), evecs[:, j])))
        assert cos == pytest.approx(1.0, abs=1e-5)
    np.testing.assert_allclose(explained.numpy(), (evals[order] / evals.sum()).astype(np.float32), rtol=1e-4)
    assert torch.all(explained[:-1] >= explained[1:])


# ----------------------------------------------------------------------------- query and pointing

def test_query_attention_selects_layer_head_and_query():
    attn = _random_attention(2, 3, 5, 5)
    got = query_attention(attn, layer=1, query=3, head=2)
    torch.testing.assert_close(got, attn[1, 2, 3, 1:].reshape(2, 2))
    torch.testing.assert_close(query_attention(attn, layer=0, query=0, head="mean"), attn[0, :, 0, 1:].mean(0).reshape(2, 2))
    torch.testing.assert_close(fuse_heads(attn, "max", dim=1), attn.amax(1))


def test_pointing_game_hand_case():
    masks = torch.zeros(2, 32, 32, dtype=torch.bool)
    masks[:, 0:5, 0:5] = True  # object pixels 0..4; dilated by one 8 px patch: 0..12
    maps = torch.zeros(2, 4, 4)
    maps[0, 1, 1] = 1.0  # centre (12, 12): inside the dilated mask
    maps[1, 2, 2] = 1.0  # centre (20, 20): outside
    hits = pointing_game(maps, masks, patch_size=8)
    assert hits.tolist() == [True, False]
    assert pointing_game(maps, masks, patch_size=8, dilate_patches=0).tolist() == [False, False]
