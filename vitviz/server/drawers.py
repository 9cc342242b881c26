"""The pictures of an analysis, chosen by its token layout rather than by the model's family.

Each kind of attention (`TokenLayout.attention`) has one module that draws it: "global" (one N x N
matrix per layer and head: `vitviz.server.views`) and "windowed" (attention within windows, stage
grids between merges: `vitviz.server.swin_views`). A page, tab or endpoint asks `drawer(exp)` for the
module and calls the same functions of every one of them (`PROTOCOL`); a new layout registers its
module with `register_drawer` and is drawn by every caller with no change there.

    drawer(exp).render_rollout(exp)
    depth, heads, queries = drawer(exp).explorer_bounds(exp, layer=3)
"""

from __future__ import annotations

from types import ModuleType

from vitviz.server import swin_views, views
from vitviz.server.views import Exploration

__all__ = ["PROTOCOL", "drawer", "register_drawer"]

# what every drawer module offers, each taking the exploration first
PROTOCOL: tuple[str, ...] = (
    "render_rollout",      # (exp, *, head_fusion) -> the rollout over the image, with its colour bar
    "render_distance",     # (exp) -> the mean attention distance per layer and head
    "render_query",        # (exp, *, layer, head, query, scale) -> one query's attention at one layer (1-based)
    "render_head_mosaic",  # (exp, *, layer, query, scale) -> every head of one layer for the query
    "patch_at",            # (exp, x, y) -> the query index of the patch under a display pixel
    "describe_query",      # (exp, query, layer=None) -> what the query index stands for, in words
    "explorer_bounds",     # (exp, layer=None) -> (layers, heads at that layer or the most of any, queries)
    "scale_refusal",       # (scale) -> None, or why this layout has no such colour scale
)

_DRAWERS: dict[str, ModuleType] = {}


def register_drawer(attention: str, module: ModuleType) -> None:
    """Draw analyses whose `layout.attention` is `attention` with `module` (every name of `PROTOCOL`)."""
    missing = [name for name in PROTOCOL if not callable(getattr(module, name, None))]
    if missing:
        raise TypeError(f"{module.__name__} cannot draw {attention!r} attention: it lacks {', '.join(missing)}")
    _DRAWERS[attention] = module


def drawer(exp: Exploration) -> ModuleType:
    """The module that draws `exp`, by its analysis' token layout."""
    attention = exp.analysis.layout.attention
    try:
        return _DRAWERS[attention]
    except KeyError:
        raise ValueError(f"no drawer for {attention!r} attention (registered: {', '.join(_DRAWERS)})") from None


register_drawer("global", views)
register_drawer("windowed", swin_views)
