"""torchvision's ViTs (B/16, B/32, L/16, L/32, H/14) with IMAGENET1K_V1 weights at 224 px, SWAG
end-to-end weights at 384/512/518 px and the SWAG linear-probe weights at 224 px.

Weights download once to torch's hub cache (`$TORCH_HOME/hub/checkpoints`) through
`torch.hub.load_state_dict_from_url`, which checks the file's hash prefix; a file already there is
read as it is. The plain name (`vit_b_16`) gets torchvision's default weights; the suffixes `_swag`
and `_swag_linear` name the others. Preprocessing and class names are the weights' own.

    vitviz.from_torchvision(torchvision_model)   # a VisionTransformer already in hand (= ViT.from_torchvision)

The source registers itself, and `ViT.from_torchvision`, when this module is imported.
"""

from __future__ import annotations

import os
import socket
import urllib.error
from pathlib import Path

import torch
from torch import nn

from vitviz.config import Preprocessing, ViTConfig
from vitviz.model import ViT
from vitviz.sources.base import Status, VariantSpec, WeightsSource, WeightsUnavailableError, register_source

__all__ = ["TorchvisionSource", "from_torchvision", "checkpoint_dir", "convert_torchvision_state_dict", "spec_for_torchvision_model"]

# architecture: (torchvision weights enum, patch, width, depth, heads, mlp_dim)
_ARCH = {
    "vit_b_16": ("ViT_B_16_Weights", 16, 768, 12, 12, 3072),
    "vit_b_32": ("ViT_B_32_Weights", 32, 768, 12, 12, 3072),
    "vit_l_16": ("ViT_L_16_Weights", 16, 1024, 24, 16, 4096),
    "vit_l_32": ("ViT_L_32_Weights", 32, 1024, 24, 16, 4096),
    "vit_h_14": ("ViT_H_14_Weights", 14, 1280, 32, 16, 5120),
}
_SUFFIX = {"IMAGENET1K_V1": "", "IMAGENET1K_SWAG_E2E_V1": "_swag", "IMAGENET1K_SWAG_LINEAR_V1": "_swag_linear"}


def checkpoint_dir() -> Path:
    """torch's hub cache for checkpoints: `$TORCH_HOME/hub/checkpoints` (default ~/.cache/torch)."""
    return Path(torch.hub.get_dir()) / "checkpoints"


def _imagenet_categories() -> tuple[str, ...]:
    from torchvision.models import ViT_B_16_Weights

    return tuple(ViT_B_16_Weights.IMAGENET1K_V1.meta["categories"])


def from_torchvision(model: nn.Module) -> ViT:
    """A vitviz ViT with the weights of a torchvision `VisionTransformer`, giving the same outputs, on
    the model's device and dtype and in its train/eval mode (`ViT.from_torchvision` is this function).

    Raises:
        TypeError: not a torchvision `VisionTransformer`.
        NotImplementedError: one with a convolutional stem or a pre-logits layer.
    """
    spec = spec_for_torchvision_model(model)
    ours = spec.build()
    ours.load_state_dict(convert_torchvision_state_dict(model.state_dict()))
    param = next(model.parameters())
    return ours.to(device=param.device, dtype=param.dtype).train(model.training)


@register_source
class TorchvisionSource(WeightsSource):
    name = "torchvision"
    library = "torchvision"

    def specs(self) -> list[VariantSpec]:
        from torchvision.models import vision_transformer as tv

        specs = []
        for arch, (enum_name, patch, width, depth, heads, mlp_dim) in _ARCH.items():
            enum = getattr(tv, enum_name)
            for w in enum:
                name = arch if w is enum.DEFAULT else arch + _SUFFIX[w.name]
                preset = w.transforms()
                size = w.meta["min_size"][0]
                top1 = w.meta["_metrics"]["ImageNet-1K"]["acc@1"]
                specs.append(
                    VariantSpec(
                        name=name,
                        config=ViTConfig(image_size=size, patch_size=patch, width=width, depth=depth, heads=heads, mlp_dim=mlp_dim,
                                         num_classes=len(w.meta["categories"])),
                        preprocessing=Preprocessing(
                            image_size=size, resize_size=preset.resize_size[0], mean=tuple(preset.mean), std=tuple(preset.std),
                            interpolation=preset.interpolation.value,
                        ),
                        categories=tuple(w.meta["categories"]),
                        source=self.name,
                        weights=f"torchvision {enum_name}.{w.name}",
                        locator=w.url,
                        filename=w.url.rsplit("/", 1)[-1],
                        top1=top1,
                        description=f"ViT-{arch[4].upper()}/{patch} at {size} px, {w.name} ({top1:.1f} % ImageNet top-1)",
                    )
                )
        return specs

    def status(self, spec: VariantSpec) -> Status:
        return "cached" if (checkpoint_dir() / spec.filename).is_file() else "download"

    def cache_dir(self) -> Path:
        return checkpoint_dir()

    def reachable(self) -> bool:
        if os.environ.get("VITVIZ_OFFLINE"):
            return False
        try:
            with socket.create_connection(("download.pytorch.org", 443), timeout=1.5):
                return True
        except OSError:
            return False

    def load(self, spec: VariantSpec, *, weights_path: str | None = None, progress: bool = True) -> ViT:
        sd = _read_checkpoint(Path(weights_path)) if weights_path is not None else self._state_dict(spec, progress)
        model = spec.build()
        try:
            model.load_state_dict(sd)
        except RuntimeError as exc:
            raise ValueError(f"the checkpoint does not fit {spec.name} ({spec.description}): {exc}") from exc
        return model

    def _state_dict(self, spec: VariantSpec, progress: bool) -> dict[str, torch.Tensor]:
        cached = checkpoint_dir() / spec.filename
        if not cached.is_file() and os.environ.get("VITVIZ_OFFLINE"):
            raise _unavailable(spec, "VITVIZ_OFFLINE is set")
        try:
            sd = torch.hub.load_state_dict_from_url(
                spec.locator, model_dir=str(checkpoint_dir()), map_location="cpu", progress=progress, check_hash=True,
                file_name=spec.filename, weights_only=True,
            )
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            raise _unavailable(spec, f"{type(exc).__name__}: {reason}") from exc
        except RuntimeError as exc:  # a hash mismatch: a corrupt or partial download, not kept
            raise _unavailable(spec, str(exc)) from exc
        return convert_torchvision_state_dict(sd)

    def convert(self, model: nn.Module, **options) -> ViT:
        return from_torchvision(model, **options)


def _unavailable(spec: VariantSpec, reason: str) -> WeightsUnavailableError:
    return WeightsUnavailableError(
        f"Weights for {spec.name} are not cached and cannot be downloaded ({reason}): put {spec.filename} "
        f"(from {spec.locator}) in {checkpoint_dir()} (set $TORCH_HOME to use another cache), "
        f"or pass weights_path= to load_model."
    )


def _read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    sd = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(sd, dict) and "model" in sd and isinstance(sd["model"], dict):
        sd = sd["model"]
    return convert_torchvision_state_dict(sd)


def spec_for_torchvision_model(tv_model: nn.Module) -> VariantSpec:
    """A spec describing any torchvision `VisionTransformer` instance."""
    from torchvision.models import VisionTransformer

    if not isinstance(tv_model, VisionTransformer):
        raise TypeError(f"expected torchvision.models.VisionTransformer, got {type(tv_model).__name__}")
    if not isinstance(tv_model.conv_proj, nn.Conv2d):
        raise NotImplementedError("torchvision ViTs with a convolutional stem (conv_stem_configs) are not supported")
    if tv_model.representation_size is not None:
        raise NotImplementedError("torchvision ViTs with representation_size (pre-logits) are not supported")
    block = tv_model.encoder.layers[0]
    num_classes = tv_model.num_classes
    categories = _imagenet_categories() if num_classes == 1000 else tuple(f"class {i}" for i in range(num_classes))
    size = tv_model.image_size
    return VariantSpec(
        name=f"torchvision_vit_{tv_model.hidden_dim}_{tv_model.patch_size}",
        config=ViTConfig(
            image_size=size, patch_size=tv_model.patch_size, width=tv_model.hidden_dim, depth=len(tv_model.encoder.layers),
            heads=block.num_heads, mlp_dim=tv_model.mlp_dim, num_classes=num_classes,
        ),
        preprocessing=Preprocessing(image_size=size, resize_size=size),
        categories=categories,
        source="torchvision",
        weights="converted from a torchvision VisionTransformer instance",
    )


def convert_torchvision_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Renames a torchvision `VisionTransformer` state dict to vitviz's names (a vitviz state dict
    passes through unchanged).

    torchvision's fused `in_proj_weight` [3D, D] stacks q, k, v, each with the heads contiguous —
    the same layout as vitviz's `qkv` ("(three h d)"), so the tensors carry over unchanged for
    any number of heads.
    """
    if "conv_proj.weight" not in sd:
        return sd
    out = {
        "patch_embed.proj.weight": sd["conv_proj.weight"],
        "patch_embed.proj.bias": sd["conv_proj.bias"],
        "cls_token": sd["class_token"],
        "pos_embed": sd["encoder.pos_embedding"],
        "norm.weight": sd["encoder.ln.weight"],
        "norm.bias": sd["encoder.ln.bias"],
        "head.weight": sd["heads.head.weight"],
        "head.bias": sd["heads.head.bias"],
    }
    depth = len({k.split(".")[2] for k in sd if k.startswith("encoder.layers.")})
    for i in range(depth):
        src, dst = f"encoder.layers.encoder_layer_{i}.", f"blocks.{i}."
        for a, b in [
            ("ln_1", "norm1"),
            ("ln_2", "norm2"),
            ("self_attention.in_proj", "attn.qkv"),
            ("self_attention.out_proj", "attn.proj"),
            ("mlp.0", "mlp.0"),
            ("mlp.3", "mlp.2"),
        ]:
            sep = "_" if a.endswith("in_proj") else "."
            out[f"{dst}{b}.weight"] = sd[f"{src}{a}{sep}weight"]
            out[f"{dst}{b}.bias"] = sd[f"{src}{a}{sep}bias"]
    return out


ViT.from_torchvision = staticmethod(from_torchvision)  # the same function, for existing callers
