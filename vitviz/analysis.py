"""Pure tensor functions that read a ViT's attention and embeddings.

- Attention rollout: Abnar & Zuidema, "Quantifying Attention Flow in Transformers" (ACL 2020),
  as used in Dosovitskiy et al. (ICLR 2021), Appendix D.8 and Figure 6.
- Mean attention distance: Dosovitskiy et al., Figure 7 (right) and Appendix D.7.
- Position-embedding similarity: Dosovitskiy et al., Figure 7 (centre).
- Principal components of the patch-embedding filters: Dosovitskiy et al., Figure 7 (left).

Shapes: L layers, B batch, H heads, N tokens = p + gh*gw with p prefix tokens, P patch size.
Functions that take an attention stack accept `[L, B, H, N, N]` or, for one image, `[L, H, N, N]`.

Queries: a map is one row of a token-by-token matrix (rollout, relevance, attention) over the patch
columns. The row is a token's (0 the cls token, 1 DeiT's distillation token), or "pool" (`POOL`) for
a model that classifies from the mean of its tokens after the prefix (timm's and vitviz's "avg"
pooling): that query's row is the mean of those tokens' rows, the patches' rows. A model that pools
with attention (SigLIP's probe, `ViTConfig.pool == "map"`) reads each token through the probe's
attention: its "pool" row is the token rows weighted by that attention (`pool_weights`).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

from vitviz import steps

__all__ = [
    "POOL",
    "Query",
    "fuse_heads",
    "attention_rollout",
    "rollout_fused",
    "cls_map",
    "pooled_row",
    "query_row",
    "with_pooled_query",
    "query_attention",
    "mean_attention_distance",
    "uniform_attention_distance",
    "patch_distances",
    "position_embedding_similarity",
    "embedding_filter_components",
    "pointing_game",
    "pointing_chance",
    "infer_grid",
    "attention_received",
]

HeadFusion = Literal["mean", "max", "min"]
POOL = "pool"
Query = int | Literal["pool"]  # a token index, or "pool": the mean of the patch tokens


def infer_grid(num_patches: int, grid: tuple[int, int] | None = None) -> tuple[int, int]:
    """The patch grid (gh, gw): `grid` if given (checked), else the square root of `num_patches`."""
    if grid is not None:
        if grid[0] * grid[1] != num_patches:
            raise ValueError(f"grid {tuple(grid)} has {grid[0] * grid[1]} patches, the tensor has {num_patches}")
        return int(grid[0]), int(grid[1])
    side = math.isqrt(num_patches)
    if side * side != num_patches:
        raise ValueError(f"{num_patches} patches do not form a square grid; pass grid=(gh, gw)")
    return side, side


def _as_batched(attn: torch.Tensor, name: str = "attn") -> tuple[torch.Tensor, bool]:
    """[L, B, H, N, N] or [L, H, N, N] -> ([L, B, H, N, N], was_unbatched)."""
    if attn.ndim == 4:
        attn = attn.unsqueeze(1)
        unbatched = True
    elif attn.ndim == 5:
        unbatched = False
    else:
        raise ValueError(f"{name} must be [L, B, H, N, N] or [L, H, N, N], got {list(attn.shape)}")
    if attn.shape[-1] != attn.shape[-2]:
        raise ValueError(f"{name} must be square in its last two dims, got {list(attn.shape)}")
    return attn, unbatched


def fuse_heads(attn: torch.Tensor, head_fusion: HeadFusion = "mean", *, dim: int = -3) -> torch.Tensor:
    """Mean, max or min over the heads dimension."""
    if head_fusion == "mean":
        return attn.mean(dim)
    if head_fusion == "max":
        return attn.amax(dim)
    if head_fusion == "min":
        return attn.amin(dim)
    raise ValueError(f"head_fusion must be 'mean', 'max' or 'min', got {head_fusion!r}")


def attention_rollout(
    attn: torch.Tensor,
    *,
    head_fusion: HeadFusion = "mean",
    discard_ratio: float = 0.0,
    num_prefix_tokens: int = 1,
) -> torch.Tensor:
    """Attention rollout R = Â_L ··· Â_1 with Â = rownorm(fuse(A) + I).

    Args:
        attn: attention stack [L, B, H, N, N] or [L, H, N, N], rows summing to 1.
        head_fusion: how heads are combined per layer.
        discard_ratio: in each row, the floor(r * (N - p)) smallest patch columns are set to 0
            before the identity is added; prefix columns are never discarded.
        num_prefix_tokens: p.

    Returns:
        R [B, N, N] (or [N, N]); rows sum to 1, and R[:, i, j] is how much token i at the output
        draws on input token j.
    """
    a, unbatched = _as_batched(attn)
    rollout = rollout_fused(fuse_heads(a, head_fusion, dim=2), discard_ratio=discard_ratio, num_prefix_tokens=num_prefix_tokens)
    return rollout[0] if unbatched else rollout


def rollout_fused(fused: torch.Tensor, *, discard_ratio: float = 0.0, num_prefix_tokens: int = 1) -> torch.Tensor:
    """Steps 2-4 of rollout on per-layer maps whose heads are already fused: [L, B, N, N] -> [B, N, N].

    Optionally zero the floor(r * (N - p)) smallest patch columns of each row, add the identity,
    renormalise each row and multiply R = Â_L ··· Â_1. Attention rollout feeds it fused attention;
    gradient rollout (`vitviz.relevance.gradient_rollout`) the fused gradient-weighted attention.
    """
    if fused.ndim != 4 or fused.shape[-1] != fused.shape[-2]:
        raise ValueError(f"fused must be [L, B, N, N], got {list(fused.shape)}")
    if not 0.0 <= discard_ratio < 1.0:
        raise ValueError(f"discard_ratio must be in [0, 1), got {discard_ratio}")
    n = fused.shape[-1]
    p = num_prefix_tokens
    drop = math.floor(discard_ratio * (n - p))
    if drop > 0:
        patch_cols = fused[..., p:]
        smallest = patch_cols.topk(drop, dim=-1, largest=False).indices
        fused = torch.cat([fused[..., :p], patch_cols.scatter(-1, smallest, 0.0)], dim=-1)
    eye = torch.eye(n, dtype=fused.dtype, device=fused.device)
    hat = fused + eye
    hat = hat / hat.sum(dim=-1, keepdim=True)
    rollout = eye.expand_as(hat[0]).clone()
    for layer in hat:  # R = Â_l @ R, first layer first
        rollout = layer @ rollout
        steps.step()
    return rollout


def pooled_row(matrix: torch.Tensor, *, num_prefix_tokens: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """The pooled query's row: the mean of the rows of the tokens an "avg" pooling averages, every
    token from p on (the patches; timm's `global_pool_nlc` without `reduce_include_prefix`); with
    `weights`, the rows weighted by them (attention pooling: the probe's attention over the tokens,
    which is what it reads each token with).

    Args:
        matrix: [..., N, N] (rollout, relevance, one layer's attention).
        num_prefix_tokens: p.
        weights: None, or a weight per token (row) [..., N] broadcastable against matrix's [..., N]
            (e.g. [N] for a stack of one image, [B, N] for a batch).

    Returns:
        [..., N]: over every key column, prefix included.
    """
    if matrix.ndim < 2 or matrix.shape[-1] != matrix.shape[-2]:
        raise ValueError(f"matrix must be [..., N, N], got {list(matrix.shape)}")
    if not 0 <= num_prefix_tokens < matrix.shape[-1]:
        raise ValueError(f"num_prefix_tokens {num_prefix_tokens} leaves no token to pool among {matrix.shape[-1]}")
    if weights is not None:
        if weights.shape[-1] != matrix.shape[-1]:
            raise ValueError(f"pooling weights over {weights.shape[-1]} tokens for a matrix of {matrix.shape[-1]}")
        if weights.ndim == 1:  # one weight per row, for one matrix or a stack: a row-by-matrix product a matrix
            n = matrix.shape[-1]  # at a time, never a temporary the size of the matrices (for a stack, the stack)
            flat, row = matrix.reshape(-1, n, n), weights.to(matrix.dtype).unsqueeze(0)
            out = torch.empty(flat.shape[0], n, dtype=matrix.dtype, device=matrix.device)
            for i, m in enumerate(flat):  # (into a buffer of its own: the product's bits do not depend on where `out` is)
                out[i] = torch.mm(row, m)[0]
            return out.reshape(matrix.shape[:-1])
        return (weights.to(matrix.dtype).unsqueeze(-1) * matrix).sum(dim=-2)
    return matrix[..., num_prefix_tokens:, :].mean(dim=-2)


def query_row(matrix: torch.Tensor, *, query: Query, num_prefix_tokens: int, pool_weights: torch.Tensor | None = None) -> torch.Tensor:
    """One query's row of a token-by-token matrix: [..., N, N] -> [..., N] (every key column).

    Args:
        query: a token index (0 is the first prefix token; patch (r, c) is p + r * gw + c) or "pool".
        pool_weights: the "pool" query's weight on each token's row (`pooled_row`), None for the mean.
    """
    if isinstance(query, str):
        if query != POOL:
            raise ValueError(f"a query is a token index or {POOL!r}, got {query!r}")
        return pooled_row(matrix, num_prefix_tokens=num_prefix_tokens, weights=pool_weights)
    n = matrix.shape[-1]
    if not 0 <= query < n:
        raise ValueError(f"query {query} is not a token (there are {n})")
    return matrix[..., query, :]


def with_pooled_query(matrix: torch.Tensor, *, num_prefix_tokens: int, pool_weights: torch.Tensor | None = None) -> torch.Tensor:
    """The rows of every query: the prefix tokens', the pooled query's, then the patches':
    [..., N, N] -> [..., N + 1, N] (the pooled row at index p)."""
    p = num_prefix_tokens
    pooled = pooled_row(matrix, num_prefix_tokens=p, weights=pool_weights).unsqueeze(-2)
    return torch.cat([matrix[..., :p, :], pooled, matrix[..., p:, :]], dim=-2)


def cls_map(
    rollout: torch.Tensor, *, grid: tuple[int, int] | None = None, num_prefix_tokens: int = 1, token: Query = 0,
    pool_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """A query's row of a rollout (or any token-by-token map) over the patches: [B, N, N] -> [B, gh, gw]
    (or [N, N] -> [gh, gw]).

    `token` 0 is the cls token; 1 is DeiT's distillation token; "pool" is the mean of the patch
    tokens' rows, the query of a model that classifies from their mean (with `pool_weights` [B, N]
    or [N], the rows weighted so: attention pooling's probe)."""
    if isinstance(token, str):
        row = query_row(rollout, query=token, num_prefix_tokens=num_prefix_tokens, pool_weights=pool_weights)[..., num_prefix_tokens:]
    else:
        if not 0 <= token < num_prefix_tokens:
            hint = f"; a model that pools its patch tokens has {POOL!r} as its query" if num_prefix_tokens == 0 else ""
            raise ValueError(f"token {token} is not a prefix token (there are {num_prefix_tokens}){hint}")
        row = rollout[..., token, num_prefix_tokens:]
    gh, gw = infer_grid(row.shape[-1], grid)
    return row.reshape(*row.shape[:-1], gh, gw)


def query_attention(
    attn: torch.Tensor,
    *,
    layer: int,
    query: Query,
    head: int | HeadFusion = "mean",
    grid: tuple[int, int] | None = None,
    num_prefix_tokens: int = 1,
    pool_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """What one query token attends to among the patches, at one layer.

    Args:
        attn: [L, H, N, N] for one image.
        layer: layer index.
        query: token index (0 is the cls token; patch (r, c) is p + r * gw + c), or "pool" (the
            mean of the patch tokens' rows).
        head: a head index, or "mean"/"max"/"min" over heads.
        pool_weights: the "pool" query's weight on each token's row [N] (attention pooling); None: the mean.

    Returns:
        [gh, gw] attention weights on the patch tokens.
    """
    if attn.ndim != 4:
        raise ValueError(f"attn must be [L, H, N, N] for one image, got {list(attn.shape)}")
    rows = query_row(attn[layer], query=query, num_prefix_tokens=num_prefix_tokens, pool_weights=pool_weights)[:, num_prefix_tokens:]  # [H, gh*gw]
    row = rows[head] if isinstance(head, int) else fuse_heads(rows, head, dim=0)
    gh, gw = infer_grid(row.shape[-1], grid)
    return row.reshape(gh, gw)


def attention_received(attn: torch.Tensor) -> torch.Tensor:
    """The share of attention each token receives, averaged over the queries: mean_i A[..., i, j].

    Rows of A sum to 1, so over the keys j these shares sum to 1 too: a distribution saying where a
    layer's attention goes. Prefix tokens (cls, distillation, registers) are where high-norm
    "artefact" tokens and registers show themselves (Darcet et al. 2024).

    Args:
        attn: [L, B, H, N, N] or [L, H, N, N] (or any [..., N, N]).

    Returns:
        [..., N]: the input's leading dims with the key dimension.
    """
    if attn.ndim < 2 or attn.shape[-1] != attn.shape[-2]:
        raise ValueError(f"attn must be [..., N, N], got {list(attn.shape)}")
    return attn.mean(dim=-2)


def patch_distances(grid: tuple[int, int], *, patch_size: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Euclidean distance in pixels between patch centres: [gh*gw, gh*gw], row-major patch order."""
    gh, gw = grid
    rr, cc = torch.meshgrid(torch.arange(gh, device=device, dtype=dtype), torch.arange(gw, device=device, dtype=dtype), indexing="ij")
    centres = torch.stack([rr.flatten(), cc.flatten()], dim=-1)  # [M, 2] in patch units
    return torch.cdist(centres, centres) * patch_size


def mean_attention_distance(
    attn: torch.Tensor,
    *,
    patch_size: int,
    num_prefix_tokens: int = 1,
    renormalize: bool = True,
    grid: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Mean attention distance in pixels per layer and head (the paper's Figure 7, right).

    MAD = mean_i sum_j A_ij * d(i, j) over patch queries i and patch keys j.

    Args:
        attn: [L, B, H, N, N] or [L, H, N, N].
        patch_size: P, pixels per patch side.
        renormalize: rescale each patch row of A[p:, p:] to sum to 1 (the paper's weighted
            average); False reproduces probing-vits, which leaves out the prefix mass.
        grid: (gh, gw), inferred when the patches form a square.

    Returns:
        [L, B, H] (or [L, H]) distances in pixels.
    """
    a, unbatched = _as_batched(attn)
    p = num_prefix_tokens
    patches = a[..., p:, p:]
    grid = infer_grid(patches.shape[-1], grid)
    d = patch_distances(grid, patch_size=patch_size, device=a.device, dtype=a.dtype)
    # [L, B, H, M]: sum_j A_ij d_ij, a layer at a time (a product of the whole stack would copy it); as a
    # contraction, not a product then a sum: 2.4x faster for a ViT-B/16 layer of 32 images on CPU
    per_query = torch.stack([torch.einsum("bhij,ij->bhi", layer, d) for layer in patches])
    if renormalize:  # divide by each row's patch mass instead of building the renormalised matrix
        per_query = per_query / patches.sum(dim=-1).clamp_min(torch.finfo(patches.dtype).tiny)
    mad = per_query.mean(dim=-1)  # [L, B, H]
    return mad[:, 0] if unbatched else mad


def uniform_attention_distance(grid: tuple[int, int], *, patch_size: int) -> float:
    """The distance uniform attention over all patches gives: the reference line of Figure 7."""
    return patch_distances(grid, patch_size=patch_size, dtype=torch.float64).mean().item()


def position_embedding_similarity(
    pos_embed: torch.Tensor, *, grid: tuple[int, int] | None = None, num_prefix_tokens: int = 1
) -> torch.Tensor:
    """Cosine similarity of the patch tokens' position embeddings: [N, D] or [1, N, D] -> [gh, gw, gh, gw].

    S[a, b, c, d] = cos(E[a, b], E[c, d]); tile (a, b) of the paper's figure is S[a, b].
    """
    if pos_embed.ndim == 3 and pos_embed.shape[0] == 1:
        pos_embed = pos_embed[0]
    if pos_embed.ndim != 2:
        raise ValueError(f"pos_embed must be [N, D] or [1, N, D], got {list(pos_embed.shape)}")
    e = F.normalize(pos_embed[num_prefix_tokens:].float(), dim=-1)
    gh, gw = infer_grid(e.shape[0], grid)
    return (e @ e.T).reshape(gh, gw, gh, gw)


def embedding_filter_components(weight: torch.Tensor, *, k: int = 28) -> tuple[torch.Tensor, torch.Tensor]:
    """Principal components of the patch-embedding filters (the paper's Figure 7, left).

    Args:
        weight: the patch-embedding Conv2d weight [D, 3, P, P]: D filters of 3 x P x P.
        k: number of components.

    Returns:
        components [k, 3, P, P] (unit norm, sign fixed so that the largest entry is positive) and
        the fraction of variance each explains [k].

    Raises:
        ValueError: the filters do not read the 3 channels of an image (a hybrid's patch embedding
            reads its convolutional stem's feature map: there are no filters over pixels to show).
    """
    if weight.ndim != 4:
        raise ValueError(f"weight must be [D, C, P, P], got {list(weight.shape)}")
    if weight.shape[1] != 3:
        raise ValueError(f"these filters read {weight.shape[1]} channels, not an image's 3 (RGB): a hybrid's patch embedding "
                         "reads its convolutional stem's feature map, and has no filters over pixels to show")
    d = weight.shape[0]
    x = weight.detach().reshape(d, -1).double()
    x = x - x.mean(dim=0, keepdim=True)
    _, s, vh = torch.linalg.svd(x, full_matrices=False)
    k = min(k, vh.shape[0])
    comps = vh[:k]
    flip = torch.sign(comps.gather(1, comps.abs().argmax(dim=1, keepdim=True)))
    comps = comps * flip
    var = s**2
    explained = var[:k] / var.sum()
    return comps.reshape(k, *weight.shape[1:]).float(), explained.float()


def pointing_game(
    maps: torch.Tensor, masks: torch.Tensor, *, patch_size: int, dilate_patches: int = 1
) -> torch.Tensor:
    """Does each map's argmax fall on the object?

    The object mask is dilated by `dilate_patches` patches (a square structuring element of
    2 * dilate_patches * P + 1 pixels), then the argmax patch's centre pixel is looked up in it.

    Args:
        maps: [B, gh, gw] saliency, e.g. cls rollout maps.
        masks: [B, S, S] boolean object masks in the model's input pixels.

    Returns:
        hits bool [B].
    """
    if maps.ndim != 3 or masks.ndim != 3 or maps.shape[0] != masks.shape[0]:
        raise ValueError(f"expected maps [B, gh, gw] and masks [B, S, S], got {list(maps.shape)} and {list(masks.shape)}")
    b, gh, gw = maps.shape
    radius = dilate_patches * patch_size
    dilated = F.max_pool2d(masks.float().unsqueeze(1), kernel_size=2 * radius + 1, stride=1, padding=radius)[:, 0] > 0
    flat = maps.reshape(b, -1).argmax(dim=-1)
    rows = (flat // gw) * patch_size + patch_size // 2
    cols = (flat % gw) * patch_size + patch_size // 2
    return dilated[torch.arange(b), rows, cols]


def pointing_chance(masks: torch.Tensor, *, patch_size: int, dilate_patches: int = 1) -> torch.Tensor:
    """A uniformly drawn patch's chance of a `pointing_game` hit, per mask [B, S, S] -> [B]: the share of
    the patches whose centre pixel lies in the mask dilated as `pointing_game` dilates it (the pointing
    game's expected score for a random map)."""
    radius = dilate_patches * patch_size
    dilated = F.max_pool2d(masks.float().unsqueeze(1), kernel_size=2 * radius + 1, stride=1, padding=radius)[:, 0] > 0
    centre = patch_size // 2
    return dilated[:, centre::patch_size, centre::patch_size].float().mean(dim=(1, 2))
