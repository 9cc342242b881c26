"""vitviz in the browser: upload an image, pick a ViT, see what it predicts and how it got there.

Layout, wiring and thin handlers only; everything computed lives in `vitviz` (`vitviz.server` for
the app's logic without Gradio). Started by `python app.py` in the repository (and as a Hugging Face
Space), or by the `vitviz-app` command that `pip install vitviz[app]` installs.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402
import torch  # noqa: E402
from gradio.components import Component  # noqa: E402
from starlette.middleware import Middleware  # noqa: E402

from vitviz.cost import price, together  # noqa: E402
from vitviz.images import MAX_BYTES, ImageError, describe_limits  # noqa: E402
from vitviz.server import explaining, inputs, views  # noqa: E402
from vitviz.server import explorer_data  # noqa: E402
from vitviz.server.export import Downloads, sweep  # noqa: E402
from vitviz import plots  # noqa: E402
from vitviz.explainers import method as registered_method, methods  # noqa: E402
from vitviz.server.gradio_io import (  # noqa: E402
    BodyLimit, GuardedBlocks, PngImage, UploadedImage, UploadLimit, ViewImage, as_text, upload_folder,
)
from vitviz.server.memory import release_memory  # noqa: E402
from vitviz.server.menus import head_choices, spec_line, variant_choices  # noqa: E402
from vitviz.server.models import ModelCache  # noqa: E402
from vitviz.server.sessions import SessionRef, SessionStore  # noqa: E402
from vitviz.server.settings import Settings  # noqa: E402
from vitviz.server.work import Cancelled, KeyedLocks, ModelWork, RequestRefused  # noqa: E402
from vitviz.sources import (  # noqa: E402
    WeightsUnavailableError, assets_dir, checkpoint_dir, default_device, default_variant, get_spec, list_variants,
)

try:  # ZeroGPU on Hugging Face Spaces; a no-op elsewhere
    import spaces

    gpu = spaces.GPU
except ImportError:  # pragma: no cover - depends on the host

    def gpu(fn):
        return fn


Outputs = dict[Component, Any]

MENU = list_variants()
# the Explain tab's maps: every registered method that explains a class or none (plugins loaded now)
METHODS = tuple(m for m in methods() if not registered_method(m).needs_text)
# every bound the server keeps, from the environment (the table in vitviz/server/settings.py)
SETTINGS = Settings.from_env(gpu=torch.cuda.is_available(), menu_tokens=max(s.num_tokens for s in MENU))
CACHE = ModelCache(max_models=SETTINGS.max_models, hub_bytes=SETTINGS.hub_bytes)
# one budget of model work for every event and the explorer's calls: priced before, bounded while running
WORK = ModelWork(budget_bytes=SETTINGS.work_bytes, lanes=SETTINGS.concurrency, seconds=SETTINGS.request_seconds)
DEFAULT_VARIANT, DEFAULT_REASON = default_variant()
EXAMPLES = sorted(str(p) for p in (assets_dir() / "examples").glob("*.png"))
MAX_COMPARE = 3
DOWNLOADS = Downloads(max_bytes=SETTINGS.downloads_bytes)
SCALES = ("one per layer", "each map its own", "all layers and heads")  # the explorer's: "layer", "map", "shared"
EXPLAIN_SCALES = ("each map", "shared by the four maps")  # the Explain tab's
# the explorer's data for the browser: files in Gradio's upload folder (which it serves), secret names
EXPLORER_DIR = upload_folder() / "vitviz-explorer"
EXPLORER_WIDGET = explorer_data.widget_files()
EXPLORER_LOCKS = KeyedLocks()  # each explorer file is written once, by one thread
EXPLORER_CALLS = threading.BoundedSemaphore(4)  # explorer_layer calls at once (they run on Gradio's thread pool)
# Analyses kept for sessions: all of them together within VITVIZ_STATE_MB (default 3 GiB, sized for
# a 16 GB Space beside 3 GiB of models); an analysis unused for VITVIZ_STATE_IDLE seconds is dropped.
STORE: SessionStore[views.Exploration] = SessionStore(budget_bytes=SETTINGS.state_bytes, idle_seconds=SETTINGS.state_idle)


def _device_line() -> str:
    dev = default_device()
    if dev.type == "cuda":
        return f"GPU: {torch.cuda.get_device_name()}"
    return f"CPU ({torch.get_num_threads()} threads)"


def _error(message: str) -> gr.Error:
    """An error for the page and the API, its text shown as typed (the page reads it as HTML)."""
    return gr.Error(as_text(message))


def _checked(check, *args, **kwargs):
    """A client's field through its check in `vitviz.server.inputs`, or a clear error."""
    try:
        return check(*args, **kwargs)
    except inputs.InputError as exc:
        raise _error(str(exc)) from None


def _variant(name: object) -> str:
    """A variant a client named, within this server's bounds (menu, parameters, tokens)."""
    return _checked(inputs.variant, name, max_params=SETTINGS.max_params, max_tokens=SETTINGS.max_tokens,
                    open_models=SETTINGS.open_models)


def _job(kind: str, variant: str, request: gr.Request | None = None, *, wait: float | None = None, **options):
    """Model work of `kind` on `variant`, priced before it starts and run within the server's budget."""
    return _priced(price(get_spec(variant), kind, budget=WORK.budget_bytes, **options), request, wait=wait)


@contextmanager
def _priced(cost, request: gr.Request | None = None, *, wait: float | None = None):
    try:
        with WORK.job(cost, session=getattr(request, "session_hash", None), wait=wait) as job:
            yield job
    except (RequestRefused, Cancelled) as exc:
        raise _error(str(exc)) from None


def _files_sweep() -> None:
    """Uploads and Gradio's copies of pictures within VITVIZ_FILES_MB, oldest first (examples stay)."""
    sweep(upload_folder(), max_age=1800, max_bytes=SETTINGS.files_bytes, recursive=True, skip=(EXPLORER_DIR,), keep=_is_example)


_EXAMPLE_FILES = {(Path(p).name, Path(p).stat().st_size): hashlib.sha256(Path(p).read_bytes()).digest() for p in EXAMPLES}


def _is_example(path: Path) -> bool:
    """Whether `path` is Gradio's copy of one of the examples (same name, size and bytes)."""
    try:
        digest = _EXAMPLE_FILES.get((path.name, path.stat().st_size))
        return digest is not None and hashlib.sha256(path.read_bytes()).digest() == digest
    except OSError:
        return False


# ------------------------------------------------------------------------------------------------
# Running the model, and the analyses kept for sessions

def _run(image: str | None, variant: str) -> views.Exploration:
    """The analysis of `image` by `variant`; a refusal is a `gr.Error` whose `cause` says which of
    the two was the problem ("image" or "variant")."""
    if image is None:
        raise _error("Upload an image first (or pick an example).")
    try:
        variant = _variant(variant)
    except gr.Error as exc:
        exc.cause = "variant"
        raise
    release_memory()  # what the previous request's rendering and encoding freed
    try:
        with _job("analyse", variant) as job:
            job.unpriced = variant not in CACHE.loaded()  # loading (or downloading) is not model speed
            return _analyze_on_device(image, variant)
    except ImageError as exc:
        error = _error(f"{_file_name(image)}: {inputs.public_text(str(exc))}")
        error.cause = "image"
        raise error from None
    except WeightsUnavailableError as exc:
        error = _error(inputs.public_text(str(exc)))
        error.cause = "variant"
        raise error from None
    except gr.Error as exc:  # priced above this server's bounds: the variant (at its size) is the problem
        exc.cause = "variant"
        raise
    finally:
        release_memory()


def _file_name(path: str | None) -> str:
    """An uploaded file's name as its owner named it (Gradio keeps it, in a folder of its own)."""
    return Path(str(path)).name if path else "the image"


@gpu
def _analyze_on_device(image: str, variant: str) -> views.Exploration:
    return views.explore(CACHE, image, variant)


@gpu
def _reanalyze_on_device(ref: SessionRef) -> views.Exploration:
    return views.explore_crop(CACHE, ref.crop, ref.variant)


def _remember(exp: views.Exploration, source: str = "") -> SessionRef:
    """Keeps `exp` in the store; the session holds only the returned reference."""
    key = STORE.put(exp, exp.analysis.nbytes)
    return SessionRef(key=key, variant=exp.analysis.variant, crop=exp.analysis.image, image=_file_name(source), source=source)


def _recall(ref: SessionRef | None) -> views.Exploration:
    """The session's analysis; computed again from its crop when the store has dropped it."""
    if not isinstance(ref, SessionRef):
        raise _error("Analyse an image first.")
    exp = STORE.get(ref.key)
    if exp is None:
        try:
            with _job("analyse", ref.variant):
                exp = _reanalyze_on_device(ref)
        except WeightsUnavailableError as exc:
            raise _error(inputs.public_text(str(exc))) from None
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
    """A new image or variant: the one handler that runs the model for an analysis.

    When nothing can be analysed (no image, an image vitviz refuses, weights that cannot be had),
    only the notice changes, saying why: the results on the page stay those of the last analysis.
    The Explain and Tokens tabs are drawn when shown (`on_tab`).
    """
    if isinstance(ref, SessionRef) and image == ref.source and isinstance(variant, str) and variant.strip() == ref.variant:
        return {results_box: gr.update(elem_classes=["vv-results"])}  # what is shown is this very analysis
    progress(0, desc=f"Loading {variant} (a first use may download its weights)")
    try:
        head_fusion, discard_ratio = _checked(inputs.fusion, head_fusion), _checked(inputs.ratio, discard_ratio)
        with _analysis_job(image, variant):  # the job lasts until every picture of the analysis is drawn
            exp = _run(image, variant)
            return _analysis_outputs(exp, image, ref, head_fusion, discard_ratio)
    except gr.Error as exc:
        return _refused(exc, ref)


@contextmanager
def _analysis_job(image: str | None, variant: object):
    """The job of an analysis and its pictures (`_run` inside it takes no second one)."""
    if image is None:
        raise _error("Upload an image first (or pick an example).")
    try:
        name = _variant(variant)
    except gr.Error as exc:
        exc.cause = "variant"
        raise
    try:
        with _job("analyse", name) as job:
            yield job
    except gr.Error as exc:
        exc.cause = getattr(exc, "cause", None) or "variant"
        raise


def _analysis_outputs(exp: views.Exploration, image: str, ref: SessionRef | None, head_fusion: str, discard_ratio: float) -> Outputs:
    same_model = isinstance(ref, SessionRef) and ref.variant == exp.analysis.variant
    _forget(ref)
    a = exp.analysis
    depth, heads = a.attentions.shape[:2]
    grid, table_rows = views.render_architecture(exp)
    similarity, filters = views.render_position(exp)
    distilled = "dist" in a.prefix_names
    has_head = a.probabilities is not None
    top = a.predictions(1)
    classes = gr.update(value=top[0][0] if top else None)
    if same_model:  # the model's own pictures and class list are on the page already
        similarity, filters, table_rows = gr.skip(), gr.skip(), gr.skip()
    else:
        classes = gr.update(choices=list(a.categories or []), value=top[0][0] if top else None, interactive=has_head)
    return {
        state: _remember(exp, image),
        notice: "",
        results_box: gr.update(elem_classes=["vv-results"]),
        result_thumb: a.image,
        predictions: gr.update(value=views.render_predictions(exp) if has_head else None, visible=has_head),
        predict_note: "" if has_head else (
            f"**{a.variant} has no classifier** (a self-supervised or feature model): there are no class predictions. "
            "The maps show what its tokens attend to."
        ),
        rollout_img: views.render_rollout(exp, head_fusion=head_fusion, discard_ratio=discard_ratio),
        dist_rollout_img: gr.update(
            value=views.render_rollout(exp, head_fusion=head_fusion, discard_ratio=discard_ratio, token=1) if distilled else None,
            visible=distilled,
        ),
        target_class: classes,
        prefix_query: gr.update(choices=list(a.query_names), value=None),
        layer: gr.update(maximum=depth, value=depth),
        head: gr.update(choices=head_choices(heads), value="mean"),
        query: 0,
        query_text: views.describe_query(exp, 0),

        distance_img: views.render_distance(exp),
        similarity_img: similarity,
        filters_img: filters,
        grid_img: grid,
        table: table_rows,
        npz: None,
        faith_img: None,
        faith_table: None,
        status: (
            f"**{_md(_file_name(image))}** on **{a.variant}** ({a.device}): {spec_line(a.variant)}. Model call "
            f"{a.model_seconds * 1e3:.0f} ms; {a.grid[0]}x{a.grid[1]} patches of {a.patch_size} px, {exp.facts.total_params:,} parameters."
        ),
    }


def _md(text: str) -> str:
    """`text` shown as typed in Markdown."""
    return "".join("\\" + c if c in "\\`*_{}[]<>()#+-.!|~" else c for c in as_text(text))


def _refused(exc: gr.Error, ref: SessionRef | None) -> Outputs:
    """Nothing could be analysed: say why, mark the results on the page as those of their own image
    and variant, put the menu back on a variant that works, and drop a file that is no image."""
    cause = getattr(exc, "cause", None)
    out: Outputs = {}
    message = exc.message
    if isinstance(ref, SessionRef):
        stop = "" if message.rstrip().endswith((".", "!", "?", ":")) else "."
        message += as_text(f"{stop} The results below are still those of {ref.image} on {ref.variant}.")
        out[results_box] = gr.update(elem_classes=["vv-results", "vv-stale"])
        if cause == "variant":  # the menu goes back to the variant that works
            out[variant] = gr.update(value=ref.variant)
            message += as_text(f" The menu is back on {ref.variant}.")
    if cause == "image":
        out[image] = None  # no broken preview left behind
    gr.Warning(exc.message)
    out[notice] = _notice(message)
    return out


def on_explorer(ref: SessionRef | None) -> Outputs:
    """After an analysis is on the page: the explorer's data for the browser (written once per
    analysis), or, for a model too large for it, the server's explorer."""
    if not isinstance(ref, SessionRef):
        return {explorer_live: gr.skip()}
    exp = _recall(ref)
    with EXPLORER_LOCKS.hold(ref.key), _job("explorer", ref.variant) as job:
        _explorer_sweep(room=job.cost.kept_bytes)
        live = explorer_data.write_payload(exp, key=ref.key, folder=EXPLORER_DIR)
    on_server = live["mode"] == "server"  # too large for the browser: the server draws the explorer
    depth = exp.analysis.attentions.shape[0]
    return {
        explorer_live: live,
        server_explorer: gr.update(visible=on_server),
        explorer_img: views.render_query(exp, layer=depth, head="mean", query=0) if on_server else None,
        mosaic: views.render_head_mosaic(exp, layer=depth, query=0) if on_server else None,
    }


def on_export(ref: SessionRef | None) -> Outputs:
    """The analysis as .npz, written when asked for (within VITVIZ_DOWNLOADS_MB on disk)."""
    exp = _recall(ref)
    with _job("export", ref.variant) as job:
        try:
            return {npz: DOWNLOADS.npz(exp, size=job.cost.kept_bytes)}
        except ValueError as exc:
            raise _error(inputs.public_text(str(exc))) from None


def on_rollout_options(ref: SessionRef | None, head_fusion: str, discard_ratio: float) -> Outputs:
    """Rollout options changed: drawn again from the stored attention (a rollout is model-sized work)."""
    exp = _recall(ref)
    fusion, ratio = _checked(inputs.fusion, head_fusion), _checked(inputs.ratio, discard_ratio)
    with _job("view", ref.variant):
        out: Outputs = {rollout_img: views.render_rollout(exp, head_fusion=fusion, discard_ratio=ratio)}
        if "dist" in exp.analysis.prefix_names:
            out[dist_rollout_img] = views.render_rollout(exp, head_fusion=fusion, discard_ratio=ratio, token=1)
    return out


def explorer_layer(request: list) -> str:
    """The browser's call for one layer's file (the "layers" layout): [analysis key, layer] -> its path.
    The key is the session's own secret; an unknown or dropped one gets an error."""
    try:
        key, layer_value = request
    except (TypeError, ValueError):
        raise _error("explorer_layer takes [key, layer].") from None
    exp = STORE.get(key) if isinstance(key, str) else None
    if exp is None:
        raise _error("This analysis is no longer kept: analyse the image again.")
    layer_value = _checked(inputs.index, layer_value, 1, exp.analysis.attentions.shape[0], "layer")
    # outside the queue, on Gradio's shared thread pool: a few at a time, none waiting long
    if not EXPLORER_CALLS.acquire(blocking=False):
        raise _error("The server is busy: the layer will be fetched again when you show it.")
    try:
        with EXPLORER_LOCKS.hold((key, layer_value)), _job("explorer_layer", exp.analysis.variant, wait=10.0) as job:
            return _write_layer(exp, key, layer_value, job)
    finally:
        EXPLORER_CALLS.release()


def _write_layer(exp: views.Exploration, key: str, layer_value: int, job) -> str:
    _explorer_sweep(room=job.cost.kept_bytes)
    return explorer_data.write_layer(exp, key=key, layer=layer_value, folder=EXPLORER_DIR)


def _explorer_sweep(*, room: int) -> None:
    """The explorer's files within VITVIZ_EXPLORER_MB, with `room` for one about to be written."""
    sweep(EXPLORER_DIR, max_age=1800, max_bytes=SETTINGS.explorer_bytes, room=room)


def on_view(ref: SessionRef | None, layer_value: float, head_value: str, query_value: float, scale_value: str = SCALES[0]) -> Outputs:
    """Layer, head, query or colour scale changed: the explorer drawn again from the stored attention."""
    exp = _recall(ref)
    depth, heads = exp.analysis.attentions.shape[:2]
    layer_value = _checked(inputs.index, layer_value, 1, depth, "layer")
    head_value = _checked(inputs.head, head_value, heads)
    query_value = _checked(inputs.index, query_value, 0, exp.analysis.num_queries - 1, "query token")
    scale = _scale(scale_value)
    return {
        explorer_img: views.render_query(exp, layer=layer_value, head=head_value, query=query_value, scale=scale),
        mosaic: views.render_head_mosaic(exp, layer=layer_value, query=query_value, scale=scale),
    }


def _scale(value: str, choices: tuple[str, ...] = SCALES) -> str:
    if value not in choices:
        raise _error(f"The colour scale must be one of: {', '.join(choices)}.")
    return {"one per layer": "layer", "each map its own": "map", "each map": "map"}.get(value, "shared")


def _click_xy(evt: gr.SelectData) -> tuple[float, float]:
    try:
        return float(evt.index[0]), float(evt.index[1])
    except (TypeError, ValueError, IndexError, AttributeError):
        raise _error("A click must give the pixel (x, y) on the image.") from None


def on_click(ref: SessionRef | None, layer_value: float, head_value: str, scale_value: str, evt: gr.SelectData) -> Outputs:
    """A click on the explorer image picks that patch as the query."""
    exp = _recall(ref)
    query_value = views.patch_at(exp, *_click_xy(evt))
    return {
        query: query_value, query_text: views.describe_query(exp, query_value), prefix_query: None,
        **on_view(ref, layer_value, head_value, query_value, scale_value),
    }


def on_prefix_query(ref: SessionRef | None, layer_value: float, head_value: str, name: str | None, scale_value: str = SCALES[0]) -> Outputs:
    """A prefix token (cls, distillation, a register) or a mean-pooled model's "pool" as the query."""
    exp = _recall(ref)
    names = exp.analysis.query_names
    if name not in names:
        raise _error(f"The query token must be one of {', '.join(names)}.")
    index = names.index(name)
    return {query: index, query_text: views.describe_query(exp, index), **on_view(ref, layer_value, head_value, index, scale_value)}


@gpu
def _explain_on_device(exp: views.Exploration, target: str | None) -> tuple[dict, int | None]:
    return explaining.explain_exploration(CACHE, exp, target=target)


class _Recent:
    """A bounded set: the newest `size` keys."""

    def __init__(self, size: int = 4096) -> None:
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def add(self, key: str) -> None:
        with self._lock:
            self._keys[key] = None
            self._keys.move_to_end(key)
            while len(self._keys) > self._size:
                self._keys.popitem(last=False)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._keys


_EXPLAINED = _Recent()  # the analyses whose Explain tab has been drawn


def on_explain(ref: SessionRef | None, target: str | None, scale_value: str = EXPLAIN_SCALES[0], request: gr.Request = None,
               *, keep_faithfulness: bool = False) -> Outputs:
    """The Explain tab: every method's map for the chosen class (one forward and one backward)."""
    exp = _recall(ref)
    a = exp.analysis
    if a.categories is not None and target not in a.categories:
        raise _error("Pick one of the model's classes to explain.")
    scale = _scale(scale_value, EXPLAIN_SCALES)
    with _job("explain", a.variant, request):
        maps, index = _explain_on_device(exp, target)
    label = a.categories[index] if index is not None else "no-class"
    pictures = views.render_method_maps(exp, maps, label=label, scale=scale)
    if index is None:
        note = (f"**{a.variant} has no classifier**: the gradient methods need a class logit, so only the attention of the "
                "last layer and its rollout are shown.")
    else:
        note = f"Explaining **{label}** ({float(a.probabilities[index]):.1%})."
    faith = {faith_img: gr.skip(), faith_table: gr.skip()} if keep_faithfulness else {faith_img: None, faith_table: None}
    _EXPLAINED.add(ref.key)
    return {explain_note: note, **faith, **{explain_imgs[m]: pictures.get(m) for m in METHODS}}


def on_explain_scale(ref: SessionRef | None, target: str | None, scale_value: str, request: gr.Request = None) -> Outputs:
    """The Explain tab's colour scale changed: the maps drawn again; the curves do not depend on it."""
    return on_explain(ref, target, scale_value, request, keep_faithfulness=True)


def on_pick_class(ref: SessionRef | None, scale_value: str, evt: gr.SelectData) -> Outputs:
    """A click on a prediction: that class, explained, in the Explain tab."""
    label = evt.value if isinstance(evt.value, str) else (evt.value or {}).get("label") if isinstance(evt.value, dict) else None
    return {target_class: label, tabs: gr.Tabs(selected="explain"), current_tab: "explain", **on_explain(ref, label, scale_value)}


@gpu
def _faithfulness_on_device(exp: views.Exploration, maps: dict, index: int, batch_size: int, check) -> dict:
    return explaining.faithfulness_of(CACHE, exp, maps, target=index, batch_size=batch_size, check=check)


def on_faithfulness(ref: SessionRef | None, target: str | None, progress=gr.Progress(), request: gr.Request = None) -> Outputs:
    """Deletion and insertion curves of every method for the chosen class, with a random order beside."""
    exp = _recall(ref)
    a = exp.analysis
    if a.categories is None:
        raise _error(f"{a.variant} has no classifier: deletion and insertion measure the probability of a class.")
    if target not in a.categories:
        raise _error("Pick one of the model's classes first.")
    progress(0, desc="Deleting and inserting patches (every method, 17 steps each)")
    with _job("faithfulness", a.variant, request) as job:
        maps, index = _explain_on_device(exp, target)
        curves = _faithfulness_on_device(exp, maps, index, job.cost.batch, job.check)
    figure = plots.faithfulness_figure(curves, title=f"{a.variant}: {target}")
    rows = [[name, f"{float(c.deletion_auc[0]):.3f}", f"{float(c.insertion_auc[0]):.3f}"] for name, c in curves.items()]
    return {faith_img: plots.named(plots.figure_to_image(figure), views._name(exp, "faithfulness", target)), faith_table: rows}


def on_stop(request: gr.Request = None) -> Outputs:
    """Stops this session's running model work (the faithfulness curves)."""
    stopped = WORK.cancel(getattr(request, "session_hash", None))
    return {explain_note: "Stopped." if stopped else gr.skip()}


def on_tokens(ref: SessionRef | None, share: float) -> Outputs:
    """The Tokens tab: attention received, token norms, DINO's head maps and the patch features."""
    exp = _recall(ref)
    share = _checked(inputs.share, share)
    norms_chart, norms_map = views.render_token_norms(exp)
    features, features_caption = views.render_features(exp)
    return {
        received_img: views.render_received(exp),
        norms_img: norms_chart,
        norms_map_img: norms_map,
        dino_img: views.render_dino_heads(exp, share=share),
        features_img: features,
        features_text: features_caption,
        similarity_map_img: None,
    }


def on_dino_share(ref: SessionRef | None, share: float) -> Outputs:
    return {dino_img: views.render_dino_heads(_recall(ref), share=_checked(inputs.share, share))}


def on_feature_click(ref: SessionRef | None, evt: gr.SelectData) -> Outputs:
    """A click on the feature image: how similar every patch's feature is to that patch's."""
    exp = _recall(ref)
    return {similarity_map_img: views.render_feature_similarity(exp, query=views.patch_at(exp, *_click_xy(evt)))}


def on_tab(ref: SessionRef | None, target: str | None, scale_value: str, share: float, evt: gr.SelectData) -> Outputs:
    """A tab was chosen: the tabs drawn on demand are drawn now (for the session's analysis)."""
    name = evt.value if isinstance(evt.value, str) else ""
    return {current_tab: _TAB_IDS.get(name, name), **_draw_tab(ref, _TAB_IDS.get(name, name), target, scale_value, share)}


def on_refresh_tab(ref: SessionRef | None, tab: str, target: str | None, scale_value: str, share: float) -> Outputs:
    """After an analysis: the tab on show, if it is drawn on demand, drawn for the new analysis —
    unless a class was picked for that analysis meanwhile (its drawing is newer than `target`, which
    was read when the analysis began)."""
    if tab == "explain" and isinstance(ref, SessionRef) and ref.key in _EXPLAINED:
        return {explain_note: gr.skip()}
    return _draw_tab(ref, tab, target, scale_value, share)


def _draw_tab(ref, tab, target, scale_value, share) -> Outputs:
    if isinstance(ref, SessionRef) and tab == "explain":
        return on_explain(ref, target, scale_value)
    if isinstance(ref, SessionRef) and tab == "tokens":
        return on_tokens(ref, share)
    return {explain_note: gr.skip()}  # nothing to draw (an empty dict would read as no outputs at all)


def on_other_model(name: str, custom: list[str] | None) -> Outputs:
    """A timm or Hugging Face model by name: checked, added to this session's menus and chosen
    (choosing it runs the analysis)."""
    custom = [c for c in (custom or []) if isinstance(c, str)][-8:]
    try:
        name = _variant(name)
    except gr.Error as exc:
        gr.Warning(exc.message)
        return {notice: _notice(exc.message)}
    if name not in custom:
        custom.append(name)
    choices = variant_choices(custom)
    return {
        custom_models: custom,
        notice: "",
        variant: gr.update(choices=choices, value=name),
        compare_pick: gr.update(choices=choices),
    }


def on_compare(image: str | None, variants: list[str] | None) -> Outputs:
    """Two or three variants on the same image, side by side.

    When something cannot be analysed, only the compare notice changes, saying why."""
    variants = list(variants) if isinstance(variants, (list, tuple)) else []
    try:
        if not 2 <= len(variants) <= MAX_COMPARE:
            raise _error(f"Pick two or three variants to compare (you picked {len(variants)}).")
        names = [_variant(v) for v in variants]
        with _priced(together([price(get_spec(v), "analyse") for v in names])):  # held together, until drawn
            return _compare_outputs([_run(image, v) for v in names])
    except gr.Error as exc:
        gr.Warning(exc.message)
        return {compare_notice: _notice(exc.message)}


def _compare_outputs(exps: list[views.Exploration]) -> Outputs:
    out: Outputs = {compare_notice: "", compare_distance: views.render_compare_distance(exps)}
    for k, (col, md, ro, gd) in enumerate(slots):
        if k < len(exps):
            e = exps[k]
            a = e.analysis
            top = "\n".join(f"- {label}: {p:.1%}" for label, p in a.predictions(3)) or "(no classifier: features only)"
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
    """Analyse an image with a Vision Transformer: its top-5 classes, the attention rollout (where the
    cls token draws from, over all layers), every head's mean attention distance, and the numbers.

    Args:
        image: the photo (an uploaded file).
        variant: the model, e.g. "shapes_p16" (embedded, offline), "vit_b_16", "timm:<name>" or
            "hf:<org/name>", optionally with "@<pixels>" for another image size.

    Returns:
        The top-5 classes with probabilities, the rollout over the image, the distance chart, and an
        .npz (rollout, cls map, distances, probabilities, the crop).
    """
    with _analysis_job(image, variant):
        exp = _run(image, variant)
        size = price(get_spec(exp.analysis.variant), "export", attentions=False).kept_bytes
        try:
            path = DOWNLOADS.npz(exp, attentions=False, size=size)
        except ValueError as exc:
            raise _error(inputs.public_text(str(exc))) from None
        return {
            api_pred: views.render_predictions(exp) or None,
            api_rollout: views.render_rollout(exp),
            api_distance: views.render_distance(exp),
            api_npz: path,
        }


def api_explain(image: str | None, variant: str, target: str, method: str) -> Outputs:
    """Explain why a Vision Transformer sees a class in an image: a relevance map over the patches.

    Args:
        image: the photo (an uploaded file).
        variant: the model, as for analyze (e.g. "shapes_p16").
        target: the class to explain, by name (empty: the top-1 class).
        method: "gradient" (Chefer et al. 2021, the default), "grad_rollout", "rollout", "attention", or a
            method a plugin registered (`vitviz.register_method`).

    Returns:
        The map over the image, with its colour bar; its file is named by the variant, method and class.
    """
    if method not in METHODS:
        raise _error(f"The method must be one of {', '.join(METHODS)}.")
    exp = _run(image, variant)
    a = exp.analysis
    target = target or None
    if target is not None and (a.categories is None or target not in a.categories):
        raise _error(f"{a.variant} has no class {target!r}: leave it empty for the top-1, or name one of its classes.")
    with _job("explain", a.variant):
        maps, index = _explain_on_device(exp, target)
    if method not in maps:
        raise _error(f"{a.variant} has no classifier: only attention and rollout can be shown.")
    label = a.categories[index] if index is not None else "no-class"
    return {api_map: views.render_method_maps(exp, {method: maps[method]}, label=label)[method]}


def api_attention(image: str | None, variant: str, layer: float, head: str, query: float) -> Outputs:
    """What one token attends to at one layer of a Vision Transformer, over the image.

    Args:
        image: the photo (an uploaded file).
        variant: the model, as for analyze (e.g. "shapes_p16").
        layer: the layer, 1 to the model's depth.
        head: "mean", "max" or "head <k>" (1-based).
        query: the query token: 0 is the cls token (for a mean-pooled model without one, the pooled
            query "pool", after any registers); patches follow in raster order.

    Returns:
        The query's attention over the patches, drawn on the image.
    """
    exp = _run(image, variant)
    depth, heads = exp.analysis.attentions.shape[:2]
    layer = _checked(inputs.index, layer, 1, depth, "layer")
    head = _checked(inputs.head, head, heads)
    query = _checked(inputs.index, query, 0, exp.analysis.num_queries - 1, "query token")
    return {api_map: views.render_query(exp, layer=layer, head=head, query=query)}


def on_variant_info(variant: str) -> Outputs:
    try:
        return {variant_info: spec_line(_variant(variant))}
    except gr.Error as exc:
        return {variant_info: exc.message}


# ------------------------------------------------------------------------------------------------
# Layout

HERE = Path(__file__).resolve().parent
CSS = (HERE / "app.css").read_text()
# Gradio's Soft theme with text at WCAG AA contrast (4.5:1): labels, accents and subdued text darker
THEME = gr.themes.Soft().set(
    block_label_text_color="*primary_700", block_title_text_color="*primary_700", color_accent="*primary_600",
    button_primary_background_fill="*primary_600", button_primary_background_fill_hover="*primary_700",
    checkbox_label_background_fill_selected="*primary_600", body_text_color_subdued="*neutral_600",
)
# after an analysis on a narrow screen the page goes to its results (they sit under the inputs there)
SCROLL_TO_RESULTS = (HERE / "app.js").read_text()

_TAB_IDS = {"Predict": "predict", "Explain": "explain", "Explorer": "explorer", "Tokens": "tokens", "Distance": "distance",
            "Positions": "positions", "Architecture": "architecture", "Compare": "compare"}


def _figure(kind=PngImage, **kwargs):
    """An output picture whose label sits above it, not over it."""
    return kind(interactive=False, buttons=["download"], elem_classes=["vv-figure"], **kwargs)


with GuardedBlocks(title="vitviz — look inside Vision Transformers", delete_cache=(600, 1800)) as demo:
    # the session's reference to its analysis (the analysis itself is in STORE)
    state = gr.State(None, time_to_live=3600, delete_callback=_forget)
    custom_models = gr.State([])  # timm / Hugging Face names this session added to the menus
    current_tab = gr.State("predict")
    gr.Markdown(
        "# vitviz — look inside Vision Transformers\n"
        f"Upload a photo, pick a ViT, and see what it predicts and how it got there. Running on **{_device_line()}**. "
        f"Default model: {DEFAULT_REASON}.".replace(str(checkpoint_dir()), f"`{checkpoint_dir()}`")
    )
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=300):
            image = UploadedImage(label="Image", type="filepath", sources=["upload", "clipboard"], height=320, elem_id="vv-image")
            variant = gr.Dropdown(
                variant_choices(), value=DEFAULT_VARIANT, label="Model variant", elem_id="vv-variant", allow_custom_value=True
            )
            variant_info = gr.Markdown(spec_line(DEFAULT_VARIANT), elem_classes="vv-caption")
            with gr.Row():
                other_model = gr.Textbox(
                    placeholder="timm:<name> or hf:<org/name>", label="Another timm or Hugging Face ViT (@<px> for a size)",
                    elem_id="vv-other", scale=3, max_length=200, lines=1, max_lines=1,
                )
                use_other = gr.Button("Use", size="sm", scale=1, min_width=60, elem_id="vv-other-use")
            run = gr.Button("Analyse", variant="primary", elem_id="vv-run")
            if EXAMPLES:
                gr.Examples(EXAMPLES, inputs=image, label="Examples")
            gr.Markdown(f"Images: {describe_limits()}.", elem_classes="vv-caption")
        with gr.Column(scale=2, min_width=320):
            notice = gr.HTML("", elem_id="vv-notice")
            with gr.Column(elem_classes=["vv-results"], elem_id="vv-results") as results_box:
                with gr.Row(equal_height=True):
                    result_thumb = gr.Image(None, show_label=False, interactive=False, container=False, height=56, width=56,
                                            min_width=56, scale=0, elem_id="vv-result-thumb", buttons=[])
                    status = gr.Markdown("", elem_id="vv-status")
                with gr.Tabs() as tabs:
                    with gr.Tab("Predict", id="predict"):
                        gr.Markdown(
                            "Top-5 classes (click one to explain it) and **attention rollout**: how much the cls token, after "
                            "all layers, draws on each patch.",
                            elem_classes="vv-caption",
                        )
                        predict_note = gr.Markdown("", elem_id="vv-predict-note")
                        with gr.Row(elem_classes="vv-pair"):
                            predictions = gr.Label(num_top_classes=5, label="Predictions", elem_id="vv-predictions")
                            rollout_img = _figure(ViewImage, label="Attention rollout", elem_id="vv-rollout")
                            dist_rollout_img = _figure(ViewImage, label="Rollout of the distillation token", visible=False, elem_id="vv-dist-rollout")
                        with gr.Row():
                            head_fusion = gr.Radio(["mean", "max", "min"], value="mean", label="Head fusion", elem_id="vv-fusion")
                            discard = gr.Slider(0.0, 0.95, value=0.0, step=0.05, label="Discard ratio", elem_id="vv-discard")
                        gr.Markdown(
                            "Rollout (Abnar & Zuidema 2020): each layer's attention is fused over heads (mean, max or min), its "
                            "weakest links are optionally discarded, the identity is added for the residual path and each row is "
                            "renormalised to sum to 1 (with mean fusion and no discard, half attention and half identity); the "
                            "layers are then multiplied from the first up.",
                            elem_classes="vv-caption",
                        )
                        with gr.Row():
                            export = gr.Button("Prepare the analysis as .npz", size="sm")
                            npz = gr.File(label="Attention stack, rollout, distances (.npz)")
                    with gr.Tab("Explain", id="explain"):
                        gr.Markdown(
                            "Why this class: four maps over the patches for the class you pick. The last layer's attention and "
                            "rollout do not depend on the class; **gradient relevance** (Chefer et al. 2021) adds, layer by layer "
                            "from the first, the head mean of the positive part of gradient x attention times the relevance so "
                            "far; **gradient-weighted rollout** fuses gradient x attention over heads and rolls it out. Deletion "
                            "removes patches in each map's order (insertion reveals them) and follows the class probability: a "
                            "faithful map makes it fall fast and rise fast; a random order is the baseline.",
                            elem_classes="vv-caption",
                        )
                        with gr.Row():
                            target_class = gr.Dropdown([], label="Class to explain", filterable=True, elem_id="vv-class", scale=3)
                            explain_scale = gr.Radio(EXPLAIN_SCALES, value=EXPLAIN_SCALES[0], label="Colour scale", elem_id="vv-explain-scale", scale=2)
                        explain_note = gr.Markdown("", elem_id="vv-explain-note")
                        explain_imgs = {}
                        for pair in (METHODS[i : i + 2] for i in range(0, len(METHODS), 2)):
                            with gr.Row(elem_classes="vv-pair"):
                                for m in pair:
                                    explain_imgs[m] = _figure(ViewImage, label=registered_method(m).title, elem_id=f"vv-explain-{m}")
                        with gr.Row():
                            faith_button = gr.Button("Measure faithfulness (deletion and insertion)", size="sm", elem_id="vv-faith-run", scale=3)
                            faith_stop = gr.Button("Stop", size="sm", elem_id="vv-faith-stop", scale=1, min_width=60)
                        faith_img = _figure(label="Deletion and insertion", elem_id="vv-faith")
                        faith_table = gr.Dataframe(headers=["Order", "Deletion AUC (lower is better)", "Insertion AUC (higher is better)"],
                                                   label="Area under each curve", elem_id="vv-faith-table")
                    with gr.Tab("Explorer", id="explorer"):
                        gr.Markdown("What one token attends to at one layer, for one head or fused over heads, and every head beside it.",
                                    elem_classes="vv-caption")
                        explorer_live = gr.HTML(
                            value=None, html_template=EXPLORER_WIDGET["html"], css_template=EXPLORER_WIDGET["css"],
                            js_on_load=EXPLORER_WIDGET["js"], server_functions=[explorer_layer], elem_id="vv-explorer-live",
                        )
                        # the server's explorer: the API's, and the page's for models too large for the browser
                        with gr.Group(visible=False) as server_explorer:
                            with gr.Row():
                                layer = gr.Slider(1, 12, value=12, step=1, label="Layer", elem_id="vv-layer")
                                head = gr.Dropdown(["mean", "max"], value="mean", label="Head", elem_id="vv-head")
                                scale_choice = gr.Radio(SCALES, value=SCALES[0], label="Colour scale", elem_id="vv-scale")
                            with gr.Row():
                                query_text = gr.Markdown("query: the cls token", elem_id="vv-query")
                                query = gr.Number(0, precision=0, minimum=0, visible=False, label="Query token")
                                prefix_query = gr.Radio(["cls"], value=None, label="Or a prefix token as the query", elem_id="vv-prefix-query")
                            with gr.Row(elem_classes="vv-pair"):
                                explorer_img = _figure(ViewImage, label="The query's attention (click a patch)", elem_id="vv-explorer")
                                mosaic = _figure(ViewImage, label="All heads of this layer", elem_id="vv-mosaic")
                        gr.Markdown(
                            "Hover over a patch to see its attention, click to pin it (click again to let go), or pick a prefix "
                            "token; by keyboard, Tab to the map, then arrows, Enter and Escape. Each map is a row of "
                            "softmax(q·kᵀ/√d) over the patches. Colour scale: **one per layer** puts the map and every head of "
                            "the layer on one colour bar; **each map its own** stretches each to its own range (a head's range "
                            "beneath its tile); **all layers and heads** lets layers be compared too. Drawn in your browser "
                            "from the analysis (8 bits per weight).",
                            elem_classes="vv-caption",
                        )
                    with gr.Tab("Tokens", id="tokens"):
                        gr.Markdown(
                            "The tokens themselves. **Attention received**: the share of each layer's attention that goes to each "
                            "prefix token (cls, distillation, registers) and to the patches. **Token norms**: where high-norm "
                            "tokens appear — large models dump attention on a few such low-information patches, which registers "
                            "take over (Darcet et al. 2024). **DINO's heads**: the last block's cls attention per head, the "
                            "patches holding the chosen share of each head's mass in colour (Caron et al. 2021). **Patch "
                            "features**: the first three principal components of the last layer's patch tokens as red, green "
                            "and blue; click a patch to see how similar every other patch's feature is to it.",
                            elem_classes="vv-caption",
                        )
                        with gr.Row(elem_classes="vv-pair"):
                            received_img = _figure(label="Attention received per layer", elem_id="vv-received")
                            norms_img = _figure(label="Token norms per layer", elem_id="vv-norms")
                        norms_map_img = _figure(label="Token norms after the last block", elem_id="vv-norms-map")
                        dino_share = gr.Slider(0.05, 1.0, value=0.6, step=0.05, label="DINO: share of each head's attention kept", elem_id="vv-dino-share")
                        dino_img = _figure(label="Last layer, cls attention per head", elem_id="vv-dino")
                        features_text = gr.Markdown("", elem_classes="vv-caption", elem_id="vv-features-text")
                        with gr.Row(elem_classes="vv-pair"):
                            features_img = _figure(label="Patch features, PCA (click a patch)", elem_id="vv-features")
                            similarity_map_img = _figure(label="Similarity to the clicked patch", elem_id="vv-feature-similarity")
                    with gr.Tab("Distance", id="distance"):
                        gr.Markdown(
                            "How far each head looks (the paper's Figure 7, right): for every head, the average pixel distance "
                            "between a patch and the patches it attends to, weighted by attention. In the paper's models, early "
                            "layers mix near and far heads and later ones look far. The dashed line is what uniform attention would give.",
                            elem_classes="vv-caption",
                        )
                        distance_img = _figure(label="Mean attention distance", elem_id="vv-distance")
                    with gr.Tab("Positions", id="positions"):
                        gr.Markdown(
                            "Left: cosine similarity between the learned position embedding of each patch (one tile per patch) "
                            "and all others — the paper's Figure 7, centre; nearby patches have similar embeddings. Right: the "
                            "top 28 principal components of the patch-embedding filters as RGB images (Figure 7, left), each "
                            "with the share of the filters' variance it explains.",
                            elem_classes="vv-caption",
                        )
                        with gr.Row(elem_classes="vv-pair"):
                            similarity_img = _figure(label="Position-embedding similarity", elem_id="vv-similarity")
                            filters_img = _figure(label="Filters: principal components", elem_id="vv-filters")
                    with gr.Tab("Architecture", id="architecture"):
                        gr.Markdown(
                            "The image as the model sees it: resized, centre-cropped and cut into patches, each becoming one "
                            "token. The table follows the tokens stage by stage with output shapes and parameter counts.",
                            elem_classes="vv-caption",
                        )
                        grid_img = _figure(label="Patch grid", elem_id="vv-grid")
                        table = gr.Dataframe(
                            headers=["Stage", "Layer", "Output shape", "Param #"], label="Stages", wrap=True, elem_id="vv-table",
                            column_widths=["30%", "34%", "20%", "16%"],
                        )
                    with gr.Tab("Compare", id="compare"):
                        gr.Markdown(
                            "Two or three variants on the same image: predictions, rollout and patch grid side by side, and "
                            "every head's attention distance in one chart, so patch size, model size and training can be compared.",
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
                                    ro = _figure(label="Rollout")
                                    gd = _figure(label="Patch grid")
                                slots.append((col, md, ro, gd))
                        compare_distance = _figure(label="Mean attention distance", elem_id="vv-compare-distance")

    # hidden outputs of the API endpoint
    with gr.Row(visible=False):
        api_button = gr.Button("api")
        api_explain_button = gr.Button("explain")
        api_attention_button = gr.Button("attention")
        api_pred = gr.Label()
        api_rollout = PngImage(interactive=False)
        api_distance = PngImage(interactive=False)
        api_npz = gr.File()
        api_variant = gr.Textbox(label="variant")  # any name, not only the menu's (the server checks it)
        api_target = gr.Textbox(label="class")
        api_method = gr.Textbox(label="method", value="gradient")
        api_layer = gr.Number(label="layer", precision=0)
        api_head = gr.Textbox(label="head", value="mean")
        api_query = gr.Number(label="query token", precision=0)
        api_map = PngImage(interactive=False)

    analysis_outputs = [
        state, notice, results_box, result_thumb, image, variant, predictions, predict_note, rollout_img, dist_rollout_img, target_class, prefix_query, layer, head,
        query, query_text, distance_img, similarity_img, filters_img, grid_img, table, npz, faith_img, faith_table, status,
    ]
    explorer_outputs = [explorer_live, server_explorer, explorer_img, mosaic]
    explain_outputs = [explain_note, faith_img, faith_table, *explain_imgs.values()]
    tokens_outputs = [received_img, norms_img, norms_map_img, dino_img, features_img, features_text, similarity_map_img]
    tab_inputs = [state, current_tab, target_class, explain_scale, dino_share]
    analysis_inputs = [image, variant, head_fusion, discard, state]
    view_inputs = [state, layer, head, query, scale_choice]
    # The session endpoints (undocumented, callable with gradio_client) keep the analysis in the
    # caller's session, as the page does: `python -m vitviz.dev.bench --app` times view changes through them.
    # Dropdowns and radios answer `.change` (a click on a menu option fires `.input` twice); sliders
    # answer `.input`, which fires while dragging, on arrow keys and on a typed number, and
    # "always_last" draws the value the control ends on. After an analysis is on the page, the
    # explorer's data is written for the browser, and the tab on show is drawn for it when it is one
    # of those drawn on demand (Explain, Tokens).
    # Progress shows on the rollout and the status line only: a spinner on every output costs the
    # browser time the analysis needs on a small machine.
    quiet = dict(show_progress="minimal")

    def _analysis(event):
        event.then(None, None, None, js=SCROLL_TO_RESULTS, api_visibility="private", queue=False)
        return event.then(on_explorer, state, explorer_outputs, api_visibility="private", show_progress="hidden", **model).then(
            on_refresh_tab, tab_inputs, [*explain_outputs, *tokens_outputs], api_visibility="private", **quiet, **model
        )

    # Everything that runs a model or builds analysis data shares one concurrency group (and, inside
    # it, WORK's budget, which the explorer's component-server calls take too).
    model = dict(concurrency_id="model", concurrency_limit=SETTINGS.concurrency)
    analyse = dict(show_progress_on=[rollout_img, status], **model)
    _analysis(run.click(on_analyze, analysis_inputs, analysis_outputs, api_visibility="undocumented", api_name="session_analyze", **analyse))
    _analysis(image.upload(on_analyze, analysis_inputs, analysis_outputs, api_visibility="private", **analyse))
    _analysis(variant.change(on_variant_info, variant, variant_info, api_visibility="private", show_progress="hidden").then(
        on_analyze, analysis_inputs, analysis_outputs, api_visibility="private", **analyse
    ))
    rollout_outputs = [rollout_img, dist_rollout_img]
    head_fusion.change(on_rollout_options, [state, head_fusion, discard], rollout_outputs, api_visibility="undocumented", api_name="session_rollout")
    discard.input(on_rollout_options, [state, head_fusion, discard], rollout_outputs, api_visibility="private", trigger_mode="always_last")
    layer.input(on_view, view_inputs, [explorer_img, mosaic], api_visibility="undocumented", api_name="session_view", trigger_mode="always_last")
    head.change(on_view, view_inputs, [explorer_img, mosaic], api_visibility="private", trigger_mode="always_last")
    scale_choice.change(on_view, view_inputs, [explorer_img, mosaic], api_visibility="private", trigger_mode="always_last")
    explorer_img.select(on_click, [state, layer, head, scale_choice], [query, query_text, prefix_query, explorer_img, mosaic], api_visibility="private")
    prefix_query.input(on_prefix_query, [state, layer, head, prefix_query, scale_choice], [query, query_text, explorer_img, mosaic], api_visibility="private")
    tabs.select(on_tab, [state, target_class, explain_scale, dino_share], [current_tab, *explain_outputs, *tokens_outputs], api_visibility="private", **model)
    target_class.input(on_explain, [state, target_class, explain_scale], explain_outputs, api_visibility="undocumented", api_name="session_explain", **model)
    explain_scale.change(on_explain_scale, [state, target_class, explain_scale], explain_outputs, api_visibility="private", **model)
    predictions.select(on_pick_class, [state, explain_scale], [target_class, tabs, current_tab, *explain_outputs], api_visibility="private", **model)
    faith = faith_button.click(on_faithfulness, [state, target_class], [faith_img, faith_table], api_visibility="undocumented",
                               api_name="session_faithfulness", **model)
    faith_stop.click(on_stop, None, explain_note, cancels=[faith], api_visibility="private", queue=False)
    dino_share.input(on_dino_share, [state, dino_share], dino_img, api_visibility="private", trigger_mode="always_last")
    features_img.select(on_feature_click, state, similarity_map_img, api_visibility="private")
    other_outputs = [custom_models, notice, variant, compare_pick]
    use_other.click(on_other_model, [other_model, custom_models], other_outputs, api_visibility="private")
    other_model.submit(on_other_model, [other_model, custom_models], other_outputs, api_visibility="private")
    export.click(on_export, state, npz, api_visibility="private", **model)
    compare_outputs = [compare_notice, compare_distance, *[c for slot in slots for c in slot]]
    compare_run.click(on_compare, [image, compare_pick], compare_outputs, api_visibility="private", **model)
    api_button.click(api_analyze, [image, api_variant], [api_pred, api_rollout, api_distance, api_npz], api_name="analyze", **model)
    api_explain_button.click(api_explain, [image, api_variant, api_target, api_method], api_map, api_name="explain", **model)
    api_attention_button.click(api_attention, [image, api_variant, api_layer, api_head, api_query], api_map, api_name="attention", **model)

# api_open=False: queued events cannot be called around the queue (POST /run/<name>), so every
# client's share holds however it calls
demo.after_event = _files_sweep  # Gradio's copies of pictures and downloads are written by every kind of event
demo.queue(max_size=SETTINGS.queue_size, default_concurrency_limit=SETTINGS.concurrency, api_open=False,
           client_jobs=SETTINGS.client_jobs, address_jobs=SETTINGS.address_jobs)

LAUNCH_KWARGS = dict(
    css=CSS,
    # the page's own margins (outside the part Gradio's css= reaches): narrow on a phone
    head=(HERE / "app_head.html").read_text(),
    theme=THEME,
    max_file_size=MAX_BYTES,
    ssr_mode=False,
    mcp_server=os.environ.get("VITVIZ_MCP", "").strip().lower() in ("1", "true", "yes", "on"),  # agents: /gradio_api/mcp/
    app_kwargs={"middleware": [
        Middleware(BodyLimit, max_bytes=SETTINGS.body_bytes),
        Middleware(UploadLimit, max_bytes=MAX_BYTES, per_minute=SETTINGS.upload_bytes_per_minute, after=demo.after_any),
    ]},
)


def main(argv: list[str] | None = None) -> None:
    """`vitviz-app`: the app on this machine (Gradio takes the next free port if this one is in use)."""
    import argparse

    ap = argparse.ArgumentParser(prog="vitviz-app", description="vitviz in the browser: look inside Vision Transformers.")
    ap.add_argument("--host", default=None, help="the address to serve on (default 127.0.0.1, or GRADIO_SERVER_NAME; 0.0.0.0 for every interface)")
    ap.add_argument("--port", type=int, default=None, help="the port (default 7860, or GRADIO_SERVER_PORT)")
    ap.add_argument("--mcp", action="store_true", help="also serve the public endpoints as MCP tools (as VITVIZ_MCP=1)")
    args = ap.parse_args(argv)
    kwargs = dict(LAUNCH_KWARGS)
    if args.host is not None:
        kwargs["server_name"] = args.host
    if args.port is not None:
        kwargs["server_port"] = args.port
    if args.mcp:
        kwargs["mcp_server"] = True
    demo.launch(**kwargs)


if __name__ == "__main__":
    main()
