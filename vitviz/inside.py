"""Inside the model: what each layer would predict, what each head writes into the answer, and what
happens when heads are switched off.

- Logit lens (nostalgebraist 2020, "interpreting GPT: the logit lens"): the residual stream after
  block l (l = 0: the embedding) read through the model's own final norm, pooling and head, as if
  the blocks after l were skipped: `lens_of(stream)` [L+1, C].
- Direct logit attribution (Elhage et al. 2021, "A Mathematical Framework for Transformer
  Circuits"; TransformerLens's conventions): the target logit split exactly into the embedding,
  every head, every attention output bias, every MLP and the biases of the norm and the head, with
  the final norm's scale frozen at its value in the forward: `attribution_of(stream, target)`.
- Head ablation (Michel et al. 2019, "Are Sixteen Heads Really Better than One?"): the forward
  again with some heads' outputs replaced by zeros or by their mean over the image's patch tokens:
  `ablate`, and every head on its own: `head_importance`.

The residual stream of a vitviz ViT (`vitviz.model`), x_l [N, D] after block l:

    x_0 = tokens(image)        patch embedding + position embeddings, the prefix tokens (and CLIP's norm_pre)
    x_l = x_{l-1} + LS1 ⊙ (sum_h o_{l,h} W_{O,l,h}^T + b_{O,l}) + LS2 ⊙ MLP_l(LN(x_{l-1} + ...))

where o_{l,h} = A_h V_h [N, d] is head h's slice of the attention output before the output
projection `Attention.proj` (W_O [D, D], its columns h*d .. (h+1)*d are W_{O,l,h}) and LS the
LayerScale (1 without it). So x_L = embedding + heads + attention biases + MLPs.

The classifier reads the residual through its query ("readout"):
- "token": the cls token (DeiT: the cls and the distillation token, Q = 2, each with its head, the
  logits their mean), after the final LayerNorm;
- "mean": the mean of the patch tokens, then `fc_norm` (timm's pooled models; or no norm at all);
- "normed mean": each patch token through the final LayerNorm, then their mean (no fc_norm);
- "attention pool": SigLIP's MAP head (attention, then an MLP with its residual) reads every
  token: the lens applies it, but it is not linear in the stream, so there is no exact direct
  logit attribution (`attribution_of` says so).
A LayerNorm is z = γ ⊙ (x − mean(x)) / σ + β with σ = sqrt(var(x) + eps). Freezing σ at its value in
the forward makes z linear in the components: z = γ ⊙ Σ_c centre(c)/σ + β, with one σ per token for
"normed mean". Each `Stream` component is already read at the query and divided by the forward's σ
(not yet centred); `attribution_of` centres it, multiplies by γ and projects it on the target's
direction:

    logit_t = Σ_c r_t · (γ ⊙ centre(ĉ)) + r_t · β + b_t

with r_t the target's row of the head (DeiT: half of each head's row on its token) and b_t its bias.
For an image–text model the logit is exp(s) cos(P z, text_t) (+ bias): r_t = exp(s) P^T text_t /
||P z|| with ||P z|| frozen at the forward's too, so the parts add up to the similarity logit.

Nothing here changes weights: the capture and the ablations are forward hooks that live for one
call (`record_stream`, `_ablating`) and act only in the thread that opened them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from vitviz.images import ImageSource, load_image
from vitviz.imagetext import ImageTextModel
from vitviz.config import ViTConfig
from vitviz.model import ViT
from vitviz.preprocess import preprocess, to_input

__all__ = [
    "Ablation",
    "Attribution",
    "Stream",
    "Unembed",
    "ablate",
    "attribution_of",
    "class_across_depth",
    "first_top1_layer",
    "head_importance",
    "lens_of",
    "lens_top_k",
    "logit_attribution",
    "logit_lens",
    "main",
    "readout_of",
    "record_stream",
    "report",
    "StreamRecord",
    "stream_of",
]

Readout = Literal["token", "mean", "normed mean", "attention pool"]
AblationMode = Literal["zero", "mean"]
Target = int | str | None


# ----------------------------------------------------------------------------- the model's last steps


def readout_of(model: ViT) -> tuple[Readout, int, nn.LayerNorm | None]:
    """How the classifier reads the residual stream: (readout, Q the query vectors, the final norm or None).

    "token": tokens 0..Q-1 (cls; DeiT's cls and distillation token), each through `model.norm`;
    "mean": the mean of the patch tokens, through `model.fc_norm` (or no norm);
    "normed mean": each patch token through `model.norm`, then their mean;
    "attention pool": every token through `model.norm`, then `model.attn_pool` (SigLIP's MAP head).
    """
    c = model.config
    norm = model.norm if isinstance(model.norm, nn.LayerNorm) else None
    if c.pool == "map":
        return "attention pool", 1, norm
    if c.pool == "token":
        return "token", 2 if c.distill_token else 1, norm
    if isinstance(model.fc_norm, nn.LayerNorm):
        return "mean", 1, model.fc_norm
    return ("normed mean", 1, norm) if norm is not None else ("mean", 1, None)


def _read(x: torch.Tensor, readout: Readout, q: int, p: int) -> torch.Tensor:
    """The tokens of a stream [B, N, D] that the classifier reads: [B, R, D] (R = Q; 1 for "mean"; the patches for "normed mean")."""
    if readout == "token":
        return x[:, :q]
    if readout == "mean":
        return x[:, p:].mean(dim=1, keepdim=True)
    return x[:, p:]


def _scaled(parts: torch.Tensor, sigma: torch.Tensor, readout: Readout) -> torch.Tensor:
    """Read parts [..., B, R, D] divided by the forward's σ [B, R] -> [..., B, Q, D] (the mean over
    the patches for "normed mean", each divided by its own σ first)."""
    out = parts / sigma[..., None]
    return out.mean(dim=-2, keepdim=True) if readout == "normed mean" else out


def _tail(model: ViT, x: torch.Tensor, readout: Readout, q: int) -> torch.Tensor:
    """The head's input(s) had the model stopped at the stream x [B, N, D]: [B, Q, D], by the model's own modules."""
    p = model.config.num_prefix_tokens
    if readout == "token":
        return model.norm(x[:, :q])
    if readout == "attention pool":
        return model.attn_pool(model.norm(x))[:, None]
    return model.fc_norm(model.norm(x[:, p:]).mean(dim=1, keepdim=True))


@dataclass(frozen=True)
class Unembed:
    """The model's last step: the head's input z [..., Q, D] -> logits [..., C].

    Attributes:
        weight: a classifier's head rows [Q, C, D] (DeiT: the cls head's and the distillation
            head's); an image–text model's normalised label embeddings [1, K, E].
        bias: [Q, C] (zeros for an image–text model).
        projection: an image–text model's image projection [E, D], None for the identity or a classifier.
        image_text: the logits are exp(logit_scale) cos(P mean_q z_q, text) (+ logit_bias).
        logit_scale, logit_bias: exp(s) and the bias of an image–text model (None: softmax over the labels;
            a bias: SigLIP's sigmoid per label).
    """

    weight: torch.Tensor
    bias: torch.Tensor
    projection: torch.Tensor | None = None
    image_text: bool = False
    logit_scale: float = 1.0
    logit_bias: float | None = None

    def _embed(self, z: torch.Tensor) -> torch.Tensor:
        e = z.mean(dim=-2)
        return e if self.projection is None else e @ self.projection.to(e.dtype).T

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        """[..., Q, D] -> [..., C]."""
        w = self.weight.to(z.dtype)
        if self.image_text:
            out = self.logit_scale * F.normalize(self._embed(z), dim=-1) @ w[0].T
            return out if self.logit_bias is None else out + self.logit_bias
        return torch.einsum("...qd,qcd->...c", z, w) / w.shape[0] + self.bias.to(z.dtype).mean(dim=0)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """Softmax over the classes; the sigmoid of each label's logit for a model with a logit bias (as `ImageTextModel.zero_shot`)."""
        return logits.sigmoid() if self.image_text and self.logit_bias is not None else logits.softmax(dim=-1)

    def direction(self, target: int, z: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The target logit as a linear function of the head's input, r [Q, D] and b, so that
        logit_t = Σ_q r_q · z_q + b at the forward's z [Q, D] (an image–text model's ||P z|| frozen there), in float64."""
        z = z.double()
        if self.image_text:
            norm = self._embed(z).norm()
            text = self.weight[0, target].double()
            row = text if self.projection is None else self.projection.double().T @ text
            r = (self.logit_scale / norm) * row / z.shape[0]
            return r.expand_as(z), float(self.logit_bias or 0.0)
        q = self.weight.shape[0]
        return self.weight[:, target].double() / q, float(self.bias[:, target].double().mean())


def _unembed(pair: ViT | ImageTextModel, labels: Sequence[str] | None, template: str | None) -> Unembed:
    """The last step of `pair` (its head; for an image–text model its projection and the label set's text embeddings), detached on the CPU."""
    if isinstance(pair, ImageTextModel):
        with torch.inference_mode(False):  # the model keeps what it encodes: never an inference tensor
            text = pair.label_embeddings(labels, template).detach().float().cpu()
        proj = pair.image_projection
        return Unembed(
            weight=text[None], bias=torch.zeros(1, text.shape[0]), image_text=True,
            projection=proj.weight.detach().float().cpu() if isinstance(proj, nn.Linear) else None,
            logit_scale=float(pair.logit_scale.detach().float().exp()),
            logit_bias=None if pair.logit_bias is None else float(pair.logit_bias.detach()),
        )
    heads = [pair.head] + ([pair.head_dist] if pair.config.distill_token else [])
    if len(heads) == 1:  # a view of the head's weights (no copy on the CPU)
        return Unembed(weight=pair.head.weight.detach().float().cpu()[None], bias=pair.head.bias.detach().float().cpu()[None])
    return Unembed(weight=torch.stack([h.weight.detach().float().cpu() for h in heads]),
                   bias=torch.stack([h.bias.detach().float().cpu() for h in heads]))


# ----------------------------------------------------------------------------- the recorded stream


@dataclass
class Stream:
    """What the classifier's query gathered through the blocks in one forward of one image, on the
    CPU (float32): enough for the logit lens and for direct logit attribution.

    Attributes:
        readout: how the classifier reads the stream (`readout_of`).
        normed: the head's input had the model stopped after block l (l = 0: the embedding) [L+1, Q, D]:
            the residual through the model's own final norm and pooling (the logit lens' input).
        embedding: the embedding x_0 read at the query, divided by the forward's final-norm σ [Q, D]
            (this and the other components: None for "attention pool", which is not linear).
        heads: head h of block l, LS1 ⊙ o_{l,h} W_{O,l,h}^T, read and divided alike [L, H, Q, D].
        attn_biases: each block's LS1 ⊙ b_O, read and divided alike [L, Q, D].
        mlps: each block's LS2 ⊙ MLP output, read and divided alike [L, Q, D].
        sigma: the final norm's σ in the forward: [Q] for "token", [1] for "mean", one per patch for
            "normed mean"; ones without a final norm.
        centred: the final norm is a LayerNorm (its mean is taken off each component).
        norm_weight, norm_bias: its γ and β [D] (ones and zeros without one).
        unembed: the head (or the image–text model's similarity).
        categories: class names (an image–text model's labels), or None.

    embedding + heads.sum((0, 1)) + attn_biases.sum(0) + mlps.sum(0) is the final stream read at the
    query over σ; the components are not centred (centring is linear: `attribution_of` does it).
    """

    readout: Readout
    normed: torch.Tensor = field(repr=False)
    unembed: Unembed = field(repr=False)
    categories: tuple[str, ...] | None = field(default=None, repr=False)
    embedding: torch.Tensor | None = field(default=None, repr=False)
    heads: torch.Tensor | None = field(default=None, repr=False)
    attn_biases: torch.Tensor | None = field(default=None, repr=False)
    mlps: torch.Tensor | None = field(default=None, repr=False)
    sigma: torch.Tensor | None = field(default=None, repr=False)
    centred: bool = False
    norm_weight: torch.Tensor | None = field(default=None, repr=False)
    norm_bias: torch.Tensor | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        """Bytes held by the stream's own tensors (the head's weights are shared with the model on the CPU)."""
        own = (self.normed, self.embedding, self.heads, self.attn_biases, self.mlps, self.sigma, self.norm_weight, self.norm_bias)
        return sum(t.numel() * t.element_size() for t in own if t is not None)


class StreamRecord:
    """What `record_stream` captured: `streams` (one `Stream` per image of the last forward) after the block."""

    def __init__(self, pair: ViT | ImageTextModel | None = None, labels: tuple[str, ...] | None = None, template: str | None = None) -> None:
        self._pair, self._labels, self._template = pair, labels, template
        self._model = None if pair is None else _tower(pair)
        self._parts: dict[str, list] = {}
        self._streams: list[Stream] | None = None

    def _start(self) -> None:
        depth = len(self._model.blocks)
        self._parts = {"normed": [], "attn": [None] * depth, "mlp": [None] * depth}
        self._streams = None

    @property
    def streams(self) -> list[Stream] | None:
        """One `Stream` per image, or None where the model has nothing to unembed (no head, or an
        image–text model without labels).

        Raises:
            RuntimeError: no complete forward ran in the block.
        """
        if self._pair is None:
            return None
        if self._streams is None:
            self._streams = self._finish()
        return self._streams

    @property
    def stream(self) -> Stream | None:
        """The first image's `Stream` (or None as `streams`)."""
        streams = self.streams
        return None if streams is None else streams[0]

    def _finish(self) -> list[Stream]:
        parts, model = self._parts, self._model
        readout, q, norm = readout_of(model)
        if len(parts.get("normed", ())) != len(model.blocks) + 1:
            raise RuntimeError("record_stream captured no complete forward: run the model inside the `with` block")
        unembed, categories = _unembed(self._pair, self._labels, self._template), _categories(self._pair, self._labels)
        if readout == "attention pool":
            normed = torch.stack(parts["normed"]).float()  # [L+1, B, 1, D]
            return [Stream(readout=readout, normed=normed[:, b], unembed=unembed, categories=categories)
                    for b in range(normed.shape[1])]
        heads, d = model.config.heads, model.config.width
        with torch.no_grad():
            last = parts["last"].float()  # [B, R, D]
            eps = norm.eps if norm is not None else 0.0
            sigma = (last.var(dim=-1, unbiased=False) + eps).sqrt() if norm is not None else torch.ones(last.shape[:-1])
            attn = torch.stack(parts["attn"]).float()  # [L, B, R, D]: the heads' outputs before W_O
            mlp = torch.stack(parts["mlp"]).float()
            per_head = _scaled(attn, sigma, readout).unflatten(-1, (heads, d // heads))  # [L, B, Q, H, d]
            ones = torch.ones(last.shape)
            biases, ls_heads, ls_mlps = [], [], []
            for i, block in enumerate(model.blocks):
                ls1 = _gamma(block.ls1, d)
                w_o = block.attn.proj.weight.detach().float().cpu().unflatten(-1, (heads, d // heads))  # [D, H, d]: W_O,h = w_o[:, h]
                b_o = block.attn.proj.bias.detach().float().cpu() if block.attn.proj.bias is not None else torch.zeros(d)
                biases.append(_scaled(ones * b_o, sigma, readout) * ls1)
                ls_heads.append(torch.einsum("bqhk,dhk->bhqd", per_head[i], w_o) * ls1)
                ls_mlps.append(_scaled(mlp[i], sigma, readout) * _gamma(block.ls2, d))
            embedding = _scaled(parts["embedding"].float(), sigma, readout)
            normed = torch.stack(parts["normed"]).float()  # [L+1, B, Q, D]
            gamma = norm.weight.detach().float().cpu() if norm is not None and norm.weight is not None else torch.ones(d)
            beta = norm.bias.detach().float().cpu() if norm is not None and norm.bias is not None else torch.zeros(d)
            return [
                Stream(readout=readout, normed=normed[:, b], embedding=embedding[b], heads=torch.stack([h[b] for h in ls_heads]),
                       attn_biases=torch.stack([x[b] for x in biases]), mlps=torch.stack([m[b] for m in ls_mlps]),
                       sigma=sigma[b], centred=norm is not None, norm_weight=gamma, norm_bias=beta,
                       unembed=unembed, categories=categories)
                for b in range(last.shape[0])
            ]


def _gamma(ls: nn.Module, d: int) -> torch.Tensor:
    """A LayerScale's per-channel scale [D] (ones for the identity)."""
    gamma = getattr(ls, "gamma", None)
    return torch.ones(d) if gamma is None else gamma.detach().float().cpu()


def _labels(pair: ViT | ImageTextModel, labels: Sequence[str] | None, template: str | None) -> tuple[str, ...] | None:
    """The label set an image–text model is read against (its own by default), None for a classifier."""
    if isinstance(pair, ImageTextModel):
        labels = pair.labels if labels is None else labels
        return None if labels is None else tuple(labels)
    if labels is not None or template is not None:
        raise ValueError("labels and template are for image–text models; this model classifies with its own head")
    return None


@contextmanager
def record_stream(
    model: ViT | ImageTextModel, *, labels: Sequence[str] | None = None, template: str | None = None
) -> Iterator[StreamRecord]:
    """Records, during the block, what the classifier's query gathers in every block of `model` (a
    vitviz ViT, or an image–text model's image tower read against `labels` through `template`).

    The hooks keep only the tokens the classifier reads (the cls token: a [B, 1, D] slice per block
    and module), so the forward costs what it cost; the per-head products run when `streams` is first
    read. Nothing is recorded (and `streams` is None) for a model without a head, or an image–text
    model without labels (its own `labels` when none are given).

        with vitviz.inside.record_stream(model) as rec:
            logits = model(x)
        rec.streams[0].heads      # [L, H, Q, D]
    """
    tower = model.image if isinstance(model, ImageTextModel) else model
    labels = _labels(model, labels, template)
    if not isinstance(tower, ViT):
        raise TypeError(f"expected a vitviz ViT or ImageTextModel, got {type(model).__name__}")
    if labels is None and not (isinstance(model, ViT) and model.config.num_classes):
        yield StreamRecord()
        return
    rec = StreamRecord(model, labels, template)
    readout, q, _ = readout_of(tower)
    p = tower.config.num_prefix_tokens
    owner = threading.get_ident()

    def keep(x: torch.Tensor) -> torch.Tensor:  # a copy: a slice would keep the whole [B, N, D] alive
        return _read(x, readout, q, p).detach().to("cpu", copy=True)

    def read_or_skip(x: torch.Tensor) -> torch.Tensor | None:
        return None if readout == "attention pool" else keep(x)

    def embedding(module: nn.Module, args: tuple) -> None:
        if threading.get_ident() == owner:
            rec._start()
            rec._parts["embedding"] = read_or_skip(args[0])
            rec._parts["normed"].append(_tail(tower, args[0], readout, q).detach().to("cpu", copy=True))

    def after_block(i: int):
        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            if threading.get_ident() == owner and rec._parts:
                rec._parts["normed"].append(_tail(tower, out, readout, q).detach().to("cpu", copy=True))
                if i == len(tower.blocks) - 1:
                    rec._parts["last"] = read_or_skip(out)
        return hook

    def slot(name: str, i: int, *, pre: bool):
        def hook(module: nn.Module, args: tuple, out: torch.Tensor | None = None) -> None:
            if threading.get_ident() == owner and rec._parts:
                rec._parts[name][i] = keep(args[0] if pre else out)
        return hook

    handles = [tower.blocks[0].register_forward_pre_hook(embedding)]
    try:
        for i, block in enumerate(tower.blocks):
            if readout != "attention pool":  # only the lens: the components would not add up through its MLP
                handles.append(block.attn.proj.register_forward_pre_hook(slot("attn", i, pre=True)))
                handles.append(block.mlp.register_forward_hook(slot("mlp", i, pre=False)))
            handles.append(block.register_forward_hook(after_block(i)))
        yield rec
    finally:
        for h in handles:
            h.remove()


# ----------------------------------------------------------------------------- inputs


def _tower(model: ViT | ImageTextModel) -> ViT:
    return model.image if isinstance(model, ImageTextModel) else model


def _as_input(model: ViT | ImageTextModel, image: ImageSource | torch.Tensor) -> torch.Tensor:
    """An image (anything `vitviz.load_image` takes, prepared by the model's own preprocessing) or a
    prepared tensor [3, S, S] / [B, 3, S, S] -> [B, 3, S, S] on the model's device and dtype."""
    tower = _tower(model)
    param = next(tower.parameters())
    if isinstance(image, torch.Tensor):
        x = image[None] if image.ndim == 3 else image
    else:
        spec = getattr(model, "spec", None)
        if spec is None:
            raise ValueError("this model has no VariantSpec (its preprocessing); load it with vitviz.load_model or a vitviz.from_* "
                             "conversion, or pass the prepared tensor [3, S, S]")
        x = preprocess(load_image(image), spec.preprocessing)[0][None]
    return x.to(device=param.device, dtype=param.dtype)


def _classes(model: ViT | ImageTextModel, labels: tuple[str, ...] | None, template: str | None) -> int:
    """The number of classes `model` scores (an image–text model's labels, encoded here once and
    kept by the model, outside inference mode); raises where there is nothing to score."""
    if isinstance(model, ImageTextModel):
        if labels is None:
            raise ValueError("this image–text model has no label set: pass labels=[...] (and a template)")
        with torch.inference_mode(False):
            return model.label_embeddings(labels, template).shape[0]
    if not model.config.num_classes:
        raise ValueError("this model has no classifier (no head): there are no logits to read; an image–text model is read "
                         "against label texts")
    return model.config.num_classes


def stream_of(
    model: ViT | ImageTextModel, image: ImageSource | torch.Tensor, *, labels: Sequence[str] | None = None, template: str | None = None
) -> Stream:
    """One forward of `model` on `image` (its preprocessing applied; or a prepared tensor [3, S, S]), recorded: its `Stream`."""
    _classes(model, _labels(model, labels, template), template)
    x = _as_input(model, image)[:1]
    with record_stream(model, labels=labels, template=template) as rec, torch.inference_mode():
        _tower(model)(x)
    return rec.stream


def _stream_or_raise(stream: Stream | None) -> Stream:
    if stream is None:
        raise ValueError("this analysis has no recorded stream: the model has no head (an image–text model: no label set), "
                         "so there are no logits to read")
    return stream


# ----------------------------------------------------------------------------- logit lens


def lens_of(stream: Stream | None, *, logits: bool = False) -> torch.Tensor:
    """The logit lens [L+1, C]: row l is what the model would predict from its stream after block l
    (row 0: the embedding; row L: the model's own output), probabilities (softmax over the classes;
    an image–text model's zero-shot scores) or, with `logits`, logits."""
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


# ----------------------------------------------------------------------------- direct logit attribution


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

    @property
    def bias(self) -> torch.Tensor:
        """The final norm's β and the head's bias, projected: norm_bias + head_bias."""
        return self.norm_bias + self.head_bias

    def rows(self) -> list[tuple[str, int | None, int | None, float]]:
        """Every part as (component, layer, head, value): "embedding", "head" (layer, head), "attn_bias"
        (layer), "mlp" (layer), "norm_bias", "head_bias"; they sum to `logit`."""
        out: list[tuple[str, int | None, int | None, float]] = [("embedding", None, None, float(self.embedding))]
        for layer in range(self.heads.shape[0]):
            out += [("head", layer, h, float(v)) for h, v in enumerate(self.heads[layer].tolist())]
            out += [("attn_bias", layer, None, float(self.attn_biases[layer])), ("mlp", layer, None, float(self.mlps[layer]))]
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
        raise ValueError(f"this model reads its stream by {stream.readout} (SigLIP's MAP head: attention, then an MLP), which "
                         "is not linear in the stream: its logit does not split exactly into the components; the logit lens works")
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
        logit=final[t],
    )


def logit_attribution(
    model: ViT | ImageTextModel, image: ImageSource | torch.Tensor, target: Target = None, *,
    labels: Sequence[str] | None = None, template: str | None = None,
) -> Attribution:
    """Direct logit attribution of `target` for `model` on `image` (`attribution_of`)."""
    return attribution_of(stream_of(model, image, labels=labels, template=template), target)


# ----------------------------------------------------------------------------- head ablation


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
    slices of the input of `attn.proj`) where masks[layer] [B, H] (or [1, H]) is True: by zeros, or
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

    handles = [model.blocks[layer].attn.proj.register_forward_pre_hook(make(mask)) for layer, mask in masks.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


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
    """A forward with some heads switched off, beside the forward without.

    Attributes:
        heads: the (layer, head) pairs ablated.
        mode: "zero" or "mean".
        target, label: the class followed (default: the unablated prediction).
        categories: class names (an image–text model's labels), or None.
        before, probabilities: the probabilities [C] without and with the ablation.
    """

    heads: tuple[tuple[int, int], ...]
    mode: str
    target: int
    label: str | None
    categories: tuple[str, ...] | None = field(repr=False)
    before: torch.Tensor = field(repr=False)
    probabilities: torch.Tensor = field(repr=False)

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


def _categories(pair: ViT | ImageTextModel, labels: tuple[str, ...] | None) -> tuple[str, ...] | None:
    if labels is not None:
        return labels
    spec = getattr(pair, "spec", None)
    return None if spec is None or spec.categories is None else tuple(spec.categories)


def ablate(
    model: ViT | ImageTextModel, image: ImageSource | torch.Tensor, heads: Sequence[tuple[int, int]], *,
    mode: AblationMode = "zero", target: Target = None, labels: Sequence[str] | None = None, template: str | None = None,
) -> Ablation:
    """Runs `model` on `image` with the heads [(layer, head), ...] switched off, and once without.

    Args:
        model: a vitviz ViT with a head, or an image–text model (its image tower's heads; zero-shot
            over `labels`, its own label set by default, through `template`).
        image: anything `vitviz.load_image` takes (the model's preprocessing applied), or a prepared [3, S, S].
        heads: the heads to switch off; their outputs o_h = A_h V_h (before the output projection,
            so b_O stays) are replaced at every token.
        mode: "zero": by zeros; "mean": by the mean of the head's output over this image's patch
            tokens (in the same forward).
        target: the class followed (index or name); default the unablated prediction.
    """
    labels = _labels(model, labels, template)
    _classes(model, labels, template)
    tower = _tower(model)
    masks = {}
    for layer, hs in _check_heads(tower, heads).items():
        masks[layer] = torch.zeros(1, tower.config.heads, dtype=torch.bool)
        masks[layer][0, hs] = True
    x = _as_input(model, image)[:1]
    with torch.inference_mode():
        before = _probabilities(model, tower.encode(x), labels, template)[0].cpu()
        with _ablating(tower, masks, mode):
            after = _probabilities(model, tower.encode(x), labels, template)[0].cpu()
    categories = _categories(model, labels)
    t = _class_index(target, categories, before.numel(), int(before.argmax()))
    return Ablation(heads=tuple((int(a), int(b)) for a, b in heads), mode=mode, target=t,
                    label=categories[t] if categories is not None else None, categories=categories, before=before, probabilities=after)


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
        for block in tower.blocks:
            streams.append(block(streams[-1]))
        before = _probabilities(pair, tower.norm(streams[-1]), labels, template)  # [B, C]
        targets = before.argmax(dim=-1) if targets is None else targets.to(before.device)
        p_before = before.gather(1, targets[:, None])[:, 0]
        mask = torch.eye(heads, dtype=torch.bool).repeat_interleave(b, dim=0)  # row h*B + i: head h off
        drops = []
        for layer in range(len(tower.blocks)):
            s = streams[layer].repeat(heads, 1, 1)  # [H*B, N, D]
            with _ablating(tower, {layer: mask}, mode):
                for block in tower.blocks[layer:]:
                    s = block(s)
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


# ----------------------------------------------------------------------------- the figures of docs/inside.md


def _fresh_inputs(spec, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` generated shapes images (`vitviz.shapes.generate`) through the model's preprocessing -> ([n, 3, S, S], labels [n])."""
    from PIL import Image

    from vitviz.shapes import generate

    images, labels, _ = generate(n, seed=seed, image_size=spec.preprocessing.image_size)
    x = torch.stack([to_input(Image.fromarray(im), spec.preprocessing) for im in images])
    return x, torch.as_tensor(labels)


def _lens_figures(model: ViT, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> dict:
    """The logit lens over images [n, 3, S, S] with true classes [n]: per layer the top-1 accuracy and
    the mean probability of the true class [L+1]; the first layer at which the true class is top-1
    (mean over the images where it ever is, and how many never); the layer from which it stays top-1."""
    top1, prob, firsts, settled = [], [], [], []
    for s in range(0, len(x), batch_size):
        with torch.inference_mode(), record_stream(model) as rec:
            model(x[s : s + batch_size])
        for stream, label in zip(rec.streams, y[s : s + batch_size].tolist()):
            ranks, values = class_across_depth(lens_of(stream), label)
            top1.append(ranks == 0)
            prob.append(values)
            firsts.append(first_top1_layer(lens_of(stream), label))
            wrong = (ranks != 0).nonzero()
            settled.append(int(wrong[-1]) + 1 if len(wrong) else 0)  # L+1: wrong at the end
    reached = [f for f in firsts if f is not None]
    kept = [s for s in settled if s <= model.config.depth]
    return {"top1_by_layer": torch.stack(top1).float().mean(0).tolist(), "p_true_by_layer": torch.stack(prob).mean(0).tolist(),
            "first_top1": sum(reached) / max(1, len(reached)), "never_top1": len(firsts) - len(reached),
            "settled": sum(kept) / max(1, len(kept))}


def _top_heads(model: ViT, x: torch.Tensor, y: torch.Tensor, mode: AblationMode, batch_size: int, k: int = 5) -> list[tuple[int, int, float]]:
    """The k heads whose ablation alone costs the true class the most probability, mean over the images: (layer, head, mean drop)."""
    drops = torch.cat([_importance(model, x[s : s + batch_size], y[s : s + batch_size], mode=mode, labels=None, template=None)[0]
                       for s in range(0, len(x), batch_size)], dim=-1).mean(dim=-1)  # [L, H]
    heads = drops.shape[1]
    return [(int(i) // heads, int(i) % heads, float(drops.flatten()[i])) for i in drops.flatten().argsort(descending=True)[:k]]


def report(
    names: Sequence[str] | None = None, *, n: int = 1000, ablation_images: int = 1000, seed: int = 3535, batch_size: int = 100
) -> list[dict]:
    """For each shapes ViT classifier (`vitviz.list_variants()` named "shapes_*": not shapes_clip or shapes_swin), over `n`
    fresh images of `seed`: the logit lens' figures (`_lens_figures`) and, over the first
    `ablation_images`, the five heads whose ablation alone costs the true class the most probability
    (zero and mean ablation)."""
    from vitviz.sources import list_variants, load_model

    names = list(names) if names else [s.name for s in list_variants()  # the shapes ViTs (not the image-text or windowed ones)
                                       if s.name.startswith("shapes_") and isinstance(s.config, ViTConfig) and s.has_head]
    out = []
    for name in names:
        start = time.perf_counter()
        model = load_model(name, device="cpu").eval()
        x, y = _fresh_inputs(model.spec, n, seed)
        row = {"variant": name, "images": n, "depth": model.config.depth, "ablation_images": min(ablation_images, n)}
        row |= _lens_figures(model, x, y, batch_size)
        for mode in ("zero", "mean"):
            row[f"top_heads_{mode}"] = _top_heads(model, x[:ablation_images], y[:ablation_images], mode, batch_size)
        row["seconds"] = time.perf_counter() - start
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> None:
    """`python -m vitviz.inside --report`: the figures of docs/inside.md."""
    import argparse

    ap = argparse.ArgumentParser(description="Logit lens and head ablation on the embedded shapes models (docs/inside.md).")
    ap.add_argument("--report", action="store_true", help="print the figures of docs/inside.md")
    ap.add_argument("--variants", nargs="*", help="default: every shapes_* classifier")
    ap.add_argument("--n", type=int, default=1000, help="fresh images for the lens")
    ap.add_argument("--ablation-images", type=int, default=1000, help="of those, the first ones for head ablation")
    ap.add_argument("--seed", type=int, default=3535, help="training used 0 and 1; any other seed gives images never trained on")
    args = ap.parse_args(argv)
    if not args.report:
        ap.error("nothing to do: pass --report")
    torch.manual_seed(0)
    for r in report(args.variants, n=args.n, ablation_images=args.ablation_images, seed=args.seed):
        print(f"{r['variant']}: {r['images']:,} fresh images (seed {args.seed}), top-1 {r['top1_by_layer'][-1]:.1%}, {r['depth']} layers")
        print(f"  logit lens: the true class first ranked top-1 at layer {r['first_top1']:.2f} on average (0 = the embedding; "
              f"{r['never_top1']} images never), top-1 from layer {r['settled']:.2f} on for good")
        print("  by layer (0 = the embedding): top-1 " + " ".join(f"{v:.1%}" for v in r["top1_by_layer"]) +
              "; probability of the true class " + " ".join(f"{v:.3f}" for v in r["p_true_by_layer"]))
        for mode in ("zero", "mean"):
            heads = ", ".join(f"L{layer}H{h} {d:+.3f}" for layer, h, d in r[f"top_heads_{mode}"])
            print(f"  {mode} ablation, {r['ablation_images']:,} images, mean drop of the true class's probability: {heads}")
        print(f"  {r['seconds']:.0f} s")


if __name__ == "__main__":
    main()
