"""Hostile and odd image files, made on the fly (nothing downloaded), with what each should give."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image


def _save(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def _photo(w: int = 120, h: int = 80) -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def exif_rotated_jpeg() -> bytes:
    """Stored 160x80 with the left half red and the right half blue, EXIF orientation 6
    (rotate 90 degrees clockwise to display): displayed 80x160, red on top, blue below."""
    arr = np.zeros((80, 160, 3), dtype=np.uint8)
    arr[:, :80] = (255, 0, 0)
    arr[:, 80:] = (0, 0, 255)
    img = Image.fromarray(arr)
    exif = img.getexif()
    exif[0x0112] = 6
    return _save(img, "JPEG", quality=95, exif=exif.tobytes())


def grey16_png() -> bytes:
    """A 64x64 16-bit grey ramp: left column 0, right column 65535."""
    ramp = np.tile(np.linspace(0, 65535, 64).astype(np.uint16), (64, 1))
    return _save(Image.fromarray(ramp), "PNG")  # uint16 -> mode I;16


def palette_transparent_png() -> bytes:
    """Palette image: index 0 (black) transparent on the left half, index 1 (green) on the right."""
    img = Image.new("P", (64, 64), 0)
    img.putpalette([0, 0, 0, 0, 200, 0] + [0] * 762)
    img.paste(1, (32, 0, 64, 64))
    return _save(img, "PNG", transparency=0)


def animated_gif() -> bytes:
    frames = [Image.new("RGB", (64, 64), c) for c in [(255, 0, 0), (0, 255, 0), (0, 0, 255)]]
    return _save(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)


def corpus() -> dict[str, tuple[bytes, str, str]]:
    """name -> (file bytes, file suffix, expected: 'ok' or a word the error message must contain)."""
    jpeg = _save(_photo(), "JPEG", quality=90)
    rgba = Image.new("RGBA", (64, 64), (255, 0, 0, 0))
    rgba.paste((0, 0, 255, 255), (0, 0, 32, 64))
    la = Image.new("LA", (64, 64), (0, 0))
    la.paste((0, 255), (0, 0, 32, 64))
    return {
        "empty": (b"", ".jpg", "empty"),
        "text-named-jpg": (b"hello, this is not a picture\n" * 20, ".jpg", "not an image"),
        "truncated-jpeg": (jpeg[: len(jpeg) // 2], ".jpg", "truncated"),
        "pixel-bomb": (_save(Image.new("1", (10_000, 9_000)), "PNG"), ".png", "pixels"),
        "one-pixel": (_save(Image.new("RGB", (1, 1), (9, 9, 9)), "PNG"), ".png", "1x1"),
        "grey16": (grey16_png(), ".png", "ok"),
        "cmyk-jpeg": (_save(_photo().convert("CMYK"), "JPEG"), ".jpg", "ok"),
        "palette-transparent": (palette_transparent_png(), ".png", "ok"),
        "la": (_save(la, "PNG"), ".png", "ok"),
        "rgba": (_save(rgba, "PNG"), ".png", "ok"),
        "animated-gif": (animated_gif(), ".gif", "ok"),
        "exif-rotated": (exif_rotated_jpeg(), ".jpg", "ok"),
        "svg": (b'<svg xmlns="http://www.w3.org/2000/svg" width="64" height="64"><circle cx="32" cy="32" r="20"/></svg>', ".svg", "not an image"),
        "webp": (_save(_photo(), "WEBP"), ".webp", "ok"),
        "bmp": (_save(_photo(), "BMP"), ".bmp", "ok"),
        "tiff": (_save(_photo(), "TIFF"), ".tiff", "ok"),
    }


def write_corpus(folder: Path) -> dict[str, tuple[Path, str]]:
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, (data, suffix, expect) in corpus().items():
        path = folder / f"{name}{suffix}"
        path.write_bytes(data)
        out[name] = (path, expect)
    return out


def many_frames_gif(frames: int = 1_380_000, side: int = 64) -> bytes:
    """A GIF of `frames` 1-pixel frames: about 15 bytes a frame, so 1.38 million fit in 20 MB."""
    import struct

    # one frame: image descriptor (1x1 at 0,0), LZW minimum code size 2, one data block with the
    # 3-bit codes clear (4), index 0, end (5) packed from the low bit: 0b101_000_100 -> 0x04 0x01
    frame = b"\x2c" + struct.pack("<HHHHB", 0, 0, 1, 1, 0) + bytes([2, 2, 0x04, 0x01, 0])
    header = b"GIF89a" + struct.pack("<HHBBB", side, side, 0xF0, 0, 0) + bytes([0, 0, 0, 255, 255, 255])
    return header + frame * frames + b"\x3b"


def float_tiff(width: int = 8000, height: int = 5000) -> bytes:
    """A 40-megapixel 32-bit float TIFF (a vertical ramp), deflate-compressed to well under 1 MB."""
    ramp = np.linspace(0, 1, height, dtype=np.float32)[:, None] * np.ones((1, width), np.float32)
    return _save(Image.fromarray(ramp, "F"), "TIFF", compression="tiff_adobe_deflate")
