"""The published protocols of `python -m vitviz.evaluate --protocol`, held to their authors' metric
code ported here line for line (numpy and torch, as their scripts compute it), on the embedded
shapes models: the same images, the same maps, the same numbers.

Chefer, Gur & Wolf 2021 (CVPR), repository hila-chefer/Transformer-Explainability (versions read:
commit 6b4f3119cb93da4c5aa2751f9dc6f838467defb0 of baselines/ViT/pertubation_eval_from_hdf5.py,
commit 3d0ef588624de7af52cadd1b14b5a32d476657c9 of baselines/ViT/generate_visualizations.py):
- `compute_saliency_and_save` (generate_visualizations.py): the patch map upsampled with
  `torch.nn.functional.interpolate(Res, scale_factor=16, mode='bilinear')`, then
  `(Res - Res.min()) / (Res.max() - Res.min())`, one image per batch (their --batch-size default 1);
  images by `transforms.Resize((224, 224))` and `ToTensor()`, unnormalised, beside the maps;
- `eval` (pertubation_eval_from_hdf5.py): `normalize` (mean 0.5, std 0.5 there: the model's own
  here), the model's accuracy on the intact images against the dataset's `target`, `vis = -vis` for
  the negative test, and for each of `perturbation_steps = [0.1, ..., 0.9]` the `torch.topk` of the
  map's `int(base_size * step)` pixels set to 0 by `scatter_` in the unnormalised image, normalised,
  and the top-1 compared with `target`;
- the area, as the authors state it in that repository's issue #31 (hila-chefer, 2021-12-17):
  `np.trapz(y, x) * 100` with the intact image's accuracy at x = 0.

Petsiuk, Das & Saenko 2018 (BMVC, RISE), repository eclique/RISE, commit
fac5d54225977091dc18cc71ef8e07f726c3bc20: `gkern`, `auc` and `CausalMetric.evaluate` of
evaluation.py; the model wrapped in `nn.Sequential(model, nn.Softmax(dim=1))`, `blur = lambda x:
nn.functional.conv2d(x, gkern(11, 5), padding=11 // 2)` for insertion and `torch.zeros_like` for
deletion (Evaluation.ipynb); `HW = 224 * 224` and `step = 224` there, S x S and S here.
"""

import csv
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torchvision.transforms.functional import to_tensor

import vitviz
import vitviz.evaluate as ev
from vitviz.evaluate import batch as ev_batch, run as ev_run
from vitviz.evaluate import EvaluateError, evaluate, main
from vitviz.faithfulness import CHEFER2021_FRACTIONS, chefer2021_auc, pixel_maps, rise_auc, rise_kernel


# ------------------------------------------------------------------------------------------------
# The authors' lines, ported


def chefer_maps(maps: torch.Tensor, patch: int) -> torch.Tensor:
    """generate_visualizations.py: each map alone (their batch of 1), upsampled and scaled: [N, 1, S, S]."""
    out = []
    for res in maps[:, None].float():
        res = torch.nn.functional.interpolate(res[None], scale_factor=patch, mode="bilinear")
        res = (res - res.min()) / (res.max() - res.min())
        out.append(res)
    return torch.cat(out)


def chefer_eval(model, data, vis, target, *, mean, std, neg: bool, batch_size: int = 16):
    """pertubation_eval_from_hdf5.py's `eval` (the accuracies only), then issue #31's AUC.
    Returns (hits of the intact images [N], hits per step [9, N], AUC)."""

    def normalize(tensor):
        m = torch.as_tensor(mean, dtype=tensor.dtype)
        s = torch.as_tensor(std, dtype=tensor.dtype)
        tensor.sub_(m[None, :, None, None]).div_(s[None, :, None, None])
        return tensor

    n = len(data)
    base_size = data.shape[-2] * data.shape[-1]  # theirs: 224 * 224
    perturbation_steps = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    num_correct_model = np.zeros(n)
    num_correct_pertub = np.zeros((9, n))
    index = 0
    with torch.no_grad():
        for start in range(0, n, batch_size):
            d, v, t = data[start : start + batch_size], vis[start : start + batch_size], target[start : start + batch_size]
            norm_data = normalize(d.clone())
            pred = model(norm_data)
            pred_class = pred.data.max(1, keepdim=True)[1].squeeze(1)
            num_correct_model[index : index + len(t)] = (t == pred_class).type(t.type()).data.cpu().numpy()
            org_shape = d.shape
            if neg:
                v = -v
            v = v.reshape(org_shape[0], -1)
            for i in range(len(perturbation_steps)):
                _data = d.clone()
                _, idx = torch.topk(v, int(base_size * perturbation_steps[i]), dim=-1)
                idx = idx.unsqueeze(1).repeat(1, org_shape[1], 1)
                _data = _data.reshape(org_shape[0], org_shape[1], -1)
                _data = _data.scatter_(-1, idx, 0)
                _data = _data.reshape(*org_shape)
                out = model(normalize(_data))
                target_class = out.data.max(1, keepdim=True)[1].squeeze(1)
                num_correct_pertub[i, index : index + len(t)] = (t == target_class).type(t.type()).data.cpu().numpy()
            index += len(t)
    trapz = getattr(np, "trapz", None) or np.trapezoid  # numpy 2 renamed it
    y = [np.mean(num_correct_model), *np.mean(num_correct_pertub, axis=1)]
    x = [0, *perturbation_steps]
    return num_correct_model, num_correct_pertub, trapz(y, x) * 100


def gkern(klen, nsig):
    """evaluation.py's Gaussian kernel."""
    from scipy.ndimage import gaussian_filter

    inp = np.zeros((klen, klen))
    inp[klen // 2, klen // 2] = 1
    k = gaussian_filter(inp, nsig)
    kern = np.zeros((3, 3, klen, klen))
    kern[0, 0] = k
    kern[1, 1] = k
    kern[2, 2] = k
    return torch.from_numpy(kern.astype("float32"))


def rise_auc_theirs(arr):
    """evaluation.py's `auc`."""
    return (arr.sum() - arr[0] / 2 - arr[-1] / 2) / (arr.shape[0] - 1)


def rise_evaluate(model, img_batch, exp_batch, *, mode: str, batch_size: int):
    """`CausalMetric.evaluate` of evaluation.py (on the CPU, without its progress bars), HW and step
    for S x S images: S * S and S. Returns scores [n_steps + 1, n_samples]."""
    klen, ksig = 11, 5
    try:
        kern = gkern(klen, ksig)
    except ImportError:  # without scipy: vitviz's kernel, equal to gkern's where scipy is installed (test above)
        kern = rise_kernel(klen, ksig)
    substrate_fn = (lambda x: torch.nn.functional.conv2d(x, kern, padding=klen // 2)) if mode == "ins" else torch.zeros_like
    model = torch.nn.Sequential(model, torch.nn.Softmax(dim=1))
    side = img_batch.shape[-1]
    HW, step, n_classes = side * side, side, model[0].spec.num_classes
    with torch.no_grad():
        n_samples = img_batch.shape[0]
        predictions = torch.FloatTensor(n_samples, n_classes)
        assert n_samples % batch_size == 0
        for i in range(n_samples // batch_size):
            predictions[i * batch_size : (i + 1) * batch_size] = model(img_batch[i * batch_size : (i + 1) * batch_size]).cpu()
        top = np.argmax(predictions, -1)
        n_steps = (HW + step - 1) // step
        scores = np.empty((n_steps + 1, n_samples))
        salient_order = np.flip(np.argsort(exp_batch.reshape(-1, HW), axis=1), axis=-1)
        r = np.arange(n_samples).reshape(n_samples, 1)
        substrate = torch.zeros_like(img_batch)
        for j in range(n_samples // batch_size):
            substrate[j * batch_size : (j + 1) * batch_size] = substrate_fn(img_batch[j * batch_size : (j + 1) * batch_size])
        if mode == "del":
            start, finish = img_batch.clone(), substrate
        else:
            start, finish = substrate, img_batch.clone()
        for i in range(n_steps + 1):
            for j in range(n_samples // batch_size):
                preds = model(start[j * batch_size : (j + 1) * batch_size])
                preds = preds.cpu().numpy()[range(batch_size), top[j * batch_size : (j + 1) * batch_size]]
                scores[i, j * batch_size : (j + 1) * batch_size] = preds
            coords = salient_order[:, step * i : step * (i + 1)]
            start.cpu().numpy().reshape(n_samples, 3, HW)[r, :, coords] = finish.cpu().numpy().reshape(n_samples, 3, HW)[r, :, coords]
    return scores


# ------------------------------------------------------------------------------------------------
# Helpers


def _table(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _rows(out: Path) -> dict[str, dict]:
    """The shard rows of a run, by relative path (with their curves, which per_image.csv leaves out)."""
    import json

    rows = {}
    for shard in sorted((out / "shards").glob("*.jsonl")):
        for line in shard.read_text().splitlines():
            row = json.loads(line)
            rows[row["file"]] = row
    return rows


def _inputs(model, data: Path):
    """The images of `data` in the evaluator's order, as both authors' loaders make them: resized
    to S x S (no crop), unnormalised [N, 3, S, S] and normalised; their class indices."""
    items = ev.scan(data)
    s = model.spec.image_size
    raw = torch.stack([to_tensor(vitviz.load_image(item.path).resize((s, s), resample=2)) for item in items])  # 2: bilinear
    mean = torch.tensor(model.spec.mean)[None, :, None, None]
    std = torch.tensor(model.spec.std)[None, :, None, None]
    classes = torch.tensor([list(model.spec.categories).index(item.label) for item in items])
    return items, raw, raw.sub(mean).div(std), classes


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    data = tmp_path_factory.mktemp("protocols") / "data"
    vitviz.shapes.write_dataset(data, 6, seed=31)
    return data


# ------------------------------------------------------------------------------------------------
# The pieces, by hand


def test_the_areas_by_hand():
    # Chefer et al.: trapezoids over 0, 0.1, ..., 0.9, times 100
    assert chefer2021_auc(torch.ones(10)).item() == pytest.approx(90.0, abs=1e-12)
    assert chefer2021_auc(torch.tensor([1.0] + [0.0] * 9)).item() == pytest.approx(5.0, abs=1e-12)
    assert chefer2021_auc(torch.tensor([0.0] * 9 + [1.0])).item() == pytest.approx(5.0, abs=1e-12)
    assert CHEFER2021_FRACTIONS == (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    # RISE: (sum - first / 2 - last / 2) / n over n steps
    assert rise_auc(torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0])).item() == pytest.approx(0.125, abs=1e-15)
    assert rise_auc(torch.tensor([0.5, 0.5, 0.5])).item() == pytest.approx(0.5, abs=1e-15)
    v = torch.rand(2, 97, dtype=torch.float64)
    torch.testing.assert_close(rise_auc(v), torch.tensor([rise_auc_theirs(r.numpy()) for r in v], dtype=torch.float64))


def test_the_blur_is_rises_gkern():
    pytest.importorskip("scipy.ndimage")
    assert torch.equal(rise_kernel(), gkern(11, 5))  # scipy's reflected, truncated Gaussian, to the bit
    assert rise_kernel()[0, 0].sum().item() == pytest.approx(1.0, abs=1e-6) and rise_kernel()[0, 1].abs().sum() == 0


@pytest.mark.parametrize("grid, patch", [(6, 16), (12, 8), (14, 16)])
def test_pixel_maps_are_chefers_upsampled_maps(grid, patch):
    maps = torch.rand(3, grid, grid)
    maps[2] = 0.25  # a constant map: no range, all pixels tie
    got = pixel_maps(maps, patch_size=patch)
    want = chefer_maps(maps[:2], patch)[:, 0]
    side = grid * patch
    assert torch.equal(got[:2], want) and torch.equal(got[2], torch.zeros(side, side))


def test_imagenet_folders_by_wordnet_id_are_classes():
    pytest.importorskip("timm")
    categories = vitviz.get_spec("timm:vit_base_patch16_224.orig_in21k_ft_in1k").categories
    items = [ev.Item(0, "a", "n01443537", None), ev.Item(1, "b", "goldfish", None), ev.Item(2, "c", "n99999999", None)]
    assert ev_batch._classes(items, categories) == {"n01443537": 1, "goldfish": 1, "n99999999": None}


# ------------------------------------------------------------------------------------------------
# The protocols against the ported code, same images, same maps


@pytest.mark.parametrize("protocol, name", [("chefer2021", "shapes_p16"), ("chefer2021-target", "shapes_p16"),
                                            pytest.param("chefer2021", "shapes_p8", marks=pytest.mark.slow)])
def test_chefer2021_equals_their_perturbation_test(folder, tmp_path, protocol, name):
    """Per image the 10 hits (intact, then 10 %, ..., 90 % removed) of the positive and negative
    tests, and the dataset's AUC, as their script and issue #31 compute them from the same maps."""
    model = vitviz.load_model(name, device="cpu")
    out = tmp_path / "out"
    summary = evaluate(folder, model=name, out=out, protocol=protocol, methods=("rollout", "gradient"), batch_size=6, workers=0,
                       compare=False, progress=False)
    rows = _rows(out)
    items, raw, x, classes = _inputs(model, folder)
    table = {(r["method"], r["metric"]): r["mean"] for r in summary}
    targets = classes if protocol == "chefer2021-target" else None
    maps, explained, _ = vitviz.relevance_maps(model, x, methods=["rollout", "gradient"], targets=targets)  # one batch, as the run
    assert [rows[item.file]["target"] for item in items] == explained.tolist()
    for method in ("rollout", "gradient"):
        vis = chefer_maps(maps[method], model.spec.patch_size)
        for neg, metric in ((False, "positive"), (True, "negative")):
            intact, perturbed, area = chefer_eval(model, raw, vis, classes, mean=model.spec.mean, std=model.spec.std, neg=neg, batch_size=4)
            for b, item in enumerate(items):
                assert rows[item.file][f"{method}_{metric}_curve"] == [intact[b], *perturbed[:, b]], (method, metric, item.file)
            assert table[(method, metric)] == pytest.approx(area, abs=1e-9)
    assert {r["metric"] for r in summary} == {"positive", "negative"} and {r["method"] for r in summary} == {"rollout", "gradient", "random"}


@pytest.mark.parametrize("name", ["shapes_p16@48", pytest.param("shapes_p16", marks=pytest.mark.slow)])
def test_rise_equals_their_causal_metric(tmp_path, name):
    """Per image RISE's deletion and insertion curves (S + 1 points for S x S images, S pixels a step)
    and their areas, as CausalMetric.evaluate computes them from the same maps; at 48 px (the model
    fed smaller images) and, slower, at the model's own 96 px."""
    data = tmp_path / "data"
    vitviz.shapes.write_dataset(data, 2, seed=32)
    model = vitviz.load_model(name, device="cpu")
    out = tmp_path / "out"
    summary = evaluate(data, model=name, out=out, protocol="rise", methods=("rollout",), batch_size=2, workers=0,
                       compare=False, progress=False)
    rows = _rows(out)
    items, _, x, _ = _inputs(model, data)
    maps, explained, _ = vitviz.relevance_maps(model, x, methods=["rollout"])
    pixels = chefer_maps(maps["rollout"], 16)[:, 0].numpy()
    table = {(r["method"], r["metric"]): r["mean"] for r in summary}
    side = model.spec.image_size
    for mode, metric in (("del", "deletion"), ("ins", "insertion")):
        scores = rise_evaluate(model, x.clone(), pixels, mode=mode, batch_size=2)
        assert scores.shape == (side + 1, 2)
        for b, item in enumerate(items):
            row = rows[item.file]
            np.testing.assert_allclose(row[f"rollout_{metric}_curve"], scores[:, b], rtol=0, atol=2e-6)
            assert row[f"rollout_{metric}"] == pytest.approx(rise_auc_theirs(scores[:, b]), abs=2e-6)
            assert row["target"] == int(explained[b])  # the class scored is the predicted one, which the map explains
        assert table[("rollout", metric)] == pytest.approx(rise_auc_theirs(scores.mean(1)), abs=2e-6)


# ------------------------------------------------------------------------------------------------
# The command


def _main(*argv) -> int:
    try:
        main([str(a) for a in argv])
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0


def test_the_command_runs_a_protocol_end_to_end(folder, tmp_path, capsys):
    out = tmp_path / "out"
    assert _main(folder, "--model", "shapes_p16", "--protocol", "chefer2021", "--methods", "rollout", "--workers", "0", "--no-compare",
                 "--out", out) == 0
    printed = capsys.readouterr().out
    assert "| rollout | positive | 6 |" in printed and "| random | negative | 6 |" in printed
    run = ev_run._previous(out)
    assert (run["protocol"], run["metrics"], run["steps"]) == ("chefer2021", ["positive", "negative"], 9)
    curves = _table(out / "curves.csv")
    assert [float(r["fraction"]) for r in curves if r["method"] == "rollout" and r["metric"] == "positive"] == list(CHEFER2021_FRACTIONS)
    assert not (out / "curves.png").exists()  # accuracies times 100: the numbers are in curves.csv
    per_image = _table(out / "per_image.csv")
    assert len(per_image) == 6 and all(0 <= float(r["rollout_positive"]) <= 90 for r in per_image)
    # the same command again: everything scored already; another protocol into the same folder: refused
    assert _main(folder, "--model", "shapes_p16", "--protocol", "chefer2021", "--methods", "rollout", "--workers", "0", "--no-compare",
                 "--out", out) == 0
    assert _main(folder, "--model", "shapes_p16", "--protocol", "chefer2021-target", "--methods", "rollout", "--workers", "0",
                 "--no-compare", "--out", out) == 2
    assert "protocol 'chefer2021' there, 'chefer2021-target' here" in capsys.readouterr().err


REFUSED = {
    "--metrics with a protocol": ("folder", ["--protocol", "chefer2021", "--metrics", "deletion"],
                                  "--protocol chefer2021 fixes its metrics (positive, negative) and its steps (0 %, 10 %, ..., 90 % of "
                                  "the pixels): leave out --metrics"),
    "--steps with a protocol": ("folder", ["--protocol", "rise", "--steps", "8"],
                                "--protocol rise fixes its metrics (deletion, insertion) and its steps (S pixels a step, S + 1 points "
                                "on S x S images): leave out --steps"),
    "an unknown protocol": ("folder", ["--protocol", "chefer"],
                            "unknown protocol 'chefer' in --protocol; the protocols are chefer2021, chefer2021-target, rise"),
    "a phrase with a protocol": ("folder", ["--protocol", "rise", "--text", "a red star"], "--protocol rise scores a classifier's classes"),
    "a model without classes": ("folder", ["--protocol", "rise", "--model", "shapes_clip", "--methods", "rollout"],
                                "--protocol rise measures a classifier and shapes_clip has none"),
    "images without a class": ("unlabelled", ["--protocol", "chefer2021"],
                               "--protocol chefer2021 measures the accuracy of each image's class, and 1 of the 7 images have none "
                               "the model knows (e.g. stray.png: it is in no class folder)"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_a_protocol_fixes_is_refused_in_one_line(folder, tmp_path, capsys, case):
    import shutil

    unlabelled = tmp_path / "unlabelled"
    shutil.copytree(folder, unlabelled)
    (unlabelled / "stray.png").write_bytes(next(folder.rglob("*.png")).read_bytes())
    which, argv, words = REFUSED[case]
    data = folder if which == "folder" else unlabelled
    options = ["--model", "shapes_p16", "--workers", "0", "--no-compare", "--out", tmp_path / "out"]
    status = _main(data, *options, *argv)  # a later --model wins
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "out").exists()
    with pytest.raises(EvaluateError):
        main([str(data), *map(str, options), *argv, "--debug"])


@pytest.mark.parametrize("protocol", [None, "chefer2021", "rise"])
@pytest.mark.parametrize("method", vitviz.methods())
def test_every_registered_method_runs_through_the_evaluator(folder, tmp_path, capsys, method, protocol):
    # Each method the registry offers, alone, with and without a protocol: a row of scores for every image.
    how = ["--protocol", protocol] if protocol else ["--metrics", "pointing,deletion", "--steps", "3"]
    out = tmp_path / "out"
    assert _main(folder, "--model", "shapes_p16@48", "--methods", method, *how, "--workers", "0", "--no-compare", "--out", out) == 0, \
        capsys.readouterr().err
    metric = {None: "deletion", "chefer2021": "positive", "rise": "deletion"}[protocol]
    per_image = _table(out / "per_image.csv")
    assert len(per_image) == 6 and all(math.isfinite(float(r[f"{method}_{metric}"])) for r in per_image)
