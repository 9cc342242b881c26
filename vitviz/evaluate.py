"""Dataset statistics and an explanation benchmark over a folder of images, on one process or many.

    python -m vitviz.evaluate DATA --model shapes_p16 --methods rollout,gradient \\
        --metrics distance,pointing,deletion,insertion --out results/
    torchrun --nproc_per_node=2 -m vitviz.evaluate DATA --model vit_b_16 --out results/   # gloo on CPU, NCCL on GPUs
    srun torchrun --nnodes=$SLURM_NNODES --nproc_per_node=4 --rdzv_backend=c10d \\
        --rdzv_endpoint=$HEAD_NODE:29500 -m vitviz.evaluate DATA --model vit_b_16 --out results/

DATA is a folder of images, searched recursively; in the ImageFolder layout (DATA/<class>/<image>)
the folder's name is the image's class, and the class explained and scored is that one when the
model knows it (else its top-1). Object masks for the pointing game lie under DATA/masks/ with the
image's relative path and stem (any image format; white on the object). `python -m vitviz.shapes DIR
--n 1000` writes such a folder.

Metrics: "distance" (mean attention distance per layer and head, the paper's Figure 7, averaged over
images), "pointing" (does each method's map peak on the object, dilated by one patch), "deletion" and
"insertion" (area under the class probability's curve as patches go in the map's order; a random
order is scored beside every method). The images are cut into global batches of --batch-size in
file order, dealt to the ranks in turn: every image is scored once, by the same batch whatever the
number of processes, and none is repeated to pad a rank. Each rank appends one line per image to its
shard (DIR/shards/); a run started again skips the images already there. Dataset figures are sums
reduced over the ranks with `all_reduce`; rank 0 merges the shards into per_image.csv and writes
summary.csv (mean and 95 % interval per method and metric: Wilson's for the pointing game), distance.csv/.png and curves.png.

    summary = vitviz.evaluate.summarize("results/")     # the same summary, from Python
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image

from vitviz import plots
from vitviz.analysis import mean_attention_distance, pointing_game, uniform_attention_distance
from vitviz.explanations import METHODS, maps_of, record
from vitviz.faithfulness import auc, perturbation_curves, random_maps
from vitviz.hooks import record_attention
from vitviz.images import ImageError, load_image
from vitviz.model import ViT
from vitviz.preprocess import Preprocessing, crop, to_input

__all__ = ["METRICS", "Item", "scan", "EvalDataset", "Z95", "wilson", "evaluate", "summarize", "main"]

METRICS = ("distance", "pointing", "deletion", "insertion")
SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff"}
Z95 = 1.959963984540054  # the normal quantile of a two-sided 95 % interval


@dataclass(frozen=True)
class Item:
    index: int
    path: str
    label: str | None
    mask: str | None


def scan(root: str | Path) -> list[Item]:
    """Every image under `root` (not under root/masks), sorted by path; the class is the first folder
    below `root` when there is one; the mask is root/masks/<the same relative path and stem>.*."""
    root = Path(root)
    masks_root = root / "masks"
    masks = {}
    if masks_root.is_dir():
        for p in masks_root.rglob("*"):
            if p.suffix.lower() in SUFFIXES:
                masks[p.relative_to(masks_root).with_suffix("").as_posix()] = str(p)
    paths = sorted(p for p in root.rglob("*") if p.suffix.lower() in SUFFIXES and masks_root not in p.parents)
    items = []
    for i, p in enumerate(paths):
        rel = p.relative_to(root)
        label = rel.parts[0] if len(rel.parts) > 1 else None
        items.append(Item(i, str(p), label, masks.get(rel.with_suffix("").as_posix())))
    return items


class EvalDataset(torch.utils.data.Dataset):
    """Items read, checked and preprocessed (in DataLoader workers): the model's input, the object
    mask cropped the same way (nearest), and whether the image could be read at all."""

    def __init__(self, items: list[Item], pre: Preprocessing) -> None:
        self.items = items
        self.pre = pre
        self.mask_pre = Preprocessing(pre.image_size, pre.resize_size, pre.mode, interpolation="nearest")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        item = self.items[i]
        s = self.pre.image_size
        out = {"index": item.index, "x": torch.zeros(3, s, s), "mask": torch.zeros(s, s, dtype=torch.bool),
               "has_mask": False, "ok": True, "error": ""}
        try:
            out["x"] = to_input(crop(load_image(item.path), self.pre), self.pre)
        except ImageError as exc:
            out.update(ok=False, error=str(exc))
            return out
        if item.mask:
            with Image.open(item.mask) as m:
                out["mask"] = torch.from_numpy(np.asarray(crop(m.convert("L"), self.mask_pre)) > 127)
            out["has_mask"] = True
        return out


class _Batches(torch.utils.data.Sampler):
    """This rank's global batches (k = rank, rank + world, ...), less the images already done."""

    def __init__(self, n: int, batch_size: int, rank: int, world: int, done: set[int]) -> None:
        self.batches = []
        for k in range(rank, math.ceil(n / batch_size), world):
            batch = [i for i in range(k * batch_size, min((k + 1) * batch_size, n)) if i not in done]
            if batch:
                self.batches.append(batch)

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _mine(n: int, batch_size: int, rank: int, world: int) -> set[int]:
    return {i for k in range(rank, math.ceil(n / batch_size), world) for i in range(k * batch_size, min((k + 1) * batch_size, n))}


# ------------------------------------------------------------------------------------------------
# One batch


def _target(label: str | None, categories) -> int | None:
    if label is None or categories is None:
        return None
    names = list(categories)
    if label in names:
        return names.index(label)
    short = [c.split(",")[0].strip().lower() for c in names]  # timm's "tench, Tinca tinca"
    return short.index(label.lower()) if label.lower() in short else None


def _score(model: ViT, batch: dict, items: list[Item], *, methods, metrics, steps: int) -> list[dict]:
    """Per-image results of one batch (the readable images of it)."""
    spec = model.spec
    keep = [k for k, ok in enumerate(batch["ok"]) if ok]
    rows = [{"index": int(i), "path": items[int(i)].path, "label": items[int(i)].label, "error": e}
            for i, ok, e in zip(batch["index"], batch["ok"], batch["error"]) if not ok]
    if not keep:
        return rows
    x = batch["x"][keep]
    index = batch["index"][keep].tolist()
    mask, has_mask = batch["mask"][keep], batch["has_mask"][keep]
    need_maps = bool({"pointing", "deletion", "insertion"} & set(metrics)) and bool(methods)
    scored = [dict(index=i, path=items[i].path, label=items[i].label, error="") for i in index]
    if need_maps:
        targets = [_target(items[i].label, spec.categories) for i in index] if spec.has_head else None
        rec = record(model, x, targets=targets, gradients=any(m in ("gradient", "grad_rollout") for m in methods))
        attn = rec.attentions
        maps = maps_of(rec, methods)
        maps["random"] = torch.stack([random_maps(rec.grid, seed=i) for i in index])  # seeded by the image
    else:  # distance only: each layer reduced as it is recorded, no stack held
        def per_layer(a: torch.Tensor) -> torch.Tensor:
            return mean_attention_distance(a.float().unsqueeze(0), patch_size=spec.patch_size, num_prefix_tokens=spec.num_prefix_tokens, grid=spec.grid)[0]

        param = next(model.parameters())
        with torch.inference_mode(), record_attention(model, reduce=per_layer) as r:
            logits = model(x.to(device=param.device, dtype=param.dtype))
        dist_lbh = r.attentions.permute(1, 0, 2).cpu().double()  # [B, L, H]
        rec = None
        probs = logits.float().softmax(-1).cpu() if spec.has_head else None
    if need_maps:
        probs = rec.probabilities.cpu() if rec.probabilities is not None else None
        if "distance" in metrics:
            dist_lbh = mean_attention_distance(attn, patch_size=spec.patch_size, num_prefix_tokens=spec.num_prefix_tokens,
                                               grid=rec.grid).permute(1, 0, 2).cpu().double()
    for b, row in enumerate(scored):
        if probs is not None:
            target = int(rec.targets[b]) if rec is not None else int(probs[b].argmax())
            row.update(target=target, predicted=int(probs[b].argmax()), probability=float(probs[b, target]))
        if "distance" in metrics:
            row["distance"] = dist_lbh[b].tolist()
    if need_maps:
        for method, m in maps.items():
            if "pointing" in metrics:
                hits = pointing_game(m, mask, patch_size=spec.patch_size)
                for b, row in enumerate(scored):
                    row[f"{method}_pointing"] = float(hits[b]) if has_mask[b] else None
            if {"deletion", "insertion"} & set(metrics):
                curves = perturbation_curves(model, x, m, rec.targets, steps=steps)
                for b, row in enumerate(scored):
                    if "deletion" in metrics:
                        row[f"{method}_deletion"] = float(curves.deletion_auc[b])
                        row[f"{method}_deletion_curve"] = curves.deletion[b].tolist()
                    if "insertion" in metrics:
                        row[f"{method}_insertion"] = float(curves.insertion_auc[b])
                        row[f"{method}_insertion_curve"] = curves.insertion[b].tolist()
    return rows + scored


# ------------------------------------------------------------------------------------------------
# Shards, reductions, outputs


def _read_shards(folder: Path) -> dict[int, dict]:
    """Every complete line of every shard: {image index: its row} (a line cut short by an interrupted
    run is skipped, and its image scored again)."""
    rows: dict[int, dict] = {}
    for shard in sorted(folder.glob("*.jsonl")):
        for line in shard.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            rows[int(row["index"])] = row
    return rows


def _scores(rows, methods, metrics) -> dict[tuple[str, str], list[float]]:
    """{(method, metric): values}, method "model" for the distance."""
    out: dict[tuple[str, str], list[float]] = {}
    for row in rows:
        if row.get("error"):
            continue
        if "distance" in metrics and row.get("distance") is not None:
            out.setdefault(("model", "distance"), []).append(float(np.mean(row["distance"])))
        for method in (*methods, "random"):
            for metric in ("pointing", "deletion", "insertion"):
                value = row.get(f"{method}_{metric}")
                if metric in metrics and value is not None:
                    out.setdefault((method, metric), []).append(float(value))
    return out


def wilson(hits: float, n: float, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion hits/n: it stays inside [0, 1], also at 0 % and 100 %."""
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def _summary_rows(sums: dict[tuple[str, str], tuple[float, float, float]]) -> list[dict]:
    """(method, metric) -> (count, sum, sum of squares) as rows with the mean and its 95 % interval:
    Wilson's for the pointing game (a proportion), else the normal one, mean ± 1.96 s / sqrt(n)."""
    rows = []
    for (method, metric), (n, total, squares) in sums.items():
        if n <= 0:
            continue
        mean = total / n
        if metric == "pointing":
            low, high = wilson(total, n)
        else:
            var = max(0.0, (squares - n * mean * mean) / (n - 1)) if n > 1 else 0.0
            half = Z95 * math.sqrt(var / n)
            low, high = mean - half, mean + half
        rows.append(dict(method=method, metric=metric, n=int(n), mean=mean, ci95_low=low, ci95_high=high))
    return rows


def summarize(out: str | Path) -> list[dict]:
    """The summary of a finished run, from its per_image.csv: [{method, metric, n, mean, ci95_low, ci95_high}]."""
    out = Path(out)
    run = json.loads((out / "run.json").read_text())
    with open(out / "per_image.csv", newline="") as f:
        table = list(csv.DictReader(f))
    sums = {}
    for row in table:
        if row["error"]:
            continue
        for key, value in row.items():
            if value in ("", None) or key in ("index", "path", "label", "error", "target", "predicted", "probability"):
                continue
            method, _, metric = key.rpartition("_")
            name = ("model", "distance") if key == "distance_mean" else (method, metric)
            n, s, q = sums.get(name, (0.0, 0.0, 0.0))
            v = float(value)
            sums[name] = (n + 1, s + v, q + v * v)
    order = {(m, k): i for i, (m, k) in enumerate(_order(run["methods"], run["metrics"]))}
    return sorted(_summary_rows(sums), key=lambda r: order.get((r["method"], r["metric"]), 1e9))


def _order(methods, metrics):
    out = [("model", "distance")] if "distance" in metrics else []
    return out + [(m, k) for m in (*methods, "random") for k in ("pointing", "deletion", "insertion") if k in metrics]


def _write_outputs(out: Path, rows: list[dict], run: dict, sums, distance, curves, spec) -> None:
    methods, metrics = run["methods"], run["metrics"]
    columns = ["index", "path", "label", "error", "target", "predicted", "probability"]
    if "distance" in metrics:
        columns.append("distance_mean")
    columns += [f"{m}_{k}" for m in (*methods, "random") for k in ("pointing", "deletion", "insertion") if k in metrics]
    with open(out / "per_image.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for row in rows:
            flat = {k: ("" if row.get(k) is None else row.get(k)) for k in columns}
            if row.get("distance") is not None:
                flat["distance_mean"] = repr(float(np.mean(row["distance"])))
            w.writerow(flat)
    summary = sorted(_summary_rows(sums), key=lambda r: _order(methods, metrics).index((r["method"], r["metric"])))
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["method", "metric", "n", "mean", "ci95_low", "ci95_high"])
        w.writeheader()
        w.writerows(summary)
    lines = [f"| method | metric | images | mean | 95 % interval |", "|---|---|---|---|---|"]
    for r in summary:
        pct = r["metric"] == "pointing"
        fmt = (lambda v: f"{100 * v:.1f} %") if pct else (lambda v: f"{v:.2f} px" if r["metric"] == "distance" else f"{v:.3f}")
        lines.append(f"| {r['method']} | {r['metric']} | {r['n']} | {fmt(r['mean'])} | {fmt(r['ci95_low'])} to {fmt(r['ci95_high'])} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    if distance is not None and distance[0] > 0:
        n, total, squares = distance
        mean = total / n
        sd = np.sqrt(np.maximum(0, squares / n - mean**2))
        with open(out / "distance.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["layer", "head", "mean_distance_px", "sd_px", "images"])
            for layer in range(mean.shape[0]):
                for head in range(mean.shape[1]):
                    w.writerow([layer + 1, head + 1, f"{mean[layer, head]:.4f}", f"{sd[layer, head]:.4f}", int(n)])
        fig = plots.distance_figure(torch.from_numpy(mean), uniform=uniform_attention_distance(spec.grid, patch_size=spec.patch_size),
                                    title=f"{spec.name}: mean attention distance over {int(n)} images")
        plots.figure_to_image(fig).save(out / "distance.png")
    if curves:
        fig = plots.curves_figure(curves, steps=run["steps"], title=f"{spec.name}: mean over the images")
        plots.figure_to_image(fig).save(out / "curves.png")


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


def _all_sum(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    if not dist.is_initialized():
        return values
    t = values.to(device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.cpu()


def _plain_rate(model: ViT, x: torch.Tensor, batches: int, device: torch.device) -> float:
    """Images per second of plain batched forwards on every rank at once (summed over the ranks)."""
    x = x.to(device)
    with torch.inference_mode():
        model(x)  # warm-up
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        for _ in range(batches):
            model(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    rate = torch.tensor([batches * x.shape[0] / seconds], dtype=torch.float64)
    return float(_all_sum(rate, device))


def evaluate(
    data: str | Path,
    *,
    model: str,
    out: str | Path,
    methods: tuple[str, ...] = ("rollout", "gradient"),
    metrics: tuple[str, ...] = METRICS,
    steps: int = 16,
    batch_size: int = 32,
    workers: int | None = None,
    max_images: int | None = None,
    compare: bool = True,
    progress: bool = True,
) -> list[dict] | None:
    """Scores every image of `data` (see the module's doc); on rank 0 returns the summary rows."""
    from tqdm import tqdm

    from vitviz.sources import load_model

    unknown = [m for m in metrics if m not in METRICS] + [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown metric or method {unknown[0]!r}; metrics: {', '.join(METRICS)}; methods: {', '.join(METHODS)}")
    rank, world, device = _setup()
    out = Path(out)
    shards = out / "shards"
    if rank == 0:
        shards.mkdir(parents=True, exist_ok=True)
    net = load_model(model, device=device)
    spec = net.spec
    if not spec.has_head and ({"deletion", "insertion"} & set(metrics) or {"gradient", "grad_rollout"} & set(methods)):
        raise ValueError(f"{spec.name} has no classifier: deletion, insertion and the gradient methods need a class")
    items = scan(data)
    if not items:
        raise ValueError(f"no images ({', '.join(sorted(SUFFIXES))}) under {data}")
    run = dict(data=str(data), model=model, methods=list(methods), metrics=list(metrics), steps=steps, batch_size=batch_size,
               images=len(items))
    if rank == 0:
        previous = out / "run.json"
        if previous.exists():
            before = {k: v for k, v in json.loads(previous.read_text()).items() if k in run}
            if before != run:
                raise ValueError(f"{out} holds a run with other settings ({before}); use another --out")
        previous.write_text(json.dumps(run, indent=1))
    if dist.is_initialized():
        dist.barrier()
    done_rows = _read_shards(shards)
    mine = _mine(len(items), batch_size, rank, world)
    done = {i for i in done_rows if i in mine}
    sampler = _Batches(len(items), batch_size, rank, world, done)
    if max_images is not None:  # stop after about this many new images (a run in parts)
        kept, total = [], 0
        for b in sampler.batches:
            if total >= max_images:
                break
            kept.append(b)
            total += len(b)
        sampler.batches = kept
    workers = workers if workers is not None else max(0, min(4, (os.cpu_count() or 1) // world - 1))
    loader = torch.utils.data.DataLoader(
        EvalDataset(items, spec.preprocessing), batch_sampler=sampler, num_workers=workers,
        collate_fn=_collate, persistent_workers=False,
    )
    shard = shards / f"rank{rank:03d}-of-{world:03d}-{os.getpid()}-{int(time.time())}.jsonl"
    start = time.perf_counter()
    scored_now = 0
    bar = tqdm(total=sum(len(b) for b in sampler.batches) * world, unit="img", disable=not (progress and rank == 0), file=sys.stderr)
    with open(shard, "a") as f:
        for batch in loader:
            for row in _score(net, batch, items, methods=methods, metrics=metrics, steps=steps):
                f.write(json.dumps(row) + "\n")
                done_rows[row["index"]] = row
                scored_now += 1
            f.flush()
            bar.update(len(batch["index"]) * world)
    bar.close()
    seconds = time.perf_counter() - start

    # dataset figures: this rank's images (scored now or in an earlier run), summed over the ranks
    my_rows = [done_rows[i] for i in sorted(mine) if i in done_rows]
    keys = _order(methods, metrics)
    values = _scores(my_rows, methods, metrics)
    sums = torch.zeros(len(keys), 3, dtype=torch.float64)
    for k, key in enumerate(keys):
        v = np.asarray(values.get(key, []), dtype=np.float64)
        sums[k] = torch.tensor([len(v), v.sum(), (v * v).sum()])
    sums = _all_sum(sums, device)
    distance = None
    if "distance" in metrics:
        d = [np.asarray(r["distance"]) for r in my_rows if r.get("distance") is not None]
        shape = (spec.depth, spec.heads)
        stack = np.stack(d) if d else np.zeros((0, *shape))
        dsum = _all_sum(torch.from_numpy(np.stack([stack.sum(0), (stack**2).sum(0)]).astype(np.float64)) if d else torch.zeros(2, *shape, dtype=torch.float64), device)
        dn = _all_sum(torch.tensor([float(len(d))], dtype=torch.float64), device)
        distance = (float(dn), dsum[0].numpy(), dsum[1].numpy())
    curves = {}
    for method in (*methods, "random"):
        for mode in ("deletion", "insertion"):
            if mode not in metrics:
                continue
            rows_with = [r[f"{method}_{mode}_curve"] for r in my_rows if r.get(f"{method}_{mode}_curve") is not None]
            total = torch.tensor(np.sum(rows_with, axis=0) if rows_with else np.zeros(steps + 1), dtype=torch.float64)
            n = _all_sum(torch.tensor([float(len(rows_with))], dtype=torch.float64), device)
            total = _all_sum(total, device)
            curves[(method, mode)] = (total / n.clamp(min=1)).numpy()
    counts = _all_sum(torch.tensor([float(scored_now), seconds], dtype=torch.float64), device)
    rate = float(counts[0]) / max(1e-9, seconds)
    plain = None
    if compare and counts[0] > 0:  # the same decision on every rank: the timing is collective
        x = torch.randn(min(batch_size, len(items)), 3, spec.image_size, spec.image_size)
        plain = _plain_rate(net, x, batches=max(1, min(8, math.ceil(len(items) / batch_size / world))), device=device)
    if dist.is_initialized():
        dist.barrier()
    summary = None
    if rank == 0:
        rows = [r for _, r in sorted(_read_shards(shards).items())]
        reduced = {key: tuple(float(v) for v in sums[k]) for k, key in enumerate(keys)}
        _write_outputs(out, rows, run, reduced, distance, curves, spec)
        summary = _summary_rows(reduced)
        run.update(scored_now=int(counts[0]))
        if counts[0] > 0:  # a run that found everything scored keeps the timing of the one that scored it
            run.update(world_size=world, images_per_second=rate, plain_forward_images_per_second=plain, seconds=seconds,
                       device=str(device))
        (out / "run.json").write_text(json.dumps(run, indent=1))
    if dist.is_initialized():
        dist.barrier()
    return summary


def _collate(samples: list[dict]) -> dict:
    return {
        "index": torch.tensor([s["index"] for s in samples]),
        "x": torch.stack([s["x"] for s in samples]),
        "mask": torch.stack([s["mask"] for s in samples]),
        "has_mask": torch.tensor([s["has_mask"] for s in samples]),
        "ok": [s["ok"] for s in samples],
        "error": [s["error"] for s in samples],
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", type=Path, help="a folder of images (ImageFolder layout for classes; masks/ for object masks)")
    ap.add_argument("--model", required=True, help="a variant name, timm:<name> or hf:<repo id>")
    ap.add_argument("--methods", default="rollout,gradient", help=f"comma-separated, of {', '.join(METHODS)}")
    ap.add_argument("--metrics", default=",".join(METRICS), help=f"comma-separated, of {', '.join(METRICS)}")
    ap.add_argument("--steps", type=int, default=16, help="deletion/insertion steps")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--workers", type=int, default=None, help="decoding processes per rank")
    ap.add_argument("--max-images", type=int, default=None, help="stop after about this many new images (run again to go on)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--no-compare", action="store_true", help="skip timing plain batched forwards")
    args = ap.parse_args(argv)
    methods = tuple(m for m in args.methods.split(",") if m)
    metrics = tuple(m for m in args.metrics.split(",") if m)
    summary = evaluate(args.data, model=args.model, out=args.out, methods=methods, metrics=metrics, steps=args.steps,
                       batch_size=args.batch_size, workers=args.workers, max_images=args.max_images, compare=not args.no_compare)
    if summary is not None:
        run = json.loads((args.out / "run.json").read_text())
        print((args.out / "summary.md").read_text())
        plain = run.get("plain_forward_images_per_second")
        ratio = f"; plain batched forwards {plain:.1f} img/s, {run['images_per_second'] / plain:.3g}x" if plain else ""
        if run["scored_now"] == 0:
            print(f"Every image was already scored (in {args.out / 'shards'}); the summary was written again.")
        else:
            print(f"{run['scored_now']} images scored in {run['seconds']:.1f} s on {run['world_size']} process(es): "
                  f"{run['images_per_second']:.1f} img/s{ratio}; results in {args.out}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
