"""What a model's tokens are and what it offers, so that every view and method can say what it needs.

A `TokenLayout` travels with every analysis (`Analysis.layout`, `Recorded.layout`): the prefix
tokens' names, the patch grid of each stage, whether attention spans the whole image or windows,
and whether the model has a classifier, learned position embeddings and a text tower. A method,
view or tab declares its needs as names from `NEEDS`; `layout.lacks(needs)` is None when the model
has them all, else the one-line reason shown in its place.

    layout.lacks({"cls", "global_attention"})   # None, or e.g. "has no cls token (...)"
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["NEEDS", "Architecture", "TokenLayout", "check_needs", "register_architecture", "registered_architecture"]

# each need, and what a model that lacks it is told
NEEDS: dict[str, str] = {
    "cls": "has no cls token (it classifies from the mean of its patch tokens)",
    "classifier": "has no classifier (a self-supervised or feature model): there are no classes to explain",
    "position_embeddings": "has no learned position embeddings",
    # learned positions of either kind: embeddings added to the patches, or a bias added to attention
    "positions": "has no learned positions (neither position embeddings nor a relative position bias)",
    "text": "has no text tower: there is no phrase to look for",
    "global_attention": "attends within local windows, not across the whole image: there is no one token-by-token matrix per layer",
    # a class or a phrase: what a method that differentiates any one score per image needs
    "target": "has no classifier and no text tower: there is no class or phrase to explain",
    # classes scored: a classifier's, or the labels an image-text model scored zero-shot
    "classes": "scores no classes: it has no classifier, and no labels were scored (an image–text model without its tokenizer)",
    # the filters of a patch embedding that reads pixels (the paper's Figure 7, left)
    # a vision–language model's tower: a language model reads it, and answers questions about the image
    "language": "is not a vision–language model: it has no language model to ask a question",
    # the residual stream its classifier reads, recorded with the analysis (`Analysis.inside`): the logit lens, direct logit attribution
    "stream": "records no residual stream for its classifier to read: there is no logit lens or attribution for it",
    "patch_filters": ("has a convolutional stem before its patches (a hybrid): its patch embedding reads the stem's feature "
                      "map, not pixels, so it has no filters to show as images"),
}


def check_needs(needs: Iterable[str]) -> frozenset[str]:
    """`needs` as a set, every name one of `NEEDS` (a misspelt need would silently never hide anything)."""
    needs = frozenset([needs] if isinstance(needs, str) else needs)
    unknown = sorted(needs - NEEDS.keys())
    if unknown:
        raise ValueError(f"unknown needs {unknown}; known: {', '.join(NEEDS)}")
    return needs


@dataclass(frozen=True)
class TokenLayout:
    """The tokens of one analysed image and what the model offers.

    Attributes:
        prefix_names: the tokens before the patches, in order ("cls", "dist", "reg1", ...).
        grids: the patch grid (gh, gw) of each stage, first to last; a plain ViT has one.
        attention: "global" (every token attends to every token: one N x N matrix per layer and head),
            "windowed" (attention within local windows, as in Swin), or the name of another kind
            that a registered `Architecture` gives its analyses (and the app draws with the drawer
            registered for it, `vitviz.server.pictures.drawers`). Every kind but "global" lacks
            "global_attention".
        pooled_query: the classifier reads the mean of the patch tokens and there is no cls token.
        classifier: the model has a classification head.
        position_embeddings: the model learned position embeddings for its patches.
        position_bias: the model learned a relative position bias that its attention adds (Swin's
            within windows, BEiT's over the grid).
        rotary: the kind of rotary position embedding that turns its queries and keys
            (`ViTConfig.rope`: "axial", "dinov3", "mixed"), or None.
        text: the model has a text tower (image-text relevance).
        labelled: an image–text model's analysis scored a label set zero-shot (its classes).
        patch_filters: the model's patch embedding is linear filters over the pixels of a patch (not
            over a convolutional stem's feature map, as a hybrid's is).
        language: the model is the vision tower of a vision–language model (`VariantSpec.vlm`).
        stream: the analysis recorded the residual stream its classifier reads (`inside`, a
            `vitviz.inside.Stream`: the logit lens and direct logit attribution).
    """

    prefix_names: tuple[str, ...]
    grids: tuple[tuple[int, int], ...]
    attention: str = "global"
    pooled_query: bool = False
    classifier: bool = True
    position_embeddings: bool = True
    position_bias: bool = False
    rotary: str | None = None
    text: bool = False
    labelled: bool = False
    patch_filters: bool = True
    language: bool = False
    stream: bool = False

    def __post_init__(self) -> None:
        if not self.grids or any(len(g) != 2 or min(g) < 1 for g in self.grids):
            raise ValueError(f"grids must be one or more (gh, gw) of positive sides, got {self.grids!r}")
        if not isinstance(self.attention, str) or not self.attention.isidentifier():
            raise ValueError(f'attention must be a name ("global", "windowed", or a registered architecture\'s), got {self.attention!r}')

    @property
    def grid(self) -> tuple[int, int]:
        """The last stage's patch grid (a plain ViT's only one)."""
        return self.grids[-1]

    @property
    def num_prefix_tokens(self) -> int:
        return len(self.prefix_names)

    @property
    def num_tokens(self) -> int:
        """Tokens of the last stage: the prefix tokens and the patches."""
        return self.num_prefix_tokens + self.grid[0] * self.grid[1]

    @property
    def query_names(self) -> tuple[str, ...]:
        """The queries besides the patches: the prefix tokens, then "pool" for a pooled model."""
        return self.prefix_names + (("pool",) if self.pooled_query else ())

    @property
    def provides(self) -> frozenset[str]:
        """The needs (names from `NEEDS`) this model meets."""
        have = {
            "cls": "cls" in self.prefix_names,
            "classifier": self.classifier,
            "position_embeddings": self.position_embeddings,
            "positions": self.position_embeddings or self.position_bias or self.rotary is not None,
            "global_attention": self.attention == "global",
            "text": self.text,
            "target": self.classifier or self.text,
            "classes": self.classifier or (self.text and self.labelled),
            "patch_filters": self.patch_filters,
            "language": self.language,
            "stream": self.stream,
        }
        return frozenset(name for name, ok in have.items() if ok)

    def lacks(self, needs: Iterable[str], *, name: str = "this model") -> str | None:
        """None when the model meets every one of `needs`; else one line naming the first it lacks
        (in `NEEDS`' order), e.g. "shapes_p16 has no text tower: there is no phrase to look for"."""
        missing = check_needs(needs) - self.provides
        for need, reason in NEEDS.items():
            if need in missing:
                return f"{name} {reason}"
        return None


@dataclass(frozen=True)
class Architecture:
    """How one class of models whose attention is not global is analysed, explained and described
    (registered with `register_architecture`; looked up by `vitviz.architectures.architecture_of`).

    Attributes:
        attention: the `TokenLayout.attention` of its analyses ("windowed" for a Swin).
        analyze: (model, image) -> its analysis of one image (an image as `vitviz.load_image` takes it).
        analyze_crop: (model, cropped PIL image) -> the same for an image already cropped to its input.
        relevance_maps: as `vitviz.relevance_maps` (model, x, *, methods, targets, text, head_fusion,
            discard_ratio) -> (maps, targets, probabilities).
        methods: the explanation methods `relevance_maps` computes, in the order offered.
        summary_rows: (model) -> its table stage by stage [[part, detail, output shape, parameters]].
        patch_filters: (model) -> its patch embedding's filters [D, 3, P, P].
    """

    attention: str
    analyze: Callable
    analyze_crop: Callable
    relevance_maps: Callable
    methods: tuple[str, ...]
    summary_rows: Callable
    patch_filters: Callable


_ARCHITECTURES: dict[type, Architecture] = {}


def register_architecture(model_type: type, architecture: Architecture) -> None:
    """Analyse, explain and describe models of `model_type` (and its subclasses) with `architecture`."""
    if not isinstance(model_type, type):
        raise TypeError(f"register an architecture for a model class, not {model_type!r}")
    if architecture.attention == "global":
        raise ValueError("a globally attending model needs no architecture: vitviz analyses it as a ViT")
    _ARCHITECTURES[model_type] = architecture


def registered_architecture(model_type: type) -> Architecture | None:
    """The architecture registered for `model_type` or its nearest base class, or None."""
    for cls in model_type.__mro__:
        found = _ARCHITECTURES.get(cls)
        if found is not None:
            return found
    return None
