"""High-norm tokens, register neurons and test-time registers (`vitviz.registers`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import vitviz
from vitviz import ViT, ViTConfig, shapes
from vitviz.registers import RegisterNeurons, outliers, record_neurons, register_neurons, with_test_time_register

ASSETS = Path(__file__).resolve().parents[1] / "assets"


def _tiny(**fields) -> ViT:
    torch.manual_seed(0)
    config = dict(image_size=32, patch_size=8, width=32, depth=4, heads=2, mlp_dim=48, num_classes=5) | fields
    return ViT(ViTConfig(**config)).eval().double()


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


# ----------------------------------------------------------------------------- the register itself


def test_the_config_adds_one_prefix_token_without_a_position():
    c = ViTConfig(image_size=32, patch_size=8, width=32, depth=4, heads=2, mlp_dim=48, register_tokens=2)
    t = c.replace(register_neurons=[[2, 5], [1, 3], [2, 5]])
    assert t.register_neurons == ((1, 3), (2, 5))  # lists (JSON) become sorted, distinct pairs
    assert t.prefix_names == ("cls", "reg1", "reg2", "ttr") and t.num_prefix_tokens == 4
    assert t.pos_embed_prefix == c.pos_embed_prefix == 3 and t.trained_prefix_tokens == 3
    assert t.num_params == c.num_params  # the register is not a parameter
    assert t.replace(register_neurons=()).num_prefix_tokens == 3
    with pytest.raises(ValueError, match="outside this model's 4 layers x 48"):
        c.replace(register_neurons=[(4, 0)])
    with pytest.raises(ValueError, match="outside"):
        c.replace(register_neurons=[(0, 48)])
    with pytest.raises(ValueError, match="register_keep_prefix"):
        c.replace(register_keep_prefix=True)


def test_the_new_model_shares_every_weight_and_names_itself():
    model = vitviz.load_model("shapes_p8")
    ttr = with_test_time_register(model, [(2, 5), (3, 1)])
    mine = dict(ttr.named_parameters())
    for name, p in model.named_parameters():
        assert mine[name] is p
    assert ttr.spec.name == "shapes_p8+ttr" and ttr.spec.prefix_names == ("cls", "ttr")
    assert "test-time register (2 neurons)" in ttr.spec.description
    assert model.config.num_prefix_tokens == 1  # the original is untouched
    x = torch.randn(1, 3, 96, 96)
    assert ttr.tokens(x).shape[1] == model.tokens(x).shape[1] + 1
    assert torch.equal(ttr.tokens(x)[:, 1], torch.zeros(1, 96))  # the register starts at zero


def _authors_reference(model: ViT, x: torch.Tensor, neurons: dict[int, list[int]], keep_prefix: bool) -> torch.Tensor:
    """The test-time register as the authors run it (nickjiang2378/test-time-registers:
    `dinov2/modifiedDINO.py`, `DinoVisionTransformerWithIntervention._intervention_hook`, and
    `shared/hook_fn.py`, `activate_on_registers` with normal_values="zero" for keep_prefix), ported
    to a vitviz ViT: a zero token appended AFTER the patches, and a forward hook on each MLP's
    activation that writes the neurons' maximum over all tokens into that last token and zeroes them
    on the other tokens (on the patches only, when keep_prefix). Returns the logits."""
    p = model.config.num_prefix_tokens
    handles = []
    for layer, idx in neurons.items():
        def hook(module, args, output, idx=idx):
            out = output.clone()
            top = out[:, :, idx].max(dim=1).values  # [B, k]
            new = torch.zeros_like(out[:, :, idx])
            new[:, -1] = top
            if keep_prefix:
                new[:, :p] = out[:, :p][:, :, idx]
            out[:, :, idx] = new
            return out
        mlp = model.blocks[layer].mlp
        target = mlp.shift if not isinstance(mlp, torch.nn.Sequential) else getattr(mlp, "1")
        if isinstance(mlp, torch.nn.Sequential):
            handles.append(target.register_forward_hook(hook))
        else:  # a gated MLP: act(gate) * value, the input of its norm
            handles.append(mlp.norm.register_forward_pre_hook(lambda m, a, idx=idx: (hook(m, a, a[0], idx),)))
    try:
        tokens = model.tokens(x)
        tokens = torch.cat([tokens, tokens.new_zeros(tokens.shape[0], 1, tokens.shape[2])], dim=1)
        for block, rope in zip(model.blocks, model.rotations(model.grid_for(x.shape[2], x.shape[3]))):
            tokens = block(tokens, rope)
        return model.head_logits(model.norm(tokens[:, :-1]))  # the classifier reads the image's tokens, not the register
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("keep_prefix", [False, True])
@pytest.mark.parametrize("fields", [{}, {"mlp": "gated", "act": "silu"}, {"register_tokens": 2}, {"pool": "avg", "class_token": False}],
                         ids=["plain", "gated", "registers", "pooled"])
def test_the_register_equals_the_authors_intervention(fields, keep_prefix):
    model = _tiny(**fields)
    neurons = {1: [3, 7], 2: [0, 11, 40]}
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    ttr = with_test_time_register(model, [(l, j) for l, js in neurons.items() for j in js], keep_prefix=keep_prefix)
    with torch.no_grad():
        mine = ttr(x)
        theirs = _authors_reference(model, x, neurons, keep_prefix)
        plain = model(x)
    torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-10)
    assert (mine - plain).abs().max() > 1e-3  # the neurons moved change the answer
    assert _hooks(model) == 0


def test_every_view_works_on_a_model_with_a_test_time_register():
    model = vitviz.load_model("shapes_p8_outliers")
    card = json.loads((ASSETS / "shapes_p8_outliers.json").read_text())
    ttr = with_test_time_register(model, [(card["layer"], j) for j in card["neurons"]])
    image = shapes.render(3, seed=5, index=0, image_size=96)[0]
    from PIL import Image

    a = vitviz.analyze(ttr, Image.fromarray(image))
    assert a.prefix_names == ("cls", "ttr") and a.attentions.shape[-1] == 2 + 144
    assert a.cls_map().shape == (12, 12) and a.distances().shape == (6, 3)
    assert float(a.logit_attribution().logit) == pytest.approx(float(a.logit_lens(logits=True)[-1].max()), rel=1e-4, abs=1e-4)
    e = vitviz.explain(ttr, Image.fromarray(image), method="grad_rollout")  # gradients go through the register's shift
    assert torch.isfinite(e.map).all() and e.map.shape == (12, 12)


def test_refusals():
    model = _tiny()
    with pytest.raises(ValueError, match="no neuron given"):
        with_test_time_register(model, [])
    ttr = with_test_time_register(model, [(0, 1)])
    with pytest.raises(ValueError, match="already"):
        with_test_time_register(ttr, [(0, 2)])
    with pytest.raises(ValueError, match="relative position bias"):
        with_test_time_register(_tiny(rel_pos_bias=True), [(0, 1)])
    with pytest.raises(ValueError, match="outside"):
        with_test_time_register(model, [(9, 1)])
    with pytest.raises(ValueError, match="vitviz ViT"):
        with_test_time_register(vitviz.load_model("shapes_swin"), [(0, 1)])


# ----------------------------------------------------------------------------- high-norm tokens


def test_outliers_by_hand():
    # 1 prefix token, a 2 x 3 grid, 2 layers; layer 1 has one patch at 10x the others
    norms = torch.tensor([[5.0, 1, 1.2, 0.9, 1.1, 1.0, 1.3], [5.0, 1, 10, 0.9, 1.1, 1.0, 1.3]])
    attn = torch.zeros(2, 2, 7, 7)
    attn[:] = 1 / 7
    attn[1, :, 0] = torch.tensor([0.1, 0.1, 0.5, 0.1, 0.1, 0.05, 0.05])  # the cls row of the last block, both heads
    o = outliers(norms, attn, grid=(2, 3), num_prefix_tokens=1)
    assert o.counts == [0, 1] and o.patches(1) == [(0, 1)] and o.first_layer == 1
    assert o.threshold[1] == pytest.approx(2 * 1.0)  # twice the median of (1, 10, 0.9, 1.1, 1.0, 1.3): torch's, the lower middle
    assert o.ratio[1] == pytest.approx(10 / 1.0)
    assert o.query_share[1] == pytest.approx(0.5)  # the last layer's outliers: the last block's rows
    assert o.patch_share[1] == pytest.approx(1 / 7)  # every other patch's row is uniform
    assert o.query_share[0] == 0 and o.fraction[1] == pytest.approx(1 / 6)
    pooled = outliers(norms[:, 1:], attn[:, :, 1:, 1:], grid=(2, 3), num_prefix_tokens=0, pooled_query=True)
    assert pooled.counts == [0, 1]
    with pytest.raises(ValueError, match="factor"):
        outliers(norms, grid=(2, 3), num_prefix_tokens=1, factor=1.0)
    with pytest.raises(ValueError, match="7 tokens"):
        outliers(norms, grid=(3, 3), num_prefix_tokens=1)


def test_the_planted_model_has_outliers_and_the_register_takes_them():
    planted = vitviz.load_model("shapes_p8_outliers")
    card = json.loads((ASSETS / "shapes_p8_outliers.json").read_text())
    images = shapes.generate(24, seed=2025)[0]
    x = (torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.5
    found = register_neurons(planted, x, top_k=len(card["neurons"]))
    assert sorted(found.neurons) == [(card["layer"], j) for j in card["neurons"]]
    assert found.ranked[len(card["neurons"])][2] < 0.5 * found.ranked[0][2]  # a clear gap to the next neuron
    assert found.images > 0 and found.images + found.skipped == 24
    ttr = with_test_time_register(planted, found)
    ratios, had = {}, None
    for name, model in (("planted", planted), ("ttr", ttr)):
        stream: list[torch.Tensor] = []
        with torch.inference_mode():
            model.encode(x, layers=stream)
        p = model.config.num_prefix_tokens
        last = stream[-1][:, p:].norm(dim=-1)
        ratio = last.max(dim=1).values / last.median(dim=1).values
        ratios[name] = ratio.max()
        if name == "planted":
            had = ratio > 2  # the images with an outlier
        else:  # where there was one, the register holds the high norm now
            assert had.sum() >= 3 and stream[-1][had, 1].norm(dim=-1).min() > 2 * last[had].median()
    assert ratios["planted"] > 4 and ratios["ttr"] < 2
    from PIL import Image

    a = vitviz.analyze(planted, Image.fromarray(images[found_index(planted, x)]))
    o = a.outliers()
    assert o.first_layer == card["layer"] and o.query_share[-2] > 5 * o.fraction[-2]  # the cls token looks at them


def found_index(model: ViT, x: torch.Tensor) -> int:
    """The first image of x with an outlier after the second-to-last block."""
    stream: list[torch.Tensor] = []
    with torch.inference_mode():
        model.encode(x, layers=stream)
    n = stream[-2][:, 1:].norm(dim=-1)
    return int((n > 2 * n.median(dim=1, keepdim=True).values).any(dim=1).nonzero()[0])


# ----------------------------------------------------------------------------- the neurons that write them


def _authors_find_register_neurons(model: ViT, images: torch.Tensor, *, register_norm_threshold: float, detect_outliers_layer: int):
    """A port of the authors' detection (nickjiang2378/test-time-registers, `shared/algorithms.py`,
    `find_register_neurons`, apply_sparsity_filter=False): per image, the layer outputs' norms at
    `detect_outliers_layer` find the register locations (norm > threshold, every token); each
    layer's neuron score is the mean |activation| (the MLP's `act` output) there; images without a
    location are skipped; the mean over the rest, flattened, sorted descending, as
    (layer, neuron, score). The hooks here are written for the port, not vitviz's."""
    num_layers, num_neurons = model.config.depth, model.config.mlp_dim
    scores = torch.zeros(len(images), num_layers, num_neurons, dtype=torch.float64)
    count = 0
    for image in images:
        acts, outs = [], []
        hs = [getattr(b.mlp, "1").register_forward_hook(lambda m, a, o: acts.append(o[0])) for b in model.blocks]
        hs += [b.register_forward_hook(lambda m, a, o: outs.append(o[0])) for b in model.blocks]
        with torch.no_grad():
            model(image[None])
        for h in hs:
            h.remove()
        norm_map = torch.norm(outs[detect_outliers_layer], dim=1)
        filtered = norm_map.clone()
        filtered[filtered < register_norm_threshold] = 0
        locations = torch.where(filtered > register_norm_threshold)[0]
        if len(locations) == 0:
            continue
        for layer in range(num_layers):
            scores[count, layer] = torch.abs(acts[layer][locations]).mean(dim=0)
        count += 1
    mean = scores[:count].mean(dim=0).flatten()
    values, indices = torch.sort(mean, descending=True)
    return [(int(i) // num_neurons, int(i) % num_neurons, float(v)) for i, v in zip(indices, values)]


def test_the_detection_equals_a_port_of_the_authors():
    model = _tiny(depth=4)
    x = torch.randn(6, 3, 32, 32, dtype=torch.float64)
    x[2] = 0.0  # an image whose token norms are all below the threshold: skipped by both
    stream: list[torch.Tensor] = []
    with torch.no_grad():
        model.encode(x, layers=stream)
    threshold = float(stream[-2].norm(dim=-1).flatten().quantile(0.8))
    theirs = _authors_find_register_neurons(model, x, register_norm_threshold=threshold, detect_outliers_layer=-2)
    mine = register_neurons(model, x, threshold=threshold, layer=-2, max_layer=-1, top_k=10)
    assert mine.images + mine.skipped == 6 and mine.skipped >= 1
    assert [(l, j) for l, j, _ in mine.ranked[:50]] == [(l, j) for l, j, _ in theirs[:50]]
    torch.testing.assert_close(torch.tensor([s for *_, s in mine.ranked]), torch.tensor([s for *_, s in theirs]), rtol=1e-5, atol=1e-6)
    assert mine.neurons == tuple((l, j) for l, j, _ in theirs[:10])
    by_default = register_neurons(model, x, threshold=threshold, top_k=10)  # max_layer: the detection layer
    assert all(l <= 2 for l, _, _ in by_default.ranked) and isinstance(by_default, RegisterNeurons)
    assert _hooks(model) == 0


def test_detection_refusals():
    model = _tiny()
    x = torch.zeros(2, 3, 32, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match="no image had a token"):
        register_neurons(model, x, threshold=1e9)
    with pytest.raises(ValueError, match="outside this model's 4 blocks"):
        register_neurons(model, x, layer=7)
    with pytest.raises(ValueError, match="top_k"):
        register_neurons(model, x, top_k=0)


def test_record_neurons_reads_the_hidden_activations():
    for fields in ({}, {"mlp": "gated", "act": "silu"}):
        model = _tiny(**fields)
        x = torch.randn(1, 3, 32, 32, dtype=torch.float64)
        with record_neurons(model) as acts, torch.no_grad():
            model(x)
        assert all(a.shape == (1, 17, 48) for a in acts)
        mlp, h = model.blocks[0].mlp, model.norm_pre(model.tokens(x))
        h = model.blocks[0].norm2(h + model.blocks[0].ls1(model.blocks[0].attn(model.blocks[0].norm1(h))))
        if isinstance(mlp, torch.nn.Sequential):
            expected = getattr(mlp, "1")(getattr(mlp, "0")(h))
        else:
            gate, value = getattr(mlp, "0")(h).split(48, dim=-1)
            expected = mlp.act(gate) * value
        torch.testing.assert_close(acts[0], expected.detach())
        assert _hooks(model) == 0


def test_an_image_text_models_tower_takes_a_register():
    clip = vitviz.load_model("shapes_clip")
    image = shapes.render(2, seed=3, index=1, image_size=96)[0]
    from PIL import Image

    before = vitviz.analyze(clip, Image.fromarray(image))
    clip.image = with_test_time_register(clip.image, [(2, 5), (3, 9)])
    after = vitviz.analyze(clip, Image.fromarray(image))
    assert after.prefix_names == ("cls", "ttr") and after.attentions.shape[-1] == before.attentions.shape[-1] + 1
    assert after.probabilities.shape == before.probabilities.shape
    (e,) = vitviz.explain(clip, Image.fromarray(image), method="legrad", text=["a star"])
    assert torch.isfinite(e.map).all()
