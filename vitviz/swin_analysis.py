"""A Swin's analysis of one image (`analyze_swin` -> `SwinAnalysis`) and its maps for a class:
`vitviz.analyze` and `vitviz.explain` (with "rollout", "attention", "gradient", "grad_rollout") hand a
Swin (`vitviz.swin`) to it, through the `Architecture` this module registers.

Its rollout and relevance run through every window layer and patch merge onto the finest grid, by
the exact products of `vitviz.swin_global` (window attention made global, merges as linear maps;
its names are this module's too). The pooled classifier's query (no cls token) is the mean of the
final tokens: its row of any such product is the mean of their rows, a map over the finest grid.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch
from PIL import Image

from vitviz.analysis import POOL, HeadFusion
from vitviz.config import VariantSpec
from vitviz.hooks import record_attention
from vitviz.images import ImageSource, load_image
from vitviz.layout import Architecture, TokenLayout, register_architecture
from vitviz.preprocess import preprocess, to_input
from vitviz.swin import Swin, WindowGeometry, _unpartition
from vitviz.swin_global import (  # noqa: F401  (the maths of windows and merges, `vitviz.swin_global`)
    SLICE_ELEMENTS,
    merge_map,
    swin_gradient_relevance,
    swin_gradient_rollout,
    swin_last_attention,
    swin_rollout,
    window_to_global,
)

if TYPE_CHECKING:  # (vitviz.inside is imported where it is used)
    from vitviz.inside import Attribution, Stream

__all__ = [
    "SwinAnalysis",
    "SWIN_METHODS",
    "SLICE_ELEMENTS",
    "window_to_global",
    "merge_map",
    "swin_rollout",
    "swin_gradient_relevance",
    "swin_gradient_rollout",
    "swin_last_attention",
    "analyze_swin",
    "analyze_swin_crop",
    "swin_relevance",
    "swin_relevance_maps",
    "swin_summary_rows",
    "record_swin_stream",
]

# the explanation methods a Swin answers (`vitviz.explain`, `vitviz.relevance_maps`)
SWIN_METHODS: tuple[str, ...] = ("attention", "rollout", "gradient", "grad_rollout")


# ---------------------------------------------------------------------------------------------
# One image: the analysis


def _spec_of(model: Swin) -> VariantSpec:
    if getattr(model, "spec", None) is None:
        raise ValueError("this Swin has no VariantSpec; load it with vitviz.load_model or convert it with vitviz.from_timm or "
                         "vitviz.from_transformers")
    return model.spec


@dataclass
class SwinAnalysis:
    """What one Swin did with one image, on the CPU.

    Attributes:
        variant: the model's variant name.
        image: the S x S crop the model saw.
        probabilities: softmax over the classes [C], or None for a model without a head.
        categories: class names, or None.
        attentions: each layer's window attention [windows, heads_l, M², M²] (`geometries[l]` says
            where each place is on the stage's grid).
        geometries: each layer's `WindowGeometry` (grid, window, shift).
        stages: each layer's stage.
        biases: each layer's relative position bias [heads_l, M², M²] (added to the logits; Swin
            V2's continuous one as it is added, 16 sigmoid(·)).
        tokens: the final tokens after the final norm [N_last, D].
        token_norms: the L2 norm of every token after each block, before the final norm: one [N_s]
            per layer, raster order of its stage's grid (where high-norm tokens appear).
        inside: what the classifier's pooled mean gathered through the last stage's blocks, recorded
            in the same forward (`vitviz.inside.Stream`, `first_layer` the stage's first block: the
            stream is as wide as the head's input there only), or None without a head.
        patch_size: P, the finest grid's patch side; stage s's tokens cover P 2^s pixels.
        device: where the model ran; model_seconds: time of the recorded forward.
        layout: the tokens and what the model offers: windowed attention, each stage's grid, a
            pooled query, no cls token, no position embeddings.
    """

    variant: str
    image: Image.Image = field(repr=False)
    probabilities: torch.Tensor | None = field(repr=False)
    categories: tuple[str, ...] | None = field(repr=False)
    attentions: list[torch.Tensor] = field(repr=False)
    geometries: list[WindowGeometry] = field(repr=False)
    stages: tuple[int, ...]
    biases: list[torch.Tensor] = field(repr=False)
    tokens: torch.Tensor = field(repr=False)
    patch_size: int
    device: str
    model_seconds: float
    layout: TokenLayout | None = None
    token_norms: list[torch.Tensor] = field(default_factory=list, repr=False)
    inside: Stream | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.layout is None:
            self.layout = TokenLayout(prefix_names=(), grids=self.stage_grids, attention="windowed", pooled_query=True,
                                      classifier=self.probabilities is not None, position_embeddings=False, position_bias=True,
                                      stream=self.inside is not None)

    prefix_names = property(lambda self: ())
    num_prefix_tokens = property(lambda self: 0)
    pooled_query = property(lambda self: True)
    query_names = property(lambda self: (POOL,))
    default_query = property(lambda self: POOL)

    @property
    def num_layers(self) -> int:
        return len(self.attentions)

    @property
    def stage_grids(self) -> tuple[tuple[int, int], ...]:
        """Each stage's grid, finest first."""
        return tuple(g.grid for i, g in enumerate(self.geometries) if i == 0 or self.stages[i] != self.stages[i - 1])

    @property
    def grid(self) -> tuple[int, int]:
        """The finest grid (gh0, gw0): where the maps are."""
        return self.geometries[0].grid

    @property
    def window_sizes(self) -> tuple[tuple[int, int], ...]:
        """Each layer's window (wh, ww)."""
        return tuple(g.window for g in self.geometries)

    @property
    def shifts(self) -> tuple[tuple[int, int], ...]:
        """Each layer's shift (sh, sw); (0, 0) for a layer that is not shifted."""
        return tuple(g.shift for g in self.geometries)

    def heads(self, layer: int) -> int:
        return self.attentions[layer].shape[1]

    def stage_patch_size(self, layer: int) -> int:
        """The pixels one token of the layer's stage covers per side: P 2^s."""
        return self.patch_size * 2 ** self.stages[layer]

    @property
    def nbytes(self) -> int:
        """Bytes held by the tensors and the crop."""
        tensors = [*self.attentions, *self.biases, *self.token_norms, self.tokens] + ([self.probabilities] if self.probabilities is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors) + 3 * self.image.size[0] * self.image.size[1]

    def predictions(self, k: int = 5) -> list[tuple[str, float]]:
        """The top-k (label, probability), most likely first; empty for a model without a head."""
        if self.probabilities is None or self.categories is None:
            return []
        top = self.probabilities.topk(min(k, self.probabilities.numel()))
        return [(self.categories[i], float(v)) for v, i in zip(top.values.tolist(), top.indices.tolist())]

    def global_attention(self, layer: int) -> torch.Tensor:
        """The layer's patch-to-patch attention on its stage's grid [heads, N_s, N_s] (`window_to_global`)."""
        return window_to_global(self.attentions[layer], self.geometries[layer])[0]

    def rollout(self, *, head_fusion: HeadFusion = "mean") -> torch.Tensor:
        """Attention rollout through the network [N_last, N_0] (rows sum to 1)."""
        return swin_rollout(self.attentions, self.geometries, self.stages, head_fusion=head_fusion)[0]

    def cls_map(self, *, head_fusion: HeadFusion = "mean") -> torch.Tensor:
        """The pooled query's rollout on the finest grid [gh0, gw0]: the mean of the final tokens' rows."""
        return self.rollout(head_fusion=head_fusion).mean(dim=0).reshape(self.grid)

    def distances(self, *, renormalize: bool = True) -> list[torch.Tensor]:
        """Mean attention distance in input pixels per layer and head: one [heads_l] per layer (the
        stages have different head counts). Each layer on its own stage's grid, a token there
        covering P 2^s pixels: MAD = mean_i sum_j A_ij d(i, j) over real tokens, each row
        renormalised to sum to 1 unless `renormalize=False`."""
        out = []
        for layer, (a, g) in enumerate(zip(self.attentions, self.geometries)):
            tokens = g.window_tokens(a.device)  # [windows, M²]
            coords = torch.stack([tokens // g.grid[1], tokens % g.grid[1]], dim=-1).to(a.dtype)
            d = torch.cdist(coords, coords) * self.stage_patch_size(layer)  # [windows, M², M²]
            kept = a * g.support(a.device).to(a.dtype)[:, None]  # [windows, heads, M², M²]
            per_query = (kept * d[:, None]).sum(dim=-1)  # [windows, heads, M²]
            if renormalize:
                per_query = per_query / kept.sum(dim=-1).clamp_min(torch.finfo(a.dtype).tiny)
            real = (tokens >= 0)[:, None, :].expand_as(per_query)
            out.append((per_query * real).sum(dim=(0, 2)) / (tokens >= 0).sum())
        return out

    def attention_received(self) -> list[torch.Tensor]:
        """The share of each layer's attention that each token receives, heads averaged: one [N_s]
        per layer, raster order of its stage's grid, mean_i A[i, j] over the real queries i of the
        stage (`vitviz.analysis.attention_received` of `global_attention`, heads averaged), summed
        window by window without the global matrix. A padded grid's rows give the padding a share,
        so a layer's shares then sum to less than 1."""
        out = []
        for a, g in zip(self.attentions, self.geometries):
            tokens = g.window_tokens(a.device)  # [windows, M²], -1 for padding
            real = tokens >= 0
            per_key = (a * real[:, None, :, None].to(a.dtype)).sum(dim=2).mean(dim=1)  # [windows, M²]: over real queries, heads averaged
            received = torch.zeros(g.grid[0] * g.grid[1], dtype=a.dtype, device=a.device)
            received.index_add_(0, tokens[real], per_key[real])
            out.append(received / real.sum())
        return out

    def attention_to(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """Each token's share of its layer's attention that goes to the tokens `keys` (bool [N_s], raster
        order of the stage's grid), heads averaged: [N_s], sum_j∈keys A[i, j] of `global_attention`'s
        rows, summed window by window without the global matrix."""
        a, g = self.attentions[layer], self.geometries[layer]
        if keys.shape != (g.grid[0] * g.grid[1],):
            raise ValueError(f"keys must be [{g.grid[0] * g.grid[1]}] for layer {layer}'s {g.grid} grid, got {list(keys.shape)}")
        tokens = g.window_tokens(a.device)  # [windows, M²], -1 for padding
        real = tokens >= 0
        on = keys.to(a.device)[tokens.clamp_min(0)] & real  # [windows, M²]: the keys of each window
        per_query = (a * on[:, None, None, :].to(a.dtype)).sum(dim=-1).mean(dim=1)  # [windows, M²]: each row's share, heads averaged
        share = torch.zeros(g.grid[0] * g.grid[1], dtype=a.dtype, device=a.device)
        share[tokens[real]] = per_query[real]
        return share

    def window_of(self, layer: int, row: int, col: int) -> torch.Tensor:
        """The cells of the layer's stage grid that the query at (row, col) of that grid attends to
        (its window, the shift undone, less what the mask separates): bool [gh_s, gw_s]."""
        g = self.geometries[layer]
        if not (0 <= row < g.grid[0] and 0 <= col < g.grid[1]):
            raise ValueError(f"({row}, {col}) is outside layer {layer}'s grid {g.grid}")
        return g.visible_from(row * g.grid[1] + col).reshape(g.grid)

    def logit_lens(self, *, logits: bool = False) -> torch.Tensor:
        """What the model would predict from its stream before the last stage's first block and after
        each of its blocks [L_last+1, C] (the final norm, the mean and the head applied there; the
        last row: `probabilities`): probabilities, or logits (`vitviz.inside.lens_of`). Earlier
        stages' tokens are narrower than the head's input: they have no lens."""
        from vitviz.inside import lens_of

        return lens_of(self.inside, logits=logits)

    def logit_attribution(self, target: int | str | None = None) -> Attribution:
        """The target logit (index or class name; default the prediction) split exactly into what
        entered the last stage, each of its heads, its MLPs and the biases (`vitviz.inside.attribution_of`)."""
        from vitviz.inside import attribution_of

        return attribution_of(self.inside, target)

    def relative_position_bias(self, layer: int) -> torch.Tensor:
        """The layer's relative position bias [heads, M², M²] (query place, key place in the window)."""
        return self.biases[layer]


def analyze_swin(model: Swin, image: ImageSource) -> SwinAnalysis:
    """Runs a Swin once on `image` (anything `vitviz.load_image` accepts), recording its window
    attention; the image is prepared by the spec's own preprocessing."""
    x, cropped = preprocess(load_image(image), _spec_of(model).preprocessing)
    return _analyze_input(model, x, cropped)


def analyze_swin_crop(model: Swin, cropped: Image.Image) -> SwinAnalysis:
    """`analyze_swin` for an image already cropped to the model's input (`SwinAnalysis.image`)."""
    return _analyze_input(model, to_input(cropped, _spec_of(model).preprocessing), cropped)


def _analyze_input(model: Swin, x: torch.Tensor, cropped: Image.Image) -> SwinAnalysis:
    spec = _spec_of(model)
    param = next(model.parameters())
    x = x.unsqueeze(0).to(device=param.device, dtype=param.dtype)
    norms: list[torch.Tensor] = []
    with torch.inference_mode():
        start = time.perf_counter()
        with record_attention(model, reduce=lambda a: a.float().cpu()) as rec, contextlib.ExitStack() as hooks, \
                record_swin_stream(model) as stream:
            for block in model.blocks:  # each block's output [B, gh, gw, C]: its tokens' norms
                hooks.callback(block.register_forward_hook(lambda _m, _i, out: norms.append(out[0].float().norm(dim=-1).flatten().cpu())).remove)
            tokens = model.encode(x)
            logits = model.head_logits(tokens) if spec.has_head else None
        if param.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        biases = [b.attn.relative_position_bias().float().cpu() for b in model.blocks]
    geometries = model.geometries(x.shape[2], x.shape[3])
    return SwinAnalysis(
        variant=spec.name,
        image=cropped,
        probabilities=logits[0].float().softmax(-1).cpu() if logits is not None else None,
        categories=spec.categories,
        attentions=list(rec.calls[-1]),
        geometries=geometries,
        stages=model.layer_stages,
        biases=biases,
        tokens=tokens[0].float().cpu(),
        token_norms=norms,
        inside=stream.stream,
        patch_size=model.config.patch_size,
        device=str(param.device),
        model_seconds=seconds,
        layout=TokenLayout(prefix_names=(), grids=model.stage_grids(x.shape[2], x.shape[3]), attention="windowed", pooled_query=True,
                           classifier=spec.has_head, position_embeddings=False, position_bias=True, stream=stream.stream is not None),
    )


# ---------------------------------------------------------------------------------------------
# The residual stream of the last stage, for the logit lens and direct logit attribution


class SwinStream:
    """What `record_swin_stream` kept: `streams` (one `vitviz.inside.Stream` per image) after the
    block, `stream` the first's; None for a model without a head."""

    def __init__(self, model: Swin | None = None) -> None:
        self._model, self.parts, self._streams = model, {}, None

    @property
    def streams(self) -> list[Stream] | None:
        if self._model is None:
            return None
        if self._streams is None:
            if len(self.parts.get("normed", ())) != len(self._model.stages[-1].blocks) + 1:
                raise RuntimeError("record_swin_stream captured no complete forward: run the model inside the `with` block")
            from vitviz.inside.stream import head_unembed, streams_of_parts

            model = self._model
            self._streams = streams_of_parts(
                self.parts, readout="normed mean", norm=model.norm, blocks=model.stages[-1].blocks, heads=model.config.num_heads[-1],
                unembed=head_unembed([model.head]), categories=model.spec.categories if model.spec is not None else None, unsplit=_unsplit(model),
                first_layer=len(model.blocks) - len(model.stages[-1].blocks))
        return self._streams

    @property
    def stream(self) -> Stream | None:
        streams = self.streams
        return None if streams is None else streams[0]


def _unsplit(model: Swin) -> str:
    """Why the logit does not split into the last stage's parts, or "": Swin V2's norm after each
    branch (res-post-norm), said as `vitviz.inside.stream.unsplit_why` says it of a ViT."""
    from vitviz.inside.stream import POST_NORM_UNSPLIT

    return POST_NORM_UNSPLIT if model.config.version == 2 else ""


@contextlib.contextmanager
def record_swin_stream(model: Swin) -> Iterator[SwinStream]:
    """Records, during the block, what the classifier reads of the stream through the last stage: a
    Swin's logits are head(mean over the final tokens of norm(x)) ("normed mean"), and only the last
    stage's tokens are as wide as the head's input. Kept: the stream entering the stage (after its
    merge) and after each of its blocks through the norm, the mean and the head (the lens); each
    block's heads' outputs before W_O, put back in raster order by the block's own windows
    (unpartitioned, unrolled, the padding cut), its MLP's output, and the final stream, a [B, N, D]
    copy each (the attribution). Nothing for a model without a head (`streams` None).

        with record_swin_stream(model) as rec:
            model(x)
        rec.stream.heads      # [L_last, H, 1, D]
    """
    if not model.config.num_classes:
        yield SwinStream()
        return
    rec = SwinStream(model)
    blocks = list(model.stages[-1].blocks)
    owner = threading.get_ident()
    split = not _unsplit(model)
    windows: dict[int, torch.Tensor] = {}

    def keep(x: torch.Tensor) -> torch.Tensor:  # [B, gh, gw, D] -> [B, N, D], a copy on the CPU
        return x.flatten(1, 2).detach().to("cpu", copy=True)

    def lens_input(x: torch.Tensor) -> torch.Tensor:  # [B, 1, D]: the head's input had the model stopped here
        return model.norm(x).flatten(1, 2).mean(dim=1, keepdim=True).detach().to("cpu", copy=True)

    def entering(module, args) -> None:
        if threading.get_ident() == owner:
            rec.parts = {"normed": [lens_input(args[0])], "attn": [None] * len(blocks), "mlp": [None] * len(blocks)}
            if split:
                rec.parts["embedding"] = keep(args[0])

    def heads_in(i: int):
        def hook(module, args) -> None:  # the heads' outputs [B * windows, M², D], before W_O
            if threading.get_ident() == owner and rec.parts:
                windows[i] = args[0]
        return hook

    def mlp_out(i: int):
        def hook(module, args, out) -> None:
            if threading.get_ident() == owner and rec.parts:
                rec.parts["mlp"][i] = keep(out)
        return hook

    def after(i: int):
        def hook(module, args, out) -> None:
            if threading.get_ident() != owner or not rec.parts:
                return
            rec.parts["normed"].append(lens_input(out))
            if split:
                g = module.geometry((out.shape[1], out.shape[2]))
                rec.parts["attn"][i] = keep(g.unroll(_unpartition(windows.pop(i), g.window, g.padded)))
                if i == len(blocks) - 1:
                    rec.parts["last"] = keep(out)
        return hook

    handles = [blocks[0].register_forward_pre_hook(entering)]
    try:
        for i, block in enumerate(blocks):
            if split:
                handles.append(block.attn.proj.register_forward_pre_hook(heads_in(i)))
                handles.append(block.mlp.register_forward_hook(mlp_out(i)))
            handles.append(block.register_forward_hook(after(i)))
        yield rec
    finally:
        for h in handles:
            h.remove()
        windows.clear()


# ---------------------------------------------------------------------------------------------
# Maps for a class: relevance, rollout, attention


def _target_index(target: int | str | None, categories: Sequence[str] | None, probabilities: torch.Tensor) -> int:
    """A class index from an index, a class name or None (the top-1)."""
    if categories is None:
        raise ValueError("this model has no classifier: there is no class to explain")
    if target is None:
        return int(probabilities.argmax())
    if isinstance(target, str):
        if target not in categories:
            raise ValueError(f"unknown class {target!r}; the model's classes are in model.spec.categories")
        return list(categories).index(target)
    if not 0 <= int(target) < len(categories):
        raise ValueError(f"class index {int(target)} is outside 0..{len(categories) - 1}")
    return int(target)


def swin_relevance_maps(
    model: Swin,
    x: torch.Tensor,
    *,
    methods: Sequence[str] = SWIN_METHODS,
    targets: Sequence[int | str | None] | torch.Tensor | None = None,
    text=None,
    head_fusion: HeadFusion = "mean",
    discard_ratio: float = 0.0,
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
    """Maps of several methods for a batch, from one forward (and one backward for gradient
    methods), as `vitviz.relevance_maps` returns them for a ViT.

    Args:
        x: preprocessed images [B, 3, S, S].
        methods: of `SWIN_METHODS`: "rollout" and "attention" (no target), "gradient" and
            "grad_rollout" (the target class's logit).
        targets: per sample a class index, a class name or None (top-1); None for all top-1.

    Returns:
        ({method: maps [B, gh0, gw0]}, targets [B] (None without a classifier), probabilities [B, C] or None).
    """
    if text is not None:
        raise ValueError("a Swin has no text tower: text= needs an image–text model; explain a class with target=")
    unknown = [m for m in methods if m not in SWIN_METHODS]
    if unknown:
        raise ValueError(f"{unknown[0]!r} cannot run on a Swin (windowed attention); it offers {', '.join(SWIN_METHODS)}")
    if discard_ratio:
        raise ValueError("discard_ratio is not defined for windowed attention (most of each row is outside the window); use 0")
    spec = _spec_of(model)
    gradients = any(m in ("gradient", "grad_rollout") for m in methods)
    if gradients and not spec.has_head:
        raise ValueError(f"{spec.name} has no classifier: gradient methods need a class logit; use 'attention' or 'rollout'")
    param = next(model.parameters())
    chosen = probs = None
    with contextlib.ExitStack() as modes:
        if gradients:  # autograd on, also when the caller is in inference mode; a fresh leaf, so frozen weights do not matter
            modes.enter_context(torch.inference_mode(False))
            modes.enter_context(torch.enable_grad())
            x = x.to(device=param.device, dtype=param.dtype).detach().clone().requires_grad_(True)
        else:
            modes.enter_context(torch.inference_mode())
            x = x.to(device=param.device, dtype=param.dtype)
        with record_attention(model, gradients=gradients) as rec:
            logits = model(x) if spec.has_head else None
            if logits is not None:
                probs = logits.detach().float().softmax(-1)
                wanted = [None] * x.shape[0] if targets is None else list(targets)
                if len(wanted) != x.shape[0]:
                    raise ValueError(f"{len(wanted)} targets for {x.shape[0]} images")
                chosen = torch.tensor([_target_index(t, spec.categories, probs[i]) for i, t in enumerate(wanted)], device=logits.device)
                if gradients:
                    logits.gather(1, chosen[:, None]).sum().backward()
        attn = [a.detach().float() for a in rec.calls[-1]]
        grads = [g.float() for g in rec.grad_calls[-1]] if gradients else None
    geometries, stages = model.geometries(x.shape[2], x.shape[3]), model.layer_stages
    grid = geometries[0].grid
    maps: dict[str, torch.Tensor] = {}
    for m in methods:
        if m == "attention":
            flat = swin_last_attention(attn, geometries, stages, head_fusion=head_fusion)
        else:
            if m == "rollout":
                r = swin_rollout(attn, geometries, stages, head_fusion=head_fusion)
            elif m == "gradient":
                r = swin_gradient_relevance(attn, grads, geometries, stages)
            else:
                r = swin_gradient_rollout(attn, grads, geometries, stages, head_fusion=head_fusion)
            flat = r.mean(dim=1)  # the pooled query: the mean of the final tokens' rows
        maps[m] = flat.reshape(-1, *grid).detach().float().cpu()
    return maps, (chosen.cpu() if chosen is not None else None), (probs.cpu() if probs is not None else None)


def swin_relevance(model: Swin, image_or_x: ImageSource | torch.Tensor, target: int | str | None = None) -> torch.Tensor:
    """Chefer et al.'s gradient relevance of the pooled query for `target` (default: the top-1
    class), through every layer and merge, on the finest grid [gh0, gw0].

    Args:
        image_or_x: an image (anything `vitviz.load_image` accepts; the spec's preprocessing is
            applied) or a preprocessed tensor [3, S, S] / [1, 3, S, S].
    """
    if isinstance(image_or_x, torch.Tensor):
        x = image_or_x if image_or_x.ndim == 4 else image_or_x.unsqueeze(0)
        if x.ndim != 4 or x.shape[0] != 1:
            raise ValueError(f"expected one preprocessed image [3, S, S] or [1, 3, S, S], got {list(image_or_x.shape)}")
    else:
        x = preprocess(load_image(image_or_x), _spec_of(model).preprocessing)[0].unsqueeze(0)
    maps, _, _ = swin_relevance_maps(model, x, methods=["gradient"], targets=[target])
    return maps["gradient"][0]


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def swin_summary_rows(model: Swin) -> list[list[str]]:
    """A Swin stage by stage as the Architecture tab lists it (stage, layer, output shape, parameters):
    the patch embedding, each stage's merge and blocks (heads, window, shift), the pooling and the head;
    parameters read from the modules, shapes from the config at the spec's image size."""
    c, spec = model.config, model.spec
    side = spec.image_size
    grids = c.stage_grids(spec.grid)
    geometries = c.geometries(spec.grid)
    rows = [["Input image", "", f"[B, 3, {side}, {side}]", "--"],
            ["Patch embedding", f"Conv2d {c.patch_size}x{c.patch_size}, stride {c.patch_size}, LayerNorm",
             f"[B, {grids[0][0]}, {grids[0][1]}, {c.embed_dim}]", f"{_count(model.patch_embed) + _count(model.patch_norm):,}"]]
    first = 0
    for s, stage in enumerate(model.stages):
        (gh, gw), dim = grids[s], c.dims[s]
        if stage.merge is not None:
            linear = f"Linear {4 * c.dims[s - 1]} -> {dim}"
            rows.append([f"Stage {s + 1}: patch merging", f"2x2 -> 1, {'LayerNorm, ' + linear if c.version == 1 else linear + ', LayerNorm'}",
                         f"[B, {gh}, {gw}, {dim}]", f"{_count(stage.merge):,}"])
        for i, block in enumerate(stage.blocks):
            g = geometries[first + i]
            where = f"shifted by {g.shift[0]}x{g.shift[1]}" if g.shifted else "not shifted"
            heads = f"{c.num_heads[s]} {'cosine ' if c.version == 2 else ''}heads"  # (Swin V2: scaled cosine attention)
            rows.append([f"  Stage {s + 1}, block {i + 1}", f"{heads}, windows {g.window[0]}x{g.window[1]} "
                         f"({g.num_windows}), {where}", f"[B, {gh}, {gw}, {dim}]", f"{_count(block):,}"])
        first += len(stage.blocks)
    rows.append(["Final LayerNorm, mean of the final tokens", "", f"[B, {c.dims[-1]}]", f"{_count(model.norm):,}"])
    if c.num_classes:
        rows.append(["Classification head", "Linear", f"[B, {c.num_classes}]", f"{_count(model.head):,}"])
    return rows


register_architecture(Swin, Architecture(attention="windowed", analyze=analyze_swin, analyze_crop=analyze_swin_crop,
                                         relevance_maps=swin_relevance_maps, methods=SWIN_METHODS, summary_rows=swin_summary_rows,
                                         patch_filters=lambda model: model.patch_embed.weight))
