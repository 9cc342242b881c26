"""The Tokens tab (drawn when shown): attention received, token norms, the high-norm tokens and a
test-time register, DINO's heads, patch features.

The high-norm tokens of a layer come from the analysis itself (`Analysis.outliers`). The test-time
register (Jiang et al. 2025, `vitviz.registers`) runs the model again, priced like any model work
("registers"): the neurons that write the high-norm tokens found on the analysed crop, moved into one
more token, and the crop analysed with it. That result is kept in the server's store for the session
(its memory counted there), so a move of the layer slider draws both sides again without running the
model.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace

import gradio as gr

from vitviz.pipeline import Analysis, analyze_crop, image_tower, spec_of
from vitviz.preprocess import to_input
from vitviz.registers import RegisterNeurons, register_neurons, with_test_time_register
from vitviz.server import runtime
from vitviz.server.guards import inputs
from vitviz.server.guards.gradio_io import ViewImage
from vitviz.server.guards.sessions import SessionRef
from vitviz.server.pictures import views
from vitviz.server.pictures.drawers import drawer
from vitviz.server.runtime import Outputs, gpu
from vitviz.server.tabs.base import Tab, figure, register_tab

MAX_NEURONS = 64  # neurons moved into the register at most
DEFAULT_NEURONS = 8
DETECTION_LAYER = -2  # where `register_neurons` finds the high-norm tokens by default (the second-to-last block)


@dataclass(frozen=True)
class RegisterRef:
    """What the session holds of its test-time register (the result itself is in the server's store)."""

    key: str  # the store's entry: random, never sent to the browser
    analysis: str  # the key of the analysis it was run for (`SessionRef.key`)
    server: str


@dataclass(frozen=True)
class Registered:
    """A test-time register kept for a session: the neurons found (ranked: those moved only, the ones
    the page lists) and the analysis with the register."""

    found: RegisterNeurons
    after: views.Exploration
    moved: int  # how many neurons were moved (the top of `found.ranked`)

    @property
    def nbytes(self) -> int:
        return self.after.analysis.nbytes + self.found.scores.numel() * self.found.scores.element_size() + 4096


def _forget(held: object) -> None:
    """Gradio's call when a session's register state expires: its entry goes from the store."""
    if isinstance(held, RegisterRef):
        runtime.server_named(held.server).store.drop(held.key)


@gpu
def register_on_device(server: str, exp: views.Exploration, neurons: int) -> tuple[RegisterNeurons, Analysis]:
    """The neurons that write the analysed crop's high-norm tokens (the top `neurons`), and the crop
    analysed by the model with them moved into a test-time register (an image–text model's image
    tower alone: the register is added to it)."""
    return moved_to_register(runtime.server_named(server).cache.get(exp.analysis.variant)[0], exp.analysis.image, neurons)


def moved_to_register(model, crop, neurons: int) -> tuple[RegisterNeurons, Analysis]:
    """`register_on_device`'s work on a loaded model and its analysed crop."""
    found = register_neurons(model, to_input(crop, spec_of(model).preprocessing)[None], top_k=neurons, layer=DETECTION_LAYER)
    return found, analyze_crop(with_test_time_register(image_tower(model), found), crop)


def no_register(a) -> str | None:
    """None when a test-time register can be added to the analysed model, else why not (one sentence)."""
    if a.layout.attention != "global":
        return (f"{a.variant} cannot take a test-time register: it is one more token beside the patches of a ViT whose tokens all "
                "attend to each other, and this model's attention and token grids are laid out otherwise.")
    if a.layout.position_bias:
        return (f"{a.variant} cannot take a test-time register: its relative position bias is learned for its own tokens, with no "
                "place for one more.")
    return None


class TokensTab(Tab):
    id = "tokens"
    label = "Tokens"
    needs = frozenset()  # every token layout's drawer draws its tokens (`drawers.PROTOCOL`)
    on_demand = True

    def __init__(self) -> None:
        super().__init__()
        self.drawn = runtime.Recent()  # the analyses this tab has drawn (a new one is shown at its last layer)

    def build(self, page) -> None:
        gr.Markdown(
            "The tokens themselves. **Attention received**: the share of each layer's attention that goes to each "
            "prefix token (cls, distillation, registers) and to the patches. **Token norms**: where high-norm "
            "tokens appear — large models dump attention on a few such low-information patches, which registers "
            "take over (Darcet et al. 2024). **DINO's heads**: the last block's cls attention per head (for a model "
            "without a cls token, its pooled query's: the mean of the rows), the patches holding the chosen share of "
            "each head's mass in colour (Caron et al. 2021). **Patch features**: the first three principal components "
            "of the last layer's patch tokens as red, green and blue; click a patch to see how similar every other "
            "patch's feature is to it. A model whose stages merge patches shows each layer over its own stage's "
            "tokens, and its last stage's grid.",
            elem_classes="vv-caption",
        )
        with gr.Row(elem_classes="vv-pair"):
            self.received_img = figure(label="Attention received per layer", elem_id="vv-received")
            self.norms_img = figure(label="Token norms per layer", elem_id="vv-norms")
        self.norms_map_img = figure(label="Token norms after the last block", elem_id="vv-norms-map")
        self._build_outliers()
        self.dino_share = gr.Slider(0.05, 1.0, value=0.6, step=0.05, label="DINO: share of each head's attention kept", elem_id="vv-dino-share")
        self.dino_img = figure(label="Last layer, cls attention per head", elem_id="vv-dino")
        self.features_text = gr.Markdown("", elem_classes="vv-caption", elem_id="vv-features-text")
        with gr.Row(elem_classes="vv-pair"):
            self.features_img = figure(label="Patch features, PCA (click a patch)", elem_id="vv-features")
            self.similarity_map_img = figure(label="Similarity to the clicked patch", elem_id="vv-feature-similarity")
        self.draw_inputs = [self.dino_share, self.outlier_layer, self.held]
        self.draw_outputs = [self.received_img, self.norms_img, self.norms_map_img, self.dino_img, self.features_img,
                             self.features_text, self.similarity_map_img, self.outlier_layer, self.outliers_img, self.outliers_text,
                             *self.register_outputs]

    def _build_outliers(self) -> None:
        """The high-norm tokens of a layer, and the test-time register that takes them."""
        gr.Markdown(
            "**High-norm tokens**: the patch tokens whose norm after a block is more than twice that block's median patch "
            "norm, outlined over every patch's norm, with the attention the classifier's query and the other patches give "
            "them. **Test-time register** (Jiang et al. 2025): the MLP neurons that write them (scored by their mean "
            "|activation| at this image's high-norm tokens after the second-to-last block) are moved into one more token; "
            "the high-norm tokens should leave the patches, and the rollout the background.",
            elem_classes="vv-caption",
        )
        self.outlier_layer = gr.Slider(1, 12, value=12, step=1, label="High-norm tokens after block", elem_id="vv-outlier-layer")
        with gr.Row(elem_classes="vv-pair"):
            self.outliers_img = figure(label="Token norms, high-norm tokens outlined", elem_id="vv-outliers")
            self.outliers_text = gr.Markdown("", elem_id="vv-outliers-text")
        with gr.Row():
            self.register_neurons = gr.Slider(1, MAX_NEURONS, value=DEFAULT_NEURONS, step=1, label="Neurons moved",
                                              elem_id="vv-register-neurons", scale=2)
            self.register_run = gr.Button("Move them to a test-time register", size="sm", elem_id="vv-register-run", scale=1)
        self.register_note = gr.Markdown("", elem_id="vv-register-note")
        with gr.Row(elem_classes="vv-pair"):
            self.rollout_before = figure(ViewImage, label="Rollout, as analysed", visible=False, elem_id="vv-register-before")
            self.rollout_after = figure(ViewImage, label="Rollout with the test-time register", visible=False, elem_id="vv-register-after")
        with gr.Row(elem_classes="vv-pair"):
            self.outliers_after = figure(label="High-norm tokens with the register", visible=False, elem_id="vv-register-outliers")
            self.norms_after = figure(label="Token norms per layer with the register", visible=False, elem_id="vv-register-norms")
        self.held = gr.State(None, time_to_live=3600, delete_callback=_forget)
        self.register_outputs = [self.register_note, self.rollout_before, self.rollout_after, self.outliers_after, self.norms_after,
                                 self.held]

    def draw(self, ref: SessionRef, share: float = 0.6, layer: float | None = None, held: RegisterRef | None = None) -> Outputs:
        return self.on_tokens(ref, share, layer, held)

    def on_tokens(self, ref: SessionRef | None, share: float, layer: float | None = None, held: RegisterRef | None = None) -> Outputs:
        """The Tokens tab: attention received, token norms, the high-norm tokens, DINO's head maps and
        the patch features; an analysis drawn for the first time shows its last layer's high-norm tokens."""
        exp = self.recall(ref)
        share = runtime.checked(inputs.share, share)
        draw = drawer(exp)
        depth = draw.explorer_bounds(exp)[0]
        if ref.key in self.drawn and layer is not None:
            layer = self._layer(exp, layer)
        else:
            layer = depth
        self.drawn.add(ref.key)
        norms_chart, norms_map = draw.render_token_norms(exp)
        features, features_caption = draw.render_features(exp)
        outliers_img, outliers_text = drawer(exp).render_outliers(exp, layer=layer)
        kept = self._kept(ref, held)
        return {
            self.received_img: draw.render_received(exp),
            self.norms_img: norms_chart,
            self.norms_map_img: norms_map,
            self.dino_img: draw.render_dino_heads(exp, share=share),
            self.features_img: features,
            self.features_text: features_caption,
            self.similarity_map_img: None,
            self.outlier_layer: gr.update(maximum=depth, value=layer),
            self.outliers_img: outliers_img,
            self.outliers_text: outliers_text,
            # a register of this analysis stays as it is drawn; one of another analysis goes
            **({c: gr.skip() for c in self.register_outputs} if kept is not None else self._no_register("", held)),
        }

    def _layer(self, exp: views.Exploration, layer: object) -> int:
        """A client's layer (1-based), within the analysed model's blocks."""
        return runtime.checked(inputs.index, layer, 1, drawer(exp).explorer_bounds(exp)[0], "layer")

    def _kept(self, ref: SessionRef, held: object) -> Registered | None:
        """The session's test-time register, when it was run for this analysis and is still kept."""
        if not isinstance(held, RegisterRef) or held.analysis != ref.key:
            return None
        kept = self.server.store.get(held.key)
        return kept if isinstance(kept, Registered) else None

    def _no_register(self, note: str, held: object) -> Outputs:
        """The register's pictures gone (and its entry in the store), `note` in their place."""
        if isinstance(held, RegisterRef):
            self.server.store.drop(held.key)
        hidden = gr.update(value=None, visible=False)
        return {self.register_note: note, self.rollout_before: hidden, self.rollout_after: hidden, self.outliers_after: hidden,
                self.norms_after: hidden, self.held: None}

    def on_dino_share(self, ref: SessionRef | None, share: float) -> Outputs:
        exp = self.recall(ref)
        return {self.dino_img: drawer(exp).render_dino_heads(exp, share=runtime.checked(inputs.share, share))}

    def on_outlier_layer(self, ref: SessionRef | None, layer: float, held: RegisterRef | None = None) -> Outputs:
        """Another layer's high-norm tokens: drawn from the analysis, and from the session's register when
        there is one (nothing runs the model)."""
        exp = self.recall(ref)
        layer = self._layer(exp, layer)
        picture, caption = drawer(exp).render_outliers(exp, layer=layer)
        kept = self._kept(ref, held)
        after = drawer(kept.after).render_outliers(kept.after, layer=layer)[0] if kept is not None else gr.skip()
        return {self.outliers_img: picture, self.outliers_text: caption, self.outliers_after: after}

    def on_register(self, ref: SessionRef | None, neurons: float, layer: float, held: RegisterRef | None = None,
                    request: gr.Request = None) -> Outputs:
        """The neurons that write the analysed crop's high-norm tokens moved into a test-time register,
        and the crop analysed again with it: the rollouts before and after, the high-norm tokens and the
        token norms after."""
        exp = self.recall(ref)
        a = exp.analysis
        neurons = runtime.checked(inputs.index, neurons, 1, MAX_NEURONS, "number of neurons moved")
        layer = self._layer(exp, layer)
        why = no_register(a)
        counts = a.outliers().counts if why is None else []
        if why is None and (len(counts) < -DETECTION_LAYER or not counts[DETECTION_LAYER]):
            why = (f"**No high-norm token to trace.** On this image no patch token's norm after block {len(counts) + DETECTION_LAYER + 1} "
                   "(the second-to-last, where the neurons are found) is above twice the median, so no neuron writes one: "
                   "try an image with flat, empty patches (background).")
        if why is not None:
            return self._no_register(why, held)
        with self.server.job("registers", a.variant, request):
            try:
                found, after = register_on_device(self.server.name, exp, neurons)
            except ValueError as exc:
                return self._no_register(inputs.public_text(str(exc)), held)
            # (what the caption shows: the neurons moved; every other neuron's rank would be kept uncounted)
            found = replace(found, ranked=found.ranked[:neurons])
            kept = Registered(found, views.Exploration(after, exp.facts), moved=neurons)
            before_img = drawer(exp).render_rollout(exp)
            after_img = drawer(kept.after).render_rollout(kept.after)
        if isinstance(held, RegisterRef):
            self.server.store.drop(held.key)
        key = self.server.store.put(kept, kept.nbytes, key=secrets.token_urlsafe(24))
        shown = drawer(kept.after)
        return {
            self.register_note: register_caption(exp, kept),
            self.rollout_before: gr.update(value=before_img, visible=True),
            self.rollout_after: gr.update(value=after_img, visible=True),
            self.outliers_after: gr.update(value=drawer(kept.after).render_outliers(kept.after, layer=layer)[0], visible=True),
            self.norms_after: gr.update(value=shown.render_token_norms(kept.after)[0], visible=True),
            self.held: RegisterRef(key, ref.key, self.server.name),
        }

    def on_feature_click(self, ref: SessionRef | None, evt: gr.SelectData) -> Outputs:
        """A click on the feature image: how similar every patch's feature is to that patch's."""
        exp = self.recall(ref)
        draw = drawer(exp)
        return {self.similarity_map_img: draw.render_feature_similarity(exp, query=draw.patch_at(exp, *runtime.click_xy(evt)))}

    def wire(self, page) -> None:
        self.dino_share.input(self.on_dino_share, [page.state, self.dino_share], self.dino_img, api_visibility="private", trigger_mode="always_last")
        self.outlier_layer.input(self.on_outlier_layer, [page.state, self.outlier_layer, self.held],
                                 [self.outliers_img, self.outliers_text, self.outliers_after], api_visibility="private",
                                 trigger_mode="always_last")
        self.register_run.click(self.on_register, [page.state, self.register_neurons, self.outlier_layer, self.held], self.register_outputs,
                                api_visibility="private", **page.model)
        self.features_img.select(self.on_feature_click, page.state, self.similarity_map_img, api_visibility="private")


def _prediction(a: Analysis) -> str:
    top = a.predictions(1)
    return f"{runtime.md(top[0][0])} {top[0][1]:.1%}" if top else "none (no classifier)"


def register_caption(exp: views.Exploration, kept: Registered) -> str:
    """What the page says of a test-time register: the neurons moved and their scores, the largest
    patch norm over the median after the last block before and after, and the prediction before and after."""
    a, b, found = exp.analysis, kept.after.analysis, kept.found
    pairs = ", ".join(f"({layer}, {neuron}) {score:.2f}" for layer, neuron, score in found.ranked[: kept.moved])
    before, after = float(a.outliers().ratio[-1]), float(b.outliers().ratio[-1])
    p = b.num_prefix_tokens
    register = float(b.token_norms[-1, b.prefix_names.index("ttr")])
    median = float(b.token_norms[-1, p:].median())
    tower = " (the image tower alone, with no zero-shot scores)" if a.layout.text else ""
    return (f"**{kept.moved} neuron{'s' if kept.moved != 1 else ''} moved into a test-time register**, as (layer, neuron) counted "
            f"from 0 with their mean |activation| at the high-norm tokens after block {found.layer + 1}: {pairs}.\n\n"
            f"After the last block, the largest patch norm is **{before:.1f} times the median before, {after:.1f} after**; the "
            f"register's own norm is {register:.1f} (the patches' median {median:.1f}).\n\n"
            f"Prediction: {_prediction(a)} before, {_prediction(b)} after{tower}. Each rollout on its own colour scale.")


TAB = register_tab(TokensTab())
