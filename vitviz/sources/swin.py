"""Swin Transformers from timm and Hugging Face, as `vitviz.swin.Swin` (same outputs, attention you
can record and make global).

    vitviz.from_timm(timm.create_model("swin_tiny_patch4_window7_224"))   # timm's SwinTransformer
    vitviz.from_timm(timm.create_model("swinv2_tiny_window8_256"))        # timm's SwinTransformerV2
    vitviz.load_model("timm:swin_tiny_patch4_window7_224")
    vitviz.from_transformers(SwinForImageClassification.from_pretrained(...))
    vitviz.load_model("hf:microsoft/swin-tiny-patch4-window7-224")
    vitviz.load_model("hf:microsoft/swinv2-tiny-patch4-window8-256")

The timm and Hugging Face families (`vitviz.sources.timm`, `vitviz.sources.hf`) hand a Swin to the
converters here and attach the spec (preprocessing and class names by their own rules); these
functions map the weights and read the architecture.

Swin V2 (timm `swinv2_*`, Hugging Face `swinv2`) is `SwinConfig.version = 2`: res-post-norm
blocks, scaled cosine attention and the continuous position bias, with each stage's pretrained
window (timm's `pretrained_window_sizes`, `swinv2_*_window12to16_192to256`). timm's other Swin V2,
`SwinTransformerV2Cr` (`swinv2_cr_*`), is refused: its position bias is another function of the
offsets and its stages end with extra norms.

Differences between the two libraries that vitviz reads: timm downsamples at the start of stages
1.., Hugging Face at the end of stages ..S-2 (the same network); timm pads a stage's grid to whole
windows after the shift, Hugging Face before it (`SwinConfig.pad_before_shift`); Hugging Face has
separate q, k and v projections (stacked here into one qkv); its Swin V2 adds the shifted windows'
mask twice (-200, `SwinConfig.mask_value`) and sizes each stage's window from the grid halved
rounded down (vitviz refuses a size where that differs from the grid it runs).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from vitviz.config import Preprocessing, VariantSpec
from vitviz.swin import CPB_HIDDEN, MASK_VALUE, Swin, SwinConfig

__all__ = [
    "swin_config_from_timm",
    "convert_timm_swin_state_dict",
    "swin_from_timm",
    "swin_config_from_transformers",
    "convert_transformers_swin_state_dict",
    "swin_spec_from_transformers",
    "swin_from_transformers",
    "is_timm_swin",
]


def is_timm_swin(model: nn.Module) -> bool:
    """Whether `model` is one of timm's Swin classes (V1 or V2; `SwinTransformerV2Cr` is refused
    when converted)."""
    return any(c.__name__.startswith("SwinTransformer") for c in type(model).__mro__)


def _act(module: nn.Module) -> str:
    if isinstance(module, nn.GELU):
        return "gelu" if module.approximate == "none" else "gelu_tanh"
    timms = {"GELU": "gelu", "GELUTanh": "gelu_tanh"}  # timm's own (timm.layers.activations), the Swin V2 blocks': F.gelu, exact or tanh
    if type(module).__module__.startswith("timm.") and type(module).__name__ in timms:
        return timms[type(module).__name__]
    raise NotImplementedError(f"the MLP activation {type(module).__name__} is not modelled by vitviz (GELU is)")


_TIMM_VERSIONS = {"SwinTransformer": 1, "SwinTransformerV2": 2}
_V2_CR = ("timm's SwinTransformerV2Cr (swinv2_cr_*) is not modelled by vitviz: its position bias is another MLP of the offsets "
          "(log(1 + |offset|), no 16 sigmoid) and its stages end with extra norms; timm's SwinTransformerV2 (swinv2_*) is")


def swin_config_from_timm(model: nn.Module) -> SwinConfig:
    """The `SwinConfig` of a timm `SwinTransformer` or `SwinTransformerV2` (read from its modules,
    no weight touched), or a clear error for what vitviz does not model."""
    if not is_timm_swin(model):
        raise TypeError(f"expected a timm SwinTransformer, got {type(model).__name__}")
    version = _TIMM_VERSIONS.get(type(model).__name__)
    if version is None:
        raise NotImplementedError(_V2_CR if type(model).__name__ == "SwinTransformerV2Cr" else
                                  f"{type(model).__name__} is not a Swin vitviz models (timm's SwinTransformer and SwinTransformerV2 are)")
    pe = model.patch_embed
    problems = []
    img, patch = tuple(pe.img_size), tuple(pe.patch_size)
    if img[0] != img[1] or patch[0] != patch[1]:
        problems.append(f"non-square images or patches ({img}, {patch})")
    if not isinstance(pe.norm, nn.LayerNorm) or pe.norm.eps != 1e-5:
        problems.append("a patch embedding without its LayerNorm (eps 1e-5)")
    if getattr(model, "global_pool", "avg") != "avg":
        problems.append(f"global_pool={model.global_pool!r} (vitviz reads 'avg')")
    depths, heads, windows, pretrained = [], [], [], []
    dims = []
    blocks = []
    for s, stage in enumerate(model.layers):
        first = stage.blocks[0]
        dims.append(first.dim)
        depths.append(len(stage.blocks))
        heads.append(first.attn.num_heads)
        windows.append(first.window_size)
        pretrained.append(tuple(getattr(first.attn, "pretrained_window_size", (0, 0))))
        blocks.append(list(stage.blocks))
        merge = stage.downsample
        if s and (not hasattr(merge, "reduction") or not isinstance(merge.norm, nn.LayerNorm) or merge.norm.eps != 1e-5
                  or merge.norm.normalized_shape[0] != (merge.reduction.in_features if version == 1 else merge.reduction.out_features)):
            problems.append(f"stage {s}: a downsampling other than patch merging with a LayerNorm (eps 1e-5)"
                            + (" before the reduction" if version == 1 else " after the reduction"))
    embed = dims[0]
    if dims != [embed * 2**s for s in range(len(dims))]:
        problems.append(f"stage widths {dims} (vitviz models C, 2C, 4C, ...)")
    if any(w[0] != w[1] for w in windows):
        problems.append(f"non-square windows {windows}")
    if any(p[0] != p[1] for p in pretrained):
        problems.append(f"non-square pretrained windows {pretrained}")
    ratios = {b.mlp.fc1.out_features / b.dim for stage in blocks for b in stage}
    if any(b.attn.qkv.out_features != 3 * b.dim for stage in blocks for b in stage):
        problems.append("a head dimension other than width / heads")
    if any(not isinstance(b.norm1, nn.LayerNorm) or not isinstance(b.norm2, nn.LayerNorm) for stage in blocks for b in stage):
        problems.append("blocks whose norms are not LayerNorms")
    if version == 2 and any(b.attn.cpb_mlp[0].out_features != CPB_HIDDEN for stage in blocks for b in stage):
        problems.append(f"a continuous position bias MLP other than 2 -> {CPB_HIDDEN} -> heads")
    if len(ratios) != 1:
        problems.append(f"MLP ratios {sorted(ratios)} that differ between stages")
    if problems:
        raise NotImplementedError(f"{type(model).__name__} has " + "; ".join(dict.fromkeys(problems)) + ", which vitviz does not model")
    first = blocks[0][0]
    config = SwinConfig(
        image_size=img[0],
        patch_size=patch[0],
        embed_dim=embed,
        depths=tuple(depths),
        num_heads=tuple(heads),
        window_size=tuple(w[0] for w in windows),
        mlp_ratio=ratios.pop(),
        num_classes=model.num_classes,
        qkv_bias=(first.attn.qkv.bias if version == 1 else first.attn.q_bias) is not None,
        act=_act(first.mlp.act),
        eps=first.norm1.eps,
        version=version,
        pretrained_window_size=tuple(p[0] for p in pretrained),
    )
    # the windows and shifts timm built must be those vitviz's rule gives (timm's `always_partition` is not)
    for s, ((window, shift), stage) in enumerate(zip(config.stage_windows(), blocks)):
        for i, block in enumerate(stage):
            if tuple(block.window_size) != window or tuple(block.shift_size) != (shift if i % 2 else (0, 0)):
                raise NotImplementedError(
                    f"stage {s} block {i} has window {tuple(block.window_size)} and shift {tuple(block.shift_size)}; vitviz's rule "
                    f"gives {window} and {shift if i % 2 else (0, 0)} (always_partition=True is not modelled)"
                )
    if int(config.mlp_ratio * embed) != first.mlp.fc1.out_features:
        raise NotImplementedError(f"an MLP width {first.mlp.fc1.out_features} that is not int(ratio x {embed})")
    return config


def convert_timm_swin_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """timm's Swin names (V1 or V2) -> vitviz's (`Swin`); buffers (masks, position indices and
    coordinates) are left out."""
    out = {}
    for k, v in sd.items():
        if k.endswith(("relative_position_index", "relative_coords_table", "attn_mask")):
            continue
        k = (k.replace("patch_embed.proj.", "patch_embed.").replace("patch_embed.norm.", "patch_norm.")
             .replace("layers.", "stages.").replace(".downsample.", ".merge.").replace("head.fc.", "head.")
             .replace(".mlp.fc1.", ".mlp.0.").replace(".mlp.fc2.", ".mlp.2."))
        out[k] = v
    return out


def swin_from_timm(model: nn.Module) -> Swin:
    """A vitviz `Swin` with the weights of a timm `SwinTransformer` or `SwinTransformerV2`, on the
    model's device and dtype and in its train/eval mode. `vitviz.from_timm` calls it and attaches the spec (timm's data
    config, class names); called alone, the model has no spec."""
    ours = Swin(swin_config_from_timm(model))
    ours.load_state_dict(convert_timm_swin_state_dict(model.state_dict()))
    param = next(model.parameters())
    return ours.to(device=param.device, dtype=param.dtype).train(model.training)


# ---------------------------------------------------------------------------------------------
# Hugging Face


_HF_ACTS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh"}


def _side(value: Any) -> int:
    """An image or patch size of a Hugging Face config (a number or a pair) as one side."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise NotImplementedError(f"non-square sizes {tuple(value)} are not modelled by vitviz")
        return int(value[0])
    return int(value)


def swin_config_from_transformers(cfg: Any, *, num_classes: int = 0) -> SwinConfig:
    """The `SwinConfig` of a Hugging Face Swin or Swin V2 config (`model.config`), or a clear error."""
    kind = getattr(cfg, "model_type", None)
    if kind not in ("swin", "swinv2"):
        raise TypeError(f"expected a Hugging Face Swin config, got model_type {kind!r}")
    version = 2 if kind == "swinv2" else 1
    if getattr(cfg, "use_absolute_embeddings", False):
        raise NotImplementedError("a Swin with absolute position embeddings (use_absolute_embeddings=True) is not modelled by vitviz")
    if getattr(cfg, "num_channels", 3) != 3:
        raise NotImplementedError(f"{cfg.num_channels} input channels (vitviz reads RGB)")
    if cfg.hidden_act not in _HF_ACTS:
        raise NotImplementedError(f"the activation {cfg.hidden_act!r} is not modelled by vitviz")
    config = SwinConfig(
        image_size=_side(cfg.image_size),
        patch_size=_side(cfg.patch_size),
        embed_dim=cfg.embed_dim,
        depths=tuple(cfg.depths),
        num_heads=tuple(cfg.num_heads),
        window_size=int(cfg.window_size),
        mlp_ratio=float(cfg.mlp_ratio),
        num_classes=num_classes,
        qkv_bias=bool(cfg.qkv_bias),
        act=_HF_ACTS[cfg.hidden_act],
        eps=cfg.layer_norm_eps,
        pad_before_shift=True,
        version=version,
        pretrained_window_size=tuple((getattr(cfg, "pretrained_window_sizes", None) or (0,) * len(cfg.depths))[: len(cfg.depths)])
        if version == 2 else 0,  # (transformers reads an entry per stage; its default has four)
        mask_value=2 * MASK_VALUE if version == 2 else MASK_VALUE,  # transformers' Swin V2 adds its mask twice
    )
    if version == 2:
        # each stage's window and shift from its grid halved rounded down (the stage runs the grid rounded up)
        m = int(cfg.window_size)
        for s, ((window, shift), (gh, _)) in enumerate(zip(config.stage_windows(), config.stage_grids())):
            floor = config.grid[0] // 2**s
            theirs = ((min(floor, m),) * 2, (0 if floor <= m else m // 2,) * 2)
            if theirs != (window, shift):
                raise NotImplementedError(f"stage {s}: transformers sizes its window {theirs[0]} and shift {theirs[1]} from the grid "
                                          f"{floor} (halved rounded down), not from the {gh} it runs; vitviz models only sizes where "
                                          f"they agree ({window}, {shift})")
        return config
    for s, (gh, gw) in enumerate(config.stage_grids()):
        if min(gh, gw) < cfg.window_size:
            # transformers shrinks the window to the grid but keeps the bias table of the full window
            raise NotImplementedError(f"stage {s}'s grid {gh}x{gw} is smaller than the window {cfg.window_size}, which transformers "
                                      "itself cannot run at this image size")
    return config


def _swinv2_layer(layer: nn.Module) -> dict[str, torch.Tensor]:
    """One Hugging Face `Swinv2Layer`'s weights under the names of a vitviz `SwinBlock` (version 2):
    q, k and v stacked into one qkv projection, the query's and value's biases as q_bias and v_bias
    (the key has none)."""
    at, out = layer.attention.self, layer.attention.output
    sd = {
        "norm1.weight": layer.layernorm_before.weight, "norm1.bias": layer.layernorm_before.bias,
        "norm2.weight": layer.layernorm_after.weight, "norm2.bias": layer.layernorm_after.bias,
        "attn.qkv.weight": torch.cat([at.query.weight, at.key.weight, at.value.weight]),
        "attn.proj.weight": out.dense.weight, "attn.proj.bias": out.dense.bias,
        "attn.logit_scale": at.logit_scale,
        "attn.cpb_mlp.0.weight": at.continuous_position_bias_mlp[0].weight,
        "attn.cpb_mlp.0.bias": at.continuous_position_bias_mlp[0].bias,
        "attn.cpb_mlp.2.weight": at.continuous_position_bias_mlp[2].weight,
        "mlp.0.weight": layer.intermediate.dense.weight, "mlp.0.bias": layer.intermediate.dense.bias,
        "mlp.2.weight": layer.output.dense.weight, "mlp.2.bias": layer.output.dense.bias,
    }
    if at.query.bias is not None:
        sd["attn.q_bias"], sd["attn.v_bias"] = at.query.bias, at.value.bias
    return sd


def convert_transformers_swin_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A Hugging Face `SwinModel` / `SwinForImageClassification`'s weights (or their `Swinv2`
    counterparts') under vitviz's names (`Swin`): q, k and v stacked into one qkv projection; stage
    s's downsampling is stage s + 1's merge."""
    backbone = getattr(model, "swin", None) or getattr(model, "swinv2", model)
    emb, layers = backbone.embeddings, backbone.encoder.layers
    sd: dict[str, torch.Tensor] = {
        "patch_embed.weight": emb.patch_embeddings.projection.weight,
        "patch_embed.bias": emb.patch_embeddings.projection.bias,
        "patch_norm.weight": emb.norm.weight,
        "patch_norm.bias": emb.norm.bias,
        "norm.weight": backbone.layernorm.weight,
        "norm.bias": backbone.layernorm.bias,
    }
    for s, stage in enumerate(layers):
        for i, layer in enumerate(stage.blocks):
            if type(layer).__name__ == "Swinv2Layer":
                sd |= {f"stages.{s}.blocks.{i}.{k}": v for k, v in _swinv2_layer(layer).items()}
                continue
            p, at = f"stages.{s}.blocks.{i}.", layer.attention
            sd[p + "norm1.weight"], sd[p + "norm1.bias"] = layer.layernorm_before.weight, layer.layernorm_before.bias
            sd[p + "norm2.weight"], sd[p + "norm2.bias"] = layer.layernorm_after.weight, layer.layernorm_after.bias
            sd[p + "attn.qkv.weight"] = torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight])
            if at.q_proj.bias is not None:
                sd[p + "attn.qkv.bias"] = torch.cat([at.q_proj.bias, at.k_proj.bias, at.v_proj.bias])
            sd[p + "attn.proj.weight"], sd[p + "attn.proj.bias"] = at.o_proj.weight, at.o_proj.bias
            sd[p + "attn.relative_position_bias_table"] = at.relative_position_bias.relative_position_bias_table
            sd[p + "mlp.0.weight"], sd[p + "mlp.0.bias"] = layer.mlp.fc1.weight, layer.mlp.fc1.bias
            sd[p + "mlp.2.weight"], sd[p + "mlp.2.bias"] = layer.mlp.fc2.weight, layer.mlp.fc2.bias
        if stage.downsample is not None:
            p = f"stages.{s + 1}.merge."
            sd[p + "norm.weight"], sd[p + "norm.bias"] = stage.downsample.norm.weight, stage.downsample.norm.bias
            sd[p + "reduction.weight"] = stage.downsample.reduction.weight
    classifier = getattr(model, "classifier", None)
    if isinstance(classifier, nn.Linear):
        sd["head.weight"], sd["head.bias"] = classifier.weight, classifier.bias
    return {k: v.detach() for k, v in sd.items()}


def _hf_classes(cfg: Any, classifier: bool | None) -> int:
    """The class count of a Hugging Face Swin: its labels when it is a classifier (by default, when
    its `architectures` name one), else 0 (features)."""
    if classifier is None:
        classifier = any(a.endswith("ForImageClassification") for a in (getattr(cfg, "architectures", None) or []))
    return int(cfg.num_labels) if classifier else 0


def swin_spec_from_transformers(
    cfg: Any, *, name: str, weights: str, preprocessing: Preprocessing | None = None, classifier: bool | None = None,
    locator: str = "", saved_in: str = "",
) -> VariantSpec:
    """The spec of a Hugging Face Swin from its config: classes from `id2label` for a classifier
    (`classifier`, by default read from `architectures`), the preprocessing given (by default
    ImageNet's mean and std, bicubic, crop 0.875 at the config's size)."""
    config = swin_config_from_transformers(cfg, num_classes=_hf_classes(cfg, classifier))
    labels = getattr(cfg, "id2label", None) or {}
    categories = None
    if config.num_classes:
        categories = tuple(labels.get(i, labels.get(str(i), f"class {i}")) for i in range(config.num_classes))
    if preprocessing is None:
        size = config.image_size
        preprocessing = Preprocessing(image_size=size, resize_size=math.floor(size / 0.875), interpolation="bicubic")
    kind = "features" if categories is None else f"{len(categories)} classes"
    return VariantSpec(
        name=name,
        config=config,
        preprocessing=preprocessing,
        categories=categories,
        source="hf",
        weights=weights,
        locator=locator,
        description=f"Hugging Face {name.removeprefix('hf:')}{f', saved in {saved_in}' if saved_in else ''}: "
        f"Swin{' V2' if config.version == 2 else ''} {'-'.join(map(str, config.depths))} blocks, {config.embed_dim}-{config.width} wide, /{config.patch_size}, "
        f"window {config.window_size[0]}, {kind}",
    )


def swin_from_transformers(model: nn.Module, *, preprocessing: Preprocessing | None = None) -> Swin:
    """A vitviz `Swin` with the weights of a Hugging Face `SwinModel` or `SwinForImageClassification`
    (or `Swinv2Model`, `Swinv2ForImageClassification`), giving the same outputs, on the model's
    device and dtype and in its train/eval mode, with its spec (`vitviz.from_transformers` passes the
    preprocessing of the image processor it is given)."""
    cfg = model.config
    classifier = isinstance(getattr(model, "classifier", None), nn.Linear)
    name = getattr(cfg, "_name_or_path", "") or type(model).__name__
    spec = swin_spec_from_transformers(cfg, name=f"hf:{name}", weights="converted from a Hugging Face model instance",
                                       preprocessing=preprocessing, classifier=classifier)
    ours = Swin(spec.config)
    ours.load_state_dict(convert_transformers_swin_state_dict(model))
    ours.spec = spec
    param = next(model.parameters())
    return ours.to(device=param.device, dtype=param.dtype).train(model.training)
