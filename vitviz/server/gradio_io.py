"""Gradio's edges made safe for a public server: what comes in as an image, what goes out as a file.

- `UploadedImage`: an image input that accepts only files that came in through Gradio's upload
  door (a regular file inside the upload folder, symlinks resolved). Gradio itself checks upload
  membership only for file payloads that carry `meta`, and decodes `data:` URLs and fetches web
  addresses before a component sees them; `GuardedBlocks` checks every image payload first, so
  that nothing else is opened, decoded or fetched, and every refusal reads the same whether or not
  the path exists on the server.
- `UploadLimit`: an ASGI middleware that lets through at most one file of at most `max_bytes` per
  upload request (Gradio's own limit is per file, up to 1,000 files a request).
- `PngImage` / `ViewImage`: output images written under a keyed hash of their bytes (a per-process
  secret), so that nobody can test whether a given picture was recently analysed.
- `as_text`: error text escaped for the page, which reads error messages as HTML.
"""

from __future__ import annotations

import hashlib
import hmac
import html
import io
import os
import secrets
from pathlib import Path
from typing import Any

import gradio as gr
from gradio.data_classes import ImageData
from gradio.utils import get_upload_folder
from PIL import Image

__all__ = [
    "UPLOAD_REFUSED",
    "GuardedBlocks",
    "UploadedImage",
    "UploadLimit",
    "PngImage",
    "ViewImage",
    "as_text",
    "secret_name",
    "uploaded_path",
    "upload_folder",
]

UPLOAD_REFUSED = (
    "The image must be uploaded to this app: drop it on the page, or send it with gradio_client's "
    "handle_file(). Server paths, data: URLs and web addresses are not accepted."
)

_SECRET = secrets.token_bytes(32)


def secret_name(data: bytes) -> str:
    """A name for `data` that only this process can compute (HMAC-SHA256 with a random key)."""
    return hmac.new(_SECRET, data, hashlib.sha256).hexdigest()


def as_text(message: str) -> str:
    """`message` for the page, where Gradio renders error text as HTML: shown as typed."""
    return html.escape(message, quote=False)


def upload_folder() -> Path:
    """Gradio's upload folder, which it serves files from (under secret names only, here)."""
    return Path(get_upload_folder())


def uploaded_path(path: Any) -> str:
    """`path` if it names a regular file inside Gradio's upload folder, after resolving symlinks.

    Raises:
        gr.Error: with `UPLOAD_REFUSED`, the same text whatever the reason (never whether a path exists).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise gr.Error(UPLOAD_REFUSED)
    try:
        folder = os.path.realpath(get_upload_folder())
        real = os.path.realpath(path)
        inside = os.path.commonpath([folder, real]) == folder and real != folder
        if inside and Path(real).is_file():
            return real
    except (ValueError, OSError):  # NUL bytes, over-long names, paths on another drive
        pass
    raise gr.Error(UPLOAD_REFUSED)


def _check_image_payload(value: Any) -> None:
    """A raw image payload, before Gradio touches it: None or an uploaded file's record."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise gr.Error(UPLOAD_REFUSED)
    url = value.get("url")
    if isinstance(url, str) and url.strip().lower().startswith("data:"):
        raise gr.Error(UPLOAD_REFUSED)
    uploaded_path(value.get("path"))


class UploadedImage(gr.Image):
    """An image input whose file goes to `vitviz.load_image` untouched, and only if it was uploaded.

    Gradio's own preprocessing opens and converts the upload with Pillow (clipping 16-bit images,
    dropping transparency to black, failing with generic errors); here every check and conversion
    is vitviz's image gate, which answers each refusal with a clear message.
    """

    def get_block_name(self) -> str:
        return "image"  # the frontend is Gradio's own image component

    def preprocess(self, payload):
        if payload is None:
            return None
        if payload.url and payload.url.strip().lower().startswith("data:"):
            raise gr.Error(UPLOAD_REFUSED)
        return uploaded_path(payload.path)


class GuardedBlocks(gr.Blocks):
    """`gr.Blocks` that checks every `UploadedImage` payload before Gradio moves, fetches or decodes it."""

    def validate_inputs(self, block_fn, inputs: list[Any]) -> None:
        super().validate_inputs(block_fn, inputs)
        for block, value in zip(block_fn.inputs, inputs):
            if isinstance(block, UploadedImage):
                _check_image_payload(value)


class UploadLimit:
    """ASGI middleware: an upload request may carry one file of at most `max_bytes`.

    The request must state its length (411 otherwise) and stay within `max_bytes` plus `overhead`
    for the multipart framing (413 otherwise, before a byte is read); a body with more than one part
    is cut off as soon as the second part's boundary arrives, and answered 413.
    """

    def __init__(self, app, *, max_bytes: int, overhead: int = 64 * 1024, path_suffix: str = "/gradio_api/upload") -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.overhead = overhead
        self.path_suffix = path_suffix

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or not scope.get("path", "").endswith(self.path_suffix):
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        length = headers.get(b"content-length")
        if length is None or not length.isdigit():
            await _plain(send, 411, "An upload must state its length (Content-Length).")
            return
        if int(length) > self.max_bytes + self.overhead:
            await _plain(send, 413, f"An upload may carry one image of at most {self.max_bytes // 2**20} MB.")
            return
        boundary = _boundary(headers.get(b"content-type", b""))
        if boundary is None:
            await self.app(scope, receive, send)  # Gradio answers 400 to anything but multipart
            return
        delimiter = b"--" + boundary
        seen = {"count": 0, "tail": b"", "refused": False, "started": False}

        async def counting_receive():
            message = await receive()
            if message["type"] == "http.request" and not seen["refused"]:
                data = seen["tail"] + message.get("body", b"")
                seen["count"] += data.count(delimiter)
                seen["tail"] = data[-(len(delimiter) - 1) :]
                if seen["count"] > 2:  # the opening delimiter of a second part (one part: open + close)
                    seen["refused"] = True
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message):
            if seen["refused"]:
                return  # what the app answers to the cut-off body is replaced below
            seen["started"] = True
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except Exception:
            if not seen["refused"]:
                raise
        if seen["refused"] and not seen["started"]:
            await _plain(send, 413, "An upload may carry one image per request.")


def _boundary(content_type: bytes) -> bytes | None:
    for part in content_type.split(b";")[1:]:
        key, _, value = part.strip().partition(b"=")
        if key.lower() == b"boundary" and value:
            return value.strip(b'"')
    return None


async def _plain(send, status: int, text: str) -> None:
    body = text.encode()
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class PngImage(gr.Image):
    """An output image sent as PNG at zlib level 1, stored under a secret name.

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
        folder = Path(self.GRADIO_CACHE) / secret_name(data)
        folder.mkdir(parents=True, exist_ok=True)
        stem = Path(str(value.info.get("vitviz_name") or "image")).stem  # a view's own download name
        stem = "".join(c if c.isalnum() or c in "-_." else "-" for c in stem)[:120] or "image"
        path = folder / f"{stem}.{'jpg' if self.FORMAT == 'jpeg' else self.FORMAT}"
        path.write_bytes(data)
        return ImageData(path=str(path), orig_name=path.name)


class ViewImage(PngImage):
    """An image that changes with every move (rollout option, layer, head, query patch): JPEG at
    quality 92 with full-resolution colour. For ViT-B/16's 448 px overlay and 12-head mosaic of
    a photo that is 4 ms and 283 kB against 57 ms and 907 kB as PNG at level 1 (the 2-core
    benchmark machine); the exact numbers are in the .npz export."""

    FORMAT = "jpeg"
    SAVE_OPTIONS = {"quality": 92, "subsampling": 0}
