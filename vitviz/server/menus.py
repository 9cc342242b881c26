"""The words of the app's menus and captions."""

from __future__ import annotations

from vitviz.sources import VariantSpec, get_spec, list_variants, source_of

__all__ = ["variant_choices", "variant_choice", "grouped_choices", "FAMILY_WORDS", "head_choices", "spec_line"]

_STATUS_WORDS = {"embedded": "embedded, offline", "cached": "ready", "download": "needs a download"}


def variant_choice(spec: VariantSpec) -> tuple[str, str]:
    """(label, name): the label says the image size, the patch size and whether the weights are ready."""
    status = source_of(spec).status(spec)
    return f"{spec.name} · {spec.image_size}px /{spec.patch_size} · {_STATUS_WORDS[status]}", spec.name


def _menu_specs(extra: list[str] | tuple[str, ...]) -> list[VariantSpec]:
    """Every listed variant, then the `extra` names (timm:..., hf:...) not among them."""
    listed = list_variants()
    names = {s.name for s in listed}
    return listed + [get_spec(n) for n in extra if n not in names]


def variant_choices(extra: list[str] | tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(label, name) for a dropdown: every listed variant, then `extra` names (timm:..., hf:...)."""
    return [variant_choice(s) for s in _menu_specs(extra)]


# a source's name as a reader knows the family (a source not named here shows its own name)
FAMILY_WORDS = {"embedded": "Embedded", "torchvision": "torchvision", "timm": "timm", "hf": "Hugging Face", "open_clip": "OpenCLIP"}
_GROUPED_STATUS = {"embedded": "offline", "cached": "ready", "download": "needs a download"}
_READY_FIRST = {"embedded": 0, "cached": 1, "download": 2}


def grouped_choices(extra: list[str] | tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(label, name) for a searchable picker: each label starts with its family, so typing a family
    (or "download", or "offline") narrows the list to it; what runs now (embedded, then on this
    machine) comes first, then what needs a download, each group in its family's order."""
    specs = _menu_specs(extra)
    family_order: dict[str, int] = {}
    for spec in specs:
        family_order.setdefault(spec.source, len(family_order))
    status = {spec.name: source_of(spec).status(spec) for spec in specs}
    ordered = sorted(specs, key=lambda s: (_READY_FIRST[status[s.name]], family_order[s.source]))  # stable: each family keeps its order
    return [(f"{FAMILY_WORDS.get(s.source, s.source)} — {s.name} · {s.image_size}px /{s.patch_size} · {_GROUPED_STATUS[status[s.name]]}", s.name)
            for s in ordered]


def head_choices(heads: int) -> list[str]:
    return ["mean", "max"] + [f"head {h + 1}" for h in range(heads)]


def spec_line(name: str) -> str:
    spec = get_spec(name)
    return f"{spec.description} — {spec.weights}"
