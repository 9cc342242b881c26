"""Tensors -> pictures. No model, no Gradio, no pyplot.

Heatmaps over images are plain pixels (numpy + a colormap lookup table), which is faster than a
plot and adds nothing a person needs. Charts (attention distance, position similarity) are
`matplotlib.figure.Figure` objects built directly and rasterised with the Agg canvas, so a server
never keeps figures alive.

The pictures by kind: `images` (pixels: heat maps, colour bars, outlines, mosaics, tiles), `charts`
(matplotlib figures) and `grids` (token grids' regions, bias tables, the heads x layers map).
"""

from vitviz.plots.images import (  # noqa: F401
    CMAP,
    COLORBAR_PX,
    heat_indices,
    lut,
    colorize,
    overlay,
    overlay_many,
    with_colorbar,
    tick_label,
    tick_values,
    named,
    mark_patch,
    patch_grid,
    mosaic,
    filters_image,
    features_image,
    figure_to_image,
    text_boxes,
    clipped_text,
)
from vitviz.plots.charts import (  # noqa: F401
    distance_figure,
    DistanceChart,
    axis_top,
    position_similarity_figure,
    received_figure,
    norms_figure,
    faithfulness_figure,
    curves_figure,
    layer_distance_figure,
    lens_figure,
)
from vitviz.plots.grids import (  # noqa: F401
    outline_cells,
    bias_tables_image,
    HeadGrid,
    head_grid_image,
)

__all__ = [
    "CMAP",
    "COLORBAR_PX",
    "heat_indices",
    "lut",
    "colorize",
    "overlay",
    "overlay_many",
    "with_colorbar",
    "tick_label",
    "tick_values",
    "named",
    "mark_patch",
    "patch_grid",
    "mosaic",
    "distance_figure",
    "DistanceChart",
    "axis_top",
    "position_similarity_figure",
    "filters_image",
    "features_image",
    "figure_to_image",
    "text_boxes",
    "clipped_text",
    "received_figure",
    "norms_figure",
    "faithfulness_figure",
    "curves_figure",
    "outline_cells",
    "layer_distance_figure",
    "bias_tables_image",
    "lens_figure",
    "HeadGrid",
    "head_grid_image",
]
