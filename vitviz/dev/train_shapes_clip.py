"""Trains the embedded image–text model `shapes_clip` from a seed and writes its weights, offline.

    python -m vitviz.dev.train_shapes_clip                    # assets/shapes_clip.pt
    python -m vitviz.dev.train_shapes_clip --steps 300 --out /tmp/clip
    python -m vitviz.dev.train_shapes_clip --report           # the published figures of assets/shapes_clip.pt
    python -m vitviz.dev.train_shapes_clip --grounding        # phrase pointing game per method, 1,000 fresh scenes

Contrastive pre-training as CLIP's (Radford et al. 2021): a symmetric InfoNCE loss over the batch,
each image against its own caption and every other caption of the batch, with a learnable logit
scale (started at log(1 / 0.07), capped at log 100). The data are generated: scenes of 2-3 shapes in
named colours (`vitviz.shapes.generate_scenes`), each paired at each step with a caption naming one
of its objects ("a red star", "a photo of a red star"; with probability `--no-color` without the
colour: "a star", "a photo of a star"), and, for a share `--singles` of each batch, the single-shape
images of the shapes classifiers (`vitviz.shapes.generate`, random unnamed colours, larger shapes),
captioned by their shape alone. Without the singles the image tower never sees a shape in an
unnamed colour or at their size, which the zero-shot figure is measured on.

In-batch false negatives (two images of the batch both holding a red star, or a caption "a star"
and another image holding a star of any colour) are masked out of both directions of the loss: a
caption is then neither pulled towards nor pushed from an image it truly describes. A single-shape
image's colour has no name: a coloured caption is never counted as describing it.

The rest is the shapes ViTs' recipe (`vitviz.dev.train_shapes`): random 90-degree rotations and
flips (every caption is invariant to both), Muon for the blocks' matrices of both towers and AdamW
for everything else under one warm-up and cosine schedule, weight decay 0.05, gradient clipping at
1.0, sine-cosine position codes for the image tower, and token labelling: every patch token of the
image tower also learns to name the shape it lies on (or "background") through a linear head used
in training only.

`--report` prints zero-shot accuracy on the 8 shape classes (1,000 fresh single-shape images, seed
2024, prompts "a photo of a {shape}"; and the same with the text embeddings of "a photo of a {colour}
{shape}" averaged over the six colours) and caption retrieval on 1,000 fresh scenes (seed 3000).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from vitviz import shapes
from vitviz.dev.train_shapes import _dihedral, generate_pool, in_chunks, sincos_2d, to_batch, token_labels
from vitviz.imagetext import ImageTextModel
from vitviz.sources.embedded import SHAPES_IMAGE_SIZE, shapes_clip_configs
from vitviz.words import WordTokenizer

CHECKOUT_ASSETS = Path(__file__).resolve().parents[2] / "assets"

__all__ = ["generate_scene_pool", "Captions", "Muon32", "muon32", "contrastive_loss", "build_model", "train", "load", "zero_shot", "retrieval", "report"]

COLOR_NAMES = tuple(shapes.COLORS)
PAIRS = [(c, s) for c in COLOR_NAMES for s in shapes.CLASSES]  # 48 (colour, shape) pairs, index c * 8 + s
COLOR_TEMPLATES = ("a {} {}", "a photo of a {} {}")
SHAPE_TEMPLATES = ("a {}", "a photo of a {}")


def generate_scene_pool(n: int, *, seed: int, workers: int = 2, chunk: int = 1000) -> tuple[np.ndarray, list, list]:
    """`shapes.generate_scenes(n, seed=seed)` computed in parallel chunks (identical result)."""
    parts = in_chunks(shapes.generate_scenes, n, seed=seed, workers=workers, chunk=chunk)
    return np.concatenate([p[0] for p in parts]), [o for p in parts for o in p[1]], [m for p in parts for m in p[2]]


class Captions:
    """Every caption the training draws from, tokenized once.

    A caption is (template, colour or -1, shape): `ids` [K, C] and `mask` [K, C] hold them all;
    `index(template, colour, shape)` finds a row.
    """

    def __init__(self, tokenizer: WordTokenizer, *, context_length: int) -> None:
        texts, self._rows = [], {}
        for t, template in enumerate(COLOR_TEMPLATES):
            for c, color in enumerate(COLOR_NAMES):
                for s, shape in enumerate(shapes.CLASSES):
                    self._rows[(t, c, s)] = len(texts)
                    texts.append(template.format(color, shape))
        for t, template in enumerate(SHAPE_TEMPLATES):
            for s, shape in enumerate(shapes.CLASSES):
                self._rows[(t, -1, s)] = len(texts)
                texts.append(template.format(shape))
        self.texts = texts
        out = tokenizer(texts, padding=True, truncation=True, max_length=context_length, return_tensors="pt")
        self.ids, self.mask = out["input_ids"], out["attention_mask"]

    def index(self, template: int, color: int, shape: int) -> int:
        return self._rows[(template, color, shape)]


def _presence(objects: list[list[tuple[str, str]]] | None, labels: np.ndarray | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Which (colour, shape) pairs [n, 48] and which shapes [n, 8] each image holds (bool); a
    single-shape image (`labels`) holds its shape and no named pair."""
    if objects is not None:
        n = len(objects)
        pairs = torch.zeros(n, len(PAIRS), dtype=torch.bool)
        kinds = torch.zeros(n, len(shapes.CLASSES), dtype=torch.bool)
        for i, objs in enumerate(objects):
            for color, shape in objs:
                c, s = COLOR_NAMES.index(color), shapes.CLASSES.index(shape)
                pairs[i, c * len(shapes.CLASSES) + s] = True
                kinds[i, s] = True
        return pairs, kinds
    assert labels is not None
    kinds = F.one_hot(torch.as_tensor(labels), len(shapes.CLASSES)).bool()
    return torch.zeros(len(labels), len(PAIRS), dtype=torch.bool), kinds


def _scene_token_labels(masks: list[np.ndarray], objects: list[list[tuple[str, str]]], patch_size: int, *, cover: float = 0.2) -> torch.Tensor:
    """Per-patch targets uint8 [n, gh, gw] of scenes: the shape of the object covering most of the
    patch where it covers at least `cover`, else `len(CLASSES)` (background)."""
    out = []
    for m, objs in zip(masks, objects):
        frac = F.avg_pool2d(torch.from_numpy(m).float().unsqueeze(1), patch_size)[:, 0]  # [K, gh, gw]
        best, k = frac.max(0)
        kinds = torch.tensor([shapes.CLASSES.index(s) for _, s in objs])
        out.append(torch.where(best >= cover, kinds[k], len(shapes.CLASSES)).to(torch.uint8))
    return torch.stack(out)


class Muon32(torch.optim.Optimizer):
    """`torch.optim.Muon` (Nesterov momentum, five quintic Newton-Schulz steps, "match_rms_adamw"
    scaling, decoupled weight decay) with the orthogonalisation in float32 instead of bfloat16.

    Written here because torch's is the step's bottleneck on a CPU without bfloat16 units: over the
    32 block matrices of `shapes_clip` its step took 1.1-1.4 s, against 1.3 s for the forward and
    backward pass of a batch of 128 (2 threads), and this one's orthogonalisations 50-100 ms (one
    thread; 2-core AMD EPYC, 2026-11-24). Its steps differ from torch's by
    1.3 % of their size (torch's bfloat16 rounding).
    """

    def __init__(self, params, *, lr: float, weight_decay: float, momentum: float = 0.95, ns_steps: int = 5) -> None:
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, ns_steps=ns_steps))

    @staticmethod
    def orthogonalise(g: torch.Tensor, *, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
        """About U S' V^T of g = U S V^T with S' near 1 (Keller Jordan's quintic iteration, as torch's)."""
        a, b, c = 3.4445, -4.7750, 2.0315
        x = g.float()
        tall = x.shape[0] > x.shape[1]
        if tall:
            x = x.T
        x = x / (x.norm() + eps)
        for _ in range(steps):
            m = x @ x.T
            x = a * x + (b * m + c * m @ m) @ x
        return x.T if tall else x

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, mom = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.lerp_(p.grad, 1 - mom)
                update = self.orthogonalise(p.grad.lerp(buf, mom), steps=group["ns_steps"])
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update.to(p.dtype), alpha=-lr * 0.2 * math.sqrt(max(p.shape)))


def muon32(matrices: list[torch.Tensor], *, lr: float, weight_decay: float, scale: float = 0.8) -> Muon32:
    """`Muon32` set as `vitviz.dev.train_shapes.muon` sets torch's: an update's root mean square is
    `scale` x `lr`, its weight decay `lr` x `weight_decay` per step."""
    boost = scale / 0.2
    return Muon32(matrices, lr=lr * boost, weight_decay=weight_decay / boost)


def contrastive_loss(logits: torch.Tensor, *, false_negatives: torch.Tensor | None = None) -> torch.Tensor:
    """Symmetric InfoNCE: the mean of the cross-entropies of each image over the captions and of each
    caption over the images, the positives on the diagonal.

    Args:
        logits: [B, B], image i (rows) against caption j (columns).
        false_negatives: bool [B, B], pairs off the diagonal that are true matches too: left out of
            both softmaxes.
    """
    if logits.ndim != 2 or logits.shape[0] != logits.shape[1]:
        raise ValueError(f"expected square logits [B, B], got {list(logits.shape)}")
    if false_negatives is not None:
        logits = logits.masked_fill(false_negatives & ~torch.eye(len(logits), dtype=torch.bool, device=logits.device), float("-inf"))
    target = torch.arange(len(logits), device=logits.device)
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


def build_model(*, seed: int) -> ImageTextModel:
    """An untrained `shapes_clip` (seeded), its image tower's position embeddings started as
    sine-cosine codes."""
    torch.manual_seed(seed)
    vision, text = shapes_clip_configs()
    model = ImageTextModel(vision, text)
    with torch.no_grad():
        image = model.image
        image.pos_embed[0, image.num_prefix_tokens :] = sincos_2d(image.grid, image.width)
        image.pos_embed[0, : image.num_prefix_tokens] = 0
    model.tokenizer = WordTokenizer()
    return model


def train(
    scenes: tuple[np.ndarray, list, list],
    singles: tuple[np.ndarray, np.ndarray, np.ndarray],
    *,
    steps: int,
    batch_size: int,
    singles_share: float,
    no_color: float,
    lr: float,
    weight_decay: float,
    warmup: float,
    token_weight: float,
    seed: int,
    log_every: int = 100,
) -> ImageTextModel:
    """Trains `shapes_clip` on the scenes (images, objects, masks) and single-shape images (images,
    labels, masks); returns it in eval mode."""
    model = build_model(seed=seed)
    gen = torch.Generator().manual_seed(seed)
    tokenizer = model.tokenizer
    captions = Captions(tokenizer, context_length=model.text.config.context_length)
    patch = model.image.patch_size
    aux = torch.nn.Linear(model.image.width, len(shapes.CLASSES) + 1)

    # the two pools as one: scenes first, then the singles
    images = torch.from_numpy(np.concatenate([scenes[0], singles[0]]))
    pairs_s, kinds_s = _presence(scenes[1], None)
    pairs_1, kinds_1 = _presence(None, singles[1])
    pairs, kinds = torch.cat([pairs_s, pairs_1]), torch.cat([kinds_s, kinds_1])
    tokens = torch.cat([_scene_token_labels(scenes[2], scenes[1], patch), token_labels(singles[2], singles[1], patch)])
    n_scenes, n_singles = len(scenes[0]), len(singles[0])
    # each scene's objects as (colour index, shape index) [n_scenes, 3], -1 past its count
    objs = torch.full((n_scenes, 3), -1, dtype=torch.long)
    for i, o in enumerate(scenes[1]):
        for k, (c, s) in enumerate(o):
            objs[i, k] = COLOR_NAMES.index(c) * len(shapes.CLASSES) + shapes.CLASSES.index(s)
    counts = (objs >= 0).sum(1)

    decay, no_decay, matrices = [], [], []
    for n, p in model.named_parameters():
        if (n.startswith("image.blocks.") or n.startswith("text.blocks.")) and p.ndim == 2:
            matrices.append(p)
        elif p.ndim >= 2 and "pos_embed" not in n and "cls_token" not in n and "token_embed" not in n:
            decay.append(p)
        else:
            no_decay.append(p)
    opts: list[torch.optim.Optimizer] = [
        torch.optim.AdamW(
            [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay + list(aux.parameters()), "weight_decay": 0.0}],
            lr=lr,
            betas=(0.9, 0.98),
        ),
        muon32(matrices, lr=lr, weight_decay=weight_decay),
    ]
    warm = max(1, int(warmup * steps))

    def factor(s: int) -> float:
        return (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm)))

    scheds = [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in opts]
    n_single = round(singles_share * batch_size)
    n_scene = batch_size - n_single
    print(f"[shapes_clip] {sum(p.numel() for p in model.parameters()):,} parameters, {steps} steps of {batch_size} "
          f"({n_scene} scenes, {n_single} single shapes)", flush=True)
    start = time.perf_counter()
    loss_sum = hit_sum = 0.0
    seen = 0
    model.train()
    for step in range(1, steps + 1):
        si = torch.randint(0, n_scenes, (n_scene,), generator=gen)
        oi = n_scenes + torch.randint(0, n_singles, (n_single,), generator=gen)
        idx = torch.cat([si, oi])
        # a caption per image: one of its objects, with or without its colour, in one of the templates
        pick = (torch.rand(n_scene, generator=gen) * counts[si]).long()
        pair = objs[si, pick]
        template = torch.randint(0, 2, (batch_size,), generator=gen)
        colored = torch.cat([torch.rand(n_scene, generator=gen) >= no_color, torch.zeros(n_single, dtype=torch.bool)])
        shape = torch.cat([pair % len(shapes.CLASSES), torch.as_tensor(singles[1])[oi - n_scenes]])
        color = torch.cat([pair // len(shapes.CLASSES), torch.zeros(n_single, dtype=torch.long)])
        rows = [
            captions.index(int(t), int(c) if col else -1, int(s)) for t, c, s, col in zip(template, color, shape, colored)
        ]
        ids, mask = captions.ids[rows], captions.mask[rows]
        # image i also matches caption j when it holds what j names (a masked false negative)
        named = color * len(shapes.CLASSES) + shape
        matches = torch.where(colored[None, :], pairs[idx][:, named], kinds[idx][:, shape])  # [B, B]

        x, t = _dihedral(gen, to_batch(images[idx]), tokens[idx])
        h = model.image.encode(x)  # [B, N, D] after the final norm
        image_embeds = model.image_projection(h[:, 0])
        logits = model.logits(image_embeds, model.encode_text(ids, mask))
        loss = contrastive_loss(logits, false_negatives=matches)
        if token_weight:
            per_patch = aux(h[:, model.image.num_prefix_tokens :])
            loss = loss + token_weight * F.cross_entropy(per_patch.reshape(-1, per_patch.shape[-1]), t.reshape(-1).long())
        for o in opts:
            o.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()) + list(aux.parameters()), 1.0)
        for o, sched in zip(opts, scheds):
            o.step()
            sched.step()
        with torch.no_grad():
            model.logit_scale.clamp_(max=math.log(100))
        seen += 1
        loss_sum += loss.item()
        hit_sum += (logits.argmax(-1) == torch.arange(batch_size)).float().mean().item()
        if step % log_every == 0 or step == steps:
            elapsed = time.perf_counter() - start
            print(
                f"[shapes_clip] step {step}/{steps} loss {loss_sum / seen:.3f} in-batch image->caption acc {hit_sum / seen:.3f} "
                f"scale {model.logit_scale.exp().item():.1f} lr {scheds[0].get_last_lr()[0]:.2e} "
                f"{step * batch_size / elapsed:.0f} img/s {elapsed / 60:.1f} min",
                flush=True,
            )
            loss_sum = hit_sum = 0.0
            seen = 0
    return model.eval()


@torch.inference_mode()
def _text_embeds(model: ImageTextModel, texts: list[str]) -> torch.Tensor:
    """Normalised text embeddings [T, E]."""
    return F.normalize(model.encode_text(*model.tokenize(texts)), dim=-1)


@torch.inference_mode()
def _image_embeds(model: ImageTextModel, images: np.ndarray, *, batch_size: int = 250) -> torch.Tensor:
    """Normalised image embeddings [n, E]."""
    return torch.cat([F.normalize(model.encode_image(to_batch(images[s : s + batch_size])), dim=-1) for s in range(0, len(images), batch_size)])


def zero_shot(model: ImageTextModel, images: np.ndarray, labels: np.ndarray, *, colors: bool = False) -> float:
    """Zero-shot top-1 over the 8 shape classes in [0, 1]: each image's class is the prompt "a photo
    of a {shape}" it scores highest against; with `colors` each class's text embedding is the mean
    of "a photo of a {colour} {shape}" over the six colours (normalised again)."""
    model.eval()
    if colors:
        texts = [f"a photo of a {c} {s}" for s in shapes.CLASSES for c in COLOR_NAMES]
        classes = F.normalize(_text_embeds(model, texts).reshape(len(shapes.CLASSES), len(COLOR_NAMES), -1).mean(1), dim=-1)
    else:
        classes = _text_embeds(model, [f"a photo of a {s}" for s in shapes.CLASSES])
    scores = _image_embeds(model, images) @ classes.T
    return (scores.argmax(-1) == torch.as_tensor(labels)).float().mean().item()


def retrieval(model: ImageTextModel, images: np.ndarray, objects: list[list[tuple[str, str]]], *, seed: int = 0) -> dict[str, float]:
    """Caption retrieval on scenes, captions "a {colour} {shape}" for all 48 pairs.

    Returns:
        top1: the share of (scene, object) pairs whose true caption outscores every caption naming a
            pair absent from the scene; top1_chance: the same for random scores (the mean of
            1 / (1 + absent pairs)); pairwise: the share of scenes whose caption of one object (picked
            at random, generator seeded with `seed`) outscores the caption of one absent pair (at random),
            chance 0.5.
    """
    model.eval()
    scores = _image_embeds(model, images) @ _text_embeds(model, [f"a {c} {s}" for c, s in PAIRS]).T  # [n, 48]
    rng = np.random.default_rng(seed)
    wins, chance, pairwise = [], [], []
    for i, objs in enumerate(objects):
        present = [PAIRS.index(o) for o in objs]
        absent = [j for j in range(len(PAIRS)) if j not in present]
        top_absent = scores[i, absent].max()
        for j in present:
            wins.append(bool(scores[i, j] > top_absent))
            chance.append(1 / (1 + len(absent)))
        pairwise.append(bool(scores[i, present[rng.integers(len(present))]] > scores[i, absent[rng.integers(len(absent))]]))
    return dict(top1=float(np.mean(wins)), top1_chance=float(np.mean(chance)), pairwise=float(np.mean(pairwise)))


def load(path: Path) -> ImageTextModel:
    """The model in a weights file written by this script."""
    model = build_model(seed=0)
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return model.eval()


def report(model: ImageTextModel) -> dict[str, float]:
    """The published figures: zero-shot on 1,000 single-shape images of seed 2024, retrieval on
    1,000 scenes of seed 3000 (neither ever trained on), and the same for an untrained model."""
    singles = generate_pool(1000, seed=2024)
    scenes = generate_scene_pool(1000, seed=3000)
    out = dict(zero_shot=zero_shot(model, singles[0], singles[1]), zero_shot_colors=zero_shot(model, singles[0], singles[1], colors=True))
    out |= retrieval(model, scenes[0], scenes[1])
    return out


def grounding(model: ImageTextModel, *, n: int = 1000, seed: int = 4000, methods: tuple[str, ...] | None = None) -> dict[str, float]:
    """Phrase grounding: on `n` scenes of `seed` (never trained on), for one object of each (the
    scenes' objects in turn), the map of "a <colour> <shape>" must have its argmax patch inside that
    object's mask dilated by one patch (`vitviz.pointing_game`); each method's hit rate, and that of
    a random map ("random", seeded). One forward and one backward per scene give every method."""
    from vitviz.analysis import pointing_game
    from vitviz.explainers import method as registered_method, methods as registered_methods
    from vitviz.explanations import relevance_maps
    from vitviz.preprocess import to_input
    from PIL import Image

    chosen = methods or tuple(m for m in registered_methods() if not registered_method(m).needs_classifier)
    images, objects, masks = shapes.generate_scenes(n, seed=seed, image_size=SHAPES_IMAGE_SIZE)
    spec = model.spec
    hits = {m: [] for m in (*chosen, "random")}
    generator = torch.Generator().manual_seed(seed)
    for i in range(n):
        k = i % len(objects[i])
        colour, shape = objects[i][k]
        x = to_input(Image.fromarray(images[i]), spec.preprocessing).unsqueeze(0)
        maps, _, _ = relevance_maps(model, x, methods=chosen, text=[f"a {colour} {shape}"])
        mask = torch.from_numpy(masks[i][k])[None]
        for m in chosen:
            hits[m].append(bool(pointing_game(maps[m][0], mask, patch_size=spec.patch_size)[0]))
        grid = maps[chosen[0]].shape[-2:]
        hits["random"].append(bool(pointing_game(torch.rand(1, *grid, generator=generator), mask, patch_size=spec.patch_size)[0]))
    return {m: float(np.mean(h)) for m, h in hits.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenes", type=int, default=40_000, help="size of the generated pool of scenes")
    ap.add_argument("--singles", type=int, default=20_000, help="size of the generated pool of single-shape images")
    ap.add_argument("--singles-share", type=float, default=0.25, help="share of each batch taken from the single-shape images")
    ap.add_argument("--no-color", type=float, default=0.3, help="probability that a scene's caption leaves out the colour")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--warmup", type=float, default=0.03, help="fraction of steps spent warming up")
    ap.add_argument("--token-weight", type=float, default=1.0, help="weight of the per-patch (token labelling) loss; 0 turns it off")
    # one thread: on the shared 2-core machine a forward and backward pass of 128 took 0.57 s with one
    # and 4.9 s with two (the other core busy with other work), 2026-11-24
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: the checkout's assets/)")
    ap.add_argument("--report", action="store_true", help="train nothing: print the figures of the weights in --out")
    ap.add_argument("--grounding", action="store_true", help="train nothing: the phrase pointing game of the weights in --out")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = args.out or CHECKOUT_ASSETS
    path = out / "shapes_clip.pt"
    if args.grounding:
        from vitviz.sources import get_spec

        model = load(path)
        model.spec, model.tokenizer = get_spec("shapes_clip"), WordTokenizer()
        t0 = time.perf_counter()
        r = grounding(model)
        print("| method | phrase pointing game (seed 4000, 1,000 scenes) |")
        print("|---|---|")
        for m, v in r.items():
            print(f"| {m} | {v:.1%} |")
        print(f"({time.perf_counter() - t0:.0f} s)")
        return
    if args.report:
        model = load(path)
        torch.manual_seed(0)
        rows = [("`shapes_clip`", report(model)), ("untrained (seed 0)", report(build_model(seed=0).eval()))]
        print("| model | zero-shot, 8 shapes (seed 2024, 1,000) | same, prompts averaged over colours | caption top-1 among absent pairs (seed 3000, 1,000 scenes) | true vs one absent caption |")
        print("|---|---|---|---|---|")
        for name, r in rows:
            print(f"| {name} | {r['zero_shot']:.1%} | {r['zero_shot_colors']:.1%} | {r['top1']:.1%} | {r['pairwise']:.1%} |", flush=True)
        print(f"chance: zero-shot 12.5 %, caption top-1 {rows[0][1]['top1_chance']:.1%}, true vs one absent 50 %")
        return
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    print(f"generating {args.scenes} scenes and {args.singles} single shapes (seed {args.seed}) ...", flush=True)
    scenes = generate_scene_pool(args.scenes, seed=args.seed)
    singles = generate_pool(args.singles, seed=args.seed)
    print(f"generated in {time.perf_counter() - t0:.0f} s", flush=True)
    t1 = time.perf_counter()
    model = train(
        scenes, singles, steps=args.steps, batch_size=args.batch_size, singles_share=args.singles_share, no_color=args.no_color,
        lr=args.lr, weight_decay=args.weight_decay, warmup=args.warmup, token_weight=args.token_weight, seed=args.seed,
    )
    train_min = (time.perf_counter() - t1) / 60
    val_singles = generate_pool(1000, seed=args.seed + 1)
    val_scenes = generate_scene_pool(1000, seed=args.seed + 1)
    r = retrieval(model, val_scenes[0], val_scenes[1])
    print(f"[shapes_clip] held-out (seed {args.seed + 1}): zero-shot {zero_shot(model, val_singles[0], val_singles[1]):.3f}, "
          f"caption top-1 {r['top1']:.3f}, pairwise {r['pairwise']:.3f}", flush=True)
    torch.save(model.state_dict(), path)
    print(f"[shapes_clip] wrote {path} ({path.stat().st_size / 1e6:.1f} MB); training {train_min:.1f} min, "
          f"total {(time.perf_counter() - t0) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
