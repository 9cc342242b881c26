"""Trains the embedded shapes ViTs (`shapes_p8`, `shapes_p16`) from a seed and writes their weights.

    python -m vitviz.dev.train_shapes                 # both variants into assets/
    python -m vitviz.dev.train_shapes --variants shapes_p16 --steps 500
    python -m vitviz.dev.train_shapes --report        # the published figures of the weights in assets/

Both variants share one recipe: a pool of generated images (`vitviz.shapes`, seed `--seed`), each
batch randomly rotated by multiples of 90 degrees and flipped (every class is invariant to both),
Muon (`torch.optim.Muon`) for the encoder blocks' matrices and AdamW for everything else, one linear warm-up and cosine
decay for both, label smoothing 0.1, gradient clipping at 1.0. Position embeddings start from 2D
sine-cosine codes and the classifier from zero. Token labelling: every patch token also learns to
name the shape it belongs to, or "background", from the object mask (a linear head used in training
only, loss weight `--token-weight`), a dense signal that the small models learn from much sooner
than from the image label alone. The held-out check uses seed `--seed + 1`; the published accuracy
figures use seed 2024, never trained on. With `--optimizer adamw` AdamW trains every parameter. With
`--whiten` the patch embedding starts as a whitening of the training patches (`patch_whitening`);
the shipped weights were trained without it.
"""

from __future__ import annotations

import argparse
import math
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from vitviz import shapes
from vitviz.sources import default_device, get_spec
from vitviz.sources.embedded import SHAPES_IMAGE_SIZE

CHECKOUT_ASSETS = Path(__file__).resolve().parents[2] / "assets"  # the weights go to the checkout, never into an installed package

__all__ = [
    "generate_pool",
    "in_chunks",
    "to_batch",
    "patch_whitening",
    "sincos_2d",
    "token_labels",
    "muon",
    "run_steps",
    "train_variant",
    "evaluate",
]


def _part(args: tuple) -> tuple:
    generate, n, seed, start = args
    return generate(n, seed=seed, image_size=SHAPES_IMAGE_SIZE, start=start)


def in_chunks(generate, n: int, *, seed: int, workers: int = 2, chunk: int = 1000) -> list[tuple]:
    """`generate(n, seed=seed, image_size=SHAPES_IMAGE_SIZE)` (`shapes.generate` or `shapes.generate_scenes`:
    example i depends on `seed` and i alone) made in parts of `chunk` examples by `workers` processes:
    the parts' results, in order."""
    jobs = [(generate, min(chunk, n - s), seed, s) for s in range(0, n, chunk)]
    if workers <= 1:
        return [_part(j) for j in jobs]
    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(_part, jobs))


def generate_pool(n: int, *, seed: int, workers: int = 2, chunk: int = 1000) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`shapes.generate(n, seed=seed)` computed in parallel chunks (identical result)."""
    parts = in_chunks(shapes.generate, n, seed=seed, workers=workers, chunk=chunk)
    return tuple(np.concatenate(p) for p in zip(*parts))  # type: ignore[return-value]


def to_batch(images: np.ndarray | torch.Tensor, *, mean: float = 0.5, std: float = 0.5) -> torch.Tensor:
    """uint8 [B, S, S, 3] -> normalised float [B, 3, S, S] (the shapes variants' preprocessing)."""
    x = torch.as_tensor(images).permute(0, 3, 1, 2).float().div_(255.0)
    return x.sub_(mean).div_(std)


def patch_whitening(
    images: np.ndarray, patch_size: int, width: int, *, samples: int = 200_000, eps: float = 0.1, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A patch embedding that whitens the patches of `images`: weight [width, 3, P, P] and bias [width].

    Output channel k is the k-th principal component of the (normalised, `to_batch`) patches, centred
    and divided by sqrt(lambda_k + eps * mean(lambda)), where lambda are the `width` largest eigenvalues
    of the patch covariance. Components with little variance are thus not blown up, and the
    few dominant ones (a patch's mean colour) end up on the same scale as shape detail. About
    `samples` patches from randomly chosen images (generator seeded with `seed`) are used.
    """
    dim = 3 * patch_size * patch_size
    if width > dim:
        raise ValueError(f"width {width} exceeds the {dim} values of a {patch_size}x{patch_size} RGB patch")
    per_image = (images.shape[1] // patch_size) * (images.shape[2] // patch_size)
    gen = torch.Generator().manual_seed(seed)
    take = torch.randperm(len(images), generator=gen)[: max(1, -(-samples // per_image))].sort().values
    # unfold's order within a patch (channel, row, column) is the conv weight's, flattened
    patches = F.unfold(to_batch(images[take.numpy()]), patch_size, stride=patch_size)
    patches = patches.transpose(1, 2).reshape(-1, dim).double()
    mean = patches.mean(0)
    centred = patches - mean
    cov = centred.T @ centred / len(centred)
    lam, vec = torch.linalg.eigh(cov)  # ascending
    lam, vec = lam.flip(0)[:width], vec.flip(1)[:, :width]
    # eigenvectors have arbitrary signs: fix each so that its largest entry is positive
    vec = vec * torch.sign(vec.gather(0, vec.abs().argmax(0, keepdim=True)))
    lam = lam.clamp_min(0)
    weight = vec.T / (lam + eps * lam.mean()).sqrt()[:, None]
    return weight.reshape(width, 3, patch_size, patch_size).float(), (-weight @ mean).float()


def sincos_2d(grid: tuple[int, int], width: int, temperature: float = 10_000.0) -> torch.Tensor:
    """2D sine-cosine position codes [gh * gw, width]: a quarter of the channels each for the sine and
    cosine of the row and of the column, at geometrically spaced frequencies; spare channels are 0."""
    gh, gw = grid
    rows, cols = torch.meshgrid(torch.arange(gh, dtype=torch.float32), torch.arange(gw, dtype=torch.float32), indexing="ij")
    quarter = width // 4
    omega = 1.0 / temperature ** (torch.arange(quarter, dtype=torch.float32) / max(1, quarter - 1))
    r = rows.reshape(-1, 1) * omega
    c = cols.reshape(-1, 1) * omega
    codes = torch.cat([r.sin(), r.cos(), c.sin(), c.cos()], dim=1)
    return F.pad(codes, (0, width - codes.shape[1]))


def token_labels(masks: np.ndarray, labels: np.ndarray, patch_size: int, *, cover: float = 0.2, chunk: int = 2000) -> torch.Tensor:
    """Per-patch targets uint8 [n, gh, gw]: the image's class where the object covers at least `cover`
    of the patch, else `len(CLASSES)` (background)."""
    out = []
    for s in range(0, len(masks), chunk):
        frac = F.avg_pool2d(torch.from_numpy(masks[s : s + chunk]).float().unsqueeze(1), patch_size)[:, 0]
        y = torch.from_numpy(labels[s : s + chunk]).view(-1, 1, 1)
        out.append(torch.where(frac >= cover, y, len(shapes.CLASSES)).to(torch.uint8))
    return torch.cat(out)


def muon(matrices: list[torch.Tensor], *, lr: float, weight_decay: float, scale: float = 0.8) -> torch.optim.Muon:
    """`torch.optim.Muon` for the encoder's matrices, set so that an update's root mean square is
    `scale` x `lr` and weight decay is `lr` x `weight_decay` per step, whatever the shape.

    Muon orthogonalises the Nesterov momentum direction (five Newton-Schulz steps, close to U V^T
    of its SVD), so that every direction of the update has about the same size however lopsided the
    gradient's spectrum. torch's "match_rms_adamw" scales the update by 0.2 sqrt(max(A, B)) x its
    learning rate (a root mean square of 0.2 x that rate) and decays by that rate x its weight decay;
    so its rate is `lr` x scale / 0.2 and its decay `weight_decay` x 0.2 / scale. One schedule can
    then drive Muon and AdamW alike (it multiplies both rates by the same factor).
    """
    boost = scale / 0.2
    return torch.optim.Muon(
        matrices, lr=lr * boost, weight_decay=weight_decay / boost, momentum=0.95, nesterov=True,
        adjust_lr_fn="match_rms_adamw",
    )


def _dihedral(gen: torch.Generator, *xs: torch.Tensor) -> list[torch.Tensor]:
    """Each sample rotated by a random multiple of 90 degrees and flipped with probability 1/2; every
    tensor in `xs` ([B, ..., H, W]) gets the same transform per sample."""
    t = torch.randint(0, 8, (xs[0].shape[0],), generator=gen)
    outs = [torch.empty_like(x) for x in xs]
    for k in range(8):
        sel = t == k
        if sel.any():
            for x, out in zip(xs, outs):
                y = torch.rot90(x[sel], k % 4, dims=(-2, -1))
                out[sel] = y.flip(-1) if k >= 4 else y
    return outs


@torch.inference_mode()
def evaluate(model: torch.nn.Module, images: np.ndarray, labels: np.ndarray, *, batch_size: int = 250) -> float:
    """Top-1 accuracy in [0, 1]."""
    device = next(model.parameters()).device
    model.eval()
    correct = 0
    for s in range(0, len(images), batch_size):
        logits = model(to_batch(images[s : s + batch_size]).to(device))
        correct += (logits.argmax(-1).cpu() == torch.as_tensor(labels[s : s + batch_size])).sum().item()
    return correct / len(images)


def run_steps(
    model: torch.nn.Module,
    aux: torch.nn.Module,
    opts: list[torch.optim.Optimizer],
    pool: tuple[np.ndarray, np.ndarray, np.ndarray],
    val: tuple[np.ndarray, np.ndarray, np.ndarray],
    forward,
    *,
    name: str,
    gen: torch.Generator,
    steps: int,
    batch_size: int,
    warmup: float,
    token_weight: float,
    token_size: int,
    device: torch.device = torch.device("cpu"),
    log_every: int = 100,
    eval_every: int = 500,
) -> None:
    """The shapes recipe's steps, for any of the shapes models: batches drawn from `pool` without
    replacement (a new order of `gen` at each pass), random 90-degree rotations and flips, the
    classifier's loss (label smoothing 0.1) plus `token_weight` times token labelling's (`aux` on
    the tokens, labels of `token_size` px squares), gradient clipping at 1.0, every optimiser of
    `opts` under one warm-up and cosine schedule; the running loss and accuracy every `log_every`
    steps and the accuracy on `val` every `eval_every`. `forward(x)` -> (logits [B, C], the tokens
    that are labelled [B, T, D], in the labels' raster order)."""
    images = torch.from_numpy(pool[0])
    labels = torch.from_numpy(pool[1])
    tokens = token_labels(pool[2], pool[1], token_size)
    warm = max(1, int(warmup * steps))

    def factor(s: int) -> float:
        return (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm)))

    scheds = [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in opts]
    start = time.perf_counter()
    order = torch.randperm(len(images), generator=gen)
    cursor = seen = hits = 0
    loss_sum = 0.0
    for step in range(1, steps + 1):
        if cursor + batch_size > len(order):  # a new pass over the pool
            order, cursor = torch.randperm(len(images), generator=gen), 0
        idx = order[cursor : cursor + batch_size]
        cursor += batch_size
        x, t = _dihedral(gen, to_batch(images[idx]), tokens[idx])
        x = x.to(device, non_blocking=True)
        y = labels[idx].to(device, non_blocking=True)
        model.train()
        logits, labelled = forward(x)
        loss = F.cross_entropy(logits, y, label_smoothing=0.1)
        if token_weight:
            per_token = aux(labelled)
            loss = loss + token_weight * F.cross_entropy(per_token.reshape(-1, per_token.shape[-1]), t.to(device).reshape(-1).long())
        for o in opts:
            o.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for o, sched in zip(opts, scheds):
            o.step()
            sched.step()
        seen += len(y)
        hits += (logits.argmax(-1) == y).sum().item()
        loss_sum += loss.item() * len(y)
        if step % log_every == 0 or step == steps:
            elapsed = time.perf_counter() - start
            print(f"[{name}] step {step}/{steps} loss {loss_sum / seen:.3f} train acc {hits / seen:.3f} "
                  f"lr {scheds[0].get_last_lr()[0]:.2e} {step * batch_size / elapsed:.0f} img/s {elapsed / 60:.1f} min", flush=True)
            seen = hits = 0
            loss_sum = 0.0
        if step % eval_every == 0 or step == steps:
            print(f"[{name}] step {step}: held-out accuracy {evaluate(model, val[0], val[1]):.4f} ({len(val[0])} images)", flush=True)


def train_variant(
    name: str,
    pool: tuple[np.ndarray, np.ndarray, np.ndarray],
    val: tuple[np.ndarray, np.ndarray, np.ndarray],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    weight_decay: float,
    warmup: float,
    seed: int,
    device: torch.device,
    token_weight: float = 1.0,
    whiten: bool = False,
    optimizer: str = "muon",
    muon_scale: float = 0.8,
    log_every: int = 100,
    eval_every: int = 500,
) -> torch.nn.Module:
    """Trains one shapes variant on `pool` (images, labels, masks) and returns it (eval mode, on CPU).

    `optimizer` is "muon" (`muon` for the encoder blocks' matrices, with update size `muon_scale` * lr,
    AdamW for the rest) or "adamw" (AdamW throughout); all follow one learning rate, warm-up and cosine
    schedule.
    """
    if optimizer not in ("muon", "adamw"):
        raise ValueError(f"optimizer must be 'muon' or 'adamw', not {optimizer!r}")
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = get_spec(name).build()
    with torch.no_grad():
        if whiten:
            weight, bias = patch_whitening(pool[0], model.patch_size, model.width, seed=seed)
            model.patch_embed.proj.weight.copy_(weight)
            model.patch_embed.proj.bias.copy_(bias)
        model.pos_embed[0, model.num_prefix_tokens :] = sincos_2d(model.grid, model.width)
        model.pos_embed[0, : model.num_prefix_tokens] = 0
        model.head.weight.zero_()
        model.head.bias.zero_()
    model = model.to(device).train()
    # token labelling: a per-patch classifier (shape classes + background), discarded after training
    aux = torch.nn.Linear(model.width, len(shapes.CLASSES) + 1).to(device)
    # weight decay on matrices and filters only; never on biases, norms, position embeddings or the cls token.
    # With Muon, the encoder blocks' matrices (attention and MLP) take its update; everything else AdamW's.
    decay, no_decay, matrices = [], [], []
    for n, p in model.named_parameters():
        if optimizer == "muon" and n.startswith("blocks.") and p.ndim == 2:
            matrices.append(p)
        else:
            (decay if p.ndim >= 2 and "pos_embed" not in n and "cls_token" not in n else no_decay).append(p)
    opts: list[torch.optim.Optimizer] = [
        torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": weight_decay},
                {"params": no_decay + list(aux.parameters()), "weight_decay": 0.0},
            ],
            lr=lr,
            betas=(0.9, 0.999),
        )
    ]
    if matrices:
        opts.append(muon(matrices, lr=lr, weight_decay=weight_decay, scale=muon_scale))
    print(
        f"[{name}] {sum(p.numel() for p in model.parameters()):,} parameters, {steps} steps of {batch_size}, {optimizer}",
        flush=True,
    )
    prefix = model.num_prefix_tokens  # the cls token is classified, the patch tokens labelled
    run_steps(model, aux, opts, pool, val, lambda x: (model.head((h := model.encode(x))[:, 0]), h[:, prefix:]), name=name, gen=gen,
              steps=steps, batch_size=batch_size, warmup=warmup, token_weight=token_weight, token_size=model.patch_size,
              device=device, log_every=log_every, eval_every=eval_every)
    return model.eval().cpu()


@torch.inference_mode()
def pointing(model: torch.nn.Module, images: np.ndarray, masks: np.ndarray, *, batch_size: int = 100) -> float:
    """The pointing game of the cls token's attention rollout (mean fusion, no discard): the share of
    images whose map peaks inside the object (dilated by one patch)."""
    from vitviz.analysis import attention_rollout, cls_map, pointing_game
    from vitviz.hooks import record_attention

    model.eval()
    hits = []
    for s in range(0, len(images), batch_size):
        with record_attention(model) as rec:
            model(to_batch(images[s : s + batch_size]))
        maps = cls_map(attention_rollout(rec.attentions), grid=model.grid)
        hits.append(pointing_game(maps, torch.from_numpy(masks[s : s + batch_size]), patch_size=model.patch_size))
    return torch.cat(hits).float().mean().item()


def report(names: list[str], *, weights_dir: Path) -> list[dict[str, float | str]]:
    """The published figures of the shapes models: top-1 on 1,000 images of seed 2024 and 5,000 of
    seed 3000 (never trained on), and the pointing game on the seed-2024 images for the trained
    model and an untrained one of the same shape (seed 0)."""
    fresh = generate_pool(1000, seed=2024)
    more = generate_pool(5000, seed=3000)
    rows = []
    for name in names:
        spec = get_spec(name)
        model = spec.build()
        model.load_state_dict(torch.load(weights_dir / spec.filename, map_location="cpu", weights_only=True))
        torch.manual_seed(0)
        untrained = spec.build()
        rows.append(
            dict(
                variant=name,
                top1=evaluate(model, fresh[0], fresh[1]),
                top1_5000=evaluate(model, more[0], more[1]),
                pointing=pointing(model, fresh[0], fresh[2]),
                pointing_untrained=pointing(untrained, fresh[0], fresh[2]),
            )
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["shapes_p16", "shapes_p8"])
    ap.add_argument("--samples", type=int, default=60_000, help="size of the generated training pool")
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--warmup", type=float, default=0.03, help="fraction of steps spent warming up")
    ap.add_argument("--token-weight", type=float, default=1.0, help="weight of the per-patch (token labelling) loss; 0 turns it off")
    ap.add_argument("--optimizer", choices=["muon", "adamw"], default="muon", help="Muon for the encoder's matrices, or AdamW throughout")
    ap.add_argument("--muon-scale", type=float, default=0.8, help="root mean square of a Muon update, in units of the learning rate")
    ap.add_argument("--whiten", action="store_true", help="start the patch embedding as a whitening of the training patches")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: the checkout's assets/)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--report", action="store_true", help="train nothing: print the figures of the weights in --out")
    args = ap.parse_args(argv)

    device = torch.device(args.device) if args.device else default_device()
    out = args.out or CHECKOUT_ASSETS
    if args.report:
        print("| variant | top-1, seed 2024 (1,000) | top-1, seed 3000 (5,000) | pointing game | same, untrained |")
        print("|---|---|---|---|---|")
        for r in report(args.variants, weights_dir=out):
            print(f"| `{r['variant']}` | {r['top1']:.1%} | {r['top1_5000']:.1%} | {r['pointing']:.1%} | {r['pointing_untrained']:.1%} |", flush=True)
        return
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    print(f"generating {args.samples} training images (seed {args.seed}) ...", flush=True)
    pool = generate_pool(args.samples, seed=args.seed)
    val = generate_pool(1000, seed=args.seed + 1)
    print(f"generated in {time.perf_counter() - t0:.0f} s; training on {device}", flush=True)
    for name in args.variants:
        t1 = time.perf_counter()
        model = train_variant(
            name,
            pool,
            val,
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            weight_decay=args.weight_decay,
            warmup=args.warmup,
            seed=args.seed,
            device=device,
            token_weight=args.token_weight,
            whiten=args.whiten,
            optimizer=args.optimizer,
            muon_scale=args.muon_scale,
        )
        path = out / get_spec(name).filename
        torch.save(model.state_dict(), path)
        print(f"[{name}] wrote {path} ({path.stat().st_size / 1e6:.1f} MB) after {(time.perf_counter() - t1) / 60:.1f} min", flush=True)
    print(f"total {(time.perf_counter() - t0) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
