"""What a tab of the results is, and the registry the page builds its tabs from.

A tab is one object (a `Tab` subclass, one module each): its `id` and `label`, the `needs` of the
analysed model it depends on (names from `vitviz.layout.NEEDS`, met or not by the analysis' token
layout, whatever the model's family), `build` (its components, inside its `gr.Tab`), `analysed` (its outputs drawn with an analysis) and/or `draw` (drawn when the tab is
shown, for `on_demand` tabs), `unfit` (its outputs for an analysis it cannot draw) and `wire`
(its own events). The page builds and wires every registered tab in one loop, and hides the content
of a tab the analysed model cannot fill behind one line saying why (`Gate`): what the tab's `lacks`
says (by default, the needs the model's layout lacks; a tab may ask more of the model, such as
the Concepts tab a sparse autoencoder trained for it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Callable

import gradio as gr
from gradio.components import Component

from vitviz.layout import check_needs
from vitviz.server import runtime
from vitviz.server.guards.gradio_io import PngImage
from vitviz.server.guards.sessions import SessionRef
from vitviz.server.pictures import views
from vitviz.server.runtime import Outputs

def figure(kind=PngImage, **kwargs):
    """An output picture whose label sits above it, not over it."""
    return kind(interactive=False, buttons=["download"], elem_classes=["vv-figure"], **kwargs)


@dataclass
class Gate:
    """Content that needs something of the model: shown, or hidden behind one line saying what the
    analysed model lacks."""

    needs: frozenset[str]
    note: Component
    content: Component
    why: Callable[[views.Exploration], str | None] | None = None  # its tab's own `lacks` (by default: the needs')

    def lacks(self, exp: views.Exploration) -> str | None:
        return self.why(exp) if self.why is not None else lacks(exp, self.needs)

    def outputs(self, exp: views.Exploration) -> Outputs:
        reason = self.lacks(exp)
        return {self.note: gr.update(value=reason or "", visible=reason is not None), self.content: gr.update(visible=reason is None)}


def labels_of(a) -> dict:
    """An image–text model's zero-shot label set (`labels=`), for the model runs that score an analysis
    `a` again (head ablation, patching, concepts); {} for a classifier."""
    return dict(labels=list(a.categories)) if a.layout.text and a.categories is not None else {}


def lacks(exp: views.Exploration, needs: Iterable[str]) -> str | None:
    """None when the analysed model meets `needs`, else the line shown in their place."""
    a = exp.analysis
    return a.layout.lacks(needs, name=a.variant)


# what a tab that draws an analysis says in place of its content before the first one
NO_ANALYSIS = "No image analysed yet: upload one or click an example, and this tab shows what the model made of it."


def gate(needs: Iterable[str], elem_id: str, gates: list[Gate], *, waits: bool = True,
         why: Callable[[views.Exploration], str | None] | None = None) -> Gate:
    """A note (`<elem_id>-lacks`) and a column (`<elem_id>-content`) for content that needs `needs`
    (open the column with `with gate.content:`); kept in `gates`, whose outputs every analysis gives. Content that `waits`
    for an analysis starts hidden behind `NO_ANALYSIS`. `why`: what the content lacks of an analysis,
    asked in place of the needs (a tab's `lacks`)."""
    note = gr.Markdown(NO_ANALYSIS if waits else "", visible=waits, elem_classes="vv-caption", elem_id=f"{elem_id}-lacks")
    content = gr.Column(visible=not waits, elem_id=f"{elem_id}-content")
    g = Gate(check_needs(needs), note, content, why)
    gates.append(g)
    return g


@dataclass(frozen=True)
class Analysed:
    """One analysis as the tabs draw it: the exploration and the options the page read with it."""

    exp: views.Exploration
    same_model: bool  # the model's own pictures and class list are on the page already
    head_fusion: str = "mean"
    discard_ratio: float = 0.0


class Tab:
    """One tab of the results. Subclasses set `id`, `label`, `needs`, and build and draw their part."""

    id: str = ""
    label: str = ""
    needs: frozenset[str] = frozenset()
    on_demand: bool = False  # drawn when shown (`draw`), not with every analysis
    waits: bool = True  # shows nothing before the first analysis (one line says so); False: works from the image alone

    def __init__(self) -> None:
        self.needs = check_needs(self.needs)
        self.page = None  # set by the page before `build`
        self.gate: Gate | None = None  # set by the page: this tab's content and its one-line note
        self.draw_inputs: list[Component] = []  # what `draw` reads besides the session's analysis
        self.draw_outputs: list[Component] = []  # what `draw` fills

    @property
    def server(self) -> runtime.Server:
        """The server the page runs on (its models, budget and the analyses kept for sessions)."""
        return self.page.server

    def lacks(self, exp: views.Exploration) -> str | None:
        """None when the tab can draw `exp`, else the line shown in place of its content."""
        return lacks(exp, self.needs)

    def recall(self, ref: SessionRef | None) -> views.Exploration:
        """The session's analysis, when the tab can draw it; else a clear error (the line the tab shows)."""
        exp = self.server.recall(ref)
        reason = self.lacks(exp)
        if reason is not None:
            raise runtime.error(f"{reason}.")
        return exp

    def build(self, page) -> None:
        """The tab's components (the page has opened its `gr.Tab` and content column)."""
        raise NotImplementedError

    def analysis_outputs(self) -> list[Component]:
        """The components `analysed` fills."""
        return []

    def analysed(self, done: Analysed) -> Outputs:
        """The tab's outputs drawn with an analysis (only when the model meets `needs`)."""
        return {}

    def unfit(self, done: Analysed) -> Outputs:
        """The tab's outputs with an analysis it cannot draw (`lacks`): by default left as they are,
        hidden behind the line saying why."""
        return {c: gr.skip() for c in self.analysis_outputs()}

    def draw(self, ref: SessionRef, *values: Any) -> Outputs:
        """An `on_demand` tab drawn for the session's analysis (`values`: of `draw_inputs`)."""
        return {}

    def skip_refresh(self, ref: SessionRef) -> bool:
        """After an analysis: whether what the tab shows is already newer than the analysis's start."""
        return False

    def wire(self, page) -> None:
        """The tab's own events."""


@dataclass
class Registry:
    """The tabs of the results, in page order."""

    tabs: list[Tab] = field(default_factory=list)

    def add(self, tab: Tab) -> Tab:
        if any(t.id == tab.id for t in self.tabs):
            raise ValueError(f"a tab with id {tab.id!r} is registered already")
        self.tabs.append(tab)
        return tab

    def __iter__(self):
        return iter(list(self.tabs))

    def __len__(self) -> int:
        return len(self.tabs)

    def by_id(self, tab_id: str) -> Tab | None:
        return next((t for t in self.tabs if t.id == tab_id), None)

    def by_label(self, label: str) -> Tab | None:
        return next((t for t in self.tabs if t.label == label), None)


TABS = Registry()


def register_tab(tab: Tab) -> Tab:
    """Adds `tab` after the tabs registered so far (before the page is built: import its module first)."""
    return TABS.add(tab)
