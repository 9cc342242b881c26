"""The figures of docs/inside.md (`python -m vitviz.inside --report`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
import torch
from vitviz.config import ViTConfig
from vitviz.inside.ablation import _importance
from vitviz.inside.lens import class_across_depth, first_top1_layer, lens_of
from vitviz.inside.stream import AblationMode, record_stream
from vitviz.model import ViT
from vitviz.preprocess import to_input


def _fresh_inputs(spec, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` generated shapes images (`vitviz.shapes.generate`) through the model's preprocessing -> ([n, 3, S, S], labels [n])."""
    from PIL import Image

    from vitviz.shapes import generate

    images, labels, _ = generate(n, seed=seed, image_size=spec.preprocessing.image_size)
    x = torch.stack([to_input(Image.fromarray(im), spec.preprocessing) for im in images])
    return x, torch.as_tensor(labels)


def _lens_figures(model: ViT, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> dict:
    """The logit lens over images [n, 3, S, S] with true classes [n]: per layer the top-1 accuracy and
    the mean probability of the true class [L+1]; the first layer at which the true class is top-1
    (mean over the images where it ever is, and how many never); the layer from which it stays top-1."""
    top1, prob, firsts, settled = [], [], [], []
    for s in range(0, len(x), batch_size):
        with torch.inference_mode(), record_stream(model) as rec:
            model(x[s : s + batch_size])
        for stream, label in zip(rec.streams, y[s : s + batch_size].tolist()):
            ranks, values = class_across_depth(lens_of(stream), label)
            top1.append(ranks == 0)
            prob.append(values)
            firsts.append(first_top1_layer(lens_of(stream), label))
            wrong = (ranks != 0).nonzero()
            settled.append(int(wrong[-1]) + 1 if len(wrong) else 0)  # L+1: wrong at the end
    reached = [f for f in firsts if f is not None]
    kept = [s for s in settled if s <= model.config.depth]
    return {"top1_by_layer": torch.stack(top1).float().mean(0).tolist(), "p_true_by_layer": torch.stack(prob).mean(0).tolist(),
            "first_top1": sum(reached) / max(1, len(reached)), "never_top1": len(firsts) - len(reached),
            "settled": sum(kept) / max(1, len(kept))}


def _top_heads(model: ViT, x: torch.Tensor, y: torch.Tensor, mode: AblationMode, batch_size: int, k: int = 5) -> list[tuple[int, int, float]]:
    """The k heads whose ablation alone costs the true class the most probability, mean over the images: (layer, head, mean drop)."""
    drops = torch.cat([_importance(model, x[s : s + batch_size], y[s : s + batch_size], mode=mode, labels=None, template=None)[0]
                       for s in range(0, len(x), batch_size)], dim=-1).mean(dim=-1)  # [L, H]
    heads = drops.shape[1]
    return [(int(i) // heads, int(i) % heads, float(drops.flatten()[i])) for i in drops.flatten().argsort(descending=True)[:k]]


def report(
    names: Sequence[str] | None = None, *, n: int = 1000, ablation_images: int = 1000, seed: int = 3535, batch_size: int = 100
) -> list[dict]:
    """For each shapes ViT classifier (`vitviz.list_variants()` named "shapes_*": not shapes_clip or shapes_swin), over `n`
    fresh images of `seed`: the logit lens' figures (`_lens_figures`) and, over the first
    `ablation_images`, the five heads whose ablation alone costs the true class the most probability
    (zero and mean ablation)."""
    from vitviz.sources import list_variants, load_model

    names = list(names) if names else [s.name for s in list_variants()  # the shapes ViTs (not the image-text or windowed ones)
                                       if s.name.startswith("shapes_") and isinstance(s.config, ViTConfig) and s.has_head]
    out = []
    for name in names:
        start = time.perf_counter()
        model = load_model(name, device="cpu").eval()
        x, y = _fresh_inputs(model.spec, n, seed)
        row = {"variant": name, "images": n, "depth": model.config.depth, "ablation_images": min(ablation_images, n)}
        row |= _lens_figures(model, x, y, batch_size)
        for mode in ("zero", "mean"):
            row[f"top_heads_{mode}"] = _top_heads(model, x[:ablation_images], y[:ablation_images], mode, batch_size)
        row["seconds"] = time.perf_counter() - start
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> None:
    """`python -m vitviz.inside --report`: the figures of docs/inside.md."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m vitviz.inside", description="Logit lens and head ablation on the embedded shapes models (docs/inside.md).")
    ap.add_argument("--report", action="store_true", help="print the figures of docs/inside.md")
    ap.add_argument("--variants", nargs="*", help="default: every shapes_* classifier")
    ap.add_argument("--n", type=int, default=1000, help="fresh images for the lens")
    ap.add_argument("--ablation-images", type=int, default=1000, help="of those, the first ones for head ablation")
    ap.add_argument("--seed", type=int, default=3535, help="training used 0 and 1; any other seed gives images never trained on")
    args = ap.parse_args(argv)
    if not args.report:
        ap.error("nothing to do: pass --report")
    torch.manual_seed(0)
    for r in report(args.variants, n=args.n, ablation_images=args.ablation_images, seed=args.seed):
        print(f"{r['variant']}: {r['images']:,} fresh images (seed {args.seed}), top-1 {r['top1_by_layer'][-1]:.1%}, {r['depth']} layers")
        print(f"  logit lens: the true class first ranked top-1 at layer {r['first_top1']:.2f} on average (0 = the embedding; "
              f"{r['never_top1']} images never), top-1 from layer {r['settled']:.2f} on for good")
        print("  by layer (0 = the embedding): top-1 " + " ".join(f"{v:.1%}" for v in r["top1_by_layer"]) +
              "; probability of the true class " + " ".join(f"{v:.3f}" for v in r["p_true_by_layer"]))
        for mode in ("zero", "mean"):
            heads = ", ".join(f"L{layer}H{h} {d:+.3f}" for layer, h, d in r[f"top_heads_{mode}"])
            print(f"  {mode} ablation, {r['ablation_images']:,} images, mean drop of the true class's probability: {heads}")
        print(f"  {r['seconds']:.0f} s")

