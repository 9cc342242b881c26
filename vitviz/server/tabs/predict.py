"""The Predict tab: the top-5 classes, the attention rollout (with its options) and the .npz download."""

from __future__ import annotations

import gradio as gr

from vitviz.imagetext import DEFAULT_TEMPLATE
from vitviz.server import runtime
from vitviz.server.guards import inputs
from vitviz.server.guards.gradio_io import ViewImage
from vitviz.server.guards.sessions import SessionRef
from vitviz.server.pictures import views
from vitviz.server.pictures.drawers import drawer
from vitviz.server.runtime import Outputs
from vitviz.server.tabs.base import Analysed, Tab, figure, register_tab


class PredictTab(Tab):
    id = "predict"
    label = "Predict"

    def build(self, page) -> None:
        gr.Markdown(
            "Top-5 classes (click one to explain it) and **attention rollout**: how much the cls token, after "
            "all layers, draws on each patch.",
            elem_classes="vv-caption",
        )
        self.predict_note = gr.Markdown("", elem_id="vv-predict-note")
        with gr.Row(elem_classes="vv-pair"):
            self.predictions = gr.Label(num_top_classes=5, label="Predictions", elem_id="vv-predictions")
            self.rollout_img = figure(ViewImage, label="Attention rollout", elem_id="vv-rollout")
            self.dist_rollout_img = figure(ViewImage, label="Rollout of the distillation token", visible=False, elem_id="vv-dist-rollout")
        with gr.Row() as self.rollout_options:
            self.head_fusion = gr.Radio(["mean", "max", "min"], value="mean", label="Head fusion", elem_id="vv-fusion")
            self.discard = gr.Slider(0.0, 0.95, value=0.0, step=0.05, label="Discard ratio", elem_id="vv-discard")
        gr.Markdown(
            "Rollout (Abnar & Zuidema 2020): each layer's attention is fused over heads (mean, max or min), its "
            "weakest links are optionally discarded, the identity is added for the residual path and each row is "
            "renormalised to sum to 1 (with mean fusion and no discard, half attention and half identity); the "
            "layers are then multiplied from the first up.",
            elem_classes="vv-caption",
        )
        with gr.Row():
            self.export = gr.Button("Prepare the analysis as .npz", size="sm")
            self.npz = gr.File(label="Attention stack, rollout, distances (.npz)")

    def analysis_outputs(self):
        return [self.predictions, self.predict_note, self.rollout_img, self.dist_rollout_img, self.rollout_options, self.discard, self.npz]

    def analysed(self, done: Analysed) -> Outputs:
        exp, a = done.exp, done.exp.analysis
        has_head = a.probabilities is not None
        drawn = drawer(exp)  # by the token layout: every layout has a rollout
        discards = drawn.DISCARD_RATIO
        distilled = "dist" in a.prefix_names
        options = dict(head_fusion=done.head_fusion, discard_ratio=done.discard_ratio)
        if a.layout.text and has_head:
            notes = [f"**Zero-shot**: each of {len(a.categories)} labels put in “{DEFAULT_TEMPLATE}” and scored against the image "
                     "by the text tower. Click one to find it in the image."]
        else:
            notes = [] if has_head else [
                f"**{a.variant} has no classifier** (a self-supervised or feature model): there are no class predictions. "
                "The maps show what its tokens attend to."
            ]
        about = drawn.rollout_note(exp)
        notes += [about] if about else []
        predictions = views.render_predictions(exp) if has_head else None
        rollout = drawn.render_rollout(exp, head_fusion=done.head_fusion, discard_ratio=done.discard_ratio if discards else 0.0)
        dist = drawn.render_rollout(exp, **options, token=1) if distilled else None
        note = "\n\n".join(notes)
        if done.same_model:  # what is shown, and how the options are, as for the last analysis: the values alone
            return {self.predictions: predictions, self.predict_note: note, self.rollout_img: rollout, self.rollout_options: gr.skip(),
                    self.discard: gr.skip() if discards else 0.0, self.dist_rollout_img: dist, self.npz: None}
        return {
            self.predictions: gr.update(value=predictions, visible=has_head),
            self.predict_note: note,
            self.rollout_img: gr.update(value=rollout, visible=True),
            self.rollout_options: gr.update(visible=True),
            self.discard: gr.update(interactive=True) if discards else gr.update(value=0.0, interactive=False),
            self.dist_rollout_img: gr.update(value=dist, visible=distilled),
            self.npz: None,
        }

    def on_rollout_options(self, ref: SessionRef | None, head_fusion: str, discard_ratio: float) -> Outputs:
        """Rollout options changed: drawn again from the stored attention (a rollout is model-sized work)."""
        exp = self.server.recall(ref)
        fusion, ratio = runtime.checked(inputs.fusion, head_fusion), runtime.checked(inputs.ratio, discard_ratio)
        drawn = drawer(exp)
        if ratio and not drawn.DISCARD_RATIO:
            raise runtime.error("The discard ratio is not defined for windowed attention (most of each row lies outside the "
                                "window): leave it at 0.")
        with self.server.job("view", ref.variant):
            out: Outputs = {self.rollout_img: drawn.render_rollout(exp, head_fusion=fusion, discard_ratio=ratio)}
            if "dist" in exp.analysis.prefix_names:
                out[self.dist_rollout_img] = drawn.render_rollout(exp, head_fusion=fusion, discard_ratio=ratio, token=1)
        return out

    def on_export(self, ref: SessionRef | None) -> Outputs:
        """The analysis as .npz, written when asked for (within VITVIZ_DOWNLOADS_MB on disk)."""
        exp = self.server.recall(ref)
        with self.server.job("export", ref.variant) as work:
            try:
                return {self.npz: self.server.downloads.npz(exp, size=work.cost.kept_bytes)}
            except ValueError as exc:
                raise runtime.error(inputs.public_text(str(exc))) from None

    def wire(self, page) -> None:
        options, rollout_outputs = [page.state, self.head_fusion, self.discard], [self.rollout_img, self.dist_rollout_img]
        self.head_fusion.change(self.on_rollout_options, options, rollout_outputs, api_visibility="undocumented", api_name="session_rollout")
        self.discard.input(self.on_rollout_options, options, rollout_outputs, api_visibility="private", trigger_mode="always_last")
        self.export.click(self.on_export, page.state, self.npz, api_visibility="private", **page.model)


TAB = register_tab(PredictTab())
