"""The Video tab: a clip through a video transformer (`vitviz.video`), its prediction, where its class
token looks in each frame, and where one patch looks across the frames.

The clip (MP4, WebM, GIF or animated WebP) is an upload only (`UploadedClip`: a path inside Gradio's
upload folder, else refused), read by `vitviz.clips.load_video` with the model's frame count and
sampling (its refusals, `VideoError`, are the tab's one-sentence errors) and priced ("video":
`vitviz.cost`) before the model runs, once: the forward that records the attention gives the logits
too. The run gives the top classes, the cls token's row of the space-time rollout (for a model without
one, such as VideoMAE, the patches' mean row), or with the Map "relevance" of the top class's relevance
(`attention_and_relevance`: the attention and the relevance from one forward and one backward; priced
"video_relevance"), over each frame
(`frame_maps`; a frame shows the map of the tubelet it belongs to) as a strip and as an animated GIF to
download, and the explorer of where one patch looks across the frames (`attention_across_frames`, heads
averaged), in one of two ways:

- in the browser (`video_explorer.js`), when the clip's data fits `vitviz.cost.VIDEO_BROWSER_BYTES`:
  the frames and every patch query's rows of every layer in 8 bits go with the run's outputs to the
  page that ran it (`vitviz.server.pictures.video_explorer`); hovering a patch of the shown frame draws
  its attention over every frame, a click pins it, and the frame and layer sliders redraw, all without
  a call to the server;
- by the server otherwise: the run's attention is kept in the server's store for the session, and the
  query patch picked with the frame and layer sliders, the row and column boxes or a click on the
  shown frame is drawn from it without running the model again. These events are the API's too,
  whichever way the page shows the explorer.

The tab needs no image analysis (`waits = False`); its models are the menu's (`MODELS`: `shapes_video`,
and Hugging Face's VideoMAE and TimeSformer fine-tuned on Kinetics-400, fetched on first use), priced
from their records before they load, and kept in the server's model cache with the image models.
"""

from __future__ import annotations

import io
import logging
import secrets
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
import numpy as np
import torch
from PIL import Image, ImageDraw

from vitviz import plots
from vitviz.clips import VideoError, clip_tensor, load_video
from vitviz.cost import price
from vitviz.server import runtime
from vitviz.server.guards import inputs
from vitviz.server.guards.gradio_io import UPLOAD_REFUSED, file_stem, secret_name, uploaded_path
from vitviz.server.pictures import video_explorer
from vitviz.server.runtime import Outputs, gpu
from vitviz.server.tabs.base import Tab, figure, register_tab
from vitviz.video.analysis import attention_across_frames, attention_and_relevance, frame_maps, space_time_rollout_row
from vitviz.server.models import TooLarge
from vitviz.sources import WeightsUnavailableError
from vitviz.video.load import VIDEO_MENU, load_video_model, video_spec
from vitviz.video.model import VideoAttention, VideoSpec, VideoViT

__all__ = ["VideoTab", "UploadedClip", "VideoResult", "MODELS", "spec_of", "model_of", "TAB"]

LOG = logging.getLogger("vitviz.server")


MODELS = VIDEO_MENU  # the menu (`vitviz.video.load.VIDEO_MENU`): its hub repositories are kept in the hub's cache like the image menu's
DEFAULT = "shapes_video"
SHOWN = {"rollout": "rollout", "relevance": "relevance of the top class"}  # the map over the frames: its colour bar's label
STRIP_LABELS = {"rollout": "Where the model looks, frame by frame (space-time rollout)",
                "relevance": "What made the top class, frame by frame (relevance, Chefer et al. 2021)"}
TOP = 5  # classes shown
SCALE = 2  # each model-size frame drawn at this many screen pixels a pixel
CLIP_TYPES = [".mp4", ".webm", ".gif", ".webp"]

CLIP_REFUSED = UPLOAD_REFUSED.replace("The image", "The clip")  # the house's refusal of what was not uploaded, for a clip


def spec_of(name: str) -> VideoSpec:
    """The menu's model `name`'s record, without its weights (`vitviz.video.load.video_spec`); a
    `runtime.error` when it cannot be had."""
    try:
        return video_spec(name)
    except WeightsUnavailableError as exc:
        LOG.info("%s", exc)
        raise runtime.error(f"{name} is not on this server and cannot be downloaded now: choose {DEFAULT}.") from None
    except (ValueError, ImportError, OSError) as exc:
        raise runtime.error(inputs.public_text(str(exc))) from None


class UploadedClip(gr.File):
    """A clip input: the path of a file uploaded to this app, and nothing else (server paths, data:
    URLs and web addresses are refused with `UPLOAD_REFUSED`); `load_video` checks the bytes."""

    def get_block_name(self) -> str:
        return "file"  # the frontend is Gradio's own file component

    def preprocess(self, payload):
        if payload is None:
            return None
        url = getattr(payload, "url", None)
        if isinstance(url, str) and url.strip().lower().startswith("data:"):
            raise gr.Error(CLIP_REFUSED)
        return uploaded_clip(getattr(payload, "path", None))


def uploaded_clip(path: object) -> str:
    """`path` if it names a file uploaded to this app (`uploaded_path`), else `CLIP_REFUSED`."""
    try:
        return uploaded_path(path)
    except gr.Error:
        raise gr.Error(CLIP_REFUSED) from None


@dataclass(frozen=True)
class VideoResult:
    """One clip's run, kept for the session: the frames as the model saw them, the attention, the class
    token's maps and the top classes."""

    model: str
    frames: np.ndarray  # uint8 [T, S, S, 3]
    attention: VideoAttention
    maps: torch.Tensor  # [t, h, w]
    top: dict[str, float]
    tubelet: int
    patch_size: int

    @property
    def nbytes(self) -> int:
        a = self.attention
        held = sum(x.numel() * x.element_size() for x in (a.joint, a.time, a.space, a.pool) if x is not None)
        return held + self.frames.nbytes + self.maps.numel() * 4 + 4096


@dataclass(frozen=True)
class VideoRef:
    """What the session holds of its run (the run itself is in the server's store)."""

    key: str
    server: str


def _forget(held: object) -> None:
    if isinstance(held, VideoRef):
        runtime.server_named(held.server).store.drop(held.key)


def model_of(server: str, name: str) -> VideoViT:
    """The video model `name`, from the server's model cache (loaded once, evicted with the image models
    as the cache's bounds say; `vitviz.video.load.load_video_model`)."""
    return runtime.server_named(server).cache.get(name, load=load_video_model)[0]


@gpu
def run_on_device(server: str, name: str, videos: torch.Tensor, shown: str = "rollout") -> tuple[torch.Tensor, VideoAttention, torch.Tensor]:
    """The probabilities, the attention (heads averaged) and the maps of one clip [T, 3, S, S]: the
    rollout's (one forward), or with `shown` "relevance" the top class's relevance (Chefer et al.; the
    attention from the same forward, and a backward); each the cls token's row, or the patches' mean
    without one."""
    return run_clip(model_of(server, name), videos, shown)


def run_clip(model: VideoViT, videos: torch.Tensor, shown: str = "rollout") -> tuple[torch.Tensor, VideoAttention, torch.Tensor]:
    """`run_on_device`'s work on a loaded video model."""
    device = next(model.parameters()).device
    videos = videos.to(device)
    query = 0 if model.config.num_prefix_tokens else "pool"  # the cls token's row, or the patches' mean
    if shown == "relevance":  # the attention every view reads (heads averaged) from the relevance's own forward
        attention, row = attention_and_relevance(model, videos, query=query, head_fusion="mean")
    else:
        attention = model.attention(videos, head_fusion="mean")
        row = space_time_rollout_row(attention, query=query)
    probs = attention.logits.float().softmax(-1).cpu()
    return probs, attention, frame_maps(row, attention.grid).float().cpu()


def _seen(videos: torch.Tensor, pre) -> np.ndarray:
    """The frames as the model saw them, uint8 [T, S, S, 3] (its normalisation undone)."""
    mean = torch.tensor(pre.mean).view(1, 3, 1, 1)
    std = torch.tensor(pre.std).view(1, 3, 1, 1)
    pixels = (videos * std + mean).clamp(0, 1) * 255
    return pixels.round().to(torch.uint8).permute(0, 2, 3, 1).numpy()


def _shown(frame: np.ndarray) -> Image.Image:
    img = Image.fromarray(frame)
    return img.resize((img.width * SCALE, img.height * SCALE), Image.NEAREST)


def _overlaid(r: VideoResult, maps: torch.Tensor) -> list[Image.Image]:
    """Each frame with the map of its tubelet over it, one colour scale for all."""
    vmin, vmax = float(maps.min()), float(maps.max())
    vmax = max(vmax, vmin + 1e-12)
    return [plots.overlay(_shown(f), maps[k // r.tubelet], vmin=vmin, vmax=vmax) for k, f in enumerate(r.frames)]


def _strip(r: VideoResult, maps: torch.Tensor, label: str, name: str) -> Image.Image:
    pictures = _overlaid(r, maps)
    strip = plots.mosaic(pictures, cols=len(pictures), labels=[f"frame {k + 1}" for k in range(len(pictures))])
    vmin, vmax = float(maps.min()), float(maps.max())
    strip = plots.with_colorbar(strip, vmin=vmin, vmax=max(vmax, vmin + 1e-12), label=label)
    return plots.named(strip, name)


def _gif(r: VideoResult, cache: str, shown: str = "rollout") -> str:
    """The overlaid frames as an animated GIF, written as the app writes its pictures (under a secret
    name in Gradio's cache, which only a page that was sent it can fetch): its path."""
    frames = _overlaid(r, r.maps)
    with io.BytesIO() as buf:
        frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=250, loop=0)
        data = buf.getvalue()
    folder = Path(cache) / secret_name(data)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{file_stem(f'vitviz-{r.model}-{shown}')}.gif"
    path.write_bytes(data)
    return str(path)


class VideoTab(Tab):
    id = "video"
    label = "Video"
    waits = False

    def build(self, page) -> None:
        gr.Markdown(
            "**Video**: upload a short clip (MP4, WebM, GIF or animated WebP) and run a video transformer on it: its top "
            "classes, where it looks in each frame (the space-time rollout of its cls token, or of its patches' mean, a frame drawn "
            "with the map of the tubelet it belongs to), and, for one patch of one frame, its attention over every frame "
            "at one layer (heads averaged): pick the frame and layer with the sliders, hover over a patch of the frame, "
            "click to pin it (click again to let go; by keyboard, Tab to the frame, then arrows, Enter and Escape). "
            "Drawn in your browser from the run (8 bits per weight); for a model too large for that, by the server.",
            elem_classes="vv-caption",
        )
        with gr.Row(equal_height=False):
            with gr.Column(scale=1, min_width=260):
                self.clip = UploadedClip(label="Clip", file_types=CLIP_TYPES, type="filepath", elem_id="vv-video-clip")
                self.model = gr.Dropdown(list(MODELS), value=DEFAULT, label="Video model", elem_id="vv-video-model")
                self.shown = gr.Radio(list(SHOWN), value="rollout", label="Map", elem_id="vv-video-map",
                                      info="rollout: where the model looks; relevance: what made its top class (a backward more). For the next run.")
                self.run = gr.Button("Run", variant="primary", elem_id="vv-video-run")
                self.prediction = gr.Label(num_top_classes=TOP, label="Prediction", elem_id="vv-video-prediction")
                self.gif = gr.File(label="Animated map (GIF)", interactive=False, visible=False, elem_id="vv-video-gif")
            with gr.Column(scale=3, min_width=300):
                self.strip = figure(label=STRIP_LABELS["rollout"], visible=False,
                                    elem_id="vv-video-strip")
                files = video_explorer.widget_files()
                self.live = gr.HTML(value=None, html_template=files["html"], css_template=files["css"], js_on_load=files["js"],
                                    elem_id="vv-video-live")
                with gr.Column(visible=False) as self.on_server:  # the server's explorer, for a clip too large for the browser
                    self._server_explorer()
        self.held = gr.State(None, time_to_live=3600, delete_callback=_forget)

    def _server_explorer(self) -> None:
        """The frame and layer sliders, the row and column boxes, the query patch's frame (a click picks
        another) and its attention across the frames, each drawn by the server."""
        with gr.Row(equal_height=False):
            with gr.Column(scale=1, min_width=200):
                self.frame = gr.Slider(1, 8, value=1, step=1, label="Frame", elem_id="vv-video-frame")
                self.layer = gr.Slider(1, 4, value=1, step=1, label="Layer", elem_id="vv-video-layer")
                with gr.Row():
                    self.row = gr.Number(1, precision=0, minimum=1, label="Row", elem_id="vv-video-row")
                    self.col = gr.Number(1, precision=0, minimum=1, label="Column", elem_id="vv-video-col")
            with gr.Column(scale=1, min_width=200):
                self.query = figure(label="The query patch (click to pick another)", visible=False,
                                    elem_id="vv-video-query")
        self.across = figure(label="Where the patch looks across the frames (one layer, heads averaged)", visible=False,
                             elem_id="vv-video-across")
        self.note = gr.Markdown("", elem_id="vv-video-note")

    # -- checks -----------------------------------------------------------------------------------

    @staticmethod
    def _model_name(value: object) -> str:
        if not isinstance(value, str) or value not in MODELS:
            raise runtime.error(f"Choose a video model from the menu ({', '.join(MODELS)}).")
        return value

    def _kept(self, held: object) -> VideoResult:
        kept = self.server.store.get(held.key) if isinstance(held, VideoRef) else None
        if not isinstance(kept, VideoResult):
            raise runtime.error("Run a clip first (a run is kept a while for the session).")
        return kept

    @staticmethod
    def _query(r: VideoResult, frame: object, layer: object, row: object, col: object) -> tuple[int, int, int, int]:
        """(frame, layer, row, col), 0-based, each checked against the kept run."""
        t, h, w = r.attention.grid
        f = runtime.checked(inputs.index, frame, 1, len(r.frames), "frame")
        lay = runtime.checked(inputs.index, layer, 1, r.attention.depth, "layer")
        y = runtime.checked(inputs.index, row, 1, h, "row")
        x = runtime.checked(inputs.index, col, 1, w, "column")
        return f - 1, lay - 1, y - 1, x - 1

    # -- drawing ----------------------------------------------------------------------------------

    def _draw(self, r: VideoResult, frame: object, layer: object, row: object, col: object) -> Outputs:
        f, lay, y, x = self._query(r, frame, layer, row, col)
        maps = attention_across_frames(r.attention, lay, f // r.tubelet, y, x).mean(0)
        across = _strip(r, maps, "attention", f"vitviz-{r.model}-frame{f + 1}-r{y + 1}c{x + 1}-l{lay + 1}")
        k = SCALE * r.patch_size
        shown = _shown(r.frames[f])
        ImageDraw.Draw(shown).rectangle((x * k, y * k, (x + 1) * k - 1, (y + 1) * k - 1), outline="#00e5ff", width=2)
        query = plots.named(shown, f"vitviz-{r.model}-frame{f + 1}")
        return {self.query: gr.update(value=query, visible=True), self.across: gr.update(value=across, visible=True),
                self.note: f"Frame {f + 1} (tubelet {f // r.tubelet + 1}), row {y + 1}, column {x + 1}, layer {lay + 1}: "
                           "its attention over every frame, heads averaged."}

    # -- events -----------------------------------------------------------------------------------

    def on_video_run(self, clip: object, model: object, frame: object, layer: object, row: object, col: object,
               held: VideoRef | None = None, shown: object = "rollout", request: gr.Request = None) -> Outputs:
        name = self._model_name(model)
        if not isinstance(shown, str) or shown not in SHOWN:
            raise runtime.error(f"Choose a map: {' or '.join(SHOWN)}.")
        if clip is None:
            raise runtime.error("Upload a clip first (MP4, WebM, GIF or animated WebP).")
        path = uploaded_clip(clip)
        spec = spec_of(name)
        try:
            loaded = load_video(path, frames=spec.frames, sampling=spec.sampling, stride=spec.frame_stride)
            videos = clip_tensor(loaded, spec.preprocessing)
        except VideoError as exc:
            raise runtime.error(inputs.public_text(str(exc))) from None
        seen = _seen(videos, spec.preprocessing)
        if shown == "relevance" and not spec.has_head:
            raise runtime.error(f"{name} has no classifier: its relevance explains a class; show the rollout.")
        with self.server.priced(price(spec, "video_relevance" if shown == "relevance" else "video"), request):
            try:
                probs, attention, maps = run_on_device(self.server.name, name, videos, shown)
            except (WeightsUnavailableError, TooLarge) as exc:
                LOG.info("%s", exc)
                raise runtime.error(inputs.public_text(str(exc))) from None
            live = video_explorer.payload(attention, seen, model=name, tubelet=spec.config.tubelet,
                                          patch_size=spec.config.patch_size, scale=SCALE)
        values, order = probs.topk(min(TOP, probs.numel()))
        cats = spec.categories or tuple(str(i) for i in range(probs.numel()))
        result = VideoResult(name, seen, attention, maps,
                             {cats[i]: float(v) for v, i in zip(values.tolist(), order.tolist())},
                             spec.config.tubelet, spec.config.patch_size)
        if isinstance(held, VideoRef):
            self.server.store.drop(held.key)
        key = self.server.store.put(result, result.nbytes, key=secrets.token_urlsafe(24))
        t, h, w = attention.grid
        frames = len(result.frames)
        f = min(max(_whole(frame, 1), 1), frames)
        lay = min(max(_whole(layer, attention.depth), 1), attention.depth)
        y = min(max(_whole(row, h // 2 + 1), 1), h)
        x = min(max(_whole(col, w // 2 + 1), 1), w)
        live["first"] = dict(frame=f, layer=lay, row=y, col=x)  # the browser's first view: the server's below
        out = {
            self.held: VideoRef(key, self.server.name),
            self.live: live,
            self.on_server: gr.update(visible=live["mode"] == "server"),
            self.prediction: result.top,
            self.strip: gr.update(value=_strip(result, maps, SHOWN[shown], f"vitviz-{name}-{shown}"), visible=True,
                                  label=STRIP_LABELS[shown]),
            self.gif: gr.update(value=_gif(result, self.gif.GRADIO_CACHE, shown), visible=True),
            self.frame: gr.update(maximum=frames, value=f),
            self.layer: gr.update(maximum=attention.depth, value=lay),
            self.row: gr.update(maximum=h, value=y),
            self.col: gr.update(maximum=w, value=x),
        }
        out.update(self._draw(result, f, lay, y, x))
        return out

    def on_video_view(self, frame: object, layer: object, row: object, col: object, held: VideoRef | None) -> Outputs:
        """Another frame, layer or patch: drawn from the kept run (no model runs)."""
        return self._draw(self._kept(held), frame, layer, row, col)

    def on_video_pick(self, frame: object, layer: object, held: VideoRef | None, evt: gr.SelectData) -> Outputs:
        """A click on the shown frame: the patch under it becomes the query."""
        r = self._kept(held)
        x, y = runtime.click_xy(evt)
        t, h, w = r.attention.grid
        k = SCALE * r.patch_size
        if not (0 <= x < w * k and 0 <= y < h * k):
            return gr.skip()
        row, col = int(y // k) + 1, int(x // k) + 1
        out = self._draw(r, frame, layer, row, col)
        out[self.row] = row
        out[self.col] = col
        return out

    def wire(self, page) -> None:
        private = dict(api_visibility="private", **page.model)
        drawn = [self.query, self.across, self.note]
        self.run.click(self.on_video_run, [self.clip, self.model, self.frame, self.layer, self.row, self.col, self.held, self.shown],
                       [self.held, self.live, self.on_server, self.prediction, self.strip, self.gif, self.frame, self.layer,
                        self.row, self.col, *drawn],
                       **private)
        view = [self.frame, self.layer, self.row, self.col, self.held]
        for control in (self.frame, self.layer):
            control.input(self.on_video_view, view, drawn, trigger_mode="always_last", **private)
        for box in (self.row, self.col):
            box.submit(self.on_video_view, view, drawn, **private)
        self.query.select(self.on_video_pick, [self.frame, self.layer, self.held], [self.row, self.col, *drawn], **private)


def _whole(value: object, default: int) -> int:
    """A slider's or box's value as a whole number for a new run (the run's own range clamps it)."""
    try:
        n = float(value)
        return int(n) if n == n and abs(n) < 1e9 else default
    except (TypeError, ValueError, OverflowError):
        return default


TAB = register_tab(VideoTab())
