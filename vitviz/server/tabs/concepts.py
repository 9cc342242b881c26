"""The Concepts tab (drawn when shown): a sparse autoencoder's features on the analysed image.

A top-k SAE (Gao et al. 2024; trained by `python -m vitviz.concepts train`) reads the residual stream
after one block. The tab shows the image with its patches: a click on one lists its strongest
features (activation, how often each fires in the SAE's data, the class it fires on most), each with
its strongest examples there; a feature chosen (in the table, the examples or by number) is drawn
over the image, and switched off at its layer (`vitviz.ablate(features=...)`: the stream x + W_dec
(z' − z), the SAE's error kept) to show the top-5 without it.

Which models: those with a concept folder (`vitviz.concepts.concept_folders`: the embedded ones and
$VITVIZ_CONCEPTS', matched by the card's model); the tab's own `lacks` says so for another, and the
page's gate shows that line in place of the content. A client names an SAE by the name the server
gave it (the dropdown's), never by a path.

The tab runs what it needs itself: the forward to the SAE's layer and its encoding ("concepts"), and
the forwards with a feature off ("concept_ablate"), each priced before it runs. What they give is
kept in the server's store for the session (memory counted there), as are the SAEs read from disk,
so clicks do not run them again.
"""

from __future__ import annotations

import hashlib
import logging
import math
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import gradio as gr
import torch

from vitviz import plots
from vitviz.concepts.browse import ConceptFolder, ConceptMap, Concepts, concept_folders, concept_map, load_concepts
from vitviz.inside import Ablation, ablate
from vitviz.pipeline import spec_of
from vitviz.preprocess import to_input
from vitviz.server import runtime
from vitviz.server.guards import inputs
from vitviz.server.guards.sessions import SessionRef
from vitviz.server.guards.work import KeyedLocks
from vitviz.server.pictures import concept_pictures, views
from vitviz.server.pictures.drawers import drawer
from vitviz.server.runtime import Outputs, gpu
from vitviz.server.tabs.base import Tab, figure, labels_of, register_tab
from vitviz.sources import get_spec

LOG = logging.getLogger("vitviz.server")

SHOWN = 5  # a patch's features listed
KEPT_ABLATIONS = 64  # the features switched off kept with a session's map
HEADERS = ["feature", "activation", "frequency", "top class"]
TRAIN = "python -m vitviz.concepts train DATA --model {model} --layer L --features F --k K --out DIR"
# a folder's SAE read by one request at a time: the others wait for it and take the one it read, instead
# of each holding a copy of its weights, index and atlas (memory the work budget does not count) at once
_READING = KeyedLocks()


@dataclass(frozen=True)
class ConceptsRef:
    """What the session holds of its concept map (the map itself is in the server's store)."""

    key: str  # the store's entry: random, never sent to the browser
    analysis: str  # the key of the analysis it maps (`SessionRef.key`)
    folder: str  # the SAE's name (`ConceptFolder.name`)
    server: str


@dataclass
class Browsed:
    """A session's concept map of its analysis, and the ablations run on it {feature: (the ablation,
    the feature's direct logit effect [C] or None)}."""

    folder: str
    map: ConceptMap
    ablations: OrderedDict = field(default_factory=OrderedDict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def nbytes(self) -> int:
        with self.lock:
            done = list(self.ablations.values())
        per = [3 * r.before.numel() * 4 + (e.numel() * 4 if e is not None else 0) + 512 for r, e in done]
        return self.map.nbytes + sum(per) + 4096

    def ablation(self, feature: int) -> tuple[Ablation, torch.Tensor | None] | None:
        with self.lock:
            return self.ablations.get(feature)

    def keep(self, feature: int, done: tuple[Ablation, torch.Tensor | None]) -> None:
        with self.lock:
            self.ablations[feature] = done
            while len(self.ablations) > KEPT_ABLATIONS:
                self.ablations.popitem(last=False)


def _forget(held: object) -> None:
    """Gradio's call when a session's state expires: its map goes from the store."""
    if isinstance(held, ConceptsRef):
        runtime.server_named(held.server).store.drop(held.key)


def concepts_of(server: str, folder: ConceptFolder) -> Concepts:
    """The folder's concepts, kept in the server's store (their memory counted with the sessions'),
    read again once dropped."""
    store = runtime.server_named(server).store
    key = "concepts-" + hashlib.sha256(str(folder.path.resolve()).encode()).hexdigest()[:24]
    kept = store.get(key)
    if isinstance(kept, Concepts):
        return kept
    with _READING.hold(key):
        kept = store.get(key)  # (read by the request this one waited for)
        if isinstance(kept, Concepts):
            return kept
        try:
            concepts = load_concepts(folder.path)
        except (OSError, ValueError, KeyError, TypeError, ImportError) as exc:  # the operator's folder: the log says where
            LOG.warning("the concepts in %s cannot be read: %s", folder.path, exc)
            raise runtime.error(f"The sparse autoencoder {folder.name} cannot be read on this server now.") from None
        store.put(concepts, concepts.nbytes, key=key)
    return concepts


def _input(model, exp: views.Exploration) -> torch.Tensor:
    """The analysed crop as the model takes it (no second resizing of a crop)."""
    return to_input(exp.analysis.image, spec_of(model).preprocessing)


@gpu
def map_on_device(server: str, exp: views.Exploration, folder: ConceptFolder) -> ConceptMap:
    model, _ = runtime.server_named(server).cache.get(exp.analysis.variant)
    return concept_map(model, _input(model, exp), concepts_of(server, folder))


@gpu
def ablate_on_device(server: str, exp: views.Exploration, folder: ConceptFolder, feature: int) -> tuple[Ablation, torch.Tensor | None]:
    model, _ = runtime.server_named(server).cache.get(exp.analysis.variant)
    return feature_ablated(model, exp, concepts_of(server, folder), feature)


def feature_ablated(model, exp: views.Exploration, concepts: Concepts, feature: int) -> tuple[Ablation, torch.Tensor | None]:
    """`ablate_on_device`'s work on a loaded model and read concepts: the feature switched off, and its
    direct effect on the logits where there is one."""
    labels = labels_of(exp.analysis)
    result = ablate(model, _input(model, exp), features=[feature], concepts=concepts, scale=0.0, **labels)
    try:
        effect = concepts.logit_effect(model, features=[feature], analysis=exp.analysis, **labels)[0]
    except ValueError:  # read through attention pooling, or no recorded stream: no one direct effect
        effect = None
    return result, effect


class ConceptsTab(Tab):
    id = "concepts"
    label = "Concepts"
    needs = frozenset({"global_attention"})  # a ViT's residual stream after a block (a windowed model's stages merge tokens)
    on_demand = True

    def build(self, page) -> None:
        gr.Markdown(
            "**Concepts**: a sparse autoencoder (top-k, Gao et al. 2024) trained on this model's residual stream after "
            "one block writes each token as a few of its many features. Click a patch to list its strongest features, each "
            "with the images where it fires most; choose a feature (in the table, its examples, or by number) to see it over "
            "the image and the top-5 with it switched off at that block (the autoencoder's error kept).",
            elem_classes="vv-caption",
        )
        self.sae = gr.Dropdown([], label="Sparse autoencoder", visible=False, elem_id="vv-concepts-sae")
        self.about = gr.Markdown("", elem_classes="vv-caption", elem_id="vv-concepts-about")
        with gr.Row(equal_height=False):
            with gr.Column(scale=1, min_width=260):
                self.image = figure(label="The image (click a patch)", elem_id="vv-concepts-image")
                with gr.Row():
                    self.row = gr.Number(1, precision=0, minimum=1, label="Row", elem_id="vv-concepts-row", min_width=80)
                    self.col = gr.Number(1, precision=0, minimum=1, label="Column", elem_id="vv-concepts-col", min_width=80)
            with gr.Column(scale=1, min_width=260):
                self.table = gr.Dataframe(headers=HEADERS, label="The patch's strongest features (click one)", interactive=False,
                                          wrap=True, elem_id="vv-concepts-table")
                self.examples = figure(label="Where each fires most (click a row)", elem_id="vv-concepts-examples")
        self.feature = gr.Number(0, precision=0, minimum=0, label="Feature", elem_id="vv-concepts-feature")
        self.note = gr.Markdown("", elem_id="vv-concepts-note")
        with gr.Row(elem_classes="vv-pair"):
            self.map = figure(label="The feature over the image", elem_id="vv-concepts-map")
            self.ablated = gr.Label(num_top_classes=5, label="Top-5 with the feature switched off", visible=False,
                                    elem_id="vv-concepts-ablated")
        self.feature_examples = figure(label="Where the feature fires most", elem_id="vv-concepts-feature-examples")
        self.held = gr.State(None, time_to_live=3600, delete_callback=_forget)
        self.draw_inputs = [self.sae, self.row, self.col, self.feature, self.held]
        self.draw_outputs = [self.sae, self.about, self.image, self.row, self.col, self.table, self.examples, self.feature, self.note,
                             self.map, self.ablated, self.feature_examples, self.held]

    # -- which models, which SAE -----------------------------------------------------------------

    def lacks(self, exp: views.Exploration) -> str | None:
        """The layout's needs, then a concept folder for the model (the gate shows this line in place of the content)."""
        why = super().lacks(exp)
        variant = exp.analysis.variant
        if why is None and not concept_folders(variant):
            return f"No sparse autoencoder for {variant}: train one with {TRAIN.format(model=variant)}, then list DIR in VITVIZ_CONCEPTS"
        return why

    def _folder(self, exp: views.Exploration, value: object) -> ConceptFolder:
        """The SAE a client chose by its name (the first by default), among this model's."""
        folders = concept_folders(exp.analysis.variant)
        if not folders:
            raise runtime.error(f"{self.lacks(exp) or 'No sparse autoencoder for this model'}.")
        if value in (None, ""):
            return folders[0]
        chosen = next((f for f in folders if isinstance(value, str) and f.name == value), None)
        if chosen is None:
            raise runtime.error("Choose one of this model's sparse autoencoders from the list.")
        return chosen

    def _concepts(self, exp: views.Exploration, folder: ConceptFolder) -> Concepts:
        concepts = concepts_of(self.server.name, folder)
        config = get_spec(exp.analysis.variant).config
        if concepts.d_in != config.width or concepts.layer >= config.depth:
            LOG.warning("the concepts in %s read a stream %d wide after block %d; %s is %d wide with %d blocks", folder.path,
                        concepts.d_in, concepts.layer, exp.analysis.variant, config.width, config.depth)
            raise runtime.error(f"The sparse autoencoder {folder.name} does not fit {exp.analysis.variant}.")
        return concepts

    def _price(self, concepts: Concepts) -> dict:
        return dict(sae=(concepts.layer, concepts.features, concepts.k))

    # -- the session's map -----------------------------------------------------------------------

    def _browsed(self, ref: SessionRef, exp: views.Exploration, folder: ConceptFolder, concepts: Concepts, held: object,
                 request) -> tuple[Browsed, ConceptsRef, bool]:
        """(the session's map of its analysis by this SAE, its reference, whether it was made now): the
        one kept, else the forward to the layer and the encoding, priced, and kept."""
        if isinstance(held, ConceptsRef) and (held.analysis, held.folder, held.server) == (ref.key, folder.name, self.server.name):
            kept = self.server.store.get(held.key)
            if isinstance(kept, Browsed):
                return kept, held, False
        with self.server.job("concepts", exp.analysis.variant, request, **self._price(concepts)):
            made = map_on_device(self.server.name, exp, folder)
        if isinstance(held, ConceptsRef):
            self.server.store.drop(held.key)
        kept = Browsed(folder.name, made)
        key = self.server.store.put(kept, kept.nbytes, key=secrets.token_urlsafe(24))
        return kept, ConceptsRef(key, ref.key, folder.name, self.server.name), True

    def _open(self, ref: SessionRef | None, sae: object, held: object, request) -> tuple:
        """(exploration, folder, concepts, map, reference, made now) for a handler."""
        exp = self.recall(ref)
        folder = self._folder(exp, sae)
        concepts = self._concepts(exp, folder)
        kept, held, made = self._browsed(ref, exp, folder, concepts, held, request)
        return exp, folder, concepts, kept, held, made

    def _cell(self, exp: views.Exploration, row: object, col: object) -> tuple[int, int]:
        gh, gw = exp.analysis.grid
        return runtime.checked(inputs.index, row, 1, gh, "row") - 1, runtime.checked(inputs.index, col, 1, gw, "column") - 1

    @staticmethod
    def _strongest(kept: Browsed) -> tuple[tuple[int, int], int]:
        """The patch with the largest activation of any feature, and that feature."""
        m = kept.map
        p = m.num_prefix_tokens
        values = m.values[p:]
        flat = int(values.argmax())
        token, slot = divmod(flat, values.shape[1])
        return divmod(token, m.grid[1]), int(m.indices[p + token, slot])

    # -- what is drawn ---------------------------------------------------------------------------

    def _about(self, exp: views.Exploration, folder: ConceptFolder, concepts: Concepts, kept: Browsed) -> str:
        shown = _metrics(concepts.card.get("metrics"))
        left = float((kept.map.error / kept.map.norm.clamp_min(1e-12)).mean())
        return (f"**{runtime.md(folder.name)}**: after block {concepts.layer + 1}, {concepts.features:,} features, {concepts.k} active "
                f"per token, trained on {'its patch tokens' if concepts.tokens == 'patches' else 'every token'}"
                + (f"; {', '.join(shown)}" if shown else "")
                + f". On this image it leaves {left:.0%} of the stream's norm unexplained (the mean over the tokens).")

    def _patch(self, exp: views.Exploration, concepts: Concepts, kept: Browsed, cell: tuple[int, int]) -> tuple[Outputs, list]:
        """The image with the patch outlined, its strongest features in the table and their examples."""
        top = kept.map.top(cell, SHOWN)
        freq = concepts.frequency
        rows = [[f, f"{v:.3g}", f"{float(freq[f]):.2%}", concepts.top_class(f) or "—"] for f, v in top]
        examples = plots.named(concept_pictures.examples_image(concepts, [f for f, _ in top]),
                               views._name(exp, "concepts-examples", f"r{cell[0] + 1}c{cell[1] + 1}")) if top else None
        return {
            self.image: plots.named(concept_pictures.shown(exp, cell), views._name(exp, "concepts-patch", f"r{cell[0] + 1}c{cell[1] + 1}")),
            self.row: cell[0] + 1, self.col: cell[1] + 1,
            self.table: rows,
            self.examples: gr.update(value=examples, visible=examples is not None),
        }, top

    def _feature(self, exp: views.Exploration, folder: ConceptFolder, concepts: Concepts, kept: Browsed, held: ConceptsRef,
                 feature: int, cell: tuple[int, int], request) -> Outputs:
        """The feature over the image, its examples, and the top-5 with it off (run once, then kept)."""
        a = exp.analysis
        heat = kept.map.feature_map(feature)
        here = float(heat[cell])
        top_class = concepts.top_class(feature)
        words = (f"**Feature {feature}** fires on {float(concepts.frequency[feature]):.2%} of the tokens of the autoencoder's data"
                 + (f", most on {runtime.md(top_class)} images" if top_class else "")
                 + f"; {here:.3g} at this patch, {float(heat.max()):.3g} at its strongest here.")
        out: Outputs = {
            self.feature: gr.update(value=feature, maximum=concepts.features - 1),
            self.map: concept_pictures.feature_image(exp, heat, feature=feature, cell=cell, name=folder.name),
            self.feature_examples: plots.named(concept_pictures.examples_image(concepts, [feature]),
                                               views._name(exp, "concept", folder.name, f"feature{feature}", "examples")),
        }
        if a.probabilities is None:
            out.update({self.ablated: gr.update(value=None, visible=False),
                        self.note: words + " (This model scores no classes: there is no top-5 to switch it off against.)"})
            return out
        done = kept.ablation(feature)
        if done is None:
            with self.server.job("concept_ablate", a.variant, request, **self._price(concepts)):
                done = ablate_on_device(self.server.name, exp, folder, feature)
            kept.keep(feature, done)
            self.server.store.put(kept, kept.nbytes, key=held.key)
        result, effect = done
        words += (f" Switched off after block {concepts.layer + 1} (its activation 0 at every token it reads, the autoencoder's "
                  f"error kept): P({runtime.md(str(result.label))}) {result.target_before:.1%} → {result.target_after:.1%} "
                  f"({result.change:+.1%}).")
        if effect is not None and a.categories is not None:
            order = effect.abs().argsort(descending=True)[:3].tolist()
            pushes = ", ".join(f"{runtime.md(a.categories[c])} {float(effect[c]):+.2f}" for c in order)
            words += f" Its direct effect on the logits, per unit of activation at this image's final-norm scale: {pushes}."
        out.update({self.ablated: gr.update(value={str(k): v for k, v in result.predictions(5)}, visible=True), self.note: words})
        return out

    # -- the events ------------------------------------------------------------------------------

    def draw(self, ref: SessionRef, sae: str | None = None, row: float | None = None, col: float | None = None,
             feature: float | None = None, held: ConceptsRef | None = None) -> Outputs:
        return self.on_concepts(ref, sae, row, col, feature, held)

    def on_concepts(self, ref: SessionRef | None, sae: str | None, row: float | None, col: float | None, feature: float | None,
                    held: ConceptsRef | None, request: gr.Request = None) -> Outputs:
        """The tab drawn for the session's analysis and the chosen SAE: the patch and the feature shown
        kept when the map is the one they were chosen on, else the strongest patch and its strongest feature."""
        exp, folder, concepts, kept, held, made = self._open(ref, sae, held, request)
        if made:
            cell, f = self._strongest(kept)
        else:
            cell = self._cell(exp, row, col)
            f = runtime.checked(inputs.index, feature, 0, concepts.features - 1, "feature")
        folders = concept_folders(exp.analysis.variant)
        out, _ = self._patch(exp, concepts, kept, cell)
        out.update({
            self.sae: gr.update(choices=[(c.describe(), c.name) for c in folders], value=folder.name, visible=len(folders) > 1),
            self.about: self._about(exp, folder, concepts, kept),
            self.held: held,
        })
        out.update(self._feature(exp, folder, concepts, kept, held, f, cell, request))
        return out

    def on_pick(self, ref: SessionRef | None, sae: str | None, held: ConceptsRef | None, evt: gr.SelectData,
                request: gr.Request = None) -> Outputs:
        """A click on the image: that patch, its features, and the strongest of them shown."""
        exp, folder, concepts, kept, held, _ = self._open(ref, sae, held, request)
        a = exp.analysis
        query = drawer(exp).patch_at(exp, *runtime.click_xy(evt))
        token = a.query_token(query)
        if not isinstance(token, int) or token < a.num_prefix_tokens:
            return gr.skip()
        cell = divmod(token - a.num_prefix_tokens, a.grid[1])
        return self._patch_and_feature(exp, folder, concepts, kept, held, cell, request)

    def on_cell(self, ref: SessionRef | None, sae: str | None, row: float, col: float, held: ConceptsRef | None,
                request: gr.Request = None) -> Outputs:
        """A patch chosen by its numbers."""
        exp, folder, concepts, kept, held, _ = self._open(ref, sae, held, request)
        return self._patch_and_feature(exp, folder, concepts, kept, held, self._cell(exp, row, col), request)

    def _patch_and_feature(self, exp, folder, concepts, kept, held, cell, request) -> Outputs:
        out, top = self._patch(exp, concepts, kept, cell)
        out[self.held] = held
        if top:
            out.update(self._feature(exp, folder, concepts, kept, held, top[0][0], cell, request))
        return out

    def on_table(self, ref: SessionRef | None, sae: str | None, row: float, col: float, held: ConceptsRef | None,
                 evt: gr.SelectData, request: gr.Request = None) -> Outputs:
        """A click on a row of the table: that feature."""
        return self._listed(ref, sae, row, col, held, _table_row(evt), request)

    def on_examples(self, ref: SessionRef | None, sae: str | None, row: float, col: float, held: ConceptsRef | None,
                    evt: gr.SelectData, request: gr.Request = None) -> Outputs:
        """A click on a row of the examples: that feature."""
        x, y = runtime.click_xy(evt)
        return self._listed(ref, sae, row, col, held, (x, y), request)

    def _listed(self, ref, sae, row, col, held, at: int | tuple[float, float], request) -> Outputs:
        """The feature at a row of the patch's list (`at`: the row, or a click on the examples' picture)."""
        exp, folder, concepts, kept, held, _ = self._open(ref, sae, held, request)
        cell = self._cell(exp, row, col)
        top = kept.map.top(cell, SHOWN)
        if isinstance(at, tuple):
            at = concept_pictures.ExampleRows(len(top), concepts.top_n, concepts.thumb).row_at(*at)
            if at is None:
                return gr.skip()
        if not 0 <= at < len(top):
            raise runtime.error(f"The patch lists {len(top)} features: pick one of them.")
        out = self._feature(exp, folder, concepts, kept, held, top[at][0], cell, request)
        out[self.held] = held
        return out

    def on_feature(self, ref: SessionRef | None, sae: str | None, row: float, col: float, feature: float, held: ConceptsRef | None,
                   request: gr.Request = None) -> Outputs:
        """A feature chosen by its number."""
        exp, folder, concepts, kept, held, _ = self._open(ref, sae, held, request)
        f = runtime.checked(inputs.index, feature, 0, concepts.features - 1, "feature")
        out = self._feature(exp, folder, concepts, kept, held, f, self._cell(exp, row, col), request)
        out[self.held] = held
        return out

    def wire(self, page) -> None:
        outputs = self.draw_outputs
        private = dict(api_visibility="private", **page.model)
        self.sae.input(self.on_concepts, [page.state, *self.draw_inputs], outputs, **private)
        self.image.select(self.on_pick, [page.state, self.sae, self.held], outputs, **private)
        for number in (self.row, self.col):
            number.input(self.on_cell, [page.state, self.sae, self.row, self.col, self.held], outputs, trigger_mode="always_last",
                         **private)
        listed = [page.state, self.sae, self.row, self.col, self.held]
        self.table.select(self.on_table, listed, outputs, **private)
        self.examples.select(self.on_examples, listed, outputs, **private)
        self.feature.input(self.on_feature, [page.state, self.sae, self.row, self.col, self.feature, self.held], outputs,
                           trigger_mode="always_last", **private)


def _metrics(metrics: object) -> list[str]:
    """What the card's evaluation says (`vitviz.concepts.metrics_table`'s figures), those it has, in words."""
    m = metrics if isinstance(metrics, dict) else {}

    def number(key: str) -> float | None:
        v = m.get(key)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None

    out = []
    if (ev := number("explained_variance")) is not None:
        out.append(f"explained variance {ev:.3f}")
    if (l0 := number("mean_l0")) is not None:
        out.append(f"mean L0 {l0:.1f}")
    if (dead := number("dead_features")) is not None:
        out.append(f"{dead:,.0f} dead")
    clean, spliced = number("accuracy_clean"), number("accuracy_spliced")
    if clean is not None and spliced is not None:
        out.append(f"accuracy {clean:.1%} → {spliced:.1%} with the layer replaced by its reconstruction")
    return out


def _table_row(evt: object) -> int:
    """The row of a click on the table (`SelectData.index`: [row, column] of whole numbers), or a clear error."""
    index = getattr(evt, "index", None)
    if isinstance(index, (list, tuple)) and len(index) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in index):
        return index[0]
    raise runtime.error("A click on the table must give its cell (row, column).")


TAB = register_tab(ConceptsTab())
