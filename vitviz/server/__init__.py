"""What the app does: loaded models, the analyses kept for sessions, the views drawn from them,
downloads, and the checks every client field passes. `gradio_io` holds the Gradio-specific inputs and
outputs; `runtime` the server's bounds and singletons; `page` the page (inputs, results, API) and
`tabs` its tabs, one module each; `app` builds and launches it (the repository's `app.py` and the
`vitviz-app` command start it)."""
