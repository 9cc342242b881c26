"""The ViT paper's hybrids (a convolutional stem before the patches, `vitviz.stems`) through vitviz: the
same logits and every block's attention as timm's own forward, for each kind of stem timm's
`vision_transformer_hybrid` builds; the pixel geometry of a token kept and the stem priced; what
vitviz does not model refused before any weight is read; the patch-filters view refused for a stem."""

import dataclasses
import json
from functools import partial
from pathlib import Path

import pytest
import torch
from conftest import random_timm

from torch.utils.flop_counter import FlopCounterMode

import vitviz
from vitviz import cost
from vitviz.config import ViTConfig

timm = pytest.importorskip("timm")

IMAGE = str(Path(__file__).resolve().parent.parent / "assets" / "examples" / "star.png")

# one timm architecture of each kind of stem: (name, ViTConfig.stem, stem_depths, pixels a token covers)
HYBRIDS = [
    ("vit_tiny_r_s16_p8_224", "bit", (), 32),  # BiT's root alone, 8x8 patches of its map
    ("vit_small_r26_s32_224", "bit", (2, 2, 2, 2), 32),  # BiT's ResNet-26, 1x1 patches
    ("vit_small_resnet50d_s16_224", "resnet_d", (3, 4, 6), 16),  # a ResNet-50-D's first three stages
    ("vit_base_mci_224", "conv", (), 16),  # MobileCLIP's convolutional stem, its last convolution the embedding
]


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.slow
@pytest.mark.parametrize("name, stem, depths, pixels", HYBRIDS, ids=[h[0] for h in HYBRIDS])
def test_a_hybrid_gives_timms_logits_and_every_blocks_attention(name, stem, depths, pixels):
    from vitviz.dev.zoo import timm_attention

    torch.manual_seed(0)
    model = random_timm(name, depth=2)
    ours = vitviz.from_timm(model)
    c = ours.config
    assert (c.stem, c.stem_depths, c.patch_size) == (stem, depths, pixels) and not ours.training
    size = model.pretrained_cfg["input_size"][-1]
    assert c.grid == tuple(model.patch_embed.grid_size) == (size // pixels,) * 2
    assert c.num_params == sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in model.parameters())
    x = torch.randn(2, 3, size, size)
    with torch.inference_mode():
        want = model(x)
        with vitviz.record_attention(ours) as rec:
            got = ours(x)
    assert want.abs().max() > 1e-3 and got.shape == want.shape and _relative(got, want) < 1e-4
    attention = timm_attention(model, x)
    assert rec.attentions.shape == attention.shape == (2, 2, c.heads, c.num_tokens, c.num_tokens)
    torch.testing.assert_close(rec.attentions, attention, atol=1e-5, rtol=0)
    with torch.inference_mode():  # the stem's map is the grid at any size that is a multiple of a token's pixels
        assert ours(torch.randn(1, 3, size + pixels, size + pixels)).shape == want[:1].shape
    with torch.inference_mode(), FlopCounterMode(display=False) as counted:  # priced before it runs, the stem too
        ours(x[:1])
    assert 0.9 < cost.forward_flops(ours.spec) / counted.get_total_flops() < 1.1


def test_randomise_moves_every_norm_and_a_batchnorms_statistics_off_their_inits():
    torch.manual_seed(0)
    model = random_timm("vit_small_resnet26d_224", depth=2)
    norms = [m for m in model.modules() if isinstance(m, (torch.nn.BatchNorm2d, torch.nn.GroupNorm, torch.nn.LayerNorm))]
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in norms)
    for m in norms:
        assert not torch.all(m.weight == 1) and not torch.all(m.bias == 0)
        if isinstance(m, torch.nn.BatchNorm2d):
            assert not torch.all(m.running_mean == 0) and not torch.all(m.running_var == 1)


@pytest.mark.parametrize("fields", [dict(stem="bit"), dict(stem="bit", stem_depths=(1, 1, 1)), dict(stem="resnet_d", stem_depths=(1, 2)),
                                    dict(stem="conv", stem_widths=(8, 16), stem_strides=(4, 2))],
                         ids=["bit root", "bit", "resnet_d", "conv"])
def test_a_stem_is_a_config_of_plain_numbers_counted_and_built_from_it(fields):
    """The stem's fields survive JSON (lists back to tuples); the parameters are counted from the config
    alone; the built stem's map has the channels and the stride the config says."""
    c = ViTConfig(image_size=64, patch_size=32, width=32, depth=1, heads=2, mlp_dim=64, num_classes=3, **fields)
    assert ViTConfig(**json.loads(json.dumps(dataclasses.asdict(c)))) == c
    model = vitviz.ViT(c).eval()
    assert c.num_params == sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        feature_map = model.patch_embed.stem(torch.randn(1, 3, 64, 64))
    assert feature_map.shape == (1, c.stem_channels, 64 // c.stem_stride, 64 // c.stem_stride)
    assert model.patch_embed.proj.kernel_size == (c.embed_patch_size,) * 2 and c.embed_patch_size * c.stem_stride == 32
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 3)


@pytest.mark.parametrize("fields, message", [
    (dict(stem="resnet", stem_depths=(1,)), "stem must be"),
    (dict(stem="bit", stem_widths=(8,), stem_strides=(2,)), "describe a \"conv\" stem"),
    (dict(stem="conv", stem_widths=(8, 8), stem_strides=(4,)), "one width and one stride per layer"),
    (dict(stem="bit", stem_depths=(1, 1, 1, 1, 1)), "0 to 4 stages"),
    (dict(stem="bit", stem_depths=(1, 1, 1, 1), patch_size=16), "not a multiple of the stem's stride 32"),
    (dict(stem_depths=(2,)), "describes a \"bit\" or \"resnet_d\" stem"),
])
def test_a_stem_that_does_not_add_up_is_refused_by_the_config(fields, message):
    with pytest.raises(ValueError, match=message):
        ViTConfig(**{**dict(image_size=64, patch_size=32, width=32, depth=1, heads=2, mlp_dim=64), **fields})


def _meta_hybrid(backbone_factory, **kwargs):
    """A timm VisionTransformer with a `HybridEmbed` over `backbone_factory()`, on the meta device (no
    weight exists to be read)."""
    from timm.layers import HybridEmbed
    from timm.models.vision_transformer import VisionTransformer

    with torch.device("meta"):
        return VisionTransformer(embed_layer=partial(HybridEmbed, backbone=backbone_factory()), img_size=64, patch_size=1,
                                 embed_dim=64, depth=1, num_heads=2, **kwargs)


@pytest.mark.parametrize("backbone, message", [
    (lambda: timm.create_model("resnet18", features_only=True, out_indices=[4]), "a ResNet root other than ResNet-C's"),
    (lambda: timm.create_model("resnet26d", features_only=True, out_indices=[2, 4]), "a ResNet feature extractor returning \\['layer2', 'layer4'\\]"),
    (lambda: timm.create_model("resnetv2_50", num_classes=0, global_pool=""), "a pre-activation ResNetV2"),
    (lambda: torch.nn.Sequential(torch.nn.Conv2d(3, 64, 4, 4)), "a hybrid patch embedding with a Sequential stem"),
], ids=["resnet18", "two feature maps", "pre-activation resnetv2", "another stem"])
def test_a_stem_vitviz_does_not_model_is_refused_before_any_weight_is_read(backbone, message):
    model = _meta_hybrid(backbone)
    with pytest.raises(NotImplementedError, match=f"VisionTransformer has {message}.*which vitviz does not model"):
        vitviz.from_timm(model)


def test_a_hybrid_by_name_is_priced_from_its_config_before_it_is_loaded():
    """`timm:<hybrid>` resolves without weights (timm's model on the meta device): its stem read, its
    parameters counted from the config as timm has them, its grid in pixels of a token."""
    spec = vitviz.get_spec("timm:vit_base_r50_s16_384.orig_in21k_ft_in1k")
    c = spec.config
    assert (c.stem, c.stem_depths, c.patch_size, spec.grid) == ("bit", (3, 4, 9), 16, (24, 24))
    with torch.device("meta"):
        model = timm.create_model("vit_base_r50_s16_384", pretrained=False)
    assert c.num_params == sum(p.numel() for p in model.parameters())
    mci = vitviz.get_spec("timm:vit_base_mci_224.apple_mclip")
    assert mci.config.stem == "conv" and mci.categories is None  # MobileCLIP's head projects into its text space


@pytest.fixture(scope="module")
def hybrid():
    torch.manual_seed(0)
    return vitviz.from_timm(random_timm("vit_tiny_r_s16_p8_224", depth=2))


def test_analyze_runs_on_a_hybrid_and_measures_distances_in_pixels_of_its_tokens(hybrid):
    a = vitviz.analyze(hybrid, IMAGE)
    assert a.grid == (7, 7) and a.patch_size == 32 and a.attentions.shape == (2, 3, 50, 50)
    torch.testing.assert_close(a.attentions.sum(-1), torch.ones(2, 3, 50))
    # near-uniform random attention spreads over the whole image, 32 px a token: near the uniform distance
    uniform = vitviz.uniform_attention_distance(a.grid, patch_size=a.patch_size)
    assert a.distances().shape == (2, 3) and abs(a.distances().mean().item() - uniform) < 0.1 * uniform
    assert not a.layout.patch_filters and "patch_filters" not in a.layout.provides
    assert "convolutional stem before its patches" in a.layout.lacks({"patch_filters"}, name=a.variant)


def test_the_filters_view_refuses_a_hybrid_with_a_sentence(hybrid):
    """A hybrid's patch embedding reads its stem's 64 channels, not pixels: the principal components of
    its "filters" are refused, the model's facts hold none, and the Positions tab hides them and says why."""
    import importlib

    from vitviz.server.models import ModelFacts
    from vitviz.server.pictures import views

    with pytest.raises(ValueError, match="read 64 channels, not an image's 3 .* hybrid's patch embedding"):
        vitviz.embedding_filter_components(hybrid.patch_embed.proj.weight)
    facts = ModelFacts.of(hybrid)
    assert facts.components is None and facts.explained is None and facts.similarity is not None
    exp = views.Exploration(analysis=vitviz.analyze(hybrid, IMAGE), facts=facts)
    similarity, filters = views.render_positions(exp)
    assert similarity is not None and filters is None
    importlib.import_module("vitviz.server.app")  # the page built: the tabs' components exist
    from vitviz.server import tabs
    from vitviz.server.tabs.base import Analysed

    tab = tabs.positions.TAB
    out = tab.analysed(Analysed(exp=exp, same_model=False))
    assert out[tab.filters_img] is None and out[tab.filters_box]["visible"] is False and out[tab.similarity_box]["visible"]
    assert "No patch-embedding filters: timm:vit_tiny_r_s16_p8_224 has a convolutional stem" in out[tab.caption]
