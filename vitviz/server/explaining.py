"""The app's model calls beyond the analysis itself: the maps that need a target class (one forward
and one backward for every method), and their deletion and insertion curves."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from vitviz.architectures import architecture_of
from vitviz.explainers import method, methods
from vitviz.explanations import METHODS as BUILT_IN, maps_of, record_for, relevance_maps, resolve_target
from vitviz.faithfulness import Curves, perturbation_curves, random_maps
from vitviz.preprocess import to_input
from vitviz.server.models import ModelCache
from vitviz.server.pictures.views import Exploration

__all__ = ["explain_exploration", "find_phrases", "faithfulness_of", "MethodGuard", "PLUGIN_SECONDS"]

LOG = logging.getLogger("vitviz.server")
# A plugin method whose map took longer than this is left out of the explanations that follow (its
# own map only: the others are drawn as before), until the server restarts.
PLUGIN_SECONDS = 10.0


class MethodGuard:
    """Keeps a plugin method's failure or slowness to its own map: a map that raises is left out of
    that explanation with a line that names the method and the kind of error (its text, which may
    hold whatever the plugin put there, goes to the server's log only); a plugin whose map took more
    than `seconds` is left out of later explanations. Built-in methods are run as they are."""

    def __init__(self, seconds: float = PLUGIN_SECONDS, *, clock: Callable[[], float] = time.perf_counter) -> None:
        self.seconds = seconds
        self._clock = clock
        self._slow: dict[str, float] = {}
        self._lock = threading.Lock()

    def left_out(self, name: str) -> str | None:
        """Why the plugin `name` is left out of explanations now, or None."""
        with self._lock:
            took = self._slow.get(name)
        if took is None:
            return None
        return f"{method(name).title} is left out: its map took {took:,.1f} s, more than the {self.seconds:,.4g} s a plugin's map may take here."

    def run(self, name: str, compute: Callable[[], torch.Tensor]) -> tuple[torch.Tensor | None, str | None]:
        """`compute()` for method `name`: (its map, None), or (None, why it is not there)."""
        if name in BUILT_IN:
            return compute(), None
        start = self._clock()
        try:
            out = compute()
        except Exception as exc:  # a plugin's own failure: its map only
            LOG.warning("the plugin method %r failed", name, exc_info=True)
            return None, f"{method(name).title} failed ({type(exc).__name__}); the server's log has the details."
        took = self._clock() - start
        if took > self.seconds:
            with self._lock:
                self._slow[name] = took
        return out, None


def _input(cache: ModelCache, exp: Exploration):
    model, _ = cache.get(exp.analysis.variant)
    return model, to_input(exp.analysis.image, model.spec.preprocessing).unsqueeze(0)


def explain_exploration(cache: ModelCache, exp: Exploration, *, target: str | None, guard: MethodGuard | None = None,
                        notes: dict[str, str] | None = None) -> tuple[dict[str, torch.Tensor], int | None]:
    """Every registered method's map [gh, gw] for `target` (a class name; None: the top-1) on the
    analysed crop: the methods whose needs the model meets (`Method.needs`), those that explain a
    score only for a model with a classifier (a model without one, an image–text model included,
    gets the maps that need no target: "attention" and "rollout"). A model of its own architecture
    (`vitviz.architectures`; a Swin: its windowed attention made global, through every merge): the
    methods it offers.

    With `guard`, a plugin method's failure or slowness stays with its own map (`MethodGuard`): it
    is left out, and `notes` (when given) gets {method: why}."""
    model, x = _input(cache, exp)
    a = exp.analysis
    has_class = a.probabilities is not None and a.layout.classifier  # an image–text model's zero-shot labels are phrases (Find)
    own = architecture_of(model)
    if own is not None:
        wanted = [m for m in own.methods if m in methods() and (has_class or not method(m).needs_target)]
    else:
        wanted = [m for m in methods() if a.layout.lacks(method(m).needs) is None and (has_class or not method(m).needs_target)]
    index = resolve_target(target, a.categories, a.probabilities) if has_class else None
    targets = [index] if index is not None else None
    if guard is None or own is not None:  # (its maps come from its own `relevance_maps`, all together)
        maps, _, _ = relevance_maps(model, x, methods=wanted, targets=targets)
        return {m: v[0] for m, v in maps.items()}, index
    why = {m: guard.left_out(m) for m in wanted}
    kept = [m for m in wanted if why[m] is None]
    rec = record_for(model, x, kept, targets=targets, in_backward=lambda m: m in BUILT_IN)  # a plugin's reduction under its guard
    found: dict[str, torch.Tensor] = {}
    for m in kept:
        found_map, why[m] = guard.run(m, lambda m=m: maps_of(rec, [m])[m])
        if found_map is not None:
            found[m] = found_map[0]
    if notes is not None:
        notes.update({m: w for m, w in why.items() if w})
    return found, index


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
