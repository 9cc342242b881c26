"""Ablation: the forward again with some heads' outputs replaced by zeros or by their mean, and/or
some of a sparse autoencoder's features switched off (or scaled) in the residual stream.

A feature is edited as Templeton et al. 2024 ("Scaling Monosemanticity") steer one: at the SAE's
layer the stream x becomes x + W_dec (z' − z), z = encode(x) and z' the same with the chosen
features multiplied by `scale`, so that the SAE's error x − x̂ stays in the stream and a run that
changes no feature adds exact zeros.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from vitviz.images import ImageSource
from vitviz.imagetext import ImageTextModel
from vitviz.inside.attribution import _class_index
from vitviz.inside.lens import lens_top_k
from vitviz.inside.stream import AblationMode, Target, _as_input, _categories, _classes, _labels, _tower
from vitviz.model import ViT

if TYPE_CHECKING:
    from vitviz.concepts.browse import Concepts
    from vitviz.concepts.sae import TopKSAE


def _check_heads(model: ViT, heads: Sequence[tuple[int, int]]) -> dict[int, list[int]]:
    """[(layer, head), ...] -> {layer: [heads]}, each checked against the model."""
    depth, n = model.config.depth, model.config.heads
    out: dict[int, list[int]] = {}
    for pair in heads:
        layer, head = (int(v) for v in pair)
        if not (0 <= layer < depth and 0 <= head < n):
            raise ValueError(f"head ({layer}, {head}) is outside this model's {depth} layers x {n} heads")
        out.setdefault(layer, []).append(head)
    return out


@contextmanager
def _ablating(model: ViT, masks: dict[int, torch.Tensor], mode: AblationMode) -> Iterator[None]:
    """Replaces, during the block and in this thread only, the heads' outputs o_h = A_h V_h (their
    slices of the input of `attn.norm`, which is `attn.proj`'s unless the model normalises them) where masks[layer] [B, H] (or [1, H]) is True: by zeros, or
    ("mean") by the mean of that head's output over the patch tokens of the same image and forward."""
    if mode not in ("zero", "mean"):
        raise ValueError(f'mode must be "zero" or "mean", got {mode!r}')
    owner, heads, p = threading.get_ident(), model.config.heads, model.config.num_prefix_tokens

    def make(mask: torch.Tensor):
        def hook(module: nn.Module, args: tuple) -> tuple | None:
            if threading.get_ident() != owner:
                return None
            o = args[0].unflatten(-1, (heads, -1))  # [B, N, H, d]
            new = torch.zeros_like(o) if mode == "zero" else o[:, p:].mean(dim=1, keepdim=True).expand_as(o)
            return (torch.where(mask.to(o.device)[:, None, :, None], new, o).flatten(-2),) + args[1:]
        return hook

    handles = [model.blocks[layer].attn.norm.register_forward_pre_hook(make(mask)) for layer, mask in masks.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def _editing_features(model: ViT, sae: nn.Module, layer: int, features: Sequence[int], scale: float, first: int) -> Iterator[None]:
    """During the block and in this thread only, the output of block `layer` (the stream x [B, N, D])
    from token `first` on becomes x + W_dec (z' − z): z = sae.encode(x), z' = z with `features`
    multiplied by `scale`. The SAE runs where its weights are (the stream is moved to it and the change back)."""
    owner = threading.get_ident()
    picked = torch.tensor(list(features), dtype=torch.long)

    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
        if threading.get_ident() != owner:
            return None
        p = next(sae.parameters())
        x = out[:, first:]
        z = sae.encode(x.to(device=p.device, dtype=p.dtype)).index_select(-1, picked.to(p.device))  # [B, n, k]: the chosen ones
        change = (z * scale - z) @ sae.W_dec.index_select(1, picked.to(p.device)).T  # W_dec (z' − z) [B, n, D]
        edited = out.clone()
        edited[:, first:] = x + change.to(device=out.device, dtype=out.dtype)
        return edited

    handle = model.blocks[layer].register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _feature_edit(tower: ViT, concepts: Concepts | TopKSAE | None, features: Sequence[int], layer: int | None,
                  scale: float) -> tuple[nn.Module, int, tuple[int, ...], int] | None:
    """(the SAE, its layer, the features (checked, each once), the first token it reads) of a feature
    ablation, or None when there is none."""
    if isinstance(features, (str, bytes)) or not isinstance(features, Sequence):
        raise TypeError(f"features is a list of feature numbers, got {type(features).__name__}")
    if concepts is None:
        if len(features) or layer is not None:
            raise ValueError("features are a sparse autoencoder's: pass concepts=... (vitviz.concepts.load_concepts, or a "
                             "TopKSAE and its layer=)")
        return None
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale != scale or abs(scale) == float("inf"):
        raise ValueError(f"scale multiplies the features' activations: a finite number, got {scale!r}")
    from vitviz.concepts.browse import _feature, check_fits, sae_site

    sae, at, tokens = sae_site(concepts, layer)
    check_fits(tower, sae, at)
    picked = tuple(dict.fromkeys(_feature(f, int(sae.W_dec.shape[1])) for f in features))
    return sae, at, picked, tower.config.num_prefix_tokens if tokens == "patches" else 0


def _probabilities(pair: ViT | ImageTextModel, tokens: torch.Tensor, labels: tuple[str, ...] | None, template: str | None) -> torch.Tensor:
    """The encoded tokens [B, N, D] (after the final norm) -> probabilities [B, C] (zero-shot for an image–text model), float32."""
    tower = _tower(pair)
    if isinstance(pair, ImageTextModel):
        pooled = tower.pool(tokens)
        feats = (pooled[0] + pooled[1]) / 2 if isinstance(pooled, tuple) else pooled
        return pair.zero_shot(pair.image_projection(feats), labels, template).float()
    return tower.head_logits(tokens).float().softmax(dim=-1)


@dataclass
class Ablation:
    """A forward with some heads (and/or a sparse autoencoder's features) switched off, beside the forward without.

    Attributes:
        heads: the (layer, head) pairs ablated.
        mode: "zero" or "mean".
        target, label: the class followed (default: the unablated prediction).
        categories: class names (an image–text model's labels), or None.
        before, probabilities: the probabilities [C] without and with the ablation.
        features: the SAE's features edited (each once, in the order given).
        feature_layer: the block after which they were edited (None without features).
        scale: what their activations were multiplied by (0: switched off).
    """

    heads: tuple[tuple[int, int], ...]
    mode: str
    target: int
    label: str | None
    categories: tuple[str, ...] | None = field(repr=False)
    before: torch.Tensor = field(repr=False)
    probabilities: torch.Tensor = field(repr=False)
    features: tuple[int, ...] = ()
    feature_layer: int | None = None
    scale: float = 0.0

    @property
    def target_before(self) -> float:
        return float(self.before[self.target])

    @property
    def target_after(self) -> float:
        return float(self.probabilities[self.target])

    @property
    def change(self) -> float:
        """The target's probability with the ablation minus without (negative: the heads helped it)."""
        return self.target_after - self.target_before

    def predictions(self, k: int = 5, *, ablated: bool = True) -> list[tuple[str | int, float]]:
        """The top-k (label, probability) with the ablation (`ablated=False`: without), the most likely first."""
        return lens_top_k((self.probabilities if ablated else self.before)[None], k, self.categories)[0]


def ablate(
    model: ViT | ImageTextModel, image: ImageSource | torch.Tensor, heads: Sequence[tuple[int, int]] = (), *,
    mode: AblationMode = "zero", target: Target = None, labels: Sequence[str] | None = None, template: str | None = None,
    features: Sequence[int] = (), concepts: Concepts | TopKSAE | None = None, scale: float = 0.0, layer: int | None = None,
) -> Ablation:
    """Runs `model` on `image` with the heads [(layer, head), ...] switched off (and/or a sparse
    autoencoder's `features` edited), and once without.

    Args:
        model: a vitviz ViT with a head, or an image–text model (its image tower's heads; zero-shot
            over `labels`, its own label set by default, through `template`).
        image: anything `vitviz.load_image` takes (the model's preprocessing applied), or a prepared [3, S, S].
        heads: the heads to switch off; their outputs o_h = A_h V_h (before the output projection,
            so b_O stays) are replaced at every token.
        mode: "zero": by zeros; "mean": by the mean of the head's output over this image's patch
            tokens (in the same forward).
        target: the class followed (index or name); default the unablated prediction.
        features: features of `concepts` whose activations are multiplied by `scale` at its layer
            (the stream x becomes x + W_dec (z' − z): the SAE's error stays; see the module's doc), on
            the tokens it was trained on (every token for a bare TopKSAE). None changed (no
            feature, or `scale` 1): the stream is unchanged exactly.
        concepts: the `Concepts` (`vitviz.concepts.load_concepts`: its layer) or a bare `TopKSAE`
            read after block `layer`.
        scale: 0 switches the features off; 2 doubles them.
    """
    labels = _labels(model, labels, template)
    _classes(model, labels, template)
    tower = _tower(model)
    edit = _feature_edit(tower, concepts, features, layer, scale)
    masks = {}
    for layer, hs in _check_heads(tower, heads).items():
        masks[layer] = torch.zeros(1, tower.config.heads, dtype=torch.bool)
        masks[layer][0, hs] = True
    x = _as_input(model, image)[:1]
    with torch.inference_mode():
        before = _probabilities(model, tower.encode(x), labels, template)[0].cpu()
        with _ablating(tower, masks, mode), (_editing_features(tower, *edit[:2], edit[2], scale, edit[3]) if edit else nullcontext()):
            after = _probabilities(model, tower.encode(x), labels, template)[0].cpu()
    categories = _categories(model, labels)
    t = _class_index(target, categories, before.numel(), int(before.argmax()))
    return Ablation(heads=tuple((int(a), int(b)) for a, b in heads), mode=mode, target=t,
                    label=categories[t] if categories is not None else None, categories=categories, before=before, probabilities=after,
                    features=edit[2] if edit else (), feature_layer=edit[1] if edit else None, scale=float(scale) if edit else 0.0)


def _importance(
    pair: ViT | ImageTextModel, x: torch.Tensor, targets: torch.Tensor | None, *, mode: AblationMode,
    labels: tuple[str, ...] | None, template: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images [B, 3, S, S] -> (the drop of each target's probability when each head alone is
    ablated [L, H, B], the targets [B]; default each image's prediction). Block l runs once on
    the H copies of the stream before it (copy h with head h off), then the blocks after it."""
    tower = _tower(pair)
    heads, b = tower.config.heads, x.shape[0]
    with torch.inference_mode():
        streams = [tower.tokens(x)]
        ropes = tower.rotations(tower.grid_for(x.shape[2], x.shape[3]))
        for block, rope in zip(tower.blocks, ropes):
            streams.append(block(streams[-1], rope))
        before = _probabilities(pair, tower.norm(streams[-1]), labels, template)  # [B, C]
        targets = before.argmax(dim=-1) if targets is None else targets.to(before.device)
        p_before = before.gather(1, targets[:, None])[:, 0]
        mask = torch.eye(heads, dtype=torch.bool).repeat_interleave(b, dim=0)  # row h*B + i: head h off
        drops = []
        for layer in range(len(tower.blocks)):
            s = streams[layer].repeat(heads, 1, 1)  # [H*B, N, D]
            with _ablating(tower, {layer: mask}, mode):
                for block, rope in zip(tower.blocks[layer:], ropes[layer:]):
                    s = block(s, rope)
            after = _probabilities(pair, tower.norm(s), labels, template).unflatten(0, (heads, b))  # [H, B, C]
            drops.append(p_before - after.gather(2, targets[None, :, None].expand(heads, b, 1))[..., 0])
    return torch.stack(drops).cpu(), targets.cpu()


def head_importance(
    model: ViT | ImageTextModel, image: ImageSource | torch.Tensor, target: Target = None, *, mode: AblationMode = "zero",
    labels: Sequence[str] | None = None, template: str | None = None,
) -> torch.Tensor:
    """How much the target's probability drops when each head alone is switched off (`ablate` with
    one head) [L, H]: positive where the head helped. Batched: the H heads of a layer in one batch
    of H copies, each run from that layer's input on."""
    labels = _labels(model, labels, template)
    classes = _classes(model, labels, template)
    x = _as_input(model, image)[:1]
    t = None if target is None else torch.tensor([_class_index(target, _categories(model, labels), classes, 0)])
    return _importance(model, x, t, mode=mode, labels=labels, template=template)[0][..., 0]
