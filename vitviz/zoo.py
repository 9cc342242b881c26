"""What can be loaded: one `VariantSpec` per model variant, weights sources and conversion.

torchvision variants use torchvision's weights (IMAGENET1K_V1 at 224 px, SWAG at 384/512/518 px and
the SWAG linear-probe weights at 224 px), downloaded to and read from torch's hub cache
(`$TORCH_HOME/hub/checkpoints`). The plain name (`vit_b_16`) gets torchvision's default weights; the
suffixes `_swag` and `_swag_linear` name the others. The embedded variants (`shapes_p8`,
`shapes_p16`) ship in `assets/` and need no network.
"""

from __future__ import annotations

import os
import socket
import urllib.error
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from vitviz.model import ViT
from vitviz.shapes import CLASSES as SHAPE_CLASSES

__all__ = [
    "VariantSpec",
    "WeightsUnavailableError",
    "list_variants",
    "get_spec",
    "load_model",
    "weights_status",
    "default_variant",
    "default_device",
    "checkpoint_dir",
    "assets_dir",
    "convert_torchvision_state_dict",
    "spec_for_torchvision_model",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class WeightsUnavailableError(RuntimeError):
    """Weights are neither cached nor downloadable; the message says where to put the file."""


@dataclass(frozen=True)
class VariantSpec:
    """Everything needed to build, load and feed one model variant.

    Attributes:
        name: the name `load_model` takes.
        image_size: input side S in pixels.
        patch_size: patch side P in pixels.
        width, depth, heads, mlp_dim: D, L, H and the MLP hidden width.
        num_prefix_tokens: tokens before the patches (1: the cls token).
        mean, std: per-channel normalisation of [0, 1] pixels.
        resize_size: the shorter side is resized to this before the centre crop to `image_size`.
        interpolation: "bilinear" or "bicubic".
        categories: class names, index = logit.
        source: "torchvision" or "embedded".
        weights: human-readable weights name, e.g. "torchvision ViT_B_16_Weights.IMAGENET1K_V1".
        url: download address (torchvision) or None.
        filename: the checkpoint's file name.
        top1: reported top-1 accuracy in % on the weights' own benchmark, if known.
        description: one line for menus.
    """

    name: str
    image_size: int
    patch_size: int
    width: int
    depth: int
    heads: int
    mlp_dim: int
    categories: tuple[str, ...] = field(repr=False)
    source: str
    weights: str
    filename: str
    url: str | None = None
    num_prefix_tokens: int = 1
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    resize_size: int | None = None
    interpolation: str = "bilinear"
    top1: float | None = None
    description: str = ""

    @property
    def grid(self) -> tuple[int, int]:
        side = self.image_size // self.patch_size
        return side, side

    @property
    def num_tokens(self) -> int:
        return self.num_prefix_tokens + self.grid[0] * self.grid[1]

    @property
    def num_classes(self) -> int:
        return len(self.categories)

    def build(self) -> ViT:
        """A randomly initialised vitviz ViT of this shape (no weights loaded)."""
        model = ViT(
            image_size=self.image_size,
            patch_size=self.patch_size,
            width=self.width,
            depth=self.depth,
            heads=self.heads,
            mlp_dim=self.mlp_dim,
            num_classes=self.num_classes,
        )
        model.spec = self
        return model


# ---------------------------------------------------------------------------------------------
# The registry

# architecture: (torchvision weights enum, patch, width, depth, heads, mlp_dim)
_TV_ARCH = {
    "vit_b_16": ("ViT_B_16_Weights", 16, 768, 12, 12, 3072),
    "vit_b_32": ("ViT_B_32_Weights", 32, 768, 12, 12, 3072),
    "vit_l_16": ("ViT_L_16_Weights", 16, 1024, 24, 16, 4096),
    "vit_l_32": ("ViT_L_32_Weights", 32, 1024, 24, 16, 4096),
    "vit_h_14": ("ViT_H_14_Weights", 14, 1280, 32, 16, 5120),
}
_SUFFIX = {"IMAGENET1K_V1": "", "IMAGENET1K_SWAG_E2E_V1": "_swag", "IMAGENET1K_SWAG_LINEAR_V1": "_swag_linear"}

SHAPES_IMAGE_SIZE = 96
SHAPES_ARCH = dict(width=96, depth=6, heads=3, mlp_dim=192)


def _torchvision_specs() -> list[VariantSpec]:
    from torchvision.models import vision_transformer as tv

    specs = []
    for arch, (enum_name, patch, width, depth, heads, mlp_dim) in _TV_ARCH.items():
        enum = getattr(tv, enum_name)
        for w in enum:
            default = w is enum.DEFAULT
            name = arch if default else arch + _SUFFIX[w.name]
            preset = w.transforms()
            size = w.meta["min_size"][0]
            top1 = w.meta["_metrics"]["ImageNet-1K"]["acc@1"]
            specs.append(
                VariantSpec(
                    name=name,
                    image_size=size,
                    patch_size=patch,
                    width=width,
                    depth=depth,
                    heads=heads,
                    mlp_dim=mlp_dim,
                    categories=tuple(w.meta["categories"]),
                    source="torchvision",
                    weights=f"torchvision {enum_name}.{w.name}",
                    url=w.url,
                    filename=w.url.rsplit("/", 1)[-1],
                    mean=tuple(preset.mean),
                    std=tuple(preset.std),
                    resize_size=preset.resize_size[0],
                    interpolation=preset.interpolation.value,
                    top1=top1,
                    description=f"ViT-{arch[4].upper()}/{patch} at {size} px, {w.name} ({top1:.1f} % ImageNet top-1)",
                )
            )
    return specs


def _embedded_specs() -> list[VariantSpec]:
    specs = []
    for patch in (8, 16):
        specs.append(
            VariantSpec(
                name=f"shapes_p{patch}",
                image_size=SHAPES_IMAGE_SIZE,
                patch_size=patch,
                **SHAPES_ARCH,
                categories=SHAPE_CLASSES,
                source="embedded",
                weights=f"embedded assets/shapes_p{patch}.pt (python -m vitviz.train_shapes)",
                filename=f"shapes_p{patch}.pt",
                mean=(0.5, 0.5, 0.5),
                std=(0.5, 0.5, 0.5),
                resize_size=SHAPES_IMAGE_SIZE,
                interpolation="bilinear",
                description=f"Shapes ViT /{patch} at {SHAPES_IMAGE_SIZE} px, 8 generated shape classes (embedded, offline)",
            )
        )
    return specs


_REGISTRY: dict[str, VariantSpec] | None = None


def _registry() -> dict[str, VariantSpec]:
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = {s.name: s for s in _embedded_specs() + _torchvision_specs()}
    return _REGISTRY


def list_variants() -> list[VariantSpec]:
    """Every loadable variant: the embedded ones first, then torchvision's."""
    return list(_registry().values())


def get_spec(name: str) -> VariantSpec:
    try:
        return _registry()[name]
    except KeyError:
        raise ValueError(f"unknown variant {name!r}; known: {', '.join(_registry())}") from None


# ---------------------------------------------------------------------------------------------
# Where weights live

def assets_dir() -> Path:
    """The folder with the embedded weights and example images (`$VITVIZ_ASSETS` overrides)."""
    env = os.environ.get("VITVIZ_ASSETS")
    return Path(env) if env else Path(__file__).resolve().parent.parent / "assets"


def checkpoint_dir() -> Path:
    """torch's hub cache for checkpoints: `$TORCH_HOME/hub/checkpoints` (default ~/.cache/torch)."""
    return Path(torch.hub.get_dir()) / "checkpoints"


def weights_status(name: str) -> str:
    """"embedded", "cached" (file present) or "download" (fetched on first use)."""
    spec = get_spec(name)
    if spec.source == "embedded":
        return "embedded"
    return "cached" if (checkpoint_dir() / spec.filename).is_file() else "download"


def _download_reachable(timeout: float = 1.5) -> bool:
    if os.environ.get("VITVIZ_OFFLINE"):
        return False
    try:
        with socket.create_connection(("download.pytorch.org", 443), timeout=timeout):
            return True
    except OSError:
        return False


def default_variant(preferred: str = "vit_b_16") -> tuple[str, str]:
    """The variant a user gets by default, and why.

    `preferred` when its weights are cached or downloadable, else the embedded `shapes_p16`.
    """
    status = weights_status(preferred)
    if status in ("embedded", "cached"):
        return preferred, f"{preferred}: weights {status}"
    if _download_reachable():
        return preferred, f"{preferred}: weights will be downloaded on first use"
    spec = get_spec(preferred)
    return "shapes_p16", (
        f"{preferred} weights are not cached in {checkpoint_dir()} and download.pytorch.org cannot be "
        f"reached, so the embedded shapes_p16 model is the default (put {spec.filename} there to use {preferred})"
    )


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# ---------------------------------------------------------------------------------------------
# Conversion from torchvision

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
    if num_classes == 1000:
        from torchvision.models import ViT_B_16_Weights

        categories = tuple(ViT_B_16_Weights.IMAGENET1K_V1.meta["categories"])
    else:
        categories = tuple(f"class {i}" for i in range(num_classes))
    return VariantSpec(
        name=f"torchvision_vit_{tv_model.hidden_dim}_{tv_model.patch_size}",
        image_size=tv_model.image_size,
        patch_size=tv_model.patch_size,
        width=tv_model.hidden_dim,
        depth=len(tv_model.encoder.layers),
        heads=block.num_heads,
        mlp_dim=tv_model.mlp_dim,
        categories=categories,
        source="torchvision",
        weights="converted from a torchvision VisionTransformer instance",
        filename="",
        resize_size=tv_model.image_size,
    )


def convert_torchvision_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Renames a torchvision `VisionTransformer` state dict to vitviz's names.

    torchvision's fused `in_proj_weight` [3D, D] stacks q, k, v, each with the heads contiguous —
    the same layout as vitviz's `qkv` ("(three h d)"), so the tensors carry over unchanged for
    any number of heads.
    """
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


def _unavailable(spec: VariantSpec, reason: str) -> WeightsUnavailableError:
    return WeightsUnavailableError(
        f"Weights for {spec.name} are not cached and cannot be downloaded ({reason}): put {spec.filename} "
        f"(from {spec.url}) in {checkpoint_dir()} (set $TORCH_HOME to use another cache), "
        f"or pass weights_path= to load_model."
    )


def _read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    sd = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(sd, dict) and "model" in sd and isinstance(sd["model"], dict):
        sd = sd["model"]
    if "conv_proj.weight" in sd:
        sd = convert_torchvision_state_dict(sd)
    return sd


def _fetch_state_dict(spec: VariantSpec, progress: bool) -> dict[str, torch.Tensor]:
    if spec.source == "embedded":
        path = assets_dir() / spec.filename
        if not path.is_file():
            raise WeightsUnavailableError(
                f"Embedded weights for {spec.name} are missing: expected {path}. "
                f"Recreate them with `python -m vitviz.train_shapes`."
            )
        return _read_checkpoint(path)
    cached = checkpoint_dir() / spec.filename
    if not cached.is_file():
        if os.environ.get("VITVIZ_OFFLINE"):
            raise _unavailable(spec, "VITVIZ_OFFLINE is set")
        try:
            checkpoint_dir().mkdir(parents=True, exist_ok=True)
            torch.hub.download_url_to_file(spec.url, str(cached), hash_prefix=_hash_prefix(spec.filename), progress=progress)
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            raise _unavailable(spec, f"{type(exc).__name__}: {exc}") from exc
        except RuntimeError as exc:  # hash mismatch: a corrupt or partial download
            cached.unlink(missing_ok=True)
            raise _unavailable(spec, str(exc)) from exc
    return _read_checkpoint(cached)


def _hash_prefix(filename: str) -> str | None:
    match = torch.hub.HASH_REGEX.search(filename)
    return match.group(1) if match else None


def load_model(
    name: str,
    *,
    device: str | torch.device | None = None,
    weights_path: str | os.PathLike | None = None,
    progress: bool = True,
) -> ViT:
    """A vitviz ViT with the variant's weights, in eval mode, on `device` (default: CUDA if available).

    Args:
        name: a name from `list_variants()`.
        device: where to put the model.
        weights_path: a local checkpoint (a torchvision or vitviz state dict) to use instead of the
            variant's own weights source.
        progress: show download progress (a tqdm bar) when weights are fetched.

    Raises:
        WeightsUnavailableError: weights neither cached nor downloadable.
    """
    spec = get_spec(name)
    sd = _read_checkpoint(Path(weights_path)) if weights_path is not None else _fetch_state_dict(spec, progress)
    model = spec.build()
    try:
        model.load_state_dict(sd)
    except RuntimeError as exc:
        raise ValueError(f"the checkpoint does not fit {name} ({spec.description}): {exc}") from exc
    return model.eval().to(device if device is not None else default_device())
