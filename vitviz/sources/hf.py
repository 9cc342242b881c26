"""Hugging Face transformers' ViTs: `ViTModel`, `ViTForImageClassification`, `Dinov2Model` and
`Dinov2WithRegistersModel` (from a `Dinov2ForImageClassification` checkpoint, the backbone); and the
image–text models `CLIPModel` and `SiglipModel`, which become a `vitviz.imagetext.ImageTextModel` (a
vitviz ViT image tower, the text tower beside it, and the repository's tokenizer where it has one;
SigLIP's attention-pooling head is the image tower's `attn_pool`).

    vitviz.load_model("hf:google/vit-base-patch16-224")
    vitviz.load_model("hf:facebook/dinov2-with-registers-small")
    vitviz.load_model("hf:openai/clip-vit-base-patch32")     # an ImageTextModel
    vitviz.from_transformers(model, processor=processor)   # a model already in hand (= ViT.from_transformers)

transformers is imported only here, and only when used (`pip install vitviz[hf]`); vitviz reads
the module layout of transformers 5. Weights come from the Hugging Face cache through
`from_pretrained`; preprocessing from the repository's image processor (resize and crop, or
resize to the square, with its mean and std), class names from the config's `id2label`.

"hf:" takes a hub repository id only ("org/name" or "name"), never a path: `from_pretrained` would
read a folder of this machine, so the id is checked before anything is fetched or opened. A folder
saved with `save_pretrained` loads with `load_model("hf:<a repo id>", weights_path=<folder>)`, from
that folder alone: its config, its class names (`id2label`) and its image processor, read as
transformers reads it (the one nested in `processor_config.json`, else `preprocessor_config.json`;
without either, ImageNet's mean and std at the config's image size, said in the spec's description
and by a warning); the hub and its cache are never asked, so the repo id is only the model's name.

A vision–language model's repository (`vitviz.sources.hf_vlm`, `vitviz.sources.hf_qwen`) loads as its
vision tower. Where `vitviz.ask` asks the family (Idefics3, SmolVLM, LLaVA, Qwen2.5-VL: the
`...ForConditionalGeneration` checkpoints, `vitviz.vlm.hf.HF_VLM_TYPES`) and the processor is at hand
(an image processor and a tokenizer saved beside the weights, in the cache, or on a reachable hub), the
whole VLM is loaded once (`vitviz.vlm.hf.load_vlm`), the tower converted from it, and the tower holds
the VLM's adapter as `tower.__dict__["vlm"]` (not a submodule; its spec's `vlm` is the family): the
adapter's model follows the tower's device and dtype on its first question, and a Qwen2.5-VL
processor's `max_pixels` is the tower's square (448 x 448 px: 256 image tokens), the crop the app
asks about, so that a question's price (`ask_shape`) is what runs. Without the processor (or, for
SmolVLM's processor, without num2words) the tower loads alone, its `vlm` None and its description
saying why it cannot be asked (and a warning). LLaVA-OneVision and Qwen3-VL load as their towers alone.

    vitviz.load_model("hf:HuggingFaceTB/SmolVLM-256M-Instruct")   # the tower, holding SmolVLM
    vitviz.ask(tower, "photo.jpg", "what is in the picture?")

The source registers itself, and `ViT.from_transformers`, when this module is imported. The
conversion of the modules once in hand (configs and state dicts) is `vitviz.sources.hf_convert`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch
from torch import nn

from vitviz.config import IMAGENET_MEAN, IMAGENET_STD, Preprocessing, ViTConfig
from vitviz.imagetext import ImageTextModel
from vitviz.model import ViT
from vitviz.sources.base import Status, VariantSpec, WeightsSource, WeightsUnavailableError, register_source, split_size
from vitviz.sources.hf_convert import (
    IMAGE_TEXT,
    SIGLIP,
    TYPES,
    config_from_transformers,
    convert_image_text_state_dict,
    convert_transformers_state_dict,
    text_config_from_transformers,
)
from vitviz.sources.hf_qwen import QWEN_TYPES, load_qwen_tower, qwen_spec
from vitviz.sources.hf_vlm import VLM_TYPES, tower_spec, vision_tower, vlm_model_class
from vitviz.sources.hf_common import _NOT_A_REPO, _is_repo_id, _saved_folder, _size, _transformers
from vitviz.sources.hub import cached_file, hub_offline, hub_reachable, missing_message
from vitviz.video.hf import VIDEO_TYPES, folder_video_processor, hub_video_processor, video_from_transformers, video_model_class, video_spec
from vitviz.vlm.hf import HF_VLM_TYPES

__all__ = [
    "CURATED",
    "HuggingFaceSource",
    "from_transformers",
    "config_from_transformers",
    "text_config_from_transformers",
    "convert_transformers_state_dict",
    "convert_image_text_state_dict",
    "preprocessing_from_processor",
]

_SWIN = ("swin", "swinv2")  # model types converted by vitviz.sources.swin
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "spiece.model")
_RESAMPLE = {0: "nearest", 2: "bilinear", 3: "bicubic"}  # PIL's codes, as image processors store them


def preprocessing_from_processor(processor: Any, image_size: int) -> Preprocessing:
    """A Hugging Face image processor (or its config dict) as vitviz's `Preprocessing`."""
    if processor is None:
        return Preprocessing(image_size=image_size, resize_size=math.floor(image_size / 0.875), interpolation="bicubic")
    get = processor.get if isinstance(processor, dict) else (lambda k, d=None: getattr(processor, k, d))
    size, crop = _size(get("size"), "shortest_edge"), _size(get("crop_size"), "height")
    resample = get("resample", 2)
    interpolation = _RESAMPLE.get(int(getattr(resample, "value", resample)), "bilinear")
    mean = tuple(get("image_mean") or IMAGENET_MEAN) if get("do_normalize", True) else (0.0, 0.0, 0.0)
    std = tuple(get("image_std") or IMAGENET_STD) if get("do_normalize", True) else (1.0, 1.0, 1.0)
    if get("max_num_patches"):  # SigLIP 2's NaFlex processor: each image keeps its aspect ratio, in at most so many patches
        p, most = int(get("patch_size") or 16), int(get("max_num_patches"))
        return Preprocessing(image_size=math.isqrt(most - 1) * p + p, mode="fit", patch_size=p, max_patches=most, mean=mean, std=std,
                             interpolation=interpolation)
    if get("do_center_crop", False) and crop.get("height"):
        side = crop["height"]
        short = size.get("shortest_edge") or size.get("height") or side
        return Preprocessing(image_size=side, resize_size=short, mean=mean, std=std, interpolation=interpolation)
    side = size.get("height") or size.get("shortest_edge") or image_size
    return Preprocessing(image_size=side, mode="squash", mean=mean, std=std, interpolation=interpolation)


def _spec(
    model: nn.Module, config: ViTConfig, *, name: str, weights: str, processor: Any, locator: str = "", saved_in: str = ""
) -> VariantSpec:
    labels = getattr(model.config, "id2label", None)
    categories = None
    if config.num_classes:
        categories = tuple(labels.get(i, labels.get(str(i), f"class {i}")) for i in range(config.num_classes)) if labels else tuple(
            f"class {i}" for i in range(config.num_classes)
        )
    if getattr(model.config, "model_type", None) == "siglip2" and processor is None:  # Siglip2ImageProcessor's own defaults
        processor = dict(max_num_patches=config.grid[0] * config.grid[1], patch_size=config.patch_size, image_mean=[0.5] * 3,
                         image_std=[0.5] * 3, resample=2)
    if getattr(model.config, "model_type", None) in IMAGE_TEXT:
        kind = "image–text"
    else:
        kind = "features" if categories is None else f"{len(categories)} classes"
    return VariantSpec(
        name=name,
        config=config,
        preprocessing=preprocessing_from_processor(processor, config.image_size),
        categories=categories,
        source="hf",
        weights=weights,
        locator=locator,
        description=f"Hugging Face {name.removeprefix('hf:')}{f', saved in {saved_in}' if saved_in else ''}: "
        f"{config.depth} x {config.heads} x {config.width}, /{config.patch_size}, {kind}",
    )


# The repositories the app's menu offers by name (image–text models, and vision–language models
# asked in the Ask tab), with what is known of them before any download (their config.json and
# preprocessor_config.json as published), so that the menu lists them offline: repo -> (model type,
# config overrides of transformers' defaults, image processor).
_CLIP_PIXELS = dict(image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711])
CURATED: dict[str, tuple[str, dict, dict]] = {
    "openai/clip-vit-base-patch16": (
        "clip", dict(vision_config=dict(patch_size=16), projection_dim=512),
        dict(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}, do_center_crop=True, resample=3, **_CLIP_PIXELS),
    ),
    "google/siglip-base-patch16-224": (
        "siglip", dict(text_config=dict(bos_token_id=None, eos_token_id=1, pad_token_id=1)),
        dict(size={"height": 224, "width": 224}, resample=3, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]),
    ),
    # SigLIP 2 NaFlex: each image at its own aspect ratio, in at most 256 patches of 16 px (Apache 2.0)
    "google/siglip2-base-patch16-naflex": (
        "siglip2", dict(text_config=dict(vocab_size=256000)),
        dict(max_num_patches=256, patch_size=16, resample=2, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]),
    ),
    # SmolVLM-256M: SigLIP B/16 at 512 px, pixel-shuffled 4 x 4 into 64 tokens, SmolLM2-135M (Apache 2.0)
    "HuggingFaceTB/SmolVLM-256M-Instruct": (
        "idefics3",
        dict(vision_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, image_size=512,
                                patch_size=16),
             text_config=dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                              num_key_value_heads=3, head_dim=64, vocab_size=49280, max_position_embeddings=8192, rms_norm_eps=1e-5,
                              tie_word_embeddings=False),
             scale_factor=4, image_token_id=49190, tie_word_embeddings=False),
        dict(max_image_size={"longest_edge": 512}, size={"longest_edge": 2048}, resample=1, image_mean=[0.5, 0.5, 0.5],
             image_std=[0.5, 0.5, 0.5]),
    ),
    # Qwen2.5-VL 3B: a 32-block windowed tower, merged 2 x 2, and a 36-layer language model (Qwen research licence)
    "Qwen/Qwen2.5-VL-3B-Instruct": (
        "qwen2_5_vl",
        dict(vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14, window_size=112,
                                fullatt_block_indexes=[7, 15, 23, 31], out_hidden_size=2048, spatial_merge_size=2, temporal_patch_size=2),
             text_config=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                              vocab_size=151936, tie_word_embeddings=True),
             tie_word_embeddings=True),
        dict(min_pixels=3136, max_pixels=12845056, patch_size=14, merge_size=2, temporal_patch_size=2, **_CLIP_PIXELS),
    ),
}
# the menu's line of each curated vision–language model
_CURATED_VLM_WORDS = {
    "HuggingFaceTB/SmolVLM-256M-Instruct": "SmolVLM-256M, a vision–language model small enough for a CPU: ask it about the image in the "
                                           "Ask tab; the other tabs show its SigLIP B/16 tower at 512 px",
    "Qwen/Qwen2.5-VL-3B-Instruct": "Qwen2.5-VL 3B, a vision–language model for a GPU: ask it about the image in the Ask tab; the other "
                                   "tabs show its 32-block windowed tower at 448 px",
}
_CONFIGS = {"clip": "CLIPConfig", "siglip": "SiglipConfig", "siglip2": "Siglip2Config", "idefics3": "Idefics3Config",
            "qwen2_5_vl": "Qwen2_5_VLConfig"}


def _curated_config(repo: str) -> Any:
    """The transformers config of a curated repository, from what is known of it (`CURATED`)."""
    kind, overrides, _ = CURATED[repo]
    return getattr(_transformers(), _CONFIGS[kind])(**overrides)


def _curated_spec(repo: str) -> VariantSpec:
    """The spec of a curated repository from its known config (transformers' classes' defaults are
    those of the base models: CLIP ViT-B/32, SigLIP B/16 at 224 px, SigLIP 2 B/16 NaFlex); a
    vision–language model's is its tower's, asked (`VariantSpec.vlm`), with its menu line."""
    kind, _, processor = CURATED[repo]
    cfg = _curated_config(repo)
    where = dict(name=f"hf:{repo}", weights=f"Hugging Face {repo}", processor=processor, locator=repo)
    if kind in QWEN_TYPES:
        spec = qwen_spec(cfg, **where)
    elif kind in VLM_TYPES:
        spec = tower_spec(cfg, **where)
    else:
        model = SimpleNamespace(config=cfg)  # an image–text model's ViTConfig and spec read its config alone
        return _spec(model, config_from_transformers(model), **where)
    return dataclasses.replace(spec, vlm=kind, description=f"Hugging Face {repo}: {_CURATED_VLM_WORDS[repo]}")


def _read_json(path: Path) -> dict | None:
    """A JSON file's content, or None where there is no such file."""
    if not path.is_file():
        return None
    with open(path) as f:
        return json.load(f)


# Where a saved model keeps its image processor, in the order transformers reads them: the processor's
# file (transformers 5's `save_pretrained` of a processor nests the image processor in it), then the
# image processor's own file.
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
NO_PROCESSOR = ("no image processor saved (processor_config.json or preprocessor_config.json): fed as ImageNet's models are "
                "(ImageNet's mean and std, bicubic resize to S/0.875, centre crop)")


def image_processor_config(read: Callable[[str], dict | None]) -> dict | None:
    """The image processor's settings as transformers reads them from a saved model: the
    "image_processor" inside processor_config.json when it is there, else preprocessor_config.json;
    None where neither holds one.

    Args:
        read: a file name of `PROCESSOR_FILES` -> its JSON content, or None where there is no such file.
    """
    nested = read("processor_config.json")
    if isinstance(nested, dict) and isinstance(nested.get("image_processor"), dict):
        return nested["image_processor"]
    return read("preprocessor_config.json")


def _noted(spec: VariantSpec, processor: dict | None) -> VariantSpec:
    """`spec` whose description says so when the model came without an image processor (and a
    warning): its pixels are then an assumption, never a silent default."""
    if processor is not None:
        return spec
    warnings.warn(f"{spec.name}: {NO_PROCESSOR}", stacklevel=3)
    return dataclasses.replace(spec, description=f"{spec.description}; {NO_PROCESSOR}")


def _split(name: str) -> tuple[str, int | None]:
    """"hf:<repo id>[@<size>]" -> (<repo id>, size), checked before anything is fetched or opened."""
    rest = name.removeprefix("hf:")
    repo = rest.rpartition("@")[0] if "@" in rest else rest
    if not _is_repo_id(repo):
        raise ValueError(_NOT_A_REPO)
    return repo, split_size(name)[1]


ASKED = "a vision–language model: its language model answers questions about the image (vitviz.ask, the app's Ask tab)"
NOT_ASKED = ("no processor saved (an image processor and a tokenizer): the tower alone, which vitviz.ask cannot ask "
             "(it needs the processor)")
_WHOLE_PARAMS: dict[str, int] = {}  # a hub repository -> its whole VLM's parameters (`HuggingFaceSource.num_params`)


def _ask_family(cfg: Any) -> str | None:
    """The family `vitviz.ask` asks of a checkpoint of this config (its model type, `HF_VLM_TYPES`), or
    None: another model type, or a checkpoint of the bare `...Model` (no language-model head)."""
    kind = getattr(cfg, "model_type", None)
    archs = getattr(cfg, "architectures", None) or []
    if kind not in HF_VLM_TYPES or (archs and all(a.endswith("Model") for a in archs)):
        return None
    return kind


def _asked(spec: VariantSpec, cfg: Any, *, at_hand: bool) -> VariantSpec:
    """A VLM tower's spec with its `vlm` the family `vitviz.ask` asks, where the processor is
    `at_hand` and can be made; else its description (and a warning) saying why the tower loads alone
    (no processor saved; SmolVLM's processor without num2words)."""
    family = _ask_family(cfg)
    if family is None:
        return spec
    why = None if at_hand else NOT_ASKED
    if why is None and family == "smolvlm" and not _transformers().utils.is_num2words_available():
        why = "its processor (SmolVLMProcessor) needs num2words (pip install num2words): the tower alone, which vitviz.ask cannot ask"
    if why is None:
        return dataclasses.replace(spec, vlm=family, description=f"{spec.description}; {ASKED}")
    warnings.warn(f"{spec.name}: {why}", stacklevel=3)
    return dataclasses.replace(spec, description=f"{spec.description}; {why}")


def _holding_vlm(ours: ViT, model: nn.Module, processor: Any) -> ViT:
    """`ours`, the vision tower converted from the VLM `model`, holding the VLM's adapter as
    `ours.__dict__["vlm"]` (`vitviz.vlm.hf.hf_vlm(model, processor, tower=ours)`: the model stays
    where it is) and its spec's `vlm` the family, where `vitviz.ask` asks `model` and `processor` is a
    whole processor (with a tokenizer); else `ours` as it is."""
    if processor is None or getattr(processor, "tokenizer", None) is None or _ask_family(model.config) is None:
        return ours
    from vitviz.vlm.hf import hf_vlm

    try:
        vlm = hf_vlm(model, processor, tower=ours)
    except TypeError:  # a model of another class than the family's `...ForConditionalGeneration`
        return ours
    ours.spec = dataclasses.replace(ours.spec, vlm=vlm.family)
    ours.__dict__["vlm"] = vlm
    return ours


def from_transformers(model: nn.Module, *, processor: Any = None, tokenizer: Any = None) -> ViT | ImageTextModel:
    """A vitviz ViT with the weights of a Hugging Face `ViTModel`, `ViTForImageClassification`,
    `Dinov2Model` or `Dinov2WithRegistersModel`, giving the same outputs, on the model's device and
    dtype and in its train/eval mode; preprocessing from `processor` (an image processor or its
    config dict) when given (`ViT.from_transformers` is this function).

    A `CLIPModel`, `SiglipModel` or `Siglip2Model` becomes a `vitviz.imagetext.ImageTextModel` with the same `logits_per_image`; its
    spec is its image tower's (no classes) and its `tokenizer` the one given (else None).

    A Qwen2.5-VL or Qwen3-VL model (or its vision model) becomes its vision tower,
    `vitviz.sources.hf_qwen.QwenVisionTower`; an Idefics3, SmolVLM, LLaVA or LLaVA-OneVision model its
    vision tower (`vitviz.sources.hf_vlm`). Given the whole processor (with its tokenizer) of a model
    `vitviz.ask` asks (Idefics3, SmolVLM, LLaVA, Qwen2.5-VL `...ForConditionalGeneration`), the tower
    holds the model's adapter (`vitviz.vlm.hf.hf_vlm`; the model is not moved) and its spec's `vlm` is
    the family, so that `vitviz.ask(tower, ...)` asks the model.
    """
    if getattr(model.config, "model_type", None) in VIDEO_TYPES:  # a video transformer: vitviz.video.hf (a VideoViT)
        return video_from_transformers(model, processor=processor)
    if getattr(model.config, "model_type", None) in (*QWEN_TYPES, *VLM_TYPES):  # a VLM: its vision tower (hf_vlm, hf_qwen)
        return _holding_vlm(vision_tower(model, processor), model, processor)
    if getattr(model.config, "model_type", None) in _SWIN:  # hierarchical, windowed: vitviz.sources.swin
        from vitviz.sources.swin import swin_from_transformers
        return swin_from_transformers(model, preprocessing=preprocessing_from_processor(processor, model.config.image_size))
    name = getattr(model.config, "_name_or_path", "") or type(model).__name__
    config = config_from_transformers(model)
    if model.config.model_type in IMAGE_TEXT:
        if not hasattr(model, "text_model"):
            raise NotImplementedError(f"{type(model).__name__} has no text tower; vitviz converts the image–text model (CLIPModel, SiglipModel)")
        siglip = model.config.model_type in SIGLIP
        ours = ImageTextModel(config, text_config_from_transformers(model), image_projection=not siglip, logit_bias=siglip)
        ours.load_state_dict(convert_image_text_state_dict(model))
        ours.tokenizer = tokenizer
    else:
        ours = ViT(config)
        ours.load_state_dict(convert_transformers_state_dict(model, config))
    ours.spec = _spec(model, config, name=f"hf:{name}", weights="converted from a Hugging Face model instance", processor=processor)
    param = next(model.parameters())
    return ours.to(device=param.device, dtype=param.dtype).train(model.training)


@register_source
class HuggingFaceSource(WeightsSource):
    name = "hf"
    prefix = "hf:"
    library = "transformers"
    hub = True

    def specs(self) -> list[VariantSpec]:
        """The curated image–text and vision–language models (`CURATED`); any other repository by name
        ("hf:<repo id>"), whose config is only known once fetched."""
        try:
            _transformers()
        except ImportError:
            return []
        return [_curated_spec(repo) for repo in CURATED]

    def _config(self, repo: str):
        transformers = _transformers()
        try:
            return transformers.AutoConfig.from_pretrained(repo, local_files_only=hub_offline() or not hub_reachable())
        except OSError as exc:
            raise WeightsUnavailableError(missing_message(f"hf:{repo}", repo, f"its config.json: {exc}", weights_path_hint="a folder saved with save_pretrained")) from None

    def resolve(self, name: str, *, weights_path: str | None = None) -> VariantSpec:
        repo, size = _split(name)  # the name is checked first, with or without a folder
        if weights_path is None:
            cfg = self._config(repo)
            where = dict(weights=f"Hugging Face {repo}", processor=self._processor(repo), locator=repo)
            folder = None
        else:
            folder = _saved_folder(weights_path, name)
            cfg = _transformers().AutoConfig.from_pretrained(folder, local_files_only=True)
            where = dict(weights=f"saved with save_pretrained in {folder}", processor=image_processor_config(lambda f: _read_json(folder / f)),
                         locator=str(folder), saved_in=folder.name)
        if getattr(cfg, "model_type", None) in VIDEO_TYPES:  # a video transformer: vitviz.video.hf (a VideoSpec)
            processor = folder_video_processor(folder) if folder is not None else hub_video_processor(repo) or where["processor"]
            spec = video_spec(cfg, name=name, weights=where["weights"], processor=processor, locator=where["locator"],
                              saved_in=where.get("saved_in", ""))
            return spec.at(size) if size else spec
        if getattr(cfg, "model_type", None) in QWEN_TYPES:  # Qwen-VL's vision tower: vitviz.sources.hf_qwen
            spec = qwen_spec(cfg, name=name, **where)
        elif getattr(cfg, "model_type", None) in VLM_TYPES:  # a VLM: its vision tower, vitviz.sources.hf_vlm
            spec = tower_spec(cfg, name=name, **where)
        else:
            spec = None
        if spec is not None:  # a VLM's tower, asked where its processor is at hand (an image processor and a tokenizer)
            at_hand = _ask_family(cfg) is not None and where["processor"] is not None and self._has_tokenizer(repo, folder)
            spec = _asked(spec, cfg, at_hand=at_hand)
            return spec.at(size) if size else spec
        if getattr(cfg, "model_type", None) in _SWIN:  # hierarchical, windowed: vitviz.sources.swin
            from vitviz.sources.swin import swin_spec_from_transformers
            spec = swin_spec_from_transformers(cfg, name=name, weights=where["weights"], locator=where["locator"], saved_in=where.get("saved_in", ""),
                                               preprocessing=preprocessing_from_processor(where["processor"], cfg.image_size))
            spec = _noted(spec, where["processor"])
            return spec.at(size) if size else spec
        if getattr(cfg, "model_type", None) not in TYPES:
            raise ValueError(f"{name} is a {getattr(cfg, 'model_type', '?')} model; vitviz reads ViT, DINOv2, DINOv2 with registers, "
                             "DINOv3, AIMv2's vision model, CLIP, SigLIP and SigLIP 2")
        with torch.device("meta"):
            model = self._model_class(cfg)._from_config(cfg)
        spec = _noted(_spec(model, config_from_transformers(model), name=name, **where), where["processor"])
        return spec.at(size) if size else spec

    @staticmethod
    def _model_class(cfg):
        transformers = _transformers()
        archs = getattr(cfg, "architectures", None) or []
        if cfg.model_type in VIDEO_TYPES:  # the encoder, or its video classifier: vitviz.video.hf
            return video_model_class(cfg)
        if cfg.model_type in VLM_TYPES:  # the whole VLM; `convert` keeps its vision tower
            return vlm_model_class(cfg)
        if cfg.model_type in _SWIN:  # SwinModel, SwinForImageClassification, Swinv2Model, Swinv2ForImageClassification
            kind = "ForImageClassification" if any(a.endswith("ForImageClassification") for a in archs) else "Model"
            return getattr(transformers, f"Swin{'v2' if cfg.model_type == 'swinv2' else ''}{kind}")
        if cfg.model_type == "vit" and any(a.endswith("ForImageClassification") for a in archs):
            return transformers.ViTForImageClassification
        if cfg.model_type in IMAGE_TEXT and any(a.endswith("ForImageClassification") for a in archs):
            raise NotImplementedError(f"{archs[0]} (an image tower with a classifier, no text tower) is not modelled by vitviz")
        return {"vit": transformers.ViTModel, "dinov2": transformers.Dinov2Model,
                "dinov2_with_registers": transformers.Dinov2WithRegistersModel, "dinov3_vit": transformers.DINOv3ViTModel,
                "aimv2_vision_model": transformers.Aimv2VisionModel,
                "clip": transformers.CLIPModel,
                "siglip": transformers.SiglipModel, "siglip2": transformers.Siglip2Model}[cfg.model_type]

    @staticmethod
    def _tokenizer(source: str, *, local: bool) -> Any:
        """The tokenizer of a repository or saved folder, or None where it has none (or, offline, where
        its files are not at hand)."""
        if local:
            folder = Path(source) if os.path.isabs(source) else None
            there = any((folder / f).is_file() for f in _TOKENIZER_FILES) if folder else cached_file(source, _TOKENIZER_FILES)
            if not there:
                return None
        try:
            return _transformers().AutoTokenizer.from_pretrained(source, local_files_only=local)
        except OSError:
            return None

    @staticmethod
    def _has_tokenizer(repo: str, folder: Path | None) -> bool:
        """Whether a tokenizer is at hand: saved in `folder`, or for a repository in the hub's cache or
        on the hub when it can be reached."""
        if folder is not None:
            return any((folder / f).is_file() for f in _TOKENIZER_FILES)
        return cached_file(repo, _TOKENIZER_FILES) is not None or (not hub_offline() and hub_reachable())

    @staticmethod
    def _processor(repo: str) -> dict | None:
        """The repository's image processor settings (`image_processor_config`), from the cache or,
        online, the hub."""
        online = not hub_offline() and hub_reachable()

        def read(filename: str) -> dict | None:
            path = cached_file(repo, (filename,))
            if path is None and online:
                from huggingface_hub import hf_hub_download
                from huggingface_hub.errors import EntryNotFoundError

                try:
                    path = hf_hub_download(repo, filename)
                except (OSError, EntryNotFoundError):  # not in the repository (or the hub is gone)
                    path = None
            return None if path is None else _read_json(Path(path))

        return image_processor_config(read)

    def status(self, spec: VariantSpec) -> Status:
        if os.path.isabs(spec.locator):  # a folder of the user's own (a repo id is never absolute)
            return "cached"
        return "cached" if cached_file(spec.locator, ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")) else "download"

    def reachable(self) -> bool:
        return hub_reachable()

    def num_params(self, spec: VariantSpec) -> int:
        """The tower's parameters; for a VLM's tower that holds its VLM (`spec.vlm`), the whole VLM's,
        counted on the model built without memory ("meta") from its config (a curated model's known one,
        else the one in the hub's cache or the saved folder), once per hub repository."""
        if spec.vlm not in HF_VLM_TYPES:
            return super().num_params(spec)
        key = spec.locator
        if key in _WHOLE_PARAMS:
            return _WHOLE_PARAMS[key]
        transformers = _transformers()
        try:
            cfg = _curated_config(key) if key in CURATED else transformers.AutoConfig.from_pretrained(key, local_files_only=True)
        except (OSError, ValueError):  # the config is gone: the tower's count (a loaded model is counted whole again)
            return super().num_params(spec)
        if getattr(cfg, "model_type", None) not in HF_VLM_TYPES:
            return super().num_params(spec)
        with torch.device("meta"):
            model = getattr(transformers, HF_VLM_TYPES[cfg.model_type])._from_config(cfg)
        count = sum(p.numel() for p in model.parameters())
        if not os.path.isabs(key):  # a folder of the user's may hold another model later
            _WHOLE_PARAMS[key] = count
        return count

    def load(self, spec: VariantSpec, *, weights_path: str | None = None, progress: bool = True) -> ViT | ImageTextModel:
        """The model from the hub (through its cache), or with `weights_path` from a folder saved
        with `save_pretrained`, read alone (`local_files_only`); an image–text model with the
        tokenizer found beside its weights (None where there is none); a VLM's tower that holds its VLM
        where `spec.vlm` says so (`_load_asked`)."""
        repo, _ = _split(spec.name)
        if weights_path is not None:
            source = str(_saved_folder(weights_path, spec.name))
            cfg = _transformers().AutoConfig.from_pretrained(source, local_files_only=True)
            local = True
        else:
            source = repo
            local = hub_offline() or not hub_reachable()
            if local and self.status(spec) != "cached":
                why = "VITVIZ_OFFLINE or HF_HUB_OFFLINE is set" if hub_offline() else "huggingface.co cannot be reached"
                raise WeightsUnavailableError(missing_message(spec.name, repo, why, weights_path_hint="a folder saved with save_pretrained"))
            cfg = self._config(repo)
        if spec.vlm in HF_VLM_TYPES:  # the whole VLM, asked: its tower holds it
            return self._load_asked(spec, repo, weights_path)
        if getattr(cfg, "model_type", None) in QWEN_TYPES:  # the vision tower's weights alone: vitviz.sources.hf_qwen
            ours = load_qwen_tower(cfg, source, name=spec.name, local=local)
            ours.spec = spec
            return ours
        try:
            model = self._model_class(cfg).from_pretrained(source, local_files_only=local)
        except OSError as exc:
            if weights_path is not None:
                raise FileNotFoundError(f"the weights of {spec.name} are not in {source} ({type(exc).__name__}: {exc})") from exc
            raise WeightsUnavailableError(
                missing_message(spec.name, repo, f"{type(exc).__name__}: {exc}", weights_path_hint="a folder saved with save_pretrained")
            ) from exc
        ours = self.convert(model.eval())
        if isinstance(ours, ImageTextModel):
            ours.tokenizer = self._tokenizer(source, local=local)
            from vitviz.sources.torchvision import _imagenet_categories

            if ours.tokenizer is not None:  # zero-shot over ImageNet's classes unless told otherwise
                ours.labels = _imagenet_categories()
        ours.spec = spec  # the spec `resolve` read (with its image processor); the converted one has none
        return ours

    @staticmethod
    def _load_asked(spec: VariantSpec, repo: str, weights_path: str | None) -> ViT:
        """The whole VLM and its processor, loaded once (`vitviz.vlm.hf.load_vlm`, frozen), its vision
        tower converted from it, holding its adapter as `tower.__dict__["vlm"]`: the adapter's model
        follows the tower's device and dtype when a prompt is made (`load_model` moves the tower alone);
        a Qwen2.5-VL processor is bounded to the tower's square (`fit_pixels(S * S)`, S the spec's image
        size: 448 px, 256 image tokens), the crop the app asks about, so that `ask_shape` prices what runs."""
        from vitviz.vlm.hf import hf_vlm, load_vlm

        whole = load_vlm(repo, weights_path=weights_path)
        model = whole.model.requires_grad_(False)
        ours = from_transformers(model)  # the tower alone (no processor: nothing attached here)
        ours.spec = spec
        vlm = hf_vlm(model, whole.processor, tower=ours, follow=True)
        vlm.name = repo
        if hasattr(vlm, "fit_pixels"):
            vlm.fit_pixels(spec.preprocessing.image_size ** 2)
        ours.__dict__["vlm"] = vlm
        return ours.eval()

    def convert(self, model: nn.Module, *, processor: Any = None, **options) -> ViT | ImageTextModel:
        return from_transformers(model, processor=processor, **options)


ViT.from_transformers = staticmethod(from_transformers)  # the same function, for existing callers
