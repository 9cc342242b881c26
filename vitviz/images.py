"""The one gate every image passes before a model sees it.

`load_image` accepts a PIL image, a path, bytes, a binary file or a uint8 array and returns a loaded
RGB PIL image, or raises `ImageError` saying what was wrong and what is accepted:

- formats: JPEG (and phones' MPO), PNG, WebP, GIF, BMP, TIFF; anything else (SVG, text, ...) is refused;
- size: files over `MAX_BYTES`, images over `MAX_PIXELS` pixels (decompression bombs) and images
  with a side under `min_side` are refused; the pixel count is checked from the header, before decoding;
- truncated or corrupt files are refused (Pillow's LOAD_TRUNCATED_IMAGES stays off);
- EXIF orientation is applied; multi-frame images (GIF, TIFF, WebP) give their first frame;
- modes: palette and grey are expanded, transparency (RGBA, LA, PA, palette with a transparent
  colour) is composited onto white, 16-bit images are rescaled (65535 -> 255) rather than clipped,
  32-bit float and integer images are min-max scaled (in chunks, never as one float copy), CMYK and YCbCr are converted.
"""

from __future__ import annotations

import io
import os
import warnings
from pathlib import Path
from typing import BinaryIO, Callable, Union

import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from vitviz.config import ImageError  # (defined with the records: preprocessing refuses images too)

__all__ = ["ImageError", "load_image", "ACCEPTED_FORMATS", "MAX_BYTES", "MAX_PIXELS", "describe_limits"]

ACCEPTED_FORMATS = ("JPEG", "MPO", "PNG", "WEBP", "GIF", "BMP", "TIFF")
MAX_BYTES = 20 * 1024 * 1024
MAX_PIXELS = 40_000_000
MIN_SIDE = 16

ImageFile.LOAD_TRUNCATED_IMAGES = False
# Pillow's own bomb guard, set explicitly: it warns above this and refuses above twice this.
# vitviz refuses above MAX_PIXELS itself, from the header, before any decoding.
Image.MAX_IMAGE_PIXELS = MAX_PIXELS

ImageSource = Union[Image.Image, str, os.PathLike, bytes, bytearray, BinaryIO, np.ndarray]


def describe_limits() -> str:
    return (
        f"accepted: {', '.join(f for f in ACCEPTED_FORMATS if f != 'MPO')} files up to {MAX_BYTES // (1024 * 1024)} MB "
        f"and {MAX_PIXELS // 1_000_000} megapixels, at least {MIN_SIDE}x{MIN_SIDE} px"
    )


def read_bounded(source, *, max_bytes: int, noun: str, refuse: Callable[[str], Exception], error: Callable[[str], Exception]) -> bytes:
    """The bytes of a file at most `max_bytes` long, from a path, bytes or a binary file object (read
    no further than one byte past the bound): how the image gate and the video gate (`vitviz.clips`)
    read what they are given.

    Args:
        noun: what is read ("image", "video"), for the messages.
        refuse: the error for a file outside the bounds, given the reason (the gate adds its limits).
        error: the error for a source that is no file to read (a missing path, a text-mode file).
    """
    article = "an" if noun[:1] in "aeiou" else "a"
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise error(f"no such {noun} file: {path}")
        size = path.stat().st_size
        if size > max_bytes:
            raise refuse(f"the file is {size / 1e6:.1f} MB")
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    elif isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, io.TextIOBase):  # (before reading: a text file's characters are not its bytes)
        raise error(f"cannot read {article} {noun} from a file opened in text mode ({type(source).__name__})")
    elif hasattr(source, "read"):
        data = source.read(max_bytes + 1)
        if not isinstance(data, (bytes, bytearray)):
            raise error(f"cannot read {article} {noun} from a file opened in text mode ({type(source).__name__})")
        data = bytes(data)
    else:
        raise error(f"cannot read {article} {noun} from {type(source).__name__}")
    if len(data) == 0:
        raise refuse("the file is empty (0 bytes)")
    if len(data) > max_bytes:
        raise refuse(f"the file is over {max_bytes // (1024 * 1024)} MB")
    return data


def _open(source: ImageSource) -> Image.Image:
    data = read_bounded(source, max_bytes=MAX_BYTES, noun="image", refuse=lambda why: ImageError(f"{why}; {describe_limits()}"),
                        error=ImageError)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageError(f"the image has too many pixels ({exc}); {describe_limits()}") from None
    except UnidentifiedImageError:
        raise ImageError(f"this file is not an image vitviz can read; {describe_limits()}") from None
    except OSError as exc:
        raise ImageError(f"the image could not be opened ({exc}); {describe_limits()}") from None


_HIGH_DEPTH = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")
_CHUNK_PIXELS = 1 << 20  # high-depth images are converted about a million pixels at a time


def _row_chunks(img: Image.Image):
    """The image as float32 arrays of a few rows each, so that no full-size float copy is made."""
    w, h = img.size
    rows = max(1, _CHUNK_PIXELS // w)
    for top in range(0, h, rows):
        yield top, np.array(img.crop((0, top, w, min(h, top + rows))), dtype=np.float32)


def _high_depth_to_rgb(img: Image.Image) -> Image.Image:
    """16-bit, 32-bit integer and float images -> 8-bit RGB, in chunks (memory: the decoded image
    plus the 8-bit result). 16-bit data is rescaled (65535 -> 255); other data outside 0..255, and
    every float image, is min-max scaled over its finite values (non-finite values become 0)."""
    mode = img.mode
    lo, hi = np.inf, -np.inf
    for _, chunk in _row_chunks(img):
        finite = chunk[np.isfinite(chunk)]
        if finite.size:
            lo, hi = min(lo, float(finite.min())), max(hi, float(finite.max()))
    if not np.isfinite(lo):
        lo = hi = 0.0
    if mode.startswith("I;16") or (mode == "I" and lo >= 0 and 255 < hi <= 65535):
        scale, offset = 1 / 257, 0.0  # 16-bit full range 0..65535 -> 0..255
    elif mode == "F" or hi > 255 or lo < 0:
        scale = 255.0 / (hi - lo) if hi > lo else 0.0
        offset = -lo * scale
    else:
        scale, offset = 1.0, 0.0
    w, h = img.size
    grey = np.empty((h, w), dtype=np.uint8)
    for top, chunk in _row_chunks(img):
        np.nan_to_num(chunk, copy=False, nan=lo, posinf=hi, neginf=lo)
        chunk *= scale
        chunk += offset
        np.rint(chunk, out=chunk)
        np.clip(chunk, 0, 255, out=chunk)
        grey[top : top + len(chunk)] = chunk
    return Image.fromarray(grey, "L").convert("RGB")


def _to_rgb(img: Image.Image) -> Image.Image:
    mode = img.mode
    if mode == "RGB":
        return img
    if mode in _HIGH_DEPTH:
        return _high_depth_to_rgb(img)
    if mode == "P":
        img = img.convert("RGBA") if "transparency" in img.info else img.convert("RGB")
        mode = img.mode
        if mode == "RGB":
            return img
    if mode in ("LA", "PA", "La", "RGBa"):
        img = img.convert("RGBA")
    elif mode in ("L", "1") and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode == "RGBA":
        background = Image.new("RGB", img.size, (255, 255, 255))
        background.paste(img, mask=img.getchannel("A"))
        return background
    return img.convert("RGB")  # L, 1, CMYK, YCbCr, LAB, HSV, RGBX


def load_image(source: ImageSource, *, min_side: int = MIN_SIDE) -> Image.Image:
    """Reads, checks and normalises one image to a loaded RGB PIL image.

    Args:
        source: a PIL image, a path, bytes, a binary file object, or a uint8 array [H, W] / [H, W, 3|4].
        min_side: the smallest accepted width and height in pixels.

    Raises:
        ImageError: the reason, and what is accepted.
    """
    if isinstance(source, np.ndarray):
        if source.dtype != np.uint8 or source.ndim not in (2, 3) or (source.ndim == 3 and source.shape[2] not in (1, 3, 4)):
            raise ImageError(f"arrays must be uint8 [H, W], [H, W, 3] or [H, W, 4]; got {source.dtype} {list(source.shape)}")
        img = Image.fromarray(source.squeeze(-1) if source.ndim == 3 and source.shape[2] == 1 else source)
    elif isinstance(source, Image.Image):
        img = source
    else:
        img = _open(source)
        if img.format not in ACCEPTED_FORMATS:
            raise ImageError(f"{img.format} files are not accepted; {describe_limits()}")

    w, h = img.size
    if w * h > MAX_PIXELS:
        raise ImageError(f"the image is {w}x{h} = {w * h / 1e6:.0f} megapixels; {describe_limits()}")
    if min(w, h) < min_side:
        raise ImageError(f"the image is only {w}x{h} px; {describe_limits()}")
    try:
        # Only the first frame is decoded. Frames are never counted: `n_frames` walks the whole file,
        # which for a 20 MB GIF of a million 1-pixel frames takes seconds.
        if hasattr(img, "tell") and img.tell() != 0:
            img.seek(0)
        img.load()
        img = ImageOps.exif_transpose(img)
        img = _to_rgb(img)
        img.load()
    except (OSError, SyntaxError, ValueError) as exc:
        raise ImageError(f"the image is truncated or corrupt ({exc}); {describe_limits()}") from None
    return img
