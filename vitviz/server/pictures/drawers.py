"""The pictures of an analysis, chosen by its token layout rather than by the model's family.

Each kind of attention (`TokenLayout.attention`) has one module that draws it: "global" (one N x N
matrix per layer and head: `vitviz.server.pictures.views`) and "windowed" (attention within windows, stage
grids between merges: `vitviz.server.pictures.swin_views`). A page, tab or endpoint asks `drawer(exp)` for the
module (`drawer_for(attention)` before there is an analysis: a model's facts) and calls the same
functions of every one of them (`PROTOCOL`, and the values `ATTRIBUTES`); a new layout registers its
module with `register_drawer` and is drawn by every caller with no change there.

The browser widgets that draw an explorer's value (`write_explorer`) are registered beside them
(`register_widget`): the Explorer tab builds one of each, and shows the one the analysis' drawer names
(`EXPLORER_WIDGET`); a layout with a widget of its own registers it, with no change to the tab.

    drawer(exp).render_rollout(exp)
    depth, heads, queries = drawer(exp).explorer_bounds(exp, layer=3)
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from vitviz.server.pictures import explorer_data, swin_explorer, swin_views, views
from vitviz.server.pictures.views import Exploration

__all__ = ["ATTRIBUTES", "PROTOCOL", "Widget", "drawer", "drawer_for", "register_drawer", "register_widget", "widgets"]

# what every drawer module offers, each taking the exploration first
PROTOCOL: tuple[str, ...] = (
    "render_rollout",      # (exp, *, head_fusion, discard_ratio=0, token=None) -> the rollout over the image, with its colour bar
    "rollout_note",        # (exp) -> None, or what the page says beside the rollout (Markdown)
    "render_distance",     # (exp) -> the mean attention distance per layer and head
    "render_query",        # (exp, *, layer, head, query, scale) -> one query's attention at one layer (1-based)
    "render_head_mosaic",  # (exp, *, layer, query, scale) -> every head of one layer for the query
    "patch_at",            # (exp, x, y) -> the query index of the patch under a display pixel
    "describe_query",      # (exp, query, layer=None) -> what the query index stands for, in words
    "explorer_bounds",     # (exp, layer=None) -> (layers, heads at that layer or the most of any, queries)
    "scale_refusal",       # (scale) -> None, or why this layout has no such colour scale
    "explorer_mode",       # (exp) -> the form of the explorer's data: "stack" (one file, written during the forward), "layers" (a file per layer when shown), "server" (none), or the layout's own
    "write_explorer",      # (exp, *, key, folder) -> writes the explorer's files; the widget's value (sent with the analysis' outputs)
    "maps_note",           # (exp, missing) -> what the Explain tab says of the methods (titles) with no map, or ""
    "render_positions",    # (exp) -> (the learned positions' picture or None, the patch filters' components or None: `TokenLayout.patch_filters`)
    "render_bias",         # (exp, *, layer) -> one layer's position tables by offset: relative bias (`TokenLayout.position_bias`) or rotary
    "render_offsets",      # (exp, *, layer) -> the attention one layer gave each offset on this image, per head
    "render_stages",       # (exp) -> None, or the stages over the image (grids, windows, merges)
    "render_received",     # (exp) -> the share of each layer's attention each token receives
    "render_token_norms",  # (exp) -> (the token norms per layer, the last block's over the image)
    "render_outliers",     # (exp, *, layer) -> (the high-norm tokens after block `layer` (1-based) outlined over the image, the page's words)
    "render_dino_heads",   # (exp, *, share) -> the classifier's query per head at the last block, `share` of each kept
    "render_features",     # (exp) -> (the final tokens' first three principal components as RGB, what they explain)
    "render_feature_similarity",  # (exp, *, query) -> how like the final token at `query` (`patch_at`'s) each one is
    "write_npz",           # (exp, path, *, attentions) -> writes the analysis as an .npz at `path` (`vitviz.cost.export_plan` weighs it)
)
# the values every drawer module has
ATTRIBUTES: tuple[str, ...] = (
    "DISCARD_RATIO",       # bool: the rollout takes a discard ratio
    "EXPLORER_WIDGET",     # the page's explorer widget that draws this layout's `write_explorer` value (None: the server draws it)
)

_DRAWERS: dict[str, ModuleType] = {}


@dataclass(frozen=True)
class Widget:
    """A browser widget that draws the explorer value of the layouts whose drawer names it
    (`EXPLORER_WIDGET`).

    Attributes:
        name: what a drawer's `EXPLORER_WIDGET` says.
        files: {"js": ..., "html": ..., "css": ...}, a Gradio `gr.HTML`'s templates and its script.
        elem_id: the widget's element id on the page.
        caption: Markdown under the widget, or "".
        server_calls: the widget asks the server for a layer's file and for the explorer of an
            analysis on its way (`explorer_layer`, `explorer_early` of the Explorer tab): they are
            attached to it (only to a widget that calls them: each is reachable by raw HTTP).
    """

    name: str
    files: dict[str, str]
    elem_id: str
    caption: str = ""
    server_calls: bool = False


_WIDGETS: dict[str, Widget] = {}


def register_widget(widget: Widget) -> Widget:
    """A widget the Explorer tab builds (in the order registered; the first is shown before any analysis)."""
    missing = sorted({"js", "html", "css"} - set(widget.files))
    if missing:
        raise TypeError(f"the explorer widget {widget.name!r} lacks its {', '.join(missing)}")
    if any(w.elem_id == widget.elem_id for w in _WIDGETS.values() if w.name != widget.name):
        raise ValueError(f"the element id {widget.elem_id!r} is another explorer widget's")
    _WIDGETS[widget.name] = widget
    return widget


def widgets() -> list[Widget]:
    """Every registered explorer widget, in order."""
    return list(_WIDGETS.values())


def register_drawer(attention: str, module: ModuleType) -> None:
    """Draw analyses whose `layout.attention` is `attention` with `module` (every name of `PROTOCOL`;
    its `EXPLORER_WIDGET` a registered widget's name, or None where the server draws its explorer)."""
    missing = [name for name in PROTOCOL if not callable(getattr(module, name, None))]
    missing += [name for name in ATTRIBUTES if not hasattr(module, name)]
    if missing:
        raise TypeError(f"{module.__name__} cannot draw {attention!r} attention: it lacks {', '.join(missing)}")
    if module.EXPLORER_WIDGET is not None and module.EXPLORER_WIDGET not in _WIDGETS:
        raise ValueError(f"{module.__name__} names the explorer widget {module.EXPLORER_WIDGET!r}, which is not registered "
                         f"(registered: {', '.join(_WIDGETS)}; `register_widget` first)")
    _DRAWERS[attention] = module


def drawer(exp: Exploration) -> ModuleType:
    """The module that draws `exp`, by its analysis' token layout."""
    return drawer_for(exp.analysis.layout.attention)


def drawer_for(attention: str) -> ModuleType:
    """The module that draws analyses of `attention` (`TokenLayout.attention`)."""
    try:
        return _DRAWERS[attention]
    except KeyError:
        raise ValueError(f"no drawer for {attention!r} attention (registered: {', '.join(_DRAWERS)})") from None


register_widget(Widget("global", explorer_data.widget_files(), elem_id="vv-explorer-live", server_calls=True))
register_widget(Widget("windowed", swin_explorer.widget_files(), elem_id="vv-swin-explorer", caption=swin_explorer.CAPTION))
register_drawer("global", views)
register_drawer("windowed", swin_views)
