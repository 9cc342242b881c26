"""Shards: every line a process wrote checked before it is merged, and what a run resumes."""

from __future__ import annotations

import json
import math
import os
import time
from vitviz.evaluate.data import CURVE_METRICS, EvaluateError, Item, MAX_TEXT_CHARS, PROTOCOLS
from pathlib import Path
from typing import Callable




_SLACK = 1e-6  # float32 probabilities and their trapezoids may pass 1 by a rounding


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _unit(v) -> bool:
    return _number(v) and -_SLACK <= v <= 1 + _SLACK


def _digest_or_none(v) -> bool:
    return v is None or (isinstance(v, str) and len(v) == 32 and all(c in "0123456789abcdef" for c in v))


Check = tuple[str, Callable[[object], bool]]


def _row_schema(methods, metrics, *, steps: int, depth: int, heads: int, classes: int, protocol: str | None = None,
                text: bool = False) -> tuple[dict[str, Check], dict[str, Check]]:
    """(the keys of every row, the keys a scored row adds), each with what it holds and its test."""
    every: dict[str, Check] = {
        "index": ("a whole number >= 0", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0),
        "file": ("a relative path", lambda v: isinstance(v, str) and bool(v) and not v.startswith("/")),
        "path": ("a path", lambda v: isinstance(v, str) and bool(v)),
        "label": ("a class name or null", lambda v: v is None or isinstance(v, str)),
        "stamp": ("the digests of the file's bytes and its mask's", lambda v: isinstance(v, str) and bool(v)),
        "sha256": ("32 hex digits or null", _digest_or_none),
        "mask_sha256": ("32 hex digits or null", _digest_or_none),
        "error": ("text", lambda v: isinstance(v, str)),
        "mask_error": ("text", lambda v: isinstance(v, str)),
    }
    scored: dict[str, Check] = {}
    if classes:
        cls = (f"a class index in 0..{classes - 1}", lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v < classes)
        scored.update(target=cls, predicted=cls, probability=("a probability in [0, 1]", _unit))
    if "distance" in metrics:
        scored["distance"] = (f"{depth} lists of {heads} distances >= 0", lambda v: isinstance(v, list) and len(v) == depth and all(
            isinstance(h, list) and len(h) == heads and all(_number(d) and d >= 0 for d in h) for h in v))
    if "inside" in metrics:
        scored["first_top1"] = (f"a layer in 0..{depth} or null", lambda v: v is None or (
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= depth))
        scored["attribution"] = (f"{depth} lists of {heads} numbers", lambda v: isinstance(v, list) and len(v) == depth and all(
            isinstance(h, list) and len(h) == heads and all(_number(a) for a in h) for h in v))
    if text:
        scored["text"] = (f"a phrase of 1 to {MAX_TEXT_CHARS} characters", lambda v: isinstance(v, str) and 0 < len(v) <= MAX_TEXT_CHARS)
        scored["similarity"] = ("a number", _number)
    if protocol is not None and PROTOCOLS[protocol].kind == "chefer2021":
        area: Check = ("an area in [0, 90]", lambda v: _number(v) and -_SLACK <= v <= 90 + _SLACK)
        curve: Check = (f"a list of {steps + 1} hits, 0 or 1",
                        lambda v: isinstance(v, list) and len(v) == steps + 1 and all(_number(p) and p in (0, 1) for p in v))
    elif text:  # similarities: any finite number
        area = ("a finite area", _number)
        curve = (f"a list of {steps + 1} numbers", lambda v: isinstance(v, list) and len(v) == steps + 1 and all(_number(p) for p in v))
    else:
        area = ("an area in [0, 1]", _unit)
        curve = (f"a list of {steps + 1} probabilities in [0, 1]",
                 lambda v: isinstance(v, list) and len(v) == steps + 1 and all(_unit(p) for p in v))
    for method in (*methods, "random"):
        if "pointing" in metrics:
            scored[f"{method}_pointing"] = ("0, 1 or null", lambda v: v is None or (_number(v) and v in (0, 1)))
        for mode in CURVE_METRICS:
            if mode in metrics:
                scored[f"{method}_{mode}"] = area
                scored[f"{method}_{mode}_curve"] = curve
    return every, scored


def _row_problem(row: object, schema: tuple[dict[str, Check], dict[str, Check]]) -> str | None:
    """What is wrong with a shard row, or None."""
    if not isinstance(row, dict):
        return f"a row is a JSON object, this is a {type(row).__name__}"
    every, scored = schema
    for want in (every, scored if row.get("error") == "" else {}):
        missing = [k for k in want if k not in row]
        if missing:
            return f"missing {', '.join(map(repr, missing))}"
        for key, (what, test) in want.items():
            if not test(row[key]):
                return f"{key!r} is {json.dumps(row[key])[:60]}, not {what}"
    extra = sorted(k for k in row if k not in every and (row["error"] or k not in scored))
    if extra:
        return f"unexpected {', '.join(map(repr, extra))}"
    return None


def _unique() -> str:
    """A shard's name part no other run's can have: a run resumed in the same second by the same
    process must not append to a shard whose last line an interrupted run cut short."""
    return f"{os.getpid()}-{time.time_ns()}-{os.urandom(4).hex()}"


def _read_shards(folder: Path, schema) -> list[dict]:
    """Every row of every shard, in order. A last line cut short by an interrupted run is skipped (its
    image is scored again); any other line that is not a row of this run stops the merge.

    Raises:
        EvaluateError: naming the shard and the line.
    """
    rows = []
    for shard in sorted(folder.glob("*.jsonl")):
        lines = shard.read_text(errors="replace").split("\n")
        last = len(lines)  # the text after the final newline: "" unless the last write was cut short
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                if n == last:
                    continue
                problem = f"not JSON ({exc.msg})"
            else:
                problem = _row_problem(row, schema)
            if problem:
                raise EvaluateError(
                    f"{shard}, line {n}: {problem}. Every line of {folder} is merged into the results and this one is not "
                    f"a row of this run: move that file out of the folder (its images are scored again) or use another --out."
                )
            rows.append(row)
    return rows


def _read_all(row: dict, item: Item) -> bool:
    """Whether a row was scored from every byte it needed: its image's, and its mask's when the image
    was scored and has one. A file that could not be read (its permissions, a failing disk) has no
    digest in the row; a file the image gate refused has one."""
    if row["sha256"] is None:
        return False
    return bool(row["error"]) or item.mask is None or row["mask_sha256"] is not None


def _current(rows: list[dict], items: list[Item]) -> dict[int, dict]:
    """{index: row} for the images of `items` whose row was scored from the file as it is now (same
    relative path, same bytes, and the same mask's bytes); the others' are dropped.
    A row scored from every byte it needed wins over one that could not read a file."""
    where = {item.file: item for item in items}
    out = {}
    for row in rows:
        item = where.get(row["file"])
        if item is not None and row["stamp"] == item.stamp:
            kept = out.get(item.index)
            if kept is None or _read_all(row, item) or not _read_all(kept, item):
                out[item.index] = dict(row, index=item.index, path=item.path)
    return out


def _done(rows: list[dict], items: list[Item]) -> set[int]:
    """The images this run skips: those with a current row that read every file it needed (a file
    that could not be read is tried again)."""
    return {i for i, row in _current(rows, items).items() if _read_all(row, items[i])}


def _differ(a: str, b: str) -> bool:
    """Whether two digests of a file (`_content`) say its bytes changed; "?" (unreadable) says nothing."""
    return a != b and "?" not in (a, b)


def _changes(before: dict[str, str], now: dict[str, str]) -> str | None:
    """How the images, and the masks of the images in both lists, differ between two file lists
    ({relative path: stamp}), with an example of each kind. A file that could not be read when one
    list was made is not counted as changed: the next run reads it again anyway."""
    added = sorted(now.keys() - before.keys())
    removed = sorted(before.keys() - now.keys())
    both = sorted(now.keys() & before.keys())
    split = {f: (before[f].partition("|"), now[f].partition("|")) for f in both}  # (image stamp, "|", mask stamp)
    changed = [f for f in both if _differ(split[f][0][0], split[f][1][0])]
    masks = {
        "added": [f for f in both if not split[f][0][2] and split[f][1][2]],
        "removed": [f for f in both if split[f][0][2] and not split[f][1][2]],
        "changed": [f for f in both if split[f][0][2] and split[f][1][2] and _differ(split[f][0][2], split[f][1][2])],
    }
    if not (added or removed or changed or any(masks.values())):
        return None
    kinds = [(f"{what}", names) for what, names in (("added", added), ("removed", removed), ("changed", changed))]
    kinds += [(f"mask {what} for", names) for what, names in masks.items()]
    examples = "; ".join(f"{what} {names[0]}" for what, names in kinds if names)
    text = f"images added: {len(added)}, removed: {len(removed)}, changed: {len(changed)}"
    if any(masks.values()):
        text += f"; masks added: {len(masks['added'])}, removed: {len(masks['removed'])}, changed: {len(masks['changed'])}"
    return f"{text} ({examples})"
