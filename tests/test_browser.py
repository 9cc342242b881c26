"""One real browser session: the system Chromium, headless, driven by Playwright."""

import os
import shutil
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.browser]

CHROMIUM = os.environ.get("VITVIZ_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip("no Chromium installed (apt-get install -y chromium; .ci/run installs it)", allow_module_level=True)

FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def url():
    from vitviz.server import app, runtime

    app.demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True, **app.LAUNCH_KWARGS)
    try:
        yield app.demo.local_url, runtime.EXAMPLES[0]
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


def _analysed(page, name):
    """Waits until the status line reports an analysis by `name` (the progress text that Gradio
    lays over the outputs while one runs also names the model, but not "on <name> (<device>)")."""
    page.wait_for_function(f"document.querySelector('#vv-status').innerText.includes({('on ' + name + ' (')!r})")


def _src(page, selector):
    return page.locator(f"{selector} img").first.get_attribute("src")


def test_a_person_explores_an_image(url, page, tmp_path_factory):
    shots = tmp_path_factory.mktemp("screens")
    base, example = url
    _open(page, base)
    page.locator("#vv-image input[type=file]").set_input_files(example)
    # the upload runs the analysis; predictions and the rollout image appear
    page.wait_for_selector("#vv-rollout img")
    _analysed(page, "shapes_p16")
    assert page.locator("#vv-predictions").inner_text().strip()
    _no_label_covers_a_picture(page)
    page.screenshot(path=str(shots / "1-predict.png"), full_page=True)

    page.get_by_role("tab", name="Explorer").click()
    page.wait_for_function("document.querySelector('#vv-explorer-live .vvx').dataset.analysis")
    explorer = page.locator("#vv-explorer-live canvas.vvx-map")
    box = explorer.bounding_box()
    explorer.click(position={"x": box["width"] * 0.8, "y": box["height"] * 0.2})  # pins patch row 2, column 5
    _shows(page, query=str(1 + 1 * 6 + 4))
    assert "patch row 2, column 5 (pinned)" in page.locator("#vv-explorer-live .vvx-query-text").inner_text()

    # drag the layer slider to the far left (layer 1): the map follows while dragging
    slider = page.locator("#vv-explorer-live .vvx-layer")
    sbox = slider.bounding_box()
    page.mouse.move(sbox["x"] + sbox["width"] - 2, sbox["y"] + sbox["height"] / 2)
    page.mouse.down()
    page.mouse.move(sbox["x"] + sbox["width"] * 0.5, sbox["y"] + sbox["height"] / 2, steps=4)
    # still dragging: the map already shows a layer between the two ends
    page.wait_for_function("['3', '4'].includes(document.querySelector('#vv-explorer-live canvas.vvx-map').dataset.layer)")
    page.mouse.move(sbox["x"] + 1, sbox["y"] + sbox["height"] / 2, steps=4)
    page.mouse.up()
    _shows(page, layer="1")
    assert slider.input_value() == "1"
    page.screenshot(path=str(shots / "2-explorer.png"), full_page=True)

    for i, tab in enumerate(["Distance", "Positions", "Architecture"], start=3):
        page.get_by_role("tab", name=tab).click()
        page.wait_for_timeout(500)
        _no_label_covers_a_picture(page)
        page.screenshot(path=str(shots / f"{i}-{tab.lower().replace(' ', '-')}.png"), full_page=True)

    page.get_by_role("tab", name="Compare").click()
    page.locator("#vv-compare-run").click()
    page.wait_for_function("document.querySelector('#vv-compare-2') && document.querySelector('#vv-compare-2').innerText.includes('shapes_p8')")
    page.locator("#vv-compare-distance").scroll_into_view_if_needed()  # below the fold: the picture loads when seen
    page.wait_for_selector("#vv-compare-distance img")
    assert "shapes_p16" in page.locator("#vv-compare-1").inner_text()
    _no_label_covers_a_picture(page)
    page.screenshot(path=str(shots / "6-compare.png"), full_page=True)

    # phone width: nothing wider than the screen
    page.set_viewport_size({"width": 390, "height": 844})
    page.get_by_role("tab", name="Predict").click()
    page.wait_for_timeout(500)
    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    page.screenshot(path=str(shots / "7-phone.png"), full_page=True)
    assert overflow <= 1, f"the page is {overflow}px wider than a phone screen"
    assert len(list(shots.glob("*.png"))) == 7


CONTRAST_JS = (Path(__file__).resolve().parent / "js" / "contrast.js").read_text()


def _open(page, base: str) -> None:
    """The page at `base` from a blank one: the module's one page may still be fetching for the test
    before it, and a navigation over that can be aborted on a loaded machine."""
    page.goto("about:blank")
    page.goto(base)


def _settled(page, quiet_ms: int = 600) -> None:
    """Waits until nothing on the page has been pending for `quiet_ms` in a row (`vitviz.dev.screens.settled`)."""
    from vitviz.dev import screens

    screens.settled(page, quiet_ms)


def _low_contrast(page) -> list[str]:
    """The texts below WCAG AA, once nothing is being computed."""
    _settled(page)
    return page.evaluate(CONTRAST_JS)


def test_the_page_at_a_desk_and_on_a_phone(url, page, tmp_path):
    """1366x900: the explorer's map and controls above the fold once its tab is chosen, the mosaic
    beside the map; 414x896: after Analyse the page has gone to the results, one column, the rollout
    at least 360 px wide with its title clear of the buttons. On both, every text at 4.5:1 at least.
    (docs/screens is made by `python -m vitviz.dev.screens`.)"""
    base, example = url
    screens = tmp_path
    page.set_viewport_size({"width": 1366, "height": 900})
    _open(page, base)
    page.wait_for_selector("#vv-run")
    low = _low_contrast(page)
    page.locator("#vv-image input[type=file]").set_input_files(example)
    _analysed(page, "shapes_p16")
    page.wait_for_selector("#vv-rollout img")
    page.screenshot(path=str(screens / "desktop-predict.png"))
    for tab in ("Predict", "Explain", "Explorer", "Tokens", "Distance", "Positions", "Architecture", "Compare"):
        page.get_by_role("tab", name=tab).click()
        page.wait_for_timeout(400)
        low += [f"{tab}: {x}" for x in _low_contrast(page)]
    page.get_by_role("tab", name="Explorer").click()
    page.wait_for_function("document.querySelector('#vv-explorer-live .vvx').dataset.analysis")
    page.evaluate("window.scrollTo(0, 0)")
    box = page.locator("#vv-explorer-live canvas.vvx-map").bounding_box()
    controls = page.locator("#vv-explorer-live .vvx-controls").bounding_box()
    mosaic = page.locator("#vv-explorer-live canvas.vvx-mosaic").bounding_box()
    assert box["y"] >= 0 and box["y"] + box["height"] <= 900 and controls["y"] + controls["height"] <= 900, (box, controls)
    assert mosaic["x"] >= box["x"] + box["width"] and abs(mosaic["y"] - box["y"]) < 5, (box, mosaic)  # beside, level
    page.screenshot(path=str(screens / "desktop-explorer.png"))

    page.set_viewport_size({"width": 414, "height": 896})
    _open(page, base)
    page.locator("#vv-image input[type=file]").set_input_files(example)
    _analysed(page, "shapes_p16")
    page.wait_for_selector("#vv-rollout img")
    page.wait_for_function("Math.abs(document.querySelector('#vv-results').getBoundingClientRect().top) < 60")
    assert page.evaluate("window.scrollY") > 500  # the results sit under the inputs on a phone: the page went there
    rollout = page.locator("#vv-rollout img").bounding_box()
    predictions = page.locator("#vv-predictions").bounding_box()
    assert rollout["width"] >= 360 and rollout["y"] >= predictions["y"] + predictions["height"] - 1, (rollout, predictions)
    _no_label_covers_a_picture(page)
    assert page.evaluate("document.documentElement.scrollWidth - window.innerWidth") <= 1
    low += [f"phone: {x}" for x in _low_contrast(page)]
    page.screenshot(path=str(screens / "phone-results.png"))
    page.get_by_role("tab", name="Explorer").click()
    page.wait_for_function("document.querySelector('#vv-explorer-live .vvx').dataset.analysis")
    page.locator("#vv-explorer-live .vvx-controls").scroll_into_view_if_needed()
    low += [f"phone explorer: {x}" for x in _low_contrast(page)]
    page.screenshot(path=str(screens / "phone-explorer.png"))
    assert low == [], "\n".join(low)


def _choose(page, label, option):
    page.get_by_label(label).click()
    page.get_by_role("option", name=option).first.click()


def test_the_page_does_what_it_says(url, page, tmp_path, monkeypatch):
    """Each control redraws its picture however it is changed; a menu pick runs one analysis; an
    error reads in full as text and leaves the previous results alone."""
    import urllib.error

    import torch

    from vitviz.server import runtime

    calls = []
    explore = runtime.views.explore
    monkeypatch.setattr(runtime.views, "explore", lambda *a, **k: calls.append(a[2]) or explore(*a, **k))
    base, example = url
    page.set_viewport_size({"width": 1280, "height": 1000})
    _open(page, base)
    page.locator("#vv-image input[type=file]").set_input_files(example)
    _analysed(page, "shapes_p16")
    assert calls == ["shapes_p16"]

    _choose(page, "Model variant", "shapes_p8 ")
    _analysed(page, "shapes_p8")
    page.mouse.click(5, 5)  # leaving the menu must not run it again
    page.wait_for_timeout(1500)
    assert calls == ["shapes_p16", "shapes_p8"], calls

    # keyboard steps redraw, not only a mouse release
    page.get_by_role("tab", name="Explorer").click()
    page.wait_for_function("document.querySelector('#vv-explorer-live .vvx').dataset.analysis")
    layer = page.locator("#vv-explorer-live .vvx-layer")
    layer.focus()
    page.keyboard.press("ArrowLeft")
    _shows(page, layer="5")
    page.keyboard.press("Home")
    _shows(page, layer="1")
    # the map by keyboard: Tab reaches it, arrows move the query patch, Enter pins it, Escape lets go
    canvas = page.locator("#vv-explorer-live canvas.vvx-map")
    canvas.focus()
    assert page.evaluate("document.activeElement.classList.contains('vvx-map')")
    start = int(canvas.get_attribute("data-query"))
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowDown")
    box = page.locator("#vv-explorer-live .vvx")
    (gh, gw), p = map(int, box.get_attribute("data-grid").split("x")), int(box.get_attribute("data-prefix"))
    r, c = divmod(max(0, start - p), gw)
    if start >= p:  # a patch: one step right, one down (at the edges, they stay)
        r, c = min(gh - 1, r + 1), min(gw - 1, c + 1)
    else:  # a prefix token: the first key moves to the first patch, the second one row down
        r, c = min(gh - 1, 1), 0
    _shows(page, query=str(p + r * gw + c))
    page.keyboard.press("Enter")
    page.wait_for_function("document.querySelector('#vv-explorer-live .vvx-query-text').innerText.includes('pinned')")
    page.keyboard.press("Escape")
    page.wait_for_function("!document.querySelector('#vv-explorer-live .vvx-query-text').innerText.includes('pinned')")
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
    assert "$TORCH_HOME/hub/checkpoints" in shown and str(tmp_path) not in shown and "still those of" in shown
    # the menu goes back to the variant that works, so the results on the page are current again
    assert "on shapes_p8." in shown and "The menu is back on shapes_p8" in shown
    page.wait_for_function("document.querySelector('#vv-variant input').value.startsWith('shapes_p8')")
    page.wait_for_timeout(500)
    page.screenshot(path=str(tmp_path / "unavailable.png"), full_page=True)
    assert _src(page, "#vv-rollout") == rollout
    assert page.locator("#vv-predictions").inner_text().strip()
    assert "vv-stale" not in (page.locator("#vv-results").get_attribute("class") or "")
    # an upload the image gate refuses: the results are marked as another image's, the preview cleared
    from PIL import Image

    tiny = tmp_path / "tiny.png"
    Image.new("RGB", (8, 8), (200, 30, 30)).save(tiny)
    page.locator("#vv-image input[type=file]").set_input_files(str(tiny))
    page.wait_for_function("document.querySelector('#vv-notice').innerText.includes('tiny.png')")
    page.wait_for_function("document.querySelector('#vv-results').className.includes('vv-stale')")
    assert page.locator("#vv-image img").count() == 0
    assert float(page.eval_on_selector("#vv-status", "e => getComputedStyle(e).opacity")) < 0.6
    lines = [line.strip() for line in page.locator("body").inner_text().splitlines()]
    assert "Error" not in lines, "an output shows Gradio's error badge"


def _other_model(page, url, name, image=None, viewport=(1280, 1000)):
    """A fresh page: the example (or `image`) analysed by the default model, then by `name` typed in as another model."""
    base, example = url
    page.set_viewport_size({"width": viewport[0], "height": viewport[1]})
    _open(page, base)
    page.locator("#vv-image input[type=file]").set_input_files(image or example)
    _analysed(page, "shapes_p16")
    page.locator("#vv-other textarea, #vv-other input").first.fill(name)
    page.locator("#vv-other-use").click()
    _analysed(page, name)


def test_a_timm_model_named_in_the_page(url, page, offline_hub):
    """A timm model typed into the page (random weights from a Hugging Face cache, offline): it is
    analysed, the page says it has no classifier, and the Tokens tab shows where attention goes."""
    _other_model(page, url, "timm:vit_small_patch16_224.dino")
    assert "no classifier" in page.locator("#vv-predict-note").inner_text()
    assert page.locator("#vv-notice").inner_text().strip() == ""
    page.get_by_role("tab", name="Tokens").click()
    page.wait_for_selector("#vv-received img")
    page.get_by_role("tab", name="Explorer").click()
    page.wait_for_function("document.querySelector('#vv-explorer-live .vvx').dataset.analysis")
    canvas = page.locator("#vv-explorer-live canvas.vvx-map")
    box = canvas.bounding_box()
    canvas.click(position={"x": box["width"] * 0.5 + 2, "y": box["height"] * 0.5 + 2})
    _shows(page, query=str(1 + 7 * 14 + 7))
    assert "patch row 8, column 8" in page.locator("#vv-explorer-live .vvx-query-text").inner_text()


def test_a_rotary_model_in_the_page(url, page, offline_hub):
    """DINOv3 (random weights, offline): rotary positions and 4 registers. The Positions tab shows
    its rotary table and this image's attention by offset in place of a position table's
    similarity; the explorer reads the registers as prefix tokens."""
    _other_model(page, url, "timm:vit_small_patch16_dinov3.lvd1689m")
    assert page.locator("#vv-notice").inner_text().strip() == ""
    page.get_by_role("tab", name="Positions").click()
    page.wait_for_selector("#vv-bias img")
    page.wait_for_selector("#vv-offsets img")
    assert "rotary" in page.locator("#vv-bias-text").inner_text()
    assert not page.locator("#vv-similarity").is_visible()
    page.get_by_role("tab", name="Explorer").click()
    page.wait_for_function("document.querySelector('#vv-explorer-live .vvx').dataset.analysis")
    canvas = page.locator("#vv-explorer-live canvas.vvx-map")
    box = canvas.bounding_box()
    canvas.click(position={"x": box["width"] * 0.5 + 2, "y": box["height"] * 0.5 + 2})
    _shows(page, query=str(5 + 8 * 16 + 8))  # cls and 4 registers before the 16 x 16 patches
    assert "patch row 9, column 9" in page.locator("#vv-explorer-live .vvx-query-text").inner_text()


def _wide_image(folder) -> str:
    """A 2:1 photograph-like picture (300 x 150 px): a gradient and a disc."""
    import numpy as np
    from PIL import Image, ImageDraw

    y, x = np.mgrid[0:150, 0:300]
    img = Image.fromarray(np.stack([x * 255 // 300, y * 255 // 150, np.full_like(x, 90)], -1).astype(np.uint8))
    ImageDraw.Draw(img).ellipse((200, 40, 260, 100), fill=(240, 30, 30))
    path = Path(folder) / "wide.png"
    img.save(path)
    return str(path)


def _tiny_siglip2(root, repo: str) -> None:
    """A SigLIP 2 (NaFlex) of random weights in the Hugging Face cache at `root`: an 8 x 8 table of
    8 px patches, its processor taking at most 32 patches (a 2:1 image: 4 x 8)."""
    import transformers
    from conftest import write_hub_cache

    text = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=100,
                max_position_embeddings=16, projection_size=32, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = dict(num_patches=64, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    model = transformers.Siglip2Model(transformers.Siglip2Config(text_config=text, vision_config=vision))
    snap = write_hub_cache(root, repo, {})
    model.save_pretrained(snap)
    transformers.Siglip2ImageProcessorPil(patch_size=8, max_num_patches=32).save_pretrained(snap)


def _ratio(page, selector) -> float:
    """Width over height of a picture as the page holds it (an img's natural size, a canvas's own)."""
    return page.locator(selector).first.evaluate("e => e.tagName === 'CANVAS' ? e.width / e.height : e.naturalWidth / e.naturalHeight")


def test_a_2_to_1_image_keeps_its_shape_in_every_view(url, page, offline_hub, tmp_path):
    """A 2:1 image on a NaFlex SigLIP 2 (random weights from a Hugging Face cache, offline) and on
    DINOv3 fed whole images ("@whole"): the grid is twice as wide as tall, the explorer works on it
    (a click reads the patch under it), the patch grid and the feature map keep the image's shape,
    every tab is drawn whole, and DINOv3's Positions tab shows its rotary table."""
    from huggingface_hub import constants

    from vitviz.dev import screens

    _tiny_siglip2(constants.HF_HUB_CACHE, "vitviz-test/tiny-siglip2-wide")
    wide = _wide_image(tmp_path)
    # (the model, its first patch's query: after its prefix tokens and a pooled query, its grid, rotary positions)
    for name, first, grid, rotary in [("hf:vitviz-test/tiny-siglip2-wide", 1, (4, 8), False),
                                      ("timm:vit_small_patch16_dinov3.lvd1689m@whole", 5, None, True)]:
        _other_model(page, url, name, image=wide, viewport=(1366, 900))
        assert page.locator("#vv-notice").inner_text().strip() == ""
        page.get_by_role("tab", name="Explorer").click()
        page.wait_for_function("document.querySelector('#vv-explorer-live .vvx').dataset.analysis")
        gh, gw = map(int, page.locator("#vv-explorer-live .vvx").get_attribute("data-grid").split("x"))
        assert (gh, gw) == grid if grid else 1.8 <= gw / gh <= 2.2, (name, gh, gw)
        assert abs(_ratio(page, "#vv-explorer-live canvas.vvx-map") - gw / gh) < 1e-6
        canvas = page.locator("#vv-explorer-live canvas.vvx-map")
        box = canvas.bounding_box()
        canvas.click(position={"x": box["width"] * (gw - 0.5) / gw, "y": box["height"] * 0.5 / gh})  # the top-right patch
        _shows(page, query=str(first + gw - 1))
        assert f"patch row 1, column {gw}" in page.locator("#vv-explorer-live .vvx-query-text").inner_text()
        found = []
        for label in [t.inner_text().strip() for t in page.get_by_role("tab").all()]:
            page.get_by_role("tab", name=label, exact=True).click()
            screens.settled(page)
            if label == "Architecture":
                assert abs(_ratio(page, "#vv-grid img") - gw / gh) < 0.02
            if label == "Tokens":
                page.wait_for_selector("#vv-features img")
                assert abs(_ratio(page, "#vv-features img") - gw / gh) < 0.02
            if label == "Positions" and rotary:
                page.wait_for_selector("#vv-bias img")
                assert "rotary" in page.locator("#vv-bias-text").inner_text()
            found += [f"{name} {label}: {p}" for p in screens.problems(page)]
        assert found == [], "\n".join(found)


def _canvas(page, selector):
    """A canvas's pixels, as the page holds them: uint8 [H, W, 3]."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    data = page.locator(selector).evaluate("c => c.toDataURL('image/png')")
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(data.split(",", 1)[1]))).convert("RGB"))


def _explorer(page, name):
    _analysed(page, name)
    page.get_by_role("tab", name="Explorer").click()
    page.wait_for_function("document.querySelector('#vv-explorer-live .vvx').dataset.analysis")
    return page.locator("#vv-explorer-live .vvx").get_attribute("data-analysis")


def _shows(page, **want):
    """Waits until the explorer's map says it shows `want` (its data-* attributes)."""
    checks = " && ".join(f"c.dataset.{k} === {str(v)!r}" for k, v in want.items())
    page.wait_for_function(f"(() => {{ const c = document.querySelector('#vv-explorer-live canvas.vvx-map'); return {checks}; }})()")


def _grab(page, layer, head, query, scale):
    """The page's map and mosaic once they show this view: (the view, map pixels, mosaic pixels)."""
    _shows(page, layer=layer, head=head, query=query, scale=scale)
    return (layer, head, query, scale), _canvas(page, "#vv-explorer-live canvas.vvx-map"), _canvas(page, "#vv-explorer-live canvas.vvx-mosaic")


def _same_as_server(exp, grabbed):
    """The page's map and every head's tile (`_grab`) are the server's pictures of that view of `exp`."""
    import numpy as np

    from vitviz.server.pictures import views

    (layer, head, query, scale), got, mosaic = grabbed
    side, tile = exp.display_image.size[0], views.mosaic_tile_px(exp.analysis.grid)
    want = np.asarray(views.render_query(exp, layer=layer, head=head, query=query, scale=scale))[:, :side]
    assert got.shape == want.shape and np.array_equal(got, want), (layer, head, query, scale, np.abs(got.astype(int) - want).max())
    server = np.asarray(views.render_head_mosaic(exp, layer=layer, query=query, scale=scale))
    heads = exp.analysis.attentions.shape[1]
    cols = int(np.ceil(np.sqrt(heads)))
    for h in range(heads):  # the tiles (the labels beneath are text, drawn by each side's own fonts)
        x, y = (h % cols) * (tile + 6), (h // cols) * (tile + 16 + 6)
        assert np.array_equal(mosaic[y : y + tile, x : x + tile], server[y : y + tile, x : x + tile]), (layer, query, h)


def test_the_browser_draws_the_servers_pixels(url, page, monkeypatch):
    """Hover, click-to-pin, keyboard layer steps, a head and the colour scale, each drawn in the
    browser, are the pictures the server draws for the same view (map and every head's tile)."""
    from vitviz.server.app import SERVER
    from vitviz.server import runtime

    base, example = url
    page.set_viewport_size({"width": 1280, "height": 1000})
    _open(page, base)
    page.locator("#vv-image input[type=file]").set_input_files(example)
    key = _explorer(page, "shapes_p16")
    exp = SERVER.store.get(key)

    def grab(*view):
        return _grab(page, *view)

    def same_as_server(*view, grabbed=None):
        _same_as_server(exp, grabbed or grab(*view))

    same_as_server(6, "mean", 0, "layer")  # the default: map and mosaic on one colour bar for the layer
    canvas = page.locator("#vv-explorer-live canvas.vvx-map")
    box = canvas.bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.4, box["y"] + box["height"] * 0.6)  # hover: patch row 4, column 3
    same_as_server(6, "mean", 1 + 3 * 6 + 2, "layer")
    page.mouse.click(box["x"] + box["width"] * 0.9, box["y"] + box["height"] * 0.1)  # pin: row 1, column 6
    page.mouse.move(box["x"] + box["width"] * 0.1, box["y"] + box["height"] * 0.9)  # a pinned query stays
    same_as_server(6, "mean", 6, "layer")
    assert "pinned" in page.locator("#vv-explorer-live .vvx-query-text").inner_text()
    page.locator("#vv-explorer-live .vvx-scale").select_option(value="map")
    same_as_server(6, "mean", 6, "map")
    page.locator("#vv-explorer-live .vvx-layer").focus()
    for layer in (5, 4):
        page.keyboard.press("ArrowLeft")
        same_as_server(layer, "mean", 6, "map")
    page.locator("#vv-explorer-live .vvx-head").select_option(label="head 2")
    same_as_server(4, "head 2", 6, "map")
    page.locator("#vv-explorer-live .vvx-scale").select_option(value="shared")
    same_as_server(4, "head 2", 6, "shared")
    page.locator("#vv-explorer-live .vvx-token", has_text="cls").click()
    same_as_server(4, "head 2", 0, "shared")

    # a new image with the explorer on the page: its explorer comes as soon as the forward has
    # written it, before the analysis' outputs (`vitviz.server.early`), and draws the same pixels
    page.locator("#vv-explorer-live .vvx-scale").select_option(value="layer")
    publish = SERVER.early.publish

    def publish_then_hold(ticket, step, value):  # the outputs held back a while: on a busy machine a small
        publish(ticket, step, value)  # model's outputs can overtake the early explorer (then the page takes
        if step == "explorer":  # them, as it should); here the early path itself is under test
            time.sleep(3)

    monkeypatch.setattr(SERVER.early, "publish", publish_then_hold)
    page.mouse.move(0, 0)  # off the map: the first view is token 0's
    held = []  # the new explorer file's range requests, held until the first views are checked

    def hold(route):
        held.append(route)
        page.evaluate("n => { window.__vvHeld = n; }", len(held))

    page.route("**/*-stack.bin*", hold)
    page.locator("#vv-image input[type=file]").set_input_files(runtime.EXAMPLES[-1])
    root = "document.querySelector('#vv-explorer-live .vvx').dataset"
    page.wait_for_function(f"{root}.analysis && {root}.analysis !== {key!r}")
    assert page.locator("#vv-explorer-live .vvx").get_attribute("data-source") == "early"
    new_key = page.locator("#vv-explorer-live .vvx").get_attribute("data-analysis")
    # drawn from the inline first view alone (token 0's rows of the last layer): the file's requests are held
    first_view = grab(6, "mean", 0, "layer")
    page.mouse.move(box["x"] + box["width"] * 0.7, box["y"] + box["height"] * 0.3)  # another query: waits for the whole layer
    page.wait_for_function("n => window.__vvHeld >= n", arg=1)
    page.locator("#vv-explorer-live .vvx-token", has_text="cls").click()  # meanwhile token 0 again, pinned: drawn at once
    pinned = grab(6, "mean", 0, "layer")
    assert "pinned" in page.locator("#vv-explorer-live .vvx-query-text").inner_text()
    for request in held:
        request.continue_()
    page.unroute("**/*-stack.bin*")
    page.wait_for_function(f"{root}.complete === {new_key!r}")  # every layer in, from the range requests after the first view
    page.wait_for_timeout(300)  # the hover's draw, its layer in, is not drawn over the newer view
    assert page.locator("#vv-explorer-live canvas.vvx-map").get_attribute("data-query") == "0"
    page.locator("#vv-explorer-live canvas.vvx-map").focus()
    page.keyboard.press("Escape")  # let go of the pin; a hover now draws from the whole layer
    page.mouse.move(box["x"] + box["width"] * 0.7 + 2, box["y"] + box["height"] * 0.3)
    hovered = grab(6, "mean", 1 + 1 * 6 + 4, "layer")
    deadline = time.monotonic() + 60
    while SERVER.store.get(new_key) is None and time.monotonic() < deadline:  # the outputs, after the hold
        time.sleep(0.1)
    _analysed(page, "shapes_p16")
    exp = SERVER.store.get(new_key)
    assert exp is not None and SERVER.store.get(key) is None  # the page's analysis now: the one before is let go
    same_as_server(grabbed=first_view)
    same_as_server(grabbed=pinned)
    same_as_server(grabbed=hovered)
    page.locator("#vv-explorer-live .vvx-token", has_text="cls").click()
    same_as_server(6, "mean", 0, "layer")
    page.locator("#vv-explorer-live .vvx-layer").focus()
    page.keyboard.press("ArrowLeft")
    same_as_server(5, "mean", 0, "layer")


def _img(page, selector):
    """An image's pixels as the page decoded them: uint8 [H, W, 3]."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    page.wait_for_function(f"(() => {{ const i = document.querySelector({selector!r}); return i && i.complete && i.naturalWidth > 0; }})()")
    data = page.locator(selector).evaluate(
        """i => { const c = document.createElement('canvas'); [c.width, c.height] = [i.naturalWidth, i.naturalHeight];
                  c.getContext('2d').drawImage(i, 0, 0); return c.toDataURL('image/png'); }"""
    )
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(data.split(",", 1)[1]))).convert("RGB"))


def test_an_explorer_over_the_browsers_budget(url, page, monkeypatch):
    """Attention over what the browser is sent at once. shapes_p8 at 288 px (1297 tokens: 8.4 MB a
    layer, 51 MB in all, over the 24 MB) goes a layer at a time: a layer's own file is written when
    the page first shows it, and the page draws the server's pixels from it. With not even one layer
    within the budget (set smaller here), the explorer says so and the server draws its views, which
    follow a click on them."""
    from vitviz.server.app import SERVER
    import numpy as np

    from vitviz import cost, get_spec
    from vitviz.server import runtime

    from vitviz.server.pictures import explorer_data, views
    asked = []  # the page's calls for a layer's file
    write_layer = explorer_data.write_layer
    monkeypatch.setattr(explorer_data, "write_layer", lambda exp, **kw: (asked.append(kw["layer"]), write_layer(exp, **kw))[1])
    _other_model(page, url, "shapes_p8@288")
    key = _explorer(page, "shapes_p8@288")
    exp = SERVER.store.get(key)
    assert explorer_data.layout_of(exp.analysis).mode == "layers"

    def files():
        return sorted(p.name.removeprefix(key + "-") for p in SERVER.explorer_dir.glob(f"{key}-*.bin"))

    _same_as_server(exp, _grab(page, 6, "mean", 0, "layer"))
    assert files() == ["layer6.bin"]  # the layer shown first, and no file of the whole stack
    canvas = page.locator("#vv-explorer-live canvas.vvx-map")
    box = canvas.bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.4, box["y"] + box["height"] * 0.6)  # hover: patch row 22, column 15
    query = 1 + 21 * 36 + 14
    _same_as_server(exp, _grab(page, 6, "mean", query, "layer"))
    page.mouse.click(box["x"] + box["width"] * 0.4, box["y"] + box["height"] * 0.6)  # pinned, while the layer changes
    page.locator("#vv-explorer-live .vvx-layer").focus()
    page.keyboard.press("ArrowLeft")
    _same_as_server(exp, _grab(page, 5, "mean", query, "layer"))
    page.locator("#vv-explorer-live .vvx-scale").select_option(value="shared")  # over all layers: the maxima in each file
    page.locator("#vv-explorer-live .vvx-head").select_option(label="head 2")
    _same_as_server(exp, _grab(page, 5, "head 2", query, "shared"))
    assert files() == ["layer5.bin", "layer6.bin"] and asked == [6, 5]  # each asked for once
    # a dragged slider passes layers 4 to 2 on its way to 1: only the layer it stays on is asked for
    page.evaluate("""() => { const s = document.querySelector('#vv-explorer-live .vvx-layer');
                             for (const v of [4, 3, 2, 1]) { s.value = String(v); s.dispatchEvent(new Event('input')); } }""")
    _same_as_server(exp, _grab(page, 1, "head 2", query, "shared"))
    assert asked == [6, 5, 1]

    # a new analysis whose first layer is refused (the server busy): the explorer of the one before is
    # not shown beside its results, and the layer is asked for again until it comes
    from vitviz.server.guards.work import Busy

    busy = [True]

    def refused(exp, **kw):
        asked.append(kw["layer"])
        if busy[0] == "gone":  # refused for good
            raise runtime.error("This analysis is no longer kept: analyse the image again.")
        if busy[0]:  # as the job's wait for memory ends
            raise Busy("The server is busy with other requests: try again in a moment.")
        return write_layer(exp, **kw)

    monkeypatch.setattr(explorer_data, "write_layer", refused)
    page.locator("#vv-image input[type=file]").set_input_files(runtime.EXAMPLES[-1])
    _says(page, "#vv-explorer-live .vvx-status", "trying again")
    assert "vvx-off" in page.locator("#vv-explorer-live .vvx").get_attribute("class")
    page.evaluate("""() => { const s = document.querySelector('#vv-explorer-live .vvx-layer');
                             s.value = '3'; s.dispatchEvent(new Event('input')); }""")  # a view asked for meanwhile
    page.wait_for_timeout(2 * 150 + 100)
    assert "trying again" in page.locator("#vv-explorer-live .vvx-status").inner_text()  # nothing drawn from the one before
    assert page.locator("#vv-explorer-live canvas.vvx-map").get_attribute("data-layer") == "1"
    _analysed(page, "shapes_p8@288")
    busy[0] = False
    root = "document.querySelector('#vv-explorer-live .vvx').dataset"
    page.wait_for_function(f"{root}.analysis && {root}.analysis !== {key!r}")
    assert "vvx-off" not in page.locator("#vv-explorer-live .vvx").get_attribute("class")
    again = SERVER.store.get(page.locator("#vv-explorer-live .vvx").get_attribute("data-analysis"))
    _same_as_server(again, _grab(page, 6, "mean", 0, "shared"))  # (the colour scale chosen stays)
    assert asked[3:-1] and set(asked[3:]) == {6}  # refused, then asked again
    # a layer refused while browsing is asked for again while the view stays on it
    busy[0], before = True, len(asked)
    page.evaluate("""() => { const s = document.querySelector('#vv-explorer-live .vvx-layer');
                             s.value = '4'; s.dispatchEvent(new Event('input')); }""")
    _says(page, "#vv-explorer-live .vvx-status", "Layer 4 could not be fetched yet")
    busy[0] = False
    _same_as_server(again, _grab(page, 4, "mean", 0, "shared"))
    assert asked[before:-1] and set(asked[before:]) == {4}
    assert page.locator("#vv-explorer-live .vvx-status").inner_text() == ""
    # one refused for good is not asked for again: the page says why
    busy[0], before = "gone", len(asked)
    page.evaluate("""() => { const s = document.querySelector('#vv-explorer-live .vvx-layer');
                             s.value = '2'; s.dispatchEvent(new Event('input')); }""")
    _says(page, "#vv-explorer-live .vvx-status", "This analysis is no longer kept")
    page.wait_for_timeout(1500)
    assert asked[before:] == [2]
    # a new analysis' first layer refused for good: the one before is not left beside its results
    page.locator("#vv-explorer-live .vvx-status").evaluate("e => { e.textContent = ''; }")
    page.locator("#vv-image input[type=file]").set_input_files(runtime.EXAMPLES[0])
    _says(page, "#vv-explorer-live .vvx-status", "This analysis is no longer kept")
    assert "vvx-off" in page.locator("#vv-explorer-live .vvx").get_attribute("class")
    _analysed(page, "shapes_p8@288")
    busy[0] = False

    # not even one layer within the budget: the server's explorer
    layout = explorer_data.layout_of(exp.analysis)
    small = cost.explorer_layout_of(get_spec("shapes_p16"))
    monkeypatch.setattr(cost, "BROWSER_BYTES", 4 * small.tokens + small.layer_bytes - 1)
    assert layout.layer_bytes > cost.BROWSER_BYTES
    _open(page, url[0])
    page.locator("#vv-image input[type=file]").set_input_files(runtime.EXAMPLES[-1])
    _analysed(page, "shapes_p16")
    page.get_by_role("tab", name="Explorer").click()
    _says(page, "#vv-explorer-live", "too large to hold in the browser")
    assert "vvx-off" in page.locator("#vv-explorer-live .vvx").get_attribute("class")
    (key,) = [k for k, (e, _, _) in SERVER.store._entries.items() if getattr(getattr(e, "analysis", None), "variant", None) == "shapes_p16"][-1:]
    exp = SERVER.store.get(key)
    assert explorer_data.layout_of(exp.analysis).mode == "server" and not list(SERVER.explorer_dir.glob(f"{key}-*"))

    def near(got, query):
        """Mean difference from the server's picture of `query` (the page's is a JPEG of it)."""
        want = np.asarray(views.render_query(exp, layer=6, head="mean", query=query, scale="layer"))
        assert got.shape == want.shape, (got.shape, want.shape)
        return np.abs(got.astype(int) - want).mean()

    first = _img(page, "#vv-explorer img")
    assert near(first, 0) < 2.0 < near(first, 6)
    side = exp.display_image.size[0]
    shown = page.locator("#vv-explorer img").bounding_box()
    at = shown["width"] * side / first.shape[1]  # the map's width on screen (a colour bar beside it)
    before = page.locator("#vv-explorer img").get_attribute("src")
    page.mouse.click(shown["x"] + at * 0.9, shown["y"] + shown["height"] * 0.1)  # patch row 1, column 6
    _says(page, "#vv-query", "row 1, column 6")
    page.wait_for_function(f"document.querySelector('#vv-explorer img').getAttribute('src') !== {before!r}")
    clicked = _img(page, "#vv-explorer img")
    assert near(clicked, 6) < 2.0 < near(clicked, 0)


def _no_label_covers_a_picture(page):
    """Every figure's label sits outside its picture (boxes as laid out on screen)."""
    overlaps = page.evaluate(
        """() => [...document.querySelectorAll('.vv-figure')].filter(f => f.offsetParent !== null).flatMap(f => {
            const label = f.querySelector('[data-testid=block-label]'), img = f.querySelector('img');
            if (!label || !img) return [];
            const a = label.getBoundingClientRect(), b = img.getBoundingClientRect();
            const overlap = a.left < b.right && b.left < a.right && a.top < b.bottom && b.top < a.bottom;
            return overlap ? [(f.id || label.innerText) + ' ' + JSON.stringify([a.top, a.bottom, b.top, b.bottom, a.left, a.right, b.left, b.right])] : [];
        })"""
    )
    assert overlaps == [], f"labels over pictures: {overlaps}"


def _says(page, selector, text):
    """Waits until the element exists (a tab mounts when first shown) and its text includes `text`."""
    page.wait_for_function(f"(document.querySelector({selector!r})?.innerText ?? '').includes({text!r})")


def _downloads(page, selector):
    return page.locator(f"{selector} a[download]").first.get_attribute("download")


def test_a_person_asks_why_this_class(url, page, tmp_path_factory):
    """Click a prediction, type another class, switch the colour scale, measure faithfulness, then
    the Tokens tab: DINO's share and a click on the features. Labels never cover a picture; every
    picture has its colour bar; downloads say what they show."""
    from PIL import Image

    from vitviz.plots import COLORBAR_PX

    shots = tmp_path_factory.mktemp("why")
    base, example = url
    page.set_viewport_size({"width": 1280, "height": 1000})
    _open(page, base)
    page.locator("#vv-image input[type=file]").set_input_files(example)
    _analysed(page, "shapes_p16")
    # the analysis' own chain (the explorer's data, then the tab on show) has finished: a class clicked
    # while it runs can still be redrawn for the top-1 by it (see docs/serving.md)
    page.wait_for_timeout(2500)
    second = page.locator("#vv-predictions button.confidence-set").nth(1)
    label = second.locator("dt").inner_text().strip()
    second.click()  # a prediction clicked: the Explain tab, for that class
    _says(page, "#vv-explain-note", label)
    page.wait_for_selector("#vv-explain-gradient img")
    assert page.locator("#vv-explain-note").inner_text().startswith(f"Explaining {label}")
    for method in ("attention", "rollout", "gradient", "grad_rollout"):
        name = _downloads(page, f"#vv-explain-{method}")
        assert name.startswith(f"shapes_p16-explain-{method}-{label}."), name
    _no_label_covers_a_picture(page)
    page.screenshot(path=str(shots / "explain.png"), full_page=True)

    # a class typed into the picker
    typed = "circle" if label != "circle" else "square"
    box = page.locator("#vv-class input")
    box.click()
    box.fill(typed)
    page.get_by_role("option", name=typed, exact=True).click()
    _says(page, "#vv-explain-note", typed)
    page.wait_for_function(f"document.querySelector('#vv-explain-rollout a[download]').download.includes({typed!r})")

    # one colour scale for all four methods: the pictures change, and each keeps its colour bar
    before = _src(page, "#vv-explain-gradient")
    page.locator("#vv-explain-scale").get_by_label("shared").check()
    page.wait_for_function(
        f"(() => {{ const i = document.querySelector('#vv-explain-gradient img'); return i && i.src !== {before!r} && i.complete && i.naturalWidth > 0; }})()"
    )
    size = page.locator("#vv-explain-gradient img").evaluate("i => [i.naturalWidth, i.naturalHeight]")
    assert size[0] >= size[1] + COLORBAR_PX - 2, f"no colour bar beside the map: {size}"

    page.locator("#vv-faith-run").click()
    page.wait_for_selector("#vv-faith img")
    table = page.locator("#vv-faith-table").inner_text()
    for row in ("attention", "rollout", "gradient", "grad_rollout", "random"):
        assert row in table
    _no_label_covers_a_picture(page)
    page.screenshot(path=str(shots / "faithfulness.png"), full_page=True)

    page.get_by_role("tab", name="Tokens").click()
    page.wait_for_selector("#vv-dino img")
    page.wait_for_selector("#vv-features img")
    before = _src(page, "#vv-dino")
    page.locator("#vv-dino-share input[type=range]").focus()
    page.keyboard.press("ArrowLeft")
    page.wait_for_function(f"document.querySelector('#vv-dino img').src !== {before!r}")
    assert _downloads(page, "#vv-dino").startswith("shapes_p16-dino-heads-share0.55."), _downloads(page, "#vv-dino")
    features = page.locator("#vv-features img")
    fbox = features.bounding_box()
    features.click(position={"x": fbox["width"] * 0.25, "y": fbox["height"] * 0.25})
    page.wait_for_selector("#vv-feature-similarity img")
    _no_label_covers_a_picture(page)
    page.screenshot(path=str(shots / "tokens.png"), full_page=True)
    for shot in shots.glob("*.png"):
        assert Image.open(shot).size[0] == 1280


def test_a_person_types_two_phrases_and_gets_two_maps(url, page):
    """shapes_clip from the menu; in the Find tab two phrases, comma-separated: two maps, each titled
    by its phrase and similarity, the other slots hidden. A plain ViT hides the tab's content behind
    one line saying why."""
    base, example = url
    page.set_viewport_size({"width": 1280, "height": 1000})
    _open(page, base)
    page.locator("#vv-image input[type=file]").set_input_files(example)
    _analysed(page, "shapes_p16")
    page.get_by_role("tab", name="Find").click()
    page.wait_for_function("document.querySelector('#vv-find-lacks') && document.querySelector('#vv-find-lacks').innerText.includes('has no text tower')")
    _choose(page, "Model variant", "shapes_clip ")
    _analysed(page, "shapes_clip")
    page.get_by_role("tab", name="Find").click()
    box = page.locator("#vv-phrases textarea, #vv-phrases input").first
    box.fill("a red star, a blue circle")
    page.locator("#vv-find-run").click()
    page.wait_for_selector("#vv-find-2 img")
    _settled(page)
    for k, phrase in ((1, "a red star"), (2, "a blue circle")):
        slot = page.locator(f"#vv-find-{k}")
        assert phrase in slot.inner_text(), slot.inner_text()  # the label names the phrase and its similarity
        size = slot.locator("img").evaluate("i => [i.naturalWidth, i.naturalHeight]")
        assert size[0] > size[1] > 0
    assert not page.locator("#vv-find-3").is_visible() and not page.locator("#vv-find-4").is_visible()
    assert "closest to" in page.locator("#vv-find-note").inner_text()


def test_clicking_an_example_analyses_it(url, page):
    """An example's click fills the image and analyses it, as an upload does (one request)."""
    base, _ = url
    _open(page, base)
    page.locator("#vv-examples button").first.click()
    _analysed(page, "shapes_p16")
    assert page.locator("#vv-predictions").inner_text().strip()
    assert page.locator("#vv-rollout img").count() == 1


def test_a_person_patches_a_covered_patch(url, page):
    """The Patch tab: a patch of the analysed image clicked and covered, Patch run; the layer x token
    and layer x head maps drawn, and a click on the first shows the patched run's top-5."""
    base, example = url
    page.set_viewport_size({"width": 1280, "height": 1000})
    _open(page, base)
    page.locator("#vv-image input[type=file]").set_input_files(example)
    _analysed(page, "shapes_p16")
    page.get_by_role("tab", name="Patch", exact=True).click()
    page.wait_for_selector("#vv-patch-clean img")
    page.locator("#vv-patch-mode").get_by_label("Cover a patch").check()
    clean = page.locator("#vv-patch-clean img")
    box = clean.bounding_box()
    clean.click(position={"x": box["width"] * 2.5 / 6, "y": box["height"] * 3.5 / 6})  # the 6x6 grid's row 4, column 3
    page.wait_for_function("document.querySelector('#vv-patch-row input').value === '4' && "
                           "document.querySelector('#vv-patch-col input').value === '3'")
    _settled(page)
    page.locator("#vv-patch-run").click()
    _says(page, "#vv-patch-note", "LD clean")
    for figure in ("#vv-patch-tokens", "#vv-patch-heads"):
        page.wait_for_function(f"(() => {{ const i = document.querySelector('{figure} img'); return i && i.complete && i.naturalWidth > 0; }})()")
        size = page.locator(f"{figure} img").evaluate("i => [i.naturalWidth, i.naturalHeight]")
        assert size[0] > 0 and size[1] > 0, (figure, size)
    assert "row 4, column 3 covered" in page.locator("#vv-patch-note").inner_text()
    tokens = page.locator("#vv-patch-tokens img")
    tokens.scroll_into_view_if_needed()
    tbox = tokens.bounding_box()
    tokens.click(position={"x": tbox["width"] * 0.45, "y": tbox["height"] * 0.5})  # a patch's column, a middle layer
    _says(page, "#vv-patch-site", "Patched")
    top5 = page.locator("#vv-patch-top5")
    assert top5.is_visible() and top5.inner_text().strip()
    _no_label_covers_a_picture(page)


def test_a_person_clicks_a_patch_then_a_feature(url, page):
    """The Concepts tab on shapes_p16's embedded sparse autoencoder: a click on a patch lists its
    strongest features with where each fires most; a click on the second of them draws it over the
    image and shows the top-5 with it switched off."""
    base, example = url
    page.set_viewport_size({"width": 1280, "height": 1000})
    _open(page, base)
    page.locator("#vv-image input[type=file]").set_input_files(example)
    _analysed(page, "shapes_p16")
    page.get_by_role("tab", name="Concepts", exact=True).click()
    page.wait_for_selector("#vv-concepts-image img")
    _says(page, "#vv-concepts-note", "Feature")
    image = page.locator("#vv-concepts-image img")
    box = image.bounding_box()
    image.click(position={"x": box["width"] * 2.5 / 6, "y": box["height"] * 3.5 / 6})  # the 6x6 grid's row 4, column 3
    page.wait_for_function("document.querySelector('#vv-concepts-row input').value === '4' && "
                           "document.querySelector('#vv-concepts-col input').value === '3'")
    _settled(page)
    cell = page.locator("#vv-concepts-table [data-testid='cell-1-0']")  # the second feature's number
    feature = cell.inner_text().strip()
    assert feature.isdigit()
    cell.click()
    page.wait_for_function(f"document.querySelector('#vv-concepts-feature input').value === {feature!r}")
    _says(page, "#vv-concepts-note", f"Feature {feature}")
    _says(page, "#vv-concepts-note", "Switched off")
    for figure in ("#vv-concepts-map", "#vv-concepts-examples", "#vv-concepts-feature-examples"):
        page.wait_for_function(f"(() => {{ const i = document.querySelector('{figure} img'); return i && i.complete && i.naturalWidth > 0; }})()")
    assert f"feature{feature}" in page.locator("#vv-concepts-map img").get_attribute("src")
    top5 = page.locator("#vv-concepts-ablated")
    assert top5.is_visible() and top5.inner_text().strip()
    _settled(page)
    _no_label_covers_a_picture(page)


def test_a_person_asks_the_image_and_picks_a_word(url, page, tmp_path):
    """shapes_vlm from the menu, a scene uploaded; in the Ask tab a question: the answer, its words as
    choices, and the first word's map; another word and the attention of one layer redraw the map.
    A plain ViT hides the tab's content behind one line saying why."""
    from PIL import Image

    from vitviz.shapes import render_scene

    base, example = url
    image, objects, _ = render_scene(seed=4000, index=3)
    scene = tmp_path / "scene.png"
    Image.fromarray(image).save(scene)
    page.set_viewport_size({"width": 1280, "height": 1000})
    _open(page, base)
    page.locator("#vv-image input[type=file]").set_input_files(example)
    _analysed(page, "shapes_p16")
    page.get_by_role("tab", name="Ask", exact=True).click()
    _says(page, "#vv-ask-lacks", "is not a vision–language model")
    _choose(page, "Model variant", "shapes_vlm ")
    page.locator("#vv-image input[type=file]").set_input_files(str(scene))
    _analysed(page, "shapes_vlm")
    page.get_by_role("tab", name="Ask", exact=True).click()
    page.locator("#vv-ask-question textarea").fill("where is the {} {} ?".format(*objects[0]))
    page.locator("#vv-ask-run").click()
    _says(page, "#vv-ask-answer", "shapes_vlm")
    page.wait_for_function("(() => { const i = document.querySelector('#vv-ask-map img'); return i && i.complete && i.naturalWidth > 0; })()")
    first = _src(page, "#vv-ask-map")
    words = page.locator("#vv-ask-word label")
    assert words.count() >= 3, words.count()  # the whole answer and its words
    words.nth(2).click()
    page.wait_for_function(f"document.querySelector('#vv-ask-map img')?.getAttribute('src') !== {first!r}")
    second = _src(page, "#vv-ask-map")
    page.locator("#vv-ask-method").get_by_label("Attention").check()
    page.wait_for_function(f"document.querySelector('#vv-ask-map img')?.getAttribute('src') !== {second!r}")
    assert page.locator("#vv-ask-layer").is_visible()
    _says(page, "#vv-ask-top", "Image tokens that count most")
    _settled(page)
    _no_label_covers_a_picture(page)


def _clip_in_the_video_tab(page, url, tmp_path):
    """A GIF of a shape moving right uploaded in the Video tab and run: the prediction, the frame strip and
    the GIF to download appear."""
    from PIL import Image

    from vitviz.server.tabs import TABS
    from vitviz.video.shapes import MOTIONS, generate_clips

    if TABS.by_id("video") is None or TABS.by_id("video").page is None:
        pytest.skip("the Video tab is not on the page (vitviz/server/tabs/__init__.py registers it)")
    frames = next(f[0] for f, labels, _ in (generate_clips(1, 9001, i) for i in range(200)) if MOTIONS[int(labels[0])] == "right")
    clip = tmp_path / "right.gif"
    pictures = [Image.fromarray(f) for f in frames]
    pictures[0].save(clip, save_all=True, append_images=pictures[1:], duration=100, loop=0)
    base, _ = url
    page.set_viewport_size({"width": 1280, "height": 1000})
    _open(page, base)
    page.get_by_role("tab", name="Video", exact=True).click()
    page.locator("#vv-video-clip input[type=file]").set_input_files(str(clip))
    _settled(page)
    page.locator("#vv-video-run").click()
    loaded = "(() => { const i = document.querySelector('%s img'); return i && i.complete && i.naturalWidth > 0; })()"
    page.wait_for_function(loaded % "#vv-video-strip")
    _says(page, "#vv-video-prediction", "right")
    strip = page.locator("#vv-video-strip img").evaluate("i => [i.naturalWidth, i.naturalHeight]")
    assert strip[0] >= 8 * 192 and strip[1] >= 192, strip
    assert page.locator("#vv-video-gif a").first.get_attribute("href"), "no GIF to download"


def _video_view(page, **want):
    """Waits until the Video tab's explorer says it shows `want` (its frame's data-* attributes)."""
    checks = " && ".join(f"c.dataset.{k} === {str(v)!r}" for k, v in want.items())
    page.wait_for_function(f"(() => {{ const c = document.querySelector('#vv-video-live canvas.vvv-shown'); return c && {checks}; }})()")


def _video_drawn(page, value, *, frame, layer, row, col):
    """The explorer's shown frame and strip, once they show this view, are what the payload `value` gives:
    the frame as the server's query picture draws it (`SCALE` times, the patch framed 2 px inside), and
    each of the strip's frames `video_explorer.strip_tiles` (the decoded row, one colour scale). Returns
    the strip's pixels."""
    import numpy as np
    from PIL import ImageDraw

    from vitviz.server.pictures import video_explorer
    from vitviz.server.tabs import video

    _video_view(page, frame=frame, layer=layer, row=row, col=col)
    t, h, w = value["grid"]
    query = (frame - 1) // value["tubelet"] * h * w + (row - 1) * w + col - 1
    frames = video_explorer.read_frames(value)
    shown = frames[frame - 1].resize((96 * video.SCALE,) * 2, resample=0)
    k = video.SCALE * 16
    ImageDraw.Draw(shown).rectangle(((col - 1) * k, (row - 1) * k, col * k - 1, row * k - 1), outline="#00e5ff", width=2)
    got = _canvas(page, "#vv-video-live canvas.vvv-shown")
    assert np.array_equal(got, np.asarray(shown)), (frame, row, col)
    strip = _canvas(page, "#vv-video-live canvas.vvv-strip")
    for i, tile in enumerate(video_explorer.strip_tiles(value, layer=layer - 1, query=query)):
        x = i * (96 + 6)
        want = np.asarray(tile)
        assert np.array_equal(strip[:96, x : x + 96], want), (frame, layer, row, col, i, np.abs(strip[:96, x : x + 96].astype(int) - want).max())
    return strip


def test_a_person_runs_a_clip_in_the_video_tab(url, page, tmp_path, monkeypatch):
    """The Video tab: a GIF of a shape moving right run; its explorer, drawn in the browser from the run's
    payload, shows the run's query patch; the frame slider moved by keyboard, the layer slider dragged,
    a patch of the shown frame hovered and a click that pins it each redraw the frame and the strip of
    the patch's attention over every frame, pixel for pixel what the payload gives (which
    tests/test_app_video.py holds to the library's attention within 8 bits), with no call to the server.
    Labels never cover a picture."""
    import numpy as np

    from vitviz.server.pictures import video_explorer

    sent = []  # the explorer's values the server sent
    payload = video_explorer.payload
    monkeypatch.setattr(video_explorer, "payload", lambda *a, **kw: (sent.append(payload(*a, **kw)), sent[-1])[1])
    _clip_in_the_video_tab(page, url, tmp_path)
    page.wait_for_function("document.querySelector('#vv-video-live .vvv')?.dataset.clip")
    value = sent[-1]
    assert value["mode"] == "browser" and page.locator("#vv-video-live .vvv").get_attribute("data-clip") == value["id"]
    assert not page.locator("#vv-video-across").is_visible() and not page.locator("#vv-video-frame").is_visible()
    first = _video_drawn(page, value, frame=1, layer=1, row=1, col=1)  # the run's query (the server's controls' values)
    calls = []
    page.on("request", lambda r: calls.append(r.url) if "/gradio_api/" in r.url and "heartbeat" not in r.url else None)
    slider = page.locator("#vv-video-live input.vvv-frame")
    slider.focus()
    for _ in range(5):
        page.keyboard.press("ArrowRight")
    moved = _video_drawn(page, value, frame=6, layer=1, row=1, col=1)
    assert not np.array_equal(moved, first)
    _says(page, "#vv-video-live .vvv-query", "Frame 6 (tubelet 3), row 1, column 1, layer 1")
    layer = page.locator("#vv-video-live input.vvv-layer").bounding_box()
    page.mouse.move(layer["x"] + 4, layer["y"] + layer["height"] / 2)
    page.mouse.down()
    page.mouse.move(layer["x"] + layer["width"] + 40, layer["y"] + layer["height"] / 2, steps=8)  # dragged past its right end: layer 4
    page.mouse.up()
    moved = _video_drawn(page, value, frame=6, layer=4, row=1, col=1)
    shown = page.locator("#vv-video-live canvas.vvv-shown")
    shown.scroll_into_view_if_needed()
    box = shown.bounding_box()
    at = (box["x"] + box["width"] * 4.5 / 6, box["y"] + box["height"] * 1.5 / 6)  # the 6x6 grid's row 2, column 5
    page.mouse.move(*at)
    hovered = _video_drawn(page, value, frame=6, layer=4, row=2, col=5)
    assert not np.array_equal(hovered, moved)
    _says(page, "#vv-video-live .vvv-query", "Frame 6 (tubelet 3), row 2, column 5, layer 4")
    page.mouse.click(*at)  # pinned: moving away keeps the patch
    _video_view(page, pinned="true", row=2, col=5)
    page.mouse.move(box["x"] + 5, box["y"] + 5)
    _video_drawn(page, value, frame=6, layer=4, row=2, col=5)
    page.mouse.click(*at)  # let go: the pointer leads again
    _video_view(page, pinned="false")
    page.mouse.move(box["x"] + 5, box["y"] + 5)
    _video_drawn(page, value, frame=6, layer=4, row=1, col=1)
    assert calls == [], calls  # every view drawn in the browser
    _settled(page)
    _no_label_covers_a_picture(page)


def test_a_clip_too_large_for_the_browser_is_explored_by_the_server(url, page, tmp_path, monkeypatch):
    """A clip whose explorer data is over the browser's bound (set smaller here): the explorer says so,
    and the server's views follow the frame slider and a click on the shown frame (from the kept run)."""
    from vitviz import cost

    monkeypatch.setattr(cost, "VIDEO_BROWSER_BYTES", 1000)
    _clip_in_the_video_tab(page, url, tmp_path)
    _says(page, "#vv-video-live .vvv-status", "too large to hold in the browser")
    loaded = "(() => { const i = document.querySelector('%s img'); return i && i.complete && i.naturalWidth > 0; })()"
    page.wait_for_function(loaded % "#vv-video-across")
    _says(page, "#vv-video-note", "Frame 1 (tubelet 1)")
    before = _src(page, "#vv-video-across")
    calls = []
    page.on("request", lambda r: calls.append(r.url) if "/gradio_api/" in r.url and "heartbeat" not in r.url else None)
    page.locator("#vv-video-frame input[type=range]").focus()
    for _ in range(5):
        page.keyboard.press("ArrowRight")
    _says(page, "#vv-video-note", "Frame 6 (tubelet 3)")
    assert calls, "the server's views came without a call that the other test's listener would have seen"
    page.wait_for_function(f"document.querySelector('#vv-video-across img')?.getAttribute('src') !== {before!r}")
    moved = _src(page, "#vv-video-across")
    _settled(page)  # the frame's views all come back before the click: one replaced under it is not selected
    shown = page.locator("#vv-video-query img")
    shown.scroll_into_view_if_needed()
    box = shown.bounding_box()
    shown.click(position={"x": box["width"] * 4.5 / 6, "y": box["height"] * 1.5 / 6})  # the 6x6 grid's row 2, column 5
    _says(page, "#vv-video-note", "row 2, column 5")
    page.wait_for_function(f"document.querySelector('#vv-video-across img')?.getAttribute('src') !== {moved!r}")
    page.wait_for_function("document.querySelector('#vv-video-row input').value === '2' && "
                           "document.querySelector('#vv-video-col input').value === '5'")
    _settled(page)
    _no_label_covers_a_picture(page)
