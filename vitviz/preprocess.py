"""From a loaded RGB image to the tensor a model takes, by the rules its weights were trained with.

Two layouts exist among published ViTs: resize the shorter side, then centre-crop a square
(torchvision's weights, timm's `crop_pct`, most image processors), or resize straight to the square
(Hugging Face's `ViTImageProcessor`: "squash"). Both run through torchvision's own transforms, so a
model sees exactly what its weights' own preprocessing would give it. The rule itself,
`Preprocessing`, lives in the leaf `vitviz.config`.
"""

from __future__ import annotations

import torch
from PIL import Image
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as TF

from vitviz.config import IMAGENET_MEAN, IMAGENET_STD, Preprocessing

__all__ = ["Preprocessing", "IMAGENET_MEAN", "IMAGENET_STD", "crop", "to_input", "preprocess"]


def crop(image: Image.Image, pre: Preprocessing) -> Image.Image:
    """The S x S RGB image the model sees: resized and centre-cropped (or squashed) as `pre` says
    (at `pre.full_size` when the model reads the top-left S x S of a larger square: the rest cut off)."""
    interpolation = InterpolationMode(pre.interpolation)
    s = pre.full_size or pre.image_size
    if pre.mode == "squash":
        out = TF.resize(image, [s, s], interpolation=interpolation, antialias=True)
    else:
        resized = TF.resize(image, [pre.resize_size or s], interpolation=interpolation, antialias=True)
        out = TF.center_crop(resized, [s, s])
    if s != pre.image_size:
        out = out.crop((0, 0, pre.image_size, pre.image_size))
    return out


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
