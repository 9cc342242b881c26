"""What every table of the bench shares: the interleaved timer, the machine line, private random weights, photos."""

from __future__ import annotations

import contextlib
import platform
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import vitviz


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
    """Random torchvision weights for `names` saved where their real weights would be: {name: the model}.
    The head's too: torchvision starts it at zeros, which scores every class alike (nothing for a
    gradient or a patched site to tell apart)."""
    import torchvision

    ckpt = vitviz.sources.checkpoint_dir()
    ckpt.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    out = {}
    for name in names:
        model = getattr(torchvision.models, name)().eval()
        torch.nn.init.normal_(model.heads.head.weight, std=0.02)
        torch.save(model.state_dict(), ckpt / vitviz.get_spec(name).filename)
        out[name] = model
    return out



def _print_table(title: str, rows: list[tuple[str, float, float]]) -> None:
    print(f"\n{title}")
    print(f"{'path':<46}{'median ms':>12}{'ratio':>9}")
    for name, ms, ratio in rows:
        print(f"{name:<46}{ms:>12.1f}{ratio:>9.2f}")
