"""The last attention of the classifier's query, averaged over heads (no target): the cls token's
row in the last layer, or for a model that pools with attention (SigLIP) its probe's attention, the
last attention the pooled query has."""

from vitviz.analysis import POOL
from vitviz.explainers.registry import register_method
from vitviz.relevance import last_layer_attention


@register_method("attention", title="Last-layer attention", needs_gradients=False, unit="attention", needs=("global_attention",))
def attention(rec, **options):
    if rec.query == POOL and rec.pool_attention is not None:
        probe = rec.pool_attention.mean(dim=1)[:, rec.num_prefix_tokens :]  # [B, gh*gw]
        return probe.reshape(-1, *rec.grid)
    return rec.query_maps(last_layer_attention(rec.attention_layers[-1][None]))  # the last layer alone: no stack of every layer
