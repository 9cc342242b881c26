"""From a loaded RGB image to the tensor a model takes, by the rules its weights were trained with.

Three layouts exist among published ViTs: resize the shorter side, then centre-crop a square
(torchvision's weights, timm's `crop_pct`, most image processors), resize straight to the square
(Hugging Face's `ViTImageProcessor`: "squash"), or resize the whole image, keeping its aspect ratio,
to as many whole patches as the model takes (SigLIP 2's NaFlex: "fit", `vitviz.config.fit_size`). Both run through torchvision's own transforms, so a
model sees exactly what its weights' own preprocessing would give it. The rule itself,
`Preprocessing`, lives in the leaf `vitviz.config`.
"""

from __future__ import annotations

import torch
from PIL import Image
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as TF

from vitviz.config import IMAGENET_MEAN, IMAGENET_STD, ImageError, Preprocessing

__all__ = ["Preprocessing", "IMAGENET_MEAN", "IMAGENET_STD", "crop", "check_crop", "to_input", "preprocess"]


# the most pixels an image is resized to before its centre crop: as many as an upload may have (`vitviz.images.MAX_PIXELS`)
MAX_RESIZED = 40_000_000


def crop(image: Image.Image, pre: Preprocessing) -> Image.Image:
    """The image the model sees: S x S, resized and centre-cropped (or squashed) as `pre` says (at
    `pre.full_size` when the model reads the top-left S x S of a larger square: the rest cut off), or
    for mode "fit" the whole image resized to h x w (`Preprocessing.size_for`)."""
    interpolation = InterpolationMode(pre.interpolation)
    if pre.mode == "fit":
        return TF.resize(image, list(pre.size_for(image.height, image.width)), interpolation=interpolation, antialias=True)
    s = pre.full_size or pre.image_size
    if pre.mode == "squash":
        out = TF.resize(image, [s, s], interpolation=interpolation, antialias=True)
    else:
        short, long = sorted(image.size)
        side = pre.resize_size or s
        if side * (side * long // short) > MAX_RESIZED:  # (a strip: its shorter side resized, the longer would be huge)
            raise ImageError(f"the image is {image.width}x{image.height} px, too elongated for a {s} px square crop (its shorter "
                             f"side resized to {side} px, it would be {side * long // short:,} px long); feed it whole "
                             "(a name with @whole) or crop it first")
        resized = TF.resize(image, [side], interpolation=interpolation, antialias=True)
        out = TF.center_crop(resized, [s, s])
    if s != pre.image_size:
        out = out.crop((0, 0, pre.image_size, pre.image_size))
    return out


def check_crop(cropped: Image.Image, pre: Preprocessing) -> None:
    """Raises ValueError unless `cropped` has a size the model takes as it is: S x S, or for "fit"
    whole patches, no more of them than `max_patches` (what `crop` makes)."""
    w, h = cropped.size
    if pre.square:
        if (w, h) != (pre.image_size, pre.image_size):
            raise ValueError(f"expected a {pre.image_size}x{pre.image_size} crop, got {w}x{h}")
        return
    p = pre.patch_size
    if w % p or h % p or (w // p) * (h // p) > pre.max_patches:
        raise ValueError(f"expected an image of whole {p} px patches, at most {pre.max_patches} of them, got {w}x{h}")


def to_input(cropped: Image.Image, pre: Preprocessing) -> torch.Tensor:
    """The crop -> the normalised tensor [3, h, w] the model takes."""
    check_crop(cropped, pre)
    x = TF.to_dtype(TF.pil_to_tensor(cropped.convert("RGB")), torch.float32, scale=True)
    return TF.normalize(x, mean=list(pre.mean), std=list(pre.std))


def preprocess(image: Image.Image, pre: Preprocessing) -> tuple[torch.Tensor, Image.Image]:
    """RGB image -> (normalised tensor [3, h, w], the h x w crop the model sees; S x S but for "fit")."""
    cropped = crop(image, pre)
    return to_input(cropped, pre), cropped
