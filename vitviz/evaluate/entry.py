"""`evaluate` and `summarize`: a folder of images (`run.evaluate_images`, `figures.summarize_images`),
or of clips for a video model (`vitviz.evaluate.clips`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from vitviz.evaluate.data import EvaluateError
from vitviz.evaluate.figures import summarize_images
from vitviz.evaluate.run import evaluate_images
from vitviz.evaluate.clips import KIND, evaluate_clips, summarize_clips
from vitviz.video.load import is_video_model


def evaluate(data: str | Path, *, model: str, out: str | Path, methods: tuple[str, ...] = ("rollout", "gradient"),
             metrics: tuple[str, ...] | None = None, steps: int | None = None, batch_size: int = 32, workers: int | None = None,
             max_images: int | None = None, compare: bool = True, progress: bool = True, rescan: bool = False,
             protocol: str | None = None, text: str | None = None, captions: str | Path | None = None) -> list[dict] | None:
    """Scores every image of `data` (`evaluate_images`, whose doc has the arguments), or for a video
    model every clip (`vitviz.evaluate.clips.evaluate_clips`, on one process; `max_images` counts clips;
    `protocol`, `text`, `captions` and `workers` are refused for it); on rank 0 returns the summary rows."""
    if is_video_model(model):
        given = [name for name, v in (("--protocol", protocol), ("--text", text), ("--captions", captions), ("--workers", workers))
                 if v is not None]
        if given:
            raise EvaluateError(f"{model} is a video model, scored over a folder of clips without {' and '.join(given)}: leave "
                                f"{'it' if len(given) == 1 else 'them'} out")
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise EvaluateError(f"{model} is a video model: its clips are scored on one process (run it without torchrun)")
        return evaluate_clips(data, model=model, out=out, methods=methods, metrics=metrics, steps=steps, batch_size=batch_size,
                              max_clips=max_images, compare=compare, progress=progress, rescan=rescan)
    return evaluate_images(data, model=model, out=out, methods=methods, metrics=metrics, steps=steps, batch_size=batch_size,
                           workers=workers, max_images=max_images, compare=compare, progress=progress, rescan=rescan,
                           protocol=protocol, text=text, captions=captions)


def summarize(out: str | Path) -> list[dict]:
    """The summary of a finished run in `out` (what its summary.csv holds): [{method, metric, n, mean,
    ci95_low, ci95_high}]."""
    if json.loads((Path(out) / "run.json").read_text()).get("kind") == KIND:
        return summarize_clips(out)
    return summarize_images(out)
