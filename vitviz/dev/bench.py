"""Side-by-side timings of vitviz against torchvision's plain forward, on the same weights.

    python -m vitviz.dev.bench                   # ViT-B/16, batch 1, CPU (and CUDA when available)
    python -m vitviz.dev.bench --rounds 30 --arch vit_b_32
    python -m vitviz.dev.bench --app             # end to end through the running app (gradio_client)
    python -m vitviz.dev.bench --browser         # in Chromium: view changes and a new analysis, as a person sees them
    python -m vitviz.dev.bench --handler         # a new analysis in the app's handler, explorer file included, no browser
    python -m vitviz.dev.bench --evaluate        # python -m vitviz.evaluate on 1 and 2 processes against plain forwards
    python -m vitviz.dev.bench --serving         # each kind of request priced and measured; one client's share of the queue
    python -m vitviz.dev.bench --inputs          # hostile images from a checkout's tests/corpus.py: time and peak memory
    python -m vitviz.dev.bench --training        # a shapes training step: fused and plain attention, Muon and AdamW, torch.compile
    python -m vitviz.dev.bench --device cuda     # any row above on CUDA only (cpu: GPUs hidden; auto, the default: as each row says)

Each round runs every candidate once, in a rotating order, so that drifts in clock speed and
cache state hit all of them alike; the table shows medians and ratios to torchvision's forward.
Weights are random (the cost does not depend on their values), so no download is needed.

--device auto (the default) times the model paths and --relevance on the CPU and, when there is a
GPU, on CUDA; --training and the in-memory passes of --evaluate on the CPU; the app's rows
(--handler, --app, --browser, --serving) and the evaluator's runs on the device the app and the
evaluator choose themselves (CUDA when there is one). --device cpu hides every GPU from this process
and the processes it starts; --device cuda runs every row that has a device on CUDA (`.ci/gpu`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import re
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import vitviz

__all__ = ["measure", "model_path_table", "main"]


def measure(candidates: dict[str, Callable[[], object]], *, rounds: int, warmup: int = 2, sync: Callable[[], None] = lambda: None) -> dict[str, list[float]]:
    """Seconds per call for each candidate over `rounds` interleaved rounds."""
    for _ in range(warmup):
        for fn in candidates.values():
            fn()
    sync()
    times: dict[str, list[float]] = {k: [] for k in candidates}
    names = list(candidates)
    for r in range(rounds):
        for k in names[r % len(names):] + names[: r % len(names)]:
            t = time.perf_counter()
            candidates[k]()
            sync()
            times[k].append(time.perf_counter() - t)
    return times


def _sync_of(device: torch.device) -> Callable[[], None]:
    """What waits for `device`'s queued work (timings on CUDA end there)."""
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = f"; CUDA: {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{cpu}, {torch.get_num_threads()} torch threads, torch {torch.__version__}{gpu}"


def model_path_table(arch: str, device: torch.device, *, rounds: int) -> list[tuple[str, float, float]]:
    """(name, median ms, ratio to torchvision's forward) for the model paths on one device."""
    import torchvision

    torch.manual_seed(0)
    tv = getattr(torchvision.models, arch)().eval().to(device)
    ours = vitviz.ViT.from_torchvision(tv).eval().to(device)
    size = tv.image_size
    x = torch.randn(1, 3, size, size, device=device)
    rng = np.random.default_rng(0)
    photo = Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def tv_forward():
        with torch.inference_mode():
            return tv(x)

    def ours_plain():
        with torch.inference_mode():
            return ours(x)

    def ours_recording():
        with torch.inference_mode(), vitviz.record_attention(ours) as rec:
            ours(x)
        return rec.attentions

    def ours_analyze():
        return vitviz.analyze(ours, photo)

    times = measure(
        {
            "torchvision forward": tv_forward,
            "vitviz forward (fused)": ours_plain,
            "vitviz forward recording attention": ours_recording,
            "vitviz.analyze (image in, CPU tensors out)": ours_analyze,
        },
        rounds=rounds,
        sync=sync,
    )
    base = statistics.median(times["torchvision forward"])
    return [(k, statistics.median(v) * 1e3, statistics.median(v) / base) for k, v in times.items()]


def relevance_table(arch: str, device: torch.device, *, batch: int = 8, rounds: int = 10) -> list[tuple[str, float, float]]:
    """(name, median ms, ratio to the plain forward and backward) for gradient relevance of a batch.

    The reference is what any gradient costs: a forward with nothing recorded (the fused attention
    kernel) and a backward to the input, the input requiring grad and every weight frozen. Beside it:
    `vitviz.relevance_maps` for the whole batch (gradient relevance, each image's top class), and the
    same rule one image at a time (the loop of Chefer et al.'s notebooks: a forward and a backward
    per image, the attention and its gradient kept by hooks)."""
    import torchvision

    from vitviz.relevance import gradient_relevance

    torch.manual_seed(0)
    tv = getattr(torchvision.models, arch)().eval()
    ours = vitviz.ViT.from_torchvision(tv).eval().to(device)
    frozen = vitviz.ViT.from_torchvision(tv).eval().to(device).requires_grad_(False)
    del tv
    size = ours.image_size
    x = torch.randn(batch, 3, size, size, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def plain():
        inp = x.clone().requires_grad_(True)
        logits = frozen(inp)
        top = logits.argmax(-1)
        (grad,) = torch.autograd.grad(logits.gather(1, top[:, None]).sum(), inp)
        return grad

    def batched():
        return vitviz.relevance_maps(ours, x, methods=["gradient"])

    def one_at_a_time():
        maps = []
        for i in range(batch):
            with vitviz.record_attention(ours, gradients=True) as rec:
                logits = ours(x[i : i + 1])
                logits[0, logits[0].argmax()].backward()
            ours.zero_grad(set_to_none=True)
            maps.append(gradient_relevance(rec.attentions[:, 0], rec.gradients[:, 0])[0, 1:])
        return maps

    times = measure({"plain forward + backward (frozen, fused)": plain, "vitviz.relevance_maps, gradient": batched,
                     "one image at a time (hooks, .backward())": one_at_a_time}, rounds=rounds, sync=sync)
    base = statistics.median(times["plain forward + backward (frozen, fused)"])
    return [(k, statistics.median(v) * 1e3, statistics.median(v) / base) for k, v in times.items()]


def _count_model_calls():
    """Wraps ViT.encode (every forward goes through it) with a counter; returns (counter dict, undo)."""
    calls = {"n": 0}
    original = vitviz.ViT.encode

    def counting(self, *args, **kwargs):
        calls["n"] += 1
        return original(self, *args, **kwargs)

    vitviz.ViT.encode = counting

    def undo():
        vitviz.ViT.encode = original

    return calls, undo


def _peak_rss_subprocess(arch: str, torch_home: str) -> float:
    """Peak resident memory (MB) of a fresh process that loads `arch` and analyses one image."""
    import os
    import subprocess
    import sys

    code = (
        "import resource, numpy as np, vitviz\n"
        "from PIL import Image\n"
        f"m = vitviz.load_model({arch!r}, device='cpu')\n"
        "vitviz.analyze(m, Image.fromarray(np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)))\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)\n"
    )
    env = dict(os.environ, TORCH_HOME=torch_home, VITVIZ_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _echo_app():
    """A one-textbox Gradio app, launched: what any call through gradio_client costs at least."""
    import gradio as gr

    with gr.Blocks() as echo:
        box, out = gr.Textbox(), gr.Textbox()
        gr.Button().click(lambda x: x, box, out, api_name="echo")
    echo.queue()
    echo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True, ssr_mode=False)
    return echo


def handler_table(arch: str = "vit_b_16", *, rounds: int = 8) -> list[tuple[str, float, float]]:
    """A new analysis in the app's handler, without a browser: (what, median ms, ratio to the plain
    forward) for the plain forward, the analysis as the page asks for it (`runtime.run` with a ticket:
    the explorer's pictures before the forward, its file during it), until its explorer's value is
    published for the page and until it returns; the explorer's two pictures on their own, and as PNG
    files for comparison; the analysis without the file, and again with the freed heap handed back to
    the system before and after it (`release_memory(keep=0)`); drawing every output of the analysis for a
    new image on the model shown (`page.analysis_outputs`) and Gradio's postprocessing of those
    outputs. New 640x480 JPEGs; random weights through the real path."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    with _private_weights() as home:
        if vitviz.get_spec(arch).source == "torchvision":
            _random_torchvision_checkpoints([arch])
        import asyncio

        from gradio.state_holder import SessionState

        from vitviz.server import app, explorer_data, page, runtime, views
        from vitviz.server.memory import release_memory

        photos = _photos(Path(home), rounds, seed=3)
        model, _ = runtime.CACHE.get(arch)
        device = next(model.parameters()).device  # the app's: CUDA when there is a GPU
        x = torch.randn(1, 3, model.spec.image_size, model.spec.image_size, device=device)
        sync = _sync_of(device)
        times: dict[str, list[float]] = {k: [] for k in ("plain forward", "the explorer's value published for the page",
                                                         "analysis, explorer file written during the forward",
                                                         "of which its two pictures, before the forward",
                                                         "the same two pictures as PNG, the base at display size", "analysis alone",
                                                         "analysis alone, the freed heap handed back before and after",
                                                         "the analysis' outputs drawn", "Gradio's postprocessing of them")}
        event = next(f for f in app.demo.fns.values() if f.name == "on_analyze")
        ref = page.analysis_outputs(runtime.run(photos[0], arch), photos[0], None)[page.PAGE.state]  # warm-up
        for photo in photos:
            start = time.perf_counter()
            with torch.inference_mode():
                model(x)
            sync()
            times["plain forward"].append(time.perf_counter() - start)
            start, published = time.perf_counter(), []
            with runtime.EARLY.opened(runtime.new_key()) as ticket:  # as the page names its analyses: pictures before the forward
                waiting = threading.Thread(target=lambda: published.append((asyncio.run(runtime.EARLY.wait(ticket, "explorer")),
                                                                             time.perf_counter())))
                waiting.start()  # as the page waits for the explorer (`vitviz.server.early`)
                exp = runtime.run(photo, arch, explorer_key=runtime.new_key(), ticket=ticket)
            times["analysis, explorer file written during the forward"].append(time.perf_counter() - start)
            waiting.join()
            if published[0][0] is None:
                raise RuntimeError("the analysis published no explorer for its ticket")
            times["the explorer's value published for the page"].append(published[0][1] - start)
            start = time.perf_counter()
            explorer_data.write_pictures(exp.analysis.image, scale=exp.scale, grid=exp.analysis.grid, key=runtime.new_key(), folder=home)
            times["of which its two pictures, before the forward"].append(time.perf_counter() - start)
            start = time.perf_counter()  # as the views' pictures are written (`views.display_of`, PNG at compress level 1)
            tile = explorer_data.mosaic_tile_px(exp.analysis.grid)
            for picture in (views.display_of(exp.analysis.image), exp.analysis.image.resize((tile, tile), Image.BILINEAR)):
                picture.save(io.BytesIO(), format="PNG", compress_level=1)
            times["the same two pictures as PNG, the base at display size"].append(time.perf_counter() - start)
            start = time.perf_counter()
            out = page.analysis_outputs(exp, photo, ref)  # a new image on the model shown
            ref = out[page.PAGE.state]
            times["the analysis' outputs drawn"].append(time.perf_counter() - start)
            start = time.perf_counter()
            asyncio.run(app.demo.postprocess_data(event, out, SessionState(app.demo)))
            times["Gradio's postprocessing of them"].append(time.perf_counter() - start)
            # the analysis alone, and with the freed heap handed back before and after it, in turns
            # (what that hands back is faulted in again, by an untimed analysis, before the next one)
            for handed_back in ((False, True) if len(times["analysis alone"]) % 2 == 0 else (True, False)):
                if handed_back:
                    runtime.release_memory = lambda **_: release_memory(keep=0)  # as every analysis did before VITVIZ_HEAP_KEEP_MB
                try:
                    start = time.perf_counter()
                    runtime.run(photo, arch)
                    times["analysis alone, the freed heap handed back before and after" if handed_back else "analysis alone"].append(
                        time.perf_counter() - start)
                finally:
                    runtime.release_memory = release_memory
                if handed_back:
                    runtime.run(photo, arch)
    base = statistics.median(times["plain forward"])
    return [(k, statistics.median(v) * 1e3, statistics.median(v) / base) for k, v in times.items()]


def app_table(arch: str, second: str, *, rounds: int) -> list[tuple[str, float, str]]:
    """End-to-end timings through the running app, on CPU, with random weights in a private cache.

    The app loads `arch` and `second` through its real weights path: their checkpoints (random
    values, the cost does not depend on them) are written to a temporary $TORCH_HOME, which also
    holds every scratch file of the run (gradio_client's downloads) and is removed at the end, when
    the environment and `tempfile.tempdir` are put back as they were.
    """
    with _private_weights() as torch_home:
        return _app_table(arch, second, rounds=rounds, torch_home=torch_home)


@contextlib.contextmanager
def _private_weights():
    """A temporary $TORCH_HOME (offline) for random checkpoints and every scratch file of a run,
    removed at the end, when the environment and `tempfile.tempdir` are put back as they were."""
    import os
    import shutil
    import tempfile

    torch_home = tempfile.mkdtemp(prefix="vitviz-bench-")
    before = tempfile.tempdir, {k: os.environ.get(k) for k in ("TORCH_HOME", "VITVIZ_OFFLINE")}
    tempfile.tempdir = torch_home
    os.environ["TORCH_HOME"] = torch_home
    os.environ["VITVIZ_OFFLINE"] = "1"
    try:
        yield torch_home
    finally:
        tempfile.tempdir = before[0]
        for key, value in before[1].items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(torch_home, ignore_errors=True)


def _photos(folder: Path, count: int, *, seed: int, name: str = "photo{i}.jpg") -> list[str]:
    """`count` new 640x480 JPEGs of random pixels in `folder` (as photos arrive): their paths."""
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        path = folder / name.format(i=i)
        Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)).save(path, quality=90)
        paths.append(str(path))
    return paths


def _random_torchvision_checkpoints(names) -> dict:
    """Random torchvision weights for `names` saved where their real weights would be: {name: the model}."""
    import torchvision

    ckpt = vitviz.sources.checkpoint_dir()
    ckpt.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    out = {}
    for name in names:
        model = getattr(torchvision.models, name)().eval()
        torch.save(model.state_dict(), ckpt / vitviz.get_spec(name).filename)
        out[name] = model
    return out


def _app_table(arch: str, second: str, *, rounds: int, torch_home: str) -> list[tuple[str, float, str]]:
    device = vitviz.default_device()  # the app's: the reference forward runs where the app's does
    tv = _random_torchvision_checkpoints([arch, second])[arch].to(device)
    sync = _sync_of(device)
    from vitviz.server import app, page, runtime, tabs
    from gradio_client import Client, handle_file

    app.demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True, **app.LAUNCH_KWARGS)
    try:
        client = Client(app.demo.local_url, verbose=False)
        paths = _photos(Path(torch_home), rounds + 2, seed=1, name="img{i}.jpg")
        x = torch.randn(1, 3, tv.image_size, tv.image_size, device=device)
        counter = {"i": 0}

        def tv_forward():
            with torch.inference_mode():
                tv(x)
            sync()

        def api_new_image():
            counter["i"] += 1
            client.predict(handle_file(str(paths[counter["i"] % len(paths)])), arch, api_name="/analyze")

        times = measure({"torchvision forward": tv_forward, "/analyze, new image (gradio_client)": api_new_image}, rounds=rounds)
        base = statistics.median(times["torchvision forward"])

        ref = page.on_analyze(str(paths[0]), arch, "mean", 0.0, progress=lambda *a, **k: None)[page.PAGE.state]
        layers = runtime.STORE.get(ref.key).analysis.attentions.shape[0]
        tokens = runtime.STORE.get(ref.key).analysis.attentions.shape[-1]
        # two sessions with an analysis each: one fetches the output images as the client does by
        # default, the other leaves them on the server (a page fetches them itself, in parallel)
        client.predict(handle_file(str(paths[0])), arch, "mean", 0.0, api_name="/session_analyze")
        viewer = Client(app.demo.local_url, verbose=False, download_files=False)
        viewer.predict(handle_file(str(paths[0])), arch, "mean", 0.0, api_name="/session_analyze")
        floor = _echo_app()
        echo = Client(floor.local_url, verbose=False)
        calls, undo = _count_model_calls()
        k = {"i": 0}

        class _Click:
            def __init__(self, i):
                self.index = [37 * i % 380, 53 * i % 380]

        def tick():
            k["i"] += 1
            return k["i"]

        handler_views = {
            "view: layer (handler)": lambda: tabs.explorer.TAB.on_view(ref, 1 + tick() % layers, "mean", 0),
            "view: head (handler)": lambda: tabs.explorer.TAB.on_view(ref, layers, ["mean", "max", "head 1", "head 2"][tick() % 4], 0),
            "view: query patch (handler)": lambda: tabs.explorer.TAB.on_click(ref, layers, "mean", tabs.explorer.SCALES[0], _Click(tick())),
            "view: rollout option (handler)": lambda: tabs.predict.TAB.on_rollout_options(ref, ["mean", "max", "min"][tick() % 3], 0.1 * (k["i"] % 9)),
        }
        client_views = {
            "view: layer (gradio_client)": lambda: viewer.predict(1 + tick() % layers, "mean", 0, "each map its own", api_name="/session_view"),
            "view: head (gradio_client)": lambda: viewer.predict(layers, ["mean", "max", "head 1", "head 2"][tick() % 4], 0, "each map its own", api_name="/session_view"),
            "view: query patch (gradio_client)": lambda: viewer.predict(layers, "mean", 1 + 37 * tick() % (tokens - 1), "each map its own", api_name="/session_view"),
            "view: rollout option (gradio_client)": lambda: viewer.predict(["mean", "max", "min"][tick() % 3], 0.1 * (k["i"] % 9), api_name="/session_rollout"),
            "view: layer (gradio_client, images fetched)": lambda: client.predict(1 + tick() % layers, "mean", 0, "each map its own", api_name="/session_view"),
            "gradio_client floor: a trivial echo app": lambda: echo.predict("x", api_name="/echo"),
        }
        try:
            views = measure({**handler_views, **client_views}, rounds=rounds * 2, warmup=1)
        finally:
            undo()
            floor.close()
        assert calls["n"] == 0, f"a view change called the model {calls['n']} times"

        def single(name):
            return lambda: page.api_analyze(str(paths[1]), name)

        compare = measure(
            {f"analyze {arch}": single(arch), f"analyze {second}": single(second), "Compare (both)": lambda: tabs.compare.TAB.on_compare(str(paths[1]), [arch, second])},
            rounds=max(3, rounds // 2),
        )
        rss = _peak_rss_subprocess(arch, torch_home)
    finally:
        app.demo.close()

    rows = [(k, statistics.median(v) * 1e3, f"{statistics.median(v) / base:.2f}x forward") for k, v in times.items()]
    rows += [(k, statistics.median(v) * 1e3, "" if k.startswith("gradio_client floor") else "model calls: 0") for k, v in views.items()]
    pair = statistics.median(compare[f"analyze {arch}"]) + statistics.median(compare[f"analyze {second}"])
    for k, v in compare.items():
        note = f"{statistics.median(v) / pair:.2f}x the two singles" if k.startswith("Compare") else ""
        rows.append((k, statistics.median(v) * 1e3, note))
    rows.append((f"peak resident memory, {arch} loaded + one analysis", rss, "MB (not ms)"))
    return rows


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


def evaluate_table(arch: str = "vit_b_16", *, images: int = 128, processes=(1, 2), metrics: str = "distance",
                   methods: str = "rollout,gradient", batch_size: int = 32) -> list[tuple[int, float, float, float, str, float]]:
    """`python -m vitviz.evaluate` over a folder of 640x480 JPEGs, on 1 process and on N (torchrun,
    gloo on CPU, NCCL on GPUs): (processes, images/s, plain batched forwards' images/s on the same
    ranks, ratio, what the plain pass is, the share of the run a rank waited for decoded images). When the run scores a gradient method's maps, the plain pass
    is a forward and a backward to the input. torchvision variants load random weights through the
    real weights path."""
    import subprocess
    import sys

    rows = []
    with _private_weights() as home:
        if vitviz.get_spec(arch).source == "torchvision":
            _random_torchvision_checkpoints([arch])
        folder = Path(home) / "photos"
        (folder / "masks").mkdir(parents=True)
        _photos(folder, images, seed=5, name="{i:04d}.jpg")
        mask = np.zeros((480, 640), dtype=np.uint8)
        mask[120:360, 160:480] = 255  # an object in the middle, for the pointing game
        for i in range(images if "pointing" in metrics else 0):
            Image.fromarray(mask).save(folder / "masks" / f"{i:04d}.png")
        root = Path(__file__).resolve().parent.parent
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
        for n in processes:
            out = Path(home) / f"out{n}"
            args = ["-m", "vitviz.evaluate", str(folder), "--model", arch, "--metrics", metrics, "--methods", methods,
                    "--batch-size", str(batch_size), "--out", str(out)]
            cmd = [sys.executable, *args] if n == 1 else ["torchrun", "--standalone", f"--nproc_per_node={n}", *args]
            subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
            run = json.loads((out / "run.json").read_text())
            rate = run["images_per_second"]
            both = run.get("plain_forward_backward_images_per_second")  # a gradient method's maps: against forwards and backwards
            plain = both or run["plain_forward_images_per_second"]
            waited = run["sessions"][-1]["data_wait_seconds"] / run["sessions"][-1]["seconds"]  # the share of the run spent waiting for images
            rows.append((n, rate, plain, rate / plain, "forwards + backwards" if both else "forwards", waited))
    return rows


def evaluator_pass_table(arch: str = "vit_b_16", *, batch: int = 16, rounds: int = 5,
                         device: torch.device = torch.device("cpu")) -> list[tuple[str, float, float, str]]:
    """The evaluator's own scoring of one batch in memory (`vitviz.evaluate._score`, no decoding, no
    files), timed in turn with the plain passes it is held to, in this process: (what, median s,
    median over the rounds of the plain pass's time over its time in the same round, what the plain
    pass is). Across a whole run the machine's speed drifts between the run and its plain passes;
    here each ratio pairs two passes timed one after the other. On `device` as a run's rank: the model
    and the plain passes' input there, the batch on the CPU as the data loader hands it over.
    torchvision variants load random weights through the real weights path (the ratios do not
    depend on the weights)."""
    from vitviz import evaluate

    with _private_weights():
        if vitviz.get_spec(arch).source == "torchvision":
            _random_torchvision_checkpoints([arch])
        model = vitviz.load_model(arch, device=device)
    size = model.image_size
    x = torch.randn(batch, 3, size, size)
    x_on = x.to(device)
    sync = _sync_of(device)
    mask = torch.zeros(batch, size, size, dtype=torch.bool)
    mask[:, size // 4 : 3 * size // 4, size // 4 : 3 * size // 4] = True
    items = [evaluate.Item(i, f"{i}.jpg", None, None, f"{i}.jpg", "") for i in range(batch)]
    data = evaluate._batch_in_memory(x, mask)

    rows = []
    for name, metrics, methods, backward in (("distance", ["distance"], [], False), ("pointing, gradient", ["pointing"], ["gradient"], True)):
        times = measure({"pass": lambda: evaluate._score(model, data, items, methods=methods, metrics=metrics, steps=16),
                         "plain": lambda: evaluate._plain_pass(model, x_on, backward=backward)}, rounds=rounds, warmup=1, sync=sync)
        what = "forwards + backwards" if backward else "forwards"
        paired = statistics.median(plain / mine for plain, mine in zip(times["plain"], times["pass"]))
        rows.append((name, statistics.median(times["pass"]), paired, what))
    return rows


def attention_part_table(arch: str = "vit_b_16", *, batch: int = 32, rounds: int = 9,
                         device: torch.device = torch.device("cpu")) -> list[tuple[str, float, float]]:
    """One layer's attention of a batch (random queries, keys and values of `arch`'s shape, 224 px or
    its own size) as the evaluator's distance pass computes it (`Attention._by_parts` with the
    per-head distances as the reduction), a few images at a time, against the fused attention that a
    plain forward runs: (what, median ms, ratio to the fused attention's time)."""
    import torch.nn.functional as F

    from vitviz import evaluate
    from vitviz.analysis import mean_attention_distance
    from vitviz.model import Attention

    spec = vitviz.get_spec(arch)
    c = spec.config
    layer = Attention(width=c.width, heads=c.heads).eval().to(device)
    tokens = c.grid[0] * c.grid[1] + c.num_prefix_tokens
    q, k, v = (torch.randn(batch, c.heads, tokens, c.width // c.heads, device=device) for _ in range(3))

    def reduce(a: torch.Tensor, first: int, total: int) -> None:
        mean_attention_distance(a.unsqueeze(0), patch_size=c.patch_size, num_prefix_tokens=c.num_prefix_tokens, grid=c.grid)

    chosen = evaluate._attention_part(vitviz.ViT(c), torch.empty(batch, 3, c.image_size, c.image_size))
    parts = sorted({chosen, 4, batch})
    candidates = {"fused attention (a plain forward's)": lambda: F.scaled_dot_product_attention(q, k, v)}
    for n in parts:
        name = f"with distances, {n} image{'s' if n > 1 else ''} at a time" + (" (the pass's)" if n == chosen else "")
        candidates[name] = lambda n=n: layer._by_parts(q, k, v, reduce, n)
    with torch.inference_mode():
        times = measure(candidates, rounds=rounds, warmup=2, sync=_sync_of(device))
    fused = statistics.median(times["fused attention (a plain forward's)"])
    return [(name, 1e3 * statistics.median(t), statistics.median(t) / fused) for name, t in times.items()]


_KIND_CODE = """
import json, os, sys, time, torch
torch.set_num_threads({threads})
import vitviz
from vitviz.cost import price
from vitviz.server import explaining, explorer_data, views
from vitviz.server.export import Downloads
from vitviz.server.models import ModelCache
from vitviz.server.memory import release_memory
def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key + ":"))
variant, kind = {variant!r}, {kind!r}
cache = ModelCache()
model, facts = cache.get(variant)
image = "{image}"
image_text = hasattr(model, "image")
if (kind == "find" and not image_text) or (kind == "faithfulness" and image_text):  # phrases need a text tower, curves a classifier
    print(json.dumps(dict(skip=True))); sys.exit(0)
exp = views.explore(cache, image, variant)
maps, index = explaining.explain_exploration(cache, exp, target=None) if kind == "faithfulness" else (None, None)
PHRASES = ["a red star", "a blue circle", "a green square", "a yellow triangle"]  # Find: four phrases at once
cost = price(model.spec, "explain" if kind == "find" else kind, budget={budget}, layer_gradients=kind in ("explain", "faithfulness"),
             phrases=len(PHRASES) if kind == "find" else 0)
from vitviz.cost import forward_flops
x = torch.zeros(1, 3, model.spec.image_size, model.spec.image_size, device=next(model.parameters()).device)
plain = []
with torch.inference_mode():
    for _ in range(3):  # the speed a plain forward runs at here, which prices the request in seconds
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter(); model.image(x) if image_text else model(x)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        plain.append(time.perf_counter() - t)
speed = forward_flops(model.spec) / sorted(plain)[1]
if kind == "find":  # the tokenizer read and the text tower run once, as a server has after its first Find
    explaining.find_phrases(cache, exp, PHRASES[:1], method="gradient")
release_memory(keep=0)
open("/proc/self/clear_refs", "w").write("5")  # the peak starts again from here
base = status("VmRSS")
gpu = torch.cuda.is_available()
if gpu:
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); gpu_base = torch.cuda.memory_allocated()
start = time.perf_counter()
from vitviz.server import swin_views
rollout = swin_views.render_rollout if swin_views.is_swin(exp) else views.render_rollout  # what the page draws
if kind == "analyse":
    e = views.explore(cache, image, variant); e.analysis.distances(); rollout(e)
elif kind == "explain":
    explaining.explain_exploration(cache, exp, target=None)
elif kind == "faithfulness":
    explaining.faithfulness_of(cache, exp, maps, target=index, batch_size=cost.batch)
elif kind == "export":
    Downloads().npz(exp, size=cost.kept_bytes)
elif kind == "explorer" and swin_views.is_swin(exp):
    from vitviz.server import swin_explorer
    swin_explorer.write_payload(exp, key="bench", folder=Downloads().folder, spec=model.spec)
elif kind == "explorer":
    explorer_data.write_payload(exp, key="bench", folder=Downloads().folder)
elif kind == "view":
    rollout(exp, head_fusion="max")
elif kind == "find":
    explaining.find_phrases(cache, exp, PHRASES, method="gradient")
if gpu:
    torch.cuda.synchronize()
seconds = time.perf_counter() - start
gpu_peak = torch.cuda.max_memory_allocated() - gpu_base if gpu else None
print(json.dumps(dict(peak=status("VmHWM") - base, seconds=seconds, price=cost.bytes, flops=cost.flops, gpu_peak=gpu_peak,
                      priced_seconds=cost.flops / speed, line=cost.line)))
"""


def serving_table(variants=("shapes_p16@384", "vit_b_16"), kinds=("analyse", "explain", "faithfulness", "export", "explorer", "view", "find"),
                  *, budget: int = 6144 * 2**20) -> list[tuple[str, str, float, float, float, float | None, float, float | None]]:
    """For each variant and kind of request, in a fresh process: (variant, kind, priced MB, measured
    peak MB above the process's resident memory before the request, priced seconds (its work at the
    speed of a plain forward of the same model, timed in that process), priced seconds at its line's
    learned speed (`Cost.line`; the median speed, flops per second, that the other variants' requests of
    the same line ran at here, as a server learns it from the jobs it ran; None when no other variant
    has one), seconds, and on a GPU the peak MB of CUDA memory allocated above what was before the
    request, else None)."""
    import subprocess
    import sys

    rows = []
    with _private_weights() as torch_home:
        _random_torchvision_checkpoints([v for v in variants if v in {s.name for s in vitviz.list_variants()} and vitviz.get_spec(v).source == "torchvision"])
        image = str(Path(vitviz.sources.assets_dir()) / "examples" / "star.png")
        for variant in variants:
            has_head = vitviz.get_spec(variant).has_head
            for kind in kinds:
                if (kind == "find" and has_head) or (kind == "faithfulness" and not has_head):  # a text tower's; a classifier's
                    continue
                code = _KIND_CODE.format(threads=torch.get_num_threads(), variant=variant, kind=kind, image=image, budget=budget)
                env = dict(os.environ, TORCH_HOME=torch_home, VITVIZ_OFFLINE="1")
                out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
                if out.returncode:
                    raise RuntimeError(f"--serving: the {kind} of {variant} failed:\n{out.stderr[-3000:]}")
                got = json.loads(out.stdout.strip().splitlines()[-1])
                if got.get("skip"):  # a kind the model has no use for
                    continue
                rows.append(dict(got, variant=variant, kind=kind))
    from vitviz.server.work import LineTimes

    table = []
    for row in rows:
        others = [r for r in rows if r["line"] == row["line"] and r["variant"] != row["variant"] and r["flops"] > 0]
        times = LineTimes(rate=1.0)  # what a server learns from the other variants' jobs of the line
        for r in others:
            times.add(r["line"], r["flops"], r["seconds"])
        learned = times.estimate(row["line"], row["flops"]) if others and row["flops"] > 0 else None
        gpu = row.get("gpu_peak")
        table.append((row["variant"], row["kind"], row["price"] / 2**20, row["peak"] / 2**20, row["priced_seconds"], learned,
                      row["seconds"], None if gpu is None else gpu / 2**20))
    return table


FLOODS = {
    # what 127.0.0.2 sends, as many as its share of the queue allows (two per session)
    "swin": ("analyze", "shapes_swin@1824", None),
    "find": ("session_find", "shapes_clip@592", "a star, a circle, a square, a triangle"),
}


def flood_table(victim: str = "vit_b_16", floods=("swin", "find"), *, rounds: int = 5) -> list[tuple[str, float, float, int]]:
    """Another address's flood against one client's analyses, through the running app over raw HTTP.
    For each flood: (flood, the victim's `/analyze` seconds alone and during the flood (medians of
    `rounds`, one after another), the flood's requests completed meanwhile). The flood comes from 127.0.0.2: every
    request its share of the queue allows (`VITVIZ_ADDRESS_JOBS`, two per session), sent again as
    each ends, for as long as the victim's requests last."""
    import threading
    import uuid

    import httpx

    with _private_weights():
        if vitviz.get_spec(victim).source == "torchvision":
            _random_torchvision_checkpoints([victim])
        from vitviz.server import app, runtime

        app.demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True, **app.LAUNCH_KWARGS)
        base = app.demo.local_url.rstrip("/")
        config = httpx.get(f"{base}/config").json()
        index = {d.get("api_name"): d["id"] for d in config["dependencies"]}
        image = str(Path(vitviz.sources.assets_dir()) / "examples" / "star.png")

        def client(address):
            return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=600)

        def upload(http):
            with open(image, "rb") as f:
                path = http.post(f"{base}/gradio_api/upload", files=[("files", ("star.png", f.read()))]).json()[0]
            return {"path": path, "meta": {"_type": "gradio.FileData"}}

        def call(http, name, data, session, count=1):
            """`count` joins of the event in one session, then their results; how many succeeded."""
            body = {"data": data, "fn_index": index[name], "session_hash": session, "event_data": None, "trigger_id": None}
            joined = sum(http.post(f"{base}/gradio_api/queue/join", json=body).status_code == 200 for _ in range(count))
            if not joined:
                raise RuntimeError(f"{name}: refused")
            done = ok = 0
            with http.stream("GET", f"{base}/gradio_api/queue/data", params={"session_hash": session}) as s:
                for line in s.iter_lines():
                    msg = json.loads(line[5:]) if line.startswith("data:") else {}
                    if msg.get("msg") == "process_completed":
                        done, ok = done + 1, ok + bool(msg.get("success"))
                        if done == joined:
                            break
            if count == 1 and not ok:
                raise RuntimeError(f"{name}: {msg.get('output')}")
            return ok

        rows = []
        try:
            mine = client("127.0.0.1")
            picture = upload(mine)

            def victim_seconds():
                out = []
                for _ in range(rounds):
                    start = time.perf_counter()
                    call(mine, "analyze", [picture, victim], uuid.uuid4().hex)
                    out.append(time.perf_counter() - start)
                return statistics.median(out)

            victim_seconds()  # (the model loaded and warm)
            for flood in floods:
                name, variant, text = FLOODS[flood]
                theirs = client("127.0.0.2")
                their_picture = upload(theirs)
                sessions = [uuid.uuid4().hex for _ in range(runtime.SETTINGS.address_jobs // 2)]
                if text is not None:  # (each session's analysis first, its flood of phrases after)
                    for session in sessions:
                        call(theirs, "session_analyze", [their_picture, variant, "mean", 0.0, None], session)
                data = [their_picture, variant] if text is None else [None, text, "legrad"]
                alone = victim_seconds()
                stop, taken = threading.Event(), [0]

                def flooding(session):
                    with client("127.0.0.2") as http:
                        while not stop.is_set():
                            try:
                                taken[0] += call(http, name, data, session, count=2)
                            except RuntimeError:
                                time.sleep(0.05)

                threads = [threading.Thread(target=flooding, args=(s,), daemon=True) for s in sessions]
                for t in threads:
                    t.start()
                deadline = time.monotonic() + 120
                while not any(j.owner == "127.0.0.2" for j in runtime.WORK.running()) and time.monotonic() < deadline:
                    time.sleep(0.05)
                during = victim_seconds()
                stop.set()
                for session in sessions:
                    runtime.WORK.cancel(session)
                for t in threads:
                    t.join(600)
                rows.append((flood, alone, during, taken[0]))
        finally:
            app.demo.close()
        return rows


_PEAK_OF_LOAD = """
import sys, time
import numpy as np
from PIL import Image
def status(key):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key + ":")) / 1024
path, how = sys.argv[1], sys.argv[2]
before = status("VmRSS")
t = time.perf_counter()
if how == "vitviz":
    import vitviz
    before = status("VmRSS")
    t = time.perf_counter()
    vitviz.load_image(path)
else:  # the plain conversion: the float pixels as a float64 array, scaled to 8 bits
    np.clip(np.asarray(Image.open(path), dtype=np.float64) * 255, 0, 255).astype(np.uint8)
print(status("VmHWM") - before, time.perf_counter() - t)
"""


def inputs_table(rounds: int = 5) -> list[tuple[str, str, float, float]]:
    """(input, how, median seconds, peak MB above the process's resident size before) for the
    hostile images of a checkout's tests/corpus.py: a 20 MB GIF of 1.38 million frames and a 40 MP
    float TIFF, each read in a fresh process (peak = VmHWM - VmRSS, Linux)."""
    import subprocess
    import sys
    import tempfile

    corpus_dir = Path(__file__).resolve().parent.parent / "tests"
    if not (corpus_dir / "corpus.py").is_file():
        raise SystemExit("--inputs needs a checkout of vitviz (it reads tests/corpus.py)")
    sys.path.insert(0, str(corpus_dir))
    import corpus

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, data, hows in (("GIF, 1.38 M frames", corpus.many_frames_gif(), ("vitviz",)),
                                 ("TIFF, 40 MP float", corpus.float_tiff(), ("vitviz", "float64"))):
            path = Path(tmp) / ("input.gif" if "GIF" in name else "input.tiff")
            path.write_bytes(data)
            for how in hows:
                runs = [subprocess.run([sys.executable, "-c", _PEAK_OF_LOAD, str(path), how], capture_output=True, text=True, check=True)
                        for _ in range(rounds)]
                peaks, seconds = zip(*(map(float, r.stdout.split()) for r in runs))
                rows.append((name, how, statistics.median(seconds), statistics.median(peaks)))
    return rows


def training_table(name: str = "shapes_p8", *, batch: int = 64, rounds: int = 10,
                   device: torch.device = torch.device("cpu")) -> list[tuple[str, float]]:
    """(what, median ms) for one training step of an embedded model on random images: forward and
    backward with the fused attention kernel and with the plain softmax product; an optimizer step
    of `torch.optim.Muon` (as `vitviz.dev.train_shapes.muon`) and of AdamW on the encoder's matrices; and
    images per second for eager and `torch.compile`d forward and backward at twice the batch."""
    from vitviz.sources import get_spec
    from vitviz.dev.train_shapes import muon

    torch.manual_seed(0)
    model = get_spec(name).build().train().to(device)
    side = model.image_size
    x, y = torch.randn(batch, 3, side, side, device=device), torch.randint(0, model.num_classes, (batch,), device=device)
    sync = _sync_of(device)
    attention = [m for m in model.modules() if hasattr(m, "fused")]

    def step(fused: bool, net=model, xb=x, yb=y):
        for m in attention:
            m.fused = fused
        model.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(net(xb), yb).backward()

    times = measure({"fused": lambda: step(True), "plain": lambda: step(False)}, rounds=rounds, sync=sync)
    rows = [(f"forward + backward, batch {batch}, fused attention", 1e3 * statistics.median(times["fused"])),
            (f"forward + backward, batch {batch}, plain softmax product", 1e3 * statistics.median(times["plain"]))]
    step(True)
    matrices = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2]
    optimizers = {"Muon": muon(matrices, lr=1e-3, weight_decay=0.05), "AdamW": torch.optim.AdamW(matrices, lr=1e-3, weight_decay=0.05)}
    times = measure({k: o.step for k, o in optimizers.items()}, rounds=rounds, sync=sync)
    rows += [(f"optimizer step, {k}, {len(matrices)} matrices", 1e3 * statistics.median(times[k])) for k in optimizers]
    big = batch * 2
    xb, yb = torch.randn(big, 3, side, side, device=device), torch.randint(0, model.num_classes, (big,), device=device)
    compiled = torch.compile(model)
    times = measure({"eager": lambda: step(True, model, xb, yb), "compiled": lambda: step(True, compiled, xb, yb)}, rounds=rounds, warmup=3,
                    sync=sync)
    rows += [(f"images/s forward + backward, batch {big}, {k}", big / statistics.median(times[k])) for k in ("eager", "compiled")]
    return rows


def _print_table(title: str, rows: list[tuple[str, float, float]]) -> None:
    print(f"\n{title}")
    print(f"{'path':<46}{'median ms':>12}{'ratio':>9}")
    for name, ms, ratio in rows:
        print(f"{name:<46}{ms:>12.1f}{ratio:>9.2f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="vit_b_16")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--cpu-only", action="store_true", help="the same as --device cpu")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="auto: as each row says (see above); cpu: every GPU hidden from this process and the processes it "
                         "starts; cuda: every row that has a device on CUDA, an error without one")
    ap.add_argument("--app", action="store_true", help="end to end through the app instead of the model paths")
    ap.add_argument("--second", default="vit_b_32", help="the other variant of the Compare timing (with --app)")
    ap.add_argument("--browser", action="store_true", help="in Chromium: view changes and new analyses as a person sees them")
    ap.add_argument("--models", nargs="+", default=["shapes_p16", "vit_b_16"], help="the models of --browser")
    ap.add_argument("--handler", action="store_true", help="a new analysis in the app's handler (no browser) against the forward")
    ap.add_argument("--evaluate", action="store_true", help="python -m vitviz.evaluate on 1 and --processes processes")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--images", type=int, default=128)
    ap.add_argument("--metrics", default=None, help="the metrics of --evaluate (default: distance, then pointing with gradient)")
    ap.add_argument("--inputs", action="store_true", help="hostile images (a checkout's tests/corpus.py): seconds and peak memory")
    ap.add_argument("--training", action="store_true", help="a shapes_p8 training step: attention kernels, optimizers, torch.compile")
    ap.add_argument("--serving", action="store_true", help="each kind of request priced and measured; one client's share of the queue")
    ap.add_argument("--flood", action="store_true", help="one client's analyses (--arch) while another address floods Swin or Find requests")
    ap.add_argument("--relevance", action="store_true", help="gradient relevance of a batch against a plain forward and backward")
    ap.add_argument("--batch", type=int, default=None,
                    help="the batch of --relevance and of --evaluate's passes in memory (default 8), of --training (default 64)")
    args = ap.parse_args(argv)
    batch = args.batch or (64 if args.training else 8)
    device = "cpu" if args.cpu_only else args.device
    if device == "cpu":  # before anything asks torch about CUDA: it counts the devices once
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        if torch.cuda.is_available():
            raise SystemExit("--device cpu: CUDA was queried before the GPUs could be hidden; run with CUDA_VISIBLE_DEVICES=''")
    elif device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU and a torch built with CUDA; torch.cuda.is_available() is False here "
                         "(leave out --device to time on the CPU)")
    # the model paths and --relevance: the CPU and, with a GPU, CUDA beside it; the other in-process rows: one device
    both = [torch.device(d) for d in (("cpu", "cuda") if torch.cuda.is_available() else ("cpu",))] if device == "auto" else [torch.device(device)]
    one = torch.device("cuda" if device == "cuda" else "cpu")

    def title(d: torch.device) -> str:
        return f"CUDA ({torch.cuda.get_device_name()})" if d.type == "cuda" else "CPU"

    if args.relevance:
        print(f"vitviz.dev.bench --relevance {args.arch}, batch {batch}, {args.rounds} rounds; {time.strftime('%Y-%m-%d')}; {_machine()}")
        for d in both:
            _print_table(title(d), relevance_table(args.arch, d, batch=batch, rounds=args.rounds * (3 if d.type == "cuda" else 1)))
        print("\ntarget: relevance_maps <= 1.05x the plain forward and backward")
        return
    if args.inputs:
        print(f"vitviz.dev.bench --inputs; {time.strftime('%Y-%m-%d')}; {_machine()}; each read in a fresh process, median of 5")
        print(f"\n{'input':<22}{'read by':<10}{'seconds':>10}{'peak MB':>10}")
        for name, how, seconds, peak in inputs_table():
            print(f"{name:<22}{how:<10}{seconds:>10.3f}{peak:>10.0f}")
        return
    if args.training:
        print(f"vitviz.dev.bench --training shapes_p8, {args.rounds} rounds, on {title(one)}; {time.strftime('%Y-%m-%d')}; {_machine()}")
        for what, value in training_table(batch=batch, rounds=args.rounds, device=one):
            print(f"{what:<58}{value:>10.1f}")
        return
    if args.serving:
        print(f"vitviz.dev.bench --serving; {time.strftime('%Y-%m-%d')}; {_machine()}")
        print("each request in a fresh process, random weights; peak = VmHWM above VmRSS before the request")
        gpu = torch.cuda.is_available()  # the fresh processes see what this one sees
        print("priced s: the request's work at the speed of a plain forward of the model, timed in the same process")
        print("line s: the same work priced by what the other variants' requests of its line (kind and family) took here (vitviz.server.work.LineTimes)")
        print(f"\n{'variant':<18}{'kind':<14}{'priced MB':>11}{'peak MB':>10}{'ratio':>7}{'priced s':>10}{'line s':>8}{'seconds':>10}{'ratio':>7}"
              + (f"{'GPU peak MB':>13}" if gpu else ""))
        variants = tuple(args.models) if args.models != ["shapes_p16", "vit_b_16"] else ("shapes_p16@384", "vit_b_16")
        for variant, kind, priced, peak, priced_s, line_s, seconds, gpu_peak in serving_table(variants):
            line = "-" if line_s is None else f"{line_s:.2f}"
            line_ratio = "-" if line_s is None else f"{line_s / seconds:.2f}"
            print(f"{variant:<18}{kind:<14}{priced:>11.0f}{peak:>10.0f}{priced / max(peak, 1):>7.2f}{priced_s:>10.2f}{line:>8}{seconds:>10.2f}"
                  f"{line_ratio:>7}" + (f"{gpu_peak:>13.0f}" if gpu_peak is not None else ""))
        return
    if args.flood:
        print(f"vitviz.dev.bench --flood; {time.strftime('%Y-%m-%d')}; {_machine()}")
        print(f"{args.arch} through /analyze from 127.0.0.1, medians of 5, alone and while 127.0.0.2 sends all its share allows")
        print(f"\n{'flood':<8}{'alone s':>9}{'during s':>10}{'ratio':>7}{'flood requests done':>21}")
        for flood, alone, during, taken in flood_table(args.arch):
            print(f"{flood + ' (' + FLOODS[flood][1] + ')':<8}{alone:>9.2f}{during:>10.2f}{during / alone:>7.2f}{taken:>21}")
        return
    if args.handler:
        print(f"vitviz.dev.bench --handler {args.arch}, {min(args.rounds, 8)} new images; {time.strftime('%Y-%m-%d')}; {_machine()}")
        _print_table(title(vitviz.sources.default_device()), handler_table(args.arch, rounds=min(args.rounds, 8)))  # the app's device
        return
    if args.evaluate:
        print(f"vitviz.dev.bench --evaluate {args.arch}, {args.images} JPEGs of 640x480; {time.strftime('%Y-%m-%d')}; {_machine()}")
        runs = [(args.metrics, "rollout,gradient")] if args.metrics else [("distance", "rollout,gradient"), ("pointing", "gradient")]
        print(f"\n{'metrics':<10}{'methods':<18}{'processes':<11}{'images/s':>10}{'plain, images/s':>17}{'ratio':>8}{'waited':>8}  plain is")
        processes = tuple(dict.fromkeys((1, args.processes)))  # 1 and --processes, once each (.ci/gpu: one per GPU)
        for metrics, methods in runs:
            for n, rate, plain, ratio, reference, waited in evaluate_table(args.arch, images=args.images, processes=processes, metrics=metrics,
                                                        methods=methods):
                print(f"{metrics:<10}{methods:<18}{n:<11}{rate:>10.2f}{plain:>17.2f}{ratio:>8.2f}{waited:>8.1%}  {reference}")
        print(f"\nthe evaluator's scoring of one batch of {batch} in memory on {title(one)}, in turn with its plain passes (this process, 5 rounds; "
              f"ratio: the median of each round's):")
        print(f"{'metrics, methods':<22}{'seconds':>9}{'ratio':>8}  plain is")
        for name, seconds, ratio, reference in evaluator_pass_table(args.arch, batch=batch, device=one):
            print(f"{name:<22}{seconds:>9.2f}{ratio:>8.2f}  {reference}")
        where = title(one) if one.type == "cuda" else f"{torch.get_num_threads()} threads"
        _print_table(f"one layer's attention of 32 images (the runs' batch), {where}; ratio: to the fused attention's time",
                     attention_part_table(args.arch, device=one))
        print("\nwaited: the share of the run the model waited for decoded images (the decoding workers behind)")
        print("targets: distance >= 0.95x plain batched forwards; a gradient method's maps >= 0.9x plain forwards + backwards")
        return
    if args.browser:
        print(f"vitviz.dev.bench --browser {' '.join(args.models)}, {args.rounds} moves each; {time.strftime('%Y-%m-%d')}; {_machine()}")
        print("the app in this process, the system's Chromium headless; random weights through the real weights path")
        print(f"\n{'model':<14}{'what':<46}{'median ms':>11}  note")
        for model, what, ms, note in browser_table(args.models, moves=args.rounds):
            print(f"{model:<14}{what:<46}{ms:>11.1f}  {note}")
        print("\ntargets: view change (hover, click, layer, head) <= 50 ms; new analysis <= 2.0x (forward + upload)")
        return
    if args.app:
        print(f"vitviz.dev.bench --app {args.arch} + {args.second}, {args.rounds} rounds; {time.strftime('%Y-%m-%d')}; {_machine()}")
        print("random weights in a temporary $TORCH_HOME, loaded through the app's real weights path")
        rows = app_table(args.arch, args.second, rounds=args.rounds)
        print(f"\n{'what':<58}{'median ms':>12}  note")
        for name, ms, note in rows:
            print(f"{name:<58}{ms:>12.1f}  {note}")
        print("\ntargets: /analyze <= 2.5x forward; view change <= 80 ms; Compare <= the two singles")
        return
    print(f"vitviz.dev.bench {args.arch}, batch 1, {args.rounds} rounds; {time.strftime('%Y-%m-%d')}; {_machine()}")
    for d in both:
        _print_table(title(d), model_path_table(args.arch, d, rounds=args.rounds * (5 if d.type == "cuda" else 1)))
    print("\ntargets: recording forward <= 1.10, analyze <= 1.20 (ratios to torchvision's forward)")


if __name__ == "__main__":
    main()
