"""A new analysis in the app's handler (no browser), and the app end to end through gradio_client."""

from __future__ import annotations

import dataclasses
import io
import os
import statistics
import threading
import time
from pathlib import Path

import torch
from PIL import Image

import vitviz
from vitviz.dev.bench.common import _count_model_calls, _photos, _private_weights, _random_torchvision_checkpoints, _sync_of, measure


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
    forward) for the plain forward, the analysis as the page asks for it (`Server.run` with a ticket:
    the explorer's pictures before the forward, its file during it), until its explorer's value is
    published for the page and until it returns; the explorer's two pictures on their own, and as PNG
    files for comparison; the analysis without the file, and again with the freed heap handed back to
    the system before and after it (VITVIZ_HEAP_KEEP_MB=0); drawing every output of the analysis for a
    new image on the model shown (`page.analysis_outputs`) and Gradio's postprocessing of those
    outputs. New 640x480 JPEGs; random weights through the real path."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    with _private_weights() as home:
        if vitviz.get_spec(arch).source == "torchvision":
            _random_torchvision_checkpoints([arch])
        import asyncio

        from gradio.state_holder import SessionState

        from vitviz.server import app, page, runtime

        from vitviz.server.pictures import explorer_data, views

        photos = _photos(Path(home), rounds, seed=3)
        model, _ = app.SERVER.cache.get(arch)
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
        ref = page.analysis_outputs(app.SERVER.run(photos[0], arch), photos[0], None)[page.PAGE.state]  # warm-up
        for photo in photos:
            start = time.perf_counter()
            with torch.inference_mode():
                model(x)
            sync()
            times["plain forward"].append(time.perf_counter() - start)
            start, published = time.perf_counter(), []
            with app.SERVER.early.opened(runtime.new_key()) as ticket:  # as the page names its analyses: pictures before the forward
                waiting = threading.Thread(target=lambda: published.append((asyncio.run(app.SERVER.early.wait(ticket, "explorer")),
                                                                             time.perf_counter())))
                waiting.start()  # as the page waits for the explorer (`vitviz.server.early`)
                exp = app.SERVER.run(photo, arch, explorer_key=runtime.new_key(), ticket=ticket)
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
                settings = app.SERVER.settings
                if handed_back:  # as every analysis did before VITVIZ_HEAP_KEEP_MB
                    app.SERVER.settings = dataclasses.replace(settings, heap_keep_bytes=0)
                try:
                    start = time.perf_counter()
                    app.SERVER.run(photo, arch)
                    times["analysis alone, the freed heap handed back before and after" if handed_back else "analysis alone"].append(
                        time.perf_counter() - start)
                finally:
                    app.SERVER.settings = settings
                if handed_back:
                    app.SERVER.run(photo, arch)
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



def _app_table(arch: str, second: str, *, rounds: int, torch_home: str) -> list[tuple[str, float, str]]:
    device = vitviz.default_device()  # the app's: the reference forward runs where the app's does
    tv = _random_torchvision_checkpoints([arch, second])[arch].to(device)
    sync = _sync_of(device)
    from vitviz.server import app, page, tabs
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
        layers = app.SERVER.store.get(ref.key).analysis.attentions.shape[0]
        tokens = app.SERVER.store.get(ref.key).analysis.attentions.shape[-1]
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
