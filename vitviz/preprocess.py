"""From a loaded RGB image to the tensor a model takes, by the rules its weights were trained with.

Two layouts exist among published ViTs: resize the shorter side, then centre-crop a square
(torchvision's weights, timm's `crop_pct`, most image processors), or resize straight to the square
(Hugging Face's `ViTImageProcessor`: "squash"). Both run through torchvision's own transforms, so a
model sees exactly what its weights' own preprocessing would give it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch
from PIL import Image
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as TF

__all__ = ["Preprocessing", "IMAGENET_MEAN", "IMAGENET_STD", "crop", "to_input", "preprocess"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Preprocessing:
    """How a model wants its images.

    Attributes:
        image_size: side S of the square the model sees.
        resize_size: the shorter side is resized to this before the centre crop (mode "crop");
            None means S.
        mode: "crop" (resize the shorter side, centre-crop S x S) or "squash" (resize to S x S).
        mean, std: per-channel normalisation of [0, 1] pixels.
        interpolation: "bilinear", "bicubic" or "nearest".
    """

    image_size: int
    resize_size: int | None = None
    mode: Literal["crop", "squash"] = "crop"
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    interpolation: str = "bilinear"

    def __post_init__(self) -> None:
        if self.mode not in ("crop", "squash"):
            raise ValueError(f'mode must be "crop" or "squash", got {self.mode!r}')
        InterpolationMode(self.interpolation)  # raises for an unknown name

    @property
    def crop_fraction(self) -> float:
        """The share of the resized shorter side that the crop keeps (timm's crop_pct)."""
        return self.image_size / (self.resize_size or self.image_size)

    def at(self, image_size: int) -> "Preprocessing":
        """The same rule for another square side (the crop keeps the same share of the image)."""
        if image_size == self.image_size:
            return self
        resize = None if self.resize_size is None else math.floor(image_size / self.crop_fraction + 1e-6)
        return replace(self, image_size=image_size, resize_size=resize)


def crop(image: Image.Image, pre: Preprocessing) -> Image.Image:
    """The S x S RGB image the model sees: resized and centre-cropped (or squashed) as `pre` says."""
    interpolation = InterpolationMode(pre.interpolation)
    s = pre.image_size
    if pre.mode == "squash":
        return TF.resize(image, [s, s], interpolation=interpolation, antialias=True)
    resized = TF.resize(image, [pre.resize_size or s], interpolation=interpolation, antialias=True)
    return TF.center_crop(resized, [s, s])


def to_input(cropped: Image.Image, pre: Preprocessing) -> torch.Tensor:
    """The S x S crop -> the normalised tensor [3, S, S] the model takes."""
    if cropped.size != (pre.image_size, pre.image_size):
        raise ValueError(f"expected a {pre.image_size}x{pre.image_size} crop, got {cropped.size[0]}x{cropped.size[1]}")
    x = TF.to_dtype(TF.pil_to_tensor(cropped.convert("RGB")), torch.float32, scale=True)
    return TF.normalize(x, mean=list(pre.mean), std=list(pre.std))


def preprocess(image: Image.Image, pre: Preprocessing) -> tuple[torch.Tensor, Image.Image]:
    """RGB image -> (normalised tensor [3, S, S], the S x S crop the model sees)."""
    cropped = crop(image, pre)
    return to_input(cropped, pre), cropped
