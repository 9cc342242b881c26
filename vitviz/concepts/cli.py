"""The command: `python -m vitviz.concepts train` (and under torchrun).

    python -m vitviz.concepts train DATA --model NAME --layer L --features F --k K --out DIR
    torchrun --nproc_per_node=2 -m vitviz.concepts train DATA ... --out DIR        # the same weights, to rounding
    python -m vitviz.concepts train DATA ... --out DIR --resume                    # after a stop or a kill

A mistake in the command is one line on stderr and exit status 2 (nothing written); a training with
no image to read, exit status 1; Ctrl-C, exit status 130 (the last checkpoint is kept: --resume goes
on); --debug shows the traceback. Progress lines go to stderr, the final table to stdout (rank 0).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path


from vitviz import ranked
from vitviz.concepts.sae import AUX_WEIGHT
from vitviz.concepts.train import CHECKPOINT, DEAD_AFTER, ConceptsError, metrics_table, train

PROG = "vitviz.concepts"
HINT = "python -m vitviz.concepts train --help lists the options"


def _parser() -> argparse.ArgumentParser:
    ap = ranked.parser(PROG, HINT, prog="python -m vitviz.concepts", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = ap.add_subparsers(dest="command", required=True, parser_class=type(ap))
    t = commands.add_parser("train", help="train a top-k sparse autoencoder on a layer of a ViT over a folder of images",
                            description="Trains a top-k sparse autoencoder (Gao et al. 2024) on the residual stream after block "
                                        "--layer of --model over the images of DATA, evaluates it and writes --out.")
    t.add_argument("data", type=Path, help="a folder of images (DATA/<class>/<image> gives classes)")
    t.add_argument("--model", required=True, help="a variant name, timm:<name> or hf:<repo id> (a ViT, not a Swin)")
    t.add_argument("--layer", type=int, required=True, help="the block after which the stream is read, 0-based")
    t.add_argument("--features", type=int, required=True, help="the SAE's features F")
    t.add_argument("--k", type=int, required=True, help="features kept per token (k <= F)")
    t.add_argument("--out", type=Path, required=True, help="the folder the SAE, its card, index and thumbnails go to")
    t.add_argument("--tokens", default="patches", help="patches (default) or all (the prefix tokens too)")
    t.add_argument("--steps", type=int, default=None, help="training steps (default: one epoch)")
    t.add_argument("--epochs", type=int, default=None, help="passes over DATA, instead of --steps")
    t.add_argument("--images-per-step", type=int, default=32, help="images a step reads, over every process (default 32)")
    t.add_argument("--lr", type=float, default=4e-4, help="Adam's learning rate, constant (default 4e-4)")
    t.add_argument("--k-aux", type=int, default=None, help="AuxK's dead features per token (default: half the model's width; 0: no AuxK)")
    t.add_argument("--aux-weight", type=float, default=AUX_WEIGHT, help="AuxK's weight (default 1/32)")
    t.add_argument("--dead-after", type=int, default=DEAD_AFTER, help=f"tokens without firing after which a feature is dead "
                                                                       f"(default {DEAD_AFTER:,})")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints (default 100; also at the last)")
    t.add_argument("--stop-after", type=int, default=None, help="stop this session after that many steps, with a checkpoint")
    t.add_argument("--resume", action="store_true", help=f"go on from DIR/{CHECKPOINT} (any number of processes)")
    t.add_argument("--eval-images", type=int, default=None, help="evaluate on that many images spread over DATA (default: all)")
    t.add_argument("--top-n", type=int, default=8, help="each feature's strongest tokens kept (default 8)")
    t.add_argument("--thumb", type=int, default=32, help="their thumbnails' side in px (default 32)")
    t.add_argument("--workers", type=int, default=None, help="decoding processes per rank, 0 or more")
    t.add_argument("--log-every", type=int, default=10, help="steps between progress lines (default 10)")
    t.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    command = shlex.join(["python", "-m", "vitviz.concepts", *(sys.argv[1:] if argv is None else argv)])

    def stopped() -> str:
        kept = args.out / CHECKPOINT
        return ("stopped; " + (f"the last checkpoint is kept in {kept}: the same command with --resume goes on from it" if kept.is_file()
                               else "no checkpoint was written yet"))

    def work():
        return train(args.data, model=args.model, layer=args.layer, features=args.features, k=args.k, out=args.out, tokens=args.tokens,
                     steps=args.steps, epochs=args.epochs, images_per_step=args.images_per_step, lr=args.lr, k_aux=args.k_aux,
                     aux_weight=args.aux_weight, dead_after=args.dead_after, seed=args.seed, checkpoint_every=args.checkpoint_every,
                     stop_after=args.stop_after, resume=args.resume, eval_images=args.eval_images, top_n=args.top_n,
                     thumb=args.thumb, workers=args.workers, log_every=args.log_every, command=command)

    card = ranked.run(PROG, work, debug=args.debug, known=ConceptsError, stopped=stopped)
    if card is not None:
        print(f"{card['model']}, layer {card['layer']} ({card['tokens']}): {card['features']} features, k {card['k']}; "
              f"{card['steps']:,} steps, {card['tokens_seen']:,} tokens, {card['seconds']:.1f} s; written to {args.out}")
        print(metrics_table(card["metrics"]))
