"""vitviz in the browser: upload an image, pick a ViT, see what it predicts and how it got there.

Layout, wiring and thin handlers only; everything computed lives in `vitviz` (`vitviz.server` for
the app's logic without Gradio). Run with `python app.py`; deploys unchanged as a Hugging Face Space.
"""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402
import torch  # noqa: E402
from gradio.components import Component  # noqa: E402
from starlette.middleware import Middleware  # noqa: E402

from vitviz.images import MAX_BYTES, ImageError, describe_limits  # noqa: E402
from vitviz.server import inputs, views  # noqa: E402
from vitviz.server.export import Downloads  # noqa: E402
from vitviz.server.gradio_io import GuardedBlocks, PngImage, UploadedImage, UploadLimit, ViewImage, as_text  # noqa: E402
from vitviz.server.memory import release_memory  # noqa: E402
from vitviz.server.menus import head_choices, spec_line, variant_choices  # noqa: E402
from vitviz.server.models import ModelCache  # noqa: E402
from vitviz.server.sessions import SessionRef, SessionStore  # noqa: E402
from vitviz.sources import WeightsUnavailableError, assets_dir, checkpoint_dir, default_device, default_variant  # noqa: E402

try:  # ZeroGPU on Hugging Face Spaces; a no-op elsewhere
    import spaces

    gpu = spaces.GPU
except ImportError:  # pragma: no cover - depends on the host

    def gpu(fn):
        return fn


Outputs = dict[Component, Any]

CACHE = ModelCache(max_models=int(os.environ.get("VITVIZ_MAX_MODELS", "3")))
DEFAULT_VARIANT, DEFAULT_REASON = default_variant()
EXAMPLES = sorted(str(p) for p in (assets_dir() / "examples").glob("*.png"))
MAX_COMPARE = 3
QUEUE_SIZE = int(os.environ.get("VITVIZ_QUEUE_SIZE", "32"))
CONCURRENCY = int(os.environ.get("VITVIZ_CONCURRENCY", "2" if torch.cuda.is_available() else "1"))
DOWNLOADS = Downloads()
# Analyses kept for sessions: all of them together within VITVIZ_STATE_MB (default 3 GiB, sized for
# a 16 GB Space beside 3 GiB of models); an analysis unused for VITVIZ_STATE_IDLE seconds is dropped.
STORE: SessionStore[views.Exploration] = SessionStore(
    budget_bytes=int(float(os.environ.get("VITVIZ_STATE_MB", "3072")) * 2**20),
    idle_seconds=float(os.environ.get("VITVIZ_STATE_IDLE", "900")),
)


def _device_line() -> str:
    dev = default_device()
    if dev.type == "cuda":
        return f"GPU: {torch.cuda.get_device_name()}"
    return f"CPU ({torch.get_num_threads()} threads)"


def _error(message: str) -> gr.Error:
    """An error for the page and the API, its text shown as typed (the page reads it as HTML)."""
    return gr.Error(as_text(message))


def _checked(check, *args):
    """A client's field through its check in `vitviz.server.inputs`, or a clear error."""
    try:
        return check(*args)
    except inputs.InputError as exc:
        raise _error(str(exc)) from None


# ------------------------------------------------------------------------------------------------
# Running the model, and the analyses kept for sessions

def _run(image: str | None, variant: str) -> views.Exploration:
    if image is None:
        raise _error("Upload an image first (or pick an example).")
    variant = _checked(inputs.variant, variant)
    release_memory()  # what the previous request's rendering and encoding freed
    try:
        return _analyze_on_device(image, variant)
    except (ImageError, WeightsUnavailableError) as exc:
        raise _error(str(exc)) from None
    finally:
        release_memory()


@gpu
def _analyze_on_device(image: str, variant: str) -> views.Exploration:
    return views.explore(CACHE, image, variant)


@gpu
def _reanalyze_on_device(ref: SessionRef) -> views.Exploration:
    return views.explore_crop(CACHE, ref.crop, ref.variant)


def _remember(exp: views.Exploration) -> SessionRef:
    """Keeps `exp` in the store; the session holds only the returned reference."""
    key = STORE.put(exp, exp.analysis.nbytes)
    return SessionRef(key=key, variant=exp.analysis.variant, crop=exp.analysis.image)


def _recall(ref: SessionRef | None) -> views.Exploration:
    """The session's analysis; computed again from its crop when the store has dropped it."""
    if not isinstance(ref, SessionRef):
        raise _error("Analyse an image first.")
    exp = STORE.get(ref.key)
    if exp is None:
        try:
            exp = _reanalyze_on_device(ref)
        except WeightsUnavailableError as exc:
            raise _error(str(exc)) from None
        STORE.put(exp, exp.analysis.nbytes, key=ref.key)
    return exp


def _forget(ref: SessionRef | None) -> None:
    """Called by Gradio when a session's state expires or its tab closes."""
    if isinstance(ref, SessionRef):
        STORE.drop(ref.key)


def _notice(message: str) -> str:
    """An error for the notice box: `message` is already escaped text."""
    return f'<div class="vv-error">{message}</div>'


# ------------------------------------------------------------------------------------------------
# Handlers: each returns its outputs by component, and is callable directly in tests

def on_analyze(image: str | None, variant: str, head_fusion: str, discard_ratio: float, ref: SessionRef | None = None,
               progress=gr.Progress(track_tqdm=True)) -> Outputs:
    """A new image or variant: the one handler that runs the model.

    When nothing can be analysed (no image, an image vitviz refuses, weights that cannot be had),
    only the notice changes, saying why: the results on the page stay those of the last analysis.
    """
    progress(0, desc=f"Loading {variant} (a first use may download its weights)")
    try:
        exp = _run(image, variant)
        head_fusion, discard_ratio = _checked(inputs.fusion, head_fusion), _checked(inputs.ratio, discard_ratio)
    except gr.Error as exc:
        shown = f" The results below are still those of {ref.variant}." if isinstance(ref, SessionRef) else ""
        gr.Warning(exc.message)
        return {notice: _notice(exc.message + as_text(shown))}
    _forget(ref)
    a = exp.analysis
    depth, heads = a.attentions.shape[:2]
    similarity, filters = views.render_position(exp)
    grid, table_rows = views.render_architecture(exp)
    return {
        state: _remember(exp),
        notice: "",
        predictions: views.render_predictions(exp),
        rollout_img: views.render_rollout(exp, head_fusion=head_fusion, discard_ratio=discard_ratio),
        layer: gr.update(maximum=depth, value=depth),
        head: gr.update(choices=head_choices(heads), value="mean"),
        query: 0,
        query_text: views.describe_query(exp, 0),
        explorer_img: views.render_query(exp, layer=depth, head="mean", query=0),
        mosaic: views.render_head_mosaic(exp, layer=depth, query=0),
        distance_img: views.render_distance(exp),
        similarity_img: similarity,
        filters_img: filters,
        grid_img: grid,
        table: table_rows,
        npz: None,
        status: (
            f"**{a.variant}** on {a.device}: {spec_line(a.variant)}. Model call {a.model_seconds * 1e3:.0f} ms; "
            f"{a.grid[0]}x{a.grid[1]} patches of {a.patch_size} px, {exp.facts.total_params:,} parameters."
        ),
    }


def on_export(ref: SessionRef | None) -> Outputs:
    """The analysis as .npz, written when asked for."""
    return {npz: DOWNLOADS.npz(_recall(ref))}


def on_rollout_options(ref: SessionRef | None, head_fusion: str, discard_ratio: float) -> Outputs:
    """Rollout options changed: drawn again from the stored attention."""
    exp = _recall(ref)
    fusion, ratio = _checked(inputs.fusion, head_fusion), _checked(inputs.ratio, discard_ratio)
    return {rollout_img: views.render_rollout(exp, head_fusion=fusion, discard_ratio=ratio)}


def on_view(ref: SessionRef | None, layer_value: float, head_value: str, query_value: float) -> Outputs:
    """Layer, head or query changed: the explorer drawn again from the stored attention."""
    exp = _recall(ref)
    depth, heads, tokens = exp.analysis.attentions.shape[:3]
    layer_value = _checked(inputs.index, layer_value, 1, depth, "layer")
    head_value = _checked(inputs.head, head_value, heads)
    query_value = _checked(inputs.index, query_value, 0, tokens - 1, "query token")
    return {
        explorer_img: views.render_query(exp, layer=layer_value, head=head_value, query=query_value),
        mosaic: views.render_head_mosaic(exp, layer=layer_value, query=query_value),
    }


def on_click(ref: SessionRef | None, layer_value: float, head_value: str, evt: gr.SelectData) -> Outputs:
    """A click on the explorer image picks that patch as the query."""
    exp = _recall(ref)
    try:
        x, y = float(evt.index[0]), float(evt.index[1])
    except (TypeError, ValueError, IndexError):
        raise _error("A click must give the pixel (x, y) on the image.") from None
    query_value = views.patch_at(exp, x, y)
    return {query: query_value, query_text: views.describe_query(exp, query_value), **on_view(ref, layer_value, head_value, query_value)}


def on_cls_query(ref: SessionRef | None, layer_value: float, head_value: str) -> Outputs:
    exp = _recall(ref)
    return {query: 0, query_text: views.describe_query(exp, 0), **on_view(ref, layer_value, head_value, 0)}


def on_compare(image: str | None, variants: list[str] | None) -> Outputs:
    """Two or three variants on the same image, side by side.

    When something cannot be analysed, only the compare notice changes, saying why."""
    variants = list(variants) if isinstance(variants, (list, tuple)) else []
    try:
        if not 2 <= len(variants) <= MAX_COMPARE:
            raise _error(f"Pick two or three variants to compare (you picked {len(variants)}).")
        exps = [_run(image, v) for v in variants]
    except gr.Error as exc:
        gr.Warning(exc.message)
        return {compare_notice: _notice(exc.message)}
    out: Outputs = {compare_notice: "", compare_distance: views.render_compare_distance(exps)}
    for k, (col, md, ro, gd) in enumerate(slots):
        if k < len(exps):
            e = exps[k]
            a = e.analysis
            top = "\n".join(f"- {label}: {p:.1%}" for label, p in a.predictions(3))
            out[col] = gr.update(visible=True)
            out[md] = (
                f"### {a.variant}\n{a.grid[0]}x{a.grid[1]} patches of {a.patch_size} px · {e.facts.total_params:,} params · "
                f"{a.model_seconds * 1e3:.0f} ms\n\n{top}"
            )
            out[ro] = views.render_rollout(e)
            out[gd] = views.render_architecture(e)[0]
        else:
            out[col], out[md], out[ro], out[gd] = gr.update(visible=False), "", None, None
    return out


def api_analyze(image: str | None, variant: str) -> Outputs:
    """The `/analyze` endpoint: image and variant in; predictions, rollout, distance plot and an .npz
    (rollout, cls map, distances, probabilities, the crop; the attention stack stays in the page's download)."""
    exp = _run(image, variant)
    return {
        api_pred: views.render_predictions(exp),
        api_rollout: views.render_rollout(exp),
        api_distance: views.render_distance(exp),
        api_npz: DOWNLOADS.npz(exp, attentions=False),
    }


def on_variant_info(variant: str) -> Outputs:
    try:
        return {variant_info: spec_line(inputs.variant(variant))}
    except inputs.InputError:
        return {variant_info: ""}


# ------------------------------------------------------------------------------------------------
# Layout

CSS = """
.vv-caption { color: var(--body-text-color-subdued); font-size: 0.92em; }
.vv-error { color: var(--error-text-color); border: 1px solid var(--error-border-color); background: var(--error-background-fill);
            border-radius: 6px; padding: 6px 10px; white-space: pre-wrap; overflow-wrap: anywhere; }
#vv-explorer img { cursor: crosshair; }
"""

with GuardedBlocks(title="vitviz — look inside Vision Transformers", delete_cache=(600, 1800)) as demo:
    # the session's reference to its analysis (the analysis itself is in STORE)
    state = gr.State(None, time_to_live=3600, delete_callback=_forget)
    gr.Markdown(
        "# vitviz — look inside Vision Transformers\n"
        f"Upload a photo, pick a ViT, and see what it predicts and how it got there. Running on **{_device_line()}**. "
        f"Default model: {DEFAULT_REASON}.".replace(str(checkpoint_dir()), f"`{checkpoint_dir()}`")
    )
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=300):
            image = UploadedImage(label="Image", type="filepath", sources=["upload", "clipboard"], height=320, elem_id="vv-image")
            variant = gr.Dropdown(variant_choices(), value=DEFAULT_VARIANT, label="Model variant", elem_id="vv-variant")
            variant_info = gr.Markdown(spec_line(DEFAULT_VARIANT), elem_classes="vv-caption")
            run = gr.Button("Analyse", variant="primary", elem_id="vv-run")
            if EXAMPLES:
                gr.Examples(EXAMPLES, inputs=image, label="Examples")
            gr.Markdown(f"Images: {describe_limits()}.", elem_classes="vv-caption")
        with gr.Column(scale=2, min_width=320):
            notice = gr.HTML("", elem_id="vv-notice")
            status = gr.Markdown("", elem_id="vv-status")
            with gr.Tabs():
                with gr.Tab("Predict"):
                    gr.Markdown(
                        "Top-5 classes and **attention rollout**: how much the cls token, after all layers, draws on each "
                        "patch. Each layer's attention is fused over heads (mean, max or min), its weakest links are "
                        "optionally discarded, the identity is added for the residual path and each row is renormalised "
                        "to sum to 1 (with mean fusion and no discard, that is half attention and half identity); the "
                        "layers are then multiplied from the first up (Abnar & Zuidema 2020).",
                        elem_classes="vv-caption",
                    )
                    with gr.Row():
                        predictions = gr.Label(num_top_classes=5, label="Predictions", elem_id="vv-predictions")
                        rollout_img = ViewImage(interactive=False, label="Attention rollout", buttons=["download"], elem_id="vv-rollout")
                    with gr.Row():
                        head_fusion = gr.Radio(["mean", "max", "min"], value="mean", label="Head fusion", elem_id="vv-fusion")
                        discard = gr.Slider(0.0, 0.95, value=0.0, step=0.05, label="Discard ratio", elem_id="vv-discard")
                    with gr.Row():
                        export = gr.Button("Prepare the analysis as .npz", size="sm")
                        npz = gr.File(label="Attention stack, rollout, distances (.npz)")
                with gr.Tab("Explorer"):
                    gr.Markdown(
                        "What one token attends to at one layer: click a patch on the image to make it the query (or use "
                        "the cls token). Each map is a row of softmax(q·kᵀ/√d) over the patches, for one head or fused "
                        "over heads; the mosaic shows every head of the layer for the same query.",
                        elem_classes="vv-caption",
                    )
                    with gr.Row():
                        layer = gr.Slider(1, 12, value=12, step=1, label="Layer", elem_id="vv-layer")
                        head = gr.Dropdown(["mean", "max"], value="mean", label="Head", elem_id="vv-head")
                    with gr.Row():
                        query_text = gr.Markdown("query: the cls token", elem_id="vv-query")
                        query = gr.Number(0, precision=0, minimum=0, visible=False, label="Query token")
                        cls_button = gr.Button("Use the cls token", size="sm")
                    with gr.Row():
                        explorer_img = ViewImage(interactive=False, label="Attention of the query (click a patch)", elem_id="vv-explorer", buttons=["download"])
                        mosaic = ViewImage(interactive=False, label="All heads of this layer", buttons=["download"], elem_id="vv-mosaic")
                with gr.Tab("Distance"):
                    gr.Markdown(
                        "How far each head looks (the paper's Figure 7, right): for every head, the average pixel distance "
                        "between a patch and the patches it attends to, weighted by attention. In the paper's models, early "
                        "layers mix near and far heads and later ones look far. The dashed line is what uniform attention would give.",
                        elem_classes="vv-caption",
                    )
                    distance_img = PngImage(interactive=False, label="Mean attention distance", buttons=["download"])
                with gr.Tab("Positions"):
                    gr.Markdown(
                        "Left: cosine similarity between the learned position embedding of each patch (one tile per patch) "
                        "and all others — the paper's Figure 7, centre; nearby patches have similar embeddings. Right: the "
                        "top 28 principal components of the patch-embedding filters as RGB images (Figure 7, left).",
                        elem_classes="vv-caption",
                    )
                    with gr.Row():
                        similarity_img = PngImage(interactive=False, label="Position-embedding similarity", buttons=["download"])
                        filters_img = PngImage(interactive=False, label="Patch-embedding filters: principal components", buttons=["download"])
                with gr.Tab("Architecture"):
                    gr.Markdown(
                        "The image as the model sees it: resized, centre-cropped and cut into patches, each becoming one "
                        "token. The table follows the tokens stage by stage with output shapes and parameter counts.",
                        elem_classes="vv-caption",
                    )
                    with gr.Row():
                        grid_img = PngImage(interactive=False, label="Patch grid", buttons=["download"])
                        table = gr.Dataframe(headers=["Stage", "Layer", "Output shape", "Param #"], label="Stages", wrap=True)
                with gr.Tab("Compare"):
                    gr.Markdown(
                        "Two or three variants on the same image: predictions, rollout and patch grid side by side, and "
                        "every head's attention distance in one chart, so patch size and model size can be compared.",
                        elem_classes="vv-caption",
                    )
                    with gr.Row():
                        compare_pick = gr.CheckboxGroup(
                            variant_choices(), value=["shapes_p16", "shapes_p8"], label="Variants (two or three)"
                        )
                        compare_run = gr.Button("Compare", variant="primary", elem_id="vv-compare-run")
                    compare_notice = gr.HTML("", elem_id="vv-compare-notice")
                    slots = []
                    with gr.Row():
                        for k in range(MAX_COMPARE):
                            with gr.Column(visible=k < 2, min_width=220) as col:
                                md = gr.Markdown("", elem_id=f"vv-compare-{k + 1}")
                                ro = PngImage(interactive=False, label="Rollout")
                                gd = PngImage(interactive=False, label="Patch grid")
                            slots.append((col, md, ro, gd))
                    compare_distance = PngImage(interactive=False, label="Mean attention distance", buttons=["download"], elem_id="vv-compare-distance")

    # hidden outputs of the API endpoint
    with gr.Row(visible=False):
        api_button = gr.Button("api")
        api_pred = gr.Label()
        api_rollout = PngImage(interactive=False)
        api_distance = PngImage(interactive=False)
        api_npz = gr.File()

    analysis_outputs = [
        state, notice, predictions, rollout_img, layer, head, query, query_text, explorer_img, mosaic, distance_img,
        similarity_img, filters_img, grid_img, table, npz, status,
    ]
    analysis_inputs = [image, variant, head_fusion, discard, state]
    view_inputs = [state, layer, head, query]
    # The session endpoints (undocumented, callable with gradio_client) keep the analysis in the
    # caller's session, as the page does: `python -m vitviz.bench --app` times view changes through them.
    # Dropdowns and radios answer `.change` (a click on a menu option fires `.input` twice); sliders
    # answer `.input`, which fires while dragging, on arrow keys and on a typed number, and
    # "always_last" draws the value the control ends on.
    run.click(on_analyze, analysis_inputs, analysis_outputs, api_visibility="undocumented", api_name="session_analyze")
    image.upload(on_analyze, analysis_inputs, analysis_outputs, api_visibility="private")
    variant.change(on_variant_info, variant, variant_info, api_visibility="private").then(
        on_analyze, analysis_inputs, analysis_outputs, api_visibility="private"
    )
    head_fusion.change(on_rollout_options, [state, head_fusion, discard], rollout_img, api_visibility="undocumented", api_name="session_rollout")
    discard.input(on_rollout_options, [state, head_fusion, discard], rollout_img, api_visibility="private", trigger_mode="always_last")
    layer.input(on_view, view_inputs, [explorer_img, mosaic], api_visibility="undocumented", api_name="session_view", trigger_mode="always_last")
    head.change(on_view, view_inputs, [explorer_img, mosaic], api_visibility="private", trigger_mode="always_last")
    explorer_img.select(on_click, [state, layer, head], [query, query_text, explorer_img, mosaic], api_visibility="private")
    cls_button.click(on_cls_query, [state, layer, head], [query, query_text, explorer_img, mosaic], api_visibility="private")
    export.click(on_export, state, npz, api_visibility="private")
    compare_outputs = [compare_notice, compare_distance, *[c for slot in slots for c in slot]]
    compare_run.click(on_compare, [image, compare_pick], compare_outputs, api_visibility="private")
    api_button.click(api_analyze, [image, variant], [api_pred, api_rollout, api_distance, api_npz], api_name="analyze")

demo.queue(max_size=QUEUE_SIZE, default_concurrency_limit=CONCURRENCY)

LAUNCH_KWARGS = dict(
    css=CSS,
    theme=gr.themes.Soft(),
    max_file_size=MAX_BYTES,
    ssr_mode=False,
    app_kwargs={"middleware": [Middleware(UploadLimit, max_bytes=MAX_BYTES)]},
)

if __name__ == "__main__":
    demo.launch(**LAUNCH_KWARGS)
