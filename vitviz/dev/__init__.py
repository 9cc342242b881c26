"""Tools for working on vitviz from a checkout, not part of the library: no module of `vitviz`
imports them and the package's distribution leaves them out.

    python -m vitviz.dev.bench               # timings (docs/performance.md, docs/serving.md)
    python -m vitviz.dev.train_shapes        # the embedded models' weights, into the checkout's assets/
    python -m vitviz.dev.train_shapes_clip   # the embedded image–text model's weights (shapes_clip)
    python -m vitviz.dev.screens             # docs/screens: every tab of every embedded model, checked
"""
