"""Positions as offsets: how a model's attention depends on where a key lies relative to its query.

Two tables over the offsets (dy, dx) = (key row − query row, key column − query column), entry
[gh − 1 + dy, gw − 1 + dx] (the centre is the query itself):

- `rotary_offsets(model)`: what a rotary model's position embedding does on its own. Rotating a
  query q at patch m and a key k at patch n turns their product into

      q_m · k_n = Σ_j |q_j| |k_j| cos(φ_j + θ_j(m) − θ_j(n))

  over the channel pairs j, φ_j the angle between the pair's halves of q and k. For a query and a
  key that are equal and spread evenly over the pairs (φ_j = 0, |q_j| |k_j| = 1 / P) the product is
  the mean of cos(θ_j(m) − θ_j(n)) over the P = d/2 pairs: 1 at offset 0, lower where some
  frequencies have turned the pairs apart. With rotary angles linear in the coordinates this depends
  on the offset only (`vitviz.model.Rotary`), per head (the same for every head and layer unless
  the frequencies are learned per head, "mixed").
- `attention_by_offset(attn, grid)`: what any model's attention did with an image: for each layer
  and head, the attention a patch query gives the patch key at each offset, averaged over the
  queries that have a key there (a learned, relative or rotary position scheme compared on one
  footing). Prefix tokens are left out; the table's entries do not sum to 1 (each offset's is a
  mean over its own queries).
"""

from __future__ import annotations

import torch

from vitviz.model import ViT, relative_index

__all__ = ["rotary_offsets", "attention_by_offset", "offset_index"]


def offset_index(grid: tuple[int, int], *, device=None) -> torch.Tensor:
    """For each (query patch, key patch) of `grid`, row by row, the flat index of their offset
    (key − query, from the centre) in a [2gh − 1, 2gw − 1] table: [gh*gw, gh*gw]. BEiT's index
    (`vitviz.model.relative_index`, query − key) read backwards: the table flipped on both axes."""
    gh, gw = grid
    return ((2 * gh - 1) * (2 * gw - 1) - 1 - relative_index(grid, 0)).to(device)


def rotary_offsets(model: ViT, grid: tuple[int, int] | None = None) -> torch.Tensor:
    """The mean over a head's channel pairs of cos(θ_j(query) − θ_j(key)) for every offset of
    `grid` (default the trained one): [L, H, 2gh − 1, 2gw − 1] (one row of L identical layers and H
    identical heads unless the model learned its frequencies per layer and head). Raises for a model
    without rotary positions."""
    rotary = getattr(model, "rotary", None)
    if rotary is None:
        raise ValueError(f"{getattr(model.spec, 'name', 'this model')} has no rotary position embeddings")
    c = model.config
    gh, gw = grid or c.grid
    with torch.no_grad():
        yx = rotary.coordinates((gh, gw))  # [gh*gw, 2]: linear in the patch's row and column
        step_y = (yx[gw, 0] - yx[0, 0]) if gh > 1 else yx.new_tensor(0.0)
        step_x = (yx[1, 1] - yx[0, 1]) if gw > 1 else yx.new_tensor(0.0)
        dy = torch.arange(-(gh - 1), gh, dtype=torch.float32, device=yx.device) * step_y
        dx = torch.arange(-(gw - 1), gw, dtype=torch.float32, device=yx.device) * step_x
        f = rotary.frequencies()  # [2, P] or [L, H, 2, P]
        if f.ndim == 2:
            f = f.expand(c.depth, c.heads, 2, f.shape[-1])
        theta = dy[:, None, None] * f[..., 0, None, None, :] + dx[None, :, None] * f[..., 1, None, None, :]  # [L, H, Y, X, P]
        return theta.cos().mean(dim=-1).cpu()


def attention_by_offset(attn: torch.Tensor, grid: tuple[int, int], *, num_prefix_tokens: int = 1) -> torch.Tensor:
    """The attention patch queries give the patch key at each offset, averaged over the queries with
    a key there: [L, H, N, N] (or [H, N, N]) -> [L, H, 2gh − 1, 2gw − 1] (or [H, ...]), float32."""
    if attn.ndim not in (3, 4):
        raise ValueError(f"attn must be [L, H, N, N] or [H, N, N], got {list(attn.shape)}")
    gh, gw = grid
    p = num_prefix_tokens
    if attn.shape[-1] != p + gh * gw:
        raise ValueError(f"attn has {attn.shape[-1]} tokens; {p} prefix tokens and a {gh}x{gw} grid make {p + gh * gw}")
    patches = attn[..., p:, p:].float().flatten(-2)  # [..., Q*K]
    index = offset_index(grid, device=attn.device).flatten()
    cells = (2 * gh - 1) * (2 * gw - 1)
    sums = patches.new_zeros(patches.shape[:-1] + (cells,)).index_add_(-1, index, patches)
    counts = torch.bincount(index, minlength=cells).to(patches.dtype)  # queries with a key at each offset
    return (sums / counts).unflatten(-1, (2 * gh - 1, 2 * gw - 1)).cpu()
