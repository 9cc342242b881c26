"""The Distance tab: how far each head looks (the paper's Figure 7, right)."""

from __future__ import annotations

import gradio as gr

from vitviz.server.pictures.drawers import drawer
from vitviz.server.runtime import Outputs
from vitviz.server.tabs.base import Analysed, Tab, figure, register_tab


class DistanceTab(Tab):
    id = "distance"
    label = "Distance"
    needs = frozenset()  # every token layout's drawer measures its distances (windowed: each layer on its stage's grid)

    def build(self, page) -> None:
        gr.Markdown(
            "How far each head looks (the paper's Figure 7, right): for every head, the average pixel distance "
            "between a patch and the patches it attends to, weighted by attention. In the paper's models, early "
            "layers mix near and far heads and later ones look far. The dashed line is what uniform attention would give. "
            "A Swin's heads look only inside their windows: each layer is measured on its own stage's grid (a token there "
            "covers 2x2 of the stage before) in input pixels, and the head count changes with the stage.",
            elem_classes="vv-caption",
        )
        self.distance_img = figure(label="Mean attention distance", elem_id="vv-distance")

    def analysis_outputs(self):
        return [self.distance_img]

    def analysed(self, done: Analysed) -> Outputs:
        return {self.distance_img: drawer(done.exp).render_distance(done.exp)}


TAB = register_tab(DistanceTab())
