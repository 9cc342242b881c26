"""Attention weighted by the same layer's gradient of the target score (a class logit or a phrase's
similarity), fused over heads, clipped and rolled out."""

import torch

from vitviz.analysis import rollout_fused
from vitviz.explainers.registry import register_method
from vitviz.relevance import gradient_rollout_layer


@register_method("grad_rollout", title="Gradient rollout", needs_gradients=True, needs_classifier=False, unit="gradient rollout",
                 needs=("global_attention",),
                 layerwise=lambda a, g, *, head_fusion="mean", **options: gradient_rollout_layer(a, g, head_fusion=head_fusion))
def grad_rollout(rec, *, head_fusion="mean", discard_ratio=0.0, **options):
    fused = torch.stack(rec.layerwise("grad_rollout", head_fusion=head_fusion))  # [L, B, N, N]
    return rec.query_maps(rollout_fused(fused, discard_ratio=discard_ratio, num_prefix_tokens=rec.num_prefix_tokens), rule="relevance_rows")
