"""The Ask tab: a question to a vision–language model about the analysed image, and for each word of
its answer, where in the image it came from.

For a model that is a VLM's vision tower (`VariantSpec.vlm`: the embedded `shapes_vlm`, SmolVLM,
Qwen2.5-VL, ...), `vitviz.ask` generates the greedy answer to the question about the crop the tower
saw, and keeps each token's attention over the image tokens (every layer and head) and its relevance
(Chefer et al. 2021b). The answer's words are choices: the chosen word's map (its tokens summed) is
drawn over the image, by relevance or by attention (all layers, or one), with the image tokens that
count most listed and outlined. The other tabs show the same tower.

The question is checked (a non-empty string of at most `QUESTION_CHARS` characters; a whole number of
tokens from 1 to `MAX_TOKENS`) and the request priced ("ask": `vitviz.cost`) before anything runs;
the answer is kept in the server's store for the session (its memory counted there), so choosing a
word, a method or a layer runs nothing again.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import gradio as gr
from PIL import Image, ImageDraw

from vitviz import plots
from vitviz.cost import price
from vitviz.server import runtime
from vitviz.server.guards import inputs
from vitviz.server.guards.sessions import SessionRef
from vitviz.server.pictures import views
from vitviz.server.runtime import Outputs, gpu
from vitviz.server.tabs.base import Analysed, Tab, figure, register_tab
from vitviz.sources import get_spec
from vitviz.vlm.ask import Answer, ask, vlm_of

QUESTION_CHARS = 300  # the longest question the page takes
MAX_TOKENS = 32  # the most tokens an answer may have here
DEFAULT_TOKENS = 12
WHOLE = "all"  # the word choice that is the whole answer
METHODS = [("Relevance (Chefer et al. 2021b)", "relevance"), ("Attention", "attention")]
TOP = 5  # image tokens listed for a word


@dataclass(frozen=True)
class AskRef:
    """What the session holds of its answer (the answer itself is in the server's store)."""

    key: str
    analysis: str  # the key of the analysis it was asked about (`SessionRef.key`)
    server: str


def _forget(held: object) -> None:
    if isinstance(held, AskRef):
        runtime.server_named(held.server).store.drop(held.key)


def _nbytes(answer: Answer) -> int:
    return answer.attention.numel() * 4 + answer.relevance.numel() * 4 + answer.image.nbytes + 4096


@gpu
def ask_on_device(server: str, variant: str, image: Image.Image, question: str, tokens: int) -> Answer:
    model, _ = runtime.server_named(server).cache.get(variant)
    return ask(model, image, question, max_new_tokens=tokens)


def question_of(value: object) -> str:
    """The question, checked: a non-empty string of at most `QUESTION_CHARS` characters."""
    if not isinstance(value, str) or not value.strip():
        raise runtime.error("Type a question about the image first.")
    if len(value) > QUESTION_CHARS:
        raise runtime.error(f"The question is {len(value):,} characters; ask in at most {QUESTION_CHARS}.")
    if any(ord(ch) < 32 and ch not in "\t\n" for ch in value):
        raise runtime.error("The question holds control characters; type it as plain text.")
    return value.strip()


def _span(answer: Answer, choice: object) -> tuple[int, int] | None:
    """The chosen word's tokens, or None for the whole answer; a choice that is not one of the answer's is refused."""
    if choice in (None, "", WHOLE):
        return None
    if isinstance(choice, str) and choice.count("-") == 1:
        a, b = choice.split("-")
        if a.isdigit() and b.isdigit() and (int(a), int(b)) in [span for _, span in answer.words()]:
            return int(a), int(b)
    raise runtime.error("Pick one of the answer's words (or the whole answer).")


def _map_picture(exp: views.Exploration, answer: Answer, span: tuple[int, int] | None, method: str, layer: int | None,
                 word: str) -> tuple[Image.Image, list[dict]]:
    values = answer.map(span, method=method, layer=layer).float()
    seen = Image.fromarray(answer.image)
    k = views.display_scale(seen)
    shown = seen.resize((seen.width * k, seen.height * k), Image.NEAREST)
    picture = plots.overlay(shown, values)
    top = answer.top_patches(span, k=TOP, method=method, layer=layer)
    draw = ImageDraw.Draw(picture)
    for rank, t in enumerate(top):
        x0, y0, x1, y1 = (v * k for v in t["box"])
        draw.rectangle((x0, y0, x1 - 1, y1 - 1), outline="#00e5ff", width=max(1, 3 - rank // 2))
    vmin, vmax = float(values.min()), float(values.max())
    label = "relevance" if method == "relevance" else ("attention" if layer is None else f"attention, layer {layer + 1}")
    picture = plots.with_colorbar(picture, vmin=vmin, vmax=max(vmax, vmin + 1e-12), label=label)
    name = views._name(exp, "ask", word or "answer", method, "" if layer is None else f"l{layer + 1}")
    return plots.named(picture, name), top


class AskTab(Tab):
    id = "ask"
    label = "Ask"
    needs = frozenset({"language"})

    def build(self, page) -> None:
        gr.Markdown(
            "**Ask the image**: the vision–language model answers a question about the analysed image (greedy decoding); "
            "pick a word of the answer to see where in the image it came from: its **relevance** (Chefer et al. 2021b: the "
            "gradient-weighted attention of every layer of the language model, composed) or the language model's "
            "**attention** from the position that wrote it to the image tokens (mean over heads; all layers or one). The "
            "image tokens that count most are outlined. The other tabs show the model's vision tower.",
            elem_classes="vv-caption",
        )
        with gr.Row(equal_height=False):
            with gr.Column(scale=1, min_width=260):
                self.question = gr.Textbox(label="Question", lines=2, max_length=QUESTION_CHARS, elem_id="vv-ask-question",
                                           placeholder="what colour is the star ?")
                self.tokens = gr.Slider(1, MAX_TOKENS, value=DEFAULT_TOKENS, step=1, label="Tokens to generate, at most",
                                        elem_id="vv-ask-tokens")
                self.run = gr.Button("Ask", variant="primary", elem_id="vv-ask-run")
                self.answer = gr.Markdown("", elem_id="vv-ask-answer")
                self.word = gr.Radio([], label="Word of the answer", visible=False, elem_id="vv-ask-word")
                self.method = gr.Radio(METHODS, value="relevance", label="Map", elem_id="vv-ask-method")
                self.layer = gr.Slider(0, 1, value=0, step=1, label="Layer of the language model (0: all, averaged)",
                                       visible=False, elem_id="vv-ask-layer")
            with gr.Column(scale=2, min_width=300):
                self.map = figure(label="Where the word came from", visible=False, elem_id="vv-ask-map")
                self.top = gr.Markdown("", elem_id="vv-ask-top")
        self.held = gr.State(None, time_to_live=3600, delete_callback=_forget)

    def analysis_outputs(self):
        return [self.answer, self.word, self.map, self.top, self.layer]

    def analysed(self, done: Analysed) -> Outputs:
        """A new analysis: the last answer's pictures gone."""
        return {self.answer: "", self.word: gr.update(choices=[], value=None, visible=False), self.map: gr.update(value=None, visible=False),
                self.top: "", self.layer: gr.update(value=0, visible=False)}

    def _kept(self, ref: SessionRef | None, held: object) -> tuple[views.Exploration, Answer]:
        exp = self.recall(ref)
        kept = self.server.store.get(held.key) if isinstance(held, AskRef) and held.analysis == ref.key else None
        if not isinstance(kept, Answer):
            raise runtime.error("Ask a question first (an answer is kept a while, for the image it was asked about).")
        return exp, kept

    def on_ask(self, ref: SessionRef | None, question: object, tokens: object, method: object, held: AskRef | None = None,
               request: gr.Request = None) -> Outputs:
        exp = self.recall(ref)
        q = question_of(question)
        n = runtime.checked(inputs.index, tokens, 1, MAX_TOKENS, "number of tokens")
        method = self._method(method)
        variant = exp.analysis.variant
        model, _ = self.server.cache.get(variant)
        shape = vlm_of(model).ask_shape(q, n)
        with self.server.priced(price(get_spec(variant), "ask", ask=shape), request):
            try:
                answer = ask_on_device(self.server.name, variant, exp.analysis.image, q, n)
            except ValueError as exc:
                raise runtime.error(inputs.public_text(str(exc))) from None
        if isinstance(held, AskRef):
            self.server.store.drop(held.key)
        key = self.server.store.put(answer, _nbytes(answer), key=secrets.token_urlsafe(24))
        words = answer.words()
        choices = [("the whole answer", WHOLE)] + [(f"{w} ({a + 1}–{b})" if b - a > 1 else w, f"{a}-{b}") for w, (a, b) in words]
        first = f"{words[0][1][0]}-{words[0][1][1]}" if words else WHOLE
        layers = answer.attention.shape[1]
        out = {
            self.held: AskRef(key, ref.key, self.server.name),
            self.answer: self._answer_text(answer),
            self.word: gr.update(choices=choices, value=first, visible=True),
            self.layer: gr.update(maximum=layers, value=0, visible=method == "attention"),
        }
        out.update(self._draw(exp, answer, first, method, 0))
        return out

    @staticmethod
    def _answer_text(answer: Answer) -> str:
        text = runtime.md(answer.text) if answer.text else "*(no words: the model ended at once)*"
        end = "" if answer.ends else f" (cut at {len(answer.ids)} tokens)"
        return f"**{answer.model}** answers: {text}{end}"

    @staticmethod
    def _method(method: object) -> str:
        if method not in [v for _, v in METHODS]:
            raise runtime.error("The map is the relevance or the attention.")
        return method

    def _draw(self, exp: views.Exploration, answer: Answer, choice: object, method: str, layer: object) -> Outputs:
        span = _span(answer, choice)
        layers = answer.attention.shape[1]
        chosen = runtime.checked(inputs.index, layer, 0, layers, "layer") if method == "attention" else 0
        word = "" if span is None else "".join(answer.tokens[span[0]: span[1]]).strip()
        picture, top = _map_picture(exp, answer, span, method, chosen - 1 if chosen else None, word)
        rows = "; ".join(f"row {t['row'] + 1}, column {t['col'] + 1}: {t['value']:.3g}" for t in top)
        what = f"**{runtime.md(word)}**" if word else "the whole answer"
        return {self.map: gr.update(value=picture, visible=True),
                self.top: f"Image tokens that count most for {what} (of {answer.token_grid[0]} x {answer.token_grid[1]}): {rows}."}

    def on_view(self, ref: SessionRef | None, choice: object, method: object, layer: object, held: AskRef | None) -> Outputs:
        """Another word, method or layer: the kept answer drawn again."""
        exp, answer = self._kept(ref, held)
        method = self._method(method)
        out = self._draw(exp, answer, choice, method, layer)
        out[self.layer] = gr.update(visible=method == "attention")
        return out

    def wire(self, page) -> None:
        private = dict(api_visibility="private", **page.model)
        outputs = [self.held, self.answer, self.word, self.layer, self.map, self.top]
        self.run.click(self.on_ask, [page.state, self.question, self.tokens, self.method, self.held], outputs, **private)
        self.question.submit(self.on_ask, [page.state, self.question, self.tokens, self.method, self.held], outputs, **private)
        view = [page.state, self.word, self.method, self.layer, self.held]
        for control in (self.word, self.method):
            control.input(self.on_view, view, [self.map, self.top, self.layer], **private)
        self.layer.input(self.on_view, view, [self.map, self.top, self.layer], trigger_mode="always_last", **private)


TAB = register_tab(AskTab())
