"""The Explain tab: every method's map for a class (drawn when shown), and the faithfulness curves."""

from __future__ import annotations

import gradio as gr

from vitviz import plots
from vitviz.explainers import method as registered_method, methods
from vitviz.server import runtime
from vitviz.server.guards.gradio_io import ViewImage
from vitviz.server.guards.sessions import SessionRef
from vitviz.server.pictures import views
from vitviz.server.pictures.drawers import drawer
from vitviz.server.runtime import Outputs
from vitviz.server.tabs.base import Analysed, Tab, figure, register_tab

# the maps: every registered method that explains a class or none (plugins loaded now)
METHODS = tuple(m for m in methods() if not registered_method(m).needs_text)
EXPLAIN_SCALES = ("each map", "shared by every map")


class ExplainTab(Tab):
    id = "explain"
    label = "Explain"
    needs = frozenset()  # the methods a model's analysis offers (windowed attention: made global, `vitviz.swin_analysis`)
    on_demand = True

    def __init__(self) -> None:
        super().__init__()
        self.explained = runtime.Recent()  # the analyses whose Explain tab has been drawn

    def build(self, page) -> None:
        gr.Markdown(
            "Why this class: one map over the patches per method, for the class you pick. The last layer's attention "
            "and rollout do not depend on the class; **gradient relevance** (Chefer et al. 2021) adds, layer by layer "
            "from the first, the head mean of the positive part of gradient x attention times the relevance so "
            "far; **gradient-weighted rollout** fuses gradient x attention over heads and rolls it out; **LeGrad** "
            "(Bousselham et al. 2024) reads the class from every layer's output and sums, over layers, the positive "
            "part of that score's gradient with respect to the layer's attention. Deletion "
            "removes patches in each map's order (insertion reveals them) and follows the class probability: a "
            "faithful map makes it fall fast and rise fast; a random order is the baseline.",
            elem_classes="vv-caption",
        )
        with gr.Row():
            self.target_class = gr.Dropdown([], label="Class to explain", filterable=True, elem_id="vv-class", scale=3)
            self.explain_scale = gr.Radio(EXPLAIN_SCALES, value=EXPLAIN_SCALES[0], label="Colour scale", elem_id="vv-explain-scale", scale=2)
        self.explain_note = gr.Markdown("", elem_id="vv-explain-note")
        self.explain_imgs = {}
        for pair in (METHODS[i : i + 2] for i in range(0, len(METHODS), 2)):
            with gr.Row(elem_classes="vv-pair"):
                for m in pair:
                    self.explain_imgs[m] = figure(ViewImage, label=registered_method(m).title, elem_id=f"vv-explain-{m}")
        with gr.Row():
            self.faith_button = gr.Button("Measure faithfulness (deletion and insertion)", size="sm", elem_id="vv-faith-run", scale=3)
            self.faith_stop = gr.Button("Stop", size="sm", elem_id="vv-faith-stop", scale=1, min_width=60)
        self.faith_img = figure(label="Deletion and insertion", elem_id="vv-faith")
        self.faith_table = gr.Dataframe(headers=["Order", "Deletion AUC (lower is better)", "Insertion AUC (higher is better)"],
                                        label="Area under each curve", visible=False, wrap=True,  # shown with its rows
                                        column_widths=["30%", "35%", "35%"], elem_id="vv-faith-table")
        self.draw_inputs = [self.target_class, self.explain_scale]
        self.draw_outputs = [self.explain_note, self.faith_img, self.faith_table, *self.explain_imgs.values()]

    def analysis_outputs(self):
        return [self.target_class, self.faith_img, self.faith_table, self.faith_button, self.faith_stop]

    def analysed(self, done: Analysed) -> Outputs:
        a = done.exp.analysis
        top = a.predictions(1)
        if done.same_model:  # the model's class list is on the page already
            classes = gr.update(value=top[0][0] if top else None)
        else:
            classes = gr.update(choices=list(a.categories or []), value=top[0][0] if top else None, interactive=a.probabilities is not None)
        # deletion and insertion follow a class's probability: without a classifier, not offered
        measurable = bool(a.layout.classifier and a.categories is not None)
        return {self.target_class: classes, self.faith_img: gr.update(value=None, visible=measurable),
                self.faith_table: gr.update(value=None, visible=False), self.faith_button: gr.update(visible=measurable),
                self.faith_stop: gr.update(visible=measurable)}

    def draw(self, ref: SessionRef, target: str | None = None, scale_value: str = EXPLAIN_SCALES[0]) -> Outputs:
        return self.on_explain(ref, target, scale_value)

    def skip_refresh(self, ref: SessionRef) -> bool:
        """After an analysis: a class picked for it meanwhile is newer than the one read when it began."""
        return ref.key in self.explained

    def on_explain(self, ref: SessionRef | None, target: str | None, scale_value: str = EXPLAIN_SCALES[0],
                   request: gr.Request = None, *, keep_faithfulness: bool = False) -> Outputs:
        """The Explain tab: every method's map for the chosen class (one forward and one backward)."""
        exp = self.server.recall(ref)
        a = exp.analysis
        if a.layout.classifier and a.categories is not None and target not in a.categories:
            raise runtime.error("Pick one of the model's classes to explain.")
        scale = runtime.scale_of(scale_value, EXPLAIN_SCALES)
        left_out: dict[str, str] = {}
        with self.server.job("explain", a.variant, request):
            maps, index = self.server.explain(exp, target, left_out)
        label = a.categories[index] if index is not None else "no-class"
        pictures = views.render_method_maps(exp, maps, label=label, scale=scale)
        if index is None:
            note = (f"**{a.variant} has no classifier**: the gradient methods need a class logit, so only the attention of the "
                    "last layer and its rollout are shown." + (" Its phrases, zero-shot labels included, are explained in the Find tab."
                                                               if a.layout.text else ""))
        else:
            note = f"Explaining **{label}** ({float(a.probabilities[index]):.1%})."
        missing = [registered_method(m).title for m in METHODS if m not in maps]
        about = drawer(exp).maps_note(exp, missing)
        if about:
            note += " " + about
        if left_out:
            note += " " + " ".join(left_out.values())
        faith = {self.faith_img: gr.skip(), self.faith_table: gr.skip()} if keep_faithfulness else {self.faith_img: None, self.faith_table: gr.update(value=None, visible=False)}
        self.explained.add(ref.key)
        # a method with no map for this model (said in the note) leaves no empty frame
        drawn = {self.explain_imgs[m]: gr.update(value=pictures.get(m), visible=m in pictures) for m in METHODS}
        return {self.explain_note: note, **faith, **drawn}

    def on_explain_scale(self, ref: SessionRef | None, target: str | None, scale_value: str, request: gr.Request = None) -> Outputs:
        """The Explain tab's colour scale changed: the maps drawn again; the curves do not depend on it."""
        return self.on_explain(ref, target, scale_value, request, keep_faithfulness=True)

    def on_faithfulness(self, ref: SessionRef | None, target: str | None, progress=gr.Progress(), request: gr.Request = None) -> Outputs:
        """Deletion and insertion curves of every method for the chosen class, with a random order beside."""
        exp = self.server.recall(ref)
        a = exp.analysis
        if a.categories is None or not a.layout.classifier:
            raise runtime.error(f"{a.variant} has no classifier: deletion and insertion measure the probability of a class.")
        if target not in a.categories:
            raise runtime.error("Pick one of the model's classes first.")
        progress(0, desc="Deleting and inserting patches (every method, 17 steps each)")
        with self.server.job("faithfulness", a.variant, request) as work:
            maps, index = self.server.explain(exp, target)
            curves = self.server.faithfulness(exp, maps, index, work.cost.batch, work.check)
        figure_ = plots.faithfulness_figure(curves, title=f"{a.variant}: {target}")
        rows = [[name, f"{float(c.deletion_auc[0]):.3f}", f"{float(c.insertion_auc[0]):.3f}"] for name, c in curves.items()]
        return {self.faith_img: plots.named(plots.figure_to_image(figure_), views._name(exp, "faithfulness", target)),
                self.faith_table: gr.update(value=rows, visible=True)}

    def on_stop(self, request: gr.Request = None) -> Outputs:
        """Stops this session's running model work (the faithfulness curves)."""
        stopped = self.server.work.cancel(getattr(request, "session_hash", None))
        return {self.explain_note: "Stopped." if stopped else gr.skip()}

    def on_pick_class(self, ref: SessionRef | None, scale_value: str, evt: gr.SelectData) -> Outputs:
        """A click on a prediction: that class, explained, in the Explain tab."""
        label = evt.value if isinstance(evt.value, str) else (evt.value or {}).get("label") if isinstance(evt.value, dict) else None
        if isinstance(ref, SessionRef) and self.server.recall(ref).analysis.layout.text:
            return gr.skip()  # a zero-shot label: the Find tab looks for it
        shown = {self.target_class: label, self.page.tabs: gr.Tabs(selected=self.id), self.page.current_tab: self.id}
        if isinstance(ref, SessionRef) and self.lacks(self.server.recall(ref)) is not None:
            return shown  # the tab says why it has nothing to show
        return {**shown, **self.on_explain(ref, label, scale_value)}

    def wire(self, page) -> None:
        shown = [page.state, self.target_class, self.explain_scale]
        outputs = self.draw_outputs
        self.target_class.input(self.on_explain, shown, outputs, api_visibility="undocumented", api_name="session_explain", **page.model)
        self.explain_scale.change(self.on_explain_scale, shown, outputs, api_visibility="private", **page.model)
        predictions = page.tab("predict").predictions  # a click on a prediction explains that class
        predictions.select(self.on_pick_class, [page.state, self.explain_scale], [self.target_class, page.tabs, page.current_tab, *outputs],
                           api_visibility="private", **page.model)
        faith = self.faith_button.click(self.on_faithfulness, [page.state, self.target_class], [self.faith_img, self.faith_table],
                                        api_visibility="undocumented", api_name="session_faithfulness", **page.model)
        self.faith_stop.click(self.on_stop, None, self.explain_note, cancels=[faith], api_visibility="private", queue=False)


TAB = register_tab(ExplainTab())
