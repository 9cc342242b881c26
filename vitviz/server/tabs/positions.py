"""The Positions tab: the learned position embeddings' similarity and the patch-embedding filters."""

from __future__ import annotations

import gradio as gr

from vitviz.server import views
from vitviz.server.runtime import Outputs
from vitviz.server.tabs.base import Analysed, Tab, figure, register_tab


class PositionsTab(Tab):
    id = "positions"
    label = "Positions"
    needs = frozenset({"position_embeddings"})

    def build(self, page) -> None:
        gr.Markdown(
            "Left: cosine similarity between the learned position embedding of each patch (one tile per patch) "
            "and all others — the paper's Figure 7, centre; nearby patches have similar embeddings. Right: the "
            "top 28 principal components of the patch-embedding filters as RGB images (Figure 7, left), each "
            "with the share of the filters' variance it explains.",
            elem_classes="vv-caption",
        )
        with gr.Row(elem_classes="vv-pair"):
            self.similarity_img = figure(label="Position-embedding similarity", elem_id="vv-similarity")
            self.filters_img = figure(label="Filters: principal components", elem_id="vv-filters")

    def analysis_outputs(self):
        return [self.similarity_img, self.filters_img]

    def analysed(self, done: Analysed) -> Outputs:
        if done.same_model:  # the model's own pictures are on the page already
            return {self.similarity_img: gr.skip(), self.filters_img: gr.skip()}
        similarity, filters = views.render_position(done.exp)
        return {self.similarity_img: similarity, self.filters_img: filters}


TAB = register_tab(PositionsTab())
