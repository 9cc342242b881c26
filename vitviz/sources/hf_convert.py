"""Hugging Face transformers' modules in hand -> vitviz's records and state dicts: a `ViTModel`'s,
`Dinov2Model`'s, `DINOv3ViTModel`'s or an image–text model's vision tower as a `ViTConfig` and the state dict of a vitviz
`ViT`; a CLIP or SigLIP text tower as a `TextConfig` and the state dict of an `ImageTextModel`. No
download and no import of transformers: the modules are read as they are (`vitviz.sources.hf` finds
and loads them)."""

from __future__ import annotations

import math

import torch
from torch import nn

from vitviz.config import TextConfig, ViTConfig

__all__ = ["config_from_transformers", "text_config_from_transformers", "convert_transformers_state_dict", "convert_image_text_state_dict"]

IMAGE_TEXT = ("clip", "siglip", "siglip2")  # model types that become an ImageTextModel
SIGLIP = ("siglip", "siglip2")  # image-text models that pool with attention and score with sigmoids
TYPES = ("vit", "dinov2", "dinov2_with_registers", "dinov3_vit", "aimv2_vision_model", *IMAGE_TEXT)  # model types read here
_ACTS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "quick_gelu": "quick_gelu",
         "silu": "silu"}


def _backbone(model: nn.Module) -> tuple[nn.Module, nn.Module | None]:
    """(the encoder with its embeddings, the classifier or None)."""
    base_prefix = getattr(model, "base_model_prefix", "")
    backbone = getattr(model, base_prefix, None) if base_prefix else None
    if backbone is None or not hasattr(backbone, "embeddings"):
        backbone = model
    classifier = getattr(model, "classifier", None) if backbone is not model else None
    return backbone, classifier


def _layers(backbone: nn.Module) -> nn.ModuleList:
    layers = getattr(backbone, "layers", None)
    if layers is None and hasattr(backbone, "encoder"):
        layers = getattr(backbone.encoder, "layer", None)
    if layers is None:
        raise NotImplementedError(f"{type(backbone).__name__}: cannot find its layers (vitviz reads transformers 5's layout)")
    return layers


def _shape(cfg) -> dict:
    """The `ViTConfig` fields every vision config states: image and patch side, width, depth, heads."""
    side = cfg.image_size if isinstance(cfg.image_size, int) else cfg.image_size[0]
    patch = cfg.patch_size if isinstance(cfg.patch_size, int) else cfg.patch_size[0]
    return dict(image_size=side, patch_size=patch, width=cfg.hidden_size, depth=cfg.num_hidden_layers, heads=cfg.num_attention_heads)


def _act(name: str) -> str:
    if name not in _ACTS:
        raise NotImplementedError(f"the activation {name!r} is not modelled by vitviz")
    return _ACTS[name]


def config_from_transformers(model: nn.Module) -> ViTConfig:
    """The `ViTConfig` of a Hugging Face ViT / DINOv2 model (of a CLIP or SigLIP model: its image tower's), or a
    clear error."""
    cfg = model.config
    kind = getattr(cfg, "model_type", None)
    if kind not in TYPES:
        raise TypeError(f"expected a Hugging Face ViT, DINOv2, DINOv2-with-registers, DINOv3, AIMv2, CLIP, SigLIP or SigLIP 2 model, "
                        f"got model_type {kind!r}")
    if kind in IMAGE_TEXT:
        vision = cfg.vision_config
        own = (  # what the image towers do differently
            dict(class_token=False, pool="map")  # SigLIP: no cls token; the attention-pooling head (its probe) reads the tokens
            if kind in SIGLIP else
            dict(patch_bias=False, norm_pre=True)  # CLIP: pre_layrnorm; post_layernorm on the cls token alone (per token: the same)
        )
        if kind == "siglip2":  # NaFlex: a square table of num_patches resampled to each image's grid, bilinear and antialiased
            side = math.isqrt(vision.num_patches)
            if side * side != vision.num_patches:
                raise NotImplementedError(f"SigLIP 2 with {vision.num_patches} position embeddings (not a square table) is not modelled by vitviz")
            own |= dict(pos_embed_interpolation="bilinear", pos_embed_antialias=True)
        return ViTConfig(
            image_size=vision.image_size if kind != "siglip2" else side * vision.patch_size,
            patch_size=vision.patch_size,
            width=vision.hidden_size,
            depth=vision.num_hidden_layers,
            heads=vision.num_attention_heads,
            mlp_dim=vision.intermediate_size,
            num_classes=0,
            final_norm=True,  # post_layernorm
            act=_act(vision.hidden_act),
            eps=vision.layer_norm_eps,
            **({"pos_embed_antialias": False} | own),
        )
    if kind == "dinov3_vit":
        return _dinov3_config(model)
    if kind == "aimv2_vision_model":
        return _aimv2_config(model)
    if getattr(cfg, "use_swiglu_ffn", False):
        raise NotImplementedError("DINOv2 with a SwiGLU MLP (the giant model) is not modelled by vitviz")
    _act(cfg.hidden_act)
    backbone, classifier = _backbone(model)
    if kind != "vit" and classifier is not None:
        raise NotImplementedError(
            f"{type(model).__name__} classifies from the cls token and the mean patch token together; load its backbone "
            f"({type(backbone).__name__}) instead"
        )
    first = _layers(backbone)[0]
    mlp_dim = first.mlp.fc1.out_features
    registers = getattr(cfg, "num_register_tokens", 0) if kind == "dinov2_with_registers" else 0
    return ViTConfig(
        **_shape(cfg),
        mlp_dim=mlp_dim,
        num_classes=classifier.out_features if classifier is not None else 0,
        register_tokens=registers,
        pos_embed_prefix=1,  # the cls token's position embedding; registers have none
        layer_scale=None if kind == "vit" else float(getattr(cfg, "layerscale_value", 1.0)),
        qkv_bias=bool(getattr(cfg, "qkv_bias", True)),
        proj_bias=first.attention.o_proj.bias is not None,
        mlp_bias=first.mlp.fc1.bias is not None,
        patch_bias=backbone.embeddings.patch_embeddings.projection.bias is not None,
        final_norm=True,
        act=_ACTS[cfg.hidden_act],
        eps=cfg.layer_norm_eps,
        # transformers resamples position embeddings bicubically, antialiased only for DINOv2 with registers
        pos_embed_antialias=kind == "dinov2_with_registers",
    )


def _dinov3_config(model: nn.Module) -> ViTConfig:
    """A `DINOv3ViTModel`'s: a cls token and registers without position embeddings, rotary positions
    (patch centres in [-1, 1], periods of rope_theta, the pairs' halves), LayerScale, a plain or gated
    MLP, the final norm; no classifier (the pooled output is the cls token)."""
    cfg = model.config
    first = model.model.layer[0]
    gated = bool(cfg.use_gated_mlp)
    biases = (cfg.query_bias, cfg.key_bias, cfg.value_bias)
    return ViTConfig(
        **_shape(cfg),
        mlp_dim=cfg.intermediate_size,
        mlp="gated" if gated else "plain",
        num_classes=0,
        register_tokens=cfg.num_register_tokens,
        abs_pos_embed=False,
        rope="dinov3",
        rope_temperature=float(cfg.rope_theta),
        rope_pairs="half",
        layer_scale=float(cfg.layerscale_value),
        qkv_bias=any(biases),
        proj_bias=first.attention.o_proj.bias is not None,
        mlp_bias=bool(cfg.mlp_bias),
        act=_act(cfg.hidden_act),
        eps=cfg.layer_norm_eps,
    )


def _aimv2_config(model: nn.Module) -> ViTConfig:
    """An `Aimv2VisionModel`'s: no cls token, an RMSNorm after the patch embedding and everywhere else,
    a learned position table, SwiGLU, and (with `use_head`) its attention pool: the learned query
    itself against key and value projections, then an output projection (`pool_head="plain"`);
    without a head, the mean of its normalised patch tokens (transformers pools nothing then)."""
    cfg = model.config
    if cfg.is_native:
        raise NotImplementedError("AIMv2's native-resolution model (sine-cosine positions computed for each image) is not "
                                  "modelled by vitviz; its fixed-size models are")
    return ViTConfig(
        **_shape(cfg), mlp_dim=cfg.intermediate_size, mlp="gated", act=_act(cfg.hidden_act), num_classes=0, class_token=False,
        norm="rmsnorm", patch_norm=True, eps=cfg.rms_norm_eps, qkv_bias=bool(cfg.qkv_bias), proj_bias=bool(cfg.qkv_bias),
        mlp_bias=bool(cfg.mlp_bias), pool="map" if cfg.use_head else "avg", pool_head="plain", pos_embed_antialias=False,
    )


def _aimv2_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    emb = model.embeddings
    sd: dict[str, torch.Tensor] = {
        "patch_embed.proj.weight": emb.patch_embed.weight, "patch_embed.proj.bias": emb.patch_embed.bias,
        "patch_embed.norm.weight": emb.rms_norm.weight, "pos_embed": emb.position_embedding.weight[None],
        "norm.weight": model.rms_norm.weight,
    }
    for i, layer in enumerate(model.encoder.layers):
        at, mlp, p = layer.attention, layer.ffn, f"blocks.{i}."
        sd[p + "norm1.weight"], sd[p + "norm2.weight"] = layer.rms_norm1.weight, layer.rms_norm2.weight
        sd[p + "attn.qkv.weight"] = torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight])
        sd[p + "attn.proj.weight"] = at.out_proj.weight
        if at.q_proj.bias is not None:
            sd[p + "attn.qkv.bias"] = torch.cat([at.q_proj.bias, at.k_proj.bias, at.v_proj.bias])
            sd[p + "attn.proj.bias"] = at.out_proj.bias
        sd[p + "mlp.0.weight"] = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        sd[p + "mlp.2.weight"] = mlp.down_proj.weight
        if mlp.down_proj.bias is not None:
            sd[p + "mlp.0.bias"] = torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias])
            sd[p + "mlp.2.bias"] = mlp.down_proj.bias
    if model.config.use_head:
        head = model.head
        sd["attn_pool.probe"] = head.cls_token
        sd["attn_pool.kv.weight"] = torch.cat([head.k_proj.weight, head.v_proj.weight])
        if head.k_proj.bias is not None:
            sd["attn_pool.kv.bias"] = torch.cat([head.k_proj.bias, head.v_proj.bias])
        sd["attn_pool.proj.weight"], sd["attn_pool.proj.bias"] = head.output_proj.weight, head.output_proj.bias
    return {k: v.detach() for k, v in sd.items()}


def _dinov3_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A `DINOv3ViTModel`'s weights under vitviz's names: q, k, v stacked (a missing bias as zeros),
    a gated MLP's gate and up projections as one (the gate's first)."""
    emb = model.embeddings
    sd: dict[str, torch.Tensor] = {
        "patch_embed.proj.weight": emb.patch_embeddings.weight, "patch_embed.proj.bias": emb.patch_embeddings.bias,
        "cls_token": emb.cls_token, "norm.weight": model.norm.weight, "norm.bias": model.norm.bias,
    }
    if model.config.num_register_tokens:
        sd["reg_token"] = emb.register_tokens
    for i, layer in enumerate(model.model.layer):
        at, mlp, p = layer.attention, layer.mlp, f"blocks.{i}."
        sd[p + "norm1.weight"], sd[p + "norm1.bias"] = layer.norm1.weight, layer.norm1.bias
        sd[p + "norm2.weight"], sd[p + "norm2.bias"] = layer.norm2.weight, layer.norm2.bias
        projs = (at.q_proj, at.k_proj, at.v_proj)
        sd[p + "attn.qkv.weight"] = torch.cat([m.weight for m in projs])
        if any(m.bias is not None for m in projs):
            sd[p + "attn.qkv.bias"] = torch.cat([m.bias if m.bias is not None else torch.zeros_like(m.weight[:, 0]) for m in projs])
        sd[p + "attn.proj.weight"] = at.o_proj.weight
        if at.o_proj.bias is not None:
            sd[p + "attn.proj.bias"] = at.o_proj.bias
        ins = [mlp.gate_proj, mlp.up_proj] if hasattr(mlp, "gate_proj") else [mlp.up_proj]
        sd[p + "mlp.0.weight"] = torch.cat([m.weight for m in ins])
        sd[p + "mlp.2.weight"] = mlp.down_proj.weight
        if mlp.down_proj.bias is not None:
            sd[p + "mlp.0.bias"] = torch.cat([m.bias for m in ins])
            sd[p + "mlp.2.bias"] = mlp.down_proj.bias
        sd[p + "ls1.gamma"], sd[p + "ls2.gamma"] = layer.layer_scale1.lambda1, layer.layer_scale2.lambda1
    return {k: v.detach() for k, v in sd.items()}


def convert_transformers_state_dict(model: nn.Module, config: ViTConfig) -> dict[str, torch.Tensor]:
    """The model's weights under vitviz's names: q, k and v stacked into one qkv projection (each
    with its heads contiguous, the same layout as vitviz's "(three h d)")."""
    if getattr(model.config, "model_type", None) == "dinov3_vit":
        return _dinov3_state_dict(model)
    if getattr(model.config, "model_type", None) == "aimv2_vision_model":
        return _aimv2_state_dict(model)
    backbone, classifier = _backbone(model)
    emb = backbone.embeddings
    sd: dict[str, torch.Tensor] = {
        "patch_embed.proj.weight": emb.patch_embeddings.projection.weight,
        "cls_token": emb.cls_token,
        "pos_embed": emb.position_embeddings,
        "norm.weight": backbone.layernorm.weight,
        "norm.bias": backbone.layernorm.bias,
    }
    if emb.patch_embeddings.projection.bias is not None:
        sd["patch_embed.proj.bias"] = emb.patch_embeddings.projection.bias
    if config.register_tokens:
        sd["reg_token"] = emb.register_tokens
    dinov2 = hasattr(_layers(backbone)[0], "norm1")
    for i, layer in enumerate(_layers(backbone)):
        at = layer.attention
        norm1, norm2 = (layer.norm1, layer.norm2) if dinov2 else (layer.layernorm_before, layer.layernorm_after)
        p = f"blocks.{i}."
        sd[p + "norm1.weight"], sd[p + "norm1.bias"] = norm1.weight, norm1.bias
        sd[p + "norm2.weight"], sd[p + "norm2.bias"] = norm2.weight, norm2.bias
        sd[p + "attn.qkv.weight"] = torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight])
        if at.q_proj.bias is not None:
            sd[p + "attn.qkv.bias"] = torch.cat([at.q_proj.bias, at.k_proj.bias, at.v_proj.bias])
        sd[p + "attn.proj.weight"] = at.o_proj.weight
        if at.o_proj.bias is not None:
            sd[p + "attn.proj.bias"] = at.o_proj.bias
        for ours, theirs in (("mlp.0", layer.mlp.fc1), ("mlp.2", layer.mlp.fc2)):
            sd[f"{p}{ours}.weight"] = theirs.weight
            if theirs.bias is not None:
                sd[f"{p}{ours}.bias"] = theirs.bias
        if dinov2:
            sd[p + "ls1.gamma"] = layer.layer_scale1.lambda1
            sd[p + "ls2.gamma"] = layer.layer_scale2.lambda1
    if classifier is not None:
        sd["head.weight"], sd["head.bias"] = classifier.weight, classifier.bias
    return {k: v.detach() for k, v in sd.items()}


def text_config_from_transformers(model: nn.Module) -> TextConfig:
    """The `TextConfig` of a Hugging Face CLIP or SigLIP model's text tower.

    CLIP reads each text at its end-of-text token: the first position holding the config's
    `eos_token_id`, or, where that id is 2 (the configs written before transformers' PR #24773), the
    position of the highest id, as transformers does. SigLIP reads the last position (its texts are
    padded to the context length), attends without a causal mask, and its projection has a bias.
    """
    cfg, text = model.config, model.config.text_config
    if cfg.model_type in SIGLIP:
        return TextConfig(
            vocab_size=text.vocab_size,
            context_length=text.max_position_embeddings,
            width=text.hidden_size,
            depth=text.num_hidden_layers,
            heads=text.num_attention_heads,
            mlp_dim=text.intermediate_size,
            embed_dim=getattr(text, "projection_size", None) or text.hidden_size,
            causal=False,
            pool="last",
            proj_bias=True,
            act=_act(text.hidden_act),
            eps=text.layer_norm_eps,
        )
    eos = getattr(text, "eos_token_id", None)
    return TextConfig(
        vocab_size=text.vocab_size,
        context_length=text.max_position_embeddings,
        width=text.hidden_size,
        depth=text.num_hidden_layers,
        heads=text.num_attention_heads,
        mlp_dim=text.intermediate_size,
        embed_dim=cfg.projection_dim,
        causal=True,
        pool="eos",
        eos_token_id=None if eos == 2 or eos is None else int(eos),
        proj_bias=False,
        act=_act(text.hidden_act),
        eps=text.layer_norm_eps,
    )


def _clip_layers(layers: nn.ModuleList, prefix: str) -> dict[str, torch.Tensor]:
    """CLIP's encoder layers under vitviz's block names (`EncoderBlock`, `TextBlock`): q, k and v
    stacked into one qkv projection."""
    sd: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(layers):
        at, p = layer.self_attn, f"{prefix}blocks.{i}."
        sd[p + "norm1.weight"], sd[p + "norm1.bias"] = layer.layer_norm1.weight, layer.layer_norm1.bias
        sd[p + "norm2.weight"], sd[p + "norm2.bias"] = layer.layer_norm2.weight, layer.layer_norm2.bias
        sd[p + "attn.qkv.weight"] = torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight])
        sd[p + "attn.qkv.bias"] = torch.cat([at.q_proj.bias, at.k_proj.bias, at.v_proj.bias])
        sd[p + "attn.proj.weight"], sd[p + "attn.proj.bias"] = at.out_proj.weight, at.out_proj.bias
        sd[p + "mlp.0.weight"], sd[p + "mlp.0.bias"] = layer.mlp.fc1.weight, layer.mlp.fc1.bias
        sd[p + "mlp.2.weight"], sd[p + "mlp.2.bias"] = layer.mlp.fc2.weight, layer.mlp.fc2.bias
    return sd


def _siglip_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A Hugging Face `SiglipModel`'s (or `Siglip2Model`'s) weights under an `ImageTextModel`'s names:
    the attention-pooling head's `nn.MultiheadAttention` input projection split into the probe's q and
    the tokens' k, v; SigLIP 2's linear projection of each patch's pixels (flattened row by row,
    channels last, as its processor cuts them) as the Conv2d that computes the same."""
    vision, text = model.vision_model, model.text_model
    head, d = vision.head, vision.config.hidden_size
    patch = vision.embeddings.patch_embedding.weight
    if patch.ndim == 2:  # [D, P*P*C]: (y, x, channel) -> [D, C, P, P]
        p = vision.config.patch_size
        patch = patch.reshape(d, p, p, -1).permute(0, 3, 1, 2).contiguous()
    sd: dict[str, torch.Tensor] = {
        "image.patch_embed.proj.weight": patch,
        "image.patch_embed.proj.bias": vision.embeddings.patch_embedding.bias,
        "image.pos_embed": vision.embeddings.position_embedding.weight[None],  # [1, gh*gw, D]
        "image.norm.weight": vision.post_layernorm.weight,
        "image.norm.bias": vision.post_layernorm.bias,
        "image.attn_pool.probe": head.probe,
        "image.attn_pool.q.weight": head.attention.in_proj_weight[:d],
        "image.attn_pool.q.bias": head.attention.in_proj_bias[:d],
        "image.attn_pool.kv.weight": head.attention.in_proj_weight[d:],
        "image.attn_pool.kv.bias": head.attention.in_proj_bias[d:],
        "image.attn_pool.proj.weight": head.attention.out_proj.weight,
        "image.attn_pool.proj.bias": head.attention.out_proj.bias,
        "image.attn_pool.norm.weight": head.layernorm.weight,
        "image.attn_pool.norm.bias": head.layernorm.bias,
        "image.attn_pool.mlp.0.weight": head.mlp.fc1.weight,
        "image.attn_pool.mlp.0.bias": head.mlp.fc1.bias,
        "image.attn_pool.mlp.2.weight": head.mlp.fc2.weight,
        "image.attn_pool.mlp.2.bias": head.mlp.fc2.bias,
        "text.token_embed.weight": text.embeddings.token_embedding.weight,
        "text.pos_embed": text.embeddings.position_embedding.weight[None],
        "text.norm.weight": text.final_layer_norm.weight,
        "text.norm.bias": text.final_layer_norm.bias,
        "text.proj.weight": text.head.weight,
        "text.proj.bias": text.head.bias,
        "logit_scale": model.logit_scale.reshape(()),
        "logit_bias": model.logit_bias.reshape(()),
    }
    sd |= _clip_layers(vision.encoder.layers, "image.") | _clip_layers(text.encoder.layers, "text.")
    return {k: v.detach() for k, v in sd.items()}


def convert_image_text_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A Hugging Face `CLIPModel`'s (or `SiglipModel`'s) weights under the names of a
    `vitviz.imagetext.ImageTextModel`."""
    if model.config.model_type in SIGLIP:
        return _siglip_state_dict(model)
    vision, text = model.vision_model, model.text_model
    emb = vision.embeddings
    sd: dict[str, torch.Tensor] = {
        "image.patch_embed.proj.weight": emb.patch_embedding.weight,
        "image.cls_token": emb.class_embedding.reshape(1, 1, -1),
        "image.pos_embed": emb.position_embedding.weight[None],  # [1, 1 + gh*gw, D]: the cls token's first
        "image.norm_pre.weight": vision.pre_layrnorm.weight,
        "image.norm_pre.bias": vision.pre_layrnorm.bias,
        "image.norm.weight": vision.post_layernorm.weight,
        "image.norm.bias": vision.post_layernorm.bias,
        "image_projection.weight": model.visual_projection.weight,
        "text.token_embed.weight": text.embeddings.token_embedding.weight,
        "text.pos_embed": text.embeddings.position_embedding.weight[None],  # [1, C, D]
        "text.norm.weight": text.final_layer_norm.weight,
        "text.norm.bias": text.final_layer_norm.bias,
        "text.proj.weight": model.text_projection.weight,
        "logit_scale": model.logit_scale.reshape(()),
    }
    sd |= _clip_layers(vision.encoder.layers, "image.") | _clip_layers(text.encoder.layers, "text.")
    return {k: v.detach() for k, v in sd.items()}
