"""Every field a client sends, checked: the API takes them from anyone."""

from __future__ import annotations

import difflib
import logging
import math
import os
import re
import tempfile

from vitviz.server.menus import head_choices
from vitviz.sources import UnknownVariant, WeightsUnavailableError, checkpoint_dir, get_spec, list_variants, source_of
from vitviz.video.model import VideoSpec

__all__ = ["InputError", "variant", "public_text", "is_menu_name", "fusion", "ratio", "index", "head", "share"]


LOG = logging.getLogger("vitviz.server")


class InputError(ValueError):
    """A field a client sent that vitviz will not use; the message says what is accepted."""


def variant(value: object, *, max_params: int | None = None, max_tokens: int | None = None, open_models: bool = True) -> str:
    """A variant name vitviz can load: a listed one, or "timm:<name>" / "hf:<repo id>" (when
    `open_models`), of at most `max_params` parameters (every tower, as its source counts them from
    the name: `WeightsSource.num_params`), at a size of at most `max_tokens` tokens (a windowed
    model: at most max_tokens² attention weights per head in any layer, what that many global tokens hold)."""
    if not isinstance(value, str) or not value.strip():
        raise InputError("Choose a model variant from the menu (or type timm:<name> or hf:<repo id> in the box below it).")
    value = value.strip()
    if len(value) > 200:
        raise InputError("A model name has at most 200 characters.")
    if not open_models and not is_menu_name(value):
        raise InputError("This server analyses the models of its menu only (VITVIZ_OPEN_MODELS=0): choose one there.")
    try:
        spec = get_spec(value)
    except WeightsUnavailableError as exc:  # the library's advice is for whoever runs the server: its log has it
        LOG.info("%s", exc)
        raise InputError(f"{_shown(value)} is not on this server and cannot be downloaded now: choose a model from the menu.") from None
    except UnknownVariant:  # no variant, and no family's prefix (a family's own refusals say more)
        raise InputError(unknown_name(value)) from None
    except (ValueError, ImportError, NotImplementedError, TypeError, OSError) as exc:
        raise InputError(public_text(str(exc))) from None
    if isinstance(spec, VideoSpec):  # (a clip's model: the image tabs have no frames to give it)
        raise InputError(f"{_shown(value)} is a video model: the Video tab runs video models on a clip.")
    if max_params is not None and (params := source_of(spec).num_params(spec)) > max_params:
        raise InputError(f"{value} has {params:,} parameters, all its towers together; this server loads models of up to "
                         f"{max_params:,} (VITVIZ_MAX_PARAMS).")
    if max_tokens is not None and spec.config.attention == "windowed":  # windowed attention: linear in tokens
        held = max(g.num_windows * g.area**2 for g in spec.config.geometries(spec.grid))  # weights per head of its largest layer
        if held > max_tokens**2:
            raise InputError(
                f"{value} at {spec.image_size} px holds {held:,} attention weights per head in a layer; this server holds at most "
                f"{max_tokens**2:,}, as many as {max_tokens:,} tokens attending to each other (VITVIZ_MAX_TOKENS)."
            )
    elif max_tokens is not None and spec.num_tokens > max_tokens:
        side = math.isqrt(max_tokens - spec.num_prefix_tokens) * spec.patch_size
        raise InputError(
            f"{value} cuts a {spec.image_size} px image into {spec.num_tokens:,} tokens; this server analyses at most "
            f"{max_tokens:,} (VITVIZ_MAX_TOKENS): for this model, sizes up to @{side}."
        )
    return value


def _shown(value: str) -> str:
    """A name a client typed, as a message quotes it: at most 60 characters."""
    return repr(value if len(value) <= 60 else value[:57] + "...")


def unknown_name(value: str) -> str:
    """One sentence for a name that is no variant and has no family's prefix (timm:, hf:, ...): a path
    is refused as one, else the closest variants are offered (never the whole list)."""
    if any(c in value for c in "/\\") or value.startswith((".", "~")):
        return f"{_shown(value)} is a path, and a model is named: choose one from the menu, or type timm:<name> or hf:<org/name>."
    names = [v.name for v in list_variants()]
    close = difflib.get_close_matches(value.rpartition("@")[0] or value, names, n=3, cutoff=0.6)
    if close:
        return f"There is no model called {_shown(value)}; did you mean {' or '.join(close)}?"
    return f"There is no model called {_shown(value)}: choose one from the menu, or type timm:<name> or hf:<org/name>."


def is_menu_name(name: str) -> bool:
    """Whether `name` is one of the menu's variants, maybe at another size ("shapes_p16@192")."""
    menu = {s.name for s in list_variants()}
    return name in menu or name.rpartition("@")[0] in menu


def public_text(message: str) -> str:
    """`message` for a web user: this machine's folders named by what they are, not where they are,
    and no advice that only a Python caller can follow."""
    message = _PYTHON_ONLY.sub(".", message)
    places = []
    try:
        from huggingface_hub.constants import HF_HUB_CACHE

        places.append((HF_HUB_CACHE, "$HF_HOME/hub"))
    except ImportError:
        pass
    places += [(str(checkpoint_dir()), "$TORCH_HOME/hub/checkpoints"), (tempfile.gettempdir(), "<temp>"),
               (os.getcwd(), "<server>"), (os.path.expanduser("~"), "~")]
    for folder, name in sorted(places, key=lambda p: -len(p[0])):
        if folder and folder != "/":  # the folder itself or a path in it, not a longer name that starts alike
            message = re.sub(rf"(?<![\w:/.~-]){re.escape(folder.rstrip('/'))}(?=/|$|[\s'\"),;:.])", name.replace("\\", r"\\"), message)
    return _ABSOLUTE.sub("<path>", message)


_PYTHON_ONLY = re.compile(r",? or pass weights_path= to load_model(?: \([^)]*\))?\.")
# an absolute path or a file: address (but not the path part of a web address)
_ABSOLUTE = re.compile(r"file://\S+|(?<![\w:/.~<>$-])/(?:[^\s'\"/<>]+/)*[^\s'\"/<>),;:]+")


def fusion(value: object) -> str:
    if value not in ("mean", "max", "min"):
        raise InputError("Head fusion must be mean, max or min.")
    return value  # type: ignore[return-value]


def _number(value: object) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return math.nan


def ratio(value: object) -> float:
    r = _number(value)
    if not 0.0 <= r <= 0.95:
        raise InputError("The discard ratio must be a number from 0 to 0.95.")
    return r


def index(value: object, low: int, high: int, what: str) -> int:
    n = _number(value)
    if not (low <= n <= high and n == int(n)):
        raise InputError(f"The {what} must be a whole number from {low} to {high}.")
    return int(n)


def head(value: object, heads: int) -> str:
    if isinstance(value, str) and value in head_choices(heads):
        return value
    raise InputError(f"The head must be mean, max or one of head 1 to head {heads}.")


def share(value: object) -> float:
    """DINO's share of a head's attention kept: a number in [0.05, 1]."""
    t = _number(value)
    if not 0.05 <= t <= 1.0:
        raise InputError("The share of attention kept must be a number from 0.05 to 1.")
    return t
