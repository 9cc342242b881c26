"""Which explanation can be trusted, measured: deletion and insertion curves, and the pointing game.

Deletion: the patches are removed in the order of the map, most relevant first, in equal steps; the
model's probability of the target class is recorded after each step. Insertion: the image starts
with every patch removed and they are revealed in the same order. A removed patch holds the value
0 in the normalised input, which is the preprocessing's mean colour. The area under each curve,
over the fraction of patches removed (or revealed) in [0, 1], by the trapezoidal rule: lower is
better for deletion, higher for insertion. A random order is the baseline every figure is read
against (Petsiuk et al., RISE, BMVC 2018; Chefer et al. 2021 evaluate ViT explanations so).

    python -m vitviz.faithfulness --model shapes_p16 --n 1000 --seed 2024

prints, for the embedded shapes models on generated images never trained on, the pointing game,
deletion AUC and insertion AUC of every method and of a random map.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np
import torch

from vitviz.analysis import pointing_game
from vitviz.explain import METHODS, relevance_maps
from vitviz.model import ViT
from vitviz.pipeline import spec_of

__all__ = ["Curves", "perturbation_curves", "auc", "random_maps", "evaluate_shapes", "main"]


@dataclass
class Curves:
    """Deletion and insertion curves of a batch for one ordering.

    Attributes:
        fractions: the share of patches removed (deletion) or revealed (insertion) [S + 1].
        deletion, insertion: the model's probability of each sample's target [B, S + 1].
    """

    fractions: torch.Tensor
    deletion: torch.Tensor
    insertion: torch.Tensor

    @property
    def deletion_auc(self) -> torch.Tensor:
        """[B]; lower is better."""
        return auc(self.fractions, self.deletion)

    @property
    def insertion_auc(self) -> torch.Tensor:
        """[B]; higher is better."""
        return auc(self.fractions, self.insertion)


def auc(fractions: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Area under values [..., S + 1] over fractions [S + 1], by the trapezoidal rule."""
    return torch.trapezoid(values, fractions, dim=-1)


def random_maps(shape: tuple[int, ...], *, seed: int) -> torch.Tensor:
    """A random map per sample (uniform values; its order is a random permutation), seeded."""
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed))


def _patch_mask(order: torch.Tensor, counts: torch.Tensor, grid: tuple[int, int], patch: int) -> torch.Tensor:
    """[B, M] patch orders, [S] counts -> bool [B, S, H, W]: True where the first `count` patches lie."""
    b, m = order.shape
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(m).expand(b, m))  # rank[b, j]: the position of patch j in the order
    taken = rank[:, None, :] < counts[None, :, None]  # [B, S, M]
    gh, gw = grid
    return taken.reshape(b, len(counts), gh, gw).repeat_interleave(patch, 2).repeat_interleave(patch, 3)


@torch.inference_mode()
def perturbation_curves(
    model: ViT, x: torch.Tensor, maps: torch.Tensor, targets: torch.Tensor, *, steps: int = 16, batch_size: int = 64
) -> Curves:
    """Deletion and insertion curves of the orderings `maps` gives.

    Args:
        model: a vitviz ViT with a classifier.
        x: preprocessed images [B, 3, S, S].
        maps: relevance [B, gh, gw]; patches are taken in decreasing order (ties in index order).
        targets: the class of each sample [B].
        steps: equal steps from no patch to every patch (the fractions are i / steps).
    """
    spec = spec_of(model)
    if not spec.has_head:
        raise ValueError(f"{spec.name} has no classifier: deletion and insertion measure a class probability")
    b = x.shape[0]
    grid = model.grid_for(x.shape[-2], x.shape[-1])
    m = grid[0] * grid[1]
    order = maps.reshape(b, m).float().argsort(dim=1, descending=True, stable=True)
    counts = torch.round(torch.arange(steps + 1) / steps * m).long()
    removed = _patch_mask(order, counts, grid, spec.patch_size)  # [B, S + 1, H, W]
    param = next(model.parameters())
    x = x.to(device=param.device, dtype=param.dtype)
    targets = torch.as_tensor(targets)
    out = {}
    for mode, keep in (("deletion", ~removed), ("insertion", removed)):
        batch = x[:, None] * keep[:, :, None].to(x.device, x.dtype)  # [B, S + 1, 3, H, W]; 0 = the mean colour
        flat = batch.reshape(-1, *x.shape[1:])
        probs = torch.cat([model(flat[i : i + batch_size]).float().softmax(-1) for i in range(0, len(flat), batch_size)])
        t = targets.repeat_interleave(steps + 1).to(probs.device)
        out[mode] = probs[torch.arange(len(t)), t].reshape(b, steps + 1).cpu()
    return Curves(fractions=counts.float() / m, deletion=out["deletion"], insertion=out["insertion"])


def evaluate_shapes(
    name: str, *, n: int = 1000, seed: int = 2024, steps: int = 16, batch_size: int = 50, methods=METHODS, device=None
) -> dict[str, dict[str, float]]:
    """Every method's pointing game and deletion/insertion AUC on `n` generated shapes images (and a
    random map's), for an embedded shapes model. Returns {method: {pointing, deletion, insertion}}."""
    from vitviz.shapes import generate
    from vitviz.sources import load_model

    model = load_model(name, device=device or "cpu")
    pre = model.spec.preprocessing
    images, labels, masks = generate(n, seed=seed, image_size=pre.image_size)
    mean, std = torch.tensor(pre.mean).view(1, 3, 1, 1), torch.tensor(pre.std).view(1, 3, 1, 1)

    def to_batch(arrays: np.ndarray) -> torch.Tensor:  # uint8 [B, S, S, 3] at the model's size already
        return (torch.from_numpy(arrays).permute(0, 3, 1, 2).float() / 255 - mean) / std

    sums: dict[str, dict[str, float]] = {k: {"pointing": 0.0, "deletion": 0.0, "insertion": 0.0} for k in (*methods, "random")}
    for s in range(0, n, batch_size):
        x = to_batch(images[s : s + batch_size])
        maps, targets, _ = relevance_maps(model, x, methods=methods, targets=[int(v) for v in labels[s : s + batch_size]])
        maps["random"] = random_maps(maps[methods[0]].shape, seed=seed * 100_003 + s)
        mask = torch.from_numpy(masks[s : s + batch_size])
        for method, m in maps.items():
            curves = perturbation_curves(model, x, m, targets, steps=steps)
            sums[method]["pointing"] += pointing_game(m, mask, patch_size=model.patch_size).float().sum().item()
            sums[method]["deletion"] += curves.deletion_auc.sum().item()
            sums[method]["insertion"] += curves.insertion_auc.sum().item()
    return {method: {k: v / n for k, v in figures.items()} for method, figures in sums.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["shapes_p16", "shapes_p8"])
    ap.add_argument("--n", type=int, default=1000, help="generated images (vitviz.shapes)")
    ap.add_argument("--seed", type=int, default=2024, help="their seed (training used 0 and 1)")
    ap.add_argument("--steps", type=int, default=16, help="deletion/insertion steps")
    ap.add_argument("--device", default=None)
    args = ap.parse_args(argv)
    print(f"{args.n} generated images, seed {args.seed}; deletion and insertion in {args.steps} steps; target: the true class")
    print("| model | method | pointing game | deletion AUC (lower is better) | insertion AUC (higher is better) |")
    print("|---|---|---|---|---|")
    for name in args.model:
        start = time.perf_counter()
        figures = evaluate_shapes(name, n=args.n, seed=args.seed, steps=args.steps, device=args.device)
        for method, f in figures.items():
            print(f"| `{name}` | {method} | {f['pointing']:.1%} | {f['deletion']:.3f} | {f['insertion']:.3f} |", flush=True)
        print(f"<!-- {name}: {time.perf_counter() - start:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()

