"""Attention rollout from the classifier's query (Abnar & Zuidema 2020; no target)."""

import torch

from vitviz.analysis import fuse_heads, rollout_fused
from vitviz.explainers.registry import register_method


@register_method("rollout", title="Attention rollout", needs_gradients=False, unit="rollout", needs=("global_attention",))
def rollout(rec, *, head_fusion="mean", discard_ratio=0.0, **options):
    fused = torch.stack([fuse_heads(a, head_fusion, dim=1) for a in rec.attention_layers])  # [L, B, N, N]: attention_rollout, layer by layer
    return rec.query_maps(rollout_fused(fused, discard_ratio=discard_ratio, num_prefix_tokens=rec.num_prefix_tokens))
