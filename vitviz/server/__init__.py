"""What the app does, without its layout: loaded models, the analyses kept for sessions, the views
drawn from them, downloads, and the checks every client field passes. `gradio_io` holds the only
Gradio-specific parts (safe inputs and outputs); `app` is the page: layout and wiring (the
repository's `app.py` and the `vitviz-app` command start it)."""
