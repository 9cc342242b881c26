"""One training step of an embedded model: attention kernels, optimizers, torch.compile."""

from __future__ import annotations

import statistics

import torch

from vitviz.dev.bench.common import _sync_of, measure


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
