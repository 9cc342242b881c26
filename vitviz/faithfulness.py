"""Which explanation can be trusted, measured: deletion and insertion curves, and the pointing game.

Deletion: the patches are removed in the order of the map, most relevant first, in equal steps; the
model's probability of the target class is recorded after each step. Insertion: the image starts
with every patch removed and they are revealed in the same order. A removed patch holds the value
0 in the normalised input, which is the preprocessing's mean colour. The area under each curve,
over the fraction of patches removed (or revealed) in [0, 1], by the trapezoidal rule: lower is
better for deletion, higher for insertion. A random order is the baseline every figure is read
against (Petsiuk et al., RISE, BMVC 2018; Chefer et al. 2021 evaluate ViT explanations so).

For an image–text model the score is the similarity of each image with its phrase
(`phrase_similarity`: `logits_per_image`, not a probability, so its areas are not in [0, 1]).

Two published protocols, exactly as their authors' scripts compute them, on maps upsampled to pixels
as Chefer et al. upsample theirs (`pixel_maps`: bilinear by the patch size, then each map scaled to
[0, 1] by its minimum and maximum):
- `chefer2021_curves`: Chefer, Gur & Wolf, "Transformer Interpretability Beyond Attention
  Visualization" (CVPR 2021), the perturbation test of their `pertubation_eval_from_hdf5.py`: the
  top-k pixels (positive: most relevant first; negative: least relevant first) set to 0 in the
  unnormalised image, k = int(S·S·f) for f = 0.1, ..., 0.9; the top-1 on each perturbed image
  compared with the image's dataset class; `chefer2021_auc`: np.trapz of the 10 accuracies (the
  intact image's first) over [0, 0.1, ..., 0.9], times 100.
- `rise_curves`: Petsiuk, Das & Saenko, "RISE" (BMVC 2018), `CausalMetric` of their
  `evaluation.py`: pixels in the map's order (numpy's argsort, reversed), `step` per iteration;
  deletion to zeros (of the normalised image), insertion from a blurred copy (`rise_kernel`); the
  probability of the class the model predicts on the intact image; `rise_auc`, their area.

Over a dataset, with the pointing game beside them: `python -m vitviz.evaluate` (on the embedded
shapes models: `python -m vitviz.shapes DIR --n 1000`, then `python -m vitviz.evaluate DIR --model
shapes_p16 --methods attention,rollout,gradient,grad_rollout --out RESULTS`; `--protocol chefer2021`
or `--protocol rise` for the protocols).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from vitviz.imagetext import ImageTextModel
from vitviz.model import ViT
from vitviz.pipeline import spec_of

__all__ = ["Curves", "Scorer", "perturbation_curves", "auc", "random_maps", "class_probability", "phrase_similarity",
           "pixel_maps", "CHEFER2021_STEPS", "CHEFER2021_FRACTIONS", "chefer2021_curves", "chefer2021_auc", "rise_kernel",
           "rise_curves", "rise_auc"]

# (images [n, 3, S, S], each image's sample index [n]) -> the score each sample's target has on it [n]
Scorer = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Curves:
    """Deletion and insertion curves of a batch for one ordering.

    Attributes:
        fractions: the share of patches removed (deletion) or revealed (insertion) [S + 1].
        deletion, insertion: the model's probability of each sample's target (or its phrase's
            similarity) [B, S + 1].
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


def _tower(model: ViT | ImageTextModel) -> ViT:
    return model.image if isinstance(model, ImageTextModel) else model


def _device(model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    param = next(model.parameters())
    return param.device, param.dtype


def class_probability(model: ViT, targets: Sequence[int] | torch.Tensor) -> Scorer:
    """The softmax probability of each sample's class `targets` [B] (a classifier)."""
    targets = torch.as_tensor(targets)

    def score(images: torch.Tensor, samples: torch.Tensor) -> torch.Tensor:
        probs = model(images).float().softmax(-1)
        return probs[torch.arange(len(samples), device=probs.device), targets[samples].to(probs.device)]

    return score


def phrase_similarity(model: ImageTextModel, text_embeds: torch.Tensor) -> Scorer:
    """The image–text similarity (`logits_per_image`: exp(logit_scale) times the cosine, plus the
    bias where the model has one) of each image with its sample's phrase, whose text embedding is
    `text_embeds` [B, E] (`model.encode_text`)."""

    def score(images: torch.Tensor, samples: torch.Tensor) -> torch.Tensor:
        image_embeds = model.encode_image(images)
        return model.logits(image_embeds, text_embeds[samples].to(image_embeds)).diagonal().float()

    return score


def _patch_mask(order: torch.Tensor, counts: torch.Tensor, grid: tuple[int, ...], patch: int | tuple[int, ...]) -> torch.Tensor:
    """[B, M] patch orders, [S] counts -> bool [B, S, *pixels]: True where the first `count` patches lie.

    `grid` is the patches' grid ((gh, gw) of an image; (t, h, w) of a clip) and `patch` each patch's
    extent along those axes (one side for all, e.g. P; or (τ, P, P) for a clip's tubelets)."""
    b, m = order.shape
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(m, device=order.device).expand(b, m))  # rank[b, j]: the position of patch j in the order
    taken = rank[:, None, :] < counts.to(order.device)[None, :, None]  # [B, S, M]
    sizes = (patch,) * len(grid) if isinstance(patch, int) else tuple(patch)
    out = taken.reshape(b, len(counts), *grid)
    for axis, size in enumerate(sizes):
        out = out.repeat_interleave(size, 2 + axis)
    return out


@torch.inference_mode()
def perturbation_curves(
    model: ViT | ImageTextModel, x: torch.Tensor, maps: torch.Tensor, targets: Sequence[int] | torch.Tensor | None = None, *,
    steps: int = 16, batch_size: int = 64, check: Callable[[], None] | None = None, score: Scorer | None = None,
) -> Curves:
    """Deletion and insertion curves of the orderings `maps` gives.

    Args:
        model: a vitviz ViT with a classifier, or an image–text model with `score`.
        x: preprocessed images [B, 3, S, S].
        maps: relevance [B, gh, gw]; patches are taken in decreasing order (ties in index order).
        targets: the class of each sample [B] (classifiers; the score is its probability).
        steps: equal steps from no patch to every patch (the fractions are i / steps).
        batch_size: perturbed images per forward.
        check: called before each forward; raising there stops the measurement (a deadline, a cancel).
        score: what each curve records instead of the class probability, e.g. `phrase_similarity`.
    """
    spec = spec_of(model)
    if score is None:
        if not spec.has_head or isinstance(model, ImageTextModel):
            raise ValueError(f"{spec.name} has no classifier: deletion and insertion measure a class probability (an "
                             "image–text model: pass score=vitviz.faithfulness.phrase_similarity(model, text_embeds))")
        if targets is None:
            raise ValueError("deletion and insertion of a classifier need each sample's class: targets=[...]")
        score = class_probability(model, targets)
    b = x.shape[0]
    grid = _tower(model).grid_for(x.shape[-2], x.shape[-1])
    m = grid[0] * grid[1]
    order = maps.reshape(b, m).float().argsort(dim=1, descending=True, stable=True)
    counts = torch.round(torch.arange(steps + 1) / steps * m).long()
    removed = _patch_mask(order, counts, grid, spec.patch_size)  # [B, S + 1, H, W]
    device, dtype = _device(model)
    x = x.to(device=device, dtype=dtype)
    samples = torch.arange(b).repeat_interleave(steps + 1)
    out = {}
    for mode in ("deletion", "insertion"):  # one mode's images at a time (`vitviz.cost` prices 18 bytes a pixel of one)
        keep = ~removed if mode == "deletion" else removed
        batch = x[:, None] * keep[:, :, None].to(x.device, x.dtype)  # [B, S + 1, 3, H, W]; 0 = the mean colour
        del keep
        flat = batch.reshape(-1, *x.shape[1:])
        chunks = []
        for i in range(0, len(flat), batch_size):
            if check is not None:
                check()
            chunks.append(score(flat[i : i + batch_size], samples[i : i + batch_size]).float())
        del batch, flat  # before the next mode's images are made
        out[mode] = torch.cat(chunks).reshape(b, steps + 1).cpu()
    return Curves(fractions=counts.float() / m, deletion=out["deletion"], insertion=out["insertion"])


# ------------------------------------------------------------------------------------------------
# Published protocols


def pixel_maps(maps: torch.Tensor, *, patch_size: int) -> torch.Tensor:
    """Patch maps [B, gh, gw] -> pixel maps [B, gh·P, gw·P] in [0, 1], as Chefer et al.'s
    `generate_visualizations.py` makes theirs: bilinear upsampling by the patch size
    (`F.interpolate(..., scale_factor=P, mode="bilinear")`, corners not aligned), then each map
    minus its minimum over its range. A constant map (no range) is all zeros: every pixel ties."""
    if maps.ndim != 3:
        raise ValueError(f"expected maps [B, gh, gw], got {list(maps.shape)}")
    up = F.interpolate(maps[:, None].float().cpu(), scale_factor=patch_size, mode="bilinear")[:, 0]  # [B, S, S]
    low, high = up.amin(dim=(1, 2), keepdim=True), up.amax(dim=(1, 2), keepdim=True)
    span = high - low
    return torch.where(span > 0, (up - low) / torch.where(span > 0, span, torch.ones_like(span)), torch.zeros_like(up))


# their perturbation_steps, as written in pertubation_eval_from_hdf5.py (k = int(S·S·f) pixels)
CHEFER2021_STEPS: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
CHEFER2021_FRACTIONS: tuple[float, ...] = (0.0, *CHEFER2021_STEPS)  # the x of their AUC: the intact image first


def _forward_chunks(n: int, batch_size: int, make: Callable[[slice], torch.Tensor], run: Callable[[torch.Tensor, slice], torch.Tensor],
                    check: Callable[[], None] | None) -> torch.Tensor:
    """run(make(chunk), chunk) over chunks of range(n), concatenated."""
    out = []
    for i in range(0, n, batch_size):
        if check is not None:
            check()
        chunk = slice(i, min(n, i + batch_size))
        out.append(run(make(chunk), chunk).cpu())
    return torch.cat(out)


@torch.inference_mode()
def chefer2021_curves(
    model: ViT, x: torch.Tensor, pixels: torch.Tensor, labels: Sequence[int] | torch.Tensor, *, batch_size: int = 64,
    check: Callable[[], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Chefer et al. 2021's positive and negative perturbation (module doc): whether the model's top-1
    is each image's class on the intact image and with 10 %, ..., 90 % of its pixels removed.

    Args:
        model: a vitviz ViT with a classifier; its preprocessing's mean and std say what 0 in the
            unnormalised image is in `x`.
        x: normalised images [B, 3, S, S].
        pixels: relevance per pixel [B, S, S] (`pixel_maps`); the top-k are removed (positive) or the
            top-k of its negation (negative), as `torch.topk` on the CPU picks them among ties.
        labels: each image's dataset class [B] (their accuracy is against it, whichever class the map
            explains).

    Returns:
        {"positive": hits [B, 10], "negative": hits [B, 10]}: 1.0 where the top-1 is the class, at
        the fractions `CHEFER2021_FRACTIONS`.
    """
    spec = spec_of(model)
    if not spec.has_head:
        raise ValueError(f"{spec.name} has no classifier: the perturbation test measures accuracy")
    b, _, h, w = x.shape
    if tuple(pixels.shape) != (b, h, w):
        raise ValueError(f"expected pixel maps [{b}, {h}, {w}] for images {list(x.shape)}, got {list(pixels.shape)}")
    device, dtype = _device(model)
    x = x.cpu()
    labels = torch.as_tensor(labels).cpu()
    # 0 in the unnormalised image, normalised as their normalize() does it: (0 - mean) / std
    fill = torch.zeros(3).sub(torch.as_tensor(spec.mean, dtype=torch.float32)).div(torch.as_tensor(spec.std, dtype=torch.float32))
    fill = fill.view(1, 3, 1, 1)

    def top1(images: torch.Tensor, chunk: slice, rows: torch.Tensor) -> torch.Tensor:
        out = model(images.to(device=device, dtype=dtype))
        return (out.max(1, keepdim=True)[1].squeeze(1).cpu() == labels[rows]).float()

    intact = _forward_chunks(b, batch_size, lambda c: x[c], lambda im, c: top1(im, c, torch.arange(b)[c]), check)
    vis = pixels.reshape(b, h * w).float().cpu()
    base = h * w
    steps = len(CHEFER2021_STEPS)
    rows = torch.arange(b).repeat_interleave(steps)  # (image, step) pairs, image-major
    out = {}
    for name, v in (("positive", vis), ("negative", -vis)):
        removed = torch.zeros(b, steps, base, dtype=torch.bool)
        for i, fraction in enumerate(CHEFER2021_STEPS):
            idx = torch.topk(v, int(base * fraction), dim=-1)[1]
            removed[:, i].scatter_(1, idx, True)
        removed = removed.reshape(b * steps, 1, h, w)

        def perturbed(c: slice) -> torch.Tensor:
            return torch.where(removed[c], fill, x[rows[c]])

        hits = _forward_chunks(b * steps, batch_size, perturbed, lambda im, c: top1(im, c, rows[c]), check).reshape(b, steps)
        out[name] = torch.cat([intact[:, None], hits], dim=1)
    return out


def chefer2021_auc(hits: torch.Tensor) -> torch.Tensor:
    """Their area: np.trapz(accuracies, [0, 0.1, ..., 0.9]) * 100 over the last axis of hits [..., 10]
    (float64; at most 90). The mean of per-image areas is the area of the mean accuracies."""
    fractions = torch.tensor(CHEFER2021_FRACTIONS, dtype=torch.float64)
    return torch.trapezoid(hits.double(), fractions, dim=-1) * 100


def rise_kernel(klen: int = 11, sigma: float = 5.0) -> torch.Tensor:
    """RISE's blur (`gkern(11, 5)`): a unit impulse at the centre of a klen x klen array smoothed as
    scipy's `gaussian_filter(impulse, sigma)` smooths it (the Gaussian truncated at 4 sigma, the array
    reflected at its edges, so that the mass beyond them folds back in), on the diagonal of a
    [3, 3, klen, klen] float32 kernel: each channel is blurred on its own by `F.conv2d`."""
    radius = int(4.0 * sigma + 0.5)
    offsets = np.arange(-radius, radius + 1)
    weights = np.exp(-0.5 / sigma**2 * offsets.astype(np.float64) ** 2)
    weights /= weights.sum()
    period = 2 * klen  # scipy's "reflect": ... c b a | a b c ... | c b a ...

    def fold(m: np.ndarray) -> np.ndarray:
        r = m % period
        return np.where(r < klen, r, period - 1 - r)

    line = np.array([weights[fold(n + offsets) == klen // 2].sum() for n in range(klen)])  # the impulse's row, smoothed
    kern = np.zeros((3, 3, klen, klen))
    for c in range(3):
        kern[c, c] = np.outer(line, line)  # the impulse and the filter are separable
    return torch.from_numpy(kern.astype(np.float32))


@torch.inference_mode()
def rise_curves(
    model: ViT, x: torch.Tensor, pixels: torch.Tensor, *, step: int | None = None, batch_size: int = 64,
    check: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, Curves]:
    """RISE's deletion and insertion (`CausalMetric`, module doc) of each image.

    Args:
        model: a vitviz ViT with a classifier.
        x: normalised images [B, 3, S, S] (deletion sets pixels to 0 here; insertion starts from
            these blurred by `rise_kernel`, zero-padded).
        pixels: relevance per pixel [B, S, S]; pixels go in the order of numpy's argsort of it,
            reversed (their order, ties included).
        step: pixels changed per iteration; their 224 on 224 px images. None: S, one image row's
            worth, so that a curve has S + 1 points at any size.

    Returns:
        (the class scored [B]: the top-1 on the intact image, Curves over i / n of n = ceil(S·S /
        step) steps: the class's softmax probability). Their area is `rise_auc` of each curve.
    """
    spec = spec_of(model)
    if not spec.has_head:
        raise ValueError(f"{spec.name} has no classifier: deletion and insertion measure a class probability")
    b, _, h, w = x.shape
    if tuple(pixels.shape) != (b, h, w):
        raise ValueError(f"expected pixel maps [{b}, {h}, {w}] for images {list(x.shape)}, got {list(pixels.shape)}")
    hw = h * w
    step = w if step is None else int(step)
    if step < 1:
        raise ValueError(f"step is {step}; it is a number of pixels, 1 or more")
    n = (hw + step - 1) // step
    device, dtype = _device(model)
    x = x.cpu()
    order = np.flip(np.argsort(pixels.reshape(b, hw).float().cpu().numpy(), axis=1), axis=-1)  # most relevant first
    rank = torch.empty(b, hw, dtype=torch.long)
    rank.scatter_(1, torch.from_numpy(order.copy()), torch.arange(hw).expand(b, hw))  # rank[b, p]: when pixel p changes

    def probs(images: torch.Tensor) -> torch.Tensor:
        return model(images.to(device=device, dtype=dtype)).float().softmax(dim=1).cpu()

    classes = _forward_chunks(b, batch_size, lambda c: x[c], lambda im, c: probs(im).argmax(-1), check)
    blurred = F.conv2d(x, rise_kernel(), padding=11 // 2)
    rows = torch.arange(b).repeat_interleave(n + 1)  # (image, iteration) pairs, image-major
    changed_after = step * torch.arange(n + 1).repeat(b)  # pixels of rank below this are changed
    out = {}
    for mode, start, finish in (("deletion", x, torch.zeros_like(x)), ("insertion", blurred, x)):

        def images(c: slice, start=start, finish=finish) -> torch.Tensor:
            changed = (rank[rows[c]] < changed_after[c, None]).view(-1, 1, h, w)
            return torch.where(changed, finish[rows[c]], start[rows[c]])

        def scored(im: torch.Tensor, c: slice) -> torch.Tensor:
            return probs(im)[torch.arange(im.shape[0]), classes[rows[c]]]

        out[mode] = _forward_chunks(b * (n + 1), batch_size, images, scored, check).reshape(b, n + 1)
    fractions = torch.arange(n + 1, dtype=torch.float64) / n
    return classes, Curves(fractions=fractions, deletion=out["deletion"], insertion=out["insertion"])


def rise_auc(values: torch.Tensor) -> torch.Tensor:
    """RISE's area of curves [..., n + 1] over equal steps in [0, 1]: (sum - first / 2 - last / 2) / n,
    float64."""
    v = values.double()
    return (v.sum(-1) - v[..., 0] / 2 - v[..., -1] / 2) / (v.shape[-1] - 1)
