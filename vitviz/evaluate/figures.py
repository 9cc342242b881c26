"""Dataset figures, from the merged rows in file order: summary.csv, per_image.csv, distance and curves."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch

from vitviz import plots
from vitviz.analysis import uniform_attention_distance
from vitviz.evaluate.data import CURVE_METRICS, PROTOCOLS, Z95, _plural


def _scores(rows, methods, metrics) -> dict[tuple[str, str], list[float]]:
    """{(method, metric): values}, method "model" for the distance."""
    out: dict[tuple[str, str], list[float]] = {}
    for row in rows:
        if row.get("error"):
            continue
        if "distance" in metrics and row.get("distance") is not None:
            out.setdefault(("model", "distance"), []).append(float(np.mean(row["distance"])))
        if "inside" in metrics and "first_top1" in row:
            _inside_scores(out, None if row["first_top1"] is None else float(row["first_top1"]))
        for method in (*methods, "random"):
            for metric in ("pointing", *CURVE_METRICS):
                value = row.get(f"{method}_{metric}")
                if metric in metrics and value is not None:
                    out.setdefault((method, metric), []).append(float(value))
    return out


def _inside_scores(out: dict[tuple[str, str], list[float]], first: float | None) -> None:
    """Adds a scored image's first_top1 layer (None: never) to ("model", "first_top1"), which counts
    the images where the class comes top-1, and 0 or 1 to ("model", "never_top1"), which counts every image."""
    if first is not None:
        out.setdefault(("model", "first_top1"), []).append(first)
    out.setdefault(("model", "never_top1"), []).append(float(first is None))


PROPORTIONS = ("pointing", "never_top1")  # metrics that are shares of the images: Wilson's interval


def wilson(hits: float, n: float, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion hits/n: it stays inside [0, 1], also at 0 % and 100 %."""
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def _summary_rows(values: dict[tuple[str, str], list[float]], order: list[tuple[str, str]]) -> list[dict]:
    """(method, metric) -> values as rows with the mean and its 95 % interval: Wilson's for the
    pointing game (a proportion), else the normal one, mean ± 1.96 s / sqrt(n). The sums are exact
    (`math.fsum`): the figures do not depend on the order of the values."""
    rows = []
    for method, metric in order:
        v = values.get((method, metric), [])
        n = len(v)
        if n == 0:
            continue
        if metric in PROPORTIONS:
            mean = math.fsum(v) / n
            low, high = wilson(math.fsum(v), n)
        else:
            mean, low, high = _normal_interval(v)
        rows.append(dict(method=method, metric=metric, n=n, mean=mean, ci95_low=low, ci95_high=high))
    return rows


def _normal_interval(v: list[float]) -> tuple[float, float, float]:
    """(mean, low, high) of values: mean ± 1.96 s / sqrt(n), the sums exact (`math.fsum`)."""
    n = len(v)
    mean = math.fsum(v) / n
    var = math.fsum((x - mean) ** 2 for x in v) / (n - 1) if n > 1 else 0.0
    half = Z95 * math.sqrt(var / n)
    return mean, mean - half, mean + half


def _order(methods, metrics):
    out = [("model", "distance")] if "distance" in metrics else []
    out += [("model", "first_top1"), ("model", "never_top1")] if "inside" in metrics else []
    return out + [(m, k) for m in (*methods, "random") for k in ("pointing", *CURVE_METRICS) if k in metrics]


def _columns(methods, metrics, *, text: bool = False) -> list[str]:
    columns = ["index", "path", "label", "error", "mask_error"]
    columns += ["text", "similarity"] if text else ["target", "predicted", "probability"]
    if "distance" in metrics:
        columns.append("distance_mean")
    if "inside" in metrics:
        columns.append("first_top1")
    columns += [f"{m}_{k}" for m, k in _order(methods, metrics) if m != "model"]
    return columns + ["sha256", "mask_sha256"]


def summarize_images(out: str | Path) -> list[dict]:
    """The summary of a finished run, from its per_image.csv: [{method, metric, n, mean, ci95_low, ci95_high}]."""
    out = Path(out)
    run = json.loads((out / "run.json").read_text())
    with open(out / "per_image.csv", newline="") as f:
        table = list(csv.DictReader(f))
    order = _order(run["methods"], run["metrics"])
    values: dict[tuple[str, str], list[float]] = {}
    for row in table:
        if row["error"]:
            continue
        if "inside" in run["metrics"]:
            _inside_scores(values, float(row["first_top1"]) if row["first_top1"] else None)
        for method, metric in order:
            if metric in ("first_top1", "never_top1"):
                continue
            value = row.get("distance_mean" if method == "model" else f"{method}_{metric}", "")
            if value:
                values.setdefault((method, metric), []).append(float(value))
    return _summary_rows(values, order)


FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")  # what makes a spreadsheet read a cell as a formula (OWASP's CSV injection)
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?|[+-]?(?:inf|nan)")


def _cell(value: object) -> object:
    """A CSV cell a spreadsheet reads as text: text that starts with one of `FORMULA_STARTS` gets a
    leading "'" (OWASP's rule); numbers, also those already written as text ("-0.25"), are as they are."""
    if isinstance(value, str) and value.startswith(FORMULA_STARTS) and not _NUMBER.fullmatch(value):
        return "'" + value
    return value


def _write_csv(path: Path, columns: list[str], rows: Iterable[Sequence]) -> None:
    """A CSV file with a header, every cell through `_cell`: how every CSV file of a run is written."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([_cell(c) for c in columns])
        w.writerows([_cell(v) for v in row] for row in rows)


def _write_outputs(out: Path, rows: list[dict], run: dict, spec) -> list[dict]:
    """per_image.csv, summary.csv/.md, distance.csv/.png, heads.csv ("inside"), curves.csv and (for
    class probabilities) curves.png from the merged rows (sorted by index); returns the summary rows."""
    methods, metrics, steps = run["methods"], run["metrics"], run["steps"]
    protocol, text = run.get("protocol"), bool(run.get("text") or run.get("captions"))
    columns = _columns(methods, metrics, text=text)

    def flat(row: dict) -> list:
        values = {k: row.get(k) for k in columns}
        if row.get("distance") is not None:
            values["distance_mean"] = float(np.mean(row["distance"]))
        return ["" if v is None else v for v in values.values()]

    _write_csv(out / "per_image.csv", columns, (flat(row) for row in rows))
    summary = _summary_rows(_scores(rows, methods, metrics), _order(methods, metrics))
    summary_columns = ["method", "metric", "n", "mean", "ci95_low", "ci95_high"]
    _write_csv(out / "summary.csv", summary_columns, ([r[c] for c in summary_columns] for r in summary))
    lines = ["| method | metric | images | mean | 95 % interval |", "|---|---|---|---|---|"]
    for r in summary:
        pct = r["metric"] in PROPORTIONS
        two = r["metric"] in ("distance", "positive", "negative", "first_top1")  # Chefer et al.'s areas x 100
        fmt = (lambda v: f"{100 * v:.1f} %") if pct else (lambda v: f"{v:.2f}{' px' if r['metric'] == 'distance' else ''}" if two
                                                           else f"{v:.3f}")
        mean = fmt(r["mean"]) + (f" ({_plural(round(r['mean'] * r['n']), 'image')})" if r["metric"] == "never_top1" else "")
        lines.append(f"| {r['method']} | {r['metric']} | {r['n']} | {mean} | {fmt(r['ci95_low'])} to {fmt(r['ci95_high'])} |")
    scored = [r for r in rows if not r.get("error")]
    attributions = [r["attribution"] for r in scored if r.get("attribution") is not None]
    if "inside" in metrics and attributions:
        lines += _write_heads(out / "heads.csv", attributions)
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    distances = [r["distance"] for r in scored if r.get("distance") is not None]
    if "distance" in metrics and distances:
        stack = np.asarray(distances, dtype=np.float64)  # [images, L, H], in file order
        n, mean, sd = len(stack), stack.mean(0), stack.std(0)
        _write_csv(out / "distance.csv", ["layer", "head", "mean_distance_px", "sd_px", "images"],
                   ([layer + 1, head + 1, f"{mean[layer, head]:.4f}", f"{sd[layer, head]:.4f}", n]
                    for layer in range(mean.shape[0]) for head in range(mean.shape[1])))
        fig = plots.distance_figure(torch.from_numpy(mean), uniform=uniform_attention_distance(spec.grid, patch_size=spec.patch_size),
                                    title=f"{spec.name}: mean attention distance over {n} images")
        plots.figure_to_image(fig).save(out / "distance.png")
    curves = {}
    for method in (*methods, "random"):
        for mode in CURVE_METRICS:
            with_curve = [r[f"{method}_{mode}_curve"] for r in scored if r.get(f"{method}_{mode}_curve") is not None]
            if mode in metrics and with_curve:
                curves[(method, mode)] = np.asarray(with_curve, dtype=np.float64).mean(0)
    if curves:
        if protocol is not None:
            fractions = PROTOCOLS[protocol].fractions(spec.image_size)
        else:
            fractions = _fractions(steps, spec.grid[0] * spec.grid[1])
        images = {key: sum(1 for r in scored if r.get(f"{key[0]}_{key[1]}_curve") is not None) for key in curves}
        _write_csv(out / "curves.csv", ["method", "metric", "step", "fraction", "mean", "images"],
                   ([method, mode, i, float(fractions[i]), float(v), images[(method, mode)]]
                    for (method, mode), mean in curves.items() for i, v in enumerate(mean)))
        if protocol is None and not text:
            # over the fractions really removed, as the areas in summary.csv: the legend's areas are the table's
            fig = plots.curves_figure(curves, fractions=fractions, title=f"{spec.name}: mean over the images")
            plots.figure_to_image(fig).save(out / "curves.png")
    return summary


def _write_heads(path: Path, attributions: list[list[list[float]]], top: int = 5) -> list[str]:
    """heads.csv from the images' direct logit attributions of their class per head ([L][H] each, in
    file order): per head its mean over the images and the normal 95 % interval; returns the lines of
    summary.md that list the `top` heads of the highest mean."""
    n, depth, heads = len(attributions), len(attributions[0]), len(attributions[0][0])
    table = []
    for layer in range(depth):
        for head in range(heads):
            mean, low, high = _normal_interval([float(a[layer][head]) for a in attributions])
            table.append(dict(layer=layer, head=head, mean_attribution=mean, ci95_low=low, ci95_high=high, images=n))
    _write_csv(path, list(table[0]), (list(r.values()) for r in table))
    best = sorted(table, key=lambda r: (-r["mean_attribution"], r["layer"], r["head"]))[:top]
    lines = ["", f"The {len(best)} heads that write the class's logit most (mean direct logit attribution over {_plural(n, 'image')}; "
             f"layer and head counted from 0, as vitviz.ablate takes them; every head in {path.name}):", "",
             "| layer | head | mean attribution | 95 % interval |", "|---|---|---|---|"]
    return lines + [f"| {r['layer']} | {r['head']} | {r['mean_attribution']:+.3f} | {r['ci95_low']:+.3f} to {r['ci95_high']:+.3f} |"
                    for r in best]


def _fractions(steps: int, patches: int) -> np.ndarray:
    """The x of a deletion or insertion curve's points [steps + 1]: the share of the patches removed
    (or revealed) after each step, round(i * patches / steps) / patches, counted as
    `vitviz.faithfulness.perturbation_curves` counts them (its areas are over these)."""
    counts = torch.round(torch.arange(steps + 1) / steps * patches).long()
    return counts.double().numpy() / patches
