"""vitviz.concepts' training: the top-k SAE and one step of it against numbers worked by hand; one
process and two (torchrun, gloo) giving the same weights to rounding; a resumed run (after a stop and
after a kill) giving what an uninterrupted one gives, to the bit; the evaluation's table recomputed
here from the saved SAE with the model's own forward; the index against a brute-force search of
every token; the folder read back; the refusals, each one line."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from conftest import sources_kept
import vitviz
from vitviz.concepts import (
    CARD_KEYS, ConceptsError, ConceptsFolderError, TopKSAE, loss_terms, metrics_table, read_concepts, remove_parallel_grad_, save_concepts,
    train, train_step,
)
from vitviz.concepts import cli as concepts_cli
from vitviz.concepts.train import BLANK, OUTLINE, _evenly, _step_images

ROOT = Path(__file__).resolve().parent.parent
LAYER = 2
SMALL = dict(model="shapes_p16", layer=LAYER, features=24, k=3, images_per_step=5, lr=2e-3, dead_after=60, workers=0, progress=False,
             top_n=4, thumb=24)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """14 images in class folders, 2 loose ones (no class: scored against the model's prediction) and
    one file the image gate refuses."""
    root = tmp_path_factory.mktemp("concepts") / "data"
    vitviz.shapes.write_dataset(root, 14, seed=31)
    images, _, _ = vitviz.shapes.generate(2, seed=32)
    for i, image in enumerate(images):
        Image.fromarray(image).save(root / f"loose_{i}.png")
    (root / "unreadable.png").write_bytes(b"not an image")
    return root


@pytest.fixture(scope="module")
def trained(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained") / "sae"
    card = train(folder, out=out, steps=9, **SMALL)
    return out, card


def _rows(card: dict, folder: Path, model) -> tuple[list[str], torch.Tensor, list[str | None]]:
    """The images the evaluation read (the readable ones, in file order): their files, inputs [I, 3, S, S] and folders."""
    files, xs, labels = [], [], []
    for file in card["images"]:
        try:
            image = vitviz.load_image(folder / file)
        except vitviz.ImageError:
            continue
        files.append(file)
        xs.append(vitviz.preprocess(image, model.spec.preprocessing)[0])
        labels.append(file.split("/")[0] if "/" in file else None)
    return files, torch.stack(xs), labels


def _brute_z(sae: TopKSAE, x: torch.Tensor) -> torch.Tensor:
    """z by the definition, written out: every pre-activation, sorted, the k largest kept."""
    pre = (x - sae.b_dec) @ sae.W_enc.T + sae.b_enc
    order = pre.argsort(dim=-1, descending=True)[..., : sae.k]
    return torch.zeros_like(pre).scatter(-1, order, pre.gather(-1, order))


# ------------------------------------------------------------------------------------------------
# 1. the SAE and one step, by hand


def _hand_sae() -> TopKSAE:
    """D = 2, F = 3, k = 2: decoder columns (1, 0), (0, 1), (0.6, 0.8); W_enc = W_decᵀ; biases 0."""
    sae = TopKSAE(2, 3, 2)
    with torch.no_grad():
        sae.W_dec.copy_(torch.tensor([[1.0, 0.0, 0.6], [0.0, 1.0, 0.8]]))
        sae.W_enc.copy_(sae.W_dec.T)
        sae.b_enc.zero_()
        sae.b_dec.zero_()
    return sae


def test_the_top_k_forward_and_one_step_against_a_hand_worked_case():
    sae = _hand_sae()
    x = torch.tensor([[3.0, 1.0]])
    # pre-activations: (3, 1)·(1, 0) = 3, (3, 1)·(0, 1) = 1, (3, 1)·(0.6, 0.8) = 2.6; k = 2 keeps 3 and 2.6
    torch.testing.assert_close(sae.pre_activations(x), torch.tensor([[3.0, 1.0, 2.6]]))
    x_hat, z = sae(x)
    torch.testing.assert_close(z, torch.tensor([[3.0, 0.0, 2.6]]))
    torch.testing.assert_close(x_hat, torch.tensor([[3 + 2.6 * 0.6, 2.6 * 0.8]]))  # (4.56, 2.08)
    # no ReLU: a negative pre-activation among the k largest is kept as it is
    # (pre-activations −1, −2, −2.2: the two largest are −1 and −2)
    torch.testing.assert_close(sae.encode(torch.tensor([[-1.0, -2.0]])), torch.tensor([[-1.0, -2.0, 0.0]]))
    # the loss: r = x̂ − x = (1.56, 1.08), |r|² = 3.6
    terms = loss_terms(sae, x)
    assert float(terms.recon.detach()) == pytest.approx(3.6, abs=1e-5) and float(terms.aux) == 0.0
    # AuxK with feature 1 dead, k_aux = 1: z_aux = (0, 1, 0), ê = (0, 1), e = x − x̂ = (−1.56, −1.08):
    # |e − ê|² = 1.56² + 2.08² = 6.76
    dead = torch.tensor([False, True, False])
    assert float(loss_terms(sae, x, dead=dead, k_aux=1).aux.detach()) == pytest.approx(6.76, abs=1e-5)
    assert float(loss_terms(sae, x, dead=dead, k_aux=5).aux.detach()) == pytest.approx(6.76, abs=1e-5)  # k_aux capped at the dead

    # one step, scale 1, no AuxK. Gradients by hand (dL/dx̂ = 2r = (3.12, 2.16)):
    #   W_dec[:, j] = 2r z_j: column 0 = 3·(3.12, 2.16) = (9.36, 6.48), column 2 = 2.6·(3.12, 2.16) = (8.112, 5.616)
    #   without their components along the columns: (0, 6.48) and (8.112, 5.616) − 9.36·(0.6, 0.8) = (2.496, −1.872)
    #   dL/dz_j = 2r·w_j: 3.12 and 3.6; W_enc[j] = dL/dz_j · x: (9.36, 3.12), 0, (10.8, 3.6); b_enc = (3.12, 0, 3.6)
    #   b_dec = 2r − Σ_j dL/dz_j W_enc[j] = (3.12, 2.16) − 3.12·(1, 0) − 3.6·(0.6, 0.8) = (−2.16, −0.72)
    # Adam's first step moves each weight by lr·g/(|g| + ε) = lr·sign(g) (0 where g = 0).
    lr = 0.1
    optimizer = torch.optim.Adam(sae.parameters(), lr=lr, betas=(0.9, 0.999), eps=6.25e-10)
    result = train_step(sae, optimizer, x, scale=1.0)
    assert result.loss == pytest.approx(3.6, abs=1e-5) and result.l0 == 2 and result.fired.tolist() == [True, False, True]
    torch.testing.assert_close(sae.W_dec.grad, torch.tensor([[0.0, 0.0, 2.496], [6.48, 0.0, -1.872]]), atol=1e-4, rtol=0)
    torch.testing.assert_close(sae.W_enc.grad, torch.tensor([[9.36, 3.12], [0.0, 0.0], [10.8, 3.6]]), atol=1e-4, rtol=0)
    torch.testing.assert_close(sae.b_enc.grad, torch.tensor([3.12, 0.0, 3.6]), atol=1e-4, rtol=0)
    torch.testing.assert_close(sae.b_dec.grad, torch.tensor([-2.16, -0.72]), atol=1e-4, rtol=0)
    # the columns after the update, (1, −0.1), (0, 1), (0.6 − 0.1, 0.8 + 0.1), renormalised
    want = torch.tensor([[1.0, 0.0, 0.5], [-0.1, 1.0, 0.9]])
    torch.testing.assert_close(sae.W_dec, want / want.norm(dim=0), atol=1e-6, rtol=0)
    torch.testing.assert_close(sae.W_dec.norm(dim=0), torch.ones(3), atol=1e-6, rtol=0)
    torch.testing.assert_close(sae.W_enc, torch.tensor([[0.9, -0.1], [0.0, 1.0], [0.5, 0.7]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(sae.b_enc, torch.tensor([-0.1, 0.0, -0.1]), atol=1e-6, rtol=0)
    torch.testing.assert_close(sae.b_dec, torch.tensor([0.1, 0.1]), atol=1e-6, rtol=0)


def test_auxk_trains_the_dead_features_and_the_parallel_component_goes():
    sae = _hand_sae()
    x = torch.tensor([[3.0, 1.0]])
    optimizer = torch.optim.SGD(sae.parameters(), lr=0.0)  # the gradients only
    seen = []

    def dead_of(fired):
        seen.append(fired.clone())
        return torch.tensor([False, True, False])

    result = train_step(sae, optimizer, x, scale=1.0, dead_of=dead_of, k_aux=1, aux_weight=1 / 32)
    assert seen[0].tolist() == [True, False, True]  # what fired, before the dead are named
    assert result.loss == pytest.approx(3.6 + 6.76 / 32, abs=1e-5) and result.aux == pytest.approx(6.76, abs=1e-5)
    # the dead column's gradient: α · −2(e − ê) = (3.12, 4.16)/32; along its column (0, 1) 4.16/32, removed
    torch.testing.assert_close(sae.W_dec.grad[:, 1], torch.tensor([3.12 / 32, 0.0]), atol=1e-5, rtol=0)
    # its encoder row: α · dL/dz_aux · x = (4.16 / 32)·(3, 1)
    torch.testing.assert_close(sae.W_enc.grad[1], torch.tensor([3 * 4.16 / 32, 4.16 / 32]), atol=1e-5, rtol=0)
    # the removal, alone: each column's gradient ends orthogonal to its column
    g = torch.randn(2, 3)
    sae.W_dec.grad = g.clone()
    remove_parallel_grad_(sae)
    torch.testing.assert_close((sae.W_dec * sae.W_dec.grad).sum(0), torch.zeros(3), atol=1e-6, rtol=0)
    torch.testing.assert_close(sae.W_dec.grad, g - (sae.W_dec * g).sum(0) * sae.W_dec, atol=1e-6, rtol=0)


def test_a_batch_is_encoded_token_by_token_and_the_init_is_gao_et_al_s():
    torch.manual_seed(3)
    sae = TopKSAE(16, 40, 5)
    torch.testing.assert_close(sae.W_dec.norm(dim=0), torch.ones(40))
    assert torch.equal(sae.W_enc, sae.W_dec.T) and not sae.b_enc.any() and not sae.b_dec.any()
    with torch.no_grad():
        sae.b_enc.normal_()
        sae.b_dec.normal_()
    x = torch.randn(3, 7, 16)
    x_hat, z = sae(x)
    assert z.shape == (3, 7, 40) and x_hat.shape == (3, 7, 16)
    assert ((z != 0).sum(-1) == 5).all()
    torch.testing.assert_close(z, _brute_z(sae, x))
    torch.testing.assert_close(x_hat[1, 2], sae.decode(sae.encode(x[1, 2])), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="k is 41"):
        TopKSAE(16, 40, 41)
    a, b = TopKSAE(8, 12, 2), TopKSAE(8, 12, 2)
    for sae_ in (a, b):
        sae_.reset_parameters(generator=torch.Generator().manual_seed(7))
    assert torch.equal(a.W_dec, b.W_dec)


# ------------------------------------------------------------------------------------------------
# 2. one process and two


def _cli(args: list[str], *, torchrun: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    head = ["torchrun", "--standalone", "--nproc_per_node=2", "-m"] if torchrun else [sys.executable, "-m"]
    out = subprocess.run([*head, "vitviz.concepts", "train", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def _options(**kw) -> list[str]:
    words = []
    for key, value in kw.items():
        words += [f"--{key.replace('_', '-')}", str(value)]
    return words


CLI = _options(model="shapes_p16", layer=LAYER, features=24, k=3, images_per_step=5, lr=2e-3, dead_after=60, workers=0, top_n=4,
               thumb=24, log_every=1)


@pytest.mark.slow
def test_two_processes_give_the_weights_one_gives_to_rounding(folder, tmp_path):
    if shutil.which("torchrun") is None:
        pytest.skip("torchrun is not installed with this torch")
    one, two = tmp_path / "one", tmp_path / "two"
    _cli([str(folder), *CLI, "--steps", "6", "--out", str(one)])
    ran = _cli([str(folder), *CLI, "--steps", "6", "--out", str(two)], torchrun=True)
    assert ran.stderr.count("step 6/6") == 1  # progress from rank 0 only
    assert "explained variance" in ran.stdout
    a, card_a, index_a, atlas_a = read_concepts(one)
    b, card_b, index_b, atlas_b = read_concepts(two)
    assert card_b["world_size"] == 2 and card_a["world_size"] == 1
    # measured: at most 5e-8 apart (W_dec), 2e-8 (b_dec, whose entries reach 20); the sums split in two places round otherwise
    for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), atol=1e-6, rtol=1e-6)
    assert torch.equal(index_a["top_images"], index_b["top_images"]) and torch.equal(index_a["top_tokens"], index_b["top_tokens"])
    for key in ("top_values", "frequency", "class_means"):
        torch.testing.assert_close(index_a[key], index_b[key], atol=1e-5, rtol=1e-5, equal_nan=True)
    for key, value in card_a["metrics"].items():
        if isinstance(value, float):
            assert math.isclose(value, card_b["metrics"][key], rel_tol=1e-5, abs_tol=1e-6), key
        else:
            assert value == card_b["metrics"][key], key
    assert card_a["tokens_seen"] == card_b["tokens_seen"]


# ------------------------------------------------------------------------------------------------
# 3. resumed after a stop and after a kill


def _same_weights(a: TopKSAE, b: TopKSAE) -> None:
    for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_a_run_stopped_and_resumed_equals_an_uninterrupted_one_to_the_bit(folder, trained, tmp_path):
    whole, card = trained
    parts = tmp_path / "parts"
    assert train(folder, out=parts, steps=9, stop_after=4, checkpoint_every=3, **SMALL) is None  # steps 0-3, a checkpoint at 3 and at 4
    assert (parts / "checkpoint.pt").is_file() and not (parts / "card.json").exists()
    with pytest.raises(ConceptsError, match="holds a training already: add --resume"):
        train(folder, out=parts, steps=9, **SMALL)
    with pytest.raises(ConceptsError, match="other settings \\(k 3 there, 4 here\\)"):
        train(folder, out=parts, steps=9, resume=True, **{**SMALL, "k": 4})
    resumed = train(folder, out=parts, steps=9, resume=True, checkpoint_every=3, **SMALL)
    _same_weights(read_concepts(whole)[0], read_concepts(parts)[0])
    assert resumed["metrics"] == card["metrics"] and resumed["steps"] == 9 and resumed["tokens_seen"] == card["tokens_seen"]
    # resumed once more at its end: the evaluation again, the same
    again = train(folder, out=parts, steps=9, resume=True, **SMALL)
    assert again["metrics"] == card["metrics"]


@pytest.mark.slow
def test_a_run_killed_mid_way_and_resumed_equals_an_uninterrupted_one_to_the_bit(folder, tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    args = [str(folder), *CLI, "--steps", "40", "--checkpoint-every", "2"]
    _cli([*args, "--out", str(whole)])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.Popen([sys.executable, "-m", "vitviz.concepts", "train", *args, "--out", str(killed)], cwd=ROOT, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for line in run.stderr:
            if line.startswith("step 5/"):
                run.send_signal(signal.SIGKILL)  # no chance to write anything: the checkpoint of step 4 (or a later one) stays
                break
    finally:
        run.wait(timeout=600)
    assert run.returncode == -signal.SIGKILL, "the run ended before it was killed"
    assert not (killed / "card.json").exists()
    step = torch.load(killed / "checkpoint.pt", weights_only=True)["step"]
    assert 4 <= step < 40
    _cli([*args, "--out", str(killed), "--resume"])
    _same_weights(read_concepts(whole)[0], read_concepts(killed)[0])
    assert json.loads((whole / "card.json").read_text())["metrics"] == json.loads((killed / "card.json").read_text())["metrics"]


# ------------------------------------------------------------------------------------------------
# 4. the table, recomputed


def test_the_metrics_table_recomputed_from_the_saved_sae_and_the_model(folder, trained):
    out, card = trained
    sae, card, index, _ = read_concepts(out)
    model = vitviz.load_model("shapes_p16", device="cpu")
    files, x, labels = _rows(card, folder, model)
    m = card["metrics"]
    assert m["eval_images"] == len(files) == 16 and m["unreadable_images"] == 1
    p = model.config.num_prefix_tokens
    layers: list[torch.Tensor] = []
    with torch.no_grad():
        clean = model(x)
        model.encode(x, layers=layers)
        a = layers[LAYER][:, p:]  # the patch tokens after block LAYER [I, 36, D]
        z = _brute_z(sae, a)
        x_hat = z @ sae.W_dec.T + sae.b_dec
    # explained variance: 1 − Σ_d Var(r_d) / Σ_d Var(x_d) over every token, in float64
    flat, r = a.reshape(-1, a.shape[-1]).double().numpy(), (a - x_hat).reshape(-1, a.shape[-1]).double().numpy()
    assert m["explained_variance"] == pytest.approx(1 - r.var(axis=0).sum() / flat.var(axis=0).sum(), abs=1e-5)
    assert m["eval_tokens"] == flat.shape[0]
    assert m["mean_l0"] == pytest.approx(float((z != 0).sum(-1).double().mean()), abs=1e-9)
    assert m["dead_features"] == int(((z != 0).sum((0, 1)) == 0).sum())

    def with_layer(value: torch.Tensor) -> torch.Tensor:  # the model's logits with block LAYER's patch tokens replaced
        def hook(module, args, output):
            output = output.clone()
            output[:, p:] = value
            return output
        handle = model.blocks[LAYER].register_forward_hook(hook)
        try:
            with torch.no_grad():
                return model(x)
        finally:
            handle.remove()

    spliced, ablated = with_layer(x_hat), with_layer(torch.zeros_like(x_hat))
    known = [vitviz.shapes.CLASSES.index(label) if label else None for label in labels]
    target = torch.tensor([k if k is not None else int(clean[i].argmax()) for i, k in enumerate(known)])
    assert m["targets_from_folders"] == 14 and m["targets_from_prediction"] == 2
    ce = {name: float(F.cross_entropy(logits.double(), target)) for name, logits in
          (("clean", clean), ("spliced", spliced), ("ablated", ablated))}
    for name, logits in (("clean", clean), ("spliced", spliced), ("ablated", ablated)):
        assert m[f"accuracy_{name}"] == pytest.approx(float((logits.argmax(-1) == target).double().mean()), abs=1e-12), name
        assert m[f"ce_{name}"] == pytest.approx(ce[name], abs=1e-4), name
    assert m["recovered"] == pytest.approx((ce["ablated"] - ce["spliced"]) / (ce["ablated"] - ce["clean"]), abs=1e-3)
    assert m["ce_ablated"] > m["ce_clean"]
    table = metrics_table(m)
    assert f"{m['explained_variance']:.4f}" in table and f"{m['recovered']:.4f}" in table
    assert "2 from the model's clean prediction" in table and "14 from their class folder" in table


# ------------------------------------------------------------------------------------------------
# 5. the index, the atlas, the folder read back


@pytest.mark.parametrize("tokens", ["patches", "all"])
def test_the_index_holds_the_true_strongest_tokens_and_the_atlas_their_thumbnails(folder, trained, tmp_path, tokens):
    out, _ = trained
    if tokens == "all":
        out = tmp_path / "all"
        train(folder, out=out, steps=4, tokens="all", eval_images=9, **SMALL)
    sae, card, index, atlas = read_concepts(out)
    model = vitviz.load_model("shapes_p16", device="cpu")
    files, x, labels = _rows(card, folder, model)
    evaluated = [card["images"][i] for i in _evenly(len(card["images"]), 9)] if tokens == "all" else card["images"]
    assert (card["eval_images"] or card["images"]) == evaluated
    keep = [i for i, f in enumerate(files) if f in evaluated]
    p = model.config.num_prefix_tokens
    first = p if tokens == "patches" else 0
    layers: list[torch.Tensor] = []
    with torch.no_grad():
        model.encode(x[keep], layers=layers)
        z = _brute_z(sae, layers[LAYER][:, first:])  # [I, T, F]
    row_of = {card["images"].index(files[i]): j for j, i in enumerate(keep)}  # card index -> row of z
    f_count, n = card["features"], card["top_n"]
    fired = (z != 0).reshape(-1, f_count)
    torch.testing.assert_close(index["frequency"], fired.float().mean(0))
    for f in range(f_count):
        values = z[..., f].reshape(-1)[fired[:, f]].sort(descending=True).values[:n]
        have = len(values)
        torch.testing.assert_close(index["top_values"][f, :have], values, atol=1e-5, rtol=1e-5)
        assert (index["top_images"][f, have:] == -1).all() and (index["top_tokens"][f, have:] == -1).all()
        assert (index["top_values"][f, have:] == 0).all()
        for j in range(have):  # each entry names a token with that activation
            image, token = int(index["top_images"][f, j]), int(index["top_tokens"][f, j])
            assert token >= first
            assert float(z[row_of[image], token - first, f]) == pytest.approx(float(index["top_values"][f, j]), abs=1e-5)
    # the mean over the patch tokens of each class's images
    for c, name in enumerate(card["classes"]):
        rows = [j for j, i in enumerate(keep) if labels[i] == name]
        want = z[rows, p - first :].reshape(-1, f_count).mean(0) if rows else torch.full((f_count,), float("nan"))
        torch.testing.assert_close(index["class_means"][:, c], want, atol=1e-5, rtol=1e-5, equal_nan=True)
    # the atlas: F rows of n cells; a blank cell where no token, the centre patch outlined where one
    thumb = card["thumb"]
    assert atlas.size == (n * thumb, f_count * thumb)
    cells = np.asarray(atlas).reshape(f_count, thumb, n, thumb, 3).transpose(0, 2, 1, 3, 4)
    for f in range(f_count):
        for j in range(n):
            image, token = int(index["top_images"][f, j]), int(index["top_tokens"][f, j])
            if image < 0:
                assert (cells[f, j] == BLANK).all()
            elif token >= p:
                assert tuple(cells[f, j][thumb // 3, thumb // 2]) == OUTLINE
            else:  # a prefix token: the whole crop
                crop = vitviz.preprocess(vitviz.load_image(folder / card["images"][image]), model.spec.preprocessing)[1]
                want = np.asarray(crop.resize((thumb, thumb), Image.Resampling.BILINEAR))
                assert np.array_equal(cells[f, j], want)


def test_the_folder_reads_back_as_it_was_written(trained, tmp_path):
    out, card = trained
    sae, read_card, index, atlas = read_concepts(out)
    assert read_card == card and set(CARD_KEYS) <= read_card.keys()
    assert read_card["layer"] == LAYER and read_card["d_in"] == 96 and read_card["tokens"] == "patches"
    assert len(read_card["images"]) == read_card["data"]["images"] == 17 and read_card["classes"] == sorted(read_card["classes"])
    assert set(index) == {"top_values", "top_images", "top_tokens", "frequency", "class_means"}
    assert index["class_means"].shape == (24, len(card["classes"]))
    torch.testing.assert_close(sae.W_dec.norm(dim=0), torch.ones(24))
    copy = tmp_path / "copy"
    save_concepts(copy, sae, read_card, index, atlas)
    sae2, card2, index2, atlas2 = read_concepts(copy)
    _same_weights(sae, sae2)
    assert card2 == read_card and all(torch.equal(index[k], index2[k]) for k in index)
    assert np.array_equal(np.asarray(atlas), np.asarray(atlas2))
    with pytest.raises(ConceptsFolderError, match="not wholly|atlas is"):
        save_concepts(tmp_path / "bad", sae, read_card, index, atlas.crop((0, 0, 10, 10)))
    (copy / "card.json").unlink()
    with pytest.raises(ConceptsFolderError, match="no card.json"):
        read_concepts(copy)


def test_a_model_without_a_classifier_gives_the_table_without_accuracy_and_says_why(folder, tmp_path):
    class Headless(vitviz.WeightsSource):
        name = "headless"
        prefix = "headless:"

        def _spec(self, name):
            config = vitviz.ViTConfig(image_size=32, patch_size=8, width=16, depth=2, heads=2, mlp_dim=32, num_classes=0)
            return vitviz.VariantSpec(name=name, config=config, preprocessing=vitviz.Preprocessing(image_size=32, resize_size=32),
                                      categories=None, source=self.name, weights="random", description="a headless ViT")

        def specs(self):
            return [self._spec("headless:tiny")]

        def resolve(self, name, *, weights_path=None):
            return self._spec(name)

        def status(self, spec):
            return "embedded"

        def load(self, spec, *, weights_path=None, progress=True):
            torch.manual_seed(0)
            return spec.build()

    with sources_kept():
        vitviz.register_source(Headless())
        card = train(folder, out=tmp_path / "out", steps=3, **{**SMALL, "model": "headless:tiny", "layer": 1, "features": 8, "k": 2})
    m = card["metrics"]
    assert m["accuracy_clean"] is None and m["recovered"] is None and "no classifier" in m["accuracy_note"]
    assert card["d_in"] == 16 and 0 <= m["dead_features"] <= 8
    table = metrics_table(m)
    assert "explained variance" in table and "not measured: headless:tiny has no classifier" in table


def test_an_image_text_model_is_scored_zero_shot_over_its_labels(folder, tmp_path):
    """shapes_clip's image tower, every token: its clean accuracy and cross-entropy are those of its
    own zero-shot classification over its label set."""
    card = train(folder, out=tmp_path / "clip", steps=2, tokens="all", **{**SMALL, "model": "shapes_clip", "layer": 5})
    model = vitviz.load_model("shapes_clip", device="cpu")
    files, x, labels = _rows(card, folder, model)
    with torch.no_grad():
        probs = model.zero_shot(model.encode_image(x), model.labels)
    target = torch.tensor([model.labels.index(label) if label else int(probs[i].argmax()) for i, label in enumerate(labels)])
    m = card["metrics"]
    assert m["accuracy_clean"] == pytest.approx(float((probs.argmax(-1) == target).double().mean()), abs=1e-12)
    assert m["ce_clean"] == pytest.approx(float(F.nll_loss(probs.double().log(), target)), abs=1e-4)
    assert m["eval_tokens"] == len(files) * (36 + 1) and card["tokens"] == "all"


# ------------------------------------------------------------------------------------------------
# 6. refusals


@pytest.mark.parametrize("change, message", [
    (dict(model="nope"), "unknown variant 'nope'"),
    (dict(layer=6), "shapes_p16 has 6 blocks, so the layer is 0 to 5"),
    (dict(k=25), "--k is 25 and --features 24"),
    (dict(model="shapes_swin"), "is a Swin and its attention is windowed"),
    (dict(model="shapes_p16@whole"), "takes each image whole"),
    (dict(tokens="cls"), "--tokens is 'cls'"),
    (dict(steps=3, epochs=1), "give one of them"),
    (dict(features=4096, top_n=8, thumb=64), "give --top-n 2 or a smaller --thumb"),
])
def test_a_mistake_is_refused_before_anything_is_written(folder, tmp_path, change, message):
    options = {**SMALL, "steps": 2, **change}
    out = tmp_path / "out"
    with pytest.raises(ConceptsError, match=message.replace("(", "\\(").replace(")", "\\)")):
        train(folder, out=out, **options)
    assert not out.exists()


def test_folders_that_do_not_fit_are_refused(folder, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConceptsError, match="no images"):
        train(empty, out=tmp_path / "out", steps=2, **SMALL)
    with pytest.raises(ConceptsError, match="is inside DATA"):
        train(folder, out=folder / "sae", steps=2, **SMALL)
    with pytest.raises(ConceptsError, match="holds no checkpoint.pt"):
        train(folder, out=tmp_path / "new", steps=2, resume=True, **SMALL)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ConceptsError, match="holds files and no training"):
        train(folder, out=other, steps=2, **SMALL)


def test_the_command_says_a_mistake_in_one_line_with_status_2(folder, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        concepts_cli.main(["train", str(folder), "--model", "shapes_p16", "--layer", "9", "--features", "8", "--k", "2",
                           "--out", str(tmp_path / "out"), "--steps", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("vitviz.concepts: --layer is 9; shapes_p16 has 6 blocks")
    with pytest.raises(SystemExit) as exc:
        concepts_cli.main(["train", str(folder), "--model", "shapes_p16"])
    assert exc.value.code == 2 and "required" in capsys.readouterr().err


def test_the_steps_read_each_epochs_permutation_in_slices():
    """Epoch e is steps eS .. eS + S - 1 (S = ⌈11 / 4⌉ = 3), each epoch every image once, in its own order."""
    n, size = 11, 4
    epochs = [[i for s in range(e * 3, e * 3 + 3) for i in _step_images(n, size, 5, s)] for e in range(2)]
    assert all(sorted(epoch) == list(range(n)) for epoch in epochs) and epochs[0] != epochs[1]
    assert [len(_step_images(n, size, 5, s)) for s in range(3)] == [4, 4, 3]
    assert _step_images(n, size, 5, 4) == _step_images(n, size, 5, 4) and _step_images(n, size, 6, 0) != _step_images(n, size, 5, 0)
    assert _evenly(10, 4) == [0, 2, 5, 7] and _evenly(3, None) == [0, 1, 2] and _evenly(3, 5) == [0, 1, 2]
