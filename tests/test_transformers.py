"""Hugging Face ViT, DINOv2, DINOv2-with-registers and DINOv3 through vitviz: the same outputs and
the same attention as transformers' own forward (small random configs), and the hub cache path,
offline."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import write_hub_cache

import vitviz

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
SMALL = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=48, patch_size=8)


def _randomise(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter away from its init (LayerScale 1, biases 0), so a dropped one shows."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "lambda1" in name or name.endswith("layernorm.weight"):  # (AIMv2's rms_norm too)
                p.normal_(1.0, 0.2) if name.endswith(("weight", "lambda1")) else p.normal_(0, 0.2)
            else:
                p.normal_(0, 0.05)
    return model.eval()


def _models():
    t = transformers
    return {
        "vit-classifier": t.ViTForImageClassification(t.ViTConfig(**SMALL, intermediate_size=128, num_labels=7, attn_implementation="eager")),
        "vit": t.ViTModel(t.ViTConfig(**SMALL, intermediate_size=128, attn_implementation="eager"), add_pooling_layer=False),
        "dinov2": t.Dinov2Model(t.Dinov2Config(**SMALL, mlp_ratio=2, attn_implementation="eager")),
        "dinov2-registers": t.Dinov2WithRegistersModel(
            t.Dinov2WithRegistersConfig(**SMALL, mlp_ratio=2, num_register_tokens=4, attn_implementation="eager")
        ),
        # DINOv3: rotary positions, no table, 4 registers, key without a bias; the larger ones gate their MLP with SiLU
        "dinov3": t.DINOv3ViTModel(t.DINOv3ViTConfig(**SMALL, intermediate_size=128, num_register_tokens=4, attn_implementation="eager")),
        "dinov3-gated": t.DINOv3ViTModel(t.DINOv3ViTConfig(**SMALL, intermediate_size=96, num_register_tokens=4, use_gated_mlp=True,
                                                           hidden_act="silu", attn_implementation="eager")),
        # AIMv2: no cls token, RMSNorm everywhere (one after the patch embedding), SwiGLU, a pool whose query is a parameter
        "aimv2": t.Aimv2VisionModel(t.Aimv2VisionConfig(**SMALL, intermediate_size=96, attn_implementation="eager")),
    }


def _relative(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("kind", ["vit-classifier", "vit", "dinov2", "dinov2-registers", "dinov3", "dinov3-gated", "aimv2"])
def test_from_transformers_gives_the_same_outputs_and_attention(kind):
    model = _randomise(_models()[kind])
    ours = vitviz.ViT.from_transformers(model)
    x = torch.randn(2, 3, 48, 48)
    with torch.inference_mode():
        out = model(pixel_values=x, output_attentions=True, output_hidden_states=True)
        with vitviz.record_attention(ours) as rec:
            tokens = ours.encode(x)
            logits = ours.head_logits(tokens)
    hidden = getattr(out, "last_hidden_state", None)
    if hidden is None:  # the classifier: its logits, and the backbone's tokens through its own forward
        assert _relative(logits, out.logits) < 1e-4
        with torch.inference_mode():
            hidden = model.vit(pixel_values=x).last_hidden_state
    assert _relative(tokens, hidden) < 1e-4
    attn = torch.stack(out.attentions)  # [L, B, H, N, N], transformers' softmax (eager)
    torch.testing.assert_close(rec.attentions, attn, atol=1e-5, rtol=0)
    spec = ours.spec
    prefix = {"dinov2-registers": 5, "dinov3": 5, "dinov3-gated": 5, "aimv2": 0}.get(kind, 1)
    assert spec.num_prefix_tokens == prefix and rec.attentions.shape[-1] == prefix + 36
    if kind == "aimv2":  # its pooled output: the attention pool's
        with torch.inference_mode():
            assert _relative(ours.forward_features(x), out.pooler_output) < 1e-4
    assert (spec.categories is not None) == (kind == "vit-classifier")
    if kind == "vit-classifier":
        assert spec.categories == tuple(f"LABEL_{i}" for i in range(7))


@pytest.mark.parametrize("kind", ["vit", "dinov2", "dinov2-registers", "dinov3"])
def test_other_image_sizes_match_transformers_interpolation(kind):
    """transformers resamples position embeddings bicubically, antialiased for DINOv2 with registers
    only; vitviz does the same for each. DINOv3's rotary positions take any grid, 2:1 included."""
    model = _randomise(_models()[kind])
    ours = vitviz.ViT.from_transformers(model)
    for side in (80, 32, (48, 96)):  # a larger and a smaller grid (and for DINOv3, one twice as wide as high)
        if isinstance(side, tuple) and kind != "dinov3":
            continue
        x = torch.randn(1, 3, *(side if isinstance(side, tuple) else (side, side)))
        extra = {"interpolate_pos_encoding": True} if kind == "vit" else {}
        with torch.inference_mode():
            want = model(pixel_values=x, **extra).last_hidden_state
            assert _relative(ours.encode(x), want) < 1e-4


def test_preprocessing_follows_the_image_processor():
    vit = transformers.ViTImageProcessor(size={"height": 224, "width": 224}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    pre = vitviz.sources.hf.preprocessing_from_processor(vit, 224)
    assert (pre.mode, pre.image_size, pre.mean, pre.interpolation) == ("squash", 224, (0.5, 0.5, 0.5), "bilinear")
    bit = transformers.BitImageProcessor(size={"shortest_edge": 256}, crop_size={"height": 224, "width": 224}, resample=3,
                                         image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
    pre = vitviz.sources.hf.preprocessing_from_processor(bit.to_dict(), 224)
    assert (pre.mode, pre.image_size, pre.resize_size, pre.interpolation) == ("crop", 224, 256, "bicubic")
    # and the pixels agree with the processor's own output
    import numpy as np
    from PIL import Image

    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (300, 411, 3), dtype=np.uint8))
    for processor in (vit, bit):
        pre = vitviz.sources.hf.preprocessing_from_processor(processor, 224)
        ours, _ = vitviz.preprocess(img, pre)
        theirs = torch.as_tensor(processor(images=img, return_tensors="pt")["pixel_values"][0])
        assert (ours - theirs).abs().mean() < 0.02  # PIL's and the processor's resampling differ by rounding


NOT_REPO_IDS = ["hf:/etc/passwd", "hf:/etc", "hf:../../etc", "hf:./mymodel", "hf:~/x", "hf:C:\\x", "hf:/no/such/folder", "hf:",
                "hf:a/b/c", "hf:-name", "hf:name-", "hf:.name", "hf:org/a--b", "hf:org/a..b", "hf:" + "a" * 97, "hf:org/a b",
                "hf:org/name@96@96", "hf:/etc@224"]


def test_hf_takes_repository_ids_only_checked_before_anything_is_fetched_or_opened(monkeypatch, tmp_path):
    def never(*args, **kwargs):
        raise AssertionError("the hub or the disk was asked")

    source = vitviz.sources.hf
    for name in ("_config", "_processor", "status", "load"):
        monkeypatch.setattr(source.HuggingFaceSource, name, never)
    monkeypatch.setattr(source, "cached_file", never)
    monkeypatch.setattr(source, "hub_reachable", never)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", never)
    (tmp_path / "mymodel").mkdir()
    messages = set()
    for name in [*NOT_REPO_IDS, f"hf:{tmp_path / 'mymodel'}"]:
        for ask in (vitviz.get_spec, lambda n: vitviz.load_model(n, device="cpu"),
                    lambda n: vitviz.load_model(n, device="cpu", weights_path=tmp_path / "mymodel")):
            with pytest.raises(ValueError) as info:
                ask(name)
            messages.add(str(info.value))
    assert len(messages) == 1  # the same whether the path exists or not
    message = messages.pop()
    assert message.startswith("hf:<repo id> takes a Hugging Face repository id such as google/vit-base-patch16-224")
    assert "weights_path=<folder>" in message and "/etc" not in message and str(tmp_path) not in message
    for size in ("@0", "@-16", "@abc", "@", "@16.5", "@ 96"):
        with pytest.raises(ValueError, match="after @ comes the side of the images .* a whole number of pixels above 0"):
            vitviz.get_spec(f"hf:google/vit-base-patch16-224{size}")
    split = source._split
    assert split("hf:google/vit-base-patch16-224@384") == ("google/vit-base-patch16-224", 384)
    assert split("hf:" + "a" * 96) == ("a" * 96, None) and split("hf:_org.x/model_v1.5") == ("_org.x/model_v1.5", None)


def test_dinov2_classifiers_and_other_models_are_refused_clearly():
    t = transformers
    with pytest.raises(NotImplementedError, match="backbone"):
        vitviz.ViT.from_transformers(t.Dinov2ForImageClassification(t.Dinov2Config(**SMALL, num_labels=3)))
    with pytest.raises(NotImplementedError, match="AIMv2's native-resolution model"):
        vitviz.ViT.from_transformers(t.Aimv2VisionModel(t.Aimv2VisionConfig(**SMALL, intermediate_size=96, is_native=True)))
    aimv2 = vitviz.ViT.from_transformers(_models()["aimv2"])
    rows = vitviz.summary(aimv2).rows
    assert any(r.stage.endswith("then an output projection") for r in rows)
    assert sum(r.params for r in rows) == sum(p.numel() for p in aimv2.parameters()) == aimv2.config.num_params
    with pytest.raises(TypeError, match="model_type 'bert'"):
        vitviz.ViT.from_transformers(t.BertModel(t.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dinov2-registers", "dinov3"])
def test_load_model_reads_the_hub_cache_offline(tmp_path, kind):
    """A repository saved with save_pretrained into a Hugging Face cache: load_model("hf:...") finds
    the weights and the image processor there, with HF_HUB_OFFLINE=1, in a fresh interpreter; and
    weights_path= loads a folder saved on disk under that repository's name."""
    model = _randomise(_models()[kind])
    repo = f"vitviz-test/tiny-{kind}"
    snap = write_hub_cache(tmp_path / "hf" / "hub", repo, {})
    model.save_pretrained(snap)
    transformers.BitImageProcessor(size={"shortest_edge": 56}, crop_size={"height": 48, "width": 48}, resample=3).save_pretrained(snap)
    other = _randomise(_models()[kind])  # other weights, saved on disk outside the cache
    with torch.no_grad():
        other.embeddings.cls_token.add_(1.0)
    other.save_pretrained(tmp_path / "saved")
    x = torch.randn(1, 3, 48, 48)
    torch.save(x, tmp_path / "x.pt")
    with torch.inference_mode():
        torch.save(model(pixel_values=x).last_hidden_state, tmp_path / "want.pt")
        torch.save(other(pixel_values=x).last_hidden_state, tmp_path / "saved.pt")
    code = f"""
import torch, vitviz
assert vitviz.weights_status("hf:{repo}") == "cached"
m = vitviz.load_model("hf:{repo}", device="cpu")
with torch.inference_mode():
    got = m.encode(torch.load({str(tmp_path / "x.pt")!r}))
want = torch.load({str(tmp_path / "want.pt")!r})
pre = m.spec.preprocessing
print(((got - want).abs().max() / want.abs().max()).item(), m.spec.prefix_names[-1], pre.resize_size, pre.interpolation)
saved = vitviz.load_model("hf:{repo}", device="cpu", weights_path={str(tmp_path / "saved")!r})
with torch.inference_mode():
    got = saved.encode(torch.load({str(tmp_path / "x.pt")!r}))
want = torch.load({str(tmp_path / "saved.pt")!r})
assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4, "weights_path"
try:
    vitviz.load_model("hf:vitviz-test/not-there", device="cpu")
except vitviz.WeightsUnavailableError as exc:
    print("UNAVAILABLE", exc)
"""
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    first, rest = out.stdout.split("\n", 1)
    rel, last_prefix, resize, interpolation = first.split()
    assert float(rel) < 1e-4 and last_prefix == "reg4" and resize == "56" and interpolation == "bicubic"
    assert "UNAVAILABLE" in rest and "hf download vitviz-test/not-there" in rest


def _never_the_hub(monkeypatch):
    """vitviz's Hugging Face source may ask neither the hub nor its cache."""
    def never(*args, **kwargs):
        raise AssertionError("the hub or its cache was asked")

    source = vitviz.sources.hf
    for name in ("cached_file", "hub_reachable"):
        monkeypatch.setattr(source, name, never)
    monkeypatch.setattr(source.HuggingFaceSource, "_config", never)
    monkeypatch.setattr(source.HuggingFaceSource, "_processor", staticmethod(never))


@pytest.mark.parametrize("offline_flag", [True, False], ids=["HF_HUB_OFFLINE", "no-network"])
@pytest.mark.parametrize("hub_config_cached", [False, True], ids=["no-cache", "hub-config-cached"])
def test_a_saved_folder_loads_offline_with_its_own_preprocessing_and_labels(
    no_network, monkeypatch, tmp_path, offline_flag, hub_config_cached
):
    """weights_path=<folder>: config, image processor (mean and std 0.5, 64 px) and labels come from
    the folder alone, also where the hub cache holds another model under the same repo id; the repo
    id is only a name, and a path is never one."""
    t = transformers
    repo = "me/myvit"
    labels = {0: "cat", 1: "dog", 2: "bird"}
    config = t.ViTConfig(**{**SMALL, "image_size": 64}, intermediate_size=128, id2label=labels,
                         label2id={v: k for k, v in labels.items()}, attn_implementation="eager")
    model = _randomise(t.ViTForImageClassification(config))
    folder = tmp_path / "myvit"
    model.save_pretrained(folder)
    processor = t.ViTImageProcessor(size={"height": 64, "width": 64}, image_mean=[0.5] * 3, image_std=[0.5] * 3, resample=3)
    processor.save_pretrained(folder)
    if hub_config_cached:  # the hub's model of that name: 48 px, 7 other labels, ImageNet's mean and std
        snap = write_hub_cache(no_network, repo, {})
        _models()["vit-classifier"].save_pretrained(snap)
        t.BitImageProcessor(size={"shortest_edge": 56}, crop_size={"height": 48, "width": 48}, image_mean=[0.485, 0.456, 0.406],
                            image_std=[0.229, 0.224, 0.225]).save_pretrained(snap)
    if not offline_flag:
        from huggingface_hub import constants

        monkeypatch.delenv("HF_HUB_OFFLINE")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for name in (f"hf:{folder}", "hf:../myvit", "hf:./myvit", f"hf:{folder}@64"):
        with pytest.raises(ValueError, match=r"^hf:<repo id> takes a Hugging Face repository id"):
            vitviz.load_model(name, device="cpu", weights_path=folder)
    _never_the_hub(monkeypatch)
    ours = vitviz.load_model(f"hf:{repo}", device="cpu", weights_path=folder)
    spec = ours.spec
    assert spec.name == f"hf:{repo}" and spec.categories == ("cat", "dog", "bird") and spec.locator == str(folder)
    pre = spec.preprocessing
    assert (pre.mode, pre.image_size, pre.mean, pre.std, pre.interpolation) == ("squash", 64, (0.5,) * 3, (0.5,) * 3, "bicubic")
    assert vitviz.sources.source_of(spec).status(spec) == "cached" and "myvit" in spec.description
    x = torch.randn(2, 3, 64, 64)
    with torch.inference_mode():
        assert _relative(ours(x), model(pixel_values=x).logits) < 1e-4
    import numpy as np
    from PIL import Image

    img = Image.fromarray(np.random.default_rng(1).integers(0, 256, (90, 120, 3), dtype=np.uint8))
    theirs = torch.as_tensor(processor(images=img, return_tensors="pt")["pixel_values"][0])
    assert (vitviz.preprocess(img, pre)[0] - theirs).abs().mean() < 0.02
    at96 = vitviz.load_model(f"hf:{repo}@96", device="cpu", weights_path=folder)
    assert at96.spec.image_size == 96 and at96.spec.mean == (0.5,) * 3 and at96.spec.categories == spec.categories


def test_a_folder_that_is_not_a_saved_model_is_refused_clearly(no_network, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="a folder saved with save_pretrained .* has no config.json"):
        vitviz.load_model("hf:me/myvit", device="cpu", weights_path=tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        vitviz.load_model("hf:me/myvit", device="cpu", weights_path=tmp_path / "missing")
