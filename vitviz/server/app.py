"""vitviz in the browser: upload an image, pick a ViT, see what it predicts and how it got there.

This module builds the server's state from the settings (`SERVER`, a `vitviz.server.runtime.Server`),
the page on it (`vitviz.server.page`, its tabs in `vitviz.server.tabs`), sets its queue and launches it;
everything computed lives in `vitviz`. Started
by `python app.py` in the repository (and as a Hugging Face Space), or by the `vitviz-app` command that
`pip install vitviz[app]` installs.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402
from starlette.middleware import Middleware  # noqa: E402

from vitviz.images import MAX_BYTES  # noqa: E402
from vitviz.server import page, runtime  # noqa: E402
from vitviz.server.guards.asgi import BodyLimit, KnownEvents, SessionHashes, UploadLimit  # noqa: E402

HERE = Path(__file__).resolve().parent
CSS = (HERE / "app.css").read_text()
# Gradio's Soft theme with text at WCAG AA contrast (4.5:1): labels, accents and subdued text darker
THEME = gr.themes.Soft().set(
    block_label_text_color="*primary_700", block_title_text_color="*primary_700", color_accent="*primary_600",
    button_primary_background_fill="*primary_600", button_primary_background_fill_hover="*primary_700",
    checkbox_label_background_fill_selected="*primary_600", body_text_color_subdued="*neutral_600",
)

SERVER = runtime.Server(runtime.settings_from_env())
demo = page.build(SERVER)
# api_open=False: queued events cannot be called around the queue (POST /run/<name>), so every
# client's share holds however it calls
demo.after_event = SERVER.files_sweep  # Gradio's copies of pictures and downloads are written by every kind of event
demo.claim_files = SERVER.files.claim  # whose they are, and whose uploads an event reads: each caller its share of the disk
demo.queue(max_size=SERVER.settings.queue_size, default_concurrency_limit=SERVER.settings.concurrency, api_open=False,
           client_jobs=SERVER.settings.client_jobs, address_jobs=SERVER.settings.address_jobs)

LAUNCH_KWARGS = dict(
    css=CSS,
    # the page's own margins (outside the part Gradio's css= reaches): narrow on a phone
    head=(HERE / "app_head.html").read_text(),
    theme=THEME,
    max_file_size=MAX_BYTES,
    # Gradio's sessions, the least recently used dropped first: as many as their price lets beside the
    # analyses kept for them in VITVIZ_STATE_MB (`Settings.sessions`, docs/serving.md)
    state_session_capacity=SERVER.settings.sessions,
    ssr_mode=False,
    mcp_server=os.environ.get("VITVIZ_MCP", "").strip().lower() in ("1", "true", "yes", "on"),  # agents: /gradio_api/mcp/
    app_kwargs={"middleware": [
        Middleware(BodyLimit, max_bytes=SERVER.settings.body_bytes),
        Middleware(SessionHashes, blocks=demo),  # a session hash of 1 to 64 [A-Za-z0-9_-], or 400 before Gradio keeps it
        Middleware(KnownEvents, blocks=demo),  # an unknown API name, event or session: 404 and why, not a 500
        Middleware(UploadLimit, max_bytes=MAX_BYTES, per_minute=SERVER.settings.upload_bytes_per_minute, after=demo.after_any,
                   claim=SERVER.files.claim),
    ]},
)


def main(argv: list[str] | None = None) -> None:
    """`vitviz-app`: the app on this machine (Gradio takes the next free port if this one is in use)."""
    import argparse

    ap = argparse.ArgumentParser(prog="vitviz-app", description="vitviz in the browser: look inside Vision Transformers.")
    ap.add_argument("--host", default=None, help="the address to serve on (default 127.0.0.1, or GRADIO_SERVER_NAME; 0.0.0.0 for every interface)")
    ap.add_argument("--port", type=int, default=None, help="the port (default 7860, or GRADIO_SERVER_PORT)")
    ap.add_argument("--mcp", action="store_true", help="also serve the public endpoints as MCP tools (as VITVIZ_MCP=1)")
    args = ap.parse_args(argv)
    kwargs = dict(LAUNCH_KWARGS)
    if args.host is not None:
        kwargs["server_name"] = args.host
    if args.port is not None:
        kwargs["server_port"] = args.port
    if args.mcp:
        kwargs["mcp_server"] = True
    demo.launch(**kwargs)


if __name__ == "__main__":
    main()
