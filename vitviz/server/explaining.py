"""The app's model calls beyond the analysis itself: the maps that need a target class (one forward
and one backward for every method), and their deletion and insertion curves."""

from __future__ import annotations

from collections.abc import Callable

import torch

from vitviz.explainers import method, methods
from vitviz.explanations import relevance_maps, resolve_target
from vitviz.faithfulness import Curves, perturbation_curves, random_maps
from vitviz.preprocess import to_input
from vitviz.server.models import ModelCache
from vitviz.server.views import Exploration
from vitviz.swin import SWIN_METHODS, SwinAnalysis

__all__ = ["explain_exploration", "find_phrases", "faithfulness_of"]


def _input(cache: ModelCache, exp: Exploration):
    model, _ = cache.get(exp.analysis.variant)
    return model, to_input(exp.analysis.image, model.spec.preprocessing).unsqueeze(0)


def explain_exploration(cache: ModelCache, exp: Exploration, *, target: str | None) -> tuple[dict[str, torch.Tensor], int | None]:
    """Every registered method's map [gh, gw] for `target` (a class name; None: the top-1) on the
    analysed crop: the methods whose needs the model meets (`Method.needs`), those that explain a
    score only for a model with a classifier (a model without one, an image–text model included,
    gets the maps that need no target: "attention" and "rollout"). A Swin: the methods of
    `vitviz.swin.SWIN_METHODS` (its windowed attention made global, through every merge)."""
    model, x = _input(cache, exp)
    a = exp.analysis
    has_class = a.probabilities is not None and a.layout.classifier  # an image–text model's zero-shot labels are phrases (Find)
    if isinstance(a, SwinAnalysis):
        wanted = [m for m in SWIN_METHODS if m in methods() and (has_class or not method(m).needs_target)]
    else:
        wanted = [m for m in methods() if a.layout.lacks(method(m).needs) is None and (has_class or not method(m).needs_target)]
    index = resolve_target(target, a.categories, a.probabilities) if has_class else None
    maps, _, _ = relevance_maps(model, x, methods=wanted, targets=[index] if index is not None else None)
    return {m: v[0] for m, v in maps.items()}, index


def find_phrases(cache: ModelCache, exp: Exploration, phrases: list[str], *, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`method`'s map [T, gh, gw] for each phrase's image–text similarity on the analysed crop, and
    the similarities [T]: one forward of the image tower, one batched backward for all phrases."""
    model, x = _input(cache, exp)
    maps, _, similarities = relevance_maps(model, x, methods=[method], text=list(phrases))
    return maps[method][0], similarities[0]


def faithfulness_of(cache: ModelCache, exp: Exploration, maps: dict[str, torch.Tensor], *, target: int, steps: int = 16,
                    seed: int = 0, batch_size: int = 64, check: Callable[[], None] | None = None) -> dict[str, Curves]:
    """Deletion and insertion curves of each map's order, and of a random order ("random"),
    `batch_size` perturbed images per forward; `check` is called before each (a deadline, a cancel)."""
    model, x = _input(cache, exp)
    orders = dict(maps)
    orders["random"] = random_maps(next(iter(maps.values())).shape, seed=seed)
    stacked = torch.stack(list(orders.values()))  # one batch: every ordering of the same image
    curves = perturbation_curves(model, x.expand(len(orders), -1, -1, -1), stacked, torch.full((len(orders),), target), steps=steps,
                                  batch_size=batch_size, check=check)
    return {
        name: Curves(fractions=curves.fractions, deletion=curves.deletion[i : i + 1], insertion=curves.insertion[i : i + 1])
        for i, name in enumerate(orders)
    }
