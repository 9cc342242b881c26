"""python -m vitviz.evaluate on one process and on two (torchrun, gloo): the same per-image results
and the same summary to the last digit, every image once, and a run in parts equal to a run in one go;
a resume after DATA changed refused or rescanned, masks through the image gate, shard lines checked;
the command as a newcomer meets it: one line for each mistake, counts, warnings, the README's commands."""

import csv
import hashlib
import json
import math
import os
import shlex
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from conftest import random_torchvision_checkpoint
import vitviz
import vitviz.evaluate as ev
from vitviz.evaluate import EvaluateError, EvaluateWarning, evaluate, main, scan, summarize, wilson
from vitviz.evaluate import batch as ev_batch, data as ev_data, run as ev_run
from vitviz.evaluate.data import _Batches

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["--model", "shapes_p16", "--methods", "rollout,gradient", "--steps", "4", "--batch-size", "5", "--no-compare"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shapes") / "data"
    vitviz.shapes.write_dataset(folder, 11, seed=77)  # 11 and one unreadable: batches of 5, 5 and 2, 7 images for rank 0 and 5 for rank 1
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
    ran = _run(["torchrun", "--standalone", "--nproc_per_node=2", "-m", "vitviz.evaluate", str(data), *ARGS, "--out", str(two),
                "--workers", "0"])
    # the bar counts the images of every rank, none twice (it counted rank 0's batches times 2: 14 for 12)
    assert "12/12" in ran.stderr and "14/14" not in ran.stderr
    rows_one, rows_two = _table(one / "per_image.csv"), _table(two / "per_image.csv")
    assert [r["index"] for r in rows_two] == [str(i) for i in range(12)]  # every image once, none twice
    _same_tables(rows_one, rows_two)
    # the dataset figures come from the merged rows in file order: the same to the last digit
    for name in ("summary.csv", "distance.csv"):
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    assert len(list((two / "shards").glob("*.jsonl"))) == 2 and json.loads((two / "run.json").read_text())["sessions"][-1]["world_size"] == 2
    unreadable = [r for r in rows_two if r["path"].endswith("unreadable.png")][0]
    assert "not an image" in unreadable["error"]
    # the summary from Python is the one the run wrote
    assert [{k: str(v) for k, v in r.items()} for r in summarize(two)] == _table(two / "summary.csv")
    # dataset figures were written
    assert (two / "distance.png").is_file() and (two / "curves.png").is_file() and len(_table(two / "distance.csv")) == 6 * 3

    # a run in parts: stopped after one batch, a line cut short by the interruption, then resumed
    _single(data, parts, "--max-images", "4", "--workers", "0")
    first = _table(parts / "per_image.csv")
    assert len(first) == 5
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


def test_a_batch_in_memory_is_scored_as_the_same_images_read_from_their_files(data):
    """`_batch_in_memory` (what the benchmark scores) is the loader's batch of the same preprocessed
    images and masks, but for the files' digests, and `_score` gives the same rows for both."""
    from dataclasses import replace

    model = vitviz.load_model("shapes_p16", device="cpu")
    items = [replace(item, index=k) for k, item in enumerate(i for i in scan(data) if i.mask)][:4]
    read = ev.EvalDataset(items, model.spec.preprocessing)
    loaded = ev_data._collate([read[k] for k in range(len(items))])
    mine = ev_data._batch_in_memory(loaded["x"], loaded["mask"])
    assert loaded.keys() == mine.keys() and all(loaded["has_mask"]) and all(loaded["ok"])
    for key, value in loaded.items():
        if key in ("sha256", "mask_sha256"):
            assert all(value) and mine[key] == [None] * len(items)
        elif isinstance(value, torch.Tensor):
            assert value.dtype == mine[key].dtype and torch.equal(value, mine[key]), key
        else:
            assert value == mine[key], key
    options = dict(methods=("gradient",), metrics=("distance", "pointing"), steps=4)
    want, got = ev_batch._score(model, loaded, items, **options), ev_batch._score(model, mine, items, **options)
    assert len(got) == len(items) and all(not row["error"] for row in got)
    for a, b in zip(want, got):
        assert {k: v for k, v in a.items() if "sha256" not in k} == {k: v for k, v in b.items() if "sha256" not in k}


def test_an_empty_folder_and_unknown_names_are_clear_errors(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no images"):
        evaluate(empty, model="shapes_p16", out=tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match="unknown method 'saliency' in --methods; the methods are attention, rollout"):
        evaluate(empty, model="shapes_p16", out=tmp_path / "out", methods=("saliency",), progress=False)


# ------------------------------------------------------------------------------------------------
# Hardening: a changed DATA, masks through the gate, shard lines checked

FAST = dict(model="shapes_p16", methods=("rollout",), metrics=("distance", "pointing"), batch_size=3, workers=0, compare=False,
            progress=False)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:32]


def _run_json(out: Path) -> dict:
    return json.loads((out / "run.json").read_text())


def test_a_resume_after_data_changed_is_refused_and_rescan_scores_only_what_changed(tmp_path, capsys):
    data = tmp_path / "data"
    paths = [Path(p) for p in vitviz.shapes.write_dataset(data, 6, seed=3)]
    out = tmp_path / "out"
    evaluate(data, out=out, **FAST)
    before = {r["path"]: r for r in _table(out / "per_image.csv")}
    # same count: one image replaced by other bytes, one moved (with its mask), one only touched (not a change: same bytes)
    replaced, moved, touched = paths[0], paths[1], paths[2]
    replaced.write_bytes(paths[3].read_bytes())
    mask = data / "masks" / moved.relative_to(data)
    new_name = moved.with_name("zz" + moved.name)
    moved.rename(new_name)
    mask.rename(mask.with_name(new_name.name))
    os.utime(touched, ns=(touched.stat().st_atime_ns, touched.stat().st_mtime_ns + 10**9))

    with pytest.raises(SystemExit) as refused:
        main([str(data), "--model", "shapes_p16", "--methods", "rollout", "--metrics", "distance,pointing", "--batch-size", "3",
              "--workers", "0", "--no-compare", "--out", str(out)])
    msg = capsys.readouterr().err
    assert refused.value.code == 2 and msg.count("\n") == 1
    assert "images added: 1, removed: 1, changed: 1" in msg and "--rescan" in msg
    assert f"added {new_name.relative_to(data).as_posix()}" in msg and f"removed {moved.relative_to(data).as_posix()}" in msg
    assert _table(out / "per_image.csv") == list(before.values())  # nothing was written

    evaluate(data, out=out, rescan=True, **FAST)
    assert _run_json(out)["scored_now"] == 2  # the replaced and the moved image; the touched one kept its row
    rows = _table(out / "per_image.csv")
    assert [r["path"] for r in rows] == [item.path for item in scan(data)] and [r["index"] for r in rows] == [str(i) for i in range(6)]
    by_path = {r["path"]: r for r in rows}
    assert str(moved) not in by_path and by_path[str(new_name)]["sha256"] == before[str(moved)]["sha256"]
    assert by_path[str(replaced)]["sha256"] == _sha(replaced) != before[str(replaced)]["sha256"]
    kept, was = by_path[str(touched)], before[str(touched)]
    assert {k: v for k, v in kept.items() if k != "index"} == {k: v for k, v in was.items() if k != "index"}
    # the rows and the summary are those of a fresh run on the folder as it is now
    fresh = tmp_path / "fresh"
    evaluate(data, out=fresh, **FAST)
    _same_tables(rows, _table(fresh / "per_image.csv"))
    _same_tables(_table(out / "summary.csv"), _table(fresh / "summary.csv"))
    # a file that comes back, and one that goes: refused again, then rescanned without scoring the one back
    new_name.rename(moved)
    mask.with_name(new_name.name).rename(mask)
    paths[4].unlink()
    with pytest.raises(EvaluateError, match="images added: 1, removed: 2, changed: 0"):
        evaluate(data, out=out, **FAST)
    evaluate(data, out=out, rescan=True, **FAST)
    assert _run_json(out)["scored_now"] == 0 and len(_table(out / "per_image.csv")) == 5


def _png(width: int, height: int) -> bytes:
    """A grey PNG that declares width x height in its header (its pixel data is a few bytes: never decoded)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_masks_pass_the_image_gate_and_a_bad_mask_stops_nothing(tmp_path):
    data = tmp_path / "data"
    paths = [Path(p) for p in vitviz.shapes.write_dataset(data, 5, seed=4)]
    masks = [data / "masks" / p.relative_to(data) for p in paths]
    masks[0].write_text("not an image")
    masks[1].write_bytes(_png(30_000, 30_000))  # 900 megapixels, from its header
    masks[2].write_bytes(_png(8_000, 8_000))  # 64 megapixels
    from PIL import Image

    with Image.open(masks[3]) as m:
        m.resize((48, 48)).save(masks[3])  # another size than its 96 px image
    out = tmp_path / "out"
    with pytest.warns(EvaluateWarning, match=r"pointing counts 1 of the 5 images scored: 4 whose mask could not be used \(per_image.csv, "
                                             r"column mask_error\)"):
        evaluate(data, out=out, **FAST)
    rows = {r["path"]: r for r in _table(out / "per_image.csv")}
    wanted = ["not an image", "too many pixels (Image size (900000000 pixels)", "too many pixels (Image size (64000000 pixels)",
              "it is 48x48 px and its image 96x96 px; a mask has the size of its image"]
    for path, mask, words in zip(paths, masks, wanted):
        row = rows[str(path)]
        assert row["mask_error"].startswith(f"mask {mask}: ") and words in row["mask_error"], row["mask_error"]
        assert row["error"] == "" and row["distance_mean"] and row["rollout_pointing"] == "" and row["random_pointing"] == ""
    good = rows[str(paths[4])]
    assert good["mask_error"] == "" and good["rollout_pointing"] in ("0.0", "1.0") and good["mask_sha256"] == _sha(masks[4])
    counted = {(r["method"], r["metric"], r["n"]) for r in _table(out / "summary.csv")}
    assert {("model", "distance", "5"), ("rollout", "pointing", "1")} <= counted
    with pytest.warns(EvaluateWarning):
        evaluate(data, out=out, **FAST)  # a resume is not stopped by them either
    assert _run_json(out)["scored_now"] == 0


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished run with every kind of column: (data, its out folder, the settings)."""
    root = tmp_path_factory.mktemp("finished")
    vitviz.shapes.write_dataset(root / "data", 3, seed=5)
    settings = dict(FAST, metrics=("distance", "pointing", "deletion"), steps=2)
    evaluate(root / "data", out=root / "out", **settings)
    return root / "data", root / "out", settings


def _one_row(out: Path) -> dict:
    return json.loads(next((out / "shards").glob("*.jsonl")).read_text().splitlines()[0])


BAD_LINES = {
    "a list": lambda row: "[]",
    "an index that is text": lambda row: json.dumps({"index": "x"}),
    "a pointing value of 7": lambda row: json.dumps(dict(row, rollout_pointing=7.0)),
    "a missing key": lambda row: json.dumps({k: v for k, v in row.items() if k != "distance"}),
    "an index of another type": lambda row: json.dumps(dict(row, index=True)),
    "an area outside [0, 1]": lambda row: json.dumps(dict(row, rollout_deletion=1.5)),
    "an area that is not a number": lambda row: json.dumps(dict(row, random_deletion=float("nan"))),
    "a curve of another length": lambda row: json.dumps(dict(row, rollout_deletion_curve=[0.5] * 7)),
    "distances of another shape": lambda row: json.dumps(dict(row, distance=[[1.0, 2.0]])),
    "a key of no metric": lambda row: json.dumps(dict(row, rollout_insertion=0.5)),
    "a digest that is not one": lambda row: json.dumps(dict(row, sha256="../../etc")),
    "a line cut short, then another": lambda row: json.dumps(row)[:40] + "\n" + json.dumps(row),
}


@pytest.mark.parametrize("bad", BAD_LINES)
def test_a_shard_line_that_is_not_a_row_stops_the_merge_naming_its_file_and_line(finished, tmp_path, bad):
    data, done, settings = finished
    out = tmp_path / "out"
    shutil.copytree(done, out)
    row = _one_row(out)
    shard = out / "shards" / "rank000-of-001-1-1.jsonl"
    shard.write_text(json.dumps(row) + "\n" + BAD_LINES[bad](row) + "\n")
    with pytest.raises(EvaluateError) as info:
        evaluate(data, out=out, **settings)
    assert f"{shard}, line 2: " in str(info.value) and "another --out" in str(info.value)


def test_a_line_cut_short_at_the_end_of_a_shard_is_scored_again(finished, tmp_path):
    data, done, settings = finished
    out = tmp_path / "out"
    shutil.copytree(done, out)
    cut = {}
    for shard in (out / "shards").glob("*.jsonl"):
        lines = shard.read_text().splitlines()
        shard.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])
        cut[shard] = shard.read_bytes()
    evaluate(data, out=out, **settings)
    assert _run_json(out)["scored_now"] == 1
    # the run wrote a shard of its own (even within the same second, by the same process): the cut one is as it was
    assert all(shard.read_bytes() == text for shard, text in cut.items()) and len(list((out / "shards").glob("*.jsonl"))) > len(cut)
    _same_tables(_table(out / "per_image.csv"), _table(done / "per_image.csv"))
    assert (out / "summary.csv").read_bytes() == (done / "summary.csv").read_bytes()


def test_results_that_are_not_finite_are_an_error_in_their_row(tmp_path, monkeypatch):
    data = tmp_path / "data"
    vitviz.shapes.write_dataset(data, 3, seed=6)
    score = ev_batch._score

    def nan_first(*args, **kwargs):
        rows = score(*args, **kwargs)
        for row in rows:
            if row["index"] == 0:
                row["distance"][0][0] = float("nan")
        return rows

    monkeypatch.setattr(ev_run, "_score", nan_first)
    out = tmp_path / "out"
    evaluate(data, out=out, **FAST)
    rows = _table(out / "per_image.csv")
    assert rows[0]["error"].startswith("the results are not usable: 'distance' is") and rows[0]["sha256"]
    assert not rows[1]["error"] and _table(out / "summary.csv")[0]["n"] == "2"
    evaluate(data, out=out, **FAST)  # and its line passes the merge's check
    assert _run_json(out)["scored_now"] == 0


# ------------------------------------------------------------------------------------------------
# The command as a newcomer meets it


def _main(*argv: str) -> int:
    """main(argv) in this process: its exit status (0 when it returned)."""
    try:
        main([str(a) for a in argv])
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0


def _lines(text: str) -> list[str]:
    """Text as printed, the progress bar's updates (carriage returns) left out."""
    return [line for line in text.split("\n") if line.strip() and "\r" not in line and "img/s]" not in line]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Three shapes with masks."""
    folder = tmp_path_factory.mktemp("tiny") / "data"
    vitviz.shapes.write_dataset(folder, 3, seed=8)
    return folder


def test_the_curves_figure_is_drawn_over_the_fractions_its_areas_use(tiny, tmp_path, monkeypatch):
    """5 steps over 36 patches remove round(36 i / 5) = 0, 7, 14, 22, 29, 36 patches, not i / 5 of them:
    the figure's points lie there and its legend's areas are summary.csv's."""
    figures = []
    draw = vitviz.plots.figure_to_image
    monkeypatch.setattr(vitviz.plots, "figure_to_image", lambda fig: figures.append(fig) or draw(fig))
    out = tmp_path / "out"
    evaluate(tiny, out=out, **dict(FAST, metrics=("deletion", "insertion"), steps=5))
    fig = next(f for f in figures if any("Deletion" in ax.get_title() for ax in f.axes))
    table = {(r["method"], r["metric"]): float(r["mean"]) for r in _table(out / "summary.csv")}
    want_x = [0, 7 / 36, 14 / 36, 22 / 36, 29 / 36, 1]
    seen = set()
    for ax, mode in zip(fig.axes, ("deletion", "insertion")):
        for line in ax.get_lines():
            assert list(line.get_xdata()) == pytest.approx(want_x, abs=1e-12)
        for text in ax.get_legend().get_texts():
            method, area = text.get_text().rstrip(")").split(" (")
            assert abs(float(area) - table[(method, mode)]) <= 0.0005 + 1e-9, (mode, method, area, table[(method, mode)])
            seen.add((method, mode))
    assert seen == {(m, k) for m in ("rollout", "random") for k in ("deletion", "insertion")}


MISTAKES = {
    "a folder that does not exist": (["{missing}"], "{missing} does not exist: DATA is a folder of images"),
    "an empty folder": (["{empty}"], "no images (.bmp, .gif, .jpeg, .jpg, .png, .tif, .tiff, .webp) under {empty}: put images there"),
    "a file for DATA": (["{file}"], "{file} is a file; DATA is a folder of images"),
    "an unknown model": (["{tiny}", "--model", "vit_bogus"], "--model: unknown variant 'vit_bogus'; known: shapes_p8"),
    "an unknown method": (["{tiny}", "--methods", "rollout,bogus"], "unknown method 'bogus' in --methods; the methods are attention"),
    "an unknown metric": (["{tiny}", "--metrics", "bogus"], "unknown metric 'bogus' in --metrics; the metrics are distance"),
    "no metric": (["{tiny}", "--metrics", ","], "--metrics names no metric"),
    "no method for the maps": (["{tiny}", "--methods", ",", "--metrics", "pointing"], "--methods names no method"),
    "a batch size of 0": (["{tiny}", "--batch-size", "0"], "--batch-size is 0; it is the number of images in a batch, 1 or more"),
    "a negative batch size": (["{tiny}", "--batch-size", "-4"], "--batch-size is -4;"),
    "negative steps": (["{tiny}", "--steps", "-3"], "--steps is -3; a deletion or insertion curve takes 2 steps or more"),
    "no steps": (["{tiny}", "--steps", "0"], "--steps is 0;"),
    "one step": (["{tiny}", "--steps", "1"], "--steps is 1;"),
    "negative workers": (["{tiny}", "--workers", "-1"], "--workers is -1; it is the number of decoding processes per rank"),
    "no images at most": (["{tiny}", "--max-images", "0"], "--max-images is 0; a run stops after about that many new images"),
    "pointing without masks": (["{unmasked}", "--metrics", "pointing"], "the pointing game needs object masks and {unmasked} has none"),
    "an option argparse refuses": (["{tiny}", "--steps", "many"], "argument --steps: invalid int value: 'many' (python -m vitviz.evaluate --help"),
    "no --model": (["{tiny}", "--model"], "argument --model: expected one argument"),
    "a run of other settings in --out": (["{done_data}", "--out", "{done}", "--methods", "rollout", "--steps", "2", "--batch-size", "3",
                                          "--metrics", "distance"],
                                         "{done} holds a run with other settings (metrics ['distance', 'pointing', 'deletion'] there, "
                                         "['distance'] here): use another --out, one per model and settings"),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_a_mistake_in_the_command_is_one_line_and_exit_status_2(tiny, finished, tmp_path, capsys, mistake):
    unmasked = tmp_path / "unmasked"
    shutil.copytree(tiny, unmasked, ignore=shutil.ignore_patterns("masks"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.png").write_bytes((next(tiny.rglob("*.png"))).read_bytes())
    where = dict(missing=tmp_path / "missing", empty=tmp_path / "empty", file=tmp_path / "file.png", tiny=tiny, unmasked=unmasked,
                 done_data=finished[0], done=finished[1])
    argv, words = MISTAKES[mistake]
    argv = [a.format(**where) for a in argv]
    options = ["--model", "shapes_p16", "--out", str(tmp_path / "out"), "--workers", "0", "--no-compare"]
    status = _main(*argv[:1], *options, *argv[1:])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and err.startswith("vitviz.evaluate: "), err
    assert words.format(**where) in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_debug_shows_the_traceback_and_help_names_the_command(tiny, tmp_path, capsys):
    with pytest.raises(EvaluateError, match="--batch-size is 0"):
        main([str(tiny), "--model", "shapes_p16", "--out", str(tmp_path / "out"), "--batch-size", "0", "--debug"])
    assert _main("--help") == 0
    assert capsys.readouterr().out.startswith("usage: python -m vitviz.evaluate ")


def test_a_folder_where_nothing_can_be_scored_fails_with_its_reason(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "unreadable.png").write_bytes(b"not an image")
    out = tmp_path / "out"
    assert _main(data, "--model", "shapes_p16", "--metrics", "distance", "--workers", "0", "--no-compare", "--out", out) == 1
    err = _lines(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith("vitviz.evaluate: none of the 1 image could be scored (e.g. unreadable.png: this file")
    assert f"each one's error is in {out / 'per_image.csv'}, column error" in err[0]
    assert _table(out / "per_image.csv")[0]["error"] and _run_json(out)["scored"] == 0 and _run_json(out)["failed"] == 1


def test_the_images_scored_and_failed_are_counted_printed_and_recorded(data, tmp_path, capsys):
    out = tmp_path / "out"
    assert _main(data, "--model", "shapes_p16", "--metrics", "distance", "--batch-size", "5", "--workers", "0", "--no-compare",
                 "--out", out) == 0
    last = _lines(capsys.readouterr().out)[-1]
    assert last.startswith(f"11 images scored, 1 failed (why: {out / 'per_image.csv'}, column error) in ")
    run = _run_json(out)
    assert (run["scored"], run["failed"], run["scored_now"], run["failed_now"]) == (11, 1, 11, 1)
    assert _main(data, "--model", "shapes_p16", "--metrics", "distance", "--batch-size", "5", "--workers", "0", "--no-compare",
                 "--out", out) == 0
    assert _lines(capsys.readouterr().out)[-1] == (f"Every image was already scored (in {out / 'shards'}): 11 scored, 1 failed "
                                                   f"(why: {out / 'per_image.csv'}, column error); the summary was written again.")


def test_ctrl_c_is_one_line_exit_status_130_and_the_same_command_goes_on(tiny, tmp_path, capsys, monkeypatch):
    score, calls = ev_batch._score, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return score(*args, **kwargs)

    monkeypatch.setattr(ev_run, "_score", interrupted)
    out = tmp_path / "out"
    command = [tiny, "--model", "shapes_p16", "--metrics", "distance", "--batch-size", "2", "--workers", "0", "--no-compare", "--out", out]
    assert _main(*command) == 130
    err = _lines(capsys.readouterr().err)
    assert err == [f"vitviz.evaluate: stopped; the images scored so far are kept in {out / 'shards'}: run the same command again to go on"]
    monkeypatch.setattr(ev_run, "_score", score)
    assert _main(*command) == 0
    last = _lines(capsys.readouterr().out)[-1]
    assert last.startswith("1 image scored, 0 failed in ") and last.endswith(f"(all 3 images: 3 scored, 0 failed); results in {out}")
    run = _run_json(out)
    assert (run["scored"], run["scored_now"]) == (3, 1)  # the first batch was kept
    # the interrupted session was not timed: run.json's rate covers the one listed, and says how many images that is
    assert len(run["sessions"]) == 1 and run["timed_images"] == 1


def test_run_json_times_every_session_of_a_run_in_parts(tiny, tmp_path):
    out = tmp_path / "out"
    evaluate(tiny, out=out, max_images=2, **dict(FAST, batch_size=2))
    evaluate(tiny, out=out, **dict(FAST, batch_size=2))
    evaluate(tiny, out=out, **dict(FAST, batch_size=2))  # nothing left: no session
    run = _run_json(out)
    assert [s["scored"] for s in run["sessions"]] == [2, 1] and run["timed_images"] == 3
    assert run["seconds"] == pytest.approx(sum(s["seconds"] for s in run["sessions"]))
    assert run["images_per_second"] == pytest.approx(3 / run["seconds"])
    assert all(s["world_size"] == 1 and s["images_per_second"] == pytest.approx(s["scored"] / s["seconds"]) for s in run["sessions"])


def test_a_gradient_run_is_timed_against_forwards_and_backwards_and_a_distance_run_against_forwards(tiny, tmp_path, capsys):
    """run.json and the closing line name the plain pass each run is compared with: a gradient method's
    maps cost a forward and a backward, distances a forward. The rates are measured, so only their
    presence is checked: how they compare depends on the machine's load."""
    rates = {}
    for metrics, methods in (("pointing", "gradient"), ("distance", "rollout")):
        out = tmp_path / metrics
        assert _main(tiny, "--model", "shapes_p16", "--metrics", metrics, "--methods", methods, "--out", out) == 0
        run = _run_json(out)
        rates[metrics] = (run["plain_forward_images_per_second"], run["plain_forward_backward_images_per_second"])
        assert run["sessions"][0]["plain_forward_backward_images_per_second"] == rates[metrics][1]
        assert 0 <= run["sessions"][0]["data_wait_seconds"] <= run["sessions"][0]["seconds"]  # the model idle, waiting for images
        last = _lines(capsys.readouterr().out)[-1]
        assert ("plain forwards and backwards" in last) == (metrics == "pointing")
    assert rates["pointing"][0] > 0 and rates["pointing"][1] > 0 and rates["distance"][0] > 0 and rates["distance"][1] is None


@pytest.mark.parametrize("maps", [False, True], ids=["distance", "maps"])
def test_passes_recorded_a_few_images_at_a_time_equal_the_whole_batchs(tiny, tmp_path, monkeypatch, maps):
    """On CPU a distance pass reduces each layer's attention as many images at a time as keep it in
    cache (one forward of the batch), and a pass for maps records as many images as keep every
    layer's within `KEPT_BYTES`; the rows are those of one pass over the whole batch."""
    model = vitviz.load_model("shapes_p16")
    x = torch.zeros(5, 3, 96, 96)
    assert ev_batch._attention_part(model, x) == 5 and ev_batch._images_in_cache(model, x) == 5  # 6 x 3 x 37 x 37: all fit
    monkeypatch.setattr(ev_batch, "PART_BYTES", 2 * 3 * 37 * 37 * 4)
    monkeypatch.setattr(ev_batch, "KEPT_BYTES", 2 * 6 * 3 * 37 * 37 * 4)
    assert ev_batch._attention_part(model, x) == 2 and ev_batch._images_in_cache(model, x) == 2
    monkeypatch.setattr(ev_batch, "PART_BYTES", 1)
    assert ev_batch._attention_part(model, x) == 1
    monkeypatch.setattr(ev_batch, "PART_BYTES", 2 * 3 * 37 * 37 * 4)
    settings = dict(FAST, metrics=("distance", "pointing") if maps else ("distance",), methods=("rollout", "gradient"), batch_size=3)
    evaluate(tiny, out=tmp_path / "two", **settings)
    monkeypatch.setattr(ev_batch, "PART_BYTES", 10**9)
    monkeypatch.setattr(ev_batch, "KEPT_BYTES", 10**9)
    evaluate(tiny, out=tmp_path / "whole", **settings)
    for table in ("per_image.csv", "distance.csv"):  # each image's results; each layer's and head's distance over the images
        two, whole = _table(tmp_path / "two" / table), _table(tmp_path / "whole" / table)
        assert len(two) == (3 if table == "per_image.csv" else 6 * 3)
        assert not maps or table != "per_image.csv" or {"rollout_pointing", "gradient_pointing", "target"} <= two[0].keys()
        _same_tables([{k: v for k, v in r.items() if k != "path"} for r in two], [{k: v for k, v in r.items() if k != "path"} for r in whole])


def test_the_pointing_game_without_masks_is_a_warning_naming_where_masks_go(tiny, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(tiny, data)
    masks = sorted((data / "masks").rglob("*.png"))
    shutil.rmtree(data / "masks")
    out = tmp_path / "out"
    command = [data, "--model", "shapes_p16", "--methods", "rollout", "--metrics", "distance,pointing", "--workers", "0",
               "--no-compare", "--out", out]
    assert _main(*command) == 0
    first = Path(scan(data)[0].file)
    warned = [line for line in _lines(capsys.readouterr().err) if "warning" in line]
    assert warned == [f"vitviz.evaluate: warning: pointing skipped: it needs object masks and {data} has none (each image's at "
                      f"DATA/masks/<its relative path>, any image format, e.g. {data / 'masks' / first} for {data / first}); "
                      f"scoring distance"]
    assert _run_json(out)["warnings"] == [warned[0].removeprefix("vitviz.evaluate: warning: ")]
    # some masks: the pointing game counts the images that have one, and says so
    for mask in masks[1:]:
        mask.parent.mkdir(parents=True, exist_ok=True)
        mask.write_bytes((tiny / mask.relative_to(data)).read_bytes())
    with pytest.warns(EvaluateWarning, match=r"pointing counts 2 of the 3 images scored: 1 without a mask \(each image's at "
                                             r"DATA/masks/<its relative path>"):
        evaluate(data, out=tmp_path / "some", **dict(FAST, methods=("rollout",)))


def test_a_resume_scores_again_the_rows_whose_inputs_changed(tiny, tmp_path, capsys, monkeypatch):
    data = tmp_path / "data"
    shutil.copytree(tiny, data, ignore=shutil.ignore_patterns("masks"))
    out = tmp_path / "out"
    with pytest.warns(EvaluateWarning, match="pointing skipped"):
        evaluate(data, out=out, **FAST)
    assert all(r["rollout_pointing"] == "" for r in _table(out / "per_image.csv"))
    # masks appear: a change of DATA, named as such; --rescan scores exactly those rows
    shutil.copytree(tiny / "masks", data / "masks")
    command = [data, "--model", "shapes_p16", "--methods", "rollout", "--metrics", "distance,pointing", "--batch-size", "3",
               "--workers", "0", "--no-compare", "--out", out]
    assert _main(*command) == 2
    err = capsys.readouterr().err
    first = scan(data)[0].file
    assert "images added: 0, removed: 0, changed: 0; masks added: 3, removed: 0, changed: 0 (mask added for " + first in err
    assert _main(*command, "--rescan") == 0
    assert _run_json(out)["scored_now"] == 3 and all(r["rollout_pointing"] in ("0.0", "1.0") for r in _table(out / "per_image.csv"))
    # a file that could not be read (an image, and a mask) is read again by the next run, its stamp unchanged
    items = scan(data)
    read = ev_data._read

    def denied(path):
        if path in (items[0].path, items[1].mask):
            raise vitviz.ImageError("the file cannot be read (Permission denied)")
        return read(path)

    fresh = tmp_path / "fresh"
    monkeypatch.setattr(ev_data, "_read", denied)
    with pytest.warns(EvaluateWarning, match="pointing counts 1 of the 2 images scored: 1 whose mask could not be used"):
        evaluate(data, out=fresh, **FAST)
    rows = _table(fresh / "per_image.csv")
    assert "Permission denied" in rows[0]["error"] and rows[0]["sha256"] == "" and "Permission denied" in rows[1]["mask_error"]
    monkeypatch.setattr(ev_data, "_read", read)
    evaluate(data, out=fresh, **FAST)
    assert _run_json(fresh)["scored_now"] == 2
    _same_tables(_table(fresh / "per_image.csv"), _table(out / "per_image.csv"))
    evaluate(data, out=fresh, **FAST)  # and then they are done
    assert _run_json(fresh)["scored_now"] == 0


@pytest.mark.slow
def test_under_torchrun_a_mistake_is_one_line(tiny, tmp_path):
    if shutil.which("torchrun") is None:
        pytest.skip("torchrun is not installed with this torch")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    ran = subprocess.run(["torchrun", "--standalone", "--nproc_per_node=2", "-m", "vitviz.evaluate", str(tiny), "--model", "shapes_p16",
                          "--batch-size", "0", "--out", str(tmp_path / "out")], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    ours = [line for line in ran.stderr.splitlines() if line.startswith("vitviz.evaluate:") or line.startswith("[rank")]
    assert ran.returncode != 0 and ours == ["vitviz.evaluate: --batch-size is 0; it is the number of images in a batch, 1 or more "
                                            "(the default is 32)"], ran.stderr[-3000:]
    assert "exitcode  : 2" in ran.stderr  # torchrun's own report of the processes follows


def _dataset_commands(path: str, heading: str) -> list[list[str]]:
    """The commands of the first block under `heading` in a Markdown file, comments left out."""
    text = (ROOT / path).read_text().split(heading, 1)[1].split("\n## ", 1)[0]
    block = text.split("\n\n    ", 1)[1].split("\n\n", 1)[0]
    return [shlex.split(line.split("  #")[0]) for line in ("    " + block).splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("where", [("README.md", "## Datasets"), ("docs/evaluate.md", "## Running it")])
def test_the_dataset_commands_of_the_readme_and_the_docs_run_one_after_another(tmp_path, monkeypatch, where):
    """As written, in one folder, a few images instead of 1,000. The torchrun line runs on one process here
    (what it would refuse does not depend on the number); vit_b_16 gets random weights in a private cache."""
    import torchvision

    commands = _dataset_commands(*where)
    assert [c[0] for c in commands] == ["python", "python", "torchrun"] and commands[0][:3] == ["python", "-m", "vitviz.shapes"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv("VITVIZ_OFFLINE", "1")
    random_torchvision_checkpoint(tmp_path / "torch")
    outs = []
    for command in commands:
        args = command[command.index("-m") + 2:]
        if command[2] == "vitviz.shapes":
            vitviz.shapes.main([("3" if a == "1000" else a) for a in args])
        else:
            assert _main(*args) == 0, command
            outs.append(Path(args[args.index("--out") + 1]))
    assert len(set(outs)) == 2 and all((out / "summary.csv").is_file() for out in outs)


# ------------------------------------------------------------------------------------------------
# Phrases: an image–text model explained and scored for --text, or for each image's caption


def _shard_rows(out: Path) -> dict[str, dict]:
    """The shard rows of a run by relative path, curves included (per_image.csv leaves them out)."""
    rows = {}
    for shard in sorted((out / "shards").glob("*.jsonl")):
        for line in shard.read_text().splitlines():
            row = json.loads(line)
            rows[row["file"]] = row
    return rows


def _write_captions(path: Path, rows: list[tuple[str, str]], *, header: str = "file,text", encoding: str = "utf-8") -> Path:
    with open(path, "w", newline="", encoding=encoding) as f:
        w = csv.writer(f)
        w.writerow(header.split(","))
        w.writerows(rows)
    return path


@pytest.fixture(scope="module")
def scenes(tmp_path_factory):
    """Four fresh scenes of 2-3 coloured shapes; each captioned "a <colour> <shape>" for one of its
    objects, whose mask is the image's mask. Returns (DATA, the captions file, {file: caption})."""
    from PIL import Image
    import numpy as np

    root = tmp_path_factory.mktemp("scenes")
    folder = root / "data"
    (folder / "masks").mkdir(parents=True)
    images, objects, masks = vitviz.shapes.generate_scenes(4, seed=91)
    captions = {}
    for i, (image, objs, m) in enumerate(zip(images, objects, masks)):
        k = i % len(objs)
        name = f"scene{i}.png"
        Image.fromarray(image).save(folder / name)
        Image.fromarray(m[k].astype(np.uint8) * 255).save(folder / "masks" / name)
        captions[name] = f"a {objs[k][0]} {objs[k][1]}"
    # a byte-order mark, an extra column and "./" are all read as meant
    path = root / "captions.csv"
    with open(path, "w", newline="", encoding="utf-8-sig") as f:
        w = csv.writer(f)
        w.writerow(["file", "note", "text"])
        w.writerows([(f"./{name}" if i == 0 else name, "seen", text) for i, (name, text) in enumerate(captions.items())])
    return folder, path, captions


def _similarity_by_hand(model, x: torch.Tensor, ids, mask) -> float:
    """logits_per_image of one image [3, S, S] and one phrase, from the model's own forward."""
    with torch.no_grad():
        return float(model(x[None], ids, mask)[0, 0])


def _deletion_by_hand(model, x: torch.Tensor, patch_map: torch.Tensor, ids, mask, steps: int) -> tuple[list[float], float]:
    """The similarity as the patches go, most relevant first (ties in index order), each set to 0
    (the mean colour), round(i N / steps) of N patches at step i; its trapezoidal area."""
    gh, gw = patch_map.shape
    p = model.spec.patch_size
    order = sorted(range(gh * gw), key=lambda j: (-float(patch_map.flatten()[j]), j))
    fractions, values = [], []
    for i in range(steps + 1):
        count = round(i * gh * gw / steps)
        y = x.clone()
        for j in order[:count]:
            r, c = divmod(j, gw)
            y[:, r * p : (r + 1) * p, c * p : (c + 1) * p] = 0
        fractions.append(count / (gh * gw))
        values.append(_similarity_by_hand(model, y, ids, mask))
    area = sum((fractions[k + 1] - fractions[k]) * (values[k + 1] + values[k]) / 2 for k in range(steps))
    return values, area


def test_captions_explain_each_image_for_its_phrase_as_vitviz_explain_does(scenes, tmp_path):
    """Each row: its caption, the similarity, the pointing game of vitviz.explain(..., text=caption)'s
    map and its deletion curve as the model's own forward gives it on the perturbed image."""
    import numpy as np

    data, captions_file, captions = scenes
    out = tmp_path / "out"
    summary = evaluate(data, model="shapes_clip", out=out, methods=("rollout", "gradient"), metrics=("pointing", "deletion", "insertion"),
                       steps=4, batch_size=4, workers=0, compare=False, progress=False, captions=captions_file)
    assert {(r["method"], r["metric"]) for r in summary} == {(m, k) for m in ("rollout", "gradient", "random")
                                                             for k in ("pointing", "deletion", "insertion")}
    model = vitviz.load_model("shapes_clip", device="cpu")
    rows = _shard_rows(out)
    assert {f: r["text"] for f, r in rows.items()} == captions
    for file, phrase in captions.items():
        row = rows[file]
        ids, mask = model.tokenize([phrase])
        x, _ = vitviz.preprocess(vitviz.load_image(str(data / file)), model.spec.preprocessing)
        assert row["similarity"] == pytest.approx(_similarity_by_hand(model, x, ids, mask), abs=1e-4)
        object_mask = torch.from_numpy(np.asarray(vitviz.load_image(str(data / "masks" / file)))[None, :, :, 0] > 127)
        for method in ("rollout", "gradient"):
            why = vitviz.explain(model, str(data / file), method=method, text=phrase)
            assert why.text == phrase and row["similarity"] == pytest.approx(why.similarity, abs=1e-4)
            assert row[f"{method}_pointing"] == float(vitviz.pointing_game(why.map[None], object_mask, patch_size=16)[0])
            values, area = _deletion_by_hand(model, x, why.map, ids, mask, steps=4)
            np.testing.assert_allclose(row[f"{method}_deletion_curve"], values, rtol=0, atol=1e-3)
            assert row[f"{method}_deletion"] == pytest.approx(area, abs=1e-3)
    # similarities, not probabilities: per_image.csv has the phrase and its similarity, no class
    table = _table(out / "per_image.csv")
    assert "text" in table[0] and "similarity" in table[0] and "probability" not in table[0]
    assert not (out / "curves.png").exists() and (out / "curves.csv").is_file()
    # another captions file is another setting: a run into the same folder is refused
    changed = _write_captions(tmp_path / "changed.csv", [(f, "a red star") for f in captions])
    with pytest.raises(EvaluateError, match="holds a run with other settings \\(captions "):
        evaluate(data, model="shapes_clip", out=out, methods=("rollout", "gradient"), metrics=("pointing", "deletion", "insertion"),
                 steps=4, batch_size=4, workers=0, compare=False, progress=False, captions=changed)


def test_one_phrase_for_every_image_from_the_command(scenes, tmp_path, capsys):
    data, _, captions = scenes
    out = tmp_path / "out"
    assert _main(data, "--model", "shapes_clip", "--text", "a red star", "--methods", "gradient", "--metrics", "pointing,deletion",
                 "--steps", "3", "--workers", "0", "--no-compare", "--out", out) == 0
    printed = capsys.readouterr().out
    assert "| gradient | pointing | 4 |" in printed and "| random | deletion | 4 |" in printed
    model = vitviz.load_model("shapes_clip", device="cpu")
    rows = _table(out / "per_image.csv")
    assert len(rows) == 4 and all(r["text"] == "a red star" for r in rows)
    for r in rows:
        why = vitviz.explain(model, r["path"], method="gradient", text="a red star")
        assert float(r["similarity"]) == pytest.approx(why.similarity, abs=1e-4)
    assert _run_json(out)["text"] == "a red star"


CAPTION_MISTAKES = {
    "an image without a row": (lambda c: list(c.items())[:3], "has no row for 1 of the 4 images under DATA (e.g. scene3.png): add a row"),
    "a row of no image": (lambda c: [*c.items(), ("cat.png", "a cat")], "line 6: cat.png is not an image under DATA (1 row like it)"),
    "an empty text": (lambda c: [(f, "  " if f == "scene1.png" else t) for f, t in c.items()], "line 3: the text of scene1.png is empty"),
    "a huge text": (lambda c: [(f, "a" * 1001 if f == "scene0.png" else t) for f, t in c.items()],
                    "line 2: the text of scene0.png is 1,001 characters; a caption is at most 1,000"),
    "a file twice": (lambda c: [*c.items(), ("scene0.png", "a blue ring")], "line 6: scene0.png has a caption already (line 2)"),
}


@pytest.mark.parametrize("mistake", [*CAPTION_MISTAKES, "no text column", "not UTF-8", "no such file", "a classifier", "both",
                                     "an empty --text", "a huge --text", "a phrase method without a phrase"])
def test_a_captions_file_that_does_not_fit_is_refused_in_one_line(scenes, tmp_path, capsys, mistake):
    data, _, captions = scenes
    path = tmp_path / "captions.csv"
    model, extra = "shapes_clip", ["--captions", path]
    if mistake in CAPTION_MISTAKES:
        rows, words = CAPTION_MISTAKES[mistake]
        _write_captions(path, rows(captions))
    elif mistake == "no text column":
        _write_captions(path, list(captions.items()), header="file,caption")
        words = "its header file,caption lacks the column text; the first line is file,text"
    elif mistake == "not UTF-8":
        path.write_bytes(b"file,text\nscene0.png,a r\xe9d star\n")
        words = "is not UTF-8 text (byte 24): save it as UTF-8"
    elif mistake == "no such file":
        words = f"--captions {path} is not a file; it is a CSV file with a header file,text"
    elif mistake == "a classifier":
        model, extra = "shapes_p16", ["--text", "a red star"]
        words = "--text needs an image–text model (shapes_clip, hf:openai/clip-vit-base-patch16, ...); shapes_p16 is not one"
    elif mistake == "both":
        _write_captions(path, list(captions.items()))
        extra += ["--text", "a red star"]
        words = "--text gives every image one phrase and --captions each image its own: give one of them"
    elif mistake == "an empty --text":
        extra = ["--text", " "]
        words = "--text is empty; it is the phrase every image is scored against"
    elif mistake == "a huge --text":
        extra = ["--text", "a" * 1001]
        words = "--text is 1,001 characters; a phrase is at most 1,000"
    else:
        extra = []
        words = ("shapes_clip has no classifier: deletion, insertion and the methods that explain a class need one (an image–text "
                 "model explains a phrase: give one with --text, or one per image with --captions)")
    status = _main(data, "--model", model, "--methods", "gradient", "--metrics", "pointing,deletion", "--workers", "0", "--no-compare",
                   "--out", tmp_path / "out", *extra)
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and err.startswith("vitviz.evaluate: "), err
    assert words in err, err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------
# --metrics inside: the logit lens and direct logit attribution as dataset statistics


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    """Eight shapes with masks (batches of 3: 3, 3 and 2)."""
    folder = tmp_path_factory.mktemp("eight") / "data"
    vitviz.shapes.write_dataset(folder, 8, seed=35)
    return folder


@pytest.mark.parametrize("path", ["plain forward", "recorded with gradients"])
def test_inside_rows_and_heads_equal_the_library_image_by_image(eight, tmp_path, path):
    """Each row's first_top1 and per-head attribution against vitviz.analyze(...).logit_lens() and
    .logit_attribution(its class) on the same file alone; summary.csv's and heads.csv's figures against
    the mean of those. The plain path is the one forward of --metrics distance,inside; the other is the
    forward that record() differentiates for the gradient maps."""
    out = tmp_path / "out"
    metrics, methods = (("distance", "inside"), ()) if path == "plain forward" else (("inside", "pointing"), ("gradient",))
    summary = evaluate(eight, model="shapes_p16", out=out, methods=methods, metrics=metrics, batch_size=3, workers=0,
                       compare=False, progress=False)
    model = vitviz.load_model("shapes_p16", device="cpu")
    rows = _shard_rows(out)
    assert len(rows) == 8
    firsts, heads = [], []
    for file, row in rows.items():
        label = file.split("/")[0]
        target = vitviz.shapes.CLASSES.index(label)  # the image's folder: the class followed
        assert row["target"] == target
        result = vitviz.analyze(model, row["path"])
        lens = result.logit_lens()  # [L+1, C]
        top = lens.argmax(dim=-1) == target
        first = int(top.nonzero()[0]) if top.any() else None
        assert row["first_top1"] == first, file
        want = result.logit_attribution(target).heads  # [L, H]
        torch.testing.assert_close(torch.tensor(row["attribution"], dtype=torch.float64), want, atol=1e-4, rtol=1e-4)
        firsts.append(first)
        heads.append(want)
    table = {(r["method"], r["metric"]): r for r in summary}
    reached = [f for f in firsts if f is not None]
    assert table[("model", "first_top1")]["n"] == len(reached)
    assert table[("model", "first_top1")]["mean"] == pytest.approx(sum(reached) / len(reached), abs=1e-12)
    assert table[("model", "never_top1")]["n"] == 8
    assert table[("model", "never_top1")]["mean"] * 8 == pytest.approx(8 - len(reached), abs=1e-9)
    assert [{k: str(v) for k, v in r.items()} for r in summarize(out)] == _table(out / "summary.csv")
    mean = torch.stack(heads).mean(0)  # [L, H]
    csv_rows = _table(out / "heads.csv")
    assert len(csv_rows) == 6 * 3 and {r["images"] for r in csv_rows} == {"8"}
    got = torch.zeros(6, 3, dtype=torch.float64)
    for r in csv_rows:
        got[int(r["layer"]), int(r["head"])] = float(r["mean_attribution"])
        assert float(r["ci95_low"]) <= float(r["mean_attribution"]) <= float(r["ci95_high"])
    torch.testing.assert_close(got, mean, atol=1e-5, rtol=0)
    # the report (summary.md, which the command prints) lists the five heads of the highest mean, the highest first
    best = mean.flatten().argsort(descending=True)[:5].tolist()
    listed = [line for line in (out / "summary.md").read_text().splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [(int(c[1]), int(c[2])) for c in (line.split("|") for line in listed)] == [(i // 3, i % 3) for i in best]


def test_inside_is_not_scored_unless_named(eight, tmp_path):
    out = tmp_path / "out"
    evaluate(eight, model="shapes_p16", out=out, methods=(), metrics=("distance",), batch_size=4, workers=0, compare=False,
             progress=False)
    assert "first_top1" not in next(iter(_shard_rows(out).values())) and not (out / "heads.csv").exists()
    assert "inside" not in ev.METRICS and "inside" in ev.EXTRA_METRICS


@pytest.mark.parametrize("model", ["timm:vit_small_patch8_224.dino", "shapes_clip"])
def test_inside_on_a_model_without_a_head_is_refused_in_one_line(tiny, tmp_path, capsys, model):
    status = _main(tiny, "--model", model, "--metrics", "inside", "--out", tmp_path / "out", "--workers", "0", "--no-compare")
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "--metrics inside reads the logit lens" in err and "has none" in err, err
    assert not (tmp_path / "out").exists()
