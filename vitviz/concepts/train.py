"""Training a top-k sparse autoencoder (`vitviz.concepts.sae`) on one layer of a ViT over a folder of
images, streamed from the model, on one process or many (torchrun), resumable; then its evaluation
(ViT-Prisma's table), the index of each feature's strongest tokens and their thumbnails.

    python -m vitviz.concepts train DATA --model shapes_p16 --layer 3 --features 256 --k 8 --out sae/
    torchrun --nproc_per_node=2 -m vitviz.concepts train DATA ... --out sae/      # gloo on CPU, NCCL on GPUs

The data. DATA is read as `python -m vitviz.evaluate` reads it (`vitviz.evaluate.scan`: every image
below it, sorted; DATA/<class>/<image> gives classes; DATA/masks/ is left out), every image through
the image gate (`vitviz.load_image`) and the model's own preprocessing. Step s of epoch e = s // S
(S = ⌈images / images_per_step⌉ steps an epoch) reads the images at places (s mod S)·B ... of
epoch e's permutation of the folder, drawn by numpy from the seed (`_order`); rank r of N reads
images r, r + N, ... of those. Each image runs through the model's blocks up to `layer` (none after
it), and the step trains on the tokens there: the patches ("patches") or every token ("all").
No activation is stored: a step's tokens are dropped once it is done.

The recipe (Gao et al. 2024, appendix A; openai/sparse_autoencoder's `train.py`): b_dec starts at the
mean of the first step's tokens, W_dec's columns at random unit vectors, W_enc at W_decᵀ, b_enc at
0. The loss of a step is

    ( Σ_t ||x_t − x̂_t||²  +  1/32 · Σ_t ||e_t − ê_t||² ) / (T · V)

over the step's T tokens (on every rank), V the variance of the first step's tokens summed over the
channels (fixed for the run: the reference's `mse_scale`, so that the loss is the unexplained share
of the variance and one learning rate fits every model). The second sum is AuxK: a feature is dead
once `dead_after` tokens (default 10 million, Gao et al.'s) have passed since it last fired (was
among a token's k); the k_aux (default D/2) largest pre-activations of the dead features alone
reconstruct the error e = x − x̂ of the live ones. Adam (β = 0.9, 0.999; ε = 6.25e-10, the
reference's), a constant learning rate, no clipping; each step removes from W_dec's gradient its
component along each column, then renormalises the columns after the update.

On N ranks each rank's loss is its own tokens' sum divided by the same T · V, and the gradients are
summed (all-reduce) before the step, as are the features that fired (for the dead counters), the
first step's mean and variance, and the evaluation's sums: N ranks compute what one computes, the
sums split in other places, so the weights agree to float rounding (they are not bitwise equal: a
sum taken in two parts rounds differently; tests/test_concepts_train.py measures the difference).

A checkpoint (the SAE, Adam's state, the step, the dead counters, V, tokens seen, seconds) is written
whole (a temporary file, then a rename) every `checkpoint_every` steps and at the end as
DIR/checkpoint.pt; `resume=True` goes on from it. Nothing random is drawn after the first step (the
images of a step are a function of the seed and the step), so a resumed run computes what an
uninterrupted one computes, to the bit on the same machine and process count.

The evaluation, after the last step, over every image of the folder (or `eval_images` of them spread
evenly over it, in file order), in the form ViT-Prisma reports (`vit_prisma/sae/evals`), defined in
`metrics_table`. Labels come from the class folders, matched to the model's classes as the evaluator
matches them; an image without one is scored against the model's own clean prediction (the table
says how many). Its pass also keeps, for each feature, the n tokens of the largest activation (z),
its share of tokens fired, and its mean activation over the patch tokens of each class's images.
"""

from __future__ import annotations

import math
import os
import shlex
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image, ImageDraw

from vitviz import steps
from vitviz.architectures import attention_of
from vitviz.concepts.sae import AUX_WEIGHT, TopKSAE, train_step
from vitviz.concepts.store import save_concepts
from vitviz.evaluate.batch import _classes
from vitviz.evaluate.data import SUFFIXES, EvalDataset, Item, _collate, _read, _stamped, scan
from vitviz.evaluate.run import _all_sum, _barrier, _setup
from vitviz.images import MAX_PIXELS, ImageError, load_image
from vitviz.imagetext import ImageTextModel
from vitviz.inside.stream import _categories, _labels, _tail, _unembed, readout_of
from vitviz.model import ViT
from vitviz.preprocess import crop

__all__ = ["train", "ConceptsError", "Recipe", "metrics_table", "TOKENS", "CHECKPOINT", "FORMAT"]

TOKENS = ("patches", "all")
CHECKPOINT = "checkpoint.pt"
FORMAT = 1  # of the checkpoint and the card
BETAS = (0.9, 0.999)
EPS = 6.25e-10
DEAD_AFTER = 10_000_000
OUTLINE = (255, 215, 0)  # the centre patch's outline in a thumbnail
BLANK = (255, 255, 255)  # an atlas cell without a token
MAX_THUMB = 256


class ConceptsError(ValueError):
    """A training that will not start, resume or finish; the message says why and what to do.

    Attributes:
        status: the command's exit status (2: a mistake in the command or its folders; 1: nothing to train on).
    """

    def __init__(self, message: str, *, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Recipe:
    """What a run's trajectory depends on: a resumed run must have the same (`_check_resume`)."""

    model: str
    layer: int
    tokens: str
    features: int
    k: int
    seed: int
    images_per_step: int
    lr: float
    k_aux: int
    aux_weight: float
    dead_after: int
    betas: tuple[float, float] = BETAS
    eps: float = EPS

    def as_dict(self) -> dict:
        return {name: (list(v) if isinstance(v, tuple) else v) for name, v in self.__dict__.items()}


@dataclass
class _Plan:
    """A run's arguments once checked, before any process group or model."""

    data: Path
    out: Path
    recipe: Recipe  # its k_aux -1 until the model's width gives the default
    steps: int | None
    epochs: int | None
    items: list[Item]
    eval_items: list[int]
    top_n: int
    thumb: int
    checkpoint_every: int
    stop_after: int | None
    resume: bool
    workers: int | None
    log_every: int
    progress: bool
    command: str
    digest: str = ""  # of the images' list and bytes (`_digest`)


def _whole(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_numbers(*, layer, features, k, k_aux, steps, epochs, images_per_step, lr, aux_weight, dead_after, seed, checkpoint_every,
                   stop_after, eval_images, top_n, thumb, workers, log_every, tokens) -> None:
    """Raises ConceptsError for a number out of range (before anything is read)."""
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ConceptsError(message)

    need(_whole(layer) and layer >= 0, f"--layer is {layer}; it is a block of the model, 0 (the first) to its depth - 1: the "
                                       f"residual stream after that block")
    need(_whole(features) and features >= 1, f"--features is {features}; it is the number of the SAE's features, 1 or more")
    need(_whole(k) and k >= 1, f"--k is {k}; it is the number of features kept per token, 1 or more")
    need(k <= features, f"--k is {k} and --features {features}: a token keeps k of the features, so k is at most --features")
    need(k_aux is None or (_whole(k_aux) and k_aux >= 0), f"--k-aux is {k_aux}; it is the number of dead features that reconstruct "
                                                          f"the error (AuxK), 0 (no AuxK) or more")
    need(steps is None or epochs is None, "--steps and --epochs both say how long to train: give one of them")
    need(steps is None or (_whole(steps) and steps >= 1), f"--steps is {steps}; it is the number of training steps, 1 or more")
    need(epochs is None or (_whole(epochs) and epochs >= 1), f"--epochs is {epochs}; it is the number of passes over DATA, 1 or more")
    need(_whole(images_per_step) and images_per_step >= 1, f"--images-per-step is {images_per_step}; a step reads 1 image or more")
    need(isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0, f"--lr is {lr}; the learning rate is a number above 0")
    need(isinstance(aux_weight, (int, float)) and math.isfinite(aux_weight) and aux_weight >= 0,
         f"--aux-weight is {aux_weight}; AuxK's weight is a number, 0 or more (Gao et al.'s is 1/32)")
    need(_whole(dead_after) and dead_after >= 1, f"--dead-after is {dead_after}; a feature is dead after that many tokens without "
                                                 f"firing, 1 or more (Gao et al.'s: 10,000,000)")
    need(_whole(seed) and 0 <= seed < 2**63, f"--seed is {seed}; it is a whole number, 0 or more")
    need(_whole(checkpoint_every) and checkpoint_every >= 1, f"--checkpoint-every is {checkpoint_every}; a checkpoint every 1 step or more")
    need(stop_after is None or (_whole(stop_after) and stop_after >= 1), f"--stop-after is {stop_after}; a session stops after 1 "
                                                                         f"step or more")
    need(eval_images is None or (_whole(eval_images) and eval_images >= 1), f"--eval-images is {eval_images}; the evaluation reads "
                                                                            f"1 image or more")
    need(_whole(top_n) and 1 <= top_n <= 1000, f"--top-n is {top_n}; each feature keeps its 1 to 1000 strongest tokens")
    need(_whole(thumb) and 8 <= thumb <= MAX_THUMB, f"--thumb is {thumb}; a thumbnail is 8 to {MAX_THUMB} px a side")
    need(workers is None or (_whole(workers) and workers >= 0), f"--workers is {workers}; decoding processes per rank, 0 or more")
    need(_whole(log_every) and log_every >= 1, f"--log-every is {log_every}; a progress line every 1 step or more")
    need(tokens in TOKENS, f"--tokens is {tokens!r}; it is 'patches' (the patch tokens) or 'all' (the prefix tokens too)")
    pixels = features * top_n * thumb * thumb
    if pixels > MAX_PIXELS:
        fits = max(1, MAX_PIXELS // (features * thumb * thumb))
        raise ConceptsError(f"the atlas of thumbnails would be {features} x {top_n} cells of {thumb} px = {pixels / 1e6:.1f} "
                            f"megapixels, over the {MAX_PIXELS / 1e6:.0f} any image of vitviz may have: give --top-n {fits} or a "
                            f"smaller --thumb")


def _check_out(data: Path, out: Path, *, resume: bool) -> None:
    """Raises ConceptsError for an --out that is a file, lies inside DATA, holds other files, holds a
    training without --resume, or none with it."""
    if out.exists() and not out.is_dir():
        raise ConceptsError(f"--out {out} is a file; it is the folder the SAE is written to (made when missing)")
    root, target = data.resolve(), out.resolve()
    if target == root or root in target.parents:
        raise ConceptsError(f"--out {out} is inside DATA ({data}): its thumbnails would be read as images of DATA; put it outside, "
                            f"e.g. --out {root.parent / 'concepts'}")
    ours = out.is_dir() and ((out / CHECKPOINT).is_file() or (out / "card.json").is_file())
    if resume and not (out / CHECKPOINT).is_file():
        raise ConceptsError(f"--resume: {out} holds no {CHECKPOINT} to go on from; leave out --resume to start a training there")
    if ours and not resume:
        raise ConceptsError(f"--out {out} holds a training already: add --resume to go on with it (or to evaluate it again), or "
                            f"use another --out")
    if out.is_dir() and not ours:
        names = [p.name for p in out.iterdir() if not p.name.endswith(".part")]
        if names:
            raise ConceptsError(f"--out {out} holds files and no training of vitviz.concepts (e.g. {min(names)}): they could be "
                                f"overwritten; give an empty or new folder")


def _evenly(n: int, m: int | None) -> list[int]:
    """m of n places spread evenly, in order (every place when m is None or at least n)."""
    if m is None or m >= n:
        return list(range(n))
    return sorted({(i * n) // m for i in range(m)})


def _order(n: int, seed: int, epoch: int) -> np.ndarray:
    """Epoch `epoch`'s permutation of the n images: numpy's, from the seed and the epoch."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def _step_images(n: int, images_per_step: int, seed: int, step: int) -> list[int]:
    """The images of training step `step` (from 0): its slice of its epoch's permutation."""
    return _Steps(n, images_per_step, seed)(step)


class _Steps:
    """The images of each training step (a rank's share: `rank::world`), each epoch's permutation drawn once."""

    def __init__(self, n: int, images_per_step: int, seed: int, rank: int = 0, world: int = 1) -> None:
        self.n, self.size, self.seed, self.rank, self.world = n, images_per_step, seed, rank, world
        self.per_epoch = math.ceil(n / images_per_step)
        self._epoch, self._order = -1, np.arange(0)

    def __call__(self, step: int) -> list[int]:
        epoch, j = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            self._epoch, self._order = epoch, _order(self.n, self.seed, epoch)
        return self._order[j * self.size : (j + 1) * self.size][self.rank :: self.world].tolist()


class _StepBatches(torch.utils.data.Sampler):
    """A rank's non-empty lists of images of steps `start` to `end` - 1, drawn as the loader asks."""

    def __init__(self, steps: _Steps, start: int, end: int) -> None:
        self.steps, self.start, self.end = steps, start, end

    def __iter__(self):
        for s in range(self.start, self.end):
            images = self.steps(s)
            if images:
                yield images


def _plan(data, out, *, model, layer, features, k, tokens, steps, epochs, images_per_step, lr, k_aux, aux_weight, dead_after, seed,
          checkpoint_every, stop_after, resume, eval_images, top_n, thumb, workers, log_every, progress, command) -> _Plan:
    """Every check that needs no process group and no model; a ConceptsError before anything is written."""
    _check_numbers(layer=layer, features=features, k=k, k_aux=k_aux, steps=steps, epochs=epochs, images_per_step=images_per_step,
                   lr=lr, aux_weight=aux_weight, dead_after=dead_after, seed=seed, checkpoint_every=checkpoint_every,
                   stop_after=stop_after, eval_images=eval_images, top_n=top_n, thumb=thumb, workers=workers, log_every=log_every,
                   tokens=tokens)
    data, out = Path(data), Path(out)
    if not data.exists():
        raise ConceptsError(f"{data} does not exist: DATA is a folder of images (DATA/<class>/<image> gives classes); "
                            f"python -m vitviz.shapes {data} --n 100 writes one to try")
    if not data.is_dir():
        raise ConceptsError(f"{data} is a file; DATA is a folder of images (DATA/<class>/<image> gives classes)")
    _check_out(data, out, resume=resume)
    items = [replace(item, mask=None) for item in scan(data, stamps=False)]  # (masks are not read)
    if not items:
        raise ConceptsError(f"no images ({', '.join(sorted(SUFFIXES))}) under {data}: put images there (DATA/<class>/<image> gives "
                            f"classes), or write some with python -m vitviz.shapes {data} --n 100")
    recipe = Recipe(model=model, layer=layer, tokens=tokens, features=features, k=k, seed=seed, images_per_step=images_per_step,
                    lr=float(lr), k_aux=-1 if k_aux is None else k_aux, aux_weight=float(aux_weight), dead_after=dead_after)
    return _Plan(data=data, out=out, recipe=recipe, steps=steps, epochs=epochs, items=items, eval_items=_evenly(len(items), eval_images),
                 top_n=top_n, thumb=thumb, checkpoint_every=checkpoint_every, stop_after=stop_after, resume=resume, workers=workers,
                 log_every=log_every, progress=progress, command=command)


@dataclass
class _Net:
    """The loaded model and what the training reads of it."""

    model: object  # ViT or ImageTextModel
    tower: ViT
    spec: object
    head: object | None  # the stream after the last block [B, N, D] -> logits [B, C] float32; None without a classifier
    categories: tuple[str, ...] | None
    why_no_head: str


def _loaded(plan: _Plan, device: torch.device) -> _Net:
    """The model on this process' device; refused where it has no global residual stream, or the layer is not one of its blocks."""
    from vitviz.sources import get_spec, load_model

    name = plan.recipe.model
    try:
        spec = get_spec(name)
    except ValueError as exc:
        raise ConceptsError(f"--model: {exc}") from None
    if not spec.preprocessing.square:
        raise ConceptsError(f"--model: {spec.name} takes each image whole at its own aspect ratio, and training reads batches of "
                            f"square crops: name the model without @whole")
    model = load_model(name, device=device)
    tower = model.image if isinstance(model, ImageTextModel) else model
    kind = attention_of(tower)
    if kind != "global" or not isinstance(tower, ViT):
        how = f"its attention is {kind}" if kind != "global" else "it is no plain ViT"
        raise ConceptsError(f"--model: {spec.name} is a {type(tower).__name__} and {how}: the SAE reads a ViT's residual stream, one "
                            f"sequence of tokens (a token per patch) after each block; name a plain ViT")
    depth = tower.config.depth
    if plan.recipe.layer >= depth:
        raise ConceptsError(f"--layer is {plan.recipe.layer}; {spec.name} has {depth} blocks, so the layer is 0 to {depth - 1} "
                            f"(the residual stream after that block)")
    labels = _labels(model, None, None)
    head, why = None, ""
    if isinstance(model, ImageTextModel):
        if labels is None:
            why = f"{spec.name} is an image–text model without a label set to classify against"
        else:
            head = _zero_shot(model, tower, labels)
    elif tower.config.num_classes:
        head = _classifier(tower)
    else:
        why = f"{spec.name} has no classifier (no head)"
    return _Net(model=model, tower=tower, spec=spec, head=head, categories=_categories(model, labels), why_no_head=why)


# ----------------------------------------------------------------------------- the model's part


def _classifier(tower: ViT):
    """The model's last steps: the stream after its last block [B, N, D] -> logits [B, C] (float32, on the CPU)."""
    def head(s: torch.Tensor) -> torch.Tensor:
        return tower.head_logits(tower.norm(s)).float().cpu()
    return head


def _zero_shot(model: ImageTextModel, tower: ViT, labels: tuple[str, ...]):
    """An image–text model's last steps against its label set: the stream [B, N, D] -> logits [B, C]
    (`vitviz.inside.stream`'s `_tail` and `Unembed`, on the CPU)."""
    unembed = _unembed(model, labels, None)
    readout, q, _ = readout_of(tower)

    def head(s: torch.Tensor) -> torch.Tensor:
        return unembed.logits(_tail(tower, s, readout, q).to("cpu", torch.float32))
    return head


def _stream_after(tower: ViT, x: torch.Tensor, layer: int) -> tuple[torch.Tensor, list]:
    """Images [B, 3, S, S] -> the residual stream after block `layer` [B, N, D] (no later block runs),
    and every block's rotary angles (for whoever runs on)."""
    return tower.stream_after(x, layer), tower.rotations(tower.grid_for(x.shape[2], x.shape[3]))


def _run_on(tower: ViT, s: torch.Tensor, ropes: list, layer: int) -> torch.Tensor:
    """The stream after block `layer` [B, N, D] through the blocks after it: [B, N, D], before the final norm."""
    for block, rope in zip(tower.blocks[layer + 1 :], ropes[layer + 1 :]):
        s = block(s, rope)
        steps.step()
    return s


def _first_token(tower: ViT, tokens: str) -> int:
    """The first token the SAE reads: the first patch ("patches") or 0 ("all")."""
    return tower.config.num_prefix_tokens if tokens == "patches" else 0


def _input(tower: ViT, x: torch.Tensor) -> torch.Tensor:
    param = next(tower.parameters())
    return x.to(device=param.device, dtype=param.dtype)


# ----------------------------------------------------------------------------- the checkpoint


def _save_checkpoint(out: Path, state: dict) -> None:
    part = out / (CHECKPOINT + ".part")
    torch.save(state, part)
    os.replace(part, out / CHECKPOINT)


def _read_checkpoint(out: Path) -> dict:
    path = out / CHECKPOINT
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ConceptsError(f"{path} cannot be read ({type(exc).__name__}: {exc}); use another --out") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ConceptsError(f"{path} is not a checkpoint of this vitviz.concepts (format {FORMAT}); use another --out")
    return state


def _check_resume(state: dict, recipe: Recipe, digest: str, out: Path, total: int) -> None:
    """Raises ConceptsError unless the checkpoint is of the same recipe, on the same images, not past `total` steps."""
    before = state["recipe"]
    now = recipe.as_dict()
    differ = [f"{key} {before.get(key)!r} there, {now[key]!r} here" for key in now if before.get(key) != now[key]]
    if differ:
        raise ConceptsError(f"{out} holds a training with other settings ({'; '.join(differ)}): resume it with its own, or use "
                            f"another --out")
    if state["digest"] != digest:
        raise ConceptsError(f"the images under DATA changed since the training in {out} began (their list or their bytes): its "
                            f"steps would read other images; train again into another --out")
    if state["step"] > total:
        raise ConceptsError(f"the checkpoint in {out} is at step {state['step']}, past the {total} steps asked for: give --steps "
                            f"{state['step']} or more")


def _digest(items: list[Item]) -> str:
    import hashlib

    h = hashlib.sha256()
    for item in items:
        h.update(f"{item.file}\t{item.stamp}\n".encode())
    return h.hexdigest()[:32]


# ----------------------------------------------------------------------------- training


@dataclass
class _State:
    """The training's state: what a checkpoint holds."""

    sae: TopKSAE
    optimizer: torch.optim.Optimizer
    step: int = 0
    since_fired: torch.Tensor | None = None  # int64 [F]: tokens since each feature last fired
    variance: float | None = None  # V: the first step's variance summed over channels
    tokens_seen: int = 0
    seconds: float = 0.0
    unreadable: int = 0  # images of the steps done that the image gate refused

    def as_dict(self, recipe: Recipe, digest: str) -> dict:
        return {"format": FORMAT, "recipe": recipe.as_dict(), "digest": digest, "step": self.step,
                "sae": {k: v.detach().cpu() for k, v in self.sae.state_dict().items()}, "optimizer": self.optimizer.state_dict(),
                "since_fired": self.since_fired.cpu(), "variance": self.variance, "tokens_seen": self.tokens_seen,
                "seconds": self.seconds, "unreadable": self.unreadable}


def _new_state(recipe: Recipe, d_in: int, device: torch.device) -> _State:
    sae = TopKSAE(d_in, recipe.features, recipe.k)
    sae.reset_parameters(generator=torch.Generator().manual_seed(recipe.seed))
    sae.to(device)
    optimizer = torch.optim.Adam(sae.parameters(), lr=recipe.lr, betas=recipe.betas, eps=recipe.eps)
    return _State(sae=sae, optimizer=optimizer, since_fired=torch.zeros(recipe.features, dtype=torch.int64, device=device))


def _restored(saved: dict, recipe: Recipe, d_in: int, device: torch.device) -> _State:
    state = _new_state(recipe, d_in, device)
    state.sae.load_state_dict(saved["sae"])
    state.optimizer.load_state_dict(saved["optimizer"])
    state.step, state.variance = saved["step"], saved["variance"]
    state.since_fired = saved["since_fired"].to(device)
    state.tokens_seen, state.seconds, state.unreadable = saved["tokens_seen"], saved["seconds"], saved["unreadable"]
    return state


def _all_reduce_(t: torch.Tensor) -> None:
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)


def _loader(items: list[Item], pre, batches, workers: int):
    """The batches of image lists `batches` (non-empty lists), read through the image gate and preprocessed (`EvalDataset`)."""
    loader = torch.utils.data.DataLoader(EvalDataset(items, pre), batch_sampler=batches, num_workers=workers, collate_fn=_collate,
                                         persistent_workers=False)
    return iter(loader)


def _workers(plan: _Plan, world: int) -> int:
    return plan.workers if plan.workers is not None else max(0, min(4, (os.cpu_count() or 1) // world - 1))


def _say(message: str, rank: int, progress: bool) -> None:
    if progress and rank == 0:
        print(message, file=sys.stderr, flush=True)


def _train_steps(plan: _Plan, net: _Net, state: _State, total: int, *, rank: int, world: int, device: torch.device) -> bool:
    """Steps from `state.step` to `total` (or `stop_after` of them); True when `total` was reached."""
    recipe, tower = plan.recipe, net.tower
    n = len(plan.items)
    end = total if plan.stop_after is None else min(total, state.step + plan.stop_after)
    mine = _Steps(n, recipe.images_per_step, recipe.seed, rank, world)
    batches = _loader(plan.items, net.spec.preprocessing, _StepBatches(_Steps(n, recipe.images_per_step, recipe.seed, rank, world),
                                                                       state.step, end), _workers(plan, world))
    first = _first_token(tower, recipe.tokens)
    d = tower.config.width
    started = time.perf_counter()
    session_start = state.step
    while state.step < end:
        s = state.step
        x = torch.zeros(0, d, device=device)
        refused = 0
        if mine(s):
            batch = next(batches)
            ok = [b for b, good in enumerate(batch["ok"]) if good]
            refused = len(batch["ok"]) - len(ok)
            if ok:
                with torch.no_grad():
                    stream, _ = _stream_after(tower, _input(tower, batch["x"][ok]), recipe.layer)
                x = stream[:, first:].reshape(-1, d).float()
        counts = _all_sum(torch.tensor([float(x.shape[0]), float(refused)], dtype=torch.float64), device)
        tokens, state.unreadable = int(counts[0]), state.unreadable + int(counts[1])
        if tokens == 0:  # every image of the step refused by the image gate: no update
            state.step += 1
            continue
        if state.variance is None:  # the first step: b_dec at the tokens' mean, V their variance summed over channels
            sums = torch.stack([x.double().sum(0), x.double().pow(2).sum(0)])
            _all_reduce_(sums)
            mean = sums[0] / tokens
            state.variance = float((sums[1] / tokens - mean.pow(2)).sum().clamp_min(1e-30))
            with torch.no_grad():
                state.sae.b_dec.copy_(mean.float())

        def dead_of(fired: torch.Tensor) -> torch.Tensor:
            anywhere = fired.to(torch.float32)
            _all_reduce_(anywhere)
            state.since_fired += tokens
            state.since_fired[anywhere > 0] = 0
            return state.since_fired >= recipe.dead_after

        k_aux = recipe.k_aux if recipe.aux_weight > 0 else 0
        result = train_step(state.sae, state.optimizer, x, scale=1.0 / (tokens * state.variance), dead_of=dead_of, k_aux=k_aux,
                            aux_weight=recipe.aux_weight, all_reduce=_all_reduce_ if dist.is_initialized() else None)
        state.step += 1
        state.tokens_seen += tokens
        if state.step % plan.log_every == 0 or state.step == end:
            stats = _all_sum(torch.tensor([result.loss, float(result.l0)], dtype=torch.float64), device)
            rate = (state.step - session_start) * recipe.images_per_step / max(1e-9, time.perf_counter() - started)
            dead = int((state.since_fired >= recipe.dead_after).sum())
            _say(f"step {state.step}/{total}  tokens {state.tokens_seen:,}  loss {float(stats[0]):.5f}  L0 {float(stats[1]) / tokens:.2f}  "
                 f"dead {dead}/{recipe.features}  ({rate:.1f} img/s)", rank, plan.progress)
        if state.step % plan.checkpoint_every == 0 or state.step == end:
            state.seconds += time.perf_counter() - started
            started = time.perf_counter()
            session_start = state.step
            if rank == 0:
                _save_checkpoint(plan.out, state.as_dict(plan.recipe, plan.digest))
    state.seconds += time.perf_counter() - started
    _barrier()
    return state.step >= total


# ----------------------------------------------------------------------------- the evaluation


@dataclass
class _Tally:
    """The evaluation's sums on one rank (float64), then over every rank (`_evaluate`)."""

    channels: torch.Tensor  # [4, D]: Σx, Σx², Σr, Σr² per channel, r = x − x̂
    counts: torch.Tensor  # [4]: tokens, Σ L0 (features fired, over the tokens), images read, images refused
    fired: torch.Tensor  # [F]: tokens each feature fired on
    class_sums: torch.Tensor  # [C, F]: Σ z over the patch tokens of each class's images
    class_tokens: torch.Tensor  # [C]
    scores: torch.Tensor  # [3, 2]: (Σ cross-entropy, hits) of clean, spliced, ablated
    targets: torch.Tensor  # [2]: images scored against their folder's class, against the clean prediction
    top_values: torch.Tensor  # [F, n] float32, -inf where none
    top_images: torch.Tensor  # [F, n] int64, -1 where none
    top_tokens: torch.Tensor  # [F, n] int64, -1 where none

    def sums(self) -> tuple[torch.Tensor, ...]:
        return self.channels, self.counts, self.fired, self.class_sums, self.class_tokens, self.scores, self.targets


def _new_tally(d: int, f: int, c: int, n: int, device: torch.device) -> _Tally:
    z64 = dict(dtype=torch.float64, device=device)
    return _Tally(channels=torch.zeros(4, d, **z64), counts=torch.zeros(4, **z64), fired=torch.zeros(f, **z64),
                  class_sums=torch.zeros(c, f, **z64), class_tokens=torch.zeros(c, **z64), scores=torch.zeros(3, 2, **z64),
                  targets=torch.zeros(2, **z64), top_values=torch.full((f, n), float("-inf"), device=device),
                  top_images=torch.full((f, n), -1, dtype=torch.int64, device=device),
                  top_tokens=torch.full((f, n), -1, dtype=torch.int64, device=device))


def _merge_top(tally: _Tally, values: torch.Tensor, images: torch.Tensor, tokens: torch.Tensor) -> None:
    """The running top-n of each feature, merged with candidates [F, m] (values, image, token)."""
    n = tally.top_values.shape[1]
    kept, where = torch.cat([tally.top_values, values], dim=1).topk(n, dim=1)
    tally.top_images = torch.cat([tally.top_images, images], dim=1).gather(1, where)
    tally.top_tokens = torch.cat([tally.top_tokens, tokens], dim=1).gather(1, where)
    tally.top_values = kept
    none = torch.isneginf(kept)
    tally.top_images[none] = -1
    tally.top_tokens[none] = -1


def _evaluate_batch(plan: _Plan, net: _Net, sae: TopKSAE, tally: _Tally, batch: dict, classes: dict, class_index: dict) -> None:
    """One batch's share of every sum, of the top-n and of the scores."""
    tower, layer = net.tower, plan.recipe.layer
    ok = [b for b, good in enumerate(batch["ok"]) if good]
    tally.counts[3] += len(batch["ok"]) - len(ok)
    if not ok:
        return
    images = batch["index"][ok].to(tally.fired.device)
    first, p = _first_token(tower, plan.recipe.tokens), tower.config.num_prefix_tokens
    with torch.no_grad():
        s, ropes = _stream_after(tower, _input(tower, batch["x"][ok]), layer)
        x = s[:, first:].float()  # [B, T, D]
        x_hat, z = sae(x)
        b, t = x.shape[:2]
        r = (x - x_hat).double()
        tally.channels += torch.stack([x.double().sum((0, 1)), x.double().pow(2).sum((0, 1)), r.sum((0, 1)), r.pow(2).sum((0, 1))])
        fired = z != 0
        tally.counts[:3] += torch.tensor([b * t, float(fired.sum()), b], dtype=torch.float64, device=tally.counts.device)
        tally.fired += fired.sum((0, 1)).double()
        rows = [class_index.get(plan.items[i].label, -1) for i in images.tolist()]
        have = [j for j, row in enumerate(rows) if row >= 0]
        if have:  # each feature's z summed over the patch tokens of each class's images
            where = torch.tensor([rows[j] for j in have], device=tally.class_sums.device)
            tally.class_sums.index_add_(0, where, z[have, p - first :].double().sum(1))
            tally.class_tokens.index_add_(0, where, torch.full((len(have),), float(s.shape[1] - p), dtype=torch.float64,
                                                              device=where.device))
        flat = z.reshape(b * t, -1).masked_fill(~fired.reshape(b * t, -1), float("-inf"))  # [B*T, F]
        values, where = flat.topk(min(tally.top_values.shape[1], b * t), dim=0)  # [m, F]: each feature's strongest here
        _merge_top(tally, values.T, images[where // t].T, (where % t + first).T)
        if net.head is not None:
            _score(net, tally, s, x_hat, ropes, layer, first, [classes.get(plan.items[i].label) for i in images.tolist()])


def _score(net: _Net, tally: _Tally, s: torch.Tensor, x_hat: torch.Tensor, ropes: list, layer: int, first: int,
           known: list[int | None]) -> None:
    """The batch's cross-entropy and hits of the clean stream s [B, N, D], of s with the SAE's tokens
    replaced by x̂ [B, T, D] (spliced) and set to 0 (zero-ablated); each image's target its folder's
    class (`known`), else the clean prediction."""
    spliced, ablated = s.clone(), s.clone()
    spliced[:, first:] = x_hat.to(s.dtype)
    ablated[:, first:] = 0
    b = s.shape[0]
    logits = net.head(_run_on(net.tower, torch.cat([s, spliced, ablated]), ropes, layer)).unflatten(0, (3, b))  # [3, B, C]
    clean_top = logits[0].argmax(-1)
    target = torch.tensor([k if k is not None else int(clean_top[j]) for j, k in enumerate(known)])
    from_folders = sum(k is not None for k in known)
    tally.targets += torch.tensor([from_folders, b - from_folders], dtype=torch.float64, device=tally.targets.device)
    for v in range(3):
        ce = F.cross_entropy(logits[v].double(), target, reduction="sum")
        hits = (logits[v].argmax(-1) == target).sum().double()
        tally.scores[v] += torch.stack([ce, hits]).to(tally.scores.device)


def _gathered(t: torch.Tensor, world: int) -> torch.Tensor:
    """Every rank's `t` [F, n], side by side: [F, world * n]."""
    if world == 1 or not dist.is_initialized():
        return t
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=1)


def _evaluate(plan: _Plan, net: _Net, sae: TopKSAE, *, rank: int, world: int, device: torch.device) -> tuple[dict, dict[str, torch.Tensor]]:
    """The metrics (`metrics_table`) and the index (`vitviz.concepts.store`), on every rank."""
    recipe, tower = plan.recipe, net.tower
    labels = sorted({item.label for item in plan.items if item.label is not None})
    class_index = {label: c for c, label in enumerate(labels)}
    classes = _classes(plan.items, net.categories) if net.head is not None else {}
    tally = _new_tally(tower.config.width, recipe.features, len(labels), plan.top_n, device)
    size = recipe.images_per_step
    mine = [plan.eval_items[i : i + size] for i in range(0, len(plan.eval_items), size)][rank::world]  # batches dealt in turn
    sae.eval()
    for batch in _loader(plan.items, net.spec.preprocessing, mine, _workers(plan, world)) if mine else ():
        _evaluate_batch(plan, net, sae, tally, batch, classes, class_index)
    for t in tally.sums():
        _all_reduce_(t)
    if world > 1:  # every rank's top-n, merged
        values, images, tokens = (_gathered(t, world) for t in (tally.top_values, tally.top_images, tally.top_tokens))
        tally.top_values = torch.full_like(tally.top_values, float("-inf"))
        tally.top_images = torch.full_like(tally.top_images, -1)
        tally.top_tokens = torch.full_like(tally.top_tokens, -1)
        _merge_top(tally, values, images, tokens)
    return _metrics(plan, net, tally), _index(tally, labels)


def _metrics(plan: _Plan, net: _Net, tally: _Tally) -> dict:
    channels = tally.channels.cpu()
    tokens, l0, images, unreadable = (float(v) for v in tally.counts)
    if images == 0:
        raise ConceptsError(f"none of the {len(plan.eval_items)} images of the evaluation could be read (the image gate refused "
                            f"them all): nothing to evaluate on", status=1)
    def variance(s: torch.Tensor, s2: torch.Tensor) -> float:  # population variances, summed over channels
        return float((s2 / tokens - (s / tokens).pow(2)).sum())

    metrics = {
        "explained_variance": 1.0 - variance(channels[2], channels[3]) / variance(channels[0], channels[1]),
        "mean_l0": l0 / tokens,
        "dead_features": int((tally.fired == 0).sum()),
        "features": plan.recipe.features,
        "eval_images": int(images),
        "eval_tokens": int(tokens),
        "unreadable_images": int(unreadable),
        "ablation": "zero",
        "accuracy_clean": None, "accuracy_spliced": None, "accuracy_ablated": None,
        "ce_clean": None, "ce_spliced": None, "ce_ablated": None, "recovered": None,
        "targets_from_folders": None, "targets_from_prediction": None,
        "accuracy_note": net.why_no_head or None,
    }
    if net.head is not None:
        scores = tally.scores.cpu()
        ce = [float(scores[v, 0]) / images for v in range(3)]
        acc = [float(scores[v, 1]) / images for v in range(3)]
        metrics.update(accuracy_clean=acc[0], accuracy_spliced=acc[1], accuracy_ablated=acc[2], ce_clean=ce[0], ce_spliced=ce[1],
                       ce_ablated=ce[2], targets_from_folders=int(tally.targets[0]), targets_from_prediction=int(tally.targets[1]))
        if ce[2] != ce[0]:
            metrics["recovered"] = (ce[2] - ce[1]) / (ce[2] - ce[0])
        else:
            metrics["accuracy_note"] = "the zero-ablated cross-entropy equals the clean one, so no share of it can be recovered"
    return metrics


def _index(tally: _Tally, labels: list[str]) -> dict[str, torch.Tensor]:
    tokens = float(tally.counts[0])
    values = tally.top_values.float().cpu()
    index = {"top_values": torch.where(torch.isneginf(values), torch.zeros_like(values), values),
             "top_images": tally.top_images.cpu(), "top_tokens": tally.top_tokens.cpu(),
             "frequency": (tally.fired / max(tokens, 1.0)).float().cpu()}
    if labels:  # NaN for a class none of whose images were evaluated
        means = (tally.class_sums / tally.class_tokens[:, None]).T  # [F, C]
        index["class_means"] = means.float().cpu().contiguous()
    return index


# ----------------------------------------------------------------------------- thumbnails


def _thumbnail(cropped: Image.Image, token: int, *, prefix: int, grid: tuple[int, int], patch: int, thumb: int) -> Image.Image:
    """A token's thumbnail: the 3 x 3 patches around its patch in the model's input crop (black beyond
    the crop's edge), `thumb` px a side, the centre patch outlined; a prefix token's is the whole crop."""
    if token < prefix:
        return cropped.resize((thumb, thumb), Image.Resampling.BILINEAR)
    gy, gx = divmod(token - prefix, grid[1])
    cell = cropped.crop(((gx - 1) * patch, (gy - 1) * patch, (gx + 2) * patch, (gy + 2) * patch)).resize((thumb, thumb),
                                                                                                          Image.Resampling.BILINEAR)
    a, b = round(thumb / 3), round(2 * thumb / 3) - 1
    ImageDraw.Draw(cell).rectangle((a, a, b, b), outline=OUTLINE, width=max(1, thumb // 32))
    return cell


def _atlas(plan: _Plan, net: _Net, index: dict[str, torch.Tensor]) -> Image.Image:
    """The thumbnails of every feature's strongest tokens: row f, column j (white where none); each
    image read again through the image gate, once."""
    f, n, thumb = plan.recipe.features, plan.top_n, plan.thumb
    atlas = Image.new("RGB", (n * thumb, f * thumb), BLANK)
    cells: dict[int, list[tuple[int, int, int]]] = {}
    for (row, j), image in np.ndenumerate(index["top_images"].numpy()):
        if image >= 0:
            cells.setdefault(int(image), []).append((row, j, int(index["top_tokens"][row, j])))
    tower, pre = net.tower, net.spec.preprocessing
    layout = dict(prefix=tower.config.num_prefix_tokens, grid=tower.grid_for(pre.image_size, pre.image_size),
                  patch=tower.config.patch_size, thumb=thumb)
    for image, wanted in sorted(cells.items()):
        try:
            cropped = crop(load_image(_read(plan.items[image].path)), pre)
        except ImageError:
            continue  # (changed since the evaluation read it: its cells stay blank)
        for row, j, token in wanted:
            atlas.paste(_thumbnail(cropped, token, **layout), (j * thumb, row * thumb))
    return atlas


# ----------------------------------------------------------------------------- the table


def metrics_table(metrics: dict) -> str:
    """The evaluation as text, each figure with its definition:

    - explained variance: 1 − Σ_d Var(x_d − x̂_d) / Σ_d Var(x_d), the variances over every token of the
      evaluation (population variances), summed over the channels d (sklearn's
      `explained_variance_score(..., multioutput="variance_weighted")`);
    - mean L0: the mean over the tokens of the features that fired (z ≠ 0);
    - dead features: those that fired on no token of the evaluation;
    - accuracy and cross-entropy of the model's prediction of each image's target, clean, with the
      layer's output replaced by x̂ on the SAE's tokens (spliced), and with those tokens set to 0
      (zero-ablated, as ViT-Prisma's `get_substitution_loss` does);
    - recovered = (CE_ablated − CE_spliced) / (CE_ablated − CE_clean): 1 when the reconstruction loses
      nothing the model uses, 0 when it is no better than zeros.
    """
    m = metrics
    lines = [f"{'explained variance':<22}{m['explained_variance']:.4f}   1 - Var(x - x̂) / Var(x), summed over channels",
             f"{'mean L0':<22}{m['mean_l0']:.2f}     features fired per token",
             f"{'dead features':<22}{m['dead_features']} of {m['features']}   fired on no token of the evaluation",
             f"{'evaluated on':<22}{m['eval_images']:,} images, {m['eval_tokens']:,} tokens"
             + (f" ({m['unreadable_images']} refused by the image gate)" if m["unreadable_images"] else "")]
    if m["accuracy_clean"] is None:
        lines.append(f"{'accuracy':<22}not measured: {m['accuracy_note']}")
        return "\n".join(lines)
    targets = []
    if m["targets_from_folders"]:
        targets.append(f"{m['targets_from_folders']} from their class folder")
    if m["targets_from_prediction"]:
        targets.append(f"{m['targets_from_prediction']} from the model's clean prediction (no class folder the model knows)")
    lines += [f"{'targets':<22}{'; '.join(targets)}",
              f"{'':<22}{'clean':>9}{'spliced':>9}{'zero-abl.':>10}",
              f"{'accuracy':<22}{m['accuracy_clean']:>9.4f}{m['accuracy_spliced']:>9.4f}{m['accuracy_ablated']:>10.4f}",
              f"{'cross-entropy':<22}{m['ce_clean']:>9.4f}{m['ce_spliced']:>9.4f}{m['ce_ablated']:>10.4f}"]
    if m["recovered"] is None:
        lines.append(f"{'recovered':<22}not defined: {m['accuracy_note']}")
    else:
        lines.append(f"{'recovered':<22}{m['recovered']:.4f}   (CE_ablated - CE_spliced) / (CE_ablated - CE_clean)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the run


def _command(data, out, recipe: Recipe, **options) -> str:
    words = ["python", "-m", "vitviz.concepts", "train", str(data), "--model", recipe.model, "--layer", str(recipe.layer), "--features",
             str(recipe.features), "--k", str(recipe.k), "--out", str(out), "--tokens", recipe.tokens, "--seed", str(recipe.seed),
             "--images-per-step", str(recipe.images_per_step), "--lr", repr(recipe.lr)]
    for name, value in options.items():
        if value is not None and value is not False:
            words += [f"--{name.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return shlex.join(words)


def train(
    data: str | Path,
    *,
    model: str,
    layer: int,
    features: int,
    k: int,
    out: str | Path,
    tokens: str = "patches",
    steps: int | None = None,
    epochs: int | None = None,
    images_per_step: int = 32,
    lr: float = 4e-4,
    k_aux: int | None = None,
    aux_weight: float = AUX_WEIGHT,
    dead_after: int = DEAD_AFTER,
    seed: int = 0,
    checkpoint_every: int = 100,
    stop_after: int | None = None,
    resume: bool = False,
    eval_images: int | None = None,
    top_n: int = 8,
    thumb: int = 32,
    workers: int | None = None,
    log_every: int = 10,
    progress: bool = True,
    command: str | None = None,
) -> dict | None:
    """Trains a top-k SAE on `model`'s residual stream after block `layer` over the images of `data`,
    evaluates it and writes `out` (`vitviz.concepts.store`; the module's doc says how). On rank 0
    returns the card; None on other ranks, and when the session stopped before the last step.

    Args:
        tokens: "patches" (the patch tokens) or "all" (the prefix tokens too).
        steps, epochs: how long: steps of `images_per_step` images, or passes over the folder (default 1 epoch).
        lr: Adam's learning rate (constant).
        k_aux: AuxK's features (default D / 2, at most `features`; 0: no AuxK).
        dead_after: tokens without firing after which a feature counts as dead (AuxK).
        checkpoint_every: steps between checkpoints (one also at the last step).
        stop_after: stop this session after that many steps, with a checkpoint (`resume` goes on).
        resume: go on from the checkpoint in `out` (the same recipe and images; any number of processes).
        eval_images: evaluate on that many images spread evenly over the folder (default all).
        top_n, thumb: each feature's strongest tokens kept, and their thumbnails' side in px.
        workers: decoding processes per rank (default: up to 4, as the CPUs allow).
        log_every: steps between progress lines (stderr, rank 0).
        command: the command line recorded in the card (default: one equivalent to the call).

    Raises:
        ConceptsError: a mistake in the arguments or folders, an unknown or unsuited model (windowed
            attention, a layer out of range), a checkpoint of another recipe or of other images;
            all before anything is written. Status 1: no image could be read.
    """
    plan = _plan(data, out, model=model, layer=layer, features=features, k=k, tokens=tokens, steps=steps, epochs=epochs,
                 images_per_step=images_per_step, lr=lr, k_aux=k_aux, aux_weight=aux_weight, dead_after=dead_after, seed=seed,
                 checkpoint_every=checkpoint_every, stop_after=stop_after, resume=resume, eval_images=eval_images, top_n=top_n,
                 thumb=thumb, workers=workers, log_every=log_every, progress=progress, command="")
    rank, world, device = _setup()
    plan.items = _stamped(plan.items, rank=rank, world=world)
    plan.digest = _digest(plan.items)
    net = _loaded(plan, device)
    d = net.tower.config.width
    if plan.recipe.k_aux < 0:
        plan.recipe = replace(plan.recipe, k_aux=min(plan.recipe.features, max(1, d // 2)))
    per_epoch = math.ceil(len(plan.items) / plan.recipe.images_per_step)
    total = plan.steps if plan.steps is not None else (plan.epochs or 1) * per_epoch
    plan.command = command or _command(plan.data, plan.out, plan.recipe, steps=total, k_aux=plan.recipe.k_aux, eval_images=eval_images,
                                       top_n=top_n, thumb=thumb)
    if resume:
        saved = _read_checkpoint(plan.out)
        _check_resume(saved, plan.recipe, plan.digest, plan.out, total)
        state = _restored(saved, plan.recipe, d, device)
        _say(f"resuming at step {state.step} of {total} from {plan.out / CHECKPOINT}", rank, progress)
    else:
        state = _new_state(plan.recipe, d, device)
    _barrier()
    if rank == 0:
        plan.out.mkdir(parents=True, exist_ok=True)
    _barrier()
    finished = _train_steps(plan, net, state, total, rank=rank, world=world, device=device)
    if not finished:
        _say(f"stopped after step {state.step} of {total}; the checkpoint is {plan.out / CHECKPOINT}: the same command with --resume "
             f"goes on", rank, progress)
        return None
    if state.variance is None:
        raise ConceptsError(f"none of the images of the {total} steps could be read (the image gate refused them all): nothing was "
                            f"trained", status=1)
    started = time.perf_counter()
    _say(f"evaluating on {len(plan.eval_items):,} images", rank, progress)
    metrics, index = _evaluate(plan, net, state.sae, rank=rank, world=world, device=device)
    if rank != 0:
        return None
    labels = sorted({item.label for item in plan.items if item.label is not None})
    atlas = _atlas(plan, net, index)
    metrics["training_unreadable_images"] = state.unreadable
    card = {
        "format": FORMAT, "model": plan.recipe.model, "layer": plan.recipe.layer, "tokens": plan.recipe.tokens, "d_in": d,
        "features": plan.recipe.features, "k": plan.recipe.k, "seed": plan.recipe.seed,
        "data": {"root": str(plan.data.resolve()), "images": len(plan.items), "digest": plan.digest},
        "metrics": metrics, "top_n": plan.top_n, "classes": labels or None, "images": [item.file for item in plan.items],
        "thumb": plan.thumb, "steps": state.step, "tokens_seen": state.tokens_seen,
        "seconds": state.seconds + time.perf_counter() - started, "command": plan.command,
        "recipe": dict(plan.recipe.as_dict(), loss="(sum_t |x - x_hat|^2 + aux_weight * sum_t |e - e_hat|^2) / (T * V)",
                       variance=state.variance, b_dec_init="mean of the first step's tokens", optimizer="Adam"),
        "eval_images": [plan.items[i].file for i in plan.eval_items] if len(plan.eval_items) < len(plan.items) else None,
        "world_size": world,
    }
    save_concepts(plan.out, state.sae.cpu(), card, index, atlas)
    return card
