"""A picture of every tab for every embedded model, as a reader sees the page, and what is wrong on it.

    python -m vitviz.dev.screens                      # docs/screens/, desktop (1366x900) and phone (414x896)
    python -m vitviz.dev.screens --out /tmp/s --models shapes_p16 --sizes desktop

Starts the app on this machine, drives the system Chromium with Playwright (no browser download:
`--chromium` or $VITVIZ_CHROMIUM, else `chromium` on the PATH), analyses the first example with each
model, shows each tab (Compare: three embedded models) and saves what the window shows, results at
its top, as `<size>-<model>-<n>-<tab>.jpg`. Each picture is checked as it is taken (`page_checks.js`:
empty figures, texts that cross, texts cut by their box, texts under 10 px); the problems are printed
and the exit status is 1 when there are any.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
from pathlib import Path

CHECKS_JS = (Path(__file__).resolve().parent / "page_checks.js").read_text()
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run"]
SIZES = {"desktop": (1366, 900), "phone": (414, 896)}
EMBEDDED = ("shapes_p16", "shapes_p8", "shapes_clip", "shapes_swin")
COMPARED = ("shapes_p16", "shapes_p8", "shapes_swin")


def settled(page, quiet_ms: int = 600) -> None:
    """Waits until nothing on the page has been pending (Gradio marks what an event will redraw) for
    `quiet_ms` in a row, the quiet spell counted from this call."""
    page.evaluate("window.__vvQuietSince = undefined")
    page.wait_for_function(
        f"""(() => {{
            const busy = document.querySelector('.pending, .generating') !== null, now = performance.now();
            if (busy || window.__vvQuietSince === undefined) window.__vvQuietSince = now;
            return !busy && now - window.__vvQuietSince >= {quiet_ms};
        }})()""",
        polling=100,
    )


def problems(page) -> list[str]:
    """What `page_checks.js` finds on the page as it is now, one line each, once the pictures in the
    window have loaded (a slow machine may take a while; the browser fetches one below the fold when
    it is scrolled to)."""
    try:
        page.wait_for_function("[...document.querySelectorAll('.vv-figure img')].every(i => i.complete || "
                               "i.getBoundingClientRect().top > innerHeight || i.getBoundingClientRect().bottom < 0)", timeout=60_000)
    except Exception:  # Playwright's TimeoutError: the check says which figure is empty
        pass
    found = page.evaluate(CHECKS_JS)
    return [f"{kind}: {item}" for kind in ("empty", "overlaps", "clipped", "small") for item in found[kind]]


def analysed(page, name: str) -> None:
    """Waits until the status line reports an analysis by `name`."""
    page.wait_for_function(f"document.querySelector('#vv-status').innerText.includes({('on ' + name + ' (')!r})")
    settled(page)


def choose_variant(page, name: str) -> None:
    """Picks `name` in the page's model menu (which analyses the image on the page)."""
    menu = page.locator("#vv-variant input")
    menu.click()
    menu.fill(name)
    page.get_by_role("option", name=f"{name} ").first.click()


def pick_compared(page, names) -> None:
    """Sets the Compare picker to `names`: what is picked cleared (Gradio's Clear button), then each
    name typed and chosen."""
    picker = page.locator("#vv-compare-pick")
    picker.locator("[title=Clear]").click()
    box = picker.locator("input")
    for name in names:
        box.click()
        box.fill(name)
        page.get_by_role("option", name=f"— {name} ").first.click()
    page.keyboard.press("Escape")


def _shown(page, selector: str) -> bool:
    return page.locator(selector).count() > 0 and page.locator(selector).first.is_visible()


def _click_and_wait(page, button: str, picture: str) -> None:
    if _shown(page, button):
        page.locator(button).first.click()
        page.wait_for_selector(f"{picture} img")
        settled(page)


def act(page, label: str) -> None:
    """What a reader does on a tab to see all of it: the figures that wait for a click, drawn."""
    if label == "Explain":
        _click_and_wait(page, "#vv-faith-run", "#vv-faith")
    elif label == "Inside":
        _click_and_wait(page, "#vv-rank-heads", "#vv-rank")
    elif label == "Tokens" and _shown(page, "#vv-features img"):
        page.locator("#vv-features img").click()
        page.wait_for_selector("#vv-feature-similarity img")
        settled(page)
    elif label == "Find" and _shown(page, "#vv-phrases input"):
        page.locator("#vv-phrases input").fill("an arrow, a red star")
        _click_and_wait(page, "#vv-find-run", "#vv-find-2")
    elif label == "Compare":
        pick_compared(page, COMPARED)
        page.locator("#vv-compare-run").click()
        page.wait_for_function("(document.querySelector('#vv-compare-3')?.innerText ?? '').includes('shapes')")
        settled(page)


def shoot(page, out: Path, stem: str) -> list[str]:
    page.evaluate("document.querySelector('#vv-results')?.scrollIntoView({block: 'start'})")
    settled(page, 300)
    found = problems(page)
    page.screenshot(path=str(out / f"{stem}.jpg"), type="jpeg", quality=70)
    return [f"{stem}: {p}" for p in found]


def shoot_all(browser, base: str, out: Path, models, sizes) -> list[str]:
    """Every tab of every model in `models` at every size in `sizes`, from the app at `base`, saved
    in `out`: the problems found, one line each."""
    from vitviz.server import runtime

    found: list[str] = []
    for size in sizes:
        width, height = SIZES[size]
        page = browser.new_page(viewport={"width": width, "height": height})
        page.set_default_timeout(120_000)
        try:
            for model in models:
                page.goto(base)
                page.wait_for_selector("#vv-run")
                page.locator("#vv-image input[type=file]").set_input_files(runtime.EXAMPLES[0])
                analysed(page, runtime.DEFAULT_VARIANT)
                if model != runtime.DEFAULT_VARIANT:  # with an image on the page, a model chosen analyses it
                    choose_variant(page, model)
                    analysed(page, model)
                labels = [t.inner_text().strip() for t in page.get_by_role("tab").all()]
                for n, label in enumerate(labels, start=1):
                    page.get_by_role("tab", name=label, exact=True).click()
                    settled(page)
                    act(page, label)
                    found += shoot(page, out, f"{size}-{model}-{n}-{label.lower()}")
        finally:
            page.close()
    return found


def run(out: Path, models, sizes, chromium: str) -> list[str]:
    """`shoot_all` with the app started here and the system Chromium."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    from playwright.sync_api import sync_playwright

    from vitviz.server import app

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    app.demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, quiet=True, **app.LAUNCH_KWARGS)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, headless=True, args=FLAGS)
            try:
                return shoot_all(browser, app.demo.local_url, out, models, sizes)
            finally:
                browser.close()
    finally:
        app.demo.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/screens"))
    parser.add_argument("--models", nargs="+", default=list(EMBEDDED), choices=EMBEDDED)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--chromium", default=os.environ.get("VITVIZ_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser"))
    args = parser.parse_args(argv)
    if not args.chromium:
        parser.error("no Chromium found: install it (apt-get install -y chromium) or name it with --chromium")
    args.out.mkdir(parents=True, exist_ok=True)
    found = run(args.out, args.models, args.sizes, args.chromium)
    print("\n".join(found) if found else "no problems found", file=sys.stderr if found else sys.stdout)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
