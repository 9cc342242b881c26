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
mode); it is `record` (the model's part) then `maps_of` (pure).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal, Sequence, Union

import torch
from PIL import Image

from vitviz.analysis import POOL, HeadFusion, Query, cls_map
from vitviz.architectures import architecture_of
from vitviz.explainers import method as registered
from vitviz.hooks import record_attention
from vitviz.images import ImageSource, load_image
from vitviz.imagetext import ImageTextModel
from vitviz.layout import TokenLayout
from vitviz.model import ViT
from vitviz.pipeline import layout_of, spec_of
from vitviz.preprocess import preprocess

__all__ = ["METHODS", "Explanation", "Recorded", "TextInput", "explain", "maps_of", "needs_gradients", "needs_layer_gradients", "record",
           "record_for", "relevance_maps", "resolve_target"]

METHODS: tuple[str, ...] = ("attention", "rollout", "gradient", "grad_rollout", "legrad")  # the built-in ones

# phrases: one string, several, token ids [T, C], or token ids and their attention mask (`ImageTextModel.tokenize`)
PoolRule = Literal["attention", "relevance", "relevance_rows"]  # how an attention-pooled model's "pool" row is weighted
TextInput = Union[str, Sequence[str], torch.Tensor, tuple[torch.Tensor, Union[torch.Tensor, None]]]


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
        attention_layers: each layer's attention [B, H, N, N], as the forward made it (no copy);
            `attentions` stacks them [L, B, H, N, N] when first read.
        gradients: [L, B, H, N, N], layer l's entry d(target score) / d(layer l's attention); None
            without a gradient method, and when every gradient method of the pass reduced each
            layer inside the backward instead (`layerwise`).
        reduced: {method: (options, [the method's `layerwise` result per layer])} computed inside
            the backward (`record(..., layerwise=...)`).
        targets: the class of each sample [B] (None without a classifier, and for phrases);
            probabilities [B, C] or None.
        grid: the patch grid; num_prefix_tokens: p.
        pooled_query: the model classifies from the mean of its patch tokens and has no cls token:
            its maps are the mean of the patch tokens' rows ("pool") instead of the cls token's.
        chosen_query: whose row the maps read when not the classifier's (a prefix token's index).
        layout: the tokens and what the model offers; each method's needs are checked against it.
        texts: the phrases explained (T of them; an entry is None for a phrase given as token ids), or
            None. With phrases the batch is the (image, phrase) pairs, image-major: B = images x T,
            row b·T + t; `attentions` repeats each image's attention T times.
        similarities: each image's score of each phrase, `logits_per_image` [images, T], or None.
        layer_gradients: [L', B, H, N, N] or None: for each layer l of `layer_gradient_layers`,
            d(s_l) / d(layer l's attention), s_l the target score read from layer l's output by
            `readout` (`layer_readout`) through the final norm and the head (or the projection and
            the phrase's embedding); for LeGrad.
        layer_gradient_layers: the layers (from 0) of `layer_gradients`' entries, first layer first.
        layer_readout: how `layer_gradients`' scores read a layer's tokens (`Readout`).
        pool_attention, pool_gradients: a model that pools with attention (SigLIP's probe): the
            probe's attention over the tokens [B, H, N] and, with gradients, d(target score) / d(it);
            None otherwise. They make the "pool" query's row (`query_maps`).
    """

    attention_layers: tuple[torch.Tensor, ...] = field(repr=False)
    gradients: torch.Tensor | None = field(repr=False)
    targets: torch.Tensor | None
    probabilities: torch.Tensor | None = field(repr=False)
    grid: tuple[int, int]
    num_prefix_tokens: int
    pooled_query: bool = False
    chosen_query: Query | None = None
    layout: TokenLayout | None = None
    texts: tuple[str | None, ...] | None = None
    similarities: torch.Tensor | None = field(default=None, repr=False)
    layer_gradients: torch.Tensor | None = field(default=None, repr=False)
    layer_gradient_layers: tuple[int, ...] = ()
    layer_readout: "Readout | None" = None
    pool_attention: torch.Tensor | None = field(default=None, repr=False)
    pool_gradients: torch.Tensor | None = field(default=None, repr=False)
    reduced: dict[str, tuple[dict, list[torch.Tensor]]] = field(default_factory=dict, repr=False)
    _stack: torch.Tensor | None = field(default=None, init=False, repr=False)

    @property
    def attentions(self) -> torch.Tensor:
        """Every layer's attention [L, B, H, N, N] (stacked once, when first read)."""
        if self._stack is None:
            self._stack = torch.stack(self.attention_layers)
        return self._stack

    @property
    def batch(self) -> int:
        """B: the samples (or image–phrase pairs) of the pass."""
        return self.attention_layers[0].shape[0]

    def layerwise(self, name: str, **options) -> list[torch.Tensor]:
        """Method `name`'s per-layer reduction (`Method.layerwise`) with `options`, first layer first:
        as computed inside the backward when the pass was recorded for it with these options, else
        from the kept gradients.

        Raises:
            ValueError: the method has no such reduction, or the pass kept neither it (with these
                options) nor the gradients.
        """
        if name in self.reduced:
            given, results = self.reduced[name]
            if all(given.get(k) == v for k, v in options.items()):
                return results
        fn = registered(name).layerwise
        if fn is None:
            raise ValueError(f"method {name!r} has no per-layer reduction (layerwise=)")
        if self.gradients is None:
            kept = self.reduced[name][0] if name in self.reduced else None
            raise ValueError(f"the pass reduced {name!r}'s layers with {kept} and kept no gradients; record it with these options "
                             f"({options}) or with keep_gradients=True")
        return [fn(a, g, **options) for a, g in zip(self.attention_layers, self.gradients)]

    @property
    def query(self) -> Query:
        """Whose row the maps are: the classifier's query, 0 (the cls token) or "pool", unless chosen."""
        if self.chosen_query is not None:
            return self.chosen_query
        return POOL if self.pooled_query else 0

    def pool_weights(self, rule: PoolRule = "attention") -> torch.Tensor | None:
        """The "pool" query's weight on each token's row [B, N] for attention pooling (None for the
        plain mean of the patch rows, as "avg" pooling reads them):

        - "attention": the probe's attention, averaged over its heads (what rollout and attention read);
        - "relevance": mean over heads of ReLU(gradient x attention) of the probe: Chefer et al.'s
          rule applied to the probe, which has no residual of its own (the gradient rule's row);
        - "relevance_rows": the same, scaled to sum to 1 (a rollout row, for gradient rollout).
        """
        if self.pool_attention is None:
            return None
        if rule == "attention":
            return self.pool_attention.mean(dim=1)
        if self.pool_gradients is None:
            raise ValueError("the probe's gradients were not recorded: record(..., gradients=True)")
        weights = (self.pool_gradients * self.pool_attention).clamp(min=0).mean(dim=1)
        if rule == "relevance":
            return weights
        if rule == "relevance_rows":
            return weights / weights.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(weights.dtype).tiny)
        raise ValueError(f'rule must be "attention", "relevance" or "relevance_rows", got {rule!r}')

    def query_maps(self, matrix: torch.Tensor, *, rule: PoolRule = "attention") -> torch.Tensor:
        """The query's row of an N x N matrix per sample [B, N, N] over the patch grid: [B, gh, gw]
        (the "pool" row of an attention-pooled model weighted by `pool_weights(rule)`)."""
        weights = self.pool_weights(rule) if self.query == POOL else None
        return cls_map(matrix, grid=self.grid, num_prefix_tokens=self.num_prefix_tokens, token=self.query, pool_weights=weights)


def needs_gradients(methods: Sequence[str]) -> bool:
    """Whether any of `methods` needs the gradients of the target score (ValueError for an unknown one)."""
    return any(registered(m).needs_gradients for m in methods)


def needs_layer_gradients(methods: Sequence[str]) -> bool:
    """Whether any of `methods` needs the per-layer gradients of per-layer scores (LeGrad)."""
    return any(registered(m).needs_layer_gradients for m in methods)


def _token_ids(model: ImageTextModel, text: TextInput) -> tuple[torch.Tensor, torch.Tensor | None, tuple[str | None, ...]]:
    """Phrases -> (token ids [T, C], attention mask [T, C] or None, the phrases; None for ids given)."""
    if isinstance(text, torch.Tensor):
        ids, mask = text, None
    elif isinstance(text, tuple) and len(text) == 2 and isinstance(text[0], torch.Tensor):
        ids, mask = text
    else:
        phrases = [text] if isinstance(text, str) else list(text)
        if not phrases or not all(isinstance(p, str) for p in phrases):
            raise ValueError(f"text= is a phrase, a list of phrases or token ids [T, C]; got {text!r}")
        if model.tokenizer is None:
            raise ValueError(
                "this image–text model has no tokenizer, so phrases cannot be encoded: set model.tokenizer = "
                "transformers.AutoTokenizer.from_pretrained(<its repo id>), or pass token ids: text=input_ids [T, C] or "
                "text=(input_ids, attention_mask)"
            )
        ids, mask = model.tokenize(phrases)
        return ids, mask, tuple(phrases)
    if ids.ndim != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"token ids must be integers of shape [T, C], got {ids.dtype} {list(ids.shape)}")
    return ids, mask, (None,) * ids.shape[0]


Readout = Literal["mean", "cls"]
READOUTS: tuple[str, ...] = ("mean", "cls")
LEGRAD_START_LAYER = -2  # the LeGrad authors' default (`LeWrapper(layer_index=-2)`): the last two layers


def _readout_tokens(vit: ViT, hidden: torch.Tensor, readout: Readout) -> torch.Tensor:
    """A layer's output [B, N, D] as the normed tokens [B, N, D] its score is read from (the head or
    the projection then pools them as they pool the final layer's):

    - "mean": LeGrad's read-out (Bousselham et al. 2024, their code's CLIP path and torchcam's):
      the mean of all tokens, prefix included, through the final norm, in the pooling token's place
      (every token is that vector). A model that pools its own tokens (the mean of the patches, an
      attention probe) reads them through its pool, as its final layer is read.
    - "cls": every token through the final norm, pooled as the final layer's (the cls token).
    """
    if readout == "cls" or vit.config.pool in ("avg", "map"):
        return vit.norm(hidden)
    return vit.norm(hidden.mean(dim=1, keepdim=True)).expand_as(hidden)


def layers_from(start_layer: int, depth: int) -> tuple[int, ...]:
    """The layers from `start_layer` to the last (Python's indexing: -2 is the last two, 0 all of them).

    Raises:
        ValueError: `start_layer` outside -depth..depth-1.
    """
    if not isinstance(start_layer, int) or isinstance(start_layer, bool) or not -depth <= start_layer < depth:
        raise ValueError(f"start_layer must be an integer from {-depth} to {depth - 1} for a model of {depth} layers, got {start_layer!r}")
    return tuple(range(start_layer % depth, depth))


def _image_features(vit: ViT, tokens: torch.Tensor) -> torch.Tensor:
    """The pooled features of normed tokens [B, N, D] -> [B, D], as `ViT.forward_features` pools them."""
    pooled = vit.pool(tokens)
    return (pooled[0] + pooled[1]) / 2 if isinstance(pooled, tuple) else pooled


def _per_target_grads(scores: torch.Tensor, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """For each column t of `scores` [B, T], the gradient of sum_b scores[b, t] with respect to each
    of `inputs`: one [T, *input.shape] per input. One backward for T = 1; for T > 1 one vectorised
    backward (`is_grads_batched`) of the T one-hot columns. The graph is kept for later calls."""
    batch, t = scores.shape
    if t == 1:
        return [g[None] for g in torch.autograd.grad(scores.sum(), list(inputs), retain_graph=True)]
    columns = torch.eye(t, dtype=scores.dtype, device=scores.device)[:, None, :].expand(t, batch, t)  # [T, B, T]
    return list(torch.autograd.grad(scores, list(inputs), grad_outputs=columns, retain_graph=True, is_grads_batched=True))


def _reduce_in_backward(
    final: torch.Tensor, live: list[torch.Tensor], probe: list[torch.Tensor], reducers: Mapping[str, Callable[..., torch.Tensor]],
    options: Mapping[str, object], *, retain: bool,
) -> tuple[dict[str, list[torch.Tensor]], torch.Tensor | None]:
    """One backward of the summed scores `final` [B, 1] down to the first layer's attention, each
    layer's reductions computed by a hook on its attention as its gradient arrives; the gradients
    themselves are autograd's, dropped as it goes on. Returns ({name: [per layer]}, the probe's
    gradient [B, H, 1, N] or None)."""
    per_layer: dict[str, list[torch.Tensor | None]] = {name: [None] * len(live) for name in reducers}

    def reduce(layer: int, attn: torch.Tensor) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            for name, fn in reducers.items():
                per_layer[name][layer] = fn(attn, grad, **options)

        return hook

    handles = [a.register_hook(reduce(layer, a.detach())) for layer, a in enumerate(live)]
    try:
        found = torch.autograd.grad(final.sum(), [live[0], *probe], retain_graph=retain)
    finally:
        for h in handles:
            h.remove()
    missing = [layer for layer, r in enumerate(next(iter(per_layer.values()))) if r is None]
    if missing:
        raise RuntimeError(f"no gradient reached the attention of layers {missing}")
    return per_layer, (found[1] if probe else None)  # type: ignore[return-value]


def _pairs(per_target: torch.Tensor) -> torch.Tensor:
    """[T, B, ...] -> [B*T, ...], image-major (row b·T + t)."""
    return per_target.transpose(0, 1).reshape(-1, *per_target.shape[2:])


def record(
    model: ViT | ImageTextModel,
    x: torch.Tensor,
    *,
    targets: Sequence[int | str | None] | torch.Tensor | None = None,
    text: TextInput | None = None,
    gradients: bool = False,
    layer_gradients: bool = False,
    layerwise: Sequence[str] = (),
    layerwise_options: Mapping[str, object] | None = None,
    keep_gradients: bool = True,
    readout: Readout = "mean",
    start_layer: int = LEGRAD_START_LAYER,
) -> Recorded:
    """A batch's attention and, for gradient methods, the gradients of each sample's target score.

    Args:
        model: a vitviz ViT, or an image–text model (its image tower is recorded).
        x: preprocessed images [B, 3, S, S].
        targets: classifiers: per sample a class index, a class name or None (top-1).
        text: image–text models: the phrases (`TextInput`), each scored against every image.
        gradients: record d(target score) / d(each layer's attention), for every sample and phrase
            (one backward of the summed per-sample scores; phrases: one vectorised backward).
        layer_gradients: record, for each layer l from `start_layer` on, d(s_l) / d(layer l's
            attention), s_l the score read from layer l's output by `readout` (LeGrad): one more
            backward call a layer, each through one block and the read-out only.
        layerwise: with `gradients`, registered methods whose per-layer reduction
            (`Method.layerwise`, called with `layerwise_options`) is computed inside the backward,
            each layer's as its gradient arrives (`Recorded.reduced`).
        keep_gradients: keep the gradient stack (`Recorded.gradients`); False with `layerwise`: no
            gradient outlives the backward, the backward stops at the first layer's attention and
            keeps no graph beyond what `layer_gradients` needs (one phrase or a class; several
            phrases keep their vectorised backward and reduce after it).
        readout: with `layer_gradients`, how a layer's score reads its tokens (`_readout_tokens`):
            "mean" (LeGrad's own) or "cls".
        start_layer: with `layer_gradients`, the first layer differentiated (`layers_from`; the
            default, -2, the last two as LeGrad's authors do; 0 every layer).

    Raises:
        ValueError: a class for an image–text model, phrases for a classifier, a gradient without
            anything to differentiate (no classifier and no phrase).
    """
    spec = spec_of(model)
    image_text = isinstance(model, ImageTextModel)
    vit = model.image if image_text else model
    differentiate = gradients or layer_gradients
    if readout not in READOUTS:
        raise ValueError(f"readout must be one of {', '.join(READOUTS)}, got {readout!r}")
    chosen_layers = layers_from(start_layer, vit.config.depth) if layer_gradients else ()
    wanted_classes = targets is not None and any(t is not None for t in targets)
    if image_text:
        if wanted_classes:
            raise ValueError(f"{spec.name} is an image–text model: it has no classes; explain a phrase with text=... instead of target=")
        if differentiate and text is None:
            raise ValueError(f"{spec.name} is an image–text model: gradient methods explain a phrase; pass text='a photo of a cat' "
                             "(or a list of phrases), or use 'attention' or 'rollout'")
    else:
        if text is not None:
            raise ValueError(f"{spec.name} has no text tower: text= needs an image–text model (CLIP, "
                             "vitviz.load_model('hf:openai/clip-vit-base-patch32')); explain a class with target=")
        if differentiate and not spec.has_head:
            raise ValueError(f"{spec.name} has no classifier: gradient methods need a class logit; use 'attention' or 'rollout'")
        if not spec.has_head and wanted_classes:
            raise ValueError(f"{spec.name} has no classifier: there is no class to explain")
    param = next(model.parameters())
    texts = similarities = probs = chosen = grads = layer_grads = pool_grads = None
    reduced: dict[str, tuple[dict, list[torch.Tensor]]] = {}
    after: dict[str, Callable[..., torch.Tensor]] = {}  # reductions taken from the kept gradients once the pass is done
    with contextlib.ExitStack() as modes:
        if differentiate:  # autograd on, also when the caller is in inference mode
            modes.enter_context(torch.inference_mode(False))
            modes.enter_context(torch.enable_grad())
            # a fresh leaf that requires grad: every attention map is then on the graph, even for frozen weights
            x = x.to(device=param.device, dtype=param.dtype).clone().requires_grad_(True)
        else:
            modes.enter_context(torch.inference_mode())
            x = x.to(device=param.device, dtype=param.dtype)
        score: Callable[[torch.Tensor], torch.Tensor] | None = None  # normed tokens [B, N, D] -> scores [B, T]
        if text is not None:
            ids, mask, texts = _token_ids(model, text)
            with torch.no_grad():  # the text tower once; nothing is differentiated through it
                text_embeds = model.encode_text(ids.to(param.device), None if mask is None else mask.to(param.device))

            def score(tokens: torch.Tensor) -> torch.Tensor:
                return model.logits(model.image_projection(_image_features(vit, tokens)), text_embeds)

        with record_attention(vit, graph=differentiate) as rec:
            layers: list[torch.Tensor] | None = [] if layer_gradients else None
            tokens = vit.encode(x, layers=layers)
            if score is not None:
                final = score(tokens)  # [B, T]
                similarities = final.detach().float()
            elif spec.has_head:
                logits = vit.head_logits(tokens)
                probs = logits.detach().float().softmax(-1)
                wanted = [None] * x.shape[0] if targets is None else list(targets)
                if len(wanted) != x.shape[0]:
                    raise ValueError(f"{len(wanted)} targets for {x.shape[0]} images")
                chosen = torch.tensor([resolve_target(t, spec.categories, probs[i]) for i, t in enumerate(wanted)], device=logits.device)

                def score(tokens: torch.Tensor) -> torch.Tensor:
                    return vit.head_logits(tokens).gather(1, chosen[:, None])  # [B, 1]

                final = logits.gather(1, chosen[:, None])
            elif vit.attn_pool is not None:
                vit.pool(tokens)  # nothing to score: the pooling runs for its probe's attention
            if differentiate:
                live = rec.graph_attentions  # layer l's softmax output, on the graph
            if gradients:
                probe = [rec.graph_pool_attention] if rec.pooled else []  # [B, H, 1, N]: the probe's, when it pools so
                reducers = {name: registered(name).layerwise for name in layerwise}
                if any(fn is None for fn in reducers.values()):
                    raise ValueError(f"methods without a per-layer reduction: {[n for n, fn in reducers.items() if fn is None]}")
                options = dict(layerwise_options or {})
                if reducers and not keep_gradients and final.shape[1] == 1:
                    per_layer, pool_grad = _reduce_in_backward(final, live, probe, reducers, options, retain=layer_gradients)
                    reduced = {name: (options, [r.float() for r in results]) for name, results in per_layer.items()}
                    pool_grads = None if pool_grad is None else pool_grad[:, :, 0].float()
                else:  # the gradients kept (and reduced below, from the stack, paired with the attention)
                    per_input = [_pairs(g) for g in _per_target_grads(final, live + probe)]
                    grads = torch.stack(per_input[: len(live)]).float()
                    pool_grads = per_input[-1][:, :, 0].float() if probe else None
                    after = reducers
            if layer_gradients:
                # each layer on its own: d(s_l)/d(A_k) is not 0 for k < l, so one backward of the sum would mix layers
                layer_grads = torch.stack([_pairs(_per_target_grads(score(_readout_tokens(vit, layers[l], readout)), [live[l]])[0])
                                           for l in chosen_layers]).float()
        attn = tuple(a.float() for a in rec.layers)
        pool_attn = None if rec.pool_attention is None else rec.pool_attention.float()
    if texts is not None and len(texts) > 1:
        attn = tuple(a.repeat_interleave(len(texts), dim=0) for a in attn)  # [B*T, H, N, N]: each image's attention per phrase
        pool_attn = None if pool_attn is None else pool_attn.repeat_interleave(len(texts), dim=0)
    if after:
        reduced = {name: (options, [fn(a, g, **options).float() for a, g in zip(attn, grads)]) for name, fn in after.items()}
    grads = grads if keep_gradients else None
    grid = vit.grid_for(x.shape[-2], x.shape[-1])
    return Recorded(
        attention_layers=attn, gradients=grads, reduced=reduced, targets=chosen, probabilities=probs, grid=grid, num_prefix_tokens=spec.num_prefix_tokens,
        pooled_query=spec.config.pooled_query, layout=layout_of(spec, grid, text=image_text), texts=texts, similarities=similarities,
        layer_gradients=layer_grads, layer_gradient_layers=chosen_layers, layer_readout=readout if layer_gradients else None,
        pool_attention=pool_attn, pool_gradients=pool_grads,
    )


def record_for(
    model: ViT | ImageTextModel,
    x: torch.Tensor,
    methods: Sequence[str],
    *,
    targets: Sequence[int | str | None] | torch.Tensor | None = None,
    text: TextInput | None = None,
    head_fusion: HeadFusion = "mean",
    discard_ratio: float = 0.0,
    readout: Readout = "mean",
    start_layer: int = LEGRAD_START_LAYER,
    in_backward: Callable[[str], bool] | None = None,
) -> Recorded:
    """The pass `methods` need and nothing more (`record`): the gradients only when one needs them;
    each gradient method with a per-layer reduction has it computed inside the backward with the
    options `maps_of` will read it with (`head_fusion`, `discard_ratio`, the same defaults), and the
    gradient stack is kept only for a method without one; `readout` and `start_layer` for the
    per-layer gradients (LeGrad). `in_backward(name)` false: that method's reduction is left out of
    the backward and taken from the kept gradients when its map is read (a server runs a plugin's
    own code where its failure and its time are its map's alone)."""
    options = {"head_fusion": head_fusion, "discard_ratio": discard_ratio}
    chosen = [registered(m) for m in methods]
    gradient_methods = [m for m in chosen if m.needs_gradients]
    inside = [m.name for m in gradient_methods if m.layerwise is not None and (in_backward is None or in_backward(m.name))]
    return record(
        model, x, targets=targets, text=text, gradients=bool(gradient_methods), layer_gradients=any(m.needs_layer_gradients for m in chosen),
        layerwise=inside, layerwise_options=options,
        keep_gradients=any(m.name not in inside for m in gradient_methods), readout=readout, start_layer=start_layer,
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
