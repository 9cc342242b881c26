"""python -m vitviz.evaluate on 1 and N processes against plain forwards; its passes in memory; one layer's attention by parts."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import vitviz
from vitviz.dev.bench.common import _photos, _private_weights, _random_torchvision_checkpoints, _sync_of, measure


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
        root = Path(vitviz.__file__).resolve().parent.parent  # the checkout (or site-packages) that holds vitviz
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
    """The evaluator's own scoring of one batch in memory (`vitviz.evaluate.batch._score`, no decoding, no
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
    data = evaluate.data._batch_in_memory(x, mask)

    rows = []
    for name, metrics, methods, backward in (("distance", ["distance"], [], False), ("pointing, gradient", ["pointing"], ["gradient"], True)):
        times = measure({"pass": lambda: evaluate.batch._score(model, data, items, methods=methods, metrics=metrics, steps=16),
                         "plain": lambda: evaluate.run._plain_pass(model, x_on, backward=backward)}, rounds=rounds, warmup=1, sync=sync)
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

    chosen = evaluate.batch._attention_part(vitviz.ViT(c), torch.empty(batch, 3, c.image_size, c.image_size))
    parts = sorted({chosen, 4, batch})
    candidates = {"fused attention (a plain forward's)": lambda: F.scaled_dot_product_attention(q, k, v)}
    for n in parts:
        name = f"with distances, {n} image{'s' if n > 1 else ''} at a time" + (" (the pass's)" if n == chosen else "")
        candidates[name] = lambda n=n: layer._by_parts(q, k, v, reduce, n)
    with torch.inference_mode():
        times = measure(candidates, rounds=rounds, warmup=2, sync=_sync_of(device))
    fused = statistics.median(times["fused attention (a plain forward's)"])
    return [(name, 1e3 * statistics.median(t), statistics.median(t) / fused) for name, t in times.items()]
