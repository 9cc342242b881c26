"""Direct logit attribution: the target logit split exactly into the embedding, every head, bias and MLP."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
import torch
from vitviz.images import ImageSource
from vitviz.imagetext import ImageTextModel
from vitviz.inside.stream import Stream, Target, _stream_or_raise, stream_of
from vitviz.model import ViT


@dataclass
class Attribution:
    """The target logit split into the parts that add up to it (float64).

    Attributes:
        target, label: the class (its index and name).
        embedding: the embedding's part (patch + position + prefix tokens, CLIP's norm_pre).
        heads: each head's part [L, H] (its slice A_h V_h W_{O,h}, through LayerScale).
        attn_biases: each block's output-projection bias b_O (through LayerScale) [L].
        mlps: each MLP's part [L] (its output bias included, through LayerScale).
        norm_bias: the final norm's β projected on the target's direction.
        head_bias: the head's bias for the target (an image–text model's logit bias, or 0).
        logit: the target logit of the forward.
        first_layer: the block the parts start at (`Stream.first_layer`): heads[l] and mlps[l] are
            block first_layer + l's, and for first_layer > 0 (a Swin's last stage) `embedding` is
            what entered that block, everything before it together.
    """

    target: int
    label: str | None
    embedding: torch.Tensor
    heads: torch.Tensor
    attn_biases: torch.Tensor
    mlps: torch.Tensor
    norm_bias: torch.Tensor
    head_bias: torch.Tensor
    logit: torch.Tensor
    first_layer: int = 0

    @property
    def bias(self) -> torch.Tensor:
        """The final norm's β and the head's bias, projected: norm_bias + head_bias."""
        return self.norm_bias + self.head_bias

    def rows(self) -> list[tuple[str, int | None, int | None, float]]:
        """Every part as (component, layer, head, value): "embedding", "head" (layer, head), "attn_bias"
        (layer), "mlp" (layer), "norm_bias", "head_bias"; they sum to `logit`. Layers are the
        model's blocks, 0-based (from `first_layer`)."""
        out: list[tuple[str, int | None, int | None, float]] = [("embedding", None, None, float(self.embedding))]
        for i in range(self.heads.shape[0]):
            layer = self.first_layer + i
            out += [("head", layer, h, float(v)) for h, v in enumerate(self.heads[i].tolist())]
            out += [("attn_bias", layer, None, float(self.attn_biases[i])), ("mlp", layer, None, float(self.mlps[i]))]
        return out + [("norm_bias", None, None, float(self.norm_bias)), ("head_bias", None, None, float(self.head_bias))]

    def total(self) -> float:
        """The sum of the parts (equal to `logit` up to rounding)."""
        return float(self.embedding + self.heads.sum() + self.attn_biases.sum() + self.mlps.sum() + self.bias)


def _class_index(target: Target, categories: Sequence[str] | None, classes: int, default: int) -> int:
    """A class given by index or name (None: `default`), checked."""
    if target is None:
        return default
    if isinstance(target, str):
        if categories is None or target not in categories:
            raise ValueError(f"{target!r} is not one of this model's classes")
        return list(categories).index(target)
    if not 0 <= int(target) < classes:
        raise ValueError(f"target {target} is outside 0..{classes - 1}")
    return int(target)


def attribution_of(stream: Stream | None, target: Target = None) -> Attribution:
    """Direct logit attribution of `target` (index or class name; default the predicted class) from a
    recorded stream: each component centred (when the final norm is a LayerNorm), already divided by
    the forward's σ, multiplied by γ and projected on the target's direction (`Unembed.direction`)."""
    stream = _stream_or_raise(stream)
    if stream.heads is None:
        raise ValueError(f"{stream.unsplit}: its logit does not split exactly into the components; the logit lens works")
    final = stream.unembed.logits(stream.normed[-1].double())
    t = _class_index(target, stream.categories, final.shape[-1], int(final.argmax()))
    rows, bias = stream.unembed.direction(t, stream.normed[-1])  # [Q, D]
    gamma = stream.norm_weight.double()

    def project(parts: torch.Tensor) -> torch.Tensor:  # [..., Q, D] -> [...]
        parts = parts.double()
        if stream.centred:
            parts = parts - parts.mean(dim=-1, keepdim=True)
        return (parts * gamma * rows).sum(dim=(-2, -1))

    return Attribution(
        target=t, label=stream.categories[t] if stream.categories is not None else None,
        embedding=project(stream.embedding), heads=project(stream.heads), attn_biases=project(stream.attn_biases),
        mlps=project(stream.mlps), norm_bias=(rows * stream.norm_bias.double()).sum(), head_bias=torch.tensor(bias, dtype=torch.float64),
        logit=final[t], first_layer=stream.first_layer,
    )


def logit_attribution(
    model: ViT | ImageTextModel, image: ImageSource | torch.Tensor, target: Target = None, *,
    labels: Sequence[str] | None = None, template: str | None = None,
) -> Attribution:
    """Direct logit attribution of `target` for `model` on `image` (`attribution_of`)."""
    return attribution_of(stream_of(model, image, labels=labels, template=template), target)
