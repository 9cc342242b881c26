"""The Patch tab: activation patching between the analysed image and an edit of it.

The clean image is the crop the model saw (`Analysis.image`); the corrupted one is the same crop with
one patch covered (the model's mean colour, which it reads as zeros), with two patches swapped, or a
second upload cut to the same crop. `vitviz.patching.patch` scores every site of two kinds, one a
layer x token map (the input of each block at each token, "resid_pre", by default; or its attention
or MLP output) and one a layer x head map (each head's output, "head", by default; or its attention
pattern), by how much of the clean logit difference patching it alone from the clean run
restores. A click on a cell runs the corrupted image once with that one site patched
(`patched_logits`) and shows its top-5. Both are priced before they run; the result is kept in the
server's store for the session (its memory counted there), so a click does not compute the maps again.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import gradio as gr
import torch
from PIL import Image

from vitviz import plots
from vitviz.images import ImageError, load_image
from vitviz.patching import Patching, patch, patched_logits
from vitviz.pipeline import spec_of
from vitviz.preprocess import crop, to_input
from vitviz.server import runtime
from vitviz.server.guards import inputs
from vitviz.server.guards.gradio_io import UploadedImage, uploaded_path
from vitviz.server.guards.sessions import SessionRef
from vitviz.server.pictures import patch_maps, views
from vitviz.server.runtime import Outputs, gpu
from vitviz.server.tabs.base import Analysed, Tab, figure, labels_of, register_tab
from vitviz.sources import get_spec

# how the corrupted copy is made: (what the page says, the value a client sends)
MODES = [("Cover a patch", "cover"), ("Swap two patches", "swap"), ("Upload a second image", "upload")]
MODE_VALUES = tuple(v for _, v in MODES)
# the kinds of site scored: one for the layer x token map, one for the layer x head map ((what the page says, the kind))
TOKEN_KINDS = [("Block input", "resid_pre"), ("Attention output", "attn_out"), ("MLP output", "mlp_out")]
HEAD_KINDS = [("Head output", "head"), ("Attention pattern", "pattern")]
SHOWN = ("resid_pre", "head")  # by default
# what a site of each kind is, in words: (layer, token or head) -> text
_SITE_WORDS = {
    "resid_pre": "the input of block {layer} at {where}", "attn_out": "the attention output of block {layer} at {where}",
    "mlp_out": "the MLP output of block {layer} at {where}", "head": "head {h} of block {layer} (L{layer} H{h})",
    "pattern": "the attention pattern of head {h} of block {layer} (L{layer} H{h})",
}
# the class followed by default: the clean run's prediction against the corrupted run's (`patch`'s target=None)
AUTO = "(the prediction)"


@dataclass(frozen=True)
class PatchRef:
    """What the session holds of its patching (the result itself is in the server's store)."""

    key: str  # the store's entry: random, never sent to the browser
    analysis: str  # the key of the analysis it patched (`SessionRef.key`)
    server: str


@dataclass(frozen=True)
class Patched:
    """A patching kept for a session: the result, the corrupted crop it ran on, and what it was."""

    result: Patching
    corrupt: Image.Image
    corruption: str  # in words, for the page

    @property
    def nbytes(self) -> int:
        r = self.result
        tensors = [*r.maps.values(), r.clean_logits, r.corrupted_logits]
        return sum(t.numel() * t.element_size() for t in tensors) + 3 * self.corrupt.width * self.corrupt.height + 4096


def _forget(held: object) -> None:
    """Gradio's call when a session's patching state expires: its entry goes from the store."""
    if isinstance(held, PatchRef):
        runtime.server_named(held.server).store.drop(held.key)


def _inputs(model, exp: views.Exploration, corrupt: Image.Image) -> tuple[torch.Tensor, torch.Tensor]:
    """The clean and corrupted crops as the model takes them (no second resizing of a crop)."""
    pre = spec_of(model).preprocessing
    return to_input(exp.analysis.image, pre), to_input(corrupt, pre)


@gpu
def patch_on_device(server: str, exp: views.Exploration, corrupt: Image.Image, target: int | None, batch: int,
                    kinds: tuple[str, str] = SHOWN) -> Patching:
    model, _ = runtime.server_named(server).cache.get(exp.analysis.variant)
    clean, corrupted = _inputs(model, exp, corrupt)
    return patch(model, clean, corrupted, target=target, where=kinds, batch_size=batch, **labels_of(exp.analysis))


@gpu
def patched_on_device(server: str, exp: views.Exploration, corrupt: Image.Image, site: tuple) -> torch.Tensor:
    model, _ = runtime.server_named(server).cache.get(exp.analysis.variant)
    clean, corrupted = _inputs(model, exp, corrupt)
    return patched_logits(model, clean, corrupted, [site], **labels_of(exp.analysis))


@dataclass(frozen=True)
class Corruption:
    """A client's choice of corruption, checked: the mode, the chosen patches (0-based (row, col)),
    the uploaded file."""

    mode: str
    cells: tuple[tuple[int, int], ...] = ()
    upload: str | None = None

    def describe(self) -> str:
        if self.mode == "cover":
            return f"patch row {self.cells[0][0] + 1}, column {self.cells[0][1] + 1} covered"
        if self.mode == "swap":
            (r1, c1), (r2, c2) = self.cells
            return f"patches (row {r1 + 1}, column {c1 + 1}) and (row {r2 + 1}, column {c2 + 1}) swapped"
        return f"the upload {runtime.file_name(self.upload)}"


def _mean_colour(a) -> tuple[int, int, int]:
    """The model's normalisation mean as RGB: a patch of it reads as (nearly) zeros to the model."""
    return tuple(round(255 * m) for m in get_spec(a.variant).preprocessing.mean)


class PatchTab(Tab):
    id = "patch"
    label = "Patch"
    needs = frozenset({"classes", "global_attention"})  # a logit difference between classes, and a ViT tower (no windows)

    def build(self, page) -> None:
        gr.Markdown(
            "**Activation patching**: run the model on the analysed image (clean) and on an edit of it (corrupted), then "
            "run the corrupted image again with one activation copied from the clean run, and see how much of the clean "
            "answer comes back: (LD patched − LD corrupted) / (LD clean − LD corrupted), LD the logit difference between "
            "two classes. 1: that site alone restores it; 0: nothing; red above 0, blue below. Click a cell of a map to "
            "see that patched run's top-5.",
            elem_classes="vv-caption",
        )
        with gr.Row(equal_height=False):
            with gr.Column(scale=1, min_width=260, elem_id="vv-patch-controls"):
                self.mode = gr.Radio(MODES, value="cover", label="The corrupted image", elem_id="vv-patch-mode")
                with gr.Row(elem_id="vv-patch-cells") as self.cells_box:
                    self.row = gr.Number(1, precision=0, minimum=1, label="Row", elem_id="vv-patch-row", min_width=80)
                    self.col = gr.Number(1, precision=0, minimum=1, label="Column", elem_id="vv-patch-col", min_width=80)
                with gr.Row(visible=False, elem_id="vv-patch-second") as self.second_box:
                    self.row2 = gr.Number(1, precision=0, minimum=1, label="Second row", elem_id="vv-patch-row2", min_width=80)
                    self.col2 = gr.Number(1, precision=0, minimum=1, label="Second column", elem_id="vv-patch-col2", min_width=80)
                # (the choice above names it: a label would lie over the drop area)
                self.upload = UploadedImage(label="Second image", show_label=False, type="filepath", sources=["upload", "clipboard"],
                                            height=200, visible=False, elem_id="vv-patch-upload")
                self.target = gr.Dropdown([(AUTO, AUTO)], value=AUTO, label="Class followed", filterable=True, elem_id="vv-patch-class",
                                          info="Against another class: by default the clean prediction against the corrupted one.")
                self.token_kind = gr.Radio(TOKEN_KINDS, value="resid_pre", label="By layer and token, patch", elem_id="vv-patch-token-kind")
                self.head_kind = gr.Radio(HEAD_KINDS, value="head", label="By layer and head, patch", elem_id="vv-patch-head-kind")
                self.run = gr.Button("Patch", variant="primary", elem_id="vv-patch-run")
            with gr.Column(scale=2, min_width=300):
                with gr.Row(elem_classes="vv-pair"):
                    self.clean_img = figure(label="Clean (click a patch)", elem_id="vv-patch-clean")
                    self.corrupt_img = figure(label="Corrupted", elem_id="vv-patch-corrupt")
        self.note = gr.Markdown("", elem_id="vv-patch-note")
        self.tokens_img = figure(label="Restored, by layer and token (click: patch that one)", visible=False, elem_id="vv-patch-tokens")
        self.heads_img = figure(label="Restored, by layer and head (click: patch that one)", visible=False, elem_id="vv-patch-heads")
        with gr.Row(elem_classes="vv-pair"):
            self.top5 = gr.Label(num_top_classes=5, label="Top-5 of the patched run", visible=False, elem_id="vv-patch-top5")
            self.site = gr.Markdown("", elem_id="vv-patch-site")
        self.held = gr.State(None, time_to_live=3600, delete_callback=_forget)

    # -- what is asked, checked ----------------------------------------------------------------

    def _cell(self, a, row: object, col: object, which: str = "") -> tuple[int, int]:
        gh, gw = a.grid
        r = runtime.checked(inputs.index, row, 1, gh, f"{which}row")
        c = runtime.checked(inputs.index, col, 1, gw, f"{which}column")
        return r - 1, c - 1

    def _corruption(self, a, mode: object, row: object, col: object, row2: object, col2: object, upload: object) -> Corruption:
        if mode not in MODE_VALUES:
            raise runtime.error("The corrupted image covers a patch (cover), swaps two (swap) or is a second upload (upload).")
        if mode == "upload":
            if upload in (None, ""):
                raise runtime.error("Upload a second image first (or cover or swap patches of this one).")
            return Corruption("upload", upload=uploaded_path(upload))
        first = self._cell(a, row, col)
        if mode == "cover":
            return Corruption("cover", (first,))
        second = self._cell(a, row2, col2, "second ")
        if second == first:
            raise runtime.error("Pick two different patches to swap.")
        return Corruption("swap", (first, second))

    def _target(self, a, target: object) -> int | None:
        """None for the default (`AUTO`, or nothing), else the class named (one of the model's)."""
        if target in (None, "", AUTO):
            return None
        if isinstance(target, str) and target in a.categories:
            return a.categories.index(target)
        raise runtime.error("Pick one of the model's classes (or the prediction: the clean one against the corrupted one).")

    def _corrupted(self, exp: views.Exploration, how: Corruption) -> Image.Image:
        """The corrupted crop: the analysed crop edited, or the upload cut as the model cuts it and,
        where its crop has another shape (a model that keeps each image's aspect), resized to the clean one's."""
        a = exp.analysis
        if how.mode == "cover":
            return patch_maps.covered(a.image, how.cells[0], patch_size=a.patch_size, colour=_mean_colour(a))
        if how.mode == "swap":
            return patch_maps.swapped(a.image, *how.cells, patch_size=a.patch_size)
        try:
            cut = crop(load_image(how.upload), get_spec(a.variant).preprocessing)
        except ImageError as exc:
            raise runtime.error(f"{runtime.file_name(how.upload)}: {inputs.public_text(str(exc))}") from None
        return cut if cut.size == a.image.size else cut.resize(a.image.size, Image.BILINEAR)

    # -- the two images ------------------------------------------------------------------------

    def _shown(self, exp: views.Exploration, crop_: Image.Image, cells: tuple, name: str) -> Image.Image:
        return plots.named(patch_maps.shown(crop_, patch_size=exp.analysis.patch_size, scale=exp.scale, cells=cells),
                           views._name(exp, "patch", name))

    def _preview(self, exp: views.Exploration, how: Corruption | None, mode: str) -> Outputs:
        """The clean image with the chosen patches outlined, the corrupted copy beside it (an upload's
        crop is shown once it is patched), and the controls of `mode`."""
        cells = how.cells if how is not None else ()
        out: Outputs = {
            self.cells_box: gr.update(visible=mode != "upload"),
            self.second_box: gr.update(visible=mode == "swap"),
            self.upload: gr.update(visible=mode == "upload"),
            self.clean_img: self._shown(exp, exp.analysis.image, cells, "clean"),
        }
        if how is None or how.mode == "upload":
            out[self.corrupt_img] = gr.update(value=None, visible=False)
        else:
            out[self.corrupt_img] = gr.update(value=self._shown(exp, self._corrupted(exp, how), cells, "corrupted"), visible=True)
        return out

    def analysis_outputs(self):
        return [self.mode, self.row, self.col, self.row2, self.col2, self.upload, self.cells_box, self.second_box, self.target,
                self.clean_img, self.corrupt_img, self.note, self.tokens_img, self.heads_img, self.top5, self.site]

    def analysed(self, done: Analysed) -> Outputs:
        """A new analysis: a patch near the middle covered, the maps of the last one gone."""
        exp = done.exp
        a = exp.analysis
        gh, gw = a.grid
        first, second = (gh // 2, gw // 2), (0, 0) if (gh // 2, gw // 2) != (0, 0) else (gh - 1, gw - 1)
        out = self._preview(exp, Corruption("cover", (first,)), "cover")
        classes = gr.update(value=AUTO) if done.same_model else gr.update(choices=[(AUTO, AUTO), *[(c, c) for c in a.categories]], value=AUTO)
        return {
            **out,
            self.mode: "cover", self.upload: gr.update(value=None, visible=False), self.target: classes,
            self.row: gr.update(value=first[0] + 1, maximum=gh), self.col: gr.update(value=first[1] + 1, maximum=gw),
            self.row2: gr.update(value=second[0] + 1, maximum=gh), self.col2: gr.update(value=second[1] + 1, maximum=gw),
            self.note: "", self.tokens_img: gr.update(value=None, visible=False), self.heads_img: gr.update(value=None, visible=False),
            self.top5: gr.update(value=None, visible=False), self.site: "",
        }

    def on_patch_edit(self, ref: SessionRef | None, mode: str, row: float, col: float, row2: float, col2: float) -> Outputs:
        """Another corruption chosen (mode, or a patch by its numbers): the two images again."""
        exp = self.recall(ref)
        how = None if mode == "upload" else self._corruption(exp.analysis, mode, row, col, row2, col2, None)
        return self._preview(exp, how, mode)

    def on_patch_pick(self, ref: SessionRef | None, mode: str, row: float, col: float, evt: gr.SelectData) -> Outputs:
        """A click on the clean image: that patch chosen (for a swap, the one chosen before becomes the second)."""
        exp = self.recall(ref)
        a = exp.analysis
        if mode not in MODE_VALUES:
            raise runtime.error("The corrupted image covers a patch (cover), swaps two (swap) or is a second upload (upload).")
        cell = patch_maps.patch_at(*runtime.click_xy(evt), patch_size=a.patch_size, scale=exp.scale, grid=a.grid)
        if cell is None or mode == "upload":
            return gr.skip()
        before = self._cell(a, row, col)
        if mode == "swap" and before == cell:
            return gr.skip()
        how = Corruption("cover", (cell,)) if mode == "cover" else Corruption("swap", (cell, before))
        out = self._preview(exp, how, mode)
        out.update({self.row: cell[0] + 1, self.col: cell[1] + 1})
        if mode == "swap":
            out.update({self.row2: before[0] + 1, self.col2: before[1] + 1})
        return out

    # -- patching ------------------------------------------------------------------------------

    def on_patch(self, ref: SessionRef | None, mode: str, row: float, col: float, row2: float, col2: float, upload: str | None,
                 target: str | None, held: PatchRef | None = None, token_kind: str = "resid_pre", head_kind: str = "head",
                 request: gr.Request = None) -> Outputs:
        """Every site of the two kinds chosen patched in turn (by default every block input, layer x
        token, and every head's output, layer x head): the two maps."""
        exp = self.recall(ref)
        a = exp.analysis
        how = self._corruption(a, mode, row, col, row2, col2, upload)
        t = self._target(a, target)
        if token_kind not in [v for _, v in TOKEN_KINDS] or head_kind not in [v for _, v in HEAD_KINDS]:
            raise runtime.error("By layer and token, patch a block's input, its attention output or its MLP output; by layer and "
                                "head, a head's output or its attention pattern.")
        kinds = (token_kind, head_kind)
        with self.server.job("patch", a.variant, request, patch_kinds=kinds) as work:
            corrupt = self._corrupted(exp, how)
            try:
                result = patch_on_device(self.server.name, exp, corrupt, t, work.cost.batch, kinds)
            except ValueError as exc:  # the two images score alike: nothing to restore
                raise runtime.error(inputs.public_text(str(exc))) from None
        if isinstance(held, PatchRef):
            self.server.store.drop(held.key)
        kept = Patched(result, corrupt, how.describe())
        key = self.server.store.put(kept, kept.nbytes, key=secrets.token_urlsafe(24))
        out = {**self._preview(exp, how, mode), **self._maps(exp, kept)}
        if how.mode == "upload":
            out[self.corrupt_img] = gr.update(value=self._shown(exp, corrupt, (), "corrupted"), visible=True)
        out[self.held] = PatchRef(key, ref.key, self.server.name)
        return out

    def _maps(self, exp: views.Exploration, kept: Patched) -> Outputs:
        r = kept.result
        token_kind, head_kind = r.kinds
        tokens, _ = patch_maps.token_map_image(r.maps[token_kind], prefix_names=r.prefix_names, grid=r.grid, label="restored")
        heads, _ = plots.head_grid_image(r.maps[head_kind], label="restored")
        name = r.label or str(r.target)
        return {
            self.tokens_img: gr.update(value=plots.named(tokens, views._name(exp, "patch-tokens", name)), visible=True),
            self.heads_img: gr.update(value=plots.named(heads, views._name(exp, "patch-heads", name)), visible=True),
            self.note: (f"**{runtime.md(r.label or str(r.target))}** against **{runtime.md(r.other_label or str(r.other))}**, "
                        f"{runtime.md(kept.corruption)}: LD clean {r.clean_diff:.2f}, corrupted {r.corrupted_diff:.2f}; "
                        f"{r.forwards} batched forwards of up to {r.batch_size} copies. Each map on its own colour scale."),
            self.top5: gr.update(value=None, visible=False), self.site: "",
        }

    def _kept(self, ref: SessionRef | None, held: object) -> tuple[views.Exploration, Patched]:
        exp = self.recall(ref)
        kept = self.server.store.get(held.key) if isinstance(held, PatchRef) and held.analysis == ref.key else None
        if not isinstance(kept, Patched):
            raise runtime.error("Run Patch first (a patching is kept a while, for the image it was run on).")
        return exp, kept

    def on_patch_token(self, ref: SessionRef | None, held: PatchRef | None, evt: gr.SelectData, request: gr.Request = None) -> Outputs:
        """A click on the layer x token map: the corrupted run with that block input patched."""
        exp, kept = self._kept(ref, held)
        r = kept.result
        kind = r.kinds[0]
        layers, tokens = r.maps[kind].shape
        cell = patch_maps.TokenGrid(layers, tokens, r.prefix_names, r.grid).cell_at(*runtime.click_xy(evt))
        if cell is None:
            return gr.skip()
        layer, n = cell
        p = len(r.prefix_names)
        where = r.prefix_names[n] if n < p else "patch row {}, column {}".format(*(v + 1 for v in divmod(n - p, r.grid[1])))
        return self._one(exp, kept, (kind, layer, n), _SITE_WORDS[kind].format(layer=layer + 1, where=where), request)

    def on_patch_head(self, ref: SessionRef | None, held: PatchRef | None, evt: gr.SelectData, request: gr.Request = None) -> Outputs:
        """A click on the layer x head map: the corrupted run with that head's output patched."""
        exp, kept = self._kept(ref, held)
        kind = kept.result.kinds[1]
        layers, heads = kept.result.maps[kind].shape
        cell = plots.HeadGrid(layers, heads).cell_at(*runtime.click_xy(evt))
        if cell is None:
            return gr.skip()
        layer, h = cell
        return self._one(exp, kept, (kind, layer, h), _SITE_WORDS[kind].format(layer=layer + 1, h=h + 1), request)

    def _one(self, exp: views.Exploration, kept: Patched, site: tuple, words: str, request) -> Outputs:
        r = kept.result
        with self.server.job("patch_one", exp.analysis.variant, request, patch_kinds=(site[0],)):
            logits = patched_on_device(self.server.name, exp, kept.corrupt, site)
        probs = logits.double().softmax(-1)
        top = probs.topk(min(5, probs.numel()))
        names = r.categories or tuple(str(i) for i in range(probs.numel()))
        ld = float(logits[r.target] - logits[r.other])
        restored = (ld - r.corrupted_diff) / (r.clean_diff - r.corrupted_diff)
        restored = 0.0 if abs(restored) < 0.005 else restored  # (no "-0.00")
        return {
            self.top5: gr.update(value={str(names[i]): float(p) for p, i in zip(top.values.tolist(), top.indices.tolist())}, visible=True),
            self.site: (f"Patched **{runtime.md(words)}** from the clean run: LD {ld:.2f} (clean {r.clean_diff:.2f}, corrupted "
                        f"{r.corrupted_diff:.2f}): score {restored:.2f} (1: the clean difference restored)."),
        }

    def wire(self, page) -> None:
        edit = [page.state, self.mode, self.row, self.col, self.row2, self.col2]
        preview = [self.cells_box, self.second_box, self.upload, self.clean_img, self.corrupt_img]
        self.mode.input(self.on_patch_edit, edit, preview, api_visibility="private", **page.model)
        for number in (self.row, self.col, self.row2, self.col2):
            number.input(self.on_patch_edit, edit, preview, api_visibility="private", trigger_mode="always_last", **page.model)
        self.clean_img.select(self.on_patch_pick, [page.state, self.mode, self.row, self.col],
                              [*preview, self.row, self.col, self.row2, self.col2], api_visibility="private", **page.model)
        maps = [self.tokens_img, self.heads_img, self.note, self.top5, self.site]
        self.run.click(self.on_patch, [*edit, self.upload, self.target, self.held, self.token_kind, self.head_kind], [*preview, *maps, self.held],
                       api_visibility="private", **page.model)
        clicked = [self.top5, self.site]
        self.tokens_img.select(self.on_patch_token, [page.state, self.held], clicked, api_visibility="private", **page.model)
        self.heads_img.select(self.on_patch_head, [page.state, self.held], clicked, api_visibility="private", **page.model)


TAB = register_tab(PatchTab())
