"""The residual stream of one forward, recorded, and what reads it: the model's last steps (final norm, pooling, head) and the inputs."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from vitviz.images import ImageSource, load_image
from vitviz.imagetext import ImageTextModel
from vitviz.model import ViT
from vitviz.preprocess import preprocess


Readout = Literal["token", "mean", "normed mean", "attention pool"]
AblationMode = Literal["zero", "mean"]
Target = int | str | None


_NORMS = (nn.LayerNorm, nn.RMSNorm)


def readout_of(model: ViT) -> tuple[Readout, int, nn.LayerNorm | nn.RMSNorm | None]:
    """How the classifier reads the residual stream: (readout, Q the query vectors, the final norm or None).

    "token": tokens 0..Q-1 (cls; DeiT's cls and distillation token), each through `model.norm`;
    "mean": the mean of the patch tokens, through `model.fc_norm` (or no norm);
    "normed mean": each patch token through `model.norm`, then their mean;
    "attention pool": every token through `model.norm`, then `model.attn_pool` (SigLIP's MAP head).
    """
    c = model.config
    norm = model.norm if isinstance(model.norm, _NORMS) else None
    if c.pool == "map":
        return "attention pool", 1, norm
    if c.pool == "token":
        return "token", 2 if c.distill_token else 1, norm
    if isinstance(model.fc_norm, _NORMS):
        return "mean", 1, model.fc_norm
    return ("normed mean", 1, norm) if norm is not None else ("mean", 1, None)


def unsplit_why(model: ViT) -> str:
    """Why the classifier's logit does not split exactly into the blocks' components, or "": SigLIP's
    attention pool (attention, then an MLP) or a LayerNorm over each block's heads before W_O (the
    heads' outputs are not added, they are normalised together)."""
    if readout_of(model)[0] == "attention pool":
        return ("this model reads its stream by attention pool (SigLIP's MAP head: attention, then an MLP), which is not linear "
                "in the stream")
    if model.config.attn_norm:
        return "this model normalises its heads' outputs together (a LayerNorm before W_O), so a head's share is not linear in it"
    if model.config.post_norm:
        return POST_NORM_UNSPLIT
    return ""


POST_NORM_UNSPLIT = ("this model normalises each branch's output before adding it to the stream (res-post-norm), so a head's "
                     "share is not linear in it")


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


_CPU_COPIES: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}  # id(parameter) -> (the parameter, its version, the copy)
_CPU_LOCK = threading.Lock()


def on_cpu(weight: torch.Tensor) -> torch.Tensor:
    """A parameter detached, as float32 on the CPU, one tensor for every analysis of its model: the
    parameter itself (a view) on a float32 CPU model, else one copy kept while the parameter lives and
    made again when it changes (its version). So a `Stream` holds no head of its own on a GPU either."""
    key = id(weight)
    with _CPU_LOCK:
        kept = _CPU_COPIES.get(key)
        if kept is not None and kept[0]() is weight and kept[1] == weight._version:
            return kept[2]
        copy = weight.detach().float().cpu()
        if kept is None or kept[0]() is not weight:
            weakref.finalize(weight, _CPU_COPIES.pop, key, None)
        _CPU_COPIES[key] = (weakref.ref(weight), weight._version, copy)
        return copy


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
    return head_unembed([pair.head] + ([pair.head_dist] if pair.config.distill_token else []))


def head_unembed(heads: Sequence[nn.Linear]) -> Unembed:
    """The `Unembed` of a classifier's linear heads (a DeiT's two, averaged), read from the model's
    one CPU copy of their weights (`on_cpu`; one head's a view of it, two stacked)."""
    if len(heads) == 1:
        return Unembed(weight=on_cpu(heads[0].weight)[None], bias=on_cpu(heads[0].bias)[None])
    return Unembed(weight=torch.stack([on_cpu(h.weight) for h in heads]), bias=torch.stack([on_cpu(h.bias) for h in heads]))


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
            (this and the other components: None where the logit does not split: `unsplit`).
        heads: head h of block l, LS1 ⊙ o_{l,h} W_{O,l,h}^T, read and divided alike [L, H, Q, D].
        attn_biases: each block's LS1 ⊙ b_O, read and divided alike [L, Q, D].
        mlps: each block's LS2 ⊙ MLP output, read and divided alike [L, Q, D].
        sigma: the final norm's σ in the forward: [Q] for "token", [1] for "mean", one per patch for
            "normed mean"; ones without a final norm.
        centred: the final norm is a LayerNorm (its mean is taken off each component).
        norm_weight, norm_bias: its γ and β [D] (ones and zeros without one).
        unembed: the head (or the image–text model's similarity).
        categories: class names (an image–text model's labels), or None.
        unsplit: why the logit does not split into components (`unsplit_why`; the components are
            then None), or "".
        first_layer: the block (0-based) the record starts before: 0 for a ViT, whose row 0 is the
            embedding; for a model whose stream changes width between stages (a Swin), its last
            stage's first block, and `embedding` is what enters it (everything before it, merged).

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
    unsplit: str = ""
    first_layer: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the stream's own tensors (the head's weights are the model's one CPU copy, `on_cpu`;
        a DeiT's two heads stacked, or an image–text model's label embeddings, are not counted)."""
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
        readout, _, norm = readout_of(model)
        if len(parts.get("normed", ())) != len(model.blocks) + 1:
            raise RuntimeError("record_stream captured no complete forward: run the model inside the `with` block")
        return streams_of_parts(parts, readout=readout, norm=norm, blocks=model.blocks, heads=model.config.heads,
                                unembed=_unembed(self._pair, self._labels, self._template),
                                categories=_categories(self._pair, self._labels), unsplit=unsplit_why(model))


def streams_of_parts(parts: dict, *, readout: Readout, norm: nn.Module | None, blocks: Sequence[nn.Module], heads: int,
                     unembed: Unembed, categories: tuple[str, ...] | None, unsplit: str = "", first_layer: int = 0) -> list[Stream]:
    """One `Stream` per image from what a forward's hooks kept of the blocks `blocks` (every block of a
    ViT; a Swin's last stage), each [B, R, D] as the classifier reads it (`_read`):

    - "normed": the head's input had the model stopped before the first of them and after each [B, Q, D];
    - "embedding": what entered the first of them; "last": what left the last;
    - "attn", "mlp": each block's heads' outputs before W_O (`attn.proj`), and its MLP's output.

    The blocks' own weights give the per-head products (`attn.proj`, LayerScale `ls1`/`ls2` where
    they have one); without "embedding" (`unsplit`: the logit does not split) only the lens' rows."""
    normed = torch.stack(parts["normed"]).float()  # [L+1, B, Q, D]
    if unsplit:
        return [Stream(readout=readout, normed=normed[:, b], unembed=unembed, categories=categories, unsplit=unsplit,
                       first_layer=first_layer) for b in range(normed.shape[1])]
    with torch.no_grad():
        last = parts["last"].float()  # [B, R, D]
        d = last.shape[-1]
        eps = norm.eps if norm is not None else 0.0
        centred = isinstance(norm, nn.LayerNorm)  # an RMSNorm divides by the root mean square, not centred
        spread = last.var(dim=-1, unbiased=False) if centred else last.pow(2).mean(dim=-1)
        sigma = (spread + eps).sqrt() if norm is not None else torch.ones(last.shape[:-1])
        attn = torch.stack(parts["attn"]).float()  # [L, B, R, D]: the heads' outputs before W_O
        mlp = torch.stack(parts["mlp"]).float()
        per_head = _scaled(attn, sigma, readout).unflatten(-1, (heads, d // heads))  # [L, B, Q, H, d]
        ones = torch.ones(last.shape)
        biases, ls_heads, ls_mlps = [], [], []
        for i, block in enumerate(blocks):
            ls1 = _gamma(getattr(block, "ls1", None), d)
            w_o = block.attn.proj.weight.detach().float().cpu().unflatten(-1, (heads, d // heads))  # [D, H, d]: W_O,h = w_o[:, h]
            b_o = block.attn.proj.bias.detach().float().cpu() if block.attn.proj.bias is not None else torch.zeros(d)
            biases.append(_scaled(ones * b_o, sigma, readout) * ls1)
            ls_heads.append(torch.einsum("bqhk,dhk->bhqd", per_head[i], w_o) * ls1)
            ls_mlps.append(_scaled(mlp[i], sigma, readout) * _gamma(getattr(block, "ls2", None), d))
        embedding = _scaled(parts["embedding"].float(), sigma, readout)
        gamma = norm.weight.detach().float().cpu() if norm is not None and norm.weight is not None else torch.ones(d)
        bias = getattr(norm, "bias", None)  # (an RMSNorm has none)
        beta = bias.detach().float().cpu() if bias is not None else torch.zeros(d)
        return [
            Stream(readout=readout, normed=normed[:, b], embedding=embedding[b], heads=torch.stack([h[b] for h in ls_heads]),
                   attn_biases=torch.stack([x[b] for x in biases]), mlps=torch.stack([m[b] for m in ls_mlps]),
                   sigma=sigma[b], centred=centred, norm_weight=gamma, norm_bias=beta,
                   unembed=unembed, categories=categories, first_layer=first_layer)
            for b in range(last.shape[0])
        ]


def _gamma(ls: nn.Module | None, d: int) -> torch.Tensor:
    """A LayerScale's per-channel scale [D] (ones for the identity, or a block without one)."""
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

    unsplit = unsplit_why(tower)

    def read_or_skip(x: torch.Tensor) -> torch.Tensor | None:
        return None if unsplit else keep(x)

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
            if not unsplit:  # else only the lens: the components would not add up
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


def _categories(pair: ViT | ImageTextModel, labels: tuple[str, ...] | None) -> tuple[str, ...] | None:
    if labels is not None:
        return labels
    spec = getattr(pair, "spec", None)
    return None if spec is None or spec.categories is None else tuple(spec.categories)
