"""Makes `shapes_p8_outliers`: the embedded `shapes_p8` given high-norm tokens on purpose, and measures
what the detector and the test-time register do with them.

    python -m vitviz.dev.plant_outliers                  # writes assets/shapes_p8_outliers.pt
    python -m vitviz.dev.plant_outliers --measure 1000   # the figures of docs/registers.md

The recipe (no training; deterministic in `--seed`), on `shapes_p8` (6 blocks, width 96, MLP 192):

1. **Where the information is low.** Over `--images` generated images (`vitviz.shapes.generate`,
   seed `--seed`), a ridge regression from block `--layer`'s MLP input (the normed stream) of each
   patch token to the standard deviation of that patch's pixels: the direction w along which the
   model's own features say "this patch is flat".
2. **The neurons.** The `--neurons` least active neurons of that block's MLP (mean |activation|
   over the images) are rewritten: their input weights read -w (scaled), their bias puts the
   threshold at the `--share` quantile of the patches' readings (the flattest 5 % of patches
   fire; the cls token never does), their output weights write random unit directions, scaled so that together
   they add `--boost` (6) times the median token norm at a firing patch. The flattest patches'
   norms jump several times the median from that block on.
3. **The sink.** In every later block, each head's key weights gain its mean cls query plus its
   mean patch query (unit each) times the direction d that separates the outliers' normed stream
   from the rest (their means' difference, unit): every query then finds the outliers (a logit at
   least `--sink` higher for the mean queries); the value weights lose the d component, so attending to an outlier adds nothing to a token.
   That is Darcet et al.'s observation written by hand: high-norm tokens in flat patches that
   the cls token attends to.

The test-time register then moves those neurons' activations into a token outside the image
(`vitviz.registers.with_test_time_register`), and the maps come back.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from vitviz import shapes
from vitviz.analysis import attention_rollout, cls_map, pointing_game
from vitviz.hooks import record_attention
from vitviz.registers import outliers, register_neurons, with_test_time_register
from vitviz.sources import get_spec, load_model

CHECKOUT_ASSETS = Path(__file__).resolve().parents[2] / "assets"
BASE = "shapes_p8"
NAME = "shapes_p8_outliers"
MEASURE_SEED = 2024  # the published figures' images, never used to plant


def _batch(images: np.ndarray) -> torch.Tensor:
    """uint8 [B, S, S, 3] -> the shapes models' input [B, 3, S, S] (mean and std 0.5)."""
    return (torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.5


def _patch_std(images: np.ndarray, patch: int) -> torch.Tensor:
    """Each patch's pixel standard deviation [B, gh*gw] (over its pixels and channels, 0..1)."""
    x = torch.from_numpy(images).float() / 255  # [B, S, S, 3]
    b, s = x.shape[0], x.shape[1]
    g = s // patch
    tiles = x.reshape(b, g, patch, g, patch, 3).permute(0, 1, 3, 2, 4, 5).reshape(b, g * g, -1)
    return tiles.std(dim=-1)


def _inputs(model, x: torch.Tensor, layer: int, part: str) -> torch.Tensor:
    """Block `layer`'s normed input of its MLP ("mlp") or of its attention ("attn") [B, N, D]."""
    kept = {}
    block = model.blocks[layer]
    norm = block.norm2 if part == "mlp" else block.norm1
    handle = norm.register_forward_hook(lambda m, a, out: kept.setdefault("x", out.detach()))
    try:
        with torch.no_grad():
            model(x)
    finally:
        handle.remove()
    return kept["x"]


def plant(model, images: np.ndarray, *, layer: int = 2, neurons: int = 4, share: float = 0.05, boost: float = 6.0,
          sink: float = 9.0, seed: int = 0) -> dict:
    """Plants high-norm tokens into `model` (a shapes ViT, changed in place) by the recipe of the
    module's doc; returns what was planted (neurons, directions' seeds, thresholds)."""
    g = torch.Generator().manual_seed(seed)
    c = model.config
    p, patch = c.num_prefix_tokens, c.patch_size
    x = _batch(images)
    # 1. the flatness direction, read from block `layer`'s MLP input
    h = _inputs(model, x, layer, "mlp")  # [B, N, D]
    feats = h[:, p:].reshape(-1, c.width).double()
    target = _patch_std(images, patch).reshape(-1).double()
    mean_f, mean_t = feats.mean(0), target.mean()
    f0 = feats - mean_f
    ridge = 1e-2 * f0.pow(2).sum(0).mean()
    w = torch.linalg.solve(f0.T @ f0 + ridge * torch.eye(c.width, dtype=torch.float64), f0.T @ (target - mean_t))
    reading = -(h.double() @ w)  # [B, N]: high = flat
    patch_reading = reading[:, p:].reshape(-1)
    tau = float(torch.quantile(patch_reading, 1 - share))
    spread = float(patch_reading.std())
    # 2. the neurons: the least active of the block, rewritten
    mlp = model.blocks[layer].mlp
    fc1, fc2 = getattr(mlp, "0"), getattr(mlp, "2")
    with torch.no_grad():
        acts = torch.nn.functional.gelu(h @ fc1.weight.T + fc1.bias)
    chosen = acts.abs().mean(dim=(0, 1)).argsort()[:neurons].tolist()
    gain = 40.0 / spread  # a reading one spread above the threshold gives a pre-activation of 40 (register neurons are large)
    directions = torch.randn(c.width, neurons, generator=g, dtype=torch.float64)
    directions = directions / directions.norm(dim=0, keepdim=True)
    firing = torch.nn.functional.gelu(gain * (patch_reading - tau))
    firing = float(firing[patch_reading > tau].mean())
    stream: list[torch.Tensor] = []
    with torch.no_grad():
        model.encode(x, layers=stream)
    median = float(stream[layer][:, p:].norm(dim=-1).median())
    # the neurons' writes (random, nearly orthogonal directions) add up to `boost` x the median norm at a firing patch
    scale = boost * median / (math.sqrt(neurons) * firing)
    with torch.no_grad():
        for i, j in enumerate(chosen):
            fc1.weight[j] = (-gain * w).float()
            fc1.bias[j] = float(-gain * tau)
            fc2.weight[:, j] = (scale * directions[:, i]).float()
    # 3. the sink, block by block after `layer`
    norms_after = None
    for b in range(layer + 1, c.depth):
        block = model.blocks[b]
        y = _inputs(model, x, b, "attn")  # [B, N, D], with the blocks before already planted
        if norms_after is None:
            stream = []
            with torch.no_grad():
                model.encode(x, layers=stream)
            norms_after = stream[layer].norm(dim=-1)  # [B, N]
        pn = norms_after[:, p:]
        flag = pn > 2.0 * pn.median(dim=1, keepdim=True).values
        mask = torch.cat([torch.zeros(flag.shape[0], p, dtype=torch.bool), flag], dim=1)
        if not mask.any():
            raise ValueError(f"nothing planted: no patch's norm after block {layer} is twice the median")
        d = (y[mask].mean(0) - y[~mask].mean(0)).double()
        d = d / d.norm()
        base = float((y[~mask].double() @ d).mean())
        lift = float((y[mask].double() @ d).mean()) - base  # the outliers' reading along d, above the others'
        qkv = block.attn.qkv
        heads, hd = c.heads, c.width // c.heads
        with torch.no_grad():
            q = (y @ qkv.weight[: c.width].T + qkv.bias[: c.width]).double().reshape(*y.shape[:2], heads, hd)
            for hh in range(heads):
                # the key direction: the sum of the head's mean cls query and mean patch query (unit each)
                qc, qp = q[:, 0, hh].mean(0), q[:, p:, hh].reshape(-1, hd).mean(0)
                kdir = qc / qc.norm() + qp / qp.norm()
                # logit gain at the outliers: lam * lift * (q . kdir) / sqrt(hd), at least `sink` for both mean queries
                lam = sink * math.sqrt(hd) / (lift * float(min(qc @ kdir, qp @ kdir)))
                rows = slice(c.width + hh * hd, c.width + (hh + 1) * hd)
                qkv.weight[rows] += (lam * torch.outer(kdir, d)).float()
                qkv.bias[rows] -= (lam * kdir * base).float()
            v = slice(2 * c.width, 3 * c.width)
            qkv.weight[v] -= (qkv.weight[v].double() @ torch.outer(d, d)).float()
    return {"layer": layer, "neurons": sorted(chosen), "threshold": tau, "share": share, "boost": boost, "scale": scale, "sink": sink,
            "seed": seed}


def _rollout_maps(model, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits [B, C], cls rollout maps [B, gh, gw] and the norm of every token after each block [B, L, N]."""
    p = model.config.num_prefix_tokens
    stream: list[torch.Tensor] = []
    with torch.inference_mode(), record_attention(model) as rec:
        logits = model.head_logits(model.encode(x, layers=stream))
    attn = rec.attentions  # [L, B, H, N, N]
    g = model.config.grid
    maps = torch.stack([cls_map(attention_rollout(attn[:, i], num_prefix_tokens=p), grid=g, num_prefix_tokens=p) for i in range(x.shape[0])])
    return logits, maps, torch.stack(stream, dim=1).norm(dim=-1)


def measure(n: int, *, batch: int = 100, top_k: int = 4, detect_images: int = 64) -> dict:
    """The figures of docs/registers.md on `n` fresh images (seed `MEASURE_SEED`): the neurons found
    (on `detect_images` other fresh images), then for `shapes_p8`, the planted model and the planted
    model with its test-time register: accuracy, the median ratio of the largest patch norm after the
    last block to the median, the share of outlier patches, and the cls rollout's pointing game
    (argmax on the object, no dilation) and share of its mass on the object — over all images and
    over those where the planted model has an outlier after the last block."""
    base, planted = load_model(BASE).eval(), load_model(NAME).eval()
    card = json.loads((CHECKOUT_ASSETS / f"{NAME}.json").read_text())
    fresh = shapes.generate(detect_images, seed=MEASURE_SEED + 1)[0]
    found = register_neurons(planted, _batch(fresh), top_k=top_k)
    ttr = with_test_time_register(planted, found)
    models = {BASE: base, NAME: planted, f"{NAME}+ttr": ttr}
    cols: dict[str, dict[str, list]] = {name: {k: [] for k in ("correct", "pointing", "mass", "ratio", "share")} for name in models}
    has_outlier: list[bool] = []
    for start in range(0, n, batch):
        images, labels, masks = shapes.generate(min(batch, n - start), seed=MEASURE_SEED, start=start)
        x, y, m = _batch(images), torch.from_numpy(labels), torch.from_numpy(masks)
        cover = torch.nn.functional.avg_pool2d(m.float()[:, None], 8)[:, 0]  # [B, gh, gw]: each patch's share on the object
        for name, model in models.items():
            logits, maps, norms = _rollout_maps(model, x)
            q = model.config.num_prefix_tokens
            last = norms[:, -1, q:]
            flagged = last > 2 * last.median(dim=1, keepdim=True).values
            col = cols[name]
            col["correct"] += (logits.argmax(-1) == y).tolist()
            col["pointing"] += pointing_game(maps, m, patch_size=8, dilate_patches=0).tolist()
            col["mass"] += ((maps * cover).flatten(1).sum(1) / maps.flatten(1).sum(1)).tolist()
            col["ratio"] += (last.max(dim=1).values / last.median(dim=1).values).tolist()
            col["share"] += flagged.float().mean(dim=1).tolist()
            if name == NAME:
                has_outlier += flagged.any(dim=1).tolist()
    sub = np.array(has_outlier)
    out: dict = {"images": n, "with_outliers": int(sub.sum()), "planted": [[card["layer"], j] for j in card["neurons"]],
                 "found": [list(v) for v in found.neurons], "detection_images": found.images,
                 "next_score": found.ranked[top_k][2] if len(found.ranked) > top_k else None,
                 "found_scores": [r[2] for r in found.ranked[:top_k]]}
    for name, col in cols.items():
        a = {k: np.array(v, dtype=float) for k, v in col.items()}
        out[name] = {"accuracy": a["correct"].mean(), "norm_ratio": float(np.median(a["ratio"])), "outlier_share": a["share"].mean(),
                     "pointing": a["pointing"].mean(), "mass": a["mass"].mean(),
                     "pointing_with_outliers": a["pointing"][sub].mean(), "mass_with_outliers": a["mass"][sub].mean(),
                     "norm_ratio_with_outliers": float(np.median(a["ratio"][sub]))}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vitviz.dev.plant_outliers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--images", type=int, default=512, help="generated images the recipe reads")
    parser.add_argument("--layer", type=int, default=2)
    parser.add_argument("--neurons", type=int, default=4)
    parser.add_argument("--share", type=float, default=0.05)
    parser.add_argument("--boost", type=float, default=6.0, help="a firing patch's write over the median token norm")
    parser.add_argument("--sink", type=float, default=9.0)
    parser.add_argument("--out", type=Path, default=CHECKOUT_ASSETS)
    parser.add_argument("--measure", type=int, default=0, help="measure on this many fresh images instead of planting")
    parser.add_argument("--top-k", type=int, default=4)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure, top_k=args.top_k), indent=1))
        return
    start = time.perf_counter()
    torch.manual_seed(args.seed)
    model = load_model(BASE).eval()
    images = shapes.generate(args.images, seed=args.seed)[0]
    card = plant(model, images, layer=args.layer, neurons=args.neurons, share=args.share, boost=args.boost, sink=args.sink, seed=args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), args.out / f"{NAME}.pt")
    card |= {"base": BASE, "images": args.images, "seconds": round(time.perf_counter() - start, 1)}
    (args.out / f"{NAME}.json").write_text(json.dumps(card, indent=1) + "\n")
    print(json.dumps(card))


if __name__ == "__main__":
    main()
