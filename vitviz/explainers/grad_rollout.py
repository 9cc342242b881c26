"""Attention weighted by the same layer's gradient of the target score (a class logit or a phrase's
similarity), fused over heads, clipped and rolled out."""

from vitviz.explainers.registry import register_method
from vitviz.relevance import gradient_rollout


@register_method("grad_rollout", title="Gradient rollout", needs_gradients=True, needs_classifier=False, unit="gradient rollout",
                 needs=("global_attention",))
def grad_rollout(rec, *, head_fusion="mean", discard_ratio=0.0, **options):
    return rec.query_maps(gradient_rollout(rec.attentions, rec.gradients, head_fusion=head_fusion, discard_ratio=discard_ratio,
                                           num_prefix_tokens=rec.num_prefix_tokens), rule="relevance_rows")
