"""Dataset statistics and an explanation benchmark over a folder of images, on one process or many.

    python -m vitviz.evaluate DATA --model shapes_p16 --methods rollout,gradient \\
        --metrics distance,pointing,deletion,insertion --out results/
    torchrun --nproc_per_node=2 -m vitviz.evaluate DATA --model vit_b_16 --out results/   # gloo on CPU, NCCL on GPUs
    srun torchrun --nnodes=$SLURM_NNODES --nproc_per_node=4 --rdzv_backend=c10d \\
        --rdzv_endpoint=$HEAD_NODE:29500 -m vitviz.evaluate DATA --model vit_b_16 --out results/

DATA is a folder of images, searched recursively; in the ImageFolder layout (DATA/<class>/<image>)
the folder's name is the image's class, and the class explained and scored is that one when the
model knows it (else its top-1). Object masks for the pointing game lie under DATA/masks/ with the
image's relative path and stem (any image format; white on the object; the size of its image).
Images and masks pass the app's image gate (`vitviz.load_image`); one it refuses is an error in its
image's row and stops nothing. `python -m vitviz.shapes DIR --n 1000` writes such a folder.

Metrics: "distance" (mean attention distance per layer and head, the paper's Figure 7, averaged over
images), "pointing" (does each method's map peak on the object, dilated by one patch), "deletion" and
"insertion" (area under the class probability's curve as patches go in the map's order; a random
order, seeded by the image's relative path, is scored beside every method); and, asked for by name
(not in the default set), "inside": per image, from the same forward, the first layer at which the
logit lens ranks the image's class top-1 (0 = the embedding) and the direct logit attribution of
that class per head [L, H] (`vitviz.inside`); summary.csv gets the mean of that layer and the share
of images where it never comes, heads.csv each head's mean attribution, summary.md the top five.

Published protocols, by name, their settings fixed (`PROTOCOLS`; --metrics and --steps are refused
with them): --protocol chefer2021 (or chefer2021-target) is Chefer et al. 2021's positive and
negative perturbation test, metrics "positive" and "negative": accuracy against each image's class
(its folder) with 0 %, 10 %, ..., 90 % of the pixels removed, AUC = np.trapz x 100, maps of the
predicted class (or of the image's class); --protocol rise is RISE's deletion (to zeros) and insertion
(from a blurred copy), S pixels a step on S x S images, the predicted class's probability, RISE's
area. Both resize images to S x S as their authors' loaders do (no crop); see
`vitviz.faithfulness` for the definitions, docs/evaluate.md for the command that reproduces Chefer
et al.'s table on ImageNet.

Image–text models (CLIP, shapes_clip) are explained for a phrase: --text "a red star" for every image,
or --captions FILE.csv (columns file,text; `read_captions`) for a phrase per image; each method's map
is then the phrase's, the pointing game uses the masks as for classes, and deletion and insertion
record the image–text similarity (logits_per_image, not a probability) of the perturbed image. The images are cut into
global batches of --batch-size in file order, dealt to the ranks in turn: every image is scored
once, by the same batch whatever the number of processes, and none is repeated to pad a rank. Each
rank appends one line per image to its shard (DIR/shards/): the image's relative path, its stamp (the
sha256 of its bytes, and of its mask's: an image is known by its content, not its size or time), the
sha256 of the bytes scored, and the results. A run started again skips the images already there;
run.json holds the settings and the list of files with their stamps, and a run into the same DIR
after DATA changed is refused, or with --rescan scores what is new or changed and drops the rows of
what is gone. --out is a folder outside DATA that is new, empty, or holds a run of vitviz.evaluate
(which it resumes); any other is refused before anything is written, as is every mistake. Rank 0
checks every shard line, merges the rows of the current files into per_image.csv and computes the
dataset figures from them in file order, so one process and many write the same summary.csv (mean
and 95 % interval per method and metric: Wilson's for the pointing game), distance.csv/.png and
curves.png (each curve over the fractions of patches its points really removed,
round(i * N / steps) / N of N patches, as the areas in summary.csv are).

A row whose file could not be read (the image's, or the mask of an image that was scored) is scored
again by the next run; a row the image gate refused stays while its file is unchanged. run.json
counts the images scored and failed, and records each session that scored images (processes,
seconds, images per second); its top-level rate covers every session listed. A mistake in the
command is one line on stderr and exit status 2 (nothing written), a run that scored nothing exit
status 1, Ctrl-C exit status 130 (run the same command again to go on); --debug shows the
traceback. Every CSV cell of text that a spreadsheet would read as a formula (it starts with =, +,
-, @, a tab or a carriage return) is written with a leading ' (OWASP's rule).

    summary = vitviz.evaluate.summarize("results/")     # the same summary, from Python
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import math
import os
import re
import sys
import time
import warnings
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, NoReturn, Sequence

import numpy as np
import torch
import torch.distributed as dist

from vitviz import plots
from vitviz.analysis import mean_attention_distance, pointing_game, uniform_attention_distance
from vitviz.explainers import method as registered_method, methods as registered_methods
from vitviz.explanations import maps_of, record_for
from vitviz.faithfulness import (
    CHEFER2021_FRACTIONS, chefer2021_auc, chefer2021_curves, perturbation_curves, phrase_similarity, pixel_maps, random_maps,
    rise_auc, rise_curves,
)
from vitviz.hooks import record_attention
from vitviz.images import MAX_BYTES, ImageError, load_image
from vitviz.imagetext import ImageTextModel
from vitviz.inside import Stream, attribution_of, first_top1_layer, lens_of, record_stream
from vitviz.model import ViT
from vitviz.preprocess import Preprocessing, crop, to_input

__all__ = ["METRICS", "EXTRA_METRICS", "PROTOCOLS", "Protocol", "MAX_TEXT_CHARS", "Item", "EvaluateError", "EvaluateWarning", "scan", "read_captions",
           "EvalDataset", "Z95", "wilson", "evaluate", "summarize", "main"]

METRICS = ("distance", "pointing", "deletion", "insertion")  # the default set
EXTRA_METRICS = ("inside",)  # scored only when named in --metrics
CURVE_METRICS = ("deletion", "insertion", "positive", "negative")  # the metrics with a curve per image and its area
SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff"}
Z95 = 1.959963984540054  # the normal quantile of a two-sided 95 % interval
FORMAT = 3  # of run.json and the shard rows: rows keyed by the image's relative path, stamped with its bytes' sha256
EARLIER_FORMATS = {  # what a run.json of an earlier format holds that this one cannot resume
    1: "its rows are not keyed by file",
    2: "its files are known by their size and modification time, not by their bytes",
}
MAX_TEXT_CHARS = 1000  # of a phrase (--text, or a caption): the text towers read 77 tokens or fewer anyway
MAX_CAPTIONS_BYTES = 64 * 2**20  # of a --captions file


@dataclass(frozen=True)
class Protocol:
    """A published benchmark protocol, run by name (`--protocol`); its settings are fixed.

    Attributes:
        name: what `--protocol` takes.
        kind: "chefer2021" or "rise": which of `vitviz.faithfulness`'s protocols it runs.
        metrics: the metrics it scores, each an area per method and image.
        explains: the class each map explains: "predicted" (the top-1) or "label" (the image's
            class, from its folder).
        description: one line for --help and errors.
    """

    name: str
    kind: str
    metrics: tuple[str, ...]
    explains: str
    description: str

    def steps(self, image_size: int) -> int:
        """Steps of a curve (its points less one): 9 for Chefer et al.'s 10 %, ..., 90 %; S for RISE."""
        return len(CHEFER2021_FRACTIONS) - 1 if self.kind == "chefer2021" else image_size

    def fractions(self, image_size: int) -> np.ndarray:
        """The x of a curve's points: the share of pixels removed (inserted) at each."""
        if self.kind == "chefer2021":
            return np.asarray(CHEFER2021_FRACTIONS, dtype=np.float64)
        return np.arange(image_size + 1, dtype=np.float64) / image_size

    def preprocessing(self, pre: Preprocessing) -> Preprocessing:
        """The images as both authors' loaders make them: resized to S x S (`transforms.Resize((S, S))`,
        bilinear, no crop), normalised with the model's own mean and std."""
        return Preprocessing(pre.image_size, None, "squash", pre.mean, pre.std, interpolation="bilinear")


PROTOCOLS: dict[str, Protocol] = {
    p.name: p for p in (
        Protocol("chefer2021", "chefer2021", ("positive", "negative"), "predicted",
                 "Chefer et al. 2021's positive and negative perturbation, maps of the predicted class (their --vis-class top)"),
        Protocol("chefer2021-target", "chefer2021", ("positive", "negative"), "label",
                 "the same, maps of each image's dataset class (their --vis-class target)"),
        Protocol("rise", "rise", ("deletion", "insertion"), "predicted",
                 "RISE's deletion (to zeros) and insertion (from a blurred copy), S pixels a step, the predicted class"),
    )
}


class EvaluateError(ValueError):
    """A run vitviz.evaluate will not start, resume or merge, or one that scored nothing; the message
    says why and what to do.

    Attributes:
        status: the command's exit status: 2 for a mistake in the command or in its folders (as
            argparse's), 1 for a run that could score nothing.
    """

    def __init__(self, message: str, *, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


class EvaluateWarning(UserWarning):
    """A metric that cannot be computed for some or all images (e.g. the pointing game without masks)."""


@dataclass(frozen=True)
class Item:
    """One image of DATA.

    Attributes:
        index: its place in the sorted list of DATA's images.
        path: the path to read (DATA joined with `file`).
        label: its class (the first folder below DATA), or None.
        mask: the path of its object mask, or None.
        file: its path relative to DATA, with "/" (what rows are keyed by).
        stamp: the sha256 of its bytes, and "|" and its mask's when it has one (`_stamp`): what a row
            was scored from; empty from `scan(..., stamps=False)`.
    """

    index: int
    path: str
    label: str | None
    mask: str | None
    file: str = ""
    stamp: str = ""


def _content(path: str) -> str:
    """The sha256 of the bytes of a file the image gate reads (its first `MAX_BYTES` + 1), read in
    chunks, its first 16 bytes in hex (the row's `sha256` when the file was scored as it is); "?"
    when the file cannot be read."""
    h = hashlib.sha256()
    left = MAX_BYTES + 1
    try:
        with open(path, "rb") as f:
            while left and (chunk := f.read(min(left, 2**20))):
                h.update(chunk)
                left -= len(chunk)
    except OSError:
        return "?"
    return h.hexdigest()[:32]


def _stamp(path: str, mask: str | None) -> str:
    """An image's stamp: its bytes' digest, and "|" and its mask's when it has one."""
    return _content(path) + ("" if mask is None else f"|{_content(mask)}")


def scan(root: str | Path, *, stamps: bool = True) -> list[Item]:
    """Every image under `root` (not under root/masks), sorted by path; the class is the first folder
    below `root` when there is one; the mask is root/masks/<the same relative path and stem>.*.

    Args:
        stamps: read and hash every image and mask for its stamp; False leaves the stamps empty
            (`evaluate` stamps them once its processes have started, each hashing a share).
    """
    root = Path(root)
    masks_root = root / "masks"
    masks = {}
    if masks_root.is_dir():
        for p in sorted(masks_root.rglob("*")):
            if p.suffix.lower() in SUFFIXES and p.is_file():
                masks.setdefault(p.relative_to(masks_root).with_suffix("").as_posix(), p)
    paths = sorted(p for p in root.rglob("*") if p.suffix.lower() in SUFFIXES and masks_root not in p.parents and p.is_file())
    items = []
    for i, p in enumerate(paths):
        rel = p.relative_to(root)
        label = rel.parts[0] if len(rel.parts) > 1 else None
        mask = masks.get(rel.with_suffix("").as_posix())
        mask = None if mask is None else str(mask)
        items.append(Item(i, str(p), label, mask, rel.as_posix(), _stamp(str(p), mask) if stamps else ""))
    return items


def _stamped(items: list[Item], *, rank: int, world: int) -> list[Item]:
    """`items` with their stamps: each rank hashes every world-th image (and its mask), then every
    rank gets every stamp, so that a run reads each file once to stamp it, on any number of processes."""
    mine = {item.index: _stamp(item.path, item.mask) for item in items[rank::world]}
    shares: list = [mine]
    if dist.is_initialized():
        shares = [None] * world
        dist.all_gather_object(shares, mine)
    stamps = {i: stamp for share in shares for i, stamp in share.items()}
    return [replace(item, stamp=stamps[item.index]) for item in items]


def _read(path: str) -> bytes:
    """The file's bytes, no more than the image gate reads (it refuses what is longer)."""
    try:
        with open(path, "rb") as f:
            return f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise ImageError(f"the file cannot be read ({exc.strerror or exc})") from None


def _digest(data: bytes) -> str:
    """The sha256 of `data`, its first 16 bytes in hex."""
    return hashlib.sha256(data).hexdigest()[:32]


def _seed(file: str) -> int:
    """The random order's seed of an image: from its relative path, so that it does not depend on
    which other images DATA holds."""
    return int.from_bytes(hashlib.sha256(file.encode()).digest()[:8], "big") >> 1


def _to_input_as_their_scripts(cropped, pre: Preprocessing) -> torch.Tensor:
    """The S x S crop -> [3, S, S] as Chefer et al.'s and RISE's scripts make it: torchvision's
    `ToTensor()` (x / 255) then `Normalize(mean, std)` ((x - mean) / std). `to_input` gives the same
    values but for the last bit of some (it multiplies by 1 / 255), which can reorder tied pixels."""
    from torchvision.transforms import functional as F1

    return F1.normalize(F1.to_tensor(cropped.convert("RGB")), mean=list(pre.mean), std=list(pre.std))


class EvalDataset(torch.utils.data.Dataset):
    """Items read, checked and preprocessed (in DataLoader workers): the model's input, the object
    mask cropped the same way (nearest), the digests of the bytes read, and what was wrong with the
    image (its row counts nowhere) or with its mask (its row counts everywhere but the pointing game)."""

    def __init__(self, items: list[Item], pre: Preprocessing, *, as_their_scripts: bool = False) -> None:
        """`as_their_scripts`: the crop made a tensor as the published protocols' scripts make it
        (`_to_input_as_their_scripts`), to the bit."""
        self.items = items
        self.pre = pre
        self.to_input = _to_input_as_their_scripts if as_their_scripts else to_input
        self.mask_pre = Preprocessing(pre.image_size, pre.resize_size, pre.mode, interpolation="nearest")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        item = self.items[i]
        out = _sample(item.index, self.pre.image_size)
        try:
            data = _read(item.path)
            out["sha256"] = _digest(data)
            image = load_image(data)
            out["x"] = self.to_input(crop(image, self.pre), self.pre)
        except ImageError as exc:
            out.update(ok=False, error=str(exc))
            return out
        if item.mask:
            try:
                data = _read(item.mask)
                out["mask_sha256"] = _digest(data)
                mask = load_image(data)
                if mask.size != image.size:
                    raise ImageError(f"it is {mask.width}x{mask.height} px and its image {image.width}x{image.height} px; "
                                     f"a mask has the size of its image")
                out["mask"] = torch.from_numpy(np.asarray(crop(mask.convert("L"), self.mask_pre)) > 127)
                out["has_mask"] = True
            except ImageError as exc:
                out["mask_error"] = f"mask {item.mask}: {exc}"
        return out


class _Batches(torch.utils.data.Sampler):
    """This rank's global batches (k = rank, rank + world, ...), less the images already done; with
    `max_images`, no more batches once that many images are dealt to this rank (a run in parts)."""

    def __init__(self, n: int, batch_size: int, rank: int, world: int, done: set[int], max_images: int | None = None) -> None:
        self.batches = []
        total = 0
        for k in range(rank, math.ceil(n / batch_size), world):
            if max_images is not None and total >= max_images:
                break
            batch = [i for i in range(k * batch_size, min((k + 1) * batch_size, n)) if i not in done]
            if batch:
                self.batches.append(batch)
                total += len(batch)

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


# ------------------------------------------------------------------------------------------------
# One batch


_WNID = re.compile(r"n[0-9]{8}")


def _imagenet_wnids(categories) -> list[str] | None:
    """ImageNet-1k's WordNet ids (n01440764, ...) in class order, for a model of its 1,000 classes
    when timm (which lists them) is installed; else None."""
    if categories is None or len(categories) != 1000:
        return None
    try:
        from timm.data import ImageNetInfo
    except ImportError:
        return None
    return list(ImageNetInfo().label_names())


def _target(label: str | None, categories, wnids: list[str] | None = None) -> int | None:
    """The class index of an image's folder name: a class name of the model, the first name of an
    entry such as timm's "tench, Tinca tinca", or an ImageNet WordNet id (`wnids`); None if none."""
    if label is None or categories is None:
        return None
    names = list(categories)
    if label in names:
        return names.index(label)
    short = [c.split(",")[0].strip().lower() for c in names]  # timm's "tench, Tinca tinca"
    if label.lower() in short:
        return short.index(label.lower())
    if wnids is not None and _WNID.fullmatch(label) and label in wnids:
        return wnids.index(label)
    return None


def _classes(items: list[Item], categories) -> dict[str, int | None]:
    """{folder name: class index or None} for the classes of `items`."""
    labels = sorted({item.label for item in items if item.label is not None})
    wnids = _imagenet_wnids(categories) if any(_WNID.fullmatch(label) for label in labels) else None
    return {label: _target(label, categories, wnids) for label in labels}


def _base_rows(batch: dict, items: list[Item]) -> dict[int, dict]:
    """{index: the row's keys every row has} for the images of a batch."""
    base = {}
    for b, i in enumerate(batch["index"].tolist()):
        item = items[i]
        base[i] = dict(index=i, file=item.file, path=item.path, label=item.label, stamp=item.stamp, sha256=batch["sha256"][b],
                       mask_sha256=batch["mask_sha256"][b], error=batch["error"][b], mask_error=batch["mask_error"][b])
    return base


def _score(model: ViT | ImageTextModel, batch: dict, items: list[Item], *, methods, metrics, steps: int,
           classes: dict[str, int | None] | None = None, protocol: str | None = None,
           phrases: dict[str, str] | None = None) -> list[dict]:
    """Per-image results of one batch (the rows of its unreadable images with their error).

    Args:
        classes: {folder name: class index}, the class explained where the model knows it.
        protocol: a name of `PROTOCOLS`: its metrics instead of `metrics`.
        phrases: {relative path: phrase} for an image–text model: each image's maps, curves and
            similarity are its phrase's.
    """
    spec = model.spec
    base = _base_rows(batch, items)
    keep = [k for k, ok in enumerate(batch["ok"]) if ok]
    rows = [base[int(i)] for i, ok in zip(batch["index"], batch["ok"]) if not ok]
    if not keep:
        return rows
    x = batch["x"][keep]
    index = batch["index"][keep].tolist()
    mask, has_mask = batch["mask"][keep], batch["has_mask"][keep]
    scored = [base[i] for i in index]
    classes = classes if classes is not None else {}
    if protocol is not None:
        _score_protocol(model, x, [items[i] for i in index], scored, methods=methods, protocol=PROTOCOLS[protocol], classes=classes)
        return rows + scored
    need_maps = bool({"pointing", "deletion", "insertion"} & set(metrics)) and bool(methods)
    dist_lbh = probs = explained = None
    streams = ExitStack()  # "inside": the stream recorded around the batch's one forward (`_inside_of`)
    inside = streams.enter_context(record_stream(_tower(model))) if "inside" in metrics else None

    def distances(attn: torch.Tensor, grid) -> torch.Tensor:  # [L, B, H, N, N] -> each image's [B, L, H], float64 on the CPU
        return mean_attention_distance(attn, patch_size=spec.patch_size, num_prefix_tokens=spec.num_prefix_tokens,
                                       grid=grid).permute(1, 0, 2).cpu().double()

    if phrases is not None:
        texts = [phrases[items[i].file] for i in index]
        maps, similarities, attn, grid = _phrase_maps(model, x, texts, methods, distance="distance" in metrics)
        maps["random"] = torch.stack([random_maps(grid, seed=_seed(items[i].file)) for i in index])
        for b, row in enumerate(scored):
            row.update(text=texts[b], similarity=float(similarities[b]))
        if attn is not None:
            dist_lbh = distances(attn, grid)
    elif need_maps:
        targets = [classes.get(items[i].label) for i in index] if spec.has_head else None
        step = _images_in_cache(_tower(model), x) if inside is None else len(x)  # "inside": one forward's stream
        parts = []
        with streams:  # record's forwards through the blocks (its backward passes run no block)
            for first in range(0, len(x), step):
                part = slice(first, first + step)
                rec = record_for(model, x[part], methods, targets=None if targets is None else targets[part])
                dist = distances(rec.attentions, rec.grid) if "distance" in metrics else None
                parts.append((maps_of(rec, methods), rec.targets, rec.probabilities, dist))
        maps = {method: torch.cat([part[0][method] for part in parts]) for method in parts[0][0]}
        maps["random"] = torch.stack([random_maps(rec.grid, seed=_seed(items[i].file)) for i in index])
        explained = torch.cat([part[1] for part in parts]) if parts[0][1] is not None else None
        probs = torch.cat([part[2] for part in parts]).cpu() if parts[0][2] is not None else None
        dist_lbh = torch.cat([part[3] for part in parts]) if "distance" in metrics else None
    else:  # distance and "inside" only: one plain forward, each layer's distances reduced as it is recorded, no stack held
        def per_layer(a: torch.Tensor) -> torch.Tensor:
            return mean_attention_distance(a.float().unsqueeze(0), patch_size=spec.patch_size, num_prefix_tokens=spec.num_prefix_tokens, grid=spec.grid)[0]

        vit = _tower(model)
        param = next(vit.parameters())
        x = x.to(device=param.device, dtype=param.dtype)
        # the whole batch in one forward, each layer's attention reduced a part at a time
        recorder = (record_attention(vit, reduce=per_layer, images_at_a_time=_attention_part(vit, x))
                    if "distance" in metrics else nullcontext())
        with streams, torch.inference_mode(), recorder as r:
            logits = vit(x)
        dist_lbh = r.attentions.permute(1, 0, 2).cpu().double() if r is not None else None  # [L, B, H] -> [B, L, H]
        probs = logits.float().softmax(-1).cpu() if spec.has_head else None
    for b, row in enumerate(scored):
        if probs is not None:
            known = classes.get(items[index[b]].label)
            target = int(explained[b]) if explained is not None else known if known is not None else int(probs[b].argmax())
            row.update(target=target, predicted=int(probs[b].argmax()), probability=float(probs[b, target]))
            if inside is not None:
                row.update(_inside_of(inside.streams[b], target))
        if "distance" in metrics:
            row["distance"] = dist_lbh[b].tolist()
    if not need_maps:
        return rows + scored
    score = None
    if phrases is not None and {"deletion", "insertion"} & set(metrics):
        score = phrase_similarity(model, _phrase_embeddings(model, [row["text"] for row in scored]))
    for method, m in maps.items():
        if "pointing" in metrics:
            hits = pointing_game(m, mask, patch_size=spec.patch_size)
            for b, row in enumerate(scored):
                row[f"{method}_pointing"] = float(hits[b]) if has_mask[b] else None
        if {"deletion", "insertion"} & set(metrics):
            curves = perturbation_curves(model, x, m, explained, steps=steps, score=score)
            for b, row in enumerate(scored):
                for mode in ("deletion", "insertion"):
                    if mode in metrics:
                        row[f"{method}_{mode}"] = float(getattr(curves, f"{mode}_auc")[b])
                        row[f"{method}_{mode}_curve"] = getattr(curves, mode)[b].tolist()
    return rows + scored


KEPT_BYTES = 192 * 2**20  # every layer's attention a recorded CPU pass keeps for its maps (and backward)
PART_BYTES = 2 * 2**20  # a part of a layer's attention a recorded CPU forward reduces while it is in cache


def _attention_part(vit: ViT, x: torch.Tensor) -> int:
    """How many images' attention a distance pass over `x` computes and reduces at a time, within
    each layer (`record_attention(..., images_at_a_time=)`; the layer's other work runs on the whole
    batch): on CPU as many as keep it within `PART_BYTES`, at least one (ViT-B/16 at 224 px: one
    image's, 1.9 MB; a layer's attention of 32 images with its distances took 58.2 ms an image at a
    time, 58.7 ms four at a time, 119.2 ms all at once, against 41.4 ms for the fused attention: the
    table of `python -m vitviz.dev.bench --evaluate`, docs/evaluate.md); on a GPU, the whole batch."""
    return _images_within(vit, x, PART_BYTES)


def _images_in_cache(vit: ViT, x: torch.Tensor) -> int:
    """How many images of `x` one pass that keeps every layer's attention (for maps and a backward)
    takes: on CPU, as many as keep all L layers' [b, H, N, N] within `KEPT_BYTES` (ViT-B/16: 9 images
    at a time; with 8, gradient relevance and rollout of 32 images took 0.85x the time of a plain
    forward and backward of the 32, the whole batch at once 1.26x); on a GPU, the whole batch."""
    return _images_within(vit, x, KEPT_BYTES, layers=vit.config.depth)


def _images_within(vit: ViT, x: torch.Tensor, budget: int, *, layers: int = 1) -> int:
    """How many images of `x` keep `layers` layers' attention [b, H, N, N] within `budget` bytes on
    CPU, at least one; on a GPU, the whole batch."""
    if x.device.type != "cpu":
        return max(1, x.shape[0])
    gh, gw = vit.grid_for(x.shape[-2], x.shape[-1])
    tokens = gh * gw + vit.config.num_prefix_tokens
    per_image = vit.config.heads * tokens * tokens * x.element_size() * layers
    return max(1, min(x.shape[0], budget // per_image))


def _tower(model: ViT | ImageTextModel) -> ViT:
    """The vitviz ViT that sees the images: the model, or an image–text model's image tower."""
    return model.image if isinstance(model, ImageTextModel) else model


def _inside_of(stream: Stream, target: int) -> dict:
    """An image's "inside" results for its class `target`, from its recorded forward: first_top1, the
    first layer l (0: the embedding, l: after block l) at which the logit lens [L+1, C] ranks `target`
    first (None: never), and attribution, the target logit's direct attribution to each head
    [L][H] (`vitviz.inside.attribution_of`: layer and head from 0)."""
    return {"first_top1": first_top1_layer(lens_of(stream), target), "attribution": attribution_of(stream, target).heads.tolist()}


def _phrase_embeddings(model: ImageTextModel, texts: list[str]) -> torch.Tensor:
    """The text embedding of each of `texts` [T, E], each distinct phrase encoded once."""
    distinct = sorted(set(texts))
    with torch.inference_mode():
        ids, attention_mask = model.tokenize(distinct)
        embeds = model.encode_text(ids, attention_mask)
    return embeds[torch.tensor([distinct.index(t) for t in texts], device=embeds.device)]


def _phrase_maps(model: ImageTextModel, x: torch.Tensor, texts: list[str], methods, *, distance: bool):
    """Each image's maps for its own phrase: one recorded pass per distinct phrase over the images
    that have it. Returns ({method: [B, gh, gw]}, similarities [B], attention [L, B, H, N, N] when
    `distance` (else None), the grid)."""
    groups: dict[str, list[int]] = {}
    for b, text in enumerate(texts):
        groups.setdefault(text, []).append(b)
    maps: dict[str, torch.Tensor] = {}
    similarities = torch.empty(len(texts), dtype=torch.float64)
    attn = grid = None
    for text, where in groups.items():
        rec = record_for(model, x[where], methods, text=text)
        grid = rec.grid
        for method, m in maps_of(rec, methods).items():
            maps.setdefault(method, torch.empty(len(texts), *m.shape[1:]))[where] = m
        similarities[where] = rec.similarities[:, 0].cpu().double()
        if distance:
            a = rec.attentions.cpu()
            if attn is None:
                attn = torch.empty(a.shape[0], len(texts), *a.shape[2:])
            attn[:, where] = a
    return maps, similarities, attn, grid


def _score_protocol(model: ViT, x: torch.Tensor, items: list[Item], scored: list[dict], *, methods, protocol: "Protocol",
                    classes: dict[str, int | None]) -> None:
    """Fills the rows `scored` with `protocol`'s areas and curves of each method and a random map."""
    spec = model.spec
    labels = [classes.get(item.label) for item in items]
    targets = labels if protocol.explains == "label" else None
    rec = record_for(model, x, methods, targets=targets)
    maps = maps_of(rec, methods)
    maps["random"] = torch.stack([random_maps(rec.grid, seed=_seed(item.file)) for item in items])
    probs = rec.probabilities.cpu()
    for b, row in enumerate(scored):
        target = int(rec.targets[b])
        row.update(target=target, predicted=int(probs[b].argmax()), probability=float(probs[b, target]))
    for method, m in maps.items():
        pixels = pixel_maps(m, patch_size=spec.patch_size)
        if protocol.kind == "chefer2021":
            curves = chefer2021_curves(model, x, pixels, torch.tensor(labels))
            areas = {name: chefer2021_auc(hits) for name, hits in curves.items()}
        else:
            _, found = rise_curves(model, x, pixels)
            curves = {"deletion": found.deletion, "insertion": found.insertion}
            areas = {name: rise_auc(values) for name, values in curves.items()}
        for b, row in enumerate(scored):
            for name in protocol.metrics:
                row[f"{method}_{name}"] = float(areas[name][b])
                row[f"{method}_{name}_curve"] = curves[name][b].tolist()


# ------------------------------------------------------------------------------------------------
# Shards: every line checked before it is merged


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


# ------------------------------------------------------------------------------------------------
# Dataset figures, from the merged rows in file order


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


def summarize(out: str | Path) -> list[dict]:
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


# ------------------------------------------------------------------------------------------------
# The run


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


def evaluate(
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
    from tqdm import tqdm

    from vitviz.sources import get_spec, load_model

    data, out = Path(data), Path(out)
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
    rank, world, device = _setup()
    items = _stamped(items, rank=rank, world=world)
    for note in notes if rank == 0 else ():
        warnings.warn(note, EvaluateWarning, stacklevel=2)
    shards = out / "shards"
    net = load_model(model, device=device)
    spec = net.spec
    if "inside" in metrics and not isinstance(net, ViT):
        raise EvaluateError(f"--metrics inside reads the residual stream of a plain ViT's blocks; {spec.name} is a "
                            f"{type(net).__name__}: leave out inside")
    if phrased and not isinstance(net, ImageTextModel):
        raise EvaluateError(f"{'--text' if text is not None else '--captions'} needs an image–text model (shapes_clip, "
                            f"hf:openai/clip-vit-base-patch16, ...); {spec.name} is not one: explain its classes without a phrase")
    run = dict(format=FORMAT, data=str(data), model=model, protocol=protocol, methods=list(methods), metrics=list(metrics),
               steps=steps, batch_size=batch_size, text=text, captions=digest, images=len(items),
               files={item.file: item.stamp for item in items})
    schema = _row_schema(methods, metrics, steps=steps, depth=spec.depth, heads=spec.heads, classes=spec.num_classes,
                         protocol=protocol, text=phrased)
    before = _previous(out)
    _check_previous(out, before, run, rescan=rescan)  # on every rank: all refuse alike
    done = _done(_read_shards(shards, schema), items)  # a line that is not a row refuses the run before anything is written
    sessions = list(before.get("sessions", [])) if before else []  # the timing of the sessions that scored the rows kept
    _barrier()
    if rank == 0:  # every check passed: the first write of the run
        shards.mkdir(parents=True, exist_ok=True)
        _write_json(out / "run.json", dict(run, sessions=sessions, **_totals(sessions)))
    _barrier()
    plans = [_Batches(len(items), batch_size, r, world, done, max_images) for r in range(world)]  # every rank's, to count them all
    sampler = plans[rank]
    rounds = max(len(p) for p in plans)
    workers = workers if workers is not None else max(0, min(4, (os.cpu_count() or 1) // world - 1))
    loader = torch.utils.data.DataLoader(
        EvalDataset(items, chosen.preprocessing(spec.preprocessing) if chosen is not None else spec.preprocessing,
                    as_their_scripts=chosen is not None),
        batch_sampler=sampler, num_workers=workers,
        collate_fn=_collate, persistent_workers=False,
    )
    shard = shards / f"rank{rank:03d}-of-{world:03d}-{_unique()}.jsonl"
    start = time.perf_counter()
    scored_now = failed_now = 0
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
                for row in _score(net, batch, items, methods=methods, metrics=metrics, steps=steps, classes=classes,
                                  protocol=protocol, phrases=phrases):
                    problem = _row_problem(row, schema)
                    if problem:  # e.g. non-finite outputs: an error row, so that every line written passes the merge's check
                        row = {key: row[key] for key in schema[0]} | {"error": f"the results are not usable: {problem}"}
                    f.write(json.dumps(row) + "\n")
                    if row["error"]:
                        failed_now += 1
                    else:
                        scored_now += 1
                f.flush()
                n = len(batch["index"])
            bar.update(int(_all_sum(torch.tensor([float(n)], dtype=torch.float64), device)[0]))
    seconds = time.perf_counter() - start
    counts = _all_sum(torch.tensor([float(scored_now), float(failed_now), waited], dtype=torch.float64), device)
    scored_now, failed_now, waited = int(counts[0]), int(counts[1]), float(counts[2]) / world  # waited: a rank's, on average
    plain = plain_backward = None
    if compare and scored_now > 0:  # the same decision on every rank: the timing is collective
        x = torch.randn(min(batch_size, len(items)), 3, spec.image_size, spec.image_size)
        batches = max(1, min(8, math.ceil(len(items) / batch_size / world)))
        plain = _plain_rate(_tower(net), x, batches=batches, device=device)
        if _differentiates(methods, metrics, protocol):
            plain_backward = _plain_rate(_tower(net), x, batches=batches, device=device, backward=True)
    _barrier()
    summary, message = None, f"none of the {_plural(len(items), 'image')} could be scored"
    verdict = torch.zeros(2, dtype=torch.float64)  # (images scored, whether every image has a row), from rank 0
    if rank == 0:  # the dataset figures from the merged rows in file order: the same for any number of ranks
        rows = [row for _, row in sorted(_current(_read_shards(shards, schema), items).items())]
        summary = _write_outputs(out, rows, run, spec)
        scored = sum(1 for row in rows if not row["error"])
        if scored_now + failed_now:  # a run that found everything scored keeps the timing of those that scored it
            sessions.append(dict(world_size=world, device=str(device), scored=scored_now, failed=failed_now, seconds=seconds,
                                 images_per_second=(scored_now + failed_now) / max(1e-9, seconds), data_wait_seconds=waited,
                                 plain_forward_images_per_second=plain, plain_forward_backward_images_per_second=plain_backward))
        if "pointing" in metrics and any(item.mask for item in items):
            note = _pointing_note(rows, data)
            if note:
                warnings.warn(note, EvaluateWarning, stacklevel=2)
                notes.append(note)
        run.update(scored=scored, failed=len(rows) - scored, scored_now=scored_now, failed_now=failed_now, warnings=notes,
                   sessions=sessions, **_totals(sessions))
        _write_json(out / "run.json", run)
        verdict = torch.tensor([float(scored), float(len(rows) == len(items))], dtype=torch.float64)
        if rows and not scored:
            message += f" (e.g. {rows[0]['file']}: {rows[0]['error']}); each one's error is in {out / 'per_image.csv'}, column error"
    verdict = _all_sum(verdict, device)  # also the barrier after rank 0's writing
    if verdict[1] and not verdict[0]:
        raise EvaluateError(message, status=1)
    return summary


def _sample(index: int, size: int) -> dict:
    """One image's entry of a batch (`EvalDataset`) before its files are read: a blank input, no mask."""
    return {"index": index, "x": torch.zeros(3, size, size), "mask": torch.zeros(size, size, dtype=torch.bool),
            "has_mask": False, "ok": True, "error": "", "mask_error": "", "sha256": None, "mask_sha256": None}


def _batch_in_memory(x: torch.Tensor, masks: torch.Tensor | None = None) -> dict:
    """The batch `_score` takes, for images already preprocessed: inputs `x` [B, 3, S, S] and object
    masks bool [B, S, S] (or none), as items 0 to B - 1 whose files were read without a digest."""
    samples = [_sample(i, x.shape[-1]) | {"x": x[i]} for i in range(len(x))]
    for sample, mask in zip(samples, masks if masks is not None else ()):
        sample.update(mask=mask, has_mask=True)
    return _collate(samples)


def _collate(samples: list[dict]) -> dict:
    return {
        "index": torch.tensor([s["index"] for s in samples]),
        "x": torch.stack([s["x"] for s in samples]),
        "mask": torch.stack([s["mask"] for s in samples]),
        "has_mask": torch.tensor([s["has_mask"] for s in samples]),
        **{key: [s[key] for s in samples] for key in ("ok", "error", "mask_error", "sha256", "mask_sha256")},
    }


# ------------------------------------------------------------------------------------------------
# The command


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "es" if word.endswith("s") else "s")


def _report(out: Path, run: dict) -> str:
    """The line that ends a run: the images scored and failed now (and in all), the rate, what is left."""
    scored, failed, scored_now, failed_now = run["scored"], run["failed"], run["scored_now"], run["failed_now"]
    why = f"why: {out / 'per_image.csv'}, column error"
    if scored_now + failed_now == 0:
        return (f"Every image was already scored (in {out / 'shards'}): {scored} scored, {failed} failed"
                f"{f' ({why})' if failed else ''}; the summary was written again.")
    now = f"{_plural(scored_now, 'image')} scored, {failed_now} failed{f' ({why})' if failed_now else ''}"
    everything = ""
    if (scored, failed) != (scored_now, failed_now):
        everything = f" (all {run['images']} images: {scored} scored, {failed} failed{f'; {why}' if failed and not failed_now else ''})"
    left = run["images"] - scored - failed
    todo = f"; {_plural(left, 'image')} still to score: run the same command again to go on" if left else ""
    s = run["sessions"][-1]
    plain = s["plain_forward_images_per_second"]
    ratio = f"; plain batched forwards {plain:.1f} img/s, {s['images_per_second'] / plain:.3g}x" if plain else ""
    both = s.get("plain_forward_backward_images_per_second")
    ratio += f"; plain forwards and backwards {both:.1f} img/s, {s['images_per_second'] / both:.3g}x" if both else ""
    return (f"{now} in {s['seconds']:.1f} s on {_plural(s['world_size'], 'process')}: {s['images_per_second']:.1f} img/s{ratio}"
            f"{everything}; results in {out}{todo}")


def _fail(status: int, message: str, *, every_rank: bool) -> NoReturn:
    """One line on stderr, from the first process only unless `every_rank`; then exit with `status`."""
    rank, world = os.environ.get("RANK", "0"), int(os.environ.get("WORLD_SIZE", "1"))
    if every_rank or rank == "0":
        where = f"rank {rank}: " if world > 1 and every_rank else ""
        print(f"vitviz.evaluate: {where}" + " ".join(line.strip() for line in message.splitlines()), file=sys.stderr)
    raise SystemExit(status)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, its mistakes one line (exit status 2) instead of the usage and the error."""

    def error(self, message: str) -> NoReturn:
        _fail(2, f"{message} (python -m vitviz.evaluate --help lists the options)", every_rank=False)


def main(argv: list[str] | None = None) -> None:
    from vitviz.sources import WeightsUnavailableError

    ap = _Parser(prog="python -m vitviz.evaluate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", type=Path, help="a folder of images (ImageFolder layout for classes; masks/ for object masks)")
    ap.add_argument("--model", required=True, help="a variant name, timm:<name> or hf:<repo id>")
    ap.add_argument("--methods", default="rollout,gradient",
                    help="comma-separated, of attention, rollout, gradient, grad_rollout and any a plugin registers (VITVIZ_PLUGINS)")
    ap.add_argument("--metrics", default=None, help=f"comma-separated, of {', '.join(METRICS + EXTRA_METRICS)} (default: "
                                                    f"{', '.join(METRICS)})")
    ap.add_argument("--steps", type=int, default=None, help="deletion/insertion steps, 2 or more (default: 16)")
    ap.add_argument("--protocol", default=None,
                    help="a published protocol, its metrics and steps fixed: " + "; ".join(f"{p.name}: {p.description}" for p in PROTOCOLS.values()))
    ap.add_argument("--text", default=None, help="image–text models: the phrase every image is explained and scored for, e.g. 'a red star'")
    ap.add_argument("--captions", type=Path, default=None, help="image–text models: a CSV file with the columns file,text, a phrase per image")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--workers", type=int, default=None, help="decoding processes per rank, 0 or more")
    ap.add_argument("--max-images", type=int, default=None, help="stop after about this many new images (run again to go on)")
    ap.add_argument("--out", type=Path, required=True, help="the folder for the results: one per model and settings")
    ap.add_argument("--rescan", action="store_true",
                    help="resume although DATA changed: score what is new or changed, drop the rows of what is gone")
    ap.add_argument("--no-compare", action="store_true", help="skip timing plain batched forwards")
    ap.add_argument("--debug", action="store_true", help="show the traceback of an error")
    args = ap.parse_args(argv)
    methods = tuple(m for m in args.methods.split(",") if m)
    metrics = None if args.metrics is None else tuple(m for m in args.metrics.split(",") if m)

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, EvaluateWarning):
            print(f"vitviz.evaluate: warning: {message}", file=sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always", EvaluateWarning)
            default, warnings.showwarning = warnings.showwarning, show
            summary = evaluate(args.data, model=args.model, out=args.out, methods=methods, metrics=metrics, steps=args.steps,
                               batch_size=args.batch_size, workers=args.workers, max_images=args.max_images,
                               compare=not args.no_compare, rescan=args.rescan, protocol=args.protocol, text=args.text,
                               captions=args.captions)
    except KeyboardInterrupt:
        if args.debug:
            raise
        _fail(130, f"stopped; the images scored so far are kept in {args.out / 'shards'}: run the same command again to go on",
              every_rank=False)
    except EvaluateError as exc:  # alike on every rank
        if args.debug:
            raise
        _fail(exc.status, str(exc), every_rank=False)
    except Exception as exc:
        if args.debug:
            raise
        what = str(exc) if isinstance(exc, (WeightsUnavailableError, OSError)) and str(exc) else f"{type(exc).__name__}: {exc}"
        _fail(1, f"{what} (--debug shows the traceback)", every_rank=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if summary is not None:
        print((args.out / "summary.md").read_text())
        print(_report(args.out, json.loads((args.out / "run.json").read_text())))


if __name__ == "__main__":
    main()
