"""Generated images of shapes on cluttered backgrounds, with labels and object masks.

Every sample is a pure function of `(seed, index)`: the same seed gives the same images on any
machine, and a different seed gives images never seen in training. Each image holds one shape of
`CLASSES` at a random position, scale, rotation and colour, over a background of gradients,
low-frequency blobs, stripes or checks, pixel noise, and distractor strokes (open lines and arcs,
never closed shapes). The mask marks the shape's pixels, so that "does the model look at the
object?" can be measured (see `pointing_game` in `vitviz.analysis`).

`generate_scenes` draws scenes of 2-3 shapes, each in one of the named `COLORS`, with the list of
their (colour, shape) names and one mask per object: the captioned data of the embedded image–text
model `shapes_clip` (`python -m vitviz.dev.train_shapes_clip`).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

__all__ = ["CLASSES", "COLORS", "generate", "generate_scenes", "render", "render_scene", "write_examples", "write_dataset"]

CLASSES: tuple[str, ...] = (
    "circle",
    "square",
    "triangle",
    "star",
    "cross",
    "ring",
    "arrow",
    "crescent",
)

# The named colours of `generate_scenes`, RGB: six hues far apart from each other.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 70, 230),
    "yellow": (245, 220, 30),
    "purple": (150, 40, 200),
    "orange": (250, 130, 10),
}

_SUPERSAMPLE = 4


def _polygon(cx: float, cy: float, radii: list[float], angle: float) -> list[tuple[float, float]]:
    """Vertices at equal angular steps with the given radii, starting at `angle`."""
    n = len(radii)
    return [
        (cx + r * math.cos(angle + 2 * math.pi * k / n), cy + r * math.sin(angle + 2 * math.pi * k / n))
        for k, r in enumerate(radii)
    ]


def _draw_shape(draw: ImageDraw.ImageDraw, name: str, cx: float, cy: float, r: float, angle: float) -> None:
    """Draws shape `name` in white (255) on an 'L' canvas; black (0) cuts holes."""
    box = (cx - r, cy - r, cx + r, cy + r)
    if name == "circle":
        draw.ellipse(box, fill=255)
    elif name == "square":
        draw.polygon(_polygon(cx, cy, [r] * 4, angle), fill=255)
    elif name == "triangle":
        draw.polygon(_polygon(cx, cy, [r] * 3, angle), fill=255)
    elif name == "arrow":
        # pointing along `angle`: a shaft 0.36 r wide and a head 1.2 r wide and 0.85 r long
        c, s = math.cos(angle), math.sin(angle)
        outline = [(-r, -0.18 * r), (0.15 * r, -0.18 * r), (0.15 * r, -0.6 * r), (r, 0.0),
                   (0.15 * r, 0.6 * r), (0.15 * r, 0.18 * r), (-r, 0.18 * r)]
        draw.polygon([(cx + x * c - y * s, cy + x * s + y * c) for x, y in outline], fill=255)
    elif name == "star":
        draw.polygon(_polygon(cx, cy, [r, 0.42 * r] * 5, angle), fill=255)
    elif name == "cross":
        w = 0.32 * r
        arm = [(-w, -r), (w, -r), (w, -w), (r, -w), (r, w), (w, w), (w, r), (-w, r), (-w, w), (-r, w), (-r, -w), (-w, -w)]
        c, s = math.cos(angle), math.sin(angle)
        draw.polygon([(cx + x * c - y * s, cy + x * s + y * c) for x, y in arm], fill=255)
    elif name == "ring":
        draw.ellipse(box, fill=255)
        q = 0.58 * r
        draw.ellipse((cx - q, cy - q, cx + q, cy + q), fill=0)
    elif name == "crescent":
        draw.ellipse(box, fill=255)
        ox, oy = cx + 0.5 * r * math.cos(angle), cy + 0.5 * r * math.sin(angle)
        q = 0.9 * r
        draw.ellipse((ox - q, oy - q, ox + q, oy + q), fill=0)
    else:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(CLASSES)}")


def _shape_alpha(size: int, name: str, cx: float, cy: float, r: float, angle: float) -> tuple[np.ndarray, tuple[slice, slice]]:
    """Anti-aliased coverage in [0, 1] of one shape, drawn supersampled within its bounding box only.

    Returns:
        coverage float32 [h, w] and the (rows, cols) slices of the image that it covers.
    """
    k = _SUPERSAMPLE
    reach = 1.1 * r + 2  # every shape lies within 1.05 r of its centre (the cross's arm corners)
    x0, y0 = max(0, math.floor(cx - reach)), max(0, math.floor(cy - reach))
    x1, y1 = min(size, math.ceil(cx + reach)), min(size, math.ceil(cy + reach))
    canvas = Image.new("L", ((x1 - x0) * k, (y1 - y0) * k), 0)
    _draw_shape(ImageDraw.Draw(canvas), name, (cx - x0) * k, (cy - y0) * k, r * k, angle)
    a = np.asarray(canvas, dtype=np.float32) / 255.0
    # [h*k, w*k] -> [h, w]: mean over each k x k block
    return a.reshape(y1 - y0, k, x1 - x0, k).mean(axis=(1, 3)), (slice(y0, y1), slice(x0, x1))


def _background(rng: np.random.Generator, size: int) -> np.ndarray:
    """A cluttered RGB background, float32 [size, size, 3] in 0..255."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    kind = rng.integers(4)
    c0, c1 = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
    if kind == 0:  # linear gradient at a random angle
        t = math.cos(a := rng.uniform(0, 2 * math.pi)) * xx + math.sin(a) * yy
        t = (t - t.min()) / (np.ptp(t) + 1e-6)
    elif kind == 1:  # low-frequency blobs: a coarse random grid, upsampled smoothly
        cells = int(rng.integers(3, 7))
        coarse = Image.fromarray((rng.uniform(0, 1, (cells, cells)) * 255).astype(np.uint8))
        t = np.asarray(coarse.resize((size, size), Image.BICUBIC), dtype=np.float32) / 255.0
    elif kind == 2:  # stripes
        freq = rng.uniform(3, 12)
        a = rng.uniform(0, math.pi)
        t = 0.5 + 0.5 * np.sin(2 * math.pi * freq * (math.cos(a) * xx + math.sin(a) * yy) + rng.uniform(0, 6.3))
        t = 0.35 + 0.3 * t
    else:  # checks
        n = int(rng.integers(3, 10))
        t = ((np.floor(xx * n) + np.floor(yy * n)) % 2) * 0.3 + 0.35
    bg = (c0 + (c1 - c0) * t[..., None]).astype(np.float32)
    bg += rng.standard_normal(bg.shape, dtype=np.float32) * rng.uniform(0, 10)
    return bg


def _strokes(rng: np.random.Generator, size: int) -> list[tuple]:
    """Distractor strokes: open polylines and arcs, as drawing commands in image coordinates."""
    out = []
    for _ in range(int(rng.integers(1, 5))):
        color = tuple(int(c) for c in rng.uniform(0, 255, 3))
        width = float(rng.uniform(1, 2.2))
        if rng.random() < 0.5:
            pts = [tuple(rng.uniform(0, size, 2)) for _ in range(int(rng.integers(2, 4)))]
            out.append(("line", pts, color, width))
        else:
            r = rng.uniform(0.1, 0.4) * size
            c = rng.uniform(0, size, 2)
            start = rng.uniform(0, 360)
            out.append(("arc", (c[0] - r, c[1] - r, c[0] + r, c[1] + r), start, start + rng.uniform(40, 200), color, width))
    return out


def render(
    label: int, *, seed: int, index: int, image_size: int = 96
) -> tuple[np.ndarray, np.ndarray]:
    """One sample of class `label`, deterministic in `(seed, index)`.

    Returns:
        image uint8 [S, S, 3] and mask bool [S, S].
    """
    rng = np.random.default_rng([seed, index, label])
    size = image_size
    img = _background(rng, size)

    canvas = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(canvas)
    for stroke in _strokes(rng, size):
        if stroke[0] == "line":
            draw.line(stroke[1], fill=stroke[2], width=max(1, round(stroke[3])))
        else:
            draw.arc(stroke[1], stroke[2], stroke[3], fill=stroke[4], width=max(1, round(stroke[5])))
    img = np.asarray(canvas, dtype=np.float32)

    name = CLASSES[label]
    r = rng.uniform(0.16, 0.30) * size
    cx, cy = rng.uniform(r + 2, size - r - 2, 2)
    angle = rng.uniform(0, 2 * math.pi)
    alpha, (rows, cols) = _shape_alpha(size, name, cx, cy, r, angle)
    mask = np.zeros((size, size), dtype=bool)
    mask[rows, cols] = alpha > 0.5

    # A colour that stands out from the background under the object.
    under = img[mask].mean(axis=0) if mask.any() else img.reshape(-1, 3).mean(axis=0)
    for _ in range(50):
        color = rng.uniform(0, 255, 3)
        if np.abs(color - under).sum() > 220:
            break
    # a little texture on the object too
    paint = color.astype(np.float32) * (1.0 + 0.04 * rng.standard_normal((*alpha.shape, 1), dtype=np.float32))
    a = alpha[..., None]
    img[rows, cols] = img[rows, cols] * (1 - a) + paint * a
    return np.clip(img, 0, 255).astype(np.uint8), mask


def generate(
    n: int, *, seed: int, image_size: int = 96, start: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`n` samples with balanced, shuffled labels, deterministic in `seed`.

    Args:
        n: number of samples.
        seed: any integer; samples with different seeds are independent.
        image_size: side of the square images in pixels.
        start: index of the first sample, so that a long stream can be generated in chunks.

    Returns:
        images uint8 [n, S, S, 3], labels int64 [n] (indices into `CLASSES`), masks bool [n, S, S].
    """
    labels = np.array(
        [np.random.default_rng([seed, i, 1_000_003]).integers(len(CLASSES)) for i in range(start, start + n)],
        dtype=np.int64,
    )
    images = np.empty((n, image_size, image_size, 3), dtype=np.uint8)
    masks = np.empty((n, image_size, image_size), dtype=bool)
    for k, (i, label) in enumerate(zip(range(start, start + n), labels)):
        images[k], masks[k] = render(int(label), seed=seed, index=i, image_size=image_size)
    return images, labels, masks


def _cluttered_background(rng: np.random.Generator, size: int) -> np.ndarray:
    """`_background` with the distractor strokes drawn on it, float32 [size, size, 3] in 0..255."""
    canvas = Image.fromarray(np.clip(_background(rng, size), 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(canvas)
    for stroke in _strokes(rng, size):
        if stroke[0] == "line":
            draw.line(stroke[1], fill=stroke[2], width=max(1, round(stroke[3])))
        else:
            draw.arc(stroke[1], stroke[2], stroke[3], fill=stroke[4], width=max(1, round(stroke[5])))
    return np.asarray(canvas, dtype=np.float32)


def render_scene(
    *, seed: int, index: int, image_size: int = 96
) -> tuple[np.ndarray, list[tuple[str, str]], np.ndarray]:
    """One scene of 2 or 3 shapes that do not overlap, deterministic in `(seed, index)`.

    Each object is a shape of `CLASSES` (radius 0.12-0.21 of the side, random position and rotation)
    painted in one of the `COLORS` (with 4 % texture), picked among the colours that stand out from
    the background under it (L1 distance of the RGB values above 200, else the farthest); no two
    objects of a scene have the same (colour, shape).

    Returns:
        image uint8 [S, S, 3], objects [(colour, shape)] (K of them), masks bool [K, S, S] (the
        pixels each object covers at least half, disjoint).
    """
    rng = np.random.default_rng([seed, index, 2_000_003])
    size = image_size
    img = _cluttered_background(rng, size)
    count = int(rng.integers(2, 4))
    placed: list[tuple[float, float, float]] = []
    objects: list[tuple[str, str]] = []
    masks = np.zeros((count, size, size), dtype=bool)
    names = list(COLORS)
    palette = np.array([COLORS[c] for c in names], dtype=np.float32)  # [6, 3]
    for k in range(count):
        for attempt in range(200):  # a free spot (the radius shrinks if none is found)
            r = rng.uniform(0.12, 0.21) * size * (0.97 ** (attempt // 20))
            cx, cy = rng.uniform(r + 2, size - r - 2, 2)
            if all(math.hypot(cx - x, cy - y) > 1.1 * (r + q) + 2 for x, y, q in placed):
                break
        placed.append((cx, cy, r))
        shape = CLASSES[int(rng.integers(len(CLASSES)))]
        alpha, (rows, cols) = _shape_alpha(size, shape, cx, cy, r, rng.uniform(0, 2 * math.pi))
        masks[k, rows, cols] = alpha > 0.5
        under = img[masks[k]].mean(axis=0) if masks[k].any() else img.reshape(-1, 3).mean(axis=0)
        distance = np.abs(palette - under).sum(axis=1)
        free = [i for i in range(len(names)) if (names[i], shape) not in objects]
        contrast = [i for i in free if distance[i] > 200]
        pick = int(rng.choice(contrast)) if contrast else max(free, key=lambda i: distance[i])
        objects.append((names[pick], shape))
        paint = palette[pick] * (1.0 + 0.04 * rng.standard_normal((*alpha.shape, 1), dtype=np.float32))
        a = alpha[..., None]
        img[rows, cols] = img[rows, cols] * (1 - a) + paint * a
    return np.clip(img, 0, 255).astype(np.uint8), objects, masks


def generate_scenes(
    n: int, *, seed: int, image_size: int = 96, start: int = 0
) -> tuple[np.ndarray, list[list[tuple[str, str]]], list[np.ndarray]]:
    """`n` scenes of 2-3 coloured shapes (`render_scene`), deterministic in `seed`.

    The colours are `COLORS`: red (220, 30, 30), green (30, 170, 50), blue (30, 70, 230), yellow
    (245, 220, 30), purple (150, 40, 200), orange (250, 130, 10).

    Args:
        n: number of scenes.
        seed: any integer; scenes with different seeds are independent.
        image_size: side of the square images in pixels.
        start: index of the first scene, so that a long stream can be generated in chunks.

    Returns:
        images uint8 [n, S, S, 3]; per image its objects as (colour name, shape name) pairs, distinct
        within an image; per image its object masks bool [K, S, S], one per object, in that order.
    """
    images = np.empty((n, image_size, image_size, 3), dtype=np.uint8)
    objects, masks = [], []
    for k, i in enumerate(range(start, start + n)):
        images[k], objs, m = render_scene(seed=seed, index=i, image_size=image_size)
        objects.append(objs)
        masks.append(m)
    return images, objects, masks


def write_examples(folder, *, seed: int = 7, image_size: int = 192) -> list[str]:
    """One PNG per class, `<class>.png`, rendered at `image_size` (the app's example images)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for label, name in enumerate(CLASSES):
        image, _ = render(label, seed=seed, index=0, image_size=image_size)
        path = folder / f"{name}.png"
        Image.fromarray(image).save(path)
        paths.append(str(path))
    return paths


def write_dataset(folder, n: int, *, seed: int = 2024, image_size: int = 96) -> list[str]:
    """`n` samples as a folder of images in the ImageFolder layout, `<folder>/<class>/<i>.png`, with
    their object masks beside, `<folder>/masks/<class>/<i>.png` (white on the object): a dataset that
    `python -m vitviz.evaluate` reads, the pointing game included. Returns the image paths."""
    folder = Path(folder)
    images, labels, masks = generate(n, seed=seed, image_size=image_size)
    paths = []
    for i, (image, label, mask) in enumerate(zip(images, labels, masks)):
        name = CLASSES[int(label)]
        path = folder / name / f"{i:06d}.png"
        mask_path = folder / "masks" / name / f"{i:06d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        mask_path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(path)
        Image.fromarray(mask.astype(np.uint8) * 255).save(mask_path)
        paths.append(str(path))
    return paths


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Writes generated shapes images, with their object masks, as an ImageFolder dataset.")
    ap.add_argument("folder", type=Path)
    ap.add_argument("--n", type=int, default=1000, help="images")
    ap.add_argument("--seed", type=int, default=2024, help="training used 0 and 1; any other seed gives images never trained on")
    ap.add_argument("--image-size", type=int, default=96)
    args = ap.parse_args(argv)
    paths = write_dataset(args.folder, args.n, seed=args.seed, image_size=args.image_size)
    print(f"wrote {len(paths)} images and their masks under {args.folder}")


if __name__ == "__main__":
    main()
