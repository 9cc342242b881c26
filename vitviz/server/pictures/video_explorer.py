"""The Video tab's explorer data (one clip's `VideoAttention`), as the browser holds it, and the one rule
both sides draw it by.

For layer l and patch query q = t_q*h*w + y*w + x (the clip's patches in token order), the row the
browser draws over the Q = t*h*w patches is `vitviz.video.analysis.attention_across_frames(attention,
l, t_q, y, x).mean(0)` (heads averaged; every query at once: `attention_across_frames_all`), kept as
8 bits relative to the row's own maximum by the image explorer's rule (`explorer_data.quantise_rows`):
q8 = floor(a / max x 255 + 1/2), read back as q8 x max / 255 (`explorer_data.dequantise`), in float64.

The strip: frame k (0-based) shows the map [h, w] of its tubelet k // τ, every frame on one colour
scale, the row's min..max, coloured and blended over the frame as the model saw it by
`vitviz.plots.overlay`'s rule (`strip_tiles`). The shown frame is that frame `scale` times as wide
(nearest), the query patch framed 2 px wide in cyan inside its box, as the tab's server picture frames it.

What the browser gets is the widget's value (`payload`), sent with the run's outputs to the page that
ran the clip (nothing is written or served); `data` in base64, little-endian:

    float32 row_max[L, Q]
    uint8   rows[L, Q, Q]

and `pictures`: each frame an `explorer_data.rgb_file` in base64. Its size is
`vitviz.cost.video_explorer_bytes`: for shapes_video (4 layers, grid 4x6x6, 8 frames of 96 px) 85,248
bytes of attention and 221,248 of frames, 306,496 in all (408,672 in base64; the value, 412 kB of
JSON). A clip whose data is over `vitviz.cost.VIDEO_BROWSER_BYTES` gets a note instead, and the tab's
views are the server's.
"""

from __future__ import annotations

import base64
import secrets
from importlib import resources

import numpy as np
import torch
from PIL import Image

from vitviz import cost
from vitviz.plots import CMAP, lut, overlay
from vitviz.server.pictures.explorer_data import dequantise, quantise_rows, read_rgb_file, rgb_file
from vitviz.video.analysis import attention_across_frames_all
from vitviz.video.model import VideoAttention

__all__ = ["OUTLINE", "layer_rows", "payload", "read_data", "map_values", "read_frames", "strip_tiles", "widget_files"]

OUTLINE = 2  # the query patch's frame, px (the tab's server picture's)


def layer_rows(attention: VideoAttention, layer: int) -> torch.Tensor:
    """Every patch query's row of layer `layer` (0-based), heads averaged: float32 [Q, Q]."""
    every = attention_across_frames_all(attention, layer)  # [H, Q, t, h, w]
    return every.mean(dim=0).reshape(every.shape[1], -1).float()


def payload(attention: VideoAttention, frames: np.ndarray, *, model: str, tubelet: int, patch_size: int, scale: int,
            budget: int | None = None) -> dict:
    """The widget's value for one clip: its `attention` and its `frames` as the model saw them (uint8
    [T, S, S, 3]), each shown `scale` times as wide; over `budget` bytes (None:
    `vitviz.cost.VIDEO_BROWSER_BYTES`), a note (mode "server") and nothing else."""
    budget = cost.VIDEO_BROWSER_BYTES if budget is None else budget
    t, h, w = attention.grid
    count, side = frames.shape[0], w * patch_size
    if frames.shape[1:] != (h * patch_size, side, 3) or frames.dtype != np.uint8 or -(-count // tubelet) != t:
        raise ValueError(f"frames must be uint8 [T, {h * patch_size}, {side}, 3], a tubelet of {tubelet} frames for each of "
                         f"the grid's {t}, got {frames.dtype} {list(frames.shape)}")
    size = cost.video_explorer_bytes(depth=attention.depth, grid=attention.grid, frames=count, image_size=side)
    value = dict(id=secrets.token_urlsafe(8), bytes=size)
    if size > budget:
        value.update(mode="server", note=f"{model}'s attention across frames is too large to hold in the browser "
                                         f"({size / 2**20:.1f} MB, over {budget / 2**20:.1f} MB): the views below are drawn by the server.")
        return value
    parts = [quantise_rows(layer_rows(attention, layer)) for layer in range(attention.depth)]  # a layer at a time: [Q, Q], [Q]
    data = np.stack([top for _, top in parts]).astype("<f4").tobytes() + np.stack([q for q, _ in parts]).tobytes()
    value.update(mode="browser", model=model, grid=[t, h, w], depth=attention.depth, tubelet=int(tubelet), frames=int(count),
                 image_size=int(side), scale=int(scale), patch_px=int(patch_size * scale), outline=OUTLINE,
                 lut=lut(CMAP).reshape(-1).tolist(), data=base64.b64encode(data).decode("ascii"),
                 pictures=[base64.b64encode(rgb_file(Image.fromarray(f))).decode("ascii") for f in frames])
    return value


def read_data(value: dict) -> tuple[np.ndarray, np.ndarray]:
    """The value's `data` read as the browser reads it: (float32 row maxima [L, Q], uint8 rows [L, Q, Q])."""
    t, h, w = value["grid"]
    layers, q = value["depth"], t * h * w
    data = base64.b64decode(value["data"])
    if len(data) != layers * q * (4 + q):
        raise ValueError(f"the explorer's data has {len(data)} bytes, not {layers * q * (4 + q)}")
    top = np.frombuffer(data, dtype="<f4", count=layers * q).reshape(layers, q)
    return top, np.frombuffer(data, dtype=np.uint8, offset=4 * layers * q).reshape(layers, q, q)


def map_values(value: dict, *, layer: int, query: int) -> np.ndarray:
    """What the browser draws for layer `layer` (0-based) and patch query `query`: float64 [t, h, w]."""
    top, rows = read_data(value)
    return dequantise(rows[layer, query], top[layer, query]).reshape(value["grid"])


def read_frames(value: dict) -> list[Image.Image]:
    """The value's frames, as the model saw them."""
    return [read_rgb_file(base64.b64decode(p)) for p in value["pictures"]]


def strip_tiles(value: dict, *, layer: int, query: int) -> list[Image.Image]:
    """The strip's tiles as the browser draws them: each frame with its tubelet's map over it, one scale."""
    maps = map_values(value, layer=layer, query=query)
    lo, hi = float(maps.min()), float(maps.max())
    shared = torch.from_numpy(maps)
    return [overlay(frame, shared[k // value["tubelet"]], vmin=lo, vmax=hi) for k, frame in enumerate(read_frames(value))]


def widget_files() -> dict[str, str]:
    """The browser side: {"js": ..., "html": ..., "css": ...} (video_explorer.js after explorer_common.js;
    video_explorer.html, .css of this package)."""
    folder = resources.files("vitviz.server")
    files = {kind: (folder / f"video_explorer.{kind}").read_text() for kind in ("js", "html", "css")}
    files["js"] = (folder / "explorer_common.js").read_text() + "\n" + files["js"]
    return files
