"""A video model over a folder of clips: its accuracy, the pointing game of its maps in every tubelet,
deletion and insertion over space-time patches, and its mean attention distance in space and in time.

    python -m vitviz.video.shapes CLIPS --n 200                       # a folder of clips with masks to try
    python -m vitviz.evaluate CLIPS --model shapes_video --out results/

`python -m vitviz.evaluate` hands a video model (`shapes_video`, or an `hf:` TimeSformer, VideoMAE,
ViViT or V-JEPA 2) to `evaluate_clips`, on one process. CLIPS is a folder of clips (MP4, WebM, GIF,
animated WebP), searched recursively; in the ImageFolder layout (CLIPS/<class>/<clip>) the folder's
name is the clip's class, and the class explained and scored is that one when the model knows it
(else its top-1). Each clip passes the video gate (`vitviz.load_video`) with the model's frame count
and sampling, and is prepared as the model's spec says; one the gate refuses is an error in its row
and stops nothing.

Object masks are frames: CLIPS/masks/<the clip's relative path without its suffix>/<k>.png for source
frame k (0-based; any image format; white on the object; the size of the clip's frames). The frames
the model samples must each have one. A tubelet's mask is the union of its frames' masks.

Methods (`VIDEO_METHODS`): "rollout", the space-time rollout (`space_time_rollout_row`), and
"gradient", Chefer et al. 2021's relevance (`space_time_relevance`, for a model with a head; joint or
divided attention); each map is the cls token's row, or for a model without one the mean of the
patches' rows (query "pool"), [t, h, w] over the tubelets (`frame_maps`). Each clip runs one forward
recording its attention (whose logits are the prediction), then a forward and a backward for
"gradient" and (steps + 1) x 2 forwards per map for deletion and insertion. A "random" map is scored beside them: seeded by the
clip's relative path for deletion and insertion; for the pointing game its expected hit, the share of
patches whose centre lies in the dilated mask.

Metrics (`VIDEO_METRICS`; default all): "pointing" (per tubelet with an object, does the map's
argmax patch lie on it, the mask dilated by one patch, `vitviz.analysis.pointing_game`; a clip's
value is its share of hits), "deletion" and "insertion" (the target's probability as space-time
patches, a tubelet's frames x P x P pixels, are set to the mean colour or revealed in the map's order
in `steps` equal steps; the area by the trapezoidal rule, as `vitviz.faithfulness`), "distance" (mean
attention distance per layer and head in pixels and in frames, `mean_attention_distance_space_time`).
Every clip with a known class adds to the model's accuracy.

The run's folder holds run.json (settings, the files and their stamps: the sha256 of each clip's bytes
and of its masks'), rows.jsonl (a line a clip, appended as it is scored: a run started again skips
the clips already there, and one whose clip or masks changed is refused unless --rescan), and,
written from the rows at the end, per_clip.csv, summary.csv (mean and 95 % interval over the clips:
Wilson's for the accuracy and the pointing game, a clip's share of hits counted as its hit),
summary.md and distance.csv. --out follows the image evaluator's rules (outside CLIPS; new, empty, or
a run to resume). A model without a head is scored for its maps' pointing game and its distances.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from vitviz.analysis import pointing_chance, pointing_game
from vitviz.clips import MAX_BYTES as MAX_CLIP_BYTES, VideoError, clip_tensor, load_video
from vitviz.evaluate.data import FORMAT, EvaluateError, EvaluateWarning, _plural, _seed, mask_preprocessing
from vitviz.evaluate.figures import _cell, _normal_interval, _write_csv, wilson
from vitviz.evaluate.run import _check_out, _check_previous, _plain_rate, _previous, _whole, _write_json
from vitviz.faithfulness import _patch_mask, auc
from vitviz.images import MAX_BYTES as MAX_IMAGE_BYTES, ImageError, load_image
from vitviz.preprocess import Preprocessing, crop
from vitviz.video.analysis import frame_maps, mean_attention_distance_space_time, space_time_relevance, space_time_rollout_row
from vitviz.video.load import EMBEDDED_VIDEO_MODELS, load_video_model, video_spec
from vitviz.video.model import VideoViT

__all__ = ["VIDEO_METHODS", "VIDEO_METRICS", "CLIP_SUFFIXES", "VIDEO_MODELS", "ClipItem", "scan_clips", "evaluate_clips", "summarize_clips"]

VIDEO_METHODS = ("rollout", "gradient")
VIDEO_METRICS = ("distance", "pointing", "deletion", "insertion")
CLIP_SUFFIXES = {".mp4", ".webm", ".gif", ".webp"}
MASK_SUFFIXES = {".png", ".gif", ".webp", ".bmp", ".jpg", ".jpeg", ".tif", ".tiff"}
VIDEO_MODELS = EMBEDDED_VIDEO_MODELS  # by name; `hf:` names are read from their config
KIND = "clips"  # run.json's "kind": a run over clips


@dataclass(frozen=True)
class ClipItem:
    """One clip of CLIPS: its place in the sorted list, path, class (its first folder) or None, its
    mask frames {source frame index: path} (empty: no masks), its path relative to CLIPS, its stamp."""

    index: int
    path: str
    label: str | None
    masks: dict[int, str]
    file: str
    stamp: str = ""


def _content(paths: list[str]) -> str:
    """The sha256 of the files' bytes, in order, each cut where the gate stops reading; "?" if one cannot be read."""
    h = hashlib.sha256()
    try:
        for path in paths:
            with open(path, "rb") as f:
                h.update(f.read(MAX_CLIP_BYTES + 1))
    except OSError:
        return "?"
    return h.hexdigest()[:32]


def _mask_frames(folder: Path) -> dict[int, str]:
    """{frame index: path} of the mask frames in `folder`, named by their 0-based source frame index."""
    frames = {}
    for p in sorted(folder.iterdir()) if folder.is_dir() else ():
        if p.is_file() and p.suffix.lower() in MASK_SUFFIXES and p.stem.isdigit():
            frames.setdefault(int(p.stem), str(p))
    return frames


def scan_clips(root: str | Path, *, stamps: bool = True) -> list[ClipItem]:
    """Every clip under `root` (not under root/masks), sorted by path, with its class and mask frames."""
    root = Path(root)
    masks_root = root / "masks"
    paths = sorted(p for p in root.rglob("*") if p.suffix.lower() in CLIP_SUFFIXES and masks_root not in p.parents and p.is_file())
    items = []
    for i, p in enumerate(paths):
        rel = p.relative_to(root)
        masks = _mask_frames(masks_root / rel.with_suffix(""))
        stamp = ""
        if stamps:
            stamp = _content([str(p)]) + (f"|{_content([masks[k] for k in sorted(masks)])}" if masks else "")
        items.append(ClipItem(i, str(p), rel.parts[0] if len(rel.parts) > 1 else None, masks, rel.as_posix(), stamp))
    return items


def _check(data: Path, out: Path, *, methods, metrics, steps, batch_size, max_clips) -> None:
    for name in methods:
        if name not in VIDEO_METHODS:
            raise EvaluateError(f"unknown method {name!r} in --methods for a video model; its methods are {', '.join(VIDEO_METHODS)}")
    for name in metrics:
        if name not in VIDEO_METRICS:
            raise EvaluateError(f"unknown metric {name!r} in --metrics for a video model; its metrics are {', '.join(VIDEO_METRICS)}")
    if not metrics:
        raise EvaluateError(f"--metrics names no metric; name one or more of {', '.join(VIDEO_METRICS)}")
    if set(metrics) - {"distance"} and not methods:
        raise EvaluateError(f"--methods names no method, and pointing, deletion and insertion score methods' maps: name one or "
                            f"more of {', '.join(VIDEO_METHODS)}, or ask for --metrics distance only")
    if not _whole(steps) or steps < 2:
        raise EvaluateError(f"--steps is {steps}; a deletion or insertion curve takes 2 steps or more; the default is 16")
    if not _whole(batch_size) or batch_size < 1:
        raise EvaluateError(f"--batch-size is {batch_size}; for clips it is the perturbed clips in a forward, 1 or more")
    if max_clips is not None and (not _whole(max_clips) or max_clips < 1):
        raise EvaluateError(f"--max-images is {max_clips}; a run stops after that many new clips, 1 or more")
    if not data.is_dir():
        raise EvaluateError(f"{data} is not a folder: DATA is a folder of clips (DATA/<class>/<clip> gives classes); "
                            f"python -m vitviz.video.shapes {data} --n 100 writes one to try")
    _check_out(data, out)


def _read_clip(data: bytes, item: ClipItem, spec, mask_pre: Preprocessing) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """(the clip as the model takes it [T, 3, S, S], its tubelets' masks bool [t, S, S] or None, the
    masks' error or ""); raises VideoError for a clip the gate refuses."""
    loaded = load_video(data, frames=spec.frames, sampling=spec.sampling, stride=spec.frame_stride)
    x = clip_tensor(loaded, spec.preprocessing)
    if not item.masks:
        return x, None, ""
    height, width = loaded.frames.shape[1:3]
    frames = []
    try:
        for k in loaded.indices:
            if k not in item.masks:
                raise ImageError(f"no mask for source frame {k} (the model samples frames {list(loaded.indices)}): "
                                 f"expected masks/{Path(item.file).with_suffix('').as_posix()}/{k}.png")
            with open(item.masks[k], "rb") as f:
                mask = load_image(f.read(MAX_IMAGE_BYTES + 1))
            if mask.size != (width, height):
                raise ImageError(f"mask frame {k} is {mask.width}x{mask.height} px and its clip's frames {width}x{height} px")
            frames.append(torch.from_numpy(np.asarray(crop(mask.convert("L"), mask_pre)) > 127))
    except (ImageError, OSError) as exc:
        return x, None, f"masks of {item.file}: {exc}"
    stacked = torch.stack(frames)
    return x, stacked.reshape(-1, spec.config.tubelet, *stacked.shape[1:]).any(dim=1), ""


def _curves(model: VideoViT, x: torch.Tensor, maps: torch.Tensor, target: int, *, steps: int, batch_size: int) -> dict[str, torch.Tensor]:
    """{"deletion", "insertion": the target's probability [steps + 1]} as the clip's space-time patches
    go (set to 0, the mean colour, or revealed from 0) in decreasing order of `maps` [t, h, w]."""
    c = model.config
    t, h, w = maps.shape
    m = t * h * w
    order = maps.reshape(1, m).float().cpu().argsort(dim=1, descending=True, stable=True)  # (on the CPU: ties broken alike on any device)
    counts = torch.round(torch.arange(steps + 1) / steps * m).long()
    gone = _patch_mask(order, counts, (t, h, w), (c.tubelet, c.patch_size, c.patch_size))[0]  # [S + 1, T, S, S]: taken at each step
    out = {}
    with torch.no_grad():
        for mode in ("deletion", "insertion"):
            keep = (~gone if mode == "deletion" else gone).to(x.device, x.dtype)  # [S + 1, T, S, S]
            probs = []
            for i in range(0, steps + 1, batch_size):
                clips = x[None] * keep[i : i + batch_size, :, None]
                probs.append(model(clips).float().softmax(-1)[:, target].cpu())
            out[mode] = torch.cat(probs)
    out["fractions"] = counts.float() / m
    return out


def _score(model: VideoViT, item: ClipItem, target_of: dict[str, int | None], *, methods, metrics, steps: int, batch_size: int,
           mask_pre: Preprocessing) -> dict:
    """One clip's row (its error when the gate refuses it)."""
    spec, c = model.spec, model.config
    row = dict(file=item.file, label=item.label, stamp=item.stamp, sha256=None, error="", mask_error="")
    try:
        with open(item.path, "rb") as f:
            data = f.read(MAX_CLIP_BYTES + 1)
    except OSError as exc:
        row["error"] = f"the file cannot be read ({exc.strerror or exc})"  # no digest: scored again by the next run
        return row
    row["sha256"] = hashlib.sha256(data).hexdigest()[:32]
    try:
        x, masks, row["mask_error"] = _read_clip(data, item, spec, mask_pre)
    except VideoError as exc:  # the gate's refusal, or frames too elongated for the model's crop
        row["error"] = str(exc)  # kept while the clip is unchanged
        return row
    device = next(model.parameters()).device
    x = x.to(device)
    attention = model.attention(x)  # the forward that records it gives the logits too
    target = None
    if spec.has_head:
        probs = attention.logits.float().softmax(-1).cpu()
        known = target_of.get(item.label) if item.label is not None else None
        target = known if known is not None else int(probs.argmax())
        row.update(target=target, predicted=int(probs.argmax()), probability=float(probs[target]),
                   correct=None if known is None else bool(int(probs.argmax()) == known))
    if "distance" in metrics:
        space, frames = mean_attention_distance_space_time(attention, attention.grid, c.patch_size, c.tubelet)
        row.update(distance_space=space.tolist(), distance_time=frames.tolist())
    if not set(metrics) & {"pointing", "deletion", "insertion"}:
        return row
    query = 0 if attention.num_prefix_tokens else "pool"
    maps = {}
    for method in methods:
        if method == "rollout":
            maps[method] = frame_maps(space_time_rollout_row(attention, query=query), attention.grid).cpu()
        else:
            maps[method] = frame_maps(space_time_relevance(model, x, target, query=query)[0], attention.grid).cpu()
    generator = torch.Generator().manual_seed(_seed(item.file))
    maps["random"] = torch.rand(attention.grid, generator=generator)
    if "pointing" in metrics and masks is not None:
        present = masks.flatten(1).any(dim=1)
        row["tubelets_with_object"] = int(present.sum())
        for method, m in maps.items():
            if not present.any():
                row[f"{method}_pointing"] = None
            elif method == "random":
                row[f"{method}_pointing"] = float(pointing_chance(masks[present], patch_size=c.patch_size).mean())
            else:
                row[f"{method}_pointing"] = float(pointing_game(m[present], masks[present], patch_size=c.patch_size).float().mean())
    if {"deletion", "insertion"} & set(metrics):
        for method, m in maps.items():
            curves = _curves(model, x, m.to(device), target, steps=steps, batch_size=batch_size)
            for mode in ("deletion", "insertion"):
                if mode in metrics:
                    row[f"{method}_{mode}"] = float(auc(curves["fractions"], curves[mode]))
                    row[f"{method}_{mode}_curve"] = curves[mode].tolist()
    return row


def _read_rows(path: Path, items: list[ClipItem]) -> dict[str, dict]:
    """{file: its last row} of rows.jsonl for the clips of `items` whose stamp it was scored from (a
    row of a clip that could not be read is scored again)."""
    stamps = {item.file: item.stamp for item in items}
    rows = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut short by a stop: its clip is scored again
            if isinstance(row, dict) and stamps.get(row.get("file")) == row.get("stamp") and row.get("sha256") is not None:
                rows[row["file"]] = row
    return rows


def _summary(rows: list[dict], methods, metrics) -> list[dict]:
    """[{method, metric, n, mean, ci95_low, ci95_high}]: the model's accuracy and distances, then each method's metrics."""
    scored = [r for r in rows if not r["error"]]
    out = []

    def add(method, metric, values, proportion=False):
        if not values:
            return
        n = len(values)
        mean = float(np.mean(values))
        low, high = wilson(sum(values), n) if proportion else _normal_interval(values)[1:]
        out.append(dict(method=method, metric=metric, n=n, mean=mean, ci95_low=float(low), ci95_high=float(high)))

    add("model", "accuracy", [float(r["correct"]) for r in scored if r.get("correct") is not None], proportion=True)
    if "distance" in metrics:
        add("model", "distance_space", [float(np.mean(r["distance_space"])) for r in scored if r.get("distance_space")])
        add("model", "distance_time", [float(np.mean(r["distance_time"])) for r in scored if r.get("distance_time")])
    for method in (*methods, "random"):
        for metric in ("pointing", "deletion", "insertion"):
            if metric in metrics:
                add(method, metric, [r[f"{method}_{metric}"] for r in scored if r.get(f"{method}_{metric}") is not None],
                    proportion=metric == "pointing")
    return out


def summarize_clips(out: str | Path) -> list[dict]:
    """The summary of a finished run over clips, from its rows (what summary.csv holds)."""
    out = Path(out)
    run = json.loads((out / "run.json").read_text())
    items = [ClipItem(i, "", None, {}, file, stamp) for i, (file, stamp) in enumerate(run["files"].items())]
    rows = _read_rows(out / "rows.jsonl", items)
    return _summary([rows[item.file] for item in items if item.file in rows], run["methods"], run["metrics"])


def _write(out: Path, rows: list[dict], summary: list[dict], run: dict) -> None:
    methods, metrics = run["methods"], run["metrics"]
    columns = ["file", "label", "error", "mask_error", "target", "predicted", "probability", "correct"]
    if "distance" in metrics:
        columns += ["distance_space_mean", "distance_time_mean"]
    columns += [f"{m}_{k}" for m in (*methods, "random") for k in ("pointing", "deletion", "insertion") if k in metrics]
    flat = []
    for row in rows:
        values = dict(row)
        if row.get("distance_space"):
            values.update(distance_space_mean=float(np.mean(row["distance_space"])), distance_time_mean=float(np.mean(row["distance_time"])))
        flat.append(["" if values.get(k) is None else values[k] for k in columns])
    _write_csv(out / "per_clip.csv", columns, flat)
    keys = ["method", "metric", "n", "mean", "ci95_low", "ci95_high"]
    _write_csv(out / "summary.csv", keys, ([r[k] for k in keys] for r in summary))
    lines = ["| method | metric | clips | mean | 95 % interval |", "|---|---|---|---|---|"]
    units = {"distance_space": " px", "distance_time": " frames"}
    for r in summary:
        if r["metric"] in ("accuracy", "pointing"):
            fmt = lambda v: f"{100 * v:.1f} %"  # noqa: E731
        else:
            fmt = lambda v, u=units.get(r["metric"], ""): f"{v:.3f}{u}"  # noqa: E731
        lines.append(f"| {_cell(r['method'])} | {r['metric']} | {r['n']} | {fmt(r['mean'])} | {fmt(r['ci95_low'])} to {fmt(r['ci95_high'])} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    spaces = [r["distance_space"] for r in rows if not r["error"] and r.get("distance_space")]
    if spaces:
        space = np.asarray(spaces, dtype=np.float64).mean(0)
        frames = np.asarray([r["distance_time"] for r in rows if not r["error"] and r.get("distance_time")], dtype=np.float64).mean(0)
        _write_csv(out / "distance.csv", ["layer", "head", "space_px", "time_frames", "clips"],
                   ([layer + 1, head + 1, f"{space[layer, head]:.4f}", f"{frames[layer, head]:.4f}", len(spaces)]
                    for layer in range(space.shape[0]) for head in range(space.shape[1])))


def evaluate_clips(
    data: str | Path,
    *,
    model: str,
    out: str | Path,
    methods: tuple[str, ...] = VIDEO_METHODS,
    metrics: tuple[str, ...] | None = None,
    steps: int | None = None,
    batch_size: int = 32,
    max_clips: int | None = None,
    compare: bool = True,
    progress: bool = True,
    rescan: bool = False,
) -> list[dict] | None:
    """Scores every clip of `data` (see the module's doc) and returns the summary rows.

    Raises:
        EvaluateError: a mistake in the arguments, an `out` the image evaluator would refuse too, a run
            in `out` with other settings or (without `rescan`) on clips that changed, all before
            anything is written; or (status 1) a run none of whose clips could be scored.

    Warns:
        EvaluateWarning: the pointing game left out (no masks) for some or all clips.
    """
    data, out = Path(data), Path(out)
    metrics = VIDEO_METRICS if metrics is None else tuple(metrics)
    steps = 16 if steps is None else steps
    methods = tuple(methods)
    _check(data, out, methods=methods, metrics=metrics, steps=steps, batch_size=batch_size, max_clips=max_clips)
    try:
        spec = video_spec(model)  # the refusals below before any weights are read
    except ValueError:
        raise EvaluateError(f"--model: {model} is not a video model (the video models: {', '.join(VIDEO_MODELS)}, or hf: TimeSformer, "
                            f"VideoMAE, ViViT, V-JEPA 2)") from None
    if "gradient" in methods and not spec.has_head:
        raise EvaluateError(f"--methods gradient: Chefer et al.'s relevance explains a class, and {spec.name} has no head: use "
                            f"--methods rollout")
    if not spec.has_head and {"deletion", "insertion"} & set(metrics):
        raise EvaluateError(f"{spec.name} has no classifier: deletion and insertion measure a class probability; leave them out")
    items = scan_clips(data)
    net = load_video_model(model, device="cuda" if torch.cuda.is_available() else "cpu")
    if not items:
        raise EvaluateError(f"no clips ({', '.join(sorted(CLIP_SUFFIXES))}) under {data}: put clips there (DATA/<class>/<clip> gives "
                            f"classes), or write some with python -m vitviz.video.shapes {data} --n 100")
    notes = []
    if "pointing" in metrics and not any(item.masks for item in items):
        example = f"masks/{Path(items[0].file).with_suffix('').as_posix()}/0.png"
        notes.append(f"pointing skipped: it needs object masks and {data} has none (each clip's frame k at DATA/{example}-style paths)")
    for note in notes:
        warnings.warn(note, EvaluateWarning, stacklevel=2)
    run = dict(format=FORMAT, kind=KIND, data=str(data), model=model, protocol=None, methods=list(methods), metrics=list(metrics),
               steps=steps, batch_size=batch_size, text=None, captions=None, images=len(items),
               files={item.file: item.stamp for item in items})
    before = _previous(out)
    _check_previous(out, before, run, rescan=rescan)
    out.mkdir(parents=True, exist_ok=True)
    sessions = list(before.get("sessions", [])) if before else []
    _write_json(out / "run.json", dict(run, sessions=sessions))
    rows_path = out / "rows.jsonl"
    done = _read_rows(rows_path, items)
    categories = spec.categories or ()
    target_of = {item.label: (list(categories).index(item.label) if item.label in categories else None) for item in items}
    mask_pre = mask_preprocessing(spec.preprocessing)
    todo = [item for item in items if item.file not in done]
    if max_clips is not None:
        todo = todo[:max_clips]
    from tqdm import tqdm

    start = time.perf_counter()
    scored = failed = 0
    with open(rows_path, "a") as f:
        for item in tqdm(todo, unit="clip", disable=not progress):
            row = _score(net, item, target_of, methods=methods, metrics=metrics, steps=steps, batch_size=batch_size, mask_pre=mask_pre)
            if not row["error"] and not all(math.isfinite(v) for k, v in row.items() if isinstance(v, float)):
                row = {k: row[k] for k in ("file", "label", "stamp", "sha256", "mask_error")} | {"error": "the results are not finite"}
            f.write(json.dumps(row) + "\n")
            f.flush()
            done[item.file] = row
            failed += bool(row["error"])
            scored += not row["error"]
    seconds = time.perf_counter() - start
    plain = None
    if compare and scored:  # one clip a forward, as the run takes them
        device = next(net.parameters()).device
        plain = _plain_rate(net, torch.zeros(1, spec.frames, 3, spec.image_size, spec.image_size), 3, device)
    rows = [done[item.file] for item in items if item.file in done]
    summary = _summary(rows, methods, metrics)
    _write(out, rows, summary, run)
    if "pointing" in metrics and items and any(item.masks for item in items):
        missing = sum(1 for r in rows if not r["error"] and r.get("mask_error"))
        if missing:
            note = f"pointing left out for {_plural(missing, 'clip')} whose masks could not be read (per_clip.csv, column mask_error)"
            warnings.warn(note, EvaluateWarning, stacklevel=2)
            notes.append(note)
    if scored + failed:
        sessions.append(dict(world_size=1, device=str(next(net.parameters()).device), scored=scored, failed=failed, seconds=seconds,
                             images_per_second=(scored + failed) / max(seconds, 1e-9), plain_forward_images_per_second=plain))
    good = sum(1 for r in rows if not r["error"])
    run.update(scored=good, failed=len(rows) - good, scored_now=scored, failed_now=failed, warnings=notes, sessions=sessions)
    _write_json(out / "run.json", run)
    if rows and not good and len(rows) == len(items):
        raise EvaluateError(f"none of the {_plural(len(items), 'clip')} could be scored (e.g. {rows[0]['file']}: {rows[0]['error']}); "
                            f"each one's error is in {out / 'per_clip.csv'}, column error", status=1)
    return summary

