"""Every field a client sends, checked: the API takes them from anyone."""

from __future__ import annotations

import math

from vitviz.server.menus import head_choices
from vitviz.sources import WeightsUnavailableError, get_spec

__all__ = ["InputError", "variant", "fusion", "ratio", "index", "head", "share"]


class InputError(ValueError):
    """A field a client sent that vitviz will not use; the message says what is accepted."""


def variant(value: object, *, max_params: int | None = None) -> str:
    """A variant name vitviz can load: a listed one, or "timm:<name>" / "hf:<repo id>" of at most
    `max_params` parameters."""
    if not isinstance(value, str) or not value.strip():
        raise InputError("Choose a model variant.")
    value = value.strip()
    if len(value) > 200:
        raise InputError("A model name has at most 200 characters.")
    try:
        spec = get_spec(value)
    except (ValueError, WeightsUnavailableError, ImportError, NotImplementedError, TypeError) as exc:
        raise InputError(str(exc)) from None
    if max_params is not None and spec.config.num_params > max_params:
        raise InputError(
            f"{value} has {spec.config.num_params / 1e6:,.0f} M parameters; this server loads models of up to "
            f"{max_params / 1e6:,.0f} M (VITVIZ_MAX_PARAMS)."
        )
    return value


def fusion(value: object) -> str:
    if value not in ("mean", "max", "min"):
        raise InputError("Head fusion must be mean, max or min.")
    return value  # type: ignore[return-value]


def _number(value: object) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return math.nan


def ratio(value: object) -> float:
    r = _number(value)
    if not 0.0 <= r <= 0.95:
        raise InputError("The discard ratio must be a number from 0 to 0.95.")
    return r


def index(value: object, low: int, high: int, what: str) -> int:
    n = _number(value)
    if not (low <= n <= high and n == int(n)):
        raise InputError(f"The {what} must be a whole number from {low} to {high}.")
    return int(n)


def head(value: object, heads: int) -> str:
    if isinstance(value, str) and value in head_choices(heads):
        return value
    raise InputError(f"The head must be mean, max or one of head 1 to head {heads}.")


def share(value: object) -> float:
    """DINO's share of a head's attention kept: a number in [0.05, 1]."""
    t = _number(value)
    if not 0.05 <= t <= 1.0:
        raise InputError("The share of attention kept must be a number from 0.05 to 1.")
    return t
