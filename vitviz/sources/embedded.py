"""The embedded shapes models (`shapes_p8`, `shapes_p16`): small ViTs trained on `vitviz.shapes`,
shipped with vitviz, offline. `python -m vitviz.dev.train_shapes` makes their weights.

`shapes_clip` is a small image–text model (`vitviz.imagetext.ImageTextModel`, an image tower like
`shapes_p16`'s and a word-level text tower) trained on captioned scenes of coloured shapes
(`vitviz.shapes.generate_scenes`); it loads with its tokenizer (`vitviz.words.WordTokenizer`).
`python -m vitviz.dev.train_shapes_clip` makes its weights.

`shapes_p8_outliers` is `shapes_p8` given high-norm tokens on purpose (a few MLP neurons rewritten
to write them into flat patches, and the later blocks' attention made to sink into them), for the
test-time registers (`vitviz.registers`); `python -m vitviz.dev.plant_outliers` makes its weights.

`shapes_vlm` is a small vision–language model (`vitviz.vlm.model.ShapesVLM`: `shapes_clip`'s image
tower, a connector and a word-level decoder) that answers questions about scenes of coloured shapes;
it loads as its vision tower (a ViT, which every view reads) holding the whole model as `vlm`, which
`vitviz.ask` asks. `python -m vitviz.dev.train_shapes_vlm` makes its weights.

`shapes_swin` is a small Swin Transformer (`vitviz.swin.Swin`) trained on the same data;
`python -m vitviz.dev.train_shapes_swin` makes its weights.

The embedded video model `shapes_video` (assets/shapes_video.pt, a `vitviz.video.VideoViT`) is not
one of these variants, which make the image models' menu: `vitviz.video.shapes.load_shapes_video`
loads it; `python -m vitviz.dev.train_shapes_video` makes its weights.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

import torch

from vitviz.config import Preprocessing, TextConfig, ViTConfig, split_size
from vitviz.imagetext import ImageTextModel
from vitviz.model import ViT
from vitviz.sources.base import Status, VariantSpec, WeightsSource, WeightsUnavailableError, register_source
from vitviz.swin import Swin, SwinConfig

__all__ = ["EmbeddedSource", "assets_dir", "shapes_clip_configs", "shapes_swin_config", "SHAPES_IMAGE_SIZE", "SHAPES_ARCH"]

SHAPES_IMAGE_SIZE = 96
SHAPES_ARCH = dict(width=96, depth=6, heads=3, mlp_dim=192)
SHAPES_CLIP_PATCH = 16
SHAPES_CLIP_TEXT = dict(context_length=8, width=64, depth=2, heads=2, mlp_dim=128, embed_dim=64)
_PREPROCESSING = Preprocessing(image_size=SHAPES_IMAGE_SIZE, resize_size=SHAPES_IMAGE_SIZE, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))


def shapes_clip_configs() -> tuple[ViTConfig, TextConfig]:
    """The architecture of `shapes_clip`: its image tower (`shapes_p16`'s, without a head) and its
    text tower (causal, read at the end token of `vitviz.words`)."""
    from vitviz.words import END_ID, VOCABULARY  # here, so that `python -m vitviz.shapes` runs it first

    vision = ViTConfig(image_size=SHAPES_IMAGE_SIZE, patch_size=SHAPES_CLIP_PATCH, num_classes=0, **SHAPES_ARCH)
    text = TextConfig(vocab_size=len(VOCABULARY), causal=True, pool="eos", eos_token_id=END_ID, **SHAPES_CLIP_TEXT)
    return vision, text


def shapes_swin_config(num_classes: int = 8) -> SwinConfig:
    """The architecture of `shapes_swin`: patch 8 (a 12 x 12 grid at 96 px), three stages of two
    blocks, 48-96-192 wide, 2-4-8 heads of 24, windows 6-3-3 (each stage's grid 12, 6, 3 a whole
    number of windows; the last stage's window is its whole grid), MLP ratio 2."""
    return SwinConfig(image_size=SHAPES_IMAGE_SIZE, patch_size=8, embed_dim=48, depths=(2, 2, 2), num_heads=(2, 4, 8),
                      window_size=(6, 3, 3), mlp_ratio=2.0, num_classes=num_classes)


def assets_dir() -> Path:
    """The folder with the embedded weights and example images.

    `$VITVIZ_ASSETS` when set; else the package's own copy (`vitviz/assets` in an installed
    vitviz); else the `assets/` folder of the source checkout the package is imported from.
    """
    env = os.environ.get("VITVIZ_ASSETS")
    if env:
        return Path(env)
    installed = Path(str(resources.files("vitviz"))) / "assets"
    if installed.is_dir():
        return installed
    return Path(__file__).resolve().parents[2] / "assets"


# the command that makes each embedded variant's weights (`python -m vitviz.dev.<script>`)
_SCRIPTS = {"shapes_p8": "train_shapes", "shapes_p16": "train_shapes", "shapes_p8_outliers": "plant_outliers",
            "shapes_clip": "train_shapes_clip", "shapes_swin": "train_shapes_swin", "shapes_vlm": "train_shapes_vlm"}


def _embedded(name: str, config, categories: tuple[str, ...] | None, description: str, vlm: str | None = None) -> VariantSpec:
    """The record of an embedded variant: its weights in assets/<name>.pt, made by its script."""
    return VariantSpec(name=name, config=config, preprocessing=_PREPROCESSING, categories=categories, source=EmbeddedSource.name,
                       weights=f"embedded assets/{name}.pt (python -m vitviz.dev.{_SCRIPTS[name]})", locator=f"{name}.pt",
                       filename=f"{name}.pt", description=description, vlm=vlm)


@register_source
class EmbeddedSource(WeightsSource):
    name = "embedded"

    def specs(self) -> list[VariantSpec]:
        from vitviz.shapes import CLASSES as SHAPE_CLASSES  # here, so that `python -m vitviz.shapes` runs it first

        vit = ViTConfig(image_size=SHAPES_IMAGE_SIZE, patch_size=8, num_classes=len(SHAPE_CLASSES), **SHAPES_ARCH)
        return [
            *(_embedded(f"shapes_p{patch}", vit.replace(patch_size=patch), SHAPE_CLASSES,
                        f"Shapes ViT /{patch} at {SHAPES_IMAGE_SIZE} px, 8 generated shape classes (embedded, offline)")
              for patch in (8, 16)),
            _embedded("shapes_p8_outliers", vit, SHAPE_CLASSES, f"Shapes ViT /8 at {SHAPES_IMAGE_SIZE} px with high-norm tokens "
                      "planted in flat patches (test-time registers; embedded, offline)"),
            _embedded("shapes_clip", shapes_clip_configs()[0], None, f"Shapes image–text model /{SHAPES_CLIP_PATCH} at "
                      f"{SHAPES_IMAGE_SIZE} px, captions of coloured shapes (embedded, offline)"),
            _embedded("shapes_swin", shapes_swin_config(len(SHAPE_CLASSES)), SHAPE_CLASSES,
                      f"Shapes Swin /8 at {SHAPES_IMAGE_SIZE} px, windows 6-3-3, 8 generated shape classes (embedded, offline)"),
            _embedded("shapes_vlm", shapes_clip_configs()[0], None, f"Shapes vision–language model /{SHAPES_CLIP_PATCH} at "
                      f"{SHAPES_IMAGE_SIZE} px: asks of coloured shapes (its vision tower; embedded, offline)", vlm="shapes_vlm"),
        ]

    def status(self, spec: VariantSpec) -> Status:
        return "embedded"

    def load(self, spec: VariantSpec, *, weights_path: str | None = None, progress: bool = True) -> ViT | ImageTextModel | Swin:
        """The variant's ViT; for `shapes_clip` an `ImageTextModel` with its `WordTokenizer`; for
        `shapes_swin` a `vitviz.swin.Swin`."""
        path = Path(weights_path) if weights_path is not None else assets_dir() / spec.filename
        if spec.vlm == "shapes_vlm":
            return self._vlm_tower(spec, path)
        image_text = split_size(spec.name)[0] == "shapes_clip"  # (at its own size or at another: "shapes_clip@192")
        swin = isinstance(spec.config, SwinConfig)
        script = _SCRIPTS[split_size(spec.name)[0]]
        if not path.is_file():
            raise WeightsUnavailableError(
                f"Embedded weights for {spec.name} are missing: expected {path}. Recreate them with `python -m vitviz.dev.{script}`."
            )
        if image_text:
            from vitviz.words import WordTokenizer

            model = ImageTextModel(*shapes_clip_configs())
            model.tokenizer = WordTokenizer()
            from vitviz.shapes import CLASSES

            model.labels = CLASSES  # zero-shot over the shapes classes, "a photo of a star", ...
            model.spec = spec
        elif swin:  # `spec.build()` builds ViTs only
            model = Swin(spec.config)
            model.spec = spec
        else:
            model = spec.build()
        try:
            model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        except RuntimeError as exc:
            raise ValueError(f"the checkpoint does not fit {spec.name} ({spec.description}): {exc}") from exc
        return model

    def _vlm_tower(self, spec: VariantSpec, path: Path) -> ViT:
        """`shapes_vlm`'s vision tower, holding the whole model as `vlm` (not a submodule: the tower is
        the VLM's)."""
        from vitviz.vlm.model import ShapesVLM, shapes_vlm_config

        if not path.is_file():
            raise WeightsUnavailableError(
                f"Embedded weights for {spec.name} are missing: expected {path}. Recreate them with "
                f"`python -m vitviz.dev.{_SCRIPTS['shapes_vlm']}`.")
        vlm = ShapesVLM(shapes_vlm_config())
        try:
            vlm.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        except RuntimeError as exc:
            raise ValueError(f"the checkpoint does not fit {spec.name} ({spec.description}): {exc}") from exc
        vlm.eval()
        vlm.spec = spec
        tower = vlm.tower
        tower.spec = spec
        tower.__dict__["vlm"] = vlm
        return tower
