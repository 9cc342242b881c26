"""Hugging Face transformers' video models as vitviz `VideoViT`s, with the same outputs:

    TimesformerModel, TimesformerForVideoClassification   divided (or joint) space-time attention, 1-frame patches
    VideoMAEModel, VideoMAEForVideoClassification         joint attention, 2-frame tubelets, sinusoidal positions
    VivitModel, VivitForVideoClassification               joint attention, tubelets, cls token, learned positions
    VJEPA2Model, VJEPA2ForVideoClassification             joint attention, 2-frame tubelets, 3D rotary positions

V-JEPA 2's encoder only (its predictor is left out); its classifier's attentive pooler too. ViViT's
pooler (a dense layer and tanh on the cls token, `VivitModel.pooler`) is left out: a `VivitModel`'s
features are the cls token after the final norm. Hugging Face's TimeSformer orders its patch tokens
position by position ((y, x) then t); vitviz's, like the other three, frame by frame ((t, y, x)).

What the model is fed (`VideoSpec`): `frames` frames of each clip, each resized (shorter side), centre-
cropped and normalised as the video processor says (its mean and std written for [0, 1] pixels: ViViT's
processor rescales to [−1, 1] before normalising with 0.5 and 0.5, which is mean 0.75 and std 0.25 on
[0, 1] pixels). Without a saved processor, the family's processor defaults at the model's frame size.
The frames of a clip: TimeSformer, VideoMAE and ViViT spread them uniformly over the video
(i * total // frames, transformers' `default_sample_indices_fn`; their processors take the frames they
are given); V-JEPA 2 takes consecutive frames at a stride of 4 (the V-JEPA data configs'
`sampling_rate: 4`), the clip centred in the video.

transformers is imported only when used.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from vitviz.config import IMAGENET_MEAN, IMAGENET_STD, Preprocessing
from vitviz.video.model import VideoConfig, VideoSpec, VideoViT

__all__ = [
    "VIDEO_TYPES",
    "video_from_transformers",
    "video_config_from_transformers",
    "video_spec",
    "video_preprocessing",
    "video_processor_config",
    "hub_video_processor",
    "video_model_class",
    "convert_video_state_dict",
]

VIDEO_TYPES = ("timesformer", "videomae", "vivit", "vjepa2")
_CLASSES = {
    "timesformer": ("TimesformerModel", "TimesformerForVideoClassification"),
    "videomae": ("VideoMAEModel", "VideoMAEForVideoClassification"),
    "vivit": ("VivitModel", "VivitForVideoClassification"),
    "vjepa2": ("VJEPA2Model", "VJEPA2ForVideoClassification"),
}
_FAMILY = {"timesformer": "TimeSformer", "videomae": "VideoMAE", "vivit": "ViViT", "vjepa2": "V-JEPA 2"}
_ACT = {"gelu": "gelu", "gelu_fast": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
        "quick_gelu": "quick_gelu", "silu": "silu", "swish": "silu"}
_IMAGENET_STANDARD = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
# each family's video processor defaults: (shorter side / crop side, mean, std, rescale to [-1, 1] first)
_PROCESSOR_DEFAULTS = {
    "timesformer": (224 / 224, IMAGENET_MEAN, IMAGENET_STD, False),
    "videomae": (224 / 224, *_IMAGENET_STANDARD, False),
    "vivit": (256 / 224, *_IMAGENET_STANDARD, True),
    "vjepa2": (256 / 224, IMAGENET_MEAN, IMAGENET_STD, False),
}
_RESAMPLE = {0: "nearest", 2: "bilinear", 3: "bicubic"}  # PIL's codes, as processors store them
VJEPA2_FRAME_STRIDE = 4


def _side(value: Any, name: str) -> int:
    side = tuple(value) if isinstance(value, (list, tuple)) else (value, value)
    if side[0] != side[1]:
        raise NotImplementedError(f"{name} {list(side)} is not square; vitviz's video models take square frames and patches")
    return int(side[0])


def _classifier(cfg: Any, model: nn.Module | None = None) -> bool:
    if model is not None:
        return type(model).__name__.endswith("ForVideoClassification")
    return any(a.endswith("ForVideoClassification") for a in (getattr(cfg, "architectures", None) or []))


def video_config_from_transformers(cfg: Any, *, classifier: bool) -> VideoConfig:
    """The `VideoConfig` of a Hugging Face video config (`model_type` one of `VIDEO_TYPES`), with the
    classifier's head where `classifier` (a `...ForVideoClassification`)."""
    kind = cfg.model_type
    if kind not in VIDEO_TYPES:
        raise ValueError(f"{kind!r} is not a video model vitviz reads ({', '.join(VIDEO_TYPES)})")
    act = _ACT.get(cfg.hidden_act) if isinstance(cfg.hidden_act, str) else None
    if act is None:
        raise NotImplementedError(f"the activation {cfg.hidden_act!r} is not one vitviz models ({', '.join(_ACT)})")
    classes = int(cfg.num_labels) if classifier else 0
    common = dict(width=cfg.hidden_size, depth=cfg.num_hidden_layers, heads=cfg.num_attention_heads, act=act, eps=cfg.layer_norm_eps,
                  num_classes=classes)
    if kind == "timesformer":
        if cfg.attention_type not in ("divided_space_time", "joint_space_time"):
            raise NotImplementedError(f"TimeSformer's {cfg.attention_type!r} attention is not modelled; divided_space_time and joint_space_time are")
        return VideoConfig(frames=cfg.num_frames, tubelet=1, image_size=_side(cfg.image_size, "image_size"),
                           patch_size=_side(cfg.patch_size, "patch_size"), mlp_dim=cfg.intermediate_size,
                           attention="divided" if cfg.attention_type == "divided_space_time" else "joint", class_token=True,
                           positions="divided", qkv_bias=cfg.qkv_bias, pool="cls", **common)
    if kind == "videomae":
        mean = bool(cfg.use_mean_pooling)
        return VideoConfig(frames=cfg.num_frames, tubelet=cfg.tubelet_size, image_size=_side(cfg.image_size, "image_size"),
                           patch_size=_side(cfg.patch_size, "patch_size"), mlp_dim=cfg.intermediate_size, positions="sinusoidal",
                           qkv_bias=cfg.qv_bias, final_norm=not mean, pool="mean" if mean else "first", fc_norm=mean and classifier,
                           fc_norm_eps=1e-5, **common)
    if kind == "vivit":
        tubelet = tuple(cfg.tubelet_size)
        return VideoConfig(frames=cfg.num_frames, tubelet=tubelet[0], image_size=_side(cfg.image_size, "image_size"),
                           patch_size=_side(tubelet[1:], "tubelet_size's patch"), mlp_dim=cfg.intermediate_size, class_token=True,
                           positions="learned", qkv_bias=cfg.qkv_bias, pool="cls", **common)
    return VideoConfig(frames=cfg.frames_per_clip, tubelet=cfg.tubelet_size, image_size=cfg.crop_size, patch_size=_side(cfg.patch_size, "patch_size"),
                       mlp_dim=int(cfg.hidden_size * cfg.mlp_ratio), positions="rope3d", qkv_bias=cfg.qkv_bias,
                       pool="attentive" if classifier else "mean", pool_layers=cfg.num_pooler_layers if classifier else 0,
                       pool_mlp_dim=int(cfg.hidden_size * 4.0) if classifier else 0, **common)


def _linear(sd: dict, src: str, dst: str, out: dict) -> None:
    out[f"{dst}.weight"] = sd[f"{src}.weight"]
    if f"{src}.bias" in sd:
        out[f"{dst}.bias"] = sd[f"{src}.bias"]


def _norm(sd: dict, src: str, dst: str, out: dict) -> None:
    out[f"{dst}.weight"], out[f"{dst}.bias"] = sd[f"{src}.weight"], sd[f"{src}.bias"]


def _qkv(sd: dict, q: str, k: str, v: str, dst: str, out: dict, *, bias: bool) -> None:
    """Separate query, key and value projections as one fused qkv (a missing bias as zeros)."""
    out[f"{dst}.weight"] = torch.cat([sd[f"{n}.weight"] for n in (q, k, v)])
    if bias:
        out[f"{dst}.bias"] = torch.cat([sd.get(f"{n}.bias", torch.zeros_like(sd[f"{n}.weight"][:, 0])) for n in (q, k, v)])


def _mlp(sd: dict, first: str, second: str, dst: str, out: dict) -> None:
    _linear(sd, first, f"{dst}.0", out)
    _linear(sd, second, f"{dst}.2", out)


def convert_video_state_dict(model: nn.Module, config: VideoConfig) -> dict[str, torch.Tensor]:
    """A Hugging Face video model's weights as a `VideoViT(config)` state dict."""
    kind = model.config.model_type
    sd = model.state_dict()
    classifier = _classifier(model.config, model)
    base = {"timesformer": "timesformer.", "videomae": "videomae.", "vivit": "vivit.", "vjepa2": "vjepa2."}[kind] if classifier else ""
    out: dict[str, torch.Tensor] = {}
    if kind == "timesformer":
        e = f"{base}embeddings."
        out["patch_embed.proj.weight"] = sd[f"{e}patch_embeddings.projection.weight"].unsqueeze(2)  # Conv2d as a Conv3d of depth 1
        out["patch_embed.proj.bias"] = sd[f"{e}patch_embeddings.projection.bias"]
        out["cls_token"], out["pos_embed"], out["time_embed"] = (sd[f"{e}cls_token"], sd[f"{e}position_embeddings"],
                                                                 sd[f"{e}time_embeddings"])
        for i in range(config.depth):
            s, d = f"{base}encoder.layer.{i}.", f"blocks.{i}."
            if config.attention == "divided":
                _norm(sd, f"{s}temporal_layernorm", f"{d}time_norm", out)
                _linear(sd, f"{s}temporal_attention.attention.qkv", f"{d}time_attn.qkv", out)
                _linear(sd, f"{s}temporal_attention.output.dense", f"{d}time_attn.proj", out)
                _linear(sd, f"{s}temporal_dense", f"{d}time_proj", out)
            _norm(sd, f"{s}layernorm_before", f"{d}norm1", out)
            _linear(sd, f"{s}attention.attention.qkv", f"{d}attn.qkv", out)
            _linear(sd, f"{s}attention.output.dense", f"{d}attn.proj", out)
            _norm(sd, f"{s}layernorm_after", f"{d}norm2", out)
            _mlp(sd, f"{s}intermediate.dense", f"{s}output.dense", f"{d}mlp", out)
        _norm(sd, f"{base}layernorm", "norm", out)
    elif kind in ("videomae", "vivit"):
        e = f"{base}embeddings."
        _linear(sd, f"{e}patch_embeddings.projection", "patch_embed.proj", out)
        if kind == "vivit":
            out["cls_token"], out["pos_embed"] = sd[f"{e}cls_token"], sd[f"{e}position_embeddings"]
        for i in range(config.depth):
            d = f"blocks.{i}."
            if kind == "videomae":
                s = f"{base}encoder.layer.{i}."
                a = f"{s}attention.attention."
                _qkv(sd, f"{a}query", f"{a}key", f"{a}value", f"{d}attn.qkv", out, bias=config.qkv_bias)
                _linear(sd, f"{s}attention.output.dense", f"{d}attn.proj", out)
                _mlp(sd, f"{s}intermediate.dense", f"{s}output.dense", f"{d}mlp", out)
            else:
                s = f"{base}layers.{i}."
                a = f"{s}attention."
                _qkv(sd, f"{a}q_proj", f"{a}k_proj", f"{a}v_proj", f"{d}attn.qkv", out, bias=config.qkv_bias)
                _linear(sd, f"{a}o_proj", f"{d}attn.proj", out)
                _mlp(sd, f"{s}mlp.fc1", f"{s}mlp.fc2", f"{d}mlp", out)
            _norm(sd, f"{s}layernorm_before", f"{d}norm1", out)
            _norm(sd, f"{s}layernorm_after", f"{d}norm2", out)
        if config.final_norm:
            _norm(sd, f"{base}layernorm", "norm", out)
        if config.fc_norm:
            _norm(sd, "fc_norm", "fc_norm", out)
    else:
        e = f"{base}encoder."
        _linear(sd, f"{e}embeddings.patch_embeddings.proj", "patch_embed.proj", out)
        for i in range(config.depth):
            s, d = f"{e}layer.{i}.", f"blocks.{i}."
            _norm(sd, f"{s}norm1", f"{d}norm1", out)
            a = f"{s}attention."
            _qkv(sd, f"{a}query", f"{a}key", f"{a}value", f"{d}attn.qkv", out, bias=config.qkv_bias)
            _linear(sd, f"{a}proj", f"{d}attn.proj", out)
            _norm(sd, f"{s}norm2", f"{d}norm2", out)
            _mlp(sd, f"{s}mlp.fc1", f"{s}mlp.fc2", f"{d}mlp", out)
        _norm(sd, f"{e}layernorm", "norm", out)
        if config.pool == "attentive":
            out["attn_pool.query"] = sd["pooler.query_tokens"]
            for i in range(config.pool_layers):
                s, d = f"pooler.self_attention_layers.{i}.", f"attn_pool.blocks.{i}."
                _norm(sd, f"{s}layer_norm1", f"{d}norm1", out)
                a = f"{s}self_attn."
                _qkv(sd, f"{a}q_proj", f"{a}k_proj", f"{a}v_proj", f"{d}attn.qkv", out, bias=True)
                _linear(sd, f"{a}out_proj", f"{d}attn.proj", out)
                _norm(sd, f"{s}layer_norm2", f"{d}norm2", out)
                _mlp(sd, f"{s}mlp.fc1", f"{s}mlp.fc2", f"{d}mlp", out)
            s, d = "pooler.cross_attention_layer.", "attn_pool.cross."
            _norm(sd, f"{s}layer_norm1", f"{d}norm1", out)
            _linear(sd, f"{s}cross_attn.q_proj", f"{d}q", out)
            out[f"{d}kv.weight"] = torch.cat([sd[f"{s}cross_attn.k_proj.weight"], sd[f"{s}cross_attn.v_proj.weight"]])
            out[f"{d}kv.bias"] = torch.cat([sd[f"{s}cross_attn.k_proj.bias"], sd[f"{s}cross_attn.v_proj.bias"]])
            _norm(sd, f"{s}layer_norm2", f"{d}norm2", out)
            _mlp(sd, f"{s}mlp.fc1", f"{s}mlp.fc2", f"{d}mlp", out)
    if config.num_classes:
        _linear(sd, "classifier", "head", out)
    return out


def _get(processor: Any) -> Callable[..., Any]:
    if isinstance(processor, dict):
        return processor.get
    return lambda key, default=None: getattr(processor, key, default)


def _size(value: Any, key: str) -> int | None:
    """One side of a processor's size (a dict, transformers' SizeDict, or one number)."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return int(value)
    get = value.get if isinstance(value, dict) else (lambda k: getattr(value, k, None))
    found = get(key) or get("height")
    return int(found) if found else None


def video_preprocessing(processor: Any, model_type: str, image_size: int) -> Preprocessing:
    """Each frame's preparation from a video (or image) processor or its config dict; None: the family's
    processor defaults at `image_size`. The processor's rescale (x · rescale_factor, minus 1 for ViViT's
    offset) and its mean and std are folded into one mean and std on [0, 1] pixels."""
    ratio, mean, std, offset = _PROCESSOR_DEFAULTS[model_type]
    if processor is None:
        return Preprocessing(image_size=image_size, resize_size=round(image_size * ratio), mean=mean, std=std, interpolation="bilinear")
    get = _get(processor)
    crop = _size(get("crop_size"), "height") if get("do_center_crop", True) else None
    short = _size(get("size"), "shortest_edge")
    resample = get("resample", 2)
    interpolation = _RESAMPLE.get(int(getattr(resample, "value", resample) or 2), "bilinear")
    if get("do_normalize", True):
        mean, std = tuple(get("image_mean") or mean), tuple(get("image_std") or std)
    else:
        mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    scale = 255.0 * float(get("rescale_factor", 1 / 255) or 1 / 255) if get("do_rescale", True) else 255.0
    shift = 1.0 if offset and get("do_rescale", True) and get("offset", True) else 0.0
    mean = tuple((m + shift) / scale for m in mean)
    std = tuple(s / scale for s in std)
    if crop:
        return Preprocessing(image_size=crop, resize_size=short or crop, mean=mean, std=std, interpolation=interpolation)
    return Preprocessing(image_size=short or image_size, mode="squash", mean=mean, std=std, interpolation=interpolation)


def video_processor_config(read: Callable[[str], dict | None]) -> dict | None:
    """A saved model's video processor settings: the "video_processor" in processor_config.json,
    else video_preprocessor_config.json, else the image processor's (the "image_processor" in
    processor_config.json, else preprocessor_config.json); None where there is none.

    Args:
        read: a file name -> its JSON content, or None where there is no such file.
    """
    nested = read("processor_config.json")
    if isinstance(nested, dict) and isinstance(nested.get("video_processor"), dict):
        return nested["video_processor"]
    found = read("video_preprocessor_config.json")
    if found is not None:
        return found
    if isinstance(nested, dict) and isinstance(nested.get("image_processor"), dict):
        return nested["image_processor"]
    return read("preprocessor_config.json")


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    with open(path) as f:
        return json.load(f)


def folder_video_processor(folder: str | Path) -> dict | None:
    """`video_processor_config` of a folder saved with `save_pretrained`."""
    return video_processor_config(lambda name: _read_json(Path(folder) / name))


def hub_video_processor(repo: str) -> dict | None:
    """`video_processor_config` of a hub repository, from the files of it already in the Hugging Face cache."""
    from vitviz.sources.hub import cached_file

    def read(name: str) -> dict | None:
        path = cached_file(repo, (name,))
        return None if path is None else _read_json(Path(path))

    return video_processor_config(read)


def video_spec(cfg: Any, *, name: str, weights: str, processor: Any, classifier: bool | None = None, locator: str = "",
               saved_in: str = "") -> VideoSpec:
    """The `VideoSpec` of a Hugging Face video config: architecture, frames and their sampling, each
    frame's preparation (`video_preprocessing`), class names (`id2label`) for a classifier."""
    classifier = _classifier(cfg) if classifier is None else classifier
    config = video_config_from_transformers(cfg, classifier=classifier)
    kind = cfg.model_type
    categories = None
    if config.num_classes:
        labels = getattr(cfg, "id2label", None) or {}
        categories = tuple(str(labels.get(i, labels.get(str(i), f"class {i}"))) for i in range(config.num_classes))
    stride = VJEPA2_FRAME_STRIDE if kind == "vjepa2" else None
    sampling = "stride" if stride else "uniform"
    rule = f"{config.frames} frames {stride} apart" if stride else f"{config.frames} frames spread uniformly"
    what = "features" if categories is None else f"{len(categories)} classes"
    t, h, w = config.grid
    description = (f"Hugging Face {name.removeprefix('hf:')}{f', saved in {saved_in}' if saved_in else ''}: {_FAMILY[kind]}, {rule}, "
                   f"{config.depth} x {config.heads} x {config.width}, tubelets {config.tubelet}x{config.patch_size}x{config.patch_size} "
                   f"({t}x{h}x{w} tokens), {config.attention} attention, {what}")
    if processor is None:
        description += "; no video processor saved: the family's processor defaults at the model's frame size"
    return VideoSpec(name=name, config=config, preprocessing=video_preprocessing(processor, kind, config.image_size), frames=config.frames,
                     sampling=sampling, frame_stride=stride, categories=categories, source="hf", weights=weights, locator=locator,
                     description=description)


def video_model_class(cfg: Any) -> type:
    """The transformers class that holds a saved video model's weights: the classifier where the config's
    architectures name one, else the encoder."""
    import transformers

    names = _CLASSES[cfg.model_type]
    return getattr(transformers, names[1] if _classifier(cfg) else names[0])


def video_from_transformers(model: nn.Module, *, processor: Any = None) -> VideoViT:
    """A `VideoViT` with the weights of a Hugging Face TimeSformer, VideoMAE, ViViT or V-JEPA 2 model (the
    encoder, or its video classifier), giving the same outputs, on the model's device and dtype and in its
    train/eval mode; `spec` a `VideoSpec`, its preprocessing from `processor` (a video processor or its
    config dict) when given."""
    kind = getattr(model.config, "model_type", None)
    if kind not in VIDEO_TYPES or type(model).__name__ not in _CLASSES[kind]:
        raise NotImplementedError(f"{type(model).__name__} is not a video model vitviz converts ({', '.join(n for c in _CLASSES.values() for n in c)})")
    classifier = _classifier(model.config, model)
    config = video_config_from_transformers(model.config, classifier=classifier)
    ours = VideoViT(config)
    ours.load_state_dict(convert_video_state_dict(model, config))
    name = getattr(model.config, "_name_or_path", "") or type(model).__name__
    ours.spec = video_spec(model.config, name=f"hf:{name}", weights="converted from a Hugging Face model instance", processor=processor,
                           classifier=classifier)
    param = next(model.parameters())
    return ours.to(device=param.device, dtype=param.dtype).train(model.training)
