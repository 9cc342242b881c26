"""Activation patching: which activations carry what tells two images apart.

Run the model on a clean image and on a corrupted one (another image of the same size), then run
the corrupted image again with one activation, a site, replaced by its value in the clean run, and
see how much of the clean answer comes back. This is causal tracing (Meng et al. 2022, "Locating
and Editing Factual Associations in GPT") as Heimersheim & Nanda 2024 ("How to use and interpret
activation patching") describe it, with TransformerLens's patching conventions
(`transformer_lens.patching`): the metric is a logit difference

    LD = logit[target] − logit[other]

and a site's score is

    (LD_patched − LD_corrupted) / (LD_clean − LD_corrupted)

1: patching that site alone restores the clean logit difference entirely; 0: it restores nothing
(negative, or above 1: it moves the difference the other way, or past the clean one).

The sites (`KINDS`; l a block, n a token in the model's order: prefix tokens, then the patches row
by row, h a head):

    "resid_pre"  (l, n)     the input of block l at token n (l = 0: the embedding, `ViT.tokens`)   map [L, N]
    "attn_out"   (l, n)     block l's attention output at token n (after W_O and its bias,
                            before LayerScale)                                                    map [L, N]
    "mlp_out"    (l, n)     block l's MLP output at token n                                         map [L, N]
    "head"       (l, h)     head h's output o_h = A_h V_h at every token (its slice of the input
                            of `Attention.norm`, before W_O)                                        map [L, H]
    "head_token" (l, n, h)  head h's output at token n alone                                        map [L, N, H]
    "pattern"    (l, h)     head h's attention pattern A_h [N, N] (the output of `Attention.attend`) map [L, H]

`patch` scores every site of the kinds asked, batched: the sites of one layer run as copies of one
batch, each copy with its own site patched, from that block on (see `patch`); `patched_logits` runs
the corrupted image once with any set of sites patched at once. The logits are the model's: a
classifier's head (DeiT: the mean of its two heads), or an image–text model's zero-shot similarity
to its label texts; the final stream reaches them by `vitviz.inside.stream`'s own last step
(`_tail`, `Unembed`). Nothing changes weights: the patches are hooks that live for one call and act
only in the thread that made them.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vitviz import steps
from vitviz.architectures import attention_of
from vitviz.config import VariantSpec
from vitviz.images import ImageSource
from vitviz.imagetext import ImageTextModel
from vitviz.inside.attribution import _class_index
from vitviz.inside.stream import Target, Unembed, _as_input, _categories, _classes, _labels, _tail, _tower, _unembed, readout_of
from vitviz.model import ViT

__all__ = ["KINDS", "Patching", "patch", "patched_logits", "patch_forwards", "copy_bytes"]

KINDS = ("resid_pre", "attn_out", "mlp_out", "head", "head_token", "pattern")

MEMORY = 512 * 2**20  # bytes the copies of one batched forward may take, by default

# Where each kind's activation is recorded in the clean run: the activation it replaces ("head" and
# "head_token" both replace the heads' outputs).
_SOURCE = {"resid_pre": "resid", "attn_out": "attn", "mlp_out": "mlp", "head": "heads", "head_token": "heads", "pattern": "pattern"}


# ----------------------------------------------------------------------------- sizes and batches


def copy_bytes(*, tokens: int, width: int, mlp: int, heads: int, gated: bool = False, itemsize: int = 4, attention: int = 2) -> int:
    """The activations one copy of a patched batch (or any forward that records nothing) may hold
    while a block runs, in bytes:

        itemsize x (12 N D + 2 N M + attention x H N²)      (a gated MLP of width M: 4 N M instead of 2 N M)

    12 N D: the stream, its norms, the fused qkv (3 N D), the rotated queries and keys, the heads'
    outputs and their copy, the projections and the sums; 2 N M: the MLP's hidden layer and its
    activation; `attention` layers of H N² (`attention_layers`): 2, one layer's attention logits and
    softmax (the explicit path, which "pattern" runs); 0, the fused kernel; 3, a relative position
    bias's mask beside the logits and softmax.
    """
    hidden = (4 if gated else 2) * tokens * mlp
    return itemsize * (12 * tokens * width + hidden + attention * heads * tokens * tokens)


def attention_layers(*, explicit: bool, bias: bool) -> int:
    """`copy_bytes`' `attention`: the [H, N, N] layers a block holds. 2 on the explicit path (a hook
    observes the softmax: its logits and weights), 0 on the fused kernel; a relative position bias
    adds its mask, and its [H, N, N] float mask sends the CPU's kernel to the explicit path as well (3)."""
    return 3 if bias else 2 if explicit else 0


@dataclass(frozen=True)
class _Sizes:
    """L, H, N, D, the MLP's width, whether it is gated, the bytes of one activation, and whether
    the attention adds a relative position bias."""

    layers: int
    heads: int
    tokens: int
    width: int
    mlp: int
    gated: bool
    itemsize: int
    rel_pos: bool = False

    def per_copy(self, kinds: Sequence[str]) -> int:
        """One copy's activations in a batch of `kinds` (`copy_bytes`; one batch size serves them all):
        a pattern is patched on the explicit path (logits and weights held), every other kind on the
        fused kernel."""
        return max(copy_bytes(tokens=self.tokens, width=self.width, mlp=self.mlp, heads=self.heads, gated=self.gated,
                              itemsize=self.itemsize, attention=attention_layers(explicit=k == "pattern", bias=self.rel_pos))
                   for k in kinds)

    def sites(self, kind: str) -> int:
        """The sites of `kind` in one layer."""
        return {"head": self.heads, "pattern": self.heads, "head_token": self.tokens * self.heads}.get(kind, self.tokens)

    def cache_bytes(self, kinds: Sequence[str], *, layers: int | None = None) -> int:
        """What `patch` keeps besides the batch: the corrupted run's block inputs [L, N, D], the clean
        run's activations of each source the kinds replace ([L, N, D] each; the patterns [L, H, N, N]).
        With `layers`, what `patched_logits` keeps for sites at that many layers: the clean run's
        sources there alone."""
        kept = self.layers if layers is None else layers
        row = kept * self.tokens * self.width * self.itemsize
        sources = {_SOURCE[k] for k in kinds}
        patterns = kept * self.heads * self.tokens**2 * self.itemsize if "pattern" in sources else 0
        return row * ((1 if layers is None else 0) + len(sources - {"pattern"})) + patterns


def _refuse_windowed(model: Any) -> None:
    attention = getattr(model.config, "attention", "global") if isinstance(model, VariantSpec) else attention_of(model)
    if attention != "global":
        raise ValueError(f"activation patching runs on ViT towers (one N x N attention a layer); this model's attention is {attention}")


def _sizes(model_or_spec: ViT | ImageTextModel | VariantSpec, tokens: int | None = None) -> _Sizes:
    _refuse_windowed(model_or_spec)
    if isinstance(model_or_spec, VariantSpec):
        c, itemsize = model_or_spec.config, 4
        n = model_or_spec.num_tokens if tokens is None else tokens
    else:
        tower = _tower(model_or_spec)
        if not isinstance(tower, ViT):
            raise TypeError(f"expected a vitviz ViT, an ImageTextModel or a VariantSpec, got {type(model_or_spec).__name__}")
        c, itemsize = tower.config, next(tower.parameters()).element_size()
        n = c.num_tokens if tokens is None else tokens
    return _Sizes(c.depth, c.heads, int(n), c.width, c.mlp_dim, c.mlp == "gated", itemsize, bool(c.rel_pos_bias))


def _kinds(where: str | Sequence[str]) -> tuple[str, ...]:
    kinds = (where,) if isinstance(where, str) else tuple(where)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"unknown kind of site {unknown[0] if unknown else where!r}: where is one or more of {', '.join(KINDS)}")
    return tuple(dict.fromkeys(kinds))  # in order, once each


def _batches(sizes: _Sizes, kinds: Sequence[str], batch_size: int | None, memory: int) -> dict[str, int]:
    """Each kind's copies per batched forward: `batch_size`, or the most whose activations fit
    `memory` (`copy_bytes`, at least 1), and never more than one layer's sites."""
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size is 1 or more (or None: as many as fit in memory), got {batch_size}")
    fit = batch_size if batch_size is not None else max(1, memory // sizes.per_copy(kinds))
    return {k: min(fit, sizes.sites(k)) for k in kinds}


def patch_forwards(
    model_or_spec: ViT | ImageTextModel | VariantSpec, kinds: str | Sequence[str], *, tokens: int | None = None,
    batch_size: int | None = None, memory: int = MEMORY,
) -> int:
    """The batched forwards `patch` runs for `kinds` (besides its clean and corrupted runs), before
    anything runs: for each kind and layer, that layer's sites in batches (`patch`).

    Args:
        model_or_spec: the model, or its `VariantSpec` (priced in float32).
        tokens: N, the tokens of the image (default: the model's trained size; a spec's size).
        batch_size, memory: as `patch` takes them.
    """
    sizes = _sizes(model_or_spec, tokens)
    kinds = _kinds(kinds)
    batches = _batches(sizes, kinds, batch_size, memory)
    return sum(sizes.layers * math.ceil(sizes.sites(k) / batches[k]) for k in kinds)


@dataclass(frozen=True)
class _Plan:
    """What `patch` of `kinds` will run and hold, for pricing (`vitviz.cost`): the largest batch, one
    copy's bytes (`copy_bytes`), the cached runs' bytes, the sites of one layer (all kinds), and what
    `patched_logits` keeps for one site of each kind (the clean run's sources at one layer)."""

    kinds: tuple[str, ...]
    batch: int
    per_copy: int
    cached: int
    sites: int
    one_site: int


def _plan(spec: VariantSpec, kinds: str | Sequence[str], *, batch_size: int | None = None, memory: int = MEMORY) -> _Plan:
    sizes = _sizes(spec)
    kinds = _kinds(kinds)
    return _Plan(kinds, max(_batches(sizes, kinds, batch_size, memory).values()), sizes.per_copy(kinds), sizes.cache_bytes(kinds),
                 sum(sizes.sites(k) for k in kinds), sizes.cache_bytes(kinds, layers=1))


# ----------------------------------------------------------------------------- recording and patching


def _record(tower: ViT, keep: dict[str, Sequence[int]]) -> tuple[dict[str, dict[int, torch.Tensor]], Any]:
    """Hooks that keep, in the calling thread, the first image's activation of each source
    ("resid" [N, D], "attn" [N, D], "mlp" [N, D], "heads" [N, H, d], "pattern" [H, N, N]) at the
    layers listed: (what they fill, the context manager that holds the hooks for one call)."""
    owner, heads = threading.get_ident(), tower.config.heads
    kept: dict[str, dict[int, torch.Tensor]] = {name: {} for name in keep}

    def pre(name: str, layer: int, reshape=None):
        def hook(module: nn.Module, args: tuple) -> None:
            if threading.get_ident() == owner:
                x = args[0][0]
                kept[name][layer] = (x if reshape is None else reshape(x)).clone()
        return hook

    def post(name: str, layer: int):
        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            if threading.get_ident() == owner:
                kept[name][layer] = out[0].clone()
        return hook

    def place(name: str, layer: int):
        block = tower.blocks[layer]
        if name == "resid":
            return block.register_forward_pre_hook(pre(name, layer))
        if name == "heads":
            return block.attn.norm.register_forward_pre_hook(pre(name, layer, lambda o: o.unflatten(-1, (heads, -1))))
        module = {"attn": block.attn, "mlp": block.mlp, "pattern": block.attn.attend}[name]
        return module.register_forward_hook(post(name, layer))

    return kept, _hooks(lambda: [place(name, layer) for name, layers in keep.items() for layer in layers])


@contextmanager
def _hooks(register) -> Iterator[None]:
    """The hooks `register()` places, for the block only (removed in `finally`, also where placing one failed)."""
    handles: list = []
    try:
        handles.extend(register())
        yield
    finally:
        for h in handles:
            h.remove()


@dataclass(frozen=True)
class _Edit:
    """Sites of one kind at one layer, patched in one forward: copy `rows[i]` of the batch gets site
    i, at token `tokens[i]` and/or head `heads[i]` (each [S], None where the kind has no such index)."""

    kind: str
    layer: int
    rows: torch.Tensor
    tokens: torch.Tensor | None = None
    heads: torch.Tensor | None = None


def _patching(tower: ViT, edits: Sequence[_Edit], clean: dict[str, dict[int, torch.Tensor]]):
    """A context manager holding, for one call and in the calling thread only, the hooks that
    replace each edit's sites by the clean run's activation (`clean`, as `_record` keeps it).
    Hooks on `Attention.attend` (for "pattern") make that layer take the explicit attention path."""
    owner, heads = threading.get_ident(), tower.config.heads

    def hook_for(edit: _Edit):
        rows, n, h = edit.rows, edit.tokens, edit.heads
        source = clean[_SOURCE[edit.kind]][edit.layer]
        block = tower.blocks[edit.layer]

        if edit.kind == "resid_pre":
            def resid(module: nn.Module, args: tuple) -> tuple | None:
                if threading.get_ident() != owner:
                    return None
                x = args[0].clone()
                x[rows, n] = source[n]
                return (x,) + args[1:]
            return block.register_forward_pre_hook(resid)

        if edit.kind in ("attn_out", "mlp_out"):
            def output(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
                if threading.get_ident() != owner:
                    return None
                out = out.clone()
                out[rows, n] = source[n]
                return out
            return (block.attn if edit.kind == "attn_out" else block.mlp).register_forward_hook(output)

        if edit.kind in ("head", "head_token"):
            def head(module: nn.Module, args: tuple) -> tuple | None:
                if threading.get_ident() != owner:
                    return None
                o = args[0].unflatten(-1, (heads, -1)).clone()  # [B, N, H, d]
                if n is None:
                    o[rows, :, h] = source[:, h].transpose(0, 1)  # copy i, every token, head h_i: [S, N, d]
                else:
                    o[rows, n, h] = source[n, h]
                return (o.flatten(-2),) + args[1:]
            return block.attn.norm.register_forward_pre_hook(head)

        def pattern(module: nn.Module, args: tuple, attn: torch.Tensor) -> torch.Tensor | None:
            if threading.get_ident() != owner:
                return None
            attn[rows, h] = source[h]  # [S, N, N]; in place: the softmax's output is the layer's own
            return attn
        return block.attn.attend.register_forward_hook(pattern)

    return _hooks(lambda: [hook_for(e) for e in edits])


def _run(tower: ViT, unembed: Unembed, s: torch.Tensor, start: int, ropes: list) -> torch.Tensor:
    """The stream s [B, N, D] before block `start` through the blocks from `start` on, the model's
    last step (`_tail`) and the unembedding (on the CPU) -> logits [B, C], float64."""
    readout, q, _ = readout_of(tower)
    for block, rope in zip(tower.blocks[start:], ropes[start:]):
        s = block(s, rope)
        steps.step()
    z = _tail(tower, s, readout, q)
    z = z.to("cpu", torch.float64 if z.dtype == torch.float64 else torch.float32)
    return unembed.logits(z).double()


# ----------------------------------------------------------------------------- the record


@dataclass
class Patching:
    """The scores of the sites of each kind patched (module docstring): 1 where patching the site
    from the clean run restores the clean logit difference, 0 where it restores nothing.

    Attributes:
        kinds: the kinds of site patched.
        maps: kind -> scores, float32: "resid_pre", "attn_out", "mlp_out" [L, N]; "head", "pattern"
            [L, H]; "head_token" [L, N, H].
        target, other: the classes whose logit difference is followed (target − other).
        label, other_label: their names, None without categories.
        categories: class names (an image–text model's labels), or None.
        clean_logits, corrupted_logits: the two runs' logits [C].
        clean_diff, corrupted_diff: LD_clean and LD_corrupted.
        forwards: the batched forwards run (besides the clean and corrupted runs, and for "pattern"
            the clean run that records the patterns).
        batch_size: sites per batched forward (the largest batch run).
        grid: the patch grid of the images; prefix_names: the prefix tokens, in order.
    """

    kinds: tuple[str, ...]
    maps: dict[str, torch.Tensor] = field(repr=False)
    target: int
    other: int
    label: str | None
    other_label: str | None
    categories: tuple[str, ...] | None = field(repr=False)
    clean_logits: torch.Tensor = field(repr=False)
    corrupted_logits: torch.Tensor = field(repr=False)
    clean_diff: float
    corrupted_diff: float
    forwards: int
    batch_size: int
    grid: tuple[int, int] = (0, 0)
    prefix_names: tuple[str, ...] = ()

    def site_names(self, kind: str) -> tuple[tuple[str, ...], ...]:
        """The names along each axis of `maps[kind]`: layers ("layer 0", ...), tokens ("cls", ...,
        "patch (row, column)") and heads ("head 0", ...), in the map's order."""
        if kind not in self.maps:
            raise ValueError(f"{kind!r} was not patched; this record has {', '.join(self.kinds)}")
        shape = self.maps[kind].shape
        layers = tuple(f"layer {i}" for i in range(shape[0]))
        gh, gw = self.grid
        tokens = self.prefix_names + tuple(f"patch ({r}, {c})" for r in range(gh) for c in range(gw))
        heads = tuple(f"head {i}" for i in range(shape[-1]))
        if kind in ("head", "pattern"):
            return layers, heads
        return (layers, tokens, heads) if kind == "head_token" else (layers, tokens)


# ----------------------------------------------------------------------------- entry points


def _prepare(model: ViT | ImageTextModel, clean: ImageSource | torch.Tensor, corrupt: ImageSource | torch.Tensor,
             labels: Sequence[str] | None, template: str | None) -> tuple[ViT, torch.Tensor, torch.Tensor, tuple[str, ...] | None]:
    """The tower, both inputs [1, 3, H, W] (checked alike), the label set; refuses what cannot be patched."""
    _refuse_windowed(model)
    tower = _tower(model)
    if not isinstance(tower, ViT):
        raise TypeError(f"expected a vitviz ViT or ImageTextModel, got {type(model).__name__}")
    labels = _labels(model, labels, template)
    _classes(model, labels, template)
    a, b = _as_input(model, clean)[:1], _as_input(model, corrupt)[:1]
    if a.shape != b.shape:
        raise ValueError(f"the clean and corrupted images must have the same shape; got {list(a.shape[1:])} and {list(b.shape[1:])}")
    tower.grid_for(a.shape[2], a.shape[3])  # (checks the size)
    return tower, a, b, labels


def _forward(tower: ViT, unembed: Unembed, x: torch.Tensor, keep: dict[str, Sequence[int]],
             edits: Sequence[_Edit] = (), clean: dict | None = None) -> tuple[torch.Tensor, dict[str, dict[int, torch.Tensor]]]:
    """One forward of images x through `_run` (the path every patched batch takes), with the
    activations `keep` names recorded and `edits` patched from `clean`: (logits [B, C] float64, what was kept)."""
    kept, recording = _record(tower, keep)
    ropes = tower.rotations(tower.grid_for(x.shape[2], x.shape[3]))
    with recording, _patching(tower, edits, clean or {}):
        logits = _run(tower, unembed, tower.tokens(x), 0, ropes)
    return logits, kept


def _other_than(logits: torch.Tensor, t: int) -> int:
    order = logits.argsort(descending=True).tolist()
    return next(i for i in order if i != t)


def _pair(target: Target | tuple[int | str, int | str], categories: tuple[str, ...] | None, clean: torch.Tensor,
          corrupted: torch.Tensor) -> tuple[int, int]:
    """(target, other) from `patch`'s `target` (module docstring of `patch`)."""
    classes = clean.numel()
    if classes < 2:
        raise ValueError("patching follows a logit difference between two classes; this model scores one")
    if target is None:
        t, o = int(clean.argmax()), int(corrupted.argmax())
        return (t, o) if o != t else (t, _other_than(corrupted, t))
    if isinstance(target, (tuple, list)):
        if len(target) != 2:
            raise ValueError(f"target is a class, a (class, other class) pair or None; got {target!r}")
        t, o = (_class_index(x, categories, classes, 0) for x in target)
        if t == o:
            raise ValueError(f"target and other are the same class ({target[0]!r}): their logit difference is always 0")
        return t, o
    t = _class_index(target, categories, classes, 0)
    return t, _other_than(corrupted, t)


def patch(
    model: ViT | ImageTextModel, clean: ImageSource | torch.Tensor, corrupt: ImageSource | torch.Tensor, *,
    target: Target | tuple[int | str, int | str] = None, where: str | Sequence[str] = "resid_pre", labels: Sequence[str] | None = None,
    template: str | None = None, batch_size: int | None = None, memory: int = MEMORY,
) -> Patching:
    """Scores every site of the kinds `where` names by how much of the clean logit difference
    patching it alone (from the clean run into the corrupted run) restores (module docstring).

    The clean and corrupted images run once each, the corrupted run keeping each block's input. A
    site of layer l then runs from block l on, in a batch of copies of the corrupted run's input of
    block l, each copy with its own site patched: the blocks before l would compute exactly the
    corrupted run, so they are not run again, and all sites of one layer share that start. A kind's
    sites of one layer go in ceil(S / B) batches of B copies (S: the layer's sites, N, H or N·H),
    so L · ceil(S / B) batched forwards a kind (`patch_forwards` counts them beforehand).

    Args:
        model: a vitviz ViT with a head, or an image–text model (zero-shot over `labels`, its own
            label set by default, through `template`).
        clean, corrupt: anything `vitviz.load_image` takes (the model's preprocessing applied), or
            prepared tensors [3, H, W]; of the same shape.
        target: None: the clean run's prediction against the corrupted run's (or, where they are
            the same class, the corrupted run's best other class); a class (index or name): it
            against the corrupted run's best other class; a pair (class, other class).
        where: a kind of site (`KINDS`) or several.
        batch_size: copies per batched forward; None: the most whose activations fit `memory`
            bytes, itemsize x (12 N D + 2 N M) a copy, 2 H N² more where a pattern is patched (the
            explicit path) and 3 H N² with a relative position bias (`copy_bytes`, `attention_layers`;
            the cached runs besides).

    Raises:
        ValueError: a Swin model, a model with nothing to score, images of different shapes, an
            unknown kind, or a clean and corrupted image with the same logit difference.
    """
    kinds = _kinds(where)
    tower, x_clean, x_corrupt, labels = _prepare(model, clean, corrupt, labels, template)
    unembed, categories = _unembed(model, labels, template), _categories(model, labels)
    grid = tower.grid_for(x_clean.shape[2], x_clean.shape[3])
    sizes = _sizes(model, tower.config.num_prefix_tokens + grid[0] * grid[1])
    every = range(sizes.layers)
    sources = {_SOURCE[k] for k in kinds}
    with torch.inference_mode():
        clean_logits, kept = _forward(tower, unembed, x_clean, {name: every for name in sources - {"pattern"}})
        corrupted_logits, started = _forward(tower, unembed, x_corrupt, {"resid": every})
        t, o = _pair(target, categories, clean_logits[0], corrupted_logits[0])
        ld_clean = float(clean_logits[0, t] - clean_logits[0, o])
        ld_corrupted = float(corrupted_logits[0, t] - corrupted_logits[0, o])
        if abs(ld_clean - ld_corrupted) < 1e-6 * max(1.0, abs(ld_clean)):
            names = (categories[t], categories[o]) if categories is not None else (t, o)
            raise ValueError(f"the clean and corrupted images give the same logit difference {ld_clean:.6g} between {names[0]!r} "
                             f"and {names[1]!r}: patching has nothing to restore; pick images the model tells apart, or "
                             "another target")
        if "pattern" in sources:  # recorded on the explicit path, in a run of its own: the clean logits stay the fused path's
            kept.update(_forward(tower, unembed, x_clean, {"pattern": every})[1])
        batches = _batches(sizes, kinds, batch_size, memory)
        ropes = tower.rotations(grid)
        device = x_clean.device
        maps, forwards = {}, 0
        for kind in kinds:
            n, h = sizes.tokens, sizes.heads
            if kind == "head_token":  # site n·H + h: the [N, H] order of the map
                tokens, heads = torch.arange(n).repeat_interleave(h), torch.arange(h).repeat(n)
            elif kind in ("head", "pattern"):
                tokens, heads = None, torch.arange(h)
            else:
                tokens, heads = torch.arange(n), None
            sites, b = sizes.sites(kind), batches[kind]
            diffs = torch.empty(sizes.layers, sites, dtype=torch.float64)
            for layer in every:
                for first in range(0, sites, b):
                    part = slice(first, min(first + b, sites))
                    count = part.stop - part.start
                    edit = _Edit(kind, layer, torch.arange(count, device=device),
                                 None if tokens is None else tokens[part].to(device), None if heads is None else heads[part].to(device))
                    start = started["resid"][layer].expand(count, -1, -1).clone()
                    with _patching(tower, [edit], kept):
                        logits = _run(tower, unembed, start, layer, ropes)
                    diffs[layer, part] = logits[:, t] - logits[:, o]
                    forwards += 1
            scores = ((diffs - ld_corrupted) / (ld_clean - ld_corrupted)).float()
            maps[kind] = scores.unflatten(1, (n, h)) if kind == "head_token" else scores
    return Patching(
        kinds=kinds, maps=maps, target=t, other=o,
        label=categories[t] if categories is not None else None, other_label=categories[o] if categories is not None else None,
        categories=categories, clean_logits=clean_logits[0].float(), corrupted_logits=corrupted_logits[0].float(),
        clean_diff=ld_clean, corrupted_diff=ld_corrupted, forwards=forwards, batch_size=max(batches.values()),
        grid=grid, prefix_names=tuple(tower.config.prefix_names),
    )


_ARITY = {"resid_pre": ("layer", "token"), "attn_out": ("layer", "token"), "mlp_out": ("layer", "token"),
          "head": ("layer", "head"), "head_token": ("layer", "token", "head"), "pattern": ("layer", "head")}


def _checked_sites(sites: Sequence[tuple], sizes: _Sizes) -> list[tuple]:
    """Each site (kind, indices...) checked against the model: [(kind, {"layer": l, "token": n, "head": h})]."""
    limits = {"layer": sizes.layers, "token": sizes.tokens, "head": sizes.heads}
    out = []
    for site in sites:
        site = tuple(site)
        kind = site[0] if site else None
        if kind not in _ARITY:
            raise ValueError(f"site {site!r}: its first entry is the kind, one of {', '.join(KINDS)}")
        axes = _ARITY[kind]
        if len(site) != 1 + len(axes):
            raise ValueError(f"site {site!r}: a {kind} site is ({kind!r}, {', '.join(axes)})")
        index = dict(zip(axes, (int(v) for v in site[1:])))
        if not all(0 <= index[a] < limits[a] for a in axes):
            raise ValueError(f"site {site!r} is outside this model's {sizes.layers} layers x {sizes.tokens} tokens x "
                             f"{sizes.heads} heads")
        out.append((kind, index))
    return out


def patched_logits(
    model: ViT | ImageTextModel, clean: ImageSource | torch.Tensor, corrupt: ImageSource | torch.Tensor,
    sites: Sequence[tuple], *, labels: Sequence[str] | None = None, template: str | None = None,
) -> torch.Tensor:
    """The logits [C] (float32, CPU) of one forward of the corrupted image with every site in `sites`
    patched at once from the clean run: ("resid_pre", l, n), ("attn_out", l, n), ("mlp_out", l, n),
    ("head", l, h), ("head_token", l, n, h), ("pattern", l, h) (module docstring). No site: the
    corrupted run's logits, as `patch` computes them; every token of "resid_pre" at a layer: the
    clean run's."""
    tower, x_clean, x_corrupt, labels = _prepare(model, clean, corrupt, labels, template)
    grid = tower.grid_for(x_clean.shape[2], x_clean.shape[3])
    checked = _checked_sites(sites, _sizes(model, tower.config.num_prefix_tokens + grid[0] * grid[1]))
    unembed = _unembed(model, labels, template)
    groups: dict[tuple[str, int], list[dict]] = {}
    for kind, index in checked:
        groups.setdefault((kind, index["layer"]), []).append(index)
    keep: dict[str, set[int]] = {}
    for kind, layer in groups:
        keep.setdefault(_SOURCE[kind], set()).add(layer)
    device = x_clean.device

    def column(indices: list[dict], axis: str) -> torch.Tensor | None:
        return torch.tensor([i[axis] for i in indices], device=device) if axis in indices[0] else None

    edits = [_Edit(kind, layer, torch.zeros(len(indices), dtype=torch.long, device=device), column(indices, "token"),
                   column(indices, "head")) for (kind, layer), indices in groups.items()]
    with torch.inference_mode():
        kept = _forward(tower, unembed, x_clean, {name: sorted(layers) for name, layers in keep.items()})[1] if edits else {}
        logits = _forward(tower, unembed, x_corrupt, {}, edits, kept)[0]
    return logits[0].float()
