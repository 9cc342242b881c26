"""Rotary positions (`ViTConfig.rope`) and the offset tables (`vitviz.offsets`): the rotation's own
properties worked by hand, its tables against brute force, and timm's rotary families exactly."""

import math

import pytest
import torch

import vitviz
from vitviz.model import Rotary, ViT, ViTConfig, rotate
from vitviz.offsets import attention_by_offset, offset_index, rotary_offsets

SMALL = dict(image_size=48, patch_size=8, width=32, depth=2, heads=2, mlp_dim=64, num_classes=5)


def _config(**kwargs) -> ViTConfig:
    return ViTConfig(**{**SMALL, **kwargs})


def _rope_model(rope: str, **kwargs) -> ViT:
    torch.manual_seed(0)
    model = ViT(_config(rope=rope, **kwargs)).eval()
    if rope == "mixed":  # learned frequencies: random here (they start at 0)
        with torch.no_grad():
            model.rotary.freqs.normal_(std=0.5)
    return model


KINDS = [dict(rope="axial"), dict(rope="axial", rope_axes="xy", rope_offset=1.0, rope_ref_grid=(4, 4)),
         dict(rope="dinov3", rope_temperature=100.0, rope_pairs="half"), dict(rope="mixed", rope_temperature=10.0)]
IDS = ["axial", "axial xy, offset, rescaled", "dinov3 half pairs", "mixed"]


def test_one_pair_turned_by_hand():
    """Head width 4 (two pairs), axial, T = 100: pair 0 turns by the row, pair 1 by the column,
    each at frequency 1 (k = 0): the patch at (row 1, column 2) turns (1, 0) by 1 rad and (0, 1) by 2 rad."""
    c = ViTConfig(image_size=24, patch_size=8, width=8, depth=1, heads=2, mlp_dim=8, rope="axial", rope_temperature=100.0)
    rope = Rotary(c)((3, 3))[0]
    q = torch.tensor([1.0, 0.0, 0.0, 1.0]).expand(9, 4)
    turned = rotate(q, rope, "interleaved")[1 * 3 + 2]
    want = torch.tensor([math.cos(1), math.sin(1), -math.sin(2), math.cos(2)])
    torch.testing.assert_close(turned, want)


@pytest.mark.parametrize("kwargs", KINDS, ids=IDS)
def test_rotation_keeps_norms_and_makes_products_depend_on_offsets_only(kwargs):
    model = _rope_model(**kwargs)
    grid, d = (4, 5), model.config.width // model.config.heads
    ropes = model.rotations(grid)
    assert len(ropes) == model.config.depth
    torch.manual_seed(1)
    q, k = torch.randn(d), torch.randn(d)
    cos, sin = ropes[-1]
    heads = 1 if cos.ndim == 2 else cos.shape[0]
    qs = rotate(q.expand(heads, 20, d), ropes[-1], model.config.rope_pairs)  # the same q at every patch
    ks = rotate(k.expand(heads, 20, d), ropes[-1], model.config.rope_pairs)
    torch.testing.assert_close(qs.norm(dim=-1), q.norm().expand(heads, 20))
    products = qs @ ks.transpose(-1, -2)  # [H, Q, K]
    index = offset_index(grid)
    for offset in index.unique():
        same = products[:, index == offset]
        torch.testing.assert_close(same, same[:, :1].expand_as(same), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kwargs", KINDS, ids=IDS)
def test_the_rotary_table_is_the_product_of_a_rotated_even_vector_with_itself(kwargs):
    """`rotary_offsets` from its formula (the mean cosine over the pairs) against the model's own
    rotation of a vector spread evenly over the pairs, for every query and key of the grid."""
    model = _rope_model(**kwargs)
    grid = (3, 4)
    c, d = model.config, model.config.width // model.config.heads
    table = rotary_offsets(model, grid)  # [L, H, 5, 7]
    assert table.shape == (c.depth, c.heads, 5, 7)
    even = torch.zeros(d)
    if c.rope_pairs == "half":
        even[: d // 2] = (2 / d) ** 0.5
    else:
        even[::2] = (2 / d) ** 0.5
    index = offset_index(grid)
    for layer, rope in enumerate(model.rotations(grid)):
        v = rotate(even.expand(c.heads, 12, d), rope, c.rope_pairs)
        products = v @ v.transpose(-1, -2)  # [H, Q, K]
        for h in range(c.heads):
            want = table[layer, h].flatten()[index]
            torch.testing.assert_close(products[h], want, atol=1e-5, rtol=0)
    assert torch.allclose(table[..., 2, 3], torch.ones(()))  # offset 0: the vector with itself


def test_attention_by_offset_against_a_loop():
    torch.manual_seed(0)
    grid, p = (3, 4), 2
    n = p + 12
    attn = torch.rand(2, 3, n, n).softmax(dim=-1)
    got = attention_by_offset(attn, grid, num_prefix_tokens=p)
    want = torch.zeros(2, 3, 5, 7)
    count = torch.zeros(5, 7)
    for qy in range(3):
        for qx in range(4):
            for ky in range(3):
                for kx in range(4):
                    want[:, :, ky - qy + 2, kx - qx + 3] += attn[:, :, p + qy * 4 + qx, p + ky * 4 + kx]
                    count[ky - qy + 2, kx - qx + 3] += 1
    torch.testing.assert_close(got, want / count)
    with pytest.raises(ValueError, match="prefix tokens and a 3x3 grid make 11"):
        attention_by_offset(attn, (3, 3), num_prefix_tokens=2)


def test_a_rotary_model_without_a_table_runs_any_grid_and_counts_its_parameters():
    for kwargs in KINDS:
        c = _config(abs_pos_embed=False, register_tokens=2, attn_norm=True, mlp_norm=True, **kwargs)
        model = ViT(c).eval()
        assert model.pos_embed is None and c.pos_embed_prefix == 0
        assert c.num_params == sum(p.numel() for p in model.parameters())
        with torch.inference_mode():
            assert model(torch.randn(1, 3, 32, 64)).shape == (1, 5)  # 4 x 8 patches
    with pytest.raises(ValueError, match="head width divisible by 4"):
        _config(width=36, heads=6, rope="axial")
    with pytest.raises(ValueError, match="pos_embed_prefix must be 0"):
        _config(abs_pos_embed=False, pos_embed_prefix=1)


def test_the_stage_table_names_rotary_positions_and_has_no_position_table_without_one():
    model = _rope_model("dinov3", abs_pos_embed=False)
    s = vitviz.summary(model)
    stages = [r.stage for r in s.rows]
    assert "Add position embeddings" not in stages
    assert "rotary positions (DINOv3)" in s.rows[stages.index("Encoder block 1")].layer
    assert sum(r.params for r in s.rows) == s.total_params


def test_rotary_offsets_refuses_a_model_without_rotary_positions():
    with pytest.raises(ValueError, match="no rotary position embeddings"):
        rotary_offsets(ViT(_config()))
