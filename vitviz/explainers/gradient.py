"""Chefer et al. 2021's relevance for the target score (`vitviz.relevance.gradient_relevance`): a class
logit, or for an image–text model a phrase's similarity, the same rule over every block of the
image tower and the classifier's query row."""

from vitviz.explainers.registry import register_method
from vitviz.relevance import relevance_from_layers, relevance_layer


@register_method("gradient", title="Gradient relevance", needs_gradients=True, needs_classifier=False, unit="relevance",
                 needs=("global_attention",), layerwise=lambda a, g, **options: relevance_layer(a, g))
def gradient(rec, **options):
    return rec.query_maps(relevance_from_layers(rec.layerwise("gradient")), rule="relevance")
