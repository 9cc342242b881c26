"""Why this class, or where this phrase: a map over the patch grid from a registered method, for a
chosen target class of a classifier or a phrase of an image–text model (CLIP).

    vitviz.explain(model, "cat.jpg", method="gradient", target="tabby, tabby cat")
    vitviz.explain(clip, "cat.jpg", method="gradient", text="a cat")          # one Explanation
    vitviz.explain(clip, "cat.jpg", method="legrad", text=["a cat", "grass"]) # one per phrase

Built-in methods (`METHODS`; `vitviz.methods()` lists them with any plugins', `vitviz.explainers`):
- "attention": the last layer's attention of the cls token, averaged over heads (no target).
- "rollout": attention rollout from the cls token (Abnar & Zuidema 2020; no target).
- "gradient": Chefer et al. 2021's relevance for the target score (`vitviz.relevance`).
- "grad_rollout": attention weighted by the same layer's gradient, fused, clipped and rolled out.
- "legrad": LeGrad, Bousselham et al. 2024 (`vitviz.explainers.legrad`).

The target score is a class logit, or for an image–text model the image–text similarity of a phrase:
CLIP's `logits_per_image[b, t]`, exp(logit_scale) times the cosine of the projected image and text
embeddings (plus SigLIP's bias). The phrases are encoded once, without gradients through the text
tower; the image tower runs once for all of them, and the gradients of the T phrases' similarities
come from one vectorised backward (`torch.autograd.grad(..., is_grads_batched=True)`: T
vector-Jacobian products of the same graph at once, T times the gradient memory of one phrase).
A recorded batch with phrases is the (image, phrase) pairs, image-major: row b·T + t.

Each map is the classifier's query's row over the patches: the cls token's, or for a model without
one that classifies from the mean of its patch tokens, the mean of the patch tokens' rows ("pool").

`relevance_maps` computes any set of methods for a batch in one forward and, when a method needs
gradients, one backward of the summed per-sample target scores (samples do not interact in eval
mode); it is `record` (the model's part, `vitviz.recording`) then `maps_of` (pure).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import torch
from PIL import Image

from vitviz.analysis import HeadFusion, Query
from vitviz.architectures import architecture_of
from vitviz.explainers import method as registered
from vitviz.images import ImageSource, load_image
from vitviz.imagetext import ImageTextModel
from vitviz.model import ViT
from vitviz.pipeline import spec_of
from vitviz.preprocess import preprocess

from vitviz.recording import (  # noqa: F401  (the model's part of an explanation, `vitviz.recording`)
    LEGRAD_START_LAYER,
    Readout,
    Recorded,
    TextInput,
    needs_gradients,
    needs_layer_gradients,
    record,
    record_for,
    resolve_target,
)

__all__ = ["METHODS", "Explanation", "Recorded", "TextInput", "explain", "maps_of", "needs_gradients", "needs_layer_gradients", "record",
           "record_for", "relevance_maps", "resolve_target"]

METHODS: tuple[str, ...] = ("attention", "rollout", "gradient", "grad_rollout", "legrad")  # the built-in ones


@dataclass
class Explanation:
    """One map over the patch grid.

    Attributes:
        map: relevance of each patch [gh, gw] (larger: more relevant).
        method: a registered method's name (`vitviz.methods()`).
        target: the class index explained (None for a model without a classifier, and for a phrase).
        label: its name.
        probability: the model's probability of it.
        image: the S x S crop the model saw.
        text: the phrase explained (image–text models; None for a class, or for a phrase given as
            token ids).
        similarity: the image–text score of that phrase, `logits_per_image[0, t]`.
    """

    map: torch.Tensor = field(repr=False)
    method: str
    target: int | None
    label: str | None
    probability: float | None
    image: Image.Image = field(repr=False)
    text: str | None = None
    similarity: float | None = None


def maps_of(
    recorded: Recorded,
    methods: Sequence[str] = METHODS,
    *,
    head_fusion: HeadFusion = "mean",
    discard_ratio: float = 0.0,
    query: Query | None = None,
) -> dict[str, torch.Tensor]:
    """{method: maps [B, gh, gw]} from a recorded batch (pure: no model).

    Args:
        query: whose row each map is: a prefix token's index or "pool"; None for the classifier's
            (`Recorded.query`).
    """
    chosen = [registered(m) for m in methods]
    for m in chosen:
        why = recorded.layout.lacks(m.needs - {"classifier", "text", "target"}) if recorded.layout is not None else None
        if why:
            raise ValueError(f"{m.name!r} cannot run: {why}")
    lacking = [m.name for m in chosen if m.needs_gradients and recorded.gradients is None and m.name not in recorded.reduced]
    if lacking:
        raise ValueError(f"{lacking[0]!r} needs a batch recorded with gradients=True (and keep_gradients=True, or layerwise=[{lacking[0]!r}])")
    if recorded.layer_gradients is None and any(m.needs_layer_gradients for m in chosen):
        raise ValueError(f"{next(m.name for m in chosen if m.needs_layer_gradients)!r} needs a batch recorded with layer_gradients=True")
    for m in chosen:
        if "classifier" in m.needs and recorded.targets is None:
            raise ValueError(f"{m.name!r} explains a class: it needs a model with a classifier")
        if "text" in m.needs and recorded.texts is None:
            raise ValueError(f"{m.name!r} explains a phrase: it needs an image–text model and text=...")
        if "target" in m.needs and recorded.targets is None and recorded.texts is None:
            raise ValueError(f"{m.name!r} explains a score: it needs a class (a model with a classifier) or a phrase (text=... "
                             "for an image–text model)")
    rec = recorded if query is None else replace(recorded, chosen_query=query)
    batch, (gh, gw) = recorded.batch, recorded.grid
    maps: dict[str, torch.Tensor] = {}
    for m in chosen:
        out = m.fn(rec, head_fusion=head_fusion, discard_ratio=discard_ratio)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (batch, gh, gw):
            raise ValueError(f"method {m.name!r} returned {getattr(out, 'shape', type(out).__name__)}; it must return maps [{batch}, {gh}, {gw}]")
        maps[m.name] = out.detach().float().cpu()
    return maps


def relevance_maps(
    model: ViT | ImageTextModel,
    x: torch.Tensor,
    *,
    methods: Sequence[str] = METHODS,
    targets: Sequence[int | str | None] | torch.Tensor | None = None,
    text: TextInput | None = None,
    head_fusion: HeadFusion = "mean",
    discard_ratio: float = 0.0,
    readout: Readout = "mean",
    start_layer: int = LEGRAD_START_LAYER,
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
    """Maps of several methods for a batch, from one forward (and one backward for gradient methods).

    Args:
        model: a vitviz ViT (in eval mode), or an image–text model.
        x: preprocessed images [B, 3, S, S].
        methods: registered methods' names (`vitviz.methods()`).
        targets: per sample a class index, a class name or None (top-1); None for all top-1.
        text: for an image–text model, T phrases (`TextInput`) scored against every image.
        head_fusion, discard_ratio: for "rollout" and "grad_rollout".
        readout, start_layer: for "legrad": how each layer's score reads its tokens ("mean", the
            authors' read-out, or "cls") and the first layer summed (-2: the last two, the authors'
            default; 0: every layer).

    Returns:
        classes: ({method: maps [B, gh, gw]}, targets [B] (None without a classifier), probabilities [B, C] or None);
        phrases: ({method: maps [B, T, gh, gw]}, None, similarities `logits_per_image` [B, T]).
    """
    own = architecture_of(model)  # a model explained its own way (a Swin: its windowed attention made global, `vitviz.swin_analysis`)
    if own is not None:
        return own.relevance_maps(model, x, methods=methods, targets=targets, text=text, head_fusion=head_fusion, discard_ratio=discard_ratio)
    rec = record_for(model, x, methods, targets=targets, text=text, head_fusion=head_fusion, discard_ratio=discard_ratio, readout=readout,
                     start_layer=start_layer)
    maps = maps_of(rec, methods, head_fusion=head_fusion, discard_ratio=discard_ratio)
    if rec.texts is not None:
        images, t = rec.similarities.shape
        return {m: v.reshape(images, t, *v.shape[1:]) for m, v in maps.items()}, None, rec.similarities.cpu()
    return maps, (rec.targets.cpu() if rec.targets is not None else None), (rec.probabilities.cpu() if rec.probabilities is not None else None)


def explain(
    model: ViT | ImageTextModel,
    image: ImageSource,
    *,
    method: str = "rollout",
    target: int | str | None = None,
    text: TextInput | None = None,
    head_fusion: HeadFusion = "mean",
    discard_ratio: float = 0.0,
    readout: Readout = "mean",
    start_layer: int = LEGRAD_START_LAYER,
) -> Explanation | list[Explanation]:
    """The map over the patch grid that `method` gives for `target` (default: the top-1 class) or,
    for an image–text model, for a phrase.

    Args:
        model: a vitviz ViT with a spec (`load_model`, `ViT.from_*`), or an image–text model.
        image: anything `vitviz.load_image` accepts.
        method: a registered method: "attention", "rollout", "gradient", "grad_rollout", "legrad" or a plugin's.
        target: a class index or name; None for the top-1 (classifiers only).
        text: image–text models only: a phrase, or several (a list, token ids [T, C], or
            `model.tokenize(...)`'s ids and mask), all from one forward of the image tower.
        head_fusion, discard_ratio: for "rollout" and "grad_rollout".
        readout, start_layer: for "legrad" (`relevance_maps`).

    Returns:
        one Explanation; for `text` other than a single string, a list of them, one per phrase in
        the phrases' order.
    """
    spec = spec_of(model)
    if isinstance(model, ImageTextModel) and target is not None:
        raise ValueError(f"{spec.name} is an image–text model: it has no classes; explain a phrase with text=... instead of target=")
    x, cropped = preprocess(load_image(image), spec.preprocessing)
    maps, targets, scores = relevance_maps(
        model, x.unsqueeze(0), methods=[method], targets=None if text is not None else [target], text=text,
        head_fusion=head_fusion, discard_ratio=discard_ratio, readout=readout, start_layer=start_layer,
    )
    if text is not None:
        given_ids = isinstance(text, torch.Tensor) or (isinstance(text, tuple) and isinstance(text[0], torch.Tensor))
        names = [None] * scores.shape[1] if given_ids else ([text] if isinstance(text, str) else list(text))
        found = [
            Explanation(map=maps[method][0, t], method=method, target=None, label=None, probability=None, image=cropped,
                        text=names[t], similarity=float(scores[0, t]))
            for t in range(scores.shape[1])
        ]
        return found[0] if isinstance(text, str) else found
    index = int(targets[0]) if targets is not None else None
    return Explanation(
        map=maps[method][0],
        method=method,
        target=index,
        label=spec.categories[index] if index is not None and spec.categories else None,
        probability=float(scores[0, index]) if index is not None else None,
        image=cropped,
    )
