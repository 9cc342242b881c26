"""Trains the embedded vision–language model `shapes_vlm` from a seed and writes its weights, offline;
measures it.

    python -m vitviz.dev.train_shapes_vlm                    # assets/shapes_vlm.pt
    python -m vitviz.dev.train_shapes_vlm --steps 200 --out /tmp/vlm
    python -m vitviz.dev.train_shapes_vlm --measure          # accuracy and grounding, 1,000 fresh scenes

The model (`vitviz.vlm.model.ShapesVLM`): `shapes_clip`'s image tower (patch 16 at 96 px, a 6 x 6
grid; its weights, kept as they are: the tower is not trained; the output of its block 3 (`--layer`)
computed once), a connector that keeps one token per patch (merge 1) and
a two-layer MLP, and a decoder of 3 blocks, 128 wide, 4 heads. The data are generated scenes of 2-3
coloured shapes (`vitviz.shapes.generate_scenes`, seed 11, 20,000 scenes), each step asking of each
scene one question of a kind drawn uniformly among those it has (`vitviz.vlm.scenes`: colour, where,
count). The loss is the cross-entropy of the answer's words and the end token, teacher-forced; AdamW
(1e-3), 100 warm-up steps, cosine to zero, weight decay 0.01, gradients clipped at 1.0, batch 128, 3,000 steps.

`--measure` runs on 1,000 fresh scenes (seed 4000, never used in training): the greedy answer's
accuracy per kind of question, and grounding: for each colour question, whether the map of the
answer's colour word points (argmax patch, `vitviz.analysis.pointing_game`, the object's mask
dilated by one patch) inside the asked shape, per method (relevance, attention over all layers,
each layer's attention), against a random map (the expected hit rate of a uniformly drawn patch).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from vitviz.vlm.model import ShapesVLM, ShapesVLMConfig, shapes_vlm_config
from vitviz.vlm.scenes import KINDS, questions

TRAIN_SEED, SCENES, MEASURE_SEED = 11, 20_000, 4000


LAYER = [3]  # the tower's block the connector reads (--layer)


def config() -> ShapesVLMConfig:
    return shapes_vlm_config(LAYER[0])


def _normalise(images: np.ndarray) -> torch.Tensor:
    return (torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.5


def _batch(model: ShapesVLM, qas: list, words) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced ids [B, T] and targets [B, T] (-100 but where the next token is the answer's)."""
    m = model.config.image_tokens
    seqs, targets = [], []
    for qa in qas:
        prompt = words.question(qa.question, m)
        answer = words.encode(qa.answer) + [words.end_id]
        seq = prompt + answer
        seqs.append(seq[:-1])
        targets.append([-100] * (len(prompt) - 1) + answer)
    t = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), t), words.pad_id, dtype=torch.long)
    tgt = torch.full((len(seqs), t), -100, dtype=torch.long)
    for i, (s, g) in enumerate(zip(seqs, targets)):
        ids[i, : len(s)] = torch.tensor(s)
        tgt[i, : len(g)] = torch.tensor(g)
    return ids, tgt


def _pick(rng: np.random.Generator, qas: list):
    kinds = sorted({qa.kind for qa in qas}, key=KINDS.index)
    kind = kinds[int(rng.integers(len(kinds)))]
    of_kind = [qa for qa in qas if qa.kind == kind]
    return of_kind[int(rng.integers(len(of_kind)))]


def train(*, steps: int, batch: int, seed: int, out: Path) -> None:
    from vitviz.shapes import generate_scenes
    from vitviz.sources.embedded import assets_dir

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = ShapesVLM(config())
    clip = torch.load(assets_dir() / "shapes_clip.pt", map_location="cpu", weights_only=True)
    model.tower.load_state_dict({k[len("image."):]: v for k, v in clip.items() if k.startswith("image.")})
    start = time.time()
    images, objects, masks = generate_scenes(SCENES, seed=TRAIN_SEED)
    qas = [questions(o, m) for o, m in zip(objects, masks)]
    print(f"{SCENES} scenes in {time.time() - start:.0f} s", flush=True)
    model.tower.requires_grad_(False).eval()
    layer, normed = model.config.reads
    with torch.no_grad():  # the tower's patch tokens where the connector reads them, once
        features = torch.cat([(model.tower.encode(x) if normed else model.tower.stream_after(x, layer))[:, model.tower.config.num_prefix_tokens :]
                              for x in (_normalise(images[i : i + 500]) for i in range(0, SCENES, 500))])
    print(f"tower features {tuple(features.shape)} at {time.time() - start:.0f} s", flush=True)
    rest = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(rest, lr=1e-3, weight_decay=0.01)
    base = [g["lr"] for g in opt.param_groups]
    words = model.words
    model.connector.train()
    model.blocks.train()
    for step in range(steps):
        scale = min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for g, lr in zip(opt.param_groups, base):
            g["lr"] = lr * scale
        pick = rng.integers(SCENES, size=batch)
        chosen = [_pick(rng, qas[i]) for i in pick]
        ids, tgt = _batch(model, chosen, words)
        logits = model.decode(ids, model.connector(features[torch.from_numpy(pick)]))
        loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(rest, 1.0)
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step} loss {loss.item():.4f} {time.time() - start:.0f} s", flush=True)
    model.eval()
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), out)
    print(f"wrote {out} after {time.time() - start:.0f} s ({steps} steps, batch {batch}, seed {seed})")


@torch.no_grad()
def greedy(model: ShapesVLM, images: torch.Tensor, prompts: list[list[int]], max_new: int = 4) -> list[list[int]]:
    """Batched greedy answers (the ids before the end token) for prompts of one length each group."""
    out = []
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        got: list[int] = []
        for _ in range(max_new):
            nxt = int(model(images[i : i + 1], ids)[0, -1].argmax())
            if nxt == model.words.end_id:
                break
            got.append(nxt)
            ids = torch.cat([ids, ids.new_tensor([[nxt]])], dim=1)
        out.append(got)
    return out


def measure(weights: Path, n: int = 1000) -> dict:
    """Accuracy per kind and grounding per method on `n` fresh scenes (module docstring)."""
    from vitviz.analysis import pointing_game
    from vitviz.shapes import generate_scenes
    from vitviz.vlm.ask import ask

    model = ShapesVLM(config())
    model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    model.eval()
    images, objects, masks = generate_scenes(n, seed=MEASURE_SEED)
    rng = np.random.default_rng(MEASURE_SEED)
    right = {k: [] for k in KINDS}
    hits: dict[str, list[bool]] = {}
    chance: list[float] = []
    p = model.config.vision.patch_size
    for i in range(n):
        qas = questions(objects[i], masks[i])
        by_kind = {k: [qa for qa in qas if qa.kind == k] for k in KINDS}
        for kind, of_kind in by_kind.items():
            if not of_kind:
                continue
            qa = of_kind[int(rng.integers(len(of_kind)))]
            answer = ask(model, images[i], qa.question, max_new_tokens=4, relevance=kind == "colour")
            right[kind].append(answer.text == qa.answer)
            if kind != "colour":
                continue
            mask = torch.from_numpy(masks[i][qa.target])[None]
            maps = {"relevance": answer.map(0), "attention": answer.map(0, method="attention")}
            for layer in range(model.config.depth):
                maps[f"attention, layer {layer}"] = answer.map(0, method="attention", layer=layer)
            for name, m in maps.items():
                hits.setdefault(name, []).append(bool(pointing_game(m[None].float(), mask, patch_size=p)[0]))
            # a random map: every patch equally likely to be the argmax
            gh, gw = model.config.vision.grid
            hit = [bool(pointing_game(torch.eye(gh * gw)[j].reshape(1, gh, gw), mask, patch_size=p)[0]) for j in range(gh * gw)]
            chance.append(float(np.mean(hit)))
    result = {"accuracy": {k: (float(np.mean(v)), len(v)) for k, v in right.items()},
              "grounding": {k: float(np.mean(v)) for k, v in hits.items()}, "random": float(np.mean(chance)),
              "colour questions": len(chance)}
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--measure", action="store_true", help="accuracy and grounding of the weights at --out (default: the embedded)")
    parser.add_argument("--scenes", type=int, default=1000)
    parser.add_argument("--layer", type=int, default=3, help="the tower's block the connector reads (-1: the last, normed)")
    args = parser.parse_args(argv)
    LAYER[0] = args.layer
    from vitviz.sources.embedded import assets_dir

    out = args.out or assets_dir() / "shapes_vlm.pt"
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.measure:
        start = time.time()
        r = measure(out, args.scenes)
        for kind, (acc, count) in r["accuracy"].items():
            print(f"accuracy {kind:7s} {acc:.3f} ({count} questions)")
        print(f"grounding of the colour word ({r['colour questions']} questions; random map {r['random']:.3f}):")
        for name, v in r["grounding"].items():
            print(f"  {name:22s} {v:.3f}")
        print(f"{time.time() - start:.0f} s")
        return
    train(steps=args.steps, batch=args.batch, seed=args.seed, out=out)


if __name__ == "__main__":
    main()
