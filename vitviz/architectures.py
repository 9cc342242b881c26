"""Models whose tokens are not one global sequence, by class: how each is analysed and explained.

A plain ViT and an image–text model's image tower attend globally (one N x N matrix per layer and
head) and are analysed by `vitviz.pipeline` and explained by `vitviz.explanations` directly. A model
whose attention works another way (a Swin's windows and merges) registers a
`vitviz.layout.Architecture` for its class (`vitviz.layout.register_architecture`, as
`vitviz.swin_analysis` does when imported): `vitviz.analyze`, `vitviz.relevance_maps`,
`vitviz.explain` and the app hand such a model to its functions, and nothing outside its own modules
asks which family it is.

    architecture_of(model)   # None for a globally attending model
    attention_of(model)      # "global" or "windowed": the `TokenLayout.attention` its analyses have
"""

from __future__ import annotations

from vitviz import swin_analysis  # noqa: F401  (registers the Swin's architecture)
from vitviz.layout import Architecture, registered_architecture

__all__ = ["Architecture", "architecture_of", "attention_of"]


def architecture_of(model) -> Architecture | None:
    """The architecture registered for `model`'s class (or the nearest base class), None for a
    globally attending model."""
    return registered_architecture(type(model))


def attention_of(model) -> str:
    """The kind of attention of `model`'s analyses: "global", or its architecture's."""
    found = architecture_of(model)
    return "global" if found is None else found.attention
