"""Explanations beyond rollout, as pure functions of recorded tensors.

- Gradient relevance: Chefer, Gur & Wolf, "Generic Attention-model Explainability for Interpreting
  Bi-Modal and Encoder-Decoder Transformers" (ICCV 2021), the rule for self-attention: with A_l a
  block's softmax output and G_l = dy_c/dA_l the gradient of the target logit with respect to that
  same A_l, R = I and, for l = 1..L in forward order, R <- R + mean_h (G_l ⊙ A_l)⁺ R. No row
  normalisation. The map is R[cls, patches]; for a model that classifies from the mean of its patch
  tokens (no cls token), the mean of the patch tokens' rows, R[patches, patches] averaged over rows.
- Gradient rollout (the idea of vit-explain's `grad_rollout`, with its bugs fixed: each layer's
  attention with the same layer's gradient, and the gradient of A itself, not of the logits before
  the softmax): A'_l = fuse_h(G_l ⊙ A_l) with negatives set to 0, then rolled out as attention
  rollout is (identity, row normalisation, product).
- DINO's head maps: Caron et al., "Emerging Properties in Self-Supervised Vision Transformers"
  (ICCV 2021), `visualize_attention.py`: the last block's cls attention per head, and the patches
  that keep a share t of each head's mass.
- Patch features: the principal components of the last layer's patch tokens as RGB (Oquab et al.,
  DINOv2, 2023) and the cosine similarity of one patch's feature to every other.

Shapes: L layers, B batch, H heads, N tokens = p + gh*gw, D width. Stacks are [L, B, H, N, N] or, for
one image, [L, H, N, N].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from vitviz import steps
from vitviz.analysis import HeadFusion, Query, _as_batched, fuse_heads, infer_grid, query_row, rollout_fused

__all__ = [
    "gradient_relevance",
    "relevance_layer",
    "relevance_from_layers",
    "gradient_rollout",
    "gradient_rollout_layer",
    "last_layer_attention",
    "dino_head_maps",
    "keep_mass",
    "feature_components",
    "feature_similarity",
]


def _paired(attn: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    a, unbatched = _as_batched(attn)
    g, _ = _as_batched(grads, "grads")
    if a.shape != g.shape:
        raise ValueError(f"attention {list(a.shape)} and gradients {list(g.shape)} must have the same shape")
    return a, g, unbatched


def relevance_layer(attn_l: torch.Tensor, grad_l: torch.Tensor) -> torch.Tensor:
    """One layer's term of Chefer et al.'s rule: mean_h (G_l ⊙ A_l)⁺, [B, H, N, N] -> [B, N, N]."""
    return grad_l.mul(attn_l).clamp_(min=0).mean(dim=-3)


def relevance_from_layers(terms: Sequence[torch.Tensor]) -> torch.Tensor:
    """Chefer et al.'s R from each layer's term (`relevance_layer`), first layer first: R = I;
    R <- R + term_l R. [B, N, N] each -> [B, N, N]."""
    first = terms[0]
    n = first.shape[-1]
    r = torch.eye(n, dtype=first.dtype, device=first.device).expand(*first.shape[:-2], n, n).clone()
    for term in terms:
        r = r + term @ r
        steps.step()
    return r


def gradient_relevance(attn: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """Chefer et al. 2021's relevance R [B, N, N] (or [N, N]): R = I; R <- R + mean_h (G_l ⊙ A_l)⁺ R, first
    layer first.

    Args:
        attn: the softmax outputs [L, B, H, N, N] (or [L, H, N, N]).
        grads: the gradient of the target logit with respect to each of those same tensors, the
            same shape (layer l of `grads` is the gradient of layer l of `attn`).
    """
    a, g, unbatched = _paired(attn, grads)
    r = relevance_from_layers([relevance_layer(a_l, g_l) for a_l, g_l in zip(a, g)])
    return r[0] if unbatched else r


def gradient_rollout_layer(attn_l: torch.Tensor, grad_l: torch.Tensor, *, head_fusion: HeadFusion = "mean") -> torch.Tensor:
    """One layer's gradient-weighted attention for gradient rollout: fuse_h(G_l ⊙ A_l), negatives set
    to 0; [B, H, N, N] -> [B, N, N]."""
    return fuse_heads(grad_l.mul(attn_l), head_fusion, dim=-3).clamp_(min=0)


def gradient_rollout(
    attn: torch.Tensor,
    grads: torch.Tensor,
    *,
    head_fusion: HeadFusion = "mean",
    discard_ratio: float = 0.0,
    num_prefix_tokens: int = 1,
) -> torch.Tensor:
    """Gradient rollout R [B, N, N] (or [N, N]): A'_l = fuse_h(G_l ⊙ A_l), negatives set to 0, then
    discard, identity, row normalisation and the product R = Â_L ··· Â_1 as in attention rollout."""
    a, g, unbatched = _paired(attn, grads)
    fused = torch.stack([gradient_rollout_layer(a_l, g_l, head_fusion=head_fusion) for a_l, g_l in zip(a, g)])  # [L, B, N, N]
    r = rollout_fused(fused, discard_ratio=discard_ratio, num_prefix_tokens=num_prefix_tokens)
    return r[0] if unbatched else r


def last_layer_attention(attn: torch.Tensor) -> torch.Tensor:
    """The last layer's attention averaged over heads: [L, B, H, N, N] -> [B, N, N] (or [L, H, N, N] -> [N, N]).

    A query's map is its row (`vitviz.analysis.cls_map`); the pooled query's, the mean of the patch
    tokens' rows."""
    a, unbatched = _as_batched(attn)
    out = a[-1].mean(dim=1)
    return out[0] if unbatched else out


def keep_mass(weights: torch.Tensor, share: float) -> torch.Tensor:
    """DINO's threshold: the entries of each row (last dim) that together hold `share` of its mass.

    Sort ascending, normalise to sum 1, cumulative sum, keep the entries whose cumulative sum exceeds
    1 - share, and put them back in their places. Returns a bool mask of `weights`' shape.
    """
    if not 0.0 < share <= 1.0:
        raise ValueError(f"share must be in (0, 1], got {share}")
    values, order = weights.sort(dim=-1)
    cumulative = (values / values.sum(dim=-1, keepdim=True)).cumsum(dim=-1)
    keep_sorted = cumulative > (1 - share)
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def dino_head_maps(
    attn: torch.Tensor, *, grid: tuple[int, int] | None = None, num_prefix_tokens: int = 1, share: float = 0.6, query: Query = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The last block's cls attention per head over the patches, and the patches holding `share` of it.

    Args:
        attn: the attention stack [L, B, H, N, N] or [L, H, N, N] (the last layer is read).
        share: t in DINO's recipe (0.6 in their videos).
        query: the cls token (0), another token, or "pool" (the mean of the patch tokens' rows, the
            query of a model without a cls token that classifies from their mean).

    Returns:
        maps [B, H, gh, gw] and masks (bool, same shape); [H, gh, gw] each for one image.
    """
    a, unbatched = _as_batched(attn)
    rows = query_row(a[-1], query=query, num_prefix_tokens=num_prefix_tokens)[..., num_prefix_tokens:]  # [B, H, gh*gw]: patch keys
    gh, gw = infer_grid(rows.shape[-1], grid)
    maps = rows.reshape(*rows.shape[:2], gh, gw)
    masks = keep_mass(rows, share).reshape(maps.shape)
    return (maps[0], masks[0]) if unbatched else (maps, masks)


def feature_components(features: torch.Tensor, *, k: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """The first k principal components of patch features: [M, D] -> (scores [M, k], explained [k]).

    Scores are the centred features projected on the components, each component's sign fixed so
    that its largest loading is positive; `explained` is the fraction of variance of each."""
    if features.ndim != 2:
        raise ValueError(f"features must be [M, D], got {list(features.shape)}")
    x = features.double()
    x = x - x.mean(dim=0, keepdim=True)
    _, s, vh = torch.linalg.svd(x, full_matrices=False)
    k = min(k, vh.shape[0])
    comps = vh[:k]
    comps = comps * torch.sign(comps.gather(1, comps.abs().argmax(dim=1, keepdim=True)))
    var = s**2
    return (x @ comps.T).float(), (var[:k] / var.sum()).float()


def feature_similarity(features: torch.Tensor, index: int) -> torch.Tensor:
    """Cosine similarity of feature `index` to every feature: [M, D] -> [M]."""
    f = F.normalize(features.float(), dim=-1)
    return f @ f[index]
