"""Why this class: a map over the patch grid from a registered method, for a chosen target class.

    vitviz.explain(model, "cat.jpg", method="gradient", target="tabby, tabby cat")

Built-in methods (`METHODS`; `vitviz.methods()` lists them with any plugins', `vitviz.explainers`):
- "attention": the last layer's attention of the cls token, averaged over heads (no target).
- "rollout": attention rollout from the cls token (Abnar & Zuidema 2020; no target).
- "gradient": Chefer et al. 2021's relevance for the target logit (`vitviz.relevance`).
- "grad_rollout": attention weighted by the same layer's gradient, fused, clipped and rolled out.

Each map is the classifier's query's row over the patches: the cls token's, or for a model without
one that classifies from the mean of its patch tokens, the mean of the patch tokens' rows ("pool").

`relevance_maps` computes any set of methods for a batch in one forward and, when a method needs
gradients, one backward of the summed per-sample target logits (samples do not interact in eval
mode); it is `record` (the model's part) then `maps_of` (pure).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch
from PIL import Image

from vitviz.analysis import POOL, HeadFusion, Query, cls_map
from vitviz.explainers import method as registered
from vitviz.hooks import record_attention
from vitviz.images import ImageSource, load_image
from vitviz.layout import TokenLayout
from vitviz.model import ViT
from vitviz.pipeline import layout_of, spec_of
from vitviz.preprocess import preprocess

__all__ = ["METHODS", "Explanation", "Recorded", "explain", "maps_of", "needs_gradients", "record", "relevance_maps", "resolve_target"]

METHODS: tuple[str, ...] = ("attention", "rollout", "gradient", "grad_rollout")  # the built-in ones


@dataclass
class Explanation:
    """One map over the patch grid.

    Attributes:
        map: relevance of each patch [gh, gw] (larger: more relevant).
        method: a registered method's name (`vitviz.methods()`).
        target: the class index explained (None for a model without a classifier).
        label: its name.
        probability: the model's probability of it.
        image: the S x S crop the model saw.
    """

    map: torch.Tensor = field(repr=False)
    method: str
    target: int | None
    label: str | None
    probability: float | None
    image: Image.Image = field(repr=False)


def resolve_target(target: int | str | None, categories: Sequence[str] | None, probabilities: torch.Tensor | None) -> int | None:
    """A class index from an index, a class name, or None (the top-1)."""
    if categories is None:
        if target is not None:
            raise ValueError("this model has no classifier: there is no class to explain")
        return None
    if target is None:
        if probabilities is None:
            raise ValueError("no target given and no probabilities to take the top-1 from")
        return int(probabilities.argmax())
    if isinstance(target, str):
        try:
            return list(categories).index(target)
        except ValueError:
            raise ValueError(f"unknown class {target!r}; the model's classes are in model.spec.categories") from None
    index = int(target)
    if not 0 <= index < len(categories):
        raise ValueError(f"class index {index} is outside 0..{len(categories) - 1}")
    return index


@dataclass
class Recorded:
    """One forward (and backward) of a batch, as the maps are computed from it.

    Attributes:
        attentions: [L, B, H, N, N]; gradients: the same shape, or None without a gradient method.
        targets: the class of each sample [B] (None without a classifier); probabilities [B, C] or None.
        grid: the patch grid; num_prefix_tokens: p.
        pooled_query: the model classifies from the mean of its patch tokens and has no cls token:
            its maps are the mean of the patch tokens' rows ("pool") instead of the cls token's.
        chosen_query: whose row the maps read when not the classifier's (a prefix token's index).
        layout: the tokens and what the model offers; each method's needs are checked against it.
    """

    attentions: torch.Tensor = field(repr=False)
    gradients: torch.Tensor | None = field(repr=False)
    targets: torch.Tensor | None
    probabilities: torch.Tensor | None = field(repr=False)
    grid: tuple[int, int]
    num_prefix_tokens: int
    pooled_query: bool = False
    chosen_query: Query | None = None
    layout: TokenLayout | None = None

    @property
    def query(self) -> Query:
        """Whose row the maps are: the classifier's query, 0 (the cls token) or "pool", unless chosen."""
        if self.chosen_query is not None:
            return self.chosen_query
        return POOL if self.pooled_query else 0

    def query_maps(self, matrix: torch.Tensor) -> torch.Tensor:
        """The query's row of an N x N matrix per sample [B, N, N] over the patch grid: [B, gh, gw]."""
        return cls_map(matrix, grid=self.grid, num_prefix_tokens=self.num_prefix_tokens, token=self.query)


def needs_gradients(methods: Sequence[str]) -> bool:
    """Whether any of `methods` needs the gradients of the target logit (ValueError for an unknown one)."""
    return any(registered(m).needs_gradients for m in methods)


def record(
    model: ViT, x: torch.Tensor, *, targets: Sequence[int | str | None] | torch.Tensor | None = None, gradients: bool = False
) -> Recorded:
    """A batch's attention (and, with `gradients`, the gradient of each sample's target logit with
    respect to every layer's softmax output, from one backward of their sum)."""
    spec = spec_of(model)
    if gradients and not spec.has_head:
        raise ValueError(f"{spec.name} has no classifier: gradient methods need a class logit; use 'attention' or 'rollout'")
    if not spec.has_head and targets is not None and any(t is not None for t in targets):
        raise ValueError(f"{spec.name} has no classifier: there is no class to explain")
    param = next(model.parameters())
    with contextlib.ExitStack() as modes:
        if gradients:  # autograd on, also when the caller is in inference mode
            modes.enter_context(torch.inference_mode(False))
            modes.enter_context(torch.enable_grad())
            # a fresh leaf that requires grad: every attention map is then on the graph, even for frozen weights
            x = x.to(device=param.device, dtype=param.dtype).clone().requires_grad_(True)
        else:
            modes.enter_context(torch.inference_mode())
            x = x.to(device=param.device, dtype=param.dtype)
        with record_attention(model, gradients=gradients) as rec:
            tokens = model.encode(x)
            logits = model.head_logits(tokens) if spec.has_head else None
            probs = logits.detach().float().softmax(-1) if logits is not None else None
            chosen = None
            if logits is not None:
                wanted = [None] * x.shape[0] if targets is None else list(targets)
                if len(wanted) != x.shape[0]:
                    raise ValueError(f"{len(wanted)} targets for {x.shape[0]} images")
                chosen = torch.tensor([resolve_target(t, spec.categories, probs[i]) for i, t in enumerate(wanted)], device=logits.device)
            if gradients:
                # one backward for the batch: the sum of each sample's own target logit
                torch.autograd.grad(logits.gather(1, chosen[:, None]).sum(), x)
        attn = rec.attentions.float()
        grads = rec.gradients.float() if gradients else None
    return Recorded(
        attentions=attn, gradients=grads, targets=chosen, probabilities=probs,
        grid=model.grid_for(x.shape[-2], x.shape[-1]), num_prefix_tokens=spec.num_prefix_tokens,
        pooled_query=spec.config.pooled_query, layout=layout_of(spec, model.grid_for(x.shape[-2], x.shape[-1])),
    )


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
        why = recorded.layout.lacks(m.needs - {"classifier"}) if recorded.layout is not None else None
        if why:
            raise ValueError(f"{m.name!r} cannot run: {why}")
    if recorded.gradients is None and any(m.needs_gradients for m in chosen):
        raise ValueError("gradient methods need a batch recorded with gradients=True")
    if recorded.targets is None and any(m.needs_classifier for m in chosen):
        raise ValueError(f"{next(m.name for m in chosen if m.needs_classifier)!r} explains a class: it needs a model with a classifier")
    rec = recorded if query is None else replace(recorded, chosen_query=query)
    batch, (gh, gw) = recorded.attentions.shape[1], recorded.grid
    maps: dict[str, torch.Tensor] = {}
    for m in chosen:
        out = m.fn(rec, head_fusion=head_fusion, discard_ratio=discard_ratio)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (batch, gh, gw):
            raise ValueError(f"method {m.name!r} returned {getattr(out, 'shape', type(out).__name__)}; it must return maps [{batch}, {gh}, {gw}]")
        maps[m.name] = out.detach().float().cpu()
    return maps


def relevance_maps(
    model: ViT,
    x: torch.Tensor,
    *,
    methods: Sequence[str] = METHODS,
    targets: Sequence[int | str | None] | torch.Tensor | None = None,
    head_fusion: HeadFusion = "mean",
    discard_ratio: float = 0.0,
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
    """Maps of several methods for a batch, from one forward (and one backward for gradient methods).

    Args:
        model: a vitviz ViT (in eval mode).
        x: preprocessed images [B, 3, S, S].
        methods: registered methods' names (`vitviz.methods()`).
        targets: per sample a class index, a class name or None (top-1); None for all top-1.
        head_fusion, discard_ratio: for "rollout" and "grad_rollout".

    Returns:
        ({method: maps [B, gh, gw]}, targets [B] (None without a classifier), probabilities [B, C] or None).
    """
    rec = record(model, x, targets=targets, gradients=needs_gradients(methods))
    maps = maps_of(rec, methods, head_fusion=head_fusion, discard_ratio=discard_ratio)
    return maps, (rec.targets.cpu() if rec.targets is not None else None), (rec.probabilities.cpu() if rec.probabilities is not None else None)


def explain(
    model: ViT,
    image: ImageSource,
    *,
    method: str = "rollout",
    target: int | str | None = None,
    head_fusion: HeadFusion = "mean",
    discard_ratio: float = 0.0,
) -> Explanation:
    """The map over the patch grid that `method` gives for `target` (default: the top-1 class).

    Args:
        model: a vitviz ViT with a spec (`load_model`, `ViT.from_*`).
        image: anything `vitviz.load_image` accepts.
        method: a registered method: "attention", "rollout", "gradient", "grad_rollout" or a plugin's.
        target: a class index or name; None for the top-1.
    """
    spec = spec_of(model)
    x, cropped = preprocess(load_image(image), spec.preprocessing)
    maps, targets, probs = relevance_maps(
        model, x.unsqueeze(0), methods=[method], targets=[target], head_fusion=head_fusion, discard_ratio=discard_ratio
    )
    index = int(targets[0]) if targets is not None else None
    return Explanation(
        map=maps[method][0],
        method=method,
        target=index,
        label=spec.categories[index] if index is not None and spec.categories else None,
        probability=float(probs[0, index]) if index is not None else None,
        image=cropped,
    )
