"""The Architecture tab: the patch grid the model sees, and its stages with shapes and parameters."""

from __future__ import annotations

import gradio as gr

from vitviz.server import views
from vitviz.server.runtime import Outputs
from vitviz.server.tabs.base import Analysed, Tab, figure, register_tab


class ArchitectureTab(Tab):
    id = "architecture"
    label = "Architecture"

    def build(self, page) -> None:
        gr.Markdown(
            "The image as the model sees it: resized, centre-cropped and cut into patches, each becoming one "
            "token. The table follows the tokens stage by stage with output shapes and parameter counts.",
            elem_classes="vv-caption",
        )
        self.grid_img = figure(label="Patch grid", elem_id="vv-grid")
        self.table = gr.Dataframe(
            headers=["Stage", "Layer", "Output shape", "Param #"], label="Stages", wrap=True, elem_id="vv-table",
            column_widths=["30%", "34%", "20%", "16%"],
        )

    def analysis_outputs(self):
        return [self.grid_img, self.table]

    def analysed(self, done: Analysed) -> Outputs:
        grid, table_rows = views.render_architecture(done.exp)
        return {self.grid_img: grid, self.table: gr.skip() if done.same_model else table_rows}


TAB = register_tab(ArchitectureTab())
