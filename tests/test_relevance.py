"""Gradient relevance, gradient rollout, DINO head maps, patch features and faithfulness, checked
against hand-worked cases and independent computations."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vitviz
from vitviz.explanations import explain, maps_of, record, record_for, relevance_maps
from vitviz.faithfulness import _patch_mask, auc, perturbation_curves
from vitviz.relevance import (
    dino_head_maps,
    feature_components,
    feature_similarity,
    gradient_relevance,
    gradient_rollout,
    keep_mass,
)

# ----------------------------------------------------------------------------- hand-worked


def test_gradient_relevance_by_hand_two_layers_two_heads():
    # layer 1, two heads; (G ⊙ A)+ then the head mean: clipping comes before the mean
    a1 = torch.tensor([[[0.2, 0.8], [0.6, 0.4]], [[0.5, 0.5], [0.1, 0.9]]])
    g1 = torch.tensor([[[1.0, -1.0], [0.5, 2.0]], [[-2.0, 1.0], [1.0, 1.0]]])
    # G ⊙ A: head 1 [[0.2, -0.8], [0.3, 0.8]], head 2 [[-1.0, 0.5], [0.1, 0.9]]
    # clipped: [[0.2, 0], [0.3, 0.8]] and [[0, 0.5], [0.1, 0.9]]; mean: [[0.1, 0.25], [0.2, 0.85]]
    abar1 = torch.tensor([[0.1, 0.25], [0.2, 0.85]])
    a2 = torch.tensor([[[1.0, 0.0], [0.3, 0.7]], [[0.4, 0.6], [0.0, 1.0]]])
    g2 = torch.tensor([[[1.0, 1.0], [1.0, -1.0]], [[0.5, 0.5], [1.0, 1.0]]])
    # clipped products: [[1, 0], [0.3, 0]] and [[0.2, 0.3], [0, 1]]; mean: [[0.6, 0.15], [0.15, 0.5]]
    abar2 = torch.tensor([[0.6, 0.15], [0.15, 0.5]])
    r1 = torch.eye(2) + abar1
    want = r1 + abar2 @ r1
    got = gradient_relevance(torch.stack([a1, a2]), torch.stack([g1, g2]))
    torch.testing.assert_close(got, want)
    # mean before clipping would give another answer: the test tells the two apart
    wrong1 = torch.eye(2) + (g1 * a1).mean(0).clamp(min=0)
    assert not torch.allclose(wrong1, r1)


def test_gradient_rollout_by_hand():
    # one layer, two heads, N = 3 with one prefix token
    a = torch.tensor([[[0.2, 0.3, 0.5]] * 3, [[0.6, 0.2, 0.2]] * 3])  # [H, N, N]
    g = torch.tensor([[[1.0, -1.0, 2.0]] * 3, [[1.0, 1.0, -4.0]] * 3])
    # G ⊙ A per head: [0.2, -0.3, 1.0] and [0.6, 0.2, -0.8]; head mean: [0.4, -0.05, 0.1]; clipped: [0.4, 0, 0.1]
    fused = torch.tensor([[0.4, 0.0, 0.1]] * 3)
    hat = fused + torch.eye(3)
    want = hat / hat.sum(-1, keepdim=True)
    torch.testing.assert_close(gradient_rollout(a.unsqueeze(0), g.unsqueeze(0)), want)
    # with gradients of one, it is attention rollout
    ones = torch.ones(2, 2, 3, 3)
    attn = torch.softmax(torch.randn(2, 2, 3, 3), -1)
    torch.testing.assert_close(gradient_rollout(attn, ones, discard_ratio=0.5), vitviz.attention_rollout(attn, discard_ratio=0.5))


def test_dino_threshold_by_hand():
    w = torch.tensor([0.1, 0.4, 0.2, 0.3])
    # sorted 0.1 0.2 0.3 0.4, cumulative 0.1 0.3 0.6 1.0; above 1 - 0.6 = 0.4: the 0.3 and the 0.4
    assert keep_mass(w, 0.6).tolist() == [False, True, False, True]
    assert keep_mass(w, 1.0).all() and keep_mass(w, 0.35).tolist() == [False, True, False, False]
    attn = torch.softmax(torch.randn(3, 2, 1 + 9, 1 + 9), -1)  # [L, H, N, N], 3x3 patches
    maps, masks = dino_head_maps(attn, share=0.6)
    torch.testing.assert_close(maps, attn[-1, :, 0, 1:].reshape(2, 3, 3))
    for h in range(2):
        kept = maps[h][masks[h]]
        # the kept patches hold at least the share, and dropping the smallest of them would not
        share = kept.sum() / maps[h].sum()
        assert share >= 0.6 - 1e-6 and (kept.sum() - kept.min()) / maps[h].sum() < 0.6


def test_feature_components_against_numpy_and_similarity_by_hand():
    f = torch.randn(30, 8, dtype=torch.float64)
    f[:, 0] *= 5
    scores, explained = feature_components(f, k=3)
    x = f.numpy() - f.numpy().mean(0)
    evals, evecs = np.linalg.eigh(np.cov(x, rowvar=False))
    order = np.argsort(evals)[::-1][:3]
    for i, j in enumerate(order):
        want = x @ evecs[:, j]
        assert abs(np.dot(scores[:, i].double().numpy(), want)) == pytest.approx(np.dot(want, want), rel=1e-5)
    np.testing.assert_allclose(explained.numpy(), (evals[order] / evals.sum()).astype(np.float32), rtol=1e-4)
    g = torch.tensor([[1.0, 0.0], [0.0, 2.0], [-3.0, 0.0], [1.0, 1.0]])
    torch.testing.assert_close(feature_similarity(g, 0), torch.tensor([1.0, 0.0, -1.0, 1 / math.sqrt(2)]))


# ----------------------------------------------------------------------------- against a recorded model


def _independent(model, x, target):
    """Attention and d(target logit)/d(attention) per layer, from a forward written out here from the
    model's weights (each layer's softmax output kept as its own tensor) and torch.autograd.grad."""
    tokens = model.tokens(x)
    attns = []
    for block in model.blocks:
        h = block.norm1(tokens)
        b, n, d = h.shape
        heads = block.attn.heads
        q, k, v = F.linear(h, block.attn.qkv.weight, block.attn.qkv.bias).reshape(b, n, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // heads), dim=-1)
        attns.append(a)
        out = (a @ v).transpose(1, 2).reshape(b, n, d)
        tokens = tokens + block.attn.proj(out)
        tokens = tokens + block.mlp(block.norm2(tokens))
    logits = model.head(model.norm(tokens)[:, 0])
    grads = torch.autograd.grad(logits[0, target], attns)
    return torch.stack([a.detach()[0] for a in attns]), torch.stack([g[0] for g in grads])


@pytest.fixture(scope="module")
def model():
    return vitviz.load_model("shapes_p16", device="cpu")


def test_recorded_gradients_are_each_layers_own(model):
    x = vitviz.preprocess(vitviz.load_image(vitviz.sources.assets_dir() / "examples" / "star.png"), model.spec.preprocessing)[0][None]
    target = 3
    attn, grads = _independent(model, x, target)
    with vitviz.record_attention(model, gradients=True) as rec:
        logits = model(x)
        logits[0, target].backward()
    torch.testing.assert_close(rec.attentions[:, 0], attn, atol=1e-5, rtol=0)
    torch.testing.assert_close(rec.gradients[:, 0], grads, atol=1e-6, rtol=1e-4)
    # the layers' gradients differ, so a pairing with another layer's would fail the line above
    assert all(not torch.allclose(grads[i], grads[j]) for i in range(6) for j in range(6) if i != j)
    model.zero_grad(set_to_none=True)

    # and the maps, against loops written here
    maps, targets, _ = relevance_maps(model, x, methods=["gradient", "grad_rollout"], targets=[target])
    r = np.eye(37)
    for a_l, g_l in zip(attn.double().numpy(), grads.double().numpy()):
        r = r + np.clip(g_l * a_l, 0, None).mean(0) @ r
    np.testing.assert_allclose(maps["gradient"][0].numpy(), r[0, 1:].reshape(6, 6), rtol=1e-4, atol=1e-6)
    r = np.eye(37)
    for a_l, g_l in zip(attn.double().numpy(), grads.double().numpy()):
        hat = np.clip((g_l * a_l).mean(0), 0, None) + np.eye(37)
        r = hat / hat.sum(1, keepdims=True) @ r
    np.testing.assert_allclose(maps["grad_rollout"][0].numpy(), r[0, 1:].reshape(6, 6), rtol=1e-4, atol=1e-6)
    assert targets.tolist() == [target]


def test_batches_give_the_single_image_maps_with_per_sample_targets(model):
    torch.manual_seed(3)
    x = torch.randn(4, 3, 96, 96)
    targets = [2, "star", None, 7]
    batched, chosen, probs = relevance_maps(model, x, targets=targets)
    assert chosen[1] == vitviz.shapes.CLASSES.index("star") and chosen[2] == probs[2].argmax()
    for i in range(4):
        single, _, _ = relevance_maps(model, x[i : i + 1], targets=[targets[i]])
        for method in batched:
            torch.testing.assert_close(batched[method][i], single[method][0], atol=1e-5, rtol=1e-4)


def test_relevance_leaves_no_gradient_on_any_weight_and_no_graph_behind(model):
    """Gradient methods differentiate the attention maps alone: after relevance_maps (every gradient
    method, LeGrad's per-layer gradients included) no weight holds a gradient, the weights still
    require grad as before, and the maps carry no graph."""
    model.zero_grad(set_to_none=True)
    x = torch.randn(2, 3, 96, 96)
    maps, _, _ = relevance_maps(model, x, methods=["gradient", "grad_rollout", "legrad"])
    assert all(p.grad is None and p.requires_grad for p in model.parameters())
    assert all(not m.requires_grad and m.grad_fn is None for m in maps.values())


def test_the_backward_reduces_each_layer_and_keeps_no_gradient(model):
    """The pass `relevance_maps` makes: each gradient method's per-layer term computed inside the
    backward (no gradient stack kept, nothing below the first layer's attention differentiated),
    giving the maps of the pass that keeps every gradient; options it was not reduced with are
    refused, not silently answered."""
    torch.manual_seed(5)
    x = torch.randn(3, 3, 96, 96)
    methods = ["gradient", "grad_rollout"]
    reached = []
    handle = model.patch_embed.register_full_backward_hook(lambda *args: reached.append(1))
    try:
        fused = record_for(model, x, methods, head_fusion="max", discard_ratio=0.0)
    finally:
        handle.remove()
    assert fused.gradients is None and set(fused.reduced) == set(methods) and not reached
    assert all(t.shape == (3, 37, 37) and t.grad_fn is None for t in fused.reduced["gradient"][1])
    kept = record(model, x, gradients=True)
    assert kept.gradients.shape == (6, 3, 3, 37, 37) and not kept.reduced
    want = {fusion: maps_of(kept, methods, head_fusion=fusion) for fusion in ("max", "mean")}
    got = maps_of(fused, methods, head_fusion="max")
    for m in methods:
        torch.testing.assert_close(got[m], want["max"][m], atol=1e-6, rtol=1e-5)
    assert not torch.allclose(want["mean"]["grad_rollout"], got["grad_rollout"])  # the fusion matters, so the check above can fail
    with pytest.raises(ValueError, match="kept no gradients"):
        maps_of(fused, ["grad_rollout"], head_fusion="mean")
    torch.testing.assert_close(maps_of(fused, ["gradient"], head_fusion="mean")["gradient"], want["mean"]["gradient"], atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="layerwise"):
        vitviz.register_method("bad_layerwise", title="x", needs_gradients=False, layerwise=lambda a, g: a)


def test_explain_names_its_target_and_refuses_what_it_cannot_explain(model):
    star = vitviz.sources.assets_dir() / "examples" / "star.png"
    top = explain(model, star, method="gradient")
    assert top.label == "star" and top.target == 3 and top.map.shape == (6, 6) and 0 < top.probability <= 1
    other = explain(model, star, method="gradient", target="circle")
    assert other.target == 0 and not torch.allclose(other.map, top.map)
    with torch.inference_mode():  # a caller in inference mode still gets gradients
        torch.testing.assert_close(explain(model, star, method="gradient").map, top.map)
    with pytest.raises(ValueError, match="unknown method"):
        explain(model, star, method="saliency")
    with pytest.raises(ValueError, match="unknown class"):
        explain(model, star, target="dog")
    feature_model = vitviz.ViT(image_size=96, patch_size=16, width=32, depth=2, heads=2, mlp_dim=64, num_classes=0)
    feature_model.spec = vitviz.VariantSpec(name="features", config=feature_model.config, preprocessing=vitviz.Preprocessing(96),
                                            categories=None, source="test", weights="random")
    assert explain(feature_model.eval(), star, method="rollout").target is None
    with pytest.raises(ValueError, match="no classifier"):
        explain(feature_model, star, method="gradient")


# ----------------------------------------------------------------------------- faithfulness


def test_patch_masks_take_the_patches_in_the_maps_order():
    order = torch.tensor([[3, 0, 2, 1]])  # a 2x2 grid, patch 3 first
    masks = _patch_mask(order, torch.tensor([0, 1, 2, 4]), (2, 2), 2)  # [1, 4, 4, 4]
    want_first = torch.zeros(4, 4, dtype=torch.bool)
    want_first[2:, 2:] = True  # patch 3 is row 1, column 1
    assert not masks[0, 0].any() and torch.equal(masks[0, 1], want_first)
    want_second = want_first.clone()
    want_second[:2, :2] = True  # then patch 0
    assert torch.equal(masks[0, 2], want_second) and masks[0, 3].all()


def test_deletion_and_insertion_curves_against_perturbed_images_made_here(model):
    torch.manual_seed(5)
    x = torch.randn(2, 3, 96, 96)
    maps = torch.rand(2, 6, 6)
    targets = torch.tensor([1, 4])
    curves = perturbation_curves(model, x, maps, targets, steps=4)
    torch.testing.assert_close(curves.fractions, torch.tensor([0.0, 9 / 36, 18 / 36, 27 / 36, 1.0]))
    for b in range(2):
        order = maps[b].flatten().argsort(descending=True)
        for s, count in enumerate([0, 9, 18, 27, 36]):
            gone = torch.zeros(36, dtype=torch.bool)
            gone[order[:count]] = True
            pixels = gone.reshape(6, 6).repeat_interleave(16, 0).repeat_interleave(16, 1)
            with torch.inference_mode():
                deleted = model((x[b] * ~pixels).unsqueeze(0)).softmax(-1)[0, targets[b]]
                inserted = model((x[b] * pixels).unsqueeze(0)).softmax(-1)[0, targets[b]]
            assert curves.deletion[b, s].item() == pytest.approx(deleted.item(), abs=1e-5)
            assert curves.insertion[b, s].item() == pytest.approx(inserted.item(), abs=1e-5)
    # the trapezoidal rule by hand
    assert auc(torch.tensor([0.0, 0.5, 1.0]), torch.tensor([1.0, 0.5, 0.0])).item() == pytest.approx(0.5)
    assert curves.deletion_auc.shape == (2,)


@pytest.fixture(scope="module")
def fresh_shapes(tmp_path_factory):
    """200 generated images never trained on, with their masks, as a folder."""
    folder = tmp_path_factory.mktemp("fresh") / "data"
    vitviz.shapes.write_dataset(folder, 200, seed=4242)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("name", ["shapes_p16", "shapes_p8"])
def test_gradient_relevance_points_at_the_object(name, fresh_shapes, tmp_path):
    """On 200 fresh images, Chefer's relevance for the true class peaks on the object (dilated by
    one patch) in at least 95 % of them, and deletes and inserts better than a random order."""
    from vitviz.evaluate import evaluate

    rows = evaluate(fresh_shapes, model=name, out=tmp_path / name, methods=("gradient", "rollout"), steps=8, batch_size=50,
                    workers=0, compare=False, progress=False)
    f = {(r["method"], r["metric"]): r["mean"] for r in rows}
    print(f"\n{name} on 200 images: " + "; ".join(f"{m} {f[(m, 'pointing')]:.1%}" for m in ("gradient", "rollout", "random")))
    assert f[("gradient", "pointing")] >= 0.95
    assert f[("random", "pointing")] < 0.7
    assert f[("gradient", "deletion")] < f[("random", "deletion")]
    assert f[("gradient", "insertion")] > f[("random", "insertion")]
