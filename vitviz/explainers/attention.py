"""The last layer's attention of the classifier's query, averaged over heads (no target)."""

from vitviz.explainers.registry import register_method
from vitviz.relevance import last_layer_attention


@register_method("attention", title="Last-layer attention", needs_gradients=False, unit="attention", needs=("global_attention",))
def attention(rec, **options):
    return rec.query_maps(last_layer_attention(rec.attentions))
