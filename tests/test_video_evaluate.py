"""The evaluator over a folder of clips (`vitviz.evaluate.clips`, reached by `python -m vitviz.evaluate`
with a video model): each figure recomputed here by an independent route from the same clips, the
run resumed and refused as the image evaluator's is, and hostile clips an error in their own row."""

from __future__ import annotations

import csv
import json
import shutil
import zipfile

import numpy as np
import pytest
import torch

from vitviz.evaluate import EvaluateError, EvaluateWarning, evaluate, summarize, wilson
from vitviz.video import frame_maps, mean_attention_distance_space_time, space_time_relevance, space_time_rollout
from vitviz.evaluate.clips import scan_clips
from vitviz.video.shapes import MOTIONS, load_shapes_video, render_clip, to_videos, write_clips

SEED = 7171  # never trained on
N = 5
FAST = dict(model="shapes_video", compare=False, progress=False)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("clips") / "data"
    write_clips(root, N, seed=SEED)
    return root


@pytest.fixture(scope="module")
def model():
    return load_shapes_video()


@pytest.fixture(scope="module")
def done(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "out"
    summary = evaluate(folder, out=out, steps=4, **FAST)
    rows = {json.loads(line)["file"]: json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()}
    return out, summary, rows


def _by(summary, method, metric):
    return next(r for r in summary if (r["method"], r["metric"]) == (method, metric))


def _hand_pointing(m: torch.Tensor, tube_masks: np.ndarray, patch: int) -> float:
    """The pointing game by hand: the argmax patch's centre pixel inside the mask dilated by a patch
    (a square of side 2P + 1, checked pixel by pixel), over the tubelets with an object."""
    hits = []
    for k in range(m.shape[0]):
        mask = tube_masks[k]
        if not mask.any():
            continue
        y, x = divmod(int(m[k].flatten().argmax()), m.shape[2])
        cy, cx = y * patch + patch // 2, x * patch + patch // 2
        window = mask[max(0, cy - patch) : cy + patch + 1, max(0, cx - patch) : cx + patch + 1]
        hits.append(float(window.any()))
    return float(np.mean(hits))


def test_every_figure_of_a_clip_is_its_own_computation(folder, done, model):
    out, summary, rows = done
    c = model.config
    for i in range(N):
        frames, label, masks = render_clip(seed=SEED, index=i)
        row = rows[f"{MOTIONS[label]}/{i:06d}.webp"]
        assert row["error"] == "" and row["mask_error"] == ""
        x = to_videos(frames)[0]  # the lossless clip read back is the clip made
        with torch.no_grad():
            probs = model(x[None]).softmax(-1)[0]
        assert row["target"] == label and row["predicted"] == int(probs.argmax())
        assert row["probability"] == pytest.approx(float(probs[label]), abs=1e-6)
        attention = model.attention(x)
        space, time = mean_attention_distance_space_time(attention, attention.grid, c.patch_size, c.tubelet)
        assert np.allclose(row["distance_space"], space.numpy(), atol=1e-5) and np.allclose(row["distance_time"], time.numpy(), atol=1e-6)
        tubes = masks.reshape(-1, c.tubelet, *masks.shape[1:]).any(axis=1)
        rollout = frame_maps(space_time_rollout(attention), attention.grid)
        relevance = frame_maps(space_time_relevance(model, x, label)[0], attention.grid)
        assert row["rollout_pointing"] == pytest.approx(_hand_pointing(rollout, tubes, c.patch_size))
        assert row["gradient_pointing"] == pytest.approx(_hand_pointing(relevance, tubes, c.patch_size))
        # the random map's expected hit: the share of all patches that would hit, counted by hand
        t, h, w = attention.grid
        chance = [np.mean([_hand_pointing(torch.eye(h * w)[j].reshape(1, h, w), tubes[k : k + 1], c.patch_size) for j in range(h * w)])
                  for k in range(t)]
        assert row["random_pointing"] == pytest.approx(float(np.mean(chance)), abs=1e-6)
        # deletion's ends: the clip itself, then every patch at the mean colour; insertion the other way round
        with torch.no_grad():
            blank = float(model(torch.zeros_like(x)[None]).softmax(-1)[0, label])
        for method in ("rollout", "gradient", "random"):
            assert row[f"{method}_deletion_curve"][0] == pytest.approx(float(probs[label]), abs=1e-5)
            assert row[f"{method}_deletion_curve"][-1] == pytest.approx(blank, abs=1e-5)
            assert row[f"{method}_insertion_curve"][0] == pytest.approx(blank, abs=1e-5)
            assert row[f"{method}_insertion_curve"][-1] == pytest.approx(float(probs[label]), abs=1e-5)
        # deletion's second point (a quarter of the patches gone, steps=4) by hand: the rollout's top patches blanked one by one
        order = rollout.flatten().argsort(descending=True, stable=True)[: round(t * h * w / 4)]
        cut = x.clone()
        for j in order.tolist():
            k, rest = divmod(j, h * w)
            y, xx = divmod(rest, w)
            cut[k * c.tubelet : (k + 1) * c.tubelet, :, y * c.patch_size : (y + 1) * c.patch_size, xx * c.patch_size : (xx + 1) * c.patch_size] = 0
        with torch.no_grad():
            assert row["rollout_deletion_curve"][1] == pytest.approx(float(model(cut[None]).softmax(-1)[0, label]), abs=1e-5)
        curve = np.asarray(row["rollout_deletion_curve"])
        assert row["rollout_deletion"] == pytest.approx(float(((curve[1:] + curve[:-1]) / 2).mean()), abs=1e-6)
    # the summary: means over the clips; the accuracy and pointing game's intervals Wilson's (within 0 and 1)
    assert _by(summary, "model", "accuracy")["n"] == N
    for method in ("rollout", "gradient", "random"):
        r = _by(summary, method, "pointing")
        shares = [row[f"{method}_pointing"] for row in rows.values()]
        assert r["mean"] == pytest.approx(np.mean(shares))
        assert (r["ci95_low"], r["ci95_high"]) == pytest.approx(wilson(sum(shares), len(shares)))
        assert 0 <= r["ci95_low"] <= r["mean"] <= r["ci95_high"] <= 1
    assert _by(summary, "rollout", "pointing")["mean"] > _by(summary, "random", "pointing")["mean"]
    with open(out / "summary.csv", newline="") as f:
        assert [{k: str(v) for k, v in r.items()} for r in summarize(out)] == list(csv.DictReader(f))
    per_clip = list(csv.DictReader(open(out / "per_clip.csv", newline="")))
    assert len(per_clip) == N and {r["label"] for r in per_clip} <= set(MOTIONS)
    distance = list(csv.DictReader(open(out / "distance.csv", newline="")))
    assert len(distance) == model.config.depth * model.config.heads


def test_the_command_runs_a_video_model_and_resumes(folder, tmp_path, capsys):
    from test_protocols import _main

    out = tmp_path / "out"
    assert _main(folder, "--model", "shapes_video", "--metrics", "distance,pointing", "--methods", "rollout", "--no-compare",
                 "--out", out) == 0
    printed = capsys.readouterr().out
    assert "| rollout | pointing | 5 |" in printed and f"{N} clips scored, 0 failed" in printed
    assert _main(folder, "--model", "shapes_video", "--metrics", "distance,pointing", "--methods", "rollout", "--no-compare",
                 "--out", out) == 0
    assert "Every clip was already scored" in capsys.readouterr().out


@pytest.mark.parametrize("extra, says", [
    (["--protocol", "rise"], "without --protocol"),
    (["--text", "a red star"], "without --text"),
    (["--methods", "grad_rollout"], "unknown method 'grad_rollout'"),
    (["--metrics", "inside"], "unknown metric 'inside'"),
    (["--steps", "1"], "--steps is 1"),
])
def test_settings_a_video_model_does_not_take_are_refused_before_anything_is_written(folder, tmp_path, capsys, extra, says):
    from test_protocols import _main

    out = tmp_path / "out"
    assert _main(folder, "--model", "shapes_video", "--out", out, *extra) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_an_out_inside_the_clips_is_refused(folder):
    with pytest.raises(EvaluateError, match="inside DATA"):
        evaluate(folder, out=folder / "results", **FAST)


def test_hostile_clips_and_missing_masks_are_rows_with_their_reason_and_the_rest_is_scored(folder, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(folder, data)
    clips = sorted(p for p in data.rglob("*.webp") if "masks" not in p.parts)
    zipped = data / "=archive.mp4"  # a zip renamed .mp4, its name a spreadsheet formula
    with zipfile.ZipFile(zipped, "w") as z:
        z.writestr("a.txt", "not a clip")
    (data / "up" / "cut.webp").parent.mkdir(exist_ok=True)
    (data / "up" / "cut.webp").write_bytes(clips[0].read_bytes()[:300])  # truncated
    first = clips[1].relative_to(data).with_suffix("")
    (data / "masks" / first / "5.png").unlink()  # one sampled frame's mask gone
    out = tmp_path / "out"
    with pytest.warns(EvaluateWarning, match="pointing left out for 1 clip"):
        summary = evaluate(data, out=out, metrics=("pointing",), methods=("rollout",), **FAST)
    rows = {r["file"]: r for r in csv.DictReader(open(out / "per_clip.csv", newline=""))}
    assert set(rows) == {clips[k].relative_to(data).as_posix() for k in range(N)} | {"'=archive.mp4", "up/cut.webp"}
    for name in ("'=archive.mp4", "up/cut.webp"):
        error = rows[name]["error"]
        assert error and "\n" not in error and "accepted:" in error, error
    assert "no mask for source frame 5" in rows[first.as_posix() + ".webp"]["mask_error"]
    assert rows[first.as_posix() + ".webp"]["rollout_pointing"] == ""
    assert _by(summary, "rollout", "pointing")["n"] == N - 1 and _by(summary, "model", "accuracy")["n"] == N
    # a refused clip keeps its row while it is unchanged: the same run scores nothing again
    evaluate(data, out=out, metrics=("pointing",), methods=("rollout",), **FAST)
    run = json.loads((out / "run.json").read_text())
    assert (run["scored_now"], run["failed_now"], run["scored"], run["failed"]) == (0, 0, N, 2)


def test_a_changed_clip_is_refused_without_rescan_and_rescored_with_it(folder, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(folder, data)
    out = tmp_path / "out"
    settings = dict(metrics=("distance",), methods=(), **FAST)
    evaluate(data, out=out, **settings)
    clips = sorted(p for p in data.rglob("*.webp") if "masks" not in p.parts)
    shutil.copy(clips[1], clips[0])  # another clip's bytes under the first one's name
    with pytest.raises(EvaluateError, match="changed since the run"):
        evaluate(data, out=out, **settings)
    evaluate(data, out=out, rescan=True, **settings)
    run = json.loads((out / "run.json").read_text())
    assert run["scored_now"] == 1 and run["scored"] == N
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert rows[-1]["file"] == clips[0].relative_to(data).as_posix()
    assert rows[-1]["distance_space"] == next(r for r in rows if r["file"] == clips[1].relative_to(data).as_posix())["distance_space"]


def test_without_masks_the_pointing_game_is_left_out_with_a_warning(folder, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(folder, data, ignore=shutil.ignore_patterns("masks"))
    assert all(not item.masks for item in scan_clips(data))
    with pytest.warns(EvaluateWarning, match="pointing skipped"):
        summary = evaluate(data, out=tmp_path / "out", methods=("rollout",), metrics=("pointing", "distance"), **FAST)
    assert {(r["method"], r["metric"]) for r in summary} == {("model", "accuracy"), ("model", "distance_space"), ("model", "distance_time")}


def test_a_hub_timesformer_is_scored_over_the_clips_with_its_divided_attention(folder, tmp_path, monkeypatch):
    """A tiny random TimeSformer in an offline hub cache: `hf:` names a video model to the evaluator, its
    divided attention is rolled out and explained, and its distances are its own."""
    transformers = pytest.importorskip("transformers")
    from huggingface_hub import constants

    from conftest import write_hub_cache
    from vitviz.clips import clip_tensor, load_video
    from vitviz.sources import load_model

    torch.manual_seed(0)
    cfg = transformers.TimesformerConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
                                         patch_size=8, num_frames=4, num_labels=5, attn_implementation="eager")
    cfg.id2label = dict(enumerate(MOTIONS))
    cfg.label2id = {v: k for k, v in cfg.id2label.items()}
    root = tmp_path / "hub"
    snap = write_hub_cache(root, "someone/timesformer-motions", {})
    transformers.TimesformerForVideoClassification(cfg).eval().save_pretrained(snap)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    name = "hf:someone/timesformer-motions"
    out = tmp_path / "out"
    summary = evaluate(folder, out=out, model=name, methods=("rollout", "gradient"), metrics=("distance", "deletion"), steps=2,
                       compare=False, progress=False)
    assert _by(summary, "model", "accuracy")["n"] == N and _by(summary, "rollout", "deletion")["n"] == N
    assert _by(summary, "gradient", "deletion")["n"] == N  # divided attention's relevance: each block's two steps
    model = load_model(name)
    row = json.loads((out / "rows.jsonl").read_text().splitlines()[0])
    clip = clip_tensor(load_video(folder / row["file"], frames=model.spec.frames, sampling=model.spec.sampling), model.spec.preprocessing)
    attention = model.attention(clip)
    assert attention.kind == "divided"
    space, time = mean_attention_distance_space_time(attention, attention.grid, 8, 1)
    assert np.allclose(row["distance_space"], space.numpy(), atol=1e-5) and np.allclose(row["distance_time"], time.numpy(), atol=1e-6)
