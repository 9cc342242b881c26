"""open_clip's CLIP models (`open_clip.model.CLIP` with its own `VisionTransformer`): OpenAI's CLIP and
the LAION, DataComp, DFN and MetaCLIP trainings of the same architectures (ViT-B/32, B/16, L/14, H/14,
...), as `vitviz.imagetext.ImageTextModel`s with open_clip's tokenizer.

    vitviz.load_model("open_clip:ViT-B-16/laion2b_s34b_b88k")
    vitviz.load_model("open_clip:ViT-B-32/openai")
    vitviz.from_open_clip(model, tokenizer=open_clip.get_tokenizer("ViT-B-16"))   # a model in hand

open_clip is imported only here, and only when used (`pip install open_clip_torch`). A name is
"open_clip:<architecture>/<pretrained tag>", both as `open_clip.list_pretrained()` lists them; the
weights come through the Hugging Face cache (the tag's `hf_hub` repository), the preprocessing from
the tag's config (mean, std, interpolation, resize mode) and the activation from its `quick_gelu`.

Read: the image tower's cls token ("tok" pooling) after `ln_post`, projected; the text at its
end-of-text token (the highest id, "argmax" pooling, or the tokenizer's end-of-text id, "eos") or at
its last position ("last") after `ln_final`, projected, under a causal mask. Models with another pooling (an attentional pooler, CoCa), a timm or Hugging Face tower
(SigLIP in open_clip, ConvNeXt, ResNets) or LayerScale in the text tower are refused with the reason
(a Hugging Face or timm tower and CoCa from the architecture's config, before anything is built).
With VITVIZ_OFFLINE or HF_HUB_OFFLINE nothing is fetched: weights and a Hugging Face tokenizer come
from the hub's cache, or the load is refused at once saying what to download.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from vitviz.config import Preprocessing, TextConfig, ViTConfig
from vitviz.imagetext import ImageTextModel
from vitviz.sources.base import Status, VariantSpec, WeightsSource, WeightsUnavailableError, register_source
from vitviz.sources.hub import cached_file, hub_offline, hub_reachable, missing_message

__all__ = ["OpenClipSource", "OpenClipTokenizer", "from_open_clip", "open_clip_configs", "convert_open_clip_state_dict"]

_NAME = re.compile(r"^open_clip:([A-Za-z0-9][A-Za-z0-9._-]{0,80})/([A-Za-z0-9][A-Za-z0-9._-]{0,80})$")
_WEIGHT_FILES = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


def _open_clip():
    try:
        import open_clip
    except ImportError:
        raise ImportError("open_clip models need open_clip: pip install open_clip_torch") from None
    return open_clip


class OpenClipTokenizer:
    """open_clip's tokenizer behind the call `ImageTextModel.tokenize` makes of a Hugging Face one:
    `tokenizer(texts, ...)` -> {"input_ids": [T, C]}: ids padded with 0 to the context length (what
    open_clip feeds its text tower; the causal mask keeps the padding after the end-of-text token
    from reaching it, so there is no attention mask)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, texts: Sequence[str], **options: Any) -> dict[str, torch.Tensor]:
        length = options.get("max_length") or getattr(self.tokenizer, "context_length", 77)
        return {"input_ids": self.tokenizer(list(texts), context_length=length)}


def _act(block: nn.Module) -> str:
    name = type(block.mlp.gelu).__name__
    if name == "QuickGELU":
        return "quick_gelu"
    if isinstance(block.mlp.gelu, nn.GELU):
        return "gelu_tanh" if block.mlp.gelu.approximate == "tanh" else "gelu"
    raise NotImplementedError(f"the activation {name} of this open_clip model is not modelled by vitviz")


def _check(model: nn.Module) -> None:
    """A clear refusal of what vitviz does not model."""
    open_clip = _open_clip()
    visual = getattr(model, "visual", None)
    if not isinstance(visual, open_clip.transformer.VisionTransformer) or not hasattr(model, "token_embedding"):
        raise NotImplementedError(
            f"{type(model).__name__} with a {type(visual).__name__} image tower: vitviz reads open_clip's CLIP with its own "
            "VisionTransformer and text transformer (not timm or Hugging Face towers, ResNets or CoCa)"
        )
    if visual.attn_pool is not None or visual.pool_type != "tok" or visual.final_ln_after_pool:
        raise NotImplementedError("this open_clip image tower pools otherwise than its cls token after ln_post; vitviz reads that one")
    if model.text_pool_type not in ("argmax", "eos", "last"):
        raise NotImplementedError(f"this open_clip text tower reads its text by {model.text_pool_type!r}; vitviz reads the highest id, "
                                  "an end-of-text id or the last position")
    for block in model.transformer.resblocks:
        if not isinstance(block.ls_1, nn.Identity) or getattr(block, "ln_attn", None) is not None:
            raise NotImplementedError("an open_clip text tower with LayerScale or extra norms is not modelled by vitviz")


def _check_config(arch: str, config: dict) -> None:
    """What vitviz does not model, refused from the architecture's config before anything is built:
    building a Hugging Face text tower fetches its config from the hub, with retries when offline."""
    vision, text = config.get("vision_cfg") or {}, config.get("text_cfg") or {}
    towers = "vitviz reads open_clip's CLIP with its own VisionTransformer and text transformer"
    if text.get("hf_model_name"):
        raise NotImplementedError(f"open_clip's {arch} has a Hugging Face text tower ({text['hf_model_name']}): {towers}")
    if vision.get("timm_model_name"):
        raise NotImplementedError(f"open_clip's {arch} has a timm image tower ({vision['timm_model_name']}): {towers}")
    if config.get("multimodal_cfg"):
        raise NotImplementedError(f"open_clip's {arch} is a CoCa (a text decoder beside the towers): {towers}")


def _mlp_dim(blocks: nn.ModuleList) -> int:
    return blocks[0].mlp.c_fc.out_features


def _text_projection(model: nn.Module) -> torch.Tensor:
    """The text projection as a [E, D] weight (open_clip keeps a [D, E] matrix or an nn.Linear)."""
    p = model.text_projection
    return p.weight if isinstance(p, nn.Linear) else p.T


def open_clip_configs(model: nn.Module) -> tuple[ViTConfig, TextConfig]:
    """The `ViTConfig` of an open_clip CLIP's image tower and the `TextConfig` of its text tower."""
    _check(model)
    visual, blocks = model.visual, model.visual.transformer.resblocks
    ls = blocks[0].ls_1
    vision = ViTConfig(
        image_size=int(visual.image_size[0]),
        patch_size=int(visual.patch_size[0]),
        width=visual.conv1.out_channels,
        depth=len(blocks),
        heads=blocks[0].attn.num_heads,
        mlp_dim=_mlp_dim(blocks),
        num_classes=0,
        layer_scale=None if isinstance(ls, nn.Identity) else 1.0,  # the gammas themselves are loaded
        patch_bias=visual.conv1.bias is not None,
        norm_pre=not isinstance(visual.ln_pre, nn.Identity),
        final_norm=True,
        act=_act(blocks[0]),
        eps=visual.ln_post.eps,
    )
    text_blocks = model.transformer.resblocks
    text = TextConfig(
        vocab_size=model.token_embedding.num_embeddings,
        context_length=model.positional_embedding.shape[0],
        width=model.token_embedding.embedding_dim,
        depth=len(text_blocks),
        heads=text_blocks[0].attn.num_heads,
        mlp_dim=_mlp_dim(text_blocks),
        embed_dim=_text_projection(model).shape[0],
        causal=model.attn_mask is not None,
        pool="last" if model.text_pool_type == "last" else "eos",
        # "argmax": the end-of-text token has the highest id; "eos": the first position holding the tokenizer's id
        eos_token_id=getattr(model, "text_eos_id", None) if model.text_pool_type == "eos" else None,
        proj_bias=isinstance(model.text_projection, nn.Linear) and model.text_projection.bias is not None,
        act=_act(text_blocks[0]),
        eps=model.ln_final.eps,
    )
    return vision, text


def _blocks(blocks: nn.ModuleList, prefix: str) -> dict[str, torch.Tensor]:
    """open_clip's residual attention blocks under vitviz's block names."""
    sd: dict[str, torch.Tensor] = {}
    for i, b in enumerate(blocks):
        p = f"{prefix}blocks.{i}."
        sd[p + "norm1.weight"], sd[p + "norm1.bias"] = b.ln_1.weight, b.ln_1.bias
        sd[p + "norm2.weight"], sd[p + "norm2.bias"] = b.ln_2.weight, b.ln_2.bias
        sd[p + "attn.qkv.weight"], sd[p + "attn.qkv.bias"] = b.attn.in_proj_weight, b.attn.in_proj_bias
        sd[p + "attn.proj.weight"], sd[p + "attn.proj.bias"] = b.attn.out_proj.weight, b.attn.out_proj.bias
        sd[p + "mlp.0.weight"], sd[p + "mlp.0.bias"] = b.mlp.c_fc.weight, b.mlp.c_fc.bias
        sd[p + "mlp.2.weight"], sd[p + "mlp.2.bias"] = b.mlp.c_proj.weight, b.mlp.c_proj.bias
        if not isinstance(b.ls_1, nn.Identity):
            sd[p + "ls1.gamma"], sd[p + "ls2.gamma"] = b.ls_1.gamma, b.ls_2.gamma
    return sd


def convert_open_clip_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """An open_clip CLIP's weights under the names of a `vitviz.imagetext.ImageTextModel`."""
    _check(model)
    v = model.visual
    sd: dict[str, torch.Tensor] = {
        "image.patch_embed.proj.weight": v.conv1.weight,
        "image.cls_token": v.class_embedding.reshape(1, 1, -1),
        "image.pos_embed": v.positional_embedding[None],  # [1, 1 + gh*gw, D]: the cls token's first
        "image.norm.weight": v.ln_post.weight,
        "image.norm.bias": v.ln_post.bias,
        "image_projection.weight": v.proj.T,  # open_clip computes x @ proj
        "text.token_embed.weight": model.token_embedding.weight,
        "text.pos_embed": model.positional_embedding[None],
        "text.norm.weight": model.ln_final.weight,
        "text.norm.bias": model.ln_final.bias,
        "text.proj.weight": _text_projection(model),
        "logit_scale": model.logit_scale.reshape(()),
    }
    if v.conv1.bias is not None:
        sd["image.patch_embed.proj.bias"] = v.conv1.bias
    if not isinstance(v.ln_pre, nn.Identity):
        sd["image.norm_pre.weight"], sd["image.norm_pre.bias"] = v.ln_pre.weight, v.ln_pre.bias
    if isinstance(model.text_projection, nn.Linear) and model.text_projection.bias is not None:
        sd["text.proj.bias"] = model.text_projection.bias
    if getattr(model, "logit_bias", None) is not None:
        sd["logit_bias"] = model.logit_bias.reshape(())
    sd |= _blocks(v.transformer.resblocks, "image.") | _blocks(model.transformer.resblocks, "text.")
    return {k: t.detach() for k, t in sd.items()}


def _preprocessing(cfg: dict, image_size: int) -> Preprocessing:
    """open_clip's image transform for evaluation as vitviz's: "shortest" resizes the shorter side and
    centre-crops, "squash" resizes to the square ("longest", padding, is not modelled: read as "shortest")."""
    mean = tuple(cfg.get("mean") or (0.48145466, 0.4578275, 0.40821073))
    std = tuple(cfg.get("std") or (0.26862954, 0.26130258, 0.27577711))
    interpolation = cfg.get("interpolation") or "bicubic"
    mode = "squash" if cfg.get("resize_mode") == "squash" else "crop"
    return Preprocessing(image_size=image_size, resize_size=None, mode=mode, mean=mean, std=std, interpolation=interpolation)


def from_open_clip(
    model: nn.Module, *, preprocessing: Preprocessing | None = None, tokenizer: Any = None, name: str | None = None
) -> ImageTextModel:
    """A vitviz `ImageTextModel` with the weights of an open_clip CLIP, the same logits (open_clip's
    `logit_scale.exp() * image @ text.T` of the normalised features), on the model's device and dtype,
    in its train/eval mode.

    Args:
        preprocessing: how the model wants its images (default: the model's `preprocess_cfg`).
        tokenizer: open_clip's tokenizer for it (`open_clip.get_tokenizer(arch)`), wrapped for
            `ImageTextModel.tokenize`; None leaves the model without one.
        name: the spec's name (default "open_clip:<class name>").
    """
    vision, text = open_clip_configs(model)
    ours = ImageTextModel(vision, text, logit_bias=getattr(model, "logit_bias", None) is not None)
    ours.load_state_dict(convert_open_clip_state_dict(model))
    if preprocessing is None:
        preprocessing = _preprocessing(getattr(model.visual, "preprocess_cfg", None) or {}, vision.image_size)
    ours.spec = VariantSpec(
        name=name or f"open_clip:{type(model).__name__}", config=vision, preprocessing=preprocessing, categories=None,
        source="open_clip", weights="converted from an open_clip model instance",
        description=f"open_clip {name or type(model).__name__}: {vision.depth} x {vision.heads} x {vision.width}, /{vision.patch_size}, image–text",
    )
    ours.tokenizer = None if tokenizer is None else OpenClipTokenizer(tokenizer)
    param = next(model.parameters())
    return ours.to(device=param.device, dtype=param.dtype).train(model.training)


@register_source
class OpenClipSource(WeightsSource):
    name = "open_clip"
    prefix = "open_clip:"
    library = "open_clip"
    hub = True

    def specs(self) -> list[VariantSpec]:
        return []  # any architecture and tag by name ("open_clip:ViT-B-16/openai")

    @staticmethod
    def _split(name: str) -> tuple[str, str, dict]:
        """(architecture, tag, the tag's pretrained config), checked against open_clip's own lists."""
        m = _NAME.match(name)
        if not m:
            raise ValueError(f"an open_clip model is named open_clip:<architecture>/<pretrained tag> (e.g. open_clip:ViT-B-16/openai), got {name!r}")
        open_clip = _open_clip()
        arch, tag = m.groups()
        if arch not in open_clip.list_models():
            raise ValueError(f"open_clip has no architecture {arch!r} (open_clip.list_models() lists them)")
        _check_config(arch, open_clip.get_model_config(arch) or {})
        cfg = open_clip.get_pretrained_cfg(arch, tag)
        if not cfg or not cfg.get("hf_hub"):
            tags = ", ".join(open_clip.list_pretrained_tags_by_model(arch)) or "none"
            raise ValueError(f"open_clip has no pretrained weights {tag!r} for {arch} on the Hugging Face hub; its tags: {tags}")
        return arch, tag, cfg

    def resolve(self, name: str, *, weights_path: str | None = None) -> VariantSpec:
        arch, tag, cfg = self._split(name)
        vision, _ = _architecture(arch, bool(cfg.get("quick_gelu")))
        repo = cfg["hf_hub"].strip("/")
        return VariantSpec(
            name=name, config=vision, preprocessing=_preprocessing(cfg, vision.image_size), categories=None, source=self.name,
            weights=weights_path or f"open_clip {tag}, Hugging Face {repo}", locator=weights_path or repo,
            description=f"open_clip {arch} ({tag}): {vision.depth} x {vision.heads} x {vision.width}, /{vision.patch_size}, image–text",
        )

    def status(self, spec: VariantSpec) -> Status:
        if spec.locator.startswith("/"):
            return "cached"
        return "cached" if cached_file(spec.locator, _WEIGHT_FILES) else "download"

    def reachable(self) -> bool:
        return hub_reachable()

    def num_params(self, spec: VariantSpec) -> int:
        """Both towers' parameters, counted on the architecture built without memory ("meta")."""
        arch, _, cfg = self._split(spec.name)
        return _architecture(arch, bool(cfg.get("quick_gelu")))[1]

    def _weights(self, spec: VariantSpec) -> str:
        """The weights file: in the hub cache, or downloaded into it when the hub can be reached."""
        path = cached_file(spec.locator, _WEIGHT_FILES)
        if path is not None:
            return str(path)
        why = "VITVIZ_OFFLINE or HF_HUB_OFFLINE is set" if hub_offline() else "huggingface.co cannot be reached"
        if hub_offline() or not hub_reachable():
            raise WeightsUnavailableError(missing_message(spec.name, spec.locator, why, weights_path_hint="an open_clip checkpoint"))
        from huggingface_hub import hf_hub_download

        errors = []
        for file in _WEIGHT_FILES:
            try:
                return hf_hub_download(spec.locator, file)
            except OSError as exc:
                errors.append(f"{file}: {type(exc).__name__}")
        raise WeightsUnavailableError(missing_message(spec.name, spec.locator, "; ".join(errors), weights_path_hint="an open_clip checkpoint"))

    def _tokenizer(self, spec: VariantSpec, arch: str) -> Any:
        """open_clip's tokenizer for `arch`: its own vocabulary (shipped with it), or a Hugging Face
        tokenizer from the hub's cache, downloaded into it when the hub can be reached."""
        open_clip = _open_clip()
        repo = ((open_clip.get_model_config(arch) or {}).get("text_cfg") or {}).get("hf_tokenizer_name")
        if not repo:
            return open_clip.get_tokenizer(arch)
        if hub_offline() or not hub_reachable():
            why = "VITVIZ_OFFLINE or HF_HUB_OFFLINE is set" if hub_offline() else "huggingface.co cannot be reached"
            if cached_file(repo, _TOKENIZER_FILES) is None:
                raise WeightsUnavailableError(_tokenizer_missing(spec.name, repo, why))
            with _hub_offline():
                return open_clip.get_tokenizer(arch, local_files_only=True)
        try:
            return open_clip.get_tokenizer(arch)
        except OSError as exc:
            raise WeightsUnavailableError(_tokenizer_missing(spec.name, repo, type(exc).__name__)) from None

    def load(self, spec: VariantSpec, *, weights_path: str | None = None, progress: bool = True) -> ImageTextModel:
        arch, tag, cfg = self._split(spec.name)
        path = weights_path or self._weights(spec)
        tokenizer = self._tokenizer(spec, arch)  # (before the model is built: nothing is built for a refusal)
        open_clip = _open_clip()
        model = open_clip.create_model(arch, pretrained=str(path), force_quick_gelu=bool(cfg.get("quick_gelu")), device="cpu").eval()
        ours = from_open_clip(model, preprocessing=spec.preprocessing, tokenizer=tokenizer, name=spec.name)
        ours.labels = _imagenet_labels()
        ours.spec = spec
        return ours

    def convert(self, model: nn.Module, **options) -> ImageTextModel:
        return from_open_clip(model, **options)


def _architecture(arch: str, quick_gelu: bool) -> tuple[ViTConfig, int]:
    """The image tower's config and the whole model's parameters (both towers) of an open_clip
    architecture, built on the "meta" device (no memory, no weights); kept for its config's content."""
    config = json.dumps(_open_clip().get_model_config(arch), sort_keys=True, default=str)
    return _architecture_of(arch, quick_gelu, config)


@functools.lru_cache(maxsize=32)
def _architecture_of(arch: str, quick_gelu: bool, config: str) -> tuple[ViTConfig, int]:
    open_clip = _open_clip()
    with torch.device("meta"):
        model = open_clip.create_model(arch, pretrained=None, load_weights=False, force_quick_gelu=quick_gelu, device="meta")
    vision, _ = open_clip_configs(model)
    return vision, sum(p.numel() for p in model.parameters())


def _tokenizer_missing(name: str, repo: str, why: str) -> str:
    from huggingface_hub.constants import HF_HUB_CACHE

    return (f"The tokenizer of {name} ({repo}) is not in the Hugging Face cache and cannot be downloaded ({why}): on a machine "
            f"with network run `hf download {repo}` and copy its models--{repo.replace('/', '--')} folder into {HF_HUB_CACHE} "
            f"(set $HF_HOME to use another cache).")


_OFFLINE_LOCK = threading.Lock()
_offline = {"users": 0, "before": False}


@contextmanager
def _hub_offline():
    """huggingface_hub (and transformers, through it) offline while a cached tokenizer is read: only
    the hub's own switch keeps it from every call (before reading even a cached file it asks
    huggingface.co for its registry of agents). The switch goes back when the last reader is done."""
    from huggingface_hub import constants

    with _OFFLINE_LOCK:
        if _offline["users"] == 0:
            _offline["before"] = constants.HF_HUB_OFFLINE
        _offline["users"] += 1
        constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        with _OFFLINE_LOCK:
            _offline["users"] -= 1
            if _offline["users"] == 0:
                constants.HF_HUB_OFFLINE = _offline["before"]


def _imagenet_labels() -> tuple[str, ...]:
    from vitviz.sources.torchvision import _imagenet_categories

    return _imagenet_categories()
