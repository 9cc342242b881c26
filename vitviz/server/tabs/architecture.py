"""The Architecture tab: the patch grid the model sees, and its stages with shapes and parameters."""

from __future__ import annotations

import gradio as gr

from vitviz.server.pictures import views
from vitviz.server.pictures.drawers import drawer
from vitviz.server.runtime import Outputs
from vitviz.server.tabs.base import Analysed, Tab, figure, register_tab


class ArchitectureTab(Tab):
    id = "architecture"
    label = "Architecture"

    def build(self, page) -> None:
        gr.Markdown(
            "The image as the model sees it: resized, centre-cropped and cut into patches, each becoming one "
            "token. The table follows the tokens stage by stage with output shapes and parameter counts. A Swin's stages "
            "are drawn too: each stage's tokens (thin lines) and windows (cyan), and its shifted windows cut by the mask "
            "into the regions a token attends within; between stages, 2x2 tokens merge into one.",
            elem_classes="vv-caption",
        )
        self.grid_img = figure(label="Patch grid", elem_id="vv-grid")
        self.stages_img = figure(label="Stages: tokens, windows and shifted windows", visible=False, elem_id="vv-stages")
        self.table = gr.Dataframe(
            headers=["Stage", "Layer", "Output shape", "Param #"], label="Stages", wrap=True, elem_id="vv-table",
            column_widths=["30%", "34%", "20%", "16%"], max_height=100_000,  # the whole table on the page, its header with it
        )

    def analysis_outputs(self):
        return [self.grid_img, self.stages_img, self.table]

    def analysed(self, done: Analysed) -> Outputs:
        grid, table_rows = views.render_architecture(done.exp)
        stages = drawer(done.exp).render_stages(done.exp)  # a layout of several stages draws them
        stages = gr.update(value=stages, visible=stages is not None)
        return {self.grid_img: grid, self.stages_img: stages, self.table: gr.skip() if done.same_model else table_rows}


TAB = register_tab(ArchitectureTab())
