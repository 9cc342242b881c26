"""Trains the embedded video model `shapes_video` from a seed and writes its weights, offline; measures it.

    python -m vitviz.dev.train_shapes_video                  # assets/shapes_video.pt
    python -m vitviz.dev.train_shapes_video --steps 200 --out /tmp/video.pt
    python -m vitviz.dev.train_shapes_video --measure        # accuracy and pointing, 1,000 fresh clips

The model is `vitviz.video.shapes.shapes_video_config`'s `VideoViT`: 8 frames in tubelets of 2 at
96 px, patch 16 (4 x 6 x 6 patch tokens and a cls token), learned positions, joint space-time
attention, 4 blocks of width 96, 3 heads, MLP 192, the head on the cls token; its classes are the
moving shape's motion (`vitviz.video.shapes.MOTIONS`: left, right, up, down, still). The data are
generated clips (`vitviz.video.shapes.generate_clips`, data seed 21, 8,000 clips, made once and held
in memory), each drawn clip transformed by a random element of the group made by horizontal and
vertical flips, the transposition of rows and columns, and the reversal of time, its label moved
accordingly (a horizontal flip swaps left and right, ...). Token labelling, as the shapes ViTs'
(`vitviz.dev.train_shapes`): every patch token also learns to name the motion at it, the clip's motion
where the moving shape covers at least a fifth of the token's patch in one of its two frames, else "no
motion here" (every token of a still clip), through a linear head used in training only, its
cross-entropy added to the classifier's at weight 1 (`--token-weight`); in a trial of 400 steps on
2,000 clips the model stayed at chance throughout without it, and left chance within 200 steps with it
(98.6 % on the held-out clips at the end). The position table starts as
3-D sine-cosine codes of (tubelet, row, column) (the cls token's entry zero) and the head at zero.
AdamW (learning rate 1e-3, weight decay 0.05 on the matrices, betas 0.9 and 0.99), 100 warm-up
steps, cosine to zero, cross-entropy, gradients clipped at 1.0, batch 32, 1,500 steps, seed 0, one
CPU thread (`--threads`). A held-out accuracy on 500 clips of data seed 22 is printed at the end.

`--measure` runs on 1,000 fresh clips (data seed 5000, never used in training): the accuracy, per
motion and overall, and, over the clips that move, the pointing game (`vitviz.analysis.pointing_game`:
the argmax patch inside the moving shape's mask dilated by one patch) per tubelet (frames 2k and 2k+1,
the mask the union of the shape's masks in those two frames) of two maps of the cls token, each
restricted to the tubelet's patches (`vitviz.video.analysis.frame_maps`): (a) the space-time rollout
(`space_time_rollout`) and (b) the gradient relevance of the predicted class (Chefer et al. 2021,
`space_time_relevance`), beside a random map (the expected hit rate of a uniformly drawn patch) and
the rollout of an untrained model of the same architecture (seed 0).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from vitviz.video.model import VideoViT
from vitviz.video.shapes import MOTIONS, generate_clips, shapes_video_config, to_videos

CHECKOUT_ASSETS = Path(__file__).resolve().parents[2] / "assets"  # the weights go to the checkout, never into an installed package
TRAIN_SEED, CLIPS, CHECK_SEED, MEASURE_SEED = 21, 8000, 22, 5000

# each transformation's permutation of MOTIONS (left, right, up, down, still) and of token labelling's
# "no motion here" (5)
_HFLIP = torch.tensor([1, 0, 2, 3, 4, 5])
_VFLIP = torch.tensor([0, 1, 3, 2, 4, 5])
_TRANSPOSE = torch.tensor([2, 3, 0, 1, 4, 5])
_REVERSE = torch.tensor([1, 0, 3, 2, 4, 5])


def sincos_3d(grid: tuple[int, int, int], width: int, temperature: float = 10_000.0) -> torch.Tensor:
    """3-D sine-cosine position codes [t * h * w, width], tokens frame by frame, row by row: a sixth of
    the channels each for the sine and cosine of the tubelet, the row and the column, at geometrically
    spaced frequencies; spare channels are 0."""
    t, h, w = grid
    coords = torch.stack(torch.meshgrid(*(torch.arange(n, dtype=torch.float32) for n in grid), indexing="ij"), dim=-1).reshape(-1, 3)
    sixth = width // 6
    omega = 1.0 / temperature ** (torch.arange(sixth, dtype=torch.float32) / max(1, sixth - 1))
    codes = torch.cat([torch.cat([(c[:, None] * omega).sin(), (c[:, None] * omega).cos()], dim=1) for c in coords.unbind(-1)], dim=1)
    return F.pad(codes, (0, width - codes.shape[1]))


def token_labels(masks: np.ndarray, labels: np.ndarray, *, tubelet: int, patch_size: int, cover: float = 0.2) -> torch.Tensor:
    """Per-token targets uint8 [n, t, h, w]: the clip's motion where the moving shape covers at least
    `cover` of the token's patch in one of its tubelet's frames, else 5 ("no motion here"); every token
    of a "still" clip 5."""
    n, frames, size, _ = masks.shape
    t, side = frames // tubelet, size // patch_size
    share = masks.reshape(n, t, tubelet, side, patch_size, side, patch_size).mean(axis=(4, 6)).max(axis=2)  # [n, t, h, w]
    out = np.where(share >= cover, labels[:, None, None, None], 5)
    out[labels == MOTIONS.index("still")] = 5
    return torch.from_numpy(out.astype(np.uint8))


def augment(gen: torch.Generator, clips: torch.Tensor, labels: torch.Tensor,
            tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Each clip [B, T, S, S, 3] flipped left-right, flipped up-down, transposed and reversed in time,
    each with probability 1/2 (drawn from `gen`), its motion label moved as its shape's motion is; the
    token labels [B, t, h, w], when given, moved alike."""
    draws = torch.rand(len(clips), 4, generator=gen) < 0.5
    out, moved, grids = [], [], []
    for i, (hflip, vflip, transpose, reverse) in enumerate(draws.tolist()):
        x, y = clips[i], labels[i]
        g = tokens[i].long() if tokens is not None else torch.zeros(1, 1, 1, dtype=torch.long)
        if hflip:
            x, y, g = x.flip(2), _HFLIP[y], _HFLIP[g.flip(2)]
        if vflip:
            x, y, g = x.flip(1), _VFLIP[y], _VFLIP[g.flip(1)]
        if transpose:
            x, y, g = x.transpose(1, 2), _TRANSPOSE[y], _TRANSPOSE[g.transpose(1, 2)]
        if reverse:
            x, y, g = x.flip(0), _REVERSE[y], _REVERSE[g.flip(0)]
        out.append(x)
        moved.append(y)
        grids.append(g)
    return torch.stack(out), torch.stack(moved), torch.stack(grids) if tokens is not None else None


@torch.no_grad()
def accuracy(model: VideoViT, clips: np.ndarray, labels: np.ndarray, *, batch_size: int = 100) -> tuple[float, np.ndarray]:
    """(top-1 accuracy, the predicted classes [n])."""
    model.eval()
    predicted = np.concatenate([model(to_videos(clips[i : i + batch_size])).argmax(-1).numpy() for i in range(0, len(clips), batch_size)])
    return float((predicted == labels).mean()), predicted


def train(*, steps: int, batch: int, seed: int, out: Path, clips: int = CLIPS, lr: float = 1e-3, token_weight: float = 1.0) -> None:
    start = time.perf_counter()
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = VideoViT(shapes_video_config())
    with torch.no_grad():
        model.pos_embed[0, 1:] = sincos_3d(model.grid, model.width)
        model.pos_embed[0, :1] = 0
        model.head.weight.zero_()
        model.head.bias.zero_()
    aux = torch.nn.Linear(model.width, len(MOTIONS) + 1)  # token labelling's head, used in training only
    videos, labels, masks = generate_clips(clips, TRAIN_SEED)
    tokens = token_labels(masks, labels, tubelet=model.config.tubelet, patch_size=model.patch_size)
    del masks
    videos, labels = torch.from_numpy(videos), torch.from_numpy(labels)
    print(f"{clips} clips (data seed {TRAIN_SEED}) in {time.perf_counter() - start:.0f} s", flush=True)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "pos_embed" not in n and "cls_token" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "pos_embed" not in n and "cls_token" not in n)]
    opt = torch.optim.AdamW([{"params": decay + [aux.weight], "weight_decay": 0.05}, {"params": rest + [aux.bias], "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.99))
    warm = 100

    def factor(s: int) -> float:
        return (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    order, cursor = torch.randperm(clips, generator=gen), 0
    loss_sum, hits, seen = 0.0, 0, 0
    model.train()
    for step in range(1, steps + 1):
        if cursor + batch > clips:
            order, cursor = torch.randperm(clips, generator=gen), 0
        idx = order[cursor : cursor + batch]
        cursor += batch
        x, y, g = augment(gen, videos[idx], labels[idx], tokens[idx])
        encoded = model.encode(to_videos(x))
        logits = model.head_logits(encoded)
        loss = F.cross_entropy(logits, y)
        if token_weight:
            loss = loss + token_weight * F.cross_entropy(aux(encoded[:, 1:]).flatten(0, 1), g.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([*model.parameters(), *aux.parameters()], 1.0)
        opt.step()
        sched.step()
        loss_sum += loss.item() * len(y)
        hits += int((logits.argmax(-1) == y).sum())
        seen += len(y)
        if step % 50 == 0 or step == steps:
            print(f"step {step}/{steps} loss {loss_sum / seen:.3f} train acc {hits / seen:.3f} lr {sched.get_last_lr()[0]:.2e} "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
            loss_sum, hits, seen = 0.0, 0, 0
    del videos
    check, check_labels, _ = generate_clips(500, CHECK_SEED)
    print(f"held-out accuracy {accuracy(model, check, check_labels)[0]:.3f} (500 clips, data seed {CHECK_SEED})")
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.eval().state_dict(), out)
    print(f"wrote {out}: {steps} steps, batch {batch}, seed {seed}, {time.perf_counter() - start:.0f} s "
          f"({(time.perf_counter() - start) / 60:.1f} min)")


def _tubelet_masks(masks: np.ndarray, tubelet: int) -> torch.Tensor:
    """Per-frame masks [n, T, S, S] -> per-tubelet masks [n, T / τ, S, S], the union over each tubelet's frames."""
    n, frames, s, _ = masks.shape
    return torch.from_numpy(masks.reshape(n, frames // tubelet, tubelet, s, s).any(axis=2))


def measure(weights: Path, n: int = 1000, *, batch_size: int = 50) -> dict:
    """Accuracy and pointing on `n` fresh clips (module docstring)."""
    from vitviz.analysis import pointing_chance, pointing_game
    from vitviz.video.analysis import frame_maps, space_time_relevance, space_time_rollout
    from vitviz.video.shapes import load_shapes_video

    model = load_shapes_video(weights_path=str(weights))
    torch.manual_seed(0)
    untrained = VideoViT(shapes_video_config()).eval()
    clips, labels, masks = generate_clips(n, MEASURE_SEED)
    acc, predicted = accuracy(model, clips, labels)
    per_motion = {m: float((predicted[labels == k] == k).mean()) for k, m in enumerate(MOTIONS)}
    moving = np.flatnonzero(labels != MOTIONS.index("still"))
    c = model.config
    t = c.grid[0]
    tubes = _tubelet_masks(masks[moving], c.tubelet)  # [m, t, S, S]
    maps: dict[str, list[torch.Tensor]] = {"rollout": [], "relevance": [], "untrained rollout": []}
    for i in moving:
        x = to_videos(clips[i])
        maps["rollout"].append(frame_maps(space_time_rollout(model.attention(x)), c.grid))
        maps["untrained rollout"].append(frame_maps(space_time_rollout(untrained.attention(x)), c.grid))
    for s in range(0, len(moving), batch_size):
        part = moving[s : s + batch_size]
        relevance = space_time_relevance(model, to_videos(clips[part]), torch.from_numpy(predicted[part]))
        maps["relevance"].extend(frame_maps(r, c.grid) for r in relevance)
    pointing = {}
    for name, found in maps.items():
        stacked = torch.stack(found)  # [m, t, h, w]
        pointing[name] = [float(pointing_game(stacked[:, k], tubes[:, k], patch_size=c.patch_size).float().mean()) for k in range(t)]
    pointing["random"] = [float(pointing_chance(tubes[:, k], patch_size=c.patch_size).mean()) for k in range(t)]
    return {"accuracy": acc, "per motion": per_motion, "clips": n, "moving clips": len(moving), "pointing": pointing}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clips", type=int, default=CLIPS, help="training clips, made once")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--token-weight", type=float, default=1.0, help="weight of the per-token (token labelling) loss; 0 turns it off")
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--measure", action="store_true", help="accuracy and pointing of the weights at --out (default: the embedded)")
    parser.add_argument("--n", type=int, default=1000, help="fresh clips for --measure")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = args.out or CHECKOUT_ASSETS / "shapes_video.pt"
    if args.measure:
        start = time.perf_counter()
        r = measure(out, args.n)
        print(f"accuracy {r['accuracy']:.3f} ({r['clips']} clips, data seed {MEASURE_SEED}); per motion: "
              + ", ".join(f"{m} {a:.3f}" for m, a in r["per motion"].items()))
        print(f"pointing game of the cls token's maps per tubelet (frames 2k, 2k+1), {r['moving clips']} moving clips:")
        for name, hits in r["pointing"].items():
            print(f"  {name:18s} " + " ".join(f"{v:.3f}" for v in hits) + f"   mean {np.mean(hits):.3f}")
        print(f"{time.perf_counter() - start:.0f} s")
        return
    train(steps=args.steps, batch=args.batch, seed=args.seed, out=out, clips=args.clips, lr=args.lr, token_weight=args.token_weight)


if __name__ == "__main__":
    main()
