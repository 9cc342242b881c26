"""Questions and answers about the generated shapes scenes (`vitviz.shapes.render_scene`): what
`shapes_vlm` learns and is measured on.

Three kinds, each answered in words of `vitviz.vlm.model.VOCABULARY`:
- "colour": "what colour is the <shape> ?" -> "<colour>", asked only of a shape that is once in the
  scene;
- "where": "where is the <colour> <shape> ?" -> "top left", "bottom right", ...: the half of the
  image (rows, then columns) that holds the centre of the object's mask;
- "count": "how many shapes are there ?" -> "two" or "three".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["QA", "KINDS", "questions", "where_words"]

KINDS = ("colour", "where", "count")
_NUMBERS = {1: "one", 2: "two", 3: "three", 4: "four"}


@dataclass(frozen=True)
class QA:
    """One question about a scene, its answer, and the object it is about (None for "count")."""

    kind: str
    question: str
    answer: str
    target: int | None


def where_words(mask: np.ndarray) -> str:
    """"top left", ...: the halves that hold the centre of the object's mask [S, S]."""
    ys, xs = np.nonzero(mask)
    size = mask.shape[0]
    return f"{'top' if ys.mean() < size / 2 else 'bottom'} {'left' if xs.mean() < size / 2 else 'right'}"


def questions(objects: list[tuple[str, str]], masks: np.ndarray) -> list[QA]:
    """Every question of the three kinds that has one answer in the scene."""
    out = []
    shapes = [s for _, s in objects]
    for k, (colour, shape) in enumerate(objects):
        if shapes.count(shape) == 1:
            out.append(QA("colour", f"what colour is the {shape} ?", colour, k))
        out.append(QA("where", f"where is the {colour} {shape} ?", where_words(masks[k]), k))
    out.append(QA("count", "how many shapes are there ?", _NUMBERS[len(objects)], None))
    return out
