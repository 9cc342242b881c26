"""One call from an image to everything the app shows: `analyze`.

image -> `load_image` (checks, RGB) -> `preprocess` (the weights' own resize, centre crop, normalise)
-> model under `record_attention` -> predictions, attention stack, rollout, cls map, mean attention
distances, all on the CPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from PIL import Image

from vitviz.analysis import HeadFusion, attention_rollout, cls_map, mean_attention_distance
from vitviz.hooks import record_attention
from vitviz.images import ImageSource, load_image
from vitviz.model import ViT
from vitviz.zoo import VariantSpec

__all__ = ["Analysis", "analyze", "analyze_crop", "preprocess", "to_input", "crop", "spec_of"]

_PIL_INTERPOLATION = {"bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC, "nearest": Image.NEAREST}


def spec_of(model: ViT) -> VariantSpec:
    if getattr(model, "spec", None) is None:
        raise ValueError("this model has no VariantSpec; load it with vitviz.load_model or ViT.from_torchvision")
    return model.spec  # type: ignore[return-value]


def crop(image: Image.Image, spec: VariantSpec) -> Image.Image:
    """Resize the shorter side to `spec.resize_size`, then centre-crop `spec.image_size` (torchvision's rule)."""
    w, h = image.size
    short = spec.resize_size or spec.image_size
    if (w <= h and w != short) or (h < w and h != short):
        if w <= h:
            size = (short, int(short * h / w))
        else:
            size = (int(short * w / h), short)
        image = image.resize(size, _PIL_INTERPOLATION[spec.interpolation])
    w, h = image.size
    s = spec.image_size
    if w < s or h < s:  # only when resize_size < image_size; pad like torchvision's center_crop
        padded = Image.new("RGB", (max(w, s), max(h, s)))
        padded.paste(image, ((max(w, s) - w) // 2, (max(h, s) - h) // 2))
        image, (w, h) = padded, padded.size
    top = int(round((h - s) / 2.0))
    left = int(round((w - s) / 2.0))
    return image.crop((left, top, left + s, top + s))


def to_input(cropped: Image.Image, spec: VariantSpec) -> torch.Tensor:
    """The S x S RGB crop -> the normalised tensor [3, S, S] the model takes."""
    if cropped.size != (spec.image_size, spec.image_size):
        raise ValueError(f"expected a {spec.image_size}x{spec.image_size} crop, got {cropped.size[0]}x{cropped.size[1]}")
    x = torch.from_numpy(np.asarray(cropped.convert("RGB"), dtype=np.uint8).copy()).permute(2, 0, 1).float().div_(255.0)
    mean = torch.tensor(spec.mean).view(3, 1, 1)
    std = torch.tensor(spec.std).view(3, 1, 1)
    return (x - mean) / std


def preprocess(image: Image.Image, spec: VariantSpec) -> tuple[torch.Tensor, Image.Image]:
    """RGB image -> (normalised tensor [3, S, S], the S x S crop the model sees)."""
    cropped = crop(image, spec)
    return to_input(cropped, spec), cropped


@dataclass
class Analysis:
    """Everything vitviz computes for one image and one model, on the CPU.

    Attributes:
        variant: the model's variant name.
        image: the S x S crop the model saw (overlays are drawn on it).
        predictions: top-k (label, probability), most likely first.
        probabilities: softmax over all classes [classes].
        attentions: attention stack [L, H, N, N].
        rollout: attention rollout [N, N] with `head_fusion` and `discard_ratio`.
        cls_map: the cls token's rollout over the patches [gh, gw].
        distances: mean attention distance in pixels [L, H].
        grid, patch_size, num_prefix_tokens: the token layout.
        head_fusion, discard_ratio: the rollout options used.
        device: where the model ran.
        model_seconds: time of the recorded forward.
    """

    variant: str
    image: Image.Image = field(repr=False)
    predictions: list[tuple[str, float]]
    probabilities: torch.Tensor = field(repr=False)
    attentions: torch.Tensor = field(repr=False)
    rollout: torch.Tensor = field(repr=False)
    cls_map: torch.Tensor = field(repr=False)
    distances: torch.Tensor = field(repr=False)
    grid: tuple[int, int]
    patch_size: int
    num_prefix_tokens: int
    head_fusion: str
    discard_ratio: float
    device: str
    model_seconds: float

    @property
    def nbytes(self) -> int:
        """Bytes held by the tensors and the crop (what keeping this analysis costs)."""
        tensors = (self.probabilities, self.attentions, self.rollout, self.cls_map, self.distances)
        return sum(t.numel() * t.element_size() for t in tensors) + 3 * self.image.size[0] * self.image.size[1]

    def with_rollout(self, *, head_fusion: HeadFusion = "mean", discard_ratio: float = 0.0) -> "Analysis":
        """The same analysis with the rollout recomputed from the stored attention (no model call)."""
        if head_fusion == self.head_fusion and discard_ratio == self.discard_ratio:
            return self
        rollout = attention_rollout(
            self.attentions, head_fusion=head_fusion, discard_ratio=discard_ratio, num_prefix_tokens=self.num_prefix_tokens
        )
        return replace(
            self,
            rollout=rollout,
            cls_map=cls_map(rollout, grid=self.grid, num_prefix_tokens=self.num_prefix_tokens),
            head_fusion=head_fusion,
            discard_ratio=discard_ratio,
        )


def analyze(
    model: ViT,
    image: ImageSource,
    *,
    top_k: int = 5,
    head_fusion: HeadFusion = "mean",
    discard_ratio: float = 0.0,
) -> Analysis:
    """Runs `model` once on `image`, recording attention, and computes the analyses.

    Args:
        model: a vitviz ViT with a spec (from `load_model` or `ViT.from_torchvision`).
        image: anything `vitviz.load_image` accepts (PIL image, path, bytes, file, uint8 array).
        top_k: number of predictions.
        head_fusion, discard_ratio: rollout options.
    """
    spec = spec_of(model)
    x, cropped = preprocess(load_image(image), spec)
    return _analyze_input(model, x, cropped, top_k=top_k, head_fusion=head_fusion, discard_ratio=discard_ratio)


def analyze_crop(model: ViT, cropped: Image.Image, **options) -> Analysis:
    """`analyze` for an image already cropped to the model's input (`Analysis.image`): no resizing,
    so analysing `analysis.image` again gives the same numbers."""
    return _analyze_input(model, to_input(cropped, spec_of(model)), cropped, **options)


def _analyze_input(
    model: ViT,
    x: torch.Tensor,
    cropped: Image.Image,
    *,
    top_k: int = 5,
    head_fusion: HeadFusion = "mean",
    discard_ratio: float = 0.0,
) -> Analysis:
    spec = spec_of(model)
    param = next(model.parameters())
    x = x.unsqueeze(0).to(device=param.device, dtype=param.dtype)
    p = model.num_prefix_tokens
    with torch.inference_mode():
        start = time.perf_counter()
        with record_attention(model) as rec:
            logits = model(x)
        attn = rec.attentions[:, 0].float()  # [L, H, N, N]
        probs = logits[0].float().softmax(-1)
        rollout = attention_rollout(attn, head_fusion=head_fusion, discard_ratio=discard_ratio, num_prefix_tokens=p)
        distances = mean_attention_distance(attn, patch_size=spec.patch_size, num_prefix_tokens=p, grid=spec.grid)
        if param.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        attn, probs, rollout, distances = (t.cpu() for t in (attn, probs, rollout, distances))
    k = min(top_k, probs.numel())
    top = probs.topk(k)
    return Analysis(
        variant=spec.name,
        image=cropped,
        predictions=[(spec.categories[i], float(v)) for v, i in zip(top.values.tolist(), top.indices.tolist())],
        probabilities=probs,
        attentions=attn,
        rollout=rollout,
        cls_map=cls_map(rollout, grid=spec.grid, num_prefix_tokens=p),
        distances=distances,
        grid=spec.grid,
        patch_size=spec.patch_size,
        num_prefix_tokens=p,
        head_fusion=head_fusion,
        discard_ratio=discard_ratio,
        device=str(param.device),
        model_seconds=seconds,
    )
