"""The page: its header, the inputs column, the results with every registered tab (built, filled and
wired in one loop, `vitviz.server.tabs`), the analysis and the event chain after it, the hidden API
endpoints (`analyze`, `explain`, `attention`) and the session endpoints (`session_*`).

Handlers return their outputs by component and are callable directly in tests; the components live
on `PAGE` (the page's own) and on each tab's object (`tabs.<name>.TAB`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import gradio as gr
from PIL import ImageOps

from vitviz.cost import price
from vitviz.images import describe_limits
from vitviz.server import runtime
from vitviz.server.guards import inputs
from vitviz.server.guards.gradio_io import GuardedBlocks, PngImage, UploadedImage
from vitviz.server.guards.sessions import SessionRef
from vitviz.server.menus import spec_line, variant_choices
from vitviz.server.pictures import views
from vitviz.server.pictures.drawers import drawer
from vitviz.server.runtime import EXAMPLES, Outputs
from vitviz.server.tabs import TABS, Analysed, Tab
from vitviz.server.tabs.base import gate
from vitviz.server.tabs.explain import METHODS
from vitviz.sources import checkpoint_dir, get_spec

HERE = Path(__file__).resolve().parent
# after an analysis on a narrow screen the page goes to its results (they sit under the inputs there)
AFTER_ANALYSIS_JS = (HERE / "app.js").read_text()
# before an analysis goes to the queue: the page names it with a ticket and asks for its explorer at
# once (`vitviz.server.early`; the explorer's widget defines `vitvizTicket`), the other inputs as they are
NAME_ANALYSIS = "(...values) => [...values.slice(0, 5), window.vitvizTicket ? window.vitvizTicket() : '']"


class Page:
    """The page's own components (set by `build`), the server it runs on (`server`), and what the tabs add to it."""

    server: runtime.Server

    def __init__(self) -> None:
        self.gates = []  # every content that needs something of the model (`tabs.base.gate`)
        self.variant_menus = []  # (menu, its choices given a session's added names): a model added by name joins them
        self.analysis_outputs = []
        # everything that runs a model or builds analysis data shares one concurrency group, handed to
        # threads as soon as one address' share allows; inside it the work budget (which the explorer's
        # component-server calls take too) runs the lanes by turns
        self.model: dict = {}

    @staticmethod
    def tab(tab_id: str) -> Tab:
        return TABS.by_id(tab_id)

    @property
    def on_demand(self) -> list[Tab]:
        return [t for t in TABS if t.on_demand]

    @property
    def draw_inputs(self) -> list:
        return [c for t in self.on_demand for c in t.draw_inputs]

    @property
    def draw_outputs(self) -> list:
        return [c for t in self.on_demand for c in t.draw_outputs]


PAGE = Page()


def build(server: runtime.Server) -> gr.Blocks:
    """The whole page on `server`, wired (once in a process: the components are `PAGE`'s and the tabs')."""
    PAGE.server = server
    PAGE.model = dict(concurrency_id="model", concurrency_limit=server.settings.dispatched)
    with GuardedBlocks(title="vitviz — look inside Vision Transformers", delete_cache=(600, 1800)) as demo:
        # the session's reference to its analysis (the analysis itself is in the server's store)
        PAGE.state = gr.State(None, time_to_live=3600, delete_callback=server.forget)
        PAGE.custom_models = gr.State([])  # timm / Hugging Face names this session added to the menus
        PAGE.current_tab = gr.State(TABS.tabs[0].id)
        gr.Markdown(
            "# vitviz — look inside Vision Transformers\n"
            f"Upload a photo, pick a ViT, and see what it predicts and how it got there. Running on **{runtime.device_line()}**. "
            f"Default model: {runtime.DEFAULT_REASON}.".replace(str(checkpoint_dir()), f"`{checkpoint_dir()}`")
        )
        with gr.Row(equal_height=False):
            with gr.Column(scale=1, min_width=300):
                _inputs()
            with gr.Column(scale=2, min_width=320):
                _results()
        _api()
        _wire()
    return demo


def _inputs() -> None:
    PAGE.image = UploadedImage(label="Image", type="filepath", sources=["upload", "clipboard"], height=320, elem_id="vv-image")
    PAGE.variant = gr.Dropdown(
        variant_choices(), value=runtime.DEFAULT_VARIANT, label="Model variant", elem_id="vv-variant", allow_custom_value=True
    )
    PAGE.variant_info = gr.Markdown(spec_line(runtime.DEFAULT_VARIANT), elem_classes="vv-caption")
    with gr.Row():
        PAGE.other_model = gr.Textbox(
            placeholder="timm:<name> or hf:<org/name>", label="Another timm or Hugging Face ViT (@<px> for a size, @whole for the whole image)",
            elem_id="vv-other", scale=3, max_length=200, lines=1, max_lines=1,
        )
        PAGE.use_other = gr.Button("Use", size="sm", scale=1, min_width=60, elem_id="vv-other-use")
    PAGE.run = gr.Button("Analyse", variant="primary", elem_id="vv-run")
    PAGE.examples = None
    if EXAMPLES:  # a click fills the image and analyses it, as an upload does (`_wire`)
        PAGE.examples = gr.Examples(EXAMPLES, inputs=PAGE.image, label="Examples (click one to analyse it)", elem_id="vv-examples")
    gr.Markdown(f"Images: {describe_limits()}.", elem_classes="vv-caption")


def _results() -> None:
    """The notice, the status line and every registered tab: each tab's content in a column that a
    model lacking the tab's needs hides behind one line saying why (the tab itself stays)."""
    PAGE.notice = gr.HTML("", elem_id="vv-notice")
    with gr.Column(elem_classes=["vv-results"], elem_id="vv-results") as PAGE.results_box:
        with gr.Row(equal_height=True):
            PAGE.result_thumb = gr.Image(None, show_label=False, interactive=False, container=False, height=56, width=56,
                                         min_width=56, scale=0, elem_id="vv-result-thumb", buttons=[])
            PAGE.status = gr.Markdown("", elem_id="vv-status")
        with gr.Tabs(overflow_behavior="wrap") as PAGE.tabs:
            for tab in TABS:
                tab.page = PAGE
                with gr.Tab(tab.label, id=tab.id):
                    tab.gate = gate(tab.needs, f"vv-{tab.id}", PAGE.gates, waits=tab.waits, why=tab.lacks)
                    with tab.gate.content:
                        tab.build(PAGE)
    PAGE.analysis_outputs = [
        PAGE.state, PAGE.notice, PAGE.results_box, PAGE.result_thumb, PAGE.image, PAGE.variant, PAGE.status,
        *[c for g in PAGE.gates for c in (g.note, g.content)], *[c for t in TABS for c in t.analysis_outputs()],
    ]


def _api() -> None:
    """The hidden components of the API endpoints."""
    with gr.Row(visible=False):
        PAGE.api_button = gr.Button("api")
        PAGE.api_explain_button = gr.Button("explain")
        PAGE.api_attention_button = gr.Button("attention")
        PAGE.api_pred = gr.Label()
        PAGE.api_rollout = PngImage(interactive=False)
        PAGE.api_distance = PngImage(interactive=False)
        PAGE.api_npz = gr.File()
        PAGE.api_variant = gr.Textbox(label="variant")  # any name, not only the menu's (the server checks it)
        PAGE.api_target = gr.Textbox(label="class")
        PAGE.api_method = gr.Textbox(label="method", value="gradient")
        PAGE.api_layer = gr.Number(label="layer", precision=0)
        PAGE.api_head = gr.Textbox(label="head", value="mean")
        PAGE.api_query = gr.Number(label="query token", precision=0)
        PAGE.api_map = PngImage(interactive=False)
        PAGE.api_session_button = gr.Button("session analyse")  # the page's analysis for a client, in its session
        PAGE.ticket = gr.Textbox("", max_length=64)  # the page's name for its analysis (NAME_ANALYSIS)


def _wire() -> None:
    """The page's events, then each tab's own.

    The session endpoints (undocumented, callable with gradio_client) keep the analysis in the
    caller's session, as the page does: `python -m vitviz.dev.bench --app` times view changes through
    them. Dropdowns and radios answer `.change` (a click on a menu option fires `.input` twice);
    sliders answer `.input`, which fires while dragging, on arrow keys and on a typed number, and
    "always_last" draws the value the control ends on.
    """
    model, predict = PAGE.model, PAGE.tab("predict")
    analysis_inputs = [PAGE.image, PAGE.variant, predict.head_fusion, predict.discard, PAGE.state, PAGE.ticket]
    # Progress shows on the rollout and the status line only: a spinner on every output costs the
    # browser time the analysis needs on a small machine.
    analyse = dict(show_progress_on=[predict.rollout_img, PAGE.status], js=NAME_ANALYSIS, **model)
    outputs = PAGE.analysis_outputs
    _analysis(PAGE.run.click(on_analyze, analysis_inputs, outputs, api_visibility="private", **analyse))
    # the same for a client (no ticket: its explorer comes with the outputs)
    PAGE.api_session_button.click(on_analyze, analysis_inputs[:-1], outputs, api_visibility="undocumented", api_name="session_analyze",
                                  **model)
    _analysis(PAGE.image.upload(on_analyze, analysis_inputs, outputs, api_visibility="private", **analyse))
    if PAGE.examples is not None:  # an example analyses as an upload does, once its image is in place
        _analysis(PAGE.examples.load_input_event.then(on_analyze, analysis_inputs, outputs, api_visibility="private", **analyse))
    _analysis(PAGE.variant.change(on_variant_info, PAGE.variant, PAGE.variant_info, api_visibility="private", show_progress="hidden").then(
        on_analyze, analysis_inputs, outputs, api_visibility="private", **analyse
    ))
    PAGE.tabs.select(on_tab, [PAGE.state, *PAGE.draw_inputs], [PAGE.current_tab, *PAGE.draw_outputs], api_visibility="private", **model)
    other_outputs = [PAGE.custom_models, PAGE.notice, PAGE.variant, *[menu for menu, _ in PAGE.variant_menus]]
    PAGE.use_other.click(on_other_model, [PAGE.other_model, PAGE.custom_models], other_outputs, api_visibility="private")
    PAGE.other_model.submit(on_other_model, [PAGE.other_model, PAGE.custom_models], other_outputs, api_visibility="private")
    PAGE.api_button.click(api_analyze, [PAGE.image, PAGE.api_variant], [PAGE.api_pred, PAGE.api_rollout, PAGE.api_distance, PAGE.api_npz],
                          api_name="analyze", **model)
    PAGE.api_explain_button.click(api_explain, [PAGE.image, PAGE.api_variant, PAGE.api_target, PAGE.api_method], PAGE.api_map,
                                  api_name="explain", **model)
    PAGE.api_attention_button.click(api_attention, [PAGE.image, PAGE.api_variant, PAGE.api_layer, PAGE.api_head, PAGE.api_query],
                                    PAGE.api_map, api_name="attention", **model)
    for tab in TABS:
        tab.wire(PAGE)


def _analysis(event) -> None:
    """After an analysis is on the page (every tab's outputs, the explorer's among them, came with
    it): the page goes to the results (on a narrow screen), and the tab on show is drawn for it when
    it is one of those drawn on demand."""
    event.then(None, None, None, js=AFTER_ANALYSIS_JS, api_visibility="private", queue=False)
    event.then(on_refresh_tab, [PAGE.state, PAGE.current_tab, *PAGE.draw_inputs], PAGE.draw_outputs, api_visibility="private",
               show_progress="minimal", **PAGE.model)


# ------------------------------------------------------------------------------------------------
# The analysis

def on_analyze(image: str | None, variant: str, head_fusion: str, discard_ratio: float, ref: SessionRef | None = None,
               ticket: str | None = None, progress=gr.Progress(track_tqdm=True)) -> Outputs:
    """A new image or variant: the one handler that runs the model for an analysis.

    When nothing can be analysed (no image, an image vitviz refuses, weights that cannot be had),
    only the notice changes, saying why: the results on the page stay those of the last analysis.
    The tabs drawn on demand are drawn when shown (`on_tab`). `ticket` is the page's name for this
    analysis: its explorer goes to the page as soon as the forward has written it (`vitviz.server.early`).
    """
    with PAGE.server.early.opened(ticket) as ticket:  # closed however the handler ends: the page's wait never outlasts it
        if isinstance(ref, SessionRef) and image == ref.source and isinstance(variant, str) and variant.strip() == ref.variant:
            return {PAGE.results_box: gr.update(elem_classes=["vv-results"])}  # what is shown is this very analysis
        progress(0, desc=f"Loading {variant} (a first use may download its weights)")
        try:
            head_fusion = runtime.checked(inputs.fusion, head_fusion)
            discard_ratio = runtime.checked(inputs.ratio, discard_ratio)
            # the job lasts until every picture of the analysis is drawn; the explorer's file is written during the forward
            with PAGE.server.analysing(image, variant, explorer_key=runtime.new_key(), ticket=ticket) as exp:
                return analysis_outputs(exp, image, ref, head_fusion, discard_ratio)
        except gr.Error as exc:
            return _refused(exc, ref)


def analysis_outputs(exp: views.Exploration, image: str, ref: SessionRef | None, head_fusion: str = "mean",
                     discard_ratio: float = 0.0) -> Outputs:
    """Everything an analysis draws: the page's own outputs, every gate (shown, or the line saying
    what the model lacks) and each tab whose needs the model meets (the others: `Tab.unfit`). An
    analysis run without a key (`Server.analysing`'s `explorer_key`) is given one: its explorer's
    files are named by the key it is kept under."""
    same_model = isinstance(ref, SessionRef) and ref.variant == exp.analysis.variant
    a = exp.analysis
    if exp.key is None:
        exp = replace(exp, key=runtime.new_key())
    done = Analysed(exp, same_model=same_model, head_fusion=head_fusion, discard_ratio=discard_ratio)
    drawn: Outputs = {}
    try:  # every tab drawn (the explorer's files written) before the session's previous analysis is let go
        for g in PAGE.gates:  # what the model lacks: as it was for the same model
            drawn.update({g.note: gr.skip(), g.content: gr.skip()} if same_model else g.outputs(exp))
        for tab in TABS:
            drawn.update(tab.analysed(done) if tab.lacks(exp) is None else tab.unfit(done))
    except BaseException:  # the page keeps the previous analysis; this one's files go
        PAGE.server.explorer_files_gone(exp.key)
        raise
    PAGE.server.forget(ref)
    out: Outputs = {
        PAGE.state: PAGE.server.remember(exp, image),
        PAGE.notice: "",
        PAGE.results_box: gr.update(elem_classes=["vv-results"]),
        PAGE.result_thumb: a.image if a.image.width == a.image.height else ImageOps.pad(a.image, (max(a.image.size),) * 2, color="white"),
        PAGE.status: (
            f"**{runtime.md(runtime.file_name(image))}** on **{a.variant}** ({a.device}): {spec_line(a.variant)}. Model call "
            f"{a.model_seconds * 1e3:.0f} ms; {a.grid[0]}x{a.grid[1]} patches of {a.patch_size} px, {exp.facts.total_params:,} parameters."
        ),
    }
    return {**out, **drawn}


def _refused(exc: gr.Error, ref: SessionRef | None) -> Outputs:
    """Nothing could be analysed: say why, mark the results on the page as those of their own image
    and variant, put the menu back on a variant that works, and drop a file that is no image."""
    cause = getattr(exc, "cause", None)
    out: Outputs = {}
    message = exc.message
    if isinstance(ref, SessionRef):
        stop = "" if message.rstrip().endswith((".", "!", "?", ":")) else "."
        message += f"{stop} The results below are still those of {ref.image} on {ref.variant}."
        out[PAGE.results_box] = gr.update(elem_classes=["vv-results", "vv-stale"])
        if cause == "variant":  # the menu goes back to the variant that works
            out[PAGE.variant] = gr.update(value=ref.variant)
            message += f" The menu is back on {ref.variant}."
    if cause == "image":
        out[PAGE.image] = None  # no broken preview left behind
    gr.Warning(exc.message)
    out[PAGE.notice] = runtime.notice_html(message)
    return out


# ------------------------------------------------------------------------------------------------
# Tabs drawn on demand: `values` are those of every such tab's `draw_inputs`, in page order

def on_tab(evt: gr.SelectData, ref: SessionRef | None, *values) -> Outputs:
    """A tab was chosen: the tabs drawn on demand are drawn now (for the session's analysis)."""
    label = evt.value if isinstance(evt.value, str) else ""
    tab = TABS.by_label(label)
    tab_id = tab.id if tab is not None else label
    return {PAGE.current_tab: tab_id, **_draw_tab(ref, tab_id, values)}


def on_refresh_tab(ref: SessionRef | None, tab_id: str, *values) -> Outputs:
    """After an analysis: the tab on show, if it is drawn on demand, drawn for the new analysis —
    unless it was drawn for that analysis meanwhile (e.g. a class picked: newer than the values,
    which were read when the analysis began)."""
    tab = TABS.by_id(tab_id)
    if tab is not None and isinstance(ref, SessionRef) and tab.skip_refresh(ref):
        return _nothing()
    return _draw_tab(ref, tab_id, values)


def _draw_tab(ref: SessionRef | None, tab_id: str, values: tuple) -> Outputs:
    start = 0
    for tab in PAGE.on_demand:
        mine, start = values[start : start + len(tab.draw_inputs)], start + len(tab.draw_inputs)
        if tab.id == tab_id and isinstance(ref, SessionRef) and tab.lacks(PAGE.server.recall(ref)) is None:
            return tab.draw(ref, *mine)
    return _nothing()


def _nothing() -> Outputs:
    """Nothing to draw (an empty dict would read as no outputs at all)."""
    return {PAGE.draw_outputs[0]: gr.skip()}


# ------------------------------------------------------------------------------------------------
# The inputs column

def on_other_model(name: str, custom: list[str] | None) -> Outputs:
    """A timm or Hugging Face model by name: checked, added to this session's menus and chosen
    (choosing it runs the analysis)."""
    custom = [c for c in (custom or []) if isinstance(c, str)][-8:]
    try:
        name = PAGE.server.variant_name(name)
    except gr.Error as exc:
        gr.Warning(exc.message)
        return {PAGE.notice: runtime.notice_html(exc.message)}
    if name not in custom:
        custom.append(name)
    choices = variant_choices(custom)
    return {
        PAGE.custom_models: custom,
        PAGE.notice: "",
        PAGE.variant: gr.update(choices=choices, value=name),
        **{menu: gr.update(choices=choices_of(custom)) for menu, choices_of in PAGE.variant_menus},
    }


def on_variant_info(variant: str) -> Outputs:
    try:
        return {PAGE.variant_info: spec_line(PAGE.server.variant_name(variant))}
    except gr.Error as exc:
        return {PAGE.variant_info: runtime.md(exc.message)}


# ------------------------------------------------------------------------------------------------
# The API endpoints

def api_analyze(image: str | None, variant: str) -> Outputs:
    """Analyse an image with a Vision Transformer: its top-5 classes, the attention rollout (where the
    cls token draws from, over all layers), every head's mean attention distance, and the numbers.

    Args:
        image: the photo (an uploaded file).
        variant: the model, e.g. "shapes_p16" (embedded, offline), "vit_b_16", "timm:<name>" or
            "hf:<org/name>", optionally with "@<pixels>" for another image size.

    Returns:
        The top-5 classes with probabilities, the rollout over the image, the distance chart, and an
        .npz (rollout, cls map, distances, probabilities, the crop).
    """
    with PAGE.server.analysing(image, variant) as exp:
        size = price(get_spec(exp.analysis.variant), "export", attentions=False).kept_bytes
        try:
            path = PAGE.server.downloads.npz(exp, attentions=False, size=size)
        except ValueError as exc:
            raise runtime.error(inputs.public_text(str(exc))) from None
        drawn = drawer(exp)  # by its token layout (a Swin's rollout and distances are its own)
        return {
            PAGE.api_pred: views.render_predictions(exp) or None,
            PAGE.api_rollout: drawn.render_rollout(exp),
            PAGE.api_distance: drawn.render_distance(exp),
            PAGE.api_npz: path,
        }


def api_explain(image: str | None, variant: str, target: str, method: str) -> Outputs:
    """Explain why a Vision Transformer sees a class in an image: a relevance map over the patches.

    Args:
        image: the photo (an uploaded file).
        variant: the model, as for analyze (e.g. "shapes_p16").
        target: the class to explain, by name (empty: the top-1 class).
        method: "gradient" (Chefer et al. 2021, the default), "grad_rollout", "rollout", "attention", or a
            method a plugin registered (`vitviz.register_method`).

    Returns:
        The map over the image, with its colour bar; its file is named by the variant, method and class.
    """
    if method not in METHODS:
        raise runtime.error(f"The method must be one of {', '.join(METHODS)}.")
    exp = PAGE.server.run(image, variant)
    a = exp.analysis
    target = target or None
    if target is not None and (a.categories is None or target not in a.categories):
        raise runtime.error(f"{a.variant} has no class {target!r}: leave it empty for the top-1, or name one of its classes.")
    with PAGE.server.job("explain", a.variant):
        maps, index = PAGE.server.explain(exp, target)
    if method not in maps:
        if index is None:
            raise runtime.error(f"{a.variant} has no classifier: only attention and rollout can be shown.")
        raise runtime.error(f"{method} cannot run on {a.variant} ({a.layout.attention} attention): it offers {', '.join(maps)}.")
    label = a.categories[index] if index is not None else "no-class"
    return {PAGE.api_map: views.render_method_maps(exp, {method: maps[method]}, label=label)[method]}


def api_attention(image: str | None, variant: str, layer: float, head: str, query: float) -> Outputs:
    """What one token attends to at one layer of a Vision Transformer, over the image.

    Args:
        image: the photo (an uploaded file).
        variant: the model, as for analyze (e.g. "shapes_p16").
        layer: the layer, 1 to the model's depth.
        head: "mean", "max" or "head <k>" (1-based).
        query: the query token: 0 is the cls token (for a mean-pooled model without one, the pooled
            query "pool", after any registers); patches follow in raster order. For a Swin, 0 is the
            pooled query and 1 + r x gw + c the finest patch (r, c): its stage's token at that layer,
            drawn on the stage's grid with its window outlined.

    Returns:
        The query's attention over the patches, drawn on the image.
    """
    exp = PAGE.server.run(image, variant)
    draw = drawer(exp)  # a windowed model's: on its layer's stage grid, its window outlined
    depth, _, _ = draw.explorer_bounds(exp)
    layer = runtime.checked(inputs.index, layer, 1, depth, "layer")
    _, heads, queries = draw.explorer_bounds(exp, layer)
    head = runtime.checked(inputs.head, head, heads)
    query = runtime.checked(inputs.index, query, 0, queries - 1, "query token")
    return {PAGE.api_map: draw.render_query(exp, layer=layer, head=head, query=query)}
