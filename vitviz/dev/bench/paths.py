"""The model paths against torchvision's plain forward, and gradient relevance against a plain forward and backward."""

from __future__ import annotations

import statistics

import numpy as np
import torch
from PIL import Image

import vitviz
from vitviz.dev.bench.common import measure


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
