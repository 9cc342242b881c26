"""The Positions tab: the learned position embeddings' similarity and the patch-embedding filters; for
a Swin (no position embeddings), each layer's relative position bias tables per head instead; for a
model with rotary positions, what its rotation does by offset; and for every model that attends
over the whole grid, the attention each offset received on this image, layer by layer."""

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
SIMILARITY = ("cosine similarity between the learned position embedding of each patch (one tile per patch) and all others — the "
              "paper's Figure 7, centre; nearby patches have similar embeddings.")
CAPTION = "Left: " + SIMILARITY + " Right: " + FILTERS
BIAS_CAPTION = "Below: " + FILTERS  # (no position embeddings: no similarity on the left)
NO_FILTERS = "No patch-embedding filters: {why}."  # a hybrid (`TokenLayout.patch_filters`)
BIAS_TEXT = ("This model has no position embeddings: each layer adds a learned **relative position bias** to its attention "
             "logits (within a window, for a Swin), one table per head. A tile shows where the key lies relative to the query "
             "(the centre, outlined, is the query itself; up is a key above it); red raises the key's attention, blue lowers it.")
ROTARY_TEXT = ("This model's positions are **rotary**: each head's queries and keys of the patches are turned, pair of channels "
               "by pair, by angles that grow with the patch's row and column, so the product of a query and a key depends on "
               "how far apart they are. A tile shows, for every offset of the key from the query (the centre, outlined, is "
               "the query itself; up is a key above it), the mean cosine of the angles between them over the head's pairs: "
               "the product of a query and a key that are alike and spread evenly over the pairs, 1 where nothing turned them "
               "apart. {which}")
ROTARY_WHICH = {"mixed": "This model learned its frequencies per layer and head: one tile per head of the chosen layer.",
                None: "Every head and layer shares the same frequencies: one tile."}
OFFSETS_TEXT = ("**Attention by offset, measured on this image.** For the chosen layer, one tile per head: the attention a patch "
                "gives the patch at each offset from it (the centre, outlined, is itself), averaged over the patches that have one "
                "there. Learned, relative and rotary positions compare on this one footing.")


class PositionsTab(Tab):
    id = "positions"
    label = "Positions"
    needs = frozenset({"positions"})  # embeddings (their similarity) or a relative position bias (its tables)

    def build(self, page) -> None:
        with gr.Column(visible=False, elem_id="vv-bias-box") as self.bias_box:  # a Swin's or a rotary model's, above its filters
            self.bias_text = gr.Markdown(BIAS_TEXT, elem_classes="vv-caption", elem_id="vv-bias-text")
            self.bias_layer = gr.Slider(1, 2, value=1, step=1, label="Layer", elem_id="vv-bias-layer")
            self.bias_img = figure(label="Relative position bias per head", elem_id="vv-bias")
        self.caption = gr.Markdown(CAPTION, elem_classes="vv-caption", elem_id="vv-positions-caption")
        with gr.Row(elem_classes="vv-pair"):
            with gr.Column(min_width=240) as self.similarity_box:
                self.similarity_img = figure(label="Position-embedding similarity", elem_id="vv-similarity")
            with gr.Column(min_width=240) as self.filters_box:  # hidden for a hybrid: no filters over pixels
                self.filters_img = figure(label="Filters: principal components", elem_id="vv-filters")
        with gr.Column(visible=False, elem_id="vv-offsets-box") as self.offsets_box:  # every model that attends over the grid
            gr.Markdown(OFFSETS_TEXT, elem_classes="vv-caption")
            self.offsets_layer = gr.Slider(1, 2, value=1, step=1, label="Layer", elem_id="vv-offsets-layer")
            self.offsets_img = figure(label="Attention by offset per head", elem_id="vv-offsets")

    def analysis_outputs(self):
        return [self.similarity_img, self.filters_img, self.similarity_box, self.filters_box, self.bias_box, self.bias_text,
                self.bias_layer, self.bias_img, self.caption, self.offsets_box, self.offsets_layer, self.offsets_img]

    def analysed(self, done: Analysed) -> Outputs:
        exp = done.exp
        drawn = drawer(exp)
        layers = drawn.explorer_bounds(exp)[0]
        layout = exp.analysis.layout
        offsets = layout.attention == "global"  # this image's attention by offset, whatever the model
        measured = {
            self.offsets_box: gr.update(visible=offsets),
            self.offsets_layer: gr.update(maximum=max(layers, 2), value=layers, visible=layers > 1) if offsets else gr.skip(),
            self.offsets_img: drawn.render_offsets(exp, layer=layers) if offsets else None,
        }
        if done.same_model:  # the model's own pictures are on the page already
            return {**{c: gr.skip() for c in self.analysis_outputs()}, **measured}
        similarity, filters = drawn.render_positions(exp)
        tables = layout.position_bias or layout.rotary is not None  # per offset, above the filters
        per_layer = layout.position_bias or layout.rotary == "mixed"
        text = ROTARY_TEXT.format(which=ROTARY_WHICH.get(layout.rotary, ROTARY_WHICH[None])) if layout.rotary else BIAS_TEXT
        caption = CAPTION if similarity is not None else BIAS_CAPTION
        no_filters = layout.lacks({"patch_filters"}, name=exp.analysis.variant)  # a hybrid: a stem before its patches
        if no_filters:
            caption = (SIMILARITY[0].upper() + SIMILARITY[1:] + " " if similarity is not None else "") + NO_FILTERS.format(why=no_filters)
        return {
            self.similarity_img: similarity, self.similarity_box: gr.update(visible=similarity is not None), self.filters_img: filters,
            self.filters_box: gr.update(visible=filters is not None),
            self.bias_box: gr.update(visible=tables),
            self.bias_text: text if tables else gr.skip(),
            self.bias_layer: gr.update(maximum=max(layers, 2), value=1, visible=per_layer) if tables else gr.skip(),
            self.bias_img: gr.update(value=drawn.render_bias(exp, layer=1), label="Rotary positions by offset" if layout.rotary
                                     else "Relative position bias per head") if tables else None,
            self.caption: caption,
            **measured,
        }

    def on_bias_layer(self, ref: SessionRef | None, layer_value: float) -> Outputs:
        """Another layer's tables by offset (a model with a relative position bias,
        `TokenLayout.position_bias`, or rotary positions)."""
        exp = self.server.recall(ref)
        layout = exp.analysis.layout
        if not layout.position_bias and layout.rotary is None:
            raise runtime.error(f"{exp.analysis.variant} has learned position embeddings, not relative position bias tables.")
        drawn = drawer(exp)
        layer_value = runtime.checked(inputs.index, layer_value, 1, drawn.explorer_bounds(exp)[0], "layer")
        return {self.bias_img: drawn.render_bias(exp, layer=layer_value)}

    def on_offsets_layer(self, ref: SessionRef | None, layer_value: float) -> Outputs:
        """Another layer's attention by offset on this image (a model that attends over the whole grid)."""
        exp = self.server.recall(ref)
        if exp.analysis.layout.attention != "global":
            raise runtime.error(f"{exp.analysis.variant} attends within windows: its offsets are its relative position bias tables.")
        drawn = drawer(exp)
        layer_value = runtime.checked(inputs.index, layer_value, 1, drawn.explorer_bounds(exp)[0], "layer")
        return {self.offsets_img: drawn.render_offsets(exp, layer=layer_value)}

    def wire(self, page) -> None:
        self.bias_layer.input(self.on_bias_layer, [page.state, self.bias_layer], self.bias_img, api_visibility="undocumented",
                              api_name="session_bias", trigger_mode="always_last")
        self.offsets_layer.input(self.on_offsets_layer, [page.state, self.offsets_layer], self.offsets_img,
                                 api_visibility="undocumented", api_name="session_offsets", trigger_mode="always_last")


TAB = register_tab(PositionsTab())
