"""In Chromium: view changes and new analyses as a person sees them (the system's Chromium through Playwright)."""

from __future__ import annotations

import json
import os
import re
import statistics
import time
from pathlib import Path

import numpy as np
import torch

import vitviz
from vitviz.dev.bench.common import _photos, _private_weights, _random_torchvision_checkpoints, _sync_of


# In the page: the watch notes the time stamp of the next input event (pointer, key, change, click)
# and resolves, once the view it waits for is in the page (an attribute's value, or a new picture
# decoded), in the next animation frame's callback, just before that frame paints. Latency = the
# callback's performance.now() - the event's time stamp (the same clock).
_WATCH_JS = """
([kind, selector, attribute, expected, previous]) => { window.__vvPending = new Promise((resolve) => {
  let start = null;
  const types = ['pointermove', 'mousemove', 'pointerdown', 'click', 'keydown', 'input', 'change'];
  const onEvent = (e) => { if (start === null) start = e.timeStamp; };
  types.forEach((t) => document.addEventListener(t, onEvent, { capture: true }));
  const finish = () => requestAnimationFrame(() => {  // the frame that paints the change
    const now = performance.now();
    types.forEach((t) => document.removeEventListener(t, onEvent, { capture: true }));
    resolve(now - (start === null ? now : start));
  });
  const check = async () => {
    const el = document.querySelector(selector);
    if (!el) return false;
    if (kind === 'attr') return el.getAttribute(attribute) === expected;
    if (el.getAttribute('src') === previous || !el.getAttribute('src')) return false;
    try { await el.decode(); } catch (e) { return false; }
    return true;
  };
  const observer = new MutationObserver(async () => { if (await check()) { observer.disconnect(); finish(); } });
  observer.observe(document.body, { subtree: true, attributes: true, childList: true });
  setTimeout(() => { observer.disconnect(); resolve(-1); }, 120000);
}); }
"""



_WATCH_EXPLORER_JS = """
(previous) => { window.__vvExplorer = new Promise((resolve) => {
  let start = null;
  const onEvent = (e) => { if (start === null) start = e.timeStamp; };
  ['input', 'change'].forEach((t) => document.addEventListener(t, onEvent, { capture: true }));
  const root = document.querySelector('#vv-explorer-live .vvx');
  const observer = new MutationObserver(() => {
    const id = root.dataset.analysis;
    if (!id || id === previous) return;
    observer.disconnect();
    requestAnimationFrame(() => resolve(performance.now() - (start === null ? performance.now() : start)));
  });
  observer.observe(root, { attributes: true, attributeFilter: ['data-analysis'] });
  setTimeout(() => { observer.disconnect(); resolve(-1); }, 120000);
}); }
"""



# what Chromium's renderer did on its main thread (DevTools' Performance.getMetrics, cumulative seconds)
_RENDERER_METRICS = {"tasks": ("TaskDuration",), "script": ("ScriptDuration",), "style and layout": ("RecalcStyleDuration", "LayoutDuration")}



def _timed(page, action, kind: str, selector: str, attribute: str | None = None, expected: str | None = None) -> float:
    """Milliseconds from `action`'s input event to the frame that shows the view it asks for."""
    previous = page.locator(selector).first.get_attribute("src") if kind == "src" else None
    page.evaluate(_WATCH_JS, [kind, selector, attribute, expected, previous])
    action()
    ms = float(page.evaluate("() => window.__vvPending"))
    if ms < 0:
        raise RuntimeError(f"the page never showed {selector} {attribute or 'src'} = {expected or 'a new picture'}")
    return ms



def browser_table(names=("shapes_p16", "vit_b_16"), *, moves: int = 20) -> list[tuple[str, str, float, str]]:
    """View changes and new analyses in the system Chromium against the app in this process.

    For each model: hover onto a new patch, click to pin one, a layer step from the keyboard, a head
    change, a rollout option (drawn by the server) and a new analysis (a new 640x480 JPEG uploaded,
    until its rollout is on screen, and, timed on its own from the same upload, until the explorer
    holds it); medians over `moves` of each. With each new analysis, the work of Chromium's renderer
    on its main thread and the CPU time of all of Chromium's processes from the upload to the rollout
    on screen (it shares the machine's cores with the forward here: on a server, the page runs
    elsewhere), and the analysis' model call as the server timed it (the status line's).
    torchvision variants load through the real weights path, with random weights. Returns
    (model, what, median ms, note) rows.
    """
    import shutil

    from playwright.sync_api import sync_playwright

    chromium = os.environ.get("VITVIZ_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("--browser needs the system's Chromium (apt-get install -y chromium)")
    flags = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--no-first-run"]
    rows = []
    with _private_weights() as torch_home:
        models = _random_torchvision_checkpoints([n for n in names if vitviz.get_spec(n).source == "torchvision"])
        from vitviz.server import app

        app.demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True, **app.LAUNCH_KWARGS)
        photos = _photos(Path(torch_home), moves + 2, seed=3)
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=chromium, headless=True, args=flags)
                page = browser.new_page(viewport={"width": 1280, "height": 1000})
                page.set_default_timeout(120_000)
                for name in names:
                    rows += _browser_rows(page, app, name, photos, moves, models.get(name))
                browser.close()
        finally:
            app.demo.close()
    return rows



def _browser_rows(page, app, name: str, photos: list[str], moves: int, tv_model) -> list[tuple[str, str, float, str]]:
    page.goto(app.demo.local_url)
    page.locator("#vv-variant input").first.fill(name)
    page.keyboard.press("Enter")
    page.locator("#vv-image input[type=file]").set_input_files(photos[0])
    page.wait_for_function(f"document.querySelector('#vv-status').innerText.includes({' on ' + name + ' ('!r})")
    page.get_by_role("tab", name="Explorer").click()
    page.wait_for_function("document.querySelector('#vv-explorer-live .vvx').dataset.analysis")
    canvas = page.locator("#vv-explorer-live canvas.vvx-map")
    box = canvas.bounding_box()
    spec = vitviz.get_spec(name)
    gh, gw = spec.grid
    p = spec.num_prefix_tokens
    map_sel = "#vv-explorer-live canvas.vvx-map"
    timings: dict[str, list[float]] = {k: [] for k in ("hover", "click", "layer", "head")}

    def at(r: int, c: int) -> tuple[float, float]:
        return box["x"] + (c + 0.5) * box["width"] / gw, box["y"] + (r + 0.5) * box["height"] / gh

    rng = np.random.default_rng(7)
    cells = [(int(r), int(c)) for r, c in zip(rng.integers(0, gh, 4 * moves), rng.integers(0, gw, 4 * moves))]
    last = None
    for r, c in cells[:moves]:
        if (r, c) == last:
            continue
        last = (r, c)
        timings["hover"].append(_timed(page, lambda: page.mouse.move(*at(r, c)), "attr", map_sel, "data-query", str(p + r * gw + c)))
    for r, c in cells[moves : 2 * moves]:
        query = str(p + r * gw + c)
        timings["click"].append(_timed(page, lambda: page.mouse.click(*at(r, c)), "attr", map_sel, "data-query", query))
        page.mouse.click(*at(r, c))  # let go of the pin again
    layer = page.locator("#vv-explorer-live .vvx-layer")
    layer.focus()
    depth = spec.depth
    current = int(canvas.get_attribute("data-layer"))
    for k in range(moves):
        step = "ArrowLeft" if current > 1 and (k // (depth - 1)) % 2 == 0 else "ArrowRight"
        current += -1 if step == "ArrowLeft" else 1
        current = min(depth, max(1, current))
        timings["layer"].append(_timed(page, lambda: page.keyboard.press(step), "attr", map_sel, "data-layer", str(current)))
    heads = ["mean", "max"] + [f"head {h + 1}" for h in range(spec.heads)]
    head_now = canvas.get_attribute("data-head")
    for k in range(moves):
        choice = heads[k % len(heads)]
        if choice == head_now:
            choice = heads[(k + 1) % len(heads)]
        sel = page.locator("#vv-explorer-live .vvx-head")
        timings["head"].append(_timed(page, lambda: sel.select_option(label=choice), "attr", map_sel, "data-head", choice))
        head_now = choice
    page.get_by_role("tab", name="Predict").click()
    rollout = []
    fusions = ["max", "min", "mean"]
    for k in range(moves):
        radio = page.locator("#vv-fusion label", has_text=fusions[k % 3])
        rollout.append(_timed(page, lambda: radio.click(), "src", "#vv-rollout img"))
    device = vitviz.default_device()  # the app's: the plain forward runs where the app's does
    model = (tv_model if tv_model is not None else vitviz.load_model(name, device=device)).to(device)
    x = torch.randn(1, 3, spec.image_size, spec.image_size, device=device)
    sync = _sync_of(device)

    def forward():
        with torch.inference_mode():
            model(x)
        sync()

    forward()
    analyse, explorer_ready, plain, served, chromium = [], [], [], [], []
    renderer = {k: [] for k in _RENDERER_METRICS}
    cdp = page.context.new_cdp_session(page)
    cdp.send("Performance.enable")

    def renderer_seconds() -> dict[str, float]:
        got = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
        return {k: sum(got.get(name, 0.0) for name in names) for k, names in _RENDERER_METRICS.items()}

    def settled() -> None:  # until the page has done its work on the last analysis: its renderer idle for 100 ms (5 s at most)
        last = renderer_seconds()["tasks"]
        for _ in range(50):
            time.sleep(0.1)
            now = renderer_seconds()["tasks"]
            if now - last < 0.002:
                return
            last = now

    for k in range(moves):  # a plain forward, then an analysis, in turn: the same machine state for both
        settled()
        start = time.perf_counter()
        forward()
        plain.append((time.perf_counter() - start) * 1e3)
        photo = photos[1 + (k % (len(photos) - 1))]
        previous = page.locator("#vv-explorer-live .vvx").get_attribute("data-analysis")
        page.evaluate(_WATCH_EXPLORER_JS, previous)  # timed from the same upload, on its own: it may come before the rollout
        before, chromium_before = renderer_seconds(), _chromium_cpu_seconds()
        analyse.append(_timed(page, lambda: page.locator("#vv-image input[type=file]").set_input_files(photo), "src", "#vv-rollout img"))
        after, chromium_after = renderer_seconds(), _chromium_cpu_seconds()
        for key in renderer:
            renderer[key].append((after[key] - before[key]) * 1e3)
        chromium.append((chromium_after - chromium_before) * 1e3)
        page.wait_for_function(f"document.querySelector('#vv-status').innerText.startsWith({json.dumps(Path(photo).name + ' on ')})")
        status = page.locator("#vv-status").inner_text()
        call = re.search(r"Model call (\d+) ms", status)
        if call is None:
            raise RuntimeError(f"the status line gives no model call: {status!r}")
        served.append(float(call.group(1)))
        explorer_ready.append(float(page.evaluate("() => window.__vvExplorer")))
        if explorer_ready[-1] < 0:
            raise RuntimeError("the explorer never held the new analysis")
        # the other layers arrive after the first is drawn: the next forward is timed once they are in
        page.wait_for_function("(() => { const r = document.querySelector('#vv-explorer-live .vvx').dataset; "
                               "return !('complete' in r) || (r.complete && r.complete === r.analysis); })()")
    uploads = page.evaluate(
        "performance.getEntriesByType('resource').filter(e => e.name.includes('/gradio_api/upload')).map(e => e.duration)"
    )
    plain = statistics.median(plain)
    upload = statistics.median(uploads[-moves:]) if uploads else 0.0
    med = {k: statistics.median(v) for k, v in timings.items()}
    rows = [(name, f"view change: {k}", v, f"{len(timings[k])} moves") for k, v in med.items()]
    rows.append((name, "rollout option (drawn by the server)", statistics.median(rollout), f"{moves} moves"))
    rows.append((name, "plain forward, batch 1", plain, "in this process, between the analyses, the page idle"))
    rows.append((name, "upload of the photo", upload, ""))
    a = statistics.median(analyse)
    rows.append((name, "new analysis: upload to rollout on screen", a, f"{a / (plain + upload):.2f}x (forward + upload)"))
    e = statistics.median(explorer_ready)
    rows.append((name, "new analysis: until the explorer holds it", e, f"{e / (plain + upload):.2f}x (forward + upload)"))
    for key, values in renderer.items():
        rows.append((name, f"new analysis: renderer's {key}", statistics.median(values), "main thread, upload to rollout on screen"))
    rows.append((name, "new analysis: Chromium's CPU, all its processes", statistics.median(chromium),
                 "upload to rollout on screen, on the cores the server shares"))
    f = statistics.median(served)
    rows.append((name, "new analysis: its forward in the server", f, f"{f / plain:.2f}x the plain forward (the status line's model call)"))
    return rows



def _chromium_cpu_seconds() -> float:
    """CPU seconds (user and system) of every Chromium process on this machine now running (Linux's
    /proc; 0 without it): a process that ends within a window takes its time with it, so a window's
    figure is at most Chromium's."""
    if not Path("/proc/self/stat").exists():
        return 0.0
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if b"chrom" not in (entry / "cmdline").read_bytes().split(b"\0", 1)[0]:
                continue
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            continue
    return total
