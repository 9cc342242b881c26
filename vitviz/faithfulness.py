"""Which explanation can be trusted, measured: deletion and insertion curves, and the pointing game.

Deletion: the patches are removed in the order of the map, most relevant first, in equal steps; the
model's probability of the target class is recorded after each step. Insertion: the image starts
with every patch removed and they are revealed in the same order. A removed patch holds the value
0 in the normalised input, which is the preprocessing's mean colour. The area under each curve,
over the fraction of patches removed (or revealed) in [0, 1], by the trapezoidal rule: lower is
better for deletion, higher for insertion. A random order is the baseline every figure is read
against (Petsiuk et al., RISE, BMVC 2018; Chefer et al. 2021 evaluate ViT explanations so).

Over a dataset, with the pointing game beside them: `python -m vitviz.evaluate` (on the embedded
shapes models: `python -m vitviz.shapes DIR --n 1000`, then `python -m vitviz.evaluate DIR --model
shapes_p16 --methods attention,rollout,gradient,grad_rollout --out RESULTS`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vitviz.model import ViT
from vitviz.pipeline import spec_of

__all__ = ["Curves", "perturbation_curves", "auc", "random_maps"]


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
    model: ViT, x: torch.Tensor, maps: torch.Tensor, targets: torch.Tensor, *, steps: int = 16, batch_size: int = 64,
    check: Callable[[], None] | None = None,
) -> Curves:
    """Deletion and insertion curves of the orderings `maps` gives.

    Args:
        model: a vitviz ViT with a classifier.
        x: preprocessed images [B, 3, S, S].
        maps: relevance [B, gh, gw]; patches are taken in decreasing order (ties in index order).
        targets: the class of each sample [B].
        steps: equal steps from no patch to every patch (the fractions are i / steps).
        batch_size: perturbed images per forward.
        check: called before each forward; raising there stops the measurement (a deadline, a cancel).
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
        chunks = []
        for i in range(0, len(flat), batch_size):
            if check is not None:
                check()
            chunks.append(model(flat[i : i + batch_size]).float().softmax(-1))
        probs = torch.cat(chunks)
        t = targets.repeat_interleave(steps + 1).to(probs.device)
        out[mode] = probs[torch.arange(len(t)), t].reshape(b, steps + 1).cpu()
    return Curves(fractions=counts.float() / m, deletion=out["deletion"], insertion=out["insertion"])
