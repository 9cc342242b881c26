"""The run: its arguments checked before anything is written, one process or many, and what it records."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from vitviz.architectures import attention_of
from vitviz.evaluate.batch import _classes, _score, _tower
from vitviz.evaluate.data import (
    EARLIER_FORMATS, EXTRA_METRICS, EvalDataset, EvaluateError, EvaluateWarning, FORMAT, Item, MAX_CAPTIONS_BYTES, MAX_TEXT_CHARS, METRICS, PROTOCOLS, SUFFIXES,
    _Batches, _collate, _digest, _plural, _stamped, scan,
)
from vitviz.evaluate.figures import _write_outputs
from vitviz.evaluate.shards import _changes, _current, _done, _read_shards, _row_problem, _row_schema, _unique
from vitviz.explainers import method as registered_method, methods as registered_methods
from vitviz.imagetext import ImageTextModel
from vitviz.model import ViT


def _setup() -> tuple[int, int, torch.device]:
    """(rank, world size, device): from torchrun's environment when it started us, else one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _all_sum(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    if not dist.is_initialized():
        return values
    t = values.to(device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.cpu()


def _differentiates(methods, metrics, protocol) -> bool:
    """Whether the run's pass is a forward and a backward: maps of a gradient method are scored."""
    wants_maps = protocol is not None or bool({"pointing", "deletion", "insertion"} & set(metrics))
    return wants_maps and any(registered_method(m).needs_gradients or registered_method(m).needs_layer_gradients for m in methods)


def _plain_pass(model: ViT, x: torch.Tensor, *, backward: bool = False) -> None:
    """One plain batched forward of `x`, nothing recorded; with `backward`, followed by the backward of
    the top logits' sum to the input (what any gradient of the batch costs: no weight's gradient)."""
    with torch.inference_mode(not backward), torch.set_grad_enabled(backward):
        if not backward:
            model(x)
            return
        inp = x.clone().requires_grad_(True)
        torch.autograd.grad(model(inp).amax(dim=-1).sum(), inp)


def _plain_rate(model: ViT, x: torch.Tensor, batches: int, device: torch.device, *, backward: bool = False) -> float:
    """Images per second of `_plain_pass` on every rank at once (summed over the ranks)."""
    x = x.to(device)
    _plain_pass(model, x, backward=backward)  # warm-up
    _barrier()
    start = time.perf_counter()
    for _ in range(batches):
        _plain_pass(model, x, backward=backward)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    rate = torch.tensor([batches * x.shape[0] / seconds], dtype=torch.float64)
    return float(_all_sum(rate, device))


def _write_json(path: Path, value: dict) -> None:
    """`value` as `path`, replaced at once: an interrupted write leaves the previous file."""
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(value, indent=1))
    os.replace(part, path)


def _previous(out: Path) -> dict | None:
    """The run.json of the run in `out`, or None."""
    path = out / "run.json"
    if not path.exists():
        return None
    try:
        before = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise EvaluateError(f"{path} cannot be read ({exc}); use another --out") from None
    if not isinstance(before, dict) or not {"model", "methods", "metrics"} <= before.keys():
        raise EvaluateError(f"{path} is not a run.json of vitviz.evaluate: the results would overwrite what is in {out}; "
                            f"use another --out (an empty or new folder)")
    return before


def _check_previous(out: Path, before: dict | None, run: dict, *, rescan: bool) -> None:
    """Raises EvaluateError unless `out` holds no run, or a run of these settings on the same files
    (on other files, with `rescan`).

    Raises:
        EvaluateError: other settings, another format, or DATA changed without `rescan`.
    """
    if before is None:
        return
    found = before.get("format", 1)  # format 1 had no such key
    if found != FORMAT:
        later = isinstance(found, int) and found > FORMAT
        why = (EARLIER_FORMATS.get(found) if isinstance(found, int) else None) or f"this one reads format {FORMAT}"
        raise EvaluateError(f"{out} holds a run written by {'a later' if later else 'an earlier'} vitviz.evaluate (format {found}: "
                            f"{why}); use another --out")
    settings = ("data", "model", "protocol", "methods", "metrics", "steps", "batch_size", "text", "captions")
    differ = [f"{k} {before.get(k)!r} there, {run[k]!r} here" for k in settings if before.get(k) != run[k]]
    if differ:
        raise EvaluateError(f"{out} holds a run with other settings ({'; '.join(differ)}): use another --out, one per model and settings")
    changes = _changes(before.get("files", {}), run["files"])
    if changes and not rescan:
        raise EvaluateError(
            f"the images under {run['data']} changed since the run in {out} began: {changes} (changed: an image's bytes; "
            f"a mask's likewise). Run again with --rescan to score what is new or changed "
            f"and drop the rows of what is gone, or use another --out."
        )


def _whole(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_protocol(protocol: str, *, metrics, steps, text, captions) -> None:
    """Raises EvaluateError for an unknown protocol, or one asked for with settings it fixes itself."""
    if protocol not in PROTOCOLS:
        raise EvaluateError(f"unknown protocol {protocol!r} in --protocol; the protocols are {', '.join(PROTOCOLS)}")
    p = PROTOCOLS[protocol]
    steps_of = "0 %, 10 %, ..., 90 % of the pixels" if p.kind == "chefer2021" else "S pixels a step, S + 1 points on S x S images"
    fixed = f"its metrics ({', '.join(p.metrics)}) and its steps ({steps_of})"
    given = [name for name, value in (("--metrics", metrics), ("--steps", steps)) if value is not None]
    if given:
        raise EvaluateError(f"--protocol {protocol} fixes {fixed}: leave out {' and '.join(given)}, or leave out --protocol "
                            f"to choose them")
    if text is not None or captions is not None:
        raise EvaluateError(f"--protocol {protocol} scores a classifier's classes; a phrase (--text, --captions) is scored "
                            f"without --protocol, with --metrics pointing,deletion,insertion")


def _check_text(text: str | None, captions: str | Path | None) -> None:
    """Raises EvaluateError for --text and --captions together, or a --text that is no phrase."""
    if text is not None and captions is not None:
        raise EvaluateError("--text gives every image one phrase and --captions each image its own: give one of them")
    if text is not None:
        if not isinstance(text, str) or not text.strip():
            raise EvaluateError("--text is empty; it is the phrase every image is scored against, e.g. --text 'a red star'")
        if len(text) > MAX_TEXT_CHARS:
            raise EvaluateError(f"--text is {len(text):,} characters; a phrase is at most {MAX_TEXT_CHARS:,} (the text towers read "
                                f"77 tokens or fewer)")


def _check_arguments(data: Path, out: Path, *, methods, metrics, steps, batch_size, workers, max_images, protocol=None, text=None,
                     captions=None) -> None:
    """Raises EvaluateError (status 2) for a mistake in the arguments, before anything is loaded or read."""
    phrases = text is not None or captions is not None
    if protocol is not None:
        _check_protocol(protocol, metrics=metrics, steps=steps, text=text, captions=captions)
        metrics, steps = PROTOCOLS[protocol].metrics, 16
    metrics = METRICS if metrics is None else metrics
    steps = 16 if steps is None else steps
    _check_text(text, captions)
    for name in metrics:
        if name not in METRICS + EXTRA_METRICS and protocol is None:
            raise EvaluateError(f"unknown metric {name!r} in --metrics; the metrics are {', '.join(METRICS + EXTRA_METRICS)}")
    if "inside" in metrics and phrases:
        raise EvaluateError("--metrics inside reads a classifier's logit lens and the attribution of its class; with --text or "
                            "--captions the model explains a phrase: leave out inside, or use a classifier")
    known = registered_methods()  # plugins (VITVIZ_PLUGINS, the "vitviz.methods" entry points) included
    for name in methods:
        if name not in known:
            raise EvaluateError(f"unknown method {name!r} in --methods; the methods are {', '.join(known)}")
        if registered_method(name).needs_text and not phrases:
            raise EvaluateError(f"--methods {name} explains a phrase: give an image–text model one with --text or --captions")
        if "classifier" in registered_method(name).needs and phrases:
            raise EvaluateError(f"--methods {name} explains a class; with --text or --captions the maps explain a phrase")
    if not metrics:
        raise EvaluateError(f"--metrics names no metric; name one or more of {', '.join(METRICS)}")
    on_maps = [m for m in metrics if m not in ("distance", "inside")]
    if on_maps and not methods:
        raise EvaluateError(f"--methods names no method, and {', '.join(on_maps)} score methods' maps: name one or more of "
                            f"{', '.join(known)}, or ask for --metrics distance only")
    if not _whole(steps) or steps < 2:
        raise EvaluateError(f"--steps is {steps}; a deletion or insertion curve takes 2 steps or more (with 1, every order "
                            f"has the same area); the default is 16")
    if not _whole(batch_size) or batch_size < 1:
        raise EvaluateError(f"--batch-size is {batch_size}; it is the number of images in a batch, 1 or more (the default is 32)")
    if workers is not None and (not _whole(workers) or workers < 0):
        raise EvaluateError(f"--workers is {workers}; it is the number of decoding processes per rank, 0 (decode in the "
                            f"main process) or more")
    if max_images is not None and (not _whole(max_images) or max_images < 1):
        raise EvaluateError(f"--max-images is {max_images}; a run stops after about that many new images, 1 or more "
                            f"(leave it out to score every image)")
    if not data.exists():
        raise EvaluateError(f"{data} does not exist: DATA is a folder of images (DATA/<class>/<image> gives classes); "
                            f"python -m vitviz.shapes {data} --n 100 writes one to try")
    if not data.is_dir():
        raise EvaluateError(f"{data} is a file; DATA is a folder of images (DATA/<class>/<image> gives classes)")
    _check_out(data, out)


def _check_out(data: Path, out: Path) -> None:
    """Raises EvaluateError for an --out that is a file, lies inside DATA (its figures would be
    scored as images), or is a folder with files and no run of vitviz.evaluate (they would be
    overwritten). A new folder, an empty one, and one with a run.json (a run to resume) pass."""
    if out.exists() and not out.is_dir():
        raise EvaluateError(f"--out {out} is a file; it is the folder the results go to (made when missing)")
    root, target = data.resolve(), out.resolve()
    if target == root or root in target.parents:
        raise EvaluateError(f"--out {out} is inside DATA ({data}): its figures would be scored as images of DATA; put the results "
                            f"outside DATA, e.g. --out {root.parent / 'results'}")
    if out.is_dir() and not (out / "run.json").exists():
        names = [p.name for p in out.iterdir()]
        if names:
            raise EvaluateError(f"--out {out} holds files and no run of vitviz.evaluate (e.g. {min(names)}): the results would "
                                f"overwrite them; give an empty or new folder")


def _check_labels(items: list[Item], classes: dict[str, int | None], protocol: str) -> None:
    """Raises EvaluateError unless every image's folder names a class of the model (Chefer et al.'s
    accuracy is against each image's dataset class)."""
    unknown = [item for item in items if classes.get(item.label) is None]
    if unknown:
        example = unknown[0]
        why = "it is in no class folder" if example.label is None else f"its folder {example.label!r} is no class of the model"
        raise EvaluateError(
            f"--protocol {protocol} measures the accuracy of each image's class, and {len(unknown)} of the {len(items)} images "
            f"have none the model knows (e.g. {example.file}: {why}): put each image in DATA/<class>/, the folder named by a "
            f"class of the model (its name, its first name such as tench, or with timm installed ImageNet's WordNet id such "
            f"as n01440764)"
        )


def read_captions(path: str | Path, items: list[Item]) -> dict[str, str]:
    """The phrase of each image of `items` from a CSV file with a header and the columns file (the
    image's path relative to DATA, with "/") and text (other columns are ignored).

    Raises:
        EvaluateError: a file that cannot be read, is over 64 MiB or not UTF-8; a missing column; a
            row whose text is empty or over `MAX_TEXT_CHARS` characters, whose file is not an image
            of DATA or has a row already; an image without a row. The message names the line.
    """
    path = Path(path)
    if not path.is_file():
        raise EvaluateError(f"--captions {path} is not a file; it is a CSV file with a header file,text and a row per image")
    size = path.stat().st_size
    if size > MAX_CAPTIONS_BYTES:
        raise EvaluateError(f"--captions {path} is {size:,} bytes; a captions file is at most {MAX_CAPTIONS_BYTES:,} (64 MiB)")
    try:
        lines = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise EvaluateError(f"--captions {path} is not UTF-8 text (byte {exc.start}): save it as UTF-8") from None
    reader = csv.DictReader(io.StringIO(lines, newline=""))
    missing = [c for c in ("file", "text") if c not in (reader.fieldnames or [])]
    if missing:
        raise EvaluateError(f"--captions {path}: its header {','.join(reader.fieldnames or []) or '(none)'} lacks the column "
                            f"{' and '.join(missing)}; the first line is file,text")
    files = {item.file for item in items}
    found: dict[str, str] = {}
    where: dict[str, int] = {}
    unknown = []
    for row in reader:
        line = reader.line_num
        file = (row["file"] or "").strip().removeprefix("./")
        phrase = (row["text"] or "").strip()
        if file not in files:
            unknown.append((line, file))
            continue
        if file in found:
            raise EvaluateError(f"--captions {path}, line {line}: {file} has a caption already (line {where[file]}); one row per image")
        if not phrase:
            raise EvaluateError(f"--captions {path}, line {line}: the text of {file} is empty")
        if len(phrase) > MAX_TEXT_CHARS:
            raise EvaluateError(f"--captions {path}, line {line}: the text of {file} is {len(phrase):,} characters; a caption is at "
                                f"most {MAX_TEXT_CHARS:,}")
        found[file], where[file] = phrase, line
    if unknown:
        line, file = unknown[0]
        raise EvaluateError(f"--captions {path}, line {line}: {file or '(empty)'} is not an image under DATA ({len(unknown)} "
                            f"row{'s' if len(unknown) > 1 else ''} like it); the file column holds paths relative to DATA, "
                            f"with /, e.g. {items[0].file}")
    without = [item.file for item in items if item.file not in found]
    if without:
        raise EvaluateError(f"--captions {path} has no row for {len(without)} of the {len(items)} images under DATA (e.g. "
                            f"{without[0]}): add a row file,text for each")
    return found


def _mask_example(data: Path, file: str) -> str:
    return f"{data / 'masks' / Path(file).with_suffix('.png')} for {data / file}"


def _pointing_note(rows: list[dict], data: Path) -> str | None:
    """What the pointing game left out, when it counts some of the images scored but not all."""
    scored = [r for r in rows if not r["error"]]
    left_out = [r for r in scored if r.get("random_pointing") is None]
    if not left_out:
        return None
    refused = [r for r in left_out if r["mask_error"]]
    missing = [r for r in left_out if not r["mask_error"]]
    why = []
    if missing:
        why.append(f"{len(missing)} without a mask (each image's at DATA/masks/<its relative path>, any image format, "
                   f"e.g. {_mask_example(data, missing[0]['file'])})")
    if refused:
        why.append(f"{len(refused)} whose mask could not be used (per_image.csv, column mask_error)")
    return f"pointing counts {len(scored) - len(left_out)} of the {len(scored)} images scored: {' and '.join(why)}"


def _totals(sessions: list[dict]) -> dict:
    """run.json's rate over every session listed: their images (scored or failed) over their seconds,
    and the plain forwards' rate for the same images, each session's at its own."""
    if not sessions:
        return {}
    images = sum(s["scored"] + s["failed"] for s in sessions)
    seconds = math.fsum(s["seconds"] for s in sessions)
    rates = {}
    for key in ("plain_forward_images_per_second", "plain_forward_backward_images_per_second"):
        rates[key] = None
        if all(s.get(key) for s in sessions):
            rates[key] = images / math.fsum((s["scored"] + s["failed"]) / s[key] for s in sessions)
    return dict(timed_images=images, seconds=seconds, images_per_second=images / max(1e-9, seconds), **rates)


def evaluate_images(
    data: str | Path,
    *,
    model: str,
    out: str | Path,
    methods: tuple[str, ...] = ("rollout", "gradient"),
    metrics: tuple[str, ...] | None = None,
    steps: int | None = None,
    batch_size: int = 32,
    workers: int | None = None,
    max_images: int | None = None,
    compare: bool = True,
    progress: bool = True,
    rescan: bool = False,
    protocol: str | None = None,
    text: str | None = None,
    captions: str | Path | None = None,
) -> list[dict] | None:
    """Scores every image of `data` (see the module's doc); on rank 0 returns the summary rows.

    Args:
        metrics: of `METRICS` and `EXTRA_METRICS`; None: the four of `METRICS` (or the protocol's).
        steps: of a deletion or insertion curve; None: 16 (or the protocol's).
        rescan: resume a run into `out` although DATA changed since it began: score the images that
            are new or changed, drop the rows of those that are gone.
        protocol: a name of `PROTOCOLS`: a published protocol with its own metrics and steps (then
            `metrics` and `steps` are refused).
        text: an image–text model: the phrase every image's maps and curves are about.
        captions: an image–text model: a CSV file with columns file,text, a phrase per image
            (`read_captions`).

    Raises:
        EvaluateError: a mistake in the arguments (unknown names, a folder that does not exist or
            holds no images, numbers out of range, a protocol with settings of its own, a captions
            file that does not fit DATA), an `out` inside `data` or holding files and no run of
            vitviz.evaluate, a run in `out` this one cannot resume, or (status 1) a run whose every
            image failed. Every one but the last is raised before anything is written.

    Warns:
        EvaluateWarning: on rank 0, a metric left out for some or all images (the pointing game
            without masks); run.json's "warnings" lists them too.
    """
    data, out = Path(data), Path(out)
    plan = _plan(data, out, model=model, methods=methods, metrics=metrics, steps=steps, batch_size=batch_size, workers=workers,
                 max_images=max_images, protocol=protocol, text=text, captions=captions)
    rank, world, device = _setup()
    plan.items = _stamped(plan.items, rank=rank, world=world)
    for note in plan.notes if rank == 0 else ():
        warnings.warn(note, EvaluateWarning, stacklevel=2)
    net = _loaded(plan, device)
    run, schema, done, sessions = _begun(plan, net.spec, rank=rank, rescan=rescan)
    scored_now, failed_now, waited, seconds = _score_shards(plan, net, schema, done, rank=rank, world=world, device=device, progress=progress)
    counts = _all_sum(torch.tensor([float(scored_now), float(failed_now), waited], dtype=torch.float64), device)
    scored_now, failed_now, waited = int(counts[0]), int(counts[1]), float(counts[2]) / world  # waited: a rank's, on average
    plain = plain_backward = None
    if compare and scored_now > 0:  # the same decision on every rank: the timing is collective
        plain, plain_backward = _plain_rates(plan, net, world=world, device=device)
    _barrier()
    timing = dict(world_size=world, device=str(device), scored=scored_now, failed=failed_now, seconds=seconds,
                  images_per_second=(scored_now + failed_now) / max(1e-9, seconds), data_wait_seconds=waited,
                  plain_forward_images_per_second=plain, plain_forward_backward_images_per_second=plain_backward)
    return _finished(plan, net.spec, run, schema, sessions, timing, rank=rank, device=device)


@dataclass
class _Plan:
    """A run's arguments once checked, and what was read for it before any process started."""

    data: Path
    out: Path
    model: str
    methods: tuple[str, ...]
    metrics: tuple[str, ...]
    steps: int
    batch_size: int
    workers: int | None
    max_images: int | None
    protocol: str | None
    chosen: object | None  # the protocol's `PROTOCOLS` entry
    text: str | None
    phrases: dict[str, str] | None  # each image's phrase (an image–text model)
    digest: str | None  # the captions file's
    items: list[Item]
    classes: dict[str, int | None]
    notes: list[str] = field(default_factory=list)  # what is left out, said as a warning and kept in run.json

    @property
    def shards(self) -> Path:
        return self.out / "shards"


def _plan(data: Path, out: Path, *, model: str, methods, metrics, steps, batch_size, workers, max_images, protocol, text,
          captions) -> _Plan:
    """Every check that needs no process group and no model: the arguments, the model's spec, the
    images and their labels, masks and phrases; an `EvaluateError` before anything is written."""
    from vitviz.sources import get_spec

    _check_arguments(data, out, methods=methods, metrics=metrics, steps=steps, batch_size=batch_size, workers=workers,
                     max_images=max_images, protocol=protocol, text=text, captions=captions)
    chosen = PROTOCOLS[protocol] if protocol is not None else None
    metrics = chosen.metrics if chosen is not None else (METRICS if metrics is None else tuple(metrics))
    steps = 16 if steps is None else steps
    phrased = text is not None or captions is not None
    try:
        spec = get_spec(model)
    except ValueError as exc:
        raise EvaluateError(f"--model: {exc}") from None
    _check_attention(spec.name, getattr(spec.config, "attention", "global"))  # before its weights are fetched
    if not spec.preprocessing.square:  # (a batch is one tensor: its images of one size)
        raise EvaluateError(f"--model: {spec.name} takes each image whole at its own aspect ratio, and the evaluator scores batches "
                            f"of square crops: analyse it one image at a time with vitviz.analyze, or name a model without @whole")
    if chosen is not None:
        steps = chosen.steps(spec.image_size)
        if not spec.has_head:
            raise EvaluateError(f"--protocol {protocol} measures a classifier and {spec.name} has none")
    if "inside" in metrics and not spec.has_head:
        raise EvaluateError(f"--metrics inside reads the logit lens and the attribution of a class through the model's head, "
                            f"and {spec.name} has none (no classifier): leave out inside, or use a model with a head")
    if not phrased and not spec.has_head and ({"deletion", "insertion"} & set(metrics)
                                              or any(registered_method(m).needs_target for m in methods)):
        raise EvaluateError(f"{spec.name} has no classifier: deletion, insertion and the methods that explain a class need one "
                            f"(an image–text model explains a phrase: give one with --text, or one per image with --captions)")
    items = scan(data, stamps=False)  # stamped once the processes have started, each hashing a share
    if not items:
        raise EvaluateError(f"no images ({', '.join(sorted(SUFFIXES))}) under {data}: put images there (DATA/<class>/<image> "
                            f"gives classes), or write some with python -m vitviz.shapes {data} --n 100")
    classes = _classes(items, spec.categories)
    if chosen is not None and chosen.kind == "chefer2021":
        _check_labels(items, classes, protocol)
    phrases = digest = None
    if phrased:
        phrases = {item.file: text for item in items} if text is not None else read_captions(captions, items)
        digest = None if captions is None else _digest(Path(captions).read_bytes())
    notes = []
    if "pointing" in metrics and not any(item.mask for item in items):
        others = [m for m in metrics if m != "pointing"]
        where = f"each image's at DATA/masks/<its relative path>, any image format, e.g. {_mask_example(data, items[0].file)}"
        if not others:
            raise EvaluateError(f"the pointing game needs object masks and {data} has none ({where}): add them, or ask for "
                                f"other --metrics")
        notes.append(f"pointing skipped: it needs object masks and {data} has none ({where}); scoring {', '.join(others)}")
    return _Plan(data=data, out=out, model=model, methods=tuple(methods), metrics=tuple(metrics), steps=steps, batch_size=batch_size,
                 workers=workers, max_images=max_images, protocol=protocol, chosen=chosen, text=text, phrases=phrases, digest=digest,
                 items=items, classes=classes, notes=notes)


def _check_attention(name: str, kind: str) -> None:
    """Refuses a model whose attention is not one token-by-token matrix per layer: the batch's one pass records them."""
    if kind != "global":
        raise EvaluateError(f"--model: {name}'s attention is {kind}, not one token-by-token matrix per layer, and the evaluator "
                            f"scores globally attending models (a ViT, DeiT, CLIP, SigLIP, ...): explain it one image at a time with "
                            f"vitviz.explain, or in the app")


def _loaded(plan: _Plan, device: torch.device):
    """The model on this process' device, refused where the run's metrics or phrases do not fit it."""
    from vitviz.sources import load_model

    net = load_model(plan.model, device=device)
    spec = net.spec
    _check_attention(spec.name, attention_of(_tower(net)))  # (a plugin's architecture is known once its model is)
    if "inside" in plan.metrics and not isinstance(net, ViT):
        raise EvaluateError(f"--metrics inside reads the residual stream of a plain ViT's blocks; {spec.name} is a "
                            f"{type(net).__name__}: leave out inside")
    if plan.phrases is not None and not isinstance(net, ImageTextModel):
        raise EvaluateError(f"{'--text' if plan.text is not None else '--captions'} needs an image–text model (shapes_clip, "
                            f"hf:openai/clip-vit-base-patch16, ...); {spec.name} is not one: explain its classes without a phrase")
    return net


def _begun(plan: _Plan, spec, *, rank: int, rescan: bool) -> tuple[dict, tuple, dict, list[dict]]:
    """The run's record, its rows' schema, the rows already scored and the sessions that scored them;
    a run in `out` this one cannot resume is refused on every rank alike, then rank 0 writes first."""
    run = dict(format=FORMAT, data=str(plan.data), model=plan.model, protocol=plan.protocol, methods=list(plan.methods),
               metrics=list(plan.metrics), steps=plan.steps, batch_size=plan.batch_size, text=plan.text, captions=plan.digest,
               images=len(plan.items), files={item.file: item.stamp for item in plan.items})
    schema = _row_schema(plan.methods, plan.metrics, steps=plan.steps, depth=spec.depth, heads=spec.heads, classes=spec.num_classes,
                         protocol=plan.protocol, text=plan.phrases is not None)
    before = _previous(plan.out)
    _check_previous(plan.out, before, run, rescan=rescan)  # on every rank: all refuse alike
    done = _done(_read_shards(plan.shards, schema), plan.items)  # a line that is not a row refuses the run before anything is written
    sessions = list(before.get("sessions", [])) if before else []  # the timing of the sessions that scored the rows kept
    _barrier()
    if rank == 0:  # every check passed: the first write of the run
        plan.shards.mkdir(parents=True, exist_ok=True)
        _write_json(plan.out / "run.json", dict(run, sessions=sessions, **_totals(sessions)))
    _barrier()
    return run, schema, done, sessions


def _score_shards(plan: _Plan, net, schema, done, *, rank: int, world: int, device: torch.device,
                  progress: bool) -> tuple[int, int, float, float]:
    """This rank's share of the images not yet scored, a row each into a shard of its own; returns
    (scored, failed, seconds spent waiting for decoded images, seconds of the scoring loop)."""
    from tqdm import tqdm

    spec = net.spec
    plans = [_Batches(len(plan.items), plan.batch_size, r, world, done, plan.max_images) for r in range(world)]  # every rank's, to count them all
    rounds = max(len(p) for p in plans)
    workers = plan.workers if plan.workers is not None else max(0, min(4, (os.cpu_count() or 1) // world - 1))
    chosen = plan.chosen
    loader = torch.utils.data.DataLoader(
        EvalDataset(plan.items, chosen.preprocessing(spec.preprocessing) if chosen is not None else spec.preprocessing,
                    as_their_scripts=chosen is not None),
        batch_sampler=plans[rank], num_workers=workers,
        collate_fn=_collate, persistent_workers=False,
    )
    shard = plan.shards / f"rank{rank:03d}-of-{world:03d}-{_unique()}.jsonl"
    start = time.perf_counter()
    scored = failed = 0
    waited = 0.0
    bar = tqdm(total=sum(len(b) for p in plans for b in p.batches), unit="img", disable=not (progress and rank == 0), file=sys.stderr)
    with bar, open(shard, "x") as f:  # the bar closed (its line ended) also when stopped
        batches = iter(loader)
        for _ in range(rounds):  # the ranks in step, a rank out of batches too, so that the bar counts every rank's images
            asked = time.perf_counter()
            batch = next(batches, None)
            waited += time.perf_counter() - asked  # the model idle, waiting for decoded images
            n = 0
            if batch is not None:
                for row in _score(net, batch, plan.items, methods=plan.methods, metrics=plan.metrics, steps=plan.steps,
                                  classes=plan.classes, protocol=plan.protocol, phrases=plan.phrases):
                    problem = _row_problem(row, schema)
                    if problem:  # e.g. non-finite outputs: an error row, so that every line written passes the merge's check
                        row = {key: row[key] for key in schema[0]} | {"error": f"the results are not usable: {problem}"}
                    f.write(json.dumps(row) + "\n")
                    if row["error"]:
                        failed += 1
                    else:
                        scored += 1
                f.flush()
                n = len(batch["index"])
            bar.update(int(_all_sum(torch.tensor([float(n)], dtype=torch.float64), device)[0]))
    return scored, failed, waited, time.perf_counter() - start


def _plain_rates(plan: _Plan, net, *, world: int, device: torch.device) -> tuple[float, float | None]:
    """The plain forward's rate (images per second) of the model at the run's batch size, and the
    forward and backward's where the run differentiates: what the run's own rate is compared to."""
    spec = net.spec
    x = torch.randn(min(plan.batch_size, len(plan.items)), 3, spec.image_size, spec.image_size)
    batches = max(1, min(8, math.ceil(len(plan.items) / plan.batch_size / world)))
    plain = _plain_rate(_tower(net), x, batches=batches, device=device)
    backward = None
    if _differentiates(plan.methods, plan.metrics, plan.protocol):
        backward = _plain_rate(_tower(net), x, batches=batches, device=device, backward=True)
    return plain, backward


def _finished(plan: _Plan, spec, run: dict, schema, sessions: list[dict], timing: dict, *, rank: int, device: torch.device) -> list[dict] | None:
    """Rank 0 merges the shards in file order (the same figures for any number of ranks), writes the
    outputs and run.json; every rank then learns whether any image could be scored."""
    summary, message = None, f"none of the {_plural(len(plan.items), 'image')} could be scored"
    verdict = torch.zeros(2, dtype=torch.float64)  # (images scored, whether every image has a row), from rank 0
    if rank == 0:
        rows = [row for _, row in sorted(_current(_read_shards(plan.shards, schema), plan.items).items())]
        summary = _write_outputs(plan.out, rows, run, spec)
        scored = sum(1 for row in rows if not row["error"])
        if timing["scored"] + timing["failed"]:  # a run that found everything scored keeps the timing of those that scored it
            sessions.append(timing)
        notes = plan.notes
        if "pointing" in plan.metrics and any(item.mask for item in plan.items):
            note = _pointing_note(rows, plan.data)
            if note:
                warnings.warn(note, EvaluateWarning, stacklevel=3)
                notes.append(note)
        run.update(scored=scored, failed=len(rows) - scored, scored_now=timing["scored"], failed_now=timing["failed"], warnings=notes,
                   sessions=sessions, **_totals(sessions))
        _write_json(plan.out / "run.json", run)
        verdict = torch.tensor([float(scored), float(len(rows) == len(plan.items))], dtype=torch.float64)
        if rows and not scored:
            message += f" (e.g. {rows[0]['file']}: {rows[0]['error']}); each one's error is in {plan.out / 'per_image.csv'}, column error"
    verdict = _all_sum(verdict, device)  # also the barrier after rank 0's writing
    if verdict[1] and not verdict[0]:
        raise EvaluateError(message, status=1)
    return summary
