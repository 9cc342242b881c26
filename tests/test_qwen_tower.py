"""Qwen2.5-VL's and Qwen3-VL's vision towers through vitviz (tiny random configs, offline): each
block's attention and the features before the merger equal an explicit computation from Hugging
Face's own modules, un-permuted from its packed, window-ordered tokens onto the grid; the merger
gives Hugging Face's image embeddings; windowed blocks attend within their windows only; the "hf:"
path through a folder saved with save_pretrained; `vitviz.analyze` on a tower."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import write_hub_cache
from PIL import Image

import vitviz
from vitviz.model import ViTConfig, window_mask
from vitviz.vlm.towers import TowerInfo

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as qwen25  # noqa: E402
from transformers.vision_utils import get_vision_window_index  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TOL = dict(atol=1e-5, rtol=1e-5)
TEXT = dict(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            bos_token_id=0, eos_token_id=1, rope_parameters=dict(rope_type="default", mrope_section=[2, 3, 3], rope_theta=10000.0))
VISION25 = dict(depth=4, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=14, window_size=56, fullatt_block_indexes=[1, 3],
                out_hidden_size=48, spatial_merge_size=2, temporal_patch_size=2)
VISION3 = dict(depth=4, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=16, out_hidden_size=48, spatial_merge_size=2,
               temporal_patch_size=2, num_position_embeddings=36, deepstack_visual_indexes=[1, 2])


def _randomise(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter away from its init (norms 1, biases 0), so a dropped one shows."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("norm" in name or "ln_q" in name) and name.endswith("weight"):
                p.normal_(1.0, 0.2)
            else:
                p.normal_(0, 0.2 if "pos_embed" in name else 0.05)
    return model.eval()


@pytest.fixture(scope="module")
def qwen25_vlm():
    config = transformers.Qwen2_5_VLConfig(vision_config=VISION25, text_config=TEXT)
    return _randomise(transformers.Qwen2_5_VLForConditionalGeneration(config))


@pytest.fixture(scope="module")
def qwen3_vlm():
    config = transformers.Qwen3VLConfig(vision_config=VISION3, text_config=TEXT)
    return _randomise(transformers.Qwen3VLForConditionalGeneration(config))


def _pixels(images: torch.Tensor, patch: int, merge: int = 2, temporal: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Images [1, 3, H, W] as Qwen's processor hands them to the tower: (patches [N, 3·T·P·P] in
    merge-unit order, grid_thw [[1, gh, gw]])."""
    processor = transformers.Qwen2VLImageProcessor()
    flat, gh, gw = processor.patchify(images, patch_size=patch, merge_size=merge, temporal_patch_size=temporal)
    return flat[0], torch.tensor([[1, gh, gw]])


def _grid_index(grid: tuple[int, int], window_index: torch.Tensor | None, merge: int = 2) -> torch.Tensor:
    """For each position of Hugging Face's token sequence, its patch's index in grid order (row by
    row): the processor's merge-unit order, reordered by `window_index` when given."""
    gh, gw = grid
    unit = merge * merge
    processor_order = torch.arange(gh * gw)
    if window_index is not None:
        processor_order = (window_index[:, None] * unit + torch.arange(unit)).flatten()
    cell, within = processor_order // unit, processor_order % unit
    y = cell // (gw // merge) * merge + within // merge
    x = cell % (gw // merge) * merge + within % merge
    return y * gw + x


def _reference(vlm: torch.nn.Module, images: torch.Tensor, patch: int) -> dict:
    """Hugging Face's tower on `images`: every block's attention [H, N, N] computed explicitly from its
    own modules (q, k with its rotary, a softmax per packed segment of `cu_seqlens`) and the tokens
    before the merger [N, D], both un-permuted to grid order; the image embeddings; the deepstack
    features (Qwen3-VL)."""
    visual = vlm.model.visual
    pixels, thw = _pixels(images, patch)
    grid = (int(thw[0, 1]), int(thw[0, 2]))
    window_index = None
    if hasattr(visual, "window_size"):
        window_index, _ = get_vision_window_index(thw, spatial_merge_size=2, window_size=visual.window_size, patch_size=patch)
    order = _grid_index(grid, window_index)
    seen, merged_in = [], []
    hooks = [b.register_forward_pre_hook(lambda m, a, kw: seen.append((m, a[0], kw)), with_kwargs=True) for b in visual.blocks]
    hooks.append(visual.merger.register_forward_pre_hook(lambda m, a: merged_in.append(a[0])))
    with torch.no_grad():
        out = vlm.model.get_image_features(pixels, thw)
        attentions = []
        for block, h, kw in seen:
            n, heads = h.shape[0], block.attn.num_heads
            q, k, _ = block.attn.qkv(block.norm1(h)).reshape(n, 3, heads, -1).permute(1, 0, 2, 3).unbind(0)
            q, k = qwen25.apply_rotary_pos_emb_vision(q, k, *kw["position_embeddings"])
            q, k = q.transpose(0, 1), k.transpose(0, 1)  # [H, N, d]
            packed = torch.zeros(heads, n, n)
            bounds = kw["cu_seqlens"].tolist()
            for start, end in zip(bounds[:-1], bounds[1:]):
                logits = q[:, start:end] @ k[:, start:end].transpose(-2, -1) * block.attn.scaling
                packed[:, start:end, start:end] = logits.softmax(dim=-1)
            attn = torch.zeros(heads, n, n)
            attn[:, order[:, None], order[None, :]] = packed
            attentions.append(attn)
    for hook in hooks:
        hook.remove()
    features = torch.zeros_like(merged_in[0])
    features[order] = merged_in[0]
    deepstack = [f[0] for f in getattr(out, "deepstack_features", None) or []]
    return dict(attentions=torch.stack(attentions), features=features, embeddings=out.pooler_output[0], grid=grid, deepstack=deepstack)


def _ours(tower: torch.nn.Module, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """vitviz's tower on `images`: (attention [L, H, N, N], tokens after the last block [N, D], each block's output)."""
    layers: list[torch.Tensor] = []
    with torch.no_grad(), vitviz.record_attention(tower) as rec:
        tokens = tower.encode(images, layers=layers)
    return rec.attentions[:, 0], tokens[0], [x[0] for x in layers]


# ----------------------------------------------------------------------------- Qwen2.5-VL


@pytest.mark.parametrize("size", [(112, 168), (84, 140), (56, 56)])
def test_qwen25_attention_features_and_merger_equal_hugging_face(qwen25_vlm, size):
    """8x12 patches (windows of 4x4 patches, whole), 6x10 (windows at the bottom and right edges
    partial) and 4x4 (one window): every block's attention, the features before the merger and the
    image embeddings."""
    tower = vitviz.from_transformers(qwen25_vlm)
    torch.manual_seed(1)
    images = torch.randn(1, 3, *size)
    ref = _reference(qwen25_vlm, images, 14)
    attn, tokens, _ = _ours(tower, images)
    assert attn.shape == ref["attentions"].shape
    torch.testing.assert_close(attn, ref["attentions"], **TOL)
    torch.testing.assert_close(tokens, ref["features"], **TOL)
    with torch.no_grad():
        merged = tower.merge(tower.encode(images), ref["grid"])[0]
        fused = tower.encode(images)[0]  # nobody observing: the fused path with its boolean window mask
    torch.testing.assert_close(merged, ref["embeddings"], **TOL)
    torch.testing.assert_close(fused, ref["features"], **TOL)


def test_qwen25_windowed_blocks_attend_within_their_windows_only(qwen25_vlm):
    """Blocks 0 and 2 (not in fullatt_block_indexes) give exactly 0 outside each query's window of
    4x4 patches (56 px), the windows at the edges smaller; blocks 1 and 3 attend globally."""
    tower = vitviz.from_transformers(qwen25_vlm)
    c = tower.config
    assert (c.attn_window, c.global_blocks) == (4, (1, 3))
    images = torch.randn(1, 3, 84, 140)  # a 6 x 10 grid: windows of 4x4, 4x2, 2x4, 2x2
    attn, _, _ = _ours(tower, images)
    inside = window_mask((6, 10), 4)
    assert inside.sum(dim=1).tolist()[:10] == [16] * 8 + [8] * 2
    for layer in (0, 2):
        assert torch.all(attn[layer][:, ~inside] == 0)
        torch.testing.assert_close(attn[layer].sum(-1), torch.ones(2, 60))
    for layer in (1, 3):
        assert torch.all(attn[layer] > 0)


def test_qwen25_tower_config_and_info(qwen25_vlm):
    """The tower of the whole model, of `Qwen2_5_VLModel` and of the vision model itself: the same
    config, no classifier, no prefix, its `tower_info`, the merger's spec and preprocessing."""
    towers = [vitviz.from_transformers(m) for m in (qwen25_vlm, qwen25_vlm.model, qwen25_vlm.model.visual)]
    for tower in towers:
        c = tower.config
        assert (c.num_classes, c.num_prefix_tokens, c.final_norm, c.norm, c.mlp, c.act, c.rope, c.rope_pairs) == (
            0, 0, False, "rmsnorm", "gated", "silu", "axial", "half")
        assert tower.tower_info == TowerInfo(family="qwen2_5_vl", feature_layer=3, final_norm=False, drop_prefix=True, merge=2)
        assert tower.spec.preprocessing.image_size % 28 == 0 and tower.spec.num_classes == 0
        assert tower.spec.preprocessing.mean == pytest.approx((0.48145466, 0.4578275, 0.40821073))
    x = torch.randn(1, 3, 56, 84)
    with torch.no_grad():
        outs = [t.encode(x) for t in towers]
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    torch.testing.assert_close(outs[0], outs[2], atol=0, rtol=0)


def test_qwen25_through_hf_folder(qwen25_vlm, tmp_path):
    """load_model("hf:<repo>", weights_path=<folder saved with save_pretrained>): the same tower,
    without the hub."""
    qwen25_vlm.save_pretrained(tmp_path)
    model = vitviz.load_model("hf:qwen/tiny-qwen25-vl", weights_path=tmp_path, device="cpu")
    assert model.spec.name == "hf:qwen/tiny-qwen25-vl" and model.spec.num_classes == 0
    assert model.tower_info.family == "qwen2_5_vl" and model.tower_info.merge == 2
    images = torch.randn(1, 3, 112, 168)
    ref = _reference(qwen25_vlm, images, 14)
    attn, tokens, _ = _ours(model, images)
    torch.testing.assert_close(attn, ref["attentions"], **TOL)
    torch.testing.assert_close(tokens, ref["features"], **TOL)
    with torch.no_grad():
        torch.testing.assert_close(model.merge(model.encode(images), ref["grid"])[0], ref["embeddings"], **TOL)
    sized = vitviz.load_model("hf:qwen/tiny-qwen25-vl@112", weights_path=tmp_path, device="cpu")
    assert sized.spec.preprocessing.image_size == 112


def test_qwen25_sharded_folder_with_its_processor(qwen25_vlm, tmp_path):
    """A checkpoint in shards (model.safetensors.index.json) with its image processor: the vision
    model's shards read, the processor's mean and std kept; a shard missing is said."""
    qwen25_vlm.save_pretrained(tmp_path, max_shard_size="40KB")
    transformers.Qwen2VLImageProcessor(image_mean=[0.25, 0.5, 0.75], image_std=[0.5, 0.5, 0.5]).save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model = vitviz.load_model("hf:qwen/tiny-qwen25-vl", weights_path=tmp_path, device="cpu")
    assert model.spec.preprocessing.mean == (0.25, 0.5, 0.75) and model.spec.preprocessing.interpolation == "bicubic"
    reference = vitviz.from_transformers(qwen25_vlm)
    x = torch.randn(1, 3, 56, 84)
    with torch.no_grad():
        torch.testing.assert_close(model.encode(x), reference.encode(x), atol=0, rtol=0)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    vision = {f for k, f in weight_map.items() if k.startswith(("visual.", "model.visual."))}
    (tmp_path / next(f for f in sorted(weight_map.values()) if f not in vision)).unlink()  # the language model's alone: not read
    vitviz.load_model("hf:qwen/tiny-qwen25-vl", weights_path=tmp_path, device="cpu")
    (tmp_path / sorted(vision)[0]).unlink()
    with pytest.raises(FileNotFoundError, match="not in"):
        vitviz.load_model("hf:qwen/tiny-qwen25-vl", weights_path=tmp_path, device="cpu")


@pytest.mark.slow
def test_qwen25_reads_the_hub_cache_offline(qwen25_vlm, tmp_path):
    """A sharded repository in a Hugging Face cache: "cached", and load_model("hf:...") reads the
    vision model's shards there with HF_HUB_OFFLINE=1, in a fresh interpreter."""
    repo = "vitviz-test/tiny-qwen25-vl"
    snap = write_hub_cache(tmp_path / "hf" / "hub", repo, {})
    qwen25_vlm.save_pretrained(snap, max_shard_size="40KB")
    x = torch.randn(1, 3, 56, 84)
    torch.save(x, tmp_path / "x.pt")
    with torch.no_grad():
        torch.save(vitviz.from_transformers(qwen25_vlm).encode(x), tmp_path / "want.pt")
    code = f"""
import torch, vitviz
assert vitviz.weights_status("hf:{repo}") == "cached"
m = vitviz.load_model("hf:{repo}", device="cpu")
with torch.no_grad():
    got = m.encode(torch.load({str(tmp_path / "x.pt")!r}))
print((got - torch.load({str(tmp_path / "want.pt")!r})).abs().max().item(), m.tower_info.family)
"""
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    diff, family = out.stdout.split()
    assert float(diff) == 0 and family == "qwen2_5_vl"


def test_qwen25_analyze(qwen25_vlm):
    """`vitviz.analyze` on the tower: its attention stack, rollout and distances."""
    tower = vitviz.from_transformers(qwen25_vlm)
    tower.spec = tower.spec.at(112)
    image = Image.new("RGB", (150, 100), (120, 40, 200))
    result = vitviz.analyze(tower, image)
    assert result.attentions.shape == (4, 2, 64, 64)
    rollout = result.rollout()
    assert rollout.shape == (64, 64) and torch.isfinite(rollout).all()
    torch.testing.assert_close(rollout.sum(-1), torch.ones(64))
    distances = result.distances()
    assert distances.shape == (4, 2) and torch.isfinite(distances).all()


# ----------------------------------------------------------------------------- windows, in general


def test_window_mask_partition():
    """Windows cut from the top-left corner, the last ones smaller."""
    mask = window_mask((3, 5), 2)
    cells = [[0, 0, 1, 1, 2], [0, 0, 1, 1, 2], [3, 3, 4, 4, 5]]
    flat = torch.tensor(cells).flatten()
    assert torch.equal(mask, flat[:, None] == flat[None, :])


def test_window_config_is_checked():
    base = dict(image_size=32, patch_size=8, width=16, depth=2, heads=2, mlp_dim=32, num_classes=0, class_token=False, pool="avg")
    assert ViTConfig(**base).attn_window is None
    assert ViTConfig(**base, attn_window=2, global_blocks=[1]).global_blocks == (1,)
    with pytest.raises(ValueError, match="prefix"):
        ViTConfig(**{**base, "class_token": True, "pool": "token"}, attn_window=2)
    with pytest.raises(ValueError, match="global_blocks"):
        ViTConfig(**base, global_blocks=(0,))
    with pytest.raises(ValueError, match="within"):
        ViTConfig(**base, attn_window=2, global_blocks=(2,))
    with pytest.raises(ValueError, match="attn_window"):
        ViTConfig(**base, attn_window=0)


def test_windowed_vit_paths_agree():
    """A windowed ViT without rotary positions: the fused and explicit paths give the same output, and
    a window as large as the grid is global attention."""
    base = dict(image_size=32, patch_size=8, width=16, depth=2, heads=2, mlp_dim=32, num_classes=0, class_token=False, pool="avg")
    windowed = vitviz.ViT(ViTConfig(**base, attn_window=2)).eval()
    x = torch.randn(2, 3, 32, 40)
    with torch.no_grad():
        fused = windowed.encode(x)
        with vitviz.record_attention(windowed) as rec:
            explicit = windowed.encode(x)
    torch.testing.assert_close(fused, explicit, **TOL)
    assert torch.all(rec.attentions[:, :, :, ~window_mask((4, 5), 2)] == 0)
    whole = vitviz.ViT(ViTConfig(**base, attn_window=5)).eval()
    plain = vitviz.ViT(ViTConfig(**base)).eval()
    plain.load_state_dict(whole.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(whole.encode(x), plain.encode(x), atol=0, rtol=0)


# ----------------------------------------------------------------------------- Qwen3-VL


@pytest.mark.parametrize("size", [(128, 192), (64, 96), (96, 96)])
def test_qwen3_attention_features_merger_and_deepstack_equal_hugging_face(qwen3_vlm, size):
    """A 6x6 table of positions resampled to 8x12 (up), 4x6 (down and its own width) and 6x6 (itself):
    every block's attention, the features, the image embeddings and the deepstack features."""
    tower = vitviz.from_transformers(qwen3_vlm)
    assert tower.tower_info == TowerInfo(family="qwen3_vl", feature_layer=3, final_norm=False, drop_prefix=True, merge=2)
    assert tower.config.attn_window is None and tower.config.image_size == 96 and tower.deepstack_layers == (1, 2)
    torch.manual_seed(1)
    images = torch.randn(1, 3, *size)
    ref = _reference(qwen3_vlm, images, 16)
    attn, tokens, layers = _ours(tower, images)
    torch.testing.assert_close(attn, ref["attentions"], **TOL)
    torch.testing.assert_close(tokens, ref["features"], **TOL)
    with torch.no_grad():
        torch.testing.assert_close(tower.merge(tokens[None], ref["grid"])[0], ref["embeddings"], **TOL)
        for j, layer in enumerate(tower.deepstack_layers):
            torch.testing.assert_close(tower.merge(layers[layer][None], ref["grid"], layer=layer)[0], ref["deepstack"][j], **TOL)


def test_qwen3_through_hf_folder(qwen3_vlm, tmp_path):
    qwen3_vlm.save_pretrained(tmp_path)
    model = vitviz.load_model("hf:qwen/tiny-qwen3-vl", weights_path=tmp_path, device="cpu")
    assert model.tower_info.family == "qwen3_vl" and model.spec.preprocessing.mean == (0.5, 0.5, 0.5)
    images = torch.randn(1, 3, 64, 96)
    ref = _reference(qwen3_vlm, images, 16)
    _, tokens, _ = _ours(model, images)
    torch.testing.assert_close(tokens, ref["features"], **TOL)
    with torch.no_grad():
        torch.testing.assert_close(model.merge(tokens[None], ref["grid"])[0], ref["embeddings"], **TOL)


def test_the_explorer_is_told_each_blocks_window(qwen25_vlm, tmp_path):
    """The explorer's value of a tower analysis: each block's window side in patches (0 for the blocks
    that attend globally), which the page outlines around the query; a model without windows all 0."""
    from vitviz.server.models import ModelFacts
    from vitviz.server.pictures import explorer_data, views

    tower = vitviz.from_transformers(qwen25_vlm)
    tower.spec = tower.spec.at(112)
    exp = views.Exploration(vitviz.analyze(tower, Image.new("RGB", (112, 112), (120, 40, 200))), ModelFacts.of(tower))
    value = explorer_data.write_payload(exp, key="k", folder=tmp_path)
    c = tower.config
    side = c.attn_window
    assert side and value["windows"] == [0 if layer in c.global_blocks else side for layer in range(c.depth)]
    assert 0 in value["windows"] and side in value["windows"]
    plain = ViTConfig(image_size=32, patch_size=8, width=16, depth=2, heads=2, mlp_dim=32)
    assert explorer_data.windows_of(plain, 2) == [0, 0]
