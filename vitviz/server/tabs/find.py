"""The Find tab: phrases typed in words, and where the image shows each (image–text models).

The target is each phrase's image–text similarity (CLIP's `logits_per_image`); the image tower runs
once for all the phrases and one batched backward gives every phrase's map (`vitviz.explain` with
`text=`). Hidden, with the reason, for a model without a text tower.
"""

from __future__ import annotations

import gradio as gr

from vitviz.explainers import method as registered_method, methods
from vitviz.imagetext import DEFAULT_TEMPLATE
from vitviz.server import runtime
from vitviz.server.guards.gradio_io import ViewImage
from vitviz.server.guards.sessions import SessionRef
from vitviz.server.pictures import views
from vitviz.server.runtime import Outputs
from vitviz.server.tabs.base import Tab, figure, register_tab

MAX_PHRASES = 4
MAX_PHRASE_CHARS = 80
# the methods that explain whatever score is differentiated: a phrase's similarity here
PHRASE_METHODS = tuple(m for m in methods() if registered_method(m).needs_target and "classifier" not in registered_method(m).needs)


def parse_phrases(text: object) -> list[str]:
    """The comma-separated phrases of `text`: 1 to `MAX_PHRASES`, each at most `MAX_PHRASE_CHARS`
    characters; a `gr.Error` says what is wrong."""
    if not isinstance(text, str):
        raise runtime.error("Type one or more phrases, separated by commas (e.g. a red star, a blue circle).")
    phrases = [p.strip() for p in text.split(",") if p.strip()]
    if not phrases:
        raise runtime.error("Type one or more phrases, separated by commas (e.g. a red star, a blue circle).")
    if len(phrases) > MAX_PHRASES:
        raise runtime.error(f"At most {MAX_PHRASES} phrases at a time (you typed {len(phrases)}).")
    long = [p for p in phrases if len(p) > MAX_PHRASE_CHARS]
    if long:
        raise runtime.error(f"A phrase is at most {MAX_PHRASE_CHARS} characters long.")
    return phrases


class FindTab(Tab):
    id = "find"
    label = "Find"
    needs = frozenset({"text", "global_attention"})

    def build(self, page) -> None:
        gr.Markdown(
            "Where the image shows a phrase: type one or several, separated by commas. Each map is the chosen "
            "method's relevance for that phrase's image–text similarity (the scaled cosine of the image and text "
            "embeddings, shown with each map); the image is seen once for all of them.",
            elem_classes="vv-caption",
        )
        with gr.Row():
            self.phrases = gr.Textbox(placeholder="a red star, a blue circle", label="Phrases", elem_id="vv-phrases",
                                      max_length=MAX_PHRASES * (MAX_PHRASE_CHARS + 2), lines=1, max_lines=1, scale=3)
            self.method = gr.Radio(list(PHRASE_METHODS), value=PHRASE_METHODS[0] if PHRASE_METHODS else None, label="Method",
                                   elem_id="vv-find-method", scale=2)
            self.run = gr.Button("Find", variant="primary", elem_id="vv-find-run", scale=1, min_width=80)
        self.note = gr.Markdown("", elem_id="vv-find-note")
        self.maps = []
        for pair in range(0, MAX_PHRASES, 2):
            with gr.Row(elem_classes="vv-pair"):
                for k in range(pair, pair + 2):
                    self.maps.append(figure(ViewImage, label=f"Phrase {k + 1}", visible=False, elem_id=f"vv-find-{k + 1}"))

    def analysis_outputs(self):
        return [self.note, *self.maps]

    def analysed(self, done) -> Outputs:
        """A new analysis: the maps of the previous one go."""
        return {self.note: "", **{m: gr.update(value=None, visible=False) for m in self.maps}}

    def on_find(self, ref: SessionRef | None, text: str, method_name: str, request: gr.Request = None) -> Outputs:
        """Each phrase's map for the session's analysis, side by side, with its similarity."""
        exp = self.server.recall(ref)
        a = exp.analysis
        why = self.lacks(exp)
        if why:
            raise runtime.error(why)
        phrases = parse_phrases(text)
        if method_name not in PHRASE_METHODS:
            raise runtime.error(f"The method must be one of {', '.join(PHRASE_METHODS)}.")
        layer_gradients = registered_method(method_name).needs_layer_gradients
        with self.server.job("explain", a.variant, request, layer_gradients=layer_gradients, phrases=len(phrases)):
            maps, similarities = self.server.find(exp, phrases, method_name)
        pictures = views.render_phrase_maps(exp, maps, phrases, method=method_name)
        out: Outputs = {}
        for k, slot in enumerate(self.maps):
            if k < len(phrases):
                out[slot] = gr.update(value=pictures[k], label=f"“{phrases[k]}” — similarity {float(similarities[k]):.2f}", visible=True)
            else:
                out[slot] = gr.update(value=None, visible=False)
        best = max(range(len(phrases)), key=lambda k: float(similarities[k]))
        out[self.note] = (f"{registered_method(method_name).title} for {len(phrases)} phrase{'s' if len(phrases) > 1 else ''}; "
                          f"the image is closest to **{phrases[best]}** ({float(similarities[best]):.2f}).")
        return out

    def on_pick_label(self, ref: SessionRef | None, method_name: str, evt: gr.SelectData, request: gr.Request = None) -> Outputs:
        """A click on a zero-shot prediction: its prompt, found in the image, in this tab."""
        label = evt.value if isinstance(evt.value, str) else (evt.value or {}).get("label") if isinstance(evt.value, dict) else None
        if not isinstance(ref, SessionRef) or not self.server.recall(ref).analysis.layout.text or not isinstance(label, str):
            return gr.skip()  # a class of a classifier: the Explain tab explains it
        phrase = DEFAULT_TEMPLATE.replace("{}", label)[:MAX_PHRASE_CHARS].replace(",", " ")
        shown = {self.phrases: phrase, self.page.tabs: gr.Tabs(selected=self.id), self.page.current_tab: self.id}
        return {**shown, **self.on_find(ref, phrase, method_name, request)}

    def wire(self, page) -> None:
        inputs, outputs = [page.state, self.phrases, self.method], [self.note, *self.maps]
        page.tab("predict").predictions.select(self.on_pick_label, [page.state, self.method], [self.phrases, page.tabs, page.current_tab, *outputs],
                                               api_visibility="private", **page.model)
        self.run.click(self.on_find, inputs, outputs, api_visibility="undocumented", api_name="session_find", **page.model)
        self.phrases.submit(self.on_find, inputs, outputs, api_visibility="private", **page.model)


TAB = register_tab(FindTab())
