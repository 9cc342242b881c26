"""vitviz in the browser, as `python app.py` and as a Hugging Face Space: the app itself is
`vitviz/server/app.py` (`vitviz-app` starts it from an install)."""

from vitviz.server.app import LAUNCH_KWARGS, demo, main  # noqa: F401  (demo: what Gradio's reload mode looks for)

if __name__ == "__main__":
    main()
