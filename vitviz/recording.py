"""One forward (and, when a method needs it, one backward) of a batch, keeping what the
explanation methods read: `record` runs the model under the attention hooks and returns a `Recorded`
(the attention stack, the target scores' gradients reduced in the backward, the readout), which
`vitviz.explanations.maps_of` turns into maps without the model. `record_for` keeps what a given set
of methods needs and no more; `resolve_target` reads a class from an index, a name or None.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, Sequence, Union

import torch

from vitviz.analysis import POOL, HeadFusion, Query, cls_map
from vitviz.explainers import method as registered
from vitviz.hooks import record_attention
from vitviz.imagetext import ImageTextModel
from vitviz.layout import TokenLayout
from vitviz.model import ViT
from vitviz.pipeline import layout_of, spec_of

__all__ = ["LEGRAD_START_LAYER", "PoolRule", "Readout", "Recorded", "TextInput", "layers_from", "needs_gradients", "needs_layer_gradients", "record",
           "record_for", "resolve_target"]

# phrases: one string, several, token ids [T, C], or token ids and their attention mask (`ImageTextModel.tokenize`)
PoolRule = Literal["attention", "relevance", "relevance_rows"]  # how an attention-pooled model's "pool" row is weighted
TextInput = Union[str, Sequence[str], torch.Tensor, tuple[torch.Tensor, Union[torch.Tensor, None]]]


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
