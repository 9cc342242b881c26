"""The explanation methods, registered: each is a function of one recorded pass that returns a map
over the patch grid per sample, with what it needs declared beside it.

    import vitviz

    @vitviz.register_method("centre", title="Distance to the centre", needs_gradients=False)
    def centre(rec, **options):
        gh, gw = rec.grid
        ...                                  # -> maps [B, gh, gw], larger: more relevant

`rec` is a `vitviz.recording.Recorded`: the attention of every layer [L, B, H, N, N], the
gradients of each sample's target logit with respect to it (for methods that need them), the
token layout (grid, prefix tokens, the classifier's query and `rec.query_maps(matrix)` to read its
row of an N x N matrix), the target classes and probabilities. `options` carries the caller's
`head_fusion` and `discard_ratio` (a method may ignore them). A gradient method whose maps need each
layer's attention and gradient only through a per-layer term declares it (`layerwise=`): the pass
then takes the term inside the backward and keeps no gradient stack (`Recorded.layerwise`).

Every consumer — `vitviz.explain`, `relevance_maps`, faithfulness curves, `python -m
vitviz.evaluate --methods`, the app's Explain tab — loops over `methods()`. Plugins register
themselves on import: the modules of the entry-point group "vitviz.methods" and those named in
`VITVIZ_PLUGINS` (comma-separated module names) are imported by `methods()`. The five built-in
methods (attention, rollout, gradient, grad_rollout, legrad) are registered the same way, one module
each in this package.

A method's target: `needs_classifier=True` (the default for gradient methods) reads `rec.targets`,
the class of each sample; `needs_classifier=False` with gradients works with whatever score was
differentiated — a class logit, or for an image–text model a phrase's similarity (`rec.texts`,
`rec.similarities`; the batch is then the (image, phrase) pairs) — and needs "target": a
classifier or a text tower.
"""

from vitviz.explainers.registry import ENTRY_POINT_GROUP, PLUGINS_ENV, Method, load_plugins, method, methods, register_method

# the built-in methods, registered in this order
from vitviz.explainers import attention, rollout, gradient, grad_rollout, legrad  # noqa: E402,F401

__all__ = ["Method", "register_method", "methods", "method", "load_plugins", "PLUGINS_ENV", "ENTRY_POINT_GROUP"]
