"""vitviz in the browser: upload an image, pick a ViT, see what it predicts and how it got there.

Layout and wiring only; everything computed lives in `vitviz` (`vitviz.explorer` for the views).
Run with `python app.py`; deploys unchanged as a Hugging Face Space.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402
import torch  # noqa: E402
from gradio.data_classes import ImageData  # noqa: E402
from PIL import Image  # noqa: E402

from vitviz import explorer as ex  # noqa: E402
from vitviz.images import ImageError, describe_limits  # noqa: E402
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


class UploadedImage(gr.Image):
    """An image input whose file goes to `vitviz.load_image` untouched.

    Gradio's own preprocessing opens and converts the upload with Pillow (clipping 16-bit images,
    dropping transparency to black, failing with generic errors); here every check and conversion
    is vitviz's image gate, which answers each refusal with a clear message.
    """

    def get_block_name(self) -> str:
        return "image"  # the frontend is Gradio's own image component

    def preprocess(self, payload):
        if payload is None or payload.path is None:
            return super().preprocess(payload)
        return str(payload.path)


class PngImage(gr.Image):
    """An output image sent as PNG at zlib level 1.

    Gradio's own encoding uses Pillow's default level 6, which takes 72 ms for a 448 px rollout
    overlay on this project's 2-core benchmark machine; level 1 takes 18 ms for 16 % more bytes.
    """

    FORMAT = "png"
    SAVE_OPTIONS: dict = {"compress_level": 1}

    # no __init__ of its own: Gradio builds the page's configuration from gr.Image's signature

    def get_block_name(self) -> str:
        return "image"

    def postprocess(self, value):
        if not isinstance(value, Image.Image):
            return super().postprocess(value)
        with io.BytesIO() as buf:
            value.convert("RGB").save(buf, format=self.FORMAT, **self.SAVE_OPTIONS)
            data = buf.getvalue()
        folder = Path(self.GRADIO_CACHE) / hashlib.sha256(data).hexdigest()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"image.{self.FORMAT}"
        path.write_bytes(data)
        return ImageData(path=str(path), orig_name=path.name)


class ViewImage(PngImage):
    """An image that changes with every move (rollout option, layer, head, query patch): JPEG at
    quality 92 with full-resolution colour. For ViT-B/16's 448 px overlay and 12-head mosaic of
    a photo that is 4 ms and 283 kB against 57 ms and 907 kB as PNG at level 1 (the 2-core
    benchmark machine); the exact numbers are in the .npz export."""

    FORMAT = "jpeg"
    SAVE_OPTIONS = {"quality": 92, "subsampling": 0}


def _device_line() -> str:
    dev = default_device()
    if dev.type == "cuda":
        return f"GPU: {torch.cuda.get_device_name()}"
    return f"CPU ({torch.get_num_threads()} threads)"


def _run(image: str | None, variant: str, head_fusion: str = "mean", discard_ratio: float = 0.0) -> ex.Exploration:
    if image is None:
        raise gr.Error("Upload an image first (or pick an example).")
    if not variant:
        raise gr.Error("Choose a model variant.")
    ex.release_memory()  # what the previous request's rendering and encoding freed
    try:
        return _analyze_on_device(image, variant, head_fusion, float(discard_ratio))
    except (ImageError, WeightsUnavailableError) as exc:
        raise gr.Error(str(exc)) from None
    finally:
        ex.release_memory()


@gpu
def _analyze_on_device(image: str, variant: str, head_fusion: str, discard_ratio: float) -> ex.Exploration:
    return ex.explore(CACHE, image, variant, head_fusion=head_fusion, discard_ratio=discard_ratio)


def _npz(exp: ex.Exploration, *, attentions: bool = True) -> str:
    """Writes the .npz download; files older than 10 minutes (long since served) are removed."""
    now = time.time()
    for old in _DOWNLOADS.glob("*.npz"):
        if now - old.stat().st_mtime > 600:
            old.unlink(missing_ok=True)
    path = _DOWNLOADS / f"vitviz-{exp.analysis.variant}-{os.urandom(4).hex()}.npz"
    return str(ex.export_npz(exp, path, attentions=attentions))


# ------------------------------------------------------------------------------------------------
# Handlers (each callable directly in tests)

def on_analyze(image, variant, head_fusion, discard_ratio, progress=gr.Progress(track_tqdm=True)):
    """A new image or variant: the one handler that runs the model."""
    progress(0, desc=f"Loading {variant} (a first use may download its weights)")
    exp = _run(image, variant, head_fusion, discard_ratio)
    a = exp.analysis
    layers = a.attentions.shape[0]
    heads = ex.head_choices(a.attentions.shape[1])
    rollout, exp = ex.render_rollout(exp, head_fusion=head_fusion, discard_ratio=float(discard_ratio))
    similarity, filters = ex.render_position(exp)
    grid, table = ex.render_architecture(exp)
    status = (
        f"**{a.variant}** on {a.device}: {ex.spec_line(a.variant)}. Model call {a.model_seconds * 1e3:.0f} ms; "
        f"{a.grid[0]}x{a.grid[1]} patches of {a.patch_size} px, {exp.facts.total_params:,} parameters."
    )
    return (
        exp,
        ex.render_predictions(exp),
        rollout,
        gr.update(maximum=layers, value=layers),
        gr.update(choices=heads, value="mean"),
        0,
        ex.describe_query(exp, 0),
        ex.render_query(exp, layer=layers, head="mean", query=0),
        ex.render_head_mosaic(exp, layer=layers, query=0),
        ex.render_distance(exp),
        similarity,
        filters,
        grid,
        table,
        None,
        status,
    )


def on_export(exp):
    """The analysis as .npz, written when asked for."""
    return _npz(_need(exp))


def _need(exp: ex.Exploration | None) -> ex.Exploration:
    if exp is None:
        raise gr.Error("Analyse an image first.")
    return exp


def on_rollout_options(exp, head_fusion, discard_ratio):
    """Rollout options changed: recompute from the stored attention."""
    rollout, exp = ex.render_rollout(_need(exp), head_fusion=head_fusion, discard_ratio=float(discard_ratio))
    return rollout, exp


def on_view(exp, layer, head, query):
    """Layer, head or query changed: re-render the explorer from the stored attention."""
    exp = _need(exp)
    layer = int(layer)
    return ex.render_query(exp, layer=layer, head=head, query=int(query)), ex.render_head_mosaic(exp, layer=layer, query=int(query))


def on_click(exp, layer, head, evt: gr.SelectData):
    """A click on the explorer image picks that patch as the query."""
    exp = _need(exp)
    x, y = evt.index[0], evt.index[1]
    query = ex.patch_at(exp, x, y)
    return (query, ex.describe_query(exp, query), *on_view(exp, layer, head, query))


def on_cls_query(exp, layer, head):
    exp = _need(exp)
    return (0, ex.describe_query(exp, 0), *on_view(exp, layer, head, 0))


def on_compare(image, variants):
    """Two or three variants on the same image, side by side."""
    variants = list(variants or [])
    if not 2 <= len(variants) <= MAX_COMPARE:
        raise gr.Error(f"Pick two or three variants to compare (you picked {len(variants)}).")
    exps = [_run(image, v) for v in variants]
    outputs = []
    for k in range(MAX_COMPARE):
        if k < len(exps):
            e = exps[k]
            a = e.analysis
            top = "\n".join(f"- {label}: {p:.1%}" for label, p in a.predictions[:3])
            outputs += [
                gr.update(visible=True),
                f"### {a.variant}\n{a.grid[0]}x{a.grid[1]} patches of {a.patch_size} px · {e.facts.total_params:,} params · "
                f"{a.model_seconds * 1e3:.0f} ms\n\n{top}",
                ex.render_rollout(e)[0],
                ex.render_architecture(e)[0],
            ]
        else:
            outputs += [gr.update(visible=False), "", None, None]
    return (*outputs, ex.render_compare_distance(exps))


def api_analyze(image, variant):
    """The `/analyze` endpoint: image and variant in; predictions, rollout, distance plot and an .npz
    (rollout, cls map, distances, probabilities, the crop; the attention stack stays in the page's download)."""
    exp = _run(image, variant)
    return ex.render_predictions(exp), ex.render_rollout(exp)[0], ex.render_distance(exp), _npz(exp, attentions=False)


def on_variant_info(variant):
    try:
        return ex.spec_line(variant)
    except ValueError as exc:
        raise gr.Error(str(exc)) from None


# ------------------------------------------------------------------------------------------------
# Layout

CSS = """
.vv-caption { color: var(--body-text-color-subdued); font-size: 0.92em; }
#vv-explorer img { cursor: crosshair; }
"""

with gr.Blocks(title="vitviz — look inside Vision Transformers", delete_cache=(600, 1800)) as demo:
    state = gr.State(None, time_to_live=3600)
    query = gr.State(0)
    gr.Markdown(
        "# vitviz — look inside Vision Transformers\n"
        f"Upload a photo, pick a ViT, and see what it predicts and how it got there. Running on **{_device_line()}**. "
        f"Default model: {DEFAULT_REASON}.".replace(str(checkpoint_dir()), f"`{checkpoint_dir()}`")
    )
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=300):
            image = UploadedImage(label="Image", type="filepath", sources=["upload", "clipboard"], height=320, elem_id="vv-image")
            variant = gr.Dropdown(ex.variant_choices(), value=DEFAULT_VARIANT, label="Model variant")
            variant_info = gr.Markdown(ex.spec_line(DEFAULT_VARIANT), elem_classes="vv-caption")
            run = gr.Button("Analyse", variant="primary", elem_id="vv-run")
            if EXAMPLES:
                gr.Examples(EXAMPLES, inputs=image, label="Examples")
            gr.Markdown(f"Images: {describe_limits()}.", elem_classes="vv-caption")
        with gr.Column(scale=2, min_width=320):
            status = gr.Markdown("", elem_id="vv-status")
            with gr.Tabs():
                with gr.Tab("Predict"):
                    gr.Markdown(
                        "Top-5 classes and **attention rollout**: how much the cls token, after all layers, draws on each "
                        "patch. Each layer's attention (heads fused by mean, max or min, the weakest links optionally "
                        "discarded) is mixed half-and-half with the identity for the residual path, and the layers are "
                        "multiplied from the first up (Abnar & Zuidema 2020).",
                        elem_classes="vv-caption",
                    )
                    with gr.Row():
                        predictions = gr.Label(num_top_classes=5, label="Predictions", elem_id="vv-predictions")
                        rollout_img = ViewImage(interactive=False, label="Attention rollout", buttons=["download"], elem_id="vv-rollout")
                    with gr.Row():
                        head_fusion = gr.Radio(["mean", "max", "min"], value="mean", label="Head fusion")
                        discard = gr.Slider(0.0, 0.95, value=0.0, step=0.05, label="Discard ratio")
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
                        head = gr.Dropdown(["mean", "max"], value="mean", label="Head")
                    with gr.Row():
                        query_text = gr.Markdown("query: the cls token", elem_id="vv-query")
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
                    slots = []
                    with gr.Row():
                        for k in range(MAX_COMPARE):
                            with gr.Column(visible=k < 2, min_width=220) as col:
                                md = gr.Markdown("", elem_id=f"vv-compare-{k + 1}")
                                ro = PngImage(interactive=False, label="Rollout")
                                gd = PngImage(interactive=False, label="Patch grid")
                            slots += [col, md, ro, gd]
                    compare_distance = PngImage(interactive=False, label="Mean attention distance", buttons=["download"], elem_id="vv-compare-distance")

    # hidden outputs of the API endpoint
    with gr.Row(visible=False):
        api_button = gr.Button("api")
        api_pred = gr.Label()
        api_rollout = PngImage(interactive=False)
        api_distance = PngImage(interactive=False)
        api_npz = gr.File()

    analysis_outputs = [
        state, predictions, rollout_img, layer, head, query, query_text, explorer_img, mosaic, distance_img,
        similarity_img, filters_img, grid_img, table, npz, status,
    ]
    # The session endpoints (undocumented, callable with gradio_client) keep the analysis in the
    # caller's session, as the page does: `python -m vitviz.bench --app` times view changes through them.
    run.click(on_analyze, [image, variant, head_fusion, discard], analysis_outputs, api_visibility="undocumented", api_name="session_analyze")
    image.upload(on_analyze, [image, variant, head_fusion, discard], analysis_outputs, api_visibility="private")
    variant.input(on_variant_info, variant, variant_info, api_visibility="private").then(
        on_analyze, [image, variant, head_fusion, discard], analysis_outputs, api_visibility="private"
    )
    head_fusion.input(on_rollout_options, [state, head_fusion, discard], [rollout_img, state], api_visibility="undocumented", api_name="session_rollout")
    discard.release(on_rollout_options, [state, head_fusion, discard], [rollout_img, state], api_visibility="private")
    layer.release(on_view, [state, layer, head, query], [explorer_img, mosaic], api_visibility="undocumented", api_name="session_view")
    head.input(on_view, [state, layer, head, query], [explorer_img, mosaic], api_visibility="private")
    explorer_img.select(on_click, [state, layer, head], [query, query_text, explorer_img, mosaic], api_visibility="private")
    cls_button.click(on_cls_query, [state, layer, head], [query, query_text, explorer_img, mosaic], api_visibility="private")
    export.click(on_export, state, npz, api_visibility="private")
    compare_run.click(on_compare, [image, compare_pick], [*slots, compare_distance], api_visibility="private")
    api_button.click(api_analyze, [image, variant], [api_pred, api_rollout, api_distance, api_npz], api_name="analyze")

demo.queue(max_size=QUEUE_SIZE, default_concurrency_limit=CONCURRENCY)

LAUNCH_KWARGS = dict(css=CSS, theme=gr.themes.Soft(), max_file_size="20mb", ssr_mode=False)

if __name__ == "__main__":
    demo.launch(**LAUNCH_KWARGS)
