"""Qwen-VL's vision towers as vitviz ViTs: Qwen2.5-VL's (`Qwen2_5_VLForConditionalGeneration`,
`Qwen2_5_VLModel` or the vision model itself) and Qwen3-VL's (`Qwen3VLForConditionalGeneration`,
`Qwen3VLModel`, `Qwen3VLVisionModel`).

    vitviz.from_transformers(model)                                          # a model in hand
    vitviz.load_model("hf:Qwen/Qwen2.5-VL-7B-Instruct")                       # the tower alone
    vitviz.load_model("hf:Qwen/Qwen2.5-VL-3B-Instruct", weights_path=folder)  # saved with save_pretrained

Hugging Face runs the tower on patches packed without a batch dimension, in the processor's order
(each 2 x 2 merge unit's four patches together) and, for Qwen2.5-VL, reordered window by window
(`window_index`), each window attending alone (`cu_seqlens`). vitviz's tower takes images
[B, 3, H, W] and keeps its tokens in grid order (row by row) throughout; the same arithmetic:

- the patch embedding: a Conv3d over `temporal_patch_size` frames of P x P pixels; a still image is
  its frame repeated in time, so it is a Conv2d whose kernel is the Conv3d's summed over time.
- 2D rotary positions (`ViTConfig.rope` "axial", pairs "half"): of a head's d channels, the first
  d/4 pairs turned by the patch's row, the next d/4 by its column, frequencies theta^(-k/(d/4)).
- Qwen2.5-VL: RMSNorm, SwiGLU MLPs, no bias in the patch embedding; every block but those of
  `fullatt_block_indexes` attends within windows of `window_size` pixels (`window_size` /
  `spatial_merge_size` / `patch_size` merge units, so as many times `spatial_merge_size` patches a
  side), cut from the grid's top-left corner, the windows of the last rows and columns smaller where
  the merged grid is not a whole number of windows (`ViTConfig.attn_window`, `global_blocks`).
- Qwen3-VL: LayerNorm, plain MLPs (tanh GELU), a learned table of positions resampled to each grid
  (bilinear, corners aligned, no antialiasing), global attention in every block.

The language model reads the tokens after the last block (no final norm: the merger has its own)
through the merger, which concatenates each cell of 2 x 2 neighbouring patches (row by row within
the cell) into one token of the language model's width: `QwenVisionTower.merge(tokens, grid)` gives
Hugging Face's image embeddings, row by row over the merged grid. Qwen3-VL also feeds the outputs
of some blocks (`deepstack_visual_indexes`) to the language model's first layers, each through a
merger of its own (`merge(tokens, grid, layer=...)`).

Preprocessing: Qwen's processor resizes each image to multiples of `patch_size` x
`spatial_merge_size` pixels (28 px for Qwen2.5-VL, 32 px for Qwen3-VL) within its min and max pixels,
keeping the aspect ratio (`smart_resize`). vitviz's spec squashes every image to a 448 px square
(a multiple of both: 32 x 32 patches of 14 px, 28 x 28 of 16 px), bicubic, with the processor's mean
and std (without a saved processor, the published ones: CLIP's for Qwen2.5-VL, 0.5 for Qwen3-VL);
"@<pixels>" feeds another side, which must be a multiple of the merge's pixels for `merge`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitviz.config import Preprocessing, ViTConfig
from vitviz.model import ViT, norm_layer
from vitviz.sources.base import VariantSpec, WeightsUnavailableError
from vitviz.sources.hub import missing_message
from vitviz.vlm.towers import TowerInfo

__all__ = [
    "QWEN_TYPES",
    "IMAGE_SIZE",
    "PatchMerger",
    "QwenVisionTower",
    "qwen_config",
    "qwen_state_dict",
    "qwen_tower_info",
    "qwen_preprocessing",
    "qwen_spec",
    "qwen_from_transformers",
    "load_qwen_tower",
]

QWEN2_5 = ("qwen2_5_vl", "qwen2_5_vl_vision")
QWEN3 = ("qwen3_vl", "qwen3_vl_vision")
QWEN_TYPES = QWEN2_5 + QWEN3  # model types read here (the VLM's, and its vision config's)
IMAGE_SIZE = 448  # the side of vitviz's square input (a multiple of 28 and of 32)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_ACTS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
         "gelu_fast": "gelu_tanh", "quick_gelu": "quick_gelu"}
_RESAMPLE = {0: "nearest", 2: "bilinear", 3: "bicubic"}  # PIL's codes, as image processors store them


def _vision_config(cfg: Any) -> Any:
    """The vision config of a Qwen-VL config (or the vision config itself)."""
    return cfg.vision_config if getattr(cfg, "vision_config", None) is not None else cfg


def _family(cfg: Any) -> str:
    """The VLM's model type ("qwen2_5_vl", "qwen3_vl") of a Qwen-VL config or its vision config."""
    kind = getattr(cfg, "model_type", None)
    if kind not in QWEN_TYPES:
        raise ValueError(f"a {kind} config is not Qwen2.5-VL's or Qwen3-VL's")
    return kind.removesuffix("_vision")


def _int(value: Any, what: str) -> int:
    """One side of a square patch (configs may give a list of equal sides)."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"vitviz reads square, equal {what}s, got {list(value)}")
        value = value[0]
    return int(value)


def qwen_config(cfg: Any) -> ViTConfig:
    """The `ViTConfig` of a Qwen2.5-VL or Qwen3-VL vision tower, from its model's config or its vision
    config: no classifier, no prefix token, no final norm, the patches' mean as the pooled features,
    448 px images (Qwen3-VL: its learned table's grid, `num_position_embeddings` patches)."""
    family, vc = _family(cfg), _vision_config(cfg)
    if int(getattr(vc, "in_channels", 3)) != 3:
        raise ValueError(f"vitviz reads RGB images; this tower takes {vc.in_channels} channels")
    rope = getattr(vc, "rope_parameters", None) or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"vitviz reads Qwen-VL's axial rotary positions, not {rope.get('rope_type')!r}")
    if vc.hidden_act not in _ACTS:
        raise ValueError(f"the activation {vc.hidden_act!r} is not one vitviz models")
    patch = _int(vc.patch_size, "patch size")
    fields = dict(patch_size=patch, width=vc.hidden_size, depth=vc.depth, heads=vc.num_heads, mlp_dim=vc.intermediate_size,
                  num_classes=0, class_token=False, pool="avg", final_norm=False, qkv_bias=True, proj_bias=True, mlp_bias=True,
                  act=_ACTS[vc.hidden_act], rope="axial", rope_pairs="half", rope_axes="yx",
                  rope_temperature=float(rope.get("rope_theta", 10000.0)), eps=1e-6)
    if family == "qwen2_5_vl":
        merge = int(vc.spatial_merge_size)
        units = int(vc.window_size) // merge // patch
        if units < 1:
            raise ValueError(f"a window of {vc.window_size} px holds no merge unit of {merge} x {merge} patches of {patch} px")
        return ViTConfig(image_size=IMAGE_SIZE, **fields, patch_bias=False, abs_pos_embed=False, norm="rmsnorm", mlp="gated",
                         attn_window=units * merge, global_blocks=tuple(i for i in vc.fullatt_block_indexes if 0 <= i < vc.depth))
    side = math.isqrt(int(vc.num_position_embeddings))
    if side * side != int(vc.num_position_embeddings):
        raise ValueError(f"vitviz reads a square table of positions, got {vc.num_position_embeddings} entries")
    return ViTConfig(image_size=side * patch, **fields, patch_bias=True, abs_pos_embed=True, norm="layernorm", mlp="plain",
                     pos_embed_interpolation="bilinear", pos_embed_align_corners=True, pos_embed_antialias=False)


def qwen_tower_info(cfg: Any) -> TowerInfo:
    """What the language model reads: the last block's output, no final norm, merged r x r
    (`spatial_merge_size`)."""
    vc = _vision_config(cfg)
    return TowerInfo(family=_family(cfg), feature_layer=int(vc.depth) - 1, final_norm=False, drop_prefix=True,
                     merge=int(vc.spatial_merge_size))


class PatchMerger(nn.Module):
    """Qwen-VL's merger of r x r neighbouring patches into one language-model token.

    tokens [B, gh*gw, D] (grid order) -> each cell of r x r patches concatenated, row by row within
    the cell, [B, (gh/r)(gw/r), r²D] -> Linear `fc1`, GELU, Linear `fc2` -> [B, (gh/r)(gw/r), out].
    The norm (`norm`: RMSNorm for Qwen2.5-VL's `ln_q`, LayerNorm for Qwen3-VL's) runs on each token
    before the concatenation, or with `after` on the concatenated r²D (Qwen3-VL's deepstack mergers).
    """

    def __init__(self, width: int, out_width: int, merge: int, *, norm: str = "rmsnorm", after: bool = False, eps: float = 1e-6) -> None:
        super().__init__()
        self.merge, self.after = merge, after
        hidden = width * merge * merge
        self.norm = norm_layer(norm, hidden if after else width, eps)
        self.fc1 = nn.Linear(hidden, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, out_width)

    def forward(self, tokens: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """[B, gh*gw, D] in grid order -> [B, (gh/r)(gw/r), out], row by row over the merged grid."""
        (gh, gw), r = grid, self.merge
        b, n, d = tokens.shape
        if n != gh * gw or gh % r or gw % r:
            raise ValueError(f"{n} tokens on a {gh} x {gw} grid do not make whole cells of {r} x {r} patches")
        x = tokens if self.after else self.norm(tokens)
        x = x.reshape(b, gh // r, r, gw // r, r, d).permute(0, 1, 3, 2, 4, 5).reshape(b, (gh // r) * (gw // r), r * r * d)
        if self.after:
            x = self.norm(x)
        return self.fc2(self.act(self.fc1(x)))


class QwenVisionTower(ViT):
    """A Qwen-VL vision tower: a vitviz `ViT` (its config, blocks and outputs as any other's; images
    [B, 3, H, W], H and W multiples of P, tokens in grid order) with the merger the language model
    reads it through (`merger`; Qwen3-VL's deepstack mergers `deepstack`, for the blocks
    `deepstack_layers`) and `tower_info`."""

    def __init__(self, config: ViTConfig, *, out_width: int, merge: int, merger_norm: str = "rmsnorm",
                 deepstack_layers: tuple[int, ...] = ()) -> None:
        super().__init__(config)
        self.merger = PatchMerger(config.width, out_width, merge, norm=merger_norm)
        self.deepstack_layers = tuple(int(i) for i in deepstack_layers)
        self.deepstack = nn.ModuleList(PatchMerger(config.width, out_width, merge, norm=merger_norm, after=True)
                                       for _ in self.deepstack_layers)
        self.tower_info: TowerInfo | None = None

    def merge(self, tokens: torch.Tensor, grid: tuple[int, int] | None = None, *, layer: int | None = None) -> torch.Tensor:
        """The language model's image tokens [B, (gh/r)(gw/r), out], row by row over the merged grid,
        from the tower's tokens [B, gh*gw, D] in grid order (`encode`'s output; `grid` (gh, gw), None
        for a square one). `layer`: one of `deepstack_layers`, whose output `tokens` then is (Qwen3-VL's
        deepstack); None: the last block's (the merger)."""
        n = tokens.shape[1]
        if grid is None:
            side = math.isqrt(n)
            if side * side != n:
                raise ValueError(f"{n} tokens are no square grid; pass the grid (gh, gw)")
            grid = (side, side)
        if layer is None:
            return self.merger(tokens, tuple(grid))
        if layer not in self.deepstack_layers:
            raise ValueError(f"block {layer} has no deepstack merger; those of blocks {list(self.deepstack_layers)} do")
        return self.deepstack[self.deepstack_layers.index(layer)](tokens, tuple(grid))


def qwen_state_dict(state: Mapping[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
    """A Hugging Face Qwen-VL vision model's state dict (its own keys: "blocks.0.attn.qkv.weight", ...)
    as a `QwenVisionTower`'s: the Conv3d's kernel summed over time (in float32), a SwiGLU's gate and up
    projections as one (the gate's first), the learned positions as `pos_embed` [1, n, D]."""
    family, vc = _family(cfg), _vision_config(cfg)
    qwen3 = family == "qwen3_vl"
    kernel = state["patch_embed.proj.weight"]
    sd: dict[str, torch.Tensor] = {"patch_embed.proj.weight": kernel.float().sum(dim=2)}
    if qwen3:
        sd["patch_embed.proj.bias"] = state["patch_embed.proj.bias"]
        sd["pos_embed"] = state["pos_embed.weight"][None]
    for i in range(int(vc.depth)):
        p = f"blocks.{i}."  # the blocks' norms and attention have the same names in both
        for name in ("norm1.weight", "norm2.weight", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias"):
            sd[p + name] = state[p + name]
        if qwen3:
            for name in ("norm1.bias", "norm2.bias"):
                sd[p + name] = state[p + name]
        for kind in ("weight", "bias"):
            if qwen3:
                sd[f"{p}mlp.0.{kind}"] = state[f"{p}mlp.linear_fc1.{kind}"]
                sd[f"{p}mlp.2.{kind}"] = state[f"{p}mlp.linear_fc2.{kind}"]
            else:
                sd[f"{p}mlp.0.{kind}"] = torch.cat([state[f"{p}mlp.gate_proj.{kind}"], state[f"{p}mlp.up_proj.{kind}"]])
                sd[f"{p}mlp.2.{kind}"] = state[f"{p}mlp.down_proj.{kind}"]
    deepstack = len(getattr(vc, "deepstack_visual_indexes", ()) or ()) if qwen3 else 0
    mergers = [("merger.", "merger.")] + [(f"deepstack_merger_list.{j}.", f"deepstack.{j}.") for j in range(deepstack)]
    for theirs, ours in mergers:
        if qwen3:
            names = {"norm.weight": "norm.weight", "norm.bias": "norm.bias", "linear_fc1.weight": "fc1.weight",
                     "linear_fc1.bias": "fc1.bias", "linear_fc2.weight": "fc2.weight", "linear_fc2.bias": "fc2.bias"}
        else:
            names = {"ln_q.weight": "norm.weight", "mlp.0.weight": "fc1.weight", "mlp.0.bias": "fc1.bias",
                     "mlp.2.weight": "fc2.weight", "mlp.2.bias": "fc2.bias"}
        for a, b in names.items():
            sd[ours + b] = state[theirs + a]
    return sd


def _build(cfg: Any) -> QwenVisionTower:
    """An empty tower of `cfg` (random weights), with its `tower_info`."""
    vc = _vision_config(cfg)
    qwen3 = _family(cfg) == "qwen3_vl"
    tower = QwenVisionTower(qwen_config(cfg), out_width=int(vc.out_hidden_size), merge=int(vc.spatial_merge_size),
                            merger_norm="layernorm" if qwen3 else "rmsnorm",
                            deepstack_layers=tuple(getattr(vc, "deepstack_visual_indexes", ()) or ()) if qwen3 else ())
    tower.tower_info = qwen_tower_info(cfg)
    return tower


def qwen_preprocessing(cfg: Any, processor: Any = None, image_size: int = IMAGE_SIZE) -> Preprocessing:
    """vitviz's preprocessing for a Qwen-VL tower: a square of `image_size` px (448), bicubic unless the
    processor says otherwise, with the processor's (or its config dict's) mean and std; without one,
    the published processor's (CLIP's for Qwen2.5-VL, 0.5 for Qwen3-VL)."""
    qwen3 = _family(cfg) == "qwen3_vl"
    mean, std = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)) if qwen3 else (CLIP_MEAN, CLIP_STD)
    interpolation = "bicubic"
    if processor is not None:
        get = processor.get if isinstance(processor, dict) else (lambda k, d=None: getattr(processor, k, d))
        resample = get("resample", 3)
        interpolation = _RESAMPLE.get(int(getattr(resample, "value", resample)), "bicubic")
        if get("do_normalize", True):
            mean, std = tuple(get("image_mean") or mean), tuple(get("image_std") or std)
        else:
            mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    return Preprocessing(image_size=image_size, mode="squash", mean=mean, std=std, interpolation=interpolation)


def qwen_spec(cfg: Any, *, name: str, weights: str, processor: Any = None, locator: str = "", saved_in: str = "") -> VariantSpec:
    """The spec of a Qwen-VL vision tower (no classes), from its model's config."""
    config, vc = qwen_config(cfg), _vision_config(cfg)
    family = _family(cfg)
    if family == "qwen2_5_vl":
        how = (f"windows of {config.attn_window} patches, global in blocks {', '.join(map(str, config.global_blocks)) or 'none'}")
    else:
        how = f"global attention, deepstack from blocks {', '.join(map(str, getattr(vc, 'deepstack_visual_indexes', ()) or ())) or 'none'}"
    label = "Qwen2.5-VL" if family == "qwen2_5_vl" else "Qwen3-VL"
    note = "" if processor is not None else f"; no image processor saved: {label}'s published mean and std"
    return VariantSpec(
        name=name, config=config, preprocessing=qwen_preprocessing(cfg, processor), categories=None, source="hf", weights=weights,
        locator=locator,
        description=f"Hugging Face {name.removeprefix('hf:')}{f', saved in {saved_in}' if saved_in else ''}: {label} vision tower, "
        f"{config.depth} x {config.heads} x {config.width}, /{config.patch_size}, {how}, merged {vc.spatial_merge_size} x "
        f"{vc.spatial_merge_size} to {vc.out_hidden_size}; features{note}",
    )


def _visual(model: nn.Module) -> nn.Module:
    """The vision model inside a Qwen-VL model (or the vision model itself)."""
    if str(getattr(model.config, "model_type", "")).endswith("_vision"):
        return model
    for path in ("visual", "model.visual"):
        module = model
        for part in path.split("."):
            module = getattr(module, part, None)
        if module is not None:
            return module
    raise NotImplementedError(f"{type(model).__name__} has no vision model (`visual`) where transformers 5 keeps it")


def qwen_from_transformers(model: nn.Module, *, processor: Any = None) -> QwenVisionTower:
    """A Hugging Face Qwen2.5-VL or Qwen3-VL model's vision tower as a `QwenVisionTower`, on the
    model's device and dtype and in its train/eval mode, with its spec (preprocessing from
    `processor`, an image processor or its config dict, when given) and `tower_info`."""
    visual = _visual(model)
    tower = _build(visual.config)
    tower.load_state_dict(qwen_state_dict(visual.state_dict(), visual.config))
    name = getattr(model.config, "_name_or_path", "") or type(model).__name__
    tower.spec = qwen_spec(visual.config, name=f"hf:{name}", weights="converted from a Hugging Face model instance", processor=processor)
    param = next(visual.parameters())
    return tower.to(device=param.device, dtype=param.dtype).train(model.training)


def _vision_tensors(files: list[Path], vision_only: bool) -> dict[str, torch.Tensor]:
    """The vision model's tensors of these safetensors files, under the vision model's own keys
    ("visual." and "model.visual." cut off; with `vision_only`, every tensor as it is)."""
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if vision_only:
                    state[key] = f.get_tensor(key)
                elif key.startswith(("visual.", "model.visual.")):
                    state[key.split("visual.", 1)[1]] = f.get_tensor(key)
    return state


def load_qwen_tower(cfg: Any, source: str, *, name: str, local: bool) -> QwenVisionTower:
    """The vision tower of the Qwen-VL model whose config is `cfg`, its weights read from `source` (a
    folder saved with `save_pretrained`, absolute, or a hub repository id, through the hub's cache;
    `local`: nothing downloaded): only the vision model's tensors of its safetensors files, one file or
    the shards `model.safetensors.index.json` names that hold any.

    Raises:
        FileNotFoundError: a folder without those weights.
        WeightsUnavailableError: a repository whose weights are neither cached nor downloadable.
    """
    folder = Path(source) if os.path.isabs(source) else None

    def fetch(filename: str) -> Path | None:
        if folder is not None:
            return folder / filename if (folder / filename).is_file() else None
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError

        try:
            return Path(hf_hub_download(source, filename, local_files_only=local))
        except (OSError, EntryNotFoundError):
            return None

    vision_only = str(getattr(cfg, "model_type", "")).endswith("_vision")
    index = fetch("model.safetensors.index.json")
    if index is not None:
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        wanted = sorted({f for k, f in weight_map.items() if vision_only or k.startswith(("visual.", "model.visual."))})
        files = [fetch(f) for f in wanted]
    else:
        files = [fetch("model.safetensors")]
    if not files or any(f is None for f in files):
        why = "no model.safetensors, or not every shard of model.safetensors.index.json that holds the vision model"
        if folder is not None:
            raise FileNotFoundError(f"the weights of {name} are not in {folder} ({why})")
        reason = "offline, and not in the cache" if local else why
        raise WeightsUnavailableError(missing_message(name, source, reason, weights_path_hint="a folder saved with save_pretrained"))
    tower = _build(cfg)
    tower.load_state_dict(qwen_state_dict(_vision_tensors(files, vision_only), cfg))
    return tower.eval()
