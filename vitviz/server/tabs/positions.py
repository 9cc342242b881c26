"""The Positions tab: the learned position embeddings' similarity and the patch-embedding filters; for
a Swin (no position embeddings), each layer's relative position bias tables per head instead."""

from __future__ import annotations

import gradio as gr

from vitviz.server import runtime
from vitviz.server.guards import inputs
from vitviz.server.guards.sessions import SessionRef
from vitviz.server.pictures.drawers import drawer
from vitviz.server.runtime import Outputs
from vitviz.server.tabs.base import Analysed, Tab, figure, register_tab


FILTERS = ("the top 28 principal components of the patch-embedding filters as RGB images (Figure 7, left), each with the "
           "share of the filters' variance it explains.")
CAPTION = ("Left: cosine similarity between the learned position embedding of each patch (one tile per patch) and all "
           "others — the paper's Figure 7, centre; nearby patches have similar embeddings. Right: " + FILTERS)
BIAS_CAPTION = "Below: " + FILTERS  # (no position embeddings: no similarity on the left)


class PositionsTab(Tab):
    id = "positions"
    label = "Positions"
    needs = frozenset({"positions"})  # embeddings (their similarity) or a relative position bias (its tables)

    def build(self, page) -> None:
        with gr.Column(visible=False, elem_id="vv-bias-box") as self.bias_box:  # a Swin's, above its filters
            gr.Markdown(
                "This model has no position embeddings: each layer adds a learned **relative position bias** to its attention "
                "logits inside a window, one table per head. A tile shows where the key lies relative to the query (the "
                "centre, outlined, is the query itself; up is a key above it); red raises the key's attention, blue lowers it.",
                elem_classes="vv-caption",
            )
            self.bias_layer = gr.Slider(1, 2, value=1, step=1, label="Layer", elem_id="vv-bias-layer")
            self.bias_img = figure(label="Relative position bias per head", elem_id="vv-bias")
        self.caption = gr.Markdown(CAPTION, elem_classes="vv-caption", elem_id="vv-positions-caption")
        with gr.Row(elem_classes="vv-pair"):
            with gr.Column(min_width=240) as self.similarity_box:
                self.similarity_img = figure(label="Position-embedding similarity", elem_id="vv-similarity")
            self.filters_img = figure(label="Filters: principal components", elem_id="vv-filters")

    def analysis_outputs(self):
        return [self.similarity_img, self.filters_img, self.similarity_box, self.bias_box, self.bias_layer, self.bias_img, self.caption]

    def analysed(self, done: Analysed) -> Outputs:
        if done.same_model:  # the model's own pictures are on the page already
            return {c: gr.skip() for c in self.analysis_outputs()}
        exp = done.exp
        drawn = drawer(exp)
        similarity, filters = drawn.render_positions(exp)
        bias = exp.analysis.layout.position_bias  # each layer's relative position bias, above the filters
        return {
            self.similarity_img: similarity, self.similarity_box: gr.update(visible=similarity is not None), self.filters_img: filters,
            self.bias_box: gr.update(visible=bias),
            self.bias_layer: gr.update(maximum=drawn.explorer_bounds(exp)[0], value=1) if bias else gr.skip(),
            self.bias_img: drawn.render_bias(exp, layer=1) if bias else None,
            self.caption: CAPTION if similarity is not None else BIAS_CAPTION,
        }

    def on_bias_layer(self, ref: SessionRef | None, layer_value: float) -> Outputs:
        """Another layer's relative position bias tables (a model with one: `TokenLayout.position_bias`)."""
        exp = self.server.recall(ref)
        if not exp.analysis.layout.position_bias:
            raise runtime.error(f"{exp.analysis.variant} has learned position embeddings, not relative position bias tables.")
        drawn = drawer(exp)
        layer_value = runtime.checked(inputs.index, layer_value, 1, drawn.explorer_bounds(exp)[0], "layer")
        return {self.bias_img: drawn.render_bias(exp, layer=layer_value)}

    def wire(self, page) -> None:
        self.bias_layer.input(self.on_bias_layer, [page.state, self.bias_layer], self.bias_img, api_visibility="undocumented",
                              api_name="session_bias", trigger_mode="always_last")


TAB = register_tab(PositionsTab())
