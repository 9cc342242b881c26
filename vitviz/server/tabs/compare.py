"""The Compare tab: two or three variants on the same image, side by side."""

from __future__ import annotations

import gradio as gr

from vitviz.cost import price, together
from vitviz.server import runtime
from vitviz.server.menus import grouped_choices
from vitviz.server.pictures import views
from vitviz.server.runtime import Outputs
from vitviz.server.tabs.base import Tab, figure, register_tab
from vitviz.sources import get_spec

MAX_COMPARE = 3
# the colour scale of the rollouts: (label, value); "shared" by default, so a colour means one density in every map
SCALES = [("One scale for all (colours comparable)", "shared"), ("Each model its own scale", "own")]


class CompareTab(Tab):
    id = "compare"
    label = "Compare"
    waits = False  # compares the image on the page, analysed or not

    def build(self, page) -> None:
        gr.Markdown(
            "Two or three variants on the same image: predictions and rollout side by side, their patch grids and sizes in "
            "one table, and every head's attention distance in one chart, so patch size, model size and training can be compared.",
            elem_classes="vv-caption",
        )
        with gr.Row(equal_height=False):
            with gr.Column(scale=1, min_width=260, elem_id="vv-compare-controls"):
                self.compare_pick = gr.Dropdown(
                    grouped_choices(), value=["shapes_p16", "shapes_p8"], multiselect=True, max_choices=MAX_COMPARE, filterable=True,
                    label="Variants (two or three)", info="Type to search by name or family; what runs offline comes first.",
                    elem_id="vv-compare-pick",
                )
                self.compare_scale = gr.Radio(SCALES, value="shared", label="Colour scale of the rollouts", elem_id="vv-compare-scale")
                self.compare_run = gr.Button("Compare", variant="primary", elem_id="vv-compare-run")
                self.compare_notice = gr.HTML("", elem_id="vv-compare-notice")
            with gr.Column(scale=3, min_width=300, elem_id="vv-compare-results"):
                self.compare_table = gr.HTML("", elem_id="vv-compare-table")
                self.slots = []
                with gr.Row():
                    for k in range(MAX_COMPARE):
                        with gr.Column(visible=k < 2, min_width=160) as col:
                            md = gr.Markdown("", elem_id=f"vv-compare-{k + 1}", elem_classes="vv-compare-head")
                            ro = figure(label="Rollout", elem_id=f"vv-compare-rollout-{k + 1}")
                            bar = gr.HTML("", elem_id=f"vv-compare-bar-{k + 1}")
                        self.slots.append((col, md, ro, bar))
                self.compare_bar = gr.HTML("", elem_id="vv-compare-bar")
        self.compare_distance = figure(label="Mean attention distance", elem_id="vv-compare-distance")
        page.variant_menus.append((self.compare_pick, grouped_choices))  # a model added by name joins it

    def on_compare(self, image: str | None, variants: list[str] | None, scale: str = "shared") -> Outputs:
        """Two or three variants on the same image, side by side; their rollouts on one colour scale
        (`scale` "shared") or each on its own ("own").

        When something cannot be analysed, only the compare notice changes, saying why."""
        variants = list(variants) if isinstance(variants, (list, tuple)) else []
        try:
            if scale not in [v for _, v in SCALES]:
                raise runtime.error("The colour scale is one for all (shared) or each model's own (own).")
            if not 2 <= len(variants) <= MAX_COMPARE:
                raise runtime.error(f"Pick two or three variants to compare (you picked {len(variants)}).")
            names = [self.server.variant_name(v) for v in variants]
            with self.server.priced(together([price(get_spec(v), "analyse") for v in names])):  # held together, until drawn
                return self._outputs([self.server.run(image, v) for v in names], shared=scale == "shared")
        except gr.Error as exc:
            gr.Warning(exc.message)
            return {self.compare_notice: runtime.notice_html(exc.message)}

    def _outputs(self, exps: list[views.Exploration], *, shared: bool) -> Outputs:
        distance = views.render_compare_distance(exps)  # (a model whose heads differ by stage: each layer its own)
        rollouts, ranges = views.render_compare_rollouts(exps, shared=shared)
        out: Outputs = {
            self.compare_notice: "",
            self.compare_distance: distance,
            self.compare_table: views.compare_table_html(exps),
            self.compare_bar: views.colour_bar_html(*ranges[0]) if shared else "",
        }
        for k, (col, md, ro, bar) in enumerate(self.slots):
            if k < len(exps):
                a = exps[k].analysis
                top = "\n".join(f"- {label}: {p:.1%}" for label, p in a.predictions(3)) or "(no classifier: features only)"
                out[col] = gr.update(visible=True)
                out[md] = f"### {a.variant}\n{top}"
                out[ro] = rollouts[k]
                out[bar] = "" if shared else views.colour_bar_html(*ranges[k])
            else:
                out[col], out[md], out[ro], out[bar] = gr.update(visible=False), "", None, ""
        return out

    def wire(self, page) -> None:
        outputs = [self.compare_notice, self.compare_distance, self.compare_table, self.compare_bar, *[c for slot in self.slots for c in slot]]
        self.compare_run.click(self.on_compare, [page.image, self.compare_pick, self.compare_scale], outputs, api_visibility="private", **page.model)


TAB = register_tab(CompareTab())
