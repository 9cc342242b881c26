"""Targets in words: the maps of an image–text model (CLIP) for a phrase, whose score is the
image–text similarity `logits_per_image[b, t]`, and LeGrad (Bousselham et al. 2024), each held to
a computation written here on transformers' own models (their forward, their attention tensors,
`torch.autograd.grad`), independent of vitviz's recording; several phrases in one call equal the
phrases one by one; the errors say what to do."""

import sys

import pytest
import torch
from test_imagetext import EOS, _clip, _texts, _tiny_tokenizer

import vitviz
from vitviz.explanations import maps_of, record, relevance_maps

transformers = pytest.importorskip("transformers")

GRADIENT_METHODS = ["gradient", "grad_rollout", "legrad"]


@pytest.fixture(autouse=True, scope="module")
def _registry_as_it_was():
    """"legrad" registers itself on first use; later test modules see the registry as it was."""
    from vitviz.explainers import registry

    before, loaded = dict(registry._REGISTRY), "vitviz.explainers.legrad" in sys.modules
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(before)
    if not loaded:
        sys.modules.pop("vitviz.explainers.legrad", None)


def _image():
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(5))


def _hf_clip_pass(model, x, ids, mask):
    """transformers' CLIP forward with autograd: (logits_per_image [B, T], attentions (one [B, H, N, N]
    per layer: the tensors multiplied by V), the vision encoder's hidden states (input, then each
    layer's output), the text embeddings)."""
    out = model(pixel_values=x, input_ids=ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
    return out.logits_per_image, out.vision_model_output.attentions, out.vision_model_output.hidden_states, out.text_embeds


def _chefer_by_hand(attentions, grads):
    """R = I; R <- R + mean_h (G ⊙ A)⁺ R, first layer first; the cls row over the patches [B, N-1]."""
    n = attentions[0].shape[-1]
    r = torch.eye(n).repeat(attentions[0].shape[0], 1, 1)
    for a, g in zip(attentions, grads):
        r = r + torch.clamp(g * a, min=0).mean(dim=1) @ r
    return r[:, 0, 1:]


def _minmax(v):
    low, high = v.min(dim=-1, keepdim=True).values, v.max(dim=-1, keepdim=True).values
    return (v - low) / (high - low)


def _legrad_by_hand(per_layer_score, attentions, start=0):
    """sum over l >= start of mean_{heads, queries} ReLU(d s_l / d A_l), patch columns, min-max; one
    `autograd.grad` per layer, each of that layer's own score."""
    total = 0
    for l, a in enumerate(attentions):
        if l < start:
            continue
        (g,) = torch.autograd.grad(per_layer_score(l), [a], retain_graph=True)
        total = total + torch.clamp(g, min=0).mean(dim=(1, 2))  # [B, N]
    return _minmax(total[:, 1:])


def _clip_by_hand(model, x, ids, mask, t, readout="mean"):
    """The "gradient" and "legrad" maps of phrase t [B, gh*gw], from transformers' CLIP; LeGrad's
    layer scores read from the mean of all tokens ("mean", the authors' read-out) or the cls token."""
    with torch.enable_grad():
        x = x.clone().requires_grad_(True)
        logits, attentions, hidden, text_embeds = _hf_clip_pass(model, x, ids, mask)
        target = logits[:, t].sum()  # the images do not interact: each image's own similarity
        grads = torch.autograd.grad(target, attentions, retain_graph=True)
        gradient = _chefer_by_hand([a.detach() for a in attentions], grads)
        vision = model.vision_model
        text = torch.nn.functional.normalize(text_embeds[t], dim=-1)

        def score(l):  # layer l's tokens through the post-layernorm and the projection, on the target's scale
            read = hidden[l + 1].mean(dim=1) if readout == "mean" else hidden[l + 1][:, 0]
            image = model.visual_projection(vision.post_layernorm(read))
            return (model.logit_scale.exp() * torch.nn.functional.normalize(image, dim=-1) @ text).sum()

        legrad = _legrad_by_hand(score, attentions)
    return gradient, legrad


def test_the_gradient_and_legrad_maps_of_a_phrase_are_those_computed_on_transformers_clip():
    model = _clip(seed=2)
    ours = vitviz.from_transformers(model)
    x = _image()
    ids, mask = _texts()
    maps, targets, sims = relevance_maps(ours, x, methods=["attention", "rollout", *GRADIENT_METHODS], text=(ids, mask))
    assert targets is None and sims.shape == (2, 3) and all(m.shape == (2, 3, 4, 4) for m in maps.values())
    with torch.no_grad():
        torch.testing.assert_close(sims, model(pixel_values=x, input_ids=ids, attention_mask=mask).logits_per_image, atol=1e-4, rtol=1e-4)
    cls, _, _ = relevance_maps(ours, x, methods=["legrad"], text=(ids, mask), readout="cls", start_layer=0)
    for t in range(3):
        gradient, legrad = _clip_by_hand(model, x, ids, mask, t)  # two layers: the last two are all of them
        torch.testing.assert_close(maps["gradient"][:, t].flatten(1), gradient, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(maps["legrad"][:, t].flatten(1), legrad, atol=1e-4, rtol=1e-4)
        _, legrad_cls = _clip_by_hand(model, x, ids, mask, t, readout="cls")
        torch.testing.assert_close(cls["legrad"][:, t].flatten(1), legrad_cls, atol=1e-4, rtol=1e-4)
        assert (legrad_cls - legrad).abs().max() > 1e-2
    # the phrases are told apart, and a target-free map is the same for every phrase
    assert (maps["gradient"][:, 0] - maps["gradient"][:, 1]).abs().max() > 1e-3
    torch.testing.assert_close(maps["rollout"][:, 0], maps["rollout"][:, 2])


def test_legrad_differentiates_each_layer_on_its_own():
    """One backward of the summed per-layer scores gives A_l the later layers' gradients too: a
    different map, which the test above would refuse."""
    model = _clip(seed=2)
    x = _image()
    ids, mask = _texts()
    _, legrad = _clip_by_hand(model, x, ids, mask, 0, readout="cls")
    with torch.enable_grad():
        xg = x.clone().requires_grad_(True)
        _, attentions, hidden, text_embeds = _hf_clip_pass(model, xg, ids, mask)
        text = torch.nn.functional.normalize(text_embeds[0], dim=-1)
        scores = [model.logit_scale.exp() * torch.nn.functional.normalize(
            model.visual_projection(model.vision_model.post_layernorm(h[:, 0])), dim=-1) @ text for h in hidden[1:]]
        mixed = torch.autograd.grad(torch.stack(scores).sum(), attentions)
    mixed_map = _minmax(sum(torch.clamp(g, min=0).mean(dim=(1, 2)) for g in mixed)[:, 1:])
    assert (mixed_map - legrad).abs().max() > 1e-2


def test_legrad_of_a_class_is_that_computed_on_transformers_vit():
    """For a classifier the score of layer l is the class logit read from the mean of layer l's
    tokens through the final layernorm and the head (torchcam's LeGrad), over the last two layers by
    default; with readout="cls" and start_layer=0, from the cls token of every layer."""
    t = transformers
    config = t.ViTConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, image_size=32, patch_size=8,
                         intermediate_size=64, num_labels=5, attn_implementation="eager")
    torch.manual_seed(0)
    model = t.ViTForImageClassification(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.2) if "layernorm" in name and name.endswith("weight") else p.normal_(0, 0.1)
    model.eval()
    ours = vitviz.ViT.from_transformers(model)
    x = _image()
    targets = torch.tensor([3, 1])
    maps, got, _ = relevance_maps(ours, x, methods=["gradient", "legrad"], targets=targets.tolist())
    cls, _, _ = relevance_maps(ours, x, methods=["legrad"], targets=targets.tolist(), readout="cls", start_layer=0)
    assert got.tolist() == [3, 1]
    with torch.enable_grad():
        xg = x.clone().requires_grad_(True)
        out = model(pixel_values=xg, output_attentions=True, output_hidden_states=True)
        rows = torch.arange(2)

        def score(l):
            return model.classifier(model.vit.layernorm(out.hidden_states[l + 1].mean(dim=1)))[rows, targets].sum()

        def cls_score(l):
            return model.classifier(model.vit.layernorm(out.hidden_states[l + 1][:, 0]))[rows, targets].sum()

        want = _legrad_by_hand(score, out.attentions, start=1)  # three layers, the last two
        want_cls = _legrad_by_hand(cls_score, out.attentions)
        grads = torch.autograd.grad(out.logits[rows, targets].sum(), out.attentions)
    torch.testing.assert_close(maps["legrad"].flatten(1), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cls["legrad"].flatten(1), want_cls, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="start_layer must be an integer from -3 to 2"):
        relevance_maps(ours, x, methods=["legrad"], targets=targets.tolist(), start_layer=3)
    with pytest.raises(ValueError, match="readout must be one of mean, cls"):
        relevance_maps(ours, x, methods=["legrad"], targets=targets.tolist(), readout="pool")
    torch.testing.assert_close(maps["gradient"].flatten(1), _chefer_by_hand([a.detach() for a in out.attentions], grads),
                               atol=1e-5, rtol=1e-4)
    assert maps["legrad"].amin(dim=(1, 2)).tolist() == [0, 0] and maps["legrad"].amax(dim=(1, 2)).tolist() == [1, 1]


def test_several_phrases_in_one_call_equal_the_phrases_one_by_one():
    ours = vitviz.from_transformers(_clip(seed=3))
    ours.tokenizer = _tiny_tokenizer()
    phrases = ["a red star", "blue", "a circle on grass"]
    x = _image()
    methods = ["attention", "rollout", *GRADIENT_METHODS]
    together, _, sims = relevance_maps(ours, x, methods=methods, text=phrases)
    for t, phrase in enumerate(phrases):
        alone, _, sim = relevance_maps(ours, x, methods=methods, text=phrase)
        for m in methods:
            torch.testing.assert_close(together[m][:, t], alone[m][:, 0], atol=1e-6, rtol=0)
        torch.testing.assert_close(sims[:, t], sim[:, 0], atol=1e-5, rtol=0)
    # token ids work without a tokenizer, and give the same maps
    ids, mask = ours.tokenize(phrases)
    ours.tokenizer = None
    by_ids, _, _ = relevance_maps(ours, x, methods=["gradient"], text=(ids, mask))
    torch.testing.assert_close(by_ids["gradient"], together["gradient"], atol=1e-6, rtol=0)


def test_explain_names_the_phrase_and_its_similarity():
    import numpy as np
    from PIL import Image

    ours = vitviz.from_transformers(_clip(seed=3))
    ours.tokenizer = _tiny_tokenizer()
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 40, 3), dtype=np.uint8))
    one = vitviz.explain(ours, image, method="gradient", text="a red star")
    assert isinstance(one, vitviz.Explanation) and one.text == "a red star" and one.target is None and one.label is None
    assert one.map.shape == (4, 4) and one.probability is None
    several = vitviz.explain(ours, image, method="legrad", text=["a red star", "blue"])
    assert [e.text for e in several] == ["a red star", "blue"] and all(e.method == "legrad" for e in several)
    x = vitviz.preprocess(image, ours.spec.preprocessing)[0][None]
    with torch.no_grad():
        want = ours(x, *ours.tokenize(["a red star", "blue"]))[0]
    assert [e.similarity for e in several] == pytest.approx(want.tolist(), abs=1e-5)
    assert one.similarity == pytest.approx(several[0].similarity, abs=1e-5)
    # the target-free methods need no phrase
    assert vitviz.explain(ours, image, method="rollout").text is None
    rec = record(ours, x, text=["blue"], gradients=True)
    assert rec.targets is None and rec.texts == ("blue",) and rec.layout.text and not rec.layout.classifier
    assert maps_of(rec, ["gradient"])["gradient"].shape == (1, 4, 4)


def test_the_errors_say_what_to_do():
    ours = vitviz.from_transformers(_clip())
    x = _image()
    with pytest.raises(ValueError, match=r"has no tokenizer.*token ids: text=input_ids \[T, C\]"):
        relevance_maps(ours, x, methods=["gradient"], text="a cat")
    with pytest.raises(ValueError, match="image–text model: it has no classes; explain a phrase with text="):
        relevance_maps(ours, x, methods=["gradient"], targets=[1, None])
    with pytest.raises(ValueError, match="image–text model: it has no classes"):
        vitviz.explain(ours, torch.rand(3, 32, 32), method="rollout", target=1)
    with pytest.raises(ValueError, match="gradient methods explain a phrase; pass text="):
        relevance_maps(ours, x, methods=["legrad"])
    with pytest.raises(ValueError, match="a phrase, a list of phrases or token ids"):
        relevance_maps(ours, x, methods=["gradient"], text=[])
    with pytest.raises(ValueError, match=r"token ids must be integers of shape \[T, C\]"):
        relevance_maps(ours, x, methods=["gradient"], text=torch.zeros(2, 3, 4))
    classifier = vitviz.ViT(image_size=32, patch_size=8, width=32, depth=2, heads=2, mlp_dim=64, num_classes=4)
    classifier.spec = vitviz.VariantSpec(name="tiny", config=classifier.config, preprocessing=vitviz.Preprocessing(32),
                                         categories=tuple("abcd"), source="test", weights="random")
    with pytest.raises(ValueError, match=r"tiny has no text tower: text= needs an image–text model"):
        relevance_maps(classifier.eval(), x, methods=["gradient"], text="a cat")
    features = vitviz.ViT(classifier.config.replace(num_classes=0))
    features.spec = vitviz.VariantSpec(name="features", config=features.config, preprocessing=vitviz.Preprocessing(32),
                                       categories=None, source="test", weights="random")
    for m in GRADIENT_METHODS:  # no classifier and no text tower: nothing to differentiate
        with pytest.raises(ValueError, match="features has no classifier: gradient methods need a class logit"):
            relevance_maps(features.eval(), x, methods=[m])
    lacking = record(features, x).layout
    assert lacking.lacks(vitviz.explainers.method("legrad").needs, name="features") == (
        "features has no classifier and no text tower: there is no class or phrase to explain")
    assert lacking.lacks(vitviz.explainers.method("gradient").needs) is not None
    assert record(ours, x).layout.lacks(vitviz.explainers.method("gradient").needs) is None


def test_a_plugin_that_reads_the_class_still_needs_a_classifier():
    """A gradient method registered without needs_classifier keeps the old default: it explains a
    class, so a phrase is not enough."""
    from vitviz.explainers import registry

    @vitviz.register_method("class_only_probe", title="probe", needs_gradients=True)
    def probe(rec, **options):
        return rec.query_maps(rec.attentions[-1].mean(dim=1))

    try:
        entry = vitviz.explainers.method("class_only_probe")
        assert entry.needs_classifier and "classifier" in entry.needs and "target" not in entry.needs
        ours = vitviz.from_transformers(_clip())
        rec = record(ours, _image(), text=(torch.tensor([[5, EOS]]), None), gradients=True)
        with pytest.raises(ValueError, match="'class_only_probe' explains a class"):
            maps_of(rec, ["class_only_probe"])
    finally:
        registry._REGISTRY.pop("class_only_probe", None)
