"""What every weights source shares: the interface of a source, and the registry of sources.

A `VariantSpec` (defined in the leaf `vitviz.config`, re-exported here) says everything needed to
build, load and feed one model variant: its architecture (`ViTConfig`), its preprocessing, its class
names and where its weights come from. A `WeightsSource` lists the variants it offers, says whether
their weights are at hand, loads them, and converts a model of its library (`library`, `convert`).

A model family is one module: its source class, registered with `register_source` when the module
is imported, and its conversion (`vitviz.from_<library>`). `vitviz.sources` imports the built-in
ones (embedded, torchvision, timm, hf: the menus' order) and then the plugins
(`vitviz.sources.load_plugins`); every lookup (`list_variants`, `get_spec`, `source_of`,
`load_model`, `weights_status`, `default_variant`) goes through `registered_sources()`.

Nothing in the library or the app branches on a source's name: a spec is loaded, checked and
described by the source that `source_of(spec)` finds by `spec.source`, and what differs between
sources is an attribute or method of theirs (`cache_dir`, `hub_repo`, `reachable`, ...). Only the
checkout's benchmark (`vitviz.dev.bench`) picks torchvision's variants by name, to give them random
weights.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar, Literal, TypeVar

from torch import nn

from vitviz.config import VariantSpec, check_size, split_size
from vitviz.model import ViT

__all__ = [
    "VariantSpec",
    "WeightsSource",
    "WeightsUnavailableError",
    "Status",
    "split_size",
    "check_size",
    "register_source",
    "registered_sources",
]

Status = Literal["embedded", "cached", "download"]


class UnknownVariant(ValueError):
    """A name that is no variant and that no source's prefix claims."""


class WeightsUnavailableError(RuntimeError):
    """Weights are neither at hand nor downloadable; the message says what to run or where to put what."""


class WeightsSource(ABC):
    """Where weights come from: a list of variants, their status, and a loader.

    Attributes:
        name: the source's name; a `VariantSpec`'s `source` names it. Registering another source
            under the same name replaces this one.
        prefix: for a source that can name any model of its library on demand (timm, Hugging Face):
            the start of such names ("timm:"); it answers `resolve` for names outside its list.
        library: the library whose models `convert` takes ("torchvision", "timm", "transformers"),
            for a source that has a conversion; None otherwise.
        hub: its weights come through the Hugging Face hub's cache, `spec.locator` naming the
            repository (`hub_repo`): a server bounds that cache by repository.
    """

    name: ClassVar[str]
    prefix: ClassVar[str | None] = None
    library: ClassVar[str | None] = None
    hub: ClassVar[bool] = False

    @abstractmethod
    def specs(self) -> list[VariantSpec]:
        """The variants this source offers by name (the menus' list)."""

    def resolve(self, name: str, *, weights_path: str | None = None) -> VariantSpec:
        """The spec of a prefixed name outside the curated list.

        Args:
            weights_path: a checkpoint on this machine: the spec is then read from it alone (its
                classes, its preprocessing where it has its own), with nothing fetched and no cache
                read; the name only names the architecture.
        """
        raise ValueError(f"{self.name} knows no variant {name!r}")

    @abstractmethod
    def status(self, spec: VariantSpec) -> Status:
        """"embedded" (ships with vitviz), "cached" (on this machine) or "download" (fetched on first use)."""

    def reachable(self) -> bool:
        """Whether weights could be downloaded now."""
        return False

    def num_params(self, spec: VariantSpec) -> int:
        """Parameters of the whole model `load` makes for `spec` (every tower: an image–text model's
        text tower too), counted without loading it. The default counts the ViT of `spec.config`: a
        source whose models hold more says so here (a server counts a loaded model again)."""
        return spec.config.num_params

    def hub_repo(self, spec: VariantSpec) -> str:
        """The Hugging Face repository `spec`'s weights come from, or "" (not from the hub, or a
        checkpoint on this machine)."""
        where = spec.locator
        if not self.hub or "/" not in where or Path(where).is_absolute() or Path(where).exists():
            return ""
        return spec.locator.removeprefix("hf-hub:")

    def cache_dir(self) -> Path | None:
        """The folder where this source looks for a spec's weights file (`spec.filename`) on this
        machine, where there is one such folder (torchvision: torch's hub checkpoints); messages
        tell users to put the file there."""
        return None

    @abstractmethod
    def load(self, spec: VariantSpec, *, weights_path: str | None = None, progress: bool = True) -> ViT:
        """A vitviz ViT with the variant's weights, on the CPU.

        Raises:
            WeightsUnavailableError: the weights are neither at hand nor downloadable.
        """

    def convert(self, model: nn.Module, **options) -> ViT:
        """A vitviz ViT from a model of this source's `library` (the same as `vitviz.from_<library>`)."""
        raise NotImplementedError(f"{self.name} models cannot be converted")


_SOURCES: dict[str, WeightsSource] = {}
_LOCK = threading.Lock()
_generation = 0  # counts registrations: caches of what the sources offer compare it (`vitviz.sources`)

_S = TypeVar("_S", bound="WeightsSource | type[WeightsSource]")


def register_source(source: _S) -> _S:
    """Registers a weights source: an instance, or a `WeightsSource` subclass (instantiated with no
    arguments), so that it also serves as a class decorator. Returns what it was given.

    A source registered under the `name` of one registered before replaces it, in its place in the
    order (the order of `registered_sources()` and of the menus). The variants it offers are listed
    and its names resolved from the next lookup on.

    Raises:
        TypeError: not a `WeightsSource` (or an abstract one).
        ValueError: no name, or a `prefix` another source (of another name) has already.
    """
    instance = source() if isinstance(source, type) and issubclass(source, WeightsSource) else source
    if not isinstance(instance, WeightsSource):
        raise TypeError(f"register_source takes a WeightsSource or a subclass of it, not {source!r}")
    name, prefix = getattr(instance, "name", None), instance.prefix
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"a weights source needs a name (a non-empty string), {type(instance).__name__} has {name!r}")
    if prefix is not None and (not isinstance(prefix, str) or not prefix):
        raise ValueError(f"the prefix of the weights source {name!r} is a non-empty string or None, not {prefix!r}")
    global _generation
    with _LOCK:
        for other in _SOURCES.values():
            if prefix and other.name != name and other.prefix == prefix:
                raise ValueError(f"the weights source {other.name!r} has the prefix {prefix!r} already")
        _SOURCES[name] = instance  # a name registered before keeps its place
        _generation += 1
    return source


def registered_sources() -> tuple[WeightsSource, ...]:
    """The sources registered so far, in order (plugins are imported by `vitviz.sources.load_plugins`,
    which every lookup of `vitviz.sources` calls first)."""
    with _LOCK:
        return tuple(_SOURCES.values())


def generation() -> int:
    """How many registrations there have been: a cache of what the sources offer is stale when this changed."""
    return _generation
