"""The logit lens, direct logit attribution and head ablation (vitviz.inside), each held to a
computation of its own: the model's own tail applied to hooked block outputs, the target logit of a
plain forward, value rows zeroed in a copy of the model, a forward written out by hand."""

import copy
import math
import threading

import numpy as np
import pytest
import torch

import vitviz
from conftest import random_timm, random_torchvision
from vitviz import inside
from vitviz.shapes import generate


def _with_spec(model: vitviz.ViT, name: str = "test") -> vitviz.ViT:
    c = model.config
    model.spec = vitviz.VariantSpec(name=name, config=c, preprocessing=vitviz.Preprocessing(c.image_size),
                                    categories=tuple(f"class {i}" for i in range(c.num_classes)) if c.num_classes else None,
                                    source="test", weights="random")
    return model.eval()


def _timm(name: str, **kwargs) -> vitviz.ViT:
    pytest.importorskip("timm")
    torch.manual_seed(3)
    return vitviz.from_timm(random_timm(name, depth=2, num_classes=5, **kwargs)).eval()


def _gap(fc_norm: bool) -> vitviz.ViT:
    model = _timm("vit_tiny_patch16_224", img_size=32, class_token=False, global_pool="avg", fc_norm=fc_norm, reg_tokens=1)
    with torch.no_grad():  # away from LayerNorm's init, so that a γ or β left out shows
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.normal_(1.0, 0.3)
                m.bias.normal_(0.0, 0.3)
    return model


def _norms_moved(model: vitviz.ViT) -> vitviz.ViT:
    with torch.no_grad():  # away from the norms' init, so that a γ left out shows
        for m in model.modules():
            if isinstance(m, torch.nn.RMSNorm):
                m.weight.normal_(1.0, 0.3)
    return model


def _vitviz(**kwargs) -> vitviz.ViT:
    torch.manual_seed(4)
    fields = dict(image_size=32, patch_size=16, width=16, depth=2, heads=2, mlp_dim=32, num_classes=5) | kwargs
    return _with_spec(vitviz.ViT(**fields))


def _torchvision_small() -> vitviz.ViT:
    from torchvision.models import VisionTransformer

    torch.manual_seed(5)
    tv = VisionTransformer(image_size=32, patch_size=16, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32, num_classes=5).eval()
    torch.nn.init.normal_(tv.heads.head.weight, std=0.5)
    return vitviz.from_torchvision(tv).eval()


BUILDERS = {
    "torchvision": _torchvision_small,
    "timm-reg4-layerscale": lambda: _timm("vit_small_patch14_reg4_dinov2", img_size=28),
    "timm-deit-distilled": lambda: _timm("deit_tiny_distilled_patch16_224", img_size=32),
    "timm-gap-fc-norm": lambda: _gap(True),
    "timm-gap-normed-tokens": lambda: _gap(False),
    "no-final-norm": lambda: _vitviz(final_norm=False),
    "parallel-blocks": lambda: _vitviz(parallel=True, layer_scale=0.5),  # attention and MLP side by side on one norm
    "timm-rmsnorm": lambda: _norms_moved(_timm("test_vit4", img_size=32)),  # every norm an RMSNorm: no centring, no β
    "timm-dinov3-rotary": lambda: _timm("vit_small_patch16_dinov3", img_size=32),  # rotary, no table, 4 registers, avg
    "shapes_p16": lambda: vitviz.load_model("shapes_p16", device="cpu").eval(),
}


@pytest.fixture(scope="module", params=list(BUILDERS))
def model(request):
    return BUILDERS[request.param]()


def _image(model: vitviz.ViT, seed: int = 0) -> torch.Tensor:
    s = model.config.image_size
    return torch.randn(3, s, s, generator=torch.Generator().manual_seed(seed))


def _hooked_blocks(model: vitviz.ViT, x: torch.Tensor) -> list[torch.Tensor]:
    """The stream before the first block and after each block [1, N, D], from hooks on model.blocks[i]."""
    seen = []
    handles = [model.blocks[0].register_forward_pre_hook(lambda m, args: seen.append(args[0]))]
    handles += [b.register_forward_hook(lambda m, args, out: seen.append(out)) for b in model.blocks]
    try:
        with torch.no_grad():
            model(x[None])
    finally:
        for h in handles:
            h.remove()
    return seen


def _no_hooks_left(model: torch.nn.Module) -> bool:
    return not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


# ----------------------------------------------------------------------------- logit lens


def test_the_lens_at_the_last_layer_is_the_models_output(model):
    x = _image(model)
    stream = inside.stream_of(model, x)
    with torch.no_grad():
        logits = model(x[None])[0]
    torch.testing.assert_close(inside.lens_of(stream, logits=True)[-1], logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(inside.lens_of(stream)[-1], logits.softmax(-1), rtol=1e-5, atol=1e-6)
    assert inside.lens_of(stream).shape == (model.config.depth + 1, model.config.num_classes)
    assert _no_hooks_left(model)


def test_each_layer_of_the_lens_equals_the_models_tail_on_its_hooked_block_output(model):
    x = _image(model, 1)
    with torch.no_grad():
        expected = torch.stack([model.head_logits(model.norm(h))[0] for h in _hooked_blocks(model, x)])
    torch.testing.assert_close(inside.logit_lens(model, x, logits=True), expected, rtol=1e-5, atol=1e-5)


def test_the_lens_reads_an_attention_pooling_model_too():
    model = _vitviz(class_token=False, pool="map")
    x = _image(model)
    with torch.no_grad():
        expected = torch.stack([model.head_logits(model.norm(h))[0] for h in _hooked_blocks(model, x)])
    torch.testing.assert_close(inside.logit_lens(model, x, logits=True), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not linear"):
        inside.logit_attribution(model, x)


@pytest.mark.parametrize("kind, why", [("attn_norm", "normalises its heads' outputs together"), ("post_norm", "res-post-norm")])
def test_norms_after_a_branch_keep_the_lens_and_refuse_the_split(kind, why):
    """EVA-02 CLIP's LayerNorm before W_O (`ViTConfig.attn_norm`) and res-post-norm blocks
    (`post_norm`): the lens is the model's tail as ever; the heads' shares do not add, so the
    attribution says why; ablating a head zeroes its output before any norm (equal to zeroing its
    value rows)."""
    model = _vitviz(**{kind: True})
    x = _image(model)
    with torch.no_grad():
        expected = torch.stack([model.head_logits(model.norm(h))[0] for h in _hooked_blocks(model, x)])
    torch.testing.assert_close(inside.logit_lens(model, x, logits=True), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=why):
        inside.logit_attribution(model, x)
    d, w = model.config.width // model.config.heads, model.config.width
    zeroed = copy.deepcopy(model)
    with torch.no_grad():
        zeroed.blocks[1].attn.qkv.weight[2 * w + d: 2 * w + 2 * d] = 0  # head 1's value rows
        zeroed.blocks[1].attn.qkv.bias[2 * w + d: 2 * w + 2 * d] = 0
        want = zeroed(x[None])[0].softmax(-1)
    got = inside.ablate(model, x, heads=[(1, 1)]).probabilities
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_lens_helpers_by_hand():
    lens = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.7, 0.1], [0.6, 0.3, 0.1], [0.1, 0.8, 0.1]])
    ranks, values = inside.class_across_depth(lens, 1)
    assert ranks.tolist() == [1, 0, 1, 0] and values.tolist() == pytest.approx([0.3, 0.7, 0.3, 0.8])
    assert inside.first_top1_layer(lens, 1) == 1 and inside.first_top1_layer(lens, 0) == 0
    assert inside.first_top1_layer(lens, 2) is None
    top = inside.lens_top_k(lens, 2, ["a", "b", "c"])
    assert [[name for name, _ in layer] for layer in top] == [["a", "b"], ["b", "a"], ["a", "b"], ["b", "a"]]
    assert top[3][0][1] == pytest.approx(0.8)


# ----------------------------------------------------------------------------- direct logit attribution


def _assert_adds_up(attribution: inside.Attribution, logit: float) -> None:
    assert attribution.total() == pytest.approx(logit, rel=1e-4, abs=1e-6)
    assert sum(v for *_, v in attribution.rows()) == pytest.approx(logit, rel=1e-4, abs=1e-6)
    assert float(attribution.logit) == pytest.approx(logit, rel=1e-5, abs=1e-6)


def test_the_attribution_adds_up_to_the_target_logit(model):
    x = _image(model, 2)
    with torch.no_grad():
        logits = model(x[None])[0]
    stream = inside.stream_of(model, x)
    for target in (None, int(logits.argmin())):
        a = inside.attribution_of(stream, target)
        assert a.target == (int(logits.argmax()) if target is None else target)
        _assert_adds_up(a, float(logits[a.target]))
        depth, heads = model.config.depth, model.config.heads
        assert a.heads.shape == (depth, heads) and a.mlps.shape == (depth,) and a.attn_biases.shape == (depth,)
        assert len(a.rows()) == 1 + depth * (heads + 2) + 2
        assert a.heads.abs().sum() > 0 and a.mlps.abs().sum() > 0


def _read_final(model: vitviz.ViT, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The stream after the last block as the classifier reads it (the cls token here) and its σ, by hand."""
    h = _hooked_blocks(model, x)[-1][0, 0].double()
    return h, (h.var(unbiased=False) + model.norm.eps).sqrt()


def _attention_branch(model: vitviz.ViT, x: torch.Tensor, layer: int) -> torch.Tensor:
    """What block `layer`'s attention branch adds to the cls token, LS1 ⊙ attn(LN(x)) [D], from a hook on its LayerScale."""
    seen = []
    handle = model.blocks[layer].ls1.register_forward_hook(lambda m, args, out: seen.append(out[0, 0].double()))
    try:
        with torch.no_grad():
            model(x[None])
    finally:
        handle.remove()
    return seen[0]


def test_each_heads_part_is_what_zeroing_its_value_rows_takes_from_its_branch():
    """With LayerScale and registers: the part of head h of block l is the change of that block's
    attention branch at the cls token when h's value rows are zeroed in a copy of the model,
    centred, over the forward's final σ, times γ, on the class row; the embedding's part is the
    model's own tokens read alike."""
    model = _timm("vit_small_patch14_reg4_dinov2", img_size=28)
    assert model.config.register_tokens == 4 and model.config.layer_scale is not None
    x, t = _image(model, 3), 2
    a = inside.logit_attribution(model, x, t)
    sigma = _read_final(model, x)[1]
    gamma, row = model.norm.weight.detach().double(), model.head.weight[t].detach().double()

    def part(v: torch.Tensor) -> float:
        return float(((v - v.mean()) / sigma * gamma * row).sum())

    for layer in range(model.config.depth):
        branch = _attention_branch(model, x, layer)
        for h in range(model.config.heads):
            removed = branch - _attention_branch(_zero_value_rows(model, [(layer, h)]), x, layer)
            assert float(a.heads[layer, h]) == pytest.approx(part(removed), rel=1e-4, abs=1e-6)
    with torch.no_grad():
        embedded = model.tokens(x[None])[0, 0].double()
    assert float(a.embedding) == pytest.approx(part(embedded), rel=1e-4, abs=1e-6)
    assert float(a.norm_bias) == pytest.approx(float((model.norm.bias.detach().double() * row).sum()), rel=1e-6)
    assert float(a.head_bias) == pytest.approx(float(model.head.bias[t].detach()), rel=1e-6)


@pytest.mark.slow
def test_the_attribution_adds_up_on_a_torchvision_vit_b_16():
    model = vitviz.from_torchvision(random_torchvision("vit_b_16")).eval()
    x = _image(model)
    stream = inside.stream_of(model, x)
    with torch.no_grad():
        logits = model(x[None])[0]
    for target in (int(logits.argmax()), 7):
        _assert_adds_up(inside.attribution_of(stream, target), float(logits[target]))
    assert inside.attribution_of(stream).heads.shape == (12, 12)


# ----------------------------------------------------------------------------- through vitviz.analyze and image–text models


def _shape_image(seed: int = 3535) -> np.ndarray:
    return generate(1, seed=seed)[0][0]


@pytest.fixture(scope="module")
def shapes_p16():
    return vitviz.load_model("shapes_p16", device="cpu").eval()


def test_an_analysis_carries_the_lens_and_the_attribution(shapes_p16):
    model = shapes_p16
    result = vitviz.analyze(model, _shape_image())
    torch.testing.assert_close(result.logit_lens()[-1], result.probabilities, rtol=1e-5, atol=1e-6)
    x = vitviz.preprocess(result.image, model.spec.preprocessing)[0]
    with torch.no_grad():
        logits = model(x[None])[0]
    a = result.logit_attribution()
    assert a.label == result.predictions(1)[0][0]
    _assert_adds_up(a, float(logits[a.target]))
    star = result.logit_attribution("star")
    assert star.target == model.spec.categories.index("star")
    _assert_adds_up(star, float(logits[star.target]))
    assert result.inside.nbytes < 50_000
    assert _no_hooks_left(model)


def test_a_model_without_a_head_has_no_lens():
    model = _vitviz(num_classes=0)
    result = vitviz.analyze(model, np.zeros((32, 32, 3), dtype=np.uint8))
    assert result.inside is None
    with pytest.raises(ValueError, match="no head"):
        result.logit_lens()
    with pytest.raises(ValueError, match="no classifier"):
        vitviz.ablate(model, _image(model), [(0, 0)])


def test_the_image_text_lens_is_the_similarity_to_the_label_texts():
    model = vitviz.load_model("shapes_clip", device="cpu").eval()
    labels, template = ["circle", "star", "ring", "arrow"], "a photo of a {}"
    image = _shape_image(3536)
    lens = inside.logit_lens(model, image, labels=labels, template=template, logits=True)
    x = vitviz.preprocess(vitviz.load_image(image), model.spec.preprocessing)[0]
    with torch.no_grad():
        logits = model(x[None], *model.tokenize([template.format(label) for label in labels]))[0]
    assert lens.shape == (model.image.config.depth + 1, len(labels))
    torch.testing.assert_close(lens[-1], logits, rtol=1e-5, atol=1e-5)
    for target in range(len(labels)):
        _assert_adds_up(inside.logit_attribution(model, image, target, labels=labels, template=template), float(logits[target]))
    result = vitviz.analyze(model, image)  # its own label set, the eight shapes
    torch.testing.assert_close(result.logit_lens()[-1], result.probabilities, rtol=1e-5, atol=1e-6)
    ablation = vitviz.ablate(model, image, [(5, 0)], labels=labels, template=template)
    torch.testing.assert_close(ablation.before, logits.softmax(-1), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- head ablation


def _zero_value_rows(model: vitviz.ViT, heads) -> vitviz.ViT:
    """A copy of the model whose value projections give zero for the given heads (so do their outputs A V)."""
    copied = copy.deepcopy(model)
    d, width = model.config.width // model.config.heads, model.config.width
    with torch.no_grad():
        for layer, h in heads:
            qkv = copied.blocks[layer].attn.qkv
            qkv.weight[2 * width + h * d : 2 * width + (h + 1) * d] = 0
            qkv.bias[2 * width + h * d : 2 * width + (h + 1) * d] = 0
    return copied


@pytest.mark.parametrize("heads", [[(0, 1)], [(1, 0)], [(0, 0), (1, 1)]])
def test_ablating_heads_equals_zeroing_their_value_rows(heads):
    model = _timm("vit_small_patch14_reg4_dinov2", img_size=28)
    x = _image(model, 4)
    result = vitviz.ablate(model, x, heads)
    with torch.no_grad():
        expected = _zero_value_rows(model, heads)(x[None])[0].softmax(-1)
        before = model(x[None])[0].softmax(-1)
    torch.testing.assert_close(result.probabilities, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(result.before, before, rtol=1e-5, atol=1e-6)
    assert result.target == int(before.argmax())
    assert result.change == pytest.approx(float(expected[result.target] - before[result.target]), abs=1e-6)
    assert result.predictions(1)[0] == (model.spec.categories[int(expected.argmax())], pytest.approx(float(expected.max()), abs=1e-6))
    assert _no_hooks_left(model)


def test_mean_ablation_equals_attention_rows_replaced_by_their_patch_mean():
    """A head's output averaged over the patch tokens is the patch rows' mean attention times V:
    a hook on the softmax that gives every query that mean row does the same."""
    model = _timm("deit_tiny_distilled_patch16_224", img_size=32)
    layer, head, p = 1, 2, model.config.num_prefix_tokens
    x = _image(model, 5)
    copied = copy.deepcopy(model)

    def mean_row(module, args, attn):
        attn = attn.clone()
        attn[:, head] = attn[:, head, p:].mean(dim=1, keepdim=True)
        return attn

    copied.blocks[layer].attn.attend.register_forward_hook(mean_row)
    with torch.no_grad():
        expected = copied(x[None])[0].softmax(-1)
    torch.testing.assert_close(vitviz.ablate(model, x, [(layer, head)], mode="mean").probabilities, expected, rtol=1e-5, atol=1e-6)


def test_ablating_every_head_leaves_the_embedding_and_mlp_path_by_hand():
    """Every head off: each block adds its output bias b_O (proj of zeros) and its MLP; the forward
    written out with plain tensor algebra (patches, LayerNorm, GELU by erf)."""
    model = _vitviz(layer_scale=0.5)
    with torch.no_grad():
        for b in model.blocks:
            b.ls1.gamma.normal_(1.0, 0.3)
            b.ls2.gamma.normal_(1.0, 0.3)
    x = _image(model, 6)
    heads = [(layer, h) for layer in range(2) for h in range(2)]
    got = vitviz.ablate(model, x, heads).probabilities

    def ln(v, norm):
        mu, var = v.mean(-1, keepdim=True), ((v - v.mean(-1, keepdim=True)) ** 2).mean(-1, keepdim=True)
        return (v - mu) / torch.sqrt(var + norm.eps) * norm.weight + norm.bias

    with torch.no_grad():
        patches = x.reshape(3, 2, 16, 2, 16).permute(1, 3, 0, 2, 4).reshape(4, 3 * 16 * 16)  # row-major grid
        conv = model.patch_embed.proj
        h = patches @ conv.weight.reshape(16, -1).T + conv.bias + model.pos_embed[0, 1:]
        h = torch.cat([model.cls_token[0] + model.pos_embed[0, :1], h])  # [5, 16]
        for b in model.blocks:
            h = h + b.ls1.gamma * b.attn.proj.bias
            fc1, fc2 = b.mlp[0], b.mlp[2]
            u = ln(h, b.norm2) @ fc1.weight.T + fc1.bias
            h = h + b.ls2.gamma * ((0.5 * u * (1 + torch.erf(u / math.sqrt(2)))) @ fc2.weight.T + fc2.bias)
        expected = (ln(h[0], model.norm) @ model.head.weight.T + model.head.bias).softmax(-1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_head_importance_is_one_ablation_per_head(mode, shapes_p16):
    model = shapes_p16
    image = _shape_image(3537)
    drops = vitviz.head_importance(model, image, "ring", mode=mode)
    assert drops.shape == (6, 3)
    for layer in range(6):
        for h in range(3):
            one = vitviz.ablate(model, image, [(layer, h)], mode=mode, target="ring")
            assert float(drops[layer, h]) == pytest.approx(-one.change, abs=1e-6)
    assert _no_hooks_left(model)


def test_ablation_acts_only_in_the_thread_that_asked_for_it():
    model = _vitviz()
    x = _image(model)[None]
    with torch.no_grad():
        clean = model(x)
    seen = {}
    with inside.ablation._ablating(model, {0: torch.ones(1, 2, dtype=torch.bool)}, "zero"):
        other = threading.Thread(target=lambda: seen.setdefault("other", model(x).detach()))
        other.start()
        other.join()
        with torch.no_grad():
            here = model(x)
    torch.testing.assert_close(seen["other"], clean)
    assert not torch.allclose(here, clean)


def test_bad_heads_and_modes_are_refused():
    model = _vitviz()
    with pytest.raises(ValueError, match="outside"):
        vitviz.ablate(model, _image(model), [(2, 0)])
    with pytest.raises(ValueError, match="mode"):
        vitviz.ablate(model, _image(model), [(0, 0)], mode="noise")
    with pytest.raises(ValueError, match="not one of"):
        inside.logit_attribution(model, _image(model), "cat")


def test_the_report_runs_on_a_few_images(capsys):
    inside.main(["--report", "--variants", "shapes_p16", "--n", "12", "--ablation-images", "6", "--seed", "3538"])
    out = capsys.readouterr().out
    assert "shapes_p16: 12 fresh images" in out and "zero ablation, 6 images" in out and "L" in out


def test_every_analysis_of_a_model_reads_one_cpu_copy_of_its_head():
    """The head a stream reads its logits with is not copied per analysis: on a float32 CPU model it is
    the model's own weight; on any other (a GPU's, here a float64 model) one copy serves every
    analysis, made again when the weights change."""
    import vitviz

    model = vitviz.load_model("shapes_p16")
    image = vitviz.shapes.render(1, seed=3, index=0, image_size=model.spec.image_size)[0]
    first, second = vitviz.analyze(model, image).inside, vitviz.analyze(model, image).inside
    assert first.unembed.weight.data_ptr() == second.unembed.weight.data_ptr() == model.head.weight.data_ptr()
    wide = vitviz.load_model("shapes_p16").double()
    one, two = vitviz.analyze(wide, image).inside, vitviz.analyze(wide, image).inside
    assert one.unembed.weight.dtype == torch.float32 and one.unembed.weight.data_ptr() == two.unembed.weight.data_ptr()
    assert one.unembed.weight.data_ptr() != wide.head.weight.data_ptr()
    with torch.no_grad():
        wide.head.weight.mul_(2)
    three = vitviz.analyze(wide, image).inside
    torch.testing.assert_close(three.unembed.weight, 2 * one.unembed.weight)
    x = vitviz.preprocess(vitviz.load_image(image), wide.spec.preprocessing)[0][None].double()
    with torch.no_grad():
        logits = wide(x)[0].float()
    torch.testing.assert_close(inside.lens_of(three, logits=True)[-1], logits, atol=1e-4, rtol=1e-4)
