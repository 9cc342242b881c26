"""What every part of the page shares: the `Server` (the app's state, one object built in
`vitviz.server.app` from the settings and handed to the page and its tabs: models, the work budget,
the analyses kept for sessions, downloads, the explorer's files, the early explorer's tickets; and
what runs through it: priced model work, running and recalling an analysis), and the helpers
handlers use beside it (a client's fields checked, errors, Markdown and HTML as typed).

Nothing here builds a component; `page` and the tabs (`vitviz.server.tabs`) do.
"""

from __future__ import annotations

import hashlib
import os
import math
import secrets
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402
import torch  # noqa: E402
from gradio.components import Component  # noqa: E402

from vitviz.cost import BASE_BYTES, Cost, explorer_layout_of, price  # noqa: E402
from vitviz.explainers import method as registered_method, methods as registered_methods  # noqa: E402
from vitviz.images import ImageError  # noqa: E402
from vitviz.pipeline import layout_of  # noqa: E402
from vitviz.server import explaining  # noqa: E402
from vitviz.server.early import TICKET, Tickets  # noqa: E402
from vitviz.server.guards import inputs  # noqa: E402
from vitviz.server.guards.export import Downloads, FileOwners, sweep  # noqa: E402
from vitviz.server.guards.gradio_io import as_text, upload_folder, uploaded_path, whose  # noqa: E402
from vitviz.server.guards.memory import release_memory  # noqa: E402
from vitviz.server.guards.sessions import SessionRef, SessionStore, crop_to_keep  # noqa: E402
from vitviz.server.guards.settings import Settings  # noqa: E402
from vitviz.server.guards.work import Busy, Cancelled, KeyedLocks, ModelWork, RequestRefused  # noqa: E402
from vitviz.server.models import ModelCache, TooLarge  # noqa: E402
from vitviz.server.pictures import explorer_data, views  # noqa: E402
from vitviz.server.pictures.drawers import drawer  # noqa: E402
from vitviz.sources import WeightsUnavailableError, assets_dir, default_device, default_variant, get_spec, list_variants  # noqa: E402

try:  # ZeroGPU on Hugging Face Spaces; a no-op elsewhere
    import spaces

    gpu = spaces.GPU
except ImportError:  # pragma: no cover - depends on the host

    def gpu(fn):
        return fn


Outputs = dict[Component, Any]

MENU = list_variants()
DEFAULT_VARIANT, DEFAULT_REASON = default_variant()
EXAMPLES = sorted(str(p) for p in (assets_dir() / "examples").glob("*.png"))
# the colour scales' names on the page, and what `views` calls them
_SCALE_NAMES = {"one per layer": "layer", "each map its own": "map", "each map": "map"}


def settings_from_env() -> Settings:
    """Every bound the server keeps, from the environment (the table in vitviz/server/guards/settings.py)."""
    return Settings.from_env(gpu=torch.cuda.is_available(), menu_tokens=max(s.num_tokens for s in MENU))


# Servers by name: a function run on the device (in ZeroGPU's worker its arguments are pickled and
# sent to another process, forked from this one) is given its server's name, not the server
_SERVERS: dict[str, "Server"] = {}


def server_named(name: str) -> "Server":
    return _SERVERS[name]


class Server:
    """The app's state, built from `settings` (`settings_from_env`, or smaller ones in tests), and what
    runs through it. Its parts are plain objects: a test or a bench may hand it others (a store with a
    small budget, downloads in their own folder) with `monkeypatch.setattr(server, "store", ...)`.

    - `cache`: the models kept loaded; `work`: one budget of model work for every event and the
      explorer's calls (priced before, bounded while running);
    - `store`: the analyses kept for sessions, all of them within what VITVIZ_STATE_MB leaves beside
      Gradio's sessions (`Settings.sessions`, a quarter by default); an analysis unused for
      VITVIZ_STATE_IDLE seconds is dropped, and its explorer's files with it;
    - `downloads`: the .npz exports; `files`: who each file in the upload folder belongs to (uploads,
      and Gradio's copies of what events sent: each caller makes room only among its own files or
      those of callers over their share, `files_sweep`);
    - `explorer_dir`: the explorer's data for the browser, files in Gradio's upload folder (which it
      serves) with secret names; `explorer_locks` (each file written once, by one thread) and
      `explorer_calls` (the widget's calls at once: they run on Gradio's thread pool);
    - `early`: the explorer of an analysis on its way, for the page that named it
      (`vitviz.server.early`): two waits per analysis, as many analyses per address as the queue lets
      it have; `method_guard`: a plugin method's failure or slowness kept to its own map.
    """

    def __init__(self, settings: Settings, *, name: str = "app") -> None:
        self.name, self.settings = name, settings
        self.cache = ModelCache(max_models=settings.max_models, hub_bytes=settings.hub_bytes, max_params=settings.max_params)
        self.work = ModelWork(budget_bytes=settings.work_bytes, lanes=settings.concurrency, seconds=settings.request_seconds)
        self.downloads = Downloads(max_bytes=settings.downloads_bytes)
        self.explorer_dir = upload_folder() / "vitviz-explorer"
        self.files = FileOwners(upload_folder(), skip=(self.explorer_dir,))
        self.explorer_locks = KeyedLocks()
        self.explorer_calls = threading.BoundedSemaphore(4)
        self.early = Tickets(waiters_per_owner=2 * settings.address_jobs)
        self.store: SessionStore[views.Exploration] = SessionStore(budget_bytes=settings.state_bytes, idle_seconds=settings.state_idle,
                                                                   on_drop=self.explorer_files_gone)
        self.method_guard = explaining.MethodGuard(clock=self.work.job_clock)
        _SERVERS[name] = self

    def __deepcopy__(self, memo) -> "Server":
        """Itself: a copy would be a second budget and store. (Gradio deep-copies a session's stateful
        components, and with them what they hold, such as a `gr.State`'s `delete_callback`, `forget`.)"""
        return self

    def __copy__(self) -> "Server":
        return self

    # -- the files it keeps --------------------------------------------------------------------

    def explorer_files_gone(self, key: str) -> None:
        """An analysis dropped (replaced on its page, its session gone, idle, or over the store's budget),
        or never kept (its pictures failed): its explorer's files go with it (a file being written is left
        to the sweep)."""
        if TICKET.fullmatch(key) is None:  # (a key, `new_key`'s, has a ticket's form: 22 URL-safe characters, never a pattern)
            return
        try:
            for path in self.explorer_dir.glob(f"{key}-*"):
                if not path.name.endswith(".part"):
                    path.unlink(missing_ok=True)
        except OSError:  # (what could not be removed goes with the sweep; the store's caller is not failed for it)
            pass

    def files_sweep(self) -> None:
        """Uploads and Gradio's copies of pictures and downloads within VITVIZ_FILES_MB (examples stay):
        files 30 minutes unused go, then, oldest first, files nobody uses and those of callers holding
        more than their share (`files`; VITVIZ_FILES_MB divided among the callers holding files); a
        session's files within its share stay. The explorer's files within their own bounds. Run after
        events (`GuardedBlocks.after_event`), so that files of a process before this one, or of analyses
        no longer written to, go by age too."""
        sweep(upload_folder(), max_age=1800, max_bytes=self.settings.files_bytes, recursive=True, skip=(self.explorer_dir,),
              keep=is_example, owners=self.files.owners)
        self.files.forget_gone()
        self.explorer_sweep(room=0)

    def explorer_sweep(self, *, room: int) -> None:
        """The explorer's files within VITVIZ_EXPLORER_MB, with `room` for one about to be written; a file
        an analysis is writing now (`explorer_data.StackStream`'s temporary one) stays."""
        sweep(self.explorer_dir, max_age=1800, max_bytes=self.settings.explorer_bytes, room=room, keep=self._being_written)

    def _being_written(self, path: Path) -> bool:
        """A temporary explorer file of a forward running now (one older than the longest request is left over)."""
        try:
            return path.name.endswith(".part") and time.time() - path.stat().st_mtime < max(60.0, 2 * self.settings.request_seconds)
        except OSError:
            return False

    # -- priced model work ---------------------------------------------------------------------

    def variant_name(self, name: object) -> str:
        """A variant a client named, within this server's bounds (menu, parameters, tokens)."""
        s = self.settings
        return checked(inputs.variant, name, max_params=s.max_params, max_tokens=s.max_tokens, open_models=s.open_models)

    def job(self, kind: str, variant: str, request: gr.Request | None = None, *, wait: float | None = None, lane: bool = True,
            **options):
        """Model work of `kind` on `variant`, priced before it starts and run within the server's budget
        (`lane` False: its memory only, for small work that runs no model; see `ModelWork.job`).
        An explanation computes every registered method at once: priced with each layer's own gradients
        when one of them needs those (LeGrad); faithfulness measures each method's order and a random one."""
        if kind in ("explain", "faithfulness") and "layer_gradients" not in options:
            options["layer_gradients"] = any(registered_method(m).needs_layer_gradients for m in registered_methods())
        if kind == "faithfulness" and "orders" not in options:
            options["orders"] = len(registered_methods()) + 1  # every method's map and a random order
        return self.priced(price(get_spec(variant), kind, budget=self.work.budget_bytes, **options), request, wait=wait, lane=lane)

    @contextmanager
    def priced(self, cost, request: gr.Request | None = None, *, wait: float | None = None, lane: bool = True):
        try:
            who = whose(request)  # (turns are taken by address, then by caller; Stop cancels by session)
            with self.work.job(cost, session=who.session, owner=who.address, caller=who.caller, wait=wait, lane=lane) as work:
                yield work
        except (RequestRefused, Cancelled) as exc:
            refused = error(str(exc))
            refused.busy = isinstance(exc, Busy)  # (asking again later may work)
            raise refused from None

    # -- running the model, and the analyses kept for sessions ---------------------------------

    def _requested(self, image: str | None, variant: object) -> str:
        """The variant's checked name, once there is an image; a refusal's `cause` is "variant"."""
        if image is None:
            raise error("Upload an image first (or pick an example).")
        try:
            return self.variant_name(variant)
        except gr.Error as exc:
            exc.cause = "variant"
            raise

    @contextmanager
    def analysing(self, image: str | None, variant: object, *, explorer_key: str | None = None, ticket: str | None = None):
        """The analysis of `image` by `variant`, the one place a request for one is checked, priced and
        run: yields the `views.Exploration`, its job held while the block draws its pictures (their memory
        is in the price). A refusal is a `gr.Error` whose `cause` says which of the two was the problem
        ("image" or "variant"; an error of the block's own keeps its cause, else "variant").

        With `explorer_key` (a new session key: see `new_key`), the explorer's files for the browser are
        named by it, within the analysis' own job and price (`analysis_price`): a file of the whole stack
        is written while the forward runs (`views.explore`); another layout's file (a windowed model's)
        when the block draws the analysis (the Explorer tab, through the drawer's `write_explorer`, as
        for every layout). With `ticket` too (one `early` opened), the explorer's value is published for
        the page as soon as the stack's file is complete, while the forward goes on (`_Early`)."""
        variant = self._requested(image, variant)
        release_memory(keep=self.settings.heap_keep_bytes)  # what the previous requests freed, past VITVIZ_HEAP_KEEP_MB
        try:
            with self.priced(self.analysis_price(variant, explorer=explorer_key is not None)) as work:
                work.unpriced = variant not in self.cache.loaded()  # loading (or downloading) is not model speed
                exp = self._run(image, variant, explorer_key=explorer_key, ticket=ticket)
                yield exp
        except gr.Error as exc:  # priced above this server's bounds: the variant (at its size) is the problem
            exc.cause = getattr(exc, "cause", None) or "variant"
            raise
        finally:
            release_memory(keep=self.settings.heap_keep_bytes)

    def run(self, image: str | None, variant: object, *, explorer_key: str | None = None, ticket: str | None = None) -> views.Exploration:
        """`analysing`'s analysis, its job ended once the model has run (for a caller that draws after it)."""
        with self.analysing(image, variant, explorer_key=explorer_key, ticket=ticket) as exp:
            return exp

    def _run(self, image: str, variant: str, *, explorer_key: str | None, ticket: str | None) -> views.Exploration:
        """The model run of `analysing`, inside its job; what vitviz refuses becomes a `gr.Error` with its cause."""
        try:
            if explorer_key is None:
                return _analyze_on_device(self.name, image, variant)
            with self.explorer_locks.hold(explorer_key):
                spec = get_spec(variant)
                self.explorer_sweep(room=_explorer_room(spec))
                stack = self.explorer_dir / f"{explorer_key}-stack.bin"
                early = _Early(self.name, ticket, spec, explorer_key)
                try:
                    exp = replace(_analyze_on_device(self.name, image, variant, stream_to=str(stack), on_crop=early.on_crop,
                                                     on_file=early.on_file), key=explorer_key)
                except BaseException:  # the pictures written for the page before the forward go with it
                    for name in explorer_data.PICTURES:
                        explorer_data.picture_path(self.explorer_dir, explorer_key, name).unlink(missing_ok=True)
                    raise
                early.after(exp, stack)
            return exp
        except ImageError as exc:
            refused = error(f"{file_name(image)}: {inputs.public_text(str(exc))}")
            refused.cause = "image"
            raise refused from None
        except (WeightsUnavailableError, TooLarge) as exc:
            refused = error(inputs.public_text(str(exc)))
            refused.cause = "variant"
            raise refused from None

    def analysis_price(self, variant: str, *, explorer: bool = False) -> Cost:
        """An analysis' price; with `explorer`, its explorer's file for the browser written within it
        (`vitviz.cost.price`'s "explorer"). A file of the whole stack is written while the forward runs:
        one layer's rows, in float32 and float64 while quantised, held beside the forward's own peak (the
        file goes to disk). A windowed model's file is written after the forward, the analysis held: what
        writing it holds (the file and its copy, a layer's rows while quantised) is added to the
        analysis' bytes (its work, a copy of the attention in 8 bits, is priced as none). A layout with no file for the browser (a layer's
        file when it is asked for, or the server's views) is the analysis alone."""
        spec = get_spec(variant)
        cost = price(spec, "analyse", budget=self.work.budget_bytes)
        if not explorer:
            return cost
        file = price(spec, "explorer")
        if spec.config.attention == "windowed":  # written after the forward; none when the server draws its views
            return replace(cost, bytes=cost.bytes + file.bytes - BASE_BYTES) if file.kept_bytes else cost
        if spec.config.attention != "global" or explorer_layout_of(spec).mode != "stack":
            return cost  # (only a file of the whole stack is written while the forward runs)
        return replace(cost, bytes=cost.bytes + file.bytes - file.kept_bytes - BASE_BYTES)

    def remember(self, exp: views.Exploration, source: str = "", *, key: str | None = None) -> SessionRef:
        """Keeps `exp` in the store (under `key`, the one chosen for it before its forward, or a new one);
        the session holds only the returned reference."""
        key = self.store.put(exp, exp.analysis.nbytes, key=key or exp.key)
        return SessionRef(key=key, variant=exp.analysis.variant, crop=crop_to_keep(exp.analysis.image), image=file_name(source),
                          source=source)

    def recall(self, ref: SessionRef | None) -> views.Exploration:
        """The session's analysis; computed again from its crop (or its upload, for a crop too large for a
        session to keep) when the store has dropped it."""
        if not isinstance(ref, SessionRef):
            raise error("Analyse an image first.")
        exp = self.store.get(ref.key)
        if exp is None:
            if ref.crop is None:
                try:
                    uploaded_path(ref.source)
                except gr.Error:
                    raise error("This analysis was dropped to make room, and its image is no longer on the server: analyse it again.") from None
            try:
                with self.job("analyse", ref.variant):
                    exp = _reanalyze_on_device(self.name, ref)
            except (WeightsUnavailableError, TooLarge) as exc:
                raise error(inputs.public_text(str(exc))) from None
            self.store.put(exp, exp.analysis.nbytes, key=ref.key)
        return exp

    def forget(self, ref: SessionRef | None) -> None:
        """Called by Gradio when a session's state expires or its tab closes."""
        if isinstance(ref, SessionRef):
            self.store.drop(ref.key)

    # -- on the device (a ZeroGPU worker where there is one) -----------------------------------

    def explain(self, exp: views.Exploration, target: str | None, notes: dict[str, str] | None = None) -> tuple[dict, int | None]:
        """Every method's map for `target`; a plugin's failure or slowness kept to its own map (`method_guard`:
        `notes` gets why it is missing)."""
        return _explain_on_device(self.name, exp, target, notes)

    def find(self, exp: views.Exploration, phrases: list[str], method: str) -> tuple[torch.Tensor, torch.Tensor]:
        return _find_on_device(self.name, exp, phrases, method)

    def faithfulness(self, exp: views.Exploration, maps: dict, index: int, batch_size: int, check) -> dict:
        return _faithfulness_on_device(self.name, exp, maps, index, batch_size, check)


def device_line() -> str:
    dev = default_device()
    if dev.type == "cuda":
        return f"GPU: {torch.cuda.get_device_name()}"
    return f"CPU ({torch.get_num_threads()} threads)"


def error(message: str) -> gr.Error:
    """An error for the page and the API, in plain text (the page gets it escaped: `gradio_io.from_page`)."""
    return gr.Error(message)


def checked(check, *args, **kwargs):
    """A client's field through its check in `vitviz.server.guards.inputs`, or a clear error."""
    try:
        return check(*args, **kwargs)
    except inputs.InputError as exc:
        raise error(str(exc)) from None


_EXAMPLE_FILES = {(Path(p).name, Path(p).stat().st_size): hashlib.sha256(Path(p).read_bytes()).digest() for p in EXAMPLES}


def is_example(path: Path) -> bool:
    """Whether `path` is Gradio's copy of one of the examples (same name, size and bytes)."""
    try:
        digest = _EXAMPLE_FILES.get((path.name, path.stat().st_size))
        return digest is not None and hashlib.sha256(path.read_bytes()).digest() == digest
    except OSError:
        return False


def _explorer_room(spec) -> int:
    """The disk an analysis' explorer may write: its file (the stack, or a layer's) and its two
    pictures; nothing when the server draws its views."""
    written = price(spec, "explorer").kept_bytes
    pre = spec.preprocessing
    return written + explorer_data.pictures_bytes(spec.image_size, spec.grid, max_patches=pre.max_patches) if written else 0


class _Early:
    """What the page that named an analysis with `ticket` gets before its outputs (`vitviz.server.early`):
    the explorer's pictures, written from the crop before the forward runs (`on_crop`), and the
    explorer's value once the forward has written the file (`on_file`), with the first view's bytes
    inline: the value the outputs bring, made by the same function (`explorer_data.value_of`) from
    the spec and the crop. Without a ticket, only the pictures are written.

    Where the two calls did not reach this process (the analysis ran in ZeroGPU's worker) or the
    value could not be made during the forward, `after` publishes both from the finished analysis,
    the value as the outputs make it (the drawer's `write_explorer`).

    Only an explorer of one file ("stack") comes early: for one a layer at a time ("layers") the
    pictures are written (its outputs' explorer uses them) and the page's waits answered None at
    once; for one the server draws ("server") no picture is written."""

    def __init__(self, server: str, ticket: str | None, spec, key: str) -> None:
        self.server, self.ticket, self.spec, self.key = server, ticket, spec, key
        self.pictures: dict | None = None
        self.grid = spec.grid  # the crop's, once it is made (an image of any aspect ratio has its own)
        self.published = False

    def on_crop(self, cropped) -> None:  # (a plain ViT's or an image–text model's: a Swin's explorer is written after)
        server = server_named(self.server)
        mode = explorer_layout_of(self.spec).mode
        p = self.spec.patch_size
        self.grid = (cropped.size[1] // p, cropped.size[0] // p)
        if mode != "server":
            self.pictures = explorer_data.write_pictures(cropped, scale=views.display_scale(cropped), grid=self.grid,
                                                         key=self.key, folder=server.explorer_dir)
        if mode == "stack":
            server.early.publish(self.ticket, "pictures", self.pictures)
        else:
            server.early.close(self.ticket)

    def on_file(self, layout, path) -> None:
        if self.ticket is None or self.pictures is None:
            return
        try:  # the forward goes on whatever happens here: `after` tries again from the finished analysis
            tokens = layout_of(self.spec, self.grid)  # as the analysis will name its queries
            value = explorer_data.value_of(layout, key=self.key, variant=self.spec.name, grid=tokens.grid,
                                           query_names=tokens.query_names, patch_px=self.spec.patch_size * self.pictures["scale"],
                                           windows=explorer_data.windows_of(self.spec.config, layout.layers), pictures=self.pictures,
                                           data=path)
            value["first"] = explorer_data.first_shown(value)
        except Exception:
            return
        server_named(self.server).early.publish(self.ticket, "explorer", value)
        self.published = True

    def after(self, exp: views.Exploration, stack: Path) -> None:
        """The analysis `exp` is done: its explorer published now if it was not during the forward."""
        if self.ticket is None or self.published or not stack.exists():
            return
        server = server_named(self.server)
        value = drawer(exp).write_explorer(exp, key=self.key, folder=server.explorer_dir)
        server.early.publish(self.ticket, "pictures", {k: value[k] for k in (*explorer_data.PICTURES, "scale")})
        server.early.publish(self.ticket, "explorer", {**value, "first": explorer_data.first_shown(value)})
        self.published = True


def new_key() -> str:
    """A new session key (random, unguessable): the analysis is kept under it, and its explorer's files are named by it."""
    return secrets.token_urlsafe(16)


def file_name(path: str | None) -> str:
    """An uploaded file's name as its owner named it (Gradio keeps it, in a folder of its own)."""
    return Path(str(path)).name if path else "the image"


@gpu
def _analyze_on_device(server: str, image: str, variant: str, stream_to: str | None = None, on_crop=None,
                       on_file=None) -> views.Exploration:
    return views.explore(server_named(server).cache, image, variant, stream_to=stream_to, on_crop=on_crop, on_file=on_file)


@gpu
def _reanalyze_on_device(server: str, ref: SessionRef) -> views.Exploration:
    cache = server_named(server).cache
    if ref.crop is None:  # a crop larger than a session keeps: from the upload again
        return views.explore(cache, ref.source, ref.variant)
    return views.explore_crop(cache, ref.crop, ref.variant)


@gpu
def _explain_on_device(server: str, exp: views.Exploration, target: str | None, notes: dict[str, str] | None) -> tuple[dict, int | None]:
    s = server_named(server)
    return explaining.explain_exploration(s.cache, exp, target=target, guard=s.method_guard, notes=notes)


@gpu
def _find_on_device(server: str, exp: views.Exploration, phrases: list[str], method: str) -> tuple[torch.Tensor, torch.Tensor]:
    return explaining.find_phrases(server_named(server).cache, exp, phrases, method=method)


@gpu
def _faithfulness_on_device(server: str, exp: views.Exploration, maps: dict, index: int, batch_size: int, check) -> dict:
    return explaining.faithfulness_of(server_named(server).cache, exp, maps, target=index, batch_size=batch_size, check=check)


def notice_html(message: str) -> str:
    """An error for a notice box (HTML, for every caller): `message`, plain text, shown as typed."""
    return f'<div class="vv-error">{as_text(message)}</div>'


def md(text: str) -> str:
    """`text` shown as typed in Markdown."""
    return "".join("\\" + c if c in "\\`*_{}[]<>()#+-.!|~" else c for c in as_text(text))


def scale_of(value: str, choices: tuple[str, ...]) -> str:
    """A colour scale the page offers (one of `choices`) as `views` names it."""
    if value not in choices:
        raise error(f"The colour scale must be one of: {', '.join(choices)}.")
    return _SCALE_NAMES.get(value, "shared")


def click_xy(evt: gr.SelectData) -> tuple[float, float]:
    """A click's pixel (x, y): two finite numbers, else a clear error (the event's data comes from the client)."""
    index = getattr(evt, "index", None)
    try:
        if not isinstance(index, (list, tuple)) or len(index) != 2:
            raise ValueError
        x, y = float(index[0]), float(index[1])
    except (TypeError, ValueError, OverflowError):
        raise error("A click must give the pixel (x, y) on the image.") from None
    if not (math.isfinite(x) and math.isfinite(y)):
        raise error("A click must give the pixel (x, y) on the image.")
    return x, y


class Recent:
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
