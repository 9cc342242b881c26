"""The Inside tab (drawn when shown): what each layer would predict (the logit lens), what each head
adds to the answer (direct logit attribution), and what switching heads off does (ablation).

The lens and the attribution come from the analysis itself (`Analysis.inside`, recorded in the same
forward); ablation runs the model again, priced like any model work. A click on a cell of the heads x
layers map switches that head off (or on again); the list beside it does the same by keyboard.
"""

from __future__ import annotations

import re

import gradio as gr
import torch

from vitviz import plots
from vitviz.inside import ablate, head_importance
from vitviz.server import runtime
from vitviz.server.guards.sessions import SessionRef
from vitviz.server.pictures import views
from vitviz.server.runtime import Outputs, gpu
from vitviz.server.tabs.base import Tab, figure, labels_of, lacks, register_tab

MAX_OFF = 64  # heads switched off at once
MODES = ("zero", "mean")
_HEAD = re.compile(r"^L(\d{1,3}) H(\d{1,3})$")


def head_name(layer: int, head: int) -> str:
    """(0, 2) -> "L1 H3": 1-based, as the map labels them."""
    return f"L{layer + 1} H{head + 1}"


def parse_heads(values: object, *, layers: int, heads: int) -> list[tuple[int, int]]:
    """A client's heads to switch off ("L1 H3", ...) as 0-based (layer, head) pairs, each within the
    model, at most `MAX_OFF`, duplicates dropped; a `gr.Error` says what is wrong."""
    if values is None or values == "":
        return []
    if isinstance(values, str) or not isinstance(values, (list, tuple)) or len(values) > MAX_OFF:
        raise runtime.error(f"Heads to switch off are a list of at most {MAX_OFF} names like “L1 H3”.")
    out: list[tuple[int, int]] = []
    for v in values:
        m = _HEAD.match(v) if isinstance(v, str) else None
        if m is None or not (1 <= int(m[1]) <= layers and 1 <= int(m[2]) <= heads):
            raise runtime.error(f"Heads are named L1 H1 to L{layers} H{heads}; got {str(v)[:40]!r}.")
        pair = (int(m[1]) - 1, int(m[2]) - 1)
        if pair not in out:
            out.append(pair)
    return out


@gpu
def ablate_on_device(server: str, exp: views.Exploration, heads: list[tuple[int, int]], mode: str, target: int):
    model, _ = runtime.server_named(server).cache.get(exp.analysis.variant)
    return ablate(model, exp.analysis.image, heads, mode=mode, target=target, **labels_of(exp.analysis))


@gpu
def importance_on_device(server: str, exp: views.Exploration, mode: str, target: int) -> torch.Tensor:
    model, _ = runtime.server_named(server).cache.get(exp.analysis.variant)
    return head_importance(model, exp.analysis.image, target=target, mode=mode, **labels_of(exp.analysis))


class InsideTab(Tab):
    id = "inside"
    label = "Inside"
    needs = frozenset({"classes", "stream"})
    on_demand = True
    ablation_needs = frozenset({"global_attention"})  # the heads switched off: each is one of a layer's heads over every token

    def build(self, page) -> None:
        gr.Markdown(
            "Inside the model. **Logit lens**: the classifier applied to the stream after each block (through the "
            "model's own final norm): at which layer does it know? **Direct logit attribution**: the chosen class's "
            "logit split exactly into what each head, MLP and the embedding write to the stream (centred and divided "
            "by the final norm's σ from this forward, as TransformerLens does). **Ablation**: click a head in the "
            "map (or list it) to switch it off and see the top-5 change; *Rank heads* switches each off alone. Where tokens merge "
            "between stages, the lens and the parts start at the last stage, the only one as wide as the classifier's input; "
            "heads are switched off where they attend across the whole image.",
            elem_classes="vv-caption",
        )
        with gr.Row():
            self.target = gr.Dropdown([], label="Class", elem_id="vv-inside-class", scale=2)
            self.mode = gr.Radio(list(MODES), value="zero", label="Switched-off heads output", elem_id="vv-inside-mode", scale=1)
        self.note = gr.Markdown("", elem_id="vv-inside-note")
        with gr.Row(elem_classes="vv-pair"):
            self.lens_img = figure(label="Logit lens: probability against depth", elem_id="vv-lens")
            self.heads_img = figure(label="Each head's part of the logit (click: switch off, where heads attend globally)",
                                    elem_id="vv-attribution")
        self.parts = gr.Dataframe(headers=["part", "logit"], label="The logit, part by part", elem_id="vv-attribution-parts",
                                  interactive=False, wrap=True, column_widths=["72%", "28%"])
        with gr.Row() as self.switches:  # the ablation's controls: shown where heads can be switched off (`_no_ablation`)
            self.off = gr.Dropdown([], value=[], multiselect=True, label="Heads switched off", elem_id="vv-heads-off", scale=3)
            self.clear = gr.Button("All on", size="sm", scale=1)
        with gr.Row(elem_classes="vv-pair"):
            self.ablated = gr.Label(num_top_classes=5, label="Top-5 with those heads off", visible=False, elem_id="vv-ablated")
            self.ablation_note = gr.Markdown("", elem_id="vv-ablation-note")
        with gr.Column() as self.ranking:
            self.rank = gr.Button("Rank heads by ablation (each alone)", size="sm", elem_id="vv-rank-heads")
            with gr.Row(elem_classes="vv-pair"):
                self.rank_img = figure(label="Drop of the class's probability, each head off alone", elem_id="vv-rank")
                self.rank_note = gr.Markdown("", elem_id="vv-rank-note")
        self.draw_inputs = [self.target, self.off, self.mode]
        self.draw_outputs = [self.target, self.note, self.lens_img, self.heads_img, self.parts, self.off, self.ablated, self.ablation_note,
                             self.mode, self.switches, self.ranking]

    def draw(self, ref: SessionRef, target: str | None = None, off: list | None = None, mode: str = "zero") -> Outputs:
        return self.on_inside(ref, target, off, mode)

    def _followed(self, ref: SessionRef | None) -> views.Exploration:
        """The session's analysis, when the tab can follow a class of it; else a `gr.Error` saying why not."""
        exp = self.server.recall(ref)
        why = self.lacks(exp)  # (the lens and the attribution: classes scored, the stream recorded)
        if why:
            raise runtime.error(why)
        return exp

    @staticmethod
    def _checked_mode(mode: object) -> str:
        if mode not in MODES:
            raise runtime.error("The switched-off heads output zeros or their mean over the patches.")
        return mode

    def _target(self, a, target: object) -> int:
        """The class followed: the one named (checked), else the top-1."""
        if isinstance(target, str) and target in a.categories:
            return a.categories.index(target)
        if target not in (None, ""):
            raise runtime.error("Pick one of the model's classes.")
        return int(a.probabilities.argmax())

    def _no_ablation(self, exp: views.Exploration) -> str | None:
        """Why the heads of `exp`'s model cannot be switched off here, or None."""
        if lacks(exp, self.ablation_needs) is None:
            return None
        return (f"No ablation here: {exp.analysis.variant}'s heads do not attend across the whole image; heads are switched off "
                "in models whose heads do.")

    def _heads(self, exp: views.Exploration) -> tuple[int, int]:
        """The layers and heads a head to switch off is named among (a global model's every layer)."""
        return tuple(exp.analysis.attentions.shape[:2])

    def on_inside(self, ref: SessionRef | None, target: str | None, off: list | None, mode: str, request: gr.Request = None) -> Outputs:
        """The lens and the attribution from the analysis, and the ablation of the heads listed."""
        exp = self._followed(ref)
        a = exp.analysis
        t = self._target(a, target)
        no_ablation = self._no_ablation(exp)
        if no_ablation:
            pairs, names = [], []
        else:
            depth, heads = self._heads(exp)
            pairs = parse_heads(off, layers=depth, heads=heads)
            names = [head_name(l, h) for l in range(depth) for h in range(heads)]
        lens = a.logit_lens()
        first_layer = a.inside.first_layer  # 0, or a Swin's last stage's first block: the lens and the parts start there
        start = "the embedding" if first_layer == 0 else "the last stage's input"
        shown = sorted(set(lens[-1].topk(min(4, lens.shape[-1])).indices.tolist()) | {t}, key=lambda c: -float(lens[-1, c]))
        lens_img = plots.figure_to_image(plots.lens_figure(lens, categories=a.categories, classes=shown, title=f"{a.variant}: logit lens",
                                                           first=first_layer, start=start))
        out: Outputs = {
            self.target: gr.update(choices=list(a.categories), value=a.categories[t]),
            self.lens_img: plots.named(lens_img, views._name(exp, "logit-lens", a.categories[t])),
            self.off: gr.update(choices=names, value=[head_name(*p) for p in pairs], interactive=not no_ablation),
            **{shown: gr.update(visible=not no_ablation) for shown in (self.mode, self.switches, self.ranking)},
        }
        try:
            parts = a.logit_attribution(t)
        except ValueError as exc:  # attention pooling (SigLIP), norms after each branch (Swin V2): not linear in the stream
            out.update({self.note: f"No attribution: {exc}", self.heads_img: None, self.parts: None})
        else:
            grid_img, _ = plots.head_grid_image(parts.heads, off=set(pairs), label="logit", first_layer=first_layer)
            first = next((l for l in range(lens.shape[0]) if int(lens[l].argmax()) == t), None)
            out.update({
                self.note: (f"**{a.categories[t]}**: logit {float(parts.logit):.2f} = the parts below (sum {parts.total():.2f}); "
                            + (f"the lens first ranks it top-1 after block {first_layer + first}." if first is not None
                               else "the lens never ranks it top-1.")
                            + (f" The lens and the parts start at block {first_layer + 1}, the last stage's first: only its "
                               "tokens are as wide as the head's input." if first_layer else "")),
                self.heads_img: plots.named(grid_img, views._name(exp, "attribution", a.categories[t])),
                self.parts: [[name, f"{value:.3f}"] for name, value in _parts_rows(parts)],
            })
        if no_ablation:
            out.update({self.ablated: gr.update(value=None, visible=False), self.ablation_note: no_ablation})
        else:
            out.update(self._ablation(exp, pairs, mode, t, request))
        return out

    def _ablation(self, exp: views.Exploration, pairs: list[tuple[int, int]], mode: object, t: int, request) -> Outputs:
        mode = self._checked_mode(mode)
        if not pairs:
            return {self.ablated: gr.update(value=None, visible=False), self.ablation_note: "No head is switched off: click one in the map."}
        with self.server.job("ablate", exp.analysis.variant, request):
            result = ablate_on_device(self.server.name, exp, pairs, mode, t)
        return {
            self.ablated: gr.update(value={str(label): p for label, p in result.predictions(5)}, visible=True),
            self.ablation_note: (f"With {len(pairs)} head{'s' if len(pairs) > 1 else ''} off ({mode}): "
                                 f"P({result.label}) {result.target_before:.1%} → {result.target_after:.1%} ({result.change:+.1%})."),
        }

    def on_click(self, ref: SessionRef | None, target: str | None, off: list | None, mode: str, evt: gr.SelectData,
                 request: gr.Request = None) -> Outputs:
        """A click on the heads x layers map: that head off (or on again), and everything redrawn."""
        exp = self.server.recall(ref)
        if self.lacks(exp) or self._no_ablation(exp):
            return gr.skip()
        depth, heads = self._heads(exp)
        pairs = parse_heads(off, layers=depth, heads=heads)
        cell = plots.HeadGrid(depth, heads).cell_at(*runtime.click_xy(evt))
        if cell is None:
            return gr.skip()
        pairs = [p for p in pairs if p != cell] if cell in pairs else pairs + [cell]
        if len(pairs) > MAX_OFF:
            raise runtime.error(f"At most {MAX_OFF} heads off at once.")
        return self.on_inside(ref, target, [head_name(*p) for p in pairs], mode, request)

    def on_clear(self, ref: SessionRef | None, target: str | None, mode: str, request: gr.Request = None) -> Outputs:
        """Every head on again."""
        return self.on_inside(ref, target, [], mode, request)

    def on_rank(self, ref: SessionRef | None, target: str | None, mode: str, request: gr.Request = None) -> Outputs:
        """Every head switched off alone (a batch of H copies per layer): the drop of the class's probability."""
        exp = self._followed(ref)
        a = exp.analysis
        no_ablation = self._no_ablation(exp)
        if no_ablation:
            raise runtime.error(no_ablation)
        mode = self._checked_mode(mode)
        t = self._target(a, target)
        with self.server.job("importance", a.variant, request):
            drop = importance_on_device(self.server.name, exp, mode, t)
        img, _ = plots.head_grid_image(drop, label="probability drop")
        order = drop.flatten().argsort(descending=True)[:5].tolist()
        heads = drop.shape[1]
        lines = [f"{i + 1}. {head_name(k // heads, k % heads)}: {float(drop.flatten()[k]):+.1%}" for i, k in enumerate(order)]
        return {self.rank_img: plots.named(img, views._name(exp, "head-ranking", a.categories[t], mode)),
                self.rank_note: f"Most important for **{a.categories[t]}** ({mode}):\n\n" + "\n".join(lines)}

    def wire(self, page) -> None:
        shown = [page.state, self.target, self.off, self.mode]
        outputs = self.draw_outputs
        for event in (self.target.input, self.off.input, self.mode.input):
            event(self.on_inside, shown, outputs, api_visibility="private", **page.model)
        self.heads_img.select(self.on_click, shown, outputs, api_visibility="private", **page.model)
        self.clear.click(self.on_clear, [page.state, self.target, self.mode], outputs, api_visibility="private", **page.model)
        self.rank.click(self.on_rank, [page.state, self.target, self.mode], [self.rank_img, self.rank_note],
                        api_visibility="undocumented", api_name="session_rank_heads", **page.model)


def _parts_rows(parts) -> list[tuple[str, float]]:
    """The attribution by kind: the embedding (from a later block: what entered it), all heads, the
    output-projection biases, each MLP, the biases."""
    first = parts.first_layer
    entering = ("embedding (patches, positions, prefix)" if first == 0
                else f"the stream entering block {first + 1} (every block before it, merged)")
    rows = [(entering, float(parts.embedding)), ("all heads", float(parts.heads.sum())),
            ("attention output biases", float(parts.attn_biases.sum()))]
    rows += [(f"MLP {first + layer + 1}", float(v)) for layer, v in enumerate(parts.mlps.tolist())]
    return rows + [("final norm's β and the head's bias", float(parts.bias))]


TAB = register_tab(InsideTab())
