"""Logit lens: the residual stream after each block read through the model's own final norm, pooling and head."""

from __future__ import annotations

from collections.abc import Sequence
import torch
from vitviz.images import ImageSource
from vitviz.imagetext import ImageTextModel
from vitviz.inside.stream import Stream, _stream_or_raise, stream_of
from vitviz.model import ViT


def lens_of(stream: Stream | None, *, logits: bool = False) -> torch.Tensor:
    """The logit lens [L+1, C]: row l is what the model would predict from its stream after block
    `stream.first_layer` + l (row 0: the embedding, or for a Swin what enters its last stage; row L:
    the model's own output), probabilities (softmax over the classes; an image–text model's zero-shot
    scores) or, with `logits`, logits."""
    stream = _stream_or_raise(stream)
    out = stream.unembed.logits(stream.normed)
    return out if logits else stream.unembed.probabilities(out)


def logit_lens(
    model: ViT | ImageTextModel, image: ImageSource | torch.Tensor, *, labels: Sequence[str] | None = None,
    template: str | None = None, logits: bool = False,
) -> torch.Tensor:
    """The logit lens of `model` on `image` [L+1, C] (`lens_of`). For an image–text model: the
    projected image embedding of each layer against the label texts' embeddings
    (`model.encode_text(*model.tokenize([template.format(label) ...]))`, normalised), scaled by
    exp(logit_scale): probabilities over `labels` (its own label set by default)."""
    return lens_of(stream_of(model, image, labels=labels, template=template), logits=logits)


def lens_top_k(lens: torch.Tensor, k: int = 5, categories: Sequence[str] | None = None) -> list[list[tuple[str | int, float]]]:
    """The top-k classes of each layer of a lens [L+1, C]: for each layer, (name or index, value), the highest first."""
    top = lens.topk(min(k, lens.shape[-1]), dim=-1)
    return [[(categories[i] if categories is not None else i, float(v)) for v, i in zip(vs.tolist(), ix.tolist())]
            for vs, ix in zip(top.values, top.indices)]


def class_across_depth(lens: torch.Tensor, target: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A class through the layers of a lens [L+1, C]: its rank in each layer (0: top-1; the classes
    scoring strictly higher) [L+1] and its value [L+1]."""
    values = lens[:, target]
    return (lens > values[:, None]).sum(dim=-1), values


def first_top1_layer(lens: torch.Tensor, target: int) -> int | None:
    """The first layer l (0: the embedding) at which the lens [L+1, C] ranks `target` first, or None."""
    hits = (class_across_depth(lens, target)[0] == 0).nonzero()
    return int(hits[0]) if len(hits) else None
