"""A Swin's attention made global, exactly, so that rollout and relevance run through the whole
network onto the input's patch grid, and the analysis of one image (`analyze_swin` -> `SwinAnalysis`);
`vitviz.analyze` and `vitviz.explain` (with "rollout", "attention", "gradient", "grad_rollout") hand a
Swin (`vitviz.swin`) to it.

Attention made global. A layer's window attention is a sparse patch-to-patch matrix of its stage:
`window_to_global` places each entry at (query, key) in raster order of the stage's grid, the shift
undone; pairs in different windows and pairs the mask separates are exactly 0. Patch merging is the
fixed linear map `merge_map(grid)` [N_{s+1}, N_s]: each merged token draws equally on its 2 x 2
children (1/4 each; at the border of an odd grid, equally on those that exist). Through them:

- attention rollout (Abnar & Zuidema 2020): per layer Â = rownorm(fuse_h(A) + I), between stages the
  merge map, R = Â_L ··· M_1 ··· Â_1 [N_last, N_0];
- Chefer et al. 2021's generic rule: R = I, per layer R <- R + mean_h (G ⊙ A)⁺ R, between stages
  R <- M R, with G the gradient of the target logit with respect to the layer's attention (the
  gradient of the global matrix on its support is the gradient of the window entry placed there);
- the pooled classifier's query (no cls token) is the mean of the final tokens: its row of any such
  matrix is the mean of their rows, a map over the finest grid [gh0, gw0].

The products are taken without building a dense N x N matrix per layer (each layer acts window by
window); tests hold them to the dense products of `window_to_global` and `merge_map`.

Padding (`vitviz.swin`): global attention is over the real tokens: without padding each row sums to 1; with padding a row sums to 1
minus what its query gives the padding (rollout renormalises its rows, so its rows still sum to 1).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch
from PIL import Image

from vitviz import steps
from vitviz.analysis import POOL, HeadFusion, fuse_heads
from vitviz.config import VariantSpec
from vitviz.hooks import record_attention
from vitviz.images import ImageSource, load_image
from vitviz.layout import Architecture, TokenLayout, register_architecture
from vitviz.preprocess import preprocess, to_input
from vitviz.swin import Swin, WindowGeometry

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
]

# the explanation methods a Swin answers (`vitviz.explain`, `vitviz.relevance_maps`)
SWIN_METHODS: tuple[str, ...] = ("attention", "rollout", "gradient", "grad_rollout")


# ---------------------------------------------------------------------------------------------
# Attention made global, and the products through the whole network


def window_to_global(attn: torch.Tensor, geometry: WindowGeometry) -> torch.Tensor:
    """A layer's window attention as its stage's patch-to-patch matrix.

    Args:
        attn: the layer's softmax output [B * windows, heads, M², M²] (windows in raster order of the
            rolled, padded grid, batch first), as `WindowAttention.attend` returns it.
        geometry: the layer's `WindowGeometry`.

    Returns:
        [B, heads, N, N], queries and keys in raster order of the stage's grid (N = gh * gw): entry
        (i, j) is the window entry of the two tokens when they share a window and a region of the
        mask, else exactly 0. Differentiable (a gather).
    """
    w, m = geometry.num_windows, geometry.area
    if attn.ndim != 4 or attn.shape[-2:] != (m, m) or attn.shape[0] % w:
        raise ValueError(f"attn must be [B * {w} windows, heads, {m}, {m}] for this layer, got {list(attn.shape)}")
    a = attn.reshape(attn.shape[0] // w, w, attn.shape[1], m, m)
    window, place = geometry.placement(attn.device)
    # a[b, window(i), h, place(i), place(j)]: the advanced indices [N, N] come first -> [N, N, B, heads]
    full = a[:, window[:, None], :, place[:, None], place[None, :]].permute(2, 3, 0, 1)
    return full * geometry.visible(attn.device).to(full.dtype)


def merge_map(grid: tuple[int, int], *, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Patch merging as a linear map of token mixtures: [N_{s+1}, N_s] for a stage grid (gh, gw).

    Merged token t = (r, c) of the grid (ceil(gh/2), ceil(gw/2)) draws equally on its children
    (2r + dr, 2c + dc), dr, dc in {0, 1}, that exist: 1/4 each inside the grid (rows sum to 1)."""
    gh, gw = grid
    ph, pw = (gh + 1) // 2, (gw + 1) // 2
    rows, cols = torch.meshgrid(torch.arange(gh, device=device), torch.arange(gw, device=device), indexing="ij")
    parent = ((rows // 2) * pw + cols // 2).flatten()  # [N_s]
    m = torch.zeros(ph * pw, gh * gw, dtype=dtype, device=device)
    m[parent, torch.arange(gh * gw, device=device)] = 1.0
    return m / m.sum(dim=1, keepdim=True)


def _merge_right(q: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """q [B, N_{s+1}, R] -> merge_map(grid)^T @ q [B, N_s, R], without the matrix: each child's row
    is its parent's, divided by the parent's children."""
    gh, gw = grid
    pw = (gw + 1) // 2
    rows, cols = torch.meshgrid(torch.arange(gh, device=q.device), torch.arange(gw, device=q.device), indexing="ij")
    parent = ((rows // 2) * pw + cols // 2).flatten()
    children = torch.bincount(parent, minlength=q.shape[1]).to(q.dtype)
    return (q / children[:, None]).index_select(1, parent)


def _window_right(q: torch.Tensor, kernel: torch.Tensor, geometry: WindowGeometry) -> torch.Tensor:
    """K^T @ q [B, N, R] for K [B, N, N] given window by window [B, windows, M², M²] and zero outside
    the support (`WindowGeometry.support`): the product without the N x N matrix. Tokens go to their
    places in their windows as whole rows (one index copy), each window's block is one batched
    matrix product, and the rows come back the same way."""
    b, _, r = q.shape
    window, place = geometry.placement(q.device)
    slot = window * geometry.area + place  # each token's row among the windows' places
    spread = q.new_zeros(b, geometry.num_windows * geometry.area, r)
    spread.index_copy_(1, slot, q)
    out = kernel.transpose(-1, -2) @ spread.view(b, geometry.num_windows, geometry.area, r)  # [B, windows, M², R]
    return out.view(b, -1, r).index_select(1, slot)


def _layer_kernels(attentions: Sequence[torch.Tensor], geometries: Sequence[WindowGeometry]) -> list[torch.Tensor]:
    """Each layer's [B * windows, ...] -> [B, windows, ...], checked against its geometry."""
    if len(attentions) != len(geometries):
        raise ValueError(f"{len(attentions)} layers of attention for {len(geometries)} geometries")
    out = []
    for l, (a, g) in enumerate(zip(attentions, geometries)):
        if a.ndim != 4 or a.shape[-1] != g.area or a.shape[0] % g.num_windows:
            raise ValueError(f"layer {l}: expected [B * {g.num_windows}, heads, {g.area}, {g.area}], got {list(a.shape)}")
        out.append(a.reshape(a.shape[0] // g.num_windows, g.num_windows, *a.shape[1:]))
    return out


SLICE_ELEMENTS = 2**22  # a slice of Q's columns holds about this many elements on the finest grid


def _through_network(
    kernels: Sequence[torch.Tensor], geometries: Sequence[WindowGeometry], stages: Sequence[int], *, rule: Literal["rollout", "add"]
) -> torch.Tensor:
    """The product of every layer's matrix and the merges between stages, onto the finest grid.

    Layer l's matrix is B_l = rownorm(K_l + I) ("rollout") or I + K_l ("add"), K_l given window by
    window [B, windows, M², M²] (fused over heads, support only). Returns
    R = B_L ··· M ··· B_1 [B, N_last, N_0], taken from the last layer down and held transposed,
    Q = R^T (Q <- B_l^T Q, Q <- M_s^T Q), so that only [B, N_s, columns] is ever held and every
    step moves whole rows. Q's columns are independent: they go through the layers a slice at a
    time (`SLICE_ELEMENTS` on the finest grid), a step (`vitviz.steps`) after each layer of each."""
    if not (len(kernels) == len(geometries) == len(stages)):
        raise ValueError("one kernel, geometry and stage per layer")
    batch = kernels[0].shape[0]
    n_last, n_first = geometries[-1].num_tokens, geometries[0].num_tokens
    layers = []  # each layer's support-masked kernel, and its rows' sums + 1 for the rollout rule
    for k, g in zip(kernels, geometries):
        k = k * g.support(k.device).to(k.dtype)
        window, place = g.placement(k.device)
        layers.append((k, k.sum(dim=-1)[:, window, place] + 1.0 if rule == "rollout" else None))
    out = torch.empty(batch, n_last, n_first, dtype=kernels[0].dtype, device=kernels[0].device)
    width = max(1, SLICE_ELEMENTS // max(1, n_first))
    for start in range(0, n_last, width):
        cols = min(width, n_last - start)
        q = torch.zeros(batch, n_last, cols, dtype=out.dtype, device=out.device)
        q[:, start:start + cols].copy_(torch.eye(cols, dtype=out.dtype, device=out.device).expand(batch, cols, cols))
        for l in range(len(kernels) - 1, -1, -1):
            (k, rows), g = layers[l], geometries[l]
            if rule == "rollout":
                scaled = q / rows[:, :, None]
                q = _window_right(scaled, k, g) + scaled
            else:
                q = q + _window_right(q, k, g)
            if l > 0 and stages[l - 1] != stages[l]:
                q = _merge_right(q, geometries[l - 1].grid)
            steps.step()
        out[:, start:start + cols] = q.transpose(1, 2)
    return out


def swin_rollout(
    attentions: Sequence[torch.Tensor], geometries: Sequence[WindowGeometry], stages: Sequence[int], *, head_fusion: HeadFusion = "mean"
) -> torch.Tensor:
    """Attention rollout through a Swin: R [B, N_last, N_0] (rows sum to 1).

    Per layer Â = rownorm(fuse_h(A) + I) on its stage's grid (A the global attention), between
    stages the merge map; R = Â_L ··· M_1 ··· Â_1. The pooled query's map is the mean of R's rows.

    Args:
        attentions: each layer's window attention [B * windows, heads, M², M²].
        geometries: each layer's `WindowGeometry`; stages: each layer's stage index.
    """
    fused = [fuse_heads(a, head_fusion, dim=2) for a in _layer_kernels(attentions, geometries)]
    return _through_network(fused, geometries, stages, rule="rollout")


def swin_gradient_relevance(
    attentions: Sequence[torch.Tensor], gradients: Sequence[torch.Tensor], geometries: Sequence[WindowGeometry], stages: Sequence[int]
) -> torch.Tensor:
    """Chefer et al. 2021's generic rule through a Swin: R [B, N_last, N_0]. R = I; per layer, first
    first, R <- R + mean_h (G ⊙ A)⁺ R on the layer's stage grid; between stages R <- M R.

    Args:
        gradients: layer l's entry is d(target) / d(layer l's window attention), the same shape.
    """
    a, g = _layer_kernels(attentions, geometries), _layer_kernels(gradients, geometries)
    cams = [(gl * al).clamp(min=0).mean(dim=2) for al, gl in zip(a, g)]
    return _through_network(cams, geometries, stages, rule="add")


def swin_gradient_rollout(
    attentions: Sequence[torch.Tensor], gradients: Sequence[torch.Tensor], geometries: Sequence[WindowGeometry], stages: Sequence[int],
    *, head_fusion: HeadFusion = "mean",
) -> torch.Tensor:
    """Gradient rollout through a Swin: A'_l = fuse_h(G_l ⊙ A_l)⁺, then rolled out as `swin_rollout`."""
    a, g = _layer_kernels(attentions, geometries), _layer_kernels(gradients, geometries)
    fused = [fuse_heads(gl * al, head_fusion, dim=2).clamp(min=0) for al, gl in zip(a, g)]
    return _through_network(fused, geometries, stages, rule="rollout")


def swin_last_attention(
    attentions: Sequence[torch.Tensor], geometries: Sequence[WindowGeometry], stages: Sequence[int], *, head_fusion: HeadFusion = "mean"
) -> torch.Tensor:
    """The last layer's attention of the pooled query (the mean of the final tokens' rows, heads
    fused), carried onto the finest grid by the merges (each key's weight shared equally among the
    patches it merged): [B, N_0]."""
    k = fuse_heads(_layer_kernels(attentions[-1:], geometries[-1:])[0], head_fusion, dim=2)
    g = geometries[-1]
    k = k * g.support(k.device).to(k.dtype)
    q = torch.full((k.shape[0], g.num_tokens, 1), 1.0 / g.num_tokens, dtype=k.dtype, device=k.device)  # the row, held as a column
    q = _window_right(q, k, g)
    for l in range(len(geometries) - 1, 0, -1):
        if stages[l - 1] != stages[l]:
            q = _merge_right(q, geometries[l - 1].grid)
    return q[:, :, 0]


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
        biases: each layer's relative position bias [heads_l, M², M²] (added to the logits).
        tokens: the final tokens after the final norm [N_last, D].
        token_norms: the L2 norm of every token after each block, before the final norm: one [N_s]
            per layer, raster order of its stage's grid (where high-norm tokens appear).
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

    def __post_init__(self) -> None:
        if self.layout is None:
            self.layout = TokenLayout(prefix_names=(), grids=self.stage_grids, attention="windowed", pooled_query=True,
                                      classifier=self.probabilities is not None, position_embeddings=False, position_bias=True)

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

    def window_of(self, layer: int, row: int, col: int) -> torch.Tensor:
        """The cells of the layer's stage grid that the query at (row, col) of that grid attends to
        (its window, the shift undone, less what the mask separates): bool [gh_s, gw_s]."""
        g = self.geometries[layer]
        if not (0 <= row < g.grid[0] and 0 <= col < g.grid[1]):
            raise ValueError(f"({row}, {col}) is outside layer {layer}'s grid {g.grid}")
        return g.visible_from(row * g.grid[1] + col).reshape(g.grid)

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
        with record_attention(model, reduce=lambda a: a.float().cpu()) as rec, contextlib.ExitStack() as hooks:
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
        patch_size=model.config.patch_size,
        device=str(param.device),
        model_seconds=seconds,
        layout=TokenLayout(prefix_names=(), grids=model.stage_grids(x.shape[2], x.shape[3]), attention="windowed", pooled_query=True,
                           classifier=spec.has_head, position_embeddings=False, position_bias=True),
    )


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
            rows.append([f"Stage {s + 1}: patch merging", f"2x2 -> 1, LayerNorm, Linear {4 * c.dims[s - 1]} -> {dim}",
                         f"[B, {gh}, {gw}, {dim}]", f"{_count(stage.merge):,}"])
        for i, block in enumerate(stage.blocks):
            g = geometries[first + i]
            where = f"shifted by {g.shift[0]}x{g.shift[1]}" if g.shifted else "not shifted"
            rows.append([f"  Stage {s + 1}, block {i + 1}", f"{c.num_heads[s]} heads, windows {g.window[0]}x{g.window[1]} "
                         f"({g.num_windows}), {where}", f"[B, {gh}, {gw}, {dim}]", f"{_count(block):,}"])
        first += len(stage.blocks)
    rows.append(["Final LayerNorm, mean of the final tokens", "", f"[B, {c.dims[-1]}]", f"{_count(model.norm):,}"])
    if c.num_classes:
        rows.append(["Classification head", "Linear", f"[B, {c.num_classes}]", f"{_count(model.head):,}"])
    return rows


register_architecture(Swin, Architecture(attention="windowed", analyze=analyze_swin, analyze_crop=analyze_swin_crop,
                                         relevance_maps=swin_relevance_maps, methods=SWIN_METHODS, summary_rows=swin_summary_rows,
                                         patch_filters=lambda model: model.patch_embed.weight))
