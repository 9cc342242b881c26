"""The Tokens tab (drawn when shown): attention received, token norms, DINO's heads, patch features."""

from __future__ import annotations

import gradio as gr

from vitviz.server import runtime
from vitviz.server.guards import inputs
from vitviz.server.guards.sessions import SessionRef
from vitviz.server.pictures.drawers import drawer
from vitviz.server.runtime import Outputs
from vitviz.server.tabs.base import Tab, figure, register_tab


class TokensTab(Tab):
    id = "tokens"
    label = "Tokens"
    needs = frozenset()  # every token layout's drawer draws its tokens (`drawers.PROTOCOL`)
    on_demand = True

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
        self.dino_share = gr.Slider(0.05, 1.0, value=0.6, step=0.05, label="DINO: share of each head's attention kept", elem_id="vv-dino-share")
        self.dino_img = figure(label="Last layer, cls attention per head", elem_id="vv-dino")
        self.features_text = gr.Markdown("", elem_classes="vv-caption", elem_id="vv-features-text")
        with gr.Row(elem_classes="vv-pair"):
            self.features_img = figure(label="Patch features, PCA (click a patch)", elem_id="vv-features")
            self.similarity_map_img = figure(label="Similarity to the clicked patch", elem_id="vv-feature-similarity")
        self.draw_inputs = [self.dino_share]
        self.draw_outputs = [self.received_img, self.norms_img, self.norms_map_img, self.dino_img, self.features_img,
                             self.features_text, self.similarity_map_img]

    def draw(self, ref: SessionRef, share: float = 0.6) -> Outputs:
        return self.on_tokens(ref, share)

    def on_tokens(self, ref: SessionRef | None, share: float) -> Outputs:
        """The Tokens tab: attention received, token norms, DINO's head maps and the patch features."""
        exp = self.recall(ref)
        share = runtime.checked(inputs.share, share)
        draw = drawer(exp)
        norms_chart, norms_map = draw.render_token_norms(exp)
        features, features_caption = draw.render_features(exp)
        return {
            self.received_img: draw.render_received(exp),
            self.norms_img: norms_chart,
            self.norms_map_img: norms_map,
            self.dino_img: draw.render_dino_heads(exp, share=share),
            self.features_img: features,
            self.features_text: features_caption,
            self.similarity_map_img: None,
        }

    def on_dino_share(self, ref: SessionRef | None, share: float) -> Outputs:
        exp = self.recall(ref)
        return {self.dino_img: drawer(exp).render_dino_heads(exp, share=runtime.checked(inputs.share, share))}

    def on_feature_click(self, ref: SessionRef | None, evt: gr.SelectData) -> Outputs:
        """A click on the feature image: how similar every patch's feature is to that patch's."""
        exp = self.recall(ref)
        draw = drawer(exp)
        return {self.similarity_map_img: draw.render_feature_similarity(exp, query=draw.patch_at(exp, *runtime.click_xy(evt)))}

    def wire(self, page) -> None:
        self.dino_share.input(self.on_dino_share, [page.state, self.dino_share], self.dino_img, api_visibility="private", trigger_mode="always_last")
        self.features_img.select(self.on_feature_click, page.state, self.similarity_map_img, api_visibility="private")


TAB = register_tab(TokensTab())
