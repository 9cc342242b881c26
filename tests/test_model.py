"""vitviz's ViT against torchvision's on the same weights, and the two attention paths."""

import pytest
import torch
import torch.nn.functional as F
from conftest import random_torchvision

import vitviz
from vitviz.model import ViT

ARCHS = ["vit_b_16", "vit_b_32", "vit_l_16", "vit_l_32", "vit_h_14"]


def _tv_features(tv, x):
    """torchvision's pre-head features: the cls token after the final LayerNorm."""
    tokens = tv._process_input(x)
    cls = tv.class_token.expand(x.shape[0], -1, -1)
    return tv.encoder(torch.cat([cls, tokens], dim=1))[:, 0]


@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.slow) if a in ("vit_l_16", "vit_h_14") else a for a in ARCHS])
def test_from_torchvision_matches_logits_and_features(arch):
    tv = random_torchvision(arch)
    ours = ViT.from_torchvision(tv)
    x = torch.randn(2, 3, 224, 224)
    with torch.inference_mode():
        want_logits, got_logits = tv(x), ours(x)
        want_feat, got_feat = _tv_features(tv, x), ours.forward_features(x)
        with vitviz.record_attention(ours) as rec:
            rec_logits = ours(x)
    assert want_logits.abs().max() > 1e-3, "the head must not be zero, or equal logits mean nothing"
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(got_feat, want_feat, atol=1e-4, rtol=0)
    torch.testing.assert_close(rec_logits, want_logits, atol=1e-4, rtol=0)
    assert rec.attentions.shape == (ours.depth, 2, ours.heads, ours.num_tokens, ours.num_tokens)


def test_recorded_attention_equals_recomputation_from_torchvision_inputs():
    tv = random_torchvision("vit_b_32")
    ours = ViT.from_torchvision(tv)
    x = torch.randn(2, 3, 224, 224)
    inputs = []
    handles = [
        layer.self_attention.register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
        for layer in tv.encoder.layers
    ]
    try:
        with torch.inference_mode():
            tv(x)
    finally:
        for h in handles:
            h.remove()
    with torch.inference_mode(), vitviz.record_attention(ours) as rec:
        ours(x)
    got = rec.attentions
    h = tv.encoder.layers[0].num_heads
    for layer, (block, q_in) in enumerate(zip(tv.encoder.layers, inputs)):
        mha = block.self_attention
        # Independent: the projection weights straight from torchvision, scale before softmax.
        with torch.no_grad():
            q, k, _ = F.linear(q_in, mha.in_proj_weight, mha.in_proj_bias).chunk(3, dim=-1)
        b, n, d = q.shape
        q = q.reshape(b, n, h, d // h).transpose(1, 2)
        k = k.reshape(b, n, h, d // h).transpose(1, 2)
        want = torch.softmax(q @ k.transpose(-1, -2) / (d // h) ** 0.5, dim=-1)
        torch.testing.assert_close(got[layer], want, atol=1e-5, rtol=0)
        # And torchvision's own MultiheadAttention asked for per-head weights.
        with torch.inference_mode():
            _, tv_weights = mha(q_in, q_in, q_in, need_weights=True, average_attn_weights=False)
        torch.testing.assert_close(got[layer], tv_weights, atol=1e-5, rtol=0)


def test_fused_and_explicit_paths_agree():
    model = vitviz.get_spec("shapes_p8").build().eval()
    x = torch.randn(3, 3, 96, 96)
    with torch.inference_mode():
        fused = model(x)
        for block in model.blocks:
            block.attn.fused = False
        explicit = model(x)
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)


def test_a_users_own_hook_on_the_softmax_sees_attention():
    model = vitviz.get_spec("shapes_p16").build().eval()
    seen = []
    handle = model.blocks[2].attn.attend.register_forward_hook(lambda m, i, o: seen.append(o))
    try:
        with torch.inference_mode():
            model(torch.randn(1, 3, 96, 96))
    finally:
        handle.remove()
    assert len(seen) == 1 and seen[0].shape == (1, 3, 37, 37)
    torch.testing.assert_close(seen[0].sum(-1), torch.ones(1, 3, 37))


def test_forward_is_deterministic_and_batch_independent():
    model = vitviz.get_spec("shapes_p8").build().eval()
    x = torch.randn(4, 3, 96, 96)
    with torch.inference_mode():
        whole = model(x)
        again = model(x)
        one_by_one = torch.cat([model(x[i : i + 1]) for i in range(4)])
    torch.testing.assert_close(whole, again, atol=0, rtol=0)
    torch.testing.assert_close(whole, one_by_one, atol=1e-5, rtol=1e-5)


def test_scale_is_applied_before_softmax():
    model = ViT(image_size=32, patch_size=16, width=8, depth=1, heads=2, mlp_dim=16, num_classes=3).eval()
    attn_mod = model.blocks[0].attn
    x = torch.randn(1, 5, 8)
    with torch.inference_mode(), vitviz.record_attention(model) as rec:
        model(torch.randn(1, 3, 32, 32))
    assert attn_mod.scale == pytest.approx(4**-0.5)
    q, k, _ = attn_mod.qkv(x).reshape(1, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)
    want = torch.softmax(q @ k.transpose(-1, -2) / 2.0, dim=-1)
    with torch.inference_mode():
        got = attn_mod.attend((q @ k.transpose(-1, -2)) * attn_mod.scale)
    torch.testing.assert_close(got, want)
    assert rec.attentions.shape == (1, 1, 2, 5, 5)


def test_wrong_input_shape_says_what_is_expected():
    model = vitviz.get_spec("shapes_p16").build()
    with pytest.raises(ValueError, match=r"\[B, 3, 96, 96\].*\[1, 1, 96, 96\]"):
        model(torch.randn(1, 1, 96, 96))
    with pytest.raises(ValueError, match=r"50x50 px.*multiples of the patch size 16"):
        model(torch.randn(1, 3, 50, 50))


def test_other_image_sizes_resample_the_position_embeddings():
    model = vitviz.get_spec("shapes_p16").build().eval()
    # at the trained size nothing is resampled
    torch.testing.assert_close(model.patch_pos_embed((6, 6)), model.pos_embed[:, 1:], atol=0, rtol=0)
    # elsewhere: bicubic, antialiased, on the [gh, gw] grid of each channel
    import torch.nn.functional as F

    grid = model.pos_embed[:, 1:].reshape(1, 6, 6, -1).permute(0, 3, 1, 2)
    want = F.interpolate(grid, size=(10, 8), mode="bicubic", antialias=True).permute(0, 2, 3, 1).reshape(1, 80, -1)
    torch.testing.assert_close(model.patch_pos_embed((10, 8)), want)
    with torch.inference_mode(), vitviz.record_attention(model) as rec:
        logits = model(torch.randn(2, 3, 160, 128))
    assert logits.shape == (2, 8) and rec.attentions.shape == (6, 2, 3, 81, 81)


def test_summary_matches_seed_table_and_real_shapes():
    tv = random_torchvision("vit_b_16")
    s = vitviz.summary(ViT.from_torchvision(tv))
    assert s.total_params == 86_567_656 == sum(p.numel() for p in tv.parameters())
    assert sum(r.params for r in s.rows) == s.total_params
    small = vitviz.get_spec("shapes_p16").build().eval()
    shapes = {}

    def keep(key):
        def hook(module, inputs, output):
            shapes[key] = tuple(output.shape)

        return hook

    small.patch_embed.proj.register_forward_hook(keep("patch"))
    small.blocks[0].register_forward_hook(keep("block"))
    small.head.register_forward_hook(keep("head"))
    with torch.inference_mode():
        small(torch.randn(2, 3, 96, 96))
    rows = {r.stage: r.output_shape for r in vitviz.summary(small, batch=2).rows}
    assert rows["Patch embedding"] == shapes["patch"]
    assert rows["Encoder block 1"] == shapes["block"]
    assert rows["Classification head"] == shapes["head"]
    assert "Total params: 527,144" in str(vitviz.summary(small))
    # as the tokens go: the cls token prepended to the 36 patches, then the 37 position embeddings added to them
    stages = [r.stage for r in vitviz.summary(small, batch=2).rows]
    assert stages.index("Prepend cls token") + 1 == stages.index("Add position embeddings")
    assert rows["Prepend cls token"] == rows["Add position embeddings"] == (2, 37, 96)


def test_the_stream_after_a_block_is_what_encode_records_there():
    torch.manual_seed(0)
    model = ViT(image_size=32, patch_size=8, width=32, depth=3, heads=2, mlp_dim=48, num_classes=4, rope="axial",
                class_token=False, pool="avg").eval()
    x = torch.randn(2, 3, 32, 48)
    layers: list[torch.Tensor] = []
    with torch.no_grad():
        model.encode(x, layers=layers)
        for layer in range(3):
            torch.testing.assert_close(model.stream_after(x, layer), layers[layer], rtol=0, atol=0)
    with pytest.raises(ValueError, match="outside this model's blocks 0..2"):
        model.stream_after(x, 3)
