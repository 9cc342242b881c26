"""The words of the app's menus and captions."""

from __future__ import annotations

from vitviz.sources import VariantSpec, get_spec, list_variants, source_of

__all__ = ["variant_choices", "variant_choice", "head_choices", "spec_line"]

_STATUS_WORDS = {"embedded": "embedded, offline", "cached": "ready", "download": "needs a download"}


def variant_choice(spec: VariantSpec) -> tuple[str, str]:
    """(label, name): the label says the image size, the patch size and whether the weights are ready."""
    status = source_of(spec).status(spec)
    return f"{spec.name} · {spec.image_size}px /{spec.patch_size} · {_STATUS_WORDS[status]}", spec.name


def variant_choices(extra: list[str] | tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(label, name) for a dropdown: every listed variant, then `extra` names (timm:..., hf:...)."""
    listed = list_variants()
    names = {s.name for s in listed}
    return [variant_choice(s) for s in listed] + [variant_choice(get_spec(n)) for n in extra if n not in names]


def head_choices(heads: int) -> list[str]:
    return ["mean", "max"] + [f"head {h + 1}" for h in range(heads)]


def spec_line(name: str) -> str:
    spec = get_spec(name)
    return f"{spec.description} — {spec.weights}"
