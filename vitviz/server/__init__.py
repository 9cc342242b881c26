"""What the app does: loaded models, the analyses kept for sessions, the views drawn from them,
downloads, and the checks every client field passes. `gradio_io` holds the Gradio-specific inputs and
outputs; `runtime` the server's bounds and singletons; `page` the page (inputs, results, API) and
`tabs` its tabs, one module each; `app` builds and launches it (the repository's `app.py` and the
`vitviz-app` command start it)."""

from vitviz.sources import load_plugins as _load_plugins

# The plugins (`VITVIZ_PLUGINS`, the entry points) first, before any module of the server: a tab
# plugin registers after the built-in tabs and before the page is built, and the server modules it
# imports are whole when it reads them.
_load_plugins()
