"""Swin Transformer V2 (Liu et al. 2022): the same logits and every block's window softmax as timm's
`SwinTransformerV2` (windows of 8 and 16, a window pretrained at 12 and run at 16) and Hugging
Face's `Swinv2Model` / `Swinv2ForImageClassification`; the continuous position bias's coordinates
by hand; what is not modelled refused before a weight is read; the analysis of one image."""

import math

import numpy as np
import pytest
import torch
from conftest import random_timm, write_hub_cache
from test_swin import _hf_run, _randomise, _relative, _run, _timm_windows

import vitviz
from vitviz.sources.swin import swin_config_from_transformers
from vitviz.swin import LOGIT_SCALE_MAX, Swin, SwinConfig, log_spaced_coordinates
from vitviz.swin_analysis import SwinAnalysis, swin_summary_rows

SMALL = dict(depths=(2, 2, 2, 2), embed_dim=32, num_heads=(1, 2, 4, 8))  # the registered windows and sizes, two narrow blocks a stage


@pytest.fixture(autouse=True)
def _one_thread():
    """These models are small: one thread runs them faster than a pool of threads does."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _scales_on_both_sides_of_the_clamp(model: torch.nn.Module) -> bool:
    scales = torch.cat([p.detach().flatten() for n, p in model.named_parameters() if n.endswith("logit_scale")])
    return bool((scales > LOGIT_SCALE_MAX).any() and (scales < LOGIT_SCALE_MAX).any())


@pytest.mark.parametrize("name, windows, pretrained, shifting", [
    # 256 px, P 4: stage grids 64, 32, 16, 8; a stage whose grid is no larger than the window has one window, not shifted
    ("swinv2_tiny_window8_256", (8, 8, 8, 8), (0, 0, 0, 0), 3),
    ("swinv2_tiny_window16_256", (16, 16, 16, 8), (0, 0, 0, 0), 2),
    # trained with windows of 12 (6 in the last stage) at 192 px, fine-tuned with 16 at 256: its offsets are scaled by 12 - 1
    ("swinv2_base_window12to16_192to256", (16, 16, 16, 8), (12, 12, 12, 6), 2),
])
def test_from_timm_gives_timms_logits_and_every_window_softmax(name, windows, pretrained, shifting):
    torch.manual_seed(0)
    model = random_timm(name, **SMALL)
    assert _scales_on_both_sides_of_the_clamp(model)
    ours = vitviz.from_timm(model)
    c = ours.config
    assert isinstance(ours, Swin) and c.version == 2 and ours.spec.name == f"timm:{name}"
    assert tuple(w for w, _ in c.stage_windows()) == tuple((m, m) for m in windows) and c.pretrained_window_size == pretrained
    assert c.num_params == sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in model.parameters())
    size = model.pretrained_cfg["input_size"][-1]
    assert size == c.image_size == 256
    x = torch.randn(2, 3, size, size)
    with torch.inference_mode():
        want = model(x)
        with vitviz.record_attention(ours) as rec:
            got = ours(x)
        fused = ours(x)  # nobody records: the fused path
    assert want.abs().max() > 1e-1 and _relative(got, want) < 1e-4
    assert _relative(fused, got) < 1e-5
    theirs = _timm_windows(model, x)
    geometries = ours.geometries(size, size)
    assert len(theirs) == len(rec.calls[-1]) == 8
    for mine, timms, g, block, timm_block in zip(rec.calls[-1], theirs, geometries, ours.blocks,
                                                 [b for stage in model.layers for b in stage.blocks]):
        assert mine.shape == timms.shape == (2 * g.num_windows, mine.shape[1], g.area, g.area)
        torch.testing.assert_close(mine, timms, atol=1e-5, rtol=0)
        torch.testing.assert_close(mine.sum(-1), torch.ones(mine.shape[:-1]), atol=1e-5, rtol=0)
        # the continuous bias's input: timm's own coordinates of the (shrunk) window, scaled by the pretrained one
        assert torch.equal(block.attn.relative_coords_table, timm_block.attn.relative_coords_table.reshape(-1, 2))
    assert [g.shifted for g in geometries] == [False, True] * shifting + [False, False] * (4 - shifting)


def test_the_coordinates_of_the_continuous_bias_by_hand():
    """A 3 x 3 window: offsets -2..2, divided by M - 1 = 2 and times 8: -8, -4, 0, 4, 8, then
    sign(t) log2(1 + |t|) / 3: ±log2(9)/3, ±log2(5)/3, 0. Pretrained at 5: divided by 4 instead."""
    table = log_spaced_coordinates((3, 3))
    assert table.shape == (25, 2)
    big, small = math.log2(9) / 3, math.log2(5) / 3
    row = (-2 + 2) * 5 + (1 + 2)  # the offset (dy, dx) = (-2, 1): `relative_position_index`'s row
    torch.testing.assert_close(table[row], torch.tensor([-big, small]))
    torch.testing.assert_close(table[12], torch.zeros(2))  # (0, 0)
    pretrained = log_spaced_coordinates((3, 3), (5, 5))
    torch.testing.assert_close(pretrained[row], torch.tensor([-small, math.log2(3) / 3]))
    assert table.abs().max() <= 1.06 and log_spaced_coordinates((16, 16), (12, 12)).abs().max() > 1.1  # beyond 1 past the pretrained window


def test_a_v2_config_counts_its_parameters_and_v1_takes_no_pretrained_window():
    config = SwinConfig(image_size=64, embed_dim=16, depths=(2, 2), num_heads=(2, 4), window_size=4, num_classes=5, version=2,
                        pretrained_window_size=(6, 3))
    model = Swin(config)
    assert config.num_params == sum(p.numel() for p in model.parameters())
    assert model.stages[1].merge.norm.normalized_shape == (32,)  # the merge normalises after the reduction, over 2C
    no_bias = Swin(SwinConfig(image_size=32, embed_dim=8, depths=(1,), num_heads=(2,), window_size=4, qkv_bias=False, version=2))
    assert no_bias.config.num_params == sum(p.numel() for p in no_bias.parameters()) and no_bias.blocks[0].attn.q_bias is None
    with pytest.raises(ValueError, match="Swin V2's"):
        SwinConfig(version=1, pretrained_window_size=12)
    with pytest.raises(ValueError, match="version must be 1 or 2"):
        SwinConfig(version=3)


# ---------------------------------------------------------------------------------------------
# Hugging Face


def _hf_swinv2(kind: dict, *, classifier: bool):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Swinv2Config(patch_size=4, num_labels=5, attn_implementation="eager", **kind)
    model = _randomise(transformers.Swinv2ForImageClassification(cfg) if classifier else transformers.Swinv2Model(cfg))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("logit_scale"):
                p.uniform_(math.log(2), math.log(200))
    return model


@pytest.mark.parametrize("kind", ["classifier-shifted", "classifier-padded", "features-pretrained"])
def test_from_transformers_gives_the_same_logits_and_window_softmax(kind):
    shape = {
        "classifier-shifted": dict(image_size=64, embed_dim=16, depths=[2, 2, 2], num_heads=[2, 4, 8], window_size=4),
        "classifier-padded": dict(image_size=40, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4),  # grids 10, 5
        "features-pretrained": dict(image_size=64, embed_dim=16, depths=[2, 2, 2], num_heads=[2, 4, 8], window_size=8,
                                    pretrained_window_sizes=[4, 4, 2]),
    }[kind]
    model = _hf_swinv2(shape, classifier=kind.startswith("classifier"))
    assert _scales_on_both_sides_of_the_clamp(model)
    ours = vitviz.from_transformers(model)
    assert isinstance(ours, Swin) and ours.config.version == 2 and ours.config.pad_before_shift and ours.config.mask_value == -200
    assert "Swin V2" in ours.spec.description
    size = shape["image_size"]
    x = torch.randn(2, 3, size, size)
    out, got, rec, caught = _hf_run(model, ours, x, "Swinv2SelfAttention")
    want = out.pooler_output if kind.startswith("features") else out.logits
    assert _relative(got, want) < 1e-4
    assert len(caught) == len(rec.calls[-1]) == sum(shape["depths"])
    for a, b in zip(rec.calls[-1], caught):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_what_is_not_modelled_is_refused_before_a_weight_is_read():
    timm = pytest.importorskip("timm")
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):  # no weight exists to be read
        cr = timm.create_model("swinv2_cr_tiny_ns_224", pretrained=False, img_size=64, embed_dim=16, depths=(1, 1), num_heads=(1, 2),
                               window_size=4)
        odd = timm.create_model("swinv2_tiny_window8_256", pretrained=False, img_size=64, embed_dim=16, depths=(2, 2, 2), num_heads=(1, 2, 4),
                                window_size=4, always_partition=True)
    with pytest.raises(NotImplementedError, match=r"^timm's SwinTransformerV2Cr \(swinv2_cr_\*\) is not modelled by vitviz: [^.]*$"):
        vitviz.from_timm(cr)
    with pytest.raises(NotImplementedError, match="always_partition=True is not modelled"):
        vitviz.from_timm(odd)
    # 40 px: grids 10, 5, 3; transformers sizes stage 2's window from 5 // 2 = 2, then runs a grid of 3
    cfg = transformers.Swinv2Config(image_size=40, patch_size=4, embed_dim=16, depths=[1, 1, 1], num_heads=[1, 2, 4], window_size=4)
    with pytest.raises(NotImplementedError, match=r"^stage 2: transformers sizes its window \(2, 2\) and shift \(0, 0\) from the grid 2"):
        swin_config_from_transformers(cfg)


# ---------------------------------------------------------------------------------------------
# the analysis of one image, and loading by name


def test_the_swin_analysis_runs_on_a_v2_model_and_its_attention_rows_sum_to_one():
    torch.manual_seed(1)
    model = random_timm("swinv2_tiny_window8_256", img_size=64, embed_dim=16, depths=(2, 2, 2), num_heads=(2, 4, 8), window_size=4,
                        num_classes=5)
    ours = vitviz.from_timm(model)
    image = (np.random.default_rng(0).random((80, 70, 3)) * 255).astype(np.uint8)
    result = vitviz.analyze(ours, image)
    assert isinstance(result, SwinAnalysis) and result.layout.attention == "windowed" and result.num_layers == 6
    assert [g.shifted for g in result.geometries] == [False, True, False, True, False, False]
    for l, (a, block) in enumerate(zip(result.attentions, ours.blocks)):
        torch.testing.assert_close(a.sum(-1), torch.ones(a.shape[:-1]), atol=1e-5, rtol=0)
        bias = result.relative_position_bias(l)  # the continuous bias as it is added: 16 sigmoid(·)
        assert bias.shape == (block.attn.heads, 16, 16) and 0 < bias.min() and bias.max() < 16
        assert result.global_attention(l).shape == (block.attn.heads, *[result.geometries[l].num_tokens] * 2)
    assert result.cls_map().shape == (16, 16) and len(result.predictions(3)) == 3
    for method in ("rollout", "gradient", "attention", "grad_rollout"):
        assert vitviz.explain(ours, image, method=method).map.shape == (16, 16)
    rows = {r[0].strip(): r[1] for r in swin_summary_rows(ours)}
    assert rows["Stage 2: patch merging"] == "2x2 -> 1, Linear 64 -> 32, LayerNorm" and "2 cosine heads" in rows["Stage 1, block 1"]


@pytest.mark.slow
def test_load_model_reads_a_timm_swinv2_from_the_hub_cache_offline(tmp_path, monkeypatch):
    from huggingface_hub import constants
    from safetensors.torch import save

    name = "swinv2_tiny_window8_256"
    torch.manual_seed(2)
    model = random_timm(name)
    root = tmp_path / "hub"
    write_hub_cache(root, f"timm/{name}.ms_in1k", {"model.safetensors": save({k: v.contiguous() for k, v in model.state_dict().items()})})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert vitviz.weights_status(f"timm:{name}") == "cached"
    spec = vitviz.get_spec(f"timm:{name}")
    assert spec.config.version == 2 and spec.config.num_params == sum(p.numel() for p in model.parameters())
    loaded = vitviz.load_model(f"timm:{name}", device="cpu")
    x = torch.randn(1, 3, 256, 256)
    with torch.inference_mode():
        assert isinstance(loaded, Swin) and _relative(loaded(x), model(x)) < 1e-4
    assert loaded.spec.categories[0].startswith("tench") and loaded.spec.preprocessing.image_size == 256


@pytest.mark.slow
def test_load_model_reads_a_hugging_face_swinv2_from_the_hub_cache_offline(tmp_path):
    transformers = pytest.importorskip("transformers")
    shape = dict(image_size=64, embed_dim=16, depths=[2, 2, 2], num_heads=[2, 4, 8], window_size=8, pretrained_window_sizes=[4, 4, 2])
    model = _hf_swinv2(shape, classifier=True)
    repo = "vitviz-test/tiny-swinv2"
    snap = write_hub_cache(tmp_path / "hf" / "hub", repo, {})
    model.save_pretrained(snap)
    transformers.ViTImageProcessor(size={"height": 64, "width": 64}, resample=3).save_pretrained(snap)
    x = torch.randn(1, 3, 64, 64)
    with torch.inference_mode():
        torch.save({"x": x, "want": model(pixel_values=x).logits}, tmp_path / "io.pt")
    code = f"""
import torch, vitviz
io = torch.load({str(tmp_path / "io.pt")!r})
m = vitviz.load_model("hf:{repo}", device="cpu")
with torch.inference_mode():
    got = m(io["x"])
print(type(m).__name__, m.config.version, m.config.pretrained_window_size, ((got - io["want"]).abs().max() / io["want"].abs().max()).item())
"""
    out = _run(code, tmp_path / "hf")
    assert out.returncode == 0, out.stderr[-3000:]
    kind, version, *pretrained, rel = out.stdout.split()
    assert kind == "Swin" and version == "2" and "".join(pretrained) == "(4,4,2)" and float(rel) < 1e-4
