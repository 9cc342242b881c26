"""Attention rollout from the classifier's query (Abnar & Zuidema 2020; no target)."""

from vitviz.analysis import attention_rollout
from vitviz.explainers.registry import register_method


@register_method("rollout", title="Attention rollout", needs_gradients=False, unit="rollout", needs=("global_attention",))
def rollout(rec, *, head_fusion="mean", discard_ratio=0.0, **options):
    return rec.query_maps(attention_rollout(rec.attentions, head_fusion=head_fusion, discard_ratio=discard_ratio,
                                            num_prefix_tokens=rec.num_prefix_tokens))
