"""Generated clips of a moving shape, with motion labels and per-frame masks, and the embedded video
model `shapes_video` trained on them.

Every clip is a pure function of `(seed, index)`. A clip has `FRAMES` frames of `IMAGE_SIZE` px: one
cluttered background (`vitviz.shapes`: gradients, blobs, stripes or checks, pixel noise, distractor
strokes), the same in every frame; one static distractor shape; and one shape that moves in a
straight line at constant speed in one of the directions of `MOTIONS` ("left", "right", "up",
"down"), or stays where it is ("still"). Both shapes are of `vitviz.shapes.CLASSES`, each painted in
one of the named `vitviz.shapes.COLORS`; the moving shape lies fully inside every frame and is drawn
over the distractor, which lies clear of its path. Each frame has its own pixel noise and its own
4 % texture on the shapes, so that frames of a still clip differ too, though nothing moves.

`shapes_video` (`load_shapes_video`) is a `VideoViT` of `shapes_video_config`: 8 frames in tubelets
of 2 at 96 px, patch 16 (4 x 6 x 6 tokens and a cls token), joint space-time attention, 4 blocks of
width 96 with 3 heads; it tells the moving shape's motion, one of `MOTIONS`.
`python -m vitviz.dev.train_shapes_video` makes its weights, assets/shapes_video.pt.
`python -m vitviz.video.shapes DIR --n 100` writes clips with their masks for `python -m vitviz.evaluate`.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from vitviz.config import Preprocessing
from vitviz.shapes import CLASSES, COLORS, _cluttered_background, _shape_alpha
from vitviz.video.model import VideoConfig, VideoSpec, VideoViT

__all__ = [
    "MOTIONS",
    "FRAMES",
    "IMAGE_SIZE",
    "render_clip",
    "generate_clips",
    "to_videos",
    "shapes_video_config",
    "shapes_video_spec",
    "load_shapes_video",
    "write_clips",
]

MOTIONS: tuple[str, ...] = ("left", "right", "up", "down", "still")
FRAMES = 8
IMAGE_SIZE = 96
# unit steps (dx, dy) in image coordinates, y pointing down
_STEPS = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0), "still": (0.0, 0.0)}
RADIUS = (0.12, 0.18)  # the shapes' radii, as shares of the side
TRAVEL = (0.32, 0.48)  # the moving shape's travel from the first frame to the last, as shares of the side (30.7-46.1 px at 96)


def _segment_distance(px: float, py: float, a: tuple[float, float], b: tuple[float, float]) -> float:
    """The distance from (px, py) to the segment from a to b."""
    (ax, ay), (bx, by) = a, b
    dx, dy = bx - ax, by - ay
    length2 = dx * dx + dy * dy
    u = 0.0 if length2 == 0 else min(1.0, max(0.0, ((px - ax) * dx + (py - ay) * dy) / length2))
    return math.hypot(px - (ax + u * dx), py - (ay + u * dy))


def _pick_colour(rng: np.random.Generator, under: np.ndarray) -> np.ndarray:
    """A named colour that stands out from `under` (the mean RGB below the shape): drawn among those
    at an L1 distance above 200, else the farthest."""
    palette = np.array(list(COLORS.values()), dtype=np.float32)
    distance = np.abs(palette - under).sum(axis=1)
    contrast = np.flatnonzero(distance > 200)
    return palette[int(rng.choice(contrast)) if contrast.size else int(distance.argmax())]


def render_clip(*, seed: int, index: int, frames: int = FRAMES, image_size: int = IMAGE_SIZE) -> tuple[np.ndarray, int, np.ndarray]:
    """One clip, deterministic in `(seed, index)` (module docstring).

    The motion is drawn uniformly among `MOTIONS`; the moving shape's radius r among `RADIUS` shares
    of the side; its travel d among `TRAVEL` shares of the side, covered in equal steps from the first
    frame to the last (d = 0 for "still"); its centre stays within r + 2 px of every edge; its rotation
    stays as it is. The distractor (radius in `RADIUS`, shrinking where no spot is found) lies more than
    1.1 (r + its radius) + 2 px from the moving shape's path.

    Returns:
        frames uint8 [T, S, S, 3], the motion (an index into `MOTIONS`), and the moving shape's masks
        bool [T, S, S] (the pixels it covers at least half, per frame).
    """
    if frames < 2:
        raise ValueError(f"a clip has at least 2 frames, not {frames}")
    rng = np.random.default_rng([seed, index, 4_000_003])
    size = image_size
    label = int(rng.integers(len(MOTIONS)))
    background = _cluttered_background(rng, size)

    r = rng.uniform(*RADIUS) * size
    travel = rng.uniform(*TRAVEL) * size if MOTIONS[label] != "still" else 0.0
    dx, dy = _STEPS[MOTIONS[label]]
    low = rng.uniform(r + 2, size - r - 2 - travel)  # the path's lower end along its axis
    across = rng.uniform(r + 2, size - r - 2)
    along_start = low + travel if dx + dy < 0 else low
    if dx != 0:
        start = (along_start, across)
    else:
        start = (across, along_start)
    end = (start[0] + dx * travel, start[1] + dy * travel)
    moving = CLASSES[int(rng.integers(len(CLASSES)))]
    angle = rng.uniform(0, 2 * math.pi)

    for attempt in range(200):
        q = rng.uniform(*RADIUS) * size * (0.97 ** (attempt // 20))
        qx, qy = rng.uniform(q + 2, size - q - 2, 2)
        if _segment_distance(qx, qy, start, end) > 1.1 * (r + q) + 2:
            break
    still = CLASSES[int(rng.integers(len(CLASSES)))]
    still_alpha, (still_rows, still_cols) = _shape_alpha(size, still, qx, qy, q, rng.uniform(0, 2 * math.pi))
    still_mask = np.zeros((size, size), dtype=bool)
    still_mask[still_rows, still_cols] = still_alpha > 0.5

    shapes = []
    masks = np.zeros((frames, size, size), dtype=bool)
    for k in range(frames):
        u = k / (frames - 1)
        alpha, (rows, cols) = _shape_alpha(size, moving, start[0] + u * (end[0] - start[0]), start[1] + u * (end[1] - start[1]), r, angle)
        masks[k, rows, cols] = alpha > 0.5
        shapes.append((alpha, rows, cols))
    path = masks.any(axis=0)
    still_colour = _pick_colour(rng, background[still_mask].mean(axis=0) if still_mask.any() else background.reshape(-1, 3).mean(axis=0))
    moving_colour = _pick_colour(rng, background[path].mean(axis=0) if path.any() else background.reshape(-1, 3).mean(axis=0))
    noise = rng.uniform(0, 4)

    out = np.empty((frames, size, size, 3), dtype=np.uint8)
    for k, (alpha, rows, cols) in enumerate(shapes):
        img = background.copy()
        for colour, a, rr, cc in ((still_colour, still_alpha, still_rows, still_cols), (moving_colour, alpha, rows, cols)):
            paint = colour * (1.0 + 0.04 * rng.standard_normal((*a.shape, 1), dtype=np.float32))
            img[rr, cc] = img[rr, cc] * (1 - a[..., None]) + paint * a[..., None]
        img += rng.standard_normal(img.shape, dtype=np.float32) * noise
        out[k] = np.clip(img, 0, 255).astype(np.uint8)
    return out, label, masks


def generate_clips(n: int, seed: int, start: int = 0, *, frames: int = FRAMES,
                   image_size: int = IMAGE_SIZE) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`n` clips (`render_clip`), clip k being index `start + k` of `seed`.

    Returns:
        frames uint8 [n, T, S, S, 3], motions int64 [n] (indices into `MOTIONS`), masks bool [n, T, S, S].
    """
    videos = np.empty((n, frames, image_size, image_size, 3), dtype=np.uint8)
    labels = np.empty(n, dtype=np.int64)
    masks = np.empty((n, frames, image_size, image_size), dtype=bool)
    for k in range(n):
        videos[k], labels[k], masks[k] = render_clip(seed=seed, index=start + k, frames=frames, image_size=image_size)
    return videos, labels, masks


def to_videos(frames: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Clips uint8 [B, T, S, S, 3] (or one [T, S, S, 3]) as the model's input, float32 [B, T, 3, S, S],
    each channel (x / 255 - 0.5) / 0.5."""
    x = torch.as_tensor(frames)
    if x.ndim == 4:
        x = x[None]
    if x.ndim != 5 or x.shape[-1] != 3:
        raise ValueError(f"expected clips of shape [B, T, S, S, 3], got {list(x.shape)}")
    return (x.permute(0, 1, 4, 2, 3).float() / 255 - 0.5) / 0.5


def shapes_video_config() -> VideoConfig:
    """The architecture of `shapes_video`: 8 frames, tubelets of 2 frames x 16 x 16 px at 96 px (a
    4 x 6 x 6 grid, 144 patch tokens and a cls token), a learned position table, joint attention,
    4 blocks of width 96, 3 heads, MLP 192, the head on the cls token, one class per motion."""
    return VideoConfig(frames=FRAMES, tubelet=2, image_size=IMAGE_SIZE, patch_size=16, width=96, depth=4, heads=3, mlp_dim=192,
                       attention="joint", class_token=True, positions="learned", pool="cls", num_classes=len(MOTIONS))


def shapes_video_spec() -> VideoSpec:
    """The record of `shapes_video`: its architecture, frames prepared as (x / 255 - 0.5) / 0.5, its
    classes `MOTIONS`, its weights in assets/shapes_video.pt."""
    return VideoSpec(name="shapes_video", config=shapes_video_config(),
                     preprocessing=Preprocessing(image_size=IMAGE_SIZE, resize_size=IMAGE_SIZE, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)),
                     frames=FRAMES, sampling="uniform", categories=MOTIONS, source="embedded",
                     weights="embedded assets/shapes_video.pt (python -m vitviz.dev.train_shapes_video)", locator="shapes_video.pt",
                     description=f"Shapes video ViT, {FRAMES} frames at {IMAGE_SIZE} px, tubelets 2x16x16 (4x6x6 tokens), joint attention, "
                                 f"{len(MOTIONS)} motions of a generated shape (embedded, offline)")


def load_shapes_video(*, device: str | torch.device = "cpu", weights_path: str | None = None) -> VideoViT:
    """The embedded `shapes_video` in eval mode, its `spec` `shapes_video_spec()`: the weights of
    `weights_path`, else assets/shapes_video.pt (`vitviz.sources.embedded.assets_dir`).

    Raises:
        WeightsUnavailableError: the weights file is missing.
    """
    from pathlib import Path

    from vitviz.sources.base import WeightsUnavailableError
    from vitviz.sources.embedded import assets_dir

    spec = shapes_video_spec()
    path = Path(weights_path) if weights_path is not None else assets_dir() / spec.locator
    if not path.is_file():
        raise WeightsUnavailableError(f"Embedded weights for shapes_video are missing: expected {path}. "
                                      "Recreate them with `python -m vitviz.dev.train_shapes_video`.")
    model = VideoViT(spec.config)
    try:
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    except RuntimeError as exc:
        raise ValueError(f"the checkpoint does not fit shapes_video ({spec.description}): {exc}") from exc
    model.spec = spec
    return model.eval().to(device)


def write_clips(folder, n: int, *, seed: int = 2024, start: int = 0) -> list[str]:
    """`n` clips (`render_clip`) as a folder the evaluator reads (`vitviz.evaluate.clips`):
    `<folder>/<motion>/<i>.webp`, each an animated lossless WebP of `FRAMES` frames (so that the frames
    read back are the frames made), and its object masks `<folder>/masks/<motion>/<i>/<k>.png` for
    frame k (white on the moving shape). Seeds 21, 22 and 5000 are the training, check and measuring
    clips; any other gives clips never trained on. Returns the clips' paths."""
    from pathlib import Path

    from PIL import Image

    folder = Path(folder)
    paths = []
    for i in range(n):
        frames, label, masks = render_clip(seed=seed, index=start + i)
        path = folder / MOTIONS[label] / f"{start + i:06d}.webp"
        path.parent.mkdir(parents=True, exist_ok=True)
        images = [Image.fromarray(f) for f in frames]
        images[0].save(path, format="WEBP", save_all=True, append_images=images[1:], lossless=True, duration=125, loop=0)
        mask_folder = folder / "masks" / MOTIONS[label] / f"{start + i:06d}"
        mask_folder.mkdir(parents=True, exist_ok=True)
        for k, mask in enumerate(masks):
            Image.fromarray(mask.astype(np.uint8) * 255).save(mask_folder / f"{k}.png")
        paths.append(str(path))
    return paths


def main(argv: list[str] | None = None) -> None:
    import argparse
    from pathlib import Path

    ap = argparse.ArgumentParser(description="Writes generated clips of a moving shape, with their per-frame object masks, "
                                             "as a folder of clips by motion (python -m vitviz.evaluate reads it).")
    ap.add_argument("folder", type=Path)
    ap.add_argument("--n", type=int, default=200, help="clips")
    ap.add_argument("--seed", type=int, default=2024, help="training used 21 and 22, the measure 5000; any other gives unseen clips")
    args = ap.parse_args(argv)
    paths = write_clips(args.folder, args.n, seed=args.seed)
    print(f"wrote {len(paths)} clips and their masks under {args.folder}")


if __name__ == "__main__":
    main()
