"""Side-by-side timings of vitviz against torchvision's plain forward, on the same weights.

    python -m vitviz.bench                   # ViT-B/16, batch 1, CPU (and CUDA when available)
    python -m vitviz.bench --rounds 30 --arch vit_b_32

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
    args = ap.parse_args(argv)
    print(f"vitviz.bench {args.arch}, batch 1, {args.rounds} rounds; {time.strftime('%Y-%m-%d')}; {_machine()}")
    _print_table("CPU", model_path_table(args.arch, torch.device("cpu"), rounds=args.rounds))
    if torch.cuda.is_available() and not args.cpu_only:
        _print_table(f"CUDA ({torch.cuda.get_device_name()})", model_path_table(args.arch, torch.device("cuda"), rounds=args.rounds * 5))
    print("\ntargets: recording forward <= 1.10, analyze <= 1.20 (ratios to torchvision's forward)")


if __name__ == "__main__":
    main()
