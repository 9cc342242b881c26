"""The vision towers of Hugging Face vision–language models as vitviz ViTs: Idefics3 and SmolVLM
(`Idefics3ForConditionalGeneration`, `SmolVLMForConditionalGeneration`, or their `...Model`), LLaVA
(`LlavaForConditionalGeneration`, `LlavaModel`) and LLaVA-OneVision (`LlavaOnevisionForConditionalGeneration`,
`LlavaOnevisionModel`). The whole VLM goes in; its vision tower comes out as a `vitviz.model.ViT` with no
head (`num_classes=0`), giving the tower's own features and attention, and with a
`vitviz.vlm.towers.TowerInfo` as its `tower_info`: which block the connector reads, whether after the
final norm and without the cls token, and how many patches one language-model token merges.

    vitviz.load_model("hf:HuggingFaceTB/SmolVLM-256M-Instruct")   # its SigLIP-like tower
    vitviz.load_model("hf:llava-hf/llava-1.5-7b-hf")               # its CLIP ViT-L/14 at 336 px
    vitviz.from_transformers(vlm, processor=processor)             # a VLM already in hand

The towers:

- Idefics3 / SmolVLM: `Idefics3VisionTransformer` (SigLIP's blocks, no cls token, no pooling head,
  `post_layernorm` after the last block). For an image of the tower's full size (`vision_config.image_size`)
  its position ids are 0..N-1, the learned table as it is: vitviz's tower is exact there. At other sizes
  Idefics3 looks the positions up in buckets of the table and vitviz resamples the table (bicubic), so the
  two differ. The connector reads the last block's output after `post_layernorm` and pixel-shuffles
  `scale_factor` x `scale_factor` neighbouring patches into one token.
- LLaVA: `CLIPVisionModel` (a cls token, `pre_layrnorm`; its `post_layernorm` acts on the pooled cls token
  only, and as vitviz's final norm on every token it leaves the features the connector reads untouched).
  The connector reads the output of the block `vision_feature_layer` names in transformers' hidden states
  (-2: the second to last block), without the cls token for the "default" feature select and with it for
  "full"; one token per patch. A SigLIP tower in a LLaVA config is read the same way ("full" only: it has
  no cls token).
- LLaVA-OneVision: `SiglipVisionModel` (no cls token), read like LLaVA's ("full", `vision_feature_layer`
  -1: the last block's output, before `post_layernorm`). A pooling head the tower may carry
  (`vision_use_head`) is read by no connector and is left out; the ViT pools the mean of its patch tokens.

Preprocessing, from the VLM's image processor when there is one (else from that processor's defaults, said
in the spec's description and by a warning):

- Idefics3 / SmolVLM: the tower sees the whole image resized to the square `vision_config.image_size`
  (the processor's `max_image_size`), normalised with mean and std 0.5 (the processor's `image_mean` and
  `image_std`), Lanczos-resampled: the one image the tower sees when image splitting is off, and the global
  view, last after the tiles, when it is on.
- LLaVA: CLIP's: the shorter side resized to the processor's `shortest_edge`, the centre crop of its
  `crop_size`, CLIP's mean and std, bicubic (a processor with `do_pad` pads the image to a square first;
  vitviz crops it).
- LLaVA-OneVision: the whole image resized to the processor's square `size` (the base image, first before
  the any-resolution crops), its mean and std (0.5 in the published models), bicubic.

The conversion reads the modules as they are (configs and state dicts; `vitviz.sources.hf_convert`'s
mapping of SigLIP's and CLIP's blocks); `vitviz.sources.hf` sends these model types here.
"""

from __future__ import annotations

import dataclasses
import warnings
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from vitviz.config import Preprocessing, VariantSpec, ViTConfig
from vitviz.model import ViT
from vitviz.sources.hf_convert import _clip_layers, config_from_transformers
from vitviz.vlm.towers import TowerInfo

__all__ = [
    "VLM_TYPES",
    "tower_config",
    "tower_info",
    "tower_state_dict",
    "tower_preprocessing",
    "tower_spec",
    "tower_from_transformers",
    "vlm_model_class",
]

IDEFICS = ("idefics3", "smolvlm")  # a SigLIP-like tower read after its final norm, pixel-shuffled
LLAVA = ("llava", "llava_onevision")  # a CLIP or SigLIP tower read at `vision_feature_layer`
VLM_TYPES = (*IDEFICS, *LLAVA)  # the VLM model types whose vision tower this module converts
_CLASSES = {"idefics3": "Idefics3", "smolvlm": "SmolVLM", "llava": "Llava", "llava_onevision": "LlavaOnevision"}
_NAMES = {"idefics3": "Idefics3", "smolvlm": "SmolVLM", "llava": "LLaVA", "llava_onevision": "LLaVA-OneVision"}
_TOWERS = {"clip_vision_model": "clip", "siglip_vision_model": "siglip"}  # a LLaVA tower's model type -> its kind
_CLIP_MEAN, _CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
_RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}  # PIL's codes


def _family(cfg: Any) -> str:
    kind = getattr(cfg, "model_type", None)
    if kind not in VLM_TYPES:
        raise TypeError(f"expected a Hugging Face Idefics3, SmolVLM, LLaVA or LLaVA-OneVision config, got model_type {kind!r}")
    return kind


def _tower_kind(cfg: Any) -> str:
    """"siglip" (Idefics3's tower and SigLIP's) or "clip": how the tower's blocks and embeddings are laid out."""
    if _family(cfg) in IDEFICS:
        return "siglip"
    kind = getattr(cfg.vision_config, "model_type", None)
    if kind not in _TOWERS:
        raise NotImplementedError(f"a {cfg.model_type} vision tower of model type {kind!r} is not modelled by vitviz; "
                                  "it reads CLIP and SigLIP towers")
    return _TOWERS[kind]


def tower_config(cfg: Any) -> ViTConfig:
    """The `ViTConfig` of a VLM's vision tower, from the VLM's config alone: SigLIP's blocks with no cls
    token and the mean of the patch tokens as the pooled output (Idefics3, SmolVLM, SigLIP towers), or
    CLIP's with its cls token and pre-norm (LLaVA's CLIP towers); no head."""
    kind = _tower_kind(cfg)
    config = config_from_transformers(SimpleNamespace(config=SimpleNamespace(model_type=kind, vision_config=cfg.vision_config)))
    if kind == "siglip":  # no pooling head is read: the mean of the patch tokens (after the final norm) is the pooled output
        config = dataclasses.replace(config, pool="avg")
    return config


def _feature_layer(cfg: Any) -> int:
    """LLaVA's `vision_feature_layer` as the 0-based block whose output it names (transformers' hidden
    states: 0 the embeddings, i + 1 block i's output), or a clear error."""
    layer = cfg.vision_feature_layer
    if isinstance(layer, (list, tuple)):
        if len(layer) != 1:
            raise NotImplementedError(f"a vision_feature_layer list ({list(layer)}: several layers concatenated) is not supported "
                                      "by vitviz; it reads one layer")
        layer = layer[0]
    depth = cfg.vision_config.num_hidden_layers
    index = int(layer) if layer >= 0 else depth + 1 + int(layer)
    if not 1 <= index <= depth:
        raise ValueError(f"vision_feature_layer {layer} names no block's output of a {depth}-block tower "
                         "(0 or -(depth + 1) is the embeddings)")
    return index - 1


def tower_info(cfg: Any) -> TowerInfo:
    """What the VLM's connector reads from its tower (`TowerInfo`), from the VLM's config."""
    family = _family(cfg)
    if family in IDEFICS:
        return TowerInfo(family=family, feature_layer=cfg.vision_config.num_hidden_layers - 1, final_norm=True, drop_prefix=False,
                         merge=int(cfg.scale_factor))
    strategy = cfg.vision_feature_select_strategy
    if strategy not in ("default", "full"):
        raise ValueError(f'vision_feature_select_strategy {strategy!r} is not supported by vitviz; it reads "default" and "full"')
    if strategy == "default" and _tower_kind(cfg) == "siglip":
        raise NotImplementedError('the "default" feature select on a tower without a cls token drops its first patch, which '
                                  "vitviz does not model")
    return TowerInfo(family=family, feature_layer=_feature_layer(cfg), final_norm=False, drop_prefix=strategy == "default", merge=1)


def _tower(model: nn.Module) -> nn.Module:
    """The VLM's vision transformer itself (the module holding `embeddings`, `encoder`, `post_layernorm`)."""
    attr = "vision_model" if _family(model.config) in IDEFICS else "vision_tower"
    inner = model if hasattr(model, attr) else getattr(model, "model", None)  # ...ForConditionalGeneration: its ...Model
    tower = getattr(inner, attr, None)
    if tower is not None and not hasattr(tower, "embeddings"):  # CLIPVisionModel, SiglipVisionModel: the transformer inside
        tower = getattr(tower, "vision_model", None)
    if tower is None or not hasattr(tower, "embeddings"):
        raise NotImplementedError(f"{type(model).__name__}: cannot find its vision tower (vitviz reads transformers 5's layout)")
    return tower


def tower_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The VLM's vision tower's weights under the names of a vitviz `ViT` of `tower_config`: q, k and v
    stacked into one qkv projection; a CLIP tower's class embedding as the cls token (its position
    embedding the table's first row)."""
    tower, kind = _tower(model), _tower_kind(model.config)
    emb = tower.embeddings
    sd: dict[str, torch.Tensor] = {
        "patch_embed.proj.weight": emb.patch_embedding.weight,
        "pos_embed": emb.position_embedding.weight[None],  # [1, (1 +) gh*gw, D]
        "norm.weight": tower.post_layernorm.weight,
        "norm.bias": tower.post_layernorm.bias,
    }
    if kind == "clip":
        sd |= {"cls_token": emb.class_embedding.reshape(1, 1, -1), "norm_pre.weight": tower.pre_layrnorm.weight,
               "norm_pre.bias": tower.pre_layrnorm.bias}
    else:
        sd["patch_embed.proj.bias"] = emb.patch_embedding.bias
    sd |= _clip_layers(tower.encoder.layers, "")
    return {k: v.detach() for k, v in sd.items()}


def _image_processor(processor: Any) -> Any:
    """The image processor inside a processor (or the image processor itself, or its config dict)."""
    return getattr(processor, "image_processor", None) or processor


def _defaults(cfg: Any) -> dict:
    """The settings of the family's image processor as transformers defines them (used when the model
    came without one)."""
    side = _tower_config_side(cfg)
    if _family(cfg) in IDEFICS:
        return dict(image_mean=[0.5] * 3, image_std=[0.5] * 3, resample=1)
    if _family(cfg) == "llava":
        return dict(size={"shortest_edge": side}, crop_size={"height": side, "width": side}, do_center_crop=True,
                    image_mean=list(_CLIP_MEAN), image_std=list(_CLIP_STD), resample=3)
    return dict(size={"height": side, "width": side}, image_mean=list(_CLIP_MEAN), image_std=list(_CLIP_STD), resample=3)


def _tower_config_side(cfg: Any) -> int:
    side = cfg.vision_config.image_size
    return side if isinstance(side, int) else side[0]


def tower_preprocessing(cfg: Any, processor: Any) -> Preprocessing:
    """How the tower sees an image (the module's docstring gives the rule of each family), from the VLM's
    image processor (an object or its config dict; None: the family's defaults)."""
    proc = _image_processor(processor)
    if proc is None:
        proc = _defaults(cfg)
    get = proc.get if isinstance(proc, dict) else (lambda k, d=None: getattr(proc, k, d))
    resample = get("resample", None)
    resample = int(getattr(resample, "value", resample)) if resample is not None else (1 if _family(cfg) in IDEFICS else 3)
    normalize = get("do_normalize", True)
    mean = tuple(get("image_mean") or (0.5,) * 3) if normalize else (0.0, 0.0, 0.0)
    std = tuple(get("image_std") or (0.5,) * 3) if normalize else (1.0, 1.0, 1.0)
    kw = dict(mean=tuple(float(m) for m in mean), std=tuple(float(s) for s in std), interpolation=_RESAMPLE.get(resample, "bicubic"))
    side = _tower_config_side(cfg)
    if _family(cfg) in IDEFICS:
        return Preprocessing(image_size=side, mode="squash", **kw)
    size, crop = _sized(get("size")), _sized(get("crop_size"))
    if get("do_center_crop", False) and crop.get("height"):
        return Preprocessing(image_size=crop["height"], resize_size=size.get("shortest_edge") or crop["height"], **kw)
    return Preprocessing(image_size=size.get("height") or size.get("shortest_edge") or side, mode="squash", **kw)


def _sized(value: Any) -> dict[str, int]:
    """An image processor's size (a dict, transformers' SizeDict, or one number) as a dict."""
    if value is None:
        return {}
    if isinstance(value, (int, float)):
        return {"height": int(value), "width": int(value), "shortest_edge": int(value)}
    get = value.get if isinstance(value, dict) else (lambda k: getattr(value, k, None))
    return {k: int(get(k)) for k in ("height", "width", "shortest_edge", "longest_edge") if get(k)}


def _reads(info: TowerInfo, depth: int) -> str:
    """Which layer the language model reads, in words."""
    where = "the last block" if info.feature_layer == depth - 1 else f"block {info.feature_layer} (0-based, of {depth})"
    after = " after the final norm" if info.final_norm else ""
    prefix = " without the cls token" if info.drop_prefix else ""
    merge = f", {info.merge} x {info.merge} patches a token" if info.merge > 1 else ", one token a patch"
    return f"the language model reads the output of {where}{after}{prefix}{merge}"


def tower_spec(cfg: Any, *, name: str, weights: str, processor: Any, locator: str = "", saved_in: str = "") -> VariantSpec:
    """The spec of a VLM's vision tower, from the VLM's config and image processor (None: the family's
    processor defaults, said in the description and by a warning)."""
    config, info = tower_config(cfg), tower_info(cfg)
    description = (f"Hugging Face {name.removeprefix('hf:')}{f', saved in {saved_in}' if saved_in else ''}: the vision tower of the "
                   f"{_NAMES[info.family]} vision–language model, {config.depth} x {config.heads} x {config.width}, /{config.patch_size}; "
                   f"{_reads(info, config.depth)}")
    if _image_processor(processor) is None:
        note = f"without its image processor: fed as {_NAMES[info.family]}'s image processor's defaults"
        warnings.warn(f"{name}: {note}", stacklevel=3)
        description = f"{description}; {note}"
    return VariantSpec(name=name, config=config, preprocessing=tower_preprocessing(cfg, processor), categories=None, source="hf",
                       weights=weights, locator=locator, description=description)


def tower_from_transformers(model: nn.Module, *, processor: Any = None, name: str | None = None) -> ViT:
    """A whole Hugging Face VLM's vision tower as a vitviz `ViT` with the same features and attention,
    on the tower's device and dtype and in its train/eval mode; its `tower_info` says what the
    connector reads, its spec (named "hf:<the model's name>") how images are fed (`tower_preprocessing`)."""
    cfg = model.config
    config = tower_config(cfg)
    ours = ViT(config)
    ours.load_state_dict(tower_state_dict(model))
    ours.tower_info = tower_info(cfg)
    name = name or getattr(cfg, "_name_or_path", "") or type(model).__name__
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a model in hand without its processor: the defaults, said in the description
        ours.spec = tower_spec(cfg, name=f"hf:{name}", weights="converted from a Hugging Face model instance", processor=processor)
    param = next(_tower(model).parameters())
    return ours.to(device=param.device, dtype=param.dtype).train(model.training)


def vlm_model_class(cfg: Any) -> type:
    """The transformers class a VLM checkpoint of this config loads into: its `...ForConditionalGeneration`,
    or its `...Model` where the checkpoint's architectures name that."""
    import transformers

    family = _family(cfg)
    archs = getattr(cfg, "architectures", None) or []
    kind = "Model" if archs and all(a.endswith("Model") for a in archs) else "ForConditionalGeneration"
    return getattr(transformers, f"{_CLASSES[family]}{kind}")


def vision_tower(model: nn.Module, processor: Any = None) -> ViT | None:
    """The vision tower of a transformers VLM as a vitviz ViT (`tower_from_transformers`, or for Qwen-VL
    `vitviz.sources.hf_qwen.qwen_from_transformers` with the processor's image processor), or None for a
    model of another family: what `vitviz.from_transformers` and a VLM's adapter (`vitviz.vlm.hf`) convert."""
    from vitviz.sources.hf_qwen import QWEN_TYPES, qwen_from_transformers

    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind in QWEN_TYPES:
        return qwen_from_transformers(model, processor=getattr(processor, "image_processor", None) or processor)
    if kind in VLM_TYPES:
        return tower_from_transformers(model, processor=processor)
    return None
