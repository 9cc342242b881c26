"""A Swin's attention made global, exactly, so that rollout and relevance run through the whole
network onto the input's patch grid (`vitviz.swin_analysis` analyses one image with them).

A layer's window attention is a sparse patch-to-patch matrix of its stage: `window_to_global` places
each entry at (query, key) in raster order of the stage's grid, the shift undone; pairs in different
windows and pairs the mask separates are exactly 0. Patch merging is the fixed linear map
`merge_map(grid)` [N_{s+1}, N_s]: each merged token draws equally on its 2 x 2 children (1/4 each; at
the border of an odd grid, equally on those that exist). Through them:

- attention rollout (Abnar & Zuidema 2020): per layer Â = rownorm(fuse_h(A) + I), between stages the
  merge map, R = Â_L ··· M_1 ··· Â_1 [N_last, N_0];
- Chefer et al. 2021's generic rule: R = I, per layer R <- R + mean_h (G ⊙ A)⁺ R, between stages
  R <- M R, with G the gradient of the target logit with respect to the layer's attention (the
  gradient of the global matrix on its support is the gradient of the window entry placed there);
- the pooled classifier's query (no cls token) is the mean of the final tokens: its row of any such
  matrix is the mean of their rows, a map over the finest grid [gh0, gw0].

The products are taken without building a dense N x N matrix per layer (each layer acts window by
window, `SLICE_ELEMENTS` of the columns at a time); tests hold them to the dense products of
`window_to_global` and `merge_map`.

Padding (`vitviz.swin`): global attention is over the real tokens: without padding each row sums to 1;
with padding a row sums to 1 minus what its query gives the padding (rollout renormalises its rows,
so its rows still sum to 1).
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch

from vitviz import steps
from vitviz.analysis import HeadFusion, fuse_heads
from vitviz.swin import WindowGeometry

__all__ = ["SLICE_ELEMENTS", "merge_map", "swin_gradient_relevance", "swin_gradient_rollout", "swin_last_attention", "swin_rollout",
           "window_to_global"]


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
