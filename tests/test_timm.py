"""timm's ViTs through vitviz: the same outputs and the same attention as timm's own forward, and the
real weights path through a Hugging Face cache, offline."""

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import random_timm, random_timm_weights, write_hub_cache

import vitviz

timm = pytest.importorskip("timm")

ROOT = Path(__file__).resolve().parent.parent

NAMES = [
    "vit_base_patch16_224.augreg2_in21k_ft_in1k",
    "vit_base_patch32_224.augreg_in21k_ft_in1k",
    "deit_base_distilled_patch16_224.fb_in1k",
    "deit3_small_patch16_224.fb_in1k",
    "vit_small_patch16_224.dino",
    "vit_small_patch8_224.dino",
    "vit_small_patch14_reg4_dinov2.lvd142m",
    "vit_base_patch16_clip_224.openai",
    "vit_base_patch16_siglip_224.webli",  # attention pooling ("map"), no prefix token
]


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _timm_attention(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    from vitviz.dev.zoo import timm_attention

    return timm_attention(model, x)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_from_timm_gives_timms_outputs_and_attention(name):
    torch.manual_seed(0)
    model = random_timm(name)
    ours = vitviz.ViT.from_timm(model)
    size = model.pretrained_cfg["input_size"][-1]
    x = torch.randn(1, 3, size, size)
    with torch.inference_mode():
        want = model(x)
        with vitviz.record_attention(ours) as rec:
            got = ours(x)
    assert want.abs().max() > 1e-3
    assert got.shape == want.shape and _relative(got, want) < 1e-4
    attn = _timm_attention(model, x)
    assert rec.attentions.shape == attn.shape
    torch.testing.assert_close(rec.attentions, attn, atol=1e-5, rtol=0)
    # the layout vitviz read
    spec = ours.spec
    assert spec.num_prefix_tokens == model.num_prefix_tokens and spec.name == f"timm:{name.split('.')[0]}"  # random: no tag
    assert spec.preprocessing.image_size == size and spec.preprocessing.mean == tuple(model.pretrained_cfg["mean"])
    if name.startswith("deit_base_distilled"):
        assert spec.prefix_names == ("cls", "dist") and ours.head_dist is not None
    if "reg4" in name:
        assert spec.prefix_names == ("cls", "reg1", "reg2", "reg3", "reg4") and spec.config.pos_embed_prefix == 0
    if name.endswith(".webli"):
        assert spec.prefix_names == () and spec.config.pool == "map"
    if name.endswith((".dino", ".lvd142m", ".openai", ".webli")):
        assert spec.categories is None  # features only: DINO has no head, CLIP's head is a projection
    else:
        assert len(spec.categories) == 1000 and spec.categories[0].startswith("tench")


def _random_vit(**kwargs) -> torch.nn.Module:
    """A small timm VisionTransformer, every weight random (its norms' too: a conversion that drops
    a LayerNorm's weight cannot pass)."""
    from timm.models.vision_transformer import VisionTransformer

    model = VisionTransformer(**{**dict(img_size=64, patch_size=16, embed_dim=96, depth=2, num_heads=4, num_classes=10), **kwargs}).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


@pytest.mark.parametrize("kwargs", [dict(qk_norm=True), dict(global_pool="map", class_token=False),
                                    dict(global_pool="map", class_token=False, qk_norm=True, init_values=0.5),
                                    dict(global_pool="map", class_token=False, reg_tokens=2),
                                    dict(global_pool="map", reg_tokens=1, pool_include_prefix=True)],
                         ids=["qk_norm", "map", "map+qk_norm+layerscale", "map over the patches beside registers",
                              "map over every token"])
def test_normalised_queries_and_keys_and_attention_pooling_match_timm(kwargs):
    """timm's `qk_norm=True` (a LayerNorm over each head's queries and keys) and its attention-pooling
    head (`global_pool="map"`, `AttentionPoolLatent`: SigLIP's; beside prefix tokens it pools the
    patches alone unless `pool_include_prefix`): the same logits, every block's attention, and the
    probe's attention as computed here from timm's own modules (0 on a prefix token it leaves out)."""
    torch.manual_seed(0)
    model = _random_vit(**kwargs)
    ours = vitviz.ViT.from_timm(model)
    assert ours.config.qk_norm == kwargs.get("qk_norm", False) and ours.config.pool == kwargs.get("global_pool", "token")
    x = torch.randn(2, 3, 64, 64)
    seen = {}
    hook = model.attn_pool.register_forward_pre_hook(lambda m, args: seen.update(tokens=args[0])) if model.attn_pool else None
    with torch.inference_mode():
        want = model(x)
        with vitviz.record_attention(ours) as rec:
            got = ours(x)
    if hook is not None:
        hook.remove()
    assert _relative(got, want) < 1e-5
    torch.testing.assert_close(rec.attentions, _timm_attention(model, x), atol=1e-5, rtol=0)
    if model.attn_pool is not None:  # the probe's softmax, written out from timm's modules
        pool, h = model.attn_pool, model.attn_pool.num_heads
        with torch.inference_mode():
            q = pool.q(pool.latent).reshape(1, 1, h, -1).transpose(1, 2)
            k = pool.kv(seen["tokens"]).reshape(2, -1, 2, h, q.shape[-1]).permute(2, 0, 3, 1, 4)[0]
            probe = ((q * pool.scale) @ k.transpose(-2, -1)).softmax(-1)
        skip = rec.pool_attention.shape[-1] - probe.shape[-1]  # the prefix tokens timm's pool did not see
        assert skip == (0 if kwargs.get("pool_include_prefix") else model.num_prefix_tokens)
        assert ours.config.pool_prefix == (skip == 0 or not model.num_prefix_tokens)
        torch.testing.assert_close(rec.pool_attention[..., skip:], probe[:, :, 0], atol=1e-6, rtol=0)
        assert (rec.pool_attention[..., :skip] == 0).all()


def _gated(kind: str):
    from functools import partial

    from timm.layers import GluMlp, SwiGLU, SwiGLUPacked

    return {"packed": SwiGLUPacked, "split": SwiGLU, "gate last": partial(GluMlp, act_layer=torch.nn.SiLU, gate_last=True)}[kind]


@pytest.mark.parametrize("kind", ["packed", "split", "gate last"])
def test_gated_mlps_match_timm(kind):
    """timm's SwiGLU MLPs (GluMlp packed as DINOv2-g's, SwiGLU with two input projections, a GluMlp
    gating with its second half) as vitviz's `GatedMLP`: the same logits and attention, and the
    parameters the config counts before any weight exists."""
    torch.manual_seed(0)
    model = _random_vit(mlp_layer=_gated(kind), act_layer=torch.nn.SiLU, mlp_ratio=8 / 3, qk_norm=kind == "split")
    ours = vitviz.ViT.from_timm(model)
    assert ours.config.mlp == "gated" and ours.config.act == "silu" and ours.config.mlp_dim == model.blocks[0].mlp.fc2.in_features
    assert ours.config.num_params == sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in model.parameters())
    x = torch.randn(2, 3, 64, 64)
    with torch.inference_mode():
        want = model(x)
        with vitviz.record_attention(ours) as rec:
            got = ours(x)
    assert _relative(got, want) < 1e-5
    torch.testing.assert_close(rec.attentions, _timm_attention(model, x), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_dinov2_giant_with_registers_converts_exactly():
    """DINOv2-g/14 with registers (a packed SwiGLU, LayerScale, registers without position
    embeddings), two of its blocks at 112 px: its features as timm's."""
    torch.manual_seed(0)
    model = random_timm("vit_giant_patch14_reg4_dinov2.lvd142m", depth=2, img_size=112)
    ours = vitviz.ViT.from_timm(model)
    assert ours.config.mlp == "gated" and ours.spec.prefix_names == ("cls", "reg1", "reg2", "reg3", "reg4")
    x = torch.randn(1, 3, 112, 112)
    with torch.inference_mode():
        assert _relative(ours(x), model(x)) < 1e-5


@pytest.mark.parametrize("kwargs, reason", [
    (dict(global_pool="map", class_token=False, fc_norm=True), "a norm after attention pooling"),
])
def test_what_vitviz_does_not_model_of_timms_pooling_and_norms_is_named(kwargs, reason):
    with pytest.raises(NotImplementedError, match=reason):
        vitviz.ViT.from_timm(_random_vit(**kwargs))


def test_a_size_off_the_patch_grid_reads_the_top_left_patches_as_timm_does():
    """SigLIP so400m at 384 px with 14 px patches: timm's transform makes 384 px, its patch embedding
    reads the top-left 27 x 27 patches (378 px). vitviz's preprocessing makes the same 384 px and cuts
    the rest off; the model is the 378 px one."""
    torch.manual_seed(0)
    model = _random_vit(img_size=60)  # 16 px patches: 3 x 3 of them, 12 px left out
    ours = vitviz.ViT.from_timm(model)
    pre = ours.spec.preprocessing
    assert ours.config.image_size == 48 and pre.image_size == 48 and pre.full_size == 60 and ours.spec.grid == (3, 3)
    x = torch.randn(1, 3, 60, 60)
    with torch.inference_mode():
        assert _relative(ours(x[..., :48, :48]), model(x)) < 1e-5
    from PIL import Image

    image = Image.fromarray((np.random.default_rng(0).random((50, 90, 3)) * 255).astype("uint8"))
    cfg = timm.data.resolve_data_config({}, model=model) | {"input_size": (3, 60, 60)}  # the transform at its own size
    want = timm.data.create_transform(**cfg)(image)  # [3, 60, 60]
    got, crop = vitviz.preprocess(image, pre)
    assert crop.size == (48, 48)
    torch.testing.assert_close(got, want[:, :48, :48])
    assert pre.at(64).full_size is None  # another size is a multiple of the patch: nothing cut off


@pytest.mark.parametrize("kind", ["norm after the attention", "norm inside a gated MLP", "norm inside an MLP"])
def test_norms_inside_the_attention_and_the_mlp_match_timm(kind):
    """timm's `scale_attn_norm` (a LayerNorm over the heads' outputs before W_O) and `scale_mlp_norm`
    (a LayerNorm after the activation, or the gating): the same logits and attention."""
    from timm.layers import SwiGLUPacked

    kwargs = {"norm after the attention": dict(qk_norm=True, scale_attn_norm=True),
              "norm inside a gated MLP": dict(mlp_layer=SwiGLUPacked, act_layer=torch.nn.SiLU, scale_mlp_norm=True),
              "norm inside an MLP": dict(scale_mlp_norm=True)}[kind]
    torch.manual_seed(0)
    model = _random_vit(**kwargs)
    ours = vitviz.ViT.from_timm(model)
    assert ours.config.attn_norm == (kind == "norm after the attention") and ours.config.mlp_norm == (kind != "norm after the attention")
    x = torch.randn(1, 3, 64, 64)
    with torch.inference_mode():
        with vitviz.record_attention(ours) as rec:
            got = ours(x)
        assert _relative(got, model(x)) < 1e-5
    torch.testing.assert_close(rec.attentions, _timm_attention(model, x), atol=1e-5, rtol=0)


# timm's Eva class, one of each kind: EVA-02 (rotary, separate q/k/v, SwiGLU with a norm inside; its CLIP
# tower with a norm after the attention), DINOv3 (no position table, 4 registers, centred rotary, half
# pairs; S+ with SwiGLU), RoPE-ViT (axial and learned "mixed" frequencies, with and without a table),
# Perception Encoder (a norm before the blocks, an attention pool of 8 heads over 12, offset and
# rescaled coordinates, x first)
EVA_NAMES = ["eva02_tiny_patch14_224", "eva02_base_patch14_224", "eva02_base_patch16_clip_224", "vit_small_patch16_dinov3",
             "vit_small_plus_patch16_dinov3_qkvb", "vit_small_patch16_rope_224", "vit_small_patch16_rope_mixed_ape_224",
             "vit_pe_core_base_patch16_224", "vit_medium_patch16_rope_reg1_gap_256",
             "aimv2_large_patch14_224",  # (a VisionTransformer: RMSNorm everywhere, one after the patch embedding, SwiGLU)
             "beit_base_patch16_224", "vit_relpos_medium_patch16_cls_224", "vit_srelpos_small_patch16_224",  # relative position bias
             "vit_base_patch16_rpn_224", "vit_relpos_small_patch16_rpn_224",  # res-post-norm blocks
             "vit_pwee_patch16_reg1_gap_256", "vit_base_patch16_xp_224"]  # parallel blocks (ViT-22B's), RMSNorm q/k norms


@pytest.mark.parametrize("name", EVA_NAMES)
def test_timms_rotary_families_give_timms_outputs_and_attention(name):
    """float32: logits within 1e-4 of the largest and every block's attention within 1e-5 of timm's
    own softmax; bfloat16 (both models cast): logits within 2e-2 and attention within 1e-2 (vitviz
    computes the softmax in float32, timm in bfloat16: up to 3.4e-3 apart measured)."""
    torch.manual_seed(0)
    model = random_timm(name, depth=2)
    ours = vitviz.ViT.from_timm(model)
    size = model.pretrained_cfg["input_size"][-2:]
    x = torch.randn(2, 3, *size)
    for dtype, logits, attention in ((torch.float32, 1e-4, 1e-5), (torch.bfloat16, 2e-2, 1e-2)):
        model, ours = model.to(dtype), ours.to(dtype)
        with torch.inference_mode():
            want = model(x.to(dtype)).float()
            with vitviz.record_attention(ours) as rec:
                got = ours(x.to(dtype)).float()
        assert want.abs().max() > 1e-3 and got.shape == want.shape and _relative(got, want) < logits, dtype
        torch.testing.assert_close(rec.attentions.float(), _timm_attention(model, x.to(dtype)).float(), atol=attention, rtol=0)
    c = ours.config
    assert c.rope is not None or name.startswith("aimv2") or c.rel_pos_bias or c.post_norm or c.parallel
    assert c.parallel == ("xp" in name or "pwee" in name)
    assert c.post_norm == ("rpn" in name)
    assert c.num_params == sum(p.numel() for p in ours.parameters())  # counted from the config alone
    if name.startswith("aimv2"):
        assert c.norm == "rmsnorm" and c.patch_norm and c.mlp == "gated"
    if "dinov3" in name:
        assert ours.spec.prefix_names == ("cls", "reg1", "reg2", "reg3", "reg4") and ours.pos_embed is None and c.rope == "dinov3"
    if "pe_core" in name:
        assert c.pool == "map" and c.pool_heads == 8 and c.norm_pre and c.rope_axes == "xy" and c.rope_offset == 1.0
        assert c.pool_mlp_dim is None  # (PE-core G's pool has an MLP of its own width: the zoo's row)


def test_a_relative_position_bias_runs_at_its_own_grid_only():
    """BEiT's tables (and vit_relpos's MLP, read into one) are learned for one grid: another size is
    refused, by name and by image."""
    model = vitviz.ViT.from_timm(random_timm("beit_base_patch16_224", depth=2))
    assert model.config.rel_pos_bias
    with pytest.raises(ValueError, match="learned for 224 px \\(14x14 patches\\); it runs at that size only"):
        vitviz.get_spec("timm:beit_base_patch16_224.in22k_ft_in22k_in1k@384")
    with pytest.raises(ValueError, match="learned for its 14x14 grid"):
        model(torch.randn(1, 3, 256, 256))
    from vitviz.pipeline import layout_of
    from vitviz.server.models import ModelFacts

    layout = layout_of(model.spec, model.config.grid)
    assert layout.position_bias and not layout.position_embeddings and "positions" in layout.provides
    facts = ModelFacts.of(model)  # the Positions tab's tables: each block's bias by offset
    assert facts.similarity is None and facts.bias.shape == (2, 12, 27, 27)
    torch.testing.assert_close(facts.bias[1], model.blocks[1].attn.rel_pos.offsets().detach())
    table = model.blocks[0].attn.rel_pos.offsets()  # [H, 27, 27]: the key dy, dx from the query
    t = model.blocks[0].attn.rel_pos.table
    assert table.shape == (12, 27, 27) and torch.equal(table[:, 13 + 2, 13 - 1], t[(-2 + 13) * 27 + (1 + 13)])


def test_an_attention_pool_of_its_own_width_matches_timm():
    """Perception Encoder's pool with an MLP narrower than the blocks' (PE-core G: 6144 beside 8960)."""
    torch.manual_seed(0)
    model = random_timm("vit_pe_core_tiny_patch16_384", depth=2, attn_pool_mlp_ratio=2.0)
    ours = vitviz.ViT.from_timm(model)
    c = ours.config
    assert c.pool_mlp_dim == 2 * c.width != c.mlp_dim and c.num_params == sum(p.numel() for p in ours.parameters())
    x = torch.randn(1, 3, 384, 384)
    with torch.inference_mode():
        assert _relative(ours(x), model(x)) < 1e-4


def test_dinov3_at_any_aspect_ratio_matches_timm():
    """DINOv3 (timm's `dynamic_img_size`) on a 2:1 image: the same features and attention on an 8 x 16 grid."""
    torch.manual_seed(0)
    model = random_timm("vit_small_patch16_dinov3", depth=2)
    ours = vitviz.ViT.from_timm(model)
    x = torch.randn(1, 3, 128, 256)
    with torch.inference_mode():
        want = model(x)
        with vitviz.record_attention(ours) as rec:
            got = ours(x)
    assert _relative(got, want) < 1e-4 and rec.attentions.shape[-1] == 5 + 8 * 16
    torch.testing.assert_close(rec.attentions, _timm_attention(model, x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name, reason", [  # (the hybrids' stems are modelled: tests/test_hybrid.py)
    ("vit_small_patch16_18x2_224", "blocks of type ParallelThingsBlock"),
    ("vit_dpwee_patch16_reg1_gap_256", "blocks of type DiffParallelScalingBlock"),
    ("vit_dwee_patch16_reg1_gap_256", "attention of type DiffAttention"),
])
def test_timms_parallel_blocks_and_differential_attention_are_named(name, reason):
    with pytest.raises(NotImplementedError, match=reason):
        vitviz.ViT.from_timm(timm.create_model(name, pretrained=False, depth=2))


@pytest.mark.slow
def test_other_image_sizes_match_timms_dynamic_size():
    """DINO's figures are made at 480 px: vitviz resamples position embeddings as timm does."""
    torch.manual_seed(1)
    model = random_timm("vit_small_patch16_224.dino", dynamic_img_size=True)
    ours = vitviz.ViT.from_timm(model)
    for side in (480, 160):
        x = torch.randn(1, 3, side, side)
        with torch.inference_mode():
            assert _relative(ours.encode(x), model.forward_features(x)) < 1e-4


def test_a_model_created_at_another_size_is_analysed_at_that_size():
    """timm's model takes only the size it was created for (img_size=224 for a 518 px DINOv2): vitviz
    reads that size, and preprocesses to it with the pretrained config's crop share."""
    from PIL import Image
    from timm.data import resolve_data_config

    model = random_timm("vit_small_patch14_reg4_dinov2", img_size=224, num_classes=10)
    assert model.pretrained_cfg["input_size"][-1] == 518
    ours = vitviz.ViT.from_timm(model)
    spec = ours.spec
    assert spec.image_size == 224 and spec.grid == (16, 16) and spec.name == "timm:vit_small_patch14_reg4_dinov2@224"
    assert spec.preprocessing.resize_size == math.floor(224 / resolve_data_config({}, model=model)["crop_pct"])
    image = Image.fromarray(torch.randint(0, 256, (300, 451, 3), dtype=torch.uint8).numpy())
    x = vitviz.preprocess(image, spec.preprocessing)[0][None]
    with torch.inference_mode():
        want = model(x)
        got = ours(x)
    assert x.shape[-1] == 224 and want.abs().max() > 1e-3 and _relative(got, want) < 1e-4


NOT_NAMES = ["timm:local-dir:/etc", "timm:hf-hub:org/name", "timm:org/name", "timm:/etc/passwd", "timm:../vit_small_patch16_224",
             "timm:Vit_small_patch16_224", "timm:vit_small_patch16_224.", "timm:vit_small_patch16_224.a/b", "timm:vit small", "timm:",
             "timm:local-dir:/etc@224"]
BAD_SIZES = ["@0", "@-16", "@abc", "@", "@16.5", "@ 96", "@096"]


def test_timm_takes_model_names_only_checked_before_timm_sees_them(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("timm was asked")

    vitviz.list_variants()  # the menu's own timm models described first, as the app does when it starts
    monkeypatch.setattr(timm, "create_model", never)
    monkeypatch.setattr(vitviz.sources.timm, "_meta_model", never)
    messages = set()
    for name in NOT_NAMES:
        with pytest.raises(ValueError) as info:
            vitviz.get_spec(name)
        messages.add(str(info.value))
    assert len(messages) == 1
    message = messages.pop()
    assert message.startswith("timm:<name> takes a timm model name such as") and "weights_path=<file>" in message
    for size in BAD_SIZES:
        with pytest.raises(ValueError, match="after @ comes the side of the images .* a whole number of pixels above 0"):
            vitviz.get_spec(f"timm:vit_small_patch16_224.dino{size}")


def test_a_size_must_be_a_multiple_of_the_patch_size():
    with pytest.raises(ValueError, match="90 px is not a multiple of .* patch size 16: 80 or 96 px would be"):
        vitviz.get_spec("timm:vit_small_patch16_224.dino@90")
    assert vitviz.get_spec("timm:vit_small_patch16_224.dino@96").image_size == 96


def test_what_vitviz_does_not_model_is_refused_clearly():
    from timm.layers import SwiGLUPacked

    with pytest.raises(NotImplementedError, match="blocks of type ParallelThingsBlock"):
        vitviz.ViT.from_timm(timm.create_model("vit_small_patch16_18x2_224", depth=2, pretrained=False))
    with pytest.raises(NotImplementedError, match="the MLP activation \\(GELU\\)"):  # a gated MLP gates with SiLU
        vitviz.ViT.from_timm(timm.create_model("vit_small_patch16_224", mlp_layer=SwiGLUPacked, pretrained=False))
    with pytest.raises(NotImplementedError, match="global_pool='avgmax'"):
        vitviz.ViT.from_timm(timm.create_model("vit_small_patch16_224", global_pool="avgmax", pretrained=False))
    with pytest.raises(TypeError, match="timm VisionTransformer"):
        vitviz.ViT.from_timm(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="timm knows no model"):
        vitviz.get_spec("timm:no_such_model_anywhere")


def test_names_offered_by_the_menu_are_described_without_weights():
    names = [s.name for s in vitviz.list_variants() if s.source == "timm"]
    assert "timm:deit_base_distilled_patch16_224.fb_in1k" in names and "timm:vit_small_patch8_224.dino" in names
    dinov2 = vitviz.get_spec("timm:vit_small_patch14_reg4_dinov2.lvd142m@224")
    assert dinov2.image_size == 224 and dinov2.grid == (16, 16) and dinov2.num_tokens == 5 + 256
    at480 = vitviz.get_spec("timm:vit_small_patch8_224.dino@480")
    assert at480.grid == (60, 60) and at480.preprocessing.resize_size == 533  # 480 / 0.9, the same crop share


# ------------------------------------------------------------------------------------------------
# The weights path: a Hugging Face cache with random weights, offline, in a fresh interpreter


def _run(code: str, hf_home: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT, timeout=600)


@pytest.mark.slow
def test_load_model_reads_the_hub_cache_offline_and_says_what_to_do_without_it(tmp_path):
    name = "vit_small_patch16_224.dino"
    model, weights = random_timm_weights(name, seed=2)
    write_hub_cache(tmp_path / "hf" / "hub", f"timm/{name}", {"model.safetensors": weights})
    x = torch.randn(1, 3, 224, 224)
    torch.save(x, tmp_path / "x.pt")
    with torch.inference_mode():
        torch.save(model(x), tmp_path / "want.pt")
    code = f"""
import torch, vitviz
assert vitviz.weights_status("timm:{name}") == "cached"
m = vitviz.load_model("timm:{name}", device="cpu")
x = torch.load({str(tmp_path / "x.pt")!r})
with torch.inference_mode():
    got = m(x)
want = torch.load({str(tmp_path / "want.pt")!r})
print(((got - want).abs().max() / want.abs().max()).item(), m.spec.name)
"""
    out = _run(code, tmp_path / "hf")
    assert out.returncode == 0, out.stderr[-3000:]
    rel, spec_name = out.stdout.split()
    assert float(rel) < 1e-4 and spec_name == f"timm:{name}"

    missing = _run(
        "import vitviz\n"
        "try:\n    vitviz.load_model('timm:vit_small_patch8_224.dino', device='cpu')\n"
        "except vitviz.WeightsUnavailableError as exc:\n    print('UNAVAILABLE', exc)\n",
        tmp_path / "hf",
    )
    assert "UNAVAILABLE" in missing.stdout, missing.stderr[-3000:]
    assert "hf download timm/vit_small_patch8_224.dino" in missing.stdout and str(tmp_path / "hf" / "hub") in missing.stdout
    assert "weights_path=" in missing.stdout


# ------------------------------------------------------------------------------------------------
# A checkpoint of the user's own, and names that claim no weights that are not there


def _never_the_hub(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the hub or its cache was asked")

    for name in ("cached_file", "hub_reachable"):
        monkeypatch.setattr(vitviz.sources.timm, name, never)


@pytest.mark.parametrize("form", ["state_dict.pth", "model.safetensors", "training.pth.tar"])
def test_a_checkpoint_with_another_class_count_loads_offline_as_timm_loads_it(no_network, monkeypatch, tmp_path, form):
    """A fine-tuned checkpoint (10 classes): built with the head's class count, the same logits as
    timm's own model with that num_classes loaded from the same file (a training checkpoint: its EMA
    weights, as timm picks them), and the architecture's own preprocessing, without the hub."""
    import argparse

    from safetensors.torch import save_file
    from timm.data import resolve_data_config

    name = "vit_tiny_patch16_224"
    sd = random_timm(name, num_classes=10).state_dict()
    path = tmp_path / form
    if form == "model.safetensors":
        save_file({k: v.contiguous() for k, v in sd.items()}, path)
    elif form == "state_dict.pth":
        torch.save(sd, path)
    else:  # as timm's train.py saves it: DataParallel names, EMA weights beside, the run's arguments
        ema = {k: v + 0.05 * torch.randn_like(v) for k, v in sd.items()}
        args = argparse.Namespace(model=name, num_classes=10, mean=(0.1, 0.2, 0.3), std=(0.2, 0.2, 0.2), crop_pct=1.0)
        torch.save({"epoch": 3, "arch": "visiontransformer", "state_dict": {f"module.{k}": v for k, v in sd.items()},
                    "state_dict_ema": ema, "args": args, "version": 2}, path)
    _never_the_hub(monkeypatch)
    ours = vitviz.load_model(f"timm:{name}", device="cpu", weights_path=path)
    theirs = timm.create_model(name, pretrained=False, num_classes=10, checkpoint_path=str(path)).eval()
    x = torch.randn(2, 3, 224, 224)
    with torch.inference_mode():
        got, want = ours(x), theirs(x)
    assert got.shape == (2, 10) and want.abs().max() > 1e-3 and _relative(got, want) < 1e-4
    spec = ours.spec
    assert spec.name == f"timm:{name}" and spec.categories == tuple(f"class {i}" for i in range(10))
    data = resolve_data_config({}, model=theirs)  # the architecture's pretrained_cfg, not the run's arguments
    pre = spec.preprocessing
    assert (pre.mean, pre.std, pre.interpolation) == (tuple(data["mean"]), tuple(data["std"]), data["interpolation"])
    assert pre.image_size == 224 and pre.resize_size == math.floor(224 / data["crop_pct"])
    assert path.name in spec.description and "hub" not in spec.weights and spec.locator == str(path)
    assert vitviz.sources.source_of(spec).status(spec) == "cached"


def test_a_checkpoint_without_a_head_loads_as_features(no_network, monkeypatch, tmp_path):
    path = tmp_path / "features.pth"
    model = random_timm("vit_tiny_patch16_224", num_classes=0)
    torch.save(model.state_dict(), path)
    _never_the_hub(monkeypatch)
    ours = vitviz.load_model("timm:vit_tiny_patch16_224@112", device="cpu", weights_path=path)
    assert ours.spec.categories is None and ours.spec.image_size == 112 and ours.spec.name == "timm:vit_tiny_patch16_224@112"
    x = torch.randn(1, 3, 224, 224)
    with torch.inference_mode():
        assert _relative(ours(x), model(x)) < 1e-4


class _Trainer:
    """An object a training script might pickle into its checkpoint."""


def test_a_checkpoint_of_another_architecture_is_refused_clearly(no_network, tmp_path):
    path = tmp_path / "tiny.pth"
    torch.save(random_timm("vit_tiny_patch16_224", num_classes=10).state_dict(), path)
    with pytest.raises(ValueError, match="tiny.pth does not fit timm:vit_small_patch16_224 .*name the timm architecture"):
        vitviz.load_model("timm:vit_small_patch16_224", device="cpu", weights_path=path)
    (tmp_path / "jax.npz").write_bytes(b"")
    with pytest.raises(ValueError, match=r"NumPy .* model.load_pretrained\(path\)\) and pass that to vitviz.ViT.from_timm"):
        vitviz.load_model("timm:vit_small_patch16_224", device="cpu", weights_path=tmp_path / "jax.npz")
    torch.save({"state_dict": random_timm("vit_tiny_patch16_224").state_dict(), "trainer": _Trainer()}, tmp_path / "pickled.pth")
    with pytest.raises(ValueError, match="pickled.pth holds Python objects besides tensors"):
        vitviz.load_model("timm:vit_tiny_patch16_224", device="cpu", weights_path=tmp_path / "pickled.pth")
    with pytest.raises(FileNotFoundError, match="is not a file"):
        vitviz.load_model("timm:vit_small_patch16_224", device="cpu", weights_path=tmp_path / "missing.pth")


def test_a_model_with_random_weights_claims_no_pretrained_tag():
    """timm keeps a tag's pretrained_cfg whether or not its weights were loaded: a converted model is
    named by its architecture, and a name timm has no weights for says so."""
    spec = vitviz.ViT.from_timm(random_timm("vit_tiny_patch16_224.augreg_in21k_ft_in1k")).spec
    assert spec.name == "timm:vit_tiny_patch16_224"
    for text in (spec.name, spec.description, spec.weights):
        assert "augreg" not in text and "in21k" not in text and "pretrained" not in text and "hub" not in text
    assert spec.mean == (0.5, 0.5, 0.5)  # the tag's preprocessing is still the one the model was made for
    untrained = vitviz.get_spec("timm:vit_base_patch16_gap_224")  # timm's default tag for it is "untrained"
    assert "(Hugging Face hub)" not in untrained.weights and "no pretrained weights" in untrained.weights
    assert "no pretrained weights" in untrained.description


def test_the_stage_table_names_the_attention_pool_and_counts_every_parameter():
    model = vitviz.ViT.from_timm(_random_vit(global_pool="map", class_token=False, qk_norm=True))
    s = vitviz.summary(model)
    stages = [r.stage for r in s.rows]
    assert any(stage.startswith("Attention pooling") for stage in stages) and not any("cls token" in stage for stage in stages)
    assert "q/k LayerNorm" in s.rows[stages.index("Encoder block 1")].layer
    assert sum(r.params for r in s.rows) == s.total_params == sum(p.numel() for p in model.parameters())


def test_the_zoo_command_says_exact_or_refused_for_each_architecture():
    """`python -m vitviz.dev.zoo` (docs/models.md's table): a ViT, an EVA-02 and a NaFlex ViT (fed a
    1:2 image) exact, three refused in one sentence each, and the table's counts."""
    from vitviz.dev import zoo

    table = [zoo.check("deit", "deit_tiny_patch16_224"), zoo.check("eva", "eva02_tiny_patch14_224"),
             zoo.check("naflexvit", "naflexvit_base_patch16_gap"), zoo.check("vision_transformer", "vit_dwee_patch16_reg1_gap_256"),
             zoo.check("vision_transformer", "vit_small_patch16_18x2_224"),
             zoo.check("eva", "vit_base_patch16_sapiens2")]  # (timm cannot build it two blocks deep: whole, on the meta device)
    assert [r.status for r in table] == ["exact", "exact", "exact", "refused", "refused", "refused"]
    assert table[5].cls == "Eva" and "non-square images" in table[5].detail
    assert table[0].cls == "VisionTransformer" and all("attention" in r.detail for r in table[:3])
    assert table[3].detail == "VisionTransformer has attention of type DiffAttention, which vitviz does not model"
    assert table[4].detail == "VisionTransformer has blocks of type ParallelThingsBlock, which vitviz does not model"
    page = zoo.markdown(table)
    assert "| all | 6 | 3 | 3 | 0 |" in page and "| `eva` | 2 | 1 | 1 | 0 |" in page
