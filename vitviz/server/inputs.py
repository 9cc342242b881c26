"""Every field a client sends, checked: the API takes them from anyone."""

from __future__ import annotations

import math

from vitviz.server.menus import head_choices
from vitviz.sources import get_spec

__all__ = ["InputError", "variant", "fusion", "ratio", "index", "head"]


class InputError(ValueError):
    """A field a client sent that vitviz will not use; the message says what is accepted."""


def variant(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise InputError("Choose a model variant.")
    try:
        get_spec(value)
    except ValueError as exc:
        raise InputError(str(exc)) from None
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
