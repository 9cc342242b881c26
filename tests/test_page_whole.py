"""The page as a reader meets it, in the system Chromium: every tab of every embedded model drawn
whole (no empty figure, no text over another or cut by its box, none under 10 px) at a desk and on a
phone; Compare's one colour scale; the tab strip, the menus and the results by keyboard; names for
what has no text. The checks are `vitviz/dev/page_checks.js`, the same that `python -m
vitviz.dev.screens` runs when it makes docs/screens; the first test shows they find what they look for."""

import os
import shutil

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.browser]

CHROMIUM = os.environ.get("VITVIZ_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip("no Chromium installed (apt-get install -y chromium; .ci/run installs it)", allow_module_level=True)


@pytest.fixture(scope="module")
def base():
    from conftest import free_port
    from vitviz.server import app

    app.demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=free_port(), quiet=True, **app.LAUNCH_KWARGS)
    try:
        yield app.demo.local_url
    finally:
        app.demo.close()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    from vitviz.dev import screens

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=screens.FLAGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser):
    p = browser.new_page(viewport={"width": 1366, "height": 900})
    p.set_default_timeout(60_000)
    try:
        yield p
    finally:
        p.close()


def test_the_checks_find_what_they_look_for(page):
    """A page made to fail each check: an empty figure, two texts across each other, a label over a
    picture, a text cut by its box, a text of 8 px; and the same page put right passes."""
    from vitviz.dev import screens

    broken = """
      <div class="vv-figure" id="empty-figure"><label data-testid="block-label">Nothing drawn</label></div>
      <p id="one" style="position:absolute; top:200px; left:10px; margin:0">first words here</p>
      <p id="two" style="position:absolute; top:204px; left:30px; margin:0">second words</p>
      <div id="pic" style="position:absolute; top:300px; left:10px"><img width="100" height="100"
        src="data:image/gif;base64,R0lGODlhAQABAIAAAP///wAAACH5BAEAAAAALAAAAAABAAEAAAICRAEAOw=="></div>
      <label data-testid="block-label" id="cover" style="position:absolute; top:290px; left:20px; height:30px">Label</label>
      <div id="narrow" style="position:absolute; top:500px; width:40px; overflow:hidden; white-space:nowrap">a text too long for its box</div>
      <p id="tiny" style="position:absolute; top:600px; font-size:8px">tiny</p>"""
    page.set_content(broken)
    found = page.evaluate(screens.CHECKS_JS)
    assert found["empty"] == ["#empty-figure"]
    assert any('"first words here" (#one) / "second words" (#two)' in o for o in found["overlaps"]), found["overlaps"]
    assert any('the label "Label" over a picture (#pic)' in o for o in found["overlaps"]), found["overlaps"]
    assert any(c.startswith('"a text too long for its box" (#narrow) cut by #narrow') for c in found["clipped"]), found["clipped"]
    assert found["small"] == ['"tiny" (#tiny)']
    page.set_content("<p>first words here</p><p>second words</p><p style='font-size:12px'>small but readable</p>")
    assert screens.problems(page) == []


def test_every_tab_of_every_embedded_model_is_whole(base, browser, tmp_path):
    """Each tab of shapes_p16, shapes_p8, shapes_clip and shapes_swin at 1366x900, and of shapes_p16
    and shapes_swin at 414x896, after what draws the rest of it (faithfulness, the head ranking, a
    click on the features, two phrases, three models compared): nothing empty, crossing, cut or tiny."""
    from vitviz.dev import screens

    found = screens.shoot_all(browser, base, tmp_path, screens.EMBEDDED, ["desktop"])
    found += screens.shoot_all(browser, base, tmp_path, ["shapes_p16", "shapes_swin"], ["phone"])
    assert found == [], "\n".join(found)
    from vitviz.server.tabs import TABS

    tabs = len(TABS)  # every registered tab, one picture each
    assert len(list(tmp_path.glob("desktop-*.jpg"))) == 4 * tabs and len(list(tmp_path.glob("phone-*.jpg"))) == 2 * tabs


def test_compare_shows_three_models_on_one_readable_colour_scale(base, page):
    from vitviz.dev import screens
    from vitviz.server import runtime

    page.goto(base)
    page.locator("#vv-image input[type=file]").set_input_files(runtime.EXAMPLES[0])
    screens.analysed(page, "shapes_p16")
    page.get_by_role("tab", name="Compare", exact=True).click()
    # the picker: typing a family narrows the list to it
    box = page.locator("#vv-compare-pick input")
    box.click()
    box.fill("Embedded")
    options = [o.inner_text().split("\n")[-1] for o in page.get_by_role("option").all()]  # a picked one starts with a tick
    assert len(options) >= 3 and all(o.startswith("Embedded — ") for o in options), options
    page.keyboard.press("Escape")
    screens.pick_compared(page, ["shapes_p16", "shapes_p8", "shapes_swin"])
    page.locator("#vv-compare-run").click()
    page.wait_for_function("(document.querySelector('#vv-compare-3')?.innerText ?? '').includes('shapes_swin')")
    screens.settled(page)
    bars = [b for b in page.locator(".vv-colourbar").all() if b.is_visible()]
    assert len(bars) == 1, "one colour scale for the three maps"
    for tick in bars[0].locator(".vv-colourbar-ticks span").all():
        height = tick.bounding_box()["height"]
        size = float(tick.evaluate("e => parseFloat(getComputedStyle(e).fontSize)"))
        assert size >= 10 and height >= 10, (tick.inner_text(), size, height)
    # the results beside the picker, not under it
    controls = page.locator("#vv-compare-controls").bounding_box()
    results = page.locator("#vv-compare-results").bounding_box()
    assert results["x"] >= controls["x"] + controls["width"] - 1 and results["y"] < controls["y"] + controls["height"]
    rows = page.locator("#vv-compare-table tbody tr").all()
    assert [r.locator("th").inner_text() for r in rows] == ["shapes_p16", "shapes_p8", "shapes_swin"]
    # each its own scale, on asking: a bar under each map, labelled as such by the choice
    page.get_by_label("Each model its own scale").check()
    page.locator("#vv-compare-run").click()
    page.wait_for_function("[...document.querySelectorAll('.vv-colourbar')].filter(b => b.offsetParent !== null).length === 3")
    assert screens.problems(page) == []


def test_the_tab_strip_and_the_menus_by_keyboard(base, page):
    """The WAI-ARIA tab pattern: arrows show the next or previous tab (wrapping), Home and End the
    first and last, and only the shown tab is in the Tab order; Tab out of a menu closes its list
    and moves on to the next control."""
    from vitviz.dev import screens

    page.goto(base)
    page.wait_for_selector("#vv-run")
    page.wait_for_selector("[role=tab]")  # (the tab strip is drawn after the run button on a busy machine)
    labels = [t.inner_text().strip() for t in page.get_by_role("tab").all()]
    selected = "document.querySelector('[role=tab][aria-selected=true]').innerText.trim()"
    page.get_by_role("tab", name=labels[0], exact=True).focus()
    for key, want in (("ArrowRight", labels[1]), ("ArrowRight", labels[2]), ("ArrowLeft", labels[1]), ("End", labels[-1]),
                      ("ArrowRight", labels[0]), ("ArrowLeft", labels[-1]), ("Home", labels[0])):
        page.keyboard.press(key)
        page.wait_for_function(f"{selected} === {want!r}")
        assert page.evaluate("document.activeElement.innerText.trim()") == want
    page.wait_for_function("[...document.querySelectorAll('[role=tab]')].filter(t => t.tabIndex === 0).length === 1")
    assert page.evaluate("document.querySelector('[role=tab][tabindex=\"0\"]').innerText.trim()") == labels[0]

    menu = page.locator("#vv-variant input")
    menu.click()
    assert menu.get_attribute("aria-expanded") == "true"
    page.keyboard.press("Tab")
    page.wait_for_function("document.querySelector('#vv-variant input').getAttribute('aria-expanded') === 'false'")
    page.wait_for_function("!document.querySelector('#vv-variant [role=listbox]')")  # the list is gone, not only marked closed
    assert page.evaluate("document.activeElement.placeholder").startswith("timm:")  # the next control: the box for another model
    screens.settled(page)


def test_what_has_no_text_is_named_and_focus_follows_a_keyboard_upload(base, page):
    """The examples say which image they analyse, the thumbnail and each figure's picture have a
    name; a file chosen from the keyboard analyses it and focus goes to the status line."""
    from vitviz.dev import screens
    from vitviz.server import runtime

    page.goto(base)
    page.wait_for_selector("#vv-examples button img")
    names = page.evaluate("[...document.querySelectorAll('#vv-examples button')].map(b => b.getAttribute('aria-label'))")
    stems = sorted(os.path.splitext(os.path.basename(p))[0] for p in runtime.EXAMPLES)
    assert sorted(names) == [f"Analyse the example {s}" for s in stems]
    assert page.get_by_role("button", name=f"Analyse the example {stems[0]}").count() == 1
    # the upload area from the keyboard: Enter opens the file chooser
    # (the upload area may be drawn again while the page settles, taking the focus with it: focus it
    # until it holds the focus, press Enter, and try again if the area was redrawn in between)
    drop = "#vv-image button[aria-label^='Drop an image']"
    focused = f"(() => {{ const b = document.querySelector(\"{drop}\"); b && b.focus(); return b && document.activeElement === b; }})()"
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    for attempt in range(6):
        page.wait_for_function(focused)
        try:
            with page.expect_file_chooser(timeout=10_000) as chooser:
                page.keyboard.press("Enter")
            break
        except PlaywrightTimeout:
            if attempt == 5:
                raise
    chooser.value.set_files(runtime.EXAMPLES[0])
    screens.analysed(page, "shapes_p16")
    page.wait_for_function("document.activeElement && document.activeElement.id === 'vv-status'")
    assert page.evaluate("document.querySelector('#vv-result-thumb img').alt") == "The analysed image"
    unnamed = page.evaluate("[...document.querySelectorAll('.vv-figure img')].filter(i => i.offsetParent !== null && !i.alt).length")
    assert unnamed == 0
    assert page.get_by_role("img", name="Attention rollout").count() == 1
