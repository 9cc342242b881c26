"""The tabs of the app's results, one module each, in page order; `register_tab` adds one more
(a module that defines a `Tab` subclass and registers an instance, imported before the page is built).

The page (`vitviz.server.page`) builds, fills and wires every registered tab in one loop: see `base`.
"""

from vitviz.server.tabs.base import Analysed, Tab, TABS, register_tab
from vitviz.server.tabs import predict, explain, find, explorer, tokens, distance, positions, architecture, compare, patch, inside, concepts, ask, video  # noqa: F401  (registers them)

__all__ = ["Analysed", "Tab", "TABS", "register_tab"]
