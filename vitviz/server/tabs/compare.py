"""The Compare tab: two or three variants on the same image, side by side."""

from __future__ import annotations

import gradio as gr

from vitviz.cost import price, together
from vitviz.server import runtime, swin_views, views
from vitviz.server.menus import variant_choices
from vitviz.server.runtime import Outputs
from vitviz.server.tabs.base import Tab, figure, register_tab
from vitviz.sources import get_spec

MAX_COMPARE = 3


class CompareTab(Tab):
    id = "compare"
    label = "Compare"

    def build(self, page) -> None:
        gr.Markdown(
            "Two or three variants on the same image: predictions, rollout and patch grid side by side, and "
            "every head's attention distance in one chart, so patch size, model size and training can be compared.",
            elem_classes="vv-caption",
        )
        with gr.Row():
            self.compare_pick = gr.CheckboxGroup(variant_choices(), value=["shapes_p16", "shapes_p8"], label="Variants (two or three)")
            self.compare_run = gr.Button("Compare", variant="primary", elem_id="vv-compare-run")
        page.variant_menus.append(self.compare_pick)  # a model added by name joins it
        self.compare_notice = gr.HTML("", elem_id="vv-compare-notice")
        self.slots = []
        with gr.Row():
            for k in range(MAX_COMPARE):
                with gr.Column(visible=k < 2, min_width=220) as col:
                    md = gr.Markdown("", elem_id=f"vv-compare-{k + 1}")
                    ro = figure(label="Rollout")
                    gd = figure(label="Patch grid")
                self.slots.append((col, md, ro, gd))
        self.compare_distance = figure(label="Mean attention distance", elem_id="vv-compare-distance")

    def on_compare(self, image: str | None, variants: list[str] | None) -> Outputs:
        """Two or three variants on the same image, side by side.

        When something cannot be analysed, only the compare notice changes, saying why."""
        variants = list(variants) if isinstance(variants, (list, tuple)) else []
        try:
            if not 2 <= len(variants) <= MAX_COMPARE:
                raise runtime.error(f"Pick two or three variants to compare (you picked {len(variants)}).")
            names = [runtime.variant_name(v) for v in variants]
            with runtime.priced(together([price(get_spec(v), "analyse") for v in names])):  # held together, until drawn
                return self._outputs([runtime.run(image, v) for v in names])
        except gr.Error as exc:
            gr.Warning(exc.message)
            return {self.compare_notice: runtime.notice_html(exc.message)}

    def _outputs(self, exps: list[views.Exploration]) -> Outputs:
        ragged = any(swin_views.is_swin(e) for e in exps)  # a Swin's heads differ by stage
        distance = swin_views.render_compare_distance(exps) if ragged else views.render_compare_distance(exps)
        out: Outputs = {self.compare_notice: "", self.compare_distance: distance}
        for k, (col, md, ro, gd) in enumerate(self.slots):
            if k < len(exps):
                e = exps[k]
                a = e.analysis
                top = "\n".join(f"- {label}: {p:.1%}" for label, p in a.predictions(3)) or "(no classifier: features only)"
                out[col] = gr.update(visible=True)
                out[md] = (
                    f"### {a.variant}\n{a.grid[0]}x{a.grid[1]} patches of {a.patch_size} px · {e.facts.total_params:,} params · "
                    f"{a.model_seconds * 1e3:.0f} ms\n\n{top}"
                )
                out[ro] = swin_views.render_rollout(e) if swin_views.is_swin(e) else views.render_rollout(e)
                out[gd] = views.render_architecture(e)[0]
            else:
                out[col], out[md], out[ro], out[gd] = gr.update(visible=False), "", None, None
        return out

    def wire(self, page) -> None:
        outputs = [self.compare_notice, self.compare_distance, *[c for slot in self.slots for c in slot]]
        self.compare_run.click(self.on_compare, [page.image, self.compare_pick], outputs, api_visibility="private", **page.model)


TAB = register_tab(CompareTab())
