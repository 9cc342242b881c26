"""What every weights source shares: the record of a variant and the interface of a source.

A `VariantSpec` says everything needed to build, load and feed one model variant: its architecture
(`ViTConfig`), its preprocessing, its class names and where its weights come from. A
`WeightsSource` lists the variants it offers, says whether their weights are at hand, and loads
them; nothing outside a source branches on where weights come from.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import ClassVar, Literal

from torch import nn

from vitviz.model import ViT, ViTConfig
from vitviz.preprocess import Preprocessing

__all__ = ["VariantSpec", "WeightsSource", "WeightsUnavailableError", "Status", "split_size", "check_size"]

Status = Literal["embedded", "cached", "download"]

_PIXELS = re.compile(r"[1-9][0-9]*")
_SIZE_RULE = "a whole number of pixels above 0, without sign or leading zeros, that is a multiple of the model's patch size"


def split_size(name: str) -> tuple[str, int | None]:
    """"<name>@<pixels>" -> (<name>, pixels); a name without "@" -> (name, None).

    Raises:
        ValueError: what follows the last "@" is not a size (it is checked against the patch size
            where the model is known: `check_size`).
    """
    base, at, size = name.rpartition("@")
    if not at:
        return name, None
    if not _PIXELS.fullmatch(size):
        raise ValueError(f"{name!r}: after @ comes the side of the images the model is fed, {_SIZE_RULE} (e.g. "
                         f"shapes_p16@96, timm:vit_small_patch8_224.dino@480); got {size!r}")
    return base, int(size)


def check_size(image_size: object, *, patch_size: int, name: str) -> int:
    """`image_size` when a model of `patch_size` can be fed images of that side.

    Raises:
        ValueError: not a whole number above 0, or not a multiple of the patch size; the message
            names the nearest sizes that are.
    """
    if not isinstance(image_size, int) or isinstance(image_size, bool) or image_size <= 0:
        raise ValueError(f"the image size of {name} is {_SIZE_RULE} ({patch_size} px); got {image_size!r}")
    if image_size % patch_size:
        below = image_size // patch_size * patch_size
        near = " or ".join(str(s) for s in (below, below + patch_size) if s > 0)
        raise ValueError(f"{image_size} px is not a multiple of {name}'s patch size {patch_size}: {near} px would be")
    return image_size


class WeightsUnavailableError(RuntimeError):
    """Weights are neither at hand nor downloadable; the message says what to run or where to put what."""


@dataclass(frozen=True)
class VariantSpec:
    """One model variant.

    Attributes:
        name: the name `load_model` takes ("vit_b_16", "shapes_p16", "timm:vit_small_patch16_224.dino").
        config: the architecture.
        preprocessing: how images are resized, cropped and normalised for it.
        categories: class names, index = logit; None for a model without a head (features only).
        source: the name of its `WeightsSource` ("torchvision", "embedded", "timm", "hf").
        weights: human-readable weights name.
        locator: where the source finds the weights (a URL, a file name, a timm name, a repo id, or
            the absolute path of a checkpoint of the user's own).
        filename: the checkpoint's file name, where there is one.
        top1: reported ImageNet top-1 accuracy in %, if known.
        description: one line for menus.
    """

    name: str
    config: ViTConfig
    preprocessing: Preprocessing
    categories: tuple[str, ...] | None = field(repr=False)
    source: str
    weights: str
    locator: str = ""
    filename: str = ""
    top1: float | None = None
    description: str = ""

    # the facts the rest of vitviz reads, from the config and the preprocessing
    image_size = property(lambda self: self.preprocessing.image_size)
    patch_size = property(lambda self: self.config.patch_size)
    width = property(lambda self: self.config.width)
    depth = property(lambda self: self.config.depth)
    heads = property(lambda self: self.config.heads)
    mlp_dim = property(lambda self: self.config.mlp_dim)
    num_prefix_tokens = property(lambda self: self.config.num_prefix_tokens)
    prefix_names = property(lambda self: self.config.prefix_names)
    mean = property(lambda self: self.preprocessing.mean)
    std = property(lambda self: self.preprocessing.std)
    resize_size = property(lambda self: self.preprocessing.resize_size)
    interpolation = property(lambda self: self.preprocessing.interpolation)

    @property
    def url(self) -> str | None:
        return self.locator if self.locator.startswith(("http://", "https://")) else None

    @property
    def grid(self) -> tuple[int, int]:
        """The patch grid at the preprocessing's image size."""
        side = self.preprocessing.image_size // self.config.patch_size
        return side, side

    @property
    def num_tokens(self) -> int:
        return self.num_prefix_tokens + self.grid[0] * self.grid[1]

    @property
    def num_classes(self) -> int:
        return len(self.categories) if self.categories is not None else 0

    @property
    def has_head(self) -> bool:
        return self.categories is not None

    def at(self, image_size: int) -> "VariantSpec":
        """The same variant fed images of another size (position embeddings are resampled)."""
        check_size(image_size, patch_size=self.patch_size, name=self.name)
        return replace(self, preprocessing=self.preprocessing.at(image_size))

    def build(self) -> ViT:
        """A randomly initialised vitviz ViT of this architecture (no weights loaded), with this spec."""
        model = ViT(self.config)
        model.spec = self
        return model


class WeightsSource(ABC):
    """Where weights come from: a list of variants, their status, and a loader.

    Sources that can name any model of their library on demand (timm, Hugging Face) set `prefix`
    ("timm:") and answer `resolve` for names outside their curated list.
    """

    name: ClassVar[str]
    prefix: ClassVar[str | None] = None

    @abstractmethod
    def specs(self) -> list[VariantSpec]:
        """The variants this source offers by name (the menus' list)."""

    def resolve(self, name: str, *, weights_path: str | None = None) -> VariantSpec:
        """The spec of a prefixed name outside the curated list.

        Args:
            weights_path: a checkpoint on this machine: the spec is then read from it alone (its
                classes, its preprocessing where it has its own), with nothing fetched and no cache
                read; the name only names the architecture.
        """
        raise ValueError(f"{self.name} knows no variant {name!r}")

    @abstractmethod
    def status(self, spec: VariantSpec) -> Status:
        """"embedded" (ships with vitviz), "cached" (on this machine) or "download" (fetched on first use)."""

    def reachable(self) -> bool:
        """Whether weights could be downloaded now."""
        return False

    @abstractmethod
    def load(self, spec: VariantSpec, *, weights_path: str | None = None, progress: bool = True) -> ViT:
        """A vitviz ViT with the variant's weights, on the CPU.

        Raises:
            WeightsUnavailableError: the weights are neither at hand nor downloadable.
        """

    def convert(self, model: nn.Module, **options) -> ViT:
        """A vitviz ViT from a model of this source's library (`ViT.from_<library>`)."""
        raise NotImplementedError(f"{self.name} models cannot be converted")
