"""One call from an image to what a ViT did with it: `analyze`.

image -> `load_image` (checks, RGB) -> `preprocess` (the weights' own resize, centre crop, normalise)
-> model under `record_attention` -> an `Analysis`: the raw results (class probabilities, the
attention stack, the final tokens), on the CPU. An image–text model (`vitviz.imagetext.ImageTextModel`)
is analysed through its image tower. Everything derived — rollout, the cls map, mean
attention distance, predictions — is a method of the record, computed from explicit options when
asked for.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from PIL import Image

from vitviz.analysis import POOL, HeadFusion, Query, attention_rollout, cls_map, mean_attention_distance
from vitviz.architectures import architecture_of
from vitviz.hooks import record_attention
from vitviz.images import ImageSource, load_image
from vitviz.imagetext import ImageTextModel
from vitviz.layout import TokenLayout
from vitviz.model import ViT
from vitviz.preprocess import preprocess, to_input
from vitviz.sources.base import VariantSpec

if TYPE_CHECKING:  # vitviz.inside is imported on first use, so that `python -m vitviz.inside` runs a module not yet imported
    from vitviz.inside import Attribution, Stream, Target
    from vitviz.concepts.browse import ConceptMap, Concepts

__all__ = ["Analysis", "analyze", "analyze_crop", "image_tower", "layout_of", "spec_of"]


def image_tower(model: ViT | ImageTextModel) -> ViT:
    """The ViT that sees the image: the model itself, or an image–text model's image tower."""
    return model.image if isinstance(model, ImageTextModel) else model


def spec_of(model: ViT | ImageTextModel) -> VariantSpec:
    if getattr(model, "spec", None) is None:
        raise ValueError(
            "this model has no VariantSpec; load it with vitviz.load_model or convert it with ViT.from_torchvision, "
            "ViT.from_timm or ViT.from_transformers"
        )
    return model.spec


def layout_of(spec: VariantSpec, grid: tuple[int, int], *, text: bool = False, labelled: bool = False, stream: bool = False) -> TokenLayout:
    """The token layout of a vitviz ViT fed an image of `grid` patches: global attention, learned
    position embeddings unless its positions are rotary or relative alone, its relative position bias
    (BEiT's) and rotary kind, its prefix tokens, a
    classifier when it has a head, a text tower when it is the image tower of an image–text model
    (`text`) that scored a label set (`labelled`), patch filters over pixels unless a
    convolutional stem comes first (a hybrid), and whether the analysis recorded the residual stream
    its classifier reads (`stream`)."""
    c = spec.config
    return TokenLayout(prefix_names=tuple(spec.prefix_names), grids=(tuple(grid),), attention="global",
                       pooled_query=c.pooled_query, classifier=spec.has_head, position_embeddings=c.abs_pos_embed,
                       position_bias=c.rel_pos_bias, rotary=c.rope, text=text, labelled=labelled, patch_filters=c.stem is None,
                       language=spec.vlm is not None, stream=stream)


@dataclass
class Analysis:
    """What one model did with one image, on the CPU.

    Attributes:
        variant: the model's variant name.
        image: the S x S crop the model saw (overlays are drawn on it).
        probabilities: softmax over the classes [C]; for an image–text model its zero-shot scores over
            a label set (`ImageTextModel.zero_shot`); None for a model without a head or labels.
        categories: class names (an image–text model's labels), or None with no probabilities.
        attentions: attention stack [L, H, N, N].
        tokens: every token after the last block and the final norm [N, D].
        token_norms: the L2 norm of every token after each block, before the final norm [L, N]
            (where high-norm "artefact" tokens appear; Darcet et al. 2024).
        grid, patch_size: the patch layout of this image.
        prefix_names: the tokens before the patches, in order ("cls", "dist", "reg1", ...).
        device: where the model ran.
        model_seconds: time of the recorded forward.
        pooled_query: the model classifies from the mean of its patch tokens and has no cls token:
            its query is "pool", the mean of the patch tokens' rows (`query_names`).
        layout: the tokens and what the model offers (`vitviz.layout.TokenLayout`): what views and
            methods check their needs against; made from the fields above when not given.
        pool_attention: a model that pools with attention (SigLIP): its probe's attention over the
            tokens [H, N], which weighs the token rows that make the "pool" query's (`pool_weights`);
            None otherwise.
        inside: what the classifier's query gathered in each block (`vitviz.inside.Stream`: the
            logit lens and direct logit attribution); None for a model without a head or labels.
        layer_tokens: the residual stream after the blocks `analyze` was asked to keep
            (`keep_layers`, or a sparse autoencoder's layer: `concepts`), {block: [N, D]}, before the
            final norm; what `concepts` reads.

    Query indices (the explorer's) are the token indices, except that a pooled model's "pool" sits
    between the prefix tokens and the patches: index i < p is prefix token i, index p is "pool",
    patch (r, c) is `patch_query(r, c)` = p + 1 + r * gw + c; `query_token` turns an index into
    the token (or "pool") it stands for.
    """

    variant: str
    image: Image.Image = field(repr=False)
    probabilities: torch.Tensor | None = field(repr=False)
    categories: tuple[str, ...] | None = field(repr=False)
    attentions: torch.Tensor = field(repr=False)
    tokens: torch.Tensor = field(repr=False)
    token_norms: torch.Tensor = field(repr=False)
    grid: tuple[int, int]
    patch_size: int
    prefix_names: tuple[str, ...]
    device: str
    model_seconds: float
    pooled_query: bool = False
    layout: TokenLayout | None = None
    pool_attention: torch.Tensor | None = field(default=None, repr=False)
    inside: Stream | None = field(default=None, repr=False)
    layer_tokens: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.layout is None:
            self.layout = TokenLayout(prefix_names=tuple(self.prefix_names), grids=(tuple(self.grid),),
                                      pooled_query=self.pooled_query, classifier=self.probabilities is not None, stream=self.inside is not None)

    @property
    def num_prefix_tokens(self) -> int:
        return len(self.prefix_names)

    @property
    def pool_weights(self) -> torch.Tensor | None:
        """The "pool" query's weight on each token's row [N]: the probe's attention averaged over its
        heads for attention pooling; None for the plain mean of the patch rows (or no pooled query)."""
        return None if self.pool_attention is None else self.pool_attention.mean(dim=0)

    @property
    def query_names(self) -> tuple[str, ...]:
        """The named queries: the prefix tokens, then "pool" for a pooled model."""
        return self.prefix_names + ((POOL,) if self.pooled_query else ())

    @property
    def default_query(self) -> Query:
        """The classifier's query: 0 (the first prefix token, the cls token) or "pool"."""
        return POOL if self.pooled_query else 0

    @property
    def num_queries(self) -> int:
        """The named queries and the patches."""
        return len(self.query_names) + self.grid[0] * self.grid[1]

    def query_token(self, index: int) -> Query:
        """The token (or "pool") query `index` stands for: [0, num_queries) -> token index or "pool"."""
        if not 0 <= index < self.num_queries:
            raise ValueError(f"query {index} is outside 0..{self.num_queries - 1}")
        p = self.num_prefix_tokens
        if not self.pooled_query or index < p:
            return index
        return POOL if index == p else index - 1

    def patch_query(self, row: int, col: int) -> int:
        """The query index of patch (row, col)."""
        return len(self.query_names) + row * self.grid[1] + col

    @property
    def nbytes(self) -> int:
        """Bytes held by the tensors and the crop (what keeping this analysis costs)."""
        tensors = [t for t in (self.probabilities, self.attentions, self.tokens, self.token_norms, self.pool_attention,
                               *self.layer_tokens.values()) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors) + 3 * self.image.size[0] * self.image.size[1]

    def predictions(self, k: int = 5) -> list[tuple[str, float]]:
        """The top-k (label, probability), most likely first (zero-shot for an image–text model);
        empty for a model without a head or labels."""
        if self.probabilities is None or self.categories is None:
            return []
        top = self.probabilities.topk(min(k, self.probabilities.numel()))
        return [(self.categories[i], float(v)) for v, i in zip(top.values.tolist(), top.indices.tolist())]

    def rollout(self, *, head_fusion: HeadFusion = "mean", discard_ratio: float = 0.0) -> torch.Tensor:
        """Attention rollout R [N, N] (rows sum to 1)."""
        return attention_rollout(self.attentions, head_fusion=head_fusion, discard_ratio=discard_ratio, num_prefix_tokens=self.num_prefix_tokens)

    def cls_map(self, *, token: Query | None = None, head_fusion: HeadFusion = "mean", discard_ratio: float = 0.0) -> torch.Tensor:
        """A query's rollout over the patches [gh, gw]: the classifier's by default (`default_query`:
        the cls token, or "pool" for a pooled model); token 1 is DeiT's distillation token."""
        r = self.rollout(head_fusion=head_fusion, discard_ratio=discard_ratio)
        token = self.default_query if token is None else token
        return cls_map(r, grid=self.grid, num_prefix_tokens=self.num_prefix_tokens, token=token, pool_weights=self.pool_weights)

    def distances(self, *, renormalize: bool = True) -> torch.Tensor:
        """Mean attention distance in pixels per layer and head [L, H]."""
        return mean_attention_distance(
            self.attentions, patch_size=self.patch_size, num_prefix_tokens=self.num_prefix_tokens, grid=self.grid, renormalize=renormalize
        )

    def outliers(self, *, factor: float = 2.0):
        """The high-norm patch tokens after each block (Darcet et al. 2024): those whose norm exceeds
        `factor` x the layer's median patch norm, and the attention the classifier's query and the
        other patches give them (`vitviz.registers.outliers`)."""
        from vitviz.registers import outliers

        return outliers(self.token_norms, self.attentions, grid=self.grid, num_prefix_tokens=self.num_prefix_tokens, factor=factor,
                        pooled_query=self.pooled_query)

    def logit_lens(self, *, logits: bool = False) -> torch.Tensor:
        """What the model would predict from its stream after each block [L+1, C] (row 0: the
        embedding, row L: `probabilities`): probabilities, or logits (`vitviz.inside.lens_of`)."""
        from vitviz.inside import lens_of

        return lens_of(self.inside, logits=logits)

    def logit_attribution(self, target: Target = None) -> Attribution:
        """The target logit (index or class name; default the prediction) split into the embedding,
        each head, each MLP and the biases (`vitviz.inside.attribution_of`)."""
        from vitviz.inside import attribution_of

        return attribution_of(self.inside, target)

    def concepts(self, sae: Concepts | torch.nn.Module, *, layer: int | None = None) -> ConceptMap:
        """A sparse autoencoder's features on every token of this image (`vitviz.concepts.ConceptMap`:
        z [N, F], the top features of a patch, a feature's map), from the stream kept at its layer:
        `Concepts` know theirs; a bare `TopKSAE` is read at `layer` (by default the one layer kept).

        Raises:
            ValueError: that layer's stream was not kept (analyze with concepts=... or keep_layers=[L]).
        """
        from vitviz.concepts.browse import ConceptMap, sae_site

        if layer is None and not hasattr(sae, "card") and len(self.layer_tokens) == 1:
            layer = next(iter(self.layer_tokens))
        sae, layer, _ = sae_site(sae, layer)
        if layer not in self.layer_tokens:
            kept = ", ".join(map(str, sorted(self.layer_tokens))) or "none"
            raise ValueError(f"this analysis kept no stream after block {layer} (kept: {kept}): analyze with concepts=... or "
                             f"keep_layers=[{layer}]")
        x = self.layer_tokens[layer]
        if x.shape[-1] != sae.W_dec.shape[0]:
            raise ValueError(f"this sparse autoencoder reads a stream {sae.W_dec.shape[0]} wide; {self.variant}'s is {x.shape[-1]} wide")
        return ConceptMap.of(x, sae, layer=layer, grid=self.grid, num_prefix_tokens=self.num_prefix_tokens)


def analyze(
    model: ViT | ImageTextModel, image: ImageSource, *, labels: Sequence[str] | None = None, template: str | None = None,
    on_layer: Callable[[int, torch.Tensor], None] | None = None, keep_layers: Sequence[int] = (), concepts: Concepts | None = None,
) -> Analysis:
    """Runs `model` once on `image`, recording attention.

    Args:
        model: a vitviz ViT with a spec (from `load_model` or a `ViT.from_*` conversion), or an
            image–text model: its image tower is analysed, and its predictions are zero-shot
            classification over a label set (the layout says it has a text tower, not a classifier).
        image: anything `vitviz.load_image` accepts (PIL image, path, bytes, file, uint8 array).
        labels: an image–text model's zero-shot label set; by default its own (`model.labels`: the
            shapes classes for `shapes_clip`, ImageNet's classes for a model from the hub; None: no
            predictions). Each label is scored through `template`.
        template: the prompt with "{}" where the label goes (default `model.template`, "a photo of a {}").
        on_layer: called with (layer, its attention [H, N, N] on the CPU) as soon as each block has
            computed it, before the next block runs (a Swin's windowed attention is not passed).
        keep_layers: blocks whose output (the residual stream after them, before the final norm) the
            analysis keeps, float32 [N, D] each (`Analysis.layer_tokens`).
        concepts: a sparse autoencoder's `Concepts` (`vitviz.concepts.load_concepts`): its layer is
            kept, for `Analysis.concepts`; checked against the model first.
    """
    own = architecture_of(model)  # a model analysed its own way (a Swin: `vitviz.swin_analysis.SwinAnalysis`)
    if own is not None:
        _no_layers_kept(keep_layers, concepts)
        return own.analyze(model, image)
    spec = spec_of(model)
    x, cropped = preprocess(load_image(image), spec.preprocessing)
    return _analyze_input(model, x, cropped, labels=labels, template=template, on_layer=on_layer,
                          keep_layers=_layers_to_keep(model, keep_layers, concepts))


def analyze_crop(
    model: ViT | ImageTextModel, cropped: Image.Image, *, labels: Sequence[str] | None = None, template: str | None = None,
    on_layer: Callable[[int, torch.Tensor], None] | None = None, keep_layers: Sequence[int] = (), concepts: Concepts | None = None,
) -> Analysis:
    """`analyze` for an image already cropped to the model's input (`Analysis.image`): no resizing,
    so analysing `analysis.image` again gives the same numbers."""
    own = architecture_of(model)
    if own is not None:
        _no_layers_kept(keep_layers, concepts)
        return own.analyze_crop(model, cropped)
    return _analyze_input(model, to_input(cropped, spec_of(model).preprocessing), cropped, labels=labels, template=template,
                          on_layer=on_layer, keep_layers=_layers_to_keep(model, keep_layers, concepts))


def _no_layers_kept(keep_layers: Sequence[int], concepts: object) -> None:
    if tuple(keep_layers) or concepts is not None:
        raise ValueError("keep_layers and concepts read a ViT's residual stream after a block; this model's stages merge its "
                         "tokens (a windowed model)")


def _layers_to_keep(model: ViT | ImageTextModel, keep_layers: Sequence[int], concepts: Concepts | None) -> tuple[int, ...]:
    """The blocks whose output an analysis keeps, checked against the model: `keep_layers` and the concepts' layer."""
    tower = image_tower(model)
    depth = len(tower.blocks)
    if isinstance(keep_layers, (str, bytes)) or not isinstance(keep_layers, Sequence):
        raise TypeError(f"keep_layers is a list of block indices, got {type(keep_layers).__name__}")
    keep = []
    for layer in keep_layers:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < depth:
            raise ValueError(f"keep_layers are blocks 0..{depth - 1} of this model, got {layer!r}")
        keep.append(layer)
    if concepts is not None:
        if not hasattr(concepts, "card"):
            raise TypeError("concepts= takes the Concepts that vitviz.concepts.load_concepts reads (a bare TopKSAE does not know "
                            "its layer: pass keep_layers=[L], then analysis.concepts(sae, layer=L))")
        concepts.check(model)
        keep.append(concepts.layer)
    return tuple(sorted(set(keep)))


def _zero_shot_labels(model: ViT | ImageTextModel, labels: Sequence[str] | None, template: str | None) -> tuple[str, ...] | None:
    """The label set an analysis scores, or None: a ViT's own classes are its head's."""
    if not isinstance(model, ImageTextModel):
        if labels is not None or template is not None:
            raise ValueError("labels and template are for image–text models (zero-shot classification); "
                             "this model classifies with its own head")
        return None
    if isinstance(labels, str):
        raise TypeError(f"labels must be a list of strings, not one string ({labels[:40]!r})")
    labels = model.labels if labels is None else labels
    return None if labels is None else tuple(labels)


def _analyze_input(
    model: ViT | ImageTextModel, x: torch.Tensor, cropped: Image.Image, *, labels: Sequence[str] | None = None, template: str | None = None,
    on_layer: Callable[[int, torch.Tensor], None] | None = None, keep_layers: Sequence[int] = (),
) -> Analysis:
    spec = spec_of(model)
    labels = _zero_shot_labels(model, labels, template)
    text = isinstance(model, ImageTextModel)
    if labels is not None:
        model.label_embeddings(labels, template)  # checked (and encoded once) before the image is
    pair, model = model, image_tower(model)
    param = next(model.parameters())
    x = x.unsqueeze(0).to(device=param.device, dtype=param.dtype)
    gh, gw = model.grid_for(x.shape[2], x.shape[3])
    depth, heads, n = model.config.depth, model.config.heads, model.config.tokens_of(gh * gw)
    # each layer's attention goes straight into its slot of one stack on the CPU, as the layer runs:
    # the analysis never holds a second copy of the stack (the peak is one stack plus one layer)
    attn = torch.empty(depth, heads, n, n, dtype=torch.float32)
    slot = iter(range(depth))

    def keep(a: torch.Tensor) -> torch.Tensor:
        layer = next(slot)
        attn[layer].copy_(a[0])
        if on_layer is not None:
            on_layer(layer, attn[layer])
        return attn[layer]

    from vitviz.inside import record_stream

    with torch.inference_mode():
        start = time.perf_counter()
        layers: list[torch.Tensor] = []
        with record_attention(model, reduce=keep) as rec, record_stream(pair, labels=labels, template=template) as stream:
            tokens = model.encode(x, layers=layers)
            logits = model.head_logits(tokens) if spec.has_head else None
            # the pooling runs for the zero-shot embedding, and for the probe's attention of a model without a head
            pooled = model.pool(tokens) if labels is not None or (model.attn_pool is not None and logits is None) else None
            embeds = pair.image_projection(pooled) if labels is not None else None
        pool_attention = None if model.attn_pool is None else rec.pool_attention[0].float().cpu()
        norms = torch.stack([h[0].float().norm(dim=-1) for h in layers])  # [L, N]
        kept = {layer: layers[layer][0].float().cpu() for layer in keep_layers}
        del layers
        if param.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        probs = logits[0].float().softmax(-1).cpu() if logits is not None else None
        if labels is not None:
            probs = pair.zero_shot(embeds, labels, template)[0].cpu()
        tokens, norms = tokens[0].float().cpu(), norms.cpu()
    return Analysis(
        variant=spec.name,
        image=cropped,
        probabilities=probs,
        categories=labels if labels is not None else spec.categories,
        attentions=attn,
        tokens=tokens,
        token_norms=norms,
        grid=(gh, gw),
        patch_size=spec.patch_size,
        prefix_names=spec.prefix_names,
        device=str(param.device),
        model_seconds=seconds,
        pooled_query=spec.config.pooled_query,
        layout=layout_of(spec, (gh, gw), text=text, labelled=labels is not None, stream=stream.stream is not None),
        pool_attention=pool_attention,
        inside=stream.stream,
        layer_tokens=kept,
    )
