"""The words of the app's menus and captions."""

from __future__ import annotations

from vitviz.sources import get_spec, list_variants, weights_status

__all__ = ["variant_choices", "head_choices", "spec_line"]

_STATUS_WORDS = {"embedded": "embedded, offline", "cached": "ready", "download": "needs a download"}


def variant_choices() -> list[tuple[str, str]]:
    """(label, name) for a dropdown: each label says whether the variant is ready."""
    out = []
    for spec in list_variants():
        status = weights_status(spec.name)
        out.append((f"{spec.name} · {spec.image_size}px /{spec.patch_size} · {_STATUS_WORDS[status]}", spec.name))
    return out


def head_choices(heads: int) -> list[str]:
    return ["mean", "max"] + [f"head {h + 1}" for h in range(heads)]


def spec_line(name: str) -> str:
    spec = get_spec(name)
    return f"{spec.description} — {spec.weights}"
