"""The command: `python -m vitviz.evaluate` (and under torchrun)."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from vitviz.evaluate.data import EXTRA_METRICS, EvaluateError, EvaluateWarning, METRICS, PROTOCOLS, _plural
from vitviz import ranked
from vitviz.evaluate.entry import evaluate



def _report(out: Path, run: dict) -> str:
    """The line that ends a run: the images scored and failed now (and in all), the rate, what is left."""
    scored, failed, scored_now, failed_now = run["scored"], run["failed"], run["scored_now"], run["failed_now"]
    clips = run.get("kind") == "clips"  # a video model's run (vitviz.evaluate.clips)
    unit, rate = ("clip", "clips/s") if clips else ("image", "img/s")
    why = f"why: {out / ('per_clip.csv' if clips else 'per_image.csv')}, column error"
    if scored_now + failed_now == 0:
        return (f"Every {unit} was already scored (in {out / ('rows.jsonl' if clips else 'shards')}): {scored} scored, {failed} failed"
                f"{f' ({why})' if failed else ''}; the summary was written again.")
    now = f"{_plural(scored_now, unit)} scored, {failed_now} failed{f' ({why})' if failed_now else ''}"
    everything = ""
    if (scored, failed) != (scored_now, failed_now):
        everything = f" (all {_plural(run['images'], unit)}: {scored} scored, {failed} failed{f'; {why}' if failed and not failed_now else ''})"
    left = run["images"] - scored - failed
    todo = f"; {_plural(left, unit)} still to score: run the same command again to go on" if left else ""
    s = run["sessions"][-1]
    plain = s["plain_forward_images_per_second"]
    ratio = f"; plain {'' if clips else 'batched '}forwards {plain:.1f} {rate}, {s['images_per_second'] / plain:.3g}x" if plain else ""
    both = s.get("plain_forward_backward_images_per_second")
    ratio += f"; plain forwards and backwards {both:.1f} {rate}, {s['images_per_second'] / both:.3g}x" if both else ""
    return (f"{now} in {s['seconds']:.1f} s on {_plural(s['world_size'], 'process')}: {s['images_per_second']:.1f} {rate}{ratio}"
            f"{everything}; results in {out}{todo}")


PROG = "vitviz.evaluate"


def main(argv: list[str] | None = None) -> None:
    ap = ranked.parser(PROG, "python -m vitviz.evaluate --help lists the options", prog="python -m vitviz.evaluate", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", type=Path, help="a folder of images (ImageFolder layout for classes; masks/ for object masks), or of clips for a video model")
    ap.add_argument("--model", required=True, help="a variant name, timm:<name> or hf:<repo id>; shapes_video or an hf: video model for clips")
    ap.add_argument("--methods", default="rollout,gradient",
                    help="comma-separated, of attention, rollout, gradient, grad_rollout and any a plugin registers (VITVIZ_PLUGINS)")
    ap.add_argument("--metrics", default=None, help=f"comma-separated, of {', '.join(METRICS + EXTRA_METRICS)} (default: "
                                                    f"{', '.join(METRICS)})")
    ap.add_argument("--steps", type=int, default=None, help="deletion/insertion steps, 2 or more (default: 16)")
    ap.add_argument("--protocol", default=None,
                    help="a published protocol, its metrics and steps fixed: " + "; ".join(f"{p.name}: {p.description}" for p in PROTOCOLS.values()))
    ap.add_argument("--text", default=None, help="image–text models: the phrase every image is explained and scored for, e.g. 'a red star'")
    ap.add_argument("--captions", type=Path, default=None, help="image–text models: a CSV file with the columns file,text, a phrase per image")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--workers", type=int, default=None, help="decoding processes per rank, 0 or more")
    ap.add_argument("--max-images", type=int, default=None, help="stop after about this many new images (run again to go on)")
    ap.add_argument("--out", type=Path, required=True, help="the folder for the results: one per model and settings")
    ap.add_argument("--rescan", action="store_true",
                    help="resume although DATA changed: score what is new or changed, drop the rows of what is gone")
    ap.add_argument("--no-compare", action="store_true", help="skip timing plain batched forwards")
    ap.add_argument("--debug", action="store_true", help="show the traceback of an error")
    args = ap.parse_args(argv)
    methods = tuple(m for m in args.methods.split(",") if m)
    metrics = None if args.metrics is None else tuple(m for m in args.metrics.split(",") if m)

    def work():
        def show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, EvaluateWarning):
                print(f"vitviz.evaluate: warning: {message}", file=sys.stderr)
            else:
                default(message, category, filename, lineno, file, line)

        with warnings.catch_warnings():
            warnings.simplefilter("always", EvaluateWarning)
            default, warnings.showwarning = warnings.showwarning, show
            return evaluate(args.data, model=args.model, out=args.out, methods=methods, metrics=metrics, steps=args.steps,
                            batch_size=args.batch_size, workers=args.workers, max_images=args.max_images,
                            compare=not args.no_compare, rescan=args.rescan, protocol=args.protocol, text=args.text,
                            captions=args.captions)

    summary = ranked.run(PROG, work, debug=args.debug, known=EvaluateError,
                         stopped=lambda: f"stopped; the images scored so far are kept in {args.out / 'shards'}: run the same command "
                                         "again to go on")
    if summary is not None:
        print((args.out / "summary.md").read_text())
        print(_report(args.out, json.loads((args.out / "run.json").read_text())))

