"""One real browser session: the system Chromium, headless, driven by Playwright."""

import os
import shutil

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.browser]

CHROMIUM = os.environ.get("VITVIZ_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip("no Chromium installed (apt-get install -y chromium; .ci/run installs it)", allow_module_level=True)

FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def url():
    import app

    app.demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True, **app.LAUNCH_KWARGS)
    try:
        yield app.demo.local_url, app.EXAMPLES[0]
    finally:
        app.demo.close()


@pytest.fixture(scope="module")
def page():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.set_default_timeout(60_000)
            yield page
        finally:
            browser.close()


def _src(page, selector):
    return page.locator(f"{selector} img").first.get_attribute("src")


def test_a_person_explores_an_image(url, page, tmp_path_factory):
    shots = tmp_path_factory.mktemp("screens")
    base, example = url
    page.goto(base)
    page.locator("#vv-image input[type=file]").set_input_files(example)
    # the upload runs the analysis; predictions and the rollout image appear
    page.wait_for_selector("#vv-rollout img")
    page.wait_for_function("document.querySelector('#vv-status') && document.querySelector('#vv-status').innerText.includes('shapes_p16')")
    assert page.locator("#vv-predictions").inner_text().strip()
    page.screenshot(path=str(shots / "1-predict.png"), full_page=True)

    page.get_by_role("tab", name="Explorer").click()
    explorer = page.locator("#vv-explorer img")
    explorer.wait_for()
    before = explorer.get_attribute("src")
    box = explorer.bounding_box()
    explorer.click(position={"x": box["width"] * 0.8, "y": box["height"] * 0.2})
    page.wait_for_function("document.querySelector('#vv-query').innerText.includes('patch row')")
    page.wait_for_function(f"document.querySelector('#vv-explorer img').src !== {before!r}")
    clicked = explorer.get_attribute("src")

    # drag the layer slider to the far left (layer 1)
    slider = page.locator("#vv-layer input[type=range]")
    sbox = slider.bounding_box()
    page.mouse.move(sbox["x"] + sbox["width"] - 2, sbox["y"] + sbox["height"] / 2)
    page.mouse.down()
    page.mouse.move(sbox["x"] + 1, sbox["y"] + sbox["height"] / 2, steps=8)
    page.mouse.up()
    page.wait_for_function(f"document.querySelector('#vv-explorer img').src !== {clicked!r}")
    assert slider.input_value() == "1"
    page.screenshot(path=str(shots / "2-explorer.png"), full_page=True)

    for i, tab in enumerate(["Distance", "Positions", "Architecture"], start=3):
        page.get_by_role("tab", name=tab).click()
        page.wait_for_timeout(500)
        page.screenshot(path=str(shots / f"{i}-{tab.lower().replace(' ', '-')}.png"), full_page=True)

    page.get_by_role("tab", name="Compare").click()
    page.locator("#vv-compare-run").click()
    page.wait_for_function("document.querySelector('#vv-compare-2') && document.querySelector('#vv-compare-2').innerText.includes('shapes_p8')")
    page.wait_for_selector("#vv-compare-distance img")
    assert "shapes_p16" in page.locator("#vv-compare-1").inner_text()
    page.screenshot(path=str(shots / "6-compare.png"), full_page=True)

    # phone width: nothing wider than the screen
    page.set_viewport_size({"width": 390, "height": 844})
    page.get_by_role("tab", name="Predict").click()
    page.wait_for_timeout(500)
    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    page.screenshot(path=str(shots / "7-phone.png"), full_page=True)
    assert overflow <= 1, f"the page is {overflow}px wider than a phone screen"
    assert len(list(shots.glob("*.png"))) == 7


def _choose(page, label, option):
    page.get_by_label(label).click()
    page.get_by_role("option", name=option).first.click()


def test_the_page_does_what_it_says(url, page, tmp_path, monkeypatch):
    """Each control redraws its picture however it is changed; a menu pick runs one analysis; an
    error reads in full as text and leaves the previous results alone."""
    import urllib.error

    import torch

    import app

    calls = []
    explore = app.views.explore
    monkeypatch.setattr(app.views, "explore", lambda *a, **k: calls.append(a[2]) or explore(*a, **k))
    base, example = url
    page.goto(base)
    page.locator("#vv-image input[type=file]").set_input_files(example)
    page.wait_for_function("document.querySelector('#vv-status').innerText.includes('shapes_p16')")
    assert calls == ["shapes_p16"]

    _choose(page, "Model variant", "shapes_p8 ")
    page.wait_for_function("document.querySelector('#vv-status').innerText.includes('shapes_p8')")
    page.mouse.click(5, 5)  # leaving the menu must not run it again
    page.wait_for_timeout(1500)
    assert calls == ["shapes_p16", "shapes_p8"], calls

    # keyboard and typed values redraw, not only a mouse release
    page.get_by_role("tab", name="Explorer").click()
    before = _src(page, "#vv-explorer")
    layer = page.locator("#vv-layer input[type=range]")
    layer.focus()
    page.keyboard.press("ArrowLeft")
    page.wait_for_function(f"document.querySelector('#vv-explorer img').src !== {before!r}")
    assert layer.input_value() == "5"
    before = _src(page, "#vv-explorer")
    page.locator("#vv-layer input[type=number]").fill("2")
    page.wait_for_function(f"document.querySelector('#vv-explorer img').src !== {before!r}")
    page.get_by_role("tab", name="Predict").click()
    before = _src(page, "#vv-rollout")
    page.locator("#vv-discard input[type=range]").focus()
    page.keyboard.press("ArrowRight")
    page.wait_for_function(f"document.querySelector('#vv-rollout img').src !== {before!r}")
    assert len(calls) == 2  # none of these ran the model

    # weights that cannot be downloaded: the whole message, as text; the results stay as they were
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.delenv("VITVIZ_OFFLINE", raising=False)

    def unreachable(url, dst, *args, **kwargs):
        # a reason with angle brackets, which the page would take for an HTML tag
        raise urllib.error.URLError("<proxy> refused the tunnel: 403 <Forbidden>")

    monkeypatch.setattr(torch.hub, "download_url_to_file", unreachable)
    rollout = _src(page, "#vv-rollout")
    _choose(page, "Model variant", "vit_b_32 ")
    page.wait_for_function("document.querySelector('#vv-notice').innerText.includes('vit_b_32-d86f8d99.pth')")
    shown = page.locator("#vv-notice").inner_text()
    assert "URLError: <proxy> refused the tunnel: 403 <Forbidden>" in shown
    assert str(tmp_path / "torch" / "hub" / "checkpoints") in shown and "still those of shapes_p8" in shown
    page.wait_for_timeout(500)
    page.screenshot(path=str(tmp_path / "unavailable.png"), full_page=True)
    assert _src(page, "#vv-rollout") == rollout
    assert page.locator("#vv-predictions").inner_text().strip()
    lines = [line.strip() for line in page.locator("body").inner_text().splitlines()]
    assert "Error" not in lines, "an output shows Gradio's error badge"
