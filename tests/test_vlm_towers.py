"""The vision towers of Hugging Face VLMs through vitviz (small random configs, offline): Idefics3 and
SmolVLM (a SigLIP-like tower read after its final norm, pixel-shuffled), LLaVA (a CLIP tower read at
`vision_feature_layer`) and LLaVA-OneVision (a SigLIP tower): every block's attention and the features
equal the tower's own; the tokens `TowerInfo` names equal what the VLM's connector reads; a folder saved
with `save_pretrained` loads as the tower with its processor's preprocessing; the analyses run on it."""

import numpy as np
import pytest
import torch
from conftest import write_hub_cache
from PIL import Image

import vitviz
from vitviz.model import ViT
from vitviz.vlm.towers import TowerInfo

transformers = pytest.importorskip("transformers")

VISION = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
TEXT = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64, vocab_size=128)

# name -> (VLM model type, the VLM's config fields beside its vision and text configs, the tower's model type)
KINDS = {
    "idefics3": ("idefics3", dict(scale_factor=2), None),
    "smolvlm": ("smolvlm", dict(scale_factor=2), None),
    "llava": ("llava", dict(), "clip_vision_model"),  # vision_feature_layer -2, "default": block 0 of 2, no cls token
    "llava-last-full": ("llava", dict(vision_feature_layer=-1, vision_feature_select_strategy="full"), "clip_vision_model"),
    "llava-last-default": ("llava", dict(vision_feature_layer=-1), "clip_vision_model"),
    "llava_onevision": ("llava_onevision", dict(image_grid_pinpoints=[[32, 32]]), "siglip_vision_model"),  # -1, "full"
    "llava_onevision-clip": ("llava_onevision", dict(image_grid_pinpoints=[[32, 32]], vision_feature_layer=-2,
                                                     vision_feature_select_strategy="default"), "clip_vision_model"),
}
_CLASS = {"idefics3": "Idefics3", "smolvlm": "SmolVLM", "llava": "Llava", "llava_onevision": "LlavaOnevision"}


def _config(kind: str, vision: dict | None = None):
    family, fields, tower = KINDS[kind]
    v = dict(vision or VISION) | ({"model_type": tower} if tower else {})
    text = dict(TEXT, model_type="qwen2" if family == "llava_onevision" else "llama")
    config = getattr(transformers, f"{_CLASS[family]}Config")(vision_config=v, text_config=text, image_token_id=100, **fields)
    for c in (config, config.vision_config, config.text_config):
        c._attn_implementation = "eager"
    return config


def _vlm(kind: str, seed: int = 0, vision: dict | None = None, whole: bool = True):
    """A small random VLM (`...ForConditionalGeneration`, or with `whole` False its `...Model`), every
    parameter away from its init so that a dropped one shows, eager attention."""
    config = _config(kind, vision)
    family = KINDS[kind][0]
    model = getattr(transformers, f"{_CLASS[family]}{'ForConditionalGeneration' if whole else 'Model'}")(config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2) if name.endswith("weight") else p.normal_(0, 0.2)
            else:
                p.normal_(0, 0.15)
    return model.eval()


def _tower(model):
    """The HF vision transformer inside the VLM (the module with `embeddings` and `post_layernorm`)."""
    inner = getattr(model, "model", model)
    tower = getattr(inner, "vision_model", None) or inner.vision_tower
    return tower if hasattr(tower, "embeddings") else tower.vision_model


def _connector_input(model, x: torch.Tensor) -> torch.Tensor:
    """What the VLM's connector (Idefics3's pixel shuffle and projection, LLaVA's projector) is fed,
    caught on its way in while transformers computes the image features."""
    inner = getattr(model, "model", model)
    family = model.config.model_type
    connector = inner.connector if family in ("idefics3", "smolvlm") else inner.multi_modal_projector
    caught = []
    handle = connector.register_forward_pre_hook(lambda module, args: caught.append(args[0].detach().clone()))
    try:
        with torch.inference_mode():
            if family in ("idefics3", "smolvlm"):
                inner.get_image_features(pixel_values=x[:, None])  # [B, images, 3, H, W]
            elif family == "llava":
                inner.get_image_features(pixel_values=x)
            else:  # one base image and one crop of the only grid pinpoint each, as its processor makes them
                sizes = torch.tensor([[x.shape[2], x.shape[3]]] * x.shape[0])
                inner.get_image_features(pixel_values=torch.stack([x, x.flip(-1)], dim=1), image_sizes=sizes)
    finally:
        handle.remove()
    (features,) = caught
    return features


def _base(model, x: torch.Tensor) -> torch.Tensor:
    """The connector's input for the images `x` themselves (OneVision's: its base images, not their crops)."""
    fed = _connector_input(model, x)
    return fed[0::2] if model.config.model_type == "llava_onevision" else fed


def _read(ours: ViT, x: torch.Tensor) -> torch.Tensor:
    """The tokens `TowerInfo` names: block `feature_layer`'s output, after the final norm and without
    the prefix tokens where it says so."""
    info = ours.tower_info
    layers = []
    with torch.inference_mode():
        ours.encode(x, layers=layers)
        tokens = layers[info.feature_layer]
        if info.final_norm:
            tokens = ours.norm(tokens)
    return tokens[:, ours.config.num_prefix_tokens :] if info.drop_prefix else tokens


def _max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got - want).abs().max().item()


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_tower_gives_transformers_features_and_every_blocks_attention(kind):
    model = _vlm(kind)
    ours = vitviz.from_transformers(model)
    assert isinstance(ours, ViT) and ours.config.num_classes == 0 and isinstance(ours.tower_info, TowerInfo)
    tower = _tower(model)
    x = torch.randn(2, 3, 32, 32)
    layers = []
    with torch.inference_mode():
        out = tower(pixel_values=x, output_attentions=True, output_hidden_states=True)
        with vitviz.record_attention(ours) as rec:
            features = ours.encode(x, layers=layers)
        want = tower.post_layernorm(out.hidden_states[-1])  # every token after the final norm
    assert _max_diff(features, want) < 1e-5
    for i, layer in enumerate(layers):  # hidden_states[0] is the embeddings, [i + 1] block i's output
        assert _max_diff(layer, out.hidden_states[i + 1]) < 1e-5
    torch.testing.assert_close(rec.attentions, torch.stack(out.attentions), atol=1e-5, rtol=0)
    clip = KINDS[kind][2] == "clip_vision_model"
    assert ours.spec.num_prefix_tokens == (1 if clip else 0) and rec.attentions.shape[-1] == ours.spec.num_prefix_tokens + 16
    if clip:  # CLIP's pooled output: its cls token after post_layernorm
        with torch.inference_mode():
            assert _max_diff(ours.forward_features(x), out.pooler_output) < 1e-5
    elif KINDS[kind][0] in ("idefics3", "smolvlm"):
        assert _max_diff(features, out.last_hidden_state) < 1e-5


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_tokens_tower_info_names_are_what_the_connector_reads(kind):
    model = _vlm(kind, seed=1)
    ours = vitviz.from_transformers(model)
    info, cfg = ours.tower_info, model.config
    assert info.family == KINDS[kind][0]
    if info.family in ("idefics3", "smolvlm"):
        assert (info.feature_layer, info.final_norm, info.drop_prefix, info.merge) == (1, True, False, cfg.scale_factor)
        assert model.model.image_seq_len == ours.config.grid[0] * ours.config.grid[1] // info.merge**2
    else:
        layer = cfg.vision_feature_layer
        assert info.feature_layer == (layer if layer >= 0 else 2 + layer) and not info.final_norm and info.merge == 1
        assert info.drop_prefix == (cfg.vision_feature_select_strategy == "default")
    x = torch.randn(2, 3, 32, 32)
    fed = _connector_input(model, x)
    if info.family == "llava_onevision":  # the base images, then their crops
        mine = torch.cat([_read(ours, x), _read(ours, x.flip(-1))])
        fed = torch.cat([fed[0::2], fed[1::2]])
    else:
        mine = _read(ours, x)
    assert mine.shape == fed.shape
    assert _max_diff(mine, fed) < 1e-5
    assert "vision tower" in ours.spec.description and "reads the output of" in ours.spec.description


def test_the_model_without_its_language_head_gives_the_same_tower():
    """`...Model` (no language-model head) converts as `...ForConditionalGeneration` does."""
    for kind in ("idefics3", "llava", "llava_onevision"):
        model = _vlm(kind, seed=2, whole=False)
        ours = vitviz.from_transformers(model)
        x = torch.randn(1, 3, 32, 32)
        assert _max_diff(_read(ours, x), _base(model, x)) < 1e-5


@pytest.mark.parametrize("side, patch", [(364, 14), (512, 16)], ids=["idefics3-364", "smolvlm-512"])
def test_idefics3_position_ids_are_the_table_in_order_at_the_published_grids(side, patch):
    """Idefics3 8B's 26 x 26 and SmolVLM's 32 x 32 patches: a full-size image's bucketed position ids
    are 0..N-1, so the tower is exact there too."""
    model = _vlm("idefics3", vision=dict(VISION, image_size=side, patch_size=patch, num_hidden_layers=1))
    ours = vitviz.from_transformers(model)
    x = torch.randn(1, 3, side, side)
    with torch.inference_mode():
        want = _tower(model)(pixel_values=x).last_hidden_state
        assert _max_diff(ours.encode(x), want) < 1e-5


def _image(seed: int = 1) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (90, 120, 3), dtype=np.uint8))


def _processor(family: str):
    """The family's image processor at the tower's 32 px (Idefics3's first resizes the longest edge to
    4 x the tower's side, as the published ones do, then squashes the image to the tower's square)."""
    t = transformers
    if family in ("idefics3", "smolvlm"):
        return getattr(t, f"{_CLASS[family]}ImageProcessor")(size={"longest_edge": 128}, max_image_size={"longest_edge": 32},
                                                             do_image_splitting=False)
    if family == "llava":
        return t.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return t.LlavaOnevisionImageProcessor(size={"height": 32, "width": 32}, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                          image_grid_pinpoints=[[32, 32]])


@pytest.mark.parametrize("kind", ["idefics3", "smolvlm", "llava", "llava_onevision"])
def test_a_saved_vlm_loads_as_its_tower_with_its_processors_preprocessing(no_network, tmp_path, kind):
    """hf:<repo> with weights_path=<a folder saved with save_pretrained>: the tower, its TowerInfo, and
    the preprocessing of the saved image processor, which makes the image the tower sees (Idefics3: the
    whole image squashed to the square; LLaVA: CLIP's resize and centre crop; OneVision: the base image)."""
    family = KINDS[kind][0]
    model = _vlm(kind, seed=3)
    folder = tmp_path / "tinyvlm"
    model.save_pretrained(folder)
    processor = _processor(family)
    processor.save_pretrained(folder)
    ours = vitviz.load_model("hf:me/tinyvlm", device="cpu", weights_path=folder)
    assert isinstance(ours, ViT) and ours.tower_info == vitviz.from_transformers(model).tower_info
    spec = ours.spec
    assert spec.name == "hf:me/tinyvlm" and spec.categories is None and spec.locator == str(folder)
    assert "vision tower" in spec.description and "tinyvlm" in spec.description
    pre = spec.preprocessing
    if family in ("idefics3", "smolvlm"):
        assert (pre.mode, pre.image_size, pre.mean, pre.std, pre.interpolation) == ("squash", 32, (0.5,) * 3, (0.5,) * 3, "lanczos")
    elif family == "llava":
        assert (pre.mode, pre.image_size, pre.resize_size, pre.interpolation) == ("crop", 32, 32, "bicubic")
        assert pre.mean == pytest.approx((0.48145466, 0.4578275, 0.40821073))
    else:
        assert (pre.mode, pre.image_size, pre.mean, pre.std, pre.interpolation) == ("squash", 32, (0.5,) * 3, (0.5,) * 3, "bicubic")
    x = torch.randn(2, 3, 32, 32)
    assert _max_diff(_read(ours, x), _base(model, x)) < 1e-5
    img = _image()
    theirs = torch.as_tensor(processor(images=img, return_tensors="pt")["pixel_values"])
    theirs = theirs.reshape(-1, 3, 32, 32)[0]  # Idefics3: the one image; OneVision: the base image, first
    assert (vitviz.preprocess(img, pre)[0] - theirs).abs().mean() < 0.02


def test_load_model_reads_a_vlm_repository_from_the_hub_cache_offline(no_network):
    repo = "vitviz-test/tiny-smolvlm"
    model = _vlm("smolvlm", seed=6)
    snap = write_hub_cache(no_network, repo, {})
    model.save_pretrained(snap)
    _processor("smolvlm").save_pretrained(snap)
    ours = vitviz.load_model(f"hf:{repo}", device="cpu")
    assert isinstance(ours, ViT) and ours.spec.name == f"hf:{repo}" and ours.tower_info.merge == 2
    assert ours.spec.preprocessing.interpolation == "lanczos"
    x = torch.randn(1, 3, 32, 32)
    assert _max_diff(_read(ours, x), _base(model, x)) < 1e-5


def test_a_saved_vlm_without_an_image_processor_is_fed_as_its_familys_defaults(no_network, tmp_path):
    model = _vlm("llava", seed=4)
    model.save_pretrained(tmp_path / "bare")
    with pytest.warns(UserWarning, match="without its image processor"):
        ours = vitviz.load_model("hf:me/bare", device="cpu", weights_path=tmp_path / "bare")
    pre = ours.spec.preprocessing
    assert (pre.mode, pre.image_size, pre.resize_size, pre.interpolation) == ("crop", 32, 32, "bicubic")
    assert "LLaVA's image processor's defaults" in ours.spec.description


@pytest.mark.parametrize("kind", ["smolvlm", "llava", "llava_onevision"])
def test_the_analyses_run_on_a_tower(kind):
    """analyze: rollout, the default query's map and the mean attention distances of every layer and head."""
    ours = vitviz.from_transformers(_vlm(kind, seed=5))
    a = vitviz.analyze(ours, _image(2))
    n = ours.spec.num_prefix_tokens + 16
    rollout = a.rollout()
    assert rollout.shape[-2:] == (n, n) and torch.isfinite(rollout).all()
    assert a.cls_map().shape == (4, 4) and torch.isfinite(a.cls_map()).all()
    distances = a.distances()
    assert distances.shape == (2, 2) and torch.isfinite(distances).all()


def test_unsupported_llava_configs_are_refused_clearly():
    model = _vlm("llava")
    model.config.vision_feature_layer = [-2, -1]
    with pytest.raises(NotImplementedError, match="vision_feature_layer list .* is not supported"):
        vitviz.from_transformers(model)
    model.config.vision_feature_layer = [-2]  # one layer in a list: that layer
    assert vitviz.from_transformers(model).tower_info.feature_layer == 0
    model.config.vision_feature_layer = 0
    with pytest.raises(ValueError, match="names no block's output"):
        vitviz.from_transformers(model)
    model.config.vision_feature_layer = -2
    vars(model.config)["vision_feature_select_strategy"] = "cls_patch"  # past transformers' own check of the field
    with pytest.raises(ValueError, match="'cls_patch' is not supported"):
        vitviz.from_transformers(model)
    siglip = _vlm("llava_onevision")
    siglip.config.vision_feature_select_strategy = "default"
    with pytest.raises(NotImplementedError, match="without a cls token"):
        vitviz.from_transformers(siglip)
