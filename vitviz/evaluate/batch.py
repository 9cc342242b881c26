"""One batch: each image's rows, scored in the model's one pass per batch."""

from __future__ import annotations

import re
from contextlib import ExitStack, nullcontext
import torch

from vitviz.analysis import mean_attention_distance, pointing_game
from vitviz.evaluate.data import Item, PROTOCOLS, Protocol, _seed
from vitviz.explanations import maps_of, record_for
from vitviz.faithfulness import (
    chefer2021_auc, chefer2021_curves, perturbation_curves, phrase_similarity, pixel_maps, random_maps, rise_auc, rise_curves,
)
from vitviz.hooks import record_attention
from vitviz.imagetext import ImageTextModel
from vitviz.inside import Stream, attribution_of, first_top1_layer, lens_of, record_stream
from vitviz.model import ViT


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
