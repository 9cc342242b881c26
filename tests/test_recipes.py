"""docs/architecture.md's three recipes (a method, a model family, a tab), run as written: each code
block saved under the file name its first line gives, in a folder outside the package, named in
`VITVIZ_PLUGINS`, and the app started from another folder. The page offers all three (the tab seen
and drawn in Chromium)."""

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from conftest import free_port, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.browser]

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("VITVIZ_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


def recipes() -> dict[str, str]:
    """{file name: code} of the recipes' Python blocks (a block's first line: `# <name>.py ...`)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    blocks = re.findall(r"^## Recipe \d+:.*?```python\n(.*?)```", text, flags=re.S | re.M)
    return {re.match(r"# (\w+\.py)", code).group(1): code for code in blocks}


def test_the_three_recipes_run_as_written_in_the_app(tmp_path):
    found = recipes()
    assert sorted(found) == ["my_family.py", "my_methods.py", "my_tab.py"]
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    for name, code in found.items():
        (plugins / name).write_text(code)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    port = free_port()
    env = dict(os.environ, VITVIZ_PLUGINS="my_methods,my_family,my_tab", PYTHONPATH=os.pathsep.join([str(plugins), str(ROOT)]),
               GRADIO_ANALYTICS_ENABLED="False", GRADIO_SERVER_PORT=str(port), TMPDIR=str(tmp_path),
               GRADIO_TEMP_DIR=str(tmp_path / "gradio"))
    server = subprocess.Popen([sys.executable, str(ROOT / "app.py")], cwd=elsewhere, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(base + "/", server)
        with urllib.request.urlopen(base + "/config") as response:
            config = json.load(response)
        props = [c.get("props", {}) for c in config["components"]]
        assert "vv-explain-centre" in {p.get("elem_id") for p in props}  # the method, in the Explain tab
        menu = next(p for p in props if p.get("elem_id") == "vv-variant")
        assert "mine:small" in [value for _, value in menu["choices"]]  # the family, in the model menu
        assert "Heads" in {p.get("label") for p in props}  # the tab, after the built-in ones
        if CHROMIUM is None:
            pytest.skip("no Chromium installed (apt-get install -y chromium; .ci/run installs it)")
        from playwright.sync_api import sync_playwright

        from vitviz.dev import screens

        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=screens.FLAGS)
            try:
                page = browser.new_page(viewport={"width": 1366, "height": 900})
                page.set_default_timeout(60_000)
                page.goto(base)
                page.wait_for_selector("[role=tab]")
                labels = [t.inner_text().strip() for t in page.get_by_role("tab").all()]
                assert labels[-1] == "Heads" and labels[0] == "Predict"
                page.locator("#vv-image input[type=file]").set_input_files(str(ROOT / "assets" / "examples" / "star.png"))
                screens.analysed(page, "shapes_p16")
                page.get_by_role("tab", name="Heads", exact=True).click()
                page.wait_for_selector("#vv-heads img")
                assert screens.problems(page) == []
            finally:
                browser.close()
    finally:
        server.terminate()
        out, _ = server.communicate(timeout=30)
    assert "Traceback" not in out, out
