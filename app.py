"""vitviz in the browser: upload an image, pick a ViT, see what it predicts and how it got there.

Layout and wiring only; everything computed lives in `vitviz` (`vitviz.explorer` for the views).
Run with `python app.py`; deploys unchanged as a Hugging Face Space.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402
import torch  # noqa: E402
from starlette.middleware import Middleware  # noqa: E402

from vitviz import explorer as ex  # noqa: E402
from vitviz.images import MAX_BYTES, ImageError, describe_limits  # noqa: E402
from vitviz.server.gradio_io import GuardedBlocks, PngImage, UploadedImage, UploadLimit, ViewImage, as_text  # noqa: E402
from vitviz.server.sessions import SessionRef, SessionStore  # noqa: E402
from vitviz.zoo import WeightsUnavailableError, assets_dir, checkpoint_dir, default_device, default_variant  # noqa: E402

try:  # ZeroGPU on Hugging Face Spaces; a no-op elsewhere
    import spaces

    gpu = spaces.GPU
except ImportError:  # pragma: no cover - depends on the host

    def gpu(fn):
        return fn


CACHE = ex.ModelCache(max_models=int(os.environ.get("VITVIZ_MAX_MODELS", "3")))
DEFAULT_VARIANT, DEFAULT_REASON = default_variant()
EXAMPLES = sorted(str(p) for p in (assets_dir() / "examples").glob("*.png"))
MAX_COMPARE = 3
QUEUE_SIZE = int(os.environ.get("VITVIZ_QUEUE_SIZE", "32"))
CONCURRENCY = int(os.environ.get("VITVIZ_CONCURRENCY", "2" if torch.cuda.is_available() else "1"))
_DOWNLOADS = Path(tempfile.mkdtemp(prefix="vitviz-"))
# Analyses kept for sessions: all of them together within VITVIZ_STATE_MB (default 3 GiB, sized for
# a 16 GB Space beside 3 GiB of models); an analysis unused for VITVIZ_STATE_IDLE seconds is dropped.
STORE: SessionStore[ex.Exploration] = SessionStore(
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


# ------------------------------------------------------------------------------------------------
# Every payload field is checked here: the API takes them from anyone.

def _variant(value) -> str:
    if not isinstance(value, str) or not value:
        raise _error("Choose a model variant.")
    try:
        ex.get_spec(value)
    except ValueError as exc:
        raise _error(str(exc)) from None
    return value


def _fusion(value) -> str:
    if value not in ("mean", "max", "min"):
        raise _error("Head fusion must be mean, max or min.")
    return value


def _ratio(value) -> float:
    try:
        ratio = float(value)
    except (TypeError, ValueError):
        ratio = float("nan")
    if not 0.0 <= ratio <= 0.95:
        raise _error("The discard ratio must be a number from 0 to 0.95.")
    return ratio


def _index(value, low: int, high: int, what: str) -> int:
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if not (low <= number <= high and number == int(number)):
        raise _error(f"The {what} must be a whole number from {low} to {high}.")
    return int(number)


def _head(value, heads: int) -> str:
    if value in ("mean", "max") or value in ex.head_choices(heads):
        return value
    raise _error(f"The head must be mean, max or one of head 1 to head {heads}.")


# ------------------------------------------------------------------------------------------------
# Running the model, and the analyses kept for sessions

def _run(image: str | None, variant: str, head_fusion: str = "mean", discard_ratio: float = 0.0) -> ex.Exploration:
    if image is None:
        raise _error("Upload an image first (or pick an example).")
    variant, head_fusion, discard_ratio = _variant(variant), _fusion(head_fusion), _ratio(discard_ratio)
    ex.release_memory()  # what the previous request's rendering and encoding freed
    try:
        return _analyze_on_device(image, variant, head_fusion, discard_ratio)
    except (ImageError, WeightsUnavailableError) as exc:
        raise _error(str(exc)) from None
    finally:
        ex.release_memory()


@gpu
def _analyze_on_device(image: str, variant: str, head_fusion: str, discard_ratio: float) -> ex.Exploration:
    return ex.explore(CACHE, image, variant, head_fusion=head_fusion, discard_ratio=discard_ratio)


@gpu
def _reanalyze_on_device(ref: SessionRef) -> ex.Exploration:
    return ex.explore_crop(CACHE, ref.crop, ref.variant)


def _remember(exp: ex.Exploration, key: str | None = None) -> SessionRef:
    """Keeps `exp` in the store; the session holds only the returned reference."""
    key = STORE.put(exp, exp.analysis.nbytes, key=key)
    return SessionRef(key=key, variant=exp.analysis.variant, crop=exp.analysis.image)


def _recall(ref: SessionRef | None) -> ex.Exploration:
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


def _npz(exp: ex.Exploration, *, attentions: bool = True) -> str:
    """Writes the .npz download under a random name; files older than 10 minutes (long since
    served) are removed."""
    now = time.time()
    for old in _DOWNLOADS.glob("*.npz"):
        if now - old.stat().st_mtime > 600:
            old.unlink(missing_ok=True)
    path = _DOWNLOADS / f"vitviz-{exp.analysis.variant}-{os.urandom(16).hex()}.npz"
    return str(ex.export_npz(exp, path, attentions=attentions))


def _notice(message: str) -> str:
    return f'<div class="vv-error">{as_text(message)}</div>'


# ------------------------------------------------------------------------------------------------
# Handlers (each callable directly in tests)

def on_analyze(image, variant, head_fusion, discard_ratio, layer_value=None, head_value=None, ref=None,
               progress=gr.Progress(track_tqdm=True)):
    """A new image or variant: the one handler that runs the model.

    Returns a dict keyed by component. When nothing can be analysed (no image, an image vitviz
    refuses, weights that cannot be had), only the notice changes, saying why: the results on the
    page stay those of the last analysis.
    """
    progress(0, desc=f"Loading {variant} (a first use may download its weights)")
    try:
        exp = _run(image, variant, head_fusion, discard_ratio)
    except gr.Error as exc:
        shown = f" The results below are still those of {ref.variant}." if isinstance(ref, SessionRef) else ""
        gr.Warning(exc.message)
        return {notice: f'<div class="vv-error">{exc.message}{as_text(shown)}</div>'}
    _forget(ref)
    a = exp.analysis
    layers = a.attentions.shape[0]
    heads = ex.head_choices(a.attentions.shape[1])
    # keep the layer and head the person was looking at when the new model has them
    layer_now = layer_value if isinstance(layer_value, (int, float)) and 1 <= layer_value <= layers else layers
    layer_now = int(layer_now)
    head_now = head_value if head_value in heads else "mean"
    rollout, exp = ex.render_rollout(exp, head_fusion=head_fusion, discard_ratio=float(discard_ratio))
    similarity, filters = ex.render_position(exp)
    grid, table_rows = ex.render_architecture(exp)
    return {
        state: _remember(exp),
        notice: "",
        predictions: ex.render_predictions(exp),
        rollout_img: rollout,
        layer: gr.update(maximum=layers, value=layer_now),
        head: gr.update(choices=heads, value=head_now),
        query: 0,
        query_text: ex.describe_query(exp, 0),
        explorer_img: ex.render_query(exp, layer=layer_now, head=head_now, query=0),
        mosaic: ex.render_head_mosaic(exp, layer=layer_now, query=0),
        distance_img: ex.render_distance(exp),
        similarity_img: similarity,
        filters_img: filters,
        grid_img: grid,
        table: table_rows,
        npz: None,
        status: (
            f"**{a.variant}** on {a.device}: {ex.spec_line(a.variant)}. Model call {a.model_seconds * 1e3:.0f} ms; "
            f"{a.grid[0]}x{a.grid[1]} patches of {a.patch_size} px, {exp.facts.total_params:,} parameters."
        ),
    }


def on_export(ref):
    """The analysis as .npz, written when asked for."""
    return _npz(_recall(ref))


def on_rollout_options(ref, head_fusion, discard_ratio):
    """Rollout options changed: recompute from the stored attention."""
    exp = _recall(ref)
    rollout, exp = ex.render_rollout(exp, head_fusion=_fusion(head_fusion), discard_ratio=_ratio(discard_ratio))
    STORE.put(exp, exp.analysis.nbytes, key=ref.key)
    return rollout


def on_view(ref, layer_value, head_value, query_value):
    """Layer, head or query changed: re-render the explorer from the stored attention."""
    exp = _recall(ref)
    depth, heads, tokens = exp.analysis.attentions.shape[:3]
    layer_value = _index(layer_value, 1, depth, "layer")
    head_value = _head(head_value, heads)
    query_value = _index(query_value, 0, tokens - 1, "query token")
    return (
        ex.render_query(exp, layer=layer_value, head=head_value, query=query_value),
        ex.render_head_mosaic(exp, layer=layer_value, query=query_value),
    )


def on_click(ref, layer_value, head_value, evt: gr.SelectData):
    """A click on the explorer image picks that patch as the query."""
    exp = _recall(ref)
    try:
        x, y = float(evt.index[0]), float(evt.index[1])
    except (TypeError, ValueError, IndexError):
        raise _error("A click must give the pixel (x, y) on the image.") from None
    query_value = ex.patch_at(exp, x, y)
    return (query_value, ex.describe_query(exp, query_value), *on_view(ref, layer_value, head_value, query_value))


def on_cls_query(ref, layer_value, head_value):
    exp = _recall(ref)
    return (0, ex.describe_query(exp, 0), *on_view(ref, layer_value, head_value, 0))


def on_compare(image, variants):
    """Two or three variants on the same image, side by side (a dict keyed by component).

    When something cannot be analysed, only the compare notice changes, saying why."""
    variants = list(variants or []) if isinstance(variants, (list, tuple)) else []
    try:
        if not 2 <= len(variants) <= MAX_COMPARE:
            raise _error(f"Pick two or three variants to compare (you picked {len(variants)}).")
        exps = [_run(image, v) for v in variants]
    except gr.Error as exc:
        gr.Warning(exc.message)
        return {compare_notice: f'<div class="vv-error">{exc.message}</div>'}
    out = {compare_notice: "", compare_distance: ex.render_compare_distance(exps)}
    for k, (col, md, ro, gd) in enumerate(slots):
        if k < len(exps):
            e = exps[k]
            a = e.analysis
            top = "\n".join(f"- {label}: {p:.1%}" for label, p in a.predictions[:3])
            out[col] = gr.update(visible=True)
            out[md] = (
                f"### {a.variant}\n{a.grid[0]}x{a.grid[1]} patches of {a.patch_size} px · {e.facts.total_params:,} params · "
                f"{a.model_seconds * 1e3:.0f} ms\n\n{top}"
            )
            out[ro] = ex.render_rollout(e)[0]
            out[gd] = ex.render_architecture(e)[0]
        else:
            out[col], out[md], out[ro], out[gd] = gr.update(visible=False), "", None, None
    return out


def api_analyze(image, variant):
    """The `/analyze` endpoint: image and variant in; predictions, rollout, distance plot and an .npz
    (rollout, cls map, distances, probabilities, the crop; the attention stack stays in the page's download)."""
    exp = _run(image, variant)
    return ex.render_predictions(exp), ex.render_rollout(exp)[0], ex.render_distance(exp), _npz(exp, attentions=False)


def on_variant_info(variant):
    try:
        return ex.spec_line(_variant(variant))
    except gr.Error:
        return ""


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
            variant = gr.Dropdown(ex.variant_choices(), value=DEFAULT_VARIANT, label="Model variant", elem_id="vv-variant")
            variant_info = gr.Markdown(ex.spec_line(DEFAULT_VARIANT), elem_classes="vv-caption")
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
                            ex.variant_choices(), value=["shapes_p16", "shapes_p8"], label="Variants (two or three)"
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
    analysis_inputs = [image, variant, head_fusion, discard, layer, head, state]
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
