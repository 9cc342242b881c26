"""Mean attention distance averaged over a folder of images, as in the paper (Figure 7, right;
Appendix D.7 averages over 128 images).

    python -m vitviz.distance IMAGES_DIR --model vit_b_16 [--limit 128] [--batch-size 32] [--out DIR]

Images are read through the image gate and preprocessed in a background thread while the model
runs batched forwards with attention recorded. Writes `<model>_distance.png` (one dot per head and
depth, with the uniform-attention line) and `<model>_distance.csv` (layer, head, mean and standard
deviation over images, in pixels), and prints the images per second next to plain batched
forwards of the same model on the same tensors.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from vitviz import plots
from vitviz.analysis import mean_attention_distance, uniform_attention_distance
from vitviz.hooks import record_attention
from vitviz.images import ImageError, load_image
from vitviz.model import ViT
from vitviz.preprocess import preprocess
from vitviz.sources import load_model

__all__ = ["dataset_distance", "main"]

SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff"}


def _load(path: Path, spec) -> torch.Tensor | None:
    try:
        return preprocess(load_image(path), spec.preprocessing)[0]
    except ImageError as exc:
        print(f"\nskipping {path.name}: {exc}", file=sys.stderr)
        return None


def dataset_distance(
    model: ViT,
    paths: list[Path],
    *,
    batch_size: int = 32,
    renormalize: bool = True,
    progress: bool = True,
) -> tuple[torch.Tensor, int, float]:
    """Mean attention distance of every image.

    Returns:
        distances [I, L, H] in pixels for the I readable images, the count I, and seconds spent.
    """
    spec = model.spec
    param = next(model.parameters())
    out: list[torch.Tensor] = []

    def per_layer(attn: torch.Tensor) -> torch.Tensor:
        """One layer's attention [B, H, N, N] -> distances [B, H], so a batch never holds the stack."""
        return mean_attention_distance(
            attn.float().unsqueeze(0), patch_size=spec.patch_size, num_prefix_tokens=model.num_prefix_tokens,
            renormalize=renormalize, grid=spec.grid,
        )[0]

    start = time.perf_counter()
    bar = tqdm(total=len(paths), unit="img", disable=not progress)
    with bar, ThreadPoolExecutor(max_workers=1) as pool:  # preprocessing overlaps the model
        batches = [paths[i : i + batch_size] for i in range(0, len(paths), batch_size)]
        pending = pool.submit(lambda b: [_load(p, spec) for p in b], batches[0]) if batches else None
        for k in range(len(batches)):
            tensors = [t for t in pending.result() if t is not None]
            pending = pool.submit(lambda b: [_load(p, spec) for p in b], batches[k + 1]) if k + 1 < len(batches) else None
            if tensors:
                x = torch.stack(tensors).to(device=param.device, dtype=param.dtype)
                with torch.inference_mode(), record_attention(model, reduce=per_layer) as rec:
                    model(x)
                out.append(rec.attentions.permute(1, 0, 2).cpu())  # [L, B, H] -> [B, L, H]
            bar.update(len(batches[k]))
    seconds = time.perf_counter() - start
    distances = torch.cat(out) if out else torch.empty(0, model.depth, model.heads)
    return distances, distances.shape[0], seconds


def _plain_rate(model: ViT, x: torch.Tensor, *, batch_size: int) -> float:
    """Images per second of plain batched forwards on already preprocessed tensors."""
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(x), batch_size):
            model(x[i : i + batch_size])
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    return len(x) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("images", type=Path, help="a folder of images (searched recursively)")
    ap.add_argument("--model", required=True, help="a variant name, see vitviz.list_variants()")
    ap.add_argument("--limit", type=int, default=128, help="at most this many images (the paper uses 128)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--no-renormalize", action="store_true", help="do not renormalise patch rows (probing-vits)")
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--device", default=None)
    ap.add_argument("--no-compare", action="store_true", help="skip the plain-forward throughput comparison")
    args = ap.parse_args(argv)

    paths = sorted(p for p in args.images.rglob("*") if p.suffix.lower() in SUFFIXES)[: args.limit]
    if not paths:
        ap.error(f"no images ({', '.join(sorted(SUFFIXES))}) under {args.images}")
    model = load_model(args.model, device=args.device)
    spec = model.spec
    distances, count, seconds = dataset_distance(
        model, paths, batch_size=args.batch_size, renormalize=not args.no_renormalize
    )
    if count == 0:
        sys.exit("no readable images")
    mean, std = distances.mean(0), distances.std(0) if count > 1 else torch.zeros_like(distances[0])
    args.out.mkdir(parents=True, exist_ok=True)
    csv_path = args.out / f"{spec.name}_distance.csv"
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["layer", "head", "mean_distance_px", "std_px", "images"])
        for layer in range(mean.shape[0]):
            for head in range(mean.shape[1]):
                w.writerow([layer + 1, head + 1, f"{mean[layer, head]:.3f}", f"{std[layer, head]:.3f}", count])
    fig = plots.distance_figure(
        mean,
        uniform=uniform_attention_distance(spec.grid, patch_size=spec.patch_size),
        title=f"{spec.name}: mean attention distance over {count} images",
    )
    png_path = args.out / f"{spec.name}_distance.png"
    plots.figure_to_image(fig).save(png_path)
    rate = count / seconds
    print(f"{count} images in {seconds:.1f} s ({rate:.1f} img/s); wrote {csv_path} and {png_path}")
    if not args.no_compare:
        param = next(model.parameters())
        x = torch.randn(min(count, 4 * args.batch_size), 3, spec.image_size, spec.image_size, device=param.device, dtype=param.dtype)
        _plain_rate(model, x[: args.batch_size], batch_size=args.batch_size)  # warm-up
        plain = _plain_rate(model, x, batch_size=args.batch_size)
        print(f"plain batched forwards: {plain:.1f} img/s; this run reached {rate / plain:.2f}x of that")


if __name__ == "__main__":
    main()
