"""The server's ASGI middlewares, in front of Gradio: each refuses what a public server must not take
before Gradio reads it, with a plain answer saying why.

- `UploadLimit`: an upload request carries one image of at most `max_bytes` (Gradio's own limit is
  per file, up to 1,000 files a request), and one address uploads at most `per_minute` bytes a minute.
- `BodyLimit`: any other request's body within `max_bytes`.
- `KnownEvents`: an unknown API name, event or session is a 404 and why, not a 500.
- `SessionHashes`: a session hash that is not 1 to 64 of [A-Za-z0-9_-] is refused on every route
  before Gradio keeps anything for it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from typing import Any
from urllib.parse import parse_qs

import anyio
import gradio as gr
from starlette.requests import HTTPConnection

from vitviz.server.guards.gradio_io import client_address, uploaded_path

__all__ = ["BodyLimit", "KnownEvents", "SESSION_HASH", "SessionHashes", "UploadLimit", "looks_like_upload"]


IMAGE_SIGNATURES = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a", b"BM", b"II*\x00", b"MM\x00*")


def looks_like_upload(head: bytes) -> bool:
    """Whether a file's first bytes are those of a format the image gate accepts (JPEG, PNG, GIF,
    WebP, BMP, TIFF), or the clip gate's MP4 or WebM (`vitviz.clips`; the Video tab's uploads): each
    gate reads the file again and refuses what is not its own."""
    from vitviz.clips import _sniff

    return head.startswith(IMAGE_SIGNATURES) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP") or _sniff(head) in ("MP4", "WebM")


class UploadLimit:
    """ASGI middleware: an upload request carries one image or clip of at most `max_bytes`, and one address
    uploads at most `per_minute` bytes a minute.

    The request must state its length (411 otherwise) and stay within `max_bytes` plus `overhead`
    for the multipart framing (413 otherwise, before a byte is read); an address past its minute's
    volume is answered 429 before a byte is read; a part whose first bytes are not an image's or a clip's is
    cut off there (415), and so is a body with more than one part, as soon as the second part's
    boundary arrives (413). `after()` runs after each upload that went through (a disk sweep);
    `claim(owner, paths)` is told the files it made, as the uploading address's ("address ...") until
    an event uses them (`GuardedBlocks.claim_files`).
    """

    def __init__(self, app, *, max_bytes: int, per_minute: int | None = None, after=None, claim=None, overhead: int = 64 * 1024,
                 path_suffix: str = "/gradio_api/upload") -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.per_minute = per_minute
        self.after = after
        self.claim = claim
        self.overhead = overhead
        self.path_suffix = path_suffix
        self._volume: dict[str, list[tuple[float, int]]] = {}

    def _over_volume(self, address: str, length: int) -> bool:
        if self.per_minute is None:
            return False
        now = time.monotonic()
        if len(self._volume) > 10_000:  # forget addresses idle for a minute
            self._volume = {a: v for a, v in self._volume.items() if v and now - v[-1][0] < 60}
        recent = [(t, n) for t, n in self._volume.get(address, []) if now - t < 60]
        if sum(n for _, n in recent) + length > self.per_minute:
            self._volume[address] = recent
            return True
        self._volume[address] = recent + [(now, length)]
        return False

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
        address = client_address(HTTPConnection(scope))
        if self._over_volume(address, int(length)):
            await _plain(send, 429, f"Uploads from one address are limited to {self.per_minute // 2**20} MB a minute: wait a little.")
            return
        boundary = _boundary(headers.get(b"content-type", b""))
        if boundary is None:
            await self.app(scope, receive, send)  # Gradio answers 400 to anything but multipart
            return
        delimiter = b"--" + boundary
        seen = {"count": 0, "tail": b"", "refused": None, "started": False, "head": b"", "sniffed": False}

        def inspect(data: bytes) -> str | None:
            seen["count"] += (seen["tail"] + data).count(delimiter)
            seen["tail"] = (seen["tail"] + data)[-(len(delimiter) - 1) :]
            if seen["count"] > 2:  # the opening delimiter of a second part (one part: open + close)
                return "parts"
            if not seen["sniffed"]:
                seen["head"] += data
                body = seen["head"]
                at = body.find(b"\r\n\r\n", body.find(delimiter) + len(delimiter)) if delimiter in body else -1
                if at >= 0 and len(body) >= at + 4 + 16:
                    seen["sniffed"] = True
                    if not looks_like_upload(body[at + 4 : at + 4 + 16]):
                        return "kind"
                    seen["head"] = b""
                elif len(body) > 64 * 1024:
                    return "kind"
            return None

        async def checking_receive():
            message = await receive()
            if message["type"] == "http.request" and not seen["refused"]:
                seen["refused"] = inspect(message.get("body", b""))
                if seen["refused"]:
                    return {"type": "http.disconnect"}
            return message

        answer = []

        async def guarded_send(message):
            if seen["refused"]:
                return  # what the app answers to the cut-off body is replaced below
            seen["started"] = True
            if message["type"] == "http.response.body" and sum(map(len, answer)) < 64 * 1024:
                answer.append(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, checking_receive, guarded_send)
        except Exception:
            if not seen["refused"]:
                raise
        if not seen["refused"]:
            uploaded = _touch_uploaded(b"".join(answer))
            if self.claim is not None and uploaded:
                self.claim(f"address {address}", uploaded)
        if seen["refused"] and not seen["started"]:
            if seen["refused"] == "kind":
                await _plain(send, 415, "Only images and clips can be uploaded here (JPEG, PNG, WebP, GIF, BMP or TIFF; MP4 or WebM).")
            else:
                await _plain(send, 413, "An upload may carry one image per request.")
        elif self.after is not None:
            await anyio.to_thread.run_sync(self.after)  # off the event loop


def _touch_uploaded(answer: bytes) -> list[str]:
    """Marks the files an upload answered with as new (Gradio keeps a file it already has, same
    bytes and name, with its old time, which an oldest-first sweep would take for the oldest), and
    returns their paths."""
    try:
        paths = json.loads(answer)
    except ValueError:
        return []
    touched = []
    for path in paths if isinstance(paths, list) else []:
        try:
            real = uploaded_path(path)
            os.utime(real)
            touched.append(real)
        except (gr.Error, OSError):
            pass
    return touched


class BodyLimit:
    """ASGI middleware: a request body other than an upload's is at most `max_bytes` (413 otherwise),
    checked against its stated length before a byte is read, and counted as it arrives when no
    length is stated."""

    def __init__(self, app, *, max_bytes: int, skip_suffix: str = "/gradio_api/upload") -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.skip_suffix = skip_suffix

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS") or scope.get("path", "").endswith(self.skip_suffix):
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        length = headers.get(b"content-length")
        message = f"A request body may be at most {self.max_bytes // 1024} kB here (images go through the upload)."
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await _plain(send, 413, message)
            return
        seen = {"bytes": 0, "refused": False, "started": False}

        async def counting_receive():
            got = await receive()
            if got["type"] == "http.request" and not seen["refused"]:
                seen["bytes"] += len(got.get("body", b""))
                if seen["bytes"] > self.max_bytes:
                    seen["refused"] = True
                    return {"type": "http.disconnect"}
            return got

        async def guarded_send(out):
            if seen["refused"]:
                return
            seen["started"] = True
            await send(out)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except Exception:
            if not seen["refused"]:
                raise
        if seen["refused"] and not seen["started"]:
            await _plain(send, 413, message)


class KnownEvents:
    """ASGI middleware: a call of an API name `blocks` lacks (`POST .../call/<name>`, `.../call/v2/<name>`),
    and the stream of an event or session its queue does not hold (`GET .../call/<name>/<event id>`,
    `GET .../queue/data?session_hash=`), are answered 404 with the reason before Gradio's route runs
    (it answers the first with a bare 500, and the second by dropping the connection mid-stream).
    What is known is looked up as Gradio's routes look it up, so no caller that Gradio would serve is
    refused."""

    _CALL = re.compile(r"/gradio_api/call/(?P<v2>v2/)?(?P<name>[^/]+)/?$")
    _STREAM = re.compile(r"/gradio_api/call/(?:v2/)?[^/]+/(?P<event>[^/]+)$")
    _DATA = re.compile(r"/gradio_api/queue/data/?$")

    def __init__(self, app, *, blocks: gr.Blocks) -> None:
        self.app = app
        self.blocks = blocks

    def _refusal(self, scope) -> str | None:
        method, path = scope.get("method"), scope.get("path", "")
        if "/gradio_api/" not in path:
            return None
        queue = self.blocks._queue
        if method == "POST" and (m := self._CALL.search(path)):
            name = m["name"]
            # (the v2 route knows the public endpoints only, as /gradio_api/info lists them)
            if not any(fn.api_name == name and (not m["v2"] or (fn.fn and fn.api_visibility == "public")) for fn in self.blocks.fns.values()):
                return f"This app has no API endpoint named {name!r}: /gradio_api/info lists them."
        elif method == "GET" and (m := self._STREAM.search(path)):
            event = m["event"]
            if event not in queue.event_ids_to_events and not any(event in ids for ids in list(queue.pending_event_ids_session.values())):
                return f"No event {event!r} is waiting here: its results were read already, or it was never joined."
        elif method == "GET" and self._DATA.search(path):
            session = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("session_hash", [None])[0]
            if session is not None and session not in queue.pending_messages_per_session:
                return "This session has no events waiting here: join one first (POST /gradio_api/queue/join)."
        return None

    async def __call__(self, scope, receive, send):
        why = self._refusal(scope) if scope["type"] == "http" else None
        if why:
            await _plain(send, 404, why)
            return
        await self.app(scope, receive, send)


SESSION_HASH = re.compile(r"[A-Za-z0-9_-]{1,64}")
BAD_SESSION = (
    "A session hash is 1 to 64 letters, digits, '-' or '_' (Gradio's page sends 11 of them, gradio_client "
    "a UUID); this request's is not."
)


class SessionHashes:
    """ASGI middleware: a request that names a session (`session_hash` in its JSON body or its form, in
    its query, in its `session_hash` header, or in the path of Gradio's heartbeat and stream routes)
    names it with 1 to 64 of [A-Za-z0-9_-] (`SESSION_HASH`), or is answered 400 with the reason
    before Gradio keeps anything under it (Gradio took any string, and kept a hash of 900 kB as the
    key of a session's state and of its message queue). A component-server call of a function the
    page lacks is answered 404 before Gradio makes the session it would make for it.

    A body is read whole before the check (`BodyLimit`, outside this one, bounds it) and handed on
    as it came."""

    _PATH = re.compile(r"/gradio_api/(?:heartbeat/(?P<beat>[^/]*)/?|stream/(?P<stream>[^/]*)/[^/]+/[^/]+/[^/]+)$")

    def __init__(self, app, *, blocks: gr.Blocks, skip_suffix: str = "/gradio_api/upload") -> None:
        self.app = app
        self.blocks = blocks
        self.skip_suffix = skip_suffix

    def _before_body(self, scope) -> str | None:
        path = scope.get("path", "")
        named = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True).get("session_hash", [])
        if (m := self._PATH.search(path)) and scope.get("method") == "GET":
            named.append(m["beat"] if m["beat"] is not None else m["stream"])
        header = dict(scope.get("headers", [])).get(b"session_hash")
        if header:
            named.append(header.decode("latin-1"))
        return BAD_SESSION if any(SESSION_HASH.fullmatch(n) is None for n in named) else None

    def _in_body(self, path: str, fields: Any) -> tuple[int, str] | None:
        if not isinstance(fields, dict):
            return None
        session = fields.get("session_hash")
        if session is not None and (not isinstance(session, str) or SESSION_HASH.fullmatch(session) is None):
            return 400, BAD_SESSION
        if path.rstrip("/").endswith("/gradio_api/component_server"):
            return self._unknown_function(fields, session)
        return None

    def _unknown_function(self, fields: dict, session: str | None) -> tuple[int, str] | None:
        """Why Gradio's component server would answer a call with no function of the page (it makes the
        caller's session first), or None; a session that exists is left to Gradio (its components may
        be its own)."""
        holder = getattr(self.blocks, "state_holder", None)
        if session is None or (holder is not None and session in holder):
            return None
        component, name = fields.get("component_id"), fields.get("fn_name")
        try:
            block = self.blocks.blocks.get(int(component))
        except (TypeError, ValueError, OverflowError):
            block = None
        fn = getattr(block, name, None) if block is not None and isinstance(name, str) else None
        if fn is None or not getattr(fn, "_is_server_fn", False):
            return 404, (f"This page has no function {str(name)[:64]!r} on a component {str(component)[:16]!r}: "
                         "/config lists its components.")
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        why = self._before_body(scope)
        if why:
            await _plain(send, 400, why)
            return
        path = scope.get("path", "")
        if scope.get("method") != "POST" or "/gradio_api/" not in path or path.endswith(self.skip_suffix):
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client has gone, or BodyLimit has cut the body off (and answers 413)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        refused = self._in_body(path, await self._fields(scope, body))
        if refused:
            await _plain(send, *refused)
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _fields(scope, body: bytes) -> Any:
        """The request's fields: its JSON object, or its form's fields (files left out), or None."""
        content_type = dict(scope.get("headers", [])).get(b"content-type", b"").decode("latin-1").lower()
        if content_type.startswith("multipart/form-data"):  # read by the parser Gradio's route uses, so that both agree
            from gradio.route_utils import GradioMultiPartParser
            from starlette.datastructures import Headers

            async def stream():
                yield body

            parser = GradioMultiPartParser(Headers(scope=scope), stream(), max_files=1000, max_fields=1000, max_file_size=len(body) + 1)
            try:
                form = await parser.parse()
            except Exception:  # noqa: BLE001 - Gradio answers what it cannot parse itself
                return None
            try:
                return {k: v for k, v in form.multi_items() if isinstance(v, str)}
            finally:
                for _, v in form.multi_items():
                    if not isinstance(v, str):
                        await v.close()
                        with contextlib.suppress(OSError, AttributeError):
                            os.unlink(v.file.name)
        if not body.lstrip()[:1] == b"{":
            return None
        try:
            return json.loads(body)
        except ValueError:
            return None


def _boundary(content_type: bytes) -> bytes | None:
    """The multipart boundary, read by the parser Gradio's own upload route uses (so that both agree
    on it, also when a header names several)."""
    from python_multipart.multipart import parse_options_header

    kind, options = parse_options_header(content_type)
    return options.get(b"boundary") or None if kind.startswith(b"multipart/") else None


async def _plain(send, status: int, text: str) -> None:
    body = text.encode()
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
