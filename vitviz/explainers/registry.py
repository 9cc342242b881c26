"""The registry of explanation methods (`vitviz.explainers` documents the contract)."""

from __future__ import annotations

import importlib
import os
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from vitviz.layout import check_needs

__all__ = ["Method", "register_method", "methods", "method", "load_plugins", "PLUGINS_ENV"]

PLUGINS_ENV = "VITVIZ_PLUGINS"
ENTRY_POINT_GROUP = "vitviz.methods"


@dataclass(frozen=True)
class Method:
    """A registered method.

    Attributes:
        name: what callers pass (`method="gradient"`, `--methods gradient`).
        title: a short title for its map (the app's label).
        needs_gradients: the pass must record the gradient of the target score (a class logit, or an
            image–text similarity) with respect to every layer's attention (`Recorded.gradients`).
        needs_classifier: it explains a class (a model without a classifier cannot use it).
        needs_text: it explains a phrase (image-text models).
        needs_layer_gradients: the pass must record, for every layer l, the gradient of the score
            read from layer l's output with respect to layer l's attention (`Recorded.layer_gradients`;
            LeGrad).
        unit: what its colour bar shows.
        needs: everything the model must offer (names from `vitviz.layout.NEEDS`: "classifier" and
            "text" as above; "target" for a method that differentiates whatever score is explained,
            a class logit or a phrase's similarity; "global_attention", "cls", ...); a model that
            lacks one is told why (`TokenLayout.lacks`) instead of getting a map.
        fn: fn(recorded, **options) -> maps [B, gh, gw].
        layerwise: for a gradient method that reads each layer's attention A_l and gradient G_l only
            through a per-layer reduction: layerwise(A_l [B, H, N, N], G_l [B, H, N, N], **options)
            -> anything per layer. The pass then computes it inside the backward, as each layer's
            gradient arrives, and neither the gradient nor the attention stack is kept; `fn` reads
            the L results with `recorded.layerwise(name, **options)`.
    """

    name: str
    title: str
    needs_gradients: bool
    needs_classifier: bool
    needs_text: bool
    unit: str
    fn: Callable[..., torch.Tensor]
    needs: frozenset[str] = frozenset()
    needs_layer_gradients: bool = False
    layerwise: Callable[..., torch.Tensor] | None = None

    @property
    def needs_target(self) -> bool:
        """It explains a score: a class ("classifier"), a phrase ("text") or either ("target")."""
        return bool(self.needs & {"classifier", "text", "target"})


_REGISTRY: dict[str, Method] = {}
_LOCK = threading.Lock()
_LOADED: set[str] = set()


def register_method(name: str, *, title: str, needs_gradients: bool, needs_classifier: bool | None = None,
                    needs_text: bool = False, needs_layer_gradients: bool = False, unit: str = "relevance",
                    needs: tuple[str, ...] | frozenset[str] = (),
                    layerwise: Callable[..., torch.Tensor] | None = None) -> Callable[[Callable], Callable]:
    """Registers the decorated function as the explanation method `name` (see the module's docstring).

    Args:
        needs_classifier: default: as `needs_gradients` (a method that reads `rec.targets` needs a
            class). False for a gradient method that works with any scalar target: it then needs
            "target" (a class, or a phrase for an image–text model) instead of "classifier".
        needs_layer_gradients: the per-layer gradients of per-layer scores (`Recorded.layer_gradients`).
        needs: what else the model must offer (`vitviz.layout.NEEDS`), e.g. ("global_attention",).
        layerwise: the method's per-layer reduction of (attention, gradient) (`Method.layerwise`);
            only for a method that needs gradients.

    Raises:
        ValueError: a bad name, or a name already registered by another function.
    """
    if not isinstance(name, str) or not name.replace("_", "").isalnum() or not name[:1].isalpha():
        raise ValueError(f"a method's name is letters, digits and _ starting with a letter, not {name!r}")
    if layerwise is not None and not (needs_gradients and callable(layerwise)):
        raise ValueError(f"method {name!r}: layerwise= is a function of each layer's attention and gradient; it needs needs_gradients=True")

    classifier = bool(needs_gradients if needs_classifier is None else needs_classifier)
    any_target = (needs_gradients or needs_layer_gradients) and not classifier and not needs_text
    wanted = (check_needs(needs) | ({"classifier"} if classifier else set()) | ({"text"} if needs_text else set())
              | ({"target"} if any_target else set()))

    def register(fn: Callable) -> Callable:
        entry = Method(name, title, bool(needs_gradients), classifier, bool(needs_text), unit, fn, frozenset(wanted),
                       bool(needs_layer_gradients), layerwise)
        with _LOCK:
            old = _REGISTRY.get(name)
            if old is not None and (old.fn.__module__, old.fn.__qualname__) != (fn.__module__, fn.__qualname__):
                raise ValueError(f"method {name!r} is registered already (by {old.fn.__module__}.{old.fn.__qualname__})")
            _REGISTRY[name] = entry
        return fn

    return register


def load_plugins() -> None:
    """Imports the plugin modules (entry-point group "vitviz.methods", then `VITVIZ_PLUGINS`), once
    each; an import that fails is an ImportError naming the plugin."""
    from importlib.metadata import entry_points

    names = [ep.value.split(":")[0] for ep in entry_points(group=ENTRY_POINT_GROUP)]
    names += [n.strip() for n in os.environ.get(PLUGINS_ENV, "").split(",") if n.strip()]
    for name in names:
        if name in _LOADED:
            continue
        try:
            importlib.import_module(name)
        except Exception as exc:
            raise ImportError(f"the vitviz plugin {name!r} could not be imported: {type(exc).__name__}: {exc}") from exc
        _LOADED.add(name)


def methods() -> tuple[str, ...]:
    """The names of every registered method, built-in first, plugins loaded."""
    load_plugins()
    with _LOCK:
        return tuple(_REGISTRY)


def method(name: str) -> Method:
    """The registered method `name`.

    Raises:
        ValueError: no such method (the message lists them).
    """
    known = methods()
    if name not in known:
        raise ValueError(f"unknown method {name!r}; the methods are {', '.join(known)}")
    return _REGISTRY[name]

