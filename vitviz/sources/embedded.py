"""The embedded shapes models (`shapes_p8`, `shapes_p16`): small ViTs trained on `vitviz.shapes`,
shipped with vitviz, offline. `python -m vitviz.dev.train_shapes` makes their weights.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

import torch

from vitviz.config import Preprocessing, ViTConfig
from vitviz.model import ViT
from vitviz.sources.base import Status, VariantSpec, WeightsSource, WeightsUnavailableError, register_source

__all__ = ["EmbeddedSource", "assets_dir", "SHAPES_IMAGE_SIZE", "SHAPES_ARCH"]

SHAPES_IMAGE_SIZE = 96
SHAPES_ARCH = dict(width=96, depth=6, heads=3, mlp_dim=192)


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


@register_source
class EmbeddedSource(WeightsSource):
    name = "embedded"

    def specs(self) -> list[VariantSpec]:
        from vitviz.shapes import CLASSES as SHAPE_CLASSES  # here, so that `python -m vitviz.shapes` runs it first

        return [
            VariantSpec(
                name=f"shapes_p{patch}",
                config=ViTConfig(image_size=SHAPES_IMAGE_SIZE, patch_size=patch, num_classes=len(SHAPE_CLASSES), **SHAPES_ARCH),
                preprocessing=Preprocessing(
                    image_size=SHAPES_IMAGE_SIZE, resize_size=SHAPES_IMAGE_SIZE, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)
                ),
                categories=SHAPE_CLASSES,
                source=self.name,
                weights=f"embedded assets/shapes_p{patch}.pt (python -m vitviz.dev.train_shapes)",
                locator=f"shapes_p{patch}.pt",
                filename=f"shapes_p{patch}.pt",
                description=f"Shapes ViT /{patch} at {SHAPES_IMAGE_SIZE} px, 8 generated shape classes (embedded, offline)",
            )
            for patch in (8, 16)
        ]

    def status(self, spec: VariantSpec) -> Status:
        return "embedded"

    def load(self, spec: VariantSpec, *, weights_path: str | None = None, progress: bool = True) -> ViT:
        path = Path(weights_path) if weights_path is not None else assets_dir() / spec.filename
        if not path.is_file():
            raise WeightsUnavailableError(
                f"Embedded weights for {spec.name} are missing: expected {path}. Recreate them with `python -m vitviz.dev.train_shapes`."
            )
        model = spec.build()
        try:
            model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        except RuntimeError as exc:
            raise ValueError(f"the checkpoint does not fit {spec.name} ({spec.description}): {exc}") from exc
        return model
