"""python -m vitviz.evaluate on one process and on two (torchrun, gloo): the same per-image results
and the same summary, every image once, and a run in parts equal to a run in one go."""

import csv
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vitviz
from vitviz.evaluate import _Batches, _mine, scan, summarize, wilson

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["--model", "shapes_p16", "--methods", "rollout,gradient", "--steps", "4", "--batch-size", "3", "--no-compare"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shapes") / "data"
    vitviz.shapes.write_dataset(folder, 11, seed=77)  # 11: odd, and 4 batches of 3 that 2 ranks share unevenly
    (folder / "unreadable.png").write_bytes(b"not an image")
    return folder


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, **kwargs)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def _single(data, out, *extra):
    return _run([sys.executable, "-m", "vitviz.evaluate", str(data), *ARGS, "--out", str(out), *extra])


def _table(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _same_tables(a: list[dict], b: list[dict], tol: float = 1e-6) -> None:
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for key in ra:
            try:
                va, vb = float(ra[key]), float(rb[key])
            except ValueError:
                assert ra[key] == rb[key], (key, ra[key], rb[key])
                continue
            assert math.isclose(va, vb, rel_tol=tol, abs_tol=tol), (key, va, vb)


def test_the_batches_deal_every_image_once():
    for n, size, world in [(11, 3, 2), (7, 32, 3), (100, 7, 4), (1, 4, 2)]:
        dealt = [i for rank in range(world) for batch in _Batches(n, size, rank, world, set()).batches for i in batch]
        assert sorted(dealt) == list(range(n))
        assert set().union(*(_mine(n, size, r, world) for r in range(world))) == set(range(n))
    assert _Batches(11, 3, 1, 2, done={3, 4}).batches == [[5], [9, 10]]


def test_the_pointing_interval_is_wilsons_and_stays_in_range():
    # Hand-worked: z = 1.96; 5 of 10 gives 0.5 ± 0.2634 around a centre of 0.5; 0 of 10 gives [0, z²/(n+z²)].
    low, high = wilson(5, 10)
    assert low == pytest.approx(0.2366, abs=1e-4) and high == pytest.approx(0.7634, abs=1e-4)
    low, high = wilson(0, 10)
    assert low == 0.0 and high == pytest.approx(1.96**2 / (10 + 1.96**2), abs=1e-4)
    low, high = wilson(1000, 1000)
    assert high == 1.0 and 0.995 < low < 1.0


def test_scan_reads_classes_and_masks(data):
    items = scan(data)
    assert len(items) == 12 and [i.index for i in items] == list(range(12))
    labelled = [i for i in items if i.label]
    assert len(labelled) == 11 and all(i.label in vitviz.shapes.CLASSES for i in labelled)
    assert all(i.mask and Path(i.mask).parent.parent.name == "masks" for i in labelled)
    assert [i for i in items if i.label is None][0].path.endswith("unreadable.png")


@pytest.mark.slow
def test_two_processes_give_what_one_gives_and_a_run_in_parts_what_one_run_gives(data, tmp_path):
    if shutil.which("torchrun") is None:
        pytest.skip("torchrun is not installed with this torch")
    one, two, parts = tmp_path / "one", tmp_path / "two", tmp_path / "parts"
    _single(data, one, "--workers", "1")  # decoding in a worker process
    _run(["torchrun", "--standalone", "--nproc_per_node=2", "-m", "vitviz.evaluate", str(data), *ARGS, "--out", str(two),
          "--workers", "0"])
    rows_one, rows_two = _table(one / "per_image.csv"), _table(two / "per_image.csv")
    assert [r["index"] for r in rows_two] == [str(i) for i in range(12)]  # every image once, none twice
    _same_tables(rows_one, rows_two)
    _same_tables(_table(one / "summary.csv"), _table(two / "summary.csv"))
    assert len(list((two / "shards").glob("*.jsonl"))) == 2 and json.loads((two / "run.json").read_text())["world_size"] == 2
    unreadable = [r for r in rows_two if r["path"].endswith("unreadable.png")][0]
    assert "not an image" in unreadable["error"]
    # the summary from Python is the one the run wrote
    _same_tables([{k: str(v) for k, v in r.items()} for r in summarize(two)], _table(two / "summary.csv"), tol=1e-12)
    # dataset figures were written
    assert (two / "distance.png").is_file() and (two / "curves.png").is_file() and len(_table(two / "distance.csv")) == 6 * 3

    # a run in parts: stopped after two batches, a line cut short by the interruption, then resumed
    _single(data, parts, "--max-images", "4", "--workers", "0")
    first = _table(parts / "per_image.csv")
    assert len(first) == 6
    shard = next((parts / "shards").glob("*.jsonl"))
    lines = shard.read_text().splitlines()
    shard.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])  # the last image half written
    _single(data, parts, "--workers", "0")
    _same_tables(_table(parts / "per_image.csv"), rows_one)
    _same_tables(_table(parts / "summary.csv"), _table(one / "summary.csv"))
    # another setting in the same folder is refused, not mixed in
    bad = subprocess.run([sys.executable, "-m", "vitviz.evaluate", str(data), *ARGS[:-1], "--steps", "8", "--out", str(parts)],
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "other settings" in bad.stderr


def test_per_image_results_match_the_library(data, tmp_path):
    """One image's row against vitviz.explain and vitviz.analyze on the same file."""
    out = tmp_path / "out"
    from vitviz.evaluate import evaluate

    summary = evaluate(data, model="shapes_p16", out=out, methods=("gradient",), metrics=("distance", "pointing"), batch_size=4,
                       workers=0, compare=False, progress=False)
    assert {(r["method"], r["metric"]) for r in summary} == {("model", "distance"), ("gradient", "pointing"), ("random", "pointing")}
    rows = _table(out / "per_image.csv")
    # the dataset's Figure 7: the mean over the readable images of each one's distances
    model = vitviz.load_model("shapes_p16", device="cpu")
    want = torch.stack([vitviz.analyze(model, r["path"]).distances() for r in rows if not r["error"]]).mean(0)
    got = torch.tensor([float(r["mean_distance_px"]) for r in _table(out / "distance.csv")]).reshape(6, 3)
    torch.testing.assert_close(got, want.float(), atol=1e-3, rtol=0)
    row = rows[2]
    result = vitviz.analyze(model, row["path"])
    assert float(row["distance_mean"]) == pytest.approx(result.distances().mean().item(), rel=1e-5)
    why = vitviz.explain(model, row["path"], method="gradient", target=row["label"])
    assert int(row["target"]) == why.target and float(row["probability"]) == pytest.approx(why.probability, abs=1e-5)
    mask = vitviz.load_image(str(data / "masks" / row["label"] / Path(row["path"]).name))
    hit = vitviz.pointing_game(why.map[None], torch.from_numpy(__import__("numpy").asarray(mask)[None, :, :, 0] > 127), patch_size=16)
    assert float(row["gradient_pointing"]) == float(hit[0])


def test_an_empty_folder_and_unknown_names_are_clear_errors(tmp_path):
    from vitviz.evaluate import evaluate

    with pytest.raises(ValueError, match="no images"):
        evaluate(tmp_path, model="shapes_p16", out=tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match="unknown metric or method 'saliency'"):
        evaluate(tmp_path, model="shapes_p16", out=tmp_path / "out", methods=("saliency",), progress=False)
