"""LeGrad: Bousselham, Boggust, Chaybouti, Strobelt & Kuehne, "LeGrad: An Explainability Method for
Vision Transformers via Feature Formation Sensitivity" (2024, arXiv 2404.03214).

Each layer is asked on its own how sensitive the target is to its attention. For layer l, the
tokens after block l are read out as the authors' code reads them (WalBouss/LeGrad, pip
`legrad_torch` 1.1, `LeWrapper.compute_legrad_clip`; torchcam 0.5's `LeGrad` for classifiers): the
mean of all the layer's tokens, prefix included, through the final norm and then the head, giving
the class logit s_l; for an image–text model through the final norm and the projection, giving an
image embedding whose similarity with the phrase's embedding, on the target's scale
(exp(logit_scale) · cosine; the scale does not change the map), is s_l. A model that pools its own
tokens (the mean of its patches, SigLIP's attention probe) is read through its pool, as its final
layer is. `readout="cls"` reads the pooling token instead, as the final layer is read by a cls model.
With A_l [H, N, N] layer l's attention (its softmax output) and h heads, n tokens:

    E_l = 1/(h·n) · sum_h sum_i ReLU(∂s_l/∂A_l)[h, i, :]        (mean over heads and query rows) [N]
    E   = minmax( sum_{l >= start} E_l[p:] )                       the patch columns, over [gh, gw]

over the layers from `start_layer` on: by default -2, the last two (the authors' `layer_index=-2`);
0 sums every layer. minmax(v) = (v - min v) / (max v - min v) per image (0 where the map is flat).
The authors' code upsamples each layer's map bilinearly to pixels before the sum and the minmax;
both are linear, so their map is the bilinear upsampling of this one, min-maxed again.

Not matched: for SigLIP the authors' code differentiates the probe's attention (re-run on each
layer's tokens, without the final norm) instead of the layer's own, and zeroes the pixels where an
empty prompt's map exceeds 0.8; vitviz applies the rule above to SigLIP too.

Cost: ∂s_l/∂A_k is not 0 for k < l (the attention of earlier layers shapes layer l's tokens), so one
backward of sum_l s_l would give each A_l the sum of all later layers' gradients. Each layer is
differentiated on its own (`vitviz.recording.record(..., layer_gradients=True)`): one call of
`torch.autograd.grad` a layer, each from s_l to A_l only, which runs back through block l's
attention output, MLP and the read-out, not through earlier blocks; one [L', B, H, N, N] gradient
stack in memory for the L' layers summed. Several phrases share the forward; each call is vectorised
over them.

Registered on demand: `method("legrad")`, `explain(..., method="legrad")` and `relevance_maps(...,
methods=["legrad"])` import this module; name it in VITVIZ_PLUGINS to list it in `methods()` and the app.
"""

from __future__ import annotations

import torch

from vitviz.explainers.registry import register_method

__all__ = ["legrad_map"]


def legrad_map(layer_gradients: torch.Tensor, *, grid: tuple[int, int], num_prefix_tokens: int = 1) -> torch.Tensor:
    """LeGrad's map from the per-layer gradients: [L', B, H, N, N] -> [B, gh, gw], each in [0, 1].

    Args:
        layer_gradients: [L', B, H, N, N], for each layer summed ∂s_l/∂A_l, s_l the score read from
            layer l's output.
        grid: (gh, gw), the patch grid; gh·gw = N - num_prefix_tokens.
        num_prefix_tokens: p, the tokens before the patches (their columns are left out).
    """
    if layer_gradients.ndim != 5 or layer_gradients.shape[-1] != layer_gradients.shape[-2]:
        raise ValueError(f"expected per-layer gradients [L', B, H, N, N], got {list(layer_gradients.shape)}")
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
