"""timm's plain ViT family (`timm.models.VisionTransformer`): ViT and AugReg, the ViT paper's hybrids
(a ResNet or convolutional stem before the patches, read by `vitviz.sources.timm_stems`), DeiT (with
its distillation token), DeiT III, DINO, DINOv2 (with registers), CLIP image towers, and any
fine-tuned model of the same class.

    vitviz.load_model("timm:vit_small_patch16_224.dino")
    vitviz.load_model("timm:vit_small_patch8_224.dino@480")   # at 480 px, position embeddings resampled
    vitviz.from_timm(timm_model)                              # a model already in hand (= ViT.from_timm)

timm is imported only here, and only when used (`pip install vitviz[timm]`). Weights come through
timm's own loader from the Hugging Face cache; preprocessing from the model's `pretrained_cfg`
(`timm.data.resolve_data_config`) at the size the model was created for, class names from timm's
ImageNet tables when the head is an ImageNet classifier (a head of another size, such as CLIP's
projection, is read as features).

The source registers itself, and `ViT.from_timm`, when this module is imported.

"timm:" takes timm's model names only (`[a-z0-9_]+`, optionally "." and a pretrained tag), checked
before timm sees them: timm itself would also read "hf-hub:<repo>" and "local-dir:<folder>".

A checkpoint on disk loads with `load_model("timm:<name>", weights_path=<file>)`, without the hub:
the name says the architecture (and, with a tag, whose `pretrained_cfg` gives the preprocessing);
the file is read as timm's `load_checkpoint` reads it (a state dict, safetensors, or a training
checkpoint's "state_dict_ema" / "model_ema" / "state_dict" / "model", EMA weights first), and the
model is built with as many classes as the file's head has rows (timm's `num_classes`; no head:
features). A training checkpoint's own settings (timm train.py's "args": mean, std, sizes) are not
read: the preprocessing is the architecture's `pretrained_cfg` (`resolve_data_config`), as for
timm's `create_model(..., checkpoint_path=)`; name the tag the model was fine-tuned from to get its
preprocessing, or replace `model.spec.preprocessing` (`dataclasses.replace`).

A model converted from an instance (`vitviz.from_timm`) is named by its architecture alone: timm does
not record whether pretrained weights were loaded, so its name claims no pretrained tag.
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import re
from dataclasses import replace

import torch
from torch import nn

from vitviz.config import Preprocessing, ViTConfig
from vitviz.model import ViT
from vitviz.sources.base import (
    Status, VariantSpec, WeightsSource, WeightsUnavailableError, check_size, register_source, split_size,
)
from vitviz.sources.hub import cached_file, hub_offline, hub_reachable, missing_message
from vitviz.sources.swin import is_timm_swin, swin_config_from_timm, swin_from_timm
from vitviz.sources.timm_stems import stem_from_timm, stem_state_dict

__all__ = ["TimmSource", "from_timm", "CURATED", "config_from_timm", "convert_timm_state_dict"]

# The timm models the app's menu offers by name: (timm name, image size or None for the model's own).
# DINOv3's weights come under Meta's DINOv3 License (timm's copies on the hub say so); EVA-02's under
# MIT; Perception Encoder's under Apache 2.0.
CURATED: tuple[tuple[str, int | None], ...] = (
    ("vit_base_patch16_224.augreg2_in21k_ft_in1k", None),
    ("vit_base_patch32_224.augreg_in21k_ft_in1k", None),
    ("deit_base_distilled_patch16_224.fb_in1k", None),
    ("vit_small_patch8_224.dino", None),
    ("vit_base_patch16_224.dino", None),
    ("vit_small_patch14_reg4_dinov2.lvd142m", 224),
    ("vit_base_patch16_clip_224.openai", None),
    ("vit_small_patch16_dinov3.lvd1689m", None),
    ("vit_base_patch16_dinov3.lvd1689m", None),
    ("eva02_base_patch14_224.mim_in22k", None),
    ("vit_pe_core_base_patch16_224.fb", None),
)

_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def _timm():
    try:
        import timm
    except ImportError:
        raise ImportError("timm models need timm: pip install 'vitviz[timm]' (or pip install timm)") from None
    return timm


def _meta_model(name: str, **kwargs) -> nn.Module:
    """The timm model `name` without memory or weights (on the meta device): its structure and config."""
    timm = _timm()
    try:
        with torch.device("meta"):
            return timm.create_model(name, pretrained=False, **kwargs)
    except RuntimeError as exc:
        raise ValueError(f"timm knows no model {name!r} ({exc}); timm.list_models(pretrained=True) lists them") from None


_NAME = re.compile(r"[a-z0-9_]+(\.[A-Za-z0-9_.-]+)?")
_NOT_A_NAME = (
    "timm:<name> takes a timm model name such as vit_small_patch16_224.dino (lower-case letters, digits and _, then "
    "optionally a dot and a pretrained tag of letters, digits, _, . and -; timm.list_models(pretrained=True) lists them), "
    "optionally with @<pixels>; not a path, hf-hub: or local-dir:. A checkpoint on disk loads with "
    "load_model('timm:<name>', weights_path=<file>)"
)


def _split(name: str) -> tuple[str, int | None]:
    """"timm:<model>[@<size>]" -> (<model>, size), checked before timm sees the name (timm would
    also read "hf-hub:<repo>" and "local-dir:<folder>")."""
    rest = name.removeprefix("timm:")
    model = rest.rpartition("@")[0] if "@" in rest else rest
    if not _NAME.fullmatch(model):
        raise ValueError(_NOT_A_NAME)
    return model, split_size(name)[1]


# timm's other ViT-family classes, and the part of each that vitviz does not model
_NOT_YET = {
    "VisionTransformerSAM": "windowed blocks with decomposed relative positions: SAM's image encoder",
}


def _is_instance(model: nn.Module, class_name: str) -> bool:
    return any(c.__name__ == class_name for c in type(model).__mro__)


# timm's classes of the plain ViT family that vitviz reads: (their blocks' class, their attention's classes)
_FAMILIES = {
    "VisionTransformer": (("Block", "ResPostBlock", "ParallelScalingBlock"), ("Attention",)),
    "Eva": (("EvaBlock", "EvaBlockPostNorm"), ("EvaAttention", "AttentionRope")),  # EVA, EVA-02, DINOv3, PE, vit_*_rope_*
    "Beit": (("Block",), ("Attention",)),  # BEiT, BEiT v2: a relative position bias per block
    "VisionTransformerRelPos": (("RelPosBlock", "ResPostRelPosBlock"), ("RelPosAttention",)),  # vit_relpos_*: an MLP of the offsets
    "NaFlexVit": (("Block",), ("Attention",)),  # SigLIP 2 NaFlex, RADIO: images of any aspect ratio, `_naflex`
}


def _embedding(model: nn.Module) -> nn.Module:
    """The module that holds the patch projection, the position table and the prefix tokens (a
    NaFlexVit's `embeds`; the model itself otherwise, its projection in `patch_embed`)."""
    return model.embeds if _family(model) == "NaFlexVit" else model


def _naflex_table(embeds: nn.Module) -> torch.Tensor | None:
    """A NaFlexVit's position table [1, gh, gw, D]: its learned one, or the sum of its factorised row
    and column tables (pos_embed_y [1, gh, D] + pos_embed_x [1, gw, D]; resampled bilinearly, the sum
    is the sum of the rows and columns each resampled linearly, as timm does); None without."""
    if embeds.pos_embed_type == "learned":
        return embeds.pos_embed
    if embeds.pos_embed_type == "factorized":
        return embeds.pos_embed_y[:, :, None] + embeds.pos_embed_x[:, None, :]
    return None


def _naflex(model: nn.Module, problems: list[str]) -> dict:
    """The `ViTConfig` fields of a timm `NaFlexVit`'s embedding: its position table [1, gh, gw, D]
    (`_naflex_table`) is resampled to each image's grid (bicubic or bilinear, to gh x gw or, with
    `pos_embed_ar_preserving`, to the square of the longer side and cut), its prefix tokens carry no
    position; what vitviz does not model goes to `problems`."""
    e = model.embeds
    if e.pos_embed_type not in ("learned", "factorized"):
        problems.append(f"{e.pos_embed_type or 'no'} position embeddings (vitviz reads NaFlex's learned 2D table)")
    if model.rope is not None:
        problems.append("rotary positions in a NaFlexVit")
    if e.pos_embed_interp_mode not in ("bicubic", "bilinear"):
        problems.append(f"position embeddings resampled {e.pos_embed_interp_mode!r} (vitviz: bicubic or bilinear)")
    if e.norm_input is not None or getattr(e, "patch_interpolator", None) is not None:
        problems.append("a norm of the raw pixels or resizable patches in the embedding")
    if not (isinstance(e.proj, nn.Linear) if e.is_linear else isinstance(e.proj, nn.Conv2d)):
        problems.append(f"a patch projection of type {type(e.proj).__name__}")
    table = _naflex_table(e)
    if table is not None and table.shape[1] != table.shape[2]:
        problems.append(f"a position table that is not square ({table.shape[1]}x{table.shape[2]})")
    if e.pos_embed_type == "factorized":  # (linear on each axis: bilinear on the sum, no antialiasing)
        return dict(pos_embed_interpolation="bilinear", pos_embed_square=bool(e.pos_embed_ar_preserving), pos_embed_antialias=False)
    return dict(pos_embed_interpolation=e.pos_embed_interp_mode, pos_embed_square=bool(e.pos_embed_ar_preserving),
                pos_embed_antialias=bool(e.pos_embed_antialias), pos_embed_align_corners=bool(e.pos_embed_align_corners))


def _naflex_state_dict(model: nn.Module, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A NaFlexVit's embedding weights under a `VisionTransformer`'s names: its linear projection of
    each patch's pixels (flattened row by row, channels last unless `channels_last` is off) as the
    Conv2d that computes the same, its [1, gh, gw, D] table as [1, gh*gw, D]."""
    e = model.embeds
    out = {k.removeprefix("embeds."): v for k, v in sd.items() if k.startswith("embeds.")}
    out = {("patch_embed." + k if k.startswith(("proj.", "norm.")) else k): v for k, v in out.items()}
    weight = out["patch_embed.proj.weight"]
    if e.is_linear:
        ph, pw = e.patch_size
        d = weight.shape[0]
        weight = (weight.reshape(d, ph, pw, -1).permute(0, 3, 1, 2) if e.channels_last else weight.reshape(d, -1, ph, pw))
        out["patch_embed.proj.weight"] = weight.contiguous()
    for key in ("pos_embed", "pos_embed_y", "pos_embed_x"):
        out.pop(key, None)
    table = _naflex_table(e)
    if table is not None:
        out["pos_embed"] = table.detach().flatten(1, 2)
    out.update({k: v for k, v in sd.items() if not k.startswith("embeds.")})
    return out


def _family(model: nn.Module) -> str | None:
    return next((f for f in _FAMILIES if _is_instance(model, f)), None)


def config_from_timm(model: nn.Module) -> ViTConfig:
    """The `ViTConfig` of a timm `VisionTransformer`, `Eva` (EVA, EVA-02, DINOv3, Perception
    Encoder, the vit_*_rope_* models), `Beit` or `VisionTransformerRelPos`, or a clear error for
    what vitviz does not model."""
    family = _family(model)
    if family is None:
        name = type(model).__name__
        if name in _NOT_YET:
            raise NotImplementedError(f"timm's {name} ({_NOT_YET[name]}) is not modelled by vitviz")
        raise TypeError(f"expected a timm VisionTransformer, Eva, Beit, VisionTransformerRelPos or NaFlexVit, got {name}")
    eva, naflex = family == "Eva", family == "NaFlexVit"
    pe = model.embeds if naflex else model.patch_embed
    problems = []
    flex = _naflex(model, problems) if naflex else {}
    hybrid = None  # a convolutional stem before the patches (`vitviz.sources.timm_stems`)
    if getattr(pe, "backbone", None) is not None:
        hybrid = stem_from_timm(pe, problems)
    elif not naflex and not isinstance(getattr(pe, "proj", None), nn.Conv2d):
        problems.append("a patch embedding other than one Conv2d (and a norm)")
    rope = _rope(model, problems) if eva else {}
    relative = _relative(model, problems)
    embedding = _embedding(model)
    table = _naflex_table(embedding) if naflex else getattr(embedding, "pos_embed", None)
    if table is None and not rope and not relative:
        problems.append("no position embedding, learned, relative or rotary")
    if model.global_pool not in ("token", "avg", "map"):
        problems.append(f"global_pool={model.global_pool!r} (vitviz reads 'token', 'avg' and 'map')")
    elif model.global_pool == "map":
        problems += _pool_problems(model)
    elif model.global_pool == "token" and not isinstance(model.fc_norm, nn.Identity):
        problems.append("a norm after the cls token")
    # timm's VisionTransformer leaves the prefix out of attention pooling unless told (pool_include_prefix); Eva's pool reads every token
    include_prefix = eva or getattr(model, "pool_include_prefix", False)
    if model.global_pool == "avg" and include_prefix and not eva:
        problems.append("pooling over the prefix tokens")
    if getattr(pe, "dynamic_img_pad", False):
        problems.append("dynamic image padding")
    patch_size = (hybrid.patch_size,) * 2 if hybrid else tuple(pe.patch_size)  # (a hybrid's: the pixels one token covers)
    img_size = tuple(pe.img_size) if not naflex else tuple(patch_size[0] * g for g in (table.shape[1:3] if table is not None else (16, 16)))
    if img_size[0] != img_size[1] or patch_size[0] != patch_size[1]:
        problems.append(f"non-square images or patches ({img_size}, {patch_size})")
    elif img_size[0] % patch_size[0] and getattr(pe, "dynamic_img_pad", False):
        problems.append(f"an image size ({img_size[0]} px) that is not a multiple of its patch ({patch_size[0]} px), padded")
    block = model.blocks[0]
    known = [b for b in model.blocks if type(b).__name__ in _FAMILIES[family][0]]  # (another kind of block is named below)
    first = _first_norm(known[0]) if known else None
    eps = getattr(first, "eps", None)
    norm_kind = _norm_kind(first, eps)  # every norm of the model must be of this kind and epsilon
    norms = [n for b in known for n in ([b.in_norm] if _parallel(b) else [getattr(b, "norm1", None), getattr(b, "norm2", None)])]
    norms += [m for m in (getattr(model, "norm_pre", None), model.norm, model.fc_norm, getattr(pe, "norm", None))
              if not isinstance(m, (nn.Identity, type(None)))]
    if known and (norm_kind is None or not all(_norm_kind(n, eps) == norm_kind for n in norms)):
        odd = next((n for n in norms if _norm_kind(n, eps) != norm_kind), first)
        problems.append(f"norms other than one kind of LayerNorm (with a weight and a bias) or RMSNorm (with a weight) and one "
                        f"epsilon (a {type(odd).__name__})")
    acts, qk_norms, mlps, scales, attn_norms = set(), set(), set(), set(), set()
    post = {type(b).__name__.startswith("ResPost") or type(b).__name__.endswith("PostNorm") for b in model.blocks}
    blocks, attentions = _FAMILIES[family]
    parallel = {_parallel(b) for b in model.blocks}
    for b in model.blocks:
        if type(b).__name__ not in blocks:
            problems.append(f"blocks of type {type(b).__name__}")
            break
        if _parallel(b):  # ViT-22B's: one norm, one input projection for q, k, v and the MLP, two output projections
            qk = [b.q_norm, b.k_norm]
            if b.out_proj is not None or (b.mlp_bias is None and b.in_proj.bias is None) != (b.mlp_out_proj.bias is None):
                problems.append("a parallel block with one fused output projection, or biases on one MLP layer only")
                break
            if not (all(isinstance(n, nn.Identity) for n in qk) or all(_norm_kind(n, eps) == norm_kind for n in qk)):
                problems.append("queries and keys normalised otherwise than by the blocks' norm each (qk_norm)")
                break
            qk_norms.add(not isinstance(qk[0], nn.Identity))
            attn_norms.add(False)
            mlps.add(("plain", b.mlp_out_proj.in_features, False))
            acts.add(_act_name(b.mlp_act))
            scales.add(not isinstance(b.ls, nn.Identity))
            continue
        attn, mlp = b.attn, b.mlp
        if type(attn).__name__ not in attentions or not (isinstance(getattr(attn, "qkv", None), nn.Linear)
                                                        or isinstance(getattr(attn, "q_proj", None), nn.Linear)):
            problems.append(f"attention of type {type(attn).__name__}")
            break
        out_norm = getattr(attn, "norm", nn.Identity())
        if not (isinstance(out_norm, nn.Identity) or _norm_kind(out_norm, eps) == norm_kind):
            problems.append(f"a norm after the attention other than the blocks' (a {type(out_norm).__name__})")
            break
        attn_norms.add(not isinstance(out_norm, nn.Identity))
        qk = [getattr(attn, n, nn.Identity()) for n in ("q_norm", "k_norm")]
        if not (all(isinstance(n, nn.Identity) for n in qk) or all(_norm_kind(n, eps) == norm_kind for n in qk)):
            problems.append("queries and keys normalised otherwise than by the blocks' norm each (qk_norm)")
            break
        qk_norms.add(not isinstance(qk[0], nn.Identity))
        width = getattr(attn, "attn_dim", None) or getattr(attn, "head_dim", 0) * getattr(attn, "num_heads", 0) or model.embed_dim
        if getattr(attn, "gate", None) is not None or width != model.embed_dim or getattr(attn, "num_kv_groups", 1) != 1:
            problems.append("gated, resized or grouped-query attention")
            break
        kind = _mlp_kind(mlp)
        if kind is None:
            problems.append(f"an MLP of type {type(mlp).__name__} (vitviz models timm's Mlp, GluMlp and SwiGLU)")
            break
        mlp_norm = getattr(mlp, "norm", nn.Identity())
        if not (isinstance(mlp_norm, nn.Identity) or _norm_kind(mlp_norm, eps) == norm_kind):
            problems.append(f"a norm inside the MLP other than the blocks' (a {type(mlp_norm).__name__})")
            break
        mlps.add((kind, _hidden(mlp), not isinstance(mlp_norm, nn.Identity)))
        acts.add(_act_name(mlp.act))
        scales.add(_layer_scales(b))
    if problems:
        raise NotImplementedError(f"{type(model).__name__} has " + "; ".join(dict.fromkeys(problems)) + ", which vitviz does not model")
    if len(qk_norms) > 1 or len(attn_norms) > 1:
        raise NotImplementedError("normalised queries and keys (qk_norm), or a norm after the attention, in some blocks only, "
                                  "which vitviz does not model")
    if len(mlps) > 1:
        raise NotImplementedError("MLPs of more than one kind or width across the blocks, which vitviz does not model")
    if len(post) > 1 or len(parallel) > 1:
        raise NotImplementedError("res-post-norm or parallel blocks among pre-norm ones, which vitviz does not model")
    if len(scales) > 1 or scales == {None}:
        raise NotImplementedError("LayerScale on one branch of a block only, or in some blocks only, which vitviz does not model")
    kind, hidden, mlp_norm = mlps.pop()
    if len(acts) != 1 or None in acts or (acts == {"silu"}) != (kind == "gated"):
        raise NotImplementedError(f"the MLP activation ({type(block.mlp.act).__name__}) is not GELU, tanh-GELU or QuickGELU "
                                  "(for a plain MLP) or SiLU (for a gated one)")
    distilled = getattr(model, "dist_token", None) is not None
    registers = embedding.reg_token.shape[1] if getattr(embedding, "reg_token", None) is not None else 0
    prefix = int(embedding.cls_token is not None) + int(distilled) + registers
    if _parallel(block):
        heads, biased = block.num_heads, block.in_proj.bias is not None
        proj_bias, mlp_bias = block.attn_out_proj.bias is not None, block.mlp_out_proj.bias is not None
    else:
        attn = block.attn
        heads, proj_bias, mlp_bias = attn.num_heads, attn.proj.bias is not None, block.mlp.fc2.bias is not None
        biased = getattr(attn, "q_bias", None) is not None or any(
            getattr(getattr(attn, n, None), "bias", None) is not None for n in ("qkv", "q_proj", "k_proj", "v_proj"))
    pool = getattr(model, "attn_pool", None)
    return ViTConfig(
        image_size=img_size[0] - img_size[0] % patch_size[0],  # (its patch embedding reads the top-left whole patches)
        patch_size=patch_size[0],
        width=model.embed_dim,
        depth=len(model.blocks),
        heads=heads,
        mlp_dim=hidden,
        mlp=kind,
        mlp_norm=mlp_norm,
        num_classes=model.num_classes,
        class_token=embedding.cls_token is not None,
        distill_token=distilled,
        register_tokens=registers,
        abs_pos_embed=table is not None,
        pos_embed_prefix=0 if getattr(model, "no_embed_class", False) or naflex or table is None else prefix,
        rel_pos_bias=relative,
        layer_scale=1.0 if scales.pop() else None,
        qkv_bias=biased,
        proj_bias=proj_bias,
        mlp_bias=mlp_bias,
        patch_bias=hybrid.patch_bias if hybrid else pe.proj.bias is not None,
        qk_norm=qk_norms.pop(),
        attn_norm=attn_norms.pop(),
        post_norm=post.pop(),
        parallel=parallel.pop(),
        norm=norm_kind,
        patch_norm=not isinstance(getattr(pe, "norm", None) or nn.Identity(), nn.Identity),
        norm_pre=not isinstance(getattr(model, "norm_pre", None) or nn.Identity(), nn.Identity),
        final_norm=not isinstance(model.norm, nn.Identity),
        pool=model.global_pool,
        pool_prefix=model.global_pool != "map" or include_prefix or not model.num_prefix_tokens,
        pool_heads=pool.num_heads if model.global_pool == "map" and pool.num_heads != heads else None,
        pool_mlp_dim=pool.mlp.fc1.out_features if model.global_pool == "map" and pool.mlp.fc1.out_features != hidden else None,
        fc_norm=model.global_pool == "avg" and not isinstance(model.fc_norm, nn.Identity),
        act=acts.pop(),
        eps=eps,
        **rope,
        **flex,
        **(hybrid.fields if hybrid else {}),
    )


def _parallel(block: nn.Module) -> bool:
    return type(block).__name__ == "ParallelScalingBlock"


def _first_norm(block: nn.Module) -> nn.Module | None:
    """A block's first norm (a parallel block's only one)."""
    return block.in_norm if _parallel(block) else getattr(block, "norm1", None)


def _parallel_state_dict(model: nn.Module, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ViT-22B's parallel blocks under vitviz's names: the input projection's rows split into the MLP's
    (first) and q, k, v; its MLP bias (`mlp_bias`, where q, k, v have none); one LayerScale for both."""
    for i, b in enumerate(model.blocks):
        if not _parallel(b):
            continue
        p, m = f"blocks.{i}.", b.mlp_out_proj.in_features
        w = sd.pop(p + "in_proj.weight")
        sd[p + "mlp.0.weight"], sd[p + "attn.qkv.weight"] = w[:m], w[m:]
        if p + "in_proj.bias" in sd:
            bias = sd.pop(p + "in_proj.bias")
            sd[p + "mlp.0.bias"], sd[p + "attn.qkv.bias"] = bias[:m], bias[m:]
        if p + "mlp_bias" in sd:
            sd[p + "mlp.0.bias"] = sd.pop(p + "mlp_bias")
        for theirs, ours in (("in_norm", "norm1"), ("attn_out_proj", "attn.proj"), ("mlp_out_proj", "mlp.2"),
                             ("q_norm", "attn.q_norm"), ("k_norm", "attn.k_norm")):
            for t in ("weight", "bias"):
                if f"{p}{theirs}.{t}" in sd:
                    sd[f"{p}{ours}.{t}"] = sd.pop(f"{p}{theirs}.{t}")
        if p + "ls.gamma" in sd:
            sd[p + "ls1.gamma"] = sd[p + "ls2.gamma"] = sd.pop(p + "ls.gamma")
    return sd


def _layer_scales(block: nn.Module) -> bool | None:
    """True: LayerScale on both branches; False: on neither; None: on one only."""
    if hasattr(block, "gamma_1"):  # Eva's and BEiT's blocks
        on = (block.gamma_1 is not None, block.gamma_2 is not None)
    else:
        on = tuple(not isinstance(getattr(block, n, nn.Identity()), nn.Identity) for n in ("ls1", "ls2"))  # (a ResPostBlock has none)
    return on[0] if on[0] == on[1] else None


def _relative(model: nn.Module, problems: list[str]) -> bool:
    """Whether a timm `Beit` or `VisionTransformerRelPos` adds a relative position bias (its blocks'
    own or one shared by them) that vitviz reads as `ViTConfig.rel_pos_bias`; what vitviz does not
    model goes to `problems`."""
    family = _family(model)
    if family == "Beit":
        grid = tuple(model.patch_embed.grid_size)
        tables = [b.attn for b in model.blocks if b.attn.relative_position_bias_table is not None]
        shared = model.rel_pos_bias
        windows = {tuple(a.window_size) for a in tables} | ({tuple(shared.window_size)} if shared is not None else set())
        if windows - {grid}:
            problems.append(f"relative position tables for another grid than its own ({sorted(windows)} over {grid})")
        return bool(tables) or shared is not None
    if family == "VisionTransformerRelPos":
        mods = [b.attn.rel_pos for b in model.blocks if b.attn.rel_pos is not None]
        if model.shared_rel_pos is not None:
            mods.append(model.shared_rel_pos)
        if any(not hasattr(m, "get_bias") or getattr(m, "prefix_tokens", 0) > 1 for m in mods):
            problems.append("a relative position module vitviz cannot read")
        return bool(mods)
    return False


def _relative_tables(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each block's relative position bias as vitviz's table (`RelativePositionBias.table`): BEiT's
    own tables (plus its shared one); for `VisionTransformerRelPos`, the bias its MLP of the
    offsets computes at the trained grid, read back into the table by the same index (exact there;
    every pair with one offset has one bias)."""
    from vitviz.model import relative_index

    grid = tuple(model.patch_embed.grid_size)
    index = relative_index(grid, model.num_prefix_tokens).flatten()
    heads = model.blocks[0].attn.num_heads
    size = (2 * grid[0] - 1) * (2 * grid[1] - 1) + 3
    out = {}
    with torch.no_grad():
        if _family(model) == "Beit":
            shared = model.rel_pos_bias.relative_position_bias_table if model.rel_pos_bias is not None else None
            for i, b in enumerate(model.blocks):
                own = b.attn.relative_position_bias_table
                table = torch.zeros(size, heads) if own is None else own.detach().clone()
                out[f"blocks.{i}.attn.rel_pos.table"] = table + (shared.detach() if shared is not None else 0)
            return out
        shared = model.shared_rel_pos.get_bias()[0] if model.shared_rel_pos is not None else None  # [H, N, N]
        for i, b in enumerate(model.blocks):
            bias = b.attn.rel_pos.get_bias()[0] if b.attn.rel_pos is not None else shared
            table = torch.zeros(size, heads, dtype=bias.dtype)
            table[index] = bias.permute(1, 2, 0).reshape(-1, heads)  # every pair writes its offset's entry: all equal
            out[f"blocks.{i}.attn.rel_pos.table"] = table
    return out


def _rope(model: nn.Module, problems: list[str]) -> dict:
    """The `ViTConfig` rotary fields of a timm `Eva`'s position embedding (`model.rope`); what vitviz
    does not model goes to `problems`."""
    rope = getattr(model, "rope", None)
    if rope is None:
        return {}
    name = type(rope).__name__
    axes = {"ij": "yx", "xy": "xy"}.get(getattr(rope, "grid_indexing", None))
    pairs = "half" if getattr(rope, "rotate_half", False) else "interleaved"
    if axes is None:
        problems.append(f"rotary positions indexed {getattr(rope, 'grid_indexing', None)!r}")
        return {}
    if name == "RotaryEmbeddingCat":
        if rope.in_pixels or rope.grid_type != "index":
            problems.append("rotary positions in pixel coordinates")
            return {}
        ref = rope.ref_feat_shape
        return dict(rope="axial", rope_temperature=float(rope.temperature), rope_offset=float(rope.grid_offset),
                    rope_ref_grid=tuple(ref) if ref is not None else None, rope_axes=axes, rope_pairs=pairs)
    if name == "RotaryEmbeddingDinoV3":
        if rope.min_period is not None or rope.max_period is not None or rope.normalize_coords != "separate":
            problems.append("DINOv3 rotary positions with min/max periods or coordinates normalised across the axes")
            return {}
        return dict(rope="dinov3", rope_temperature=float(rope.temperature), rope_offset=float(rope.grid_offset),
                    rope_axes=axes, rope_pairs=pairs)
    if name == "RotaryEmbeddingMixed":
        return dict(rope="mixed", rope_temperature=float(rope.temperature), rope_axes=axes, rope_pairs="interleaved")
    problems.append(f"rotary positions of type {name}")
    return {}


def _state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A timm model's weights under vitviz's names (`convert_timm_state_dict`; for an `Eva`, its
    attention's q, k, v projections or q/v biases as one qkv, its LayerScale gammas and learned
    rotary frequencies as well)."""
    sd = _parallel_state_dict(model, stem_state_dict(model, dict(model.state_dict())))
    family = _family(model)
    if family == "NaFlexVit":
        sd = _naflex_state_dict(model, sd)
    if family in ("Beit", "VisionTransformerRelPos"):
        sd = {k: v for k, v in sd.items() if not (".relative_position_bias_table" in k or ".rel_pos." in k
                                                  or k.startswith(("rel_pos_bias.", "shared_rel_pos.")))}
        sd.update(_relative_tables(model))
    if family in ("Eva", "Beit"):
        for i, b in enumerate(model.blocks):
            p, attn = f"blocks.{i}.", b.attn
            if getattr(attn, "qkv", None) is None:  # separate projections (EVA-02); the key has no bias in EvaAttention
                projs = [attn.q_proj, attn.k_proj, attn.v_proj]
                for n in ("q_proj", "k_proj", "v_proj"):
                    for t in ("weight", "bias"):
                        sd.pop(f"{p}attn.{n}.{t}", None)
                sd[p + "attn.qkv.weight"] = torch.cat([m.weight for m in projs])
                if any(m.bias is not None for m in projs):
                    sd[p + "attn.qkv.bias"] = torch.cat([m.bias if m.bias is not None else torch.zeros_like(m.weight[:, 0]) for m in projs])
            elif getattr(attn, "q_bias", None) is not None:  # EvaAttention's q and v biases; its key's is zero
                sd.pop(p + "attn.q_bias"), sd.pop(p + "attn.v_bias")
                sd[p + "attn.qkv.bias"] = torch.cat([attn.q_bias, torch.zeros_like(attn.q_bias), attn.v_bias])
            for timm_name, ours in (("gamma_1", "ls1.gamma"), ("gamma_2", "ls2.gamma")):
                if p + timm_name in sd:
                    sd[p + ours] = sd.pop(p + timm_name)
        if "rope.freqs" in sd:  # RoPE-Mixed: timm's (f_x, f_y) [2, L, H, d/2] for its grid's (first, second) axis
            f = sd.pop("rope.freqs")
            if model.rope.grid_indexing == "xy":  # its first coordinate is the column
                f = f.flip(0)
            sd["rotary.freqs"] = f.permute(1, 2, 0, 3)
    return convert_timm_state_dict(sd)


def _norm_kind(norm: nn.Module | None, eps: float) -> str | None:
    """"layernorm" for a LayerNorm with a weight and a bias, "rmsnorm" for an RMSNorm with a weight
    (timm's RmsNorm, torch's), each with epsilon `eps` (what vitviz builds); None for anything else."""
    name = type(norm).__name__
    if name == "LayerNorm" and norm.elementwise_affine and getattr(norm, "bias", None) is not None and norm.eps == eps:
        return "layernorm"
    if name in ("RmsNorm", "RMSNorm") and getattr(norm, "weight", None) is not None and norm.eps == eps:
        return "rmsnorm"
    return None


def _pool_problems(model: nn.Module) -> list[str]:
    """What a timm attention-pooling head ("map") has that vitviz's `AttentionPool` does not: vitviz
    models one learned query (the probe) with biased q, kv and output projections, no position
    embedding or normalised queries and keys of its own, then the blocks' kind of norm and an MLP (the
    blocks' activation, a width of its own) with a residual."""
    pool = getattr(model, "attn_pool", None)
    if type(pool).__name__ != "AttentionPoolLatent":
        return [f"an attention pool of type {type(pool).__name__}"]
    block, problems = model.blocks[0], []
    if _parallel(block):
        return ["attention pooling after parallel blocks"]
    if pool.latent_len != 1 or pool.pool != "token":
        problems.append(f"attention pooling with {pool.latent_len} queries read by {pool.pool!r}")
    if pool.pos_embed is not None or not all(isinstance(getattr(pool, n), nn.Identity) for n in ("q_norm", "k_norm")):
        problems.append("attention pooling with its own position embedding or normalised queries and keys")
    linear = [getattr(pool, n) for n in ("q", "kv", "proj")]
    if not all(isinstance(m, nn.Linear) and m.bias is not None for m in linear):
        problems.append("attention pooling without biased q, kv and output projections")
    mlp = pool.mlp
    if mlp is None or type(mlp).__name__ != "Mlp" or _act_name(mlp.act) != _act_name(block.mlp.act) or _norm_kind(pool.norm, block.norm1.eps) != _norm_kind(block.norm1, block.norm1.eps):
        problems.append("attention pooling without the blocks' norm and an MLP of their activation after it")
    if not isinstance(model.fc_norm, nn.Identity):
        problems.append("a norm after attention pooling")
    return problems


def _mlp_kind(mlp: nn.Module) -> str | None:
    """"plain" (timm's Mlp), "gated" (GluMlp, SwiGLU), or None for what vitviz does not model (a
    convolution, biases on some layers only)."""
    name = type(mlp).__name__
    if name == "Mlp" and isinstance(mlp.fc1, nn.Linear):
        return "plain"
    if name == "GluMlp" and isinstance(mlp.fc1, nn.Linear) and (mlp.fc1.bias is None) == (mlp.fc2.bias is None):
        return "gated"
    if name == "SwiGLU" and (mlp.fc1_g.bias is None) == (mlp.fc1_x.bias is None) == (mlp.fc2.bias is None):
        return "gated"
    return None


def _gates_first(model: nn.Module, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A GluMlp that gates with the second half of its input projection (`gate_last`) has the halves
    swapped, as vitviz's `GatedMLP` reads the gate first."""
    for i, block in enumerate(model.blocks):
        if type(getattr(block, "mlp", None)).__name__ == "GluMlp" and block.mlp.gate_last:
            for name in ("weight", "bias"):
                key = f"blocks.{i}.mlp.0.{name}"
                if key in sd:
                    sd[key] = torch.cat(sd[key].chunk(2, dim=0)[::-1])
    return sd


def _hidden(mlp: nn.Module) -> int:
    """The MLP's width (a gated one's after the gate)."""
    return mlp.fc2.in_features


def _act_name(act: nn.Module) -> str | None:
    if isinstance(act, nn.GELU):
        return "gelu" if act.approximate == "none" else "gelu_tanh"
    if type(act).__name__ == "QuickGELU":
        return "quick_gelu"
    if type(act).__name__ == "GELUTanh":
        return "gelu_tanh"
    if isinstance(act, nn.SiLU):
        return "silu"
    return None


def convert_timm_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """timm's names -> vitviz's: the same but for the MLPs' layers (fc1, fc2 -> 0, 2; SwiGLU's
    fc1_g, fc1_x -> one 0) and the attention pool's learned query (latent -> probe)."""
    out = {k.replace(".mlp.fc1.", ".mlp.0.").replace(".mlp.fc2.", ".mlp.2."): v for k, v in sd.items()}
    for key in [k for k in out if ".mlp.fc1_g." in k]:  # SwiGLU's two input projections: one, the gate's first
        out[key.replace(".mlp.fc1_g.", ".mlp.0.")] = torch.cat([out.pop(key), out.pop(key.replace(".fc1_g.", ".fc1_x."))])
    if "attn_pool.latent" in out:
        out["attn_pool.probe"] = out.pop("attn_pool.latent")
    return out


def _read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """The weights in a timm checkpoint file, as timm's `load_checkpoint` reads them (EMA weights
    first, "module." prefixes removed). Only tensors and a training run's `argparse.Namespace` are
    unpickled (`weights_only`)."""
    from timm.models import load_state_dict

    if not os.path.isfile(path):
        raise FileNotFoundError(f"weights_path for a timm model is a checkpoint file; {path} is not a file")
    if path.lower().endswith((".npz", ".npy")):
        raise ValueError(
            f"{os.path.basename(path)} is a NumPy (big_vision) checkpoint, which vitviz does not read: load it into timm's "
            "model (model = timm.create_model(name, num_classes=<its classes>); model.load_pretrained(path)) and pass that "
            "to vitviz.ViT.from_timm"
        )
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):  # timm train.py's "args", as newer timm allows them
            return load_state_dict(path, use_ema=True, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError) as exc:  # newer timm wraps torch's UnpicklingError in a RuntimeError
        if not isinstance(exc, pickle.UnpicklingError) and not isinstance(exc.__cause__, pickle.UnpicklingError):
            raise
        raise ValueError(
            f"{os.path.basename(path)} holds Python objects besides tensors, which vitviz does not unpickle: save the "
            "model's state_dict alone (torch.save(model.state_dict(), path) or safetensors)"
        ) from exc


def _checkpoint_classes(sd: dict[str, torch.Tensor]) -> int:
    """The class count of a checkpoint: the rows of its head (timm's `num_classes`), 0 without one."""
    head = sd.get("head.weight", sd.get("head.fc.weight"))  # a Swin's head is head.fc
    return int(head.shape[0]) if head is not None and head.ndim == 2 else 0


def _categories(model: nn.Module) -> tuple[str, ...] | None:
    """ImageNet class names for an ImageNet head, the checkpoint's own label names when it has
    them, "class i" for another classifier; None for a model without one."""
    n = model.num_classes
    if not n:
        return None
    cfg = getattr(model, "pretrained_cfg", None) or {}
    if cfg.get("label_names") and len(cfg["label_names"]) == n:
        return tuple(cfg["label_names"])
    from timm.data import ImageNetInfo, infer_imagenet_subset

    subset = infer_imagenet_subset(model)
    if subset:
        info = ImageNetInfo(subset)
        if info.num_classes() == n:
            return tuple(info.index_to_description(i) for i in range(n))
    arch = str(cfg.get("architecture", ""))
    if cfg.get("num_classes") == n and n != 1000 and ("clip" in arch or "_mci_" in arch or arch.startswith("vit_pe_core")):
        return None  # CLIP's (MobileCLIP's, Perception Encoder's) head is a projection into the text embedding space, not classes
    return tuple(f"class {i}" for i in range(n))


def _preprocessing(model: nn.Module, size: int | None = None) -> Preprocessing:
    """timm's own data config (`resolve_data_config`), at `size` px when given (the same crop share);
    its size is the pretrained config's, not the model's own when it was built for another. A
    NaFlexVit keeps each image's aspect ratio ("fit") with as many patches as a square of that size
    has (timm's naflex transforms' `max_seq_len`)."""
    from timm.data import resolve_data_config

    data = resolve_data_config({}, model=model)
    size = size or data["input_size"][-1]
    if _family(model) == "NaFlexVit":
        p = model.embeds.patch_size[0]
        return Preprocessing(image_size=size, mode="fit", patch_size=p, max_patches=(size // p) ** 2, mean=tuple(data["mean"]),
                             std=tuple(data["std"]), interpolation=data.get("interpolation", "bicubic"))
    crop_pct = data.get("crop_pct") or 1.0
    squash = data.get("crop_mode") == "squash" and crop_pct == 1.0
    return Preprocessing(
        image_size=size,
        resize_size=None if squash else math.floor(size / crop_pct),
        mode="squash" if squash else "crop",
        mean=tuple(data["mean"]),
        std=tuple(data["std"]),
        interpolation=data.get("interpolation", "bicubic"),
    )


def _spec(
    model: nn.Module, *, name: str, weights: str, size: int | None = None, locator: str | None = None, note: str = ""
) -> VariantSpec:
    """The model's spec at `size` px, by default at the size it was built for (`patch_embed.img_size`,
    which is the pretrained config's unless the model was created with another `img_size`).

    Args:
        locator: where the weights are; by default the pretrained config's hub repository.
        note: said after the name in the description (where the weights come from).
    """
    config = swin_config_from_timm(model) if is_timm_swin(model) else config_from_timm(model)
    categories = _categories(model)  # None with a head (CLIP): the head's output is the features
    cfg = getattr(model, "pretrained_cfg", None) or {}
    kind = "features" if categories is None else f"{len(categories)} classes"
    own = _preprocessing(model).image_size if _family(model) == "NaFlexVit" else config.image_size  # (NaFlex: the pretrained size, not its table's)
    size = own if size is None else check_size(size, patch_size=config.patch_size, name=name)
    if getattr(config, "rel_pos_bias", False) and size != config.image_size:
        raise ValueError(f"{name}: its relative position bias is learned for {config.image_size} px ({config.grid[0]}x"
                         f"{config.grid[1]} patches); it runs at that size only")
    preprocessing = _preprocessing(model, size)
    built = int(model.patch_embed.img_size[0]) if hasattr(model, "patch_embed") and not is_timm_swin(model) else size
    if size == config.image_size and built != size:  # not a multiple of the patch: timm's transform makes `built`, the model reads `size`
        preprocessing = replace(_preprocessing(model, built), image_size=size, full_size=built)
    return VariantSpec(
        name=name,
        config=config,
        preprocessing=preprocessing,
        categories=categories,
        source="timm",
        weights=weights,
        locator=(cfg.get("hf_hub_id") or "") if locator is None else locator,
        description=f"timm {name.removeprefix('timm:')}{note}: "
        f"{config.depth} x {config.heads} x {config.width}, /{config.patch_size}, {kind}",
    )


def from_timm(model: nn.Module) -> ViT:
    """A vitviz ViT with the weights of a timm `VisionTransformer` (ViT, DeiT, DINO, DINOv2, CLIP
    towers, fine-tuned or not), giving the same outputs, on the model's device and dtype and in its
    train/eval mode; preprocessing and labels from its `pretrained_cfg` (`ViT.from_timm` is this
    function). A `SwinTransformer` becomes a `vitviz.swin.Swin` (`vitviz.sources.swin`).
    """
    if is_timm_swin(model):  # hierarchical, windowed: vitviz.sources.swin
        ours = swin_from_timm(model)
    else:
        ours = ViT(config_from_timm(model))
        ours.load_state_dict(_gates_first(model, _state_dict(model)))
    config = ours.config
    cfg = getattr(model, "pretrained_cfg", None) or {}
    arch = cfg.get("architecture") or type(model).__name__
    pretrained = cfg.get("input_size")
    built = f"@{config.image_size}" if pretrained and pretrained[-1] != config.image_size else ""  # created with img_size=
    # no pretrained tag in the name: timm keeps the tag's config whether or not its weights were loaded
    ours.spec = _spec(model, name=f"timm:{arch}" + built, weights="converted from a timm model instance", locator="")
    param = next(model.parameters())
    return ours.to(device=param.device, dtype=param.dtype).train(model.training)


@register_source
class TimmSource(WeightsSource):
    name = "timm"
    prefix = "timm:"
    library = "timm"
    hub = True

    def specs(self) -> list[VariantSpec]:
        try:
            _timm()
        except ImportError:
            return []
        out = []
        for timm_name, size in CURATED:
            out.append(self.resolve(f"timm:{timm_name}" + (f"@{size}" if size else "")))
        return out

    def resolve(self, name: str, *, weights_path: str | None = None) -> VariantSpec:
        timm_name, size = _split(name)
        if weights_path is not None:
            path = os.path.abspath(os.path.expanduser(weights_path))
            model = _meta_model(timm_name, num_classes=_checkpoint_classes(_read_checkpoint(path)))
            return _spec(model, name=name, weights=f"the checkpoint {path}", size=size, locator=path,
                         note=f" from {os.path.basename(path)}")
        model = _meta_model(timm_name)
        if not model.pretrained_cfg.get("hf_hub_id"):
            return _spec(model, name=name, weights=f"none: timm has no pretrained weights for {timm_name}; pass weights_path=", size=size,
                         note=" (no pretrained weights)")
        return _spec(model, name=name, weights=f"timm {timm_name} (Hugging Face hub)", size=size)

    def _repo(self, spec: VariantSpec) -> str:
        if not spec.locator:
            raise WeightsUnavailableError(f"{spec.name} has no pretrained weights on the Hugging Face hub; pass weights_path=")
        return spec.locator.removeprefix("hf-hub:")

    def status(self, spec: VariantSpec) -> Status:
        if os.path.isabs(spec.locator):  # a checkpoint of the user's own (a hub repository is never absolute)
            return "cached"
        try:
            return "cached" if cached_file(self._repo(spec), _WEIGHT_FILES) else "download"
        except WeightsUnavailableError:
            return "download"

    def reachable(self) -> bool:
        return hub_reachable()

    def load(self, spec: VariantSpec, *, weights_path: str | None = None, progress: bool = True) -> ViT:
        """The model with timm's pretrained weights (through the hub's cache), or with `weights_path`
        from a checkpoint file, built with the spec's class count (`resolve` reads it from the file)."""
        timm = _timm()
        timm_name, _ = _split(spec.name)
        if weights_path is not None:
            sd = _read_checkpoint(os.path.expanduser(weights_path))
            model = timm.create_model(timm_name, pretrained=False, num_classes=spec.config.num_classes)
            try:
                model.load_state_dict(sd)
            except RuntimeError as exc:
                raise ValueError(
                    f"the checkpoint {os.path.basename(weights_path)} does not fit {spec.name} ({spec.description}): name the "
                    f"timm architecture it was trained as (the class count is read from its head.weight). {exc}"
                ) from None
        else:
            repo = self._repo(spec)
            if not cached_file(repo, _WEIGHT_FILES):
                why = "VITVIZ_OFFLINE or HF_HUB_OFFLINE is set" if hub_offline() else "huggingface.co cannot be reached"
                if hub_offline() or not hub_reachable():
                    raise WeightsUnavailableError(missing_message(spec.name, repo, why, weights_path_hint="a timm checkpoint file"))
            try:
                model = timm.create_model(timm_name, pretrained=True)
            except OSError as exc:  # the hub client's errors for a missing file are OSErrors
                raise WeightsUnavailableError(
                    missing_message(spec.name, repo, f"{type(exc).__name__}: {exc}", weights_path_hint="a timm checkpoint file")
                ) from exc
        ours = self.convert(model.eval())
        ours.spec = spec
        return ours

    def convert(self, model: nn.Module, **options) -> ViT:
        return from_timm(model, **options)


ViT.from_timm = staticmethod(from_timm)  # the same function, for existing callers
