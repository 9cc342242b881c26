"""The Explorer tab: what one token attends to at one layer, drawn in the browser from the analysis's
data, or by the server for a model too large for it. The tab builds every registered browser widget
(`drawers.widgets()`: "global", `explorer.js`; "windowed", `swin_explorer.js`, a query's attention on
its layer's stage grid, its window outlined) and shows the one the analysis' drawer names
(`EXPLORER_WIDGET`) with the value it writes (`write_explorer`, the one producer of that value). The
value goes to the page with the analysis' outputs, whatever the layout (its files written while the
forward runs, or after it within the analysis' job); a page that named its analysis may get the
same value earlier (`explorer_early`)."""

from __future__ import annotations

from pathlib import Path

import gradio as gr

from vitviz.server import runtime
from vitviz.server.guards import inputs
from vitviz.server.guards.gradio_io import ViewImage, client_address
from vitviz.server.guards.sessions import SessionRef
from vitviz.server.menus import head_choices
from vitviz.server.pictures import explorer_data, views
from vitviz.server.pictures.drawers import drawer, widgets
from vitviz.server.runtime import Outputs
from vitviz.server.tabs.base import Analysed, Tab, figure, register_tab

SCALES = ("one per layer", "each map its own", "all layers and heads")  # as `views` names them: "layer", "map", "shared"
LAYER_WAIT = 10.0  # seconds a layer's file waits for its memory before it is answered "busy"


def explorer_layer(request: list) -> str | dict:
    """The browser's call for one layer's file (the "layers" layout): [analysis key, layer] -> its path,
    or {"error": why, "busy": whether asking again later may work} (busy: too many calls at once, or
    no memory free in `LAYER_WAIT` s; not: an unknown or dropped key, a layer out of range). The key is the
    session's own secret. A file already written is answered at once; one to write takes a job that
    needs no lane (a layer's rows quantised, its memory within the shared budget), so that a long
    job of another session does not hold the page's layers back."""
    try:
        return _explorer_layer(request)
    except gr.Error as exc:  # answered, not raised: Gradio's component-server route has no error path (a bare 500 and a logged traceback)
        return {"error": str(exc.message), "busy": getattr(exc, "busy", False)}  # (plain text: the page shows it as text)


def _explorer_layer(request: list) -> str:
    try:
        key, layer_value = request
    except (TypeError, ValueError):
        raise runtime.error("explorer_layer takes [key, layer].") from None
    exp = TAB.server.store.get(key) if isinstance(key, str) else None
    if exp is None:
        raise runtime.error("This analysis is no longer kept: analyse the image again.")
    mode = drawer(exp).explorer_mode(exp)
    if mode != "layers":  # one file for the browser, written with or after the analysis, or no file: drawn by the server
        raise runtime.error(f"This analysis' explorer has no layer files (its layout is {mode!r}).")
    layer_value = runtime.checked(inputs.index, layer_value, 1, exp.analysis.attentions.shape[0], "layer")
    path = explorer_data.layer_path(TAB.server.explorer_dir, key, layer_value)
    if path.exists():  # (written whole under a temporary name, then renamed)
        return str(path)
    # outside the queue, on Gradio's shared thread pool: a few at a time, none waiting long
    calls = TAB.server.explorer_calls
    if not calls.acquire(blocking=False):
        refused = runtime.error("The server is busy (too many layers asked for at once): ask again in a moment.")
        refused.busy = True
        raise refused
    try:  # (a refusal of the job says whether it was busy: no memory free in its wait)
        with TAB.server.explorer_locks.hold((key, layer_value)), \
                TAB.server.job("explorer_layer", exp.analysis.variant, wait=LAYER_WAIT, lane=False) as work:
            TAB.server.explorer_sweep(room=work.cost.kept_bytes)
            written = explorer_data.write_layer(exp, key=key, layer=layer_value, folder=TAB.server.explorer_dir)
        if key not in TAB.server.store:  # dropped while it was written: its files went before this one was complete
            Path(written).unlink(missing_ok=True)
            raise runtime.error("This analysis is no longer kept: analyse the image again.")
        return written
    finally:
        calls.release()


async def explorer_early(request: list, http: gr.Request) -> dict | None:
    """The browser's call for the explorer of an analysis on its way (`vitviz.server.early`):
    [ticket, "pictures"] -> the explorer's pictures, written before the forward; [ticket, "explorer"]
    -> the explorer's value once the forward has written its file, with the first view's data inline.
    None: no such analysis, or its explorer comes with its outputs. Waits without a thread, at most a
    minute, a few per network address, none after its caller has gone."""
    try:
        ticket, step = request
    except (TypeError, ValueError):
        return None
    gone = getattr(http, "is_disconnected", None)
    return await TAB.server.early.wait(ticket, step, owner=client_address(http), gone=gone if callable(gone) else None)


class ExplorerTab(Tab):
    id = "explorer"
    label = "Explorer"
    needs = frozenset()  # every token layout's drawer has an explorer (`drawers.PROTOCOL`)

    def build(self, page) -> None:
        gr.Markdown("What one token attends to at one layer, for one head or fused over heads, and every head beside it.",
                    elem_classes="vv-caption")
        self.boxes: dict[str, gr.Column] = {}  # each registered widget (`drawers.widgets()`) in its column, by name
        self.live: dict[str, gr.HTML] = {}
        for i, widget in enumerate(widgets()):
            with gr.Column(visible=i == 0) as self.boxes[widget.name]:
                calls = [explorer_layer, explorer_early] if widget.server_calls else []
                self.live[widget.name] = gr.HTML(value=None, html_template=widget.files["html"], css_template=widget.files["css"],
                                                 js_on_load=widget.files["js"], server_functions=calls, elem_id=widget.elem_id)
                if widget.caption:
                    gr.Markdown(widget.caption, elem_classes="vv-caption")
        # the server's explorer: the API's, and the page's for models too large for the browser
        with gr.Group(visible=False) as self.server_explorer:
            with gr.Row():
                self.layer = gr.Slider(1, 12, value=12, step=1, label="Layer", elem_id="vv-layer")
                self.head = gr.Dropdown(["mean", "max"], value="mean", label="Head", elem_id="vv-head")
                self.scale_choice = gr.Radio(SCALES, value=SCALES[0], label="Colour scale", elem_id="vv-scale")
            with gr.Row():
                self.query_text = gr.Markdown("query: the cls token", elem_id="vv-query")
                self.query = gr.Number(0, precision=0, minimum=0, visible=False, label="Query token")
                self.prefix_query = gr.Radio(["cls"], value=None, label="Or a prefix token as the query", elem_id="vv-prefix-query")
            with gr.Row(elem_classes="vv-pair"):
                self.explorer_img = figure(ViewImage, label="The query's attention (click a patch)", elem_id="vv-explorer")
                self.mosaic = figure(ViewImage, label="All heads of this layer", elem_id="vv-mosaic")
        gr.Markdown(
            "Hover over a patch to see its attention, click to pin it (click again to let go), or pick a prefix "
            "token; by keyboard, Tab to the map, then arrows, Enter and Escape. Each map is a row of "
            "softmax(q·kᵀ/√d) over the patches. Colour scale: **one per layer** puts the map and every head of "
            "the layer on one colour bar; **each map its own** stretches each to its own range (a head's range "
            "beneath its tile); **all layers and heads** lets layers be compared too. Drawn in your browser "
            "from the analysis (8 bits per weight).",
            elem_classes="vv-caption",
        )

    def analysis_outputs(self):
        return [self.prefix_query, self.layer, self.head, self.query, self.query_text, *self._live_outputs()]

    def _live_outputs(self) -> list:
        return [*self.live.values(), *self.boxes.values(), self.server_explorer, self.explorer_img, self.mosaic]

    def _shown(self, kind: str | None, live: dict | None) -> Outputs:
        """The widget `kind` shown with the value `live`, every other one hidden and emptied."""
        out: Outputs = {}
        for name, widget in self.live.items():
            out[widget] = live if name == kind else None
            out[self.boxes[name]] = gr.update(visible=name == kind)
        return out

    def analysed(self, done: Analysed) -> Outputs:
        exp, a = done.exp, done.exp.analysis
        depth, heads, _ = drawer(exp).explorer_bounds(exp)
        same = done.same_model  # the same choices and bounds as for the last analysis: the values alone
        return {
            self.prefix_query: None if same else gr.update(choices=list(a.query_names), value=None),
            self.layer: depth if same else gr.update(maximum=depth, value=depth),
            self.head: "mean" if same else gr.update(choices=head_choices(heads), value="mean"),
            self.query: 0,
            self.query_text: drawer(exp).describe_query(exp, 0),
            **self._explorer(exp, same_model=same),
        }

    def unfit(self, done: Analysed) -> Outputs:
        """A model the tab cannot draw: every widget emptied and the server's explorer hidden (the
        line saying why is in their place)."""
        return {**{c: gr.skip() for c in self.analysis_outputs()}, **{widget: None for widget in self.live.values()},
                self.server_explorer: gr.update(visible=False)}

    def _explorer(self, exp: views.Exploration, *, same_model: bool = False) -> Outputs:
        """The explorer of `exp` as its analysis brings it: the value its drawer writes (`write_explorer`;
        the files named by `exp.key`, the stack's written while the forward ran, a windowed model's
        now, within the analysis' job) in the widget that draws it; for a model too large for the
        browser, the server's explorer with its first views (the last layer, the heads' mean, token 0)."""
        drawn = drawer(exp)
        with self.server.explorer_locks.hold(exp.key):
            live = drawn.write_explorer(exp, key=exp.key, folder=self.server.explorer_dir)
        on_server = live["mode"] == "server"  # too large for the browser: the server draws the explorer
        depth = drawn.explorer_bounds(exp)[0]
        first = self._pictures(exp, depth, "mean", 0, "layer") if on_server else {self.explorer_img: None, self.mosaic: None}
        shown = {**self._shown(drawn.EXPLORER_WIDGET, live), self.server_explorer: gr.update(visible=on_server), **first}
        return {**shown, **({c: gr.skip() for c in self.boxes.values()} if same_model else {})}

    def _pictures(self, exp: views.Exploration, layer: int, head: str, query: int, scale: str) -> Outputs:
        """The server's explorer: the query's map and the layer's heads (a Swin's on its stage grid, its window outlined)."""
        draw = drawer(exp)
        return {self.explorer_img: draw.render_query(exp, layer=layer, head=head, query=query, scale=scale),
                self.mosaic: draw.render_head_mosaic(exp, layer=layer, query=query, scale=scale)}

    def on_view(self, ref: SessionRef | None, layer_value: float, head_value: str, query_value: float, scale_value: str = SCALES[0]) -> Outputs:
        """Layer, head, query or colour scale changed: the explorer drawn again from the stored attention."""
        exp = self.server.recall(ref)
        draw = drawer(exp)
        depth, _, _ = draw.explorer_bounds(exp)
        layer_value = runtime.checked(inputs.index, layer_value, 1, depth, "layer")
        _, heads, queries = draw.explorer_bounds(exp, layer_value)
        head_value = runtime.checked(inputs.head, head_value, heads)
        query_value = runtime.checked(inputs.index, query_value, 0, queries - 1, "query token")
        scale = runtime.scale_of(scale_value, SCALES)
        refusal = draw.scale_refusal(scale)
        if refusal:
            raise runtime.error(refusal)
        return self._pictures(exp, layer_value, head_value, query_value, scale)

    def on_click(self, ref: SessionRef | None, layer_value: float, head_value: str, scale_value: str, evt: gr.SelectData) -> Outputs:
        """A click on the explorer image picks that patch as the query."""
        exp = self.server.recall(ref)
        x, y = runtime.click_xy(evt)
        draw = drawer(exp)
        query_value = draw.patch_at(exp, x, y)
        shown = self.on_view(ref, layer_value, head_value, query_value, scale_value)  # the values checked
        text = draw.describe_query(exp, query_value, layer=int(float(layer_value)))  # (a stage's token, for a windowed model)
        return {self.query: query_value, self.query_text: text, self.prefix_query: None, **shown}

    def on_prefix_query(self, ref: SessionRef | None, layer_value: float, head_value: str, name: str | None,
                        scale_value: str = SCALES[0]) -> Outputs:
        """A prefix token (cls, distillation, a register) or a mean-pooled model's "pool" as the query."""
        exp = self.server.recall(ref)
        names = exp.analysis.query_names
        if name not in names:
            raise runtime.error(f"The query token must be one of {', '.join(names)}.")
        index = names.index(name)
        text = drawer(exp).describe_query(exp, index)
        return {self.query: index, self.query_text: text,
                **self.on_view(ref, layer_value, head_value, index, scale_value)}

    def wire(self, page) -> None:
        view_inputs, shown = [page.state, self.layer, self.head, self.query, self.scale_choice], [self.explorer_img, self.mosaic]
        self.layer.input(self.on_view, view_inputs, shown, api_visibility="undocumented", api_name="session_view", trigger_mode="always_last")
        self.head.change(self.on_view, view_inputs, shown, api_visibility="private", trigger_mode="always_last")
        self.scale_choice.change(self.on_view, view_inputs, shown, api_visibility="private", trigger_mode="always_last")
        self.explorer_img.select(self.on_click, [page.state, self.layer, self.head, self.scale_choice],
                                 [self.query, self.query_text, self.prefix_query, *shown], api_visibility="private")
        self.prefix_query.input(self.on_prefix_query, [page.state, self.layer, self.head, self.prefix_query, self.scale_choice],
                                [self.query, self.query_text, *shown], api_visibility="private")


TAB = register_tab(ExplorerTab())
