"""The Distance tab: how far each head looks (the paper's Figure 7, right)."""

from __future__ import annotations

import gradio as gr

from vitviz.server import views
from vitviz.server.runtime import Outputs
from vitviz.server.tabs.base import Analysed, Tab, figure, register_tab


class DistanceTab(Tab):
    id = "distance"
    label = "Distance"
    needs = frozenset({"global_attention"})

    def build(self, page) -> None:
        gr.Markdown(
            "How far each head looks (the paper's Figure 7, right): for every head, the average pixel distance "
            "between a patch and the patches it attends to, weighted by attention. In the paper's models, early "
            "layers mix near and far heads and later ones look far. The dashed line is what uniform attention would give.",
            elem_classes="vv-caption",
        )
        self.distance_img = figure(label="Mean attention distance", elem_id="vv-distance")

    def analysis_outputs(self):
        return [self.distance_img]

    def analysed(self, done: Analysed) -> Outputs:
        return {self.distance_img: views.render_distance(done.exp)}


TAB = register_tab(DistanceTab())
