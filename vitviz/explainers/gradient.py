"""Chefer et al. 2021's relevance for the target logit (`vitviz.relevance.gradient_relevance`)."""

from vitviz.explainers.registry import register_method
from vitviz.relevance import gradient_relevance


@register_method("gradient", title="Gradient relevance", needs_gradients=True, unit="relevance", needs=("global_attention",))
def gradient(rec, **options):
    return rec.query_maps(gradient_relevance(rec.attentions, rec.gradients))
