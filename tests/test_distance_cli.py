"""python -m vitviz.distance: dataset-averaged mean attention distance."""

import csv

import pytest
import torch
from PIL import Image

import vitviz
from vitviz.distance import main


def test_folder_average_matches_per_image_analyses(tmp_path, capsys):
    folder = tmp_path / "imgs"
    (folder / "sub").mkdir(parents=True)
    paths = []
    for i in range(7):
        path = folder / ("sub" if i % 2 else "") / f"{i}.png"
        Image.fromarray(vitviz.shapes.render(i % 8, seed=31, index=i)[0]).save(path)
        paths.append(path)
    (folder / "broken.jpg").write_bytes(b"not an image")
    out = tmp_path / "out"
    main([str(folder), "--model", "shapes_p16", "--batch-size", "3", "--out", str(out), "--no-compare"])
    assert "7 images" in capsys.readouterr().out
    rows = list(csv.DictReader(open(out / "shapes_p16_distance.csv")))
    assert len(rows) == 6 * 3 and rows[0]["images"] == "7"
    model = vitviz.load_model("shapes_p16", device="cpu")
    want = torch.stack([vitviz.analyze(model, p).distances() for p in paths]).mean(0)
    got = torch.tensor([float(r["mean_distance_px"]) for r in rows]).reshape(6, 3)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=0)
    assert Image.open(out / "shapes_p16_distance.png").size[0] > 300


def test_empty_folder_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--model", "shapes_p16"])
