"""Trains the embedded Swin Transformer `shapes_swin` from a seed and writes its weights, offline.

    python -m vitviz.dev.train_shapes_swin                    # assets/shapes_swin.pt
    python -m vitviz.dev.train_shapes_swin --steps 300 --out /tmp/swin
    python -m vitviz.dev.train_shapes_swin --report           # the published figures of assets/shapes_swin.pt

The architecture is `vitviz.sources.embedded.shapes_swin_config` (Liu et al. 2021's Swin, small:
patch 8, stages of 12 x 12, 6 x 6 and 3 x 3 tokens, windows 6, 3 and 3). The recipe is the shapes
ViTs' (`vitviz.dev.train_shapes`): the same generated pool (`generate_pool`, seed `--seed`),
random 90-degree rotations and flips, Muon for the blocks' matrices (attention and MLP) and AdamW
for everything else under one warm-up and cosine schedule, label smoothing 0.1, weight decay 0.05,
gradient clipping at 1.0, the classifier started at zero. A Swin has no position embeddings (its
relative position bias tables start as timm's, truncated normal of 0.02), so there is nothing to
start from sine-cosine codes. Token labelling: each final token also learns to name the shape it
lies on, or "background", through a linear head used in training only; the labels are taken at the
final tokens' size (P 2^(stages-1) = 32 px, a 3 x 3 grid), since those are the tokens the
classifier pools. Muon is `vitviz.dev.train_shapes_clip.Muon32` (torch's update, orthogonalised in
float32, which this CPU runs far faster than torch's bfloat16).

`--report` prints top-1 on 1,000 fresh images (seed 2024, as for the shapes ViTs) and the pointing
game on the same images of rollout, of Chefer et al.'s gradient relevance and of the other maps a
Swin offers (gradient rollout, the last layer's attention): the pooled query's map on the finest
grid (`vitviz.swin_analysis.swin_relevance_maps`; gradient methods explain the true class), beside a
uniformly random map and the rollout of an untrained model of the same shape (seed 0).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from vitviz import shapes
from vitviz.analysis import pointing_game
from vitviz.dev.train_shapes import evaluate, generate_pool, run_steps, to_batch
from vitviz.dev.train_shapes_clip import muon32
from vitviz.sources import get_spec, source_of
from vitviz.swin import Swin
from vitviz.swin_analysis import swin_relevance_maps

CHECKOUT_ASSETS = Path(__file__).resolve().parents[2] / "assets"  # the weights go to the checkout, never into an installed package
NAME = "shapes_swin"
REPORTED = ("rollout", "gradient", "grad_rollout", "attention")  # the maps whose pointing game `--report` prints
FRESH_SEED = 2024  # never trained on (training: --seed, held-out checks: --seed + 1)

__all__ = ["build_model", "parameter_groups", "train", "load", "pointing", "report"]


def build_model(*, seed: int = 0) -> Swin:
    """A `shapes_swin` of random weights (seed `seed`, timm's initialisation) with a zero classifier, and its spec."""
    spec = get_spec(NAME)
    torch.manual_seed(seed)
    model = Swin(spec.config)
    with torch.no_grad():
        model.head.weight.zero_()
        model.head.bias.zero_()
    model.spec = spec
    return model


def parameter_groups(model: Swin) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """(Muon's matrices, AdamW with weight decay, AdamW without): Muon takes the blocks' attention and
    MLP matrices; weight decay falls on the other matrices and filters (patch embedding, merges,
    head), never on biases, norms or the relative position bias tables."""
    matrices, decay, no_decay = [], [], []
    for name, p in model.named_parameters():
        if ".blocks." in name and p.ndim == 2 and "relative_position_bias_table" not in name:
            matrices.append(p)
        elif p.ndim >= 2 and "relative_position_bias_table" not in name:
            decay.append(p)
        else:
            no_decay.append(p)
    return matrices, decay, no_decay


def train(
    pool: tuple[np.ndarray, np.ndarray, np.ndarray],
    val: tuple[np.ndarray, np.ndarray, np.ndarray],
    *,
    steps: int,
    batch_size: int = 64,
    lr: float = 1e-3,
    weight_decay: float = 0.05,
    warmup: float = 0.03,
    token_weight: float = 1.0,
    muon_scale: float = 0.8,
    seed: int = 0,
    log_every: int = 100,
    eval_every: int = 500,
) -> Swin:
    """Trains `shapes_swin` on `pool` (images uint8 [n, 96, 96, 3], labels [n], masks [n, 96, 96])
    and returns it in eval mode, on the CPU; `val` is checked every `eval_every` steps."""
    gen = torch.Generator().manual_seed(seed)
    model = build_model(seed=seed).train()
    c = model.config
    final_patch = c.patch_size * 2 ** (c.num_stages - 1)  # the side of a final token in pixels
    aux = torch.nn.Linear(c.width, len(shapes.CLASSES) + 1)  # token labelling: shape classes + background
    matrices, decay, no_decay = parameter_groups(model)
    opts: list[torch.optim.Optimizer] = [
        torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                           {"params": no_decay + list(aux.parameters()), "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.999)),
        muon32(matrices, lr=lr, weight_decay=weight_decay, scale=muon_scale),
    ]
    grid = model.config.image_size // final_patch
    print(f"[{NAME}] {sum(p.numel() for p in model.parameters()):,} parameters ({len(matrices)} matrices on Muon), "
          f"{steps} steps of {batch_size}, token labels on a {grid} x {grid} grid", flush=True)
    # the final tokens [B, 9, 192] in raster order of the final grid, each labelled
    run_steps(model, aux, opts, pool, val, lambda x: (model.head_logits(h := model.encode(x)), h), name=NAME, gen=gen, steps=steps,
              batch_size=batch_size, warmup=warmup, token_weight=token_weight, token_size=final_patch, log_every=log_every,
              eval_every=eval_every)
    return model.eval()


def load(folder: Path) -> Swin:
    """`shapes_swin` with the weights in `folder`, through its source (as `vitviz.load_model` loads it)."""
    spec = get_spec(NAME)
    return source_of(spec).load(spec, weights_path=str(folder / spec.filename)).eval()


def pointing(
    model: Swin, images: np.ndarray, labels: np.ndarray, masks: np.ndarray, *, methods: tuple[str, ...] = ("rollout", "gradient"),
    batch_size: int = 100,
) -> dict[str, float]:
    """The pointing game of each method's map (the pooled query's, on the finest grid; gradient
    methods explain the true class): the share of images whose map peaks inside the object mask
    dilated by one patch (`vitviz.analysis.pointing_game`)."""
    model.eval()
    hits: dict[str, list[torch.Tensor]] = {m: [] for m in methods}
    for s in range(0, len(images), batch_size):
        x = to_batch(images[s : s + batch_size])
        maps, _, _ = swin_relevance_maps(model, x, methods=methods, targets=torch.as_tensor(labels[s : s + batch_size]).tolist())
        for m in methods:
            hits[m].append(pointing_game(maps[m], torch.from_numpy(masks[s : s + batch_size]), patch_size=model.patch_size))
    return {m: torch.cat(h).float().mean().item() for m, h in hits.items()}


def random_pointing(masks: np.ndarray, *, grid: tuple[int, int], patch_size: int, seed: int = 0) -> float:
    """The pointing game of uniformly random maps [n, gh, gw] (generator seeded with `seed`)."""
    maps = torch.rand(len(masks), *grid, generator=torch.Generator().manual_seed(seed))
    return pointing_game(maps, torch.from_numpy(masks), patch_size=patch_size).float().mean().item()


def report(folder: Path, *, n: int = 1000, seed: int = FRESH_SEED) -> dict[str, float]:
    """The published figures of the weights in `folder`, on `n` fresh images of `seed`: top-1, the
    pointing game of each of `REPORTED`'s maps, of a random map, and of an untrained model's rollout."""
    images, labels, masks = generate_pool(n, seed=seed)
    model = load(folder)
    out = {"top1": evaluate(model, images, labels)}
    out |= pointing(model, images, labels, masks, methods=REPORTED)
    out["random"] = random_pointing(masks, grid=model.config.grid, patch_size=model.patch_size)
    out["untrained_rollout"] = pointing(build_model(seed=0), images, labels, masks, methods=("rollout",))["rollout"]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=60_000, help="size of the generated training pool")
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--warmup", type=float, default=0.03, help="fraction of steps spent warming up")
    ap.add_argument("--token-weight", type=float, default=1.0, help="weight of the per-token (token labelling) loss; 0 turns it off")
    ap.add_argument("--muon-scale", type=float, default=0.8, help="root mean square of a Muon update, in units of the learning rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: the checkout's assets/)")
    ap.add_argument("--report", action="store_true", help="train nothing: print the figures of the weights in --out")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = args.out or CHECKOUT_ASSETS
    if args.report:
        t0 = time.perf_counter()
        r = report(out)
        print(f"1,000 fresh images (seed {FRESH_SEED}): top-1 {r['top1']:.1%}")
        print("| pointing game | " + " | ".join(f"`{m}`" for m in REPORTED) + " | random map | `rollout`, untrained (seed 0) |")
        print("|---|" + "---|" * (len(REPORTED) + 2))
        print(f"| `{NAME}` | " + " | ".join(f"{r[m]:.1%}" for m in REPORTED) + f" | {r['random']:.1%} | {r['untrained_rollout']:.1%} |")
        print(f"({time.perf_counter() - t0:.0f} s)", flush=True)
        return
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    print(f"generating {args.samples} training images (seed {args.seed}) ...", flush=True)
    pool = generate_pool(args.samples, seed=args.seed)
    val = generate_pool(1000, seed=args.seed + 1)
    print(f"generated in {time.perf_counter() - t0:.0f} s; training on the CPU, {args.threads} thread(s)", flush=True)
    t1 = time.perf_counter()
    model = train(pool, val, steps=args.steps, batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay,
                  warmup=args.warmup, token_weight=args.token_weight, muon_scale=args.muon_scale, seed=args.seed)
    path = out / get_spec(NAME).filename
    torch.save(model.state_dict(), path)
    print(f"[{NAME}] wrote {path} ({path.stat().st_size / 1e6:.2f} MB) after {(time.perf_counter() - t1) / 60:.1f} min training; "
          f"total {(time.perf_counter() - t0) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
