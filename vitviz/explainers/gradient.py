"""Chefer et al. 2021's relevance for the target score (`vitviz.relevance.gradient_relevance`): a class
logit, or for an image–text model a phrase's similarity, the same rule over every block of the
image tower and the classifier's query row."""

from vitviz.explainers.registry import register_method
from vitviz.relevance import gradient_relevance


@register_method("gradient", title="Gradient relevance", needs_gradients=True, needs_classifier=False, unit="relevance",
                 needs=("global_attention",))
def gradient(rec, **options):
    return rec.query_maps(gradient_relevance(rec.attentions, rec.gradients), rule="relevance")
