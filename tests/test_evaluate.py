"""python -m vitviz.evaluate on one process and on two (torchrun, gloo): the same per-image results
and the same summary to the last digit, every image once, and a run in parts equal to a run in one go;
a resume after DATA changed refused or rescanned, masks through the image gate, shard lines checked."""

import csv
import hashlib
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

import vitviz
from vitviz.evaluate import EvaluateError, _Batches, evaluate, main, scan, summarize, wilson

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
    # the dataset figures come from the merged rows in file order: the same to the last digit
    for name in ("summary.csv", "distance.csv"):
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    assert len(list((two / "shards").glob("*.jsonl"))) == 2 and json.loads((two / "run.json").read_text())["world_size"] == 2
    unreadable = [r for r in rows_two if r["path"].endswith("unreadable.png")][0]
    assert "not an image" in unreadable["error"]
    # the summary from Python is the one the run wrote
    assert [{k: str(v) for k, v in r.items()} for r in summarize(two)] == _table(two / "summary.csv")
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
    with pytest.raises(ValueError, match="no images"):
        evaluate(tmp_path, model="shapes_p16", out=tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match="unknown metric or method 'saliency'"):
        evaluate(tmp_path, model="shapes_p16", out=tmp_path / "out", methods=("saliency",), progress=False)


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
    # same count: one image replaced by other bytes, one moved (with its mask), one only touched
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
    msg = str(refused.value)
    assert "images added: 1, removed: 1, changed: 2" in msg and "--rescan" in msg
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
    for shard in (out / "shards").glob("*.jsonl"):
        lines = shard.read_text().splitlines()
        shard.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])
    evaluate(data, out=out, **settings)
    assert _run_json(out)["scored_now"] == 1
    _same_tables(_table(out / "per_image.csv"), _table(done / "per_image.csv"))
    assert (out / "summary.csv").read_bytes() == (done / "summary.csv").read_bytes()


def test_results_that_are_not_finite_are_an_error_in_their_row(tmp_path, monkeypatch):
    import vitviz.evaluate as ev

    data = tmp_path / "data"
    vitviz.shapes.write_dataset(data, 3, seed=6)
    score = ev._score

    def nan_first(*args, **kwargs):
        rows = score(*args, **kwargs)
        for row in rows:
            if row["index"] == 0:
                row["distance"][0][0] = float("nan")
        return rows

    monkeypatch.setattr(ev, "_score", nan_first)
    out = tmp_path / "out"
    evaluate(data, out=out, **FAST)
    rows = _table(out / "per_image.csv")
    assert rows[0]["error"].startswith("the results are not usable: 'distance' is") and rows[0]["sha256"]
    assert not rows[1]["error"] and _table(out / "summary.csv")[0]["n"] == "2"
    evaluate(data, out=out, **FAST)  # and its line passes the merge's check
    assert _run_json(out)["scored_now"] == 0
