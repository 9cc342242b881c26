"""High-norm tokens, the MLP neurons that write them, and test-time registers.

- **High-norm tokens** (Darcet et al. 2024, "Vision Transformers Need Registers", figures 3-4):
  large ViTs write a few patch tokens (about 2 %) whose norm is several times the rest's — in
  DINOv2-g above 150 against below 100 for the others —, from about the middle of the network on,
  in low-information patches; the cls token's attention goes to them. `outliers` flags, per layer,
  the patch tokens whose norm after that block exceeds `factor` (2) times the median norm of that
  layer's patch tokens (torch's median: the lower middle value for an even count) (the gap of Darcet et al.'s histogram: twice the median falls between the two
  modes), and says how much attention the classifier's query and the other patches give them in
  the block that reads them (block l + 1 for the tokens after block l; the last block for the last
  layer).
- **Register neurons** (Jiang et al. 2025, "Vision Transformers Don't Need Trained Registers";
  their code: nickjiang2378/test-time-registers, `shared/algorithms.py`, `find_register_neurons`):
  for each image, the outlier positions are the tokens whose norm after the detection layer (the
  second-to-last block by default, their DINOv2 setting) is above a threshold; every MLP neuron of
  every layer scores the mean of its |activation| (after the activation function) over those
  positions; images without an outlier are skipped; the scores are averaged over the images that had
  one, ranked, and the top k whose layer is at most `max_layer` are the register neurons.
  With `threshold` given this is their rule to the letter (all tokens, an absolute norm); without,
  the outlier positions are `outliers`' patches.
- **Test-time register** (same paper; their DINOv2 wrapper `DinoVisionTransformerWithIntervention`):
  one extra token, zero at the input with no position embedding; in each block with register
  neurons the MLP's activations of those neurons are moved into it: it takes each neuron's maximum
  over the tokens and every other token gets 0 (`ViTConfig.register_neurons`, `RegisterShift` in
  `vitviz.model`). vitviz places the register after the learned prefix tokens (the authors append it
  after the patches: attention does not see order, so the result is the same) and names it "ttr".
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from vitviz.images import ImageSource
from vitviz.model import ViT

__all__ = ["OUTLIER_FACTOR", "Outliers", "outliers", "RegisterNeurons", "register_neurons", "with_test_time_register",
           "record_neurons"]

OUTLIER_FACTOR = 2.0


# ----------------------------------------------------------------------------- high-norm tokens


@dataclass
class Outliers:
    """The high-norm patch tokens of one image, layer by layer (`outliers`).

    Attributes:
        factor: the rule's factor: a patch is an outlier when its norm exceeds factor x the median.
        norms: each patch token's norm after each block [L, gh, gw].
        threshold: factor x the median patch norm, per layer [L].
        mask: the outliers [L, gh, gw].
        ratio: the largest patch norm over the median, per layer [L].
        query_share: the share of the classifier's query's attention (the cls token's row; a pooled
            model's mean patch row) that goes to the layer's outliers, averaged over the heads, in the
            block that reads them [L] (0 where there is none).
        patch_share: the same for the other patches' rows, averaged over them [L].
    """

    factor: float
    norms: torch.Tensor = field(repr=False)
    threshold: torch.Tensor = field(repr=False)
    mask: torch.Tensor = field(repr=False)
    ratio: torch.Tensor = field(repr=False)
    query_share: torch.Tensor = field(repr=False)
    patch_share: torch.Tensor = field(repr=False)

    @property
    def counts(self) -> list[int]:
        """How many outliers each layer has."""
        return [int(v) for v in self.mask.flatten(1).sum(dim=1)]

    @property
    def fraction(self) -> torch.Tensor:
        """The share of the patches that are outliers, per layer [L]."""
        return self.mask.flatten(1).float().mean(dim=1)

    @property
    def first_layer(self) -> int | None:
        """The first block after which there is an outlier, or None."""
        hit = [i for i, n in enumerate(self.counts) if n]
        return hit[0] if hit else None

    def patches(self, layer: int) -> list[tuple[int, int]]:
        """The (row, col) of the outliers after block `layer` (negative counts from the end)."""
        return [(int(r), int(c)) for r, c in self.mask[layer].nonzero().tolist()]


def outliers(
    token_norms: torch.Tensor, attentions: torch.Tensor | None = None, *, grid: tuple[int, int], num_prefix_tokens: int,
    factor: float = OUTLIER_FACTOR, pooled_query: bool = False,
) -> Outliers:
    """The high-norm patch tokens after each block.

    Args:
        token_norms: every token's norm after each block [L, N] (`Analysis.token_norms`).
        attentions: the attention stack [L, H, N, N], for the shares of attention the outliers
            receive; None leaves them at 0.
        grid: (gh, gw), N = num_prefix_tokens + gh * gw.
        factor: a patch is an outlier when its norm exceeds factor x the layer's median patch norm.
        pooled_query: the classifier's query is the mean of the patch rows (no cls token).
    """
    if factor <= 1:
        raise ValueError(f"factor must be above 1 (an outlier's norm over the median), got {factor}")
    depth, n = token_norms.shape
    p, (gh, gw) = num_prefix_tokens, grid
    if n != p + gh * gw:
        raise ValueError(f"token_norms has {n} tokens; {p} prefix tokens and a {gh}x{gw} grid make {p + gh * gw}")
    patches = token_norms[:, p:].float()  # [L, P]
    median = patches.median(dim=1).values
    threshold = factor * median
    mask = patches > threshold[:, None]
    query_share, patch_share = torch.zeros(depth), torch.zeros(depth)
    if attentions is not None:
        if attentions.shape[0] != depth or attentions.shape[-1] != n:
            raise ValueError(f"attentions {list(attentions.shape)} do not fit token_norms {list(token_norms.shape)}")
        for layer in range(depth):
            if not mask[layer].any():
                continue
            a = attentions[min(layer + 1, depth - 1)].float().mean(dim=0)  # [N, N], the block that reads them
            to = a[:, p:][:, mask[layer]].sum(dim=1)  # [N]: each row's share on the outliers
            rows = to[p:]
            query_share[layer] = rows.mean() if pooled_query or p == 0 else to[0]
            others = ~mask[layer]
            patch_share[layer] = rows[others].mean() if others.any() else 0.0
    return Outliers(
        factor=float(factor), norms=patches.reshape(depth, gh, gw), threshold=threshold, mask=mask.reshape(depth, gh, gw),
        ratio=patches.max(dim=1).values / median, query_share=query_share, patch_share=patch_share,
    )


# ----------------------------------------------------------------------------- the neurons that write them


def _hidden_point(block: nn.Module) -> tuple[nn.Module, bool]:
    """Where block's MLP hidden activations (after the activation function, before any norm and W_2)
    can be read: (module, True) for its output, (module, False) for its input."""
    mlp = block.mlp
    if hasattr(mlp, "shift") and not isinstance(mlp, nn.Sequential):  # GatedMLP: act(gate) * value is `shift`'s input
        return mlp.shift, False
    return getattr(mlp, "1"), True


@contextmanager
def record_neurons(model: ViT) -> Iterator[list[torch.Tensor | None]]:
    """Every block's MLP hidden activations [B, N, M] during the block (one slot per block, the last
    forward's), after the activation function (a gated MLP's act(gate) * value). Hooks live for the
    block only."""
    slots: list[torch.Tensor | None] = [None] * len(model.blocks)
    handles = []
    for i, block in enumerate(model.blocks):
        module, output = _hidden_point(block)

        def keep(i=i, output=output):
            def hook(mod, args, out=None):
                slots[i] = (out if output else args[0]).detach()
            return hook

        handles.append(module.register_forward_hook(keep()) if output else module.register_forward_pre_hook(keep()))
    try:
        yield slots
    finally:
        for h in handles:
            h.remove()


@dataclass
class RegisterNeurons:
    """The MLP neurons that write the high-norm tokens (`register_neurons`).

    Attributes:
        scores: each neuron's mean |activation| at the outlier positions, averaged over the images
            that had any [L, M].
        ranked: every (layer, neuron, score) with layer <= max_layer, the highest score first.
        neurons: the top k of `ranked` as (layer, neuron): what `with_test_time_register` takes.
        layer: the detection layer (a block's index; its output's norms are read).
        threshold: the absolute norm threshold, or None for the `outliers` rule (`factor`).
        factor: the rule's factor (when `threshold` is None).
        images: images that had an outlier; skipped: those that had none.
    """

    scores: torch.Tensor = field(repr=False)
    ranked: list[tuple[int, int, float]] = field(repr=False)
    neurons: tuple[tuple[int, int], ...]
    layer: int
    threshold: float | None
    factor: float
    images: int
    skipped: int


def _images(model: ViT, images: Iterable[ImageSource] | torch.Tensor) -> Iterator[torch.Tensor]:
    from vitviz.inside.stream import _as_input

    if isinstance(images, torch.Tensor):
        batch = images[None] if images.ndim == 3 else images
        for x in batch:
            yield _as_input(model, x)
        return
    if isinstance(images, (str, bytes)) or not isinstance(images, Iterable):
        images = [images]
    for image in images:
        yield _as_input(model, image)


def register_neurons(
    model: ViT, images: Iterable[ImageSource] | torch.Tensor, *, layer: int = -2, threshold: float | None = None,
    factor: float = OUTLIER_FACTOR, top_k: int = 50, max_layer: int | None = None,
) -> RegisterNeurons:
    """The neurons that write the high-norm tokens, by Jiang et al. 2025's rule (see the module's doc).

    Args:
        model: a vitviz ViT (an image–text model's `image` tower).
        images: images (anything `vitviz.load_image` takes; the model's preprocessing applied) or
            prepared tensors [B, 3, S, S]; run one at a time, as the authors do.
        layer: the detection layer: the block whose output's token norms find the outliers (-2: the
            second-to-last, the authors' DINOv2 setting).
        threshold: an absolute norm (the authors': 150 for DINOv2-L, their default 30): every token
            above it is an outlier position. None: `outliers`' rule over the patches (`factor`).
        top_k: how many neurons `neurons` keeps (the authors' DINOv2-L setting: 50).
        max_layer: only neurons of blocks up to this one are ranked (the authors': 17 of DINOv2-L's
            24); default the detection layer (a later neuron cannot have written what it found).
    """
    from vitviz.inside.stream import _tower

    tower = _tower(model)
    if not isinstance(tower, ViT):
        raise ValueError("register neurons are read from a ViT's MLPs (not a windowed model's)")
    depth, p = tower.config.depth, tower.config.num_prefix_tokens
    detect = layer % depth if -depth <= layer < depth else None
    if detect is None:
        raise ValueError(f"layer {layer} is outside this model's {depth} blocks")
    top = detect if max_layer is None else (max_layer % depth if -depth <= max_layer < depth else None)
    if top is None:
        raise ValueError(f"max_layer {max_layer} is outside this model's {depth} blocks")
    if top_k < 1:
        raise ValueError(f"top_k must be 1 or more, got {top_k}")
    total = torch.zeros(depth, tower.config.mlp_dim, dtype=torch.float64)
    counted = skipped = 0
    with torch.inference_mode():
        for x in _images(tower, images):
            outputs: list[torch.Tensor] = []
            with record_neurons(tower) as acts:
                tower.encode(x, layers=outputs)
            norms = outputs[detect][0].float().norm(dim=-1)  # [N]
            if threshold is None:
                gh, gw = tower.grid_for(x.shape[2], x.shape[3])
                where = outliers(norms[None].cpu(), grid=(gh, gw), num_prefix_tokens=p, factor=factor).mask[0].flatten().nonzero()[:, 0] + p
            else:
                where = (norms > threshold).nonzero()[:, 0].cpu()
            if not len(where):
                skipped += 1
                continue
            counted += 1
            for i, a in enumerate(acts):
                total[i] += a[0, where.to(a.device)].abs().float().mean(dim=0).double().cpu()
    if not counted:
        rule = f"above {threshold}" if threshold is not None else f"above {factor} x the median patch norm"
        raise ValueError(f"no image had a token whose norm after block {detect} is {rule}: no outlier to trace "
                         f"({skipped} image{'s' if skipped != 1 else ''}); lower the threshold or give more images")
    scores = (total / counted).float()
    kept = scores[: top + 1].flatten()
    order = kept.argsort(descending=True, stable=True)
    m = tower.config.mlp_dim
    ranked = [(int(i) // m, int(i) % m, float(kept[i])) for i in order]
    return RegisterNeurons(scores=scores, ranked=ranked, neurons=tuple((l, j) for l, j, _ in ranked[:top_k]), layer=detect,
                           threshold=threshold, factor=float(factor), images=counted, skipped=skipped)


# ----------------------------------------------------------------------------- the test-time register


def with_test_time_register(
    model: ViT, neurons: RegisterNeurons | Sequence[tuple[int, int]], *, keep_prefix: bool = False,
) -> ViT:
    """`model` with a test-time register: one more prefix token, "ttr", into which the MLP
    activations of `neurons` are moved (`ViTConfig.register_neurons`). The new model shares every
    weight with `model` (nothing is copied) and carries a spec named "<variant>+ttr".

    Args:
        model: a vitviz ViT.
        neurons: (layer, neuron) pairs, or `register_neurons`' result (its `neurons`).
        keep_prefix: the learned prefix tokens keep their activations at those neurons (default: 0,
            as the authors' DINOv2 wrapper).
    """
    if not isinstance(model, ViT):
        raise ValueError("a test-time register is added to a vitviz ViT (for an image–text model, to its `image` tower)")
    pairs = neurons.neurons if isinstance(neurons, RegisterNeurons) else tuple((int(l), int(j)) for l, j in neurons)
    if not pairs:
        raise ValueError("no neuron given: a test-time register needs the neurons whose activations it takes")
    c = model.config
    if c.register_neurons:
        raise ValueError("this model has a test-time register already")
    if c.rel_pos_bias:
        raise ValueError("this model's relative position bias is learned for its own tokens: it has no place for one more")
    config = c.replace(register_neurons=pairs, register_keep_prefix=keep_prefix)
    with torch.device("meta"):
        new = ViT(config)
    _share(new, model)
    new.train(model.training)
    spec = getattr(model, "spec", None)
    if spec is not None:
        new.spec = replace(spec, name=f"{spec.name}+ttr", config=config,
                           description=f"{spec.description}, with a test-time register ({len(config.register_neurons)} neurons)")
    return new


def _share(new: nn.Module, old: nn.Module) -> None:
    """Puts `old`'s parameters and buffers (the same tensors) into `new`, built on the meta device
    with the same modules (a test-time register adds none that hold a tensor)."""
    theirs = dict(old.named_parameters(remove_duplicate=False)) | dict(old.named_buffers(remove_duplicate=False))
    mine = [name for name, _ in new.named_parameters(remove_duplicate=False)] + [name for name, _ in new.named_buffers(remove_duplicate=False)]
    missing = [name for name in mine if name not in theirs]
    if missing:
        raise ValueError(f"the model lacks {missing[:3]}: it is not the architecture its config describes")
    for name in mine:
        owner, _, leaf = name.rpartition(".")
        module = new.get_submodule(owner) if owner else new
        tensor = theirs[name]
        if leaf in module._parameters:
            module._parameters[leaf] = tensor
        else:
            module._buffers[leaf] = tensor
