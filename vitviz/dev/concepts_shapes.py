"""The embedded sparse autoencoder of `shapes_p16` (assets/concepts/shapes_p16/), made and measured.

    python -m vitviz.dev.concepts_shapes --make        # scenes written to a temporary folder, then python -m vitviz.concepts train
    python -m vitviz.dev.concepts_shapes --measure 1000 # the AUROC table of docs/concepts.md

The training data are generated scenes of 2-3 coloured shapes (`vitviz.shapes.generate_scenes`,
seed `SEED`), written as PNG files into a folder the trainer reads like any other. The measure asks
whether the features mean something a person would name: on fresh scenes (seed `MEASURE_SEED`), each
patch token of the SAE's layer is labelled, for each of the 8 shapes and 6 colours, by whether half
of the patch or more lies on an object with that attribute; for each attribute the single feature
whose activation best separates those patches from all the others (AUROC, ties ranked by their mean
rank) is reported, and the count of attributes with a feature at AUROC >= 0.9; then the same among
the patches on an object only (the attribute against the other objects, not the background) —
beside a random dictionary of the same size (unit-norm random decoder, encoder its transpose, pre-bias the data's
mean, the same top-k).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from vitviz import shapes
from vitviz.sources import load_model

CHECKOUT_ASSETS = Path(__file__).resolve().parents[2] / "assets"
OUT = CHECKOUT_ASSETS / "concepts" / "shapes_p16"
MODEL = "shapes_p16"
SEED = 31
MEASURE_SEED = 2024
ARGS = dict(layer=3, features=256, k=8, scenes=12000, steps=2000)  # 2,000 steps of 32 scenes: 5.3 epochs


def write_scenes(folder: Path, n: int, *, seed: int) -> None:
    """`n` scenes as `<folder>/<i>.png` (no labels: the trainer follows the model's own predictions)."""
    folder.mkdir(parents=True, exist_ok=True)
    for start in range(0, n, 500):
        images = shapes.generate_scenes(min(500, n - start), seed=seed, start=start)[0]
        for i, image in enumerate(images):
            Image.fromarray(image).save(folder / f"{start + i:06d}.png")


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """AUROC of each column of `scores` [P, F] for each column of `labels` bool [P, A]: [A, F]
    (Mann-Whitney U over the average ranks, so tied activations, zeros mostly, count a half)."""
    p = scores.shape[0]
    order = scores.argsort(dim=0)
    sorted_scores = scores.gather(0, order)
    ranks = torch.empty_like(scores, dtype=torch.float64)
    for f in range(scores.shape[1]):  # average ranks within runs of equal values
        _, inverse, counts = torch.unique_consecutive(sorted_scores[:, f], return_inverse=True, return_counts=True)
        ends = counts.cumsum(0).double()
        mean_rank = ends - (counts.double() - 1) / 2
        ranks[order[:, f], f] = mean_rank[inverse]
    pos = labels.double()
    n_pos = pos.sum(dim=0)  # [A]
    n_neg = p - n_pos
    rank_sums = pos.T @ ranks  # [A, F]
    return (rank_sums - n_pos[:, None] * (n_pos[:, None] + 1) / 2) / (n_pos[:, None] * n_neg[:, None])


def _labels(objects: list[list[tuple[str, str]]], masks: list[np.ndarray], patch: int) -> torch.Tensor:
    """Per patch of each scene, bool [scenes * gh * gw, 14]: on an object of each shape (8), then of each colour (6)."""
    attrs = list(shapes.CLASSES) + list(shapes.COLORS)
    rows = []
    for objs, m in zip(objects, masks):
        k, s, _ = m.shape
        g = s // patch
        cover = torch.from_numpy(m).float().reshape(k, g, patch, g, patch).mean(dim=(2, 4)).reshape(k, -1) >= 0.5  # [K, g*g]
        label = torch.zeros(g * g, len(attrs), dtype=torch.bool)
        for (colour, shape), c in zip(objs, cover):
            label[c, attrs.index(shape)] = True
            label[c, attrs.index(colour)] = True
        rows.append(label)
    return torch.cat(rows)


def measure(n: int, *, folder: Path = OUT, batch: int = 200) -> dict:
    """The table of docs/concepts.md: for each attribute the best feature's AUROC, trained and random."""
    from vitviz.concepts import TopKSAE, read_concepts

    sae, card, _, _ = read_concepts(folder)
    model = load_model(card["model"]).eval()
    p, patch, layer = model.config.num_prefix_tokens, model.config.patch_size, card["layer"]
    feats, labels = [], []
    with torch.inference_mode():
        for start in range(0, n, batch):
            images, objects, masks = shapes.generate_scenes(min(batch, n - start), seed=MEASURE_SEED, start=start)
            x = (torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.5
            feats.append(model.stream_after(x, layer)[:, p:].reshape(-1, model.config.width))
            labels.append(_labels(objects, masks, patch))
    acts, labels = torch.cat(feats), torch.cat(labels)
    torch.manual_seed(0)
    random = TopKSAE(acts.shape[1], card["features"], card["k"])
    with torch.no_grad():
        w = torch.randn_like(random.W_dec)
        random.W_dec.copy_(w / w.norm(dim=0, keepdim=True))
        random.W_enc.copy_(random.W_dec.T)
        random.b_enc.zero_()
        random.b_dec.copy_(acts.mean(dim=0))
    attrs = list(shapes.CLASSES) + list(shapes.COLORS)
    out: dict = {"scenes": n, "patches": int(acts.shape[0]), "layer": layer, "features": card["features"], "k": card["k"],
                 "positives": {a: int(v) for a, v in zip(attrs, labels.sum(dim=0))}}
    for name, dictionary in (("trained", sae), ("random", random)):
        with torch.inference_mode():
            z = dictionary.encode(acts)
        table = auroc(z, labels)  # [A, F]
        best, which = table.max(dim=1)
        out[name] = {a: {"feature": int(f), "auroc": round(float(v), 4)} for a, v, f in zip(attrs, best, which)}
        out[f"{name}_at_0.9"] = int((best >= 0.9).sum())
        # harder: among the patches on an object only (the attribute against the other objects', not the background)
        on = labels.any(dim=1)
        best, which = auroc(z[on], labels[on]).max(dim=1)
        out[f"{name}_among_objects"] = {a: {"feature": int(f), "auroc": round(float(v), 4)} for a, v, f in zip(attrs, best, which)}
        out[f"{name}_among_objects_at_0.9"] = int((best >= 0.9).sum())
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m vitviz.dev.concepts_shapes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--make", action="store_true", help="write the scenes and train the embedded SAE into assets/concepts/shapes_p16")
    ap.add_argument("--measure", type=int, default=0, help="measure on this many fresh scenes")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--steps", type=int, default=ARGS["steps"], help="training steps")
    args = ap.parse_args(argv)
    if args.make:
        from vitviz.concepts.cli import main as concepts

        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            write_scenes(Path(tmp) / "scenes", ARGS["scenes"], seed=SEED)
            command = ["train", str(Path(tmp) / "scenes"), "--model", MODEL, "--layer", str(ARGS["layer"]), "--features",
                       str(ARGS["features"]), "--k", str(ARGS["k"]), "--out", str(args.out), "--seed", str(SEED)]
            command += ["--steps", str(args.steps)]
            print("python -m vitviz.concepts " + " ".join(command), flush=True)
            concepts(command)
            print(f"{time.perf_counter() - start:.0f} s with writing the scenes")
        (args.out / "checkpoint.pt").unlink(missing_ok=True)  # a finished training: nothing to resume in the shipped folder
    if args.measure:
        print(json.dumps(measure(args.measure, folder=args.out), indent=1))


if __name__ == "__main__":
    main()
