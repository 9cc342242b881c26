"""What can be loaded, from every weights source behind one interface (`WeightsSource`).

    vitviz.list_variants()                 # the named variants of every source
    vitviz.load_model("vit_b_16")          # torchvision weights, downloaded once
    vitviz.load_model("shapes_p16")        # embedded, offline

A model family is one module: a `WeightsSource` subclass that registers itself
(`@register_source`) and, for a library's models, its conversion `from_<library>`. This package
imports the built-in ones (embedded, torchvision, timm, hf, open_clip: the menus' order), then, at the first
lookup (and again when `VITVIZ_PLUGINS` changes), the plugins (`load_plugins`): the modules of the entry-point group "vitviz.sources", and
those named in `VITVIZ_PLUGINS` (comma-separated; the same variable names explanation-method
plugins, and one module may register both). A plugin's source is then listed, loaded and resolved
(its `prefix`) like the built-in ones, with no file of vitviz changed.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import threading

import torch

from vitviz.imagetext import ImageTextModel
from vitviz.model import ViT
from vitviz.sources import base
from vitviz.sources.base import (
    Status,
    UnknownVariant,
    VariantSpec,
    WeightsSource,
    WeightsUnavailableError,
    register_source,
    registered_sources,
    split_size,
)

# the built-in sources, registered on import in this order (the menus' order)
from vitviz.sources import embedded, torchvision, timm, hf, open_clip  # noqa: E402,F401  isort: skip
from vitviz.sources.embedded import assets_dir  # noqa: E402
from vitviz.sources.hf import from_transformers  # noqa: E402
from vitviz.sources.open_clip import from_open_clip  # noqa: E402
from vitviz.sources.timm import from_timm  # noqa: E402
from vitviz.sources.torchvision import checkpoint_dir, from_torchvision  # noqa: E402

__all__ = [
    "SOURCES",
    "VariantSpec",
    "WeightsSource",
    "WeightsUnavailableError",
    "UnknownVariant",
    "Status",
    "register_source",
    "registered_sources",
    "load_plugins",
    "converter",
    "ENTRY_POINT_GROUP",
    "from_torchvision",
    "from_timm",
    "from_transformers",
    "from_open_clip",
    "list_variants",
    "get_spec",
    "source_of",
    "load_model",
    "weights_status",
    "default_variant",
    "default_device",
    "assets_dir",
    "checkpoint_dir",
]

ENTRY_POINT_GROUP = "vitviz.sources"
_PLUGINS_LOADED_FOR: str | None = None  # the value of VITVIZ_PLUGINS the plugins were last imported for


def load_plugins() -> None:
    """Imports the plugin modules, once each: those of the entry-point group "vitviz.sources", then
    those of `vitviz.explainers.load_plugins` (the group "vitviz.methods", and the modules named in
    `VITVIZ_PLUGINS`). A plugin registers its sources (and methods) when imported; an import that
    fails is an ImportError naming the plugin.

    Every lookup of this module calls it; it does the work again only when `VITVIZ_PLUGINS` has
    changed (the entry points are read once per process).
    """
    global _PLUGINS_LOADED_FOR
    from vitviz.explainers.registry import PLUGINS_ENV
    from vitviz.explainers.registry import load_plugins as load_named_plugins

    named = os.environ.get(PLUGINS_ENV, "")
    if named == _PLUGINS_LOADED_FOR:
        return
    if _PLUGINS_LOADED_FOR is None:
        from importlib.metadata import entry_points

        for module in dict.fromkeys(ep.value.split(":")[0] for ep in entry_points(group=ENTRY_POINT_GROUP)):
            try:
                importlib.import_module(module)
            except Exception as exc:
                raise ImportError(f"the vitviz plugin {module!r} could not be imported: {type(exc).__name__}: {exc}") from exc
    load_named_plugins()
    _PLUGINS_LOADED_FOR = named


def _sources() -> tuple[WeightsSource, ...]:
    """Every registered source, plugins imported first."""
    load_plugins()
    return registered_sources()


def converter(library: str):
    """The conversion of a registered family whose models are `library`'s (its `convert`), plugins
    included; None when no family converts that library's models. `vitviz.from_<library>` is it."""
    for source in reversed(_sources()):  # the latest registered first, as a name registered again replaces
        if source.library == library and type(source).convert is not WeightsSource.convert:
            return source.convert
    return None


def __getattr__(name: str):
    if name == "SOURCES":  # the registered sources, plugins included (a snapshot: a list made now)
        return list(_sources())
    if name.startswith("from_") and (convert := converter(name[len("from_"):])) is not None:
        return convert  # a plugin family's conversion (the built-in ones are this module's own names)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_REGISTRY: dict[str, VariantSpec] | None = None
_GENERATION = -1  # base.generation() when _REGISTRY and _RESOLVED were filled
_LOCK = threading.Lock()
_RESOLVED: dict[str, VariantSpec] = {}
WHOLE = "@whole"  # a variant name's suffix: each image fed whole, its aspect ratio kept (`VariantSpec.whole`)


def _registry() -> dict[str, VariantSpec]:
    """The named variants of every source; made again after a source is registered."""
    global _REGISTRY, _GENERATION
    sources = _sources()
    with _LOCK:
        if _REGISTRY is None or _GENERATION != base.generation():
            _GENERATION = base.generation()
            _RESOLVED.clear()
            _REGISTRY = {s.name: s for source in sources for s in source.specs()}
        return _REGISTRY


def list_variants() -> list[VariantSpec]:
    """Every named variant: the embedded ones first, then torchvision's, then the other sources' picks."""
    return list(_registry().values())


def get_spec(name: str) -> VariantSpec:
    """The spec of a named variant, or of any model a prefixed source can name ("timm:...", "hf:...").

    A suffix "@<pixels>" feeds the variant images of that size ("timm:vit_small_patch8_224.dino@480"):
    a whole number above 0 that is a multiple of the patch size, else a ValueError says so. A suffix
    "@whole" feeds it each image whole, its aspect ratio kept (`VariantSpec.whole`).
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError("a variant name is a non-empty string")
    name = name.strip()
    spec = _registry().get(name) or _RESOLVED.get(name)
    if spec is not None:
        return spec
    if name.endswith(WHOLE) and len(name) > len(WHOLE):
        base = name.removesuffix(WHOLE)
        if base.endswith(WHOLE):
            raise ValueError(f"{name[:60]!r}: @whole is said once, at the end of the name")
        return dataclasses.replace(get_spec(base).whole(), name=name)
    for source in _sources():
        if source.prefix and name.startswith(source.prefix):
            spec = source.resolve(name)
            with _LOCK:
                if len(_RESOLVED) > 256:
                    _RESOLVED.clear()
                _RESOLVED[name] = spec
            return spec
    base, at, _ = name.rpartition("@")
    if at and base in _registry():
        _, size = split_size(name)
        return dataclasses.replace(_registry()[base].at(size), name=name)
    prefixes = ", ".join(f"{s.prefix}<name>" for s in _sources() if s.prefix)
    raise UnknownVariant(f"unknown variant {name!r}; known: {', '.join(_registry())}" + (f"; or {prefixes}" if prefixes else ""))


def source_of(spec: VariantSpec) -> WeightsSource:
    """The registered source that `spec.source` names."""
    for source in _sources():
        if source.name == spec.source:
            return source
    raise ValueError(f"{spec.name} comes from an unknown source {spec.source!r}")


def weights_status(name: str) -> Status:
    """"embedded", "cached" (on this machine) or "download" (fetched on first use)."""
    spec = get_spec(name)
    return source_of(spec).status(spec)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_variant(preferred: str = "vit_b_16") -> tuple[str, str]:
    """The variant a user gets by default, and why: `preferred` when its weights are at hand or
    downloadable, else the embedded `shapes_p16`."""
    spec = get_spec(preferred)
    source = source_of(spec)
    status = source.status(spec)
    if status in ("embedded", "cached"):
        return preferred, f"{preferred}: weights {status}"
    if source.reachable():
        return preferred, f"{preferred}: weights will be downloaded on first use"
    folder = source.cache_dir()
    where = f" in {folder}" if folder is not None else ""
    return "shapes_p16", (
        f"{preferred} weights are not cached{where} and cannot be downloaded from here, so the embedded shapes_p16 "
        f"model is the default" + (f" (put {spec.filename} there to use {preferred})" if spec.filename else "")
    )


def _checkpoint_spec(name: str, weights_path: str) -> VariantSpec:
    """The spec of `name` loaded from a checkpoint on this machine: a prefixed source ("timm:",
    "hf:") reads it from the checkpoint alone; a named variant keeps its own (its loader checks that
    the checkpoint fits)."""
    if isinstance(name, str):
        stripped = name.strip()
        for source in _sources():
            if source.prefix and stripped.startswith(source.prefix):
                return source.resolve(stripped, weights_path=weights_path)
    return get_spec(name)


def load_model(
    name: str,
    *,
    device: str | torch.device | None = None,
    weights_path: str | os.PathLike | None = None,
    progress: bool = True,
    image_size: int | None = None,
    dtype: torch.dtype | str | None = None,
) -> ViT | ImageTextModel:
    """A vitviz ViT with the variant's weights, in eval mode, on `device` (default: CUDA if available);
    for a Hugging Face CLIP repository a `vitviz.imagetext.ImageTextModel` (its image tower a vitviz
    ViT, its spec the image tower's, with the repository's tokenizer).

    Args:
        name: a name from `list_variants()`, or "timm:<name>" / "hf:<repo id>" for any model of those
            libraries' plain ViT families (and Hugging Face's CLIP).
        device: where to put the model.
        weights_path: a local checkpoint to use instead of the variant's own weights source (a
            torchvision or vitviz state dict; for "timm:<name>" a timm checkpoint file, for
            "hf:<repo id>" a folder saved with `save_pretrained`). For timm and Hugging Face the
            checkpoint alone says what the model is: classes (timm: the head's rows; Hugging Face:
            `id2label`), preprocessing (the folder's `preprocessor_config.json`; timm: the named
            architecture's `pretrained_cfg`); nothing is fetched and no hub cache is read, so the
            name only names the architecture.
        progress: show download progress (a tqdm bar) when weights are fetched.
        image_size: feed the model images of this side instead of its own (position embeddings are
            resampled; e.g. 480 for DINO's figures).
        dtype: the weights' dtype: float32 (default), bfloat16 or float16 (names or torch dtypes).
            In half precision each attention's logits and softmax are computed in float32 (what
            vitviz records, and what relevance and the lens read), the rest in the weights' dtype.

    Raises:
        WeightsUnavailableError: weights neither at hand nor downloadable; the message says what to do.
    """
    path = None if weights_path is None else os.fspath(weights_path)
    whole = isinstance(name, str) and name.strip().endswith(WHOLE)
    if whole:  # the model itself, fed whole images
        name = name.strip().removesuffix(WHOLE)
        if name.endswith(WHOLE):
            raise ValueError(f"{name[:60]!r}: @whole is said once, at the end of the name")
    spec = get_spec(name) if path is None else _checkpoint_spec(name, path)
    model = source_of(spec).load(spec, weights_path=path, progress=progress)
    model.spec = spec.at(image_size) if image_size else spec
    if whole:
        model.spec = dataclasses.replace(model.spec.whole(), name=model.spec.name + WHOLE)
    return model.eval().to(device=device if device is not None else default_device(), dtype=weights_dtype(dtype))


def weights_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    """float32, bfloat16 or float16, from a torch dtype or its name ("bfloat16", "bf16", "float16",
    "fp16", "half", "float32"); None: float32."""
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str):
        if dtype.removeprefix("torch.") not in names:
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
        return names[dtype.removeprefix("torch.")]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    return dtype
