"""The evaluator's folders: where --out may be (not inside DATA; empty, new, or holding a run of
vitviz.evaluate), a refused run that leaves nothing behind, a resume that knows an image by its
bytes, and CSV cells a spreadsheet reads as text, never as a formula."""

import csv
import json
import os
import shutil
from pathlib import Path

import pytest

import vitviz
import vitviz.evaluate as ev
from vitviz.evaluate import EvaluateError, evaluate, summarize
from test_protocols import _main

FAST = dict(model="shapes_p16", methods=("rollout",), metrics=("distance",), batch_size=3, workers=0, compare=False, progress=False)
COMMAND = ["--model", "shapes_p16", "--methods", "rollout", "--metrics", "distance", "--batch-size", "3", "--workers", "0",
           "--no-compare"]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """Three shapes with masks, never written to: copy them to change them."""
    folder = tmp_path_factory.mktemp("shapes") / "data"
    vitviz.shapes.write_dataset(folder, 3, seed=12)
    return folder


@pytest.fixture
def data(shapes, tmp_path):
    shutil.copytree(shapes, tmp_path / "data")
    return tmp_path / "data"


def _files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder`, by relative path, with its bytes."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _run_json(out: Path) -> dict:
    return json.loads((out / "run.json").read_text())


def _refused_in_one_line(capsys, *argv) -> str:
    status = _main(*argv)
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and err.startswith("vitviz.evaluate: ") and "Traceback" not in err, err
    return err


# ------------------------------------------------------------------------------------------------
# Where --out may be


@pytest.mark.parametrize("where", ["DATA itself", "a folder under DATA", "under DATA, with --rescan", "a link into DATA"])
def test_an_out_folder_inside_data_is_refused_before_anything_is_written(data, tmp_path, capsys, where):
    out = {"DATA itself": data, "a folder under DATA": data / "results", "under DATA, with --rescan": data / "cat" / "results",
           "a link into DATA": tmp_path / "link" / "results"}[where]
    if where == "a link into DATA":
        (tmp_path / "link").symlink_to(data, target_is_directory=True)
    before = _files(data)
    err = _refused_in_one_line(capsys, data, *COMMAND, "--out", out, *(["--rescan"] if "rescan" in where else []))
    assert f"--out {out} is inside DATA ({data})" in err and "put the results outside DATA" in err
    assert _files(data) == before and not (data / "results").exists()
    with pytest.raises(EvaluateError, match="is inside DATA"):
        evaluate(data, out=out, **FAST)


def test_an_out_folder_holding_other_files_is_refused_and_an_empty_or_new_one_is_used(data, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "summary.csv").write_text("my own figures\n")
    (out / "notes.txt").write_text("keep me\n")
    before = _files(out)
    err = _refused_in_one_line(capsys, data, *COMMAND, "--out", out)
    assert f"--out {out} holds files and no run of vitviz.evaluate (e.g. notes.txt)" in err and "an empty or new folder" in err
    assert _files(out) == before
    # a run.json of something else is no run of vitviz.evaluate either
    (out / "run.json").write_text(json.dumps({"epochs": 3}))
    err = _refused_in_one_line(capsys, data, *COMMAND, "--out", out)
    assert f"{out / 'run.json'} is not a run.json of vitviz.evaluate" in err
    assert json.loads((out / "run.json").read_text()) == {"epochs": 3}
    # an empty folder, and one that does not exist yet: a run goes there; the same command again resumes it
    for out in (tmp_path / "empty", tmp_path / "new" / "results"):
        if out.name == "empty":
            out.mkdir()
        assert _main(data, *COMMAND, "--out", out) == 0
        assert _main(data, *COMMAND, "--out", out) == 0
        assert _run_json(out)["scored_now"] == 0 and _run_json(out)["scored"] == 3


# ------------------------------------------------------------------------------------------------
# A refused run leaves nothing behind


def test_a_refused_resume_leaves_the_folder_as_it_was(data, tmp_path):
    out = tmp_path / "out"
    evaluate(data, out=out, **FAST)
    shard = next((out / "shards").glob("*.jsonl"))
    shard.write_text(shard.read_text() + "[]\n" + shard.read_text())  # a line that is no row, then rows
    before = _files(out)
    with pytest.raises(EvaluateError, match="line 4: a row is a JSON object"):
        evaluate(data, out=out, **FAST)
    assert _files(out) == before  # run.json included: not rewritten by the run that was refused
    (data / "cat.png").write_bytes(next(data.rglob("*.png")).read_bytes())  # DATA changed: with --rescan, the same
    with pytest.raises(EvaluateError, match="line 4: a row is a JSON object"):
        evaluate(data, out=out, rescan=True, **FAST)
    assert _files(out) == before


REFUSALS = {
    "a phrase for a classifier": ["--text", "a red star"],
    "inside on a model without a head": ["--model", "shapes_clip", "--metrics", "inside"],
    "a protocol on images without a class": ["--protocol", "chefer2021", "--metrics", None],
    "deletion on a model without a classifier": ["--model", "shapes_clip", "--metrics", "deletion"],
    "a model that attends within windows": ["--model", "shapes_swin", "--metrics", "distance"],
}


@pytest.mark.parametrize("case", REFUSALS)
def test_a_refused_run_creates_no_folder_and_no_run_json(data, tmp_path, capsys, case):
    (data / "stray.png").write_bytes(next(data.rglob("*.png")).read_bytes())  # no class folder
    argv = list(COMMAND)
    extra = REFUSALS[case]
    for name, value in zip(extra[::2], extra[1::2]):
        if name in argv:
            i = argv.index(name)
            del argv[i:i + 2]
        if value is not None:
            argv += [name, value]
    for out in (tmp_path / "new", tmp_path / "empty"):
        if out.name == "empty":
            out.mkdir()
        _refused_in_one_line(capsys, data, *argv, "--out", out)
        assert not (out / "run.json").exists() and (out.name == "empty") == out.exists()
        assert not out.exists() or not any(out.iterdir())


# ------------------------------------------------------------------------------------------------
# Resume by content


@pytest.fixture
def bitmaps(shapes, tmp_path):
    """The shapes as BMP files: images of one size are files of one size, so one can stand in for another."""
    from PIL import Image

    folder = tmp_path / "bitmaps"
    for path in shapes.rglob("*.png"):
        target = folder / path.relative_to(shapes).with_suffix(".bmp")
        target.parent.mkdir(parents=True, exist_ok=True)
        with Image.open(path) as image:
            image.save(target)
    return folder


def test_an_image_swapped_for_another_of_its_size_and_time_is_seen_as_changed(bitmaps, tmp_path, capsys):
    out = tmp_path / "out"
    evaluate(bitmaps, out=out, **FAST)
    images = [item for item in ev.scan(bitmaps)]
    first, second = Path(images[0].path), Path(images[1].path)
    assert first.stat().st_size == second.stat().st_size and first.read_bytes() != second.read_bytes()
    times = first.stat()
    first.write_bytes(second.read_bytes())
    os.utime(first, ns=(times.st_atime_ns, times.st_mtime_ns))  # the same size and modification time, other bytes
    err = _refused_in_one_line(capsys, bitmaps, *COMMAND, "--out", out)
    assert f"images added: 0, removed: 0, changed: 1 (changed {images[0].file})" in err and "--rescan" in err
    evaluate(bitmaps, out=out, rescan=True, **FAST)
    assert _run_json(out)["scored_now"] == 1
    with open(out / "per_image.csv", newline="") as f:
        rows = {r["index"]: r for r in csv.DictReader(f)}
    assert rows["0"]["sha256"] == rows["1"]["sha256"] and rows["0"]["distance_mean"] == rows["1"]["distance_mean"]


def test_an_image_touched_or_copied_over_with_the_same_bytes_is_not_a_change(data, tmp_path):
    out = tmp_path / "out"
    evaluate(data, out=out, **FAST)
    items = ev.scan(data)
    touched, copied = Path(items[0].path), Path(items[1].path)
    os.utime(touched, ns=(touched.stat().st_atime_ns, touched.stat().st_mtime_ns + 10**9))
    shutil.copy(copied, tmp_path / "copy.png")
    shutil.copy(tmp_path / "copy.png", copied)  # new times, same bytes
    mask = Path(items[2].mask)
    os.utime(mask, ns=(mask.stat().st_atime_ns, mask.stat().st_mtime_ns + 10**9))
    evaluate(data, out=out, **FAST)  # no --rescan needed: nothing changed
    assert _run_json(out)["scored_now"] == 0


def test_a_run_json_of_the_size_and_time_format_is_refused_in_one_line(data, tmp_path, capsys):
    out = tmp_path / "out"
    evaluate(data, out=out, **FAST)
    run = _run_json(out)
    (out / "run.json").write_text(json.dumps(dict(run, format=2)))  # format 2: files stamped by size and modification time
    err = _refused_in_one_line(capsys, data, *COMMAND, "--out", out)
    assert f"{out} holds a run written by an earlier vitviz.evaluate (format 2" in err and "use another --out" in err


# ------------------------------------------------------------------------------------------------
# CSV cells


TRIGGERS = ("=", "+", "-", "@", "\t", "\r")


def _cells(path: Path) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def _number(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True


def test_csv_cells_that_a_spreadsheet_would_read_as_formulas_are_written_as_text(shapes, tmp_path, monkeypatch):
    data = tmp_path / "data"
    shutil.copytree(shapes, data)
    names = ["=HYPERLINK(1).png", "-x.png", "@cls/+y.png"]
    for old, new in zip(sorted(p for p in data.rglob("*.png") if "masks" not in p.parts), names):
        (data / new).parent.mkdir(exist_ok=True)
        old.rename(data / new)
    shutil.rmtree(data / "masks")
    monkeypatch.chdir(data)  # DATA given as ".": the path column starts with the file's name
    out = tmp_path / "out"
    settings = dict(FAST, metrics=("distance", "deletion", "inside"), steps=2)
    evaluate(".", out=out, **settings)
    per_image = _cells(out / "per_image.csv")
    header = per_image[0]
    paths = sorted(row[header.index("path")] for row in per_image[1:])
    assert paths == ["'-x.png", "'=HYPERLINK(1).png", "'@cls/+y.png"]
    assert sorted(row[header.index("label")] for row in per_image[1:]) == ["", "", "'@cls"]
    written = ["per_image.csv", "summary.csv", "distance.csv", "curves.csv", "heads.csv"]
    for name in written:
        for row in _cells(out / name):
            for cell in row:
                assert not cell.startswith(TRIGGERS) or _number(cell), (name, cell)  # numbers, negative ones too, as they are
    assert any(cell.startswith("-") and _number(cell) for row in _cells(out / "heads.csv") for cell in row)
    # the run reads back what it wrote: the same command resumes it, the summary from Python is summary.csv's
    assert set(_run_json(out)["files"]) == {"=HYPERLINK(1).png", "-x.png", "@cls/+y.png"}
    evaluate(".", out=out, **settings)
    assert _run_json(out)["scored_now"] == 0 and _run_json(out)["scored"] == 3
    with open(out / "summary.csv", newline="") as f:
        assert [{k: str(v) for k, v in r.items()} for r in summarize(out)] == list(csv.DictReader(f))


def test_a_phrase_that_starts_like_a_formula_is_written_as_text(shapes, tmp_path):
    out = tmp_path / "out"
    evaluate(shapes, out=out, model="shapes_clip", methods=("rollout",), metrics=("pointing",), text="-1+1 a red star",
             batch_size=3, workers=0, compare=False, progress=False)
    with open(out / "per_image.csv", newline="") as f:
        assert {r["text"] for r in csv.DictReader(f)} == {"'-1+1 a red star"}
