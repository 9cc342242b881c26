"""LeGrad: Bousselham, Boggust, Chaybouti, Strobelt & Kuehne, "LeGrad: An Explainability Method for
Vision Transformers via Feature Formation Sensitivity" (2024, arXiv 2404.03214).

Each layer is asked on its own how sensitive the target is to its attention. For layer l, the
tokens after block l are read out as the final layer's are: the pooling token (cls) through the
final norm and the head, giving the class logit s_l; for an image–text model through the final
norm and the projection, giving an image embedding whose similarity with the phrase's embedding,
on the target's scale (exp(logit_scale) · cosine), is s_l. With A_l [H, N, N] layer l's attention
(its softmax output) and h heads, n tokens:

    E_l = 1/(h·n) · sum_h sum_i ReLU(∂s_l/∂A_l)[h, i, :]        (mean over heads and query rows) [N]
    E   = minmax( sum_l E_l[p:] )                                  the patch columns, over [gh, gw]

minmax(v) = (v - min v) / (max v - min v) per image (0 where the map is flat). The last layer's s_L is
the target itself. A query's output depends on its own row of A_l only, so with a cls read-out only
the cls row of ∂s_l/∂A_l is nonzero and the mean over query rows is that row divided by n; the mean
matters for models that pool their patch tokens.

Cost: ∂s_l/∂A_k is not 0 for k < l (the attention of earlier layers shapes layer l's tokens), so one
backward of sum_l s_l would give each A_l the sum of all later layers' gradients. Each layer is
differentiated on its own (`vitviz.explanations.record(..., layer_gradients=True)`): L calls of
`torch.autograd.grad`, each from s_l to A_l only, which runs back through block l's attention
output, MLP and the read-out, not through earlier blocks: about one more backward of the whole
tower, one forward, and one [L, B, H, N, N] gradient stack in memory. Several phrases share the
forward; each call is vectorised over them.

Registered on demand: `method("legrad")`, `explain(..., method="legrad")` and `relevance_maps(...,
methods=["legrad"])` import this module; name it in VITVIZ_PLUGINS to list it in `methods()` and the app.
"""

from __future__ import annotations

import torch

from vitviz.explainers.registry import register_method

__all__ = ["legrad_map"]


def legrad_map(layer_gradients: torch.Tensor, *, grid: tuple[int, int], num_prefix_tokens: int = 1) -> torch.Tensor:
    """LeGrad's map from the per-layer gradients: [L, B, H, N, N] -> [B, gh, gw], each in [0, 1].

    Args:
        layer_gradients: layer l's entry is ∂s_l/∂A_l, s_l the score read from layer l's output.
        grid: (gh, gw), the patch grid; gh·gw = N - num_prefix_tokens.
        num_prefix_tokens: p, the tokens before the patches (their columns are left out).
    """
    if layer_gradients.ndim != 5 or layer_gradients.shape[-1] != layer_gradients.shape[-2]:
        raise ValueError(f"expected per-layer gradients [L, B, H, N, N], got {list(layer_gradients.shape)}")
    gh, gw = grid
    n = layer_gradients.shape[-1]
    if n - num_prefix_tokens != gh * gw:
        raise ValueError(f"{n} tokens with {num_prefix_tokens} prefix tokens do not fill a {gh}x{gw} grid")
    per_layer = layer_gradients.clamp(min=0).mean(dim=(2, 3))  # [L, B, N]: ReLU, mean over heads and query rows
    summed = per_layer.sum(dim=0)[:, num_prefix_tokens:]  # [B, gh*gw]: the patch columns, summed over layers
    low = summed.min(dim=-1, keepdim=True).values
    span = summed.max(dim=-1, keepdim=True).values - low
    scaled = torch.where(span > 0, (summed - low) / span.clamp(min=torch.finfo(summed.dtype).tiny), torch.zeros_like(summed))
    return scaled.reshape(-1, gh, gw)


@register_method("legrad", title="LeGrad", needs_gradients=False, needs_classifier=False, needs_layer_gradients=True, unit="LeGrad",
                 needs=("global_attention",))
def legrad(rec, **options):
    return legrad_map(rec.layer_gradients, grid=rec.grid, num_prefix_tokens=rec.num_prefix_tokens)
