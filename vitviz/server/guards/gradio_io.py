"""Gradio's edges made safe for a public server: what comes in as an image, what goes out as a file.

- `UploadedImage`: an image input that accepts only files that came in through Gradio's upload
  door (a regular file inside the upload folder, symlinks resolved). Gradio itself checks upload
  membership only for file payloads that carry `meta`, and decodes `data:` URLs and fetches web
  addresses before a component sees them; `GuardedBlocks` checks every image payload first, so
  that nothing else is opened, decoded or fetched, and every refusal reads the same whether or not
  the path exists on the server.
- The ASGI middlewares in front of Gradio (upload and body limits, known events, session hashes):
  `vitviz.server.guards.asgi`.
- `PngImage` / `ViewImage`: output images written under a keyed hash of their bytes (a per-process
  secret), so that nobody can test whether a given picture was recently analysed.
- Sessions: a join refused at the door, or the failed first event of a session, leaves no session state;
  `launch(state_session_capacity=...)` bounds the sessions kept and, as many, their message queues.
- Error text: plain for API callers (gradio_client, raw HTTP, MCP); escaped on its way out to the
  page (whose requests carry Gradio's `x-gradio-user: app`), which reads error and warning text as
  HTML (`as_text`).
- Callers: whose request an event is (`caller_of`): its Gradio session, or for a call that Gradio's
  MCP server relays (through one gradio_client of its own: one session, from this machine), the MCP
  caller (`mcp_caller`), named in a header only this process can sign; the queue's shares and the
  disk's count each caller apart (`current_caller` while its event runs).
"""

from __future__ import annotations

import contextvars
import copy
import hashlib
import hmac
import html
import io
import os
import secrets
import threading
import time
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any, NamedTuple

import gradio as gr
from gradio.data_classes import ImageData
from gradio_client.utils import QueueError
from gradio.server_messages import LogMessage, ProcessCompletedMessage
from gradio.utils import LRUCache, get_upload_folder
from PIL import Image

__all__ = [
    "UPLOAD_REFUSED",
    "GuardedBlocks",
    "UploadedImage",
    "client_address",
    "caller_of",
    "current_caller",
    "whose",
    "Whose",
    "mcp_caller",
    "PngImage",
    "ViewImage",
    "as_text",
    "from_page",
    "secret_name",
    "file_stem",
    "uploaded_path",
    "upload_folder",
]

UPLOAD_REFUSED = (
    "The image must be uploaded to this app: drop it on the page, or send it with gradio_client's "
    "handle_file(). Server paths, data: URLs and web addresses are not accepted."
)

_SECRET = secrets.token_bytes(32)


def file_stem(text: str, *, max_bytes: int = 200) -> str:
    """`text` as the stem of a file name: letters, digits, "-", "_" and "." kept (any script), the
    rest "-", cut to at most `max_bytes` bytes of UTF-8 without splitting a character (file systems
    allow 255 bytes a name, which 86 CJK characters fill); "image" when nothing is left."""
    stem = "".join(c if c.isalnum() or c in "-_." else "-" for c in text)
    return stem.encode()[:max_bytes].decode("utf-8", "ignore") or "image"


def secret_name(data: bytes) -> str:
    """A name for `data` that only this process can compute (HMAC-SHA256 with a random key)."""
    return hmac.new(_SECRET, data, hashlib.sha256).hexdigest()


def as_text(message: str) -> str:
    """`message` for the page, where Gradio renders error text as HTML: shown as typed."""
    return html.escape(message, quote=False)


def from_page(request: Any) -> bool:
    """Whether a request came from the app's own page: Gradio's page sends `x-gradio-user: app`
    (its JavaScript client sends "api" for other callers, gradio_client "api", MCP "mcp"). Only the
    page reads error text as HTML; a client that claims to be the page gets its text escaped."""
    headers = getattr(request, "headers", None) or {}
    return headers.get("x-gradio-user") == "app"


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


def _uploads_in(block_fn, inputs) -> list[str]:
    """The paths of the uploaded images an event's raw inputs name."""
    if not isinstance(inputs, list):
        return []
    return [v["path"] for b, v in zip(block_fn.inputs, inputs) if isinstance(b, UploadedImage) and isinstance(v, dict)
            and isinstance(v.get("path"), str)]


def _files_in(data, *, depth: int = 6) -> list[str]:
    """The paths of the files in an event's outputs (file records, also inside updates, lists and dicts)."""
    if depth < 0:
        return []
    if isinstance(data, dict):
        found = [data["path"]] if isinstance(data.get("path"), str) else []
        return found + [p for v in data.values() if isinstance(v, (dict, list)) for p in _files_in(v, depth=depth - 1)]
    if isinstance(data, list):
        return [p for v in data for p in _files_in(v, depth=depth - 1)]
    return []


_SKIP = {"__type__": "update"}  # gr.skip(): an output left as it is


def _is_skip(value) -> bool:
    return isinstance(value, dict) and value == _SKIP


FAILED = "{what} could not be done: {why}. The page's own controls send valid values; analyse the image again if this persists."


class GuardedBlocks(gr.Blocks):
    """`gr.Blocks` for a public server.

    - Every `UploadedImage` payload is checked before Gradio moves, fetches or decodes it.
    - A failure that is not a `gr.Error` (a value Gradio's own preprocessing cannot read, a bug)
      reaches the client as a message that says what failed, never a bare "Error" and never a
      server path.
    - Error and warning text is written plain; the page's own requests get it escaped on its way
      out of the queue (`from_page`), since the page reads it as HTML.
    - `queue(client_jobs=..., address_jobs=...)`: one session may have at most `client_jobs` jobs
      waiting in the queue (besides those running), one network address `address_jobs` waiting or
      running; more are answered "one at a time, please" while the queue keeps serving everyone
      else, and sessions take turns in each waiting line. A session is a caller (`caller_of`): each
      MCP caller one of its own, at its own address, also though Gradio relays every MCP call
      through one client of its own (`_per_caller`).
    - An output a handler leaves as it is (`gr.skip()`, or left out of its dict) costs nothing:
      Gradio would build its component again and regenerate its config (about 2 ms each).
    - Sessions: a join with fewer inputs than its event takes is refused before Gradio makes the
      session's state; a session whose first event fails keeps none (Gradio made it before running the event);
      `launch(state_session_capacity=n)` keeps at most n sessions, and n sessions' message queues.
    """

    client_jobs: int | None = None
    address_jobs: int | None = None
    after_event = None  # called (off the event loop, at most every `after_every` s) when an event has run
    claim_files = None  # called with (caller, paths, used=...) for the uploads an event reads and the files it sends (`export.FileOwners.claim`)
    after_every: float = 5.0
    _after_last = 0.0
    _after_lock = threading.Lock()

    def after_any(self) -> None:
        """Runs `after_event` in a thread of its own, unless it ran less than `after_every` s ago."""
        with self._after_lock:
            if self.after_event is None or time.monotonic() - self._after_last < self.after_every:
                return
            self._after_last = time.monotonic()
        threading.Thread(target=self.after_event, daemon=True).start()

    def _claim(self, caller: str | None, paths: list[str], *, used: bool = False) -> None:
        if self.claim_files is not None and caller is not None and paths:
            self.claim_files(caller, paths, used=used)

    @property
    def mcp_server_obj(self):
        return self.__dict__.get("_mcp_server_obj")

    @mcp_server_obj.setter
    def mcp_server_obj(self, server) -> None:  # (set by Gradio when it makes the app of a launch with mcp_server=True)
        self.__dict__["_mcp_server_obj"] = server
        if server is not None:
            _per_caller(self, server)

    def validate_inputs(self, block_fn, inputs: list[Any]) -> None:
        super().validate_inputs(block_fn, inputs)
        for block, value in zip(block_fn.inputs, inputs):
            if isinstance(block, UploadedImage):
                _check_image_payload(value)

    async def process_api(self, block_fn, inputs, *args, **kwargs):
        request = kwargs.get("request", args[1] if len(args) > 1 else None)
        request = request[0] if isinstance(request, list) and request else request
        whom = _whose(request, kwargs.get("session_hash"))
        _EVENT.set(whom)  # (this task's context, copied into the handler's thread)
        caller = whom.caller
        self._claim(caller, _uploads_in(block_fn, inputs), used=True)
        try:
            output = await super().process_api(block_fn, inputs, *args, **kwargs)
            self._claim(caller, _files_in(output.get("data") if isinstance(output, dict) else None))
            _served(kwargs.get("state"))
            return output
        except gr.Error:
            _forget_unserved(self, kwargs.get("state"), kwargs.get("session_hash"))
            raise
        except Exception as exc:  # noqa: BLE001 - every other failure becomes one readable message
            _forget_unserved(self, kwargs.get("state"), kwargs.get("session_hash"))
            from vitviz.server.guards.inputs import public_text

            name = str(getattr(block_fn, "name", None) or "this request")
            for prefix in ("on_", "api_", "session_"):
                name = name.removeprefix(prefix)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            why = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
            what = name.rstrip("_0123456789").replace("_", " ").strip().capitalize()
            raise gr.Error(FAILED.format(what=what, why=public_text(why)[:300].rstrip("."))) from exc
        finally:
            self.after_any()

    async def postprocess_data(self, block_fn, predictions, state):
        outputs = list(block_fn.outputs)
        if not isinstance(predictions, dict) or len(outputs) < 3 or not all(isinstance(k, gr.blocks.Block) for k in predictions):
            return await super().postprocess_data(block_fn, predictions, state)
        kept = [b for b in outputs if b.stateful or not _is_skip(predictions.get(b, _SKIP))]
        if len(kept) < 2 or len(kept) == len(outputs):  # nothing skipped, or one output left (Gradio reads a single value then)
            return await super().postprocess_data(block_fn, predictions, state)
        alone = copy.copy(block_fn)  # the same event with only the outputs that change
        alone.outputs = kept
        done = iter(await super().postprocess_data(alone, {b: predictions.get(b, _SKIP) for b in kept}, state))
        mine = set(map(id, kept))
        return [next(done) if id(b) in mine else dict(_SKIP) for b in outputs]

    def queue(self, *args, client_jobs: int | None = None, address_jobs: int | None = None, **kwargs):
        out = super().queue(*args, **kwargs)
        self.client_jobs, self.address_jobs = client_jobs, address_jobs
        _fair(self)
        _escaped_for_the_page(self)
        return out

    def launch(self, *args, state_session_capacity: int = 10_000, **kwargs):
        if self._queue is not None:
            _bounded_messages(self._queue, state_session_capacity)
        return super().launch(*args, state_session_capacity=state_session_capacity, **kwargs)


_SERVED: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()  # session states an event has completed in


def _served(state) -> None:
    if state is not None:
        _SERVED[state] = True


def _forget_unserved(blocks: gr.Blocks, state, session: str | None) -> None:
    """Gradio makes a session's state before it runs the session's event: when the first event of a
    session fails (its inputs refused, the handler refused it) and no other event of it waits or runs,
    the state goes, as if the request had been refused at the door."""
    holder = getattr(blocks, "state_holder", None)
    if not session or state is None or holder is None or state in _SERVED or holder.session_data.get(session) is not state:
        return
    waiting, running = _queued(blocks._queue)
    if sum(e.session_hash == session for e in waiting + running) > 1:  # (this event runs: one of them)
        return
    with holder.lock:
        if holder.session_data.get(session) is state:
            del holder.session_data[session]
            holder.time_last_used.pop(session, None)


class _MessageQueues(LRUCache):
    """Gradio's message queues of sessions (`Queue.pending_messages_per_session`), at most `max_size`:
    over it, the least recently joined session with no event waiting or running goes (Gradio's
    LRUCache drops the oldest, whose results may still be on their way)."""

    def __init__(self, queue, max_size: int) -> None:
        super().__init__(max_size)
        self._queue = queue

    def __setitem__(self, key, value) -> None:
        if key not in self:
            self.make_room(1)
        OrderedDict.__setitem__(self, key, value)
        self.move_to_end(key)

    def make_room(self, new: int = 0) -> None:
        """Drops sessions until `new` more fit within `max_size` (also after `max_size` was lowered)."""
        live = {e.session_hash for e in list(self._queue.event_ids_to_events.values())}
        while self and len(self) + new > self.max_size:
            idle = next((k for k in self if k not in live), None)
            self.pop(idle if idle is not None else next(iter(self)))


def _bounded_messages(queue, sessions: int) -> None:
    """The queue keeps the messages of at most `sessions` sessions (Gradio: 2,000, whatever the
    sessions kept), those with nothing waiting or running and least recently joined dropped first; a
    message for a session dropped so is dropped too (nobody can read it: Gradio answers its stream
    404) instead of failing the job."""
    if not isinstance(queue.pending_messages_per_session, _MessageQueues):
        kept = _MessageQueues(queue, sessions)
        OrderedDict.update(kept, queue.pending_messages_per_session)
        queue.pending_messages_per_session = kept
    queue.pending_messages_per_session.max_size = sessions
    queue.pending_messages_per_session.make_room()
    if getattr(queue, "_vitviz_bounded", False):
        return
    send = queue.send_message

    def send_message(event, message) -> None:
        if event.session_hash in queue.pending_messages_per_session:
            send(event, message)

    queue.send_message = send_message
    queue._vitviz_bounded = True


def _escaped_for_the_page(blocks: GuardedBlocks) -> None:
    """Wraps the queue's `send_message`: the text of an error (`process_completed` that failed) and of
    a warning or info (`log`) goes escaped to the page (`from_page`), as written to everyone else."""
    queue = blocks._queue
    if getattr(queue, "_vitviz_escaped", False):
        return
    send = queue.send_message

    def send_message(event, message) -> None:
        if from_page(getattr(event, "request", None)):
            if isinstance(message, ProcessCompletedMessage) and isinstance(message.output.get("error"), str):
                message = message.model_copy(update={"output": {**message.output, "error": as_text(message.output["error"])}})
            elif isinstance(message, LogMessage):
                message = message.model_copy(update={"log": as_text(message.log)})
        send(event, message)

    queue.send_message = send_message
    queue._vitviz_escaped = True


ONE_AT_A_TIME = (
    "One at a time, please: {count} of your requests are already waiting on this server; "
    "send the next when one has finished."
)


def client_address(request: Any) -> str:
    """The address a request came from: the MCP caller's, for a call Gradio's MCP server relays
    (`mcp_caller`); behind Hugging Face's proxy (SPACE_ID is set) the address it appended last to
    X-Forwarded-For; otherwise the peer's."""
    caller = mcp_caller(request)
    if caller is not None:
        return caller[1]
    headers = getattr(request, "headers", None) or {}
    forwarded = headers.get("x-forwarded-for") if os.environ.get("SPACE_ID") else None
    if forwarded:
        return forwarded.split(",")[-1].strip()
    client = getattr(request, "client", None)
    return getattr(client, "host", None) or "?"


CALLER = "x-vitviz-caller"  # on a call Gradio's MCP server relays: whose it is ("<session>/<address>/<signature>")


class Whose(NamedTuple):
    """Whose a request is: its caller (`caller_of`), network address (`client_address`) and Gradio session hash."""

    caller: str | None
    address: str | None
    session: str | None


_EVENT: contextvars.ContextVar[Whose] = contextvars.ContextVar("vitviz_event", default=Whose(None, None, None))


def _signature(text: str) -> str:
    return hmac.new(_SECRET, b"mcp caller\0" + text.encode(), hashlib.sha256).hexdigest()


def mcp_caller(request: Any) -> tuple[str, str] | None:
    """(session, address) of the MCP caller whose call `request` relays, when this process's own MCP
    bridge sent it (`_per_caller`: signed with this process's secret); None for any other request,
    also one that names a caller it cannot sign."""
    headers = getattr(request, "headers", None) or {}
    token = headers.get(CALLER)
    if not isinstance(token, str):
        return None
    named, _, signature = token.rpartition("/")
    session, _, address = named.partition("/")
    if not session or not address or not hmac.compare_digest(signature.encode(), _signature(named).encode()):
        return None
    return session, address


def caller_of(request: Any, session_hash: str | None = None) -> str | None:
    """Whose request this is, for the shares of the queue and the disk: the MCP caller a relayed call
    names ("mcp ..."), otherwise its Gradio session ("session ..."); None without either."""
    caller = mcp_caller(request)
    if caller is not None:
        return f"mcp {caller[0]}"
    session = session_hash or getattr(request, "session_hash", None)
    return f"session {session}" if isinstance(session, str) and session else None


def _whose(request: Any, session_hash: str | None = None) -> Whose:
    session = session_hash or getattr(request, "session_hash", None)
    return Whose(caller_of(request, session), client_address(request), session if isinstance(session, str) else None)


def whose(request: Any = None) -> Whose:
    """Whose `request` is; without one, whose the event running in this context is
    (`GuardedBlocks.process_api` sets it; Gradio's handler threads run in a copy of its context)."""
    return _whose(request) if request is not None else _EVENT.get()


def current_caller() -> str | None:
    """The caller (`caller_of`) of the event running in this context."""
    return _EVENT.get().caller


def _mcp_identity(request: Any) -> tuple[str, str]:
    """(session, address) of the MCP caller that sent `request` (the HTTP request of its call): the
    session is the one it names (an `mcp-session-id` header, the SSE transport's `session_id`;
    Gradio's MCP server is stateless and issues none) or else its address: one agent per address
    unless it names its sessions. Keyed with the address, so that no caller can take another's."""
    address = client_address(request)
    headers = getattr(request, "headers", None) or {}
    params = getattr(request, "query_params", None) or {}
    named = headers.get("mcp-session-id") or params.get("session_id") or ""
    return secret_name(f"{address}\0{named}".encode())[:32], address


def _per_caller(blocks: GuardedBlocks, server) -> None:
    """Gradio's MCP server (`gradio.mcp.GradioMCPServer`) calls a queued event through one
    gradio_client of its own (one session hash, from this machine's address) whatever the caller,
    with the caller's headers: each call now also names its caller (`CALLER`, signed), so that the
    queue counts it as that caller's session and address; a refusal of the queue reaches the caller as
    its text (gradio_client reads every refusal as "Queue is full")."""
    prepare = server._prepare_tool_call_args

    def prepare_for_caller(name, arguments):
        endpoint, args, headers, block_fn = prepare(name, arguments)
        session, address = _mcp_identity(server.mcp_server.request_context.request)
        named = f"{session}/{address}"
        headers[CALLER] = f"{named}/{_signature(named)}"  # (replaces whatever the caller sent under that name)
        return endpoint, args, headers, block_fn

    def told(execute):
        async def execute_telling(job, *args):
            try:
                return await execute(job, *args)
            except QueueError:
                session, _ = _mcp_identity(server.mcp_server.request_context.request)
                why = blocks.__dict__.get("_refusals", {}).pop(f"mcp {session}", None)
                if why is None:
                    raise
                raise QueueError(why) from None

        return execute_telling

    server._prepare_tool_call_args = prepare_for_caller
    server._execute_tool_without_progress = told(server._execute_tool_without_progress)
    server._execute_tool_with_progress = told(server._execute_tool_with_progress)


def _queued(queue) -> tuple[list, list]:
    """The queue's events: (waiting in its lines, handed to threads)."""
    waiting = [e for line in queue.event_queue_per_concurrency_id.values() for e in line.queue]
    return waiting, [e for job in queue.active_jobs if job for e in job]


def _take_turns(queue) -> None:
    """Orders each waiting line so that clients take turns: an address's k-th job (counting its jobs
    already running) waits behind every other address's earlier ones, and within an address a
    session's k-th behind its other sessions' earlier ones; within a session, in order. A session is
    a caller (`caller_of`)."""
    def keys(e):
        return ("address", client_address(e.request)), caller_of(e.request, e.session_hash)

    running: dict[object, int] = {}
    for e in _queued(queue)[1]:
        for key in keys(e):
            running[key] = running.get(key, 0) + 1
    for line in queue.event_queue_per_concurrency_id.values():
        seen = dict(running)
        turns = []
        for e in line.queue:
            turns.append(tuple(seen.get(k, 0) for k in keys(e)))
            for k in keys(e):
                seen[k] = seen.get(k, 0) + 1
        order = sorted(range(len(line.queue)), key=lambda i: turns[i])  # stable: arrival order within a turn
        line.queue[:] = [line.queue[i] for i in order]


UNKNOWN_EVENT = "This app has no event {index!r}: the page's configuration (/config) lists its events and their ids."


def _unknown_event(blocks: gr.Blocks, body) -> str | None:
    """Why a join names no event of this app (Gradio would answer 500), or None. No session's state
    is made for the check (Gradio's own lookup makes one)."""
    if body.fn_index is None:
        return None  # Gradio answers that itself (400)
    return UNKNOWN_EVENT.format(index=body.fn_index) if body.fn_index not in _fns(blocks, body.session_hash) else None


def _fns(blocks: gr.Blocks, session: str | None) -> dict:
    """The events a join of `session` may name: its session's own, or the app's (no state is made)."""
    return blocks.state_holder[session].blocks_config.fns if session and session in blocks.state_holder else blocks.fns


def _unfit_inputs(blocks: GuardedBlocks, body) -> str | None:
    """Why a join's inputs fail Gradio's own check (fewer values than the event's inputs), or None;
    checked at the door, where no session's state is made for it (Gradio makes one before it checks).
    A value refused later (an image not uploaded, junk in a field) is the event's error, as before, and
    `_forget_unserved` takes back the state Gradio made for it."""
    fn = _fns(blocks, body.session_hash)[body.fn_index]
    if fn.batch or fn.cancels or not isinstance(body.data, list):
        return None  # (Gradio rewrites or rejects these itself)
    if len(body.data) < len(fn.inputs):
        return f"This event takes {len(fn.inputs)} input values; the request sent {len(body.data)}."
    return None


READ_FIRST = (
    "Read your results first: {count} of your requests have finished and nobody has read what they "
    "returned (GET /gradio_api/queue/data?session_hash=...)."
)


def _fair(blocks: GuardedBlocks) -> None:
    """Wraps the queue's `push`: a join that names no event of this app, or whose inputs do not fit
    its event, is refused (400, with the reason) before Gradio makes a session for it, and no client
    holds more than its share of jobs (nor of finished results it has not read)."""
    queue = blocks._queue
    if getattr(queue, "_vitviz_fair", False):
        return
    push = queue.push

    async def fair_push(body, request, username):
        unknown = _unknown_event(blocks, body) or (body.fn_index is not None and _unfit_inputs(blocks, body))
        if unknown:
            return False, unknown, "error"
        per_session, per_address = blocks.client_jobs, blocks.address_jobs
        if per_session or per_address:
            waiting, running = _queued(queue)
            address = client_address(request)
            me = caller_of(request, body.session_hash)  # (an MCP caller's relayed call: the caller's, not the relay's)
            # a session's jobs beside its first: those in the line and those handed to a thread (the model
            # group hands events on before their turn for the model comes: `Settings.dispatched`)
            mine = sum(1 for e in waiting + running if me and caller_of(e.request, e.session_hash) == me) - 1
            here = sum(1 for e in waiting + running if client_address(e.request) == address)
            unread = _unread(queue, body.session_hash)
            if per_session and mine >= per_session:
                return _refused(blocks, me, ONE_AT_A_TIME.format(count=mine))
            if per_session and unread >= per_session:
                return _refused(blocks, me, READ_FIRST.format(count=unread))
            if per_address and here >= per_address:
                return _refused(blocks, me, ONE_AT_A_TIME.format(count=here))
        result = await push(body, request, username)
        if result[0]:
            _take_turns(queue)
            _forget_read_sessions(queue)
        return result

    queue.push = fair_push
    queue._vitviz_fair = True


def _unread(queue, session: str | None) -> int:
    """The events of `session` that have finished and whose results nobody has read yet (they wait in
    its message queue); none once the queue has dropped that (and then their ids go too)."""
    ids = queue.pending_event_ids_session.get(session) if session else None
    if not ids:
        return 0
    if session not in queue.pending_messages_per_session:
        ids.intersection_update(queue.event_ids_to_events)  # (those waiting or running)
        return 0
    return sum(1 for i in ids if i not in queue.event_ids_to_events)


def _refused(blocks: GuardedBlocks, caller: str | None, why: str):
    """A refusal of `fair_push`; an MCP caller's is kept for the MCP bridge to tell it (`_per_caller`):
    the newest 1,024 callers' last."""
    if caller is not None and caller.startswith("mcp "):
        refusals = blocks.__dict__.setdefault("_refusals", OrderedDict())
        refusals[caller] = why
        refusals.move_to_end(caller)
        while len(refusals) > 1024:
            refusals.popitem(last=False)
    return False, why, "queue_full"


def _forget_read_sessions(queue) -> None:
    """Gradio keeps the ids of each session's events until they are read, and the session's entry
    for good: entries with nothing left to read, or whose messages the queue has dropped (and no
    event waits or runs), go once there are more than its message queues."""
    ids = queue.pending_event_ids_session
    if len(ids) <= 2 * queue.pending_messages_per_session.max_size:
        return
    waiting, running = _queued(queue)
    live = {e.session_hash for e in waiting + running}
    for session in [s for s, pending in ids.items() if s not in live and (not pending or s not in queue.pending_messages_per_session)]:
        del ids[session]


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
        stem = file_stem(Path(str(value.info.get("vitviz_name") or "image")).stem)  # a view's own download name
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
