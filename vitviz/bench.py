"""Side-by-side timings of vitviz against torchvision's plain forward, on the same weights.

    python -m vitviz.bench                   # ViT-B/16, batch 1, CPU (and CUDA when available)
    python -m vitviz.bench --rounds 30 --arch vit_b_32
    python -m vitviz.bench --app             # end to end through the running app (gradio_client)

Each round runs every candidate once, in a rotating order, so that drifts in clock speed and
cache state hit all of them alike; the table shows medians and ratios to torchvision's forward.
Weights are random (the cost does not depend on their values), so no download is needed.
"""

from __future__ import annotations

import argparse
import platform
import statistics
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


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


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


def app_table(arch: str, second: str, *, rounds: int) -> list[tuple[str, float, str]]:
    """End-to-end timings through the running app, on CPU, with random weights in a private cache.

    The app loads `arch` and `second` through its real weights path: their checkpoints (random
    values, the cost does not depend on them) are written to a temporary $TORCH_HOME, which also
    holds every scratch file of the run (gradio_client's downloads) and is removed at the end, when
    the environment and `tempfile.tempdir` are put back as they were.
    """
    import os
    import shutil
    import tempfile

    torch_home = tempfile.mkdtemp(prefix="vitviz-bench-")
    before = tempfile.tempdir, {k: os.environ.get(k) for k in ("TORCH_HOME", "VITVIZ_OFFLINE")}
    tempfile.tempdir = torch_home
    os.environ["TORCH_HOME"] = torch_home
    os.environ["VITVIZ_OFFLINE"] = "1"
    try:
        return _app_table(arch, second, rounds=rounds, torch_home=torch_home)
    finally:
        tempfile.tempdir = before[0]
        for key, value in before[1].items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(torch_home, ignore_errors=True)


def _app_table(arch: str, second: str, *, rounds: int, torch_home: str) -> list[tuple[str, float, str]]:
    import torchvision

    ckpt = vitviz.sources.checkpoint_dir()
    ckpt.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    tv = None
    for name in (arch, second):
        spec = vitviz.get_spec(name)
        model = getattr(torchvision.models, name)().eval()
        torch.save(model.state_dict(), ckpt / spec.filename)
        if name == arch:
            tv = model
    import app
    from gradio_client import Client, handle_file

    app.demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True, **app.LAUNCH_KWARGS)
    try:
        client = Client(app.demo.local_url, verbose=False)
        rng = np.random.default_rng(1)
        paths = []
        for i in range(rounds + 2):
            path = Path(torch_home) / f"img{i}.jpg"  # a 640x480 JPEG, as photos arrive
            Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)).save(path, quality=90)
            paths.append(path)
        x = torch.randn(1, 3, tv.image_size, tv.image_size)
        counter = {"i": 0}

        def tv_forward():
            with torch.inference_mode():
                tv(x)

        def api_new_image():
            counter["i"] += 1
            client.predict(handle_file(str(paths[counter["i"] % len(paths)])), arch, api_name="/analyze")

        times = measure({"torchvision forward": tv_forward, "/analyze, new image (gradio_client)": api_new_image}, rounds=rounds)
        base = statistics.median(times["torchvision forward"])

        ref = app.on_analyze(str(paths[0]), arch, "mean", 0.0, progress=lambda *a, **k: None)[app.state]
        layers = app.STORE.get(ref.key).analysis.attentions.shape[0]
        tokens = app.STORE.get(ref.key).analysis.attentions.shape[-1]
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
            "view: layer (handler)": lambda: app.on_view(ref, 1 + tick() % layers, "mean", 0),
            "view: head (handler)": lambda: app.on_view(ref, layers, ["mean", "max", "head 1", "head 2"][tick() % 4], 0),
            "view: query patch (handler)": lambda: app.on_click(ref, layers, "mean", _Click(tick())),
            "view: rollout option (handler)": lambda: app.on_rollout_options(ref, ["mean", "max", "min"][tick() % 3], 0.1 * (k["i"] % 9)),
        }
        client_views = {
            "view: layer (gradio_client)": lambda: viewer.predict(1 + tick() % layers, "mean", 0, api_name="/session_view"),
            "view: head (gradio_client)": lambda: viewer.predict(layers, ["mean", "max", "head 1", "head 2"][tick() % 4], 0, api_name="/session_view"),
            "view: query patch (gradio_client)": lambda: viewer.predict(layers, "mean", 1 + 37 * tick() % (tokens - 1), api_name="/session_view"),
            "view: rollout option (gradio_client)": lambda: viewer.predict(["mean", "max", "min"][tick() % 3], 0.1 * (k["i"] % 9), api_name="/session_rollout"),
            "view: layer (gradio_client, images fetched)": lambda: client.predict(1 + tick() % layers, "mean", 0, api_name="/session_view"),
            "gradio_client floor: a trivial echo app": lambda: echo.predict("x", api_name="/echo"),
        }
        try:
            views = measure({**handler_views, **client_views}, rounds=rounds * 2, warmup=1)
        finally:
            undo()
            floor.close()
        assert calls["n"] == 0, f"a view change called the model {calls['n']} times"

        def single(name):
            return lambda: app.api_analyze(str(paths[1]), name)

        compare = measure(
            {f"analyze {arch}": single(arch), f"analyze {second}": single(second), "Compare (both)": lambda: app.on_compare(str(paths[1]), [arch, second])},
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


def _print_table(title: str, rows: list[tuple[str, float, float]]) -> None:
    print(f"\n{title}")
    print(f"{'path':<46}{'median ms':>12}{'ratio':>9}")
    for name, ms, ratio in rows:
        print(f"{name:<46}{ms:>12.1f}{ratio:>9.2f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="vit_b_16")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--cpu-only", action="store_true")
    ap.add_argument("--app", action="store_true", help="end to end through the app instead of the model paths")
    ap.add_argument("--second", default="vit_b_32", help="the other variant of the Compare timing (with --app)")
    args = ap.parse_args(argv)
    if args.app:
        print(f"vitviz.bench --app {args.arch} + {args.second}, {args.rounds} rounds; {time.strftime('%Y-%m-%d')}; {_machine()}")
        print("random weights in a temporary $TORCH_HOME, loaded through the app's real weights path")
        rows = app_table(args.arch, args.second, rounds=args.rounds)
        print(f"\n{'what':<58}{'median ms':>12}  note")
        for name, ms, note in rows:
            print(f"{name:<58}{ms:>12.1f}  {note}")
        print("\ntargets: /analyze <= 2.5x forward; view change <= 80 ms; Compare <= the two singles")
        return
    print(f"vitviz.bench {args.arch}, batch 1, {args.rounds} rounds; {time.strftime('%Y-%m-%d')}; {_machine()}")
    _print_table("CPU", model_path_table(args.arch, torch.device("cpu"), rounds=args.rounds))
    if torch.cuda.is_available() and not args.cpu_only:
        _print_table(f"CUDA ({torch.cuda.get_device_name()})", model_path_table(args.arch, torch.device("cuda"), rounds=args.rounds * 5))
    print("\ntargets: recording forward <= 1.10, analyze <= 1.20 (ratios to torchvision's forward)")


if __name__ == "__main__":
    main()
